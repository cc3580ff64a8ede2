#include "safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string_view>

#include "../status.hpp"
// The one FNV-1a 64 of Loom's file formats (the dataset, the index files, the trainer's
// checkpoints) is part of the formats, so it is the ABI's.
#include <loom/checksum.h>

namespace loom::host::safetensors {
namespace {

struct DtypeRow {
  Dtype dtype;
  std::string_view name;
  uint32_t bytes;
  DLDataType dl;
};

constexpr DtypeRow kDtypes[] = {
    {Dtype::F64, "F64", 8, {kDLFloat, 64, 1}}, {Dtype::F32, "F32", 4, {kDLFloat, 32, 1}},
    {Dtype::F16, "F16", 2, {kDLFloat, 16, 1}}, {Dtype::BF16, "BF16", 2, {kDLBfloat, 16, 1}},
    {Dtype::I64, "I64", 8, {kDLInt, 64, 1}},   {Dtype::I32, "I32", 4, {kDLInt, 32, 1}},
    {Dtype::I16, "I16", 2, {kDLInt, 16, 1}},   {Dtype::I8, "I8", 1, {kDLInt, 8, 1}},
    {Dtype::U64, "U64", 8, {kDLUInt, 64, 1}},  {Dtype::U32, "U32", 4, {kDLUInt, 32, 1}},
    {Dtype::U16, "U16", 2, {kDLUInt, 16, 1}},  {Dtype::U8, "U8", 1, {kDLUInt, 8, 1}},
    {Dtype::BOOL, "BOOL", 1, {kDLUInt, 8, 1}},
};

const DtypeRow& row(Dtype d) { return kDtypes[static_cast<size_t>(d)]; }

// A malformed file: corrupt or truncated data.
[[noreturn]] void bad(const std::string& file, const std::string& message) {
  throw Error(LOOM_ERR_DATA_LOSS, file + ": " + message);
}

std::string sq(const std::string& s) { return "'" + s + "'"; }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string kind_phrase(const nlohmann::ordered_json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::string:
      return "a string";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

// A non-negative integer JSON value, or nullopt (floats, negatives, anything else).
std::optional<uint64_t> as_count(const nlohmann::ordered_json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

nlohmann::ordered_json parse_json(const char* begin, const char* end, const std::string& file) {
  // Duplicate keys are an error (a JSON library keeps one of them silently), and nothing
  // valid nests deeper than a tensor's arrays.
  std::vector<std::set<std::string>> keys;
  std::string tensor;  // the current top-level key, for messages
  auto callback = [&](int depth, nlohmann::json::parse_event_t event,
                      nlohmann::ordered_json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (depth > 3) bad(file, "the header nests JSON deeper than a safetensors header can");
    if (event == E::object_start) keys.emplace_back();
    if (event == E::object_end && !keys.empty()) keys.pop_back();
    if (event == E::key && !keys.empty()) {
      const std::string k = parsed.get<std::string>();
      if (!keys.back().insert(k).second) {
        if (keys.size() == 1) bad(file, "the header names " + sq(k) + " twice");
        bad(file, "the header's entry " + sq(tensor) + " has key " + sq(k) + " twice");
      }
      if (keys.size() == 1) tensor = k;
    }
    return true;
  };
  try {
    return nlohmann::ordered_json::parse(begin, end, callback, true, false);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is 1-based within the header; say where in the file too.
    bad(
        file, "the header is not valid JSON (at header byte " + std::to_string(e.byte) +
                  ", file byte " + std::to_string(e.byte + 7) + "): " + [&] {
                    const std::string w = e.what();
                    const auto p = w.find("parse error");
                    return p == std::string::npos ? w : w.substr(p);
                  }());
  } catch (const nlohmann::json::exception& e) {
    bad(file, std::string("the header is not valid JSON: ") + e.what());
  }
}

TensorEntry parse_entry(const std::string& name, const nlohmann::ordered_json& v,
                        const std::string& file) {
  const std::string what = "tensor " + sq(name);
  if (name.empty()) bad(file, "the header has a tensor with an empty name");
  if (!v.is_object()) {
    bad(file,
        what + " must be an object with dtype, shape and data_offsets, not " + kind_phrase(v));
  }
  for (const auto& [k, x] : v.items()) {
    if (k != "dtype" && k != "shape" && k != "data_offsets") {
      bad(file,
          what + " has unknown key " + sq(k) + " (a tensor has dtype, shape and data_offsets)");
    }
  }
  for (const char* k : {"dtype", "shape", "data_offsets"}) {
    if (!v.contains(k)) bad(file, what + " has no " + sq(k));
  }
  TensorEntry t;
  t.name = name;
  const auto& d = v["dtype"];
  if (!d.is_string()) bad(file, what + ": dtype must be a string, not " + kind_phrase(d));
  const auto dt = parse_dtype(d.get<std::string>());
  if (!dt) {
    bad(file, what + " has dtype " + sq(d.get<std::string>()) +
                  ", which this reader does not know (it reads " + dtype_names() + ")");
  }
  t.dtype = *dt;
  const auto& s = v["shape"];
  if (!s.is_array()) bad(file, what + ": shape must be an array, not " + kind_phrase(s));
  uint64_t numel = 1;
  bool overflow = false;
  bool empty = false;
  for (const auto& x : s) {
    const auto n = as_count(x);
    if (!n || *n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      bad(file, what + ": shape must hold non-negative integers, not " + x.dump());
    }
    t.shape.push_back(static_cast<int64_t>(*n));
    if (*n == 0) empty = true;
    if (*n != 0 && numel > std::numeric_limits<uint64_t>::max() / *n) overflow = true;
    numel *= *n;
  }
  const uint32_t esize = dtype_size(t.dtype);
  if (empty) {  // a zero dimension makes the whole product 0, whatever came before
    overflow = false;
    numel = 0;
  }
  if (overflow || numel > std::numeric_limits<uint64_t>::max() / esize) {
    bad(file, what + " has shape " + shape_text(t.shape) + ", too large to address");
  }
  t.numel = numel;
  const auto& o = v["data_offsets"];
  if (!o.is_array() || o.size() != 2 || !as_count(o[0]) || !as_count(o[1])) {
    bad(file,
        what + ": data_offsets must be two non-negative integers [begin, end], not " + o.dump());
  }
  t.begin = *as_count(o[0]);
  t.end = *as_count(o[1]);
  if (t.end < t.begin) {
    bad(file, what + " has data_offsets [" + std::to_string(t.begin) + ", " +
                  std::to_string(t.end) + "]: the end is before the begin");
  }
  const uint64_t need = numel * esize;
  if (t.end - t.begin != need) {
    bad(file, what + " is " + std::string(dtype_name(t.dtype)) + " " + shape_text(t.shape) + " (" +
                  std::to_string(need) + " bytes) but its data_offsets [" +
                  std::to_string(t.begin) + ", " + std::to_string(t.end) + "] span " +
                  std::to_string(t.end - t.begin) + " bytes");
  }
  return t;
}

constexpr std::string_view kZeroDigits = "0000000000000000";

std::string hex16(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

bool is_hex16(std::string_view s) {
  return s.size() == 16 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// A metadata value as a message shows it: quoted, and cut short (a value may be huge).
std::string shown(const std::string& v) {
  return v.size() <= 40 ? "'" + v + "'" : "'" + v.substr(0, 40) + "...'";
}

// What the writer puts in front of the checksum's digits, byte for byte.
std::string checksum_prefix() {
  return "\"" + std::string(kChecksumKey) + "\":\"" + std::string(kChecksumAlgorithm) + ":";
}

// The file offset of the 16 digits `digits` of "loom.checksum": the one place the header
// text holds the key as the writer writes it (compact, unescaped). JSON escapes every quote
// inside a string, so that text only occurs where the key really is; anything else is
// refused rather than guessed at.
uint64_t checksum_digits_at(const uint8_t* bytes, const Header& h, std::string_view digits,
                            const std::string& file) {
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8),  // NOLINT
                              static_cast<size_t>(h.header_bytes));
  const std::string prefix = checksum_prefix();
  const size_t at = text.find(prefix);
  const size_t d = at == std::string_view::npos ? text.size() : at + prefix.size();
  if (at == std::string_view::npos || text.find(prefix, at + 1) != std::string_view::npos ||
      d + 17 > text.size() || text.substr(d, 16) != digits || text[d + 16] != '"') {
    bad(file, "__metadata__ '" + std::string(kChecksumKey) + "' is not written once as " + prefix +
                  "<16 hex digits>\" in the header, so the bytes it covers cannot be found");
  }
  return 8 + d;
}

// FNV-1a 64 of the whole file with the checksum's 16 digits (at `digits_at`) read as '0'.
uint64_t whole_file_hash(const uint8_t* bytes, uint64_t size, uint64_t digits_at) {
  uint64_t h = loom_fnv1a64(bytes, digits_at, LOOM_FNV1A64_OFFSET);
  h = loom_fnv1a64(kZeroDigits.data(), kZeroDigits.size(), h);
  return loom_fnv1a64(bytes + digits_at + 16, size - digits_at - 16, h);
}

void write_all(int fd, const void* data, uint64_t bytes, uint64_t offset, const std::string& file) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(bytes, 1ull << 30));
    const ssize_t n = ::pwrite(fd, p, chunk, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(LOOM_ERR_INTERNAL,
                  file + ": write failed: " + std::string(std::strerror(n < 0 ? errno : ENOSPC)));
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void read_all(int fd, void* data, uint64_t bytes, uint64_t offset, const std::string& file) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, static_cast<size_t>(bytes), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(LOOM_ERR_INTERNAL, file + ": cannot read back what was written: " +
                                         std::string(n < 0 ? std::strerror(errno) : "too short"));
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

}  // namespace

std::optional<Dtype> parse_dtype(std::string_view name) {
  for (const auto& r : kDtypes) {
    if (r.name == name) return r.dtype;
  }
  return std::nullopt;
}
std::string_view dtype_name(Dtype dtype) { return row(dtype).name; }
uint32_t dtype_size(Dtype dtype) { return row(dtype).bytes; }
DLDataType to_dlpack(Dtype dtype) { return row(dtype).dl; }
std::string dtype_names() {
  std::string out;
  for (const auto& r : kDtypes) out += (out.empty() ? "" : ", ") + std::string(r.name);
  return out;
}

const TensorEntry* Header::find(std::string_view name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Header parse(const uint8_t* bytes, size_t size, const std::string& file) {
  if (size < 8) {
    bad(file, "truncated safetensors file: " + std::to_string(size) +
                  " bytes, less than the 8-byte header length that starts the format");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxHeaderBytes) {
    bad(file, "the header length is " + std::to_string(n) + " bytes, over the " +
                  std::to_string(kMaxHeaderBytes >> 20) +
                  " MiB limit of the format (not a safetensors file, or a corrupt one)");
  }
  if (n > size - 8) {
    bad(file, "truncated safetensors file: the header length is " + std::to_string(n) +
                  " bytes but only " + std::to_string(size - 8) + " bytes follow it");
  }
  if (n == 0) bad(file, "the header is empty (header length 0): expected a JSON object");
  const char* text = reinterpret_cast<const char*>(bytes + 8);  // NOLINT
  if (text[0] != '{') {
    bad(file, "the header does not start with '{' (not a safetensors file, or a corrupt one)");
  }
  const auto json = parse_json(text, text + n, file);
  if (!json.is_object()) bad(file, "the header is " + kind_phrase(json) + ", not a JSON object");
  Header h;
  h.header_bytes = n;
  h.data_offset = 8 + n;
  h.data_bytes = size - 8 - n;
  for (const auto& [k, v] : json.items()) {
    if (k == "__metadata__") {
      if (!v.is_object()) bad(file, "__metadata__ must be an object, not " + kind_phrase(v));
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string()) {
          bad(file, "__metadata__ values must be strings; " + sq(mk) + " is " + kind_phrase(mv));
        }
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(parse_entry(k, v, file));
  }
  std::stable_sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const TensorEntry* prev = nullptr;
  for (const auto& t : h.tensors) {
    if (t.end > h.data_bytes) {
      bad(file, "header says tensor " + t.name + " ends at byte " + std::to_string(t.end) +
                    " but the data area is " + std::to_string(h.data_bytes) + " bytes" +
                    (t.begin >= h.data_bytes ? " (truncated file?)" : ""));
    }
    if (t.begin < covered) {
      bad(file, "tensors " + sq(prev->name) + " [" + std::to_string(prev->begin) + ", " +
                    std::to_string(prev->end) + ") and " + sq(t.name) + " [" +
                    std::to_string(t.begin) + ", " + std::to_string(t.end) +
                    ") overlap in the data area");
    }
    if (t.begin > covered) {
      bad(file, "bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                    ") of the data area belong to no tensor (before " + sq(t.name) + ")");
    }
    if (t.end > t.begin || prev == nullptr) prev = &t;
    covered = std::max(covered, t.end);
  }
  if (covered != h.data_bytes) {
    bad(file, "the data area is " + std::to_string(h.data_bytes) + " bytes but the tensors cover " +
                  std::to_string(covered) + ": " + std::to_string(h.data_bytes - covered) +
                  " bytes at its end belong to no tensor");
  }
  return h;
}

Checksums verify_checksums(const uint8_t* bytes, size_t size, const Header& header,
                           const std::string& file) {
  Checksums c;
  const auto& m = header.metadata;
  if (const auto it = m.find(std::string(kChecksumKey)); it != m.end()) {
    const std::string& v = it->second;
    const std::string key = "__metadata__ '" + std::string(kChecksumKey) + "'";
    const auto colon = v.find(':');
    if (colon == std::string::npos) {
      bad(file, key + " is " + shown(v) + ": expected ALGORITHM:DIGITS, such as " +
                    std::string(kChecksumAlgorithm) + ":<16 hex digits>");
    }
    const std::string algorithm = v.substr(0, colon);
    if (algorithm != kChecksumAlgorithm) {
      bad(file, key + " uses checksum algorithm " + shown(algorithm) +
                    ", which this reader does not know (it knows " +
                    std::string(kChecksumAlgorithm) + "): written by a newer Loom, or damaged");
    }
    const std::string digits = v.substr(colon + 1);
    if (!is_hex16(digits)) {
      bad(file, key + " is " + shown(v) + ": " + algorithm + " takes 16 lowercase hex digits");
    }
    const std::string got =
        hex16(whole_file_hash(bytes, size, checksum_digits_at(bytes, header, digits, file)));
    if (got != digits) {
      bad(file, "checksum mismatch: " + key + " says " + v + " but the file hashes to " +
                    algorithm + ":" + got +
                    ": the file was changed or damaged after it was written");
    }
    c.file = true;
  }
  if (const auto it = m.find(std::string(kDataChecksumKey)); it != m.end()) {
    const std::string& v = it->second;
    const std::string key = "__metadata__ '" + std::string(kDataChecksumKey) + "'";
    if (!is_hex16(v)) {
      bad(file, key + " is " + shown(v) + ": the data checksum is 16 lowercase hex digits");
    }
    const std::string got = hex16(loom_fnv1a64(
        bytes + header.data_offset, static_cast<size_t>(header.data_bytes), LOOM_FNV1A64_OFFSET));
    if (got != v) {
      bad(file, "data checksum mismatch: " + key + " says " + v + " but the data area hashes to " +
                    got + ": the data was changed or damaged after it was written");
    }
    c.data = true;
  }
  return c;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(LOOM_ERR_NOT_FOUND, path + ": cannot open: " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(LOOM_ERR_INVALID_ARGUMENT, path + ": not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      throw Error(LOOM_ERR_RESOURCE_EXHAUSTED, path + ": cannot map: " + std::strerror(err));
    }
    base_ = static_cast<uint8_t*>(p);
  } else {
    ::close(fd);
  }
  try {
    static const uint8_t kEmpty[1] = {0};
    const uint8_t* bytes = base_ != nullptr ? base_ : kEmpty;
    header_ = parse(bytes, size_, path);
    // Every checksum the file carries, once, here: whoever reads a mapped file (loom
    // quantize, the C API) reads verified bytes, and none of them can forget to.
    checksums_ = verify_checksums(bytes, size_, header_, path);
  } catch (...) {
    if (base_ != nullptr) ::munmap(base_, size_);
    throw;
  }
}

MappedFile::~MappedFile() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

Writer::Writer(const std::string& path, std::vector<OutTensor> tensors,
               const std::map<std::string, std::string>& metadata)
    : path_(path), tensors_(std::move(tensors)) {
  if (metadata.count(std::string(kChecksumKey)) != 0) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, path + ": metadata key '" + std::string(kChecksumKey) +
                                               "' is the writer's own (it covers this file)");
  }
  std::set<std::string> names;
  for (const auto& t : tensors_) {
    if (t.name.empty()) throw Error(LOOM_ERR_INVALID_ARGUMENT, path + ": a tensor name is empty");
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  path + ": tensor name " + sq(t.name) + " is used twice or reserved");
    }
  }
  // Largest elements first, so each tensor starts aligned to its element size.
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors_[a].dtype) > dtype_size(tensors_[b].dtype);
  });
  sizes_.resize(tensors_.size());
  offsets_.resize(tensors_.size());
  written_.assign(tensors_.size(), false);
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  {
    // The checksum first, its digits '0' until commit() hashes the file and writes them.
    auto& m = h["__metadata__"];
    m[std::string(kChecksumKey)] = std::string(kChecksumAlgorithm) + ":" + std::string(kZeroDigits);
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  uint64_t off = 0;
  std::vector<uint64_t> rel(tensors_.size());
  for (const size_t i : order) {
    const auto& t = tensors_[i];
    uint64_t numel = 1;
    for (const int64_t d : t.shape) {
      if (d < 0)
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    path + ": tensor " + sq(t.name) + " has a negative dimension");
      numel *= static_cast<uint64_t>(d);
    }
    sizes_[i] = numel * dtype_size(t.dtype);
    rel[i] = off;
    h[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                 {"shape", t.shape},
                 {"data_offsets", {off, off + sizes_[i]}}};
    off += sizes_[i];
  }
  std::string text = h.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  {
    // The reader finds the digits by this text, which must occur once (a metadata key that
    // embeds it, quotes and all, would make a second).
    const std::string prefix = checksum_prefix();
    const size_t at = text.find(prefix);
    if (at == std::string::npos || text.find(prefix, at + 1) != std::string::npos) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  path + ": a metadata key or value repeats the checksum's key text " + prefix);
    }
    checksum_at_ = 8 + at + prefix.size();
  }
  for (size_t i = 0; i < tensors_.size(); ++i) offsets_[i] = 8 + text.size() + rel[i];
  file_bytes_ = 8 + text.size() + off;

  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  // Not mkstemp: its file is mode 0600 whatever the umask. A fresh name opened with O_EXCL
  // and mode 0666 gets what the umask allows, as a file the program wrote directly would.
  std::random_device seed;
  std::mt19937_64 rng((static_cast<uint64_t>(seed()) << 32) ^ seed() ^
                      static_cast<uint64_t>(::getpid()));
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  for (int attempt = 0; attempt < 100; ++attempt) {
    std::string suffix(6, 'x');
    for (char& c : suffix) c = kChars[rng() % (sizeof kChars - 1)];
    tmp_ = dir + "." + base + ".tmp-" + suffix;
    fd_ = ::open(tmp_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0 || errno != EEXIST) break;
  }
  if (fd_ < 0) {
    throw Error(LOOM_ERR_NOT_FOUND,
                path + ": cannot create a file beside it (" + tmp_ + "): " + std::strerror(errno));
  }
  try {
    uint8_t len[8];
    const uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
    write_all(fd_, len, 8, 0, tmp_);
    write_all(fd_, text.data(), text.size(), 8, tmp_);
    if (::ftruncate(fd_, static_cast<off_t>(file_bytes_)) != 0) {
      throw Error(LOOM_ERR_RESOURCE_EXHAUSTED,
                  tmp_ + ": cannot size the file: " + std::string(std::strerror(errno)));
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].data != nullptr) write(i, tensors_[i].data, sizes_[i]);
    }
  } catch (...) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
    fd_ = -1;
    throw;
  }
}

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void Writer::write(size_t index, const void* data, uint64_t bytes) {
  if (index >= tensors_.size() || bytes != sizes_[index] || fd_ < 0) {
    throw Error(LOOM_ERR_INTERNAL, path_ + ": internal error: tensor write of the wrong size");
  }
  write_all(fd_, data, bytes, offsets_[index], tmp_);
  written_[index] = true;
}

