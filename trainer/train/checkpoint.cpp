#include "checkpoint.hpp"

#include <loom/embed.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "dataset.hpp"

namespace loom::trainer {

namespace {

std::vector<uint8_t> read_all(const std::string& path, const char* what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw CheckpointError(path + ": is a folder, not the " + std::string(what));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) throw CheckpointError(path + ": cannot open the " + std::string(what));
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw CheckpointError(path + ": read error in the " + std::string(what));
  return b;
}

std::string hex(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof(s), "%016llx", static_cast<unsigned long long>(v));
  return s;
}

// A libloom message, which names the file already; prefixed with it where it does not.
std::string with_path(const std::string& path, const std::string& message) {
  return message.rfind(path + ": ", 0) == 0 ? message : path + ": " + message;
}

constexpr char kBlobMagic[8] = {'L', 'O', 'O', 'M', 'C', 'K', 'P', 'T'};
constexpr size_t kBlobHeader = 32;

}  // namespace

void save_safetensors(const std::string& path, const std::vector<ParamTensor>& params,
                      const std::map<std::string, std::string>& metadata) {
  // The host's writer lays tensors of one element size out back to back in the order given,
  // so the data area, which "fnv1a64" covers, is the parameters' values one after the other.
  static const float kNoBytes = 0.0f;  // the writer wants a pointer even for an empty tensor
  std::vector<loom_tensor_out> out;
  out.reserve(params.size());
  uint64_t sum = fnv1a64(nullptr, 0);
  for (const auto& p : params) {
    loom_tensor_out t{};
    t.struct_size = LOOM_TENSOR_OUT_SIZE;
    t.ndim = static_cast<int32_t>(p.shape.size());
    t.name = p.name.c_str();
    t.dtype = "F32";
    t.shape = p.shape.data();
    t.data = p.value != nullptr ? p.value : &kNoBytes;
    out.push_back(t);
    sum = fnv1a64(p.value, 4 * p.numel, sum);
  }
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("format", "pt");
  meta["fnv1a64"] = hex(sum);
  std::vector<const char*> pairs;
  for (const auto& [k, v] : meta) {
    pairs.push_back(k.c_str());
    pairs.push_back(v.c_str());
  }
  if (loom_tensor_file_write(path.c_str(), out.data(), out.size(), pairs.data(), meta.size()) !=
      LOOM_OK) {
    throw WriteError(with_path(path, loom_last_error()));
  }
}

void load_safetensors(const std::string& path, const std::vector<ParamTensor>& params) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw CheckpointError(path + ": is a folder, not the model checkpoint");
  }
  // Opening checks the whole file (header, offsets, sizes) and every checksum it carries.
  loom_tensor_file* opened = nullptr;
  if (loom_tensor_file_open(path.c_str(), &opened) != LOOM_OK) {
    throw CheckpointError(with_path(path, loom_last_error()));
  }
  const std::unique_ptr<loom_tensor_file, void (*)(loom_tensor_file*)> file(opened,
                                                                            loom_tensor_file_close);
  loom_tensor_file* f = file.get();
  // The data checksum is not optional: a header edited to drop or rename it must not switch
  // the check off (the reader verifies only the checksums a file carries).
  if (loom_tensor_file_metadata(f, "fnv1a64") == nullptr) {
    throw CheckpointError(path +
                          ": has no data checksum (__metadata__ key \"fnv1a64\"): every model "
                          "checkpoint loom train writes has one; the file is damaged or edited");
  }
  std::vector<const float*> values(params.size());
  std::set<std::string> names;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamTensor& p = params[i];
    size_t index = 0;
    if (loom_tensor_file_find(f, p.name.c_str(), &index) != LOOM_OK) {
      throw CheckpointError(path + ": tensor '" + p.name + "' is missing");
    }
    loom_tensor_info t{};
    t.struct_size = LOOM_TENSOR_INFO_SIZE;
    if (loom_tensor_file_info(f, index, &t) != LOOM_OK) {
      throw CheckpointError(with_path(path, loom_last_error()));
    }
    if (t.quantized != 0 || t.tensor.dtype.code != kDLFloat || t.tensor.dtype.bits != 32 ||
        t.tensor.dtype.lanes != 1) {
      throw CheckpointError(path + ": tensor '" + p.name + "': bad entry (expected F32" +
                            (t.quantized != 0 ? ", not a quantized tensor)" : ")"));
    }
    const std::vector<int64_t> shape(t.tensor.shape, t.tensor.shape + t.tensor.ndim);
    if (shape != p.shape) {
      throw CheckpointError(path + ": tensor '" + p.name + "' has shape " +
                            nlohmann::json(shape).dump() + ", the model needs " +
                            nlohmann::json(p.shape).dump());
    }
    uint64_t numel = 1;
    for (const int64_t d : shape) numel *= static_cast<uint64_t>(d);
    if (numel != p.numel) {
      throw CheckpointError(path + ": tensor '" + p.name + "' holds " + std::to_string(numel) +
                            " values, the model needs " + std::to_string(p.numel));
    }
    values[i] = static_cast<const float*>(t.tensor.data);
    names.insert(p.name);
  }
  const size_t count = loom_tensor_file_count(f);
  for (size_t i = 0; i < count; ++i) {
    const std::string name = loom_tensor_file_name(f, i);
    if (names.count(name) == 0) {
      throw CheckpointError(path + ": tensor '" + name + "' is not a parameter of this model");
    }
  }
  // The whole file checked out: only now does anything reach the model.
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel != 0) std::memcpy(params[i].value, values[i], 4 * params[i].numel);
  }
}

