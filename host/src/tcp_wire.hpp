// The rendezvous' wire (tcp_bootstrap.cpp speaks its protocol over it): the frame every
// message starts with, an owned descriptor, and whole-message sends and receives with
// deadlines over non-blocking sockets. Internal to the host.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom::host::tcp {

using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ wire format

inline constexpr uint32_t kMagic = 0x4d4f4f4cu;  // "LOOM" in memory on a little-endian machine
inline constexpr uint16_t kVersion = 1;

enum Kind : uint16_t {
  kHello = 1,    // rank -> rank 0: rank, world
  kWelcome = 2,  // rank 0 -> rank: the job is complete
  kGather = 3,   // rank -> rank 0: seq, bytes per rank, then the block
  kBarrier = 4,  // rank -> rank 0: seq
  kResult = 5,   // rank 0 -> rank: seq, total bytes, then the concatenation
  kFail = 6,     // rank 0 -> rank: rank = the loom_code, bytes = message length, then the text
};

// Every message starts with one (host byte order: a peer of the other order fails the
// magic check).
struct Frame {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t kind = 0;
  int32_t rank = 0;
  int32_t world = 0;
  uint64_t seq = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(Frame) == 32, "Frame has no padding");

// The name of a message kind, for errors ("allgather").
const char* kind_name(uint16_t kind);

// ------------------------------------------------------------------ sockets

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  [[nodiscard]] int get() const { return fd_; }
  [[nodiscard]] bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

std::string errno_text(int err);

// Milliseconds left until `deadline`, rounded up, for poll().
int ms_left(Clock::time_point deadline);

// poll() that restarts after a signal with the time that is left. Returns its result
// (0 when the deadline passed), or -1 with errno for a real failure.
int poll_until(pollfd* fds, size_t n, Clock::time_point deadline);

enum class Io { kOk, kClosed, kTimeout, kError };
struct IoResult {
  Io what = Io::kOk;
  int err = 0;  // errno for kError (and kClosed from a reset)
};

bool is_reset(int err);

// Receives exactly n bytes, waiting at most until the deadline; with `idle` above zero the
// deadline moves to `idle` after the last byte received (a long message that keeps coming is
// not cut off).
IoResult recv_all(int fd, void* buf, size_t n, Clock::time_point deadline,
                  Clock::duration idle = Clock::duration::zero());

// Sends exactly n bytes, waiting at most until the deadline. With `watch_input`, stops when
// the other side has something to say (rank 0 only speaks early to report an error): the
// result is then kOk with `interrupted` set.
IoResult send_all(int fd, const void* buf, size_t n, Clock::time_point deadline,
                  bool watch_input = false, bool* interrupted = nullptr);

// One message for one connection: a frame and its payload, for send_many.
struct Outgoing {
  int fd = -1;
  Frame head{};
  const char* data = nullptr;
  size_t bytes = 0;
  size_t sent = 0;               // of size()
  IoResult io{Io::kTimeout, 0};  // kOk once everything is sent
  bool finished = false;
  [[nodiscard]] size_t size() const { return sizeof(Frame) + bytes; }
  // Part of the message is out but not all: the stream is mid-frame, and nothing else may be
  // written to it.
  [[nodiscard]] bool torn() const { return sent > 0 && sent < size(); }
};

// Sends every message at once (one slow reader does not hold up the others), until each is
// sent or has failed, or the deadline passes (the unfinished ones keep kTimeout). With `idle`
// above zero the deadline moves to `idle` after every byte sent. With `stop_on_failure`,
// returns as soon as one connection fails.
void send_many(std::vector<Outgoing>& out, Clock::time_point deadline, Clock::duration idle,
               bool stop_on_failure);

void set_nodelay(int fd);

// "host:port" ("[v6]:port") of a peer's address.
std::string peer_name(const sockaddr* sa);

}  // namespace loom::host::tcp
