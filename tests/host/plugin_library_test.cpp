// host/src/plugin_library.cpp and elf_check.cpp: loading plugins built for other ABI
// versions, broken files, unsafe folders and plugins that throw. Each error names the
// plugin's file; the host stays usable afterwards.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "abi_version.hpp"
#include "loom_test.hpp"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

struct Described {
  int32_t rc = LOOM_OK;
  nlohmann::json doc;
  std::string last_error;  // loom_last_error() right after the call
  int32_t last_code = LOOM_OK;
};

Described describe(const char* name, const std::string& plugin_path) {
  char* raw = nullptr;
  Described d;
  d.rc = loom_describe_plugins(name, plugin_path.c_str(), &raw);
  d.last_error = loom_last_error();
  d.last_code = loom_last_error_code();
  if (raw != nullptr) {
    d.doc = nlohmann::json::parse(raw);
    loom_free_string(raw);
  }
  return d;
}

std::string first_error(const Described& d) {
  if (!d.doc.contains("errors") || d.doc["errors"].empty()) return "";
  return d.doc["errors"][0]["error"].get<std::string>();
}

class PluginLibrary : public loom_test::ManifestTest {};

TEST_F(PluginLibrary, OlderMinorWithSmallerStructsLoads) {
  const auto d = describe("oldminor", loom_test::plugin_dir().string());
  ASSERT_EQ(d.rc, LOOM_OK) << d.doc.dump(2);
  ASSERT_EQ(d.doc["plugins"].size(), 1U);
  const auto& p = d.doc["plugins"][0];
  EXPECT_EQ(p["abi"], "1.0");
  ASSERT_EQ(p["kinds"].size(), 1U);
  const auto& k = p["kinds"][0];
  EXPECT_EQ(k["kind"], "loom.optimizer/1");
  EXPECT_EQ(k["has_state"], false);  // its factory ends before export_state
  ASSERT_EQ(k["params"].size(), 2U);
  EXPECT_EQ(k["params"][0]["name"], "scale");
  EXPECT_EQ(k["params"][0]["default"], 1.0);
  EXPECT_EQ(k["params"][0]["max"], 10.0);
  EXPECT_FALSE(k["params"][0].contains("choices"));  // absent in its smaller spec
  EXPECT_EQ(k["params"][1]["name"], "note");
  EXPECT_EQ(k["params"][1]["default"], "none");
}

