// What only the mpi transport does (plugins/comm/mpi), beside the shared transport tests that
// the comm.mpi.* entries run against it (LOOM_TEST_COMM_PLUGIN=mpi): its byte counters, an
// error inside MPI, device tensors, and jobs MPI did not start. Each test skips for other
// transports.
#include <loom/embed.h>
#include <loom/sdk/comm.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "comm_helpers.hpp"

namespace {

using namespace loom_test;  // NOLINT(google-build-using-namespace)

bool testing_mpi() { return transport() == "mpi"; }

// A world-wide allreduce, checked against every rank's input.
void check_world(const CommView& c, std::size_t n) {
  Buf x(Dt::kF32, n);
  for (std::size_t i = 0; i < n; ++i) x.set(i, value(c.rank, i));
  const Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
  ASSERT_EQ(r.code, LOOM_OK) << r.text;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float ref = 0;
    for (int k = 0; k < c.size; ++k) ref += value(k, i);
    bad += x.get(i) != ref ? 1 : 0;
  }
  EXPECT_EQ(bad, 0U);
}

// floor(bytes * num / den), as the plugin computes it.
uint64_t share(uint64_t bytes, uint64_t num, uint64_t den) {
  return bytes / den * num + bytes % den * num / den;
}

// MPI does not say what it moved: the counters hold the volumes of the bandwidth-optimal
// algorithms (docs/comm.md), checked here exactly, with one round per call.
TEST(MpiStats, CountTheNominalVolumes) {
  if (!testing_mpi()) GTEST_SKIP() << "the mpi transport's own";
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const auto p = static_cast<uint64_t>(c.size);
  const auto r = static_cast<uint64_t>(c.rank);
  auto delta = [&](auto&& fn) {
    const loom_comm_stats before = c.stats();
    fn();
    const loom_comm_stats after = c.stats();
    EXPECT_EQ(after.rounds - before.rounds, 1U);
    return std::pair<uint64_t, uint64_t>(after.bytes_sent - before.bytes_sent,
                                         after.bytes_received - before.bytes_received);
  };
  {  // allreduce: 2 (P - 1) / P of the tensor each way
    const uint64_t n = 1000003;
    Buf x(Dt::kF32, n);
    auto [sent, recvd] =
        delta([&] { EXPECT_EQ(c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t).code, LOOM_OK); });
    EXPECT_EQ(sent, share(4 * n, 2 * (p - 1), p));
    EXPECT_EQ(recvd, sent);
  }
  {  // reduce_scatter: P - 1 blocks each way
    const uint64_t n = 1001;
    Buf s(Dt::kBF16, n * p);
    Buf out(Dt::kBF16, n);
    const loom_reduce_scatter_args a{LOOM_REDUCE_SCATTER_ARGS_SIZE, LOOM_REDUCE_AVG, &s.t, &out.t,
                                     nullptr};
    auto [sent, recvd] = delta([&] { EXPECT_EQ(Result(c.vt->reduce_scatter(c.obj, &a)).code, 0); });
    EXPECT_EQ(sent, 2 * n * (p - 1));
    EXPECT_EQ(recvd, sent);
  }
  {  // allgather: P - 1 blocks each way
    const uint64_t n = 777;
    Buf s(Dt::kF32, n);
    Buf out(Dt::kF32, n * p);
    auto [sent, recvd] = delta([&] { EXPECT_EQ(c.allgather(&s.t, &out.t).code, LOOM_OK); });
    EXPECT_EQ(sent, 4 * n * (p - 1));
    EXPECT_EQ(recvd, 4 * n * (p - 1));
  }
  {  // all_to_all: everything but the own block
    const uint64_t block = 321;
    Buf s(Dt::kBF16, block * p);
    Buf out(Dt::kBF16, block * p);
    auto [sent, recvd] =
        delta([&] { EXPECT_EQ(c.all_to_all(&s.t, &out.t, nullptr, nullptr).code, LOOM_OK); });
    EXPECT_EQ(sent, 2 * block * (p - 1));
    EXPECT_EQ(recvd, 2 * block * (p - 1));
  }
  {  // broadcast: a chain from the root; every rank but the last sends, all but the root receive
    const uint64_t n = 5000;
    Buf x(Dt::kF32, n);
    auto [sent, recvd] = delta([&] { EXPECT_EQ(c.broadcast(0, &x.t).code, LOOM_OK); });
    EXPECT_EQ(recvd, r == 0 ? 0 : 4 * n);
    EXPECT_EQ(sent, r == p - 1 ? 0 : 4 * n);
  }
  {
    auto [sent, recvd] = delta([&] { EXPECT_EQ(c.barrier().code, LOOM_OK); });
    EXPECT_EQ(sent, 0U);
    EXPECT_EQ(recvd, 0U);
  }
}

