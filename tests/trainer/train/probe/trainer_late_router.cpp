// trainer_late_router: a test-only learned loom.router/1 plugin (it has backward) that routes
// layer `layer` in training only from step `from_step` on, keeping the first min(keep,
// seq_len) positions of each sequence with gate 0.5. Its plan of step 1 keeps every position,
// so the trainer gives the layer no router weight, and the run must stop at the first step
// that routes it with an error naming the cause.
#include <loom/sdk/kinds/router.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

class TrainerLateRouter : public loom::sdk::Router {
 public:
  static loom::sdk::Schema schema() {
    return {loom::sdk::Int("keep", 8, "Positions the routed layer keeps.").min(1),
            loom::sdk::Int("layer", 1, "The routed layer.").min(0),
            loom::sdk::Int("from_step", 2, "The first step that routes it.").min(1)};
  }

  explicit TrainerLateRouter(loom::sdk::Context& ctx)
      : keep_(ctx.get_int("keep")), layer_(ctx.get_int("layer")), from_(ctx.get_int("from_step")) {}

  void plan(loom_router_plan_args& a) { a.kept = kept(a.step, a.layer, a.seq_len, a.training); }

  void select(const loom_router_select_args& a) {
    const int64_t k = kept(a.step, a.layer, a.seq_len, a.training);
    auto* idx = static_cast<int32_t*>(a.indices->data);
    for (int64_t b = 0; b < a.batch; ++b) {
      for (int64_t j = 0; j < k; ++j) idx[b * k + j] = static_cast<int32_t>(j);
    }
    const int64_t n = a.batch * k;
    if (a.gates->dtype.bits == 64) {
      std::fill_n(static_cast<double*>(a.gates->data), n, 0.5);
    } else {
      std::fill_n(static_cast<float*>(a.gates->data), n, 0.5f);
    }
  }

  void gather(const loom::sdk::RouterMove& m) { move(m, true); }
  void scatter(const loom::sdk::RouterMove& m) { move(m, false); }
  void backward(const loom_router_backward_args&) {}  // constant gates: nothing to add

  void advance(loom_router_advance_args& a) {
    int64_t tokens = 0;
    for (int32_t l = 0; l < a.num_layers; ++l) tokens += a.batch * kept(a.step, l, a.seq_len, 1);
    consumed_ += static_cast<uint64_t>(tokens);
    a.layer_tokens = tokens;
    a.consumed_layer_tokens = consumed_;
  }

 private:
  int64_t kept(int64_t step, int64_t layer, int64_t seq_len, uint32_t training) const {
    if (training == 0 || layer != layer_ || step < from_) return seq_len;
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

  int64_t keep_, layer_, from_;
  uint64_t consumed_ = 0;
};

}  // namespace

LOOM_PLUGIN("trainer_late_router", "1.0.0",
            "A learned router that routes a layer only from a later step (tests only)",
            loom::sdk::factory<TrainerLateRouter>());
