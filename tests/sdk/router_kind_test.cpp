// The SDK's table for loom.router/1, in process: the entries a class gets (backward only for
// a learned router), the flags the table sets, and every check made before the class is
// called (scalars, shapes, dtypes, devices and buffers against the plan; a plan's kept out of
// range is the plugin's bug). The suite is SdkKinds, so scripts/test.sh's sanitizer pass runs
// these with the other kinds' tables.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/router.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace {

using loom::sdk::Context;

// ---- classes

// A random-style router: keeps the last min(4, seq_len) positions of every sequence, asks for
// 64 bytes of workspace, copies fp32 tokens on the host. Counts the calls that reach it.
class LastFour : public loom::sdk::Router {
 public:
  explicit LastFour(Context& /*ctx*/) {}
  void plan(loom_router_plan_args& a) {
    a.kept = a.seq_len < 4 ? a.seq_len : 4;
    a.workspace_bytes = 64;
    a.flags = 0xf0;  // overwritten by the table
  }
  void select(const loom_router_select_args& a) {
    ++selects;
    const int64_t kept = a.seq_len < 4 ? a.seq_len : 4;
    auto* idx = loom::sdk::data_as<int32_t>(*a.indices);
    for (int64_t b = 0; b < a.batch; ++b) {
      for (int64_t j = 0; j < kept; ++j) {
        idx[b * kept + j] = static_cast<int32_t>(a.seq_len - kept + j);
      }
    }
  }
  void gather(const loom::sdk::RouterMove& m) {
    ++moves;
    for (int64_t b = 0; b < m.batch; ++b) {
      for (int64_t j = 0; j < m.kept_count; ++j) {
        for (int64_t c = 0; c < m.channels; ++c) {
          kept_at(m, b, j)[c] = full_at(m, b, m.indices[b * m.kept_count + j])[c];
        }
      }
    }
  }
  void scatter(const loom::sdk::RouterMove& m) {
    ++moves;
    for (int64_t b = 0; b < m.batch; ++b) {
      for (int64_t j = 0; j < m.kept_count; ++j) {
        for (int64_t c = 0; c < m.channels; ++c) {
          full_at(m, b, m.indices[b * m.kept_count + j])[c] = kept_at(m, b, j)[c];
        }
      }
    }
  }
  void advance(loom_router_advance_args& a) {
    const int64_t kept = a.seq_len < 4 ? a.seq_len : 4;
    a.layer_tokens = a.batch * kept * a.num_layers;
    consumed_ += static_cast<uint64_t>(a.layer_tokens);
    a.consumed_layer_tokens = consumed_;
  }

  int selects = 0;
  int moves = 0;

 private:
  static float* full_at(const loom::sdk::RouterMove& m, int64_t b, int64_t p) {
    return static_cast<float*>(m.full.data) + b * m.full.batch_stride + p * m.full.position_stride;
  }
  static float* kept_at(const loom::sdk::RouterMove& m, int64_t b, int64_t j) {
    return static_cast<float*>(m.kept.data) + b * m.kept.batch_stride + j * m.kept.position_stride;
  }
  uint64_t consumed_ = 0;
};

// A learned router: keeps the first half (at least 1), gates 0.5, saves one double per kept
// token. Counts the calls that reach it.
class HalfLearned : public loom::sdk::Router {
 public:
  explicit HalfLearned(Context& /*ctx*/) {}
  static int64_t kept_of(int64_t seq_len) { return seq_len / 2 > 0 ? seq_len / 2 : 1; }
  void plan(loom_router_plan_args& a) {
    a.kept = kept_of(a.seq_len);
    a.saved_bytes = static_cast<uint64_t>(a.batch * a.kept) * sizeof(double);
  }
  void select(const loom_router_select_args& a) {
    ++selects;
    const int64_t kept = kept_of(a.seq_len);
    auto* idx = loom::sdk::data_as<int32_t>(*a.indices);
    auto* g = loom::sdk::data_as<float>(*a.gates);
    for (int64_t i = 0; i < a.batch * kept; ++i) {
      idx[i] = static_cast<int32_t>(i % kept);
      g[i] = 0.5F;
    }
  }
  void gather(const loom::sdk::RouterMove& /*m*/) {}
  void scatter(const loom::sdk::RouterMove& /*m*/) {}
  void advance(loom_router_advance_args& a) { a.layer_tokens = 1; }
  void backward(const loom_router_backward_args& /*a*/) { ++backwards; }

