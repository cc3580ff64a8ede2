#include "trainer_state.hpp"

#include <cmath>

namespace loom::trainer {

namespace {

// "LTS5"; "LTS4" (still read: its layer tokens are taken as layers x tokens, since no run
// routed then) lacked the layer tokens, "LTS3" (still
// read, as warmup_tokens 0) warmup_tokens, "LTS2" (still read, as 0 skipped steps)
// skipped_steps, "LTS1" the loss sums.
constexpr uint32_t kTrainerStateMagic = 0x4c545335;
constexpr uint32_t kTrainerStateMagicV4 = 0x4c545334;
constexpr uint32_t kTrainerStateMagicV3 = 0x4c545333;
constexpr uint32_t kTrainerStateMagicV2 = 0x4c545332;

constexpr uint32_t kMoeStateMagic = 0x314f4d4c;  // "LMO1"

}  // namespace

std::vector<uint8_t> encode_trainer_state(const TrainerState& s) {
  std::vector<uint8_t> b;
  put(b, kTrainerStateMagic);
  put(b, s.step);
  put(b, s.seed);
  put(b, s.world);
  put(b, s.tokens_seen);
  put(b, s.grad_bytes_sent);
  put(b, s.grad_bytes_received);
  put(b, s.grad_rounds);
  put(b, s.uncompressed_bytes);
  put(b, s.elapsed_s);
  put(b, s.loss_acc);
  put(b, s.acc_steps);
  put(b, s.skipped_steps);
  put(b, s.warmup_tokens);
  put(b, s.layer_tokens);
  put(b, s.warmup_layer_tokens);
  return b;
}
TrainerState decode_trainer_state(const std::vector<uint8_t>& b, const std::string& file) {
  size_t o = 0;
  const auto magic = take<uint32_t>(b, o, file);
  if (magic != kTrainerStateMagic && magic != kTrainerStateMagicV4 &&
      magic != kTrainerStateMagicV3 && magic != kTrainerStateMagicV2) {
    throw CheckpointError(file + ": not a trainer state of this version of loom-train");
  }
  TrainerState s;
  s.step = take<int64_t>(b, o, file);
  s.seed = take<uint64_t>(b, o, file);
  s.world = take<int32_t>(b, o, file);
  s.tokens_seen = take<uint64_t>(b, o, file);
  s.grad_bytes_sent = take<uint64_t>(b, o, file);
  s.grad_bytes_received = take<uint64_t>(b, o, file);
  s.grad_rounds = take<uint64_t>(b, o, file);
  s.uncompressed_bytes = take<uint64_t>(b, o, file);
  s.elapsed_s = take<double>(b, o, file);
  s.loss_acc = take<double>(b, o, file);
  s.acc_steps = take<int64_t>(b, o, file);
  if (magic != kTrainerStateMagicV2) s.skipped_steps = take<uint64_t>(b, o, file);
  if (magic == kTrainerStateMagic || magic == kTrainerStateMagicV4) {
    s.warmup_tokens = take<uint64_t>(b, o, file);
  }
  if (magic == kTrainerStateMagic) {
    s.layer_tokens = take<uint64_t>(b, o, file);
    s.warmup_layer_tokens = take<uint64_t>(b, o, file);
  } else {
    s.has_layer_tokens = false;
  }
  if (o != b.size()) throw CheckpointError(file + ": trailing bytes in the trainer state");
  return s;
}

void check_trainer_state(const TrainerState& s, const TrainerStateLimits& limits,
                         const std::string& file) {
  const auto refuse = [&](const std::string& what) {
    throw CheckpointError(file + ": " + what +
                          ": the trainer state is damaged or was edited (resume from another "
                          "checkpoint, or start over with --fresh)");
  };
  const auto u = [](auto v) { return std::to_string(v); };
  if (s.step != limits.folder_step) {
    refuse("step " + u(s.step) + " in a checkpoint folder of step " + u(limits.folder_step));
  }
  if (s.step < 1) refuse("step " + u(s.step) + " (a checkpoint follows step 1 or later)");
  const auto steps = static_cast<uint64_t>(s.step);
  // Tokens: a step takes at most batch_size x seq_len of them; layers see each at most once.
  if (limits.max_step_tokens > 0 && s.tokens_seen / steps > limits.max_step_tokens) {
    refuse(u(s.tokens_seen) + " tokens seen in " + u(s.step) + " steps of at most " +
           u(limits.max_step_tokens));
  }
  if (s.has_layer_tokens && s.layer_tokens / limits.layers > s.tokens_seen) {
    refuse(u(s.layer_tokens) + " layer tokens for " + u(s.tokens_seen) + " tokens and " +
           u(limits.layers) + " layers");
  }
  if (s.warmup_tokens > s.tokens_seen) {
    refuse("warmup ended at token " + u(s.warmup_tokens) + ", after the " + u(s.tokens_seen) +
           " seen");
  }
  if (s.warmup_layer_tokens > s.layer_tokens) {
    refuse("warmup ended at layer token " + u(s.warmup_layer_tokens) + ", after the " +
           u(s.layer_tokens) + " seen");
  }
  if (s.skipped_steps > steps) refuse(u(s.skipped_steps) + " skipped steps in " + u(s.step));
  if (s.acc_steps < 0 || s.acc_steps > s.step) {
    refuse(u(s.acc_steps) + " steps since the last metrics line, at step " + u(s.step));
  }
  // A loss sum is never negative (cross-entropy); NaN is kept: a NaN loss is a real outcome.
  if (s.loss_acc < 0 || std::isinf(s.loss_acc)) refuse("loss sum " + u(s.loss_acc));
  if (!(s.elapsed_s >= 0) || std::isinf(s.elapsed_s)) refuse("elapsed time " + u(s.elapsed_s));
}

std::vector<uint8_t> encode_moe_state(const MoeState& s) {
  std::vector<uint8_t> b;
  put(b, kMoeStateMagic);
  put(b, s.aux_acc);
  put(b, static_cast<uint32_t>(s.layers.size()));
  for (const auto& l : s.layers) {
    put(b, l.layer);
    put(b, l.experts);
    put(b, static_cast<uint32_t>(l.bias.size()));
    for (const float v : l.bias) put(b, v);
  }
  return b;
}

MoeState decode_moe_state(const std::vector<uint8_t>& b, const std::string& file) {
  size_t o = 0;
  if (take<uint32_t>(b, o, file) != kMoeStateMagic) {
    throw CheckpointError(file + ": not a [moe] state of this version of loom-train");
  }
  MoeState s;
  s.aux_acc = take<double>(b, o, file);
  const auto n = take<uint32_t>(b, o, file);
  // Each layer takes at least 12 bytes: a count past what the buffer holds is damage, not a
  // reason to reserve memory for it.
  if (n > (b.size() - o) / 12) {
    throw CheckpointError(file + ": says " + std::to_string(n) + " MoE layers in " +
                          std::to_string(b.size()) + " bytes");
  }
  for (uint32_t i = 0; i < n; ++i) {
    MoeLayerState l;
    l.layer = take<int32_t>(b, o, file);
    l.experts = take<int32_t>(b, o, file);
    const auto count = take<uint32_t>(b, o, file);
    if (count > (b.size() - o) / sizeof(float)) {
      throw CheckpointError(file + ": MoE layer #" + std::to_string(i) + " says " +
                            std::to_string(count) + " biases, more than the file holds");
    }
    l.bias.resize(count);
    for (float& v : l.bias) v = take<float>(b, o, file);
    s.layers.push_back(std::move(l));
  }
  if (o != b.size()) throw CheckpointError(file + ": trailing bytes in the [moe] state");
  return s;
}

}  // namespace loom::trainer
