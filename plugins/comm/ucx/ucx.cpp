// The `ucx` transport (loom.comm/1): collectives on host memory over UCX's UCP tag API.
//
// Setup: one UCP context and worker per instance; worker addresses are exchanged through
// the host's bootstrap allgather and every rank opens an endpoint to every peer, then a
// dissemination barrier checks that every peer answers within timeout_s.
//
// Algorithms (docs/comm.md has the details):
//   allreduce  < small_message_bytes: recursive doubling, extra ranks of a non-power-of-two
//              world folded into a partner first; otherwise a ring reduce-scatter + allgather
//              pipelined in chunks of chunk_bytes with pipeline_depth chunks in flight, so the
//              reduction of one chunk overlaps the transfer of the others.
//   allgather  ring, pipelined in chunks.  all_to_all  pairwise exchange.
//   broadcast  binomial tree, pipelined in chunks.  barrier  dissemination.
//
// Every message's 64-bit tag holds the collective's sequence number, the step and the chunk,
// so messages of different calls or steps never match, plus a 12-bit signature of the call
// (collective, op, dtype, element count): a peer that called something else is reported as
// such instead of corrupting data. A rank that fails a collective tells every peer (an abort
// message), so all ranks fail with a clear error instead of waiting; waits without progress
// end after timeout_s with LOOM_ERR_DEADLINE_EXCEEDED naming the silent peer. After such a
// failure the instance refuses further collectives (the ranks no longer agree on where they
// are); argument errors found before any message is sent leave it usable.
#include <loom/sdk.hpp>

#include <sched.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../../common/reduce.hpp"

namespace {

using loom::plugins::ucx::Dtype;
using loom::plugins::ucx::Op;
using loom::sdk::Context;
using loom::sdk::Error;
using Clock = std::chrono::steady_clock;

// ---- tags: kind(2) | epoch(4) | seq(16) | step(12) | chunk(18) | signature(12)
// The epoch is a random number agreed at creation (with the signature, also mixed with it):
// messages still in flight from an earlier, failed instance never match this one's.
constexpr uint64_t kKindData = 0;
constexpr uint64_t kKindAbort = 1;
constexpr uint64_t kKindHello = 2;
constexpr uint64_t kSigMask = 0xfffULL;
constexpr uint64_t kMaxChunks = 1ULL << 18;
constexpr int kMaxSteps = 1 << 12;
constexpr int kMaxRanks = 2000;  // ring allreduce uses 2 (size - 1) steps
constexpr int kStepUnfold = kMaxSteps - 1;
constexpr std::size_t kAbortBytes = 1024;
constexpr std::size_t kAbortHeader = 16;  // code, rank, epoch

constexpr uint64_t kAbortMask = 0xfcULL << 56;  // kind and epoch

uint64_t make_tag(uint64_t kind, uint64_t epoch, uint64_t seq, uint64_t step, uint64_t chunk,
                  uint64_t sig) {
  return (kind << 62) | ((epoch & 0xfULL) << 58) | ((seq & 0xffffULL) << 42) |
         ((step & 0xfffULL) << 30) | ((chunk & 0x3ffffULL) << 12) | (sig & kSigMask);
}

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t signature(uint64_t collective, uint64_t a, uint64_t b, uint64_t count) {
  return mix(mix(mix(mix(collective) ^ a) ^ b) ^ count) & kSigMask;
}

std::string seconds_string(double s) {
  std::string t = std::to_string(s);
  while (!t.empty() && t.back() == '0') t.pop_back();
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t;
}

// An error another rank reported to us: not re-broadcast.
class PeerAbort : public Error {
 public:
  using Error::Error;
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
  static loom::sdk::Schema schema() {
    using namespace loom::sdk;
    return {
        Float("timeout_s", 60.0,
              "Seconds a collective (or the connection setup) waits for a peer without any "
              "progress before it fails with DEADLINE_EXCEEDED naming that peer.")
            .range(0.001, 1e6),
        Int("small_message_bytes", 65536,
            "Allreduce below this many bytes uses recursive doubling; at or above it, a "
            "pipelined ring reduce-scatter + allgather.")
            .range(0, 9.0e18),
        Int("chunk_bytes", 1 << 20, "Pipeline chunk of the ring and the broadcast tree.")
            .range(4096, 1 << 30),
        Int("pipeline_depth", 4, "Chunks in flight at once in the pipelined algorithms.")
            .range(1, 256),
    };
  }

