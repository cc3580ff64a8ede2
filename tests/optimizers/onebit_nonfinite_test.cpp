// The 1-bit optimizers on 2 ranks (mpirun -np 2, ucx transport, onebit codec) with a NaN or an
// Inf in rank 1's local gradient only: every rank skips that step (the ranks agree on the
// flag before anything changes), so the parameters stay identical across ranks, equal a run
// that never saw the step, and training continues. Injected once in warmup and once after
// the freeze (compressed phase; 0/1 Adam: its local steps). With skip_nonfinite = false the
// NaN reaches the parameters, as before.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

struct World {
  loom_session* s = nullptr;
  void* comm = nullptr;
  const loom_comm_v1* vt = nullptr;
  int rank = 0;
  int size = 1;
  explicit World(const std::string& optimizers) {
    const std::string toml =
        "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\nplugin = \"onebit\"\n" + optimizers;
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    if (loom_open_string(toml.c_str(), "onebit_nonfinite.toml", &o, &s) != 0) {
      ADD_FAILURE() << loom_last_error();
      return;
    }
    loom_instance* c = nullptr;
    EXPECT_EQ(loom_find_instance(s, "loom.comm/1", "world", &c), 0);
    comm = loom_instance_object(c);
    vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(c));
    rank = vt->rank(comm);
    size = vt->size(comm);
  }
  ~World() { loom_close(s); }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  loom_instance* opt(const char* name) {
    loom_instance* i = nullptr;
    EXPECT_EQ(loom_find_instance(s, "loom.optimizer/1", name, &i), 0) << loom_last_error();
    return i;
  }
  // x reduced over the ranks with `op` (in place).
  void reduce(std::vector<float>& x, int32_t op) {
    int64_t shape[1] = {static_cast<int64_t>(x.size())};
    DLTensor t{};
    t.data = x.data();
    t.device = {kDLCPU, 0};
    t.ndim = 1;
    t.dtype = {kDLFloat, 32, 1};
    t.shape = shape;
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, op, nullptr, &t, nullptr};
    loom_status* st = vt->allreduce(comm, &a);
    if (st != nullptr) {
      ADD_FAILURE() << st->message;
      st->destroy(st);
    }
  }
  // True when x is bit-identical on every rank (max == min elementwise, and no NaN).
  bool same_on_every_rank(const std::vector<float>& x) {
    std::vector<float> hi = x, lo = x;
    reduce(hi, LOOM_REDUCE_MAX);
    reduce(lo, LOOM_REDUCE_MIN);
    return std::memcmp(hi.data(), x.data(), x.size() * 4) == 0 &&
           std::memcmp(lo.data(), x.data(), x.size() * 4) == 0;
  }
};

std::vector<uint8_t> state(loom_instance* opt) {
  size_t size = 0;
  EXPECT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), 0) << loom_last_error();
  std::vector<uint8_t> buf(size);
  EXPECT_EQ(loom_instance_export_state(opt, buf.data(), buf.size(), &size), 0) << loom_last_error();
  buf.resize(size);
  return buf;
}

uint64_t skipped(loom_instance* opt) {
  loom_optimizer_comm_info ci{};
  ci.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
  EXPECT_EQ(loom_optimizer_get_comm_info(opt, &ci), 0) << loom_last_error();
  return ci.skipped_steps;
}

// Two fp32 tensors (the flat layout of the 1-bit optimizers spans both).
struct Params {
  std::vector<float> a, b;
  explicit Params(uint32_t seed) : a(300), b(77) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    for (auto& x : a) x = d(rng);
    for (auto& x : b) x = d(rng);
  }
  std::vector<float> all() const {
    std::vector<float> out = a;
    out.insert(out.end(), b.begin(), b.end());
    return out;
  }
};

int32_t step(loom_instance* opt, Params& p, std::vector<float>& ga, std::vector<float>& gb,
             int64_t t, int32_t* found_inf) {
  int64_t sa[1] = {static_cast<int64_t>(p.a.size())};
  int64_t sb[1] = {static_cast<int64_t>(p.b.size())};
  auto mk = [](void* data, int64_t* shape) {
    DLTensor x{};
    x.data = data;
    x.device = {kDLCPU, 0};
    x.ndim = 1;
    x.dtype = {kDLFloat, 32, 1};
    x.shape = shape;
    return x;
  };
  DLTensor tpa = mk(p.a.data(), sa), tga = mk(ga.data(), sa);
  DLTensor tpb = mk(p.b.data(), sb), tgb = mk(gb.data(), sb);
  const loom_optimizer_tensor ts[2] = {{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tpa, &tga, nullptr},
                                       {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tpb, &tgb, nullptr}};
  const loom_optimizer_group g{LOOM_OPTIMIZER_GROUP_SIZE, 0, ts, 2, 1.0, NAN};
  loom_optimizer_step_args args{};
  args.struct_size = LOOM_OPTIMIZER_STEP_ARGS_SIZE;
  args.groups = &g;
  args.group_count = 1;
  args.lr = 1e-2;
  args.grad_scale = 2.0;
  args.step = t;
  args.found_inf = found_inf;
  return loom_optimizer_step(opt, &args);
}

