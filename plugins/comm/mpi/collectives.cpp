// The mpi transport's collectives: argument checks (all before any MPI call, so an argument
// error leaves the instance usable), then one MPI collective each, cut in pieces where a count
// passes MPI's int (or LOOM_MPI_COUNT_LIMIT, which tests lower to run those paths on small
// data). The byte counters hold the volumes of the bandwidth-optimal algorithms (MPI does
// not report what it moved): docs/comm.md has the table.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../../common/host_comm_checks.hpp"
#include "mpi_comm.hpp"

namespace loom::plugins::mpi {
namespace {

bool overlaps(const void* a, std::size_t na, const void* b, std::size_t nb) {
  if (na == 0 || nb == 0) return false;
  const auto x =
      reinterpret_cast<uintptr_t>(a);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
  const auto y =
      reinterpret_cast<uintptr_t>(b);  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast)
  return x < y + nb && y < x + na;
}

// floor(bytes * num / den) without overflowing for num < 2^32.
uint64_t share(uint64_t bytes, uint64_t num, uint64_t den) {
  return bytes / den * num + bytes % den * num / den;
}

// Calls fn(first, count) for consecutive pieces of at most `limit` of n elements (once, with
// count 0, when n is 0: every rank makes the same MPI calls).
template <class Fn>
void in_pieces(std::size_t n, int64_t limit, Fn&& fn) {
  std::size_t o = 0;
  do {
    const std::size_t len = std::min<std::size_t>(static_cast<std::size_t>(limit), n - o);
    fn(o, static_cast<int>(len));
    o += len;
  } while (o < n);
}

Op reduce_kind(int32_t op) {
  return op == LOOM_REDUCE_MAX ? Op::kMax : op == LOOM_REDUCE_MIN ? Op::kMin : Op::kSum;
}

}  // namespace

// ---------------------------------------------------------------- allreduce
void MpiComm::allreduce(const loom_allreduce_args& a) {
  const DLTensor& recv = host_tensor(a.recv, "allreduce recv");
  const Dtype dt = reduce_dtype(recv, "allreduce recv");
  check_op(a.op, "allreduce");
  const char* src = nullptr;
  if (a.send != nullptr) {
    const DLTensor& send = host_tensor(a.send, "allreduce send");
    loom::sdk::expect_dtype(send, recv.dtype, "allreduce send");
    loom::sdk::expect_numel(send, loom::sdk::numel(recv), "allreduce send");
    src = loom::sdk::data_as<const char>(send);
  }
  usable();
  begin();
  const auto n = static_cast<std::size_t>(loom::sdk::numel(recv));
  const std::size_t es = loom::sdk::element_bytes(recv.dtype);
  const std::size_t bytes = n * es;
  char* buf = loom::sdk::data_as<char>(recv);
  bool in_place = src == nullptr || src == buf;
  if (!in_place && (size_ == 1 || overlaps(src, bytes, buf, bytes))) {
    if (bytes != 0) std::memmove(buf, src, bytes);
    in_place = true;
  }
  if (size_ == 1) return;  // sum/avg/max/min of one contribution
  const MPI_Datatype type = reduce_type(dt);
  const MPI_Op op = reduce_mpi_op(dt, a.op);
  in_pieces(n, process_.count_limit, [&](std::size_t o, int len) {
    call(MPI_Allreduce(in_place ? MPI_IN_PLACE : src + o * es, buf + o * es, len, type, op, comm_),
         [&] {
           return std::string("allreduce(") + loom::sdk::reduce_op_string(a.op) + ", " +
                  loom::sdk::dtype_string(recv.dtype) + ", " + std::to_string(n) + " elements)";
         });
  });
  if (a.op == LOOM_REDUCE_AVG) reduce_ops::divide(dt, buf, n, static_cast<float>(size_));
  const uint64_t v = share(bytes, 2 * static_cast<uint64_t>(size_ - 1), size_);
  moved(v, v);
}