  int selects = 0;
  int backwards = 0;
};

// A plan outside 1 .. seq_len: kept = seq_len + shift.
template <int Shift>
class BadPlan : public loom::sdk::Router {
 public:
  explicit BadPlan(Context& /*ctx*/) {}
  void plan(loom_router_plan_args& a) { a.kept = Shift <= 0 ? -Shift : a.seq_len + Shift; }
  void select(const loom_router_select_args& /*a*/) {}
  void gather(const loom::sdk::RouterMove& /*m*/) {}
  void scatter(const loom::sdk::RouterMove& /*m*/) {}
  void advance(loom_router_advance_args& /*a*/) {}
};

// ---- an in-process instance through its factory, as a host makes it

template <class T>
class Instance {
 public:
  explicit Instance(uint16_t minor = LOOM_ABI_MINOR,
                    uint32_t services_size = LOOM_HOST_SERVICES_SIZE) {
    factory_ = loom::sdk::factory<T>()();
    svc_.struct_size = services_size;
    svc_.abi_major = LOOM_ABI_MAJOR;
    svc_.abi_minor = minor;
    svc_.instance_name = "test";
    loom_status* st = factory_->create(&svc_, &obj_);
    if (st != nullptr) {
      ADD_FAILURE() << st->message;
      st->destroy(st);
    }
  }
  ~Instance() {
    if (obj_ != nullptr) factory_->destroy(obj_);
  }
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;

  const loom_factory* factory() const { return factory_; }
  void* object() const { return obj_; }
  const loom_router_v1* table() const {
    return static_cast<const loom_router_v1*>(factory_->vtable);
  }
  // The class object behind the instance (the SDK's wrapper keeps it first).
  T& cls() const { return loom::sdk::detail::shared_object<T>(obj_); }

 private:
  const loom_factory* factory_ = nullptr;
  loom_host_services svc_{};
  void* obj_ = nullptr;
};

