// The trainer's model: every layer's backward and the whole model's gradients against
// double-precision central differences, float against double, a tiny training run,
// determinism, bad inputs, and the MLP seam.
#include <gtest/gtest.h>
#include <hwy/highway.h>
#include <loom/sdk/blas.hpp>

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpt.hpp"
#include "layers.hpp"
#include "model.hpp"

namespace lt = loom::trainer;
namespace ly = loom::trainer::layers;

namespace {

std::vector<double> randn(size_t n, std::mt19937_64& rng, double std = 1.0) {
  std::normal_distribution<double> d(0.0, std);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Compares analytic[i] with the central difference of loss() in x[i], for `samples` random
// indices (all of them when x is small). Returns the number of entries checked.
size_t check_grad(const std::string& what, std::vector<double>& x,
                  const std::vector<double>& analytic, const std::function<double()>& loss,
                  std::mt19937_64& rng, size_t samples = 40) {
  EXPECT_EQ(x.size(), analytic.size()) << what;
  std::vector<size_t> idx;
  if (x.size() <= samples) {
    for (size_t i = 0; i < x.size(); ++i) idx.push_back(i);
  } else {
    std::uniform_int_distribution<size_t> pick(0, x.size() - 1);
    for (size_t k = 0; k < samples; ++k) idx.push_back(pick(rng));
  }
  constexpr double h = 1e-6;
  for (const size_t i : idx) {
    const double saved = x[i];
    x[i] = saved + h;
    const double lp = loss();
    x[i] = saved - h;
    const double lm = loss();
    x[i] = saved;
    const double num = (lp - lm) / (2 * h);
    EXPECT_NEAR(analytic[i], num, 1e-6 + 1e-5 * std::fabs(num)) << what << "[" << i << "]";
  }
  return idx.size();
}

}  // namespace

TEST(TrainerLayers, FastExpMatchesStdExp) {
  for (float x = -80.0f; x < 80.0f; x += 0.01337f) {
    const float want = std::exp(x);
    EXPECT_NEAR(ly::fast_exp(x), want, 4e-7f * want) << x;
  }
  EXPECT_TRUE(std::isfinite(ly::fast_exp(1000.0f)));
  EXPECT_GE(ly::fast_exp(-1000.0f), 0.0f);
  EXPECT_NEAR(ly::fast_tanh(0.3f), std::tanh(0.3f), 1e-6f);
  EXPECT_NEAR(ly::fast_tanh(-20.0f), -1.0f, 1e-6f);
}

// Runs `body` once per SIMD target this CPU supports and Highway generated code for, so the
// kernels are checked on AVX2 (and the baseline) even on an AVX-512 machine.
template <class Fn>
void for_each_target(Fn body) {
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    EXPECT_STREQ(ly::kernel_target(), hwy::TargetName(target));
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(TrainerLayers, FloatSpansMatchTheReferenceOnEveryTarget) {
  const size_t sizes[] = {0, 1, 3, 7, 8, 15, 16, 17, 31, 32, 33, 100, 1000, 4099};
  for_each_target([&] {
    std::mt19937_64 rng(7);
    for (const size_t n : sizes) {
      SCOPED_TRACE("n=" + std::to_string(n));
      std::vector<float> x(n);
      std::vector<float> dout(n);
      std::normal_distribution<float> nd(0.0f, 3.0f);
      for (auto& v : x) v = nd(rng);
      for (auto& v : dout) v = nd(rng);
      if (n > 2) {  // the clamp and the saturated tails
        x[0] = -200.0f;
        x[1] = 95.0f;
      }
      std::vector<float> out(n + 1, -1.0f);  // one guard element past the span
      ly::gelu_forward_span(out.data(), x.data(), n);
      std::vector<float> din(n + 1, 0.5f);
      ly::gelu_backward_span(din.data(), x.data(), dout.data(), n);
      for (size_t i = 0; i < n; ++i) {
        const double xd = x[i];
        const double u = 0.79788456080286535588 * (xd + 0.044715 * xd * xd * xd);
        const double th = std::tanh(u);
        const double want = 0.5 * xd * (1 + th);
        ASSERT_NEAR(out[i], want, 2e-6 * (1 + std::fabs(want))) << "gelu x=" << xd;
        const double du = 0.79788456080286535588 * (1 + 3 * 0.044715 * xd * xd);
        const double g = 0.5 * (1 + th) + 0.5 * xd * (1 - th * th) * du;
        const double dwant = 0.5 + g * dout[i];
        // 1 + tanh(u) cancels in float for x << 0: about 1e-5 absolute, on every target.
        ASSERT_NEAR(din[i], dwant, 1.5e-5 * (1 + std::fabs(dwant))) << "gelu' x=" << xd;
      }
      EXPECT_EQ(out[n], -1.0f);
      EXPECT_EQ(din[n], 0.5f);
      // The vector kernels and the scalar loops they replace agree to rounding.
      std::vector<float> sout(n);
      std::vector<float> sdin(n, 0.5f);
      ly::gelu_forward_span<float>(sout.data(), x.data(), n);
      ly::gelu_backward_span<float>(sdin.data(), x.data(), dout.data(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(out[i], sout[i], 1e-6f * (1 + std::fabs(sout[i]))) << "x=" << x[i];
        ASSERT_NEAR(din[i], sdin[i], 1e-6f * (1 + std::fabs(sdin[i]) + std::fabs(dout[i])))
            << "x=" << x[i];
      }

      std::vector<float> e = x;
      e.push_back(-1.0f);
      const float shift = n > 0 ? *std::max_element(x.begin(), x.end()) : 0.0f;
      const float sum = ly::exp_sum_span(e.data(), n, shift);
      double want_sum = 0;
      for (size_t i = 0; i < n; ++i) {
        const double want = std::exp(std::max(-87.0, double(x[i]) - shift));
        want_sum += double(e[i]);
        ASSERT_NEAR(e[i], want, 1e-6 * want + 1e-37) << "exp x=" << x[i];
      }
      EXPECT_NEAR(sum, want_sum, 1e-5 * want_sum + 1e-30);
      EXPECT_EQ(e[n], -1.0f);
    }
  });
}

// A NaN stays a NaN on every target (x86's min/max would turn it into the clamp bound), so
// a diverging run shows a NaN loss instead of training on.
TEST(TrainerLayers, FloatSpansKeepNaNOnEveryTarget) {
  for_each_target([] {
    for (const size_t at : {size_t{0}, size_t{5}, size_t{16}, size_t{36}}) {
      std::vector<float> x(37, 0.25f);
      x[at] = std::numeric_limits<float>::quiet_NaN();
      std::vector<float> out(x.size());
      ly::gelu_forward_span(out.data(), x.data(), x.size());
      EXPECT_TRUE(std::isnan(out[at])) << "gelu at " << at;
      EXPECT_FALSE(std::isnan(out[(at + 1) % x.size()]));
      std::vector<float> e = x;
      const float sum = ly::exp_sum_span(e.data(), e.size(), 0.0f);
      EXPECT_TRUE(std::isnan(e[at])) << "exp at " << at;
      EXPECT_TRUE(std::isnan(sum)) << "sum with a NaN at " << at;
    }
  });
}

TEST(TrainerLayers, LayerNormGradient) {
  std::mt19937_64 rng(1);
  const int N = 6, C = 8;
  auto inp = randn(N * C, rng, 2.0), w = randn(C, rng), b = randn(C, rng);
  const auto R = randn(N * C, rng);
  std::vector<double> out(N * C), mean(N), rstd(N);
  auto loss = [&] {
    ly::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N,
                          C);
    return dot(out, R);
  };
  loss();
  std::vector<double> dinp(N * C, 0.0), dw(C, 0.0), db(C, 0.0);
  ly::layernorm_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(),
                         mean.data(), rstd.data(), N, C);
  check_grad("ln.inp", inp, dinp, loss, rng);
  check_grad("ln.w", w, dw, loss, rng);
  check_grad("ln.b", b, db, loss, rng);
}

TEST(TrainerLayers, MatmulGradient) {
  std::mt19937_64 rng(2);
  const int N = 5, IC = 7, OC = 9;
  auto inp = randn(N * IC, rng), w = randn(OC * IC, rng), b = randn(OC, rng);
  const auto R = randn(N * OC, rng);
  std::vector<double> out(N * OC);
  auto loss = [&] {
    ly::matmul_forward(out.data(), inp.data(), w.data(), b.data(), N, IC, OC);
    return dot(out, R);
  };
  loss();
  std::vector<double> dinp(N * IC, 0.0), dw(OC * IC, 0.0), db(OC, 0.0);
  ly::matmul_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), w.data(), N, IC, OC);
  check_grad("mm.inp", inp, dinp, loss, rng);
  check_grad("mm.w", w, dw, loss, rng);
  check_grad("mm.b", b, db, loss, rng);
}

