// Test helpers: DLTensors over caller-owned buffers for the router tests.
#pragma once

#include <dlpack/dlpack.h>
#include <loom/kinds/router.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace routers_test {

// A DLTensor with its own shape and strides (strides empty: contiguous).
struct View {
  DLTensor t{};
  int64_t shape[3] = {0, 0, 0};
  int64_t strides[3] = {0, 0, 0};
  View() = default;
  View(void* data, std::vector<int64_t> dims, DLDataType dtype, std::vector<int64_t> st = {},
       DLDevice device = DLDevice{kDLCPU, 0}) {
    for (std::size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
    for (std::size_t i = 0; i < st.size(); ++i) strides[i] = st[i];
    t.data = data;
    t.device = device;
    t.ndim = static_cast<int32_t>(dims.size());
    t.dtype = dtype;
    t.shape = shape;
    t.strides = st.empty() ? nullptr : strides;
    t.byte_offset = 0;
  }
  View(const View& o) { *this = o; }
  View& operator=(const View& o) {
    if (this == &o) return *this;
    std::memcpy(shape, o.shape, sizeof(shape));
    std::memcpy(strides, o.strides, sizeof(strides));
    t = o.t;
    t.shape = shape;
    t.strides = o.t.strides == nullptr ? nullptr : strides;
    return *this;
  }
  DLTensor* get() { return &t; }
};

inline DLDataType uint_type(int bits) { return DLDataType{kDLUInt, static_cast<uint8_t>(bits), 1}; }
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kF64{kDLFloat, 64, 1};

// Random bytes.
inline std::vector<unsigned char> random_bytes(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> out(n);
  for (std::size_t i = 0; i < n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<std::size_t>(8, n - i));
  }
  return out;
}

// batch rows of `kept` strictly increasing positions in [0, seq_len) (a uniform subset).
inline std::vector<int32_t> random_rows(int64_t batch, int64_t seq_len, int64_t kept,
                                        uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out;
  out.reserve(static_cast<std::size_t>(batch * kept));
  for (int64_t b = 0; b < batch; ++b) {
    // Selection sampling (Knuth's algorithm S): increasing by construction.
    int64_t need = kept;
    for (int64_t p = 0; p < seq_len && need > 0; ++p) {
      const int64_t left = seq_len - p;
      if (static_cast<int64_t>(rng() % static_cast<uint64_t>(left)) < need) {
        out.push_back(static_cast<int32_t>(p));
        --need;
      }
    }
  }
  return out;
}

inline loom_router_move_args move_args(View& full, View& kept, View& idx, void* stream = nullptr) {
  loom_router_move_args a{};
  a.struct_size = LOOM_ROUTER_MOVE_ARGS_SIZE;
  a.full = full.get();
  a.kept = kept.get();
  a.indices = idx.get();
  a.stream = stream;
  return a;
}

}  // namespace routers_test

#include <loom/sdk/parallel.hpp>

#include <thread>

namespace routers_test {

// A pool of `threads` std::threads per call, registered with the SDK while it lives, so the
// kernels' parallel_for splits work as under a host (static split like the host's pool).
class TestPool {
 public:
  explicit TestPool(std::size_t threads) : threads_(threads) {
    loom::sdk::Pool p;
    p.parallel_for = &run;
    p.thread_count = &count;
    p.host_ctx = this;
    reg_ = loom::sdk::PoolRegistration(p);
  }

 private:
  static loom_status* run(void* ctx, std::size_t n, std::size_t grain, loom::sdk::ParallelBody body,
                          void* body_ctx) {
    auto* self = static_cast<TestPool*>(ctx);
    grain = grain == 0 ? 1 : grain;
    const std::size_t blocks = (n + grain - 1) / grain;
    const std::size_t parts = std::min(self->threads_, blocks);
    const std::size_t per = (blocks + parts - 1) / parts * grain;
    std::vector<std::thread> ts;
    for (std::size_t i = 1; i * per < n; ++i) {
      ts.emplace_back([=] { body(body_ctx, i * per, std::min(n, (i + 1) * per)); });
    }
    body(body_ctx, 0, std::min(n, per));
    for (auto& t : ts) t.join();
    return nullptr;
  }
  static std::size_t count(void* ctx) { return static_cast<TestPool*>(ctx)->threads_; }

  std::size_t threads_;
  loom::sdk::PoolRegistration reg_;
};

// Collects what a StateWriter writes.
struct Blob {
  std::vector<std::byte> bytes;
  loom_state_writer writer{};
  Blob() {
    writer.struct_size = LOOM_STATE_WRITER_SIZE;
    writer.ctx = this;
    writer.write = [](void* ctx, const void* data, std::size_t n) -> loom_status* {
      auto* self = static_cast<Blob*>(ctx);
      const auto* p = static_cast<const std::byte*>(data);
      self->bytes.insert(self->bytes.end(), p, p + n);
      return nullptr;
    };
  }
  Blob(const Blob&) = delete;
  Blob& operator=(const Blob&) = delete;
};

}  // namespace routers_test
