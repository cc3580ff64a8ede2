// ABI 1.2's core through the host: exclusive bounds and exact int64 ranges in schemas
// (validate.cpp, describe.cpp), the factory's cross-parameter validate (reported at the key it
// blames), the args-struct create and import_state (preferred when present, the positional
// ones for plugins built against 1.0 / 1.1), and the SDK's side of all three (sdk12).
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/abi.h>
#include <loom/sdk/plugin.hpp>

#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "abi_version.hpp"
#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;

nlohmann::json describe(const char* name) {
  char* raw = nullptr;
  const int32_t rc = loom_describe_plugins(name, loom_test::plugin_dir().string().c_str(), &raw);
  EXPECT_EQ(rc, LOOM_OK) << loom_last_error();
  if (raw == nullptr) return {};
  auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  EXPECT_EQ(doc["plugins"].size(), 1U) << doc.dump(2);
  return doc["plugins"][0];
}

const nlohmann::json& param(const nlohmann::json& plugin, const std::string& name) {
  for (const auto& p : plugin["kinds"][0]["params"]) {
    if (p["name"] == name) return p;
  }
  static const nlohmann::json none;
  ADD_FAILURE() << "no parameter " << name;
  return none;
}

// The exported state of instance `kind.name`, as int32 values.
std::vector<int32_t> state_of(loom_session* s, const char* kind, const char* name) {
  loom_instance* inst = nullptr;
  EXPECT_EQ(loom_find_instance(s, kind, name, &inst), LOOM_OK) << loom_last_error();
  size_t size = 0;
  EXPECT_EQ(loom_instance_export_state(inst, nullptr, 0, &size), LOOM_OK) << loom_last_error();
  std::vector<int32_t> out(size / sizeof(int32_t));
  EXPECT_EQ(loom_instance_export_state(inst, out.data(), out.size() * sizeof(int32_t), &size),
            LOOM_OK)
      << loom_last_error();
  return out;
}

class Abi12 : public loom_test::ManifestTest {
 protected:
  // optimizer.a of plugin abi12 with `extra` from line 3 on.
  int32_t check_abi12(const std::string& extra) {
    return check("[optimizer.a]\nplugin = \"abi12\"\n" + extra + "\n");
  }
  int32_t check_sdk12(const std::string& extra) {
    return check("[optimizer.s]\nplugin = \"sdk12\"\n" + extra + "\n");
  }
};

// ---------------------------------------------------------------- bounds

TEST_F(Abi12, ExclusiveLowerBoundRefusesTheBoundItself) {
  EXPECT_EQ(check_abi12("gain = 0"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) + "parameter 'gain' of optimizer.a = 0 must be > 0");
  EXPECT_EQ(check_abi12("gain = -0.5"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) + "parameter 'gain' of optimizer.a = -0.5 must be > 0");
  EXPECT_EQ(check_abi12("gain = 1e-300"), LOOM_OK) << error_;
}

TEST_F(Abi12, ExclusiveBoundsOnBothSidesPrintAnOpenInterval) {
  EXPECT_EQ(check_abi12("ratio = 1"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 9) + "parameter 'ratio' of optimizer.a = 1 is out of range (0, 1)");
  EXPECT_EQ(check_abi12("ratio = 0.0"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 9) + "parameter 'ratio' of optimizer.a = 0 is out of range (0, 1)");
  EXPECT_EQ(check_abi12("ratio = 0.999"), LOOM_OK) << error_;
}

