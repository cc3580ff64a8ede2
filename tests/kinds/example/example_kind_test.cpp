// loom.example/1, the kind that exists only in tests, end to end: a host built with the
// example kind list (LOOM_EXTRA_KINDS, kinds.cpp recompiled, every other object as libloom's)
// creates an instance from [example.NAME] and calls its table; the stock `loom` command
// refuses the kind by name. lint.example_kind_is_three_places shows nothing else names it.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/example.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace {

std::string manifest(const std::string& body) {
  return "[loom]\nabi = 1\nplugin_path = [\"" LOOM_EXAMPLE_PLUGIN_DIR "\"]\n\n" + body;
}

TEST(ExampleKind, AHostWithTheKindInItsListCreatesAndCallsIt) {
  const std::string text = manifest("[example.count]\nplugin = \"example_kind\"\nstart = 10\n");
  loom_session* s = nullptr;
  ASSERT_EQ(loom_open_string(text.c_str(), "example.toml", nullptr, &s), LOOM_OK)
      << loom_last_error();
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(s, "example", "count", &inst), LOOM_OK) << loom_last_error();
  EXPECT_STREQ(loom_instance_kind(inst), LOOM_KIND_EXAMPLE);
  void* obj = nullptr;
  const void* vt = nullptr;
  ASSERT_EQ(loom_instance_table(inst, LOOM_KIND_EXAMPLE, LOOM_EXAMPLE_V1_MIN_SIZE, &obj, &vt),
            LOOM_OK)
      << loom_last_error();
  const auto* table = static_cast<const loom_example_v1*>(vt);
  loom_example_args a{LOOM_EXAMPLE_ARGS_SIZE, 3, 0};
  ASSERT_EQ(loom_instance_take_status(inst, table->run(obj, &a), nullptr, 0), LOOM_OK)
      << loom_last_error();
  EXPECT_EQ(a.result, 13);
  a.steps = 4;
  ASSERT_EQ(loom_instance_take_status(inst, table->run(obj, &a), nullptr, 0), LOOM_OK);
  EXPECT_EQ(a.result, 17);
  // The SDK's shared argument checks, reported through the host with the instance's name.
  a.steps = 0;
  EXPECT_EQ(loom_instance_take_status(inst, table->run(obj, &a), nullptr, 0),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(loom_last_error()).find("steps is 0; must be >= 1"), std::string::npos)
      << loom_last_error();
  loom_close(s);
}

TEST(ExampleKind, ItsSectionIsAmongTheKnownSectionsAndItsSchemaIsChecked) {
  loom_session* s = nullptr;
  const std::string misspelt = manifest("[exampel.x]\nplugin = \"example_kind\"\n");
  EXPECT_NE(loom_open_string(misspelt.c_str(), "example.toml", nullptr, &s), LOOM_OK);
  EXPECT_NE(std::string(loom_last_error()).find("(did you mean 'example'?)"), std::string::npos)
      << loom_last_error();
  const std::string bad = manifest("[example.x]\nplugin = \"example_kind\"\nstart = \"3\"\n");
  EXPECT_NE(loom_open_string(bad.c_str(), "example.toml", nullptr, &s), LOOM_OK);
  EXPECT_NE(std::string(loom_last_error()).find("start"), std::string::npos) << loom_last_error();
}

TEST(ExampleKind, TheStockHostRefusesTheKindByName) {
  const std::string cmd = std::string("'") + LOOM_STOCK_CLI + "' validate-plugin '" +
                          LOOM_EXAMPLE_PLUGIN_DIR + "/loom_example_kind.so' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  std::array<char, 4096> buf{};
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) out.append(buf.data(), n);
  const int status = pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_NE(out.find("does not know the kind loom.example/1"), std::string::npos) << out;
}

}  // namespace