TEST(TrainerLayers, MatmulSplitAcrossThreadsMatchesOneGemm) {
  // Large enough that par_gemm splits over the pool along both m and n.
  std::mt19937_64 rng(9);
  for (const auto& [N, OC] : {std::pair{300, 70}, std::pair{40, 330}}) {
    const int IC = 33;
    auto inp = randn(static_cast<size_t>(N) * IC, rng),
         w = randn(static_cast<size_t>(OC) * IC, rng);
    std::vector<double> out(static_cast<size_t>(N) * OC), ref(out.size());
    ly::matmul_forward<double>(out.data(), inp.data(), w.data(), nullptr, N, IC, OC);
    for (int i = 0; i < N; ++i)
      for (int o = 0; o < OC; ++o) {
        double s = 0;
        for (int c = 0; c < IC; ++c) s += inp[i * IC + c] * w[o * IC + c];
        ref[static_cast<size_t>(i) * OC + o] = s;
      }
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-10) << i;
  }
}

TEST(TrainerLayers, GeluGradient) {
  std::mt19937_64 rng(3);
  auto inp = randn(50, rng, 2.0);
  const auto R = randn(50, rng);
  std::vector<double> out(50);
  auto loss = [&] {
    ly::gelu_forward(out.data(), inp.data(), inp.size());
    return dot(out, R);
  };
  loss();
  EXPECT_NEAR(out[0],
              0.5 * inp[0] *
                  (1 + std::tanh(std::sqrt(2 / M_PI) * (inp[0] + 0.044715 * std::pow(inp[0], 3)))),
              1e-12);
  std::vector<double> dinp(50, 0.0);
  ly::gelu_backward(dinp.data(), inp.data(), R.data(), inp.size());
  check_grad("gelu", inp, dinp, loss, rng);
}

