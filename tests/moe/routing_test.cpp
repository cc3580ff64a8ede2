// The MoE routing against a plain reference (reference.hpp) on fixed logits: top-1/2/3, ties,
// capacity and drop order, RTS, dropless, eval determinism, aux loss, the bias update.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <loom/sdk/random.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <loom/moe/gating.hpp>
#include <loom/moe/moe_math.hpp>
#include "reference.hpp"
#include "simd.hpp"

using loom::moe::DropPolicy;
using loom::moe::GateConfig;
using loom::moe::NoisePolicy;
using loom::moe::RouteOut;

namespace {

struct Routed {
  std::vector<float> probs, weights;
  std::vector<int32_t> choice, route;
  std::vector<int64_t> load;
  int64_t dropped = 0, capacity = 0;
  double aux = 0.0;
};

// Routes S tokens whose gate logits are exactly `logits` (x = logits, gate_w = identity).
Routed route(const GateConfig& cfg, const std::vector<float>& logits, int64_t S,
             const std::vector<float>& bias = {}) {
  const int E = cfg.num_experts;
  std::vector<float> eye(static_cast<size_t>(E * E), 0.0f);
  for (int e = 0; e < E; ++e) eye[static_cast<size_t>(e * E + e)] = 1.0f;
  Routed r;
  r.probs.resize(static_cast<size_t>(S * E));
  r.choice.resize(static_cast<size_t>(S * cfg.k));
  r.route.resize(static_cast<size_t>(S * cfg.k));
  r.weights.resize(static_cast<size_t>(S * cfg.k));
  r.load.resize(static_cast<size_t>(E));
  RouteOut<float> out;
  out.probs = r.probs.data();
  out.choice = r.choice.data();
  out.route = r.route.data();
  out.weights = r.weights.data();
  out.load = r.load.data();
  loom::moe::route_tokens<float>(cfg, logits.data(), S, E, eye.data(),
                                 bias.empty() ? nullptr : bias.data(), out);
  r.dropped = out.dropped;
  r.capacity = out.capacity;
  r.aux = out.aux_loss;
  return r;
}

std::vector<uint32_t> rts_keys(const GateConfig& cfg, int64_t S) {
  std::vector<uint32_t> keys(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    const loom::sdk::CounterRng rng(cfg.seed, cfg.step, cfg.layer,
                                    static_cast<uint32_t>(cfg.first_token + s),
                                    loom::moe::kPurposeRts);
    keys[static_cast<size_t>(s)] = rng.word(0);
  }
  return keys;
}

void expect_matches_reference(const GateConfig& cfg, const std::vector<float>& logits, int64_t S,
                              const std::vector<float>& bias = {}) {
  const Routed r = route(cfg, logits, S, bias);
  const int E = cfg.num_experts;
  // probabilities are the softmax of the logits
  for (int64_t s = 0; s < S; ++s) {
    double mx = -1e30, sum = 0.0;
    for (int e = 0; e < E; ++e) mx = std::max(mx, double{logits[static_cast<size_t>(s * E + e)]});
    for (int e = 0; e < E; ++e) sum += std::exp(logits[static_cast<size_t>(s * E + e)] - mx);
    for (int e = 0; e < E; ++e) {
      const double want = std::exp(logits[static_cast<size_t>(s * E + e)] - mx) / sum;
      ASSERT_NEAR(r.probs[static_cast<size_t>(s * E + e)], want, 2e-7 + 4e-7 * want);
    }
  }
  const moe_test::RefRoute ref = moe_test::reference_route(cfg, r.probs, S, bias, rts_keys(cfg, S));
  ASSERT_EQ(r.choice, ref.choice);
  ASSERT_EQ(r.route, ref.route);
  EXPECT_EQ(r.dropped, ref.dropped);
  if (cfg.drop_tokens) {
    EXPECT_EQ(r.capacity, ref.capacity);
  }
  for (size_t i = 0; i < r.weights.size(); ++i) EXPECT_NEAR(r.weights[i], ref.weights[i], 1e-7);
}

GateConfig base(int E, int k) {
  GateConfig c;
  c.num_experts = E;
  c.k = k;
  c.min_capacity = 0;
  return c;
}

}  // namespace

