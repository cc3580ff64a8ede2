// The process's thread pool (host/src/thread_pool.cpp) through the embedding API
// (loom_parallel_for, loom_thread_count, loom_set_thread_count), and an SDK plugin's
// loom::sdk::parallel_for running on it (tests/plugins/pool_probe): through libloom, through
// a host table of its own, and inline under a 1.1 host that has no pool.
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/kinds/optimizer.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;

using Block = std::pair<size_t, size_t>;
using BlockFn = std::function<void(size_t, size_t)>;

void run_fn(void* ctx, size_t begin, size_t end) { (*static_cast<BlockFn*>(ctx))(begin, end); }

int32_t pool_for(size_t n, size_t grain, BlockFn fn) {
  return loom_parallel_for(n, grain, &run_fn, &fn);
}

// The blocks one call made, sorted, with the thread that ran each.
struct Calls {
  std::vector<Block> blocks;
  std::vector<pid_t> threads;
};

Calls record(size_t n, size_t grain) {
  Calls c;
  std::mutex mu;
  EXPECT_EQ(pool_for(n, grain,
                     [&](size_t b, size_t e) {
                       const std::lock_guard<std::mutex> lock(mu);
                       c.blocks.emplace_back(b, e);
                       c.threads.push_back(gettid());
                     }),
            LOOM_OK)
      << loom_last_error();
  std::sort(c.blocks.begin(), c.blocks.end());
  return c;
}

// The pool's threads (the caller's included): with as many one-element blocks as threads,
// worker i runs block i, so every thread runs one.
std::set<pid_t> pool_threads() {
  const Calls c = record(loom_thread_count(), 1);
  return {c.threads.begin(), c.threads.end()};
}

class PoolTest : public ::testing::Test {
 protected:
  void TearDown() override {
    ::unsetenv("LOOM_NUM_THREADS");
    ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    EXPECT_EQ(loom_set_thread_count(0), LOOM_OK);
  }
};

TEST_F(PoolTest, BlocksAreDisjointGrainAlignedAndCoverTheRange) {
  for (const size_t threads : std::initializer_list<size_t>{1, 2, 3, 4, 7}) {
    ASSERT_EQ(loom_set_thread_count(threads), LOOM_OK) << loom_last_error();
    ASSERT_EQ(loom_thread_count(), threads);
    for (const size_t n : std::initializer_list<size_t>{1, 2, 5, 63, 64, 65, 1000, 4097}) {
      for (const size_t grain : std::initializer_list<size_t>{0, 1, 3, 64, 1000}) {
        SCOPED_TRACE("threads " + std::to_string(threads) + " n " + std::to_string(n) + " grain " +
                     std::to_string(grain));
        const size_t g = std::max<size_t>(grain, 1);
        const Calls c = record(n, grain);
        ASSERT_FALSE(c.blocks.empty());
        EXPECT_LE(c.blocks.size(), threads);
        size_t next = 0;
        for (const auto& [b, e] : c.blocks) {
          EXPECT_EQ(b, next) << "a gap or an overlap";
          EXPECT_LT(b, e) << "an empty block";
          EXPECT_EQ(b % g, 0U) << "block " << b << " does not begin at a multiple of the grain";
          next = e;
        }
        EXPECT_EQ(next, n);
        // More than one grain-sized block and more than one thread: the work is split.
        if (threads > 1 && n > g) {
          EXPECT_GE(c.blocks.size(), 2U);
        }
      }
    }
  }
}

TEST_F(PoolTest, EveryIndexRunsExactlyOnce) {
  ASSERT_EQ(loom_set_thread_count(3), LOOM_OK);
  std::vector<std::atomic<int>> visits(100000);
  ASSERT_EQ(pool_for(visits.size(), 16,
                     [&](size_t b, size_t e) {
                       for (size_t i = b; i < e; ++i) visits[i].fetch_add(1);
                     }),
            LOOM_OK);
  for (size_t i = 0; i < visits.size(); ++i) ASSERT_EQ(visits[i].load(), 1) << "index " << i;
}