TEST(TrainerLayers, AttentionGradientAndCausality) {
  std::mt19937_64 rng(4);
  const int B = 2, T = 5, C = 8, NH = 2;
  auto qkv = randn(B * T * 3 * C, rng);
  const auto R = randn(B * T * C, rng);
  std::vector<double> out(B * T * C), att(B * NH * T * T);
  auto loss = [&] {
    ly::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return dot(out, R);
  };
  loss();
  // Rows of att are distributions over the causal prefix.
  for (int bh = 0; bh < B * NH; ++bh)
    for (int i = 0; i < T; ++i) {
      double s = 0;
      for (int j = 0; j < T; ++j) {
        const double a = att[(bh * T + i) * T + j];
        if (j > i) {
          EXPECT_EQ(a, 0.0);
        }
        s += a;
      }
      EXPECT_NEAR(s, 1.0, 1e-12);
    }
  // Causality: changing the last position's k and v leaves earlier outputs unchanged.
  const auto before = out;
  for (int c = C; c < 3 * C; ++c) qkv[(T - 1) * 3 * C + c] += 1.0;
  loss();
  for (int t = 0; t < T - 1; ++t)
    for (int c = 0; c < C; ++c) EXPECT_EQ(out[t * C + c], before[t * C + c]);
  loss();
  std::vector<double> dqkv(qkv.size(), 0.0), scratch(att.size());
  ly::attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), att.data(), B, T, C,
                         NH);
  check_grad("attn.qkv", qkv, dqkv, loss, rng, 400);
}

