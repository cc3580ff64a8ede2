// Checkpoint files of the reference trainer (docs/trainer.md has the byte layouts):
//  - model weights as safetensors, read and written by libloom (loom_tensor_file_open,
//    loom_tensor_file_write): 8-byte little-endian header length N, N bytes of JSON
//    ({"__metadata__": {"loom.checksum": "fnv1a64:<hex of the whole file>", "fnv1a64": "<hex
//    of the data section>", "format": "pt", ...}, "name": {"dtype": "F32", "shape": [...],
//    "data_offsets": [begin, end]}, ...}), then the raw data;
//  - blobs (optimizer state, trainer state): magic "LOOMCKPT", uint32 version 1, uint32
//    kind, uint64 payload bytes, uint64 FNV-1a 64 of the payload, then the payload.
// Every file is written to a temporary file beside it, fsynced and renamed into place, its
// folder fsynced (durable_file.hpp; libloom's writer for the weights); writers throw
// WriteError. Readers throw CheckpointError naming the file and what is wrong (truncated,
// corrupted, shape mismatch...).
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "durable_file.hpp"
#include "model.hpp"

namespace loom::trainer {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void save_safetensors(const std::string& path, const std::vector<ParamTensor>& params,
                      const std::map<std::string, std::string>& metadata = {});
// Loads every tensor of `params` (by name; dtype, shape and size must match); tensors in the
// file that `params` lacks are an error too, and so is a file without the data checksum
// "fnv1a64". Nothing reaches `params` unless the whole file checks out.
void load_safetensors(const std::string& path, const std::vector<ParamTensor>& params);

// kCurriculum: a [curriculum] instance's exported state (the sampler's, the seqlen schedule's);
// kRouter: the [routing] router's; kMoe: the [moe] layers' trainer state (expert biases).
enum class BlobKind : uint32_t {
  kOptimizer = 1,
  kTrainer = 2,
  kCurriculum = 3,
  kRouter = 4,
  kMoe = 5
};
void save_blob(const std::string& path, BlobKind kind, const std::vector<uint8_t>& payload);
std::vector<uint8_t> load_blob(const std::string& path, BlobKind kind);
// load_blob's checks on bytes already read (`path` names them in errors).
std::vector<uint8_t> parse_blob(const std::vector<uint8_t>& bytes, BlobKind kind,
                                const std::string& path);

// ---- the run folder's checkpoints/ (docs/trainer.md, "Checkpoints")

// The complete checkpoint folders in `ckpt_root` (step_N; a step_N.tmp is still being
// written), oldest first.
std::vector<std::string> checkpoint_folders(const std::string& ckpt_root);
// What a run folder holds that starting over would delete, for the overwrite guard ("" when
// nothing): its checkpoint folders or `latest`, and a non-empty metrics file.
std::string run_contents(const std::string& ckpt_root, const std::string& metrics);
// The checkpoint folder a resume continues from: the one `latest` names, or, when `latest` is
// missing (a run stopped between renaming a checkpoint into place and naming it), the newest
// complete one (*newest set); "" when there is none.
std::string checkpoint_to_resume(const std::string& ckpt_root, bool* newest);
// N of a folder named step_N (digits only), or -1.
int64_t checkpoint_step(const std::string& name);

}  // namespace loom::trainer
