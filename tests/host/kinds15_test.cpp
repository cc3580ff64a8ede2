// The kinds of ABI 1.5, loom.moe/1 and loom.quantizer/1, through the host: the plugin loads and
// describes both (kinds15, plain C), the table-size check refuses a short MoE table
// (kinds15shortmoe) and a short quantizer table (kinds15shortquant), the manifest's
// [moe.NAME] and [quantizer.NAME] sections validate against the plugin's schemas, and
// instances run plan / forward and layout / quantize / dequantize through loom_instance_table,
// with the optional entries NULL.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/abi.h>
#include <loom/embed.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "abi_version.hpp"
#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class Kinds15 : public loom_test::ManifestTest {
 protected:
  // The table of instance `name` of kind `section` in the open session.
  const void* table(const char* section, const char* kind, uint32_t min_size, const char* name,
                    void** obj) {
    loom_instance* inst = nullptr;
    EXPECT_EQ(loom_find_instance(session_, section, name, &inst), LOOM_OK) << loom_last_error();
    if (inst == nullptr) return nullptr;
    EXPECT_STREQ(loom_instance_kind(inst), kind);
    const void* raw = nullptr;
    EXPECT_EQ(loom_instance_table(inst, kind, min_size, obj, &raw), LOOM_OK) << loom_last_error();
    return raw;
  }
};

std::string take(loom_status* st, int32_t* code = nullptr) {
  if (code != nullptr) *code = st == nullptr ? LOOM_OK : st->code;
  if (st == nullptr) return "";
  std::string m = st->message;
  st->destroy(st);
  return m;
}

DLTensor host_tensor(void* data, DLDataType dtype, int32_t ndim, int64_t* shape) {
  return DLTensor{data, {kDLCPU, 0}, ndim, dtype, shape, nullptr, 0};
}

constexpr DLDataType kF32{kDLFloat, 32, 1};

TEST_F(Kinds15, DescribeListsBothKinds) {
  char* raw = nullptr;
  ASSERT_EQ(loom_describe_plugins("kinds15", loom_test::plugin_dir().string().c_str(), &raw),
            LOOM_OK)
      << loom_last_error();
  const auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  ASSERT_EQ(doc["plugins"].size(), 1U);
  const auto& p = doc["plugins"][0];
  EXPECT_EQ(p["abi"], kHostAbi);
  ASSERT_EQ(p["kinds"].size(), 2U);
  EXPECT_EQ(p["kinds"][0]["kind"], LOOM_KIND_MOE);
  EXPECT_EQ(p["kinds"][0]["params"][0]["name"], "num_experts");
  EXPECT_EQ(p["kinds"][1]["kind"], LOOM_KIND_QUANTIZER);
  EXPECT_EQ(p["kinds"][1]["params"][0]["name"], "bits");
}

