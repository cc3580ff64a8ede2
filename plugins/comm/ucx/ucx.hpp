// The `ucx` transport's shared declarations: the message tags, what an instance and its
// sub-communicators share (Link), one collective call's bookkeeping (Round, round.cpp) and
// the transport instance (Ucx): its connection setup, split and teardown (connection.cpp),
// its collectives and their algorithms (collectives.cpp). The plugin's entry point and
// overview are in ucx.cpp.
#ifndef LOOM_PLUGINS_COMM_UCX_UCX_HPP
#define LOOM_PLUGINS_COMM_UCX_UCX_HPP

#include <loom/sdk.hpp>
#include <loom/sdk/collective_queue.hpp>
#include <loom/sdk/kinds/comm.hpp>

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../../common/reduce.hpp"

namespace loom::plugins::ucx {

using loom::sdk::Context;
using loom::sdk::Error;
using Clock = std::chrono::steady_clock;

// ---- tags: kind(2) | epoch(4) | comm(6) | seq(16) | step(12) | chunk(12) | signature(12)
// The epoch is a random number agreed at creation (with the signature, also mixed with it):
// messages still in flight from an earlier, failed instance never match this one's. `comm`
// tells apart the communicators sharing one UCP worker (an instance and the
// sub-communicators split from it): each rank numbers its own live ones (0: the instance the
// factory made) and a sender writes the receiver's number, so no two communicators on a
// worker match each other's messages, whatever ranks they span.
inline constexpr uint64_t kKindData = 0;
inline constexpr uint64_t kKindAbort = 1;
inline constexpr uint64_t kKindHello = 2;
inline constexpr uint64_t kSigMask = 0xfffULL;
inline constexpr uint64_t kMaxChunks = 1ULL << 12;
inline constexpr int kMaxComms = 64;  // live communicators per worker, the root included
inline constexpr int kMaxSteps = 1 << 12;
inline constexpr int kMaxRanks = 2000;  // ring allreduce uses 2 (size - 1) steps
inline constexpr int kStepUnfold = kMaxSteps - 1;
inline constexpr std::size_t kAbortBytes = 1024;
inline constexpr std::size_t kAbortHeader = 16;  // code, rank, epoch

inline constexpr uint64_t kAbortMask = 0xfffULL << 52;  // kind, epoch and comm

inline uint64_t make_tag(uint64_t kind, uint64_t epoch, uint64_t comm, uint64_t seq, uint64_t step,
                         uint64_t chunk, uint64_t sig) {
  return (kind << 62) | ((epoch & 0xfULL) << 58) | ((comm & 0x3fULL) << 52) |
         ((seq & 0xffffULL) << 36) | ((step & 0xfffULL) << 24) | ((chunk & 0xfffULL) << 12) |
         (sig & kSigMask);
}

inline uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline uint64_t signature(uint64_t collective, uint64_t a, uint64_t b, uint64_t count) {
  return mix(mix(mix(mix(collective) ^ a) ^ b) ^ count) & kSigMask;
}

std::string seconds_string(double s);

// An error another rank reported to us: not re-broadcast.
class PeerAbort : public Error {
 public:
  using Error::Error;
};

// What the instance the factory made (the root) and every sub-communicator split from it
// share: the UCP context and worker, one endpoint per world rank, and which comm numbers
// are live on this worker. Held by shared_ptr: the last communicator to go closes it.
struct Link {
  Link() = default;
  ~Link();
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // The lowest free comm number, now taken; -1 when all kMaxComms are live.
  int reserve_id();
  void release_id(int id);

  // The worker runs in serialized mode, and communicators sharing it may be called from
  // different threads at once (they are different instances): every UCX call on it holds
  // this lock. Recursive: an error path progresses the worker from inside a call.
  std::recursive_mutex mu;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<ucp_ep_h> eps;  // by world rank; NULL for this rank
  std::vector<std::atomic<int>> ep_failed;
  uint64_t epoch = 0;
  uint64_t ids = 1;  // bit i: comm number i is live on this worker (0: the root)
  double close_timeout_s = 10.0;
  bool force_close = false;  // a communicator failed: close the endpoints without flushing
};

// What split hands the SDK to construct the sub-communicator with (Ucx(Context&,
// SplitPlan&&)). Owns the reserved comm number until the sub-communicator takes it over.
struct SplitPlan {
  SplitPlan() = default;
  SplitPlan(SplitPlan&& o) noexcept;
  SplitPlan& operator=(SplitPlan&&) = delete;
  SplitPlan(const SplitPlan&) = delete;
  SplitPlan& operator=(const SplitPlan&) = delete;
  ~SplitPlan();

