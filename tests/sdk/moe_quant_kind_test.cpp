// The SDK's tables for loom.moe/1 and loom.quantizer/1, in process: the entries a class gets
// (the optional ones NULL when it lacks them), the fields the tables own (EXPERT_PARALLEL,
// HAS_MATMUL, the packed sizes), a plan or layout that breaks the rules reported as the
// plugin's bug, and the checks made before the class is called (scalars, shapes, dtypes and
// buffers against the plan or layout, the format field by field). The suite is SdkKinds, so
// scripts/test.sh's sanitizer pass runs these with the other kinds' tables.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/moe.hpp>
#include <loom/sdk/kinds/quantizer.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace {

using loom::sdk::Context;

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};
constexpr DLDevice kCpu{kDLCPU, 0};

template <class E>
struct Tensor {
  Tensor(std::vector<int64_t> dims, DLDataType dtype = kF32) : shape(std::move(dims)) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    data.assign(static_cast<size_t>(n), E{});
    t.data = data.data();
    t.device = kCpu;
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dtype;
    t.shape = shape.data();
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  std::vector<int64_t> shape;
  std::vector<E> data;
  DLTensor t{};
};

struct alignas(256) Scratch {
  unsigned char bytes[1024];
};

std::string take(loom_status* st, int32_t* code = nullptr) {
  if (code != nullptr) *code = st == nullptr ? LOOM_OK : st->code;
  if (st == nullptr) return "";
  std::string m = st->message;
  st->destroy(st);
  return m;
}

template <class T, class Table>
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
    if (st != nullptr) ADD_FAILURE() << take(st);
  }
  ~Instance() {
    if (obj_ != nullptr) factory_->destroy(obj_);
  }
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;
  const loom_factory* factory() const { return factory_; }
  void* object() const { return obj_; }
  const Table* table() const { return static_cast<const Table*>(factory_->vtable); }
  T& cls() const { return loom::sdk::detail::shared_object<T>(obj_); }

 private:
  const loom_factory* factory_ = nullptr;
  loom_host_services svc_{};
  void* obj_ = nullptr;
};

// ---- MoE

// E = 4 experts over ep_size `Ep` (a fake rank 0), top-2, 100 saved bytes per token, capacity
// = tokens. Counts the calls that reach it and the plan the table handed over.
template <int Ep = 1, bool kResidual = false>
class TwoOfFour : public loom::sdk::Moe {
 public:
  explicit TwoOfFour(Context& /*ctx*/) {}
  void plan(loom_moe_plan_args& a) {
    a.experts = a.num_experts != 0 ? a.num_experts : 4;
    a.ep_size = Ep;
    a.local_experts = a.experts / Ep;
    a.top_k = 2;
    a.activation = LOOM_MOE_GELU;
    a.capacity = a.tokens;
    a.max_expert_rows = a.tokens * 2;
    a.saved_bytes = static_cast<uint64_t>(a.tokens) * 100;
    a.workspace_bytes = 64;
    a.flags = kResidual ? LOOM_MOE_RESIDUAL : 0u;
  }
  void forward(const loom_moe_forward_args& a, const loom_moe_plan_args& p) {
    ++forwards;
    last_capacity = p.capacity;
    if (a.stats != nullptr) a.stats->dropped = 7;
  }
  void backward(const loom_moe_backward_args& /*a*/, const loom_moe_plan_args& /*p*/) {
    ++backwards;
  }
  int forwards = 0;
  int backwards = 0;
  int64_t last_capacity = -1;
};

class WithDispatch : public TwoOfFour<> {
 public:
  using TwoOfFour::TwoOfFour;
  void dispatch(const loom_moe_dispatch_args& /*a*/) { ++moves; }
  void combine(const loom_moe_dispatch_args& /*a*/) { ++moves; }
  void reduce_gradients(const loom_moe_reduce_args& a) { reduced += a.count; }
  int moves = 0;
  int64_t reduced = 0;
};

