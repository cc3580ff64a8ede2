// CPU kernels of the bundled codecs (onebit, ef8): SIMD with runtime dispatch (Highway),
// threaded with loom::plugins::parallel_for. Plain C++ interface; the plugins and the tests
// call these, and tests compare them against scalar references of the same definitions.
//
// onebit, for a buffer b = x + e (e optional) of n elements:
//   sum of squares in a fixed order (so CPU, CUDA and any thread count agree bit for bit):
//     blocks of kNormBlock = 2048 elements; inside a block 16 fp32 lane sums, lane l adding
//     (b*b) of elements l, l+16, l+32, ... in order (no FMA), then folded pairwise
//     (lane[i] += lane[i+8], +4, +2, +1); block sums are widened to double and added in
//     order within superblocks of kNormSuper = 256 blocks; superblock sums are added in
//     order. scale = (float)sqrt(sum / n) computed in double.
//   sign: bit = (b >= 0), so +0.0 and -0.0 both give bit 1 (+1); NaN fails earlier.
//   pack: MSB-first, element 8k+j -> bit 7-j of byte k.
//   error: e = b - (bit ? scale : -scale).
//   decode: out = (accumulate ? out : 0) + (bit ? v : -v), v = (float)(alpha * scale).
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom::codecs {

inline constexpr std::size_t kNormBlock = 2048;
inline constexpr std::size_t kNormLanes = 16;
inline constexpr std::size_t kNormSuper = 256;

// ---- onebit
// Sum of squares of (x + e) (e may be NULL) in the order above. Threaded.
double onebit_sum_squares(const float* x, const float* e, std::size_t n);
// (float)sqrt(sum_squares / n).
float onebit_scale(double sum_squares, std::size_t n);
// Bits of (x + e) into n / 8 bytes (n % 8 == 0) and, when e is set, the new error. Not
// threaded (callers split the work).
void onebit_sign_pack(const float* x, float* e, std::size_t n, float scale, uint8_t* bits);
// out[i] = (accumulate ? out[i] : 0) + (bit i ? v : -v), n % 8 == 0. Not threaded.
// nontemporal: write with streaming stores (for outputs much larger than the cache).
void onebit_unpack(const uint8_t* bits, std::size_t n, float v, bool accumulate, float* out,
                   bool nontemporal = false);
// The sum of `count` chunks in one pass: out[i] = (accumulate ? out[i] : 0) + s_0(i) + s_1(i)
// + ..., added in chunk order, where s_j(i) = (bit i of bits[j] ? v[j] : -v[j]). Bit-identical
// to `count` onebit_unpack calls (the first with `accumulate`, the rest accumulating), but
// out is written once. n % 8 == 0. Not threaded.
void onebit_unpack_sum(const uint8_t* const* bits, const float* v, std::size_t count, std::size_t n,
                       bool accumulate, float* out, bool nontemporal = false);

// Name of the SIMD target the dispatcher picked ("AVX2", "AVX3", ...).
const char* simd_target_name();

// ---- ef8: per chunk, max-abs scale, int8 round-to-nearest-even, error feedback.
//   b = x + e; m = max |b|; scale = m / 127; q = clamp(nearbyint(b * (127 / m)), -127, 127)
//   (q = 0 when m = 0); e = b - q * scale; decode: out (=|+=) (float)(alpha * scale) * q.
// Returns false when b has a non-finite value (nothing written then).
bool ef8_max_abs(const float* x, const float* e, std::size_t n, float* max_abs);
void ef8_quantize(const float* x, float* e, std::size_t n, float max_abs, int8_t* q);
void ef8_dequantize(const int8_t* q, std::size_t n, float v, bool accumulate, float* out);

}  // namespace loom::codecs
