// A plugin of the test-only kind loom.example/1, written with the SDK like any other: a
// counter that starts at its `start` parameter.
#include <loom/sdk.hpp>
#include <loom/sdk/kinds/example.hpp>

#include <cstdint>

namespace {

class Counter : public loom::sdk::Example {
 public:
  static loom::sdk::Schema schema() {
    return {loom::sdk::Int("start", 0, "The total before the first run.")};
  }
  explicit Counter(loom::sdk::Context& ctx) : total_(ctx.get_int("start")) {}
  void run(loom_example_args& a) {
    total_ += a.steps;
    a.result = total_;
  }

 private:
  int64_t total_;
};

}  // namespace

LOOM_PLUGIN("example_kind", "1.0.0", "a counter of the test-only kind loom.example/1",
            loom::sdk::factory<Counter>());