TEST(MoeRouting, TopKTiesGoToTheLowerIndex) {
  GateConfig c = base(4, 3);
  c.drop_tokens = false;
  // token 0: experts 1 and 3 tie for first, 0 and 2 for third; token 1: all equal
  const std::vector<float> logits = {0.5f, 2.0f, 0.5f, 2.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const Routed r = route(c, logits, 2);
  EXPECT_EQ(r.choice, (std::vector<int32_t>{1, 3, 0, 0, 1, 2}));
  expect_matches_reference(c, logits, 2);
}

TEST(MoeRouting, TopOneTwoThreeMatchTheReference) {
  for (int k : {1, 2, 3}) {
    for (DropPolicy policy : {DropPolicy::Probs, DropPolicy::Position}) {
      for (double f : {0.5, 1.0, 1.25}) {
        GateConfig c = base(5, k);
        c.capacity_factor = f;
        c.eval_capacity_factor = f;
        c.drop_policy = policy;
        const int64_t S = 37;
        const auto logits = moe_test::random_vec<float>(static_cast<size_t>(S * 5), 11u + k, 3.0);
        SCOPED_TRACE(testing::Message()
                     << "k " << k << " policy " << static_cast<int>(policy) << " f " << f);
        expect_matches_reference(c, logits, S);
      }
    }
  }
}

TEST(MoeRouting, CapacityDropsLaterChoicesFirstThenByProbability) {
  // E = 2, k = 2, S = 3: every token chooses both experts; C = ceil(2 * 0.5 * 3 / 2) = 2.
  GateConfig c = base(2, 2);
  c.capacity_factor = 0.5;
  c.eval_capacity_factor = 0.5;
  // token 0 prefers expert 0 (p0 ~ 0.73), token 1 prefers expert 1 strongly, token 2 prefers 0
  // weakly (p0 ~ 0.55)
  const std::vector<float> logits = {1.0f, 0.0f, 0.0f, 3.0f, 0.2f, 0.0f};
  Routed r = route(c, logits, 3);
  EXPECT_EQ(r.capacity, 2);
  EXPECT_EQ(r.choice, (std::vector<int32_t>{0, 1, 1, 0, 0, 1}));
  // Expert 0: first choices of tokens 0 and 2 fill it; token 1's second choice is dropped.
  // Expert 1: token 1's first choice, then second choices of 0 (p1 ~ 0.27) and 2 (p1 ~ 0.45):
  // by probability, token 2's second choice stays and token 0's is dropped.
  EXPECT_EQ(r.route, (std::vector<int32_t>{0, -1, 1, -1, 0, 1}));
  EXPECT_EQ(r.dropped, 2);
  // token 0 and token 1 kept only one choice: renormalised to 1
  EXPECT_FLOAT_EQ(r.weights[0], 1.0f);
  EXPECT_FLOAT_EQ(r.weights[2], 1.0f);
  EXPECT_NEAR(r.weights[4] + r.weights[5], 1.0f, 1e-6);
  // position policy: the earlier token 0 keeps its second choice instead
  c.drop_policy = DropPolicy::Position;
  r = route(c, logits, 3);
  EXPECT_EQ(r.route, (std::vector<int32_t>{0, 1, 1, -1, 0, -1}));
  expect_matches_reference(c, logits, 3);
}

TEST(MoeRouting, CapacityIsCappedAtTheTokensAndHonoursTheMinimum) {
  GateConfig c = base(4, 2);
  c.min_capacity = 100;
  EXPECT_EQ(loom::moe::expert_capacity(c, 10), 10);
  c.min_capacity = 3;
  c.capacity_factor = 1.0;
  c.training = true;
  EXPECT_EQ(loom::moe::expert_capacity(c, 10), 5);  // ceil(2 * 10 / 4)
  c.training = false;
  c.eval_capacity_factor = 0.1;
  EXPECT_EQ(loom::moe::expert_capacity(c, 10), 3);  // the minimum
  c.drop_tokens = false;
  EXPECT_EQ(loom::moe::expert_capacity(c, 10), 0);
}

TEST(MoeRouting, RandomTokenSelectionIsSeededAndDeterministic) {
  GateConfig c = base(3, 1);
  c.training = true;
  c.use_rts = true;
  c.capacity_factor = 0.5;
  c.seed = 1234;
  c.step = 7;
  const int64_t S = 48;
  const auto logits = moe_test::random_vec<float>(static_cast<size_t>(S * 3), 5u, 2.0);
  const Routed a = route(c, logits, S);
  const Routed b = route(c, logits, S);
  EXPECT_EQ(a.route, b.route);
  EXPECT_GT(a.dropped, 0);
  expect_matches_reference(c, logits, S);
  GateConfig other = c;
  other.seed = 99;
  const Routed d = route(other, logits, S);
  EXPECT_EQ(d.choice, a.choice);
  EXPECT_NE(d.route, a.route);  // another seed keeps other tokens
  expect_matches_reference(other, logits, S);
  // not random in eval: the policy decides
  GateConfig eval = c;
  eval.training = false;
  eval.eval_capacity_factor = 0.5;
  GateConfig probs = eval;
  probs.use_rts = false;
  EXPECT_EQ(route(eval, logits, S).route, route(probs, logits, S).route);
}

TEST(MoeRouting, DroplessKeepsEveryChoiceForAnyK) {
  for (int k : {1, 2, 3}) {
    GateConfig c = base(4, k);
    c.drop_tokens = false;
    const int64_t S = 21;
    const auto logits = moe_test::random_vec<float>(static_cast<size_t>(S * 4), 3u + k, 4.0);
    const Routed r = route(c, logits, S);
    EXPECT_EQ(r.dropped, 0);
    EXPECT_EQ(r.route, r.choice);
    if (k >= 2) {
      for (int64_t s = 0; s < S; ++s) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += r.weights[static_cast<size_t>(s * k + j)];
        EXPECT_NEAR(sum, 1.0f, 1e-6);
      }
    }
    expect_matches_reference(c, logits, S);
  }
}