TEST_F(Abi12, ExactInt64BoundsPastTwoToThe53) {
  // 2^53 + 1 is the bound; 2^53 + 2 is one past it but the same double as the bound's nearest.
  EXPECT_EQ(check_abi12("seed = 9007199254740993"), LOOM_OK) << error_;
  EXPECT_EQ(check_abi12("seed = 9007199254740994"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) +
                        "parameter 'seed' of optimizer.a = 9007199254740994 is out of range [0, "
                        "9007199254740993]");
  EXPECT_EQ(check_abi12("seed = -1"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(check_abi12("seed = 9223372036854775807"), LOOM_ERR_INVALID_ARGUMENT);
}

TEST_F(Abi12, ExactExclusiveBoundOnListElements) {
  EXPECT_EQ(check_abi12("offsets = [9223372036854775807, -9007199254740992]"), LOOM_OK) << error_;
  EXPECT_EQ(check_abi12("offsets = [0, -9007199254740993]"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 15) +
                        "element 1 of parameter 'offsets' of optimizer.a = -9007199254740993 "
                        "must be > -9007199254740993");
}

TEST_F(Abi12, DescribeShowsExclusiveAndExactBounds) {
  const auto p = describe("abi12");
  EXPECT_EQ(p["abi"], kHostAbi);
  EXPECT_EQ(p["kinds"][0]["has_validate"], true);
  EXPECT_EQ(p["kinds"][0]["has_state"], true);
  const auto& gain = param(p, "gain");
  EXPECT_EQ(gain["min"], 0.0);
  EXPECT_TRUE(gain["max"].is_null());
  EXPECT_EQ(gain["min_exclusive"], true);
  EXPECT_EQ(gain["max_exclusive"], false);
  const auto& ratio = param(p, "ratio");
  EXPECT_EQ(ratio["min_exclusive"], true);
  EXPECT_EQ(ratio["max_exclusive"], true);
  const auto& seed = param(p, "seed");
  ASSERT_TRUE(seed["max"].is_number_integer()) << seed.dump();
  EXPECT_EQ(seed["max"].get<int64_t>(), 9007199254740993LL);  // exact, not a rounded double
  EXPECT_EQ(seed["min"].get<int64_t>(), 0);
  const auto& offsets = param(p, "offsets");
  EXPECT_EQ(offsets["min"].get<int64_t>(), -9007199254740993LL);
  EXPECT_TRUE(offsets["max"].is_null());  // INT64_MAX: unbounded
  EXPECT_EQ(offsets["min_exclusive"], true);
  EXPECT_EQ(param(p, "low")["min_exclusive"], false);
}

TEST_F(Abi12, UnknownSpecFlagBitRefusesThePluginNamingTheParameter) {
  char* raw = nullptr;
  EXPECT_EQ(loom_describe_plugins("badflags", loom_test::plugin_dir().string().c_str(), &raw),
            LOOM_ERR_ABI_MISMATCH);
  loom_free_string(raw);
  EXPECT_THAT(std::string(loom_last_error()),
              HasSubstr("parameter 0 ('gain') has unknown flags 0x80 (from a newer ABI minor "
                        "than this host's " +
                        kHostAbi + ")"));
  EXPECT_EQ(check("[optimizer.b]\nplugin = \"badflags\"\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr(at(2, 10) + "optimizer.b: plugin file "));
  EXPECT_THAT(error_, HasSubstr("unknown flags 0x80"));
}

// The SDK refuses a schema that contradicts its own bounds (the entry point returns NULL).
std::string schema_error(const loom::sdk::Param& p) {
  try {
    const loom::sdk::SchemaStorage storage(loom::sdk::Schema{p});
  } catch (const loom::sdk::Error& e) {
    return e.what();
  }
  return "";
}

TEST(SdkSchema, BoundBuildersRefuseContradictions) {
  using namespace loom::sdk;
  EXPECT_EQ(schema_error(Float("eps", 0.0, "d").greater_than(0)),
            "schema parameter 'eps': default out of range");
  EXPECT_EQ(schema_error(Float("eps", 1e-8, "d").greater_than(0)), "");
  EXPECT_EQ(schema_error(Float("r", 1.0, "d").range(0, 1).less_than(1)),
            "schema parameter 'r': default out of range");
  EXPECT_EQ(schema_error(Float("r", 0.5, "d").greater_than(1).less_than(1)),
            "schema parameter 'r': empty range");
  EXPECT_EQ(schema_error(Int("n", 3, "d").greater_than(3).less_than(4)),
            "schema parameter 'n': empty range");  // no integer strictly between 3 and 4
  EXPECT_EQ(schema_error(Int("n", 9007199254740993, "d").int_max(9007199254740992)),
            "schema parameter 'n': default out of range");  // exact, not as doubles
  EXPECT_EQ(schema_error(Int("n", 9007199254740993, "d").int_max(9007199254740993)), "");
  EXPECT_EQ(schema_error(IntList("l", {1, 0}, "d").int_min(1)),
            "schema parameter 'l': default element out of range");
  EXPECT_EQ(schema_error(Int("n", 0, "d").int_range(5, 4)), "schema parameter 'n': empty range");
}

TEST(SdkSchema, SpecsCarryFlagsAndOutwardRoundedDoubles) {
  using namespace loom::sdk;
  const SchemaStorage storage(Schema{
      Float("eps", 1e-8, "d").greater_than(0).max(1),
      Int("n", 0, "d").int_range(-9007199254740993, 9007199254740993),
      Int("m", 5, "d").greater_than(2.5),  // integers > 2.5 are those > 2
      String("s", "a", "d"),
  });
  const loom_param_spec* spec = storage.data();
  EXPECT_EQ(spec[0].struct_size, LOOM_PARAM_SPEC_SIZE);
  EXPECT_EQ(spec[0].flags, LOOM_PARAM_MIN_EXCLUSIVE);
  EXPECT_EQ(spec[0].min, 0.0);
  EXPECT_EQ(spec[0].max, 1.0);
  EXPECT_EQ(spec[1].flags, LOOM_PARAM_INT_RANGE);
  EXPECT_EQ(spec[1].int_min, -9007199254740993LL);
  EXPECT_EQ(spec[1].int_max, 9007199254740993LL);
  EXPECT_EQ(spec[1].min, -9007199254740994.0);  // the next double outward
  EXPECT_EQ(spec[1].max, 9007199254740994.0);
  EXPECT_EQ(spec[2].flags, LOOM_PARAM_MIN_EXCLUSIVE);  // double bounds only
  EXPECT_EQ(spec[2].min, 2.5);
  EXPECT_EQ(spec[3].flags, 0U);
}

// ---------------------------------------------------------------- validate

TEST_F(Abi12, ValidateErrorIsReportedAtTheKeyItBlames) {
  EXPECT_EQ(check_abi12("low = 5\nhigh = 5"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(4, 1) + "parameter 'high' of optimizer.a: must be greater than low");
  EXPECT_EQ(check_abi12("low = 5\nhigh = 6"), LOOM_OK) << error_;
}

TEST_F(Abi12, ValidateBlamingAnUnsetKeyPointsAtTheTable) {
  EXPECT_EQ(check("\n[optimizer.a]\nplugin = \"abi12\"\nlow = 20\n"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(2, 1) +
                        "parameter 'high' of optimizer.a (not set, so its default): must "
                        "be greater than low");
}

TEST_F(Abi12, ValidateBlamingNoKeyOrAnUnknownIndexPointsAtTheTable) {
  EXPECT_EQ(check_abi12("mode = \"blame_instance\""), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(1, 1) + "optimizer.a (plugin 'abi12'): abi12: refused as a whole");
  EXPECT_EQ(check_abi12("mode = \"blame_outside\""), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(1, 1) + "optimizer.a (plugin 'abi12'): abi12: blames no real key");
}

TEST_F(Abi12, ValidateRunsOnlyOnParametersThatPassedTheSchema) {
  // gain fails the schema: the cross-check (which would blame high) is not run.
  EXPECT_EQ(check_abi12("gain = 0\nlow = 5\nhigh = 5"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(loom_test::lines(error_).size(), 1U) << error_;
  EXPECT_THAT(error_, HasSubstr("'gain'"));
}

TEST_F(Abi12, ValidateAlsoGuardsSessionCreation) {
  EXPECT_EQ(open("[optimizer.a]\nplugin = \"abi12\"\nlow = 5\nhigh = 1\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(4, 1) + "parameter 'high' of optimizer.a: must be greater than low");
  EXPECT_EQ(session_, nullptr);
}

// ---------------------------------------------------------------- args-struct entries

TEST_F(Abi12, ArgsStructEntriesArePreferred) {
  ASSERT_EQ(open("[optimizer.a]\nplugin = \"abi12\"\n"), LOOM_OK) << error_;
  auto st = state_of(session_, "optimizer", "a");
  ASSERT_EQ(st.size(), 4U);
  EXPECT_EQ(st[0], 2);  // created through create_with_args, not create
  EXPECT_EQ(st[3], 7);  // validate saw all 7 parameters, defaults filled
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(session_, "optimizer", "a", &inst), LOOM_OK);
  ASSERT_EQ(loom_instance_import_state(inst, st.data(), st.size() * sizeof(int32_t)), LOOM_OK)
      << loom_last_error();
  st = state_of(session_, "optimizer", "a");
  EXPECT_EQ(st[1], 0);  // import_state
  EXPECT_EQ(st[2], 1);  // import_state_with_args
  // Its error still comes back through the new entry.
  EXPECT_EQ(loom_instance_import_state(inst, "abc", 3), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("abi12: state must be 16 bytes"));
}

TEST_F(Abi12, PluginBuiltAgainst11UsesThePositionalEntries) {
  const auto p = describe("minor1");
  EXPECT_EQ(p["abi"], "1.1");
  EXPECT_EQ(p["kinds"][0]["has_validate"], false);
  const auto& rate = param(p, "rate");
  EXPECT_EQ(rate["max"], 1.0);
  EXPECT_EQ(rate["min_exclusive"], false);  // its specs end before flags: inclusive
  EXPECT_EQ(param(p, "mode")["choices"], nlohmann::json({"fast", "exact"}));

  EXPECT_EQ(check("[optimizer.m]\nplugin = \"minor1\"\nrate = 0\nmode = \"slow\"\n"),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(error_, HasSubstr(at(4, 8) + "parameter 'mode' of optimizer.m = 'slow' is not one "
                                           "of 'fast', 'exact'"));
  ASSERT_EQ(open("[optimizer.m]\nplugin = \"minor1\"\nrate = 0\n"), LOOM_OK) << error_;
  auto st = state_of(session_, "optimizer", "m");
  ASSERT_EQ(st.size(), 2U);
  EXPECT_EQ(st[0], 1);
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(session_, "optimizer", "m", &inst), LOOM_OK);
  ASSERT_EQ(loom_instance_import_state(inst, st.data(), st.size() * sizeof(int32_t)), LOOM_OK)
      << loom_last_error();
  EXPECT_EQ(state_of(session_, "optimizer", "m")[1], 1);  // through import_state
}

// ---------------------------------------------------------------- the SDK's side

TEST_F(Abi12, SdkValidateHookBlamesTheKey) {
  EXPECT_EQ(check_sdk12("nesterov = true"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 1) + "parameter 'nesterov' of optimizer.s: nesterov needs momentum > 0");
  EXPECT_EQ(check_sdk12("nesterov = true\nmomentum = 0.9"), LOOM_OK) << error_;
  EXPECT_EQ(check_sdk12("seed = 13"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(1, 1) + "optimizer.s (plugin 'sdk12'): seed 13 is refused");
}

TEST_F(Abi12, SdkBoundBuilders) {
  EXPECT_EQ(check_sdk12("eps = 0"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 7) + "parameter 'eps' of optimizer.s = 0 must be > 0");
  EXPECT_EQ(check_sdk12("beta = 1"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) + "parameter 'beta' of optimizer.s = 1 is out of range (0, 1)");
  EXPECT_EQ(check_sdk12("seed = -9007199254740994"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 8) +
                        "parameter 'seed' of optimizer.s = -9007199254740994 is out of range "
                        "[-9007199254740993, 9007199254740993]");
  EXPECT_EQ(check_sdk12("seed = 9007199254740993\nsizes = [1, 2]"), LOOM_OK) << error_;
  EXPECT_EQ(check_sdk12("sizes = [1, 0]"), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(error_, at(3, 13) + "element 1 of parameter 'sizes' of optimizer.s = 0 must be >= 1");

  const auto p = describe("sdk12");
  EXPECT_EQ(p["kinds"][0]["has_validate"], true);
  EXPECT_EQ(param(p, "eps")["min_exclusive"], true);
  EXPECT_EQ(param(p, "seed")["max"].get<int64_t>(), 9007199254740993LL);
  EXPECT_EQ(param(p, "sizes")["min"].get<int64_t>(), 1);
}

// The SDK's factory, called directly as hosts of other minors would call it.
class SdkFactory : public ::testing::Test {
 protected:
  void SetUp() override {
    handle_ = dlopen(loom_test::plugin_file("sdk12").c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(handle_, nullptr) << dlerror();
    auto entry = reinterpret_cast<loom_plugin_entry_v1_fn>(  // NOLINT
        dlsym(handle_, LOOM_PLUGIN_ENTRY_V1_NAME));
    ASSERT_NE(entry, nullptr);
    const loom_plugin_v1* plugin = entry();
    ASSERT_NE(plugin, nullptr);
    EXPECT_EQ(plugin->abi_minor, LOOM_ABI_MINOR);
    factory_ = plugin->factories[0];
    ASSERT_GE(factory_->struct_size, LOOM_FACTORY_SIZE);
  }
  void TearDown() override {
    if (handle_ != nullptr) dlclose(handle_);
  }

  // momentum 0, nesterov true: what validate_params refuses. `seed` as given.
  void fill_params(int64_t seed) {
    params_.assign(3, loom_param{});
    const char* names[] = {"momentum", "nesterov", "seed"};
    const int32_t types[] = {LOOM_PARAM_FLOAT, LOOM_PARAM_BOOL, LOOM_PARAM_INT};
    for (size_t i = 0; i < 3; ++i) {
      params_[i].struct_size = LOOM_PARAM_SIZE;
      params_[i].name = names[i];
      params_[i].value.struct_size = LOOM_VALUE_SIZE;
      params_[i].value.type = types[i];
    }
    params_[1].value.int_value = 1;
    params_[2].value.int_value = seed;
  }

  // A services table as a host of `minor` fills it (1.1's ended at param_count too).
  loom_host_services host(uint16_t minor) {
    loom_host_services h{};
    h.struct_size = LOOM_STRUCT_SIZE(loom_host_services, param_count);
    h.abi_major = LOOM_ABI_MAJOR;
    h.abi_minor = minor;
    h.instance_name = "s";
    h.params = params_.data();
    h.param_count = params_.size();
    return h;
  }

  static std::string take(loom_status* s, int32_t* code) {
    if (s == nullptr) return "";
    *code = s->code;
    std::string m = s->message;
    s->destroy(s);
    return m;
  }

  void* handle_ = nullptr;
  const loom_factory* factory_ = nullptr;
  std::vector<loom_param> params_;
};

TEST_F(SdkFactory, FillsEveryEntry) {
  EXPECT_NE(factory_->create, nullptr);
  EXPECT_NE(factory_->create_with_args, nullptr);
  EXPECT_NE(factory_->import_state, nullptr);
  EXPECT_NE(factory_->import_state_with_args, nullptr);
  EXPECT_NE(factory_->validate, nullptr);
  const auto* spec = factory_->param_specs;
  ASSERT_EQ(spec[0].struct_size, LOOM_PARAM_SPEC_SIZE);
  EXPECT_EQ(spec[2].flags, LOOM_PARAM_MIN_EXCLUSIVE);                             // eps
  EXPECT_EQ(spec[3].flags, LOOM_PARAM_MIN_EXCLUSIVE | LOOM_PARAM_MAX_EXCLUSIVE);  // beta
  EXPECT_EQ(spec[4].flags, LOOM_PARAM_INT_RANGE);                                 // seed
  EXPECT_EQ(spec[4].int_max, 9007199254740993LL);
  // The double bounds are rounded outward, for hosts before 1.2.
  EXPECT_GE(spec[4].max, 9007199254740993.0);
  EXPECT_LE(spec[4].min, -9007199254740993.0);
  EXPECT_EQ(spec[0].flags, 0U);  // momentum: inclusive
}

TEST_F(SdkFactory, ValidateSetsBadParamToTheKeyItsHookNames) {
  fill_params(0);
  loom_validate_args args{};
  args.struct_size = LOOM_VALIDATE_ARGS_SIZE;
  args.params = params_.data();
  args.param_count = params_.size();
  args.instance_name = "s";
  args.bad_param = -1;
  int32_t code = 0;
  EXPECT_EQ(take(factory_->validate(&args), &code), "nesterov needs momentum > 0");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(args.bad_param, 1);

  fill_params(13);
  params_[1].value.int_value = 0;
  args.params = params_.data();
  args.bad_param = -1;
  EXPECT_EQ(take(factory_->validate(&args), &code), "seed 13 is refused");
  EXPECT_EQ(args.bad_param, -1);

  params_[2].value.int_value = 1;
  EXPECT_EQ(factory_->validate(&args), nullptr);
  EXPECT_THAT(take(factory_->validate(nullptr), &code), HasSubstr("validate args"));  // no crash
}

TEST_F(SdkFactory, OnAHostBefore12CreateChecksTheBoundsThatHostCannot) {
  // A 1.1 host checks only the inclusive double bounds: eps = 0 and seed = 2^53 + 2 pass there.
  fill_params(9007199254740994);
  params_[1].value.int_value = 0;  // nesterov off: only the bounds are at stake
  loom_param eps{};
  eps.struct_size = LOOM_PARAM_SIZE;
  eps.name = "eps";
  eps.value.struct_size = LOOM_VALUE_SIZE;
  eps.value.type = LOOM_PARAM_FLOAT;
  eps.value.float_value = 1e-8;
  params_.push_back(eps);
  const loom_host_services old_host = host(1);
  void* instance = nullptr;
  int32_t code = 0;
  EXPECT_EQ(take(factory_->create(&old_host, &instance), &code),
            "parameter 'seed' = 9007199254740994 is out of range [-9007199254740993, "
            "9007199254740993]");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  params_[2].value.int_value = 9007199254740993;
  params_[3].value.float_value = 0.0;
  const loom_host_services old_host2 = host(1);
  EXPECT_EQ(take(factory_->create(&old_host2, &instance), &code),
            "parameter 'eps' = 0 is out of range (0, inf]");
  EXPECT_EQ(instance, nullptr);
  params_[3].value.float_value = 1e-8;
  const loom_host_services old_host3 = host(1);
  ASSERT_EQ(factory_->create(&old_host3, &instance), nullptr);
  ASSERT_NE(instance, nullptr);
  factory_->destroy(instance);
}

TEST_F(SdkFactory, OnAHostBefore12CreateRunsTheHookItself) {
  fill_params(0);
  const loom_host_services old_host = host(1);
  void* instance = reinterpret_cast<void*>(1);  // NOLINT: create must reset it
  int32_t code = 0;
  EXPECT_EQ(take(factory_->create(&old_host, &instance), &code),
            "parameter 'nesterov': nesterov needs momentum > 0");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(instance, nullptr);

  // A 1.2 host has run validate already: create does not repeat it.
  const loom_host_services new_host = host(2);
  ASSERT_EQ(factory_->create(&new_host, &instance), nullptr);
  ASSERT_NE(instance, nullptr);
  factory_->destroy(instance);

  loom_create_args args{};
  args.struct_size = LOOM_CREATE_ARGS_SIZE;
  args.host = &new_host;
  instance = nullptr;
  ASSERT_EQ(factory_->create_with_args(&args, &instance), nullptr);
  ASSERT_NE(instance, nullptr);
  // import_state_with_args checks the frame like import_state does.
  loom_import_state_args imp{};
  imp.struct_size = LOOM_IMPORT_STATE_ARGS_SIZE;
  imp.data = "LOOMSTv2garbage";
  imp.bytes = 15;
  EXPECT_NE(take(factory_->import_state_with_args(instance, &imp), &code), "");
  EXPECT_THAT(take(factory_->import_state_with_args(instance, nullptr), &code),
              HasSubstr("import_state args is NULL"));
  factory_->destroy(instance);
}

}  // namespace
