// The trainer's own state in a checkpoint (trainer.rankN.bin's payload): the step, the
// counters a resume continues from, and the loss sums of the current metrics interval.
// Decoding checks the layout; check_trainer_state checks the values against the checkpoint
// folder and the run's config, so an edited (checksum recomputed) file cannot resume a run at
// a step or position it never reached.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint.hpp"

namespace loom::trainer {

// Little-endian fields appended to, and read from, a byte buffer (the state files' layout).
template <class T>
void put(std::vector<uint8_t>& b, const T& v) {
  // resize + memcpy, not insert: GCC 12 reports a false -Wstringop-overflow in the inlined
  // insert of a range into an empty vector
  const size_t at = b.size();
  b.resize(at + sizeof(T));
  std::memcpy(b.data() + at, &v, sizeof(T));
}
template <class T>
T take(const std::vector<uint8_t>& b, size_t& off, const std::string& file) {
  if (off + sizeof(T) > b.size()) {
    throw CheckpointError(file + ": truncated: a field at byte " + std::to_string(off) +
                          " runs past the end (" + std::to_string(b.size()) + " bytes)");
  }
  T v;
  std::memcpy(&v, b.data() + off, sizeof(T));
  off += sizeof(T);
  return v;
}

// What a checkpoint holds besides the weights and the optimizer state (rank-local).
struct TrainerState {
  int64_t step = 0;
  uint64_t seed = 0;
  int32_t world = 1;
  uint64_t tokens_seen = 0;
  uint64_t grad_bytes_sent = 0, grad_bytes_received = 0, grad_rounds = 0;
  uint64_t uncompressed_bytes = 0;
  double elapsed_s = 0;
  // This rank's train-loss sum over the steps since the last metrics line, so the first line
  // after a resume averages the same steps as without the interruption.
  double loss_acc = 0;
  int64_t acc_steps = 0;
  // Steps the optimizer skipped for a non-finite gradient (found_inf), over the whole run.
  uint64_t skipped_steps = 0;
  // Tokens consumed when the lr warmup ended (lr_unit = "tokens" decays from there).
  uint64_t warmup_tokens = 0;
  // Layer tokens (the sum over layers of the tokens each processed) consumed so far, and
  // when the warmup ended (lr_unit = "layer_tokens").
  uint64_t layer_tokens = 0;
  uint64_t warmup_layer_tokens = 0;
  bool has_layer_tokens = true;  // false: read from a file before LTS5 (not encoded)
};
// Limits a resumed state must keep, from the config the run continues with.
struct TrainerStateLimits {
  int64_t folder_step = 0;       // the step in the checkpoint folder's name (step_N)
  uint64_t max_step_tokens = 0;  // tokens one step can take at most (all ranks)
  uint64_t layers = 1;           // the model's layer count
};

std::vector<uint8_t> encode_trainer_state(const TrainerState& s);
// Throws CheckpointError naming `file` on a layout it does not know or a truncated buffer.
TrainerState decode_trainer_state(const std::vector<uint8_t>& b, const std::string& file);
// Throws CheckpointError naming `file` and the value when the state lies outside `limits`.
void check_trainer_state(const TrainerState& s, const TrainerStateLimits& limits,
                         const std::string& file);

// The [moe] layers' trainer state (moe.rankN.bin's payload): "LMO1", the aux-loss sum since
// the last metrics line (f64), the layer count (u32), then per layer its index and expert
// count (i32 each), the bias count (u32) and the biases (f32).
struct MoeLayerState {
  int32_t layer = 0;
  int32_t experts = 0;
  std::vector<float> bias;  // empty without aux-loss-free balancing
};
struct MoeState {
  double aux_acc = 0;
  std::vector<MoeLayerState> layers;
};
std::vector<uint8_t> encode_moe_state(const MoeState& s);
// Throws CheckpointError naming `file` on a layout it does not know, a truncated buffer or
// trailing bytes; whether the layers fit the config is the caller's check.
MoeState decode_moe_state(const std::vector<uint8_t>& b, const std::string& file);

}  // namespace loom::trainer
