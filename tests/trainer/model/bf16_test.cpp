// The trainer's bf16 conversion (trainer/model/bf16.hpp) against a plain reference, and the
// model's bf16 mode: master weights untouched by the forward, bf16 values at the layers'
// boundaries, fp32 gradients close to the fp32 model's, and the same bytes every run.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "bf16.hpp"
#include "model.hpp"

namespace lt = loom::trainer;

namespace {

// The bf16 nearest to a finite f, ties to the even one, computed in double: the two bf16
// values around f (truncation and the next one away from zero) and their distances.
uint16_t reference_bf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t lo = static_cast<uint16_t>(bits >> 16);  // toward zero
  if ((bits & 0xffffU) == 0) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);  // away from zero (may be an infinity)
  const double x = std::fabs(static_cast<double>(f));
  const double a = std::fabs(static_cast<double>(lt::from_bf16(lo)));
  const double b = std::fabs(static_cast<double>(lt::from_bf16(hi)));
  // hi as an infinity: the distance to 2^128, where rounding would put the next value.
  const double bb = std::isinf(b) ? std::ldexp(1.0, 128) : b;
  if (x - a < bb - x) return lo;
  if (x - a > bb - x) return hi;
  return (lo & 1U) == 0 ? lo : hi;
}

bool is_bf16(float f) { return (std::bit_cast<uint32_t>(f) & 0xffffU) == 0; }

TEST(Bf16, MatchesTheReferenceOnRandomBitPatterns) {
  std::mt19937 rng(7);
  size_t checked = 0;
  for (int i = 0; i < 2000000; ++i) {
    const auto bits = static_cast<uint32_t>(rng());
    const float f = std::bit_cast<float>(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(lt::to_bf16(f), reference_bf16(f)) << std::hex << bits;
    ++checked;
  }
  EXPECT_GT(checked, 1900000U);
}

TEST(Bf16, TiesGoToEven) {
  // bf16 has 7 mantissa bits: at 1.0 its step is 2^-7, half a step 2^-8.
  EXPECT_EQ(lt::round_bf16(1.0f + 0x1p-8f), 1.0f);                // even below
  EXPECT_EQ(lt::round_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);  // even above
  EXPECT_EQ(lt::round_bf16(-(1.0f + 3 * 0x1p-8f)), -(1.0f + 0x1p-6f));
  EXPECT_EQ(lt::round_bf16(1.0f + 0x1p-8f + 0x1p-23f), 1.0f + 0x1p-7f);  // past the tie
  // Subnormals tie too: half the smallest bf16 goes to 0, one and a half of it to 2.
  EXPECT_EQ(lt::to_bf16(std::bit_cast<float>(0x00008000U)), 0x0000U);
  EXPECT_EQ(lt::to_bf16(std::bit_cast<float>(0x00018000U)), 0x0002U);
  EXPECT_EQ(lt::to_bf16(-0.0f), 0x8000U);
}

TEST(Bf16, InfinitiesOverflowAndNaNs) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(lt::to_bf16(inf), 0x7f80U);
  EXPECT_EQ(lt::to_bf16(-inf), 0xff80U);
  EXPECT_EQ(lt::round_bf16(std::numeric_limits<float>::max()), inf);   // past bf16's largest
  EXPECT_EQ(lt::to_bf16(std::bit_cast<float>(0x7f7f7fffU)), 0x7f7fU);  // just below the tie
  EXPECT_EQ(lt::to_bf16(-std::numeric_limits<float>::max()), 0xff80U);
  // NaNs stay NaNs of their sign, quiet, even with the payload only in the dropped bits.
  for (const uint32_t nan : {0x7fc00000U, 0x7f800001U, 0xff800001U, 0x7fffffffU, 0xffc01234U}) {
    const uint16_t h = lt::to_bf16(std::bit_cast<float>(nan));
    EXPECT_TRUE(std::isnan(lt::from_bf16(h))) << std::hex << nan;
    EXPECT_EQ(h & 0x8000U, (nan >> 16) & 0x8000U) << std::hex << nan;
    EXPECT_NE(h & 0x0040U, 0U) << std::hex << nan;
  }
  // Every bf16 survives the round trip, and round_bf16_span rounds each element.
  for (uint32_t h = 0; h < 0x10000U; ++h) {
    const float f = lt::from_bf16(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(lt::to_bf16(f), h);
    }
  }
  std::vector<float> v{1.0f + 0x1p-8f, 3.14159265f, -inf, 1e-40f};
  lt::round_bf16_span(v.data(), v.size());
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], lt::round_bf16(3.14159265f));
  EXPECT_EQ(v[2], -inf);
  EXPECT_TRUE(is_bf16(v[3]));
}

lt::ModelConfig tiny() {
  lt::ModelConfig c;
  c.vocab_size = 40;
  c.context = 16;
  c.layers = 2;
  c.heads = 2;
  c.dim = 16;
  return c;
}

