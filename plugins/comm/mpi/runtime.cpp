// The mpi transport's process-wide part: making libmpi's symbols global, initialising MPI when
// nobody has (and finalising it at exit then), checking that MPI_COMM_WORLD is the job the
// host's bootstrap describes, the user-defined reduction operators for fp16, bf16 and the
// fp32 max/min, and MPI error messages.
#include <dlfcn.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "mpi_comm.hpp"

namespace loom::plugins::mpi {
namespace {

// Guards MpiProcess and the operators. Never destroyed: instances may outlive static
// destruction (a session left open at exit).
std::mutex& process_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
MpiProcess*& process_state() {
  static MpiProcess* p = nullptr;
  return p;
}

// ---- the operators: MPI_User_function over reduce_ops (inout = in (op) inout; every
// combine here is symmetric, so the order does not matter and every rank gets the same bits)

template <Dtype dt, Op op>
void combine(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  reduce_ops::reduce_typed<op>(dt, inout, in, static_cast<std::size_t>(*len));
}

constexpr int kDtypes = 3;
constexpr int kOps = 3;
std::array<MPI_Op, kDtypes * kOps> g_ops{};  // [dtype * kOps + op], filled under the mutex

MPI_User_function* combine_fn(Dtype dt, Op op) {
  switch (dt) {
    case Dtype::kF32:
      return op == Op::kSum   ? &combine<Dtype::kF32, Op::kSum>
             : op == Op::kMax ? &combine<Dtype::kF32, Op::kMax>
                              : &combine<Dtype::kF32, Op::kMin>;
    case Dtype::kF16:
      return op == Op::kSum   ? &combine<Dtype::kF16, Op::kSum>
             : op == Op::kMax ? &combine<Dtype::kF16, Op::kMax>
                              : &combine<Dtype::kF16, Op::kMin>;
    case Dtype::kBF16:
      break;
  }
  return op == Op::kSum   ? &combine<Dtype::kBF16, Op::kSum>
         : op == Op::kMax ? &combine<Dtype::kBF16, Op::kMax>
                          : &combine<Dtype::kBF16, Op::kMin>;
}

void create_ops() {
  for (int d = 0; d < kDtypes; ++d) {
    for (int o = 0; o < kOps; ++o) {
      MPI_Op& slot = g_ops[static_cast<std::size_t>(d * kOps + o)];
      const int rc = MPI_Op_create(combine_fn(static_cast<Dtype>(d), static_cast<Op>(o)), 1, &slot);
      if (rc != MPI_SUCCESS) {
        throw Error(mpi_error_code(rc), "mpi: MPI_Op_create failed: " + mpi_error_string(rc));
      }
    }
  }
}

// ---- launching

// The variables the MPI launchers set (the host's bootstrap looks for the same ones).
bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
         std::getenv("PMI_RANK") != nullptr;
}

// Open MPI opens its components (mca_*.so) itself; built without --disable-dlopen they
// resolve libmpi's symbols from the global scope, which a library loaded with this plugin
// (RTLD_LOCAL, as the host loads plugins) is not in. Promotes the loaded libmpi (and its
// dependencies) to RTLD_GLOBAL; a no-op where the host already opened it so. The handle is
// kept: libmpi stays loaded for the life of the process.
void make_libmpi_global() {
  Dl_info info{};
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-reinterpret-cast)
  if (::dladdr(reinterpret_cast<void*>(&MPI_Init_thread), &info) == 0 ||
      info.dli_fname == nullptr) {
    throw Error(LOOM_ERR_UNAVAILABLE, "mpi: cannot find the libmpi this plugin was loaded with");
  }
  void* h = ::dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
  if (h == nullptr) h = ::dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) {
    const char* e = ::dlerror();
    throw Error(LOOM_ERR_UNAVAILABLE, std::string("mpi: cannot make ") + info.dli_fname +
                                          "'s symbols global: " + (e != nullptr ? e : "?"));
  }
}

int64_t count_limit_from_env() {
  const char* v = std::getenv("LOOM_MPI_COUNT_LIMIT");
  if (v == nullptr || *v == '\0') return INT32_MAX;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || n < 1 || n > INT32_MAX) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, std::string("LOOM_MPI_COUNT_LIMIT='") + v +
                                               "' is not a count of elements in 1..2147483647");
  }
  return n;
}

double finalize_limit_s() {
  const char* v = std::getenv("LOOM_BOOTSTRAP_TIMEOUT");
  if (v == nullptr || *v == '\0') return 300;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  return end != v && *end == '\0' && t > 0 && t <= 1e7 ? t : 300;
}

