// libFuzzer target for the reference trainer's checkpoint files (trainer/train):
// the blob container every state file uses (parse_blob: optimizer, trainer, curriculum,
// router and MoE state), the trainer state inside trainer.rankN.bin (decode_trainer_state,
// then check_trainer_state against a run's limits), the [moe] state inside moe.rankN.bin
// (decode_moe_state), and the model weights (load_safetensors: libloom's safetensors reader
// and the trainer's rules on top, from an in-memory file; safetensors_fuzz covers the reader
// itself instrumented). The payloads of the other blob kinds go to plugins: the
// optimizer_state and plugin_state targets cover those.
//
// Input: one byte of mode, then the file. Mode bits 0-1: 0 (and 3) a blob file of kind
// 1 + (bits 4-6 modulo 5), 1 a trainer state payload alone, 2 a model safetensors file.
// Bit 2 recomputes the checksums over the input first (a blob's payload size and FNV-1a;
// the 16 hex digits of a safetensors header's "fnv1a64", then of its "loom.checksum" over the
// whole file), so mutations get past them.
//
// Besides crashes and sanitizer reports, it checks:
//  - every CheckpointError names the file;
//  - an accepted blob's payload is the file after its 32-byte header;
//  - a trainer state of the current layout, and an accepted [moe] state, encode back to the
//    same bytes.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "dataset.hpp"
#include "fuzz_common.hpp"
#include "trainer_state.hpp"

namespace {

using loom::trainer::BlobKind;
using loom::trainer::CheckpointError;

constexpr const char* kTarget = "checkpoint_fuzz";
constexpr size_t kBlobHeader = 32;

loom_fuzz::MemFile* g_file = nullptr;

// The model the weights are read into: three small tensors.
struct Weights {
  std::vector<float> wte = std::vector<float>(12), w = std::vector<float>(5),
                     b = std::vector<float>(2);
  std::vector<loom::trainer::ParamTensor> params{{"wte", {4, 3}, wte.data(), nullptr, 12},
                                                 {"h.0.w", {5}, w.data(), nullptr, 5},
                                                 {"lnf.b", {2}, b.data(), nullptr, 2}};
};

void check_named(const CheckpointError& e, const std::string& file) {
  const std::string m = e.what();
  if (m.rfind(file + ": ", 0) != 0) {
    loom_fuzz::invariant_failed(kTarget, "an error that does not name the file", m);
  }
}

template <class T>
void store(std::vector<uint8_t>& b, size_t off, T v) {
  std::memcpy(b.data() + off, &v, sizeof(T));
}

std::string hex(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof(s), "%016llx", static_cast<unsigned long long>(v));
  return s;
}

void trainer_state(const std::vector<uint8_t>& payload, const std::string& file) {
  loom::trainer::TrainerState s;
  try {
    s = loom::trainer::decode_trainer_state(payload, file);
  } catch (const CheckpointError& e) {
    check_named(e, file);
    return;
  }
  if (s.has_layer_tokens && loom::trainer::encode_trainer_state(s) != payload) {
    loom_fuzz::invariant_failed(kTarget, "decode then encode changes the trainer state", file);
  }
  // The limits of a run of 4 layers taking at most 16 x 128 tokens a step, resumed from the
  // folder of the state's own step (and of another).
  for (const int64_t folder : {s.step, int64_t{100}}) {
    try {
      loom::trainer::check_trainer_state(s, {folder, 16 * 128, 4}, file);
    } catch (const CheckpointError& e) {
      check_named(e, file);
    }
  }
}

// The [moe] state: an accepted one encodes back to the same bytes.
void moe_state(const std::vector<uint8_t>& payload, const std::string& file) {
  loom::trainer::MoeState s;
  try {
    s = loom::trainer::decode_moe_state(payload, file);
  } catch (const CheckpointError& e) {
    check_named(e, file);
    return;
  }
  if (loom::trainer::encode_moe_state(s) != payload) {
    loom_fuzz::invariant_failed(kTarget, "decode then encode changes the [moe] state", file);
  }
}

void blob(std::vector<uint8_t> b, BlobKind kind, bool fix) {
  if (fix && b.size() >= kBlobHeader) {
    store<uint64_t>(b, 16, b.size() - kBlobHeader);
    store<uint64_t>(b, 24, loom::trainer::fnv1a64(b.data() + kBlobHeader, b.size() - kBlobHeader));
  }
  const std::string file = "trainer.rank0.bin";
  std::vector<uint8_t> payload;
  try {
    payload = loom::trainer::parse_blob(b, kind, file);
  } catch (const CheckpointError& e) {
    check_named(e, file);
    return;
  }
  if (b.size() < kBlobHeader || payload.size() != b.size() - kBlobHeader ||
      !std::equal(payload.begin(), payload.end(), b.begin() + kBlobHeader)) {
    loom_fuzz::invariant_failed(kTarget, "accepted blob's payload", std::to_string(b.size()));
  }
  if (kind == BlobKind::kTrainer) trainer_state(payload, file);
  if (kind == BlobKind::kMoe) moe_state(payload, file);
}

// The 16 hex digits after `key` in the header, or nullptr.
uint8_t* digits_after(std::vector<uint8_t>& b, uint64_t n, const std::string& key) {
  const auto begin = b.begin() + 8;
  const auto end = begin + static_cast<std::ptrdiff_t>(n);
  const auto at = std::search(begin, end, key.begin(), key.end());
  if (end - at < static_cast<std::ptrdiff_t>(key.size() + 16)) return nullptr;
  return &*(at + static_cast<std::ptrdiff_t>(key.size()));
}