void tokens(std::vector<int32_t>& x, std::vector<int32_t>& y, size_t n) {
  x.resize(n);
  y.resize(n);
  for (size_t i = 0; i < n; ++i) {
    x[i] = static_cast<int32_t>((i * 7 + 3) % 40);
    y[i] = static_cast<int32_t>((i * 11 + 5) % 40);
  }
}

TEST(Bf16Model, MasterWeightsStayFp32AndActivationsAreBf16) {
  lt::Model fp(tiny(), 3);
  lt::Model bf(tiny(), 3);
  bf.set_bf16(true);
  EXPECT_TRUE(bf.bf16());
  ASSERT_EQ(fp.parameters().size(), bf.parameters().size());
  std::vector<int32_t> x, y;
  tokens(x, y, 2 * 16);
  const float lf = fp.forward_backward(x.data(), y.data(), 2, 16);
  const float lb = bf.forward_backward(x.data(), y.data(), 2, 16);
  // The master weights are the fp32 model's, bit for bit, after a forward and backward.
  size_t non_bf16 = 0;
  for (size_t i = 0; i < fp.parameters().size(); ++i) {
    const auto& a = fp.parameters()[i];
    const auto& b = bf.parameters()[i];
    ASSERT_EQ(a.name, b.name);
    ASSERT_EQ(std::memcmp(a.value, b.value, 4 * a.numel), 0) << a.name;
    for (size_t k = 0; k < b.numel; ++k) non_bf16 += is_bf16(b.value[k]) ? 0 : 1;
  }
  EXPECT_GT(non_bf16, 1000U) << "the master weights should not be rounded";
  // Every layer boundary holds bf16 values.
  for (int l = -1; l < 2; ++l) {
    const float* o = bf.layer_output(l);
    for (size_t k = 0; k < 2 * 16 * 16; ++k) ASSERT_TRUE(is_bf16(o[k])) << l << " " << k;
  }
  EXPECT_NE(lf, lb);
  EXPECT_NEAR(lb, lf, 0.01 * lf);
  // The gradients: fp32, close to the fp32 model's (cosine similarity over all of them).
  double dot = 0, na = 0, nb = 0;
  size_t non_bf16_grads = 0;
  for (size_t i = 0; i < fp.parameters().size(); ++i) {
    const auto& a = fp.parameters()[i];
    const auto& b = bf.parameters()[i];
    for (size_t k = 0; k < a.numel; ++k) {
      dot += static_cast<double>(a.grad[k]) * b.grad[k];
      na += static_cast<double>(a.grad[k]) * a.grad[k];
      nb += static_cast<double>(b.grad[k]) * b.grad[k];
      non_bf16_grads += is_bf16(b.grad[k]) ? 0 : 1;
    }
  }
  EXPECT_GT(dot / std::sqrt(na * nb), 0.99);
  EXPECT_GT(non_bf16_grads, 1000U) << "the gradients should be fp32";
}

TEST(Bf16Model, TheForwardReadsTheMasterWeightsRounded) {
  // A model whose master weights are bf16 already computes what the bf16 mode computes from
  // the unrounded ones: the forward reads round_bf16(master).
  lt::Model a(tiny(), 5);
  lt::Model b(tiny(), 5);
  a.set_bf16(true);
  b.set_bf16(true);
  for (auto& p : b.parameters()) lt::round_bf16_span(p.value, p.numel);
  std::vector<int32_t> x, y;
  tokens(x, y, 16);
  EXPECT_EQ(a.forward_loss(x.data(), y.data(), 1, 16), b.forward_loss(x.data(), y.data(), 1, 16));
  // Changing the master weights changes the next forward (the rounded copy is refreshed).
  for (auto& p : a.parameters())
    for (size_t k = 0; k < p.numel; ++k) p.value[k] *= 1.5f;
  EXPECT_NE(a.forward_loss(x.data(), y.data(), 1, 16), b.forward_loss(x.data(), y.data(), 1, 16));
}

TEST(Bf16Model, TrainsAndRepeatsBitForBit) {
  auto train = [](std::vector<float>& losses) {
    lt::Model m(tiny(), 9);
    m.set_bf16(true);
    std::vector<int32_t> x, y;
    tokens(x, y, 4 * 16);
    for (int step = 0; step < 30; ++step) {
      m.zero_grad();
      losses.push_back(m.forward_backward(x.data(), y.data(), 4, 16));
      for (auto& p : m.parameters())
        for (size_t k = 0; k < p.numel; ++k) p.value[k] -= 0.05f * p.grad[k];
    }
    std::vector<float> w;
    for (auto& p : m.parameters()) w.insert(w.end(), p.value, p.value + p.numel);
    return w;
  };
  std::vector<float> l1, l2;
  const auto w1 = train(l1);
  const auto w2 = train(l2);
  EXPECT_LT(l1.back(), l1.front() - 0.5f);
  EXPECT_EQ(l1, l2);
  ASSERT_EQ(w1.size(), w2.size());
  EXPECT_EQ(std::memcmp(w1.data(), w2.data(), 4 * w1.size()), 0);
}

}  // namespace
