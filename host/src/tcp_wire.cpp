#include "tcp_wire.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace loom::host::tcp {

const char* kind_name(uint16_t kind) {
  switch (kind) {
    case kHello:
      return "hello";
    case kWelcome:
      return "welcome";
    case kGather:
      return "allgather";
    case kBarrier:
      return "barrier";
    case kResult:
      return "result";
    case kFail:
      return "error";
    default:
      return "unknown message";
  }
}

std::string errno_text(int err) { return std::strerror(err); }

// Milliseconds left until `deadline`, rounded up, for poll().
int ms_left(Clock::time_point deadline) {
  const auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

// poll() that restarts after a signal with the time that is left. Returns its result
// (0 when the deadline passed), or -1 with errno for a real failure.
int poll_until(pollfd* fds, size_t n, Clock::time_point deadline) {
  for (;;) {
    const int r = ::poll(fds, n, ms_left(deadline));
    if (r >= 0 || errno != EINTR) return r;
  }
}

bool is_reset(int err) { return err == EPIPE || err == ECONNRESET || err == ENOTCONN; }

// Receives exactly n bytes, waiting at most until the deadline; with `idle` above zero the
// deadline moves to `idle` after the last byte received (a long message that keeps coming is
// not cut off).
IoResult recv_all(int fd, void* buf, size_t n, Clock::time_point deadline, Clock::duration idle) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, std::min<size_t>(n, size_t{1} << 30), 0);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      if (idle > Clock::duration::zero()) deadline = std::max(deadline, Clock::now() + idle);
      continue;
    }
    if (k == 0) return {Io::kClosed, 0};
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return {is_reset(errno) ? Io::kClosed : Io::kError, errno};
    }
    pollfd pfd{fd, POLLIN, 0};
    const int r = poll_until(&pfd, 1, deadline);
    if (r < 0) return {Io::kError, errno};
    if (r == 0) return {Io::kTimeout, 0};
  }
  return {};
}

// Sends exactly n bytes, waiting at most until the deadline. With `watch_input`, stops when
// the other side has something to say (rank 0 only speaks early to report an error): the
// result is then kOk with `interrupted` set.
IoResult send_all(int fd, const void* buf, size_t n, Clock::time_point deadline, bool watch_input,
                  bool* interrupted) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, std::min<size_t>(n, size_t{1} << 30), MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      return {is_reset(errno) ? Io::kClosed : Io::kError, errno};
    }
    pollfd pfd{fd, static_cast<short>(POLLOUT | (watch_input ? POLLIN : 0)), 0};
    const int r = poll_until(&pfd, 1, deadline);
    if (r < 0) return {Io::kError, errno};
    if (r == 0) return {Io::kTimeout, 0};
    if (watch_input && (pfd.revents & POLLIN) != 0) {
      if (interrupted != nullptr) *interrupted = true;
      return {};
    }
  }
  return {};
}

// Sends every message at once (one slow reader does not hold up the others), until each is
// sent or has failed, or the deadline passes (the unfinished ones keep kTimeout). With `idle`
// above zero the deadline moves to `idle` after every byte sent. With `stop_on_failure`,
// returns as soon as one connection fails.
void send_many(std::vector<Outgoing>& out, Clock::time_point deadline, Clock::duration idle,
               bool stop_on_failure) {
  std::vector<pollfd> fds;
  std::vector<size_t> who;
  for (;;) {
    bool failed = false;
    fds.clear();
    who.clear();
    for (size_t i = 0; i < out.size(); ++i) {
      Outgoing& o = out[i];
      if (o.finished) continue;
      bool moved = false;
      while (o.sent < o.size()) {
        const char* p = nullptr;
        size_t n = 0;
        if (o.sent < sizeof(Frame)) {
          p = reinterpret_cast<const char*>(&o.head) + o.sent;  // NOLINT
          n = sizeof(Frame) - o.sent;
        } else {
          p = o.data + (o.sent - sizeof(Frame));
          n = o.size() - o.sent;
        }
        const ssize_t k = ::send(o.fd, p, std::min<size_t>(n, size_t{1} << 30), MSG_NOSIGNAL);
        if (k > 0) {
          o.sent += static_cast<size_t>(k);
          moved = true;
          continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k == 0 || errno == EAGAIN || errno == EWOULDBLOCK) break;
        o.io = {is_reset(errno) ? Io::kClosed : Io::kError, errno};
        o.finished = true;
        failed = true;
        break;
      }
      if (moved && idle > Clock::duration::zero()) {
        deadline = std::max(deadline, Clock::now() + idle);
      }
      if (!o.finished && o.sent == o.size()) {
        o.io = {};
        o.finished = true;
      }
      if (!o.finished) {
        fds.push_back({o.fd, POLLOUT, 0});
        who.push_back(i);
      }
    }
    if (fds.empty() || (failed && stop_on_failure)) return;
    const int r = poll_until(fds.data(), fds.size(), deadline);
    if (r < 0) {
      const int err = errno;
      for (const size_t i : who) out[i].io = {Io::kError, err};
      return;
    }
    if (r == 0) return;
  }
}

void set_nodelay(int fd) {
  const int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::string peer_name(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  bool v6 = false;
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);  // NOLINT
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);  // NOLINT
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {  // an IPv4 peer of the dual-stack listener
      ::inet_ntop(AF_INET, &in6->sin6_addr.s6_addr[12], host, sizeof host);
    } else {
      ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
      v6 = true;
    }
    port = ntohs(in6->sin6_port);
  }
  return (v6 ? "[" + std::string(host) + "]" : std::string(host)) + ":" + std::to_string(port);
}

}  // namespace loom::host::tcp
