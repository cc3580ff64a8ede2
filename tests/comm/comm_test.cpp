// The host-memory transports (ucx, and mpi with LOOM_TEST_COMM_PLUGIN=mpi) through the
// embedding API, run by every rank of an mpirun job (or alone, as a world of one). Each rank
// fills its data from its rank, so every collective is checked against a reference computed
// locally; the bad cases check that every rank gets a clear error and nobody hangs. Tests of
// what only ucx does (its algorithms' volumes, its mismatch checks and timeouts) skip on the
// others, saying why.
#include <loom/embed.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm_helpers.hpp"

namespace {

using namespace loom_test;  // NOLINT(google-build-using-namespace)

// The three ways the transport may run an allreduce: its defaults, ring for everything (with
// small chunks, so the pipeline has many chunks in flight), recursive doubling for everything.
const char* kConfigs[] = {
    "timeout_s = 30.0\n",
    "timeout_s = 30.0\nsmall_message_bytes = 0\nchunk_bytes = 4096\npipeline_depth = 3\n",
    "timeout_s = 30.0\nsmall_message_bytes = 1000000000\n",
};

const std::size_t kSizes[] = {1, 7, 1000, 1000003};

void check_allreduce(const Comm& c, Dt dt, int32_t op, std::size_t n, bool in_place) {
  Buf send(dt, n);
  Buf recv(dt, n);
  for (std::size_t i = 0; i < n; ++i)
    send.set(i, value(c.rank, i) * (op == LOOM_REDUCE_MAX ? 1 : 1));
  if (in_place) {
    std::memcpy(recv.bytes.data(), send.bytes.data(), send.bytes.size());
  } else {
    std::fill(recv.bytes.begin(), recv.bytes.end(), 0xab);
  }
  Result r = c.allreduce(op, in_place ? nullptr : &send.t, &recv.t);
  ASSERT_EQ(r.code, LOOM_OK) << r.text;
  std::size_t bad = 0;
  std::size_t first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double ref = op == LOOM_REDUCE_MAX ? -1e30 : op == LOOM_REDUCE_MIN ? 1e30 : 0.0;
    for (int k = 0; k < c.size; ++k) {
      const double v = value(k, i);
      if (op == LOOM_REDUCE_MAX) {
        ref = std::max(ref, v);
      } else if (op == LOOM_REDUCE_MIN) {
        ref = std::min(ref, v);
      } else {
        ref += v;
      }
    }
    float expect = static_cast<float>(ref);
    if (op == LOOM_REDUCE_AVG)
      expect = round_to(dt, static_cast<float>(ref) / static_cast<float>(c.size));
    if (recv.get(i) != expect) {
      if (bad++ == 0) first = i;
    }
  }
  EXPECT_EQ(bad, 0U) << dt_name(dt) << " op " << op << " n " << n << ": first wrong element "
                     << first << " = " << recv.get(first);
}

TEST(UcxAllreduce, MatchesReferenceForEveryDtypeOpSizeAndAlgorithm) {
  for (const char* config : kConfigs) {
    Comm c(config);
    ASSERT_EQ(c.rc, LOOM_OK) << c.error;
    for (Dt dt : {Dt::kF32, Dt::kF16, Dt::kBF16}) {
      for (int32_t op : {LOOM_REDUCE_SUM, LOOM_REDUCE_AVG}) {
        for (std::size_t n : kSizes) {
          SCOPED_TRACE(std::string(config) + dt_name(dt));
          check_allreduce(c, dt, op, n, n % 2 == 1);
        }
      }
    }
    for (int32_t op : {LOOM_REDUCE_MAX, LOOM_REDUCE_MIN}) {
      check_allreduce(c, Dt::kF32, op, 1000, false);
      check_allreduce(c, Dt::kBF16, op, 1000003, true);
    }
    if (!testing_ucx()) break;  // the configurations choose ucx's algorithms
  }
}

