#include "bootstrap.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "status.hpp"
#include "tcp_bootstrap.hpp"

namespace loom::host {
namespace {

loom_status* single_allgather(void* /*ctx*/, const void* send, size_t bytes, void* recv) noexcept {
  if (bytes > 0 && (send == nullptr || recv == nullptr)) {
    return make_status(LOOM_ERR_INVALID_ARGUMENT, "bootstrap allgather: NULL buffer");
  }
  if (bytes > 0) std::memmove(recv, send, bytes);
  return nullptr;
}

loom_status* single_barrier(void* /*ctx*/) noexcept { return nullptr; }

// OpenMPI's C API, reached through dlsym so libloom has no link-time MPI dependency.
// Handles are pointers to OpenMPI's predefined objects (its mpi.h does the same).
struct Mpi {
  using Comm = void*;
  using Datatype = void*;
  using Request = void*;
  int (*initialized)(int*) = nullptr;
  int (*finalized)(int*) = nullptr;
  int (*init_thread)(int*, char***, int, int*) = nullptr;
  int (*finalize)() = nullptr;
  int (*abort)(void*, int) = nullptr;
  int (*comm_rank)(Comm, int*) = nullptr;
  int (*comm_size)(Comm, int*) = nullptr;
  int (*iallgather)(const void*, int, Datatype, void*, int, Datatype, Comm, Request*) = nullptr;
  int (*ibarrier)(Comm, Request*) = nullptr;
  int (*test)(Request*, int*, void*) = nullptr;
  int (*cancel)(Request*) = nullptr;
  Comm world = nullptr;
  Datatype byte = nullptr;
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  double timeout_s = 300;
  bool we_initialized = false;
  loom_bootstrap table{};
};

Mpi& mpi() {
  static auto* m = new Mpi();  // lives until exit: instances may use it from atexit paths
  return *m;
}

// Waits for a non-blocking MPI request, up to the configured timeout, so a rank that died
// or never started turns into an error instead of a hang.
loom_status* wait_request(Mpi& m, Mpi::Request* req, const char* what) {
  if (m.test == nullptr) return make_status(LOOM_ERR_INTERNAL, "MPI is not initialised");
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(m.timeout_s);
  auto sleep = std::chrono::microseconds(1);
  for (;;) {
    int done = 0;
    if (m.test(req, &done, nullptr) != 0) {
      return make_status(LOOM_ERR_UNAVAILABLE, (std::string("MPI bootstrap ") + what +
                                                " failed on rank " + std::to_string(m.rank))
                                                   .c_str());
    }
    if (done != 0) return nullptr;
    if (std::chrono::steady_clock::now() > deadline) {
      return make_status(
          LOOM_ERR_DEADLINE_EXCEEDED,
          (std::string("MPI bootstrap ") + what + ": rank " + std::to_string(m.rank) + " of " +
           std::to_string(m.size) + " waited " + std::to_string(static_cast<int>(m.timeout_s)) +
           " s for the other ranks (did one die or never start? LOOM_BOOTSTRAP_TIMEOUT sets "
           "the limit in seconds)")
              .c_str());
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(2000));
  }
}

loom_status* mpi_allgather(void* /*ctx*/, const void* send, size_t bytes, void* recv) noexcept {
  Mpi& m = mpi();
  if (m.iallgather == nullptr) return make_status(LOOM_ERR_INTERNAL, "MPI is not initialised");
  if (bytes > static_cast<size_t>(INT32_MAX)) {
    return make_status(LOOM_ERR_OUT_OF_RANGE, "bootstrap allgather: more than 2 GiB per rank");
  }
  Mpi::Request req = nullptr;
  const int n = static_cast<int>(bytes);
  if (m.iallgather(send, n, m.byte, recv, n, m.byte, m.world, &req) != 0) {
    return make_status(LOOM_ERR_UNAVAILABLE, "MPI_Iallgather failed");
  }
  return wait_request(m, &req, "allgather");
}

loom_status* mpi_barrier(void* /*ctx*/) noexcept {
  Mpi& m = mpi();
  if (m.ibarrier == nullptr) return make_status(LOOM_ERR_INTERNAL, "MPI is not initialised");
  Mpi::Request req = nullptr;
  if (m.ibarrier(m.world, &req) != 0)
    return make_status(LOOM_ERR_UNAVAILABLE, "MPI_Ibarrier failed");
  return wait_request(m, &req, "barrier");
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(v, &end, 10);
  return end != v && *end == '\0' && parsed >= 0 && parsed <= INT32_MAX ? static_cast<int>(parsed)
                                                                        : fallback;
}

// MPI_Finalize waits for every rank; a stopped or hung one would hold this process forever.
// A watchdog ends it after the bootstrap timeout instead (status 1: the job did not end
// cleanly), saying why.
void finalize_at_exit() {
  int done = 0;
  Mpi& m = mpi();
  if (m.finalized != nullptr) m.finalized(&done);
  if (done != 0 || m.finalize == nullptr) return;
  const double limit_s = m.timeout_s;
  const int rank = m.rank;
  std::thread([limit_s, rank] {
    std::this_thread::sleep_for(std::chrono::duration<double>(limit_s));
    const std::string text = "loom: rank " + std::to_string(rank) + ": MPI_Finalize waited " +
                             std::to_string(static_cast<int>(limit_s)) +
                             " s for the other ranks (one stopped or hung?); exiting without it\n";
    (void)!::write(STDERR_FILENO, text.data(), text.size());
    ::_exit(1);
  }).detach();
  m.finalize();
}

const loom_bootstrap* init_mpi() {
  Mpi& m = mpi();
  const char* names[] = {"libmpi.so.40", "libmpi.so"};
  void* lib = nullptr;
  std::string why;
  for (const char* n : names) {
    lib = ::dlopen(n, RTLD_NOW | RTLD_GLOBAL);  // GLOBAL: OpenMPI's own components need it
    if (lib != nullptr) break;
    if (const char* e = ::dlerror()) why = e;
  }
  if (lib == nullptr) {
    throw Error(LOOM_ERR_UNAVAILABLE,
                "this process was launched by an MPI launcher, but libmpi could not be loaded (" +
                    why + "); install openmpi-bin, or set LOOM_BOOTSTRAP=single");
  }
  auto sym = [&](const char* name) {
    void* p = ::dlsym(lib, name);
    if (p == nullptr) throw Error(LOOM_ERR_UNAVAILABLE, std::string("libmpi lacks ") + name);
    return p;
  };
  // NOLINTBEGIN(cppcoreguidelines-pro-type-reinterpret-cast)
  m.initialized = reinterpret_cast<int (*)(int*)>(sym("MPI_Initialized"));
  m.finalized = reinterpret_cast<int (*)(int*)>(sym("MPI_Finalized"));
  m.init_thread = reinterpret_cast<int (*)(int*, char***, int, int*)>(sym("MPI_Init_thread"));
  m.finalize = reinterpret_cast<int (*)()>(sym("MPI_Finalize"));
  m.abort = reinterpret_cast<int (*)(Mpi::Comm, int)>(sym("MPI_Abort"));
  m.comm_rank = reinterpret_cast<int (*)(Mpi::Comm, int*)>(sym("MPI_Comm_rank"));
  m.comm_size = reinterpret_cast<int (*)(Mpi::Comm, int*)>(sym("MPI_Comm_size"));
  m.iallgather =
      reinterpret_cast<int (*)(const void*, int, Mpi::Datatype, void*, int, Mpi::Datatype,
                               Mpi::Comm, Mpi::Request*)>(sym("MPI_Iallgather"));
  m.ibarrier = reinterpret_cast<int (*)(Mpi::Comm, Mpi::Request*)>(sym("MPI_Ibarrier"));
  m.test = reinterpret_cast<int (*)(Mpi::Request*, int*, void*)>(sym("MPI_Test"));
  // NOLINTEND(cppcoreguidelines-pro-type-reinterpret-cast)
  m.world = sym("ompi_mpi_comm_world");
  m.byte = sym("ompi_mpi_byte");
  int already = 0;
  m.initialized(&already);
  if (already == 0) {
    int provided = 0;
    // MPI_THREAD_MULTIPLE, whatever MPI then provides: the bootstrap itself needs only
    // SERIALIZED ([process]: one call at a time, from whichever thread opens a session), but
    // the mpi transport (plugins/comm/mpi) runs started collectives on a thread of its own
    // while this thread goes on, and falls back to running them at once below MULTIPLE.
    constexpr int kThreadMultiple = 3;
    if (m.init_thread(nullptr, nullptr, kThreadMultiple, &provided) != 0) {
      throw Error(LOOM_ERR_UNAVAILABLE, "MPI_Init_thread failed");
    }
    m.we_initialized = true;
    std::atexit(finalize_at_exit);
  }
  m.comm_rank(m.world, &m.rank);
  m.comm_size(m.world, &m.size);
  m.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", env_int("SLURM_LOCALID", 0));
  m.timeout_s = bootstrap_timeout_s();
  m.table = loom_bootstrap{LOOM_BOOTSTRAP_SIZE, m.rank,     m.size, m.local_rank, nullptr,
                           mpi_allgather,       mpi_barrier};
  return &m.table;
}

}  // namespace

double bootstrap_timeout_s() {
  const char* v = std::getenv("LOOM_BOOTSTRAP_TIMEOUT");
  if (v == nullptr || *v == '\0') return 300;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(t > 0) || t > 1e7) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string("LOOM_BOOTSTRAP_TIMEOUT='") + v +
                                               "' is not a number of seconds above 0");
  }
  return t;
}

