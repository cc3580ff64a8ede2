#include "tcp_bootstrap.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "job_processes.hpp"
#include "status.hpp"
#include "tcp_wire.hpp"

namespace loom::host {
namespace {

// The frame, the socket helpers and their clock (tcp_wire.hpp).
using namespace tcp;  // NOLINT(google-build-using-namespace)

constexpr size_t kMaxFailMessage = size_t{64} * 1024;
constexpr long kMaxWorld = 1L << 20;  // rank 0 holds a connection per rank
// Connections rank 0 holds before they say hello; beyond it the oldest is dropped.
constexpr size_t kMaxPending = 64;
// The longest a rank waits for one address of MASTER_ADDR to answer before it tries the next
// (a filtered address would otherwise take the whole timeout).
constexpr auto kConnectAttempt = std::chrono::seconds(2);

// ------------------------------------------------------------------ configuration

struct Config {
  int rank = 0;
  int world = 1;
  int local_rank = -1;  // -1: unset, worked out from host names
  std::string addr;
  int port = 0;
  std::string port_from;  // where the port came from, for messages
  double timeout_s = 300;
};

const char* env_value(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

constexpr const char* kVars[] = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
constexpr const char* kHint =
    " (a torchrun-style launch sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on every "
    "rank; LOOM_BOOTSTRAP=single ignores them)";

int parse_int(const char* name, const char* text, long lo, long hi) {
  const std::string v(text);
  bool digits = !v.empty() && v.size() <= 10;
  for (const char c : v) digits = digits && c >= '0' && c <= '9';
  const long parsed = digits ? std::strtol(v.c_str(), nullptr, 10) : -1;
  if (!digits || parsed < lo || parsed > hi) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string("env bootstrap: ") + name + "='" + v + "' is not a whole number from " +
                    std::to_string(lo) + " to " + std::to_string(hi) + kHint);
  }
  return static_cast<int>(parsed);
}

Config read_config(double timeout_s) {
  std::string set, missing;
  int n_set = 0;
  for (const char* v : kVars) {
    std::string& list = env_value(v) != nullptr ? set : missing;
    list += std::string(list.empty() ? "" : ", ") + v;
    n_set += env_value(v) != nullptr ? 1 : 0;
  }
  if (n_set < 4) {
    const char* set_verb = n_set == 1 ? " is" : " are";
    const char* missing_verb = n_set == 3 ? " is" : " are";
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "env bootstrap: " +
                    (n_set == 0 ? std::string("none of the variables is set")
                                : set + set_verb + " set but " + missing + missing_verb + " not") +
                    kHint);
  }
  Config c;
  c.world = parse_int("WORLD_SIZE", env_value("WORLD_SIZE"), 1, kMaxWorld);
  c.rank = parse_int("RANK", env_value("RANK"), 0, INT32_MAX);
  if (c.rank >= c.world) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "env bootstrap: RANK=" + std::to_string(c.rank) +
                    " is not below WORLD_SIZE=" + std::to_string(c.world) + " (ranks are 0 to " +
                    std::to_string(c.world - 1) + ")");
  }
  if (const char* lr = env_value("LOCAL_RANK")) {
    c.local_rank = parse_int("LOCAL_RANK", lr, 0, c.world - 1);
  }
  c.addr = env_value("MASTER_ADDR");
  if (c.addr.size() >= 2 && c.addr.front() == '[' && c.addr.back() == ']') {
    c.addr = c.addr.substr(1, c.addr.size() - 2);  // a bracketed IPv6 address, as in a URL
  }
  if (c.addr.empty() || c.addr.find_first_of("[] \t") != std::string::npos) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string("env bootstrap: MASTER_ADDR='") +
                                               env_value("MASTER_ADDR") +
                                               "' is not a host name or address" + kHint);
  }
  const int master_port = parse_int("MASTER_PORT", env_value("MASTER_PORT"), 1, 65535);
  c.port = master_port;
  c.port_from = "MASTER_PORT";
  const char* agent = env_value("TORCHELASTIC_USE_AGENT_STORE");
  if (const char* own = env_value("LOOM_BOOTSTRAP_PORT")) {
    c.port = parse_int("LOOM_BOOTSTRAP_PORT", own, 1, 65535);
    c.port_from = "LOOM_BOOTSTRAP_PORT";
  } else if (agent != nullptr && std::string(agent) == "True") {
    // torchrun's agent serves its own store on MASTER_PORT (its workers connect to it as
    // clients), so rank 0 cannot listen there: the next port is Loom's.
    if (master_port == 65535) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "env bootstrap: MASTER_PORT=65535 is torchrun's agent store, and Loom's rank 0 "
                  "listens on MASTER_PORT + 1, which does not exist: pick a lower MASTER_PORT "
                  "or set LOOM_BOOTSTRAP_PORT");
    }
    c.port = master_port + 1;
    c.port_from = "MASTER_PORT + 1, as torchrun's agent serves MASTER_PORT";
  }
  c.timeout_s = timeout_s;
  return c;
}