// In a sub-communicator of two ranks, rank 0 sends rank 1 one element more than rank 1
// expects: MPI truncates rank 1's receive and says so (MPI_ERRORS_RETURN). Rank 1 gets a
// clear error naming the call and the ranks, and that sub-communicator refuses further calls
// there; the parent goes on. (Ranks that disagree on a collective's arguments make an
// erroneous MPI program: with more ranks MPI may stop a collective half way and leave the
// others waiting, which only the launcher or loom_abort_job ends, so two ranks it is: the
// exchange with the partner is the last step of every algorithm.)
loom_instance* pair_of_ranks(const Comm& c) {
  loom_instance* sub = nullptr;
  EXPECT_EQ(loom_comm_split(c.instance, c.rank < 2 ? 0 : LOOM_COMM_SPLIT_NONE, -c.rank, &sub),
            LOOM_OK)
      << loom_last_error();
  return sub;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> truncating_counts(const CommView& g) {
  std::vector<int64_t> sc(static_cast<std::size_t>(g.size), 4);
  std::vector<int64_t> rc(static_cast<std::size_t>(g.size), 4);
  if (g.rank == 0) sc[1] = 5;
  return {sc, rc};
}

TEST(MpiErrors, AnMpiErrorBreaksThatCommunicatorOnly) {
  if (!testing_mpi()) GTEST_SKIP() << "the mpi transport's own";
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  if (c.size == 1) GTEST_SKIP() << "needs two ranks";
  loom_instance* bad = pair_of_ranks(c);
  if (bad != nullptr) {
    const CommView g(bad);
    ASSERT_EQ(g.size, 2);
    auto [sc, rc] = truncating_counts(g);
    Buf s(Dt::kF32, 10);
    Buf out(Dt::kF32, 8);
    const auto t0 = std::chrono::steady_clock::now();
    const Result r = g.all_to_all(&s.t, &out.t, sc.data(), rc.data());
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
    if (g.rank == 1) {
      // Open MPI says MPI_ERR_TRUNCATE (INVALID_ARGUMENT); another MPI may use another class.
      EXPECT_NE(r.code, LOOM_OK) << r.text;
      std::printf("failed: %s\n", r.text.c_str());  // what the user reads, in the test's log
      EXPECT_NE(r.text.find("all_to_all"), std::string::npos) << r.text;
      EXPECT_NE(r.text.find("failed on rank 1 (world rank 0)"), std::string::npos) << r.text;
      EXPECT_NE(r.text.find("MPI error class"), std::string::npos) << r.text;
      const Result again = g.barrier();
      EXPECT_EQ(again.code, LOOM_ERR_FAILED_PRECONDITION) << again.text;
      EXPECT_NE(again.text.find("open a new session"), std::string::npos) << again.text;
    }
  }
  check_world(c, 1000);
  EXPECT_EQ(loom_comm_destroy_split(bad), LOOM_OK) << loom_last_error();
  check_world(c, 77);
}

// The same through start and wait: the error is the request's, at its wait.
TEST(MpiErrors, AFailedStartedCollectiveFailsItsWait) {
  if (!testing_mpi()) GTEST_SKIP() << "the mpi transport's own";
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  if (c.size == 1) GTEST_SKIP() << "needs two ranks";
  loom_instance* bad = pair_of_ranks(c);
  if (bad != nullptr) {
    const CommView g(bad);
    auto [sc, rc] = truncating_counts(g);
    Buf s(Dt::kF32, 10);
    Buf out(Dt::kF32, 8);
    const loom_all_to_all_args a{
        LOOM_ALL_TO_ALL_ARGS_SIZE, 0, &s.t, &out.t, sc.data(), rc.data(), nullptr};
    const loom::sdk::InstanceRef<loom_comm_v1> ref("world/0", g.obj, g.vt);
    loom::sdk::CommRequest req = loom::sdk::comm_start(ref, LOOM_COLLECTIVE_ALL_TO_ALL, &a);
    if (g.rank == 1) {
      try {
        req.wait();
        ADD_FAILURE() << "wait succeeded";
      } catch (const loom::sdk::Error& e) {
        EXPECT_NE(std::string(e.what()).find("MPI error class"), std::string::npos) << e.what();
      }
      EXPECT_EQ(g.barrier().code, LOOM_ERR_FAILED_PRECONDITION);
    } else {
      try {
        req.wait();  // this side's part may well have succeeded
      } catch (const loom::sdk::Error&) {
      }
    }
  }
  check_world(c, 1000);
  EXPECT_EQ(loom_comm_destroy_split(bad), LOOM_OK) << loom_last_error();
  check_world(c, 77);
}

TEST(MpiErrors, DeviceTensorsAreRefusedNamingTheNcclTransport) {
  if (!testing_mpi()) GTEST_SKIP() << "the mpi transport's own";
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  float f[8] = {};
  int64_t n = 8;
  DLTensor gpu{f, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &n, nullptr, 0};
  const Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &gpu);
  EXPECT_EQ(r.code, LOOM_ERR_UNIMPLEMENTED) << r.text;
  EXPECT_NE(r.text.find("nccl transport"), std::string::npos) << r.text;
  DLTensor pinned{f, {kDLCUDAHost, 0}, 1, {kDLFloat, 32, 1}, &n, nullptr, 0};
  EXPECT_EQ(c.vt->supports_device(c.obj, pinned.device), 1);
  EXPECT_EQ(c.allreduce(LOOM_REDUCE_MAX, nullptr, &pinned).code, LOOM_OK);
  EXPECT_EQ(c.barrier().code, LOOM_OK);  // an argument error leaves the instance usable
}