TEST(TrainerLayers, AttentionGradientAcrossRowBlocks) {
  // T spans several blocks of query rows (kAttRows), the last one partial.
  std::mt19937_64 rng(14);
  const int B = 1, T = 2 * ly::kAttRows + 7, C = 4, NH = 2;
  auto qkv = randn(static_cast<size_t>(B) * T * 3 * C, rng);
  const auto R = randn(static_cast<size_t>(B) * T * C, rng);
  std::vector<double> out(static_cast<size_t>(B) * T * C), att(static_cast<size_t>(B) * NH * T * T);
  auto loss = [&] {
    ly::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return dot(out, R);
  };
  loss();
  // Reference output by the definition, for the last row of head 1.
  const int i = T - 1, h = 1, hs = C / NH;
  std::vector<double> w(static_cast<size_t>(T));
  double mx = -1e300, sum = 0;
  for (int j = 0; j <= i; ++j) {
    double sc = 0;
    for (int c = 0; c < hs; ++c)
      sc += qkv[i * 3 * C + h * hs + c] * qkv[j * 3 * C + C + h * hs + c];
    w[j] = sc / std::sqrt(double(hs));
    mx = std::max(mx, w[j]);
  }
  for (int j = 0; j <= i; ++j) sum += (w[j] = std::exp(w[j] - mx));
  for (int c = 0; c < hs; ++c) {
    double y = 0;
    for (int j = 0; j <= i; ++j) y += w[j] / sum * qkv[j * 3 * C + 2 * C + h * hs + c];
    EXPECT_NEAR(out[i * C + h * hs + c], y, 1e-12);
  }
  std::vector<double> dqkv(qkv.size(), 0.0), scratch(att.size());
  ly::attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), att.data(), B, T, C,
                         NH);
  check_grad("attn.qkv.blocks", qkv, dqkv, loss, rng, 300);
}

TEST(TrainerLayers, EmbeddingGradient) {
  std::mt19937_64 rng(5);
  const int B = 2, T = 4, C = 3, V = 5;
  const std::vector<int32_t> tokens = {1, 3, 1, 0, 4, 4, 2, 1};
  auto wte = randn(V * C, rng), wpe = randn(T * C, rng);
  const auto R = randn(B * T * C, rng);
  std::vector<double> out(B * T * C);
  auto loss = [&] {
    ly::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, R);
  };
  loss();
  std::vector<double> dwte(V * C, 0.0), dwpe(T * C, 0.0);
  ly::encoder_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, T, C);
  check_grad("wte", wte, dwte, loss, rng);
  check_grad("wpe", wpe, dwpe, loss, rng);
}

TEST(TrainerLayers, SoftmaxCrossEntropyGradientAndStability) {
  std::mt19937_64 rng(6);
  const int N = 4, V = 7;
  auto logits = randn(N * V, rng, 3.0);
  const std::vector<int32_t> targets = {0, 6, 3, 3};
  std::vector<double> probs(N * V);
  auto loss = [&] {
    return ly::crossentropy_forward(probs.data(), logits.data(), targets.data(), N, V);
  };
  loss();
  std::vector<double> dl(N * V);
  ly::crossentropy_backward(dl.data(), probs.data(), targets.data(), N, V);
  check_grad("ce.logits", logits, dl, loss, rng);
  // Huge logits: finite loss, no NaN (float path, fast_exp).
  std::vector<float> big = {1000.0f, -1000.0f, 0.0f, 80.0f};
  std::vector<float> p(4);
  const int32_t t = 1;
  const double l = ly::crossentropy_forward(p.data(), big.data(), &t, 1, 4);
  EXPECT_NEAR(l, 2000.0, 1e-3);
  for (float v : p) EXPECT_TRUE(std::isfinite(v));
}

TEST(TrainerLayers, MlpGradient) {
  std::mt19937_64 rng(12);
  const int N = 5, C = 4;
  auto x = randn(N * C, rng), fcw = randn(4 * C * C, rng, 0.7), fcb = randn(4 * C, rng),
       pw = randn(C * 4 * C, rng, 0.5), pb = randn(C, rng);
  std::vector<double> gfcw(fcw.size(), 0.0), gfcb(fcb.size(), 0.0), gpw(pw.size(), 0.0),
      gpb(pb.size(), 0.0);
  auto ref = [](std::vector<double>& v, std::vector<double>& g, const char* n) {
    return lt::ParamRef<double>{n, {}, v.data(), g.data(), v.size()};
  };
  lt::DenseMlp<double> mlp(C, ref(fcw, gfcw, "fc.w"), ref(fcb, gfcb, "fc.b"),
                           ref(pw, gpw, "proj.w"), ref(pb, gpb, "proj.b"));
  const auto R = randn(N * C, rng);
  std::vector<double> y(N * C);
  auto loss = [&] {
    mlp.forward(x.data(), y.data(), N);
    return dot(y, R);
  };
  loss();
  std::vector<double> dx(N * C, 0.0);
  mlp.backward(x.data(), R.data(), dx.data(), N);
  check_grad("mlp.x", x, dx, loss, rng);
  check_grad("mlp.fc.w", fcw, gfcw, loss, rng);
  check_grad("mlp.fc.b", fcb, gfcb, loss, rng);
  check_grad("mlp.proj.w", pw, gpw, loss, rng);
  check_grad("mlp.proj.b", pb, gpb, loss, rng);
}