TEST(UcxAllreduce, RandomFloatsAgreeBitwiseOnEveryRank) {
  Comm c("timeout_s = 30.0\nchunk_bytes = 65536\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  for (std::size_t n : {std::size_t{1000}, std::size_t{300001}}) {
    Buf x(Dt::kF32, n);
    uint64_t s = 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(c.rank + 1);
    std::vector<double> ref(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      for (int k = 0; k < c.size; ++k) {
        uint64_t z =
            (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(k + 1)) ^ (i * 0x2545F4914F6CDD1DULL);
        z ^= z >> 29;
        z *= 0xbf58476d1ce4e5b9ULL;
        z ^= z >> 32;
        const float v = static_cast<float>(static_cast<double>(z % 2000001) / 1000000.0 - 1.0);
        ref[i] += v;
        if (k == c.rank) x.set(i, v);
      }
    }
    (void)s;
    Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
    ASSERT_EQ(r.code, LOOM_OK) << r.text;
    double worst = 0;
    for (std::size_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(x.get(i) - ref[i]));
    EXPECT_LT(worst, 1e-5 * c.size);
    // The result is the same bits on every rank.
    uint64_t h = 1469598103934665603ULL;
    for (unsigned char b : x.bytes) h = (h ^ b) * 1099511628211ULL;
    const std::vector<int64_t> all = c.gather(static_cast<int64_t>(h));
    for (int64_t v : all) EXPECT_EQ(v, static_cast<int64_t>(h));
  }
}

TEST(UcxAllgather, MatchesReference) {
  Comm c("timeout_s = 30.0\nchunk_bytes = 8192\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  for (Dt dt : {Dt::kF32, Dt::kBF16}) {
    for (std::size_t n : kSizes) {
      Buf send(dt, n);
      Buf recv(dt, n * static_cast<std::size_t>(c.size));
      for (std::size_t i = 0; i < n; ++i) send.set(i, value(c.rank, i));
      Result r = c.allgather(&send.t, &recv.t);
      ASSERT_EQ(r.code, LOOM_OK) << r.text;
      std::size_t bad = 0;
      for (int k = 0; k < c.size; ++k) {
        for (std::size_t i = 0; i < n; ++i) {
          if (recv.get(static_cast<std::size_t>(k) * n + i) != value(k, i)) ++bad;
        }
      }
      EXPECT_EQ(bad, 0U) << dt_name(dt) << " n " << n;
    }
  }
}

// [instance]: one call at a time, but from any thread. Each collective here runs on a
// different thread than the one that created the instance (and than the previous call),
// the way a trainer's step may move between threads; results must match the reference.
TEST(UcxThreads, CallsFromOtherThreadsOneAtATime) {
  Comm c("timeout_s = 30.0\nsmall_message_bytes = 0\nchunk_bytes = 4096\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  for (int round = 0; round < 4; ++round) {
    std::thread t([&] {
      check_allreduce(c, Dt::kF32, LOOM_REDUCE_SUM, 100003, round % 2 == 0);
      const Result b = c.barrier();
      EXPECT_EQ(b.code, LOOM_OK) << b.text;
    });
    t.join();
    check_allreduce(c, Dt::kBF16, LOOM_REDUCE_MAX, 1000, false);  // and back on this one
    const std::vector<int64_t> ranks = c.gather(c.rank);
    for (int k = 0; k < c.size; ++k) EXPECT_EQ(ranks[static_cast<std::size_t>(k)], k);
  }
}

// Element i of the block rank `from` sends to rank `to`.
float a2a_value(int from, int to, std::size_t i) {
  return static_cast<float>(from * 1000 + to * 100 + static_cast<int>(i % 97));
}

TEST(UcxAllToAll, EqualSplits) {
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const auto p = static_cast<std::size_t>(c.size);
  for (std::size_t block : {std::size_t{1}, std::size_t{5}, std::size_t{100003}}) {
    Buf send(Dt::kF32, block * p);
    Buf recv(Dt::kF32, block * p);
    for (std::size_t j = 0; j < p; ++j) {
      for (std::size_t i = 0; i < block; ++i)
        send.set(j * block + i, a2a_value(c.rank, static_cast<int>(j), i));
    }
    Result r = c.all_to_all(&send.t, &recv.t, nullptr, nullptr);
    ASSERT_EQ(r.code, LOOM_OK) << r.text;
    std::size_t bad = 0;
    for (std::size_t j = 0; j < p; ++j) {
      for (std::size_t i = 0; i < block; ++i) {
        if (recv.get(j * block + i) != a2a_value(static_cast<int>(j), c.rank, i)) ++bad;
      }
    }
    EXPECT_EQ(bad, 0U) << "block " << block;
  }
}

// Rank r sends count(r, j) elements to rank j; some counts are zero.
int64_t a2a_count(int from, int to, int64_t scale) { return ((from + 2 * to) % 3) * scale + to; }