std::string take(loom_status* st, int32_t* code = nullptr) {
  if (code != nullptr) *code = st == nullptr ? LOOM_OK : st->code;
  if (st == nullptr) return "";
  std::string m = st->message;
  st->destroy(st);
  return m;
}

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kF64{kDLFloat, 64, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDevice kCpu{kDLCPU, 0};

// A host tensor over a vector with its own shape (and optional strides).
template <class E>
struct Tensor {
  Tensor(std::vector<int64_t> dims, DLDataType dtype = DLDataType{}) : shape(std::move(dims)) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    data.assign(static_cast<size_t>(n), E{});
    t.data = data.data();
    t.device = kCpu;
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dtype.bits != 0 ? dtype : DLDataType{kDLFloat, 32, 1};
    t.shape = shape.data();
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  std::vector<int64_t> shape;
  std::vector<E> data;
  DLTensor t{};
};

// 256-byte aligned scratch for saved and workspace.
struct alignas(256) Scratch {
  unsigned char bytes[1024];
};

loom_router_plan_args plan_args(int64_t batch, int64_t seq_len, int64_t channels = 2,
                                int64_t step = 1, int32_t layer = 0, int32_t num_layers = 3) {
  loom_router_plan_args p{};
  p.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
  p.batch = batch;
  p.seq_len = seq_len;
  p.channels = channels;
  p.step = step;
  p.layer = layer;
  p.num_layers = num_layers;
  p.training = 1;
  p.dtype = kF32;
  return p;
}

loom_router_select_args select_args(int64_t batch, int64_t seq_len, int64_t channels) {
  loom_router_select_args s{};
  s.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
  s.seed = 7;
  s.step = 1;
  s.batch = batch;
  s.seq_len = seq_len;
  s.channels = channels;
  s.layer = 1;
  s.num_layers = 3;
  s.training = 1;
  return s;
}

// ---- tests

TEST(SdkKinds, RouterTableHasBackwardOnlyForALearnedClass) {
  Instance<LastFour> r;
  EXPECT_STREQ(r.factory()->kind, LOOM_KIND_ROUTER);
  const auto* t = r.table();
  EXPECT_EQ(t->struct_size, LOOM_ROUTER_V1_SIZE);
  EXPECT_NE(t->plan, nullptr);
  EXPECT_NE(t->select, nullptr);
  EXPECT_NE(t->gather, nullptr);
  EXPECT_NE(t->scatter, nullptr);
  EXPECT_NE(t->advance, nullptr);
  EXPECT_EQ(t->backward, nullptr);

  Instance<HalfLearned> l;
  EXPECT_NE(l.table()->backward, nullptr);
}

TEST(SdkKinds, RouterPlanSetsTheFlags) {
  Instance<LastFour> r;
  auto p = plan_args(2, 8);
  p.reserved2 = 0;
  ASSERT_EQ(take(r.table()->plan(r.object(), &p)), "");
  EXPECT_EQ(p.kept, 4);
  EXPECT_EQ(p.flags, LOOM_ROUTER_ROUTED);  // the class's 0xf0 is overwritten
  EXPECT_EQ(p.workspace_bytes, 64u);
  EXPECT_EQ(p.saved_bytes, 0u);
  EXPECT_EQ(p.seq_len, 8);  // the in-fields are left as given
  // Keeping every position is not routed.
  p = plan_args(2, 3);
  ASSERT_EQ(take(r.table()->plan(r.object(), &p)), "");
  EXPECT_EQ(p.kept, 3);
  EXPECT_EQ(p.flags, 0u);

  Instance<HalfLearned> l;
  p = plan_args(3, 10);
  ASSERT_EQ(take(l.table()->plan(l.object(), &p)), "");
  EXPECT_EQ(p.kept, 5);
  EXPECT_EQ(p.flags, LOOM_ROUTER_ROUTED | LOOM_ROUTER_LEARNED);
  EXPECT_EQ(p.saved_bytes, 3u * 5u * sizeof(double));
  p = plan_args(3, 1);
  ASSERT_EQ(take(l.table()->plan(l.object(), &p)), "");
  EXPECT_EQ(p.kept, 1);
  EXPECT_EQ(p.flags, LOOM_ROUTER_LEARNED);
}

TEST(SdkKinds, RouterPlanScalarsAreChecked) {
  Instance<LastFour> r;
  int32_t code = 0;
  auto plan = [&](loom_router_plan_args p) { return take(r.table()->plan(r.object(), &p), &code); };
  EXPECT_EQ(plan(plan_args(0, 8)), "router plan: batch is 0; must be >= 1");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(plan(plan_args(1, 0)), "router plan: seq_len is 0; must be >= 1");
  EXPECT_EQ(plan(plan_args(1, 8, -2)), "router plan: channels is -2; must be >= 1");
  EXPECT_EQ(plan(plan_args(1, 8, 2, 0)), "router plan: step is 0; must be >= 1");
  EXPECT_EQ(plan(plan_args(1, 8, 2, 1, 0, 0)), "router plan: num_layers is 0; must be >= 1");
  EXPECT_EQ(plan(plan_args(1, 8, 2, 1, 3, 3)),
            "router plan: layer 3 is outside 0 .. 2 (num_layers 3)");
  EXPECT_EQ(plan(plan_args(1, 8, 2, 1, -1, 3)),
            "router plan: layer -1 is outside 0 .. 2 (num_layers 3)");
  EXPECT_EQ(plan(plan_args(1, int64_t{INT32_MAX} + 1)),
            "router plan: seq_len 2147483648 is above 2^31 - 1, the most int32 indices address");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  // A struct shorter than the kind's (which is new in 1.4, so every field is required).
  auto p = plan_args(1, 8);
  p.struct_size = 16;
  EXPECT_NE(plan(p), "");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(plan(plan_args(1, 8)), "");
}

TEST(SdkKinds, RouterPlanKeptOutOfRangeIsThePluginsBug) {
  int32_t code = 0;
  Instance<BadPlan<1>> over;
  auto p = plan_args(2, 8);
  EXPECT_EQ(take(over.table()->plan(over.object(), &p), &code),
            "the plugin's plan kept 9 of 8 positions; kept must be 1 .. seq_len");
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  Instance<BadPlan<0>> none;
  p = plan_args(2, 8);
  EXPECT_EQ(take(none.table()->plan(none.object(), &p), &code),
            "the plugin's plan kept 0 of 8 positions; kept must be 1 .. seq_len");
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
  // select plans first, so the same bug stops it before any tensor is read.
  auto s = select_args(2, 8, 2);
  Tensor<int32_t> idx({2, 9}, kI32);
  s.indices = &idx.t;
  EXPECT_EQ(take(over.table()->select(over.object(), &s), &code),
            "the plugin's plan kept 9 of 8 positions; kept must be 1 .. seq_len");
  EXPECT_EQ(code, LOOM_ERR_INTERNAL);
}

TEST(SdkKinds, RouterSelectChecksTensorsAgainstThePlan) {
  Instance<LastFour> r;
  LastFour& cls = r.cls();
  int32_t code = 0;
  Scratch ws{};
  Tensor<int32_t> idx({2, 4}, kI32);
  Tensor<float> x({2, 8, 3}, kF32);
  auto good = [&] {
    auto s = select_args(2, 8, 3);
    s.indices = &idx.t;
    s.workspace = ws.bytes;
    s.workspace_bytes = 64;
    return s;
  };
  auto select = [&](const loom_router_select_args& s) {
    return take(r.table()->select(r.object(), &s), &code);
  };
  auto s = good();
  s.step = 0;
  EXPECT_EQ(select(s), "router select: step is 0; must be >= 1");
  s = good();
  s.layer = 3;
  EXPECT_EQ(select(s), "router select: layer 3 is outside 0 .. 2 (num_layers 3)");
  s = good();
  s.indices = nullptr;
  EXPECT_EQ(select(s), "indices is NULL");
  Tensor<int32_t> idx_wide({2, 5}, kI32);
  s = good();
  s.indices = &idx_wide.t;
  EXPECT_EQ(select(s), "indices has shape [2,5], expected [2, 4] (batch, kept)");
  Tensor<int64_t> idx64({2, 4}, DLDataType{kDLInt, 64, 1});
  s = good();
  s.indices = &idx64.t;
  EXPECT_EQ(select(s), "indices has dtype int64, expected int32");
  // x is optional for a router that does not learn, but checked when given.
  Tensor<float> x_short({2, 7, 3}, kF32);
  s = good();
  s.x = &x_short.t;
  EXPECT_EQ(select(s), "x has shape [2,7,3], expected [2, 8, 3]");
  Tensor<float> x2d({16, 3}, kF32);
  s = good();
  s.x = &x2d.t;
  EXPECT_EQ(select(s), "x has shape [16,3], expected [batch, positions, channels]");
  s = good();
  s.workspace = nullptr;
  EXPECT_EQ(select(s), "workspace is NULL but the plan asks for 64 bytes");
  s = good();
  s.workspace_bytes = 32;
  EXPECT_EQ(select(s), "workspace is 32 bytes but the plan asks for 64 bytes");
  s = good();
  s.workspace = ws.bytes + 8;
  EXPECT_EQ(select(s), "workspace is not 256-byte aligned");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  x.t.device = DLDevice{kDLCUDA, 0};
  s = good();
  s.x = &x.t;
  EXPECT_EQ(select(s), "x is on cuda:0, expected cpu");
  x.t.device = kCpu;
  EXPECT_EQ(cls.selects, 0);  // nothing reached the class
  EXPECT_EQ(idx.data, std::vector<int32_t>(8, 0));

  s = good();
  s.x = &x.t;
  ASSERT_EQ(select(s), "");
  EXPECT_EQ(cls.selects, 1);
  EXPECT_EQ(idx.data, (std::vector<int32_t>{4, 5, 6, 7, 4, 5, 6, 7}));
  ASSERT_EQ(select(good()), "");  // without x
  EXPECT_EQ(cls.selects, 2);
}

TEST(SdkKinds, LearnedRouterSelectNeedsXWeightGatesAndSaved) {
  Instance<HalfLearned> l;
  HalfLearned& cls = l.cls();
  int32_t code = 0;
  Scratch saved{};
  Tensor<int32_t> idx({2, 3}, kI32);
  Tensor<float> x({2, 6, 4}, kF32);
  Tensor<float> w({4}, kF32);
  Tensor<float> gates({2, 3}, kF32);
  auto good = [&] {
    auto s = select_args(2, 6, 4);
    s.indices = &idx.t;
    s.x = &x.t;
    s.weight = &w.t;
    s.gates = &gates.t;
    s.saved = saved.bytes;
    s.saved_bytes = 2 * 3 * sizeof(double);
    return s;
  };
  auto select = [&](const loom_router_select_args& s) {
    return take(l.table()->select(l.object(), &s), &code);
  };
  auto s = good();
  s.x = nullptr;
  EXPECT_EQ(select(s), "x is NULL; a learned router scores the layer's input");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  s = good();
  s.weight = nullptr;
  EXPECT_EQ(select(s), "weight is NULL; a learned router needs its weight");
  Tensor<float> w_long({5}, kF32);
  s = good();
  s.weight = &w_long.t;
  EXPECT_EQ(select(s), "weight has shape [5], expected [4]");
  Tensor<double> w64({4}, kF64);
  s = good();
  s.weight = &w64.t;
  EXPECT_EQ(select(s), "weight has dtype float64, expected float32");
  s = good();
  s.gates = nullptr;
  EXPECT_EQ(select(s), "gates is NULL");
  Tensor<double> g64({2, 3}, kF64);
  s = good();
  s.gates = &g64.t;
  EXPECT_EQ(select(s), "gates has dtype float64, expected float32");
  Tensor<float> g_short({2, 2}, kF32);
  s = good();
  s.gates = &g_short.t;
  EXPECT_EQ(select(s), "gates has shape [2,2], expected [2, 3] (batch, kept)");
  s = good();
  s.saved = nullptr;
  EXPECT_EQ(select(s), "saved is NULL but the plan asks for 48 bytes");
  s = good();
  s.saved_bytes = 47;
  EXPECT_EQ(select(s), "saved is 47 bytes but the plan asks for 48 bytes");
  s = good();
  s.saved = saved.bytes + 16;
  EXPECT_EQ(select(s), "saved is not 256-byte aligned");
  w.t.device = DLDevice{kDLCUDA, 1};
  EXPECT_EQ(select(good()), "weight is on cuda:1, expected cpu");
  w.t.device = kCpu;
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(cls.selects, 0);

  ASSERT_EQ(select(good()), "");
  EXPECT_EQ(cls.selects, 1);
  EXPECT_EQ(idx.data, (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(gates.data, std::vector<float>(6, 0.5F));
}

TEST(SdkKinds, RouterGatherScatterCheckTheMove) {
  Instance<LastFour> r;
  LastFour& cls = r.cls();
  int32_t code = 0;
  // full [2, 6, 2] stored as [seq_len, batch, channels]: batch stride 2, position stride 4.
  Tensor<float> full({2, 6, 2}, kF32);
  int64_t strides[3] = {2, 4, 1};
  full.t.strides = strides;
  for (size_t i = 0; i < full.data.size(); ++i) full.data[i] = static_cast<float>(i);
  Tensor<float> kept({2, 3, 2}, kF32);
  Tensor<int32_t> idx({2, 3}, kI32);
  idx.data = {0, 2, 5, 1, 3, 4};
  auto move = [&](DLTensor* f, DLTensor* k, const DLTensor* i) {
    loom_router_move_args m{};
    m.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
    m.full = f;
    m.kept = k;
    m.indices = i;
    return m;
  };
  auto gather = [&](const loom_router_move_args& m) {
    return take(r.table()->gather(r.object(), &m), &code);
  };
  auto scatter = [&](const loom_router_move_args& m) {
    return take(r.table()->scatter(r.object(), &m), &code);
  };
  ASSERT_EQ(gather(move(&full.t, &kept.t, &idx.t)), "");
  // kept[b, j, c] = full[b, idx[b, j], c] = element b*2 + p*4 + c.
  EXPECT_EQ(kept.data, (std::vector<float>{0, 1, 8, 9, 20, 21, 6, 7, 14, 15, 18, 19}));
  for (float& v : kept.data) v = -v - 1;
  ASSERT_EQ(scatter(move(&full.t, &kept.t, &idx.t)), "");
  EXPECT_EQ(full.data[8], -9.0F);    // b 0, p 2, c 0
  EXPECT_EQ(full.data[18], -19.0F);  // b 1, p 4, c 0
  EXPECT_EQ(full.data[4], 4.0F);     // b 0, p 1: not kept, left as it was
  EXPECT_EQ(cls.moves, 2);

  idx.data = {0, 2, 6, 1, 3, 4};
  EXPECT_EQ(gather(move(&full.t, &kept.t, &idx.t)), "indices[0, 2] = 6 is outside the 6 positions");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  idx.data = {0, 2, 5, 3, 3, 4};
  EXPECT_EQ(scatter(move(&full.t, &kept.t, &idx.t)),
            "indices[1, 1] = 3 does not increase on [1, 0] = 3");
  idx.data = {0, 2, 5, -1, 3, 4};
  EXPECT_EQ(gather(move(&full.t, &kept.t, &idx.t)),
            "indices[1, 0] = -1 is outside the 6 positions");
  idx.data = {0, 2, 5, 1, 3, 4};
  Tensor<float> kept_b3({3, 3, 2}, kF32);
  EXPECT_EQ(gather(move(&full.t, &kept_b3.t, &idx.t)),
            "kept has shape [3, 3, 2] but full has [2, 6, 2] (batch and channels must agree)");
  Tensor<float> kept_long({2, 7, 2}, kF32);
  EXPECT_EQ(gather(move(&full.t, &kept_long.t, &idx.t)),
            "kept has 7 positions per sequence but full has only 6");
  Tensor<double> kept64({2, 3, 2}, kF64);
  EXPECT_EQ(gather(move(&full.t, &kept64.t, &idx.t)),
            "kept has dtype float64 but full has float32");
  Tensor<int32_t> idx_short({2, 2}, kI32);
  EXPECT_EQ(gather(move(&full.t, &kept.t, &idx_short.t)),
            "indices has shape [2,2], expected [2, 3] (batch, kept)");
  EXPECT_EQ(gather(move(&full.t, &kept.t, nullptr)), "indices is NULL");
  int64_t bad_strides[3] = {2, 4, 2};
  full.t.strides = bad_strides;
  EXPECT_EQ(gather(move(&full.t, &kept.t, &idx.t)),
            "full has channel stride 2; the channels of a token must be contiguous (stride 1)");
  full.t.strides = strides;
  kept.t.device = DLDevice{kDLCUDA, 0};
  EXPECT_EQ(scatter(move(&full.t, &kept.t, &idx.t)), "kept is on cuda:0 but full is on cpu");
  kept.t.device = kCpu;
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(cls.moves, 2);  // none of the bad moves reached the class
}

// The tensor a move or backward writes must not have rows that share elements (a row
// written twice, or by two threads at once); the tensors it reads may (a broadcast).
TEST(SdkKinds, RouterDestinationRowsMustNotOverlap) {
  Instance<LastFour> r;
  LastFour& cls = r.cls();
  int32_t code = 0;
  Tensor<float> full({2, 6, 2}, kF32);
  for (size_t i = 0; i < full.data.size(); ++i) full.data[i] = static_cast<float>(i);
  Tensor<float> kept({2, 3, 2}, kF32);
  Tensor<int32_t> idx({2, 3}, kI32);
  idx.data = {0, 2, 5, 1, 3, 4};
  auto call = [&](bool gather) {
    loom_router_move_args m{};
    m.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
    m.full = &full.t;
    m.kept = &kept.t;
    m.indices = &idx.t;
    return take(gather ? r.table()->gather(r.object(), &m) : r.table()->scatter(r.object(), &m),
                &code);
  };
  // kept's positions one element apart while a row has two.
  int64_t kept_overlap[3] = {6, 1, 1};
  kept.t.strides = kept_overlap;
  EXPECT_EQ(call(true),
            "kept has position stride 1 over 3 positions, less than its 2 channels (a router "
            "writes every row of kept, so rows must not overlap)");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  // scatter only reads kept.
  ASSERT_EQ(call(false), "");
  kept.t.strides = nullptr;
  for (size_t i = 0; i < full.data.size(); ++i) full.data[i] = static_cast<float>(i);
  // full broadcast over the batch: a source of gather, never a destination of scatter.
  int64_t broadcast[3] = {0, 2, 1};
  full.t.strides = broadcast;
  ASSERT_EQ(call(true), "");
  EXPECT_EQ(kept.data, (std::vector<float>{0, 1, 4, 5, 10, 11, 2, 3, 6, 7, 8, 9}));
  EXPECT_EQ(call(false),
            "full has batch stride 0 over 2 sequences, less than its 2 channels (a router "
            "writes every row of full, so rows must not overlap)");
  // Position-major with too small a position stride: sequence 1's rows run into sequence 0's
  // next position.
  int64_t tight[3] = {2, 3, 1};
  full.t.strides = tight;
  EXPECT_EQ(call(false),
            "full has position stride 3, less than the span of its 2 sequences at batch stride 2 "
            "(1 * 2 + 2 channels) (a router writes every row of full, so rows must not overlap)");
  // Position-major rows that just fit, and a zero stride over an extent of 1, are fine.
  int64_t fits[3] = {2, 4, 1};
  full.t.strides = fits;
  ASSERT_EQ(call(false), "");
  Tensor<float> one({1, 6, 2}, kF32);
  Tensor<float> one_kept({1, 3, 2}, kF32);
  Tensor<int32_t> one_idx({1, 3}, kI32);
  one_idx.data = {0, 1, 5};
  int64_t zero_batch[3] = {0, 2, 1};
  one.t.strides = zero_batch;
  one_kept.t.strides = zero_batch;
  loom_router_move_args m{};
  m.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
  m.full = &one.t;
  m.kept = &one_kept.t;
  m.indices = &one_idx.t;
  ASSERT_EQ(take(r.table()->scatter(r.object(), &m), &code), "");
  ASSERT_EQ(take(r.table()->gather(r.object(), &m), &code), "");
  EXPECT_EQ(cls.moves, 5);

  // backward's dx.
  Instance<HalfLearned> l;
  Tensor<int32_t> bidx({2, 3}, kI32);
  bidx.data = {0, 1, 2, 0, 1, 2};
  Tensor<float> x({2, 6, 4}, kF32);
  Tensor<float> w({4}, kF32);
  Tensor<float> dgates({2, 3}, kF32);
  Tensor<float> dx({2, 6, 4}, kF32);
  Tensor<float> dw({4}, kF32);
  loom_router_backward_args b{};
  b.struct_size = LOOM_ROUTER_BACKWARD_ARGS_SIZE;
  b.batch = 2;
  b.seq_len = 6;
  b.channels = 4;
  b.x = &x.t;
  b.weight = &w.t;
  b.indices = &bidx.t;
  b.dgates = &dgates.t;
  b.dx = &dx.t;
  b.dweight = &dw.t;
  int64_t dx_overlap[3] = {12, 2, 1};
  dx.t.strides = dx_overlap;
  EXPECT_EQ(take(l.table()->backward(l.object(), &b), &code),
            "dx has position stride 2 over 6 positions, less than its 4 channels (a router "
            "writes every row of dx, so rows must not overlap)");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(l.cls().backwards, 0);
  x.t.strides = dx_overlap;  // x is only read
  dx.t.strides = nullptr;
  ASSERT_EQ(take(l.table()->backward(l.object(), &b), &code), "");
  EXPECT_EQ(l.cls().backwards, 1);
}

TEST(SdkKinds, RouterBackwardChecksWhatItReads) {
  Instance<HalfLearned> l;
  HalfLearned& cls = l.cls();
  int32_t code = 0;
  Tensor<int32_t> idx({2, 3}, kI32);
  idx.data = {0, 1, 2, 0, 1, 2};
  Tensor<float> x({2, 6, 4}, kF32);
  Tensor<float> w({4}, kF32);
  Tensor<float> dgates({2, 3}, kF32);
  Tensor<float> dx({2, 6, 4}, kF32);
  Tensor<float> dw({4}, kF32);
  auto good = [&] {
    loom_router_backward_args b{};
    b.struct_size = LOOM_ROUTER_BACKWARD_ARGS_SIZE;
    b.batch = 2;
    b.seq_len = 6;
    b.channels = 4;
    b.x = &x.t;
    b.weight = &w.t;
    b.indices = &idx.t;
    b.dgates = &dgates.t;
    b.dx = &dx.t;
    b.dweight = &dw.t;
    return b;
  };
  auto backward = [&](const loom_router_backward_args& b) {
    return take(l.table()->backward(l.object(), &b), &code);
  };
  auto b = good();
  b.batch = 0;
  EXPECT_EQ(backward(b), "router backward: batch is 0; must be >= 1");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  b = good();
  b.x = nullptr;
  EXPECT_EQ(backward(b), "x is NULL; backward needs x and weight as given to select");
  b = good();
  b.weight = nullptr;
  EXPECT_EQ(backward(b), "weight is NULL; backward needs x and weight as given to select");
  Tensor<int32_t> idx_long({2, 7}, kI32);
  b = good();
  b.indices = &idx_long.t;
  EXPECT_EQ(backward(b),
            "indices has shape [2,7], expected [batch, kept] with 1 <= kept <= seq_len 6");
  Tensor<float> dg_short({2, 2}, kF32);
  b = good();
  b.dgates = &dg_short.t;
  EXPECT_EQ(backward(b), "dgates has shape [2,2], expected [2, 3] (batch, kept)");
  Tensor<float> dx_short({2, 5, 4}, kF32);
  b = good();
  b.dx = &dx_short.t;
  EXPECT_EQ(backward(b), "dx has shape [2,5,4] but x has [2,6,4]");
  Tensor<double> dx64({2, 6, 4}, kF64);
  b = good();
  b.dx = &dx64.t;
  EXPECT_EQ(backward(b), "dx has dtype float64, expected float32");
  Tensor<double> dw64({4}, kF64);
  b = good();
  b.dweight = &dw64.t;
  EXPECT_EQ(backward(b), "dweight has dtype float64, expected float32");
  b = good();
  b.dweight = nullptr;
  EXPECT_EQ(backward(b), "dweight is NULL");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(cls.backwards, 0);
  ASSERT_EQ(backward(good()), "");
  EXPECT_EQ(cls.backwards, 1);
}

TEST(SdkKinds, RouterAdvanceChecksItsScalarsAndFillsTheOuts) {
  Instance<LastFour> r;
  int32_t code = 0;
  auto advance = [&](int64_t step, int64_t batch, int64_t seq_len, int32_t layers,
                     loom_router_advance_args* out = nullptr) {
    loom_router_advance_args a{};
    a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
    a.step = step;
    a.batch = batch;
    a.seq_len = seq_len;
    a.num_layers = layers;
    a.layer_tokens = -5;
    a.consumed_layer_tokens = 99;
    std::string m = take(r.table()->advance(r.object(), &a), &code);
    if (out != nullptr) *out = a;
    return m;
  };
  EXPECT_EQ(advance(0, 4, 8, 2), "router advance: step is 0; must be >= 1");
  EXPECT_EQ(advance(1, 0, 8, 2), "router advance: batch is 0; must be >= 1");
  EXPECT_EQ(advance(1, 4, -1, 2), "router advance: seq_len is -1; must be >= 1");
  EXPECT_EQ(advance(1, 4, 8, 0), "router advance: num_layers is 0; must be >= 1");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  loom_router_advance_args a{};
  ASSERT_EQ(advance(1, 4, 8, 2, &a), "");
  EXPECT_EQ(a.layer_tokens, 4 * 4 * 2);
  EXPECT_EQ(a.consumed_layer_tokens, 32u);
  ASSERT_EQ(advance(2, 4, 2, 2, &a), "");
  EXPECT_EQ(a.layer_tokens, 4 * 2 * 2);
  EXPECT_EQ(a.consumed_layer_tokens, 48u);
}

// The kind needs no 1.4 host's services (the services table did not change in 1.4): a 1.3,
// 1.2 or 1.1 host's table creates the instance, which plans and selects.
TEST(SdkKinds, RouterCreatedByOlderHosts) {
  const uint32_t v11 = LOOM_STRUCT_SIZE(loom_host_services, param_count);
  for (const auto& [minor, size] : {std::pair<uint16_t, uint32_t>{3, LOOM_HOST_SERVICES_SIZE},
                                    {2, LOOM_HOST_SERVICES_SIZE},
                                    {1, v11}}) {
    SCOPED_TRACE("ABI 1." + std::to_string(minor));
    Instance<LastFour> r(minor, size);
    ASSERT_NE(r.object(), nullptr);
    auto p = plan_args(1, 6);
    ASSERT_EQ(take(r.table()->plan(r.object(), &p)), "");
    EXPECT_EQ(p.kept, 4);
  }
}

}  // namespace
