// host/src/manifest.cpp: TOML syntax and the structural checks that need no plugin
// (sections, the [loom] table, instance tables). Every error names FILE:LINE:COL.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "abi_version.hpp"
#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class Manifest : public loom_test::ManifestTest {};

TEST_F(Manifest, ValidManifestPasses) {
  EXPECT_EQ(check("[loom]\nabi = 1\nlog_level = \"warn\"\n\n"
                  "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n"),
            LOOM_OK)
      << error_;
  EXPECT_EQ(error_, "");
}

TEST_F(Manifest, TomlSyntaxErrorNamesItsPlace) {
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"probe\"\ntag = = 1\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 7) + "TOML syntax error: "));
  EXPECT_EQ(loom_test::lines(error_).size(), 1U) << error_;
}

TEST_F(Manifest, NonAsciiOutsideStringsIsASyntaxError) {
  // Inputs that drive toml++ 3.3 into TOML_UNREACHABLE (marzer/tomlplusplus#190, #295):
  // they must be plain syntax errors (the fuzzer checks the same under UBSan).
  EXPECT_EQ(check("[\xc5\x9f.e[\x01"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(1, 2) + "TOML syntax error: "));
  EXPECT_EQ(check("\xcc\xaa"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(1, 1) + "TOML syntax error: "));
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"probe\"\n\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87 = 1\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, StartsWith(at(3, 1) + "TOML syntax error: "));
  // Inside strings, non-ASCII text is fine.
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"probe\"\ntag = \"\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87 "
                  "\xc2\xa7\"\n"),
            LOOM_OK)
      << error_;
}