TEST_F(PoolTest, TheCallerRunsTheFirstBlockAndWorkersTheRest) {
  ASSERT_EQ(loom_set_thread_count(4), LOOM_OK);
  const Calls c = record(4, 1);
  ASSERT_EQ(c.blocks.size(), 4U);
  const std::set<pid_t> distinct(c.threads.begin(), c.threads.end());
  EXPECT_EQ(distinct.size(), 4U);
  EXPECT_EQ(distinct.count(gettid()), 1U);
  // The same persistent threads every time.
  EXPECT_EQ(pool_threads(), distinct);
  EXPECT_EQ(pool_threads(), distinct);
  // Nothing to split: one block, on the caller.
  const Calls one = record(10, 10);
  ASSERT_EQ(one.blocks.size(), 1U);
  EXPECT_EQ(one.threads[0], gettid());
}

TEST_F(PoolTest, NestedCallsRunInlineOnTheBlocksThread) {
  ASSERT_EQ(loom_set_thread_count(4), LOOM_OK);
  std::atomic<int> wrong{0};
  std::atomic<int> outer{0};
  std::atomic<int> resize_refused{0};
  ASSERT_EQ(pool_for(4, 1,
                     [&](size_t b, size_t /*e*/) {
                       outer.fetch_add(1);
                       const pid_t me = gettid();
                       int calls = 0;
                       const int32_t rc = pool_for(1000, 1, [&](size_t nb, size_t ne) {
                         ++calls;
                         if (gettid() != me || nb != 0 || ne != 1000) wrong.fetch_add(1);
                       });
                       if (rc != LOOM_OK || calls != 1) wrong.fetch_add(1);
                       if (b == 0 && loom_set_thread_count(2) == LOOM_ERR_FAILED_PRECONDITION &&
                           std::string(loom_last_error()).find("inside a parallel_for body") !=
                               std::string::npos) {
                         resize_refused.fetch_add(1);
                       }
                     }),
            LOOM_OK);
  EXPECT_EQ(outer.load(), 4);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(resize_refused.load(), 1);
  EXPECT_EQ(loom_thread_count(), 4U);  // the refused resize changed nothing
}

TEST_F(PoolTest, ConcurrentCallersFromSeveralThreadsEachGetTheirWholeRange) {
  ASSERT_EQ(loom_set_thread_count(3), LOOM_OK);
  constexpr int kCallers = 4;
  constexpr int kRounds = 200;
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      std::vector<int> visits(997 + static_cast<size_t>(c) * 13);
      for (int r = 0; r < kRounds; ++r) {
        std::fill(visits.begin(), visits.end(), 0);
        // Blocks are disjoint, so plain ints are written by one thread each.
        if (pool_for(visits.size(), 7, [&](size_t b, size_t e) {
              for (size_t i = b; i < e; ++i) ++visits[i];
            }) != LOOM_OK) {
          wrong.fetch_add(1);
        }
        for (const int v : visits) {
          if (v != 1) wrong.fetch_add(1);
        }
      }
    });
  }
  // And the pool resized under them: a resize waits for the call in progress.
  std::thread resizer([&] {
    for (int r = 0; r < 20; ++r) {
      if (loom_set_thread_count(2 + static_cast<size_t>(r % 3)) != LOOM_OK) wrong.fetch_add(1);
      std::this_thread::yield();
    }
  });
  for (auto& t : callers) t.join();
  resizer.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST_F(PoolTest, ThreadCountComesFromLoomNumThreads) {
  ::setenv("LOOM_NUM_THREADS", "1", 1);
  ASSERT_EQ(loom_set_thread_count(0), LOOM_OK);
  EXPECT_EQ(loom_thread_count(), 1U);
  const Calls one = record(1000, 1);  // one thread: everything inline on the caller
  ASSERT_EQ(one.blocks.size(), 1U);
  EXPECT_EQ(one.blocks[0], Block(0, 1000));
  EXPECT_EQ(one.threads[0], gettid());

  ::setenv("LOOM_NUM_THREADS", "3", 1);
  ASSERT_EQ(loom_set_thread_count(0), LOOM_OK);
  EXPECT_EQ(loom_thread_count(), 3U);
  EXPECT_EQ(pool_threads().size(), 3U);

  // Without it (or with a value that is not a count): the cores shared among the local
  // ranks; 100000 ranks on this machine leave one thread each.
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "100000", 1);
  for (const char* bad : {"0", "-2", "abc", "3x", "100000"}) {
    ::setenv("LOOM_NUM_THREADS", bad, 1);
    ASSERT_EQ(loom_set_thread_count(0), LOOM_OK);
    EXPECT_EQ(loom_thread_count(), 1U) << "LOOM_NUM_THREADS=" << bad;
  }
  ::unsetenv("LOOM_NUM_THREADS");
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ASSERT_EQ(loom_set_thread_count(0), LOOM_OK);
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(loom_thread_count(), static_cast<size_t>(CPU_COUNT(&set)));

  // An explicit count wins over the environment, and is capped.
  ::setenv("LOOM_NUM_THREADS", "3", 1);
  ASSERT_EQ(loom_set_thread_count(2), LOOM_OK);
  EXPECT_EQ(loom_thread_count(), 2U);
  ASSERT_EQ(loom_set_thread_count(1U << 20), LOOM_OK);
  EXPECT_EQ(loom_thread_count(), 1024U);
}

