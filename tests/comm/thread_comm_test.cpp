// The thread_comm test transport (tests/plugins/thread_comm) through the embedding API: 1-4
// ranks as threads of this process, each opening its own session. Every collective is
// checked bit for bit against a reference computed locally (so every rank holds the same
// bits), and so are the traffic counters; disagreements between ranks fail on every rank,
// a missing rank fails the others with DEADLINE_EXCEEDED, and onebit_adam over thread_comm
// + the onebit codec on 4 ranks equals adam during warmup and keeps the ranks identical
// after the freeze. The CUDA variant skips without a GPU.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/kinds/comm.h>
#include <loom/kinds/optimizer.h>
#include <loom/sdk/comm.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <latch>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/reduce.hpp"
#include "thread_comm_dir.hpp"

#if defined(LOOM_TEST_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

namespace hf = loom::plugins::reduce_ops;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A world name no other test uses.
std::string fresh_world() {
  static std::atomic<int> next{0};
  return "tw" + std::to_string(next++);
}

// Runs fn(rank) on n threads and joins them.
void on_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

std::string comm_section(const std::string& world, int rank, int size, double timeout_s) {
  return "[comm.c]\nplugin = \"thread_comm\"\nworld = \"" + world +
         "\"\nrank = " + std::to_string(rank) + "\nsize = " + std::to_string(size) +
         "\ntimeout_s = " + std::to_string(timeout_s) + "\n";
}

struct Result {
  int32_t code = LOOM_OK;
  std::string message;
  bool ok() const { return code == LOOM_OK; }
};

Result take(loom_status* st) {
  Result r;
  if (st != nullptr) {
    r.code = st->code;
    r.message = st->message != nullptr ? st->message : "";
    st->destroy(st);
  }
  return r;
}

// One rank: its own session with a thread_comm instance "c" (and whatever `extra` adds).
struct Rank {
  Rank(const std::string& world, int rank, int size, double timeout_s = 30,
       const std::string& extra = "") {
    const std::string toml = comm_section(world, rank, size, timeout_s) + extra;
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    const std::string dir = loom_test::thread_comm_dir();
    o.plugin_path = dir.c_str();
    o.log_level = -1;
    open_code = loom_open_string(toml.c_str(), "thread_comm_test.toml", &o, &s);
    if (open_code != LOOM_OK) {
      open_error = loom_last_error();
      s = nullptr;
      return;
    }
    loom_instance* c = nullptr;
    EXPECT_EQ(loom_find_instance(s, "loom.comm/1", "c", &c), LOOM_OK) << loom_last_error();
    comm = loom_instance_object(c);
    vt = static_cast<const loom_comm_v1*>(loom_instance_vtable(c));
  }
  ~Rank() { loom_close(s); }
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  bool opened() const { return s != nullptr && vt != nullptr; }

  Result allreduce(int32_t op, const DLTensor* send, DLTensor* recv, void* stream = nullptr) {
    loom_allreduce_args a{LOOM_ALLREDUCE_ARGS_SIZE, op, send, recv, stream};
    return take(vt->allreduce(comm, &a));
  }
  Result allgather(const DLTensor* send, DLTensor* recv, void* stream = nullptr) {
    loom_allgather_args a{LOOM_ALLGATHER_ARGS_SIZE, 0, send, recv, stream};
    return take(vt->allgather(comm, &a));
  }
  Result all_to_all(const DLTensor* send, DLTensor* recv, const int64_t* sc = nullptr,
                    const int64_t* rc = nullptr, void* stream = nullptr) {
    loom_all_to_all_args a{LOOM_ALL_TO_ALL_ARGS_SIZE, 0, send, recv, sc, rc, stream};
    return take(vt->all_to_all(comm, &a));
  }
  Result broadcast(int32_t root, DLTensor* t, void* stream = nullptr) {
    loom_broadcast_args a{LOOM_BROADCAST_ARGS_SIZE, root, t, stream};
    return take(vt->broadcast(comm, &a));
  }
  Result barrier() { return take(vt->barrier(comm, nullptr)); }
  loom_comm_stats stats() {
    loom_comm_stats st{};
    st.struct_size = LOOM_COMM_STATS_SIZE;
    EXPECT_TRUE(take(vt->stats(comm, &st)).ok());
    return st;
  }

  loom_session* s = nullptr;
  void* comm = nullptr;
  const loom_comm_v1* vt = nullptr;
  int32_t open_code = LOOM_OK;
  std::string open_error;
};

// ---- typed host buffers