TEST_F(Manifest, UnknownSectionSuggestsTheClosestOne) {
  EXPECT_EQ(check("[optimzer.x]\nplugin = \"probe\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_,
            at(1, 2) +
                "unknown section 'optimzer' (did you mean 'optimizer'?); known sections: "
                "loom, optimizer, comm, codec, curriculum, sampler, router, moe, quantizer");
}

TEST_F(Manifest, UnknownSectionFarFromAnyGetsNoSuggestion) {
  EXPECT_EQ(check("[trainer.x]\nplugin = \"probe\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(1, 2) +
                        "unknown section 'trainer'; known sections: loom, optimizer, comm, codec, "
                        "curriculum, sampler, router, moe, quantizer");
}

TEST_F(Manifest, UnknownLoomKeySuggestsTheClosestOne) {
  EXPECT_EQ(check("[loom]\nabi = 1\nplugn_path = []\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 1) +
                        "unknown key 'plugn_path' in [loom] (did you mean 'plugin_path'?); [loom] "
                        "takes abi, plugin_path and log_level");
}

TEST_F(Manifest, OtherAbiMajorIsRejected) {
  EXPECT_EQ(check("[loom]\nabi = 2\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(2, 7) + "[loom] abi = 2 is not supported: this host speaks ABI " + kHostAbi);
}

TEST_F(Manifest, LoomKeysOfTheWrongType) {
  EXPECT_EQ(check("[loom]\nabi = \"1\"\nplugin_path = \"plugins\"\nlog_level = \"loud\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  const auto l = loom_test::lines(error_);
  ASSERT_EQ(l.size(), 3U) << error_;
  EXPECT_EQ(l[0], at(2, 7) + "[loom] abi must be an integer, not a string");
  EXPECT_EQ(l[1], at(3, 15) + "[loom] plugin_path must be an array of strings, not a string");
  EXPECT_EQ(l[2], at(4, 13) +
                      "[loom] log_level must be one of trace, debug, info, warn, error, off, not "
                      "'loud'");
}

TEST_F(Manifest, MissingPluginKey) {
  EXPECT_EQ(check("[optimizer.main]\ntag = \"t\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(1, 1) +
                        "optimizer.main is missing required key 'plugin' (the plugin that "
                        "implements it, e.g. plugin = \"name\")");
}

TEST_F(Manifest, PluginKeyMustBeAString) {
  EXPECT_EQ(check("[optimizer.main]\nplugin = 3\ntag = \"t\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_,
            at(2, 10) + "optimizer.main: plugin must be a plugin name string, not an integer");
}

TEST_F(Manifest, SectionMustHoldTables) {
  EXPECT_EQ(check("optimizer = 1\ncomm.x = 2\n"), LOOM_ERR_INVALID_ARGUMENT);
  const auto l = loom_test::lines(error_);
  ASSERT_EQ(l.size(), 2U) << error_;
  EXPECT_EQ(l[0], at(1, 1) + "'optimizer' must be a table of instances: write [optimizer.NAME]");
  EXPECT_EQ(l[1], at(2, 6) +
                      "'comm.x' must be a table: instances are declared as [comm.NAME] with "
                      "plugin = \"...\" inside");
}

TEST_F(Manifest, RelativePluginPathResolvesAgainstTheManifest) {
  // No plugin folder from the options: only the manifest's relative plugin_path finds probe.
  const auto rel = std::filesystem::relative(loom_test::plugin_dir(), dir_.path());
  const auto file = dir_.write("relative.toml", "[loom]\nplugin_path = [\"" + rel.string() +
                                                    "\"]\n[optimizer.main]\nplugin = "
                                                    "\"probe\"\ntag = \"t\"\n");
  auto r = loom_test::open_file(file, true, "");
  EXPECT_EQ(r.rc, LOOM_OK) << r.error;
  loom_close(r.session);

  const auto other = dir_.write("missing.toml",
                                "[loom]\nplugin_path = [\"nowhere\"]\n[optimizer.main]\nplugin = "
                                "\"probe\"\ntag = \"t\"\n");
  r = loom_test::open_file(other, true, "");
  EXPECT_EQ(r.rc, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(r.error, HasSubstr("unknown plugin 'probe'"));
  EXPECT_THAT(r.error, HasSubstr((dir_.path() / "nowhere").string()));
}

TEST_F(Manifest, MissingFileIsNotFound) {
  auto r = loom_test::open_file(dir_.path() / "absent.toml", true);
  EXPECT_EQ(r.rc, LOOM_ERR_NOT_FOUND);
  EXPECT_THAT(r.error, HasSubstr("absent.toml: cannot open manifest"));
}

// User text echoed in an error (a key, a value, a name) is cut to its first 64 bytes and its
// size, with control characters escaped: a 20 MB key gives a short one-line error that still
// says what is wrong and where.
TEST_F(Manifest, AHugeKeyIsQuotedShort) {
  const std::string huge(20U << 20U, 'k');
  const std::string head(64, 'k');
  EXPECT_EQ(check("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n" + huge + " = 1\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_LT(error_.size(), 1024U) << error_.substr(0, 300);
  EXPECT_THAT(error_, StartsWith(at(4, 1) + "unknown parameter '" + head +
                                 "...' (20971520 bytes) for optimizer.main (plugin 'probe'); "
                                 "it takes: "));
  EXPECT_EQ(loom_test::lines(error_).size(), 1U);
}

TEST_F(Manifest, EveryEchoOfUserTextIsCut) {
  const std::string big(100000, 'x');
  const std::string cut = "'" + std::string(64, 'x') + "...' (100000 bytes)";
  struct Case {
    std::string toml;
    std::string expected;  // the error, after FILE:LINE:COL
  };
  const std::string probe = "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n";
  const Case cases[] = {
      {"[" + big + "]\n", "unknown section " + cut + "; known sections: "},
      {"[loom]\n" + big + " = 1\n", "unknown key " + cut + " in [loom]; [loom] takes "},
      {"[loom]\nlog_level = \"" + big + "\"\n", "[loom] log_level must be one of "},
      {"[optimizer]\n" + big + " = 1\n",
       "'optimizer." + std::string(64 - 10, 'x') + "...' (100010 bytes) must be a table"},
      {"[optimizer.\"" + big + "!\"]\n",
       "instance name '" + std::string(64, 'x') + "...' (100001 bytes) may only use letters"},
      {probe + "mode = \"" + big + "\"\n",
       "parameter 'mode' of optimizer.main = " + cut + " is not one of 'sgd', 'signsgd'"},
      {probe + "comm = \"" + big + "\"\n",
       "parameter 'comm' of optimizer.main references unknown instance " + cut},
      {"[optimizer.main]\nplugin = \"" + big + "\"\n", "optimizer.main: unknown plugin " + cut +
                                                           "; no loom_" + std::string(59, 'x') +
                                                           "... (100008 bytes) in "},
      {"[[quantize]]\ntensors = [\"w\"]\nquantizer = \"" + big + "\"\n",
       "[[quantize]] rule 1: quantizer " + cut + " is not declared; declare [quantizer." +
           std::string(64, 'x') + "... (100000 bytes)] with its plugin"},
      {"[[quantize]]\ntensors = [\"w\"]\ncopy = true\n" + big + " = 1\n",
       "unknown key " + cut + " in [[quantize]] rule 1"},
      // toml++'s own message quotes the key.
      {probe + big + " = 1\n" + big + " = 2\n",
       "TOML syntax error: Error while parsing key-value pair: cannot redefine existing "
       "integer '"},
      // A control character in a quoted key stays on the one line, escaped.
      {probe + "\"a\\nb\\u0000c\" = 1\n", "unknown parameter 'a\\nb\\u0000c' for optimizer.main"},
      {"[optimizer." + std::string(100, 'n') + "]\nplugin = \"probe\"\n",
       "optimizer." + std::string(64, 'n') + "... (100 bytes) is missing required parameter 'tag'"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(check(c.toml), LOOM_ERR_INVALID_ARGUMENT) << c.expected;
    EXPECT_LT(error_.size(), 1024U) << error_.substr(0, 300);
    EXPECT_EQ(loom_test::lines(error_).size(), 1U) << error_.substr(0, 300);
    EXPECT_THAT(error_, HasSubstr(": " + c.expected)) << error_.substr(0, 1024);
  }
}

}  // namespace