// A plan that breaks one rule, chosen by `Bug`.
template <int Bug>
class BadMoePlan : public TwoOfFour<> {
 public:
  using TwoOfFour::TwoOfFour;
  void plan(loom_moe_plan_args& a) {
    TwoOfFour::plan(a);
    if (Bug == 0) a.top_k = 5;                  // more than E
    if (Bug == 1) a.local_experts = 3;          // 3 * 1 != 4
    if (Bug == 2) a.flags = 1u << 9;            // unknown flag
    if (Bug == 3) a.activation = 0;             // no activation
    if (Bug == 4) a.flags = LOOM_MOE_DROPLESS;  // dropless with a capacity
  }
};

using MoeInstance = Instance<TwoOfFour<>, loom_moe_v1>;

loom_moe_plan_args moe_plan_args(int64_t tokens = 3) {
  loom_moe_plan_args p{};
  p.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
  p.tokens = tokens;
  p.model_dim = 2;
  p.hidden_dim = 5;
  p.layer = 0;
  p.num_layers = 2;
  p.training = 1;
  p.dtype = kF32;
  return p;
}

// The tensors of one forward and backward: T = 3 tokens, M = 2, H = 5, E = E_l = 4.
struct MoeCall {
  static constexpr int64_t kT = 3, kM = 2, kH = 5, kE = 4;
  Tensor<float> x{{kT, kM}}, y{{kT, kM}}, dy{{kT, kM}}, dx{{kT, kM}};
  Tensor<float> gate{{kE, kM}}, w1{{kE, kH, kM}}, b1{{kE, kH}}, w2{{kE, kM, kH}}, b2{{kE, kM}};
  Tensor<float> g_gate{{kE, kM}}, g_w1{{kE, kH, kM}}, g_b1{{kE, kH}}, g_w2{{kE, kM, kH}},
      g_b2{{kE, kM}};
  Scratch saved{}, workspace{};
  loom_moe_weights weights{}, grads{};
  loom_moe_stats stats{};
  int64_t load[kE] = {5, 5, 5, 5};
  loom_moe_forward_args fwd{};
  loom_moe_backward_args bwd{};

  MoeCall() {
    weights = {LOOM_MOE_WEIGHTS_SIZE,
               0,
               &gate.t,
               &w1.t,
               &b1.t,
               &w2.t,
               &b2.t,
               nullptr,
               nullptr,
               nullptr,
               nullptr,
               nullptr,
               nullptr};
    grads = {LOOM_MOE_WEIGHTS_SIZE,
             0,
             &g_gate.t,
             &g_w1.t,
             &g_b1.t,
             &g_w2.t,
             &g_b2.t,
             nullptr,
             nullptr,
             nullptr,
             nullptr,
             nullptr,
             nullptr};
    stats.struct_size = LOOM_MOE_STATS_SIZE;
    stats.aux_loss = 3.5;
    stats.load = load;
    stats.load_count = kE;
    fwd.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
    fwd.step = 1;
    fwd.tokens = kT;
    fwd.model_dim = kM;
    fwd.hidden_dim = kH;
    fwd.num_layers = 2;
    fwd.training = 1;
    fwd.x = &x.t;
    fwd.weights = &weights;
    fwd.y = &y.t;
    fwd.stats = &stats;
    fwd.saved = saved.bytes;
    fwd.saved_bytes = sizeof saved.bytes;
    fwd.workspace = workspace.bytes;
    fwd.workspace_bytes = sizeof workspace.bytes;
    bwd.struct_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
    bwd.step = 1;
    bwd.tokens = kT;
    bwd.model_dim = kM;
    bwd.hidden_dim = kH;
    bwd.num_layers = 2;
    bwd.training = 1;
    bwd.x = &x.t;
    bwd.weights = &weights;
    bwd.dy = &dy.t;
    bwd.dx = &dx.t;
    bwd.grads = &grads;
    bwd.saved = saved.bytes;
    bwd.saved_bytes = sizeof saved.bytes;
    bwd.workspace = workspace.bytes;
    bwd.workspace_bytes = sizeof workspace.bytes;
  }
};