TEST_F(PoolTest, BadArguments) {
  EXPECT_EQ(loom_parallel_for(10, 1, nullptr, nullptr), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("loom_parallel_for: body is NULL"));
  EXPECT_EQ(loom_parallel_for(0, 1, nullptr, nullptr), LOOM_OK);
  EXPECT_STREQ(loom_last_error(), "");
  int calls = 0;
  EXPECT_EQ(pool_for(0, 1, [&](size_t, size_t) { ++calls; }), LOOM_OK);
  EXPECT_EQ(calls, 0);
  // A grain larger than n, and the largest n: one block (0, n).
  const Calls c = record(5, ~size_t{0});
  ASSERT_EQ(c.blocks.size(), 1U);
  EXPECT_EQ(c.blocks[0], Block(0, 5));
}

// ---- pool_probe: an SDK plugin's parallel_for

// One step of a pool_probe instance: `ids` gets the thread of each index, `out` the probe's
// results ([0] thread_count, [1] nesting ran inline, [2] an exception reached the caller).
struct ProbeStep {
  std::vector<float> ids;
  std::vector<float> out = std::vector<float>(3, -1.0F);
  explicit ProbeStep(size_t n) : ids(n, 0.0F) {}

  [[nodiscard]] std::set<pid_t> threads() const {
    std::set<pid_t> s;
    for (const float v : ids) s.insert(static_cast<pid_t>(v));
    return s;
  }
};

int32_t step_instance(loom_instance* inst, ProbeStep& s) {
  float* params[2] = {s.ids.data(), s.out.data()};
  const float* grads[2] = {s.ids.data(), s.out.data()};
  const int64_t numels[2] = {static_cast<int64_t>(s.ids.size()),
                             static_cast<int64_t>(s.out.size())};
  return loom_optimizer_step_f32(inst, params, grads, numels, 2, 0.1);
}

class PoolPlugin : public loom_test::ManifestTest {
 protected:
  void TearDown() override {
    ManifestTest::TearDown();
    EXPECT_EQ(loom_set_thread_count(0), LOOM_OK);
  }
  loom_instance* probe(loom_session* session) {
    loom_instance* out = nullptr;
    EXPECT_EQ(loom_find_instance(session, "optimizer", "p", &out), LOOM_OK) << loom_last_error();
    return out;
  }
  static constexpr const char* kManifest = "[optimizer.p]\nplugin = \"pool_probe\"\n";
};

TEST_F(PoolPlugin, AStepRunsOnTheHostsPool) {
  ASSERT_EQ(loom_set_thread_count(4), LOOM_OK);
  const std::set<pid_t> host = pool_threads();
  ASSERT_EQ(host.size(), 4U);
  ASSERT_EQ(open(kManifest), LOOM_OK) << error_;
  ProbeStep s(4096);
  ASSERT_EQ(step_instance(probe(session_), s), LOOM_OK) << loom_last_error();
  EXPECT_EQ(s.threads(), host) << "the plugin's blocks ran on threads other than the host's";
  EXPECT_EQ(s.out[0], 4.0F) << "loom::sdk::thread_count()";
  EXPECT_EQ(s.out[1], 1.0F) << "a parallel_for nested in a block did not run inline";
  EXPECT_EQ(s.out[2], 1.0F) << "an exception thrown in a block did not reach the caller";
  // Resizing the host's pool resizes what the plugin sees.
  ASSERT_EQ(loom_set_thread_count(2), LOOM_OK);
  ProbeStep t(4096);
  ASSERT_EQ(step_instance(probe(session_), t), LOOM_OK) << loom_last_error();
  EXPECT_EQ(t.threads(), pool_threads());
  EXPECT_EQ(t.out[0], 2.0F);
}