// ---------------------------------------------------------------- reduce_scatter
void MpiComm::reduce_scatter(const loom_reduce_scatter_args& a) {
  const DLTensor& recv = host_tensor(a.recv, "reduce_scatter recv");
  const DLTensor& send = host_tensor(a.send, "reduce_scatter send");
  const Dtype dt = reduce_dtype(recv, "reduce_scatter recv");
  check_op(a.op, "reduce_scatter");
  loom::sdk::expect_dtype(send, recv.dtype, "reduce_scatter send");
  const auto n = static_cast<std::size_t>(loom::sdk::numel(recv));
  loom::sdk::expect_numel(send, static_cast<int64_t>(n) * size_, "reduce_scatter send");
  usable();
  begin();
  const std::size_t es = loom::sdk::element_bytes(recv.dtype);
  const std::size_t block = n * es;
  const auto p = static_cast<std::size_t>(size_);
  const char* in = loom::sdk::data_as<const char>(send);
  char* out = loom::sdk::data_as<char>(recv);
  if (size_ == 1) {
    if (block != 0 && in != out) std::memmove(out, in, block);
    return;
  }
  if (overlaps(in, block * p, out, block)) {  // MPI reads send while it writes recv
    char* copy = scratch(block * p);
    std::memcpy(copy, in, block * p);
    in = copy;
  }
  const MPI_Datatype type = reduce_type(dt);
  const MPI_Op op = reduce_mpi_op(dt, a.op);
  auto what = [&] {
    return std::string("reduce_scatter(") + loom::sdk::reduce_op_string(a.op) + ", " +
           loom::sdk::dtype_string(recv.dtype) + ", " + std::to_string(n) + " elements per rank)";
  };
  if (static_cast<int64_t>(n) <= process_.count_limit) {
    call(MPI_Reduce_scatter_block(in, out, static_cast<int>(n), type, op, comm_), what);
  } else {
    // Piece [o, o + len) of every block, packed rank after rank.
    const auto limit = static_cast<std::size_t>(process_.count_limit);
    std::vector<char> packed(limit * es * p);
    in_pieces(n, process_.count_limit, [&](std::size_t o, int len) {
      const std::size_t piece = static_cast<std::size_t>(len) * es;
      for (std::size_t r = 0; r < p; ++r) {
        std::memcpy(packed.data() + r * piece, in + r * block + o * es, piece);
      }
      call(MPI_Reduce_scatter_block(packed.data(), out + o * es, len, type, op, comm_), what);
    });
  }
  if (a.op == LOOM_REDUCE_AVG) reduce_ops::divide(dt, out, n, static_cast<float>(size_));
  const uint64_t v = static_cast<uint64_t>(block) * (p - 1);
  moved(v, v);
}

// ---------------------------------------------------------------- allgather
void MpiComm::allgather(const loom_allgather_args& a) {
  const DLTensor& send = host_tensor(a.send, "allgather send");
  const DLTensor& recv = host_tensor(a.recv, "allgather recv");
  const std::size_t es = byte_dtype(send, "allgather send");
  loom::sdk::expect_dtype(recv, send.dtype, "allgather recv");
  const auto n = static_cast<std::size_t>(loom::sdk::numel(send));
  loom::sdk::expect_numel(recv, static_cast<int64_t>(n) * size_, "allgather recv");
  usable();
  begin();
  char* out = loom::sdk::data_as<char>(recv);
  const char* in = loom::sdk::data_as<const char>(send);
  const std::size_t block = n * es;
  // This rank's block goes in place first (memmove: send may overlap recv), then MPI fills the
  // others (MPI_IN_PLACE).
  char* own = out + static_cast<std::size_t>(rank_) * block;
  if (block != 0 && own != in) std::memmove(own, in, block);
  if (size_ == 1) return;
  const Datatype unit = move_type(es);
  auto what = [&] {
    return "allgather(" + loom::sdk::dtype_string(send.dtype) + ", " + std::to_string(n) +
           " elements per rank)";
  };
  if (static_cast<int64_t>(n) <= process_.count_limit) {
    call(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, static_cast<int>(n), unit.get(),
                       comm_),
         what);
  } else {
    // Piece [o, o + len) of every block: one element of a type of len elements whose extent
    // is a whole block, so rank r's piece lands in block r.
    in_pieces(n, process_.count_limit, [&](std::size_t o, int len) {
      MPI_Datatype piece = MPI_DATATYPE_NULL;
      MPI_Datatype resized = MPI_DATATYPE_NULL;
      call(MPI_Type_contiguous(len, unit.get(), &piece), what);
      const Datatype hold_piece(piece, true);
      call(MPI_Type_create_resized(piece, 0, static_cast<MPI_Aint>(block), &resized), what);
      const Datatype hold(resized, true);
      call(MPI_Type_commit(&resized), what);
      call(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out + o * es, 1, resized, comm_),
           what);
    });
  }
  const uint64_t v = static_cast<uint64_t>(block) * static_cast<uint64_t>(size_ - 1);
  moved(v, v);
}