enum class Dt { kF32, kF16, kBF16, kU8, kI32 };
DLDataType dl(Dt d) {
  switch (d) {
    case Dt::kF32:
      return {kDLFloat, 32, 1};
    case Dt::kF16:
      return {kDLFloat, 16, 1};
    case Dt::kBF16:
      return {kDLBfloat, 16, 1};
    case Dt::kU8:
      return {kDLUInt, 8, 1};
    case Dt::kI32:
      return {kDLInt, 32, 1};
  }
  return {};
}
std::size_t esize(Dt d) { return d == Dt::kF32 || d == Dt::kI32 ? 4 : d == Dt::kU8 ? 1 : 2; }
const char* dt_name(Dt d) {
  switch (d) {
    case Dt::kF32:
      return "f32";
    case Dt::kF16:
      return "f16";
    case Dt::kBF16:
      return "bf16";
    case Dt::kU8:
      return "u8";
    case Dt::kI32:
      return "i32";
  }
  return "?";
}

struct Buf {
  Buf(Dt d, std::size_t n) : dt(d), bytes(n * esize(d)), shape(static_cast<int64_t>(n)) {
    t.data = bytes.empty() ? nullptr : bytes.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = dl(d);
    t.shape = &shape;
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  std::size_t size() const { return static_cast<std::size_t>(shape); }
  void set(std::size_t i, float v) {
    if (dt == Dt::kF32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = dt == Dt::kF16 ? hf::f32_to_f16(v) : hf::f32_to_bf16(v);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  float get(std::size_t i) const {
    if (dt == Dt::kF32) {
      float v = 0;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      return v;
    }
    uint16_t h = 0;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return dt == Dt::kF16 ? hf::f16_to_f32(h) : hf::bf16_to_f32(h);
  }
  Dt dt;
  std::vector<unsigned char> bytes;
  int64_t shape;
  DLTensor t{};
};

// Rank r's input: random floats (rounded to the dtype), the same on every thread.
void fill(Buf& b, int rank, uint32_t salt) {
  std::mt19937 rng(1000u * salt + static_cast<uint32_t>(rank));
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  if (b.dt == Dt::kU8 || b.dt == Dt::kI32) {
    for (auto& x : b.bytes) x = static_cast<unsigned char>(rng());
    return;
  }
  for (std::size_t i = 0; i < b.size(); ++i) b.set(i, u(rng));
}

// The reduction the transport documents: rank order, fp32 accumulation, one rounding.
std::vector<unsigned char> reference_allreduce(Dt dt, int32_t op, std::size_t n, int p,
                                               uint32_t salt) {
  std::vector<float> acc(n);
  for (int r = 0; r < p; ++r) {
    Buf in(dt, n);
    fill(in, r, salt);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = in.get(i);
      if (r == 0) {
        acc[i] = x;
      } else if (op == LOOM_REDUCE_MAX) {
        acc[i] = std::max(acc[i], x);
      } else if (op == LOOM_REDUCE_MIN) {
        acc[i] = std::min(acc[i], x);
      } else {
        acc[i] = acc[i] + x;
      }
    }
  }
  if (op == LOOM_REDUCE_AVG) {
    for (float& x : acc) x /= static_cast<float>(p);
  }
  Buf out(dt, n);
  for (std::size_t i = 0; i < n; ++i) out.set(i, acc[i]);
  return out.bytes;
}

class ThreadComm : public ::testing::TestWithParam<int> {};

// ------------------------------------------------------------------ collectives

TEST_P(ThreadComm, AllreduceMatchesTheRankOrderReferenceBitForBit) {
  const int p = GetParam();
  const std::string world = fresh_world();
  on_threads(p, [&](int rank) {
    Rank c(world, rank, p);
    ASSERT_TRUE(c.opened()) << c.open_error;
    EXPECT_EQ(c.vt->rank(c.comm), rank);
    EXPECT_EQ(c.vt->size(c.comm), p);
    uint32_t salt = 0;
    for (Dt dt : {Dt::kF32, Dt::kF16, Dt::kBF16}) {
      for (int32_t op : {LOOM_REDUCE_SUM, LOOM_REDUCE_AVG, LOOM_REDUCE_MAX, LOOM_REDUCE_MIN}) {
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
          for (bool in_place : {false, true}) {
            ++salt;
            Buf in(dt, n);
            fill(in, rank, salt);
            Buf out(dt, n);
            const Result r =
                in_place ? c.allreduce(op, nullptr, &in.t) : c.allreduce(op, &in.t, &out.t);
            ASSERT_TRUE(r.ok()) << r.message;
            const auto want = reference_allreduce(dt, op, n, p, salt);
            EXPECT_EQ(in_place ? in.bytes : out.bytes, want)
                << dt_name(dt) << " op " << op << " n " << n << " in_place " << in_place << " rank "
                << rank;
          }
        }
      }
    }
  });
}

TEST_P(ThreadComm, AllgatherAllToAllBroadcastBarrier) {
  const int p = GetParam();
  const auto up = static_cast<std::size_t>(p);
  const std::string world = fresh_world();
  on_threads(p, [&](int rank) {
    Rank c(world, rank, p);
    ASSERT_TRUE(c.opened()) << c.open_error;
    const auto me = static_cast<std::size_t>(rank);
    // allgather: rank blocks in rank order, several dtypes and sizes.
    for (Dt dt : {Dt::kF32, Dt::kU8, Dt::kBF16}) {
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}}) {
        Buf in(dt, n);
        fill(in, rank, 77);
        Buf out(dt, n * up);
        ASSERT_TRUE(c.allgather(&in.t, &out.t).ok());
        for (int r = 0; r < p && n > 0; ++r) {  // (memcmp of empty buffers: null pointers)
          Buf want(dt, n);
          fill(want, r, 77);
          EXPECT_EQ(0,
                    std::memcmp(out.bytes.data() + static_cast<std::size_t>(r) * want.bytes.size(),
                                want.bytes.data(), want.bytes.size()))
              << "allgather " << dt_name(dt) << " n " << n << " block " << r;
        }
      }
    }
    // all_to_all, equal splits: element k of rank r's send is r * 1000 + k.
    {
      const std::size_t each = 3;
      std::vector<int32_t> send(each * up), recv(each * up, -1);
      for (std::size_t k = 0; k < send.size(); ++k) send[k] = rank * 1000 + static_cast<int32_t>(k);
      int64_t sshape = static_cast<int64_t>(send.size());
      DLTensor ts{send.data(), {kDLCPU, 0}, 1, dl(Dt::kI32), &sshape, nullptr, 0};
      DLTensor tr{recv.data(), {kDLCPU, 0}, 1, dl(Dt::kI32), &sshape, nullptr, 0};
      ASSERT_TRUE(c.all_to_all(&ts, &tr).ok());
      for (std::size_t r = 0; r < up; ++r) {
        for (std::size_t k = 0; k < each; ++k) {
          EXPECT_EQ(recv[r * each + k], static_cast<int32_t>(r * 1000 + me * each + k));
        }
      }
    }
    // all_to_all, variable splits: rank r sends (r + j) % 3 elements to rank j (some zero).
    {
      auto cnt = [](std::size_t from, std::size_t to) {
        return static_cast<int64_t>((from + to) % 3);
      };
      std::vector<int64_t> sc(up), rc(up);
      int64_t ns = 0, nr = 0;
      for (std::size_t j = 0; j < up; ++j) {
        sc[j] = cnt(me, j);
        rc[j] = cnt(j, me);
        ns += sc[j];
        nr += rc[j];
      }
      std::vector<int32_t> send(static_cast<std::size_t>(ns) + 2),
          recv(static_cast<std::size_t>(nr) + 1, -7);
      // Element k of what rank r sends to rank j: r * 10000 + j * 100 + k.
      std::size_t at = 0;
      for (std::size_t j = 0; j < up; ++j) {
        for (int64_t k = 0; k < sc[j]; ++k) {
          send[at++] = static_cast<int32_t>(me * 10000 + j * 100 + static_cast<std::size_t>(k));
        }
      }
      int64_t sshape = static_cast<int64_t>(send.size());
      int64_t rshape = static_cast<int64_t>(recv.size());
      DLTensor ts{send.data(), {kDLCPU, 0}, 1, dl(Dt::kI32), &sshape, nullptr, 0};
      DLTensor tr{recv.data(), {kDLCPU, 0}, 1, dl(Dt::kI32), &rshape, nullptr, 0};
      const Result r = c.all_to_all(&ts, &tr, sc.data(), rc.data());
      ASSERT_TRUE(r.ok()) << r.message;
      at = 0;
      for (std::size_t i = 0; i < up; ++i) {
        for (int64_t k = 0; k < rc[i]; ++k) {
          EXPECT_EQ(recv[at++],
                    static_cast<int32_t>(i * 10000 + me * 100 + static_cast<std::size_t>(k)));
        }
      }
      EXPECT_EQ(recv.back(), -7);  // past the counts: untouched
    }
    // broadcast from every root.
    for (int root = 0; root < p; ++root) {
      Buf b(Dt::kF32, 33);
      fill(b, rank, 5);
      ASSERT_TRUE(c.broadcast(root, &b.t).ok());
      Buf want(Dt::kF32, 33);
      fill(want, root, 5);
      EXPECT_EQ(b.bytes, want.bytes) << "broadcast root " << root;
    }
    EXPECT_TRUE(c.barrier().ok());
  });
}