TEST_F(PluginLibrary, OlderMinorValidatesCreatesAndSteps) {
  EXPECT_EQ(check("[optimizer.o]\nplugin = \"oldminor\"\nscale = 11\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 9) + "parameter 'scale' of optimizer.o = 11 is out of range [0, 10]");

  ASSERT_EQ(open("[optimizer.o]\nplugin = \"oldminor\"\nscale = 2.0\nnote = \"old\"\n"), LOOM_OK)
      << error_;
  loom_instance* opt = nullptr;
  ASSERT_EQ(loom_find_instance(session_, "optimizer", "o", &opt), LOOM_OK);
  EXPECT_STREQ(loom_instance_plugin(opt), "oldminor");
  float p[3] = {1.0F, 2.0F, 3.0F};
  const float g[3] = {0.5F, -1.0F, 0.0F};
  float* params[] = {p};
  const float* grads[] = {g};
  const int64_t numels[] = {3};
  ASSERT_EQ(loom_optimizer_step_f32(opt, params, grads, numels, 1, 0.1), LOOM_OK)
      << loom_last_error();
  EXPECT_FLOAT_EQ(p[0], 1.0F - 0.1F * 2.0F * 0.5F);
  EXPECT_FLOAT_EQ(p[1], 2.0F + 0.1F * 2.0F * 1.0F);
  EXPECT_FLOAT_EQ(p[2], 3.0F);

  // Its optimizer table ends before comm_info: the host reports no communication.
  loom_optimizer_comm_info info{};
  info.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
  info.rounds = 99;
  EXPECT_EQ(loom_optimizer_get_comm_info(opt, &info), LOOM_OK) << loom_last_error();
  EXPECT_EQ(info.owns_communication, 0);
  EXPECT_EQ(info.rounds, 0U);

  // No export_state/import_state in its factory: an empty state, and a non-empty one refused.
  size_t size = 123;
  EXPECT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), LOOM_OK);
  EXPECT_EQ(size, 0U);
  EXPECT_EQ(loom_instance_import_state(opt, "x", 1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("has no state"));
}

TEST_F(PluginLibrary, OtherMajorIsRefusedNamingBothVersions) {
  const std::string file = loom_test::plugin_file("major2").string();
  EXPECT_EQ(check("[optimizer.x]\nplugin = \"major2\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(2, 10) + "optimizer.x: plugin file " + file + ": "));
  EXPECT_THAT(error_, HasSubstr("built for Loom ABI 2"));
  EXPECT_THAT(error_, HasSubstr("this host speaks ABI " + kHostAbi));

  const auto d = describe("major2", loom_test::plugin_dir().string());
  EXPECT_EQ(d.rc, LOOM_ERR_ABI_MISMATCH);
  EXPECT_THAT(first_error(d), HasSubstr("built for Loom ABI 2"));
}

TEST_F(PluginLibrary, LibraryWithoutEntrySymbolIsRefused) {
  const std::string file = loom_test::plugin_file("nosymbol").string();
  EXPECT_EQ(check("[comm.x]\nplugin = \"nosymbol\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(2, 10) + "comm.x: plugin file " + file + ": "));
  EXPECT_THAT(error_, HasSubstr("has no entry symbol loom_plugin_entry_v1"));

  const auto d = describe("nosymbol", loom_test::plugin_dir().string());
  EXPECT_EQ(d.rc, LOOM_ERR_NOT_FOUND);
  EXPECT_THAT(first_error(d), HasSubstr("has no entry symbol loom_plugin_entry_v1"));
}

// A failing describe sets the thread's last error like every other call (its message is the
// one in "errors"); a succeeding one clears a stale error.
TEST_F(PluginLibrary, DescribeFailureSetsLastError) {
  const auto broken = describe("major2", loom_test::plugin_dir().string());
  ASSERT_EQ(broken.rc, LOOM_ERR_ABI_MISMATCH);
  EXPECT_EQ(broken.last_code, LOOM_ERR_ABI_MISMATCH);
  EXPECT_EQ(broken.last_error, first_error(broken));
  EXPECT_THAT(broken.last_error, HasSubstr("built for Loom ABI 2"));

  const auto missing = describe("no_such_plugin", loom_test::plugin_dir().string());
  EXPECT_NE(missing.rc, LOOM_OK);
  EXPECT_EQ(missing.last_code, missing.rc);
  EXPECT_THAT(missing.last_error, HasSubstr("no_such_plugin"));

  const auto ok = describe("probe", loom_test::plugin_dir().string());
  ASSERT_EQ(ok.rc, LOOM_OK) << ok.doc.dump(2);
  EXPECT_EQ(ok.last_code, LOOM_OK);
  EXPECT_EQ(ok.last_error, "");

  EXPECT_EQ(loom_describe_plugins("probe", nullptr, nullptr), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(loom_last_error_code(), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(loom_last_error(), "loom_describe_plugins: json_out must not be NULL");
}

TEST_F(PluginLibrary, TruncatedLibraryIsRefused) {
  loom_test::TempDir dir;
  const fs::path copy = dir.path() / "loom_truncated.so";
  fs::copy_file(loom_test::plugin_file("probe"), copy);
  fs::resize_file(copy, fs::file_size(copy) / 2);
  const auto d = describe("truncated", dir.path().string());
  EXPECT_EQ(d.rc, LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(first_error(d), StartsWith("plugin file " + copy.string() + ": truncated"));

  const auto manifest = dir.write("m.toml", "[comm.x]\nplugin = \"truncated\"\n");
  const auto r = loom_test::open_file(manifest, false, dir.path().string());
  EXPECT_EQ(r.rc, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(r.error, StartsWith(manifest.string() + ":2:10: comm.x: plugin file " +
                                  copy.string() + ": truncated"));
}

TEST_F(PluginLibrary, NonElfFileIsRefused) {
  loom_test::TempDir dir;
  dir.write("loom_garbage.so",
            "This is not a shared library, just text that is long enough to hold an ELF "
            "header, so that the magic-number check is the one that fails.\n");
  const auto d = describe("garbage", dir.path().string());
  EXPECT_EQ(d.rc, LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(first_error(d), HasSubstr("loom_garbage.so: not a shared library"));
  EXPECT_THAT(first_error(d), HasSubstr("ELF magic"));
}

TEST_F(PluginLibrary, GroupWritableFolderIsRefused) {
  loom_test::TempDir dir;
  const fs::path unsafe = dir.path() / "shared";
  fs::create_directory(unsafe);
  ASSERT_EQ(::chmod(unsafe.c_str(), 0775), 0);
  const fs::path copy = unsafe / "loom_probe.so";
  fs::copy_file(loom_test::plugin_file("probe"), copy);
  ASSERT_EQ(::chmod(copy.c_str(), 0755), 0);  // the file itself is fine; its folder is not

  const auto d = describe("probe", unsafe.string());
  EXPECT_EQ(d.rc, LOOM_ERR_FAILED_PRECONDITION);
  EXPECT_THAT(first_error(d),
              HasSubstr(unsafe.string() + " can be written by users other than its owner"));
  EXPECT_THAT(first_error(d), HasSubstr("chmod go-w"));

  // The same plugin from a safe folder loads.
  ASSERT_EQ(::chmod(unsafe.c_str(), 0755), 0);
  EXPECT_EQ(describe("probe", unsafe.string()).rc, LOOM_OK);
}

TEST_F(PluginLibrary, GroupWritableFileIsRefused) {
  loom_test::TempDir dir;
  const fs::path copy = dir.path() / "loom_probe.so";
  fs::copy_file(loom_test::plugin_file("probe"), copy);
  ASSERT_EQ(::chmod(copy.c_str(), 0666), 0);
  const auto d = describe("probe", dir.path().string());
  EXPECT_EQ(d.rc, LOOM_ERR_FAILED_PRECONDITION);
  EXPECT_THAT(first_error(d),
              HasSubstr(copy.string() + " can be written by users other than its owner"));
}

TEST_F(PluginLibrary, ThrowingCreateIsReportedAndTheHostLivesOn) {
  const std::string file = loom_test::plugin_file("thrower").string();
  EXPECT_EQ(
      open(
          "[optimizer.ok]\nplugin = \"probe\"\ntag = \"t\"\n\n[comm.boom]\nplugin = \"thrower\"\n"),
      LOOM_ERR_INTERNAL);
  EXPECT_EQ(session_, nullptr);
  EXPECT_THAT(error_, StartsWith(at(5, 1) + "comm.boom (plugin 'thrower' (" + file +
                                 ")): create failed: "));
  EXPECT_THAT(error_, HasSubstr("threw an exception: thrower: comm create exploded"));

  // Still alive: the next session works.
  ASSERT_EQ(open("[optimizer.ok]\nplugin = \"probe\"\ntag = \"t\"\n"), LOOM_OK) << error_;
}

TEST_F(PluginLibrary, FailingStepIsReportedAndTheNextCallWorks) {
  const std::string file = loom_test::plugin_file("thrower").string();
  ASSERT_EQ(open("[optimizer.bad]\nplugin = \"thrower\"\n\n[optimizer.worse]\nplugin = "
                 "\"thrower\"\nthrow_in_step = true\n\n[optimizer.good]\nplugin = \"probe\"\ntag = "
                 "\"t\"\n"),
            LOOM_OK)
      << error_;
  loom_instance* bad = nullptr;
  loom_instance* worse = nullptr;
  loom_instance* good = nullptr;
  ASSERT_EQ(loom_find_instance(session_, "optimizer", "bad", &bad), LOOM_OK);
  ASSERT_EQ(loom_find_instance(session_, "optimizer", "worse", &worse), LOOM_OK);
  ASSERT_EQ(loom_find_instance(session_, "optimizer", "good", &good), LOOM_OK);
  float p[1] = {1.0F};
  const float g[1] = {1.0F};
  float* params[] = {p};
  const float* grads[] = {g};
  const int64_t numels[] = {1};

  for (int i = 1; i <= 2; ++i) {
    EXPECT_EQ(loom_optimizer_step_f32(bad, params, grads, numels, 1, 0.5),
              LOOM_ERR_FAILED_PRECONDITION);
    const std::string e = loom_last_error();
    EXPECT_THAT(e, HasSubstr("optimizer.bad (plugin 'thrower' (" + file + "))"));
    EXPECT_THAT(e, HasSubstr("thrower: step " + std::to_string(i) + " refused"));
    EXPECT_EQ(loom_last_error_code(), LOOM_ERR_FAILED_PRECONDITION);
  }
  for (int i = 1; i <= 2; ++i) {
    EXPECT_EQ(loom_optimizer_step_f32(worse, params, grads, numels, 1, 0.5), LOOM_ERR_INTERNAL);
    const std::string e = loom_last_error();
    EXPECT_THAT(e, HasSubstr("optimizer.worse (plugin 'thrower' (" + file + "))"));
    EXPECT_THAT(e,
                HasSubstr("threw an exception: thrower: step " + std::to_string(i) + " exploded"));
  }
  EXPECT_EQ(p[0], 1.0F);
  EXPECT_EQ(loom_optimizer_step_f32(good, params, grads, numels, 1, 0.5), LOOM_OK)
      << loom_last_error();
  EXPECT_EQ(p[0], 0.5F);
  EXPECT_STREQ(loom_last_error(), "");
}

TEST_F(PluginLibrary, PluginsListsEveryFileAndItsErrors) {
  const auto d = describe(nullptr, loom_test::plugin_dir().string());
  EXPECT_EQ(d.rc, LOOM_OK);
  std::vector<std::string> names;
  for (const auto& p : d.doc["plugins"]) names.push_back(p["name"]);
  EXPECT_THAT(names, ::testing::IsSupersetOf({"probe", "oldminor", "thrower"}));
  std::string errors;
  for (const auto& e : d.doc["errors"]) errors += e["error"].get<std::string>() + "\n";
  EXPECT_THAT(errors, HasSubstr("loom_major2.so"));
  EXPECT_THAT(errors, HasSubstr("loom_nosymbol.so"));
  EXPECT_EQ(d.doc["search_path"][0], loom_test::plugin_dir().string());
}

}  // namespace