TEST_F(Kinds15, ShortTablesAreRefused) {
  EXPECT_EQ(check("[moe.m]\nplugin = \"kinds15shortmoe\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(
      error_,
      HasSubstr("(loom.moe/1) has a function table of " + std::to_string(LOOM_MOE_V1_MIN_SIZE - 8) +
                " bytes, smaller than the minimum " + std::to_string(LOOM_MOE_V1_MIN_SIZE)));
  EXPECT_EQ(check("[quantizer.q]\nplugin = \"kinds15shortquant\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("(loom.quantizer/1) has a function table of " +
                                std::to_string(LOOM_QUANTIZER_V1_MIN_SIZE - 8) +
                                " bytes, smaller than the minimum " +
                                std::to_string(LOOM_QUANTIZER_V1_MIN_SIZE)));
}

TEST_F(Kinds15, SectionsValidateAgainstTheSchemas) {
  EXPECT_EQ(check("[moe.m]\nplugin = \"kinds15\"\nnum_experts = 4\n"
                  "[quantizer.q]\nplugin = \"kinds15\"\nbits = 8\n"),
            LOOM_OK)
      << error_;
  EXPECT_EQ(check("[moe.m]\nplugin = \"kinds15\"\nnum_experts = 0\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 15)));
  EXPECT_THAT(error_, HasSubstr("num_experts"));
  EXPECT_EQ(check("[quantizer.q]\nplugin = \"kinds15\"\nbits = 4\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 8)));
  EXPECT_EQ(check("[quantizer.q]\nplugin = \"kinds15\"\nbitz = 8\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("unknown parameter 'bitz' for quantizer.q"));
  // A plugin that provides no MoE layer, named in a moe section.
  EXPECT_EQ(check("[moe.m]\nplugin = \"probe\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr(LOOM_KIND_MOE));
  EXPECT_EQ(check("[quantiser.q]\nplugin = \"kinds15\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("unknown section 'quantiser' (did you mean 'quantizer'?)"));
}

TEST_F(Kinds15, MoeInstanceRunsThroughItsTable) {
  ASSERT_EQ(open("[moe.m]\nplugin = \"kinds15\"\n"), LOOM_OK) << error_;
  void* obj = nullptr;
  const auto* t =
      static_cast<const loom_moe_v1*>(table("moe", LOOM_KIND_MOE, LOOM_MOE_V1_MIN_SIZE, "m", &obj));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dispatch, nullptr);
  EXPECT_EQ(t->combine, nullptr);
  EXPECT_EQ(t->reduce_gradients, nullptr);

  loom_moe_plan_args plan{};
  plan.struct_size = LOOM_MOE_PLAN_ARGS_SIZE;
  plan.tokens = 2;
  plan.model_dim = 2;
  plan.hidden_dim = 1;
  plan.num_layers = 1;
  plan.dtype = kF32;
  ASSERT_EQ(take(t->plan(obj, &plan)), "");
  EXPECT_EQ(plan.experts, 2);  // the parameter's default
  EXPECT_EQ(plan.top_k, 1);
  EXPECT_EQ(plan.capacity, 2);

  // Expert 0 sees feature 0, expert 1 feature 1; each MLP is the identity on its feature.
  std::vector<float> x = {3, 1, -1, 2}, y(4, 9.0F);
  std::vector<float> gate = {1, 0, 0, 1}, w1 = {1, 0, 0, 1}, b1 = {0, 0};
  std::vector<float> w2 = {1, 0, 0, 1}, b2 = {0, 0, 0, 0};
  int64_t xs[2] = {2, 2}, gs[2] = {2, 2}, w1s[3] = {2, 1, 2}, b1s[2] = {2, 1}, w2s[3] = {2, 2, 1},
          b2s[2] = {2, 2};
  DLTensor xt = host_tensor(x.data(), kF32, 2, xs), yt = host_tensor(y.data(), kF32, 2, xs);
  DLTensor gt = host_tensor(gate.data(), kF32, 2, gs), w1t = host_tensor(w1.data(), kF32, 3, w1s),
           b1t = host_tensor(b1.data(), kF32, 2, b1s), w2t = host_tensor(w2.data(), kF32, 3, w2s),
           b2t = host_tensor(b2.data(), kF32, 2, b2s);
  loom_moe_weights w{LOOM_MOE_WEIGHTS_SIZE,
                     0,
                     &gt,
                     &w1t,
                     &b1t,
                     &w2t,
                     &b2t,
                     nullptr,
                     nullptr,
                     nullptr,
                     nullptr,
                     nullptr,
                     nullptr};
  int64_t load[2] = {-1, -1};
  loom_moe_stats stats{LOOM_MOE_STATS_SIZE, 0, 1.0, 1, 1, load, 2};
  loom_moe_forward_args f{};
  f.struct_size = LOOM_MOE_FORWARD_ARGS_SIZE;
  f.step = 1;
  f.tokens = 2;
  f.model_dim = 2;
  f.hidden_dim = 1;
  f.num_layers = 1;
  f.x = &xt;
  f.weights = &w;
  f.y = &yt;
  f.stats = &stats;
  ASSERT_EQ(take(t->forward(obj, &f)), "");
  // Token 0 (3, 1) picks expert 0 with p = 1 / (1 + e^-2); token 1 (-1, 2) expert 1, p = 1 /
  // (1 + e^-3); the identity expert passes its feature (ReLU keeps the positive one).
  const float p0 = static_cast<float>(1.0 / (1.0 + std::exp(-2.0)));
  const float p1 = static_cast<float>(1.0 / (1.0 + std::exp(-3.0)));
  EXPECT_NEAR(y[0], p0 * 3, 1e-5);
  EXPECT_EQ(y[1], 0.0F);
  EXPECT_EQ(y[2], 0.0F);
  EXPECT_NEAR(y[3], p1 * 2, 1e-5);
  EXPECT_EQ(load[0], 1);
  EXPECT_EQ(load[1], 1);

  loom_moe_backward_args b{};
  b.struct_size = LOOM_MOE_BACKWARD_ARGS_SIZE;
  int32_t code = 0;
  EXPECT_THAT(take(t->backward(obj, &b), &code), HasSubstr("no backward"));
  EXPECT_EQ(code, LOOM_ERR_UNIMPLEMENTED);
}

TEST_F(Kinds15, QuantizerInstanceRunsThroughItsTable) {
  ASSERT_EQ(open("[quantizer.q]\nplugin = \"kinds15\"\n"), LOOM_OK) << error_;
  void* obj = nullptr;
  const auto* t = static_cast<const loom_quantizer_v1*>(
      table("quantizer", LOOM_KIND_QUANTIZER, LOOM_QUANTIZER_V1_MIN_SIZE, "q", &obj));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->matmul, nullptr);

  int64_t shape[2] = {2, 3};
  loom_quant_format fmt{};
  fmt.struct_size = LOOM_QUANT_FORMAT_SIZE;
  loom_quantizer_layout_args l{};
  l.struct_size = LOOM_QUANTIZER_LAYOUT_ARGS_SIZE;
  l.role = LOOM_QUANTIZER_WEIGHT;
  l.ndim = 2;
  l.shape = shape;
  l.dtype = kF32;
  l.format = &fmt;
  ASSERT_EQ(take(t->layout(obj, &l)), "");
  EXPECT_EQ(l.flags & LOOM_QUANTIZER_HAS_MATMUL, 0u);
  EXPECT_EQ(l.packed_bytes, 6u);
  EXPECT_EQ(l.scale_count, 2);
  EXPECT_EQ(fmt.bits, 8u);
  EXPECT_EQ(fmt.group_size, 3);
  EXPECT_EQ(fmt.shape, shape);

  std::vector<float> x = {1.27F, -0.5F, 0.0F, 0.0F, 0.0F, 0.0F};
  std::vector<uint8_t> codes(6, 0xAA);
  std::vector<float> scales(2, -1.0F);
  int64_t ps[1] = {6}, ss[1] = {2};
  DLTensor xt = host_tensor(x.data(), kF32, 2, shape);
  DLTensor pt = host_tensor(codes.data(), DLDataType{kDLUInt, 8, 1}, 1, ps);
  DLTensor st = host_tensor(scales.data(), kF32, 1, ss);
  loom_quantizer_quantize_args q{};
  q.struct_size = LOOM_QUANTIZER_QUANTIZE_ARGS_SIZE;
  q.role = LOOM_QUANTIZER_WEIGHT;
  q.format = &fmt;
  q.x = &xt;
  q.packed = &pt;
  q.scales = &st;
  ASSERT_EQ(take(t->quantize(obj, &q)), "");
  EXPECT_FLOAT_EQ(scales[0], 0.01F);
  EXPECT_EQ(scales[1], 1.0F);  // an all-zero row
  EXPECT_EQ(codes[0], 127);
  EXPECT_EQ(static_cast<int8_t>(codes[1]), -50);
  EXPECT_EQ(codes[3], 0);
  std::fill(x.begin(), x.end(), 7.0F);
  ASSERT_EQ(take(t->dequantize(obj, &q)), "");
  EXPECT_FLOAT_EQ(x[0], 1.27F);
  EXPECT_FLOAT_EQ(x[1], -0.5F);
  EXPECT_EQ(x[4], 0.0F);
}

}  // namespace