// The traffic counters follow the rule documented in thread_comm.cpp.
TEST_P(ThreadComm, StatsCountRingAndPairwiseTraffic) {
  const int p = GetParam();
  const auto up = static_cast<uint64_t>(p);
  const std::string world = fresh_world();
  on_threads(p, [&](int rank) {
    Rank c(world, rank, p);
    ASSERT_TRUE(c.opened()) << c.open_error;
    loom_comm_stats last = c.stats();
    EXPECT_EQ(last.bytes_sent, 0u);
    EXPECT_EQ(last.rounds, 0u);
    auto expect_delta = [&](uint64_t sent, uint64_t received, const char* what) {
      const loom_comm_stats now = c.stats();
      EXPECT_EQ(now.bytes_sent - last.bytes_sent, sent) << what << " rank " << rank;
      EXPECT_EQ(now.bytes_received - last.bytes_received, received) << what << " rank " << rank;
      EXPECT_EQ(now.rounds - last.rounds, 1u) << what;
      last = now;
    };
    Buf x(Dt::kF32, 1001);  // 4004 bytes
    ASSERT_TRUE(c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t).ok());
    expect_delta(2 * (up - 1) * 4004 / up, 2 * (up - 1) * 4004 / up, "allreduce");
    Buf g(Dt::kF32, 10), go(Dt::kF32, 10 * up);
    ASSERT_TRUE(c.allgather(&g.t, &go.t).ok());
    expect_delta((up - 1) * 40, (up - 1) * 40, "allgather");
    Buf a(Dt::kF32, 3 * up), ao(Dt::kF32, 3 * up);
    ASSERT_TRUE(c.all_to_all(&a.t, &ao.t).ok());
    expect_delta((up - 1) * 12, (up - 1) * 12, "all_to_all");
    Buf b(Dt::kU8, 100);
    const int root = 1 % p;
    ASSERT_TRUE(c.broadcast(root, &b.t).ok());
    const int k = (rank - root + p) % p;
    expect_delta(k < p - 1 ? 100 : 0, k > 0 ? 100 : 0, "broadcast");
    ASSERT_TRUE(c.barrier().ok());
    expect_delta(0, 0, "barrier");
    // A failed call counts nothing.
    Buf bad(Dt::kI32, 4);
    EXPECT_EQ(c.allreduce(LOOM_REDUCE_SUM, nullptr, &bad.t).code, LOOM_ERR_UNIMPLEMENTED);
    const loom_comm_stats after = c.stats();
    EXPECT_EQ(after.rounds, last.rounds);
    EXPECT_EQ(after.bytes_sent, last.bytes_sent);
  });
}