// ---------------------------------------------------------------- all_to_all
void MpiComm::all_to_all(const loom_all_to_all_args& a) {
  const DLTensor& send = host_tensor(a.send, "all_to_all send");
  const DLTensor& recv = host_tensor(a.recv, "all_to_all recv");
  const std::size_t es = byte_dtype(send, "all_to_all send");
  loom::sdk::expect_dtype(recv, send.dtype, "all_to_all recv");
  if ((a.send_counts == nullptr) != (a.recv_counts == nullptr)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "all_to_all: send_counts and recv_counts must both be set or both be NULL");
  }
  const auto p = static_cast<std::size_t>(size_);
  const int64_t ns = loom::sdk::numel(send);
  const int64_t nr = loom::sdk::numel(recv);
  std::vector<int64_t> sc(p);
  std::vector<int64_t> rc(p);
  int64_t ts = 0;
  int64_t tr = 0;
  if (a.send_counts == nullptr) {
    if (ns % size_ != 0) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "all_to_all with equal splits: send has " + std::to_string(ns) +
                      " elements, not a multiple of the " + std::to_string(size_) + " ranks");
    }
    loom::sdk::expect_numel(recv, ns, "all_to_all recv");
    std::fill(sc.begin(), sc.end(), ns / size_);
    rc = sc;
    ts = tr = ns;
  } else {
    for (std::size_t i = 0; i < p; ++i) {
      if (a.send_counts[i] < 0 || a.recv_counts[i] < 0) {
        throw Error(LOOM_ERR_INVALID_ARGUMENT,
                    "all_to_all: negative count for rank " + std::to_string(i));
      }
      sc[i] = a.send_counts[i];
      rc[i] = a.recv_counts[i];
      ts += sc[i];
      tr += rc[i];
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
  begin();
  const char* in = loom::sdk::data_as<const char>(send);
  char* out = loom::sdk::data_as<char>(recv);
  const auto send_bytes = static_cast<std::size_t>(ts) * es;
  if (size_ == 1) {
    if (send_bytes != 0 && in != out) std::memmove(out, in, send_bytes);
    return;
  }
  if (overlaps(in, send_bytes, out, static_cast<std::size_t>(tr) * es)) {
    char* copy = scratch(send_bytes);
    std::memcpy(copy, in, send_bytes);
    in = copy;
  }
  // MPI_Alltoallv takes int counts and int offsets, in elements.
  if (ts <= process_.count_limit && tr <= process_.count_limit) {
    alltoallv(in, out, sc, rc, es);
  } else {
    alltoallw(in, out, sc, rc, es);
  }
  uint64_t sent = 0;
  uint64_t received = 0;
  for (std::size_t i = 0; i < p; ++i) {
    if (i == me) continue;
    sent += static_cast<uint64_t>(sc[i]) * es;
    received += static_cast<uint64_t>(rc[i]) * es;
  }
  moved(sent, received);
}

void MpiComm::alltoallv(const char* in, char* out, const std::vector<int64_t>& sc,
                        const std::vector<int64_t>& rc, std::size_t es) {
  const std::size_t p = sc.size();
  std::vector<int> scount(p);
  std::vector<int> rcount(p);
  std::vector<int> sdispl(p);
  std::vector<int> rdispl(p);
  int64_t so = 0;
  int64_t ro = 0;
  for (std::size_t i = 0; i < p; ++i) {
    scount[i] = static_cast<int>(sc[i]);
    rcount[i] = static_cast<int>(rc[i]);
    sdispl[i] = static_cast<int>(so);
    rdispl[i] = static_cast<int>(ro);
    so += sc[i];
    ro += rc[i];
  }
  const Datatype unit = move_type(es);
  call(MPI_Alltoallv(in, scount.data(), sdispl.data(), unit.get(), out, rcount.data(),
                     rdispl.data(), unit.get(), comm_),
       [&] { return "all_to_all(" + std::to_string(es) + "-byte elements, MPI_Alltoallv)"; });
}

// Counts or offsets past the int limit: MPI_Alltoallw from MPI_BOTTOM, each peer's part one
// datatype over absolute addresses, cut in blocks of at most the limit.
void MpiComm::alltoallw(const char* in, char* out, const std::vector<int64_t>& sc,
                        const std::vector<int64_t>& rc, std::size_t es) {
  const std::size_t p = sc.size();
  const Datatype unit = move_type(es);
  const auto limit = static_cast<std::size_t>(process_.count_limit);
  auto what = [&] { return "all_to_all(" + std::to_string(es) + "-byte elements, MPI_Alltoallw)"; };
  std::vector<Datatype> held;
  held.reserve(2 * p);
  // Peer i's part: count elements at base + first elements.
  auto part = [&](const char* base, std::size_t first, std::size_t count) -> MPI_Datatype {
    if (count == 0) return unit.get();
    const std::size_t blocks = (count + limit - 1) / limit;
    std::vector<int> lens(blocks);
    std::vector<MPI_Aint> at(blocks);
    for (std::size_t b = 0; b < blocks; ++b) {
      lens[b] = static_cast<int>(std::min(limit, count - b * limit));
      call(MPI_Get_address(base + (first + b * limit) * es, &at[b]), what);
    }
    MPI_Datatype t = MPI_DATATYPE_NULL;
    call(MPI_Type_create_hindexed(static_cast<int>(blocks), lens.data(), at.data(), unit.get(), &t),
         what);
    held.emplace_back(t, true);
    call(MPI_Type_commit(&t), what);
    return t;
  };
  std::vector<MPI_Datatype> stype(p);
  std::vector<MPI_Datatype> rtype(p);
  std::vector<int> scount(p);
  std::vector<int> rcount(p);
  const std::vector<int> zero(p, 0);
  std::size_t so = 0;
  std::size_t ro = 0;
  for (std::size_t i = 0; i < p; ++i) {
    const auto s = static_cast<std::size_t>(sc[i]);
    const auto r = static_cast<std::size_t>(rc[i]);
    stype[i] = part(in, so, s);
    rtype[i] = part(out, ro, r);
    scount[i] = s != 0 ? 1 : 0;
    rcount[i] = r != 0 ? 1 : 0;
    so += s;
    ro += r;
  }
  call(MPI_Alltoallw(MPI_BOTTOM, scount.data(), zero.data(), stype.data(), MPI_BOTTOM,
                     rcount.data(), zero.data(), rtype.data(), comm_),
       what);
}

// ---------------------------------------------------------------- broadcast
void MpiComm::broadcast(const loom_broadcast_args& a) {
  const DLTensor& t = host_tensor(a.tensor, "broadcast tensor");
  const std::size_t es = byte_dtype(t, "broadcast tensor");
  if (a.root < 0 || a.root >= size_) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "broadcast root " + std::to_string(a.root) +
                                               " is not a rank of " + std::to_string(size_));
  }
  usable();
  begin();
  if (size_ == 1) return;
  const auto n = static_cast<std::size_t>(loom::sdk::numel(t));
  char* buf = loom::sdk::data_as<char>(t);
  const Datatype unit = move_type(es);
  in_pieces(n, process_.count_limit, [&](std::size_t o, int len) {
    call(MPI_Bcast(buf + o * es, len, unit.get(), a.root, comm_), [&] {
      return "broadcast(root " + std::to_string(a.root) + ", " + loom::sdk::dtype_string(t.dtype) +
             ", " + std::to_string(n) + " elements)";
    });
  });
  // As a chain from the root: every rank but the last forwards the tensor once, every rank
  // but the root receives it once.
  const uint64_t bytes = static_cast<uint64_t>(n) * es;
  moved(rank_ == (a.root + size_ - 1) % size_ ? 0 : bytes, rank_ == a.root ? 0 : bytes);
}

