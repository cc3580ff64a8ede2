#include "checkpoint.hpp"

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
  std::ifstream f(path, std::ios::binary);
  if (!f) throw CheckpointError(path + ": cannot open the " + std::string(what));
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
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

void write_file_atomic(const std::string& path, const void* data, size_t bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw CheckpointError(tmp + ": cannot create the file");
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    f.flush();
    if (!f) throw CheckpointError(tmp + ": write failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw CheckpointError(path + ": cannot rename into place: " + ec.message());
}

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
    if (!t.is_object() || t.value("dtype", "") != "F32" || !t.contains("shape") ||
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
  if (h.contains("__metadata__") && h["__metadata__"].is_object() &&
      h["__metadata__"].contains("fnv1a64")) {
    if (h["__metadata__"].value("fnv1a64", "") != hex(fnv1a64(data, data_bytes))) {
      throw CheckpointError(path + ": corrupted safetensors file: data checksum mismatch");
    }
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
  const auto b = read_all(path, "checkpoint file");
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

}  // namespace loom::trainer