TEST(MoeRouting, EvalIsDeterministicAndNoiseOnlyActsInTraining) {
  GateConfig c = base(6, 2);
  c.noise = NoisePolicy::RSample;
  c.use_rts = true;
  c.seed = 1;
  const int64_t S = 40;
  const auto logits = moe_test::random_vec<float>(static_cast<size_t>(S * 6), 17u, 1.0);
  const Routed a = route(c, logits, S);
  c.seed = 2;
  c.step = 3;
  const Routed b = route(c, logits, S);
  EXPECT_EQ(a.route, b.route);
  EXPECT_EQ(a.weights, b.weights);
  c.noise = NoisePolicy::None;
  c.use_rts = false;
  EXPECT_EQ(route(c, logits, S).route, a.route);
  // in training, Gumbel noise changes some choices, and the same seed repeats them
  c.noise = NoisePolicy::RSample;
  c.training = true;
  c.drop_tokens = false;
  const Routed n1 = route(c, logits, S);
  const Routed n2 = route(c, logits, S);
  EXPECT_EQ(n1.choice, n2.choice);
  EXPECT_NE(n1.choice, a.choice);
  // the noise moves the choice, never the weights' probabilities
  for (int64_t s = 0; s < S; ++s) {
    for (int j = 0; j < 2; ++j) {
      const int e = n1.route[static_cast<size_t>(s * 2 + j)];
      const float p = n1.probs[static_cast<size_t>(s * 6 + e)];
      const int o = n1.route[static_cast<size_t>(s * 2 + 1 - j)];
      const float q = n1.probs[static_cast<size_t>(s * 6 + o)];
      EXPECT_NEAR(n1.weights[static_cast<size_t>(s * 2 + j)], p / (p + q), 1e-6);
    }
  }
}