// Run by comm.mpi.env2 (LOOM_TEST_MPI_REFUSAL=env: 2 ranks of the env launcher) and
// comm.mpi.np2.bootstrap_single (=single: mpirun -np 2 with LOOM_BOOTSTRAP=single, so the host
// sees a world of one while MPI sees two). Either way the transport must refuse at once, on
// every rank, instead of running worlds that do not match the job.
TEST(MpiLaunch, AJobThatIsNotMpisIsRefusedClearly) {
  if (!testing_mpi()) GTEST_SKIP() << "the mpi transport's own";
  const char* mode = std::getenv("LOOM_TEST_MPI_REFUSAL");
  if (mode == nullptr) GTEST_SKIP() << "run by comm.mpi.env2 and comm.mpi.np2.bootstrap_single";
  const auto t0 = std::chrono::steady_clock::now();
  const Comm c;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  EXPECT_EQ(c.rc, LOOM_ERR_FAILED_PRECONDITION) << c.error;
  std::printf("refused: %s\n", c.error.c_str());  // what the user reads, in the test's log
  if (std::string(mode) == "env") {
    EXPECT_NE(c.error.find("needs mpirun or srun"), std::string::npos) << c.error;
    EXPECT_NE(c.error.find("ucx transport"), std::string::npos) << c.error;
    EXPECT_NE(c.error.find("of 2 started by a launcher that is not MPI's"), std::string::npos)
        << c.error;
  } else {
    EXPECT_NE(c.error.find("MPI_COMM_WORLD has 2 ranks"), std::string::npos) << c.error;
    EXPECT_NE(c.error.find("LOOM_BOOTSTRAP"), std::string::npos) << c.error;
  }
}

}  // namespace