// ------------------------------------------------------------------ errors

TEST_P(ThreadComm, DisagreementsFailOnEveryRankAndLeaveTheWorldUsable) {
  const int p = GetParam();
  const auto up = static_cast<std::size_t>(p);
  const std::string world = fresh_world();
  on_threads(p, [&](int rank) {
    Rank c(world, rank, p, /*timeout_s=*/30);
    ASSERT_TRUE(c.opened()) << c.open_error;
    const auto t0 = Clock::now();
    // The last rank has one more element.
    Buf x(Dt::kF32, rank == p - 1 ? 11 : 10);
    Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
    EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("disagree"), std::string::npos) << r.message;
    // A different collective on rank 0.
    Buf y(Dt::kF32, 4);
    r = rank == 0 ? c.barrier() : c.allreduce(LOOM_REDUCE_SUM, nullptr, &y.t);
    EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT) << r.message;
    // Broadcast roots that differ.
    r = c.broadcast(rank == 0 ? 0 : p - 1, &y.t);
    EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT) << r.message;
    // all_to_all counts that do not match: rank 0 sends one element more to the last rank.
    {
      std::vector<int64_t> sc(up, 1), rc(up, 1);
      if (rank == 0) sc[up - 1] = 2;
      Buf s(Dt::kF32, up + 1), o(Dt::kF32, up + 1);
      r = c.all_to_all(&s.t, &o.t, sc.data(), rc.data());
      EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT) << r.message;
      EXPECT_NE(r.message.find("expects"), std::string::npos) << r.message;
    }
    // One rank's own argument error (an op that does not exist) fails everywhere.
    r = c.allreduce(rank == p - 1 ? 7 : LOOM_REDUCE_SUM, nullptr, &y.t);
    EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT) << r.message;
    if (rank != p - 1) {
      EXPECT_NE(r.message.find("rank " + std::to_string(p - 1) + "'s allreduce failed"),
                std::string::npos)
          << r.message;
    }
    // Unsupported dtype and a bad root: the same on every rank.
    Buf i32(Dt::kI32, 4);
    EXPECT_EQ(c.allreduce(LOOM_REDUCE_SUM, nullptr, &i32.t).code, LOOM_ERR_UNIMPLEMENTED);
    EXPECT_EQ(c.broadcast(p, &y.t).code, LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_LT(seconds_since(t0), 10.0);  // nobody waited for the 30 s timeout
    // Still in step: a good call works.
    Buf z(Dt::kF32, 5);
    for (std::size_t i = 0; i < 5; ++i) z.set(i, static_cast<float>(rank));
    r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &z.t);
    ASSERT_TRUE(r.ok()) << r.message;
    EXPECT_EQ(z.get(4), static_cast<float>(p * (p - 1) / 2));
  });
}