TEST(SdkKinds, MoeTableEntriesFollowTheClass) {
  MoeInstance plain;
  EXPECT_STREQ(plain.factory()->kind, LOOM_KIND_MOE);
  const loom_moe_v1* t = plain.table();
  EXPECT_EQ(t->struct_size, LOOM_MOE_V1_SIZE);
  EXPECT_NE(t->plan, nullptr);
  EXPECT_NE(t->forward, nullptr);
  EXPECT_NE(t->backward, nullptr);
  EXPECT_EQ(t->dispatch, nullptr);
  EXPECT_EQ(t->combine, nullptr);
  EXPECT_EQ(t->reduce_gradients, nullptr);
  Instance<WithDispatch, loom_moe_v1> full;
  EXPECT_NE(full.table()->dispatch, nullptr);
  EXPECT_NE(full.table()->combine, nullptr);
  EXPECT_NE(full.table()->reduce_gradients, nullptr);
}

TEST(SdkKinds, MoePlanSetsExpertParallelAndChecksScalars) {
  Instance<TwoOfFour<2>, loom_moe_v1> ep;
  loom_moe_plan_args p = moe_plan_args();
  EXPECT_EQ(take(ep.table()->plan(ep.object(), &p)), "");
  EXPECT_EQ(p.experts, 4);
  EXPECT_EQ(p.local_experts, 2);
  EXPECT_EQ(p.flags, LOOM_MOE_EXPERT_PARALLEL);
  MoeInstance one;
  p = moe_plan_args();
  EXPECT_EQ(take(one.table()->plan(one.object(), &p)), "");
  EXPECT_EQ(p.flags, 0u);
  EXPECT_EQ(p.saved_bytes, 300u);
  int32_t code = 0;
  p = moe_plan_args();
  p.layer = 2;
  EXPECT_NE(take(one.table()->plan(one.object(), &p), &code).find("layer 2 is outside 0 .. 1"),
            std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  p = moe_plan_args(0);
  EXPECT_NE(take(one.table()->plan(one.object(), &p)).find("tokens is 0; must be >= 1"),
            std::string::npos);
  p = moe_plan_args();
  p.struct_size = 16;
  EXPECT_NE(take(one.table()->plan(one.object(), &p)).find("struct_size 16"), std::string::npos);
}

template <int Bug>
std::string bad_plan_message() {
  Instance<BadMoePlan<Bug>, loom_moe_v1> bad;
  loom_moe_plan_args p = moe_plan_args();
  int32_t code = 0;
  std::string m = take(bad.table()->plan(bad.object(), &p), &code);
  EXPECT_EQ(code, LOOM_ERR_INTERNAL) << m;
  return m;
}

TEST(SdkKinds, MoeBrokenPlanIsThePluginsBug) {
  EXPECT_NE(bad_plan_message<0>().find("top_k 5 for 4 experts"), std::string::npos);
  EXPECT_NE(bad_plan_message<1>().find("local_experts 3"), std::string::npos);
  EXPECT_NE(bad_plan_message<2>().find("unknown flags 0x200"), std::string::npos);
  EXPECT_NE(bad_plan_message<3>().find("activation 0"), std::string::npos);
  EXPECT_NE(bad_plan_message<4>().find("dropless"), std::string::npos);
}

TEST(SdkKinds, MoeForwardChecksAgainstThePlan) {
  MoeInstance inst;
  const loom_moe_v1* t = inst.table();
  {
    MoeCall c;
    EXPECT_EQ(take(t->forward(inst.object(), &c.fwd)), "");
    EXPECT_EQ(inst.cls().forwards, 1);
    EXPECT_EQ(inst.cls().last_capacity, 3);  // planned for the call's tokens
    EXPECT_EQ(c.stats.dropped, 7);
    EXPECT_EQ(c.stats.aux_loss, 0.0);  // zeroed by the table
    EXPECT_EQ(c.load[2], 0);
    EXPECT_EQ(take(t->backward(inst.object(), &c.bwd)), "");
    EXPECT_EQ(inst.cls().backwards, 1);
  }
  auto refused = [&](auto&& edit, const char* expect) {
    MoeCall c;
    edit(c);
    int32_t code = 0;
    const std::string m = take(t->forward(inst.object(), &c.fwd), &code);
    EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT) << expect;
    EXPECT_NE(m.find(expect), std::string::npos) << m;
  };
  Tensor<float> wrong_w1({4, 2, 5});
  Tensor<float> gate3({3, 2});
  Tensor<int32_t> y_int({3, 2}, kI32);
  Tensor<float> bias({4});
  refused([&](MoeCall& c) { c.weights.w1 = &wrong_w1.t; },
          "weights.w1 has shape [4,2,5], expected [4, 5, 2]");
  refused([&](MoeCall& c) { c.weights.gate_w = &gate3.t; }, "weights.gate_w has shape [3,2]");
  refused([&](MoeCall& c) { c.fwd.y = &y_int.t; }, "y has dtype int32");
  refused([&](MoeCall& c) { c.fwd.expert_bias = &bias.t; }, "expert_bias is given");
  refused([&](MoeCall& c) { c.weights.res_w1 = &gate3.t; }, "res_w1 is given");
  refused([&](MoeCall& c) { c.fwd.saved_bytes = 299; },
          "saved is 299 bytes but the plan asks for 300");
  refused([&](MoeCall& c) { c.fwd.workspace = c.workspace.bytes + 1; }, "256-byte aligned");
  refused([&](MoeCall& c) { c.stats.load_count = 3; }, "stats.load_count is 3");
  refused([&](MoeCall& c) { c.fwd.step = 0; }, "step is 0; must be >= 1");
  refused([&](MoeCall& c) { c.fwd.tokens = 2; }, "x has shape [3,2], expected [2, 2]");
  EXPECT_EQ(inst.cls().forwards, 1);
  MoeCall c;
  c.fwd.training = 0;
  c.fwd.step = 0;  // evaluation needs no step
  EXPECT_EQ(take(t->forward(inst.object(), &c.fwd)), "");
  Tensor<float> dx_short({2, 2});
  c.bwd.dx = &dx_short.t;
  EXPECT_NE(take(t->backward(inst.object(), &c.bwd)).find("dx has shape [2,2]"), std::string::npos);
  c.bwd.dx = &c.dx.t;
  c.grads.b2 = &c.b1.t;
  EXPECT_NE(take(t->backward(inst.object(), &c.bwd)).find("grads.b2 has shape [4,5]"),
            std::string::npos);
  EXPECT_EQ(inst.cls().backwards, 1);  // only the first, good, backward
}