  std::shared_ptr<Link> link;
  int rank = 0;
  std::vector<int> world;     // the group's ranks -> world ranks
  std::vector<uint32_t> ids;  // the group's ranks -> their comm number for the group
  int id = 0;                 // this rank's comm number for the group
  uint64_t epoch_sig = 0;
  double timeout_s = 60.0;
  std::size_t small_bytes = 0;
  std::size_t chunk_bytes = 0;
  int depth = 1;
};

class Ucx;

// One collective call: the requests it has posted, the deadline and the checks on every
// received message.
class Round {
 public:
  Round(Ucx& t, uint64_t kind, uint64_t seq, uint64_t sig, std::string what);
  ~Round();
  Round(const Round&) = delete;
  Round& operator=(const Round&) = delete;

  // Posts a message of this call (signature `sig`, default the call's) and returns its slot.
  std::size_t send(int peer, const void* data, std::size_t bytes, int step, uint64_t chunk,
                   uint64_t sig = kUseCallSig);
  std::size_t recv(int peer, void* data, std::size_t bytes, int step, uint64_t chunk,
                   uint64_t sig = kUseCallSig);
  // True when slot `i` has completed; throws on a failed or mismatched message.
  bool test(std::size_t i);
  // Drives UCX once; throws on a peer's abort or when nothing completed for timeout_s.
  void progress();
  void wait(std::size_t i) {
    while (!test(i)) progress();
  }
  void wait(std::size_t a, std::size_t b) {
    for (;;) {
      const bool da = test(a);  // test both: each completion resets the deadline
      const bool db = test(b);
      if (da && db) return;
      progress();
    }
  }
  const std::string& what() const { return what_; }

 private:
  struct Slot {
    void* request = nullptr;
    int peer = 0;
    bool is_recv = false;
    bool done = false;
    std::size_t bytes = 0;
    int step = 0;
    uint64_t sig = 0;
  };
  static constexpr uint64_t kUseCallSig = ~0ULL;

  [[noreturn]] void mismatch(const Slot& s, const std::string& detail);
  // A failed send or receive. A peer that failed first may have closed its side right after
  // telling us why; its abort message is then already on the way, and is the better error.
  [[noreturn]] void transport_error(const std::string& message);

  Ucx& t_;
  uint64_t kind_;
  uint64_t seq_;
  uint64_t sig_;
  std::string what_;
  std::deque<Slot> slots_;
  Clock::time_point last_event_;
};

class Ucx : public loom::sdk::Comm {
 public:
  static loom::sdk::Schema schema();

  explicit Ucx(Context& ctx);
  Ucx(Context& ctx, SplitPlan&& plan);  // a sub-communicator (connection.cpp)
  ~Ucx() {
    queue_.stop();  // a started collective may still be running on the queue's thread
    teardown(broken_);
  }
  Ucx(const Ucx&) = delete;
  Ucx& operator=(const Ucx&) = delete;

  int32_t rank() const { return rank_; }
  int32_t size() const { return size_; }
  bool supports_device(DLDevice d) const { return loom::sdk::is_cpu(d); }

  void stats(loom_comm_stats& out) const {
    out.bytes_sent = bytes_sent_.load(std::memory_order_relaxed);
    out.bytes_received = bytes_received_.load(std::memory_order_relaxed);
    out.rounds = rounds_.load(std::memory_order_relaxed);
  }

  // collectives.cpp
  void allreduce(const loom_allreduce_args& a);
  void allgather(const loom_allgather_args& a);
  void all_to_all(const loom_all_to_all_args& a);
  void broadcast(const loom_broadcast_args& a);
  void reduce_scatter(const loom_reduce_scatter_args& a);
  void barrier(void* stream);
  // Started collectives run on the queue's thread (start, test, wait).
  loom::sdk::CollectiveQueue& collective_queue() { return queue_; }
  // connection.cpp: collective over this instance; std::nullopt for a negative color.
  std::optional<SplitPlan> split(int32_t color, int32_t key);