const loom_bootstrap* single_process_bootstrap() {
  static const loom_bootstrap b{LOOM_BOOTSTRAP_SIZE, 0, 1, 0, nullptr, single_allgather,
                                single_barrier};
  return &b;
}

namespace {
// Which bootstrap default_bootstrap chose, for abort_job (none: not asked yet).
enum class Chosen { kNone, kMpi, kEnv, kSingle };
std::atomic<Chosen> g_chosen{Chosen::kNone};

}  // namespace

const loom_bootstrap* default_bootstrap(std::string* how) {
  static std::mutex mu;
  static const loom_bootstrap* chosen = nullptr;
  static std::string chosen_how;
  const std::lock_guard<std::mutex> lock(mu);
  if (chosen == nullptr) {
    const char* force = std::getenv("LOOM_BOOTSTRAP");
    const std::string mode = force != nullptr ? force : "";
    const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
                          std::getenv("PMIX_RANK") != nullptr || std::getenv("PMI_RANK") != nullptr;
    if (!mode.empty() && mode != "mpi" && mode != "env" && mode != "single") {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "LOOM_BOOTSTRAP='" + mode + "' is not one of mpi, env, single");
    }
    if (mode == "mpi" || (mode.empty() && launched)) {
      chosen = init_mpi();
      g_chosen = Chosen::kMpi;
      chosen_how =
          "MPI: rank " + std::to_string(chosen->rank) + " of " + std::to_string(chosen->size);
    } else if (mode == "env" || (mode.empty() && env_launch_requested())) {
      chosen = init_env_bootstrap(bootstrap_timeout_s(), &chosen_how);
      g_chosen = Chosen::kEnv;
    } else {
      chosen = single_process_bootstrap();
      chosen_how = "a world of one";
      g_chosen = Chosen::kSingle;
    }
  }
  if (how != nullptr) *how = chosen_how;
  return chosen;
}

void abort_job(int status) {
  std::fflush(nullptr);
  switch (g_chosen.load()) {
    case Chosen::kMpi:
      // The launcher ends every rank (a stopped one too); MPI_Abort does not return.
      if (mpi().abort != nullptr) mpi().abort(mpi().world, status);
      break;
    case Chosen::kEnv:
      end_same_host_ranks();
      break;
    default:
      break;
  }
  ::_exit(status);
}

}  // namespace loom::host