TEST(UcxAllToAll, VariableSplits) {
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  for (int64_t scale : {int64_t{1}, int64_t{40000}}) {
    std::vector<int64_t> sc(static_cast<std::size_t>(c.size));
    std::vector<int64_t> rcv(static_cast<std::size_t>(c.size));
    int64_t ts = 0;
    int64_t tr = 0;
    for (int j = 0; j < c.size; ++j) {
      sc[static_cast<std::size_t>(j)] = a2a_count(c.rank, j, scale);
      rcv[static_cast<std::size_t>(j)] = a2a_count(j, c.rank, scale);
      ts += sc[static_cast<std::size_t>(j)];
      tr += rcv[static_cast<std::size_t>(j)];
    }
    Buf send(Dt::kF32, static_cast<std::size_t>(ts) + 3);  // longer than needed is fine
    Buf recv(Dt::kF32, static_cast<std::size_t>(tr));
    std::size_t o = 0;
    for (int j = 0; j < c.size; ++j) {
      for (int64_t i = 0; i < sc[static_cast<std::size_t>(j)]; ++i) {
        send.set(o++, a2a_value(c.rank, j, static_cast<std::size_t>(i)));
      }
    }
    Result r = c.all_to_all(&send.t, &recv.t, sc.data(), rcv.data());
    ASSERT_EQ(r.code, LOOM_OK) << r.text;
    std::size_t bad = 0;
    o = 0;
    for (int j = 0; j < c.size; ++j) {
      for (int64_t i = 0; i < rcv[static_cast<std::size_t>(j)]; ++i) {
        if (recv.get(o++) != a2a_value(j, c.rank, static_cast<std::size_t>(i))) ++bad;
      }
    }
    EXPECT_EQ(bad, 0U) << "scale " << scale;
    // Sent bytes are this rank's counts to the others.
    (void)tr;
  }
}