TEST(SdkKinds, MoeResidualWeightsAreRequiredWithTheFlag) {
  Instance<TwoOfFour<1, true>, loom_moe_v1> inst;
  MoeCall c;
  EXPECT_NE(take(inst.table()->forward(inst.object(), &c.fwd)).find("weights.res_w1 is NULL"),
            std::string::npos);
  EXPECT_EQ(inst.cls().forwards, 0);
}

TEST(SdkKinds, MoeDispatchChecksTheRouting) {
  Instance<WithDispatch, loom_moe_v1> inst;
  Tensor<float> x({3, 2}), rows({6, 2});
  Tensor<int32_t> experts({3, 2}, kI32);
  experts.data = {0, 1, 2, 3, -1, 0};
  int64_t counts[4] = {};
  loom_moe_dispatch_args d{};
  d.struct_size = LOOM_MOE_DISPATCH_ARGS_SIZE;
  d.tokens = 3;
  d.model_dim = 2;
  d.top_k = 2;
  d.x = &x.t;
  d.rows = &rows.t;
  d.route_experts = &experts.t;
  d.counts = counts;
  d.counts_count = 4;
  EXPECT_EQ(take(inst.table()->dispatch(inst.object(), &d)), "");
  EXPECT_EQ(take(inst.table()->combine(inst.object(), &d)), "");
  EXPECT_EQ(inst.cls().moves, 2);
  experts.data[3] = 4;
  EXPECT_NE(take(inst.table()->dispatch(inst.object(), &d)).find("route_experts[1, 1] = 4"),
            std::string::npos);
  experts.data[3] = 3;
  d.top_k = 1;
  EXPECT_NE(take(inst.table()->combine(inst.object(), &d)).find("chooses 2 experts"),
            std::string::npos);
  d.top_k = 2;
  d.counts_count = 2;
  EXPECT_NE(take(inst.table()->dispatch(inst.object(), &d)).find("counts_count is 2"),
            std::string::npos);
  EXPECT_EQ(inst.cls().moves, 2);

  Tensor<float> g({3});
  Tensor<int32_t> gi({3}, kI32);
  DLTensor* list[2] = {&g.t, &gi.t};
  loom_moe_reduce_args r{LOOM_MOE_REDUCE_ARGS_SIZE, 0, list, 1, nullptr};
  EXPECT_EQ(take(inst.table()->reduce_gradients(inst.object(), &r)), "");
  r.count = 2;
  EXPECT_NE(take(inst.table()->reduce_gradients(inst.object(), &r)).find("tensors[1] has dtype"),
            std::string::npos);
  EXPECT_EQ(inst.cls().reduced, 1);
}

