// The reference trainer's data: tokenizers (byte-level, and a byte-level BPE trained by
// `loom data prepare`) and the memory-mapped token dataset file.
//
// Dataset file (version 1), little-endian, docs/trainer.md has the table:
//   offset  size  field
//        0     8  magic "LOOMDATA"
//        8     4  version (1)
//       12     4  dtype (1 = uint16 tokens)
//       16     4  vocab_size (every token is < vocab_size)
//       20     4  header_bytes (64)
//       24     8  train_tokens
//       32     8  heldout_tokens
//       40     8  FNV-1a 64 of the payload (the token bytes after the header)
//       48     8  FNV-1a 64 of header bytes 0..47
//       56     8  reserved (0)
//       64        train tokens, then heldout tokens (uint16 each)
// Readers reject a file whose size, magic, version, dtype, checksums or tokens do not match,
// with a DataError naming the file and what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace loom::trainer {

// Every error of the data layer: a message that names the file and the problem.
class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

uint64_t fnv1a64(const void* data, size_t bytes, uint64_t seed = 0xcbf29ce484222325ull);

// ---- tokenizers

// Byte-level BPE: token t < 256 is byte t; token 256 + i is merges[i] = (left, right).
// Encoding splits text into chunks that start at each whitespace byte and applies the merges
// within chunks in rank order, so decode(encode(s)) == s for any bytes.
class Tokenizer {
 public:
  Tokenizer() = default;  // byte-level (vocab 256)
  static Tokenizer byte_level() { return Tokenizer(); }
  // Trains merges on `texts` until vocab_size tokens exist (or no pair occurs twice).
  // `progress`, when given, is called after each merge with (merges done, merges wanted).
  static Tokenizer train_bpe(const std::vector<std::string>& texts, int vocab_size,
                             const std::function<void(int, int)>& progress = nullptr);
  // The tokenizer file (JSON): {"format": "loom-tokenizer", "version": 1, "type": "byte"|"bpe",
  // "vocab_size": N, "merges": [[a, b], ...]}. Throws DataError naming the file.
  static Tokenizer load(const std::string& path);
  void save(const std::string& path) const;

  bool is_bpe() const { return !merges_.empty(); }
  int vocab_size() const { return 256 + static_cast<int>(merges_.size()); }
  const std::vector<std::pair<int, int>>& merges() const { return merges_; }

  // `progress`, when given, is called about every MiB with the bytes of `text` encoded.
  std::vector<uint16_t> encode(const std::string& text,
                               const std::function<void(size_t)>& progress = nullptr) const;
  std::string decode(std::span<const uint16_t> tokens) const;

 private:
  void build_tables();
  std::vector<std::pair<int, int>> merges_;
  std::vector<std::string> pieces_;  // token -> bytes
};

// ---- dataset file

struct DatasetHeader {
  uint32_t version = 1;
  uint32_t dtype = 1;
  uint32_t vocab_size = 256;
  uint64_t train_tokens = 0;
  uint64_t heldout_tokens = 0;
  uint64_t payload_checksum = 0;  // offset 40: what index files record as the dataset's
};

inline constexpr size_t kDatasetHeaderBytes = 64;
inline constexpr char kDatasetMagic[8] = {'L', 'O', 'O', 'M', 'D', 'A', 'T', 'A'};

// Writes the dataset atomically (temp file + rename). Throws DataError.
void write_dataset(const std::string& path, uint32_t vocab_size, std::span<const uint16_t> train,
                   std::span<const uint16_t> heldout);

// Splits a token stream into train and heldout: blocks of `block` tokens, every k-th block
// (k = round(1 / fraction)) held out, so both parts sample the whole corpus.
void split_heldout(std::span<const uint16_t> tokens, double fraction, size_t block,
                   std::vector<uint16_t>& train, std::vector<uint16_t>& heldout);

// A read-only, memory-mapped dataset file, validated on open.
class Dataset {
 public:
  explicit Dataset(const std::string& path);  // throws DataError
  ~Dataset();
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;

  const std::string& path() const { return path_; }
  const DatasetHeader& header() const { return header_; }
  uint32_t vocab_size() const { return header_.vocab_size; }
  std::span<const uint16_t> train() const { return {tokens_, header_.train_tokens}; }
  std::span<const uint16_t> heldout() const {
    return {tokens_ + header_.train_tokens, header_.heldout_tokens};
  }

 private:
  std::string path_;
  DatasetHeader header_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const uint16_t* tokens_ = nullptr;
};

// The tokenizer file that `loom data prepare` writes beside DATA.bin: DATA.tokenizer.json.
std::string tokenizer_path_for(const std::string& dataset_path);

}  // namespace loom::trainer