// ------------------------------------------------------------------ the bootstrap

class TcpBootstrap {
 public:
  explicit TcpBootstrap(Config c) : c_(std::move(c)), peers_(static_cast<size_t>(c_.world)) {
    const bool v6 = c_.addr.find(':') != std::string::npos;
    where_ = (v6 ? "[" + c_.addr + "]" : c_.addr) + ":" + std::to_string(c_.port);
  }

  // Runs the rendezvous and fills the table. Throws Error.
  void start() {
    const auto deadline = deadline_from_now();
    if (c_.rank == 0) {
      accept_ranks(deadline);
    } else {
      join(deadline);
    }
    // Always run (so every rank makes the same calls whichever variables it has).
    const int by_host = local_rank_from_host_names();
    const int local = c_.local_rank >= 0 ? c_.local_rank : by_host;
    table_ = loom_bootstrap{LOOM_BOOTSTRAP_SIZE, c_.rank,      c_.world, local, this,
                            gather_entry,        barrier_entry};
  }

  [[nodiscard]] const loom_bootstrap* table() const { return &table_; }
  [[nodiscard]] const std::string& where() const { return where_; }

 private:
  static loom_status* gather_entry(void* ctx, const void* send, size_t bytes, void* recv) noexcept {
    auto* self = static_cast<TcpBootstrap*>(ctx);
    if (bytes > 0 && (send == nullptr || recv == nullptr)) {
      return make_status(LOOM_ERR_INVALID_ARGUMENT, "bootstrap allgather: NULL buffer");
    }
    return self->collective(kGather, send, bytes, recv);
  }
  static loom_status* barrier_entry(void* ctx) noexcept {
    return static_cast<TcpBootstrap*>(ctx)->collective(kBarrier, nullptr, 0, nullptr);
  }