namespace {

lt::ModelConfig tiny() {
  lt::ModelConfig c;
  c.vocab_size = 11;
  c.context = 6;
  c.layers = 2;
  c.heads = 2;
  c.dim = 8;
  return c;
}

}  // namespace

TEST(TrainerModel, WholeModelGradientEveryTensorDouble) {
  lt::Gpt<double> m(tiny(), 7);
  std::mt19937_64 rng(8);
  const int B = 2, T = 5;
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int i = 0; i < B * T; ++i) {
    tok[i] = static_cast<int32_t>(rng() % 11);
    tgt[i] = static_cast<int32_t>(rng() % 11);
  }
  // Larger weights than the init so every path (attention softmax, GELU curvature) matters.
  for (auto& p : m.parameters())
    for (size_t i = 0; i < p.numel; ++i) p.value[i] += 0.3 * std::normal_distribution<>()(rng);
  m.zero_grad();
  m.forward_backward(tok.data(), tgt.data(), B, T);
  // grads must accumulate: a second call doubles them.
  std::vector<std::vector<double>> g1;
  for (auto& p : m.parameters()) g1.emplace_back(p.grad, p.grad + p.numel);
  m.forward_backward(tok.data(), tgt.data(), B, T);
  for (size_t k = 0; k < g1.size(); ++k)
    for (size_t i = 0; i < g1[k].size(); ++i)
      ASSERT_NEAR(m.parameters()[k].grad[i], 2 * g1[k][i], 1e-12);
  size_t tensors = 0;
  for (size_t k = 0; k < m.parameters().size(); ++k) {
    auto& p = m.parameters()[k];
    std::vector<double> x(p.value, p.value + p.numel);
    auto loss = [&] {
      std::copy(x.begin(), x.end(), p.value);
      return m.forward_loss(tok.data(), tgt.data(), B, T);
    };
    check_grad(p.name, x, g1[k], loss, rng, 12);
    std::copy(x.begin(), x.end(), p.value);
    ++tensors;
  }
  EXPECT_EQ(tensors, 2u + 12u * 2u + 2u);
  // Positions past seq (context 6, seq 5) get no gradient in wpe.
  const auto& wpe = m.parameters()[1];
  for (int c = 0; c < 8; ++c) EXPECT_EQ(g1[1][5 * 8 + c], 0.0) << wpe.name;
}