void save_blob(const std::string& path, BlobKind kind, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out(kBlobHeader + payload.size());
  std::memcpy(out.data(), kBlobMagic, 8);
  const uint32_t version = 1, k = static_cast<uint32_t>(kind);
  const uint64_t n = payload.size(), sum = fnv1a64(payload.data(), payload.size());
  std::memcpy(out.data() + 8, &version, 4);
  std::memcpy(out.data() + 12, &k, 4);
  std::memcpy(out.data() + 16, &n, 8);
  std::memcpy(out.data() + 24, &sum, 8);
  if (!payload.empty()) std::memcpy(out.data() + kBlobHeader, payload.data(), payload.size());
  write_file_atomic(path, out.data(), out.size());
}

std::vector<uint8_t> load_blob(const std::string& path, BlobKind kind) {
  return parse_blob(read_all(path, "checkpoint file"), kind, path);
}

std::vector<uint8_t> parse_blob(const std::vector<uint8_t>& b, BlobKind kind,
                                const std::string& path) {
  if (b.size() < kBlobHeader) {
    throw CheckpointError(path + ": truncated checkpoint file (" + std::to_string(b.size()) +
                          " bytes, the header alone is " + std::to_string(kBlobHeader) + ")");
  }
  if (std::memcmp(b.data(), kBlobMagic, 8) != 0) {
    throw CheckpointError(path + ": not a Loom checkpoint file (bad magic)");
  }
  uint32_t version, k;
  uint64_t n, sum;
  std::memcpy(&version, b.data() + 8, 4);
  std::memcpy(&k, b.data() + 12, 4);
  std::memcpy(&n, b.data() + 16, 8);
  std::memcpy(&sum, b.data() + 24, 8);
  if (version != 1) {
    throw CheckpointError(path + ": checkpoint file version " + std::to_string(version) +
                          " is not supported");
  }
  if (k != static_cast<uint32_t>(kind)) {
    throw CheckpointError(path + ": wrong kind of checkpoint file");
  }
  if (n != b.size() - kBlobHeader) {
    throw CheckpointError(path + ": truncated checkpoint file: the header says " +
                          std::to_string(n) + " payload bytes, the file has " +
                          std::to_string(b.size() - kBlobHeader));
  }
  if (fnv1a64(b.data() + kBlobHeader, n) != sum) {
    throw CheckpointError(path + ": corrupted checkpoint file: payload checksum mismatch");
  }
  return {b.begin() + kBlobHeader, b.end()};
}

std::vector<std::string> checkpoint_folders(const std::string& ckpt_root) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(ckpt_root, ec)) {
    const std::string f = e.path().filename().string();
    if (e.is_directory(ec) && checkpoint_step(f) >= 0) out.push_back(f);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string run_contents(const std::string& ckpt_root, const std::string& metrics) {
  std::vector<std::string> held;
  const auto dirs = checkpoint_folders(ckpt_root);
  std::error_code ec;
  if (!dirs.empty()) {
    held.push_back("checkpoints (" + dirs.front() +
                   (dirs.size() > 1 ? " to " + dirs.back() : std::string()) + ")");
  } else if (std::filesystem::exists(std::filesystem::path(ckpt_root) / "latest", ec)) {
    held.push_back("checkpoints/latest");
  }
  if (std::filesystem::exists(metrics, ec) && std::filesystem::file_size(metrics, ec) > 0) {
    held.push_back("metrics (" + std::filesystem::path(metrics).filename().string() + ")");
  }
  std::string out;
  for (const auto& h : held) out += (out.empty() ? "" : " and ") + h;
  return out;
}

std::string checkpoint_to_resume(const std::string& ckpt_root, bool* newest) {
  *newest = false;
  const auto latest = std::filesystem::path(ckpt_root) / "latest";
  std::error_code ec;
  if (std::filesystem::exists(latest, ec)) {
    const auto b = read_all(latest.string(), "latest file");
    std::string name(b.begin(), b.end());
    while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back()))) {
      name.pop_back();
    }
    return name.empty() ? "?" : name;  // the loader refuses a name that is no checkpoint
  }
  const auto dirs = checkpoint_folders(ckpt_root);
  if (dirs.empty()) return "";
  *newest = true;
  return dirs.back();
}

int64_t checkpoint_step(const std::string& name) {
  constexpr size_t kPrefix = 5;  // "step_"
  if (name.size() <= kPrefix || name.size() > kPrefix + 18 || name.rfind("step_", 0) != 0 ||
      name.find_first_not_of("0123456789", kPrefix) != std::string::npos) {
    return -1;
  }
  return std::stoll(name.substr(kPrefix));
}

}  // namespace loom::trainer
