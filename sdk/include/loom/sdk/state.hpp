// Exported state: StateWriter streams bytes to the host's loom_state_writer; StateReader
// parses a blob on import and throws Error(DATA_LOSS) when it runs out of bytes.
// Values are written in native byte order (every supported target is little-endian).
#ifndef LOOM_SDK_STATE_HPP
#define LOOM_SDK_STATE_HPP

#include <loom/abi.h>
#include <loom/sdk/status.hpp>

#include <cstddef>
#include <cstdint>
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

}  // namespace loom::sdk

#endif  // LOOM_SDK_STATE_HPP