// ---- quantizer

// Symmetric INT8, one scale per row for weights (per token for activations), plain loops.
// `kMatmul` adds a weight-only matmul; `kBits` picks the bits (4: no matmul for it).
template <bool kMatmul, uint32_t kBits = 8>
class RowInt : public loom::sdk::Quantizer {
 public:
  explicit RowInt(Context& /*ctx*/) {}
  void layout(loom_quantizer_layout_args& a) {
    loom_quant_format& f = *a.format;
    f.scheme = LOOM_QUANT_INT;
    f.bits = kBits;
    f.flags = LOOM_QUANT_SYMMETRIC;
    f.packing = LOOM_QUANT_PACK_LSB_FIRST;
    f.axis = 1;
    f.group_size = a.shape[1];
    f.scale_dtype = kF32;
    if (kBits != 8) a.flags &= ~LOOM_QUANTIZER_HAS_MATMUL;
    a.workspace_bytes = 0;
    a.matmul_workspace_bytes = 32;
  }
  void quantize(const loom_quantizer_quantize_args& a, const loom_quantizer_layout_args& l) {
    ++quantizes;
    last_packed = l.packed_bytes;
    const int64_t n = a.x->shape[0], k = a.x->shape[1];
    const auto* x = loom::sdk::data_as<const float>(*a.x);
    auto* q = loom::sdk::data_as<int8_t>(*a.packed);
    auto* s = loom::sdk::data_as<float>(*a.scales);
    for (int64_t r = 0; r < n; ++r) {
      float m = 0;
      for (int64_t c = 0; c < k; ++c) m = std::max(m, std::abs(x[r * k + c]));
      s[r] = m > 0 ? m / 127 : 1;
      for (int64_t c = 0; c < k; ++c) {
        q[r * k + c] = static_cast<int8_t>(std::nearbyint(x[r * k + c] / s[r]));
      }
    }
  }
  void dequantize(const loom_quantizer_quantize_args& /*a*/,
                  const loom_quantizer_layout_args& /*l*/) {
    ++dequantizes;
  }
  int quantizes = 0;
  int dequantizes = 0;
  uint64_t last_packed = 0;
};