void Writer::commit() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!written_[i]) {
      throw Error(LOOM_ERR_INTERNAL, path_ + ": internal error: tensor " + sq(tensors_[i].name) +
                                         " was never written");
    }
  }
  // The checksum of what the file now holds (its digits still '0'), read back in pieces:
  // tensors are written in any order, and FNV-1a runs front to back.
  std::vector<uint8_t> chunk(static_cast<size_t>(std::min<uint64_t>(file_bytes_, 4u << 20)));
  uint64_t sum = LOOM_FNV1A64_OFFSET;
  for (uint64_t off = 0; off < file_bytes_; off += chunk.size()) {
    const uint64_t n = std::min<uint64_t>(chunk.size(), file_bytes_ - off);
    read_all(fd_, chunk.data(), n, off, tmp_);
    sum = loom_fnv1a64(chunk.data(), static_cast<size_t>(n), sum);
  }
  const std::string digits = hex16(sum);
  write_all(fd_, digits.data(), digits.size(), checksum_at_, tmp_);
  if (::fsync(fd_) != 0) {
    throw Error(LOOM_ERR_INTERNAL, tmp_ + ": cannot flush: " + std::string(std::strerror(errno)));
  }
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    throw Error(LOOM_ERR_INTERNAL, tmp_ + ": cannot close: " + std::string(std::strerror(errno)));
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    throw Error(LOOM_ERR_INTERNAL,
                path_ + ": cannot rename into place: " + std::string(std::strerror(errno)));
  }
  committed_ = true;
  // The rename itself reaches the disk only with its folder: sync that too, so a power loss
  // cannot leave the old file (or none) behind a run that went on as if it were written.
  std::string folder = std::filesystem::path(path_).parent_path().string();
  if (folder.empty()) folder = ".";
  const int dfd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || (::fsync(dfd) != 0 && errno != EINVAL)) {
    const std::string why = std::strerror(errno);
    if (dfd >= 0) ::close(dfd);
    throw Error(LOOM_ERR_INTERNAL,
                folder + ": cannot sync the folder after writing " + path_ + ": " + why);
  }
  ::close(dfd);
}

void write_file(const std::string& path, const std::vector<OutTensor>& tensors,
                const std::map<std::string, std::string>& metadata) {
  Writer w(path, tensors, metadata);
  w.commit();
}

}  // namespace loom::host::safetensors