TEST_F(PoolPlugin, SeveralSessionsShareThePoolAndOneClosingLeavesItToTheOthers) {
  ASSERT_EQ(loom_set_thread_count(3), LOOM_OK);
  const std::set<pid_t> host = pool_threads();
  ASSERT_EQ(open(kManifest), LOOM_OK) << error_;
  const auto other_file = dir_.write("other.toml", kManifest);
  auto other = loom_test::open_file(other_file, false);
  ASSERT_EQ(other.rc, LOOM_OK) << other.error;

  // Both at once, from two threads (different instances may be called concurrently): every
  // index is covered, each block by the host's threads or by the caller running inline.
  ProbeStep a(1 << 16);
  ProbeStep b(1 << 16);
  pid_t caller_a = 0;
  pid_t caller_b = 0;
  int32_t rc_a = -1;
  int32_t rc_b = -1;
  loom_instance* inst_a = probe(session_);
  loom_instance* inst_b = probe(other.session);
  std::thread ta([&] {
    caller_a = gettid();
    rc_a = LOOM_OK;
    for (int r = 0; r < 20 && rc_a == LOOM_OK; ++r) rc_a = step_instance(inst_a, a);
  });
  std::thread tb([&] {
    caller_b = gettid();
    rc_b = LOOM_OK;
    for (int r = 0; r < 20 && rc_b == LOOM_OK; ++r) rc_b = step_instance(inst_b, b);
  });
  ta.join();
  tb.join();
  EXPECT_EQ(rc_a, LOOM_OK);
  EXPECT_EQ(rc_b, LOOM_OK);
  for (const pid_t t : a.threads()) EXPECT_TRUE(host.count(t) == 1 || t == caller_a) << t;
  for (const pid_t t : b.threads()) EXPECT_TRUE(host.count(t) == 1 || t == caller_b) << t;

  // The first session's instance registered the pool first; with it gone the second's is
  // used.
  loom_close(session_);
  session_ = nullptr;
  ProbeStep c(4096);
  ASSERT_EQ(step_instance(probe(other.session), c), LOOM_OK) << loom_last_error();
  EXPECT_EQ(c.threads(), host);
  loom_close(other.session);
}

// ---- the plugin created directly, by a host table of the test's own

struct DirectHost {
  std::atomic<int> calls{0};
  std::atomic<int> blocks{0};
};

loom_status* fake_parallel_for(void* host_ctx, size_t n, size_t /*grain*/,
                               void (*body)(void*, size_t, size_t), void* body_ctx) {
  auto* h = static_cast<DirectHost*>(host_ctx);
  h->calls.fetch_add(1);
  // Two blocks, both on the caller.
  const size_t half = n / 2;
  if (half > 0) {
    h->blocks.fetch_add(1);
    body(body_ctx, 0, half);
  }
  h->blocks.fetch_add(1);
  body(body_ctx, half, n);
  return nullptr;
}

size_t fake_thread_count(void* /*host_ctx*/) { return 7; }