TEST_P(ThreadComm, SizeDisagreementAtOpenFailsEveryRank) {
  const int p = GetParam();
  const std::string world = fresh_world();
  std::atomic<int> failed{0};
  const auto t0 = Clock::now();
  on_threads(p, [&](int rank) {
    Rank c(world, rank, rank == p - 1 ? p + 1 : p, /*timeout_s=*/30);
    EXPECT_FALSE(c.opened());
    EXPECT_EQ(c.open_code, LOOM_ERR_INVALID_ARGUMENT) << c.open_error;
    EXPECT_NE(c.open_error.find("size"), std::string::npos) << c.open_error;
    if (!c.opened()) ++failed;
  });
  EXPECT_EQ(failed.load(), p);
  EXPECT_LT(seconds_since(t0), 10.0);
}

TEST_P(ThreadComm, DuplicateRankAtOpenFailsEveryRank) {
  const int p = GetParam();
  const std::string world = fresh_world();
  on_threads(p, [&](int rank) {
    Rank c(world, rank == 1 ? 0 : rank, p, /*timeout_s=*/30);
    EXPECT_FALSE(c.opened());
    EXPECT_EQ(c.open_code, LOOM_ERR_INVALID_ARGUMENT) << c.open_error;
  });
}

TEST_P(ThreadComm, MissingRankAtOpenGivesDeadlineExceeded) {
  const int p = GetParam();
  const std::string world = fresh_world();
  on_threads(p - 1, [&](int rank) {
    const auto t0 = Clock::now();
    Rank c(world, rank, p, /*timeout_s=*/0.5);
    const double waited = seconds_since(t0);
    EXPECT_FALSE(c.opened());
    EXPECT_EQ(c.open_code, LOOM_ERR_DEADLINE_EXCEEDED) << c.open_error;
    EXPECT_NE(c.open_error.find("rank(s) " + std::to_string(p - 1)), std::string::npos)
        << c.open_error;
    EXPECT_GE(waited, 0.45);
    EXPECT_LT(waited, 5.0);
  });
  // The world was removed with its last instance: the name works again.
  on_threads(p, [&](int rank) {
    Rank c(world, rank, p);
    EXPECT_TRUE(c.opened()) << c.open_error;
    if (c.opened()) {
      EXPECT_TRUE(c.barrier().ok());
    }
  });
}

TEST_P(ThreadComm, SilentRankGivesDeadlineExceededThenTheInstanceRefuses) {
  const int p = GetParam();
  const std::string world = fresh_world();
  std::latch others_done(p - 1);
  on_threads(p, [&](int rank) {
    Rank c(world, rank, p, /*timeout_s=*/2);
    ASSERT_TRUE(c.opened()) << c.open_error;
    if (rank == p - 1) {  // never makes the call, but keeps its instance until the end
      others_done.wait();
      return;
    }
    Buf x(Dt::kF32, 8);
    const auto t0 = Clock::now();
    const Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
    const double waited = seconds_since(t0);
    EXPECT_EQ(r.code, LOOM_ERR_DEADLINE_EXCEEDED) << r.message;
    EXPECT_NE(r.message.find("rank(s) " + std::to_string(p - 1)), std::string::npos) << r.message;
    EXPECT_GE(waited, 1.9);
    EXPECT_LT(waited, 6.0);
    EXPECT_EQ(c.barrier().code, LOOM_ERR_FAILED_PRECONDITION);
    others_done.count_down();
  });
}

