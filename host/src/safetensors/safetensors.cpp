#include "safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "../status.hpp"

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
    header_ = parse(base_ != nullptr ? base_ : kEmpty, size_, path);
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
  if (!metadata.empty()) {
    auto& m = h["__metadata__"];
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
}

void write_file(const std::string& path, const std::vector<OutTensor>& tensors,
                const std::map<std::string, std::string>& metadata) {
  Writer w(path, tensors, metadata);
  w.commit();
}

}  // namespace loom::host::safetensors
