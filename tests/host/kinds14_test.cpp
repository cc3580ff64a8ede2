// The kind of ABI 1.4, loom.router/1, through the host: the plugin loads and describes
// (kinds14, plain C), the table-size check refuses a short router table (kinds14short), the
// manifest's [router.NAME] section validates against the plugin's schema, and an instance
// runs plan, select, gather, scatter and advance through loom_instance_table.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/abi.h>
#include <loom/embed.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "abi_version.hpp"
#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class Kinds14 : public loom_test::ManifestTest {
 protected:
  // The router instance `name` of the open session and its table.
  const loom_router_v1* router(const char* name, void** obj) {
    loom_instance* inst = nullptr;
    EXPECT_EQ(loom_find_instance(session_, "router", name, &inst), LOOM_OK) << loom_last_error();
    if (inst == nullptr) return nullptr;
    EXPECT_STREQ(loom_instance_kind(inst), LOOM_KIND_ROUTER);
    const void* raw = nullptr;
    EXPECT_EQ(loom_instance_table(inst, LOOM_KIND_ROUTER, LOOM_ROUTER_V1_MIN_SIZE, obj, &raw),
              LOOM_OK)
        << loom_last_error();
    return static_cast<const loom_router_v1*>(raw);
  }
};

// The status's message ("" for success), destroying it.
std::string take(loom_status* st, int32_t* code = nullptr) {
  if (code != nullptr) *code = st == nullptr ? LOOM_OK : st->code;
  if (st == nullptr) return "";
  std::string m = st->message;
  st->destroy(st);
  return m;
}

TEST_F(Kinds14, DescribeListsTheRouterKind) {
  char* raw = nullptr;
  ASSERT_EQ(loom_describe_plugins("kinds14", loom_test::plugin_dir().string().c_str(), &raw),
            LOOM_OK)
      << loom_last_error();
  const auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  ASSERT_EQ(doc["plugins"].size(), 1U);
  const auto& p = doc["plugins"][0];
  EXPECT_EQ(p["abi"], kHostAbi);
  ASSERT_EQ(p["kinds"].size(), 1U);
  EXPECT_EQ(p["kinds"][0]["kind"], LOOM_KIND_ROUTER);
  ASSERT_EQ(p["kinds"][0]["params"].size(), 1U);
  EXPECT_EQ(p["kinds"][0]["params"][0]["name"], "stride");
}

TEST_F(Kinds14, ShortRouterTableIsRefused) {
  EXPECT_EQ(check("[router.r]\nplugin = \"kinds14short\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("(loom.router/1) has a function table of " +
                                std::to_string(LOOM_ROUTER_V1_MIN_SIZE - 8) +
                                " bytes, smaller than the minimum " +
                                std::to_string(LOOM_ROUTER_V1_MIN_SIZE)));
}