template <uint32_t kBits = 8>
class RowIntMatmul : public RowInt<true, kBits> {
 public:
  using RowInt<true, kBits>::RowInt;
  void matmul(const loom_quantizer_matmul_args& /*a*/, const loom_quantizer_layout_args& l) {
    ++matmuls;
    last_rows_ws = l.matmul_workspace_bytes;
  }
  int matmuls = 0;
  uint64_t last_rows_ws = 0;
};

// A layout that gets its sizes wrong or breaks the format.
template <int Bug>
class BadLayout : public RowInt<false> {
 public:
  using RowInt::RowInt;
  void layout(loom_quantizer_layout_args& a) {
    RowInt::layout(a);
    if (Bug == 0) a.packed_bytes = 3;
    if (Bug == 1) a.format->bits = 9;
    if (Bug == 2) a.flags = 1u << 5;
  }
};

loom_quantizer_layout_args layout_args(const int64_t* shape, loom_quant_format* f,
                                       int32_t role = LOOM_QUANTIZER_WEIGHT) {
  loom_quantizer_layout_args a{};
  a.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
  a.role = role;
  a.ndim = 2;
  a.shape = shape;
  a.dtype = kF32;
  *f = loom_quant_format{};
  f->struct_size = LOOM_QUANT_FORMAT_SIZE;
  a.format = f;
  return a;
}

TEST(SdkKinds, QuantizerLayoutOwnsSizesAndMatmulFlag) {
  const int64_t shape[2] = {3, 4};
  loom_quant_format f{};
  Instance<RowInt<false>, loom_quantizer_v1> plain;
  EXPECT_STREQ(plain.factory()->kind, LOOM_KIND_QUANTIZER);
  EXPECT_EQ(plain.table()->matmul, nullptr);
  loom_quantizer_layout_args a = layout_args(shape, &f);
  EXPECT_EQ(take(plain.table()->layout(plain.object(), &a)), "");
  EXPECT_EQ(a.flags, 0u);
  EXPECT_EQ(a.matmul_workspace_bytes, 0u);
  EXPECT_EQ(a.packed_bytes, 12u);
  EXPECT_EQ(a.scale_count, 3);
  EXPECT_EQ(a.zero_point_count, 0);
  EXPECT_EQ(f.shape, shape);
  EXPECT_EQ(f.ndim, 2);

  Instance<RowIntMatmul<>, loom_quantizer_v1> mm;
  EXPECT_NE(mm.table()->matmul, nullptr);
  a = layout_args(shape, &f);
  EXPECT_EQ(take(mm.table()->layout(mm.object(), &a)), "");
  EXPECT_EQ(a.flags, LOOM_QUANTIZER_HAS_MATMUL);
  EXPECT_EQ(a.matmul_workspace_bytes, 32u);
  a = layout_args(shape, &f, LOOM_QUANTIZER_ACTIVATION);
  EXPECT_EQ(take(mm.table()->layout(mm.object(), &a)), "");
  EXPECT_EQ(a.flags, 0u);  // matmul takes weights

  Instance<RowIntMatmul<4>, loom_quantizer_v1> four;  // opts out of matmul for its format
  a = layout_args(shape, &f);
  EXPECT_EQ(take(four.table()->layout(four.object(), &a)), "");
  EXPECT_EQ(a.flags, 0u);
  EXPECT_EQ(a.packed_bytes, 6u);

  a = layout_args(shape, &f);
  a.role = 3;
  EXPECT_NE(take(plain.table()->layout(plain.object(), &a)).find("role 3"), std::string::npos);
  a = layout_args(shape, &f);
  a.ndim = 3;
  EXPECT_NE(take(plain.table()->layout(plain.object(), &a)).find("ndim is 3"), std::string::npos);
  a = layout_args(shape, &f);
  f.struct_size = 8;
  EXPECT_NE(take(plain.table()->layout(plain.object(), &a)).find("format has struct_size 8"),
            std::string::npos);
}

