// Exported state: StateWriter streams bytes to the host's loom_state_writer; StateReader
// parses a blob on import and throws Error(DATA_LOSS) when it runs out of bytes.
// Values are written in native byte order (every supported target is little-endian).
//
// The SDK frames what a plugin's export_state writes (see plugin.hpp's export thunk):
//
//   "LOOMSTv2" (8 bytes) | payload size (uint64) | payload | CRC32C of all before (uint32)
//
// and import checks the frame before the plugin sees the payload, so a changed, truncated
// or extended blob is DATA_LOSS rather than a state that parses by chance. Blobs written
// before the frame existed (they start with the plugin's own header) are still accepted,
// unchecked, as they always were.
#ifndef LOOM_SDK_STATE_HPP
#define LOOM_SDK_STATE_HPP

#include <loom/abi.h>
#include <loom/sdk/status.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom::sdk {

class StateWriter {
 public:
  explicit StateWriter(const loom_state_writer* writer) : writer_(writer) {
    if (writer_ == nullptr || writer_->write == nullptr) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "state writer is NULL");
    }
  }

  void write(const void* data, std::size_t bytes) {
    if (bytes == 0) return;
    check(writer_->write(writer_->ctx, data, bytes), "state writer");
    written_ += bytes;
  }
  void write_bytes(std::span<const std::byte> bytes) { write(bytes.data(), bytes.size()); }

  template <class T>
  void write_pod(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "write_pod needs a trivially copyable type");
    write(&value, sizeof(T));
  }

  // A uint64 element count, then the elements.
  template <class T>
  void write_vector(const std::vector<T>& values) {
    static_assert(std::is_trivially_copyable_v<T>, "write_vector needs trivially copyable T");
    write_pod<uint64_t>(values.size());
    write(values.data(), values.size() * sizeof(T));
  }
  void write_string(std::string_view s) {
    write_pod<uint64_t>(s.size());
    write(s.data(), s.size());
  }

  // A header that lets import reject blobs from other plugins or newer formats:
  // the magic as a string, then the format version.
  void write_header(std::string_view magic, uint32_t version) {
    write_string(magic);
    write_pod(version);
  }

  std::size_t bytes_written() const { return written_; }

 private:
  const loom_state_writer* writer_;
  std::size_t written_ = 0;
};

class StateReader {
 public:
  explicit StateReader(std::span<const std::byte> blob) : blob_(blob) {}
  StateReader(const void* data, std::size_t bytes)
      : blob_(static_cast<const std::byte*>(data), data == nullptr ? 0 : bytes) {}

  std::size_t remaining() const { return blob_.size() - pos_; }

  void read(void* out, std::size_t bytes) {
    need(bytes);
    if (bytes != 0) std::memcpy(out, blob_.data() + pos_, bytes);
    pos_ += bytes;
  }
  std::span<const std::byte> read_bytes(std::size_t bytes) {
    need(bytes);
    std::span<const std::byte> out = blob_.subspan(pos_, bytes);
    pos_ += bytes;
    return out;
  }

  template <class T>
  T read_pod() {
    static_assert(std::is_trivially_copyable_v<T>, "read_pod needs a trivially copyable type");
    T value;
    read(&value, sizeof(T));
    return value;
  }

  // Checks the count against the bytes left before allocating, so a corrupt count cannot
  // ask for terabytes.
  template <class T>
  std::vector<T> read_vector() {
    static_assert(std::is_trivially_copyable_v<T>, "read_vector needs trivially copyable T");
    const uint64_t count = read_pod<uint64_t>();
    if (count > remaining() / sizeof(T)) truncated(count * sizeof(T));
    std::vector<T> values(static_cast<std::size_t>(count));
    read(values.data(), values.size() * sizeof(T));
    return values;
  }
  std::string read_string() {
    const uint64_t size = read_pod<uint64_t>();
    if (size > remaining()) truncated(size);
    std::string s(static_cast<std::size_t>(size), '\0');
    read(s.data(), s.size());
    return s;
  }