  explicit Ucx(Context& ctx)
      : ctx_(ctx),
        rank_(ctx.rank()),
        size_(ctx.world_size()),
        timeout_s_(ctx.get_float("timeout_s")),
        small_bytes_(static_cast<std::size_t>(ctx.get_int("small_message_bytes"))),
        chunk_bytes_(static_cast<std::size_t>(ctx.get_int("chunk_bytes"))),
        depth_(static_cast<int>(ctx.get_int("pipeline_depth"))) {
    if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "bootstrap gave rank " + std::to_string(rank_) + " of " + std::to_string(size_));
    }
    if (size_ > kMaxRanks) {
      throw Error(LOOM_ERR_UNIMPLEMENTED,
                  "ucx supports up to " + std::to_string(kMaxRanks) + " ranks");
    }
    if (size_ == 1) return;  // a world of one: collectives are local copies
    try {
      connect();
    } catch (...) {
      teardown(true);
      throw;
    }
  }

  ~Ucx() { teardown(broken_); }
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

  // ---------------------------------------------------------------- allreduce
  void allreduce(const loom_allreduce_args& a) {
    const DLTensor& recv = host_tensor(a.recv, "allreduce recv");
    const Dtype dt = reduce_dtype(recv, "allreduce recv");
    if (a.op < LOOM_REDUCE_SUM || a.op > LOOM_REDUCE_MIN) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "allreduce op " + std::to_string(a.op) + " is not a loom_reduce_op");
    }
    if (a.send != nullptr) {
      const DLTensor& send = host_tensor(a.send, "allreduce send");
      loom::sdk::expect_dtype(send, recv.dtype, "allreduce send");
      loom::sdk::expect_numel(send, loom::sdk::numel(recv), "allreduce send");
    }
    usable();
    const auto n = static_cast<std::size_t>(loom::sdk::numel(recv));
    const std::size_t es = loom::sdk::element_bytes(recv.dtype);
    char* buf = loom::sdk::data_as<char>(recv);
    if (a.send != nullptr) {
      const char* src = loom::sdk::data_as<const char>(*a.send);
      if (src != buf && n != 0) std::memmove(buf, src, n * es);
    }
    rounds_.fetch_add(1, std::memory_order_relaxed);
    if (size_ == 1) return;  // sum/avg/max/min of one contribution
    const Op op = a.op == LOOM_REDUCE_MAX   ? Op::kMax
                  : a.op == LOOM_REDUCE_MIN ? Op::kMin
                                            : Op::kSum;
    const bool avg = a.op == LOOM_REDUCE_AVG;
    const uint64_t sig = signature(1, static_cast<uint64_t>(a.op), dtype_key(recv.dtype), n);
    const std::string what = std::string("allreduce(") + loom::sdk::reduce_op_string(a.op) + ", " +
                             loom::sdk::dtype_string(recv.dtype) + ", " + std::to_string(n) +
                             " elements)";
    collective(sig, what, [&](Round& rd) {
      if (n * es < small_bytes_) {
        recursive_doubling(rd, buf, n, es, dt, op, avg);
      } else {
        ring_allreduce(rd, buf, n, es, dt, op, avg);
      }
    });
  }

  // ---------------------------------------------------------------- allgather
  void allgather(const loom_allgather_args& a) {
    const DLTensor& send = host_tensor(a.send, "allgather send");
    const DLTensor& recv = host_tensor(a.recv, "allgather recv");
    const std::size_t es = byte_dtype(send, "allgather send");
    loom::sdk::expect_dtype(recv, send.dtype, "allgather recv");
    const auto n = static_cast<std::size_t>(loom::sdk::numel(send));
    loom::sdk::expect_numel(recv, static_cast<int64_t>(n) * size_, "allgather recv");
    usable();
    char* out = loom::sdk::data_as<char>(recv);
    const char* in = loom::sdk::data_as<const char>(send);
    const std::size_t block = n * es;
    if (block != 0 && out + static_cast<std::size_t>(rank_) * block != in) {
      std::memmove(out + static_cast<std::size_t>(rank_) * block, in, block);
    }
    rounds_.fetch_add(1, std::memory_order_relaxed);
    if (size_ == 1) return;
    const uint64_t sig = signature(2, 0, dtype_key(send.dtype), n);
    const std::string what = "allgather(" + loom::sdk::dtype_string(send.dtype) + ", " +
                             std::to_string(n) + " elements per rank)";
    std::vector<std::size_t> off(static_cast<std::size_t>(size_) + 1);
    for (int j = 0; j <= size_; ++j)
      off[static_cast<std::size_t>(j)] = static_cast<std::size_t>(j) * n;
    collective(sig, what, [&](Round& rd) {
      ring(
          rd, out, off, es, size_ - 1, 0, Dtype::kF32, Op::kSum, false,
          [&](int t) { return mod(rank_ - t); }, [&](int t) { return mod(rank_ - t - 1); });
    });
  }

  // ---------------------------------------------------------------- all_to_all
  void all_to_all(const loom_all_to_all_args& a) {
    const DLTensor& send = host_tensor(a.send, "all_to_all send");
    const DLTensor& recv = host_tensor(a.recv, "all_to_all recv");
    const std::size_t es = byte_dtype(send, "all_to_all send");
    loom::sdk::expect_dtype(recv, send.dtype, "all_to_all recv");
    const auto p = static_cast<std::size_t>(size_);
    std::vector<std::size_t> sc(p);
    std::vector<std::size_t> rc(p);
    if ((a.send_counts == nullptr) != (a.recv_counts == nullptr)) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "all_to_all: send_counts and recv_counts must both be set or both be NULL");
    }
    const int64_t ns = loom::sdk::numel(send);
    const int64_t nr = loom::sdk::numel(recv);
    if (a.send_counts == nullptr) {
      if (ns % size_ != 0) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "all_to_all with equal splits: send has " + std::to_string(ns) +
                        " elements, not a multiple of the " + std::to_string(size_) + " ranks");
      }
      loom::sdk::expect_numel(recv, ns, "all_to_all recv");
      std::fill(sc.begin(), sc.end(), static_cast<std::size_t>(ns / size_));
      rc = sc;
    } else {
      int64_t ts = 0;
      int64_t tr = 0;
      for (std::size_t i = 0; i < p; ++i) {
        if (a.send_counts[i] < 0 || a.recv_counts[i] < 0) {
          throw Error(LOOM_ERR_INVALID_ARGUMENT,
                      "all_to_all: negative count for rank " + std::to_string(i));
        }
        sc[i] = static_cast<std::size_t>(a.send_counts[i]);
        rc[i] = static_cast<std::size_t>(a.recv_counts[i]);
        ts += a.send_counts[i];
        tr += a.recv_counts[i];
      }
      if (ts > ns || tr > nr) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "all_to_all: the counts add up to " + std::to_string(ts) + " sent / " +
                        std::to_string(tr) + " received elements, but send has " +
                        std::to_string(ns) + " and recv " + std::to_string(nr));
      }
    }
    const auto me = static_cast<std::size_t>(rank_);
    if (sc[me] != rc[me]) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "all_to_all: this rank sends itself " +
                                                 std::to_string(sc[me]) + " elements but " +
                                                 "expects " + std::to_string(rc[me]));
    }
    usable();
    std::vector<std::size_t> so(p + 1, 0);
    std::vector<std::size_t> ro(p + 1, 0);
    for (std::size_t i = 0; i < p; ++i) {
      so[i + 1] = so[i] + sc[i];
      ro[i + 1] = ro[i] + rc[i];
    }
    const char* in = loom::sdk::data_as<const char>(send);
    char* out = loom::sdk::data_as<char>(recv);
    if (sc[me] != 0) std::memmove(out + ro[me] * es, in + so[me] * es, sc[me] * es);
    rounds_.fetch_add(1, std::memory_order_relaxed);
    if (size_ == 1) return;
    const std::string what = "all_to_all(" + loom::sdk::dtype_string(send.dtype) + ")";
    const uint64_t key = dtype_key(send.dtype);
    // Each message carries the signature of its own count, so the tag check compares rank
    // r's send_counts[j] with rank j's recv_counts[r].
    collective(signature(3, 0, key, 0), what, [&](Round& rd) {
      for (int i = 1; i < size_; ++i) {
        const auto to = static_cast<std::size_t>(mod(rank_ + i));
        const auto from = static_cast<std::size_t>(mod(rank_ - i));
        const std::size_t s = rd.send(static_cast<int>(to), in + so[to] * es, sc[to] * es, i, 0,
                                      signature(3, 0, key, sc[to]));
        const std::size_t r = rd.recv(static_cast<int>(from), out + ro[from] * es, rc[from] * es, i,
                                      0, signature(3, 0, key, rc[from]));
        rd.wait(s, r);
      }
    });
  }

  // ---------------------------------------------------------------- broadcast
  void broadcast(const loom_broadcast_args& a) {
    const DLTensor& t = host_tensor(a.tensor, "broadcast tensor");
    const std::size_t es = byte_dtype(t, "broadcast tensor");
    if (a.root < 0 || a.root >= size_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "broadcast root " + std::to_string(a.root) +
                                                 " is not a rank of " + std::to_string(size_));
    }
    usable();
    rounds_.fetch_add(1, std::memory_order_relaxed);
    if (size_ == 1) return;
    const auto n = static_cast<std::size_t>(loom::sdk::numel(t));
    char* buf = loom::sdk::data_as<char>(t);
    const uint64_t sig = signature(4, static_cast<uint64_t>(a.root), dtype_key(t.dtype), n);
    const std::string what = "broadcast(root " + std::to_string(a.root) + ", " +
                             loom::sdk::dtype_string(t.dtype) + ", " + std::to_string(n) +
                             " elements)";
    collective(sig, what, [&](Round& rd) { binomial_broadcast(rd, buf, n * es, a.root); });
  }

  // ---------------------------------------------------------------- barrier
  void barrier(void* /*stream*/) {
    usable();
    rounds_.fetch_add(1, std::memory_order_relaxed);
    if (size_ == 1) return;
    collective(signature(5, 0, 0, 0), "barrier", [&](Round& rd) { dissemination(rd); });
  }

 private:
  friend class Round;

  // ---- validation

  static const DLTensor& host_tensor(const DLTensor* t, const char* what) {
    const DLTensor& x = loom::sdk::expect_tensor(t, what);
    if (!loom::sdk::is_cpu(x)) {
      throw Error(LOOM_ERR_UNIMPLEMENTED,
                  std::string(what) + " is on " + loom::sdk::device_string(x.device) +
                      ": the ucx transport moves host memory only (use the nccl transport "
                      "for CUDA memory)");
    }
    loom::sdk::expect_contiguous(x, what);
    return x;
  }

  static Dtype reduce_dtype(const DLTensor& t, const char* what) {
    if (loom::sdk::is_fp32(t)) return Dtype::kF32;
    if (loom::sdk::is_fp16(t)) return Dtype::kF16;
    if (loom::sdk::is_bf16(t)) return Dtype::kBF16;
    throw Error(LOOM_ERR_UNIMPLEMENTED, std::string(what) + " has dtype " +
                                            loom::sdk::dtype_string(t.dtype) +
                                            ": ucx reduces float32, float16 and bfloat16");
  }

  static std::size_t byte_dtype(const DLTensor& t, const char* what) {
    const std::size_t es = loom::sdk::element_bytes(t.dtype);
    if (es == 0 || t.dtype.bits % 8 != 0) {
      throw Error(LOOM_ERR_UNIMPLEMENTED, std::string(what) + " has dtype " +
                                              loom::sdk::dtype_string(t.dtype) +
                                              ": ucx moves whole-byte element types only");
    }
    return es;
  }

  static uint64_t dtype_key(DLDataType d) {
    return (static_cast<uint64_t>(d.code) << 24) | (static_cast<uint64_t>(d.bits) << 16) | d.lanes;
  }

  void usable() const {
    if (broken_) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "the ucx transport failed earlier and the ranks no longer agree on the "
                  "collective sequence (" +
                      broken_why_ + "); open a new session");
    }
  }

  int mod(int x) const { return ((x % size_) + size_) % size_; }

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

  // ---- algorithms

  void recursive_doubling(Round& rd, char* buf, std::size_t n, std::size_t es, Dtype dt, Op op,
                          bool avg) {
    const std::size_t bytes = n * es;
    char* tmp = scratch(bytes);
    int pof2 = 1;
    while (pof2 * 2 <= size_) pof2 *= 2;
    const int rem = size_ - pof2;
    int newrank = -1;
    if (rank_ < 2 * rem) {
      if (rank_ % 2 == 0) {
        rd.wait(rd.send(rank_ + 1, buf, bytes, 0, 0));
      } else {
        rd.wait(rd.recv(rank_ - 1, tmp, bytes, 0, 0));
        loom::plugins::ucx::reduce(op, dt, buf, tmp, n);
        newrank = rank_ / 2;
      }
    } else {
      newrank = rank_ - rem;
    }
    if (newrank >= 0) {
      int step = 1;
      for (int mask = 1; mask < pof2; mask <<= 1, ++step) {
        const int pn = newrank ^ mask;
        const int partner = pn < rem ? pn * 2 + 1 : pn + rem;
        const std::size_t s = rd.send(partner, buf, bytes, step, 0);
        const std::size_t r = rd.recv(partner, tmp, bytes, step, 0);
        rd.wait(s, r);
        loom::plugins::ucx::reduce(op, dt, buf, tmp, n);
      }
      if (avg) loom::plugins::ucx::divide(dt, buf, n, static_cast<float>(size_));
    }
    if (rank_ < 2 * rem) {
      if (rank_ % 2 == 1) {
        rd.wait(rd.send(rank_ - 1, buf, bytes, kStepUnfold, 0));
      } else {
        rd.wait(rd.recv(rank_ + 1, buf, bytes, kStepUnfold, 0));
      }
    }
  }

  void ring_allreduce(Round& rd, char* buf, std::size_t n, std::size_t es, Dtype dt, Op op,
                      bool avg) {
    const auto p = static_cast<std::size_t>(size_);
    std::vector<std::size_t> off(p + 1);
    for (std::size_t j = 0; j <= p; ++j) off[j] = j * n / p;  // segment j: [off[j], off[j+1])
    // Reduce-scatter: step s sends segment r - s and reduces segment r - s - 1 into place, so
    // after size - 1 steps this rank holds the full result of segment r + 1. Allgather: step
    // t sends segment r + 1 - t and receives segment r - t.
    const int steps = 2 * (size_ - 1);
    ring(
        rd, buf, off, es, steps, size_ - 1, dt, op, avg,
        [&](int s) { return s < size_ - 1 ? mod(rank_ - s) : mod(rank_ + 1 - (s - size_ + 1)); },
        [&](int s) { return s < size_ - 1 ? mod(rank_ - s - 1) : mod(rank_ - (s - size_ + 1)); });
  }

  // The pipelined ring. Segment j is elements [off[j], off[j+1]) of buf. In step s this rank
  // sends its segment send_seg(s) to the right and receives segment recv_seg(s) from the
  // left; in steps < reduce_steps the received data is combined into place (divided by the
  // world size after the last one when avg), later it lands in place. Each segment is cut in
  // chunks; `depth` lanes carry one chunk index each through all steps, so transfers of some
  // chunks overlap the reduction of others.
  template <class SendSeg, class RecvSeg>
  void ring(Round& rd, char* buf, const std::vector<std::size_t>& off, std::size_t es, int steps,
            int reduce_steps, Dtype dt, Op op, bool avg, SendSeg send_seg, RecvSeg recv_seg) {
    if (steps <= 0) return;
    std::size_t longest = 0;
    for (std::size_t j = 0; j + 1 < off.size(); ++j)
      longest = std::max(longest, off[j + 1] - off[j]);
    std::size_t ce = std::max<std::size_t>(1, chunk_bytes_ / es);
    std::size_t nchunks = std::max<std::size_t>(1, (longest + ce - 1) / ce);
    if (nchunks > kMaxChunks) {
      ce = (longest + kMaxChunks - 1) / kMaxChunks;
      nchunks = (longest + ce - 1) / ce;
    }
    const std::size_t lanes = std::min<std::size_t>(static_cast<std::size_t>(depth_), nchunks);
    struct Lane {
      std::size_t chunk;
      int step = 0;
      std::size_t send = 0;
      std::size_t recv = 0;
      char* tmp = nullptr;
      std::size_t start = 0;  // the received chunk's first element in its segment
      std::size_t count = 0;
      int rseg = 0;
      bool active = true;
    };
    char* tmp = reduce_steps > 0 ? scratch(lanes * ce * es) : nullptr;
    std::vector<Lane> lane(lanes);
    auto range = [&](int seg, std::size_t c, std::size_t* start, std::size_t* count) {
      const std::size_t len =
          off[static_cast<std::size_t>(seg) + 1] - off[static_cast<std::size_t>(seg)];
      *start = std::min(len, c * ce);
      *count = std::min(len, (c + 1) * ce) - *start;
    };
    auto post = [&](Lane& l) {
      const int sseg = send_seg(l.step);
      std::size_t ss = 0;
      std::size_t sn = 0;
      range(sseg, l.chunk, &ss, &sn);
      l.rseg = recv_seg(l.step);
      range(l.rseg, l.chunk, &l.start, &l.count);
      char* dst = l.step < reduce_steps
                      ? l.tmp
                      : buf + (off[static_cast<std::size_t>(l.rseg)] + l.start) * es;
      l.recv = rd.recv(mod(rank_ - 1), dst, l.count * es, l.step, l.chunk);
      l.send = rd.send(mod(rank_ + 1), buf + (off[static_cast<std::size_t>(sseg)] + ss) * es,
                       sn * es, l.step, l.chunk);
    };
    for (std::size_t i = 0; i < lanes; ++i) {
      lane[i].chunk = i;
      if (tmp != nullptr) lane[i].tmp = tmp + i * ce * es;
      post(lane[i]);
    }
    std::size_t active = lanes;
    while (active > 0) {
      bool moved = false;
      for (Lane& l : lane) {
        if (!l.active) continue;
        const bool received = rd.test(l.recv);
        const bool sent = rd.test(l.send);
        if (!received || !sent) continue;
        moved = true;
        if (l.step < reduce_steps) {
          char* acc = buf + (off[static_cast<std::size_t>(l.rseg)] + l.start) * es;
          loom::plugins::ucx::reduce(op, dt, acc, l.tmp, l.count);
          if (avg && l.step == reduce_steps - 1) {
            loom::plugins::ucx::divide(dt, acc, l.count, static_cast<float>(size_));
          }
        }
        if (++l.step == steps) {
          l.step = 0;
          l.chunk += lanes;
          if (l.chunk >= nchunks) {
            l.active = false;
            --active;
            continue;
          }
        }
        post(l);
      }
      if (!moved && active > 0) rd.progress();
    }
  }

  void binomial_broadcast(Round& rd, char* buf, std::size_t bytes, int root) {
    const int v = mod(rank_ - root);
    int parent = -1;
    int mask = 1;
    while (mask < size_) {
      if ((v & mask) != 0) {
        parent = mod(v - mask + root);
        break;
      }
      mask <<= 1;
    }
    std::vector<int> children;
    for (mask >>= 1; mask > 0; mask >>= 1) {
      if (v + mask < size_) children.push_back(mod(v + mask + root));
    }
    const std::size_t cb = chunk_bytes_;
    const std::size_t nchunks =
        std::max<std::size_t>(1, std::min<std::size_t>((bytes + cb - 1) / cb, kMaxChunks));
    const std::size_t per = (bytes + nchunks - 1) / nchunks;
    auto piece = [&](std::size_t c, std::size_t* start, std::size_t* len) {
      *start = std::min(bytes, c * per);
      *len = std::min(bytes, (c + 1) * per) - *start;
    };
    std::vector<std::size_t> sends;
    auto forward = [&](std::size_t c) {
      std::size_t s = 0;
      std::size_t len = 0;
      piece(c, &s, &len);
      for (int child : children) sends.push_back(rd.send(child, buf + s, len, 0, c));
    };
    if (parent < 0) {
      for (std::size_t c = 0; c < nchunks; ++c) forward(c);
    } else {
      // Up to `depth` chunks posted ahead; each is forwarded as soon as it arrives.
      std::deque<std::pair<std::size_t, std::size_t>> pending;  // (chunk, slot)
      std::size_t next = 0;
      auto post_recv = [&] {
        std::size_t s = 0;
        std::size_t len = 0;
        piece(next, &s, &len);
        pending.emplace_back(next, rd.recv(parent, buf + s, len, 0, next));
        ++next;
      };
      const auto ahead = static_cast<std::size_t>(std::max(depth_, 2));
      while (next < nchunks && pending.size() < ahead) post_recv();
      while (!pending.empty()) {
        if (rd.test(pending.front().second)) {
          forward(pending.front().first);
          pending.pop_front();
          if (next < nchunks) post_recv();
        } else {
          rd.progress();
        }
      }
    }
    for (std::size_t s : sends) rd.wait(s);
  }

  void dissemination(Round& rd) {
    int step = 0;
    for (int d = 1; d < size_; d <<= 1, ++step) {
      const std::size_t s = rd.send(mod(rank_ + d), nullptr, 0, step, 0);
      const std::size_t r = rd.recv(mod(rank_ - d), nullptr, 0, step, 0);
      rd.wait(s, r);
    }
  }

  char* scratch(std::size_t bytes) {
    if (scratch_.size() < bytes) {
      scratch_.clear();
      scratch_.shrink_to_fit();
      scratch_.resize(bytes);
    }
    return scratch_.data();
  }

  // ---- setup and teardown

  static void check_ucs(ucs_status_t st, const std::string& what) {
    if (st != UCS_OK) {
      throw Error(LOOM_ERR_UNAVAILABLE, what + ": " + ucs_status_string(st));
    }
  }

  static void on_ep_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* failed = static_cast<std::atomic<int>*>(arg);
    failed->store(static_cast<int>(status) == 0 ? -1 : static_cast<int>(status));
  }

  void connect() {
    ucp_config_t* config = nullptr;
    check_ucs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
    params.features = UCP_FEATURE_TAG;
    params.estimated_num_eps = static_cast<std::size_t>(size_);
    const ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    check_ucs(st, "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // [instance]: one call at a time, but not always from the creating thread.
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    check_ucs(ucp_worker_create(context_, &wp, &worker_), "ucp_worker_create");
    ucp_address_t* address = nullptr;
    std::size_t address_len = 0;
    check_ucs(ucp_worker_get_address(worker_, &address, &address_len), "ucp_worker_get_address");
    // Two bootstrap rounds: every rank's address length, then the addresses padded to the
    // longest.
    const auto p = static_cast<std::size_t>(size_);
    std::vector<uint64_t> hdr(2 * p);  // per rank: address length, epoch proposal
    std::random_device entropy;
    const uint64_t mine[2] = {address_len,
                              mix((static_cast<uint64_t>(entropy()) << 32) ^ entropy() ^
                                  static_cast<uint64_t>(Clock::now().time_since_epoch().count()))};
    std::vector<unsigned char> all;
    std::size_t longest = 0;
    try {
      ctx_.bootstrap_allgather(mine, sizeof(mine), hdr.data());
      epoch_ = hdr[1];  // rank 0's
      epoch_sig_ = mix(epoch_) & kSigMask;
      for (std::size_t j = 0; j < p; ++j) longest = std::max<std::size_t>(longest, hdr[2 * j]);
      std::vector<unsigned char> padded(longest, 0);
      std::memcpy(padded.data(), address, address_len);
      all.resize(longest * p);
      ctx_.bootstrap_allgather(padded.data(), longest, all.data());
    } catch (...) {
      ucp_worker_release_address(worker_, address);
      throw;
    }
    ucp_worker_release_address(worker_, address);
    eps_.assign(p, nullptr);
    ep_failed_ = std::vector<std::atomic<int>>(p);
    for (std::size_t j = 0; j < p; ++j) {
      if (static_cast<int>(j) == rank_) continue;
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(all.data() + j * longest);
      // Default error mode: UCP_ERR_HANDLING_MODE_PEER gave spurious "Endpoint timeout" errors
      // between healthy ranks with UCX 1.13 here (docs/comm.md); a dead peer is caught by
      // timeout_s instead. The handler still records any error UCX reports.
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      ep.err_handler.cb = &on_ep_error;
      ep.err_handler.arg = &ep_failed_[j];
      check_ucs(ucp_ep_create(worker_, &ep, &eps_[j]),
                "ucp_ep_create to rank " + std::to_string(j));
    }
    post_abort_recv();
    // Every peer answers (and the endpoints are wired up) before the first collective.
    Round rd(*this, kKindHello, 0, 0, "connection setup");
    dissemination(rd);
  }

  void post_abort_recv() {
    ucp_request_param_t rp{};
    abort_req_ = ucp_tag_recv_nbx(worker_, abort_in_, kAbortBytes,
                                  make_tag(kKindAbort, epoch_, 0, 0, 0, 0), kAbortMask, &rp);
    if (UCS_PTR_IS_ERR(abort_req_)) {
      const ucs_status_t st = UCS_PTR_STATUS(abort_req_);
      abort_req_ = nullptr;
      check_ucs(st, "posting the abort receive");
    }
  }

  // Throws the error a peer reported, if one arrived.
  void check_abort() {
    if (abort_req_ == nullptr) return;
    ucp_tag_recv_info_t info{};
    const ucs_status_t st = ucp_tag_recv_request_test(abort_req_, &info);
    if (st == UCS_INPROGRESS) return;
    ucp_request_free(abort_req_);
    abort_req_ = nullptr;
    int32_t code = LOOM_ERR_INTERNAL;
    int32_t from = -1;
    uint64_t epoch = 0;
    std::string text = "(unreadable abort message)";
    if (st == UCS_OK && info.length >= kAbortHeader) {
      std::memcpy(&code, abort_in_, 4);
      std::memcpy(&from, abort_in_ + 4, 4);
      std::memcpy(&epoch, abort_in_ + 8, 8);
      text.assign(abort_in_ + kAbortHeader,
                  abort_in_ + std::min<std::size_t>(info.length, kAbortBytes));
      if (epoch != epoch_) {  // from an earlier instance whose tag epoch collided: ignore
        post_abort_recv();
        return;
      }
    }
    if (code <= LOOM_OK || code > LOOM_ERR_INTERNAL) code = LOOM_ERR_INTERNAL;
    throw PeerAbort(static_cast<loom_code>(code),
                    "rank " + std::to_string(from) + " failed the collective: " + text);
  }

  void send_abort(loom_code code, const std::string& message) noexcept {
    if (worker_ == nullptr) return;
    const int32_t c = code;
    const int32_t me = rank_;
    std::memcpy(abort_out_, &c, 4);
    std::memcpy(abort_out_ + 4, &me, 4);
    std::memcpy(abort_out_ + 8, &epoch_, 8);
    const std::size_t len = std::min(message.size(), kAbortBytes - kAbortHeader);
    std::memcpy(abort_out_ + kAbortHeader, message.data(), len);
    std::vector<void*> reqs;
    for (std::size_t j = 0; j < eps_.size(); ++j) {
      if (eps_[j] == nullptr || ep_failed_[j].load() != 0) continue;
      ucp_request_param_t rp{};
      void* r = ucp_tag_send_nbx(eps_[j], abort_out_, kAbortHeader + len,
                                 make_tag(kKindAbort, epoch_, seq_, 0, 0, 0), &rp);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) reqs.push_back(r);
    }
    // Best effort: give the messages a moment to leave, without waiting on dead peers.
    const auto until = Clock::now() + std::chrono::milliseconds(500);
    while (!reqs.empty() && Clock::now() < until) {
      ucp_worker_progress(worker_);
      std::erase_if(reqs, [](void* r) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
        ucp_request_free(r);
        return true;
      });
    }
    for (void* r : reqs) ucp_request_free(r);  // completes in the background or at close
  }

  void teardown(bool force) noexcept {
    if (worker_ != nullptr) {
      if (abort_req_ != nullptr) {
        ucp_request_cancel(worker_, abort_req_);
        ucp_request_free(abort_req_);
        abort_req_ = nullptr;
      }
      std::vector<void*> closing;
      for (ucp_ep_h& ep : eps_) {
        if (ep == nullptr) continue;
        ucp_request_param_t rp{};
        rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        rp.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
        void* r = ucp_ep_close_nbx(ep, &rp);
        if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
        ep = nullptr;
      }
      const auto until = Clock::now() + std::chrono::duration<double>(std::min(timeout_s_, 10.0));
      while (!closing.empty() && Clock::now() < until) {
        ucp_worker_progress(worker_);
        std::erase_if(closing, [](void* r) {
          if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
          ucp_request_free(r);
          return true;
        });
      }
      for (void* r : closing) ucp_request_free(r);
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
    }
    if (context_ != nullptr) {
      ucp_cleanup(context_);
      context_ = nullptr;
    }
  }

  Context& ctx_;
  int rank_;
  int size_;
  double timeout_s_;
  std::size_t small_bytes_;
  std::size_t chunk_bytes_;
  int depth_;

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  std::vector<std::atomic<int>> ep_failed_;
  void* abort_req_ = nullptr;
  char abort_in_[kAbortBytes] = {};
  char abort_out_[kAbortBytes] = {};

  uint64_t epoch_ = 0;
  uint64_t epoch_sig_ = 0;
  uint64_t seq_ = 0;
  bool broken_ = false;
  std::string broken_why_;
  std::vector<char> scratch_;

  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> rounds_{0};
};

