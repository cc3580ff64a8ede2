#include "dataset.hpp"

#include <loom/checksum.h>
#include "durable_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

namespace loom::trainer {

uint64_t fnv1a64(const void* data, size_t bytes, uint64_t seed) {
  return loom_fnv1a64(data, bytes, seed);
}

// ------------------------------------------------------------------ tokenizer

namespace {

bool is_space(unsigned char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// Chunks start at every whitespace byte: "a b\n" -> "a", " b", "\n".
template <class F>
void for_each_chunk(const std::string& text, F&& f) {
  size_t start = 0;
  for (size_t i = 1; i <= text.size(); ++i) {
    if (i == text.size() || is_space(static_cast<unsigned char>(text[i]))) {
      if (i > start) f(std::string_view(text).substr(start, i - start));
      start = i;
    }
  }
}

// The longest piece (token's bytes) a BPE merge may make, in training and in a loaded file.
// Real text's pieces are words and short runs of symbols; without a bound, 40 merges that
// each double a piece ask for terabytes. 65280 merges at most make the tables <= 16 MiB.
constexpr size_t kMaxPieceBytes = 256;
// Tokens are uint16: 256 bytes plus at most this many merges.
constexpr size_t kMaxMerges = 65536 - 256;

// An integer JSON value that fits int64 (floats, strings and the like do not).
bool as_int64(const nlohmann::json& v, int64_t& out) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return false;
    out = static_cast<int64_t>(u);
    return true;
  }
  if (!v.is_number_integer()) return false;
  out = v.get<int64_t>();
  return true;
}

// A JSON value for an error message, cut short: a field can be as long as the file.
std::string shown(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

uint64_t pair_key(int a, int b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Replaces every non-overlapping (a, b), left to right, by `id`.
void apply_merge(std::vector<int>& w, int a, int b, int id) {
  size_t o = 0;
  for (size_t i = 0; i < w.size();) {
    if (i + 1 < w.size() && w[i] == a && w[i + 1] == b) {
      w[o++] = id;
      i += 2;
    } else {
      w[o++] = w[i++];
    }
  }
  w.resize(o);
}

}  // namespace

Tokenizer Tokenizer::train_bpe(const std::vector<std::string>& texts, int vocab_size,
                               const std::function<void(int, int)>& progress) {
  if (vocab_size < 256 || vocab_size > 65536) {
    throw DataError("BPE vocab size " + std::to_string(vocab_size) +
                    " is out of range [256, 65536] (tokens are uint16)");
  }
  std::unordered_map<std::string, uint64_t> counts;
  for (const auto& t : texts) {
    for_each_chunk(t, [&](std::string_view c) { ++counts[std::string(c)]; });
  }
  std::vector<std::vector<int>> words;
  std::vector<uint64_t> freq;
  words.reserve(counts.size());
  for (const auto& [w, n] : counts) {
    std::vector<int> s(w.size());
    for (size_t i = 0; i < w.size(); ++i) s[i] = static_cast<unsigned char>(w[i]);
    words.push_back(std::move(s));
    freq.push_back(n);
  }
  Tokenizer tok;
  std::vector<size_t> piece_bytes(256, 1);  // token -> the length of its piece
  std::unordered_map<uint64_t, uint64_t> pairs;
  for (int id = 256; id < vocab_size; ++id) {
    pairs.clear();
    for (size_t i = 0; i < words.size(); ++i) {
      const auto& w = words[i];
      for (size_t j = 0; j + 1 < w.size(); ++j) pairs[pair_key(w[j], w[j + 1])] += freq[i];
    }
    uint64_t best = 0, best_n = 0;
    for (const auto& [k, n] : pairs) {
      // A pair whose piece would be too long is never merged, so that load() accepts
      // every tokenizer trained here.
      if (piece_bytes[k >> 32] + piece_bytes[k & 0xffffffffu] > kMaxPieceBytes) continue;
      if (n > best_n || (n == best_n && k < best)) best = k, best_n = n;
    }
    if (best_n < 2) break;
    const int a = static_cast<int>(best >> 32), b = static_cast<int>(best & 0xffffffffu);
    tok.merges_.emplace_back(a, b);
    piece_bytes.push_back(piece_bytes[a] + piece_bytes[b]);
    for (auto& w : words) apply_merge(w, a, b, id);
    if (progress) progress(id - 255, vocab_size - 256);
  }
  tok.build_tables();
  return tok;
}

void Tokenizer::build_tables() {
  pieces_.assign(256, std::string());
  for (int i = 0; i < 256; ++i) pieces_[i] = std::string(1, static_cast<char>(i));
  for (const auto& [a, b] : merges_) pieces_.push_back(pieces_[a] + pieces_[b]);
}

std::vector<uint16_t> Tokenizer::encode(const std::string& text,
                                        const std::function<void(size_t)>& progress) const {
  std::vector<uint16_t> out;
  out.reserve(text.size());
  if (merges_.empty()) {
    for (unsigned char c : text) out.push_back(c);
    return out;
  }
  std::unordered_map<uint64_t, int> rank;
  rank.reserve(merges_.size() * 2);
  for (size_t i = 0; i < merges_.size(); ++i) {
    rank.emplace(pair_key(merges_[i].first, merges_[i].second), static_cast<int>(i));
  }
  std::unordered_map<std::string_view, std::vector<uint16_t>> cache;
  std::vector<int> w;
  size_t done = 0, reported = 0;
  for_each_chunk(text, [&](std::string_view c) {
    done += c.size();
    if (progress && done - reported >= (size_t{1} << 20)) progress(reported = done);
    auto it = cache.find(c);
    if (it == cache.end()) {
      w.resize(c.size());
      for (size_t i = 0; i < c.size(); ++i) w[i] = static_cast<unsigned char>(c[i]);
      while (w.size() > 1) {
        int best = -1;
        for (size_t j = 0; j + 1 < w.size(); ++j) {
          auto r = rank.find(pair_key(w[j], w[j + 1]));
          if (r != rank.end() && (best < 0 || r->second < best)) best = r->second;
        }
        if (best < 0) break;
        apply_merge(w, merges_[best].first, merges_[best].second, 256 + best);
      }
      std::vector<uint16_t> t(w.begin(), w.end());
      it = cache.emplace(c, std::move(t)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  });
  return out;
}

std::string Tokenizer::decode(std::span<const uint16_t> tokens) const {
  std::string s;
  for (uint16_t t : tokens) {
    if (t < 256) {
      s.push_back(static_cast<char>(t));
    } else if (t < pieces_.size()) {
      s += pieces_[t];
    } else {
      throw DataError("token " + std::to_string(t) + " is outside the tokenizer's vocabulary (" +
                      std::to_string(vocab_size()) + ")");
    }
  }
  return s;
}

void Tokenizer::save(const std::string& path) const {
  nlohmann::json j;
  j["format"] = "loom-tokenizer";
  j["version"] = 1;
  j["type"] = is_bpe() ? "bpe" : "byte";
  j["vocab_size"] = vocab_size();
  auto m = nlohmann::json::array();
  for (const auto& [a, b] : merges_) m.push_back({a, b});
  j["merges"] = m;
  const std::string text = j.dump() + "\n";
  write_file_atomic(path, text.data(), text.size());
}

Tokenizer Tokenizer::load(const std::string& path) {
  // A folder opens as a stream and then reads as nothing (or throws an error that names no
  // path): say what is wrong instead.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw DataError(path + ": is a folder, not a file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw DataError(path + ": cannot open the tokenizer file");
  std::stringstream ss;
  ss << f.rdbuf();
  auto j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw DataError(path + ": not a JSON tokenizer file");
  // Every field is checked for its JSON type before its value is read: nlohmann's accessors
  // throw type_error otherwise, an error that names neither the file nor the field.
  const auto field = [&](const char* name) -> const nlohmann::json& {
    const auto it = j.find(name);
    if (it == j.end()) {
      throw DataError(path + ": not a loom-tokenizer file: it has no \"" + name + "\" field");
    }
    return *it;
  };
  const auto wrong_type = [&](const char* name, const nlohmann::json& v, const char* expected) {
    return DataError(path + ": \"" + name + "\" is a JSON " + v.type_name() + ", expected " +
                     expected);
  };
  const auto& format = field("format");
  if (!format.is_string()) throw wrong_type("format", format, "the string \"loom-tokenizer\"");
  if (format.get_ref<const std::string&>() != "loom-tokenizer") {
    throw DataError(path + ": \"format\" is " + shown(format) + ", expected \"loom-tokenizer\"");
  }
  int64_t version = 0;
  const auto& version_field = field("version");
  if (!as_int64(version_field, version)) throw wrong_type("version", version_field, "an integer");
  if (version != 1) {
    throw DataError(path + ": \"version\" is " + std::to_string(version) +
                    "; this build reads loom-tokenizer version 1");
  }
  const auto& merges = field("merges");
  if (!merges.is_array()) throw wrong_type("merges", merges, "an array of [a, b] pairs");
  Tokenizer t;
  std::vector<size_t> piece_bytes(256, 1);  // token -> the length of its piece
  for (const auto& m : merges) {
    const size_t i = t.merges_.size();
    const int64_t id = 256 + static_cast<int64_t>(i);
    const std::string where = path + ": merge " + std::to_string(i);
    if (i == kMaxMerges) {
      throw DataError(where + " is one too many: tokens are uint16, so a tokenizer has at most " +
                      std::to_string(kMaxMerges) + " merges (vocab 65536)");
    }
    int64_t a = 0, b = 0;
    if (!m.is_array() || m.size() != 2 || !as_int64(m[0], a) || !as_int64(m[1], b)) {
      throw DataError(where + " is not a pair of ints");
    }
    if (a < 0 || b < 0 || a >= id || b >= id) {
      throw DataError(where + " refers to a token not yet defined");
    }
    const size_t bytes = piece_bytes[static_cast<size_t>(a)] + piece_bytes[static_cast<size_t>(b)];
    if (bytes > kMaxPieceBytes) {
      throw DataError(where + " makes a piece of " + std::to_string(bytes) + " bytes; at most " +
                      std::to_string(kMaxPieceBytes) + " are allowed");
    }
    piece_bytes.push_back(bytes);
    t.merges_.emplace_back(static_cast<int>(a), static_cast<int>(b));
  }
  if (const auto it = j.find("type"); it != j.end()) {
    // Optional (what the merges say); when present it must agree with them.
    const char* expected = t.is_bpe() ? "bpe" : "byte";
    if (!it->is_string()) throw wrong_type("type", *it, "the string \"byte\" or \"bpe\"");
    if (it->get_ref<const std::string&>() != expected) {
      throw DataError(path + ": \"type\" is " + shown(*it) + ", but " +
                      std::to_string(t.merges_.size()) + " merges make a \"" + expected +
                      "\" tokenizer");
    }
  }
  int64_t vocab = 0;
  const auto& vocab_field = field("vocab_size");
  if (!as_int64(vocab_field, vocab)) throw wrong_type("vocab_size", vocab_field, "an integer");
  if (vocab != t.vocab_size()) {
    throw DataError(path + ": \"vocab_size\" is " + std::to_string(vocab) + ", but " +
                    std::to_string(t.merges_.size()) + " merges make a vocabulary of " +
                    std::to_string(t.vocab_size()));
  }
  t.build_tables();
  return t;
}

std::string tokenizer_path_for(const std::string& dataset_path) {
  std::filesystem::path p(dataset_path);
  return (p.parent_path() / (p.stem().string() + ".tokenizer.json")).string();
}

// ------------------------------------------------------------------ dataset file

namespace {

template <class T>
void put(unsigned char* h, size_t off, T v) {
  std::memcpy(h + off, &v, sizeof(T));
}
template <class T>
T get(const unsigned char* h, size_t off) {
  T v;
  std::memcpy(&v, h + off, sizeof(T));
  return v;
}

}  // namespace

void split_heldout(std::span<const uint16_t> tokens, double fraction, size_t block,
                   std::vector<uint16_t>& train, std::vector<uint16_t>& heldout) {
  train.clear();
  heldout.clear();
  if (!(fraction >= 0.0 && fraction < 1.0)) {
    throw DataError("heldout fraction " + std::to_string(fraction) + " is not in [0, 1)");
  }
  if (block == 0) throw DataError("heldout block size is 0");
  const size_t k =
      fraction > 0 ? std::max<size_t>(2, static_cast<size_t>(std::lround(1.0 / fraction))) : 0;
  for (size_t b = 0, i = 0; i < tokens.size(); ++b, i += block) {
    const size_t n = std::min(block, tokens.size() - i);
    auto& dst = (k != 0 && b % k == k - 1) ? heldout : train;
    dst.insert(dst.end(), tokens.begin() + static_cast<std::ptrdiff_t>(i),
               tokens.begin() + static_cast<std::ptrdiff_t>(i + n));
  }
}

void write_dataset(const std::string& path, uint32_t vocab_size, std::span<const uint16_t> train,
                   std::span<const uint16_t> heldout) {
  if (vocab_size == 0 || vocab_size > 65536) {
    throw DataError(path + ": vocab size " + std::to_string(vocab_size) + " does not fit uint16");
  }
  for (auto s : {train, heldout}) {
    for (uint16_t t : s) {
      if (t >= vocab_size) {
        throw DataError(path + ": token " + std::to_string(t) + " >= vocab size " +
                        std::to_string(vocab_size));
      }
    }
  }
  unsigned char h[kDatasetHeaderBytes] = {};
  std::memcpy(h, kDatasetMagic, 8);
  put<uint32_t>(h, 8, 1);
  put<uint32_t>(h, 12, 1);
  put<uint32_t>(h, 16, vocab_size);
  put<uint32_t>(h, 20, static_cast<uint32_t>(kDatasetHeaderBytes));
  put<uint64_t>(h, 24, train.size());
  put<uint64_t>(h, 32, heldout.size());
  uint64_t sum = fnv1a64(train.data(), train.size_bytes());
  sum = fnv1a64(heldout.data(), heldout.size_bytes(), sum);
  put<uint64_t>(h, 40, sum);
  put<uint64_t>(h, 48, fnv1a64(h, 48));
  write_file_atomic(path, {FilePart{h, sizeof(h)}, FilePart{train.data(), train.size_bytes()},
                           FilePart{heldout.data(), heldout.size_bytes()}});
}

Dataset::Dataset(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw DataError(path + ": cannot open the dataset: " + std::strerror(errno) +
                    " (prepare it with `loom data prepare --input FILES... --output " + path +
                    "`)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw DataError(path + ": cannot stat the dataset");
  }
  // A folder opens too; its size would read as a truncated dataset or fail to map.
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw DataError(path + ": is a folder, not a file");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw DataError(path + ": is not a regular file (a dataset is memory-mapped)");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < kDatasetHeaderBytes) {
    ::close(fd);
    throw DataError(path + ": truncated dataset: " + std::to_string(size) +
                    " bytes, the header alone is " + std::to_string(kDatasetHeaderBytes));
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) throw DataError(path + ": cannot map the dataset: " + std::strerror(errno));
  map_ = m;
  map_bytes_ = size;
  try {
    const auto* h = static_cast<const unsigned char*>(m);
    if (std::memcmp(h, kDatasetMagic, 8) != 0) {
      throw DataError(path + ": not a Loom dataset (bad magic; expected \"LOOMDATA\")");
    }
    header_.version = get<uint32_t>(h, 8);
    if (header_.version != 1) {
      throw DataError(path + ": dataset version " + std::to_string(header_.version) +
                      " is not supported (this reader knows version 1)");
    }
    if (get<uint64_t>(h, 48) != fnv1a64(h, 48)) {
      throw DataError(path + ": corrupted dataset header (header checksum mismatch)");
    }
    header_.dtype = get<uint32_t>(h, 12);
    if (header_.dtype != 1) {
      throw DataError(path + ": dataset dtype " + std::to_string(header_.dtype) +
                      " is not supported (1 = uint16)");
    }
    header_.vocab_size = get<uint32_t>(h, 16);
    if (get<uint32_t>(h, 20) != kDatasetHeaderBytes || header_.vocab_size == 0 ||
        header_.vocab_size > 65536) {
      throw DataError(path + ": corrupted dataset header (header size or vocab size)");
    }
    header_.train_tokens = get<uint64_t>(h, 24);
    header_.heldout_tokens = get<uint64_t>(h, 32);
    const uint64_t n = header_.train_tokens + header_.heldout_tokens;
    if (header_.train_tokens > (1ull << 40) || header_.heldout_tokens > (1ull << 40)) {
      throw DataError(path + ": corrupted dataset header (token counts)");
    }
    const uint64_t expected = kDatasetHeaderBytes + 2 * n;
    if (size < expected) {
      throw DataError(path + ": truncated dataset: " + std::to_string(size) +
                      " bytes, the header says " + std::to_string(expected) + " (" +
                      std::to_string(header_.train_tokens) + " train + " +
                      std::to_string(header_.heldout_tokens) + " heldout tokens)");
    }
    if (size > expected) {
      throw DataError(path + ": dataset has " + std::to_string(size - expected) +
                      " trailing bytes after the payload the header describes");
    }
    tokens_ = reinterpret_cast<const uint16_t*>(h + kDatasetHeaderBytes);
    header_.payload_checksum = get<uint64_t>(h, 40);
    if (fnv1a64(tokens_, 2 * n) != header_.payload_checksum) {
      throw DataError(path + ": corrupted dataset: payload checksum mismatch");
    }
    for (uint64_t i = 0; i < n; ++i) {
      if (tokens_[i] >= header_.vocab_size) {
        throw DataError(path + ": corrupted dataset: token " + std::to_string(tokens_[i]) +
                        " at index " + std::to_string(i) + " >= vocab size " +
                        std::to_string(header_.vocab_size));
      }
    }
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

Dataset::~Dataset() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

}  // namespace loom::trainer