// ---------------------------------------------------------------- barrier
void MpiComm::barrier(void* /*stream*/) {
  usable();
  begin();
  if (size_ == 1) return;
  call(MPI_Barrier(comm_), [] { return std::string("barrier"); });
}

// ---- validation and helpers

const DLTensor& MpiComm::host_tensor(const DLTensor* t, const char* what) {
  return host_comm_tensor(
      t, what, "mpi",
      "it does not rely on a CUDA-aware MPI; use the nccl transport for CUDA memory");
}

Dtype MpiComm::reduce_dtype(const DLTensor& t, const char* what) {
  return host_comm_reduce_dtype(t, what, "mpi");
}

std::size_t MpiComm::byte_dtype(const DLTensor& t, const char* what) {
  return host_comm_byte_dtype(t, what, "mpi");
}

void MpiComm::check_op(int32_t op, const char* what) {
  if (op < LOOM_REDUCE_SUM || op > LOOM_REDUCE_MIN) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string(what) + " op " + std::to_string(op) + " is not a loom_reduce_op");
  }
}

void MpiComm::usable() const {
  if (broken_) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION,
                "the mpi transport failed earlier and the ranks may no longer agree on the "
                "collective sequence (" +
                    broken_why_ + "); open a new session");
  }
}

void MpiComm::fail(int rc, const std::string& what) {
  std::string text = "mpi: " + what + " failed on " + who(rank_) + ": " + mpi_error_string(rc);
  broken_ = true;
  broken_why_ = text;
  throw Error(mpi_error_code(rc), text);
}