 private:
  friend class Round;

  // ---- validation (collectives.cpp)
  static const DLTensor& host_tensor(const DLTensor* t, const char* what);
  static Dtype reduce_dtype(const DLTensor& t, const char* what);
  static std::size_t byte_dtype(const DLTensor& t, const char* what);
  static uint64_t dtype_key(DLDataType d) {
    return (static_cast<uint64_t>(d.code) << 24) | (static_cast<uint64_t>(d.bits) << 16) | d.lanes;
  }
  void usable() const;
  int mod(int x) const { return ((x % size_) + size_) % size_; }
  // "rank 2", or in a sub-communicator "rank 2 (world rank 5)", for messages.
  std::string who(int r) const;

  // Runs one collective: on any failure, tells the peers (unless a peer told us), marks the
  // instance broken and rethrows.
  template <class Fn>
  void collective(uint64_t sig, const std::string& what, Fn&& fn) {
    const uint64_t seq = ++seq_;
    try {
      Round rd(*this, kKindData, seq, sig, what);
      fn(rd);
    } catch (const PeerAbort& e) {
      broken_ = true;
      broken_why_ = e.what();
      throw;
    } catch (const Error& e) {
      broken_ = true;
      broken_why_ = e.what();
      send_abort(e.code(), e.what());
      throw;
    } catch (const std::exception& e) {
      broken_ = true;
      broken_why_ = e.what();
      send_abort(LOOM_ERR_INTERNAL, e.what());
      throw;
    }
  }

  // ---- algorithms (collectives.cpp)
  void recursive_doubling(Round& rd, char* buf, std::size_t n, std::size_t es, Dtype dt, Op op,
                          bool avg);
  void ring_allreduce(Round& rd, char* buf, std::size_t n, std::size_t es, Dtype dt, Op op,
                      bool avg);
  template <class SendSeg, class RecvSeg>
  void ring(Round& rd, char* buf, const std::vector<std::size_t>& off, std::size_t es, int steps,
            int reduce_steps, Dtype dt, Op op, bool avg, SendSeg send_seg, RecvSeg recv_seg);
  // Every rank's n elements of es bytes, at out + rank * n * es, gathered around the ring.
  void ring_allgather(Round& rd, char* out, std::size_t n, std::size_t es);
  void binomial_broadcast(Round& rd, char* buf, std::size_t bytes, int root);
  void dissemination(Round& rd);
  char* scratch(std::size_t bytes);

  // ---- setup and teardown (connection.cpp)
  static void check_ucs(ucs_status_t st, const std::string& what);
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  void connect();
  void post_abort_recv();
  // Throws the error a peer reported, if one arrived.
  void check_abort();
  void send_abort(loom_code code, const std::string& message) noexcept;
  void teardown(bool force) noexcept;

  Context& ctx_;
  int rank_;
  int size_;
  double timeout_s_;
  std::size_t small_bytes_;
  std::size_t chunk_bytes_;
  int depth_;

  std::shared_ptr<Link> link_;
  std::vector<int> world_;     // this communicator's ranks -> world ranks (endpoints)
  std::vector<uint32_t> ids_;  // this communicator's ranks -> their comm number for it
  int id_ = 0;                 // this rank's comm number for it (0: the root)
  bool root_ = true;
  void* abort_req_ = nullptr;
  char abort_in_[kAbortBytes] = {};
  char abort_out_[kAbortBytes] = {};

  uint64_t epoch_sig_ = 0;
  uint64_t seq_ = 0;
  bool broken_ = false;
  std::string broken_why_;
  std::vector<char> scratch_;
  std::vector<char> reduce_scatter_work_;  // reduce_scatter's copy of send (the ring is in place)

  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> rounds_{0};
  // Last: constructed after, stopped (in the destructor's body) before everything it uses.
  loom::sdk::CollectiveQueue queue_;
};

}  // namespace loom::plugins::ucx

#endif  // LOOM_PLUGINS_COMM_UCX_UCX_HPP
