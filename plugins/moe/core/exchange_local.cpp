// The Exchange without a transport: one rank per expert-parallel group (ep_size 1). Every
// move is a copy in the same layout (one source rank), sum_ep / max_ep are the identity, and
// reduce_gradients is the identity for a world of one rank. The build uses it only while
// exchange.cpp (the comm-backed implementation) is absent.
#include "exchange.hpp"

#include <cstring>
#include <stdexcept>
#include <string>

#if LOOM_MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace loom::moe {

struct Exchange::Impl {
  int world_size = 1;
  int world_rank = 0;
};

Exchange::Exchange(const loom_comm_v1* vt, void* comm, int ep_size) : impl_(new Impl) {
  if (ep_size != 1) {
    throw std::invalid_argument("moe: ep_size " + std::to_string(ep_size) +
                                " needs expert parallelism, which this build lacks");
  }
  if (vt != nullptr && comm != nullptr && vt->size != nullptr && vt->rank != nullptr) {
    impl_->world_size = vt->size(comm);
    impl_->world_rank = vt->rank(comm);
  }
}

Exchange::~Exchange() = default;

int Exchange::ep_size() const { return 1; }
int Exchange::ep_rank() const { return 0; }
int Exchange::world_size() const { return impl_->world_size; }
int Exchange::world_rank() const { return impl_->world_rank; }

Exchange::Plan Exchange::plan(const int64_t* send_counts, int num_experts) {
  Plan p;
  p.num_experts = num_experts;
  p.local_experts = num_experts;
  p.ep = 1;
  p.send_counts.assign(send_counts, send_counts + num_experts);
  p.recv_counts = p.send_counts;
  for (int64_t c : p.send_counts) p.recv_rows += c;
  return p;
}

namespace {
void copy_rows(const void* src, void* dst, int64_t bytes, DLDevice device, void* stream) {
  if (bytes <= 0 || src == dst) return;
  if (device.device_type == kDLCPU) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return;
  }
#if LOOM_MOE_HAVE_CUDA
  if (device.device_type == kDLCUDA) {
    if (cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                        static_cast<cudaStream_t>(stream)) != cudaSuccess) {
      throw std::runtime_error("moe: exchange copy on the device failed");
    }
    return;
  }
#else
  (void)stream;
#endif
  throw std::invalid_argument("moe: exchange: unsupported device type " +
                              std::to_string(static_cast<int>(device.device_type)));
}
}  // namespace

void Exchange::forward(const Plan& p, const void* send, void* recv, int64_t row_bytes,
                       DLDevice device, void* stream) {
  copy_rows(send, recv, p.recv_rows * row_bytes, device, stream);
}

void Exchange::reverse(const Plan& p, const void* recv_layout, void* send_layout, int64_t row_bytes,
                       DLDevice device, void* stream) {
  copy_rows(recv_layout, send_layout, p.recv_rows * row_bytes, device, stream);
}

void Exchange::reduce_gradients(DLTensor* const* tensors, int64_t count, void* stream) {
  (void)tensors;
  (void)count;
  (void)stream;
  if (impl_->world_size != 1) {
    throw std::runtime_error("moe: reduce_gradients over " + std::to_string(impl_->world_size) +
                             " ranks needs the comm-backed exchange, which this build lacks");
  }
}

void Exchange::sum_ep(int64_t* v, int64_t n) {
  (void)v;
  (void)n;
}

int64_t Exchange::max_ep(int64_t v) { return v; }

}  // namespace loom::moe