TEST(TrainerModel, FloatModelMatchesDouble) {
  lt::ModelConfig cfg;
  cfg.vocab_size = 37;
  cfg.context = 32;
  cfg.layers = 2;
  cfg.heads = 4;
  cfg.dim = 32;
  lt::Model mf(cfg, 3);
  lt::Gpt<double> md(cfg, 3);
  ASSERT_EQ(mf.parameters().size(), md.parameters().size());
  for (size_t k = 0; k < mf.parameters().size(); ++k) {
    ASSERT_EQ(mf.parameters()[k].name, md.parameters()[k].name);
    for (size_t i = 0; i < mf.parameters()[k].numel; ++i)
      md.parameters()[k].value[i] = mf.parameters()[k].value[i];
  }
  const int B = 3, T = 32;
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int i = 0; i < B * T; ++i) {
    tok[i] = (i * 7 + 3) % 37;
    tgt[i] = (i * 5 + 1) % 37;
  }
  mf.zero_grad();
  md.zero_grad();
  const float lf = mf.forward_backward(tok.data(), tgt.data(), B, T);
  const double ld = md.forward_backward(tok.data(), tgt.data(), B, T);
  EXPECT_NEAR(lf, ld, 1e-5 * ld);
  EXPECT_NEAR(ld, std::log(37.0), 0.1);  // near-uniform predictions at init
  // fp32 rounding: small relative error overall; per tensor looser (the q/k gradients are
  // tiny at init, where attention is near uniform, so cancellation dominates there).
  double all_diff = 0, all_norm = 0;
  for (size_t k = 0; k < mf.parameters().size(); ++k) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < mf.parameters()[k].numel; ++i) {
      const double a = mf.parameters()[k].grad[i], b = md.parameters()[k].grad[i];
      diff += (a - b) * (a - b);
      norm += b * b;
    }
    all_diff += diff;
    all_norm += norm;
    EXPECT_GT(norm, 0.0) << mf.parameters()[k].name;
    EXPECT_LE(std::sqrt(diff), 1e-2 * std::sqrt(norm) + 1e-9) << mf.parameters()[k].name;
  }
  EXPECT_LE(std::sqrt(all_diff), 1e-4 * std::sqrt(all_norm));
  // logits agree with the loss: forward_logits then CE by hand.
  std::vector<float> logits(static_cast<size_t>(B) * T * 37);
  mf.forward_logits(tok.data(), B, T, logits.data());
  double total = 0;
  for (int i = 0; i < B * T; ++i) {
    const float* l = logits.data() + static_cast<size_t>(i) * 37;
    double mx = l[0], s = 0;
    for (int v = 0; v < 37; ++v) mx = std::max(mx, static_cast<double>(l[v]));
    for (int v = 0; v < 37; ++v) s += std::exp(l[v] - mx);
    total += mx + std::log(s) - l[tgt[i]];
  }
  EXPECT_NEAR(total / (B * T), ld, 1e-5);
}

TEST(TrainerModel, ParametersAreContiguousAndCounted) {
  lt::ModelConfig cfg = tiny();
  lt::Model m(cfg, 1);
  const size_t C = 8, V = 11, L = 2;
  EXPECT_EQ(m.num_parameters(), V * C + 6 * C + L * (12 * C * C + 13 * C) + 2 * C);
  float* expect = m.parameters()[0].value;
  float* expect_g = m.parameters()[0].grad;
  for (const auto& p : m.parameters()) {
    EXPECT_EQ(p.value, expect) << p.name;
    EXPECT_EQ(p.grad, expect_g) << p.name;
    size_t n = 1;
    for (auto d : p.shape) n *= static_cast<size_t>(d);
    EXPECT_EQ(n, p.numel);
    expect += p.numel;
    expect_g += p.numel;
  }
  // Init statistics: wte std 0.02, residual projections 0.02/sqrt(2L), LN gains 1.
  auto stdev = [](const lt::ParamTensor& p) {
    double s = 0;
    for (size_t i = 0; i < p.numel; ++i) s += double(p.value[i]) * p.value[i];
    return std::sqrt(s / static_cast<double>(p.numel));
  };
  lt::ModelConfig big;
  big.layers = 8;
  lt::Model mb(big, 2);
  for (const auto& p : mb.parameters()) {
    if (p.name == "wte") {
      EXPECT_NEAR(stdev(p), 0.02, 0.001);
    }
    if (p.name == "h.3.mlp.proj.w") {
      EXPECT_NEAR(stdev(p), 0.02 / 4.0, 0.0003);
    }
    if (p.name == "h.0.ln1.w") {
      EXPECT_EQ(p.value[5], 1.0f);
    }
  }
  EXPECT_NEAR(m.flops_per_token(5), 6.0 * (L * 12 * C * C + V * C) + 6.0 * L * 5 * C, 1e-6);
}

