// The kinds of ABI 1.3, loom.curriculum/1 and loom.sampler/1, through the host: the plugin
// loads and describes (kinds13, plain C), the table-size check refuses a short curriculum
// table (kinds13short), the manifest's [curriculum.NAME] and [sampler.NAME] sections, a
// sampler's REF to a curriculum (created first, whatever the order in the file; refused when
// it names nothing or another kind), and loom_instance_table with the new kind IDs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/abi.h>
#include <loom/embed.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "abi_version.hpp"
#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class Kinds13 : public loom_test::ManifestTest {
 protected:
  loom_instance* find(const char* kind, const char* name) {
    loom_instance* inst = nullptr;
    EXPECT_EQ(loom_find_instance(session_, kind, name, &inst), LOOM_OK) << loom_last_error();
    return inst;
  }
};

const char* const kManifest =
    "[sampler.s]\nplugin = \"kinds13\"\nschedule = \"lin\"\n"
    "[curriculum.lin]\nplugin = \"kinds13\"\nmin_difficulty = 10.0\nmax_difficulty = 20.0\n"
    "total_steps = 3\n";

TEST_F(Kinds13, DescribeListsBothKindsAndTheRefKind) {
  char* raw = nullptr;
  ASSERT_EQ(loom_describe_plugins("kinds13", loom_test::plugin_dir().string().c_str(), &raw),
            LOOM_OK)
      << loom_last_error();
  const auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  ASSERT_EQ(doc["plugins"].size(), 1U);
  const auto& p = doc["plugins"][0];
  EXPECT_EQ(p["abi"], kHostAbi);
  ASSERT_EQ(p["kinds"].size(), 2U);
  EXPECT_EQ(p["kinds"][0]["kind"], LOOM_KIND_CURRICULUM);
  EXPECT_EQ(p["kinds"][0]["params"].size(), 3U);
  EXPECT_EQ(p["kinds"][1]["kind"], LOOM_KIND_SAMPLER);
  ASSERT_EQ(p["kinds"][1]["params"].size(), 1U);
  EXPECT_EQ(p["kinds"][1]["params"][0]["name"], "schedule");
  EXPECT_EQ(p["kinds"][1]["params"][0]["ref_kind"], LOOM_KIND_CURRICULUM);
}

TEST_F(Kinds13, ShortCurriculumTableIsRefused) {
  EXPECT_EQ(check("[curriculum.c]\nplugin = \"kinds13short\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr("(loom.curriculum/1) has a function table of " +
                                std::to_string(LOOM_CURRICULUM_V1_MIN_SIZE - 8) +
                                " bytes, smaller than the minimum " +
                                std::to_string(LOOM_CURRICULUM_V1_MIN_SIZE)));
}