template <int Bug>
std::string bad_layout_message() {
  Instance<BadLayout<Bug>, loom_quantizer_v1> bad;
  const int64_t shape[2] = {3, 4};
  loom_quant_format f{};
  loom_quantizer_layout_args a = layout_args(shape, &f);
  int32_t code = 0;
  std::string m = take(bad.table()->layout(bad.object(), &a), &code);
  EXPECT_EQ(code, LOOM_ERR_INTERNAL) << m;
  return m;
}

TEST(SdkKinds, QuantizerBrokenLayoutIsThePluginsBug) {
  EXPECT_NE(bad_layout_message<0>().find("packed_bytes 3, but its format takes 12"),
            std::string::npos);
  EXPECT_NE(bad_layout_message<1>().find("broken format"), std::string::npos);
  EXPECT_NE(bad_layout_message<2>().find("unknown flags 0x20"), std::string::npos);
}

struct QuantCall {
  const int64_t shape[2] = {3, 4};
  loom_quant_format f{};
  Tensor<float> x{{3, 4}};
  Tensor<uint8_t> packed{{12}, kU8};
  Tensor<float> scales{{3}};
  loom_quantizer_quantize_args q{};
  QuantCall() {
    x.data = {1, -2, 3, 0.5F, 0, 0, 0, 0, -4, 4, 2, -1};
    f.struct_size = LOOM_QUANT_FORMAT_SIZE;
    f.scheme = LOOM_QUANT_INT;
    f.bits = 8;
    f.flags = LOOM_QUANT_SYMMETRIC;
    f.packing = LOOM_QUANT_PACK_LSB_FIRST;
    f.axis = 1;
    f.group_size = 4;
    f.ndim = 2;
    f.shape = shape;
    f.scale_dtype = kF32;
    q.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
    q.role = LOOM_QUANTIZER_WEIGHT;
    q.format = &f;
    q.x = &x.t;
    q.packed = &packed.t;
    q.scales = &scales.t;
  }
};

TEST(SdkKinds, QuantizerQuantizeChecksAgainstTheLayout) {
  Instance<RowInt<false>, loom_quantizer_v1> inst;
  const loom_quantizer_v1* t = inst.table();
  {
    QuantCall c;
    EXPECT_EQ(take(t->quantize(inst.object(), &c.q)), "");
    EXPECT_EQ(inst.cls().quantizes, 1);
    EXPECT_EQ(inst.cls().last_packed, 12u);
    EXPECT_EQ(static_cast<int8_t>(c.packed.data[2]), 127);  // 3 is row 0's max
    EXPECT_FLOAT_EQ(c.scales.data[2], 4.0F / 127);
    EXPECT_EQ(take(t->dequantize(inst.object(), &c.q)), "");
    EXPECT_EQ(inst.cls().dequantizes, 1);
  }
  auto refused = [&](auto&& edit, const char* expect) {
    QuantCall c;
    edit(c);
    int32_t code = 0;
    const std::string m = take(t->quantize(inst.object(), &c.q), &code);
    EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT) << expect;
    EXPECT_NE(m.find(expect), std::string::npos) << m;
  };
  Tensor<uint8_t> short_packed({11}, kU8);
  Tensor<float> four_scales({4});
  Tensor<uint8_t> zeros({3}, kU8);
  Tensor<int32_t> x_int({3, 4}, kI32);
  refused([](QuantCall& c) { c.f.bits = 4; }, "format.bits is 4");
  refused([](QuantCall& c) { c.f.group_size = 2; }, "format.group_size is 2");
  refused([](QuantCall& c) { c.f.packing = LOOM_QUANT_PACK_MSB_FIRST; }, "format.packing is 2");
  refused([&](QuantCall& c) { c.q.packed = &short_packed.t; }, "hold 11 bytes");
  refused([&](QuantCall& c) { c.q.scales = &four_scales.t; }, "scales has 4 elements, expected 3");
  refused([&](QuantCall& c) { c.q.zero_points = &zeros.t; }, "zero_points is given");
  refused([&](QuantCall& c) { c.q.x = &x_int.t; }, "x has dtype int32");
  refused([](QuantCall& c) { c.q.role = 0; }, "role 0");
  refused([](QuantCall& c) { c.q.format = nullptr; }, "format is NULL");
  EXPECT_EQ(inst.cls().quantizes, 1);
}