TEST(UcxBroadcast, FromANonZeroRoot) {
  Comm c("timeout_s = 30.0\nchunk_bytes = 65536\npipeline_depth = 2\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const int root = c.size - 1;
  for (std::size_t n : kSizes) {
    Buf x(Dt::kF32, n);
    for (std::size_t i = 0; i < n; ++i) x.set(i, c.rank == root ? value(99, i) : -7.0f);
    Result r = c.broadcast(root, &x.t);
    ASSERT_EQ(r.code, LOOM_OK) << r.text;
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += x.get(i) != value(99, i) ? 1 : 0;
    EXPECT_EQ(bad, 0U) << "n " << n;
  }
}

// Bytes each collective moves, summed over ranks and per rank, against the algorithms'
// volumes (docs/comm.md).
TEST(UcxStats, CountBytesAndRounds) {
  if (!testing_ucx()) GTEST_SKIP() << "ucx's algorithms' volumes (MpiStats.* checks mpi's)";
  Comm c("timeout_s = 30.0\nsmall_message_bytes = 65536\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const auto p = static_cast<uint64_t>(c.size);
  const int r = c.rank;
  auto delta = [&](auto&& fn) {
    const loom_comm_stats before = c.stats();
    fn();
    const loom_comm_stats after = c.stats();
    EXPECT_EQ(after.rounds - before.rounds, 1U);
    return std::pair<uint64_t, uint64_t>(after.bytes_sent - before.bytes_sent,
                                         after.bytes_received - before.bytes_received);
  };
  auto total = [&](uint64_t mine) {
    uint64_t t = 0;
    for (int64_t v : c.gather(static_cast<int64_t>(mine))) t += static_cast<uint64_t>(v);
    return t;
  };
  // Ring allreduce: segment j is [j n / p, (j + 1) n / p); rank r sends every segment but
  // r + 1 in the reduce-scatter and every one but r + 2 in the allgather.
  {
    const uint64_t n = 1000003;
    Buf x(Dt::kF32, n);
    auto [sent, recvd] =
        delta([&] { EXPECT_EQ(c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t).code, LOOM_OK); });
    auto seg = [&](uint64_t j) { return ((j % p) + 1) * n / p - (j % p) * n / p; };
    const uint64_t expect =
        p == 1
            ? 0
            : 4 * (2 * n - seg(static_cast<uint64_t>(r) + 1) - seg(static_cast<uint64_t>(r) + 2));
    EXPECT_EQ(sent, expect);
    EXPECT_EQ(total(sent), 4 * 2 * (p - 1) * n);
    EXPECT_EQ(total(recvd), 4 * 2 * (p - 1) * n);
  }
  // Recursive doubling: log2 of the largest power of two <= p exchanges of everything, plus
  // the fold and unfold of the extra ranks.
  {
    const uint64_t n = 1000;
    Buf x(Dt::kF32, n);
    auto [sent, recvd] =
        delta([&] { EXPECT_EQ(c.allreduce(LOOM_REDUCE_AVG, nullptr, &x.t).code, LOOM_OK); });
    uint64_t pof2 = 1;
    int lg = 0;
    while (pof2 * 2 <= p) {
      pof2 *= 2;
      ++lg;
    }
    const uint64_t rem = p - pof2;
    uint64_t expect = 4 * n * static_cast<uint64_t>(lg);
    if (static_cast<uint64_t>(r) < 2 * rem)
      expect = r % 2 == 0 ? 4 * n : 4 * n * (static_cast<uint64_t>(lg) + 1);
    EXPECT_EQ(sent, expect);
    EXPECT_EQ(recvd, expect);
  }
  // Allgather ring: p - 1 blocks out and in.
  {
    const uint64_t n = 777;
    Buf s(Dt::kF32, n);
    Buf rr(Dt::kF32, n * p);
    auto [sent, recvd] = delta([&] { EXPECT_EQ(c.allgather(&s.t, &rr.t).code, LOOM_OK); });
    EXPECT_EQ(sent, 4 * n * (p - 1));
    EXPECT_EQ(recvd, 4 * n * (p - 1));
  }
  // all_to_all: everything but the own block.
  {
    const uint64_t block = 321;
    Buf s(Dt::kBF16, block * p);
    Buf rr(Dt::kBF16, block * p);
    auto [sent, recvd] =
        delta([&] { EXPECT_EQ(c.all_to_all(&s.t, &rr.t, nullptr, nullptr).code, LOOM_OK); });
    EXPECT_EQ(sent, 2 * block * (p - 1));
    EXPECT_EQ(recvd, 2 * block * (p - 1));
  }
  // Broadcast: every rank but the root receives the tensor once.
  {
    const uint64_t n = 5000;
    Buf x(Dt::kF32, n);
    auto [sent, recvd] = delta([&] { EXPECT_EQ(c.broadcast(0, &x.t).code, LOOM_OK); });
    EXPECT_EQ(recvd, r == 0 ? 0 : 4 * n);
    EXPECT_EQ(total(sent), 4 * n * (p - 1));
  }
  {
    auto [sent, recvd] = delta([&] { EXPECT_EQ(c.barrier().code, LOOM_OK); });
    EXPECT_EQ(sent, 0U);
    EXPECT_EQ(recvd, 0U);
  }
}

// ---- bad cases

TEST(UcxErrors, DifferentSizesOnDifferentRanksFailEverywhere) {
  if (!testing_ucx()) {
    GTEST_SKIP() << "MPI does not check that the ranks agree on a collective's arguments "
                    "(MpiErrors.* checks what an MPI error does)";
  }
  for (std::size_t n : {std::size_t{1000}, std::size_t{1000000}}) {
    Comm c("timeout_s = 20.0\n");
    ASSERT_EQ(c.rc, LOOM_OK) << c.error;
    if (c.size == 1) GTEST_SKIP() << "needs two ranks";
    Buf x(Dt::kF32, n + (c.rank == 0 ? 1 : 0));
    const auto t0 = std::chrono::steady_clock::now();
    Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT) << r.text;
    EXPECT_NE(r.text.find("does not agree"), std::string::npos) << r.text;
    EXPECT_LT(s, 15.0) << "the error came from the timeout, not the mismatch check";
    // The instance refuses to go on.
    EXPECT_EQ(c.barrier().code, LOOM_ERR_FAILED_PRECONDITION);
  }
}

TEST(UcxErrors, UnsupportedDtypeDeviceAndArguments) {
  Comm c;
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  int32_t data[8] = {};
  int64_t n = 8;
  DLTensor i32{data, {kDLCPU, 0}, 1, {kDLInt, 32, 1}, &n, nullptr, 0};
  Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &i32);
  EXPECT_EQ(r.code, LOOM_ERR_UNIMPLEMENTED);
  EXPECT_NE(r.text.find("int32"), std::string::npos) << r.text;

  float f[8] = {};
  DLTensor gpu{f, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, &n, nullptr, 0};
  r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &gpu);
  EXPECT_EQ(r.code, LOOM_ERR_UNIMPLEMENTED);
  EXPECT_NE(r.text.find("cuda:0"), std::string::npos) << r.text;
  EXPECT_EQ(c.vt->supports_device(c.obj, DLDevice{kDLCUDA, 0}), 0);
  EXPECT_EQ(c.vt->supports_device(c.obj, DLDevice{kDLCPU, 0}), 1);
  r = c.broadcast(0, &gpu);
  EXPECT_EQ(r.code, LOOM_ERR_UNIMPLEMENTED);

  DLTensor cpu{f, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &n, nullptr, 0};
  EXPECT_EQ(c.broadcast(c.size, &cpu).code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(c.allreduce(42, nullptr, &cpu).code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(c.allreduce(LOOM_REDUCE_SUM, nullptr, nullptr).code, LOOM_ERR_INVALID_ARGUMENT);
  int64_t sc[1] = {1};
  EXPECT_EQ(c.all_to_all(&cpu, &cpu, sc, nullptr).code, LOOM_ERR_INVALID_ARGUMENT);
  int64_t strides[1] = {2};
  int64_t four = 4;
  DLTensor strided{f, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &four, strides, 0};
  EXPECT_EQ(c.allreduce(LOOM_REDUCE_SUM, nullptr, &strided).code, LOOM_ERR_INVALID_ARGUMENT);

  // Errors found before any message leave the transport usable.
  for (int i = 0; i < 8; ++i) f[i] = 1.0f;
  r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &cpu);
  ASSERT_EQ(r.code, LOOM_OK) << r.text;
  EXPECT_EQ(f[7], static_cast<float>(c.size));
}

