// The model's distillation terms (linear_hook.hpp): the loss a distilled training forward
// returns is CE + w_logit * soft CE + w_hidden * hidden MSE, computed from their definitions
// here, and the gradient of every tensor matches central differences in double precision;
// an evaluation forward leaves them out.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "gpt.hpp"

namespace lt = loom::trainer;

TEST(TrainerDistillation, LossIsTheWeightedTermsAndItsGradientMatchesFiniteDifferences) {
  const lt::ModelConfig cfg{11, 6, 2, 2, 8};
  lt::Gpt<double> m(cfg, 7), teacher(cfg, 9);
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd(0.0, 0.3);
  for (auto* g : {&m, &teacher})
    for (auto& p : g->parameters())
      for (size_t i = 0; i < p.numel; ++i) p.value[i] += nd(rng);
  const int B = 2, T = 5, N = B * T, V = 11, C = 8;
  std::vector<int32_t> tok(N), tgt(N);
  for (int i = 0; i < N; ++i) {
    tok[i] = static_cast<int32_t>(rng() % 11);
    tgt[i] = static_cast<int32_t>(rng() % 11);
  }
  std::vector<double> tlogits(static_cast<size_t>(N) * V);
  teacher.forward_logits(tok.data(), B, T, tlogits.data());
  std::vector<std::vector<double>> hidden;
  for (int l = 0; l < cfg.layers; ++l)
    hidden.emplace_back(teacher.layer_output(l), teacher.layer_output(l) + N * C);
  lt::DistillationT<double> d;
  d.teacher_logits = tlogits.data();
  d.logit_weight = 0.7;
  d.teacher_hidden = {hidden[0].data(), hidden[1].data()};
  d.hidden_weight = 1.3;
  m.set_distillation(&d);

  // The terms from their definitions, on the student's own logits and hidden states.
  const double ce = m.forward_loss(tok.data(), tgt.data(), B, T, false);  // evaluation: CE only
  std::vector<double> logits(static_cast<size_t>(N) * V);
  m.forward_logits(tok.data(), B, T, logits.data());
  double sce = 0;
  for (int i = 0; i < N; ++i) {
    const double* s = logits.data() + i * V;
    const double* t = tlogits.data() + i * V;
    double smax = s[0], tmax = t[0];
    for (int v = 1; v < V; ++v) smax = std::max(smax, s[v]), tmax = std::max(tmax, t[v]);
    double ssum = 0, tsum = 0;
    for (int v = 0; v < V; ++v) ssum += std::exp(s[v] - smax), tsum += std::exp(t[v] - tmax);
    for (int v = 0; v < V; ++v)
      sce -= std::exp(t[v] - tmax) / tsum * (s[v] - smax - std::log(ssum));
  }
  sce /= N;
  double mse = 0;
  for (int l = 0; l < cfg.layers; ++l) {
    const double* h = m.layer_output(l);
    double acc = 0;
    for (int i = 0; i < N * C; ++i) acc += (h[i] - hidden[l][i]) * (h[i] - hidden[l][i]);
    mse += acc / (N * C);
  }
  mse /= cfg.layers;
  const double total = m.forward_loss(tok.data(), tgt.data(), B, T, true);
  EXPECT_NEAR(m.distillation_terms().ce, ce, 1e-12);
  EXPECT_NEAR(m.distillation_terms().soft_ce, sce, 1e-12);
  EXPECT_NEAR(m.distillation_terms().hidden_mse, mse, 1e-12);
  EXPECT_GT(sce, 0.1);
  EXPECT_GT(mse, 1e-3);
  EXPECT_NEAR(total, ce + 0.7 * sce + 1.3 * mse, 1e-12);

  m.zero_grad();
  m.forward_backward(tok.data(), tgt.data(), B, T);
  std::uniform_int_distribution<size_t> pick;
  size_t checked = 0;
  for (auto& p : m.parameters()) {
    for (int k = 0; k < 6; ++k) {
      const size_t i = pick(rng) % p.numel;
      const double saved = p.value[i];
      constexpr double h = 1e-6;
      p.value[i] = saved + h;
      const double lp = m.forward_loss(tok.data(), tgt.data(), B, T, true);
      p.value[i] = saved - h;
      const double lm = m.forward_loss(tok.data(), tgt.data(), B, T, true);
      p.value[i] = saved;
      const double num = (lp - lm) / (2 * h);
      EXPECT_NEAR(p.grad[i], num, 1e-6 + 1e-5 * std::fabs(num)) << p.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6u * m.parameters().size());
  m.set_distillation(nullptr);
  EXPECT_NEAR(m.forward_loss(tok.data(), tgt.data(), B, T, true), ce, 1e-12);
}
