// The trainer's own configuration file (TOML), which names the Loom manifest it uses.
// docs/trainer.md lists every key.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <loom/embed.h>
#include <nlohmann/json.hpp>

#include "model.hpp"

namespace loom::trainer {

// A config's problems, one "FILE:LINE:COL: [section] key: problem" per line (what() joins
// them with newlines), every one found, not just the first.
class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(const std::string& error) : ConfigError(std::vector<std::string>{error}) {}
  explicit ConfigError(std::vector<std::string> errors);
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  std::vector<std::string> errors_;
};

struct TrainConfig {
  std::string config_path;  // the file this was read from
  // [loom]
  std::string manifest;            // the Loom manifest (path resolved against the config file)
  std::string optimizer = "main";  // [optimizer.NAME] in the manifest
  std::string comm = "world";      // [comm.NAME] in the manifest; "" for none (one rank)
  // [model]  (vocab_size 0: the dataset's)
  ModelConfig model{0, 128, 4, 4, 128};
  // [data]
  std::string dataset;
  // [curriculum] (optional; docs/trainer.md "Curriculum and sequence-length warmup")
  std::string sampler;     // [sampler.NAME] in the manifest: batches are its sample ids
  std::string seqlen;      // [curriculum.NAME] in the manifest: a sequence-length schedule
  std::string sampler_at;  // FILE:LINE:COL of those keys, for the errors found later
  std::string seqlen_at;
  // [routing] (optional; docs/trainer.md "Token routing")
  std::string router;     // [router.NAME] in the manifest: the middle layers' token router
  std::string router_at;  // FILE:LINE:COL of the key
  // [moe] (optional; docs/trainer.md "Mixture of Experts")
  std::string moe;               // [moe.NAME] in the manifest: the loom.moe/1 instance
  std::vector<int> moe_layers;   // the MoE blocks, as listed
  std::vector<int> moe_experts;  // per entry of moe_layers; 0: the instance's num_experts
  int moe_hidden = 0;            // each expert's hidden width; 0: 4 * [model] dim
  double moe_aux_loss_coef = 0.01;
  std::string moe_at, moe_layers_at, moe_experts_at;  // FILE:LINE:COL of the keys
  // [quantization] (optional; docs/trainer.md "Quantization")
  std::string quantizer;                   // [quantizer.NAME] in the manifest ("": no quantization)
  std::string quantizer_at;                // FILE:LINE:COL of the key
  std::vector<std::string> quant_tensors;  // name patterns (default: the blocks' linears)
  std::string quant_tensors_at;
  std::vector<int> quant_layers;  // blocks whose weights are quantized (empty: all)
  std::string quant_layers_at;
  bool qat = false;     // train with fake-quantized weights (straight-through gradients)
  std::string weights;  // fp32 safetensors the model starts from ("": the seed's init)
  std::string weights_at;
  std::string checkpoint;  // a `loom quantize` output, evaluated as it is (--eval-only)
  std::string checkpoint_at;
  std::string teacher;  // fp32 safetensors of the teacher (LKD, KD); "": `weights`
  std::string teacher_at;
  int64_t lkd_steps = 0;  // ZeroQuant's layer-by-layer distillation: steps per block
  double lkd_lr = 1e-4;
  bool kd = false;  // XTC's distillation during QAT: CE + kd_weight * soft CE + hidden MSE
  double kd_weight = 1.0;
  double hidden_weight = 1.0;
  // [gradients] (optional; docs/trainer.md "Gradient communication"): how the trainer averages
  // the gradients over the ranks. Absent: one allreduce of all of them after the backward.
  bool grad_buckets = false;  // the section is present: buckets
  double bucket_mb = 25.0;    // a bucket's gradients, in MiB of fp32
  bool overlap = true;        // start each bucket during the backward, as soon as it is final
  std::string wire = "fp32";  // "fp32" | "bf16": the element type on the wire
  std::string wire_at;        // FILE:LINE:COL of the key
  // [train]
  int64_t steps = 1000;
  int batch_size = 16;  // sequences per global batch, split evenly over the ranks
  int seq_len = 128;
  uint64_t seed = 1234;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 100;
  // >0: stop once this many tokens (all ranks) are consumed; `steps` is then an upper bound.
  int64_t train_tokens = 0;
  // "steps": the decay follows the step; "tokens": it follows the tokens consumed (warmup
  // stays in steps). See lr_at_tokens.
  // "layer_tokens": it follows the layer tokens consumed (the sum over layers of the tokens
  // each processed; a router's kept counts), see lr_at_layer_tokens.
  // "fp32" | "bf16": the model's precision (docs/trainer.md, "bf16 mode"): bf16 weights and
  // activations in the forward and backward, fp32 master weights in the optimizer.
  std::string precision = "fp32";
  std::string precision_at;  // FILE:LINE:COL of the key
  std::string lr_unit = "steps";
  std::string lr_unit_at;       // FILE:LINE:COL of lr_unit, for the warning below
  std::string train_tokens_at;  // FILE:LINE:COL of train_tokens, for the warning below
  // >0: stop once this many layer tokens (all ranks) are consumed; with lr_unit =
  // "layer_tokens" also the decay's end (else layers * the decay's tokens).
  int64_t train_layer_tokens = 0;
  std::string train_layer_tokens_at;
  std::string decay = "cosine";       // "cosine" | "linear" | "constant"
  double clip_grad_norm = 1.0;        // 0: off
  int64_t eval_interval = 100;        // 0: only at the end
  int eval_batches = 8;               // batches of batch_size sequences of seq_len
  int64_t checkpoint_interval = 100;  // 0: only at the end
  int64_t log_interval = 10;
  int64_t stop_after = 0;     // >0: exit (as if killed) after this step, for tests
  std::string run_dir;        // default: runs/<config stem> beside the config file
  std::string plot = "auto";  // "auto": RUN_DIR/loss.png; "" or "none": no plot
  int threads = 0;            // model threads per rank; 0: cores / ranks
  // Position rows at and past seq_len never get a gradient: pass the optimizer an
  // exp_avg_mask that zeroes their momentum (1-bit compression cannot represent 0, so
  // without it they drift; optimizers with an exact allreduce ignore the mask).
  bool mask_unused_positions = true;
};