TEST(MoeRouting, JitterChangesTheLogitsOnlyInTraining) {
  GateConfig c = base(4, 1);
  c.noise = NoisePolicy::Jitter;
  c.jitter_eps = 0.2f;
  c.drop_tokens = false;
  const int64_t S = 16;
  const auto logits = moe_test::random_vec<float>(static_cast<size_t>(S * 4), 23u, 1.0);
  const Routed eval = route(c, logits, S);
  GateConfig plain = c;
  plain.noise = NoisePolicy::None;
  EXPECT_EQ(eval.probs, route(plain, logits, S).probs);
  c.training = true;
  const Routed t = route(c, logits, S);
  EXPECT_NE(t.probs, eval.probs);
  EXPECT_EQ(t.probs, route(c, logits, S).probs);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t m = 0; m < 4; ++m) {
      const float f = loom::moe::jitter_at(c, s, m);
      EXPECT_GE(f, 0.8f);
      EXPECT_LE(f, 1.2f);
    }
  }
}

TEST(MoeRouting, AuxLossIsOneWhenUniformAndMatchesTheFormula) {
  GateConfig c = base(4, 1);
  c.drop_tokens = false;
  // every token: equal logits -> p = 1/4, all choose expert 0: E * (1/4 * 1) = 1
  EXPECT_NEAR(route(c, std::vector<float>(8 * 4, 0.5f), 8).aux, 1.0, 1e-6);
  for (int k : {1, 2, 3}) {
    c.k = k;
    const int64_t S = 30;
    const auto logits = moe_test::random_vec<float>(static_cast<size_t>(S * 4), 31u + k, 2.0);
    const Routed r = route(c, logits, S);
    double want = 0.0;
    for (int e = 0; e < 4; ++e) {
      double me = 0.0, ce = 0.0;
      for (int64_t s = 0; s < S; ++s) {
        me += r.probs[static_cast<size_t>(s * 4 + e)] / static_cast<double>(S);
        const int counted = k <= 2 ? 1 : k;
        for (int j = 0; j < counted; ++j) {
          if (r.choice[static_cast<size_t>(s * k + j)] == e) ce += 1.0 / (S * counted);
        }
      }
      want += me * ce;
    }
    EXPECT_NEAR(r.aux, 4.0 * want, 1e-9) << "k " << k;
    int64_t total = 0;
    for (int64_t v : r.load) total += v;
    EXPECT_EQ(total, S * k);
  }
}

TEST(MoeRouting, BiasMovesTheChoiceNotTheWeightsAndUpdatesBySign) {
  GateConfig c = base(3, 1);
  c.drop_tokens = false;
  const std::vector<float> logits = {1.0f, 0.9f, 0.0f};
  EXPECT_EQ(route(c, logits, 1).choice[0], 0);
  const std::vector<float> bias = {0.0f, 0.1f, 0.0f};
  const Routed r = route(c, logits, 1, bias);
  EXPECT_EQ(r.choice[0], 1);
  EXPECT_FLOAT_EQ(r.weights[0], r.probs[1]);
  expect_matches_reference(c, logits, 1, bias);
  std::vector<float> b = {0.0f, 0.0f, 0.0f};
  const std::vector<int64_t> load = {5, 1, 3};  // mean 3
  loom::moe::update_expert_bias(b.data(), load.data(), 3, 0.25);
  EXPECT_EQ(b, (std::vector<float>{-0.25f, 0.25f, 0.0f}));
}

// Runs body once per Highway target compiled in and supported by this CPU.
template <class Body>
void for_each_target(Body&& body) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
}

