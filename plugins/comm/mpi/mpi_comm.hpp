// The `mpi` transport's shared declarations: the process-wide MPI state (runtime.cpp: loading,
// initialising and finalising MPI, the reduction operators), what split hands over to a
// sub-communicator, and the transport instance (MpiComm: creation, split and teardown in
// mpi.cpp, the collectives in collectives.cpp). The overview is in mpi.cpp.
#ifndef LOOM_PLUGINS_COMM_MPI_MPI_COMM_HPP
#define LOOM_PLUGINS_COMM_MPI_MPI_COMM_HPP

#include <loom/sdk.hpp>
#include <loom/sdk/collective_queue.hpp>
#include <loom/sdk/kinds/comm.hpp>

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "../../common/reduce.hpp"

namespace loom::plugins::mpi {

using loom::sdk::Context;
using loom::sdk::Error;
using reduce_ops::Dtype;
using reduce_ops::Op;

// ---- runtime.cpp: MPI itself, once per process

// What the transport learned about MPI when its first instance was made.
struct MpiProcess {
  int thread_level = MPI_THREAD_SINGLE;  // MPI_Query_thread
  bool we_initialised = false;           // this plugin called MPI_Init_thread (and finalises)
  std::string library;                   // e.g. "Open MPI v4.1.4"
  int64_t count_limit = INT32_MAX;       // elements per MPI call (LOOM_MPI_COUNT_LIMIT lowers it)
};

// Makes MPI usable for an instance created with `ctx`: libmpi's symbols global (Open MPI's
// components resolve against them), MPI initialised (by the host's bootstrap, the program,
// or here with MPI_THREAD_MULTIPLE), and MPI_COMM_WORLD the same job as the host's bootstrap.
// Throws a clear error where MPI cannot be the transport (another launcher's ranks, MPI
// already finalised, worlds that disagree). [process]: called from the factory's create.
const MpiProcess& ensure_mpi(const Context& ctx);

// The user-defined MPI_Op for `op` on `dt`: each pairwise combine in fp32, rounded once
// (plugins/common/reduce.hpp); created once per process, never freed.
MPI_Op user_op(Dtype dt, Op op);

// "MPI_ERR_TRUNCATE: message truncated" for an MPI return code.
std::string mpi_error_string(int rc);
// The loom_code an MPI error class maps to.
loom_code mpi_error_code(int rc);

// An MPI datatype, freed when it goes if it is a derived one.
class Datatype {
 public:
  Datatype() = default;
  Datatype(MPI_Datatype t, bool owned) : t_(t), owned_(owned) {}
  ~Datatype() { reset(); }
  Datatype(Datatype&& o) noexcept : t_(o.t_), owned_(o.owned_) { o.owned_ = false; }
  Datatype& operator=(Datatype&& o) noexcept {
    if (this != &o) {
      reset();
      t_ = o.t_;
      owned_ = o.owned_;
      o.owned_ = false;
    }
    return *this;
  }
  Datatype(const Datatype&) = delete;
  Datatype& operator=(const Datatype&) = delete;
  MPI_Datatype get() const { return t_; }

 private:
  void reset() noexcept;
  MPI_Datatype t_ = MPI_DATATYPE_NULL;
  bool owned_ = false;
};

// What split hands the SDK to construct the sub-communicator with (MpiComm(Context&,
// MpiSplit&&)). Owns the new communicator until the sub-communicator takes it over.
struct MpiSplit {
  MpiSplit() = default;
  MpiSplit(MpiSplit&& o) noexcept;
  MpiSplit& operator=(MpiSplit&&) = delete;
  MpiSplit(const MpiSplit&) = delete;
  MpiSplit& operator=(const MpiSplit&) = delete;
  ~MpiSplit();

  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  std::vector<int> world;  // the group's ranks -> world ranks, for messages
};

class MpiComm : public loom::sdk::Comm {
 public:
  explicit MpiComm(Context& ctx);
  MpiComm(Context& ctx, MpiSplit&& sub);  // a sub-communicator
  ~MpiComm();
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

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
  // Started collectives run on the queue's thread under MPI_THREAD_MULTIPLE, at once on the
  // caller's thread below it.
  loom::sdk::CollectiveQueue& collective_queue() { return queue_; }
  // mpi.cpp: MPI_Comm_split over this instance; std::nullopt for a negative color.
  std::optional<MpiSplit> split(int32_t color, int32_t key);

 private:
  // ---- validation (collectives.cpp)
  static const DLTensor& host_tensor(const DLTensor* t, const char* what);
  static Dtype reduce_dtype(const DLTensor& t, const char* what);
  static std::size_t byte_dtype(const DLTensor& t, const char* what);
  static void check_op(int32_t op, const char* what);
  void usable() const;
  // "rank 2", or in a sub-communicator "rank 2 (world rank 5)", for messages.
  std::string who(int r) const;

  // Checks one MPI call's return code: a failure marks the instance broken and throws, naming
  // the collective (`describe()`, built only then) and this rank.
  template <class Describe>
  void call(int rc, Describe&& describe) {
    if (rc != MPI_SUCCESS) fail(rc, describe());
  }
  [[noreturn]] void fail(int rc, const std::string& what);
  // Counts one collective call (at its start, like the other transports), then its bytes.
  void begin() { rounds_.fetch_add(1, std::memory_order_relaxed); }
  void moved(uint64_t sent, uint64_t received) {
    bytes_sent_.fetch_add(sent, std::memory_order_relaxed);
    bytes_received_.fetch_add(received, std::memory_order_relaxed);
  }
  // The MPI datatype and operator that reduce `dt` with `op` (avg: sum, divided after).
  static MPI_Datatype reduce_type(Dtype dt);
  static MPI_Op reduce_mpi_op(Dtype dt, int32_t op);
  // The element type that moves `es` bytes per element.
  static Datatype move_type(std::size_t es);
  // Scratch for a copy of send when MPI needs separate buffers.
  char* scratch(std::size_t bytes);

  // ---- all_to_all's two forms (collectives.cpp)
  void alltoallv(const char* in, char* out, const std::vector<int64_t>& sc,
                 const std::vector<int64_t>& rc, std::size_t es);
  void alltoallw(const char* in, char* out, const std::vector<int64_t>& sc,
                 const std::vector<int64_t>& rc, std::size_t es);

  Context& ctx_;
  const MpiProcess& process_;
  int rank_ = 0;
  int size_ = 1;
  bool root_ = true;        // the instance the factory made (not a split)
  std::vector<int> world_;  // this communicator's ranks -> world ranks
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool broken_ = false;
  std::string broken_why_;
  std::vector<char> scratch_;

  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> rounds_{0};
  // Last: constructed after, stopped (first thing in the destructor) before everything it uses.
  loom::sdk::CollectiveQueue queue_;
};

}  // namespace loom::plugins::mpi

#endif  // LOOM_PLUGINS_COMM_MPI_MPI_COMM_HPP
