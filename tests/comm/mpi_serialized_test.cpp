// The mpi transport in a program that initialised MPI itself below MPI_THREAD_MULTIPLE
// (MPI_THREAD_SERIALIZED): the host reuses that MPI, and the transport runs a started
// collective at once on the caller's thread (its request is finished when start returns),
// with the same results as the blocking calls. Run under mpirun (comm.mpi.np2.serialized) or
// alone.
#include <loom/embed.h>
#include <mpi.h>
#include <loom/sdk/comm.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

float value(int rank, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 3) % 11) -
                            5);
}

TEST(MpiSerialized, StartedCollectivesRunAtOnceOnTheCallersThread) {
  int level = MPI_THREAD_MULTIPLE;
  MPI_Query_thread(&level);
  ASSERT_LT(level, MPI_THREAD_MULTIPLE);
  loom_session* s = nullptr;
  ASSERT_EQ(loom_open_string("[comm.world]\nplugin = \"mpi\"\n", nullptr, nullptr, &s), LOOM_OK)
      << loom_last_error();
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(s, "comm", "world", &inst), LOOM_OK);
  const auto* vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(inst));
  const loom::sdk::InstanceRef<loom_comm_v1> comm("world", loom_instance_object(inst), vt);
  const int rank = vt->rank(comm.instance());
  const int size = vt->size(comm.instance());
  ASSERT_TRUE(loom::sdk::comm_nonblocking(comm));

  constexpr std::size_t kBuckets = 5;
  std::vector<std::vector<float>> data(kBuckets);
  std::vector<int64_t> shapes(kBuckets);
  std::vector<DLTensor> tensors(kBuckets);
  std::vector<loom_allreduce_args> args(kBuckets);
  std::vector<loom::sdk::CommRequest> reqs;
  for (std::size_t k = 0; k < kBuckets; ++k) {
    data[k].resize(1000 + k * 3001);
    for (std::size_t i = 0; i < data[k].size(); ++i) data[k][i] = value(rank, i + k);
    shapes[k] = static_cast<int64_t>(data[k].size());
    tensors[k] =
        DLTensor{data[k].data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shapes[k], nullptr, 0};
    args[k] = loom_allreduce_args{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &tensors[k],
                                  nullptr};
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_ALLREDUCE, &args[k]));
    EXPECT_TRUE(reqs.back().test()) << "bucket " << k << " is not finished when start returns";
  }
  for (auto& r : reqs) ASSERT_NO_THROW(r.wait());
  for (std::size_t k = 0; k < kBuckets; ++k) {
    for (std::size_t i = 0; i < data[k].size(); ++i) {
      float ref = 0;
      for (int j = 0; j < size; ++j) ref += value(j, i + k);
      ASSERT_EQ(data[k][i], ref) << "bucket " << k << " element " << i;
    }
  }
  loom_close(s);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
