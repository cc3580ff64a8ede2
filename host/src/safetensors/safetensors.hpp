// Safetensors files: a strict reader and a writer.
//
// The format: 8 bytes, the little-endian length N of the header; N bytes of JSON, an object
// mapping each tensor name to {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin,
// end]} plus an optional "__metadata__" object of string values; then the data area, where
// each tensor's bytes lie at [begin, end) (offsets relative to the data area), row-major,
// little-endian. The tensors cover the data area exactly: no gaps, no overlaps.
//
// The reader checks every one of those rules and throws loom::host::Error naming the file,
// the tensor and what is wrong; nothing in a file can make it read out of bounds.
//
// Checksums live in __metadata__ (docs/quantization.md, "Checksums"). The writer's own,
// "loom.checksum": "fnv1a64:<16 lowercase hex digits>", is FNV-1a 64 of the whole file with
// those 16 digits read as ASCII '0', so a changed byte anywhere (length, header, padding,
// data) is caught; the trainer's, "fnv1a64": "<16 lowercase hex digits>", covers the data
// area only. A mapped file has every checksum it carries verified.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom::host::safetensors {

enum class Dtype : uint8_t { F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

// "F32" -> Dtype::F32; nullopt for a name this reader does not know.
std::optional<Dtype> parse_dtype(std::string_view name);
std::string_view dtype_name(Dtype dtype);
uint32_t dtype_size(Dtype dtype);  // bytes per element
// The DLPack type of an element (BOOL: uint8 holding 0 or 1: DLPack 0.6 has no bool).
DLDataType to_dlpack(Dtype dtype);
// "F64, F32, ..., BOOL" for messages.
std::string dtype_names();

// The header's limit: larger headers are refused before anything is allocated.
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct TensorEntry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  uint64_t numel = 0;
  uint64_t begin = 0;  // offsets in the data area
  uint64_t end = 0;
  [[nodiscard]] uint64_t bytes() const { return end - begin; }
};

struct Header {
  std::vector<TensorEntry> tensors;  // in data order (by begin)
  std::map<std::string, std::string> metadata;
  uint64_t header_bytes = 0;  // N
  uint64_t data_offset = 0;   // 8 + N: where the data area starts in the file
  uint64_t data_bytes = 0;
  // nullptr when the file has no tensor of that name.
  [[nodiscard]] const TensorEntry* find(std::string_view name) const;
};

// Parses and checks a whole file held in memory (`bytes`, `size`); `file` names it in
// messages. Throws loom::host::Error (DATA_LOSS for a malformed file). Checksums are not
// verified here: see verify_checksums.
Header parse(const uint8_t* bytes, size_t size, const std::string& file);

inline constexpr std::string_view kChecksumKey = "loom.checksum";  // the whole file
inline constexpr std::string_view kDataChecksumKey = "fnv1a64";    // the trainer's: the data
inline constexpr std::string_view kChecksumAlgorithm = "fnv1a64";

// Which checksums a file carried (each one verified).
struct Checksums {
  bool file = false;  // "loom.checksum"
  bool data = false;  // "fnv1a64"
};

// Verifies every checksum `header` (parsed from these bytes) carries. Throws
// loom::host::Error (DATA_LOSS) naming `file` for a mismatch, a malformed value, or an
// algorithm this reader does not know.
Checksums verify_checksums(const uint8_t* bytes, size_t size, const Header& header,
                           const std::string& file);

// A file mapped read-only (copy-on-write private pages: writes through data() never reach
// the file), with its parsed header.
class MappedFile {
 public:
  // Throws loom::host::Error: NOT_FOUND when the file cannot be opened, DATA_LOSS when it
  // is not a valid safetensors file or a checksum it carries does not match.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] const Header& header() const { return header_; }
  [[nodiscard]] uint64_t file_bytes() const { return size_; }
  [[nodiscard]] Checksums checksums() const { return checksums_; }
  // The first byte of a tensor's data.
  [[nodiscard]] uint8_t* data(const TensorEntry& t) const {
    return base_ + header_.data_offset + t.begin;
  }

 private:
  std::string path_;
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  Header header_;
  Checksums checksums_;
};

// One tensor to write: its bytes come from `data` (numel * dtype_size bytes), or, when
// `data` is null, are written later with Writer::write.
struct OutTensor {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Writes a safetensors file to PATH.tmp-XXXXXX beside `path` and renames it into place on
// commit(); a writer destroyed without commit() removes the temporary file, so a failed run
// never leaves a half-written `path`. Tensors are laid out by element size, largest first
// (then in the order given), and the header is padded to a multiple of 8, so every tensor's
// data is aligned to its element size. The file always carries "loom.checksum" (first in
// __metadata__), computed at commit() from what was written; `metadata` must not hold it.
class Writer {
 public:
  Writer(const std::string& path, std::vector<OutTensor> tensors,
         const std::map<std::string, std::string>& metadata);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Writes tensor `index`'s bytes (of the list given to the constructor): exactly its size.
  void write(size_t index, const void* data, uint64_t bytes);
  // Checks that every tensor was written, flushes, and renames into place.
  void commit();
  [[nodiscard]] uint64_t file_bytes() const { return file_bytes_; }
  [[nodiscard]] uint64_t tensor_bytes(size_t index) const { return sizes_.at(index); }

 private:
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  std::vector<OutTensor> tensors_;
  std::vector<uint64_t> offsets_;  // in the file
  std::vector<uint64_t> sizes_;
  std::vector<bool> written_;
  uint64_t file_bytes_ = 0;
  uint64_t checksum_at_ = 0;  // the file offset of the checksum's 16 hex digits
  bool committed_ = false;
};

// The whole file in one call (every tensor's `data` set).
void write_file(const std::string& path, const std::vector<OutTensor>& tensors,
                const std::map<std::string, std::string>& metadata);

}  // namespace loom::host::safetensors