class DirectPlugin : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = dlopen(loom_test::plugin_file("pool_probe").c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(lib_, nullptr) << dlerror();
    auto entry = reinterpret_cast<loom_plugin_entry_v1_fn>(dlsym(lib_, LOOM_PLUGIN_ENTRY_V1_NAME));
    ASSERT_NE(entry, nullptr);
    const loom_plugin_v1* plugin = entry();
    ASSERT_NE(plugin, nullptr);
    ASSERT_EQ(plugin->factory_count, 1U);
    factory_ = plugin->factories[0];
  }
  // No dlclose: plugin libraries are never unloaded (docs/abi.md), and the SDK's registry
  // lives as long as the library.

  loom_host_services services(uint32_t size, uint16_t minor) {
    loom_host_services s{};
    s.struct_size = size;
    s.abi_major = LOOM_ABI_MAJOR;
    s.abi_minor = minor;
    s.host_ctx = &host_;
    s.instance_name = "p";
    s.parallel_for = &fake_parallel_for;
    s.thread_count = &fake_thread_count;
    return s;
  }

  // Creates an instance with `svc`, runs one step, destroys it.
  void step(const loom_host_services& svc, ProbeStep& s) {
    void* obj = nullptr;
    loom_status* st = factory_->create(&svc, &obj);
    ASSERT_EQ(st, nullptr) << st->message;
    int64_t shapes[2] = {static_cast<int64_t>(s.ids.size()), static_cast<int64_t>(s.out.size())};
    DLTensor t[2]{};
    float* data[2] = {s.ids.data(), s.out.data()};
    loom_optimizer_tensor ts[2]{};
    for (int i = 0; i < 2; ++i) {
      t[i].data = data[i];
      t[i].device = {kDLCPU, 0};
      t[i].ndim = 1;
      t[i].dtype = {kDLFloat, 32, 1};
      t[i].shape = &shapes[i];
      ts[i].struct_size = LOOM_OPTIMIZER_TENSOR_SIZE;
      ts[i].param = &t[i];
      ts[i].grad = &t[i];
    }
    loom_optimizer_group g{};
    g.struct_size = LOOM_OPTIMIZER_GROUP_SIZE;
    g.tensors = ts;
    g.tensor_count = 2;
    g.lr_scale = 1.0;
    g.weight_decay = NAN;
    loom_optimizer_step_args a{};
    a.struct_size = LOOM_OPTIMIZER_STEP_ARGS_SIZE;
    a.groups = &g;
    a.group_count = 1;
    a.lr = 0.1;
    a.grad_scale = 1.0;
    a.step = 1;
    const auto* vt = static_cast<const loom_optimizer_v1*>(factory_->vtable);
    st = vt->step(obj, &a);
    EXPECT_EQ(st, nullptr) << st->message;
    if (st != nullptr) st->destroy(st);
    factory_->destroy(obj);
  }

  void* lib_ = nullptr;
  const loom_factory* factory_ = nullptr;
  DirectHost host_;
};

TEST_F(DirectPlugin, KernelsGoThroughTheCreatingHostsParallelFor) {
  ProbeStep s(1000);
  step(services(LOOM_HOST_SERVICES_SIZE, LOOM_ABI_MINOR), s);
  // The ids, the outer loop of the nesting check and the exception check; the nested calls
  // ran inline in the plugin without asking the host.
  EXPECT_EQ(host_.calls.load(), 3);
  EXPECT_EQ(host_.blocks.load(), 6);
  EXPECT_EQ(s.threads(), std::set<pid_t>{gettid()});
  EXPECT_EQ(s.out[0], 7.0F);
  EXPECT_EQ(s.out[1], 1.0F);
  EXPECT_EQ(s.out[2], 1.0F);
}

TEST_F(DirectPlugin, AHostWithoutThePoolRunsKernelsInline) {
  // A 1.1 host's table ends at param_count: the pool's fields, though set here, are beyond
  // its struct_size and must not be used.
  ProbeStep s(1000);
  step(services(LOOM_STRUCT_SIZE(loom_host_services, param_count), 1), s);
  EXPECT_EQ(host_.calls.load(), 0);
  EXPECT_EQ(s.threads(), std::set<pid_t>{gettid()});
  EXPECT_EQ(s.out[0], 1.0F);
  EXPECT_EQ(s.out[1], 1.0F);
  EXPECT_EQ(s.out[2], 1.0F);
  // And after a 1.2 instance came and went, the library is back to inline.
  ProbeStep t(10);
  step(services(LOOM_HOST_SERVICES_SIZE, LOOM_ABI_MINOR), t);
  EXPECT_EQ(host_.calls.load(), 3);
  ProbeStep u(1000);
  step(services(LOOM_STRUCT_SIZE(loom_host_services, param_count), 1), u);
  EXPECT_EQ(host_.calls.load(), 3);
  EXPECT_EQ(u.out[0], 1.0F);
}

}  // namespace
