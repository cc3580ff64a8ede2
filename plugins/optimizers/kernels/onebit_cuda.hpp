// CUDA kernels of the 1-bit optimizer family (onebit_adam, zero_one_adam, onebit_lamb):
// one kernel per update loop of plugins/optimizers/onebit.cpp, over the same flat fp32
// buffers (m, v, aux, the gradient scratch) kept in device memory, plus the per-tensor
// parameters. Plain C++ interface (no CUDA types): `stream` is a cudaStream_t, every
// function is stream-ordered and returns an empty string on success, else the argument
// error; a CUDA failure throws loom::sdk::Error (UNAVAILABLE) naming the call, file and line
// (LOOM_CUDA_CHECK).
//
// Arithmetic. Each kernel evaluates the expression of the matching scalar CPU loop in
// onebit.cpp, operation by operation, with IEEE round-to-nearest intrinsics (no FMA
// contraction, correctly rounded sqrt and division, no flush to zero), from the same
// float scalars the host computes (in double, then cast, exactly as onebit.cpp does; a
// decay rate crosses as a Decay, beta and 1 - beta both from double). So
// every element equals what an unfused scalar C++ loop computes; only the order of the
// double reductions differs from the CPU.
//
// Layout. A Segment is one tensor of the step: elements [offset, offset + n) of the flat
// buffers, and (where a kernel touches parameters) its own fp32 parameter p[0, n) and its
// exp_avg_mask mask[0, n) (nullptr: no mask; leave it null for non_freeze tensors). Any
// subset of the step's tensors may be passed (e.g. only the compressed groups' tensors).
// Segments of one call are updated by multi-tensor launches (at most kMaxSegments per
// launch, blocks of kChunk elements); n = 0 segments are allowed.
//
// Reductions (sums of squares, max factor) are deterministic: thread t of block b of a
// segment accumulates, in double, elements b * kChunk + t + k * 256 in increasing k; the
// block combines its 256 threads with a fixed shared-memory tree; a second kernel sums
// the per-block partials of each segment with the same fixed thread-stride + tree. No
// atomics: the result is identical on every run (for the same inputs and launch
// constants), independent of scheduling. Functions that return values to the host
// (those with a host `out` pointer) copy them back and SYNCHRONIZE the stream before
// returning; their device workspace is allocated and freed stream-ordered
// (cudaMallocAsync) inside the call.
#pragma once

#include <cstddef>
#include <string>

#include "kernels/cpu.hpp"