// ------------------------------------------------------------------------------- Round

Round::Round(Ucx& t, uint64_t kind, uint64_t seq, uint64_t sig, std::string what)
    : t_(t), kind_(kind), seq_(seq), sig_(sig), what_(std::move(what)), last_event_(Clock::now()) {}

Round::~Round() {
  // Normal completion leaves nothing pending. On an error, receives are cancelled (their
  // buffers are the caller's); sends cannot be cancelled and complete or fail at close.
  for (Slot& s : slots_) {
    if (s.done || s.request == nullptr) continue;
    if (s.is_recv) ucp_request_cancel(t_.worker_, s.request);
  }
  const auto until = Clock::now() + std::chrono::milliseconds(200);
  bool pending = true;
  while (pending && Clock::now() < until) {
    pending = false;
    for (Slot& s : slots_) {
      if (s.done || s.request == nullptr || !s.is_recv) continue;
      if (ucp_request_check_status(s.request) == UCS_INPROGRESS) pending = true;
    }
    if (pending) ucp_worker_progress(t_.worker_);
  }
  for (Slot& s : slots_) {
    if (!s.done && s.request != nullptr) ucp_request_free(s.request);
  }
}

std::size_t Round::send(int peer, const void* data, std::size_t bytes, int step, uint64_t chunk,
                        uint64_t sig) {
  Slot slot;
  slot.peer = peer;
  slot.bytes = bytes;
  slot.step = step;
  slot.sig = ((sig == kUseCallSig ? sig_ : sig) ^ t_.epoch_sig_) & kSigMask;
  ucp_request_param_t rp{};
  void* r = ucp_tag_send_nbx(
      t_.eps_[static_cast<std::size_t>(peer)], data, bytes,
      make_tag(kind_, t_.epoch_, seq_, static_cast<uint64_t>(step), chunk, slot.sig), &rp);
  if (UCS_PTR_IS_ERR(r)) {
    transport_error(what_ + ": sending to rank " + std::to_string(peer) +
                    " failed: " + ucs_status_string(UCS_PTR_STATUS(r)));
  }
  slot.request = r;
  slot.done = r == nullptr;
  if (slot.done) t_.bytes_sent_.fetch_add(bytes, std::memory_order_relaxed);
  slots_.push_back(slot);
  return slots_.size() - 1;
}

