#include "checkpoint.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

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

constexpr char kBlobMagic[8] = {'L', 'O', 'O', 'M', 'C', 'K', 'P', 'T'};
constexpr size_t kBlobHeader = 32;

}  // namespace

void save_safetensors(const std::string& path, const std::vector<ParamTensor>& params,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h;
  size_t off = 0;
  for (const auto& p : params) {
    h[p.name] = {{"dtype", "F32"}, {"shape", p.shape}, {"data_offsets", {off, off + 4 * p.numel}}};
    off += 4 * p.numel;
  }
  std::vector<uint8_t> data(off);
  off = 0;
  for (const auto& p : params) {
    std::memcpy(data.data() + off, p.value, 4 * p.numel);
    off += 4 * p.numel;
  }
  nlohmann::ordered_json meta = {{"format", "pt"}};
  for (const auto& [k, v] : metadata) meta[k] = v;
  meta["fnv1a64"] = hex(fnv1a64(data.data(), data.size()));
  h["__metadata__"] = meta;
  std::string js = h.dump();
  while (js.size() % 8 != 0) js.push_back(' ');  // data 8-byte aligned, as the format suggests
  std::vector<uint8_t> out(8 + js.size() + data.size());
  const uint64_t n = js.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, js.data(), js.size());
  std::memcpy(out.data() + 8 + js.size(), data.data(), data.size());
  write_file_atomic(path, out.data(), out.size());
}

void load_safetensors(const std::string& path, const std::vector<ParamTensor>& params) {
  const auto b = read_all(path, "model checkpoint");
  if (b.size() < 8) {
    throw CheckpointError(path + ": truncated safetensors file (" + std::to_string(b.size()) +
                          " bytes, no header length)");
  }
  uint64_t n;
  std::memcpy(&n, b.data(), 8);
  if (n > b.size() - 8) {
    throw CheckpointError(path + ": truncated safetensors file: header length " +
                          std::to_string(n) + " exceeds the " + std::to_string(b.size() - 8) +
                          " bytes that follow");
  }
  auto h = nlohmann::json::parse(b.begin() + 8, b.begin() + 8 + static_cast<std::ptrdiff_t>(n),
                                 nullptr, false);
  if (h.is_discarded() || !h.is_object()) {
    throw CheckpointError(path + ": corrupted safetensors file: the header is not a JSON object");
  }
  const uint8_t* data = b.data() + 8 + n;
  const size_t data_bytes = b.size() - 8 - n;
  std::set<std::string> seen;
  size_t expected_bytes = 0;
  for (const auto& p : params) {
    if (!h.contains(p.name)) {
      throw CheckpointError(path + ": tensor '" + p.name + "' is missing");
    }
    const auto& t = h[p.name];
    if (!t.is_object() || !t.contains("dtype") || !t["dtype"].is_string() ||
        t["dtype"].get<std::string>() != "F32" || !t.contains("shape") ||
        !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2) {
      throw CheckpointError(path + ": tensor '" + p.name + "': bad entry (expected F32)");
    }
    std::vector<int64_t> shape;
    try {
      shape = t["shape"].get<std::vector<int64_t>>();
    } catch (...) {
      throw CheckpointError(path + ": tensor '" + p.name + "': bad shape");
    }
    if (shape != p.shape) {
      throw CheckpointError(path + ": tensor '" + p.name + "' has shape " + t["shape"].dump() +
                            ", the model needs " + nlohmann::json(p.shape).dump());
    }
    const auto& o = t["data_offsets"];
    if (!o[0].is_number_unsigned() || !o[1].is_number_unsigned()) {
      throw CheckpointError(path + ": tensor '" + p.name + "': bad data_offsets");
    }
    const uint64_t lo = o[0].get<uint64_t>(), hi = o[1].get<uint64_t>();
    if (hi < lo || hi - lo != 4 * p.numel) {
      throw CheckpointError(path + ": tensor '" + p.name +
                            "': data_offsets do not match its shape");
    }
    if (hi > data_bytes) {
      throw CheckpointError(path + ": truncated safetensors file: tensor '" + p.name +
                            "' ends at byte " + std::to_string(hi) + " of a " +
                            std::to_string(data_bytes) + "-byte data section");
    }
    expected_bytes += 4 * p.numel;
    seen.insert(p.name);
  }
  for (const auto& [k, v] : h.items()) {
    if (k != "__metadata__" && !seen.count(k)) {
      throw CheckpointError(path + ": tensor '" + k + "' is not a parameter of this model");
    }
  }
  if (data_bytes != expected_bytes) {
    throw CheckpointError(path + ": data section is " + std::to_string(data_bytes) +
                          " bytes, the tensors need " + std::to_string(expected_bytes));
  }
  // The checksum is not optional: a header edited to drop or rename it must not switch the
  // check off.
  const auto meta = h.find("__metadata__");
  if (meta == h.end() || !meta->is_object() || !meta->contains("fnv1a64") ||
      !(*meta)["fnv1a64"].is_string()) {
    throw CheckpointError(path +
                          ": has no data checksum (__metadata__ key \"fnv1a64\"): every model "
                          "checkpoint loom train writes has one; the file is damaged or edited");
  }
  if ((*meta)["fnv1a64"].get<std::string>() != hex(fnv1a64(data, data_bytes))) {
    throw CheckpointError(path + ": corrupted safetensors file: data checksum mismatch");
  }
  for (const auto& p : params) {
    const uint64_t lo = h[p.name]["data_offsets"][0].get<uint64_t>();
    std::memcpy(p.value, data + lo, 4 * p.numel);
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
