// The routing on the device (routing_cuda.cu) against the host's functions (gating.hpp,
// dispatch.hpp), bit for bit: choices, routes after capacity, combine weights, slots, loads,
// drops, the aux loss and the gate's dlogits, over every drop and noise policy, ties, a
// collapsed gate that overflows one expert's capacity, more tokens than one block ranks at a
// time, and NaN probabilities (an overflowed gate). Skips without a CUDA device (the CUDA
// emulation provides one).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <loom/moe/dispatch.hpp>
#include <loom/moe/gating.hpp>
#include <loom/moe/moe_cuda.hpp>
#include "cuda_support.hpp"
#include "reference.hpp"

namespace {

using loom::moe::DropPolicy;
using loom::moe::GateConfig;
using loom::moe::NoisePolicy;

class MoeRoutingCuda : public moe_test::CudaTest {};
using moe_test::Dev;

struct Case {
  std::string name;
  GateConfig cfg;
  int64_t tokens;
  bool twins;             // every odd token repeats the one before it (equal probabilities)
  float bias_first;       // added to expert 0's score (a large one collapses the gate onto it)
  bool overflow = false;  // every fifth token has an infinite feature (NaN probabilities)
};

// Equal bits, or NaN on both sides (a GPU's NaN payload is not the CPU's).
template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    ASSERT_TRUE(both_nan || std::memcmp(&got[i], &want[i], sizeof(T)) == 0)
        << what << "[" << i << "]: " << got[i] << " vs " << want[i];
  }
}

GateConfig gate(int E, int k, bool training) {
  GateConfig c;
  c.num_experts = E;
  c.k = k;
  c.training = training;
  c.capacity_factor = 0.6;
  c.eval_capacity_factor = 0.8;
  c.min_capacity = 0;
  c.seed = 17;
  c.step = 3;
  c.layer = 2;
  c.first_token = 4096;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"top1_probs", gate(8, 1, true), 300, true, 0.0f});
  Case c = {"top2_position_jitter", gate(6, 2, true), 290, false, 0.0f};
  c.cfg.drop_policy = DropPolicy::Position;
  c.cfg.noise = NoisePolicy::Jitter;
  out.push_back(c);
  c = {"top2_rts_rsample", gate(5, 2, true), 333, true, 0.0f};
  c.cfg.use_rts = true;
  c.cfg.noise = NoisePolicy::RSample;
  out.push_back(c);
  c = {"top1_collapsed_onto_one_expert", gate(4, 1, true), 520, true, 10.0f};
  c.cfg.normalize_top1 = true;
  out.push_back(c);
  c = {"top2_collapsed_rts", gate(4, 2, true), 260, false, 10.0f};
  c.cfg.use_rts = true;
  out.push_back(c);
  c = {"top3_dropless", gate(6, 3, true), 200, true, 0.0f};
  c.cfg.drop_tokens = false;
  out.push_back(c);
  c = {"top2_eval_min_capacity", gate(7, 2, false), 97, false, 0.0f};
  c.cfg.min_capacity = 12;
  c.cfg.noise = NoisePolicy::RSample;  // not applied outside training
  out.push_back(c);
  out.push_back({"no_tokens", gate(4, 2, true), 0, false, 0.0f});
  c = {"top2_probs_with_nan_probabilities", gate(4, 2, true), 300, false, 0.0f, true};
  out.push_back(c);
  c = {"top1_rts_with_nan_probabilities", gate(3, 1, true), 280, false, 0.0f, true};
  c.cfg.use_rts = true;
  out.push_back(c);
  return out;
}

}  // namespace

