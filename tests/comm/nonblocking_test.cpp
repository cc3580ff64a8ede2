// reduce_scatter and the non-blocking collectives (start, test, wait; ABI 1.6) of the
// host-memory transports (ucx, or the one LOOM_TEST_COMM_PLUGIN names), run by every rank of
// an mpirun or env-launched job, or alone. Results are
// checked against references computed locally and against the blocking calls; the SDK's
// fallbacks are checked on the same transport seen through a 1.5-sized table.
#include <loom/embed.h>
#include <loom/sdk/comm.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "comm_helpers.hpp"

namespace {

using namespace loom_test;  // NOLINT(google-build-using-namespace)
using loom::sdk::CommRequest;
using loom::sdk::InstanceRef;

InstanceRef<loom_comm_v1> ref_of(const CommView& c) { return {"world", c.obj, c.vt}; }

const char* kConfigs[] = {
    "timeout_s = 30.0\n",
    "timeout_s = 30.0\nchunk_bytes = 4096\npipeline_depth = 3\n",
};

// Rank k's element i of a reduce_scatter's send.
float rs_value(int k, std::size_t i) { return value(k, i * 5 + 3); }

void check_reduce_scatter(const CommView& c, Dt dt, int32_t op, std::size_t n, bool through_sdk) {
  Buf send(dt, n * static_cast<std::size_t>(c.size));
  for (std::size_t i = 0; i < send.size(); ++i) send.set(i, rs_value(c.rank, i));
  Buf recv(dt, n);
  std::fill(recv.bytes.begin(), recv.bytes.end(), 0xcd);
  const loom_reduce_scatter_args a{LOOM_REDUCE_SCATTER_ARGS_SIZE, op, &send.t, &recv.t, nullptr};
  if (through_sdk) {
    ASSERT_NO_THROW(loom::sdk::comm_reduce_scatter(ref_of(c), a));
  } else {
    Result r(c.vt->reduce_scatter(c.obj, &a));
    ASSERT_EQ(r.code, LOOM_OK) << r.text;
  }
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t g = static_cast<std::size_t>(c.rank) * n + i;
    double ref = op == LOOM_REDUCE_MAX ? -1e30 : 0.0;
    for (int k = 0; k < c.size; ++k) {
      ref = op == LOOM_REDUCE_MAX ? std::max(ref, double{rs_value(k, g)}) : ref + rs_value(k, g);
    }
    float expect = static_cast<float>(ref);
    if (op == LOOM_REDUCE_AVG) expect = round_to(dt, expect / static_cast<float>(c.size));
    if (recv.get(i) != expect) ++bad;
  }
  EXPECT_EQ(bad, 0U) << dt_name(dt) << " op " << op << " n " << n;
}

TEST(UcxReduceScatter, MatchesReferenceForEveryDtypeOpAndSize) {
  for (const char* config : kConfigs) {
    Comm c(config);
    ASSERT_EQ(c.rc, LOOM_OK) << c.error;
    ASSERT_NE(c.vt->reduce_scatter, nullptr);
    for (Dt dt : {Dt::kF32, Dt::kF16, Dt::kBF16}) {
      for (int32_t op : {LOOM_REDUCE_SUM, LOOM_REDUCE_AVG, LOOM_REDUCE_MAX}) {
        for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{250007}}) {
          SCOPED_TRACE(config);
          check_reduce_scatter(c, dt, op, n, false);
        }
      }
    }
    if (!testing_ucx()) break;  // the configurations choose ucx's algorithms
  }
}

TEST(UcxReduceScatter, WrongSendSizeIsAClearError) {
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  Buf send(Dt::kF32, 10 * static_cast<std::size_t>(c.size) + 1);
  Buf recv(Dt::kF32, 10);
  const loom_reduce_scatter_args a{LOOM_REDUCE_SCATTER_ARGS_SIZE, LOOM_REDUCE_SUM, &send.t, &recv.t,
                                   nullptr};
  Result r(c.vt->reduce_scatter(c.obj, &a));
  EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT) << r.text;
  EXPECT_NE(r.text.find("reduce_scatter send"), std::string::npos) << r.text;
  EXPECT_EQ(c.barrier().code, LOOM_OK);  // an argument error leaves the instance usable
}