// Reads and validates the file; relative paths become relative to its folder. Throws
// ConfigError with every problem found.
TrainConfig load_config(const std::string& path);
// The same, but appends the problems (in file order) to `problems` and returns what it could
// read; only a file it cannot open or parse throws.
TrainConfig read_config(const std::string& path, std::vector<std::string>& problems);

// Settings that are valid but likely not what was meant, one line each (FILE:LINE:COL:
// [section] key: warning: ...): train_tokens with lr_unit = "steps" (the decay runs over
// `steps`, an upper bound, so a run ended by tokens stops before the rate reaches min_lr);
// train_layer_tokens with another lr_unit; lr_unit = "layer_tokens" under [routing] without
// train_layer_tokens (the decay runs over the unrouted run's layer tokens, which a routed run
// does not reach by its last step, so the rate ends above min_lr).
std::vector<std::string> config_warnings(const TrainConfig& c);

// One instance's parameters as libloom validated them (loom_instance_params: {"params":
// {NAME: {"value", "at"}}, ...}), or null when `session` has no such instance. The trainer
// reads its instances' settings here, never from the manifest's text.
nlohmann::json instance_params(loom_session* session, const char* kind, const std::string& name);

// The problems of the names the config gives its manifest's instances ([optimizer.NAME],
// [comm.NAME]), one message each; empty when both are there (or the manifest is unreadable:
// libloom reports that). It reads the manifest's table names itself, so that a config's
// names are checked even when the manifest does not validate.
std::vector<std::string> manifest_name_problems(const TrainConfig& c);

// The index a [sampler.NAME] of plugin curriculum_sampler reads (any clustering_type but
// "single_cluster"): its `index` folder and `metric`, as `session` validated them. nullopt for
// another plugin, for single_cluster, or without an index (the plugin reports that).
struct SamplerIndexRef {
  std::string index;  // as written (relative: to the working folder, as the sampler opens it)
  std::string metric;
};
std::optional<SamplerIndexRef> sampler_index_ref(loom_session* session, const TrainConfig& c);