MPI_Datatype MpiComm::reduce_type(Dtype dt) { return dt == Dtype::kF32 ? MPI_FLOAT : MPI_UINT16_T; }

// fp32 sum and avg use MPI's own MPI_SUM (a + b is the same either way round); everything else
// a user-defined operator: MPI has no fp16/bf16 reductions, and its MPI_MAX/MPI_MIN return
// whichever operand a NaN comparison falls to, so partners could end with different bits.
MPI_Op MpiComm::reduce_mpi_op(Dtype dt, int32_t op) {
  const Op kind = reduce_kind(op);
  if (dt == Dtype::kF32 && kind == Op::kSum) return MPI_SUM;
  return user_op(dt, kind);
}

Datatype MpiComm::move_type(std::size_t es) {
  switch (es) {
    case 1:
      return {MPI_BYTE, false};
    case 2:
      return {MPI_UINT16_T, false};
    case 4:
      return {MPI_UINT32_T, false};
    case 8:
      return {MPI_UINT64_T, false};
    default:
      break;
  }
  MPI_Datatype t = MPI_DATATYPE_NULL;
  if (MPI_Type_contiguous(static_cast<int>(es), MPI_BYTE, &t) != MPI_SUCCESS ||
      MPI_Type_commit(&t) != MPI_SUCCESS) {
    throw Error(LOOM_ERR_INTERNAL,
                "mpi: cannot make a datatype of " + std::to_string(es) + "-byte elements");
  }
  return {t, true};
}

char* MpiComm::scratch(std::size_t bytes) {
  if (scratch_.size() < bytes) {
    scratch_.clear();
    scratch_.shrink_to_fit();
    scratch_.resize(bytes);
  }
  return scratch_.data();
}

}  // namespace loom::plugins::mpi