// At exit, when this plugin initialised MPI. MPI_Finalize waits for every rank; a watchdog
// ends the process after LOOM_BOOTSTRAP_TIMEOUT instead of letting a stopped rank hold it (as
// the host's own exit handler does).
void finalize_at_exit() {
  int done = 0;
  MPI_Finalized(&done);
  if (done != 0) return;
  const double limit_s = finalize_limit_s();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::thread([limit_s, rank] {
    std::this_thread::sleep_for(std::chrono::duration<double>(limit_s));
    const std::string text = "loom: mpi transport, rank " + std::to_string(rank) +
                             ": MPI_Finalize waited " + std::to_string(static_cast<int>(limit_s)) +
                             " s for the other ranks (one stopped or hung?); exiting without it\n";
    (void)!::write(STDERR_FILENO, text.data(), text.size());
    ::_exit(1);
  }).detach();
  MPI_Finalize();
}

// "Open MPI v4.1.4" out of its version text's first line.
std::string library_name(const char* s) {
  std::string out(s);
  const auto end = out.find_first_of(",\n");
  if (end != std::string::npos) out.resize(end);
  while (!out.empty() && (out.back() == ' ' || out.back() == ',')) out.pop_back();
  return out;
}

}  // namespace

const MpiProcess& ensure_mpi(const Context& ctx) {
  const std::lock_guard lock(process_mutex());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION,
                "mpi: MPI was already finalised in this process, and MPI cannot be started twice");
  }
  const int rank = ctx.rank();
  const int size = ctx.world_size();
  const bool mpi_launch = launched_by_mpi();
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised == 0 && size > 1 && !mpi_launch) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION,
                "mpi: this process is rank " + std::to_string(rank) + " of " +
                    std::to_string(size) +
                    " started by a launcher that is not MPI's (RANK/WORLD_SIZE, e.g. torchrun or "
                    "a shell loop; none of OMPI_COMM_WORLD_SIZE, PMIX_RANK, PMI_RANK is set), and "
                    "MPI can only join ranks that its own launcher started: the mpi transport "
                    "needs mpirun or srun --mpi=pmix. Launch the job with one of them, or use the "
                    "ucx transport under this launcher");
  }
  if (process_state() == nullptr) {
    const int64_t count_limit = count_limit_from_env();
    make_libmpi_global();
    auto* p = new MpiProcess();  // never freed: see process_mutex()
    p->count_limit = count_limit;
    if (initialised == 0) {
      int provided = MPI_THREAD_SINGLE;
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) {
        delete p;
        throw Error(LOOM_ERR_UNAVAILABLE,
                    "mpi: MPI_Init_thread failed (" + std::to_string(rc) + ")");
      }
      p->we_initialised = true;
      std::atexit(finalize_at_exit);
    }
    MPI_Query_thread(&p->thread_level);
    char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int len = 0;
    if (MPI_Get_library_version(version, &len) == MPI_SUCCESS) p->library = library_name(version);
    try {
      create_ops();
    } catch (...) {
      delete p;
      throw;
    }
    process_state() = p;
  }
  int world_rank = 0;
  int world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  if (world_rank != rank || world_size != size) {
    std::string why = "mpi: MPI_COMM_WORLD has " + std::to_string(world_size) +
                      " ranks and this is its rank " + std::to_string(world_rank) +
                      ", but the session's bootstrap says rank " + std::to_string(rank) + " of " +
                      std::to_string(size) + ": the mpi transport runs on MPI_COMM_WORLD, so ";
    why += mpi_launch ? "the bootstrap must be MPI's (under mpirun or srun, leave LOOM_BOOTSTRAP "
                        "unset or set it to mpi) or one that agrees with it"
                      : "the job must be started by mpirun or srun --mpi=pmix (under another "
                        "launcher, use the ucx transport)";
    throw Error(LOOM_ERR_FAILED_PRECONDITION, why);
  }
  return *process_state();
}

MPI_Op user_op(Dtype dt, Op op) {
  return g_ops[static_cast<std::size_t>(static_cast<int>(dt) * kOps + static_cast<int>(op))];
}

std::string mpi_error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) {
    return "MPI error " + std::to_string(rc);
  }
  int cls = rc;
  MPI_Error_class(rc, &cls);
  return std::string(text, static_cast<std::size_t>(len)) + " (MPI error class " +
         std::to_string(cls) + ")";
}

loom_code mpi_error_code(int rc) {
  int cls = rc;
  if (MPI_Error_class(rc, &cls) != MPI_SUCCESS) return LOOM_ERR_UNAVAILABLE;
  switch (cls) {
    case MPI_ERR_TRUNCATE:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_OP:
    case MPI_ERR_ARG:
    case MPI_ERR_BUFFER:
    case MPI_ERR_ROOT:
    case MPI_ERR_RANK:
      return LOOM_ERR_INVALID_ARGUMENT;
    case MPI_ERR_NO_MEM:
      return LOOM_ERR_RESOURCE_EXHAUSTED;
    case MPI_ERR_INTERN:
      return LOOM_ERR_INTERNAL;
    default:
      return LOOM_ERR_UNAVAILABLE;
  }
}

void Datatype::reset() noexcept {
  if (!owned_) return;
  owned_ = false;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized == 0) MPI_Type_free(&t_);
  t_ = MPI_DATATYPE_NULL;
}

}  // namespace loom::plugins::mpi