// `message` (an error from opening the manifest) with the index hint's DATASET and SEQ_LEN
// filled in from this config, so the `loom data analyze` command it gives runs as printed.
std::string with_run_values(const std::string& message, const TrainConfig& c);

// "" when the index the config's sampler reads was written for this dataset (its payload
// checksum, `dataset_checksum`) and for sample length seq_len; else the problem, naming the
// index folder and both values (the caller prefixes the config key). No index: "".
std::string sampler_index_problem(loom_session* session, const TrainConfig& c,
                                  uint64_t dataset_checksum);

// The manifest's sections `loom check` opens (loom_open_options.sections) to create and plan
// the curriculum's, the router's and the quantizer's instances without its comm and optimizer.
inline constexpr const char* kCurriculumSections = "curriculum,sampler,router,quantizer";

// The manifest's [loom] and [moe.*] tables alone, as TOML text, with each [moe.*] table's
// `comm` and `ep_size` lines blanked: what `loom check` opens to create and plan the MoE
// instance as one rank would, without a comm (the other lines keep their numbers). Empty when
// the manifest does not parse or a [moe.*] table is not laid out line by line. (The one text
// edit left: the host has no way yet to create an instance with parameters overridden.)
std::string moe_check_manifest(const TrainConfig& c);

// The [moe.NAME] instance's (NAME = c.moe) ep_size and where the manifest sets it ("" for the
// default), and its comm ("" when it names none), as `session` validated them.
int64_t moe_instance_ep_size(loom_session* session, const TrainConfig& c, std::string& at);
std::string moe_instance_comm(loom_session* session, const TrainConfig& c);

// The names of the model's parameters [quantization] selects (its tensors and layers), and
// the problems of its patterns (one per pattern that matches nothing, at the tensors key).
std::vector<std::string> quantized_tensor_names(const TrainConfig& c,
                                                std::vector<std::string>* problems = nullptr);

// The learning rate of (1-based) step `step`: linear warmup from lr/warmup to lr over
// warmup_steps, then cosine / linear decay to min_lr at `steps`, or constant.
double lr_at(const TrainConfig& c, int64_t step);

// The tokens the decay ends at under lr_unit = "tokens": train_tokens, or, when that is 0,
// steps * batch_size * seq_len.
uint64_t decay_tokens(const TrainConfig& c);

// lr_unit = "tokens": warmup as lr_at (by step); past it the decay's progress is
// r = (tokens - warmup_tokens) / (decay_tokens - warmup_tokens), clamped to [0, 1], where
// `tokens` are the tokens consumed up to and including this step and `warmup_tokens` those
// consumed when the warmup ended (after step warmup_steps). With a constant sequence length
// this is exactly lr_at.
double lr_at_tokens(const TrainConfig& c, int64_t step, uint64_t tokens, uint64_t warmup_tokens);

// The layer tokens the decay ends at under lr_unit = "layer_tokens": train_layer_tokens, or,
// when that is 0, the baseline's layer tokens: layers * decay_tokens (every layer processing
// every token of train_tokens, or of steps * batch_size * seq_len). Saturates.
uint64_t decay_layer_tokens(const TrainConfig& c);

// lr_unit = "layer_tokens": lr_at_tokens over layer tokens: warmup by step, then the decay's
// progress r = (layer_tokens - warmup) / (decay_layer_tokens - warmup), clamped to [0, 1],
// `layer_tokens` counting this step's own. Without routing it is exactly lr_at_tokens.
double lr_at_layer_tokens(const TrainConfig& c, int64_t step, uint64_t layer_tokens,
                          uint64_t warmup_layer_tokens);

// The sequence length a step trains at, from the seq_len a sequence-length schedule gives for
// it: `seq_len` when scheduled >= seq_len, else `scheduled` rounded down to a multiple of 8,
// and at least 8 (and never above seq_len).
int step_seq_len(int64_t scheduled, int seq_len);

}  // namespace loom::trainer
