// The nccl transport through the embedding API. Without a CUDA device, creating it must fail
// with UNAVAILABLE ("no CUDA device") and the device tests skip; with one, a world of one
// runs every collective on device memory and checks the results and counters.
#include <cuda_runtime.h>
#include <loom/embed.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

bool have_gpu() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e == cudaSuccess && n > 0;
}

struct Session {
  Session() {
    rc =
        loom_open_string("[comm.gpu]\nplugin = \"nccl\"\ntimeout_s = 60.0\n", nullptr, nullptr, &s);
    if (rc != LOOM_OK) {
      error = loom_last_error();
      return;
    }
    rc = loom_find_instance(s, "comm", "gpu", &inst);
    if (rc != LOOM_OK) return;
    obj = loom_instance_object(inst);
    vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(inst));
  }
  ~Session() { loom_close(s); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  loom_session* s = nullptr;
  loom_instance* inst = nullptr;
  int32_t rc = LOOM_OK;
  std::string error;
  void* obj = nullptr;
  const loom_comm_v1* vt = nullptr;
};

int32_t code_of(loom_status* st) {
  const int32_t c = st == nullptr ? LOOM_OK : st->code;
  if (st != nullptr) st->destroy(st);
  return c;
}

TEST(Nccl, WithoutAGpuCreationFailsClearly) {
  if (have_gpu()) GTEST_SKIP() << "a CUDA device is present";
  Session s;
  EXPECT_EQ(s.rc, LOOM_ERR_UNAVAILABLE);
  EXPECT_NE(s.error.find("no CUDA device"), std::string::npos) << s.error;
}

TEST(Nccl, CollectivesOnOneGpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Session s;
  ASSERT_EQ(s.rc, LOOM_OK) << s.error;
  ASSERT_EQ(s.vt->size(s.obj), 1);
  EXPECT_EQ(s.vt->supports_device(s.obj, DLDevice{kDLCUDA, 0}), 1);
  EXPECT_EQ(s.vt->supports_device(s.obj, DLDevice{kDLCPU, 0}), 0);
  const char* kind = nullptr;
  void* handle = nullptr;
  ASSERT_EQ(code_of(s.vt->native_handle(s.obj, &kind, &handle)), LOOM_OK);
  EXPECT_STREQ(kind, "nccl");
  EXPECT_NE(handle, nullptr);

  const int64_t n = 1000003;
  std::vector<float> host(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) host[static_cast<std::size_t>(i)] = static_cast<float>(i % 13);
  float* a = nullptr;
  float* b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, n * sizeof(float)), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  int64_t shape = n;
  DLTensor ta{a, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  DLTensor tb{b, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};

  loom_allreduce_args ar{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, &ta, &tb, stream};
  ASSERT_EQ(code_of(s.vt->allreduce(s.obj, &ar)), LOOM_OK);
  loom_allgather_args ag{LOOM_ALLGATHER_ARGS_SIZE, 0, &tb, &ta, stream};
  ASSERT_EQ(code_of(s.vt->allgather(s.obj, &ag)), LOOM_OK);
  loom_broadcast_args bc{LOOM_BROADCAST_ARGS_SIZE, 0, &ta, stream};
  ASSERT_EQ(code_of(s.vt->broadcast(s.obj, &bc)), LOOM_OK);
  loom_all_to_all_args aa{LOOM_ALL_TO_ALL_ARGS_SIZE, 0, &ta, &tb, nullptr, nullptr, stream};
  ASSERT_EQ(code_of(s.vt->all_to_all(s.obj, &aa)), LOOM_OK);
  ASSERT_EQ(code_of(s.vt->barrier(s.obj, stream)), LOOM_OK);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> back(static_cast<std::size_t>(n));
  ASSERT_EQ(cudaMemcpy(back.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(back.data(), host.data(), n * sizeof(float)), 0);

  // Host memory is refused with a clear code.
  DLTensor th{host.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  loom_allreduce_args bad{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &th, stream};
  EXPECT_EQ(code_of(s.vt->allreduce(s.obj, &bad)), LOOM_ERR_UNIMPLEMENTED);

  loom_comm_stats st{};
  st.struct_size = LOOM_COMM_STATS_SIZE;
  ASSERT_EQ(code_of(s.vt->stats(s.obj, &st)), LOOM_OK);
  EXPECT_EQ(st.rounds, 5U);
  EXPECT_EQ(st.bytes_sent, 0U);  // a world of one moves nothing over the wire
  cudaStreamDestroy(stream);
  cudaFree(a);
  cudaFree(b);
}

// ncclCommSplit on a world of one: color 0 gives a one-rank child with its own ncclComm_t that
// runs collectives; a negative color gives NULL; the parent still works. (Not run where
// there is no GPU: NCCL needs a device, and the CUDA emulation does not build it.)
TEST(Nccl, SplitOnOneGpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Session s;
  ASSERT_EQ(s.rc, LOOM_OK) << s.error;
  ASSERT_NE(s.vt->split, nullptr);
  ASSERT_NE(s.vt->native_handle2, nullptr);
  loom_instance* sub = nullptr;
  ASSERT_EQ(loom_comm_split(s.inst, 0, 0, &sub), LOOM_OK) << loom_last_error();
  ASSERT_NE(sub, nullptr);
  void* child = loom_instance_object(sub);
  EXPECT_EQ(s.vt->size(child), 1);
  EXPECT_EQ(s.vt->rank(child), 0);
  loom_comm_native_handle_args nh{LOOM_COMM_NATIVE_HANDLE_ARGS_SIZE, 0, nullptr, nullptr};
  ASSERT_EQ(code_of(s.vt->native_handle2(child, &nh)), LOOM_OK);
  EXPECT_STREQ(nh.kind, "nccl");
  const char* kind = nullptr;
  void* parent_handle = nullptr;
  ASSERT_EQ(code_of(s.vt->native_handle(s.obj, &kind, &parent_handle)), LOOM_OK);
  EXPECT_NE(nh.handle, nullptr);
  EXPECT_NE(nh.handle, parent_handle);  // its own communicator

  const int64_t n = 4099;
  std::vector<float> host(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) host[static_cast<std::size_t>(i)] = static_cast<float>(i % 7);
  float* a = nullptr;
  ASSERT_EQ(cudaMalloc(&a, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  int64_t shape = n;
  DLTensor ta{a, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  for (void* obj : {child, s.obj}) {
    loom_allreduce_args ar{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &ta, nullptr};
    ASSERT_EQ(code_of(s.vt->allreduce(obj, &ar)), LOOM_OK);
    loom_comm_barrier_args b{LOOM_COMM_BARRIER_ARGS_SIZE, 0, nullptr};
    ASSERT_EQ(code_of(s.vt->barrier2(obj, &b)), LOOM_OK);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> back(static_cast<std::size_t>(n));
  ASSERT_EQ(cudaMemcpy(back.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(back.data(), host.data(), n * sizeof(float)), 0);  // a sum of one
  loom_comm_device_args d{LOOM_COMM_DEVICE_ARGS_SIZE, 0, DLDevice{kDLCUDA, 0}, 0};
  ASSERT_EQ(code_of(s.vt->supports_device2(child, &d)), LOOM_OK);
  EXPECT_EQ(d.supported, 1);

  loom_instance* none = sub;
  ASSERT_EQ(loom_comm_split(s.inst, LOOM_COMM_SPLIT_NONE, 0, &none), LOOM_OK) << loom_last_error();
  EXPECT_EQ(none, nullptr);
  EXPECT_EQ(loom_comm_destroy_split(sub), LOOM_OK) << loom_last_error();
  cudaFree(a);
}

}  // namespace