struct Variant {
  const char* plugin;
  const char* params;  // the schedule: a warmup of 3 steps
  // The last step after which every rank holds the same parameters (0/1 Adam's local steps
  // after its variance freeze leave them rank-local between syncs); 0: every step.
  int same_until = 0;
};

class OnebitNonfinite : public ::testing::TestWithParam<Variant> {};

TEST_P(OnebitNonfinite, NonfiniteOnOneRankSkipsTheStepOnEveryRank) {
  const Variant v = GetParam();
  const std::string common = std::string("plugin = \"") + v.plugin +
                             "\"\ncomm = \"world\"\ncodec = \"onebit\"\n" + v.params;
  World w("[optimizer.a]\n" + common + "[optimizer.b]\n" + common + "[optimizer.off]\n" + common +
          "skip_nonfinite = false\n");
  ASSERT_NE(w.s, nullptr);
  ASSERT_EQ(w.size, 2) << "run under mpirun -np 2";
  loom_instance* a = w.opt("a");      // sees the bad steps
  loom_instance* b = w.opt("b");      // never sees them
  loom_instance* off = w.opt("off");  // sees the first one, without the check
  Params pa(1), pb(1), poff(1);       // the same start on every rank
  std::mt19937 rng(50 + w.rank);      // local gradients differ per rank
  std::normal_distribution<float> d;
  const int kSteps = 14;
  const int kWarmBad = 2;  // in warmup
  const int kLateBad = 7;  // after the freeze
  int64_t tb = 0;          // b's own step count
  for (int t = 1; t <= kSteps; ++t) {
    SCOPED_TRACE("step " + std::to_string(t) + " rank " + std::to_string(w.rank));
    std::vector<float> ga(pa.a.size()), gb(pa.b.size());
    for (auto& x : ga) x = d(rng);
    for (auto& x : gb) x = d(rng);
    const bool bad = t == kWarmBad || t == kLateBad;
    if (!bad) {
      std::vector<float> ca = ga, cb = gb;
      ASSERT_EQ(step(b, pb, ca, cb, ++tb, nullptr), 0) << loom_last_error();
    }
    if (bad && w.rank == 1) {
      // Rank 1 only: a NaN in warmup, an Inf after the freeze, in the second tensor.
      gb[40] = t == kWarmBad ? std::numeric_limits<float>::quiet_NaN()
                             : std::numeric_limits<float>::infinity();
    }
    const auto before = pa.all();
    const auto s_before = state(a);
    int32_t found = -1;
    std::vector<float> ca = ga, cb = gb;
    ASSERT_EQ(step(a, pa, ca, cb, t, &found), 0) << loom_last_error();
    EXPECT_EQ(found, bad ? 1 : 0);
    if (bad) {
      EXPECT_EQ(pa.all(), before) << "a skipped step changed the parameters";
      EXPECT_EQ(state(a), s_before) << "a skipped step changed the state";
    }
    if (v.same_until == 0 || t <= v.same_until) {
      EXPECT_TRUE(w.same_on_every_rank(pa.all())) << "the ranks diverged";
    }
    EXPECT_EQ(pa.all(), pb.all()) << "differs from the run that never saw the bad steps";
    if (t <= kWarmBad) {
      // The opt-out, up to the first bad step: the NaN spreads with the warmup average.
      found = -1;
      ASSERT_EQ(step(off, poff, ga, gb, t, &found), 0) << loom_last_error();
      EXPECT_EQ(found, 0);
      if (t == kWarmBad) {
        EXPECT_TRUE(std::isnan(poff.b[40])) << "skip_nonfinite = false";
        EXPECT_EQ(skipped(off), 0u);
      }
    }
  }
  EXPECT_EQ(state(a), state(b));
  EXPECT_EQ(skipped(a), 2u);
  EXPECT_EQ(skipped(b), 0u);
  for (const float x : pa.all()) ASSERT_TRUE(std::isfinite(x));
  EXPECT_NE(pa.all(), Params(1).all()) << "training went on";
}

INSTANTIATE_TEST_SUITE_P(
    Variants, OnebitNonfinite,
    ::testing::Values(
        Variant{"onebit_adam", "freeze_step = 3\n"},
        Variant{"zero_one_adam",
                "var_freeze_step = 3\nlocal_step_scaler = 4\nlocal_step_clipper = 4\n", 3},
        Variant{"onebit_lamb", "freeze_step = 3\n"}),
    [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.plugin); });

}  // namespace
