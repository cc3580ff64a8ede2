// The `mpi` transport (loom.comm/1): collectives on host memory through the MPI library's own
// collectives, so a cluster's tuned MPI (its algorithms, its network support, its launcher) is
// used as it is.
//
// MPI itself (runtime.cpp): the host's bootstrap initialises MPI when an MPI launcher started
// the job (asking for MPI_THREAD_MULTIPLE); otherwise the first instance does (a world of one
// launched alone, or a program with a bootstrap of its own under mpirun) and finalises it at
// exit. Ranks started by another launcher (RANK/WORLD_SIZE) are refused: MPI cannot join
// them. Every instance runs on its own duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN.
//
// Collectives (collectives.cpp, docs/comm.md has the table): allreduce MPI_Allreduce,
// reduce_scatter MPI_Reduce_scatter_block, allgather MPI_Allgather, broadcast MPI_Bcast,
// all_to_all MPI_Alltoallv (MPI_Alltoallw over absolute addresses when counts or offsets pass
// MPI's int), barrier MPI_Barrier. fp32 sums use MPI_SUM; fp16, bf16 and max/min use
// user-defined operators that combine in fp32 and round once per combine, like the ucx
// transport, so the result is the same on every rank. Calls above INT_MAX elements are cut in
// pieces.
//
// Non-blocking collectives run on a CollectiveQueue's thread when MPI gives
// MPI_THREAD_MULTIPLE; below it, start runs the collective at once on the caller's thread.
//
// Failures: argument errors are found before any MPI call and leave the instance usable; an
// MPI error marks it broken (later calls fail with FAILED_PRECONDITION). MPI collectives have
// no timeout: a dead rank ends the job through the MPI launcher (mpirun kills the job when a
// rank dies) or through loom_abort_job (MPI_Abort), not through this transport.
//
// Files: mpi_comm.hpp (declarations), runtime.cpp (MPI per process: loading, init, finalize,
// operators, errors), collectives.cpp (checks and the collectives), this file (creation,
// split, teardown, the entry point).
#include <loom/sdk.hpp>

#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "mpi_comm.hpp"

namespace loom::plugins::mpi {
namespace {

loom::sdk::CollectiveQueue::Mode queue_mode(const MpiProcess& p) {
  return p.thread_level >= MPI_THREAD_MULTIPLE ? loom::sdk::CollectiveQueue::Mode::background_thread
                                               : loom::sdk::CollectiveQueue::Mode::inline_calls;
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    default:
      return "MPI_THREAD_MULTIPLE";
  }
}

void free_comm(MPI_Comm& comm) noexcept {
  if (comm == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized == 0) MPI_Comm_free(&comm);  // local in practice; MPI frees it when all are done
  comm = MPI_COMM_NULL;
}

}  // namespace

MpiSplit::MpiSplit(MpiSplit&& o) noexcept
    : comm(std::exchange(o.comm, MPI_COMM_NULL)),
      rank(o.rank),
      size(o.size),
      world(std::move(o.world)) {}

MpiSplit::~MpiSplit() { free_comm(comm); }

// ------------------------------------------------------------------------------- creation

MpiComm::MpiComm(Context& ctx)
    : ctx_(ctx),
      process_(ensure_mpi(ctx)),
      rank_(ctx.rank()),
      size_(ctx.world_size()),
      queue_(queue_mode(process_)) {
  world_.resize(static_cast<std::size_t>(size_));
  std::iota(world_.begin(), world_.end(), 0);
  // MPI_Comm_dup waits for every rank; the bootstrap's barrier (which has a deadline,
  // LOOM_BOOTSTRAP_TIMEOUT) makes a rank that never creates its instance an error here
  // instead of a hang inside MPI.
  if (size_ > 1) ctx_.bootstrap_barrier();
  const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
  if (rc != MPI_SUCCESS) {
    comm_ = MPI_COMM_NULL;
    throw Error(mpi_error_code(rc),
                "mpi: MPI_Comm_dup(MPI_COMM_WORLD) failed: " + mpi_error_string(rc));
  }
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  if (rank_ == 0) {
    ctx_.debug("mpi: " + std::to_string(size_) + (size_ == 1 ? " rank" : " ranks") + " over " +
               (process_.library.empty() ? std::string("MPI") : process_.library) + ", " +
               thread_level_name(process_.thread_level) +
               (process_.we_initialised ? " (MPI initialised by this transport)" : ""));
    if (process_.thread_level < MPI_THREAD_MULTIPLE) {
      ctx_.warn(std::string("mpi: MPI provides ") + thread_level_name(process_.thread_level) +
                ", not MPI_THREAD_MULTIPLE (the program initialised MPI itself): a started "
                "collective runs at once on the caller's thread, and calls on this transport's "
                "instances and sub-communicators must not overlap in time" +
                (process_.thread_level < MPI_THREAD_SERIALIZED
                     ? std::string(" and must come from the thread that initialised MPI")
                     : std::string()));
    }
  }
}

MpiComm::MpiComm(Context& ctx, MpiSplit&& sub)
    : ctx_(ctx),
      process_(ensure_mpi(ctx)),
      rank_(sub.rank),
      size_(sub.size),
      root_(false),
      world_(std::move(sub.world)),
      comm_(std::exchange(sub.comm, MPI_COMM_NULL)),
      queue_(queue_mode(process_)) {}

MpiComm::~MpiComm() {
  queue_.stop();  // a started collective may still be running on the queue's thread
  free_comm(comm_);
}

std::string MpiComm::who(int r) const {
  std::string s = "rank " + std::to_string(r);
  if (!root_ && r >= 0 && r < size_) {
    s += " (world rank " + std::to_string(world_[static_cast<std::size_t>(r)]) + ")";
  }
  return s;
}

// ------------------------------------------------------------------------------- split

std::optional<MpiSplit> MpiComm::split(int32_t color, int32_t key) {
  usable();
  begin();
  MpiSplit sub;
  call(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub.comm), [&] {
    return "split(color " + std::to_string(color) + ", key " + std::to_string(key) + ")";
  });
  if (color < 0) return std::nullopt;  // MPI_COMM_NULL
  if (sub.comm == MPI_COMM_NULL) {
    throw Error(LOOM_ERR_INTERNAL,
                "mpi: MPI_Comm_split gave no communicator for color " + std::to_string(color));
  }
  MPI_Comm_set_errhandler(sub.comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(sub.comm, &sub.rank);
  MPI_Comm_size(sub.comm, &sub.size);
  // The group's ranks in this communicator, then in the world (for messages).
  MPI_Group mine = MPI_GROUP_NULL;
  MPI_Group parent = MPI_GROUP_NULL;
  MPI_Comm_group(sub.comm, &mine);
  MPI_Comm_group(comm_, &parent);
  std::vector<int> ranks(static_cast<std::size_t>(sub.size));
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<int> here(ranks.size(), MPI_UNDEFINED);
  MPI_Group_translate_ranks(mine, sub.size, ranks.data(), parent, here.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&parent);
  sub.world.resize(ranks.size());
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const int h = here[i];
    sub.world[i] = h >= 0 && h < size_ ? world_[static_cast<std::size_t>(h)] : -1;
  }
  return std::optional<MpiSplit>(std::move(sub));
}

}  // namespace loom::plugins::mpi

LOOM_PLUGIN("mpi", "1.0.0",
            "Collectives on host memory through the MPI library's own (MPI_Allreduce, ...)",
            loom::sdk::factory<loom::plugins::mpi::MpiComm>());