// The blocked, vectorised gate against the plain formulation it replaced, bit for bit, on
// every target: each logit one sum in feature order from 0 (product and sum rounded apart),
// softmax with exp_fixed. Shapes cover a short last token block, experts not a multiple of
// the lane width, one expert, more experts than one vector, and jitter.
TEST(MoeRouting, BlockedGateIsBitIdenticalToThePlainLoop) {
  for_each_target([] {
    struct Shape {
      int64_t S, M;
      int E;
      bool jitter;
    };
    for (const Shape sh : {Shape{7, 37, 5, false}, Shape{13, 64, 16, true}, Shape{3, 9, 1, false},
                           Shape{9, 20, 23, true}, Shape{17, 33, 40, false}}) {
      GateConfig cfg;
      cfg.num_experts = sh.E;
      cfg.k = 1;
      cfg.training = sh.jitter;
      cfg.noise = sh.jitter ? NoisePolicy::Jitter : NoisePolicy::None;
      cfg.jitter_eps = 0.05f;
      cfg.seed = 3;
      cfg.step = 2;
      std::vector<float> x(static_cast<size_t>(sh.S * sh.M)), w(static_cast<size_t>(sh.E * sh.M));
      uint32_t h = 12345;
      auto next = [&h] {
        h = h * 1664525u + 1013904223u;
        return static_cast<float>(static_cast<int32_t>(h >> 8) - (1 << 23)) / float(1 << 22);
      };
      for (float& v : x) v = next();
      for (float& v : w) v = next();
      x[3] = -0.0f;  // a signed zero in the input
      std::vector<float> got(static_cast<size_t>(sh.S * sh.E));
      loom::moe::gate_probs<float>(cfg, x.data(), sh.S, sh.M, w.data(), got.data());
      for (int64_t s = 0; s < sh.S; ++s) {
        std::vector<float> lg(static_cast<size_t>(sh.E));
        float mx = -INFINITY;
        for (int e = 0; e < sh.E; ++e) {
          float acc = 0.0f;
          for (int64_t m = 0; m < sh.M; ++m) {
            float xm = x[static_cast<size_t>(s * sh.M + m)];
            if (sh.jitter) xm = xm * loom::moe::jitter_at(cfg, s, m);
            const float p = xm * w[static_cast<size_t>(e * sh.M + m)];
            acc = acc + p;
          }
          lg[static_cast<size_t>(e)] = acc;
          mx = std::max(mx, acc);
        }
        float sum = 0.0f;
        for (int e = 0; e < sh.E; ++e) {
          lg[static_cast<size_t>(e)] = loom::moe::exp_fixed(lg[static_cast<size_t>(e)] - mx);
          sum = sum + lg[static_cast<size_t>(e)];
        }
        for (int e = 0; e < sh.E; ++e) {
          const float want = lg[static_cast<size_t>(e)] / sum;
          const float have = got[static_cast<size_t>(s * sh.E + e)];
          ASSERT_EQ(std::memcmp(&want, &have, sizeof want), 0)
              << "S " << sh.S << " M " << sh.M << " E " << sh.E << ": token " << s << " expert "
              << e << ": " << have << " vs " << want;
        }
      }
    }
  });
}