TEST_F(MoeRoutingCuda, DeviceRoutingIsTheHostRoutingBitForBit) {
  for (const Case& tc : cases()) {
    SCOPED_TRACE(tc.name);
    const GateConfig& cfg = tc.cfg;
    const int E = cfg.num_experts, k = cfg.k;
    const int64_t S = tc.tokens, M = 24;
    auto x = moe_test::random_vec<float>(S * M, 31u, 2.0);
    if (tc.twins) {
      for (int64_t s = 1; s < S; s += 2) {
        std::copy(x.begin() + (s - 1) * M, x.begin() + s * M, x.begin() + s * M);
      }
    }
    if (tc.overflow) {
      for (int64_t s = 0; s < S; s += 5) x[static_cast<size_t>(s * M)] = INFINITY;
    }
    const auto w = moe_test::random_vec<float>(E * M, 32u, 1.5);
    std::vector<float> bias = moe_test::random_vec<float>(E, 33u, 0.05);
    bias[0] += tc.bias_first;

    // host
    std::vector<float> probs(static_cast<size_t>(S * E));
    std::vector<int32_t> choice(static_cast<size_t>(S * k)), route(choice.size());
    std::vector<float> weights(choice.size());
    std::vector<int64_t> slot(choice.size()), counts(static_cast<size_t>(E)), load(counts.size());
    loom::moe::gate_probs<float>(cfg, x.data(), S, M, w.data(), probs.data());
    loom::moe::top_k_choices<float>(cfg, probs.data(), S, bias.data(), choice.data());
    const int64_t capacity = loom::moe::expert_capacity(cfg, S);
    const int64_t dropped = loom::moe::apply_capacity<float>(cfg, probs.data(), choice.data(), S,
                                                             capacity, route.data());
    loom::moe::combine_weights<float>(cfg, probs.data(), route.data(), S, weights.data());
    const double aux = loom::moe::aux_loss<float>(cfg, probs.data(), choice.data(), S);
    const int64_t rows = loom::moe::build_slots(route.data(), S, k, E, counts.data(), slot.data());
    for (const int32_t e : choice) ++load[static_cast<size_t>(e)];
    if (tc.bias_first > 1.0f) {
      EXPECT_GT(dropped, S / 4) << "the collapsed gate overflows its expert";
    }

    // device
    Dev<float> dx(x), dw(w), dbias(bias), dprobs(static_cast<size_t>(S * E));
    Dev<int32_t> dchoice(choice.size()), droute(choice.size());
    Dev<float> dweights(choice.size());
    Dev<int64_t> dslot(choice.size());
    Dev<int64_t> scratch(static_cast<size_t>(loom::moe::cuda::route_scratch_words(E, k, S)));
    loom::moe::cuda::gate_probs(cfg, dx.p, S, M, dw.p, dprobs.p, stream_);
    loom::moe::cuda::RouteSummary sum;
    loom::moe::cuda::route_on_device(
        cfg, dprobs.p, S, dbias.p, capacity,
        loom::moe::cuda::RouteBuffers{dchoice.p, droute.p, dweights.p, dslot.p}, scratch.p, sum,
        stream_);
    if (tc.overflow) {
      EXPECT_TRUE(std::isnan(probs[0])) << "an infinite feature gives NaN probabilities";
    }
    expect_same(dprobs.read(), probs, "probs");
    EXPECT_EQ(dchoice.read(), choice);
    EXPECT_EQ(droute.read(), route);
    expect_same(dweights.read(), weights, "weights");
    EXPECT_EQ(dslot.read(), slot);
    EXPECT_EQ(sum.send_counts, counts);
    EXPECT_EQ(sum.load, load);
    EXPECT_EQ(sum.send_rows, rows);
    EXPECT_EQ(sum.dropped, dropped);
    // summed in the host's order: the same double
    expect_same(std::vector<double>{sum.aux_loss}, std::vector<double>{aux}, "aux");

    // the gate's adjoint from the same routing
    const auto dweight = moe_test::random_vec<float>(S * k, 34u, 1.0);
    std::vector<float> dlogits(static_cast<size_t>(S * E));
    loom::moe::gate_dlogits<float>(cfg, S, probs.data(), choice.data(), route.data(),
                                   dweight.data(), 0.01, dlogits.data());
    Dev<float> ddw(dweight), ddl(static_cast<size_t>(S * E));
    loom::moe::cuda::gate_dlogits(cfg, S, dprobs.p, dchoice.p, droute.p, ddw.p, 0.01, ddl.p,
                                  scratch.p, stream_);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    expect_same(ddl.read(), dlogits, "dlogits");
  }
}

TEST_F(MoeRoutingCuda, SlotsOfACallersRoutingAreBuildSlotsAndABadExpertIsNamed) {
  const int E = 5, k = 2;
  const int64_t S = 301;
  std::vector<int32_t> route(static_cast<size_t>(S * k));
  for (size_t i = 0; i < route.size(); ++i)
    route[i] = static_cast<int32_t>((i * 7 + i / 3) % 6) - 1;
  std::vector<int64_t> counts(static_cast<size_t>(E)), slot(route.size());
  const int64_t rows = loom::moe::build_slots(route.data(), S, k, E, counts.data(), slot.data());
  Dev<int32_t> droute(route);
  Dev<int64_t> dslot(route.size()), scratch(static_cast<size_t>(2 * E + 1));
  const loom::moe::cuda::AloneSlots a =
      loom::moe::cuda::alone_slots(droute.p, S, k, E, dslot.p, scratch.p, stream_);
  EXPECT_EQ(a.bad_pair, -1);
  EXPECT_EQ(a.counts, counts);
  EXPECT_EQ(a.send_rows, rows);
  EXPECT_EQ(dslot.read(), slot);

  route[201] = E;  // token 100, choice 1
  route[415] = -2;
  Dev<int32_t> dbad(route);
  const loom::moe::cuda::AloneSlots b =
      loom::moe::cuda::alone_slots(dbad.p, S, k, E, dslot.p, scratch.p, stream_);
  EXPECT_EQ(b.bad_pair, 201);  // the first one
  EXPECT_EQ(b.bad_value, E);
}