std::size_t Round::recv(int peer, void* data, std::size_t bytes, int step, uint64_t chunk,
                        uint64_t sig) {
  Slot slot;
  slot.peer = peer;
  slot.bytes = bytes;
  slot.step = step;
  slot.is_recv = true;
  slot.sig = ((sig == kUseCallSig ? sig_ : sig) ^ t_.epoch_sig_) & kSigMask;
  // Always a request (no immediate completion), so test() reads the sender's tag.
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  void* r = ucp_tag_recv_nbx(
      t_.worker_, data, bytes,
      make_tag(kind_, t_.epoch_, seq_, static_cast<uint64_t>(step), chunk, 0), ~kSigMask, &rp);
  if (UCS_PTR_IS_ERR(r)) {
    transport_error(what_ + ": receiving from rank " + std::to_string(peer) +
                    " failed: " + ucs_status_string(UCS_PTR_STATUS(r)));
  }
  slot.request = r;
  slots_.push_back(slot);
  return slots_.size() - 1;
}

void Round::transport_error(const std::string& message) {
  const auto until = Clock::now() + std::chrono::milliseconds(300);
  while (kind_ != kKindHello && Clock::now() < until) {
    ucp_worker_progress(t_.worker_);
    t_.check_abort();  // throws the peer's error when it has arrived
  }
  throw Error(LOOM_ERR_UNAVAILABLE, message);
}

