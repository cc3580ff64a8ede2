// The MoE exchange (plugins/moe/core/exchange.cpp) over the ucx transport, run by every rank of
// an mpirun job (2 and 4 ranks) or alone. Each row's bytes name its sender, its global expert
// and its place among that sender's rows for the expert, so a wrong count, a wrong order or a
// row from the wrong rank shows up as a wrong value; every rank's counts differ, some are 0 and
// one rank sends no rows at all.
#include <loom/embed.h>
#include <loom/sdk/status.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <loom/moe/exchange.hpp>
#include "comm_helpers.hpp"

namespace {

using loom::moe::Exchange;
using namespace loom_test;  // NOLINT(google-build-using-namespace)

constexpr DLDevice kCpu{kDLCPU, 0};

// Rows world rank w sends to global expert e: unequal everywhere, some 0, and rank 1 sends
// nothing at all.
int64_t rows_of(int w, int e) {
  if (w == 1) return 0;
  return (w * 3 + e * 5) % 4 + (e % 3 == 0 ? 0 : w % 2);
}

// A row is kWords int32: sender, expert, index, then a mix of the three (so a row cut at the
// wrong byte offset shows up too).
constexpr int kWords = 5;
constexpr int64_t kRowBytes = kWords * 4;
void fill_row(int32_t* r, int w, int e, int64_t j) {
  r[0] = w;
  r[1] = e;
  r[2] = static_cast<int32_t>(j);
  r[3] = w * 1000003 + e * 1009 + static_cast<int32_t>(j);
  r[4] = -r[3];
}

// The world ranks of this rank's expert-parallel group (consecutive ranks).
std::vector<int> ep_group(int world_rank, int ep) {
  std::vector<int> g;
  const int first = world_rank / ep * ep;
  for (int k = 0; k < ep; ++k) g.push_back(first + k);
  return g;
}

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int k = 1; k <= n; ++k) {
    if (n % k == 0) d.push_back(k);
  }
  return d;
}

