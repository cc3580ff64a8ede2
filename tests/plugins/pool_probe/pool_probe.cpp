// pool_probe: a test-only loom.optimizer/1 built with the SDK whose step shows from outside
// which threads loom::sdk::parallel_for ran on (tests/host/pool_test.cpp). step() ignores the
// gradients and writes into its first group's tensors (fp32, CPU):
//   tensor 0: element i = the Linux thread id (gettid) of the thread that ran index i;
//   tensor 1 (optional, >= 3 elements): [0] loom::sdk::thread_count(); [1] 1 when a
//   parallel_for nested in every block of an outer one ran inline (one block (0, m) on the
//   block's own thread), else 0; [2] 1 when an exception thrown in a block reached the
//   caller of parallel_for, else 0.
// Thread ids are below 2^22 (the kernel's PID_MAX_LIMIT), so a float holds them exactly.
#include <unistd.h>
#include <loom/sdk/kinds/optimizer.hpp>
#include <loom/sdk/parallel.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace {

using loom::sdk::Error;

float* floats(const DLTensor* t, std::size_t* n) {
  if (t == nullptr || t->data == nullptr || t->dtype.code != kDLFloat || t->dtype.bits != 32 ||
      t->device.device_type != kDLCPU) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "pool_probe: tensors must be fp32 on the CPU");
  }
  std::size_t count = 1;
  for (int32_t d = 0; d < t->ndim; ++d) count *= static_cast<std::size_t>(t->shape[d]);
  *n = count;
  return reinterpret_cast<float*>(static_cast<char*>(t->data) + t->byte_offset);  // NOLINT
}

class PoolProbe : public loom::sdk::Optimizer {
 public:
  explicit PoolProbe(loom::sdk::Context& /*ctx*/) {}

  void step(const loom_optimizer_step_args& args) {
    if (args.groups == nullptr || args.group_count < 1 || args.groups[0].tensors == nullptr ||
        args.groups[0].tensor_count < 1) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT, "pool_probe: step needs a group with a tensor");
    }
    const loom_optimizer_group& g = args.groups[0];
    std::size_t n = 0;
    float* ids = floats(g.tensors[0].param, &n);
    loom::sdk::parallel_for(n, 1, [&](std::size_t b, std::size_t e) {
      const auto me = static_cast<float>(gettid());
      for (std::size_t i = b; i < e; ++i) ids[i] = me;
    });
    if (g.tensor_count < 2) return;
    std::size_t m = 0;
    float* out = floats(g.tensors[1].param, &m);
    if (m < 3) throw Error(LOOM_ERR_INVALID_ARGUMENT, "pool_probe: tensor 1 needs 3 elements");
    out[0] = static_cast<float>(loom::sdk::thread_count());

    std::atomic<int> wrong{0};
    loom::sdk::parallel_for(8, 1, [&](std::size_t /*b*/, std::size_t /*e*/) {
      const pid_t me = gettid();
      int calls = 0;
      loom::sdk::parallel_for(64, 1, [&](std::size_t nb, std::size_t ne) {
        ++calls;
        if (gettid() != me || nb != 0 || ne != 64) wrong.fetch_add(1);
      });
      if (calls != 1) wrong.fetch_add(1);
    });
    out[1] = wrong.load() == 0 ? 1.0F : 0.0F;

    out[2] = 0.0F;
    try {
      loom::sdk::parallel_for(8, 1, [&](std::size_t b, std::size_t e) {
        if (b <= 5 && 5 < e) throw std::runtime_error("block with index 5");
      });
    } catch (const std::runtime_error& e) {
      out[2] = std::string(e.what()) == "block with index 5" ? 1.0F : 0.0F;
    }
  }
};

}  // namespace

LOOM_PLUGIN("pool_probe", "1.0.0", "shows which threads parallel_for ran on (tests)",
            loom::sdk::factory<PoolProbe>());