void Round::mismatch(const Slot& s, const std::string& detail) {
  throw Error(LOOM_ERR_INVALID_ARGUMENT,
              what_ + ": rank " + std::to_string(s.peer) + " does not agree with rank " +
                  std::to_string(t_.rank_) + " (" + detail +
                  "): every rank must make the same collective call with the same dtype, "
                  "op and element count; this rank called " +
                  what_);
}

bool Round::test(std::size_t i) {
  Slot& s = slots_[i];
  if (s.done) return true;
  if (!s.is_recv) {
    const ucs_status_t st = ucp_request_check_status(s.request);
    if (st == UCS_INPROGRESS) return false;
    ucp_request_free(s.request);
    s.request = nullptr;
    s.done = true;
    if (st != UCS_OK) {
      transport_error(what_ + ": sending to rank " + std::to_string(s.peer) +
                      " failed: " + ucs_status_string(st));
    }
    t_.bytes_sent_.fetch_add(s.bytes, std::memory_order_relaxed);
    last_event_ = Clock::now();
    return true;
  }
  ucp_tag_recv_info_t info{};
  const ucs_status_t st = ucp_tag_recv_request_test(s.request, &info);
  if (st == UCS_INPROGRESS) return false;
  ucp_request_free(s.request);
  s.request = nullptr;
  s.done = true;
  if (st == UCS_ERR_MESSAGE_TRUNCATED) mismatch(s, "its message is longer than expected");
  if (st != UCS_OK) {
    transport_error(what_ + ": receiving from rank " + std::to_string(s.peer) +
                    " failed: " + ucs_status_string(st));
  }
  if ((info.sender_tag & kSigMask) != s.sig) mismatch(s, "its call differs");
  if (info.length != s.bytes) {
    mismatch(s, "it sent " + std::to_string(info.length) + " bytes where " +
                    std::to_string(s.bytes) + " were expected");
  }
  t_.bytes_received_.fetch_add(s.bytes, std::memory_order_relaxed);
  last_event_ = Clock::now();
  return true;
}