void round_trip(const Comm& c, int ep, int local_experts) {
  SCOPED_TRACE("ep " + std::to_string(ep) + ", local experts " + std::to_string(local_experts));
  Exchange ex(c.vt, c.obj, ep);
  ASSERT_EQ(ex.ep_size(), ep);
  ASSERT_EQ(ex.ep_rank(), c.rank % ep);
  ASSERT_EQ(ex.world_size(), c.size);
  ASSERT_EQ(ex.world_rank(), c.rank);
  const int E = ep * local_experts;
  std::vector<int64_t> sc(static_cast<std::size_t>(E));
  int64_t sent = 0;
  for (int e = 0; e < E; ++e) sent += sc[static_cast<std::size_t>(e)] = rows_of(c.rank, e);
  std::vector<int32_t> send(static_cast<std::size_t>(sent * kWords));
  int64_t o = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t j = 0; j < rows_of(c.rank, e); ++j) fill_row(&send[(o++) * kWords], c.rank, e, j);
  }
  const Exchange::Plan p = ex.plan(sc.data(), E);
  ASSERT_EQ(p.num_experts, E);
  ASSERT_EQ(p.local_experts, local_experts);
  ASSERT_EQ(p.ep, ep);
  // recv_counts[l * ep + r]: what the group's rank r sends to this rank's local expert l.
  const std::vector<int> group = ep_group(c.rank, ep);
  int64_t expect_rows = 0;
  ASSERT_EQ(p.recv_counts.size(), static_cast<std::size_t>(E));
  for (int l = 0; l < local_experts; ++l) {
    for (int r = 0; r < ep; ++r) {
      const int e = ex.ep_rank() * local_experts + l;
      EXPECT_EQ(p.recv_counts[static_cast<std::size_t>(l * ep + r)], rows_of(group[r], e))
          << "local expert " << l << " from rank " << r;
      expect_rows += rows_of(group[r], e);
    }
  }
  ASSERT_EQ(p.recv_rows, expect_rows);

  std::vector<int32_t> recv(static_cast<std::size_t>(p.recv_rows * kWords) + kWords, 0x5a5a5a5a);
  ex.forward(p, send.data(), recv.data(), kRowBytes, kCpu, nullptr);
  // Grouped by local expert, then source rank, each source's rows in its order.
  int bad = 0;
  o = 0;
  std::vector<int32_t> want(kWords);
  for (int l = 0; l < local_experts; ++l) {
    const int e = ex.ep_rank() * local_experts + l;
    for (int r = 0; r < ep; ++r) {
      for (int64_t j = 0; j < rows_of(group[r], e); ++j) {
        fill_row(want.data(), group[r], e, j);
        bad += std::memcmp(want.data(), &recv[(o++) * kWords], kRowBytes) != 0 ? 1 : 0;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "rows out of place after forward";
  EXPECT_EQ(recv[static_cast<std::size_t>(p.recv_rows * kWords)], 0x5a5a5a5a) << "wrote past";

  // The experts' answer: each row changed in a way that depends on where it sits, then sent
  // back with reverse; every sender must get its own rows, changed, in its own order.
  for (int64_t i = 0; i < p.recv_rows; ++i) recv[i * kWords + 4] += 7;
  std::vector<int32_t> back(static_cast<std::size_t>(sent * kWords) + kWords, 0x3c3c3c3c);
  ex.reverse(p, recv.data(), back.data(), kRowBytes, kCpu, nullptr);
  bad = 0;
  o = 0;
  for (int e = 0; e < E; ++e) {
    for (int64_t j = 0; j < rows_of(c.rank, e); ++j) {
      fill_row(want.data(), c.rank, e, j);
      want[4] += 7;
      bad += std::memcmp(want.data(), &back[(o++) * kWords], kRowBytes) != 0 ? 1 : 0;
    }
  }
  EXPECT_EQ(bad, 0) << "rows out of place after reverse";
  EXPECT_EQ(back[static_cast<std::size_t>(sent * kWords)], 0x3c3c3c3c) << "wrote past";

  // The small EP-group sums the layer uses (load per expert, dropless bounds).
  std::vector<int64_t> load(sc);
  ex.sum_ep(load.data(), E);
  int64_t biggest = 0;
  for (int e = 0; e < E; ++e) {
    int64_t s = 0;
    for (int w : group) s += rows_of(w, e);
    EXPECT_EQ(load[static_cast<std::size_t>(e)], s) << "sum_ep expert " << e;
  }
  for (int w : group) biggest = std::max<int64_t>(biggest, 100 + w);
  EXPECT_EQ(ex.max_ep(100 + c.rank), biggest);
}

TEST(MoeEpExchange, RoundTripWithUnequalCountsForEveryEpSize) {
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  for (int ep : divisors(c.size)) {
    for (int local : {1, 3}) round_trip(c, ep, local);
  }
}

// What world rank w holds in element i of gradient tensor k (small integers: every sum exact).
float grad(int w, int k, std::size_t i) {
  return static_cast<float>((static_cast<int>(i) * 3 + w * 5 + k) % 9 - 4);
}

TEST(MoeEpExchange, ReduceGradientsIsTheExpertDataParallelSumOverTheWorldSize) {
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  for (int ep : divisors(c.size)) {
    SCOPED_TRACE("ep " + std::to_string(ep));
    Exchange ex(c.vt, c.obj, ep);
    const std::size_t sizes[] = {5, 0, 70001};
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<DLTensor*> ts;
    for (int k = 0; k < 3; ++k) {
      bufs.push_back(std::make_unique<Buf>(Dt::kF32, sizes[k]));
      for (std::size_t i = 0; i < sizes[k]; ++i) bufs.back()->set(i, grad(c.rank, k, i));
      ts.push_back(&bufs.back()->t);
    }
    ex.reduce_gradients(ts.data(), static_cast<int64_t>(ts.size()), nullptr);
    for (int k = 0; k < 3; ++k) {
      std::size_t bad = 0;
      for (std::size_t i = 0; i < sizes[k]; ++i) {
        float sum = 0;  // the ranks with this rank's place in their expert-parallel group
        for (int w = c.rank % ep; w < c.size; w += ep) sum += grad(w, k, i);
        bad += bufs[k]->get(i) != sum / static_cast<float>(c.size) ? 1 : 0;
      }
      EXPECT_EQ(bad, 0U) << "tensor " << k;
    }
    // A bad tensor is refused before anything moves, naming it (every rank passes it).
    Buf ints(Dt::kF16, 4);
    DLTensor* bad_list[] = {ts[0], &ints.t};
    try {
      ex.reduce_gradients(bad_list, 2, nullptr);
      ADD_FAILURE() << "a float16 gradient was accepted";
    } catch (const loom::sdk::Error& e) {
      EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(e.what()).find("tensor 1"), std::string::npos) << e.what();
    }
  }
}

TEST(MoeEpExchange, BadConfigurationsAreRefusedNamingWhat) {
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  auto code_and_text = [](auto&& fn) -> std::pair<int, std::string> {
    try {
      fn();
    } catch (const loom::sdk::Error& e) {
      return {e.code(), e.what()};
    }
    return {LOOM_OK, ""};
  };
  // ep_size that does not divide the world: refused before any collective, on every rank.
  auto r = code_and_text([&] { Exchange ex(c.vt, c.obj, c.size + 1); });
  EXPECT_EQ(r.first, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.second.find("not a multiple of ep_size " + std::to_string(c.size + 1)),
            std::string::npos)
      << r.second;
  EXPECT_NE(r.second.find(std::to_string(c.size) + " ranks"), std::string::npos) << r.second;
  r = code_and_text([&] { Exchange ex(nullptr, nullptr, 2); });
  EXPECT_EQ(r.first, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.second.find("no comm"), std::string::npos) << r.second;
  // Experts that the group cannot hold evenly, and a negative count.
  Exchange ex(c.vt, c.obj, c.size);
  const std::vector<int64_t> counts(static_cast<std::size_t>(2 * c.size + 1), 1);
  if (c.size > 1) {
    r = code_and_text([&] { ex.plan(counts.data(), 2 * c.size + 1); });
    EXPECT_EQ(r.first, LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(r.second.find("num_experts " + std::to_string(2 * c.size + 1)), std::string::npos)
        << r.second;
  }
  std::vector<int64_t> neg(static_cast<std::size_t>(c.size), 1);
  neg.back() = -2;
  r = code_and_text([&] { ex.plan(neg.data(), c.size); });
  EXPECT_EQ(r.first, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.second.find("send_counts[" + std::to_string(c.size - 1) + "] is -2"),
            std::string::npos)
      << r.second;
  // Still usable after the refusals (nothing was sent).
  std::vector<int64_t> zero(static_cast<std::size_t>(c.size), 0);
  EXPECT_EQ(ex.plan(zero.data(), c.size).recv_rows, 0);
}

// Last in the file (the transport refuses collectives after a timeout): one rank never makes
// its call; the others' plan fails with DEADLINE_EXCEEDED within the comm's timeout instead
// of waiting forever.
TEST(MoeEpExchange, ZDeadRankGivesAnErrorWithinTheTimeout) {
  constexpr double kTimeout = 1.0;
  Comm c("timeout_s = 1.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  if (c.size == 1) GTEST_SKIP() << "needs two ranks";
  Exchange ex(c.vt, c.obj, c.size);
  if (c.rank == c.size - 1) {
    // Silent: stays alive (so its peers see silence, not a closed connection) until they
    // have given up, then leaves.
    std::this_thread::sleep_for(std::chrono::duration<double>(kTimeout + 1.5));
    return;
  }
  std::vector<int64_t> counts(static_cast<std::size_t>(c.size), 3);
  const auto t0 = std::chrono::steady_clock::now();
  int code = LOOM_OK;
  std::string text;
  try {
    ex.plan(counts.data(), c.size);
  } catch (const loom::sdk::Error& e) {
    code = e.code();
    text = e.what();
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(code, LOOM_ERR_DEADLINE_EXCEEDED) << text;
  EXPECT_NE(text.find("rank"), std::string::npos) << text;
  EXPECT_LT(s, kTimeout + 1.0);
}

}  // namespace