void weights(std::vector<uint8_t> b, bool fix) {
  uint64_t n = 0;
  if (b.size() >= 8) std::memcpy(&n, b.data(), 8);
  if (fix && b.size() >= 8 && n <= b.size() - 8) {
    if (uint8_t* d = digits_after(b, n, "\"fnv1a64\":\"")) {
      const std::string sum = hex(loom::trainer::fnv1a64(b.data() + 8 + n, b.size() - 8 - n));
      std::copy(sum.begin(), sum.end(), d);
    }
    // The whole file's, over its bytes with these digits read as '0' (docs/quantization.md).
    if (uint8_t* d = digits_after(b, n, "\"loom.checksum\":\"fnv1a64:")) {
      std::fill(d, d + 16, static_cast<uint8_t>('0'));
      const std::string sum = hex(loom::trainer::fnv1a64(b.data(), b.size()));
      std::copy(sum.begin(), sum.end(), d);
    }
  }
  g_file->set(b.data(), b.size());
  Weights w;
  try {
    loom::trainer::load_safetensors(g_file->path(), w.params);
  } catch (const CheckpointError& e) {
    check_named(e, g_file->path());
  }
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::vector<loom_fuzz::Seed> seeds() {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("loom_checkpoint_fuzz_seeds_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<loom_fuzz::Seed> out;
  auto add = [&](const std::string& name, uint8_t mode, const std::vector<uint8_t>& bytes) {
    std::vector<uint8_t> b{mode};
    b.insert(b.end(), bytes.begin(), bytes.end());
    out.push_back({name, std::move(b)});
  };
  loom::trainer::TrainerState s;
  s.step = 100;
  s.seed = 1234;
  s.world = 2;
  s.tokens_seen = 100 * 16 * 128;
  s.grad_bytes_sent = 1 << 20;
  s.grad_bytes_received = 1 << 20;
  s.grad_rounds = 200;
  s.uncompressed_bytes = 1 << 22;
  s.elapsed_s = 12.5;
  s.loss_acc = 31.25;
  s.acc_steps = 10;
  s.skipped_steps = 1;
  s.warmup_tokens = 10 * 16 * 128;
  s.layer_tokens = 4 * s.tokens_seen;
  s.warmup_layer_tokens = 4 * s.warmup_tokens;
  const std::vector<uint8_t> lts5 = loom::trainer::encode_trainer_state(s);
  add("trainer_state_lts5", 1, lts5);
  // The older layouts still read: LTS4 without the layer tokens, LTS2 also without the
  // skipped steps and warmup tokens.
  std::vector<uint8_t> lts4(lts5.begin(), lts5.end() - 16);
  store<uint32_t>(lts4, 0, 0x4c545334);
  add("trainer_state_lts4", 1, lts4);
  std::vector<uint8_t> lts2(lts5.begin(), lts5.end() - 32);
  store<uint32_t>(lts2, 0, 0x4c545332);
  add("trainer_state_lts2", 1, lts2);
  loom::trainer::MoeState moe;
  moe.aux_acc = 0.75;
  moe.layers = {{1, 4, {0.5f, -0.25f, 0.0f, 1.0f}}, {3, 8, {}}};
  const std::pair<BlobKind, std::vector<uint8_t>> blobs[] = {
      {BlobKind::kTrainer, lts5},
      {BlobKind::kOptimizer, {1, 2, 3, 4, 5, 6, 7, 8}},
      {BlobKind::kCurriculum, {}},
      {BlobKind::kRouter, {9, 9, 9}},
      {BlobKind::kMoe, loom::trainer::encode_moe_state(moe)},
  };
  for (const auto& [kind, payload] : blobs) {
    const std::string path = (dir / "blob.bin").string();
    loom::trainer::save_blob(path, kind, payload);
    const auto k = static_cast<uint8_t>(static_cast<uint32_t>(kind) - 1);
    const std::string name = "blob_kind" + std::to_string(static_cast<uint32_t>(kind));
    add(name, static_cast<uint8_t>(k << 4), file_bytes(path));
    add(name + "_fixed", static_cast<uint8_t>((k << 4) | 4), file_bytes(path));
  }
  Weights w;
  for (size_t i = 0; i < w.wte.size(); ++i) w.wte[i] = 0.25f * static_cast<float>(i);
  const std::string path = (dir / "model.safetensors").string();
  loom::trainer::save_safetensors(path, w.params, {{"step", "100"}});
  add("model", 2, file_bytes(path));
  add("model_fixed", 2 | 4, file_bytes(path));
  std::filesystem::remove_all(dir);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  loom_fuzz::write_seeds_if_asked(seeds());
  g_file = new loom_fuzz::MemFile("checkpoint_fuzz.safetensors");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::vector<uint8_t> file(data + 1, data + size);
  const bool fix = (data[0] & 4) != 0;
  switch (data[0] & 3) {
    case 1:
      trainer_state(file, "trainer.rank0.bin");
      break;
    case 2:
      weights(std::move(file), fix);
      break;
    default:
      blob(std::move(file), static_cast<BlobKind>(1 + ((data[0] >> 4) & 7) % 5), fix);
      break;
  }
  return 0;
}