TEST_F(Kinds14, RouterSectionValidatesAgainstTheSchema) {
  EXPECT_EQ(check("[router.r]\nplugin = \"kinds14\"\nstride = 3\n"), LOOM_OK) << error_;
  EXPECT_EQ(check("[router.r]\nplugin = \"kinds14\"\n"), LOOM_OK) << error_;
  // A parameter's range is checked at its key.
  EXPECT_EQ(check("[router.r]\nplugin = \"kinds14\"\nstride = 0\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 10)));
  EXPECT_THAT(error_, HasSubstr("stride"));
  EXPECT_EQ(check("[router.r]\nplugin = \"kinds14\"\nstrde = 3\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("unknown parameter 'strde' for router.r"));
  // A plugin that provides no router, named in a router section.
  EXPECT_EQ(check("[router.r]\nplugin = \"probe\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr(LOOM_KIND_ROUTER));
  // A misspelt section is pointed at the router one.
  EXPECT_EQ(check("[routr.r]\nplugin = \"kinds14\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("unknown section 'routr' (did you mean 'router'?)"));
}

TEST_F(Kinds14, InstanceRunsThroughItsTable) {
  ASSERT_EQ(open("[router.r]\nplugin = \"kinds14\"\nstride = 3\n"), LOOM_OK) << error_;
  void* obj = nullptr;
  const loom_router_v1* t = router("r", &obj);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->backward, nullptr);

  loom_router_plan_args plan{};
  plan.struct_size = LOOM_ROUTER_PLAN_ARGS_SIZE;
  plan.batch = 2;
  plan.seq_len = 7;
  plan.channels = 2;
  plan.step = 1;
  plan.layer = 1;
  plan.num_layers = 4;
  plan.training = 1;
  plan.dtype = {kDLFloat, 32, 1};
  ASSERT_EQ(take(t->plan(obj, &plan)), "");
  EXPECT_EQ(plan.kept, 3);  // positions 0, 3, 6
  EXPECT_EQ(plan.flags, LOOM_ROUTER_ROUTED);

  std::vector<int32_t> idx(6, -1);
  int64_t ishape[2] = {2, 3};
  DLTensor it{idx.data(), {kDLCPU, 0}, 2, {kDLInt, 32, 1}, ishape, nullptr, 0};
  loom_router_select_args sel{};
  sel.struct_size = LOOM_ROUTER_SELECT_ARGS_SIZE;
  sel.seed = 1;
  sel.step = 1;
  sel.batch = 2;
  sel.seq_len = 7;
  sel.channels = 2;
  sel.layer = 1;
  sel.num_layers = 4;
  sel.training = 1;
  sel.indices = &it;
  ASSERT_EQ(take(t->select(obj, &sel)), "");
  EXPECT_EQ(idx, (std::vector<int32_t>{0, 3, 6, 0, 3, 6}));

  std::vector<float> full(2 * 7 * 2);
  for (size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>(i);
  std::vector<float> kept(2 * 3 * 2, 0.0F);
  int64_t fshape[3] = {2, 7, 2};
  int64_t kshape[3] = {2, 3, 2};
  DLTensor ft{full.data(), {kDLCPU, 0}, 3, {kDLFloat, 32, 1}, fshape, nullptr, 0};
  DLTensor kt{kept.data(), {kDLCPU, 0}, 3, {kDLFloat, 32, 1}, kshape, nullptr, 0};
  loom_router_move_args mv{LOOM_ROUTER_MOVE_ARGS_SIZE, 0, &ft, &kt, &it, nullptr};
  ASSERT_EQ(take(t->gather(obj, &mv)), "");
  EXPECT_EQ(kept, (std::vector<float>{0, 1, 6, 7, 12, 13, 14, 15, 20, 21, 26, 27}));
  for (float& v : kept) v = -v;
  ASSERT_EQ(take(t->scatter(obj, &mv)), "");
  EXPECT_EQ(full[6], -6.0F);    // sequence 0, position 3
  EXPECT_EQ(full[2], 2.0F);     // sequence 0, position 1: bypassed, as it was
  EXPECT_EQ(full[26], -26.0F);  // sequence 1, position 6

  // advance: 4 layers * 8 sequences * ceil(5 / 3) = 64 layer tokens a step; the last step
  // again changes nothing; a gap is refused.
  loom_router_advance_args adv{};
  adv.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
  adv.batch = 8;
  adv.seq_len = 5;
  adv.num_layers = 4;
  for (int64_t step : {1, 2, 2}) {
    adv.step = step;
    ASSERT_EQ(take(t->advance(obj, &adv)), "") << step;
    EXPECT_EQ(adv.layer_tokens, 64) << step;
  }
  EXPECT_EQ(adv.consumed_layer_tokens, 128u);
  adv.step = 4;
  int32_t code = 0;
  EXPECT_THAT(take(t->advance(obj, &adv), &code), HasSubstr("the next step or the last one"));
  EXPECT_EQ(code, LOOM_ERR_FAILED_PRECONDITION);
}

TEST_F(Kinds14, InstanceTableChecksTheKind) {
  ASSERT_EQ(open("[router.r]\nplugin = \"kinds14\"\n"), LOOM_OK) << error_;
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(session_, LOOM_KIND_ROUTER, "r", &inst), LOOM_OK);
  void* obj = nullptr;
  const void* table = nullptr;
  EXPECT_EQ(loom_instance_table(inst, "sampler", 8, &obj, &table), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("is a loom.router/1 instance, not loom.sampler/1"));
  EXPECT_EQ(loom_instance_table(inst, "router", LOOM_ROUTER_V1_SIZE + 8, &obj, &table),
            LOOM_ERR_UNIMPLEMENTED);
  loom_instance* wrong = nullptr;
  EXPECT_NE(loom_find_instance(session_, "curriculum", "r", &wrong), LOOM_OK);
}

}  // namespace