TEST(TrainerModel, TinyTrainingRunLowersLoss) {
  lt::ModelConfig cfg;
  cfg.vocab_size = 16;
  cfg.context = 16;
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.dim = 32;
  lt::Model m(cfg, 11);
  const int B = 4, T = 16;
  // A repeating sequence: 0 5 3 9 12 1 7 0 5 3 ...
  const int pattern[] = {0, 5, 3, 9, 12, 1, 7};
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      tok[b * T + t] = pattern[(b + t) % 7];
      tgt[b * T + t] = pattern[(b + t + 1) % 7];
    }
  // Adam, written here.
  std::vector<std::vector<float>> mom, vel;
  for (auto& p : m.parameters()) {
    mom.emplace_back(p.numel, 0.0f);
    vel.emplace_back(p.numel, 0.0f);
  }
  const float first = m.forward_loss(tok.data(), tgt.data(), B, T);
  float last = first;
  for (int step = 1; step <= 60; ++step) {
    m.zero_grad();
    last = m.forward_backward(tok.data(), tgt.data(), B, T);
    ASSERT_TRUE(std::isfinite(last));
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f;
    const float c1 = 1 - std::pow(b1, float(step)), c2 = 1 - std::pow(b2, float(step));
    for (size_t k = 0; k < m.parameters().size(); ++k) {
      auto& p = m.parameters()[k];
      for (size_t i = 0; i < p.numel; ++i) {
        mom[k][i] = b1 * mom[k][i] + (1 - b1) * p.grad[i];
        vel[k][i] = b2 * vel[k][i] + (1 - b2) * p.grad[i] * p.grad[i];
        p.value[i] -= lr * (mom[k][i] / c1) / (std::sqrt(vel[k][i] / c2) + 1e-8f);
      }
    }
  }
  const float after = m.forward_loss(tok.data(), tgt.data(), B, T);
  EXPECT_NEAR(first, std::log(16.0f), 0.2f);
  EXPECT_LT(after, 0.5f * first) << "first " << first << " last " << last;
}

// The matmuls run on several pool threads at once, which only OpenBLAS's pthread build allows
// at full speed (loom/sdk/blas.hpp makes any other build take turns). A trainer linked to the
// serial build (what Debian's alternatives pick when only libopenblas-serial-dev is installed)
// fails here.
TEST(TrainerModel, LinksOpenBlasPthreadBuild) {
  EXPECT_EQ(openblas_get_parallel(), loom::sdk::blas::kPthreadBuild) << openblas_get_config();
  EXPECT_TRUE(loom::sdk::blas::concurrent_calls_safe());
}

TEST(TrainerModel, DeterministicForSameSeed) {
  lt::ModelConfig cfg;
  cfg.vocab_size = 50;
  cfg.context = 64;
  cfg.layers = 2;
  cfg.heads = 4;
  cfg.dim = 64;
  const int B = 4, T = 64;
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int i = 0; i < B * T; ++i) {
    tok[i] = (i * 13) % 50;
    tgt[i] = (i * 17 + 2) % 50;
  }
  auto run = [&](uint64_t seed, std::vector<float>& grads) {
    lt::Model m(cfg, seed);
    m.zero_grad();
    const float l = m.forward_backward(tok.data(), tgt.data(), B, T);
    grads.assign(m.parameters()[0].grad, m.parameters()[0].grad + m.num_parameters());
    return l;
  };
  std::vector<float> g1, g2, g3;
  const float l1 = run(42, g1), l2 = run(42, g2), l3 = run(43, g3);
  uint32_t b1, b2;
  std::memcpy(&b1, &l1, 4);
  std::memcpy(&b2, &l2, 4);
  EXPECT_EQ(b1, b2);
  EXPECT_EQ(0, std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(float)));
  EXPECT_NE(l1, l3);
}

TEST(TrainerModel, BadInputsThrowClearErrors) {
  auto make = [](lt::ModelConfig c) { lt::Model m(c, 1); };
  lt::ModelConfig c = tiny();
  c.dim = 9;  // not divisible by 2 heads
  EXPECT_THROW(make(c), std::invalid_argument);
  c = tiny();
  c.layers = 0;
  EXPECT_THROW(make(c), std::invalid_argument);
  c = tiny();
  c.vocab_size = -3;
  EXPECT_THROW(make(c), std::invalid_argument);
  lt::Model m(tiny(), 1);
  std::vector<int32_t> tok(10, 1), tgt(10, 2);
  EXPECT_THROW(m.forward_backward(tok.data(), tgt.data(), 1, 7), std::invalid_argument);
  EXPECT_THROW(m.forward_backward(tok.data(), tgt.data(), 0, 5), std::invalid_argument);
  EXPECT_THROW(m.forward_backward(nullptr, tgt.data(), 2, 5), std::invalid_argument);
  tok[3] = 11;
  try {
    m.forward_loss(tok.data(), tgt.data(), 2, 5);
    ADD_FAILURE() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("token 11"), std::string::npos) << e.what();
  }
  tok[3] = 1;
  tgt[9] = -1;
  EXPECT_THROW(m.forward_loss(tok.data(), tgt.data(), 2, 5), std::invalid_argument);
  tgt[9] = 2;
  EXPECT_NO_THROW(m.forward_loss(tok.data(), tgt.data(), 2, 5));
  EXPECT_THROW(m.replace_mlp(2, nullptr), std::invalid_argument);
}

