// The ucx transport's collectives: argument checks, then the algorithms (docs/comm.md):
// recursive doubling and the pipelined ring for allreduce, the ring for allgather and
// reduce_scatter, pairwise exchange for all_to_all, a pipelined binomial tree for broadcast,
// dissemination for the barrier.
#include <algorithm>
#include <cstring>
#include <deque>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "../../common/host_comm_checks.hpp"
#include "ucx.hpp"

namespace loom::plugins::ucx {

// ---------------------------------------------------------------- allreduce
void Ucx::allreduce(const loom_allreduce_args& a) {
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
  const Op op = a.op == LOOM_REDUCE_MAX ? Op::kMax : a.op == LOOM_REDUCE_MIN ? Op::kMin : Op::kSum;
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
void Ucx::allgather(const loom_allgather_args& a) {
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
  collective(sig, what, [&](Round& rd) { ring_allgather(rd, out, n, es); });
}

// ---------------------------------------------------------------- all_to_all
void Ucx::all_to_all(const loom_all_to_all_args& a) {
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

// ---------------------------------------------------------------- reduce_scatter
void Ucx::reduce_scatter(const loom_reduce_scatter_args& a) {
  const DLTensor& recv = host_tensor(a.recv, "reduce_scatter recv");
  const DLTensor& send = host_tensor(a.send, "reduce_scatter send");
  const Dtype dt = reduce_dtype(recv, "reduce_scatter recv");
  if (a.op < LOOM_REDUCE_SUM || a.op > LOOM_REDUCE_MIN) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "reduce_scatter op " + std::to_string(a.op) + " is not a loom_reduce_op");
  }
  loom::sdk::expect_dtype(send, recv.dtype, "reduce_scatter send");
  const auto n = static_cast<std::size_t>(loom::sdk::numel(recv));
  loom::sdk::expect_numel(send, static_cast<int64_t>(n) * size_, "reduce_scatter send");
  usable();
  const std::size_t es = loom::sdk::element_bytes(recv.dtype);
  const char* in = loom::sdk::data_as<const char>(send);
  char* out = loom::sdk::data_as<char>(recv);
  rounds_.fetch_add(1, std::memory_order_relaxed);
  if (size_ == 1) {
    if (n != 0 && in != out) std::memmove(out, in, n * es);
    return;
  }
  const Op op = a.op == LOOM_REDUCE_MAX ? Op::kMax : a.op == LOOM_REDUCE_MIN ? Op::kMin : Op::kSum;
  const bool avg = a.op == LOOM_REDUCE_AVG;
  const uint64_t sig = signature(6, static_cast<uint64_t>(a.op), dtype_key(recv.dtype), n);
  const std::string what = std::string("reduce_scatter(") + loom::sdk::reduce_op_string(a.op) +
                           ", " + loom::sdk::dtype_string(recv.dtype) + ", " + std::to_string(n) +
                           " elements per rank)";
  // The ring works in place: on a copy of send, whose block r is this rank's result at the end.
  const std::size_t total = n * static_cast<std::size_t>(size_) * es;
  if (reduce_scatter_work_.size() < total) {
    reduce_scatter_work_.clear();
    reduce_scatter_work_.shrink_to_fit();
    reduce_scatter_work_.resize(total);
  }
  char* buf = reduce_scatter_work_.data();
  std::memcpy(buf, in, total);
  std::vector<std::size_t> off(static_cast<std::size_t>(size_) + 1);
  for (int j = 0; j <= size_; ++j)
    off[static_cast<std::size_t>(j)] = static_cast<std::size_t>(j) * n;
  collective(sig, what, [&](Round& rd) {
    // Step s sends segment r - s - 1 and reduces segment r - s - 2 into place: after size - 1
    // steps segment r holds every rank's contribution.
    ring(
        rd, buf, off, es, size_ - 1, size_ - 1, dt, op, avg,
        [&](int s) { return mod(rank_ - s - 1); }, [&](int s) { return mod(rank_ - s - 2); });
  });
  std::memcpy(out, buf + static_cast<std::size_t>(rank_) * n * es, n * es);
}

// ---------------------------------------------------------------- broadcast
void Ucx::broadcast(const loom_broadcast_args& a) {
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
void Ucx::barrier(void* /*stream*/) {
  usable();
  rounds_.fetch_add(1, std::memory_order_relaxed);
  if (size_ == 1) return;
  collective(signature(5, 0, 0, 0), "barrier", [&](Round& rd) { dissemination(rd); });
}

// ---- validation

const DLTensor& Ucx::host_tensor(const DLTensor* t, const char* what) {
  return host_comm_tensor(t, what, "ucx", "use the nccl transport for CUDA memory");
}

Dtype Ucx::reduce_dtype(const DLTensor& t, const char* what) {
  return host_comm_reduce_dtype(t, what, "ucx");
}

std::size_t Ucx::byte_dtype(const DLTensor& t, const char* what) {
  return host_comm_byte_dtype(t, what, "ucx");
}

void Ucx::usable() const {
  if (broken_) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION,
                "the ucx transport failed earlier and the ranks no longer agree on the "
                "collective sequence (" +
                    broken_why_ + "); open a new session");
  }
}

// ---- algorithms

void Ucx::recursive_doubling(Round& rd, char* buf, std::size_t n, std::size_t es, Dtype dt, Op op,
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

void Ucx::ring_allreduce(Round& rd, char* buf, std::size_t n, std::size_t es, Dtype dt, Op op,
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
void Ucx::ring(Round& rd, char* buf, const std::vector<std::size_t>& off, std::size_t es, int steps,
               int reduce_steps, Dtype dt, Op op, bool avg, SendSeg send_seg, RecvSeg recv_seg) {
  if (steps <= 0) return;
  std::size_t longest = 0;
  for (std::size_t j = 0; j + 1 < off.size(); ++j) longest = std::max(longest, off[j + 1] - off[j]);
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
    l.send = rd.send(mod(rank_ + 1), buf + (off[static_cast<std::size_t>(sseg)] + ss) * es, sn * es,
                     l.step, l.chunk);
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

void Ucx::ring_allgather(Round& rd, char* out, std::size_t n, std::size_t es) {
  std::vector<std::size_t> off(static_cast<std::size_t>(size_) + 1);
  for (int j = 0; j <= size_; ++j) {
    off[static_cast<std::size_t>(j)] = static_cast<std::size_t>(j) * n;
  }
  ring(
      rd, out, off, es, size_ - 1, 0, Dtype::kF32, Op::kSum, false,
      [&](int t) { return mod(rank_ - t); }, [&](int t) { return mod(rank_ - t - 1); });
}

void Ucx::binomial_broadcast(Round& rd, char* buf, std::size_t bytes, int root) {
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

void Ucx::dissemination(Round& rd) {
  int step = 0;
  for (int d = 1; d < size_; d <<= 1, ++step) {
    const std::size_t s = rd.send(mod(rank_ + d), nullptr, 0, step, 0);
    const std::size_t r = rd.recv(mod(rank_ - d), nullptr, 0, step, 0);
    rd.wait(s, r);
  }
}

char* Ucx::scratch(std::size_t bytes) {
  if (scratch_.size() < bytes) {
    scratch_.clear();
    scratch_.shrink_to_fit();
    scratch_.resize(bytes);
  }
  return scratch_.data();
}

}  // namespace loom::plugins::ucx