TEST(UcxErrors, SilentPeerGivesDeadlineExceededWithinTimeout) {
  if (!testing_ucx()) {
    GTEST_SKIP() << "MPI collectives have no timeout: the MPI launcher or loom_abort_job ends "
                    "a job with a dead rank (docs/comm.md)";
  }
  constexpr double kTimeout = 2.0;
  Comm c("timeout_s = 2.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  if (c.size == 1) GTEST_SKIP() << "needs two ranks";
  const int silent = c.size - 1;
  if (c.rank == silent) {
    // Never calls; stays alive until the others have given up, then leaves.
    std::this_thread::sleep_for(std::chrono::duration<double>(kTimeout + 4.0));
    return;
  }
  Buf x(Dt::kF32, 100000);
  const auto t0 = std::chrono::steady_clock::now();
  Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, LOOM_ERR_DEADLINE_EXCEEDED) << r.text;
  // Each rank names the peer it waited for (the silent rank, or a neighbour that waits on
  // it); whoever times out first tells the others, so every message says who waited.
  EXPECT_NE(r.text.find("waited 2 s for rank"), std::string::npos) << r.text;
  EXPECT_GE(s, kTimeout * 0.9);
  EXPECT_LT(s, kTimeout + 3.0);
}

// Run alone (its own ctest entry, LOOM_TEST_NO_JOIN=1): the last rank never opens the
// session, so the others' bootstrap (LOOM_BOOTSTRAP_TIMEOUT) or connection setup
// (timeout_s) must fail with DEADLINE_EXCEEDED instead of hanging.
TEST(UcxNoJoin, OthersFailWithinTheTimeout) {
  const char* on = std::getenv("LOOM_TEST_NO_JOIN");
  if (on == nullptr || std::string(on) != "1") GTEST_SKIP() << "run by the no-join ctest entry";
  const char* rank_env = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* size_env = std::getenv("OMPI_COMM_WORLD_SIZE");
  ASSERT_NE(rank_env, nullptr);
  const int rank = std::atoi(rank_env);
  const int size = std::atoi(size_env);
  ASSERT_GE(size, 2);
  // The silent rank stays in the job until every other rank has given up (each leaves a
  // marker file; mpirun is the parent of all ranks), so the others can only fail by their own
  // timeout, however loaded the machine is.
  auto marker = [](int r) {
    return "/tmp/loom-no-join-" + std::to_string(::getppid()) + "-rank" + std::to_string(r);
  };
  if (rank == size - 1) {
    // Joins the job (an empty session still starts the MPI bootstrap, so MPI_Init's own
    // rendezvous completes) but never opens the transport.
    loom_session* s = nullptr;
    ASSERT_EQ(loom_open_string("", nullptr, nullptr, &s), LOOM_OK) << loom_last_error();
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(50);
    for (int r = 0; r < size - 1; ++r) {
      while (::access(marker(r).c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      ::unlink(marker(r).c_str());
    }
    loom_close(s);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  Comm c("timeout_s = 3.0\n");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::FILE* f = std::fopen(marker(rank).c_str(), "w");
  if (f != nullptr) std::fclose(f);
  EXPECT_EQ(c.rc, LOOM_ERR_DEADLINE_EXCEEDED) << c.error;
  // Not a speed bound: only a guard against waiting on the silent rank forever (the silent
  // rank leaves after 50 s). The deadline itself is the bootstrap's or the transport's.
  EXPECT_LT(s, 45.0);
  if (!HasFailure()) std::printf("NOJOIN-OK rank %d\n", rank);
}

}  // namespace