TEST_F(Kinds13, SectionsValidateAgainstTheirSchemas) {
  EXPECT_EQ(check(kManifest), LOOM_OK) << error_;
  // A curriculum parameter's range is checked at its key.
  EXPECT_EQ(check("[curriculum.c]\nplugin = \"kinds13\"\ntotal_steps = 0\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 15)));
  EXPECT_THAT(error_, HasSubstr("total_steps"));
  // A REF may be left out (its default names nothing); this sampler then refuses at create.
  EXPECT_EQ(check("[sampler.s]\nplugin = \"kinds13\"\n"), LOOM_OK) << error_;
  EXPECT_EQ(open("[sampler.s]\nplugin = \"kinds13\"\n"), LOOM_ERR_FAILED_PRECONDITION);
  EXPECT_THAT(error_, HasSubstr("kinds13: parameter 'schedule' names no curriculum"));
  // A plugin that provides no sampler, named in a sampler section.
  EXPECT_EQ(check("[sampler.s]\nplugin = \"probe\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr(LOOM_KIND_SAMPLER));
}

TEST_F(Kinds13, SamplerRefMustNameACurriculum) {
  EXPECT_EQ(check("[sampler.s]\nplugin = \"kinds13\"\nschedule = \"nothing\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 12)));
  EXPECT_THAT(error_, HasSubstr("nothing"));
  EXPECT_EQ(
      check("[optimizer.o]\nplugin = \"probe\"\ntag = \"t\"\n[sampler.s]\nplugin = \"kinds13\"\n"
            "schedule = \"o\"\n"),
      LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(6, 12) +
                        "parameter 'schedule' of sampler.s must name a loom.curriculum/1 "
                        "instance, but 'o' is optimizer.o (loom.optimizer/1)");
}

TEST_F(Kinds13, InstancesRunThroughTheirTables) {
  ASSERT_EQ(open(kManifest), LOOM_OK) << error_;
  loom_instance* cur = find("curriculum", "lin");
  loom_instance* smp = find(LOOM_KIND_SAMPLER, "s");
  ASSERT_NE(cur, nullptr);
  ASSERT_NE(smp, nullptr);
  EXPECT_STREQ(loom_instance_kind(cur), LOOM_KIND_CURRICULUM);
  EXPECT_STREQ(loom_instance_kind(smp), LOOM_KIND_SAMPLER);

  void* cobj = nullptr;
  const void* raw = nullptr;
  ASSERT_EQ(loom_instance_table(cur, "curriculum", LOOM_CURRICULUM_V1_MIN_SIZE, &cobj, &raw),
            LOOM_OK)
      << loom_last_error();
  const auto* ct = static_cast<const loom_curriculum_v1*>(raw);
  loom_curriculum_plan_args plan{};
  plan.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
  ASSERT_EQ(ct->plan(cobj, &plan), nullptr);
  EXPECT_EQ(plan.roles, LOOM_CURRICULUM_METRIC | LOOM_CURRICULUM_SCHEDULE);
  EXPECT_EQ(ct->count, nullptr);

  std::vector<uint16_t> tokens(10, 1);
  std::vector<int64_t> offsets{0, 4, 10};
  std::vector<double> scores(2, 0.0);
  int64_t tshape = 10;
  int64_t oshape = 3;
  int64_t sshape = 2;
  DLTensor tt{tokens.data(), {kDLCPU, 0}, 1, {kDLUInt, 16, 1}, &tshape, nullptr, 0};
  DLTensor ot{offsets.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, &oshape, nullptr, 0};
  DLTensor st{scores.data(), {kDLCPU, 0}, 1, {kDLFloat, 64, 1}, &sshape, nullptr, 0};
  loom_curriculum_score_args sa{};
  sa.struct_size = LOOM_CURRICULUM_SCORE_ARGS_SIZE;
  sa.samples = {LOOM_CURRICULUM_SAMPLES_SIZE, 0, &tt, &ot};
  sa.vocab_size = 2;
  sa.scores = &st;
  ASSERT_EQ(ct->score(cobj, &sa), nullptr);
  EXPECT_EQ(scores, (std::vector<double>{4.0, 6.0}));

  // The sampler was created after the curriculum it REFs, though declared first, and draws
  // at the schedule's difficulty: 10 at step 1, 15 at 2, 20 from 3 on.
  void* sobj = nullptr;
  ASSERT_EQ(loom_instance_table(smp, LOOM_KIND_SAMPLER, LOOM_SAMPLER_V1_MIN_SIZE, &sobj, &raw),
            LOOM_OK)
      << loom_last_error();
  const auto* sm = static_cast<const loom_sampler_v1*>(raw);
  loom_sampler_plan_args sp{};
  sp.struct_size = LOOM_SAMPLER_PLAN_ARGS_SIZE;
  sp.dataset_size = 7;
  sp.global_batch = 4;
  sp.world_size = 2;
  ASSERT_EQ(sm->plan(sobj, &sp), nullptr);
  EXPECT_EQ(sp.capacity, 2);
  std::vector<int64_t> ids(2, -1);
  int64_t ishape = 2;
  DLTensor it{ids.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, &ishape, nullptr, 0};
  const double want[] = {10.0, 15.0, 20.0, 20.0};
  for (int64_t step = 1; step <= 4; ++step) {
    loom_sampler_next_args na{};
    na.struct_size = LOOM_SAMPLER_NEXT_ARGS_SIZE;
    na.step = step;
    na.rank = 1;
    na.world_size = 2;
    na.indices = &it;
    ASSERT_EQ(sm->next(sobj, &na), nullptr);
    EXPECT_EQ(na.count, 2);
    EXPECT_EQ(na.difficulty, want[step - 1]) << step;
    // Rank 1 of 2 takes slots 2 and 3 of ids (step - 1) * 4 + j mod 7.
    EXPECT_EQ(ids[0], ((step - 1) * 4 + 2) % 7) << step;
    EXPECT_EQ(ids[1], ((step - 1) * 4 + 3) % 7) << step;
  }
}

TEST_F(Kinds13, InstanceTableChecksTheKind) {
  ASSERT_EQ(open(kManifest), LOOM_OK) << error_;
  loom_instance* cur = find(LOOM_KIND_CURRICULUM, "lin");
  void* obj = nullptr;
  const void* table = nullptr;
  EXPECT_EQ(loom_instance_table(cur, "sampler", LOOM_SAMPLER_V1_MIN_SIZE, &obj, &table),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("is a loom.curriculum/1 instance, not loom.sampler/1"));
  EXPECT_EQ(
      loom_instance_table(cur, LOOM_KIND_CURRICULUM, LOOM_CURRICULUM_V1_SIZE + 8, &obj, &table),
      LOOM_ERR_UNIMPLEMENTED);
  EXPECT_THAT(loom_last_error(),
              HasSubstr("the caller needs " + std::to_string(LOOM_CURRICULUM_V1_SIZE + 8)));
  // The section name and the kind ID find the same instance.
  loom_instance* by_id = nullptr;
  ASSERT_EQ(loom_find_instance(session_, "loom.curriculum/1", "lin", &by_id), LOOM_OK);
  EXPECT_EQ(by_id, cur);
  loom_instance* wrong = nullptr;
  EXPECT_NE(loom_find_instance(session_, "sampler", "lin", &wrong), LOOM_OK);
}

}  // namespace
