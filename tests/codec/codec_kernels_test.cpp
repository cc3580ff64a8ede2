// The codecs' CPU kernels against the scalar reference (reference.hpp), bit for bit: random
// sizes including ones that are not multiples of the SIMD width or the norm block, zeros,
// negative zeros, with and without error feedback.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <random>
#include <vector>

#include "codec_kernels.hpp"
#include "reference.hpp"

namespace {

using loom::codecs::kNormBlock;

std::vector<float> random_values(size_t n, std::mt19937& rng, float bias = 0.0f) {
  std::normal_distribution<float> g(bias, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  // Exact zeros of both signs, which must give bit 1 (+1).
  for (size_t i = 0; i < n; i += 7) v[i] = (i / 7) % 2 == 0 ? 0.0f : -0.0f;
  return v;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The kernel path exactly as the onebit plugin runs it, without the plugin: pass 1, then
// pack per chunk.
std::vector<uint8_t> kernel_encode(const std::vector<float>& x, std::vector<float>* e,
                                   size_t chunks) {
  const size_t n = x.size();
  const double sum = loom::codecs::onebit_sum_squares(x.data(), e ? e->data() : nullptr, n);
  const float s = loom::codecs::onebit_scale(sum, n);
  const size_t c = n / chunks;
  std::vector<uint8_t> out(chunks * (4 + c / 8));
  for (size_t j = 0; j < chunks; ++j) {
    std::memcpy(out.data() + j * (4 + c / 8), &s, 4);
    loom::codecs::onebit_sign_pack(x.data() + j * c, e ? e->data() + j * c : nullptr, c, s,
                                   out.data() + j * (4 + c / 8) + 4);
  }
  return out;
}

// Runs `body` once per SIMD target this CPU supports and the kernels were compiled for.
template <class Fn>
void for_each_target(Fn body) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(OnebitKernels, MatchScalarReferenceBitForBit) {
  for_each_target([] {
    std::mt19937 rng(42);
    const size_t sizes[] = {
        8, 16, 24, 56, 64, 72, 120, 2040, 2048, 2056, 4096 + 8, 256 * kNormBlock + 8 * 3, 1000008};
    for (size_t n : sizes) {
      for (bool with_error : {false, true}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " error=" + std::to_string(with_error));
        const std::vector<float> x = random_values(n, rng, 0.1f);
        std::vector<float> e_ref = random_values(n, rng);
        for (auto& v : e_ref) v *= 0.25f;
        std::vector<float> e_k = e_ref;
        const size_t chunks = n % 16 == 0 ? 2 : 1;
        const auto want = ref::onebit_encode(x, with_error ? &e_ref : nullptr, chunks);
        const auto got = kernel_encode(x, with_error ? &e_k : nullptr, chunks);
        ASSERT_EQ(got, want);
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(e_k[i]), bits_of(e_ref[i])) << "i=" << i;

        // Decode, plain and accumulating.
        const float alpha = 0.375f;
        std::vector<float> out_ref = random_values(n, rng);
        std::vector<float> out_k = out_ref;
        ref::onebit_decode(want.data(), chunks, n / chunks, alpha, true, out_ref.data());
        for (size_t j = 0; j < chunks; ++j) {
          float s;
          std::memcpy(&s, got.data() + j * (4 + n / chunks / 8), 4);
          loom::codecs::onebit_unpack(got.data() + j * (4 + n / chunks / 8) + 4, n / chunks,
                                      alpha * s, true, out_k.data() + j * (n / chunks));
        }
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(out_k[i]), bits_of(out_ref[i])) << i;
      }
    }
  });
}

// The streaming-store decode (large outputs) writes the same values.
TEST(OnebitKernels, NontemporalDecodeMatches) {
  for_each_target([] {
    const size_t n = 4096 + 8;
    std::mt19937 rng(11);
    const std::vector<float> x = random_values(n, rng);
    const auto enc = ref::onebit_encode(x, nullptr, 1);
    std::vector<float> want(n);
    ref::onebit_decode(enc.data(), 1, n, 0.5f, false, want.data());
    float s;
    std::memcpy(&s, enc.data(), 4);
    auto* out = static_cast<float*>(::operator new (n * sizeof(float), std::align_val_t{64}));
    loom::codecs::onebit_unpack(enc.data() + 4, n, 0.5f * s, false, out, true);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(out[i]), bits_of(want[i])) << i;
    ::operator delete (out, std::align_val_t{64});
  });
}