  [[nodiscard]] Clock::time_point deadline_from_now() const { return Clock::now() + timeout(); }
  [[nodiscard]] Clock::duration timeout() const {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(c_.timeout_s));
  }
  // How much longer than rank 0 the other ranks wait for it: rank 0 times out first and
  // tells them why (which rank it waited for), rather than each giving up on its own.
  [[nodiscard]] double grace_s() const { return std::max(2.0, c_.timeout_s * 0.1); }
  [[nodiscard]] Clock::duration peer_timeout() const {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(c_.timeout_s + grace_s()));
  }
  static std::string seconds_text(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return std::string(buf) + " s";
  }
  [[nodiscard]] std::string timeout_text() const { return seconds_text(c_.timeout_s); }
  [[nodiscard]] std::string peer_timeout_text() const {
    return seconds_text(c_.timeout_s + grace_s()) +
           " (LOOM_BOOTSTRAP_TIMEOUT=" + seconds_text(c_.timeout_s) + " plus " +
           seconds_text(grace_s()) + " for rank 0's verdict)";
  }
  [[nodiscard]] std::string me() const {
    return "rank " + std::to_string(c_.rank) + " of " + std::to_string(c_.world);
  }

  // ---------------------------------------------------------------- rank 0: rendezvous

  // Binds the wildcard address (IPv6 dual-stack when available, else IPv4) on the port.
  Fd listen_socket() const {
    int last_err = 0;
    for (const int family : {AF_INET6, AF_INET}) {
      Fd fd(::socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!fd.valid()) {
        last_err = errno;
        continue;
      }
      const int one = 1, zero = 0;
      (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      int rc = 0;
      if (family == AF_INET6) {
        (void)::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        sockaddr_in6 a{};
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_any;
        a.sin6_port = htons(static_cast<uint16_t>(c_.port));
        rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);  // NOLINT
      } else {
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons(static_cast<uint16_t>(c_.port));
        rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);  // NOLINT
      }
      if (rc == 0 && ::listen(fd.get(), std::min(c_.world, 4096)) == 0) return fd;
      last_err = errno;
      if (last_err == EADDRINUSE || last_err == EACCES) break;  // IPv4 would say the same
    }
    throw Error(LOOM_ERR_UNAVAILABLE,
                "env bootstrap: rank 0 cannot listen on port " + std::to_string(c_.port) + " (" +
                    c_.port_from + "): " + errno_text(last_err) +
                    (last_err == EADDRINUSE ? " (another job or program uses the port: pick "
                                              "another MASTER_PORT, or set LOOM_BOOTSTRAP_PORT "
                                              "to a free port on every rank)"
                                            : ""));
  }

  struct Pending {
    Fd fd;
    std::string from;
    Frame hello{};
    size_t got = 0;
  };

  // Accepts connections until every rank has said hello, or fails every connected rank. A
  // connection that is not one of this job's ranks (a port scanner, a rank of another job, a
  // second process with a RANK already taken) is turned away on its own, and the rendezvous
  // goes on: the timeout's message quotes what was turned away.
  void accept_ranks(Clock::time_point deadline) {
    if (c_.world == 1) return;
    Fd listener = listen_socket();
    std::vector<Pending> pending;
    std::vector<std::string> from(peers_.size());
    std::vector<std::string> rejected;
    int joined = 0;
    int strangers = 0;
    // Turns one connection away with the error and goes on waiting for the job's ranks.
    const auto reject = [&](Fd& offender, const std::string& message) {
      send_fail(offender.get(), LOOM_ERR_INVALID_ARGUMENT, message, Clock::now());
      offender.reset();
      rejected.push_back(message);
    };
    while (joined < c_.world - 1) {
      std::vector<pollfd> fds;
      fds.push_back({listener.get(), POLLIN, 0});
      for (const auto& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
      const int r = poll_until(fds.data(), fds.size(), deadline);
      if (r < 0) {
        const int err = errno;
        fail_all(LOOM_ERR_INTERNAL, "env bootstrap: poll failed: " + errno_text(err));
      }
      if (r == 0 || ms_left(deadline) == 0) {
        std::string absent;
        int n_absent = 0;
        for (size_t i = 1; i < peers_.size(); ++i) {
          if (peers_[i].valid()) continue;
          if (++n_absent <= 16) absent += (absent.empty() ? "" : ", ") + std::to_string(i);
        }
        if (n_absent > 16) absent += " and " + std::to_string(n_absent - 16) + " more";
        std::string turned;
        for (size_t i = 0; i < rejected.size() && i < 3; ++i) {
          turned += (i == 0 ? "" : "; ") +
                    rejected[i].substr(rejected[i].rfind("env bootstrap: ", 0) == 0 ? 15 : 0);
        }
        if (rejected.size() > 3) turned += "; and " + std::to_string(rejected.size() - 3) + " more";
        fail_all(LOOM_ERR_DEADLINE_EXCEEDED,
                 "env bootstrap: rank 0 waited " + timeout_text() + " on port " +
                     std::to_string(c_.port) + " but " + (n_absent == 1 ? "rank " : "ranks ") +
                     absent + " of WORLD_SIZE=" + std::to_string(c_.world) +
                     " never connected (did one fail to start, or is its MASTER_ADDR/"
                     "MASTER_PORT different? LOOM_BOOTSTRAP_TIMEOUT sets the limit in seconds)" +
                     (rejected.empty()
                          ? std::string()
                          : "; rank 0 turned away " + std::to_string(rejected.size()) +
                                (rejected.size() == 1 ? " process: " : " processes: ") + turned) +
                     (strangers > 0 ? "; " + std::to_string(strangers) +
                                          " connections that were not Loom ranks were dropped"
                                    : std::string()));
      }
      // Read hellos before accepting more, so `fds` still matches `pending`.
      for (size_t i = fds.size(); i-- > 1;) {
        if (fds[i].revents == 0) continue;
        Pending& p = pending[i - 1];
        auto* dst = reinterpret_cast<char*>(&p.hello);  // NOLINT
        const ssize_t k = ::recv(p.fd.get(), dst + p.got, sizeof(Frame) - p.got, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k <= 0) {  // gone before its hello: not (yet) one of ours
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i - 1));
          continue;
        }
        p.got += static_cast<size_t>(k);
        if (p.got < sizeof(Frame)) continue;
        Pending done = std::move(p);
        pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i - 1));
        const Frame& h = done.hello;
        if (h.magic != kMagic || h.kind != kHello) {
          ++strangers;  // something that is not a Loom rank: drop it
          continue;
        }
        if (h.version != kVersion) {
          reject(done.fd, "env bootstrap: the rank at " + done.from +
                              " speaks bootstrap protocol " + std::to_string(h.version) +
                              ", rank 0 speaks " + std::to_string(kVersion) +
                              " (are all ranks running the same Loom?)");
          continue;
        }
        if (h.world != c_.world) {
          reject(done.fd, "env bootstrap: ranks disagree on WORLD_SIZE: rank " +
                              std::to_string(h.rank) + " (at " + done.from +
                              ") has WORLD_SIZE=" + std::to_string(h.world) +
                              " but rank 0 has WORLD_SIZE=" + std::to_string(c_.world));
          continue;
        }
        if (h.rank == 0) {
          reject(done.fd, "env bootstrap: two processes have RANK=0 (the one listening on port " +
                              std::to_string(c_.port) + " and the one at " + done.from +
                              "); every rank needs its own RANK");
          continue;
        }
        if (h.rank < 0 || h.rank >= c_.world) {
          reject(done.fd, "env bootstrap: the process at " + done.from +
                              " says RANK=" + std::to_string(h.rank) + ", outside 0.." +
                              std::to_string(c_.world - 1));
          continue;
        }
        const auto idx = static_cast<size_t>(h.rank);
        if (peers_[idx].valid()) {
          reject(done.fd, "env bootstrap: two processes have RANK=" + std::to_string(h.rank) +
                              " (at " + from[idx] + " and at " + done.from +
                              "); every rank needs its own RANK (rank 0 kept the first and "
                              "turned the second away)");
          continue;
        }
        peers_[idx] = std::move(done.fd);
        from[idx] = done.from;
        ++joined;
      }
      if ((fds[0].revents & POLLIN) != 0) {
        for (;;) {
          sockaddr_storage sa{};
          socklen_t len = sizeof sa;
          const int fd = ::accept4(listener.get(), reinterpret_cast<sockaddr*>(&sa),  // NOLINT
                                   &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (fd < 0) {
            const int err = errno;
            if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) {
              break;
            }
            if ((err == EMFILE || err == ENFILE) && !pending.empty()) {
              // Out of files with connections that have not said who they are: drop the one
              // that has waited longest (a rank says hello as soon as it connects).
              pending.erase(pending.begin());
              ++strangers;
              continue;
            }
            fail_all(LOOM_ERR_RESOURCE_EXHAUSTED,
                     "env bootstrap: rank 0 cannot accept a connection: " + errno_text(err) +
                         (err == EMFILE || err == ENFILE
                              ? " (WORLD_SIZE needs that many open files on rank 0: raise "
                                "ulimit -n)"
                              : ""));
          }
          set_nodelay(fd);
          Pending p;
          p.fd = Fd(fd);
          p.from = peer_name(reinterpret_cast<sockaddr*>(&sa));  // NOLINT
          pending.push_back(std::move(p));
          if (pending.size() > kMaxPending) {  // idle connections: drop the oldest
            pending.erase(pending.begin());
            ++strangers;
          }
        }
      }
    }
    listener.reset();  // complete: the port is free again
    Frame w;
    w.kind = kWelcome;
    w.world = c_.world;
    send_to_all(w, nullptr, "the welcome", "env bootstrap", "left before the job started");
  }

  // Rank 0: sends `head` and `total` bytes of `data` to every rank at once, with a fresh
  // deadline that moves while bytes move, so a phase that started late still has its time.
  // On a failure, fails every rank; those whose message is half sent are only shut down (a
  // Fail frame there would be read as part of the message).
  void send_to_all(const Frame& head, const char* data, const std::string& what,
                   const std::string& prefix, const std::string& closed_text) {
    std::vector<Outgoing> outs(peers_.size() - 1);
    for (size_t i = 1; i < peers_.size(); ++i) {
      Outgoing& o = outs[i - 1];
      o.fd = peers_[i].get();
      o.head = head;
      o.data = data;
      o.bytes = data != nullptr ? head.bytes : 0;
    }
    send_many(outs, deadline_from_now(), timeout(), true);
    // A connection that failed comes first: send_many stopped there, and the ones it left
    // unfinished (still marked kTimeout) did not time out.
    size_t bad = 0;
    for (size_t i = 1; i < peers_.size() && bad == 0; ++i) {
      const Io got = outs[i - 1].io.what;
      if (got != Io::kOk && got != Io::kTimeout) bad = i;
    }
    for (size_t i = 1; i < peers_.size() && bad == 0; ++i) {
      if (outs[i - 1].io.what != Io::kOk) bad = i;
    }
    if (bad != 0) {
      const size_t i = bad;
      const IoResult io = outs[i - 1].io;
      std::vector<char> torn(peers_.size(), 0);
      for (size_t j = 1; j < peers_.size(); ++j) torn[j] = outs[j - 1].torn() ? 1 : 0;
      torn[i] = 1;
      if (io.what == Io::kTimeout) {
        fail_all(LOOM_ERR_DEADLINE_EXCEEDED,
                 prefix + ": rank " + std::to_string(i) + " did not take " + what + " (" +
                     std::to_string(outs[i - 1].sent) + " of " +
                     std::to_string(outs[i - 1].size()) + " bytes sent, none for " +
                     timeout_text() + "; is it stuck?)",
                 &torn);
      }
      fail_all(
          LOOM_ERR_UNAVAILABLE,
          prefix + ": rank " + std::to_string(i) + " " + closed_text + " (" + describe(io) + ")",
          &torn);
    }
  }

  static std::string describe(const IoResult& io) {
    switch (io.what) {
      case Io::kClosed:
        return io.err != 0 ? "connection closed: " + errno_text(io.err) : "connection closed";
      case Io::kTimeout:
        return "timed out";
      case Io::kError:
        return errno_text(io.err);
      case Io::kOk:
        break;
    }
    return "ok";
  }

  // Sends the error to every connection in `fds` at once, best effort until `deadline` (a
  // peer may be gone or not reading), then shuts each down: the peer reads the error, then
  // the end of the stream.
  static void send_fail_to(const std::vector<int>& fds, loom_code code, const std::string& message,
                           Clock::time_point deadline) {
    const std::string text = message.substr(0, kMaxFailMessage);
    std::vector<Outgoing> outs(fds.size());
    for (size_t i = 0; i < fds.size(); ++i) {
      outs[i].fd = fds[i];
      outs[i].head.kind = kFail;
      outs[i].head.rank = code;
      outs[i].head.bytes = text.size();
      outs[i].data = text.data();
      outs[i].bytes = text.size();
    }
    send_many(outs, deadline, Clock::duration::zero(), false);
    for (const Outgoing& o : outs) {
      (void)::shutdown(o.fd, o.io.what == Io::kOk ? SHUT_WR : SHUT_RDWR);
    }
  }
  static void send_fail(int fd, loom_code code, const std::string& message,
                        Clock::time_point deadline) {
    if (fd >= 0) send_fail_to({fd}, code, message, deadline);
  }

  // Rank 0: tells every connected rank (all at once, within a second in all), then throws
  // the error (collective() remembers it for later calls). The ranks marked in `torn` are
  // mid-message: they are only shut down.
  [[noreturn]] void fail_all(loom_code code, const std::string& message,
                             const std::vector<char>* torn = nullptr) {
    std::vector<int> fds;
    for (size_t i = 1; i < peers_.size(); ++i) {
      if (!peers_[i].valid()) continue;
      if (torn != nullptr && (*torn)[i] != 0) {
        (void)::shutdown(peers_[i].get(), SHUT_RDWR);
      } else {
        fds.push_back(peers_[i].get());
      }
    }
    send_fail_to(fds, code, message, Clock::now() + std::chrono::seconds(1));
    throw Error(code, message);
  }

  // ---------------------------------------------------------------- other ranks: rendezvous

  void join(Clock::time_point deadline) {
    Fd fd = connect_to_rank0(deadline);
    // Rank 0 listens, so its own deadline started before now: wait longer than it does, so
    // that its verdict (which ranks never came) is the one every rank reports.
    deadline = Clock::now() + peer_timeout();
    Frame h;
    h.kind = kHello;
    h.rank = c_.rank;
    h.world = c_.world;
    bool interrupted = false;
    IoResult io = send_all(fd.get(), &h, sizeof h, deadline, true, &interrupted);
    if (io.what == Io::kOk) {
      Frame reply;
      io = recv_all(fd.get(), &reply, sizeof reply, deadline);
      if (io.what == Io::kOk) {
        check_reply(fd.get(), reply, deadline, "the handshake");
        if (reply.kind == kWelcome && reply.world == c_.world) {
          peers_[0] = std::move(fd);
          return;
        }
        throw Error(LOOM_ERR_INTERNAL, "env bootstrap: " + me() + ": unexpected " +
                                           kind_name(reply.kind) + " from rank 0 at " + where_ +
                                           " during the handshake");
      }
    }
    if (io.what == Io::kTimeout) {
      throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
                  "env bootstrap: " + me() + " reached rank 0 at " + where_ +
                      " but the job did not start within " + peer_timeout_text() +
                      ": rank 0 waits for all WORLD_SIZE ranks to connect, and its own error "
                      "names the missing ones (LOOM_BOOTSTRAP_TIMEOUT sets the limit in "
                      "seconds)");
    }
    throw Error(LOOM_ERR_UNAVAILABLE, "env bootstrap: " + me() + ": the process at " + where_ +
                                          " closed the connection during the handshake (" +
                                          describe(io) +
                                          "; is it rank 0 of this job, and still running?)");
  }

  // Throws rank 0's error if `reply` is one, or a protocol error if it is not a Loom frame.
  void check_reply(int fd, const Frame& reply, Clock::time_point deadline,
                   const std::string& during) const {
    if (reply.magic != kMagic || reply.version != kVersion) {
      throw Error(LOOM_ERR_UNAVAILABLE, "env bootstrap: " + me() + ": the process at " + where_ +
                                            " is not a Loom rank 0 of the same version (bad "
                                            "reply during " +
                                            during + ")");
    }
    if (reply.kind != kFail) return;
    std::string text(std::min<uint64_t>(reply.bytes, kMaxFailMessage), '\0');
    const IoResult io = recv_all(fd, text.data(), text.size(), deadline);
    if (io.what != Io::kOk) text = "(its message was cut off)";
    const bool known = reply.rank > LOOM_OK && reply.rank <= LOOM_ERR_INTERNAL;
    throw Error(known ? static_cast<loom_code>(reply.rank) : LOOM_ERR_INTERNAL,
                text + " [reported to " + me() + " by rank 0]");
  }

  Fd connect_to_rank0(Clock::time_point deadline) const {
    std::string last = "no attempt made";
    auto pause = std::chrono::milliseconds(20);
    for (;;) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* list = nullptr;
      const std::string port = std::to_string(c_.port);
      const int gai = ::getaddrinfo(c_.addr.c_str(), port.c_str(), &hints, &list);
      const std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(list, ::freeaddrinfo);
      // A name that does not resolve yet may later (a Kubernetes headless service has no
      // address until its pod is up): retry until the deadline.
      if (gai != 0) {
        last = "MASTER_ADDR '" + c_.addr + "' does not resolve: " +
               (gai == EAI_SYSTEM ? errno_text(errno) : std::string(::gai_strerror(gai)));
      }
      for (const addrinfo* a = list; a != nullptr; a = a->ai_next) {
        Fd fd(
            ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
        if (!fd.valid()) {
          const int err = errno;
          last = errno_text(err);
          continue;
        }
        int rc = ::connect(fd.get(), a->ai_addr, a->ai_addrlen);
        if (rc != 0 && (errno == EINPROGRESS || errno == EINTR)) {
          // At most kConnectAttempt per address, then the next one (and the list again).
          pollfd pfd{fd.get(), POLLOUT, 0};
          const int r = poll_until(&pfd, 1, std::min(deadline, Clock::now() + kConnectAttempt));
          if (r <= 0) {
            const int err = errno;
            last = r == 0 ? "connection attempt timed out" : errno_text(err);
            continue;
          }
          int err = 0;
          socklen_t len = sizeof err;
          if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
          rc = err == 0 ? 0 : -1;
          errno = err;
        }
        const int err = errno;
        if (rc == 0) {
          set_nodelay(fd.get());
          return fd;
        }
        last = errno_text(err);
      }
      const int left = ms_left(deadline);
      if (left == 0) break;
      std::this_thread::sleep_for(std::min(pause, std::chrono::milliseconds(left)));
      pause = std::min(pause * 2, std::chrono::milliseconds(500));
    }
    throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
                "env bootstrap: " + me() + " could not reach rank 0 at " + where_ + " within " +
                    timeout_text() + " (last error: " + last +
                    "); is rank 0 running, and do all ranks have the same MASTER_ADDR and "
                    "MASTER_PORT? (the port is " +
                    c_.port_from + "; LOOM_BOOTSTRAP_TIMEOUT sets the limit in seconds)");
  }

  // ---------------------------------------------------------------- collectives

  loom_status* collective(Kind kind, const void* send, size_t bytes, void* recv) noexcept {
    const std::lock_guard<std::mutex> lock(mu_);
    if (failed_) {
      return make_status(failed_code_,
                         ("bootstrap: an earlier collective failed: " + failed_text_).c_str());
    }
    try {
      ++seq_;
      if (c_.rank == 0) {
        root_collective(kind, send, bytes, recv);
      } else {
        peer_collective(kind, send, bytes, recv);
      }
      return nullptr;
    } catch (const Error& e) {
      fail_locally(e.code(), e.what());
      return make_status(e.code(), e.what());
    } catch (const std::exception& e) {
      fail_locally(LOOM_ERR_INTERNAL, e.what());
      return make_status(LOOM_ERR_INTERNAL, e.what());
    }
  }

  // Remembers the error for later calls. A rank other than 0 also shuts its connection down,
  // so rank 0 sees the end of the stream at once instead of waiting for the timeout.
  void fail_locally(loom_code code, const std::string& text) {
    failed_ = true;
    failed_code_ = code;
    failed_text_ = text;
    if (c_.rank != 0 && peers_[0].valid()) (void)::shutdown(peers_[0].get(), SHUT_RDWR);
  }

  [[nodiscard]] std::string op_text(Kind kind, size_t bytes) const {
    return std::string(kind_name(kind)) + " #" + std::to_string(seq_) +
           (kind == kGather ? " (" + std::to_string(bytes) + " bytes per rank)" : "");
  }

  static uint64_t total_bytes(size_t bytes, int world) {
    if (bytes != 0 && static_cast<size_t>(world) > SIZE_MAX / bytes) {
      throw Error(LOOM_ERR_OUT_OF_RANGE, "bootstrap allgather: " + std::to_string(bytes) +
                                             " bytes from each of " + std::to_string(world) +
                                             " ranks overflow the address space");
    }
    return static_cast<uint64_t>(bytes) * static_cast<uint64_t>(world);
  }

  struct Incoming {
    Frame head{};
    size_t got_head = 0;
    size_t got_data = 0;
    bool done = false;
  };

  void root_collective(Kind kind, const void* send, size_t bytes, void* recv) {
    const uint64_t total = total_bytes(bytes, c_.world);
    const auto deadline = deadline_from_now();
    auto* out = static_cast<char*>(recv);
    if (bytes > 0) std::memmove(out, send, bytes);
    const size_t n = peers_.size();
    std::vector<Incoming> in(n);
    in[0].done = true;
    size_t remaining = n - 1;
    std::vector<pollfd> fds;
    std::vector<size_t> who;
    while (remaining > 0) {
      fds.clear();
      who.clear();
      for (size_t i = 1; i < n; ++i) {
        if (in[i].done) continue;
        fds.push_back({peers_[i].get(), POLLIN, 0});
        who.push_back(i);
      }
      const int r = poll_until(fds.data(), fds.size(), deadline);
      if (r < 0) {
        const int err = errno;
        fail_all(LOOM_ERR_INTERNAL, "bootstrap: poll failed: " + errno_text(err));
      }
      if (r == 0 || ms_left(deadline) == 0) {
        std::string late;
        for (const size_t i : who) late += (late.empty() ? "" : ", ") + std::to_string(i);
        fail_all(LOOM_ERR_DEADLINE_EXCEEDED,
                 "bootstrap " + op_text(kind, bytes) + ": rank 0 waited " + timeout_text() +
                     " for " + (who.size() == 1 ? "rank " : "ranks ") + late + " of " +
                     std::to_string(c_.world) +
                     " (did one die, hang, or stop calling the bootstrap? "
                     "LOOM_BOOTSTRAP_TIMEOUT sets the limit in seconds)");
      }
      for (size_t j = 0; j < fds.size(); ++j) {
        if (fds[j].revents == 0) continue;
        const size_t i = who[j];
        Incoming& m = in[i];
        char* dst = nullptr;
        size_t want = 0;
        if (m.got_head < sizeof(Frame)) {
          dst = reinterpret_cast<char*>(&m.head) + m.got_head;  // NOLINT
          want = sizeof(Frame) - m.got_head;
        } else {
          dst = out + i * bytes + m.got_data;
          want = bytes - m.got_data;
        }
        const ssize_t k = ::recv(peers_[i].get(), dst, std::min<size_t>(want, size_t{1} << 30), 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (k <= 0) {
          const int err = k < 0 ? errno : 0;
          fail_all(LOOM_ERR_UNAVAILABLE,
                   "bootstrap " + op_text(kind, bytes) + ": rank " + std::to_string(i) +
                       " closed its connection to rank 0" +
                       (err != 0 ? " (" + errno_text(err) + ")" : std::string()) +
                       " (did it exit or crash?)");
        }
        if (m.got_head < sizeof(Frame)) {
          m.got_head += static_cast<size_t>(k);
          if (m.got_head == sizeof(Frame)) check_request(i, m.head, kind, bytes);
        } else {
          m.got_data += static_cast<size_t>(k);
        }
        if (m.got_head == sizeof(Frame) && m.got_data == bytes) {
          m.done = true;
          --remaining;
        }
      }
    }
    // Every block is in: the result goes out with its own deadline (the last rank may have
    // come just before the gathering's).
    Frame res;
    res.kind = kResult;
    res.seq = seq_;
    res.bytes = total;
    send_to_all(res, out, "the result", "bootstrap " + op_text(kind, bytes),
                "closed its connection");
  }

  void check_request(size_t from, const Frame& h, Kind kind, size_t bytes) {
    const std::string who = "rank " + std::to_string(from);
    if (h.magic != kMagic || h.version != kVersion || (h.kind != kGather && h.kind != kBarrier)) {
      fail_all(LOOM_ERR_INTERNAL, "bootstrap " + op_text(kind, bytes) + ": " + who +
                                      " sent a malformed message (" + kind_name(h.kind) + ")");
    }
    if (h.kind != kind || h.seq != seq_ || (kind == kGather && h.bytes != bytes)) {
      const std::string theirs =
          std::string(kind_name(h.kind)) + " #" + std::to_string(h.seq) +
          (h.kind == kGather ? " (" + std::to_string(h.bytes) + " bytes per rank)" : std::string());
      fail_all(LOOM_ERR_FAILED_PRECONDITION,
               "bootstrap: the ranks' collectives do not match: rank 0 is in " +
                   op_text(kind, bytes) + " but " + who + " called " + theirs +
                   " (every rank must make the same bootstrap calls in the same order)");
    }
  }

  void peer_collective(Kind kind, const void* send, size_t bytes, void* recv) {
    const uint64_t total = total_bytes(bytes, c_.world);
    const auto deadline = Clock::now() + peer_timeout();
    const int fd = peers_[0].get();
    const std::string what = "bootstrap " + op_text(kind, bytes) + ": " + me();
    Frame req;
    req.kind = kind;
    req.rank = c_.rank;
    req.world = c_.world;
    req.seq = seq_;
    req.bytes = bytes;
    // Rank 0 speaks before our request is complete only to report an error: then stop
    // sending and read it. A send that finds the connection closed may still find the
    // error in the receive queue.
    bool early = false;
    IoResult io = send_all(fd, &req, sizeof req, deadline, true, &early);
    if (io.what == Io::kOk && !early) io = send_all(fd, send, bytes, deadline, true, &early);
    if (io.what == Io::kOk || io.what == Io::kClosed) {
      Frame reply;
      const IoResult got = recv_all(fd, &reply, sizeof reply, deadline);
      if (got.what == Io::kOk) {
        check_reply(fd, reply, deadline, op_text(kind, bytes));  // throws rank 0's error
        if (io.what != Io::kOk || early || reply.kind != kResult || reply.seq != seq_ ||
            reply.bytes != total) {
          throw Error(LOOM_ERR_INTERNAL, what + " got an unexpected " + kind_name(reply.kind) +
                                             " #" + std::to_string(reply.seq) + " from rank 0");
        }
        // Rank 0 sends the result with a deadline of its own: wait while it keeps coming.
        io = recv_all(fd, recv, total, Clock::now() + peer_timeout(), peer_timeout());
        if (io.what == Io::kOk) return;
      } else if (io.what == Io::kOk) {
        io = got;
      }
    }
    if (io.what == Io::kTimeout) {
      throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
                  what + " waited " + peer_timeout_text() +
                      " for rank 0, which did not say why (did rank 0 die, hang, or stop "
                      "calling the bootstrap? LOOM_BOOTSTRAP_TIMEOUT sets the limit in seconds)");
    }
    throw Error(LOOM_ERR_UNAVAILABLE, what + ": rank 0 at " + where_ + " closed the connection (" +
                                          describe(io) + "; did it exit or crash?)");
  }

  // ---------------------------------------------------------------- local rank

  int local_rank_from_host_names() {
    const ProcessRecord me = this_process();
    std::vector<ProcessRecord> all(peers_.size());
    loom_status* st = collective(kGather, &me, sizeof me, all.data());
    if (st != nullptr) {
      const TakenStatus t = take_status(st);
      throw Error(t.code, t.message);
    }
    remember_job_processes(all, c_.rank);
    int local = 0;
    for (int i = 0; i < c_.rank; ++i) {
      if (std::strncmp(all[static_cast<size_t>(i)].host, me.host, sizeof me.host) == 0) ++local;
    }
    return local;
  }

  Config c_;
  std::string where_;
  std::vector<Fd> peers_;  // rank 0: one per rank (peers_[0] unused); others: peers_[0]
  loom_bootstrap table_{};
  std::mutex mu_;
  uint64_t seq_ = 0;
  bool failed_ = false;
  loom_code failed_code_ = LOOM_OK;
  std::string failed_text_;
};

}  // namespace

bool env_launch_requested() {
  return std::any_of(std::begin(kVars), std::end(kVars),
                     [](const char* v) { return env_value(v) != nullptr; });
}

const loom_bootstrap* init_env_bootstrap(double timeout_s, std::string* how) {
  auto b = std::make_unique<TcpBootstrap>(read_config(timeout_s));
  b->start();
  const loom_bootstrap* t = b->table();
  if (how != nullptr) {
    *how = "env: rank " + std::to_string(t->rank) + " of " + std::to_string(t->size) + " via " +
           b->where() + " (local rank " + std::to_string(t->local_rank) + ")";
  }
  (void)b.release();  // lives until exit, like the MPI bootstrap: instances may use it late
  return t;
}

}  // namespace loom::host
