// A kind the SDK has never heard of, loom.example/1 (tests/kinds/example: its C header and its
// SDK header, base class, table and KindTraits). plugin.hpp is not touched, yet factory<T>()
// builds the kind's factory, the table's entries report faults as the SDK's kinds do, and one
// plugin provides it beside an SDK 1.5 kind. tests/kinds/example runs it through a host.
#include <loom/sdk/kinds/example.hpp>
#include <loom/sdk/kinds/optimizer.hpp>
#include <loom/sdk/plugin.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>

// ---- a plugin of the new kind

namespace {

class Counter : public loom::sdk::Example {
 public:
  explicit Counter(loom::sdk::Context& /*ctx*/) {}
  void run(loom_example_args& a) {
    total_ += a.steps;
    a.result = total_;
  }

 private:
  int64_t total_ = 0;
};

class Sgd : public loom::sdk::Optimizer {
 public:
  explicit Sgd(loom::sdk::Context& /*ctx*/) {}
  void step(const loom_optimizer_step_args& /*args*/) {}
};

// Derives from two kinds' base classes: refused by factory<T>().
class Both : public loom::sdk::Example, public loom::sdk::Optimizer {};

static_assert(loom::sdk::detail::HasOneKind<Counter>);
static_assert(loom::sdk::detail::HasOneKind<Sgd>);
static_assert(!loom::sdk::detail::HasOneKind<Both>);
static_assert(!loom::sdk::detail::HasOneKind<int>);

std::string take(loom_status* st, int32_t* code = nullptr) {
  if (code != nullptr) *code = st == nullptr ? LOOM_OK : st->code;
  if (st == nullptr) return "";
  std::string m = st->message;
  st->destroy(st);
  return m;
}

TEST(SdkNewKind, FactoryCarriesTheKindAndItsTable) {
  const loom_factory* f = loom::sdk::factory<Counter>()();
  ASSERT_NE(f, nullptr);
  EXPECT_STREQ(f->kind, "loom.example/1");
  const auto* vt = static_cast<const loom_example_v1*>(f->vtable);
  ASSERT_NE(vt, nullptr);
  EXPECT_EQ(vt, loom::sdk::detail::ExampleTable<Counter>::get());

  loom_host_services svc{};
  svc.struct_size = LOOM_HOST_SERVICES_SIZE;
  svc.abi_major = LOOM_ABI_MAJOR;
  svc.abi_minor = LOOM_ABI_MINOR;
  svc.instance_name = "counter";
  void* obj = nullptr;
  ASSERT_EQ(take(f->create(&svc, &obj)), "");
  ASSERT_NE(obj, nullptr);

  loom_example_args a{};
  a.struct_size = LOOM_EXAMPLE_ARGS_SIZE;
  a.steps = 3;
  EXPECT_EQ(take(vt->run(obj, &a)), "");
  EXPECT_EQ(a.result, 3);
  a.steps = 4;
  EXPECT_EQ(take(vt->run(obj, &a)), "");
  EXPECT_EQ(a.result, 7);

  // The shared checks, in the same words as the SDK's own kinds.
  int32_t code = 0;
  a.steps = 0;
  EXPECT_EQ(take(vt->run(obj, &a), &code), "example run: steps is 0; must be >= 1");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(take(vt->run(obj, nullptr), &code), "example args is NULL");
  a.struct_size = 4;
  EXPECT_EQ(take(vt->run(obj, &a), &code), "example args has struct_size 4, smaller than the " +
                                               std::to_string(LOOM_EXAMPLE_ARGS_SIZE) +
                                               " bytes of the fields this plugin reads");
  a.struct_size = LOOM_EXAMPLE_ARGS_SIZE;
  a.steps = 1;
  EXPECT_EQ(take(vt->run(nullptr, &a), &code), "instance is NULL");
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  f->destroy(obj);
}

TEST(SdkNewKind, OnePluginProvidesItBesideAnSdk15Kind) {
  const loom::sdk::detail::PluginStorage storage(
      "two_kinds", "1.0.0", "a new kind and an optimizer",
      {loom::sdk::factory<Counter>(), loom::sdk::factory<Sgd>()});
  const loom_plugin_v1* p = storage.get();
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(p->factory_count, 2u);
  EXPECT_STREQ(p->factories[0]->kind, "loom.example/1");
  EXPECT_STREQ(p->factories[1]->kind, LOOM_KIND_OPTIMIZER);
}

}  // namespace
