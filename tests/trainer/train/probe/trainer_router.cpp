// trainer_router: a test-only loom.router/1 plugin built with the SDK, so the trainer's
// routing path runs end to end without the real routers. In training, layers first_layer ..
// last_layer keep min(keep, seq_len) positions of each sequence: the ones with the smallest
// keys splitmix64(seed, step, layer, sample, position) (sample = first_sample + b), in
// position order, ungated; evaluation and the other layers keep everything. advance adds
// batch * kept over the layers; its state is (step, consumed), and it accepts only the step
// after the last one accounted (or that one again), so a resume that does not import the
// state fails.
#include <loom/sdk/kinds/router.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace {

using loom::sdk::Context;
using loom::sdk::Error;

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class TrainerRouter : public loom::sdk::Router {
 public:
  static loom::sdk::Schema schema() {
    return {loom::sdk::Int("keep", 8, "Positions a routed layer keeps in training.").min(1),
            loom::sdk::Int("first_layer", 1, "The first routed layer.").min(0),
            loom::sdk::Int("last_layer", 1, "The last routed layer.").min(0)};
  }

  explicit TrainerRouter(Context& ctx)
      : keep_(ctx.get_int("keep")),
        first_(ctx.get_int("first_layer")),
        final_(ctx.get_int("last_layer")) {}

  void plan(loom_router_plan_args& a) { a.kept = kept(a.layer, a.seq_len, a.training != 0); }

  void select(const loom_router_select_args& a) {
    const int64_t k = kept(a.layer, a.seq_len, a.training != 0);
    auto* idx = static_cast<int32_t*>(a.indices->data);
    std::vector<uint64_t> key(static_cast<size_t>(a.seq_len));
    std::vector<int32_t> pos(static_cast<size_t>(a.seq_len));
    for (int64_t b = 0; b < a.batch; ++b) {
      const uint64_t s = static_cast<uint64_t>(a.first_sample + b);
      for (int64_t p = 0; p < a.seq_len; ++p) {
        key[p] = mix(
            mix(mix(mix(a.seed ^ static_cast<uint64_t>(a.step)) ^ static_cast<uint64_t>(a.layer)) ^
                s) ^
            static_cast<uint64_t>(p));
      }
      std::iota(pos.begin(), pos.end(), 0);
      std::sort(pos.begin(), pos.end(),
                [&](int32_t x, int32_t y) { return key[x] != key[y] ? key[x] < key[y] : x < y; });
      std::sort(pos.begin(), pos.begin() + k);
      std::copy(pos.begin(), pos.begin() + k, idx + b * k);
    }
  }

  void gather(const loom::sdk::RouterMove& m) { move(m, true); }
  void scatter(const loom::sdk::RouterMove& m) { move(m, false); }

  void advance(loom_router_advance_args& a) {
    if (a.step != step_ && a.step != step_ + 1) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "trainer_router: advance(step " + std::to_string(a.step) + ") after step " +
                      std::to_string(step_) + " (state not imported?)");
    }
    int64_t tokens = 0;
    for (int32_t l = 0; l < a.num_layers; ++l) tokens += a.batch * kept(l, a.seq_len, true);
    if (a.step == step_ + 1) {
      step_ = a.step;
      last_tokens_ = tokens;
      consumed_ += static_cast<uint64_t>(tokens);
    }
    a.layer_tokens = last_tokens_;
    a.consumed_layer_tokens = consumed_;
  }

  void export_state(loom::sdk::StateWriter& out) {
    out.write_header(kMagic, 1);
    out.write_pod(step_);
    out.write_pod(last_tokens_);
    out.write_pod(consumed_);
  }
  void import_state(std::span<const std::byte> blob) {
    loom::sdk::StateReader in(blob);
    in.read_header(kMagic, 1);
    const auto step = in.read_pod<int64_t>();
    const auto last = in.read_pod<int64_t>();
    const auto consumed = in.read_pod<uint64_t>();
    in.expect_end();
    step_ = step;
    last_tokens_ = last;
    consumed_ = consumed;
  }

 private:
  static constexpr const char* kMagic = "loom.test.trainer_router";

  int64_t kept(int32_t layer, int64_t seq_len, bool training) const {
    if (!training || layer < first_ || layer > final_) return seq_len;
    return std::min(keep_, seq_len);
  }

  static void move(const loom::sdk::RouterMove& m, bool gather) {
    const size_t row = static_cast<size_t>(m.channels) * m.full.element_bytes;
    for (int64_t b = 0; b < m.batch; ++b) {
      for (int64_t j = 0; j < m.kept_count; ++j) {
        const int64_t p = m.indices[b * m.kept_count + j];
        char* f = static_cast<char*>(m.full.data) +
                  (b * m.full.batch_stride + p * m.full.position_stride) * m.full.element_bytes;
        char* k = static_cast<char*>(m.kept.data) +
                  (b * m.kept.batch_stride + j * m.kept.position_stride) * m.kept.element_bytes;
        if (gather) {
          std::memcpy(k, f, row);
        } else {
          std::memcpy(f, k, row);
        }
      }
    }
  }

  int64_t keep_, first_, final_;
  int64_t step_ = 0, last_tokens_ = 0;
  uint64_t consumed_ = 0;
};

}  // namespace

LOOM_PLUGIN("trainer_router", "1.0.0", "Keeps a hashed subset of positions (tests only)",
            loom::sdk::factory<TrainerRouter>());