namespace {
// A replacement MLP for the seam test: y = x * W^T (C -> C), no bias.
class LinearMlp final : public lt::Mlp {
 public:
  explicit LinearMlp(int c) : c_(c), w_(static_cast<size_t>(c) * c, 0.01f), g_(w_.size(), 0.f) {}
  void forward(const float* x, float* y, int rows) override {
    ly::matmul_forward<float>(y, x, w_.data(), nullptr, rows, c_, c_);
  }
  void backward(const float* x, const float* dy, float* dx, int rows) override {
    ly::matmul_backward<float>(dx, g_.data(), nullptr, dy, x, w_.data(), rows, c_, c_);
  }
  std::vector<lt::ParamTensor> parameters() override {
    return {{"moe.w", {c_, c_}, w_.data(), g_.data(), w_.size()}};
  }
  double flops_per_token() const override { return 6.0 * c_ * c_; }

 private:
  int c_;
  std::vector<float> w_, g_;
};
}  // namespace

TEST(TrainerModel, MlpSeamReplacesALayersMlp) {
  lt::Model m(tiny(), 1);
  const size_t before = m.num_parameters();
  const double flops_before = m.flops_per_token(5);
  m.replace_mlp(1, std::make_unique<LinearMlp>(8));
  EXPECT_EQ(m.num_parameters(), before - (8 * 32 + 32 + 32 * 8 + 8) + 64);
  EXPECT_NEAR(m.flops_per_token(5), flops_before - 48.0 * 64 + 6.0 * 64, 1e-6);
  bool found = false;
  std::vector<int32_t> tok(10, 1), tgt(10, 2);
  m.zero_grad();
  EXPECT_TRUE(std::isfinite(m.forward_backward(tok.data(), tgt.data(), 2, 5)));
  for (const auto& p : m.parameters()) {
    if (p.name != "moe.w") continue;
    found = true;
    double s = 0;
    for (size_t i = 0; i < p.numel; ++i) s += std::fabs(p.grad[i]);
    EXPECT_GT(s, 0.0);
  }
  EXPECT_TRUE(found);
  m.zero_grad();
  for (const auto& p : m.parameters())
    for (size_t i = 0; i < p.numel; ++i) ASSERT_EQ(p.grad[i], 0.0f) << p.name;
}

TEST(TrainerModel, ThreadCountDefaultsShareCoresAmongLocalRanks) {
  ::unsetenv("LOOM_NUM_THREADS");
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "100000", 1);
  lt::set_num_threads(0);
  EXPECT_EQ(lt::num_threads(), 1);
  ::setenv("LOOM_NUM_THREADS", "3", 1);
  lt::set_num_threads(0);
  EXPECT_EQ(lt::num_threads(), 3);
  lt::set_num_threads(2);
  EXPECT_EQ(lt::num_threads(), 2);
  // Results do not depend on the thread count.
  lt::ModelConfig cfg;
  cfg.vocab_size = 40;
  cfg.context = 64;
  cfg.layers = 1;
  cfg.heads = 2;
  cfg.dim = 64;
  std::vector<int32_t> tok(4 * 64), tgt(4 * 64);
  for (size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<int32_t>(i * 7 % 40);
    tgt[i] = static_cast<int32_t>(i * 3 % 40);
  }
  float losses[2];
  for (int k = 0; k < 2; ++k) {
    lt::set_num_threads(k + 1);
    lt::Model m(cfg, 5);
    losses[k] = m.forward_loss(tok.data(), tgt.data(), 4, 64);
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-6f);
  ::unsetenv("LOOM_NUM_THREADS");
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  lt::set_num_threads(0);
}