// The vector GELU (tanh approximation) and its derivative against the libm formula
// (act_forward / act_grad) on every target, over a dense range, the large |x| tails where
// the formula saturates, zeros and a short tail: within 1e-6 * max(1, |x|) for the value and
// 1e-6 for the derivative (a few ulp of float at the sizes involved).
TEST(MoeExperts, VectorGeluMatchesTheLibmFormula) {
  std::vector<float> x;
  for (int i = -4000; i <= 4000; ++i) x.push_back(static_cast<float>(i) * 0.0025f);  // [-10, 10]
  for (float v : {0.0f,  -0.0f,  1e-30f, -1e-30f, 9.99f, 10.0f, 10.01f, -9.99f, -10.0f, -10.01f,
                  15.0f, -15.0f, 30.0f,  -30.0f,  1e3f,  -1e3f, 1e6f,   -1e6f,  3e12f,  -3e12f}) {
    x.push_back(v);
  }
  x.push_back(0.5f);  // an odd count: a partial last vector
  const auto n = static_cast<int64_t>(x.size());
  for_each_target([&] {
    std::vector<float> y(x.size()), g(x.size()), dy(x.size(), 2.0f);
    loom::moe::simd::gelu_forward(x.data(), y.data(), n);
    loom::moe::simd::gelu_slope(x.data(), g.data(), n);
    loom::moe::simd::gelu_grad_mul(x.data(), dy.data(), n);
    const auto gelu = loom::moe::Activation::Gelu;
    for (size_t i = 0; i < x.size(); ++i) {
      const float want = loom::moe::act_forward(gelu, x[i]);
      const float want_g = loom::moe::act_grad(gelu, x[i]);
      ASSERT_LE(std::fabs(y[i] - want), 1e-6f * std::max(1.0f, std::fabs(x[i])))
          << "gelu(" << x[i] << ") = " << y[i] << ", libm " << want;
      ASSERT_LE(std::fabs(g[i] - want_g), 1e-6f)
          << "gelu'(" << x[i] << ") = " << g[i] << ", libm " << want_g;
      ASSERT_EQ(dy[i], 2.0f * g[i]) << "gelu_grad_mul at " << x[i];
    }
    EXPECT_EQ(y[static_cast<size_t>(4000)], 0.0f);   // gelu(0)
    EXPECT_EQ(g[static_cast<size_t>(4000)], 0.5f);   // gelu'(0)
    EXPECT_EQ(y[static_cast<size_t>(8000)], 10.0f);  // saturated: gelu(10) = 10 in float
  });
}

// exp_fixed's library-free host twin (the gate's softmax) against exp_fixed itself over the
// softmax's range and its edges.
TEST(MoeRouting, FastExpMatchesExpFixedBitForBit) {
  GateConfig cfg;
  cfg.num_experts = 2;
  cfg.k = 1;
  // logits (0, d): the second probability is exp(-|d|) / (1 + exp(-|d|)) computed by the gate
  std::vector<float> ds;
  for (float d = 0.0f; d < 100.0f; d += 0.0137f) ds.push_back(d);
  for (float d : {86.99f, 87.0f, 87.01f, 1e-30f, 3.4e38f}) ds.push_back(d);
  for (const float d : ds) {
    const float x[2] = {0.0f, -d};
    const float eye[4] = {1.0f, 0.0f, 0.0f, 1.0f};
    float p[2];
    loom::moe::gate_probs<float>(cfg, x, 1, 2, eye, p);
    const float e1 = loom::moe::exp_fixed(-d);
    const float sum = 1.0f + e1;
    const float want[2] = {1.0f / sum, e1 / sum};
    ASSERT_EQ(std::memcmp(want, p, sizeof p), 0) << "d " << d << ": " << p[1] << " vs " << want[1];
  }
}

// RSample is the Gumbel-max trick on the log-probabilities: the first choice is a sample of
// p, so over many tokens with the same gate the choice frequencies follow p (4 000 tokens:
// a standard deviation under 0.008 per expert; the bound is 0.03). Noise added to p itself
// would flatten them towards uniform (about 0.31 for the 0.5 expert here).
TEST(MoeRouting, RSampleChoicesFollowTheProbabilities) {
  GateConfig c = base(4, 1);
  c.noise = NoisePolicy::RSample;
  c.training = true;
  c.drop_tokens = false;
  c.seed = 11;
  c.step = 2;
  const std::vector<float> want = {0.5f, 0.25f, 0.15f, 0.10f};
  const int64_t S = 4000;
  std::vector<float> logits(static_cast<size_t>(S * 4));
  for (int64_t s = 0; s < S; ++s) {
    for (int e = 0; e < 4; ++e) logits[static_cast<size_t>(s * 4 + e)] = std::log(want[e]);
  }
  const Routed r = route(c, logits, S);
  std::vector<int64_t> count(4, 0);
  for (int32_t e : r.choice) ++count[static_cast<size_t>(e)];
  for (int e = 0; e < 4; ++e) {
    const double f = static_cast<double>(count[static_cast<size_t>(e)]) / static_cast<double>(S);
    EXPECT_NEAR(f, want[static_cast<size_t>(e)], 0.03) << "expert " << e;
  }
}