void Round::progress() {
  unsigned events = 0;
  while (ucp_worker_progress(t_.worker_) != 0) ++events;
  // Nothing to do: let the other ranks run (they may share this core).
  if (events == 0) sched_yield();
  // A peer may already have failed the first collective while this rank still finishes
  // its connection setup: that abort is for the collective, so it waits until then.
  if (kind_ != kKindHello) t_.check_abort();
  for (std::size_t j = 0; j < t_.ep_failed_.size(); ++j) {
    const int f = t_.ep_failed_[j].load();
    if (f != 0) {
      transport_error(what_ + ": the connection to rank " + std::to_string(j) + " failed (" +
                      ucs_status_string(static_cast<ucs_status_t>(f)) + "); did it exit?");
    }
  }
  const double idle = std::chrono::duration<double>(Clock::now() - last_event_).count();
  if (idle < t_.timeout_s_) return;
  // Name the peer we wait for: a pending receive first (its sender is silent).
  const Slot* late = nullptr;
  for (const Slot& s : slots_) {
    if (s.done) continue;
    if (late == nullptr || (s.is_recv && !late->is_recv)) late = &s;
  }
  const std::string peer = late != nullptr ? std::to_string(late->peer) : "?";
  throw Error(LOOM_ERR_DEADLINE_EXCEEDED,
              what_ + ": rank " + std::to_string(t_.rank_) + " waited " +
                  seconds_string(t_.timeout_s_) + " s for rank " + peer + " (step " +
                  std::to_string(late != nullptr ? late->step : 0) +
                  ") without progress: did it fail, exit or make a different call? "
                  "(timeout_s sets the limit)");
}

}  // namespace

LOOM_PLUGIN("ucx", "1.0.0", "Collectives on host memory over UCX (shared memory, TCP, RDMA)",
            loom::sdk::factory<Ucx>());