// The server's one-pass sum of n chunks equals n chunk-by-chunk decodes, bit for bit, plain
// and accumulating, streaming or not, for chunk counts 1 to 5.
TEST(OnebitKernels, UnpackSumEqualsChunkByChunkDecode) {
  for_each_target([] {
    std::mt19937 rng(17);
    for (size_t n : {size_t{8}, size_t{72}, size_t{4096 + 8}, size_t{100008}}) {
      for (size_t count = 1; count <= 5; ++count) {
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " count=" + std::to_string(count) +
                       " accumulate=" + std::to_string(accumulate));
          std::vector<std::vector<uint8_t>> enc;
          std::vector<const uint8_t*> bits;
          std::vector<float> v;
          for (size_t j = 0; j < count; ++j) {
            enc.push_back(ref::onebit_encode(random_values(n, rng, 0.2f), nullptr, 1));
            float s;
            std::memcpy(&s, enc.back().data(), 4);
            v.push_back(0.25f * s);
          }
          for (const auto& e : enc) bits.push_back(e.data() + 4);
          const std::vector<float> start = random_values(n, rng);
          std::vector<float> want = start;
          for (size_t j = 0; j < count; ++j) {
            loom::codecs::onebit_unpack(bits[j], n, v[j], accumulate || j > 0, want.data());
          }
          for (bool nontemporal : {false, true}) {
            auto* got =
                static_cast<float*>(::operator new (n * sizeof(float), std::align_val_t{64}));
            std::memcpy(got, start.data(), n * sizeof(float));
            loom::codecs::onebit_unpack_sum(bits.data(), v.data(), count, n, accumulate, got,
                                            nontemporal);
            for (size_t i = 0; i < n; ++i) {
              ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << "i=" << i;
            }
            ::operator delete (got, std::align_val_t{64});
          }
        }
      }
    }
  });
}

TEST(OnebitKernels, ZeroAndNegativeZeroAreBitOne) {
  std::vector<float> x(16, 0.0f);
  for (size_t i = 8; i < 16; ++i) x[i] = -0.0f;
  std::vector<uint8_t> bits(2);
  loom::codecs::onebit_sign_pack(x.data(), nullptr, 16, 1.0f, bits.data());
  EXPECT_EQ(bits[0], 0xFF);
  EXPECT_EQ(bits[1], 0xFF);
  // The sum of squares of an all-zero buffer is 0, so the scale is 0 (decodes to +-0).
  EXPECT_EQ(loom::codecs::onebit_scale(loom::codecs::onebit_sum_squares(x.data(), nullptr, 16), 16),
            0.0f);
}

TEST(OnebitKernels, MsbFirstPacking) {
  // Only element 0 positive -> 0x80; only element 7 -> 0x01.
  std::vector<float> x(8, -1.0f);
  x[0] = 1.0f;
  uint8_t byte = 0;
  loom::codecs::onebit_sign_pack(x.data(), nullptr, 8, 1.0f, &byte);
  EXPECT_EQ(byte, 0x80);
  x[0] = -1.0f;
  x[7] = 2.0f;
  loom::codecs::onebit_sign_pack(x.data(), nullptr, 8, 1.0f, &byte);
  EXPECT_EQ(byte, 0x01);
}

TEST(Ef8Kernels, MatchScalarReferenceBitForBit) {
  for_each_target([] {
    std::mt19937 rng(7);
    for (size_t n : {size_t{1}, size_t{3}, size_t{17}, size_t{1000}, size_t{65537}}) {
      SCOPED_TRACE("n=" + std::to_string(n));
      const std::vector<float> x = random_values(n, rng, 0.2f);
      std::vector<float> e_ref(n, 0.01f);
      std::vector<float> e_k = e_ref;
      const auto want = ref::ef8_encode(x, &e_ref, 1);
      float m = 0.0f;
      ASSERT_TRUE(loom::codecs::ef8_max_abs(x.data(), e_k.data(), n, &m));
      std::vector<uint8_t> got(4 + n);
      const float scale = m / 127.0f;
      std::memcpy(got.data(), &scale, 4);
      loom::codecs::ef8_quantize(x.data(), e_k.data(), n, m,
                                 reinterpret_cast<int8_t*>(got.data() + 4));
      ASSERT_EQ(got, want);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(e_k[i]), bits_of(e_ref[i]));
      // Error feedback keeps the residual within half a quantization step.
      for (size_t i = 0; i < n; ++i) ASSERT_LE(std::fabs(e_k[i]), scale * 0.5f + 1e-6f);
    }
    // Ties round to even: max 127 makes the step exactly 1.
    {
      std::vector<float> x = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, 126.5f, -127.0f};
      x.resize(40, 3.5f);
      float m = 0.0f;
      ASSERT_TRUE(loom::codecs::ef8_max_abs(x.data(), nullptr, x.size(), &m));
      std::vector<int8_t> q(x.size());
      loom::codecs::ef8_quantize(x.data(), nullptr, x.size(), m, q.data());
      const int8_t want[8] = {127, 0, 2, 2, 0, -2, 126, -127};
      for (int i = 0; i < 8; ++i) EXPECT_EQ(q[i], want[i]) << i;
      for (size_t i = 8; i < q.size(); ++i) EXPECT_EQ(q[i], 4) << i;
    }
    // Non-finite values anywhere (in the SIMD body or the tail) are reported.
    for (size_t at : {size_t{1}, size_t{40}, size_t{63}}) {
      std::vector<float> bad(64, 1.0f);
      bad[at] = std::nanf("");
      float m = 0.0f;
      EXPECT_FALSE(loom::codecs::ef8_max_abs(bad.data(), nullptr, bad.size(), &m)) << at;
      bad[at] = -INFINITY;
      EXPECT_FALSE(loom::codecs::ef8_max_abs(bad.data(), nullptr, bad.size(), &m)) << at;
    }
  });
}

}  // namespace