TEST(SdkKinds, QuantizerMatmulChecksShapesAndSupport) {
  Instance<RowIntMatmul<>, loom_quantizer_v1> inst;
  QuantCall c;
  Tensor<float> x({2, 4}), y({2, 3}), bias({3}), y_wrong({3, 2});
  Scratch ws{};
  loom_quantizer_matmul_args m{};
  m.struct_size = LOOM_QUANTIZER_MATMUL_ARGS_SIZE;
  m.format = &c.f;
  m.x = &x.t;
  m.packed = &c.packed.t;
  m.scales = &c.scales.t;
  m.bias = &bias.t;
  m.y = &y.t;
  m.workspace = ws.bytes;
  m.workspace_bytes = 32;
  EXPECT_EQ(take(inst.table()->matmul(inst.object(), &m)), "");
  EXPECT_EQ(inst.cls().matmuls, 1);
  EXPECT_EQ(inst.cls().last_rows_ws, 32u);
  m.workspace_bytes = 31;
  EXPECT_NE(take(inst.table()->matmul(inst.object(), &m)).find("workspace is 31 bytes"),
            std::string::npos);
  m.workspace_bytes = 32;
  m.y = &y_wrong.t;
  EXPECT_NE(
      take(inst.table()->matmul(inst.object(), &m)).find("y has shape [3,2], expected [2, 3]"),
      std::string::npos);
  m.y = &y.t;
  Tensor<float> x5({2, 5});
  m.x = &x5.t;
  EXPECT_NE(take(inst.table()->matmul(inst.object(), &m)).find("x's columns must be K 4"),
            std::string::npos);
  EXPECT_EQ(inst.cls().matmuls, 1);

  Instance<RowIntMatmul<4>, loom_quantizer_v1> four;  // has matmul, but not for 4 bits
  QuantCall c4;
  c4.f.bits = 4;
  Tensor<uint8_t> packed4({6}, kU8);
  m.x = &x.t;
  m.format = &c4.f;
  m.packed = &packed4.t;
  m.scales = &c4.scales.t;
  int32_t code = 0;
  EXPECT_NE(take(four.table()->matmul(four.object(), &m), &code).find("no matmul"),
            std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_UNIMPLEMENTED);
  EXPECT_EQ(four.cls().matmuls, 0);
}

// The kinds need no 1.5 host's services (the services table did not change in 1.5): a 1.4 or
// 1.1 host's table creates the instances, which plan and lay out.
TEST(SdkKinds, MoeAndQuantizerCreatedByOlderHosts) {
  const uint32_t v11 = LOOM_STRUCT_SIZE(loom_host_services, param_count);
  for (const auto& [minor, size] :
       {std::pair<uint16_t, uint32_t>{4, LOOM_HOST_SERVICES_SIZE}, {1, v11}}) {
    SCOPED_TRACE("ABI 1." + std::to_string(minor));
    Instance<TwoOfFour<>, loom_moe_v1> moe(minor, size);
    ASSERT_NE(moe.object(), nullptr);
    loom_moe_plan_args p = moe_plan_args();
    ASSERT_EQ(take(moe.table()->plan(moe.object(), &p)), "");
    EXPECT_EQ(p.top_k, 2);
    Instance<RowInt<false>, loom_quantizer_v1> q(minor, size);
    ASSERT_NE(q.object(), nullptr);
    const int64_t shape[2] = {2, 5};
    loom_quant_format f{};
    loom_quantizer_layout_args a = layout_args(shape, &f);
    ASSERT_EQ(take(q.table()->layout(q.object(), &a)), "");
    EXPECT_EQ(a.packed_bytes, 10u);
  }
}

}  // namespace