namespace loom::optim::cuda::onebit {

constexpr std::size_t kMaxSegments = 32;  // per launch; longer lists take several launches
constexpr std::size_t kChunk = 4096;      // elements per block

struct Segment {
  std::size_t offset = 0;       // first element in the flat buffers
  std::size_t n = 0;            // elements
  float* p = nullptr;           // fp32 parameter (device), for kernels that read or write it
  const float* mask = nullptr;  // exp_avg_mask (device, n floats), or nullptr
  void* low = nullptr;          // optional low-precision copy, written from the updated p (RNE)
  DType ltype = DType::kBF16;
  const void* g = nullptr;  // load_grad: the gradient (device), in gtype
  DType gtype = DType::kF32;
  // Per-tensor (per-group) scalars; each kernel documents which it reads.
  float decay = 1.0f;  // apply_adam: 1 - lr * wd
  float step = 0.0f;   // apply_adam: lr / bc1; lamb_apply: lr * lr_scale * coeff (* factor)
  float lr = 0.0f;     // zero_one_local: lr * lr_scale
  float wd = 0.0f;     // zero_one_local, lamb_warmup_moments, lamb_post, lamb_apply
  float scale = 1.0f;  // momentum_segments: scaling_coeff; lamb_post: 1 / scaling_coeff
};

// gather_grads: flat[offset + i] = float(g[i]) * inv_scale (g in fp32, bf16 or fp16).
std::string load_grad(const Segment* segs, std::size_t count, float* flat, float inv_scale,
                      void* stream);

// momentum_flat: m = b1.beta * m + b1.rest * g over the whole flat buffer.
std::string momentum(float* m, const float* g, std::size_t n, Decay b1, void* stream);

// Per segment: m_prev = m (when m_prev is not null), then
// m = (b1.beta * m + b1.rest * g) * seg.scale: 1-bit LAMB's compression momentum (scale =
// scaling_coeff), or, with the default scale 1 (exact), the momentum of a subset of the
// tensors (onebit_adam's compressed groups beside non_freeze ones). Reads offset, n, scale.
std::string momentum_segments(const Segment* segs, std::size_t count, float* m, const float* g,
                              float* m_prev, Decay b1, void* stream);

// apply_masks: buf[offset + i] *= seg.mask[i] for the segments with a mask (for places
// without a fused kernel, e.g. 0/1 Adam's 1-bit averaged gradient before `momentum`).
// Reads offset, n, mask.
std::string mask_multiply(const Segment* segs, std::size_t count, float* buf, void* stream);

// apply_adam: m = m * seg.mask (written back; skipped without a mask), then
// p = p * seg.decay - seg.step * (m / (sqrt(v) * inv_bc2 + eps)); copy-out to seg.low.
// Reads offset, n, p, mask, low, ltype, decay, step.
std::string apply_adam(const Segment* segs, std::size_t count, float* m, const float* v,
                       float inv_bc2, float eps, void* stream);

// 0/1 Adam phase-B local step: d = m * inv_bc1 / (sqrt(v) * inv_bc2 + eps) + seg.wd * p;
// p -= seg.lr * d; u -= seg.lr * d; copy-out to seg.low when set (pass low = nullptr on a
// sync step and copy out in zero_one_sync_post). Reads offset, n, p, low, ltype, lr, wd.
std::string zero_one_local(const Segment* segs, std::size_t count, const float* m, const float* v,
                           float* u, float inv_bc1, float inv_bc2, float eps, void* stream);

// 0/1 Adam sync, before the compressed allreduce of u:
// p -= u; u *= sqrt(v) * inv_bc2 + eps. Reads offset, n, p.
std::string zero_one_sync_pre(const Segment* segs, std::size_t count, const float* v, float* u,
                              float inv_bc2, float eps, void* stream);

// 0/1 Adam sync, after it: u = u * seg.mask (when set); m = u * scale (scale = -bc1 / lrs);
// p += u / (sqrt(v) * inv_bc2 + eps); u = 0; copy-out to seg.low. Reads offset, n, p, mask,
// low, ltype.
std::string zero_one_sync_post(const Segment* segs, std::size_t count, float* m, const float* v,
                               float* u, float scale, float inv_bc2, float eps, void* stream);

// Copies p into seg.low (RNE) for every segment with a low copy. Reads n, p, low, ltype.
std::string copy_out(const Segment* segs, std::size_t count, void* stream);

// shard_state's compressed parameter update: p += flat[offset + i]; copy-out to seg.low.
// Reads offset, n, p, low, ltype.
std::string add_update(const Segment* segs, std::size_t count, const float* flat, void* stream);

// 1-bit LAMB warmup, pass 1 (lamb_moments_cpu on the averaged gradient g, per tensor):
// m = b1.beta * m + b1.rest * g; v = b2.beta * v + b2.rest * g * g;
// u = seg.wd * p + (m * inv_bc1) / (sqrt(v) * inv_bc2 + eps).
// out (host, 2 * count doubles): out[2k] = sum p^2, out[2k + 1] = sum u^2 of segment k.
// The host derives the trust ratio (and its EMA) and runs lamb_apply with
// seg.step = lr * lr_scale * coeff. Synchronizes the stream. Reads offset, n, p, wd.
std::string lamb_warmup_moments(const Segment* segs, std::size_t count, const float* g, float* m,
                                float* v, Decay b1, Decay b2, float inv_bc1, float inv_bc2,
                                float eps, double* out, void* stream);

// Per-segment sum of m^2 (the scaling coefficients' rms): out (host, count doubles).
// Synchronizes the stream. Reads offset, n.
std::string sum_squares(const Segment* segs, std::size_t count, const float* m, double* out,
                        void* stream);

// Per-tensor results of lamb_post.
struct LambPostStats {
  double pre2 = 0.0;    // sum of pre^2
  double u2 = 0.0;      // sum of (pre + wd * p)^2
  float factor = 0.0f;  // max of denom / (sqrt(vf) * inv_bc2_fresh + eps), 0 when n = 0
};

// 1-bit LAMB's per-tensor post loop after the compressed allreduce, per element:
// m *= seg.scale (1 / scaling_coeff); m *= seg.mask (when set); gh = (m - b1.beta * mp) / b1.rest;
// vf = b2.beta * vf + b2.rest * gh * gh; denom = sqrt(v) * inv_bc2 + eps;
// pre = m * inv_bc1 / denom; u = pre + seg.wd * p. p is not written.
// out (host, count entries). Synchronizes the stream. Reads offset, n, p, mask, wd, scale.
std::string lamb_post(const Segment* segs, std::size_t count, float* m, const float* mp,
                      const float* v, float* vf, Decay b1, Decay b2, float inv_bc1, float inv_bc2,
                      float inv_bc2_fresh, float eps, LambPostStats* out, void* stream);

// LAMB apply (warmup pass 2 and the compression-stage update):
// u = m * inv_bc1 / (sqrt(v) * inv_bc2 + eps) + seg.wd * p; p -= seg.step * u; copy-out.
// Reads offset, n, p, low, ltype, step, wd.
std::string lamb_apply(const Segment* segs, std::size_t count, const float* m, const float* v,
                       float inv_bc1, float inv_bc2, float eps, void* stream);

// dst = src (device to device, stream-ordered), e.g. aux = v at the LAMB freeze.
std::string copy_device(void* dst, const void* src, std::size_t bytes, void* stream);

}  // namespace loom::optim::cuda::onebit