  // Reads a header written by StateWriter::write_header. A different magic or a version
  // above `max_version` is INVALID_ARGUMENT; returns the blob's version.
  uint32_t read_header(std::string_view magic, uint32_t max_version) {
    const uint64_t size = read_pod<uint64_t>();
    if (size != magic.size() || remaining() < size ||
        std::memcmp(blob_.data() + pos_, magic.data(), magic.size()) != 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "state blob is not a '" + std::string(magic) + "' state");
    }
    pos_ += magic.size();
    const uint32_t version = read_pod<uint32_t>();
    if (version == 0 || version > max_version) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "'" + std::string(magic) + "' state has version " +
                                                 std::to_string(version) + ", this build reads " +
                                                 "up to " + std::to_string(max_version));
    }
    return version;
  }

  // Throws DATA_LOSS when bytes are left over: a blob that is longer than its format says
  // is as suspect as a short one.
  void expect_end() const {
    if (remaining() != 0) {
      throw Error(LOOM_ERR_DATA_LOSS,
                  "state blob has " + std::to_string(remaining()) + " unexpected trailing bytes");
    }
  }

 private:
  void need(std::size_t bytes) const {
    if (bytes > remaining()) truncated(bytes);
  }
  [[noreturn]] void truncated(uint64_t wanted) const {
    throw Error(LOOM_ERR_DATA_LOSS, "state blob is truncated: needed " + std::to_string(wanted) +
                                        " bytes at offset " + std::to_string(pos_) + ", " +
                                        std::to_string(remaining()) + " left");
  }

  std::span<const std::byte> blob_;
  std::size_t pos_ = 0;
};

// ---- CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of state frames.

namespace detail {

// Slicing-by-8 tables: kCrcTables[k][b] is the CRC of byte b followed by k zero bytes.
inline constexpr std::array<std::array<uint32_t, 256>, 8> kCrcTables = [] {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1U) != 0 ? (c >> 1) ^ 0x82F63B78U : c >> 1;
    t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (std::size_t k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFU];
  }
  return t;
}();

// The running (pre-inverted) CRC over `bytes` bytes, portable.
inline uint32_t crc32c_portable(uint32_t crc, const unsigned char* p, std::size_t bytes) {
  const auto& t = kCrcTables;
  while (bytes >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian: the first byte is the low one
    word ^= crc;
    crc = t[7][word & 0xFFU] ^ t[6][(word >> 8) & 0xFFU] ^ t[5][(word >> 16) & 0xFFU] ^
          t[4][(word >> 24) & 0xFFU] ^ t[3][(word >> 32) & 0xFFU] ^ t[2][(word >> 40) & 0xFFU] ^
          t[1][(word >> 48) & 0xFFU] ^ t[0][word >> 56];
    p += 8;
    bytes -= 8;
  }
  while (bytes-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFFU];
  return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The SSE4.2 crc32 instruction computes the same CRC32C; chosen at run time, so one build
// still runs on every x86-64 CPU.
__attribute__((target("sse4.2"))) inline uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p,
                                                               std::size_t bytes) {
  uint64_t c = crc;
  while (bytes >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
    p += 8;
    bytes -= 8;
  }
  auto c32 = static_cast<uint32_t>(c);
  while (bytes-- > 0) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

}  // namespace detail

// CRC32C of `bytes`; crc32c("123456789") == 0xE3069283.
inline uint32_t crc32c(const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFU;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  crc = hardware ? detail::crc32c_sse42(crc, p, bytes) : detail::crc32c_portable(crc, p, bytes);
#else
  crc = detail::crc32c_portable(crc, p, bytes);
#endif
  return ~crc;
}

// ---- the state frame