TEST_P(ThreadComm, RankThatClosesFailsTheOthersFast) {
  const int p = GetParam();
  const std::string world = fresh_world();
  on_threads(p, [&](int rank) {
    Rank c(world, rank, p, /*timeout_s=*/30);
    ASSERT_TRUE(c.opened()) << c.open_error;
    if (rank == p - 1) return;  // closes its session without the call
    const auto t0 = Clock::now();
    EXPECT_EQ(c.barrier().code, LOOM_ERR_UNAVAILABLE);
    EXPECT_LT(seconds_since(t0), 10.0);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ThreadComm, ::testing::Values(2, 3, 4), [](const auto& param_info) {
  return "np" + std::to_string(param_info.param);
});

// Process groups need a plugin that has them: thread_comm (SDK, no split method) and probe
// (a raw C plugin whose table is a 1.1 one) both give UNIMPLEMENTED naming the instance,
// through the embedding API and through the SDK's helper; the SDK's args-struct helpers
// fall back to the 1.0 entries of the 1.1 table.
TEST(ThreadCommAlone, SplitIsUnimplementedForPluginsWithoutProcessGroups) {
  const std::string dir = loom_test::thread_comm_dir();
  if (!std::filesystem::exists(std::filesystem::path(dir) / "loom_probe.so")) {
    GTEST_SKIP() << "the probe test plugin is not beside loom_thread_comm.so";
  }
  Rank c(fresh_world(), 0, 1, 30, "\n[comm.p]\nplugin = \"probe\"\n");
  ASSERT_TRUE(c.opened()) << c.open_error;
  for (const char* name : {"c", "p"}) {
    SCOPED_TRACE(name);
    loom_instance* inst = nullptr;
    ASSERT_EQ(loom_find_instance(c.s, "comm", name, &inst), LOOM_OK) << loom_last_error();
    loom_instance* sub = inst;
    EXPECT_EQ(loom_comm_split(inst, 0, 0, &sub), LOOM_ERR_UNIMPLEMENTED);
    EXPECT_EQ(sub, nullptr);
    const std::string error = loom_last_error();
    EXPECT_NE(error.find(std::string("comm.") + name + " (plugin"), std::string::npos) << error;
    EXPECT_NE(error.find("no process groups"), std::string::npos) << error;
    const loom::sdk::InstanceRef<loom_comm_v1> ref(
        name, loom_instance_object(inst),
        static_cast<const loom_comm_v1*>(loom_instance_vtable(inst)));
    try {
      (void)loom::sdk::comm_split(ref, 0, 0);
      ADD_FAILURE() << "comm_split did not throw";
    } catch (const loom::sdk::Error& e) {
      EXPECT_EQ(e.code(), LOOM_ERR_UNIMPLEMENTED);
      EXPECT_NE(std::string(e.what()).find(std::string("instance '") + name + "'"),
                std::string::npos)
          << e.what();
    }
    // barrier / supports_device through whichever entry the table has.
    EXPECT_NO_THROW(loom::sdk::comm_barrier(ref, nullptr));
    EXPECT_TRUE(loom::sdk::comm_supports_device(ref, DLDevice{kDLCPU, 0}));
  }
  loom_instance* probe = nullptr;
  ASSERT_EQ(loom_find_instance(c.s, "comm", "p", &probe), LOOM_OK);
  const auto* pvt = static_cast<const loom_comm_v1*>(loom_instance_vtable(probe));
  EXPECT_EQ(pvt->struct_size, LOOM_STRUCT_SIZE(loom_comm_v1, native_handle));
  EXPECT_FALSE(loom::sdk::comm_provides(pvt, &loom_comm_v1::barrier2));
  EXPECT_TRUE(loom::sdk::comm_provides(c.vt, &loom_comm_v1::barrier2));  // the SDK's table
}

TEST(ThreadCommAlone, AWorldOfOneCopiesAndMovesNoBytes) {
  Rank c(fresh_world(), 0, 1);
  ASSERT_TRUE(c.opened()) << c.open_error;
  EXPECT_EQ(c.vt->supports_device(c.comm, DLDevice{kDLCPU, 0}), 1);
  EXPECT_EQ(c.vt->supports_device(c.comm, DLDevice{kDLROCM, 0}), 0);
  Buf x(Dt::kF32, 5), y(Dt::kF32, 5);
  fill(x, 0, 3);
  ASSERT_TRUE(c.allreduce(LOOM_REDUCE_AVG, &x.t, &y.t).ok());
  EXPECT_EQ(x.bytes, y.bytes);
  ASSERT_TRUE(c.allgather(&x.t, &y.t).ok());
  EXPECT_EQ(x.bytes, y.bytes);
  ASSERT_TRUE(c.broadcast(0, &x.t).ok());
  ASSERT_TRUE(c.barrier().ok());
  const loom_comm_stats st = c.stats();
  EXPECT_EQ(st.bytes_sent, 0u);
  EXPECT_EQ(st.bytes_received, 0u);
  EXPECT_EQ(st.rounds, 4u);
  // rank outside the world
  Rank bad(fresh_world(), 1, 1);
  EXPECT_EQ(bad.open_code, LOOM_ERR_INVALID_ARGUMENT) << bad.open_error;
}

// ------------------------------------------------------------------ end to end

// One optimizer step on fp32 CPU tensors.
int32_t step(loom_instance* opt, std::vector<std::vector<float>*> params,
             std::vector<std::vector<float>*> grads, double lr, int64_t t) {
  std::vector<int64_t> shapes(params.size());
  std::vector<DLTensor> tp(params.size()), tg(params.size());
  std::vector<loom_optimizer_tensor> ts(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    shapes[i] = static_cast<int64_t>(params[i]->size());
    tp[i] = DLTensor{params[i]->data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shapes[i], nullptr, 0};
    tg[i] = tp[i];
    tg[i].data = grads[i]->data();
    ts[i] = {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp[i], &tg[i], nullptr};
  }
  loom_optimizer_group g{LOOM_OPTIMIZER_GROUP_SIZE, 0, ts.data(), ts.size(), 1.0, NAN};
  loom_optimizer_step_args a{LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, &g, 1, lr, 1.0, t, nullptr};
  return loom_optimizer_step(opt, &a);
}

// Rank-dependent gradients of a quadratic: g = x - target_r + noise_r(t).
void gradient(const std::vector<float>& x, int rank, int t, std::size_t salt,
              std::vector<float>* g) {
  g->resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double target = std::sin(0.37 * static_cast<double>(i + salt) + rank);
    const double noise =
        0.1 * std::cos(1.3 * static_cast<double>(t) + static_cast<double>(i) + rank);
    (*g)[i] = static_cast<float>(x[i] - target + noise);
  }
}

TEST(ThreadCommEndToEnd, OnebitAdamOnFourThreadRanksEqualsAdamInWarmupAndStaysInStep) {
  constexpr int kRanks = 4;
  constexpr int kFreeze = 3;
  constexpr int kSteps = 12;
  const std::string world = fresh_world();
  on_threads(kRanks, [&](int rank) {
    Rank c(world, rank, kRanks, 60,
           "[codec.k]\nplugin = \"onebit\"\n"
           "[optimizer.o]\nplugin = \"onebit_adam\"\ncomm = \"c\"\ncodec = \"k\"\n"
           "freeze_step = " +
               std::to_string(kFreeze) +
               "\n"
               "[optimizer.adam]\nplugin = \"adam\"\n");
    ASSERT_TRUE(c.opened()) << c.open_error;
    loom_instance* ob = nullptr;
    loom_instance* ad = nullptr;
    ASSERT_EQ(loom_find_instance(c.s, "loom.optimizer/1", "o", &ob), LOOM_OK);
    ASSERT_EQ(loom_find_instance(c.s, "loom.optimizer/1", "adam", &ad), LOOM_OK);
    // Two tensors (one of odd length), the same start on every rank.
    std::vector<float> a0(32, 0.25f), a1(17, -0.5f), b0 = a0, b1 = a1, g0, g1, h0, h1;
    auto average = [&](std::vector<float>& v) {
      int64_t shape = static_cast<int64_t>(v.size());
      DLTensor t{v.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
      const Result r = c.allreduce(LOOM_REDUCE_AVG, nullptr, &t);
      ASSERT_TRUE(r.ok()) << r.message;
    };
    const uint64_t rounds_before = c.stats().rounds;
    for (int t = 1; t <= kSteps; ++t) {
      gradient(a0, rank, t, 0, &g0);
      gradient(a1, rank, t, 100, &g1);
      ASSERT_EQ(step(ob, {&a0, &a1}, {&g0, &g1}, 1e-2, t), LOOM_OK) << loom_last_error();
      gradient(b0, rank, t, 0, &h0);
      gradient(b1, rank, t, 100, &h1);
      average(h0);
      average(h1);
      ASSERT_EQ(step(ad, {&b0, &b1}, {&h0, &h1}, 1e-2, t), LOOM_OK) << loom_last_error();
      if (t <= kFreeze) {
        ASSERT_EQ(0, std::memcmp(a0.data(), b0.data(), a0.size() * 4)) << "warmup step " << t;
        ASSERT_EQ(0, std::memcmp(a1.data(), b1.data(), a1.size() * 4)) << "warmup step " << t;
      }
    }
    // Compression was on after the freeze: onebit_adam left plain adam's trajectory.
    EXPECT_NE(0, std::memcmp(a0.data(), b0.data(), a0.size() * 4));
    // The optimizer communicated through this comm (warmup allreduces and compressed steps).
    EXPECT_GT(c.stats().rounds - rounds_before, static_cast<uint64_t>(2 * kSteps));
    loom_optimizer_comm_info info{};
    info.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
    ASSERT_EQ(loom_optimizer_get_comm_info(ob, &info), LOOM_OK) << loom_last_error();
    EXPECT_EQ(info.owns_communication, 1);
    EXPECT_GT(info.rounds, static_cast<uint64_t>(kSteps));
    // After the freeze the parameters are identical on every rank.
    for (std::vector<float>* v : {&a0, &a1}) {
      std::vector<float> all(v->size() * kRanks);
      int64_t s1 = static_cast<int64_t>(v->size()), s2 = static_cast<int64_t>(all.size());
      DLTensor ts{v->data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &s1, nullptr, 0};
      DLTensor tr{all.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &s2, nullptr, 0};
      ASSERT_TRUE(c.allgather(&ts, &tr).ok());
      for (int r = 0; r < kRanks; ++r) {
        EXPECT_EQ(0, std::memcmp(all.data() + static_cast<std::size_t>(r) * v->size(), v->data(),
                                 v->size() * 4))
            << "rank " << rank << " differs from rank " << r;
      }
    }
  });
}

// ------------------------------------------------------------------ CUDA

#if defined(LOOM_TEST_CUDA)
bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

// A device copy of a host Buf, on `stream`.
struct DevBuf {
  DevBuf(const Buf& h, cudaStream_t s) : bytes(h.bytes.size()), shape(h.shape) {
    if (bytes != 0) {
      EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
      EXPECT_EQ(cudaMemcpyAsync(ptr, h.bytes.data(), bytes, cudaMemcpyHostToDevice, s),
                cudaSuccess);
    }
    t.data = ptr;
    t.device = DLDevice{kDLCUDA, 0};
    t.ndim = 1;
    t.dtype = h.t.dtype;
    t.shape = &shape;
  }
  ~DevBuf() { cudaFree(ptr); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  std::vector<unsigned char> host(cudaStream_t s) const {
    std::vector<unsigned char> out(bytes);
    if (bytes != 0) {
      EXPECT_EQ(cudaMemcpyAsync(out.data(), ptr, bytes, cudaMemcpyDeviceToHost, s), cudaSuccess);
    }
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    return out;
  }
  void* ptr = nullptr;
  std::size_t bytes;
  int64_t shape;
  DLTensor t{};
};

TEST(ThreadCommCuda, CollectivesOnDeviceMemoryMatchTheHostReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (int p : {2, 4}) {
    const auto up = static_cast<std::size_t>(p);
    const std::string world = fresh_world();
    on_threads(p, [&](int rank) {
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      cudaStream_t s = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
      {
        Rank c(world, rank, p);
        ASSERT_TRUE(c.opened()) << c.open_error;
        EXPECT_EQ(c.vt->supports_device(c.comm, DLDevice{kDLCUDA, 0}), 1);
        uint32_t salt = 500;
        for (Dt dt : {Dt::kF32, Dt::kF16, Dt::kBF16}) {
          for (int32_t op : {LOOM_REDUCE_SUM, LOOM_REDUCE_AVG, LOOM_REDUCE_MAX}) {
            for (bool in_place : {false, true}) {
              ++salt;
              Buf in(dt, 1000);
              fill(in, rank, salt);
              DevBuf din(in, s);
              Buf zero(dt, 1000);
              DevBuf dout(zero, s);
              const Result r = in_place ? c.allreduce(op, nullptr, &din.t, s)
                                        : c.allreduce(op, &din.t, &dout.t, s);
              ASSERT_TRUE(r.ok()) << r.message;
              EXPECT_EQ((in_place ? din : dout).host(s), reference_allreduce(dt, op, 1000, p, salt))
                  << dt_name(dt) << " op " << op << " in_place " << in_place;
            }
          }
        }
        // allgather
        Buf g(Dt::kF32, 9);
        fill(g, rank, 900);
        Buf go(Dt::kF32, 9 * up);
        DevBuf dg(g, s), dgo(go, s);
        ASSERT_TRUE(c.allgather(&dg.t, &dgo.t, s).ok());
        const auto got = dgo.host(s);
        for (int r = 0; r < p; ++r) {
          Buf want(Dt::kF32, 9);
          fill(want, r, 900);
          EXPECT_EQ(
              0, std::memcmp(got.data() + static_cast<std::size_t>(r) * 36, want.bytes.data(), 36));
        }
        // all_to_all (equal splits), device to device
        std::vector<int32_t> send(2 * up);
        for (std::size_t k = 0; k < send.size(); ++k)
          send[k] = rank * 1000 + static_cast<int32_t>(k);
        Buf hs(Dt::kI32, send.size());
        std::memcpy(hs.bytes.data(), send.data(), hs.bytes.size());
        Buf hr(Dt::kI32, send.size());
        DevBuf ds(hs, s), dr(hr, s);
        ASSERT_TRUE(c.all_to_all(&ds.t, &dr.t, nullptr, nullptr, s).ok());
        const auto recv = dr.host(s);
        for (std::size_t r = 0; r < up; ++r) {
          for (std::size_t k = 0; k < 2; ++k) {
            int32_t v = 0;
            std::memcpy(&v, recv.data() + 4 * (r * 2 + k), 4);
            EXPECT_EQ(v, static_cast<int32_t>(r * 1000 + static_cast<std::size_t>(rank) * 2 + k));
          }
        }
        // broadcast from the last rank
        Buf b(Dt::kBF16, 17);
        fill(b, rank, 901);
        DevBuf db(b, s);
        ASSERT_TRUE(c.broadcast(p - 1, &db.t, s).ok());
        Buf want(Dt::kBF16, 17);
        fill(want, p - 1, 901);
        EXPECT_EQ(db.host(s), want.bytes);
        EXPECT_TRUE(take(c.vt->barrier(c.comm, s)).ok());
      }
      cudaStreamDestroy(s);
    });
  }
}
#endif

}  // namespace