// Several collectives in flight at once, waited for in reverse order, with a blocking call
// among them: every result matches the reference, on every rank.
TEST(UcxNonBlocking, OutstandingCollectivesMatchTheReference) {
  for (const char* config : kConfigs) {
    Comm c(config);
    ASSERT_EQ(c.rc, LOOM_OK) << c.error;
    const InstanceRef<loom_comm_v1> comm = ref_of(c);
    ASSERT_TRUE(loom::sdk::comm_nonblocking(comm));
    const std::size_t n = 300001;
    const auto p = static_cast<std::size_t>(c.size);

    std::vector<Buf*> sums;
    Buf a(Dt::kF32, n);
    Buf b(Dt::kBF16, 1000);
    for (std::size_t i = 0; i < n; ++i) a.set(i, value(c.rank, i));
    for (std::size_t i = 0; i < 1000; ++i) b.set(i, value(c.rank, i + 1));
    Buf g_in(Dt::kF32, 17);
    Buf g_out(Dt::kF32, 17 * p);
    for (std::size_t i = 0; i < 17; ++i) g_in.set(i, static_cast<float>(c.rank * 100 + i));
    Buf rs_in(Dt::kF32, 4096 * p);
    Buf rs_out(Dt::kF32, 4096);
    for (std::size_t i = 0; i < rs_in.size(); ++i) rs_in.set(i, rs_value(c.rank, i));
    Buf x_in(Dt::kF32, 8 * p);
    Buf x_out(Dt::kF32, 8 * p);
    for (std::size_t i = 0; i < x_in.size(); ++i)
      x_in.set(i, static_cast<float>(c.rank * 1000 + i));
    Buf bc(Dt::kF32, 5000);
    for (std::size_t i = 0; i < bc.size(); ++i) bc.set(i, c.rank == 0 ? static_cast<float>(i) : -1);
    Buf blocking(Dt::kF32, 64);
    for (std::size_t i = 0; i < 64; ++i) blocking.set(i, 1.0F);

    const loom_allreduce_args ar_a{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &a.t,
                                   nullptr};
    const loom_allreduce_args ar_b{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_AVG, nullptr, &b.t,
                                   nullptr};
    const loom_allgather_args ag{LOOM_ALLGATHER_ARGS_SIZE, 0, &g_in.t, &g_out.t, nullptr};
    const loom_reduce_scatter_args rs{LOOM_REDUCE_SCATTER_ARGS_SIZE, LOOM_REDUCE_SUM, &rs_in.t,
                                      &rs_out.t, nullptr};
    const loom_all_to_all_args xa{
        LOOM_ALL_TO_ALL_ARGS_SIZE, 0, &x_in.t, &x_out.t, nullptr, nullptr, nullptr};
    const loom_broadcast_args br{LOOM_BROADCAST_ARGS_SIZE, 0, &bc.t, nullptr};

    std::vector<CommRequest> reqs;
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_ALLREDUCE, &ar_a));
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_ALLGATHER, &ag));
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_REDUCE_SCATTER, &rs));
    // A blocking call runs after the started ones, in the same order on every rank.
    ASSERT_EQ(c.allreduce(LOOM_REDUCE_SUM, nullptr, &blocking.t).code, LOOM_OK);
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_ALL_TO_ALL, &xa));
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_BROADCAST, &br));
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_ALLREDUCE, &ar_b));
    // Work on this thread while they run; test() never blocks.
    double busy = 0;
    for (int i = 0; i < 200000; ++i) busy += std::sqrt(static_cast<double>(i));
    EXPECT_GT(busy, 0);
    for (auto& r : reqs) EXPECT_NO_THROW((void)r.test());
    for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) {
      ASSERT_NO_THROW(it->wait());
      EXPECT_FALSE(it->pending());
    }

    for (std::size_t i = 0; i < 64; ++i) ASSERT_EQ(blocking.get(i), static_cast<float>(c.size));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float ref = 0;
      for (int k = 0; k < c.size; ++k) ref += value(k, i);
      bad += a.get(i) != ref ? 1 : 0;
    }
    EXPECT_EQ(bad, 0U) << "allreduce";
    for (std::size_t i = 0; i < 1000; ++i) {
      float ref = 0;
      for (int k = 0; k < c.size; ++k) ref += value(k, i + 1);
      ASSERT_EQ(b.get(i), round_to(Dt::kBF16, ref / static_cast<float>(c.size))) << i;
    }
    for (std::size_t k = 0; k < p; ++k) {
      for (std::size_t i = 0; i < 17; ++i) {
        ASSERT_EQ(g_out.get(k * 17 + i), static_cast<float>(k * 100 + i));
      }
    }
    for (std::size_t i = 0; i < 4096; ++i) {
      float ref = 0;
      for (int k = 0; k < c.size; ++k)
        ref += rs_value(k, static_cast<std::size_t>(c.rank) * 4096 + i);
      ASSERT_EQ(rs_out.get(i), ref) << i;
    }
    for (std::size_t k = 0; k < p; ++k) {
      for (std::size_t i = 0; i < 8; ++i) {
        ASSERT_EQ(x_out.get(k * 8 + i),
                  static_cast<float>(k * 1000 + static_cast<std::size_t>(c.rank) * 8 + i));
      }
    }
    for (std::size_t i = 0; i < bc.size(); ++i) ASSERT_EQ(bc.get(i), static_cast<float>(i));
    if (!testing_ucx()) break;  // the configurations choose ucx's algorithms
  }
}