namespace state_frame {

inline constexpr char kTag[8] = {'L', 'O', 'O', 'M', 'S', 'T', 'v', '2'};
inline constexpr std::size_t kHeaderBytes = 16;  // tag + payload size
inline constexpr std::size_t kTrailerBytes = 4;  // CRC32C
inline constexpr std::size_t kOverhead = kHeaderBytes + kTrailerBytes;

// Starts a frame in `blob` (which must be empty): the tag, and a size finish() fills in.
inline void begin(std::vector<std::byte>& blob) {
  blob.resize(kHeaderBytes);
  std::memcpy(blob.data(), kTag, sizeof kTag);
}

// Completes a frame begun by begin() once the payload has been appended.
inline void finish(std::vector<std::byte>& blob) {
  const uint64_t payload = blob.size() - kHeaderBytes;
  std::memcpy(blob.data() + sizeof kTag, &payload, sizeof payload);
  const uint32_t crc = crc32c(blob.data(), blob.size());
  const auto* c = reinterpret_cast<const std::byte*>(&crc);
  blob.insert(blob.end(), c, c + sizeof crc);
}

inline std::string hex32(uint32_t v) {
  char buf[11];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// The payload inside `blob`, checked; a blob without a frame (the format before frames)
// is returned whole. Throws Error(DATA_LOSS) saying what does not match.
inline std::span<const std::byte> open(std::span<const std::byte> blob) {
  // How many bits of the blob's first bytes differ from the tag: 0 is a frame; a few is a
  // frame with a damaged tag. Unframed SDK blobs start with a small uint64 (their magic's
  // length), dozens of bits away from the tag.
  const std::size_t head = blob.size() < sizeof kTag ? blob.size() : sizeof kTag;
  int distance = 0;
  for (std::size_t i = 0; i < head; ++i) {
    distance += std::popcount(static_cast<unsigned>(static_cast<unsigned char>(blob[i]) ^
                                                    static_cast<unsigned char>(kTag[i])));
  }
  // Unframed (the plugin's own checks apply): empty, far from the tag, or a short blob
  // that is not a prefix of it.
  if (head == 0 || distance > 3 || (head < sizeof kTag && distance != 0)) return blob;
  if (blob.size() < kOverhead) {
    throw Error(LOOM_ERR_DATA_LOSS, "state blob is truncated: " + std::to_string(blob.size()) +
                                        " bytes, shorter than the " + std::to_string(kOverhead) +
                                        "-byte frame of a checksummed state");
  }
  if (distance != 0) {
    throw Error(LOOM_ERR_DATA_LOSS,
                "state blob's frame tag is damaged (" + std::to_string(distance) +
                    " bits differ from 'LOOMSTv2'): the blob was changed after export");
  }
  uint64_t payload = 0;
  std::memcpy(&payload, blob.data() + sizeof kTag, sizeof payload);
  if (payload != blob.size() - kOverhead) {
    throw Error(LOOM_ERR_DATA_LOSS,
                "state blob is " + std::to_string(blob.size()) + " bytes, but its frame says " +
                    std::to_string(payload) + " payload bytes (" +
                    (payload > blob.size() - kOverhead ? "truncated" : "extended or damaged") +
                    " after export)");
  }
  uint32_t stored = 0;
  std::memcpy(&stored, blob.data() + blob.size() - kTrailerBytes, sizeof stored);
  const uint32_t computed = crc32c(blob.data(), blob.size() - kTrailerBytes);
  if (stored != computed) {
    throw Error(LOOM_ERR_DATA_LOSS, "state blob checksum mismatch: its frame stores CRC32C " +
                                        hex32(stored) + ", its " + std::to_string(blob.size()) +
                                        " bytes give " + hex32(computed) +
                                        " (the blob was changed or damaged after export)");
  }
  return blob.subspan(kHeaderBytes, static_cast<std::size_t>(payload));
}

}  // namespace state_frame

}  // namespace loom::sdk

#endif  // LOOM_SDK_STATE_HPP