// Many small started allreduces in a row (the trainer's buckets), each waited for in order.
TEST(UcxNonBlocking, ManyBucketsInOrder) {
  Comm c("timeout_s = 30.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const InstanceRef<loom_comm_v1> comm = ref_of(c);
  constexpr std::size_t kBuckets = 40;
  std::vector<std::unique_ptr<Buf>> bufs;
  std::vector<loom_allreduce_args> args(kBuckets);
  std::vector<CommRequest> reqs;
  for (std::size_t k = 0; k < kBuckets; ++k) {
    bufs.push_back(std::make_unique<Buf>(Dt::kF32, 1000 + k * 997));
    for (std::size_t i = 0; i < bufs[k]->size(); ++i) bufs[k]->set(i, value(c.rank, i + k));
    args[k] = loom_allreduce_args{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &bufs[k]->t,
                                  nullptr};
    reqs.push_back(loom::sdk::comm_start(comm, LOOM_COLLECTIVE_ALLREDUCE, &args[k]));
  }
  for (auto& r : reqs) ASSERT_NO_THROW(r.wait());
  for (std::size_t k = 0; k < kBuckets; ++k) {
    for (std::size_t i = 0; i < bufs[k]->size(); ++i) {
      float ref = 0;
      for (int j = 0; j < c.size; ++j) ref += value(j, i + k);
      ASSERT_EQ(bufs[k]->get(i), ref) << "bucket " << k << " element " << i;
    }
  }
}

// The same transport seen through a table that ends where ABI 1.5's did: the SDK's calls fall
// back to the blocking ones and give the same results.
TEST(UcxNonBlocking, OlderTableFallsBackToBlockingCalls) {
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  loom_comm_v1 old = *c.vt;
  old.struct_size = LOOM_STRUCT_SIZE(loom_comm_v1, native_handle2);
  const CommView view(c.obj, &old);
  const InstanceRef<loom_comm_v1> comm = ref_of(view);
  EXPECT_FALSE(loom::sdk::comm_nonblocking(comm));
  Buf x(Dt::kF32, 5000);
  for (std::size_t i = 0; i < x.size(); ++i) x.set(i, value(c.rank, i));
  const loom_allreduce_args ar{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &x.t, nullptr};
  CommRequest r = loom::sdk::comm_start(comm, LOOM_COLLECTIVE_ALLREDUCE, &ar);
  EXPECT_FALSE(r.pending()) << "a blocking fallback returns a finished request";
  EXPECT_TRUE(r.test());
  for (std::size_t i = 0; i < x.size(); ++i) {
    float ref = 0;
    for (int k = 0; k < c.size; ++k) ref += value(k, i);
    ASSERT_EQ(x.get(i), ref);
  }
  for (Dt dt : {Dt::kF32, Dt::kBF16}) {
    check_reduce_scatter(view, dt, LOOM_REDUCE_SUM, 3001, true);
    check_reduce_scatter(view, dt, LOOM_REDUCE_AVG, 7, true);
  }
}

TEST(UcxNonBlocking, BadRequestsAreClearErrors) {
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  Buf x(Dt::kF32, 10);
  const loom_allreduce_args ar{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &x.t, nullptr};
  loom_comm_start_args s{LOOM_COMM_START_ARGS_SIZE, 99, &ar, nullptr};
  Result bad_kind(c.vt->start(c.obj, &s));
  EXPECT_EQ(bad_kind.code, LOOM_ERR_INVALID_ARGUMENT) << bad_kind.text;
  EXPECT_NE(bad_kind.text.find("unknown collective 99"), std::string::npos) << bad_kind.text;
  EXPECT_EQ(s.request, nullptr);
  const loom_comm_request_args none{LOOM_COMM_REQUEST_ARGS_SIZE, 0, nullptr};
  Result bad_wait(c.vt->wait(c.obj, &none));
  EXPECT_EQ(bad_wait.code, LOOM_ERR_INVALID_ARGUMENT) << bad_wait.text;
  s.collective = LOOM_COLLECTIVE_ALLREDUCE;
  s.args = nullptr;
  Result no_args(c.vt->start(c.obj, &s));
  EXPECT_EQ(no_args.code, LOOM_ERR_INVALID_ARGUMENT) << no_args.text;
  EXPECT_EQ(c.barrier().code, LOOM_OK);  // nothing was started
}

// A started collective that the ranks disagree on fails at its wait, on every rank, well
// before the timeout; the instance then refuses further calls.
TEST(UcxNonBlocking, AFailedCollectiveFailsItsWaitEverywhere) {
  if (!testing_ucx()) {
    GTEST_SKIP() << "MPI does not check that the ranks agree on a collective's arguments "
                    "(MpiErrors.AFailedStartedCollectiveFailsItsWait is mpi's case)";
  }
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  if (c.size == 1) GTEST_SKIP() << "needs two ranks";
  Buf x(Dt::kF32, 100000 + (c.rank == 0 ? 1 : 0));
  const loom_allreduce_args ar{LOOM_ALLREDUCE_ARGS_SIZE, LOOM_REDUCE_SUM, nullptr, &x.t, nullptr};
  const auto t0 = std::chrono::steady_clock::now();
  CommRequest r = loom::sdk::comm_start(ref_of(c), LOOM_COLLECTIVE_ALLREDUCE, &ar);
  try {
    r.wait();
    ADD_FAILURE() << "wait succeeded";
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not agree"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 15.0);
  EXPECT_EQ(c.barrier().code, LOOM_ERR_FAILED_PRECONDITION);
}

}  // namespace
