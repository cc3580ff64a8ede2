// Process groups of the host-memory transports (loom_comm_split; ucx, or the one
// LOOM_TEST_COMM_PLUGIN names), run by every rank of an mpirun job or alone. Each rank's data
// depends on its world rank, and every result inside a group is checked against a reference
// computed from the group's expected members, in the expected order, so a wrong membership, a wrong
// order or messages crossing between communicators all show up as wrong values.
#include <loom/embed.h>
#include <loom/sdk/comm.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm_helpers.hpp"

namespace {

using namespace loom_test;  // NOLINT(google-build-using-namespace)

// The world ranks that pass `color`, in the order split promises: by (key, world rank).
template <class Color, class Key>
std::vector<int> expected_group(int world, int color, Color color_of, Key key_of) {
  std::vector<int> g;
  for (int r = 0; r < world; ++r) {
    if (color_of(r) == color) g.push_back(r);
  }
  std::stable_sort(g.begin(), g.end(), [&](int a, int b) { return key_of(a) < key_of(b); });
  return g;
}

// What world rank w contributes to element i of the collectives below.
float input(int w, std::size_t i) { return value(w, i) + static_cast<float>(w % 3); }

// Element i of the block world rank `from` sends to world rank `to` in all_to_all.
float a2a(int from, int to, std::size_t i) {
  return static_cast<float>(from * 1000 + to * 100 + static_cast<int>(i % 97));
}
// Elements world rank `from` sends to world rank `to`: some zero, none equal everywhere.
int64_t a2a_count(int from, int to) { return (from + 2 * to) % 3 + (to % 2) * 5; }

// Every collective on `g`, whose members are the world ranks `group` (g's rank k is world
// rank group[k]); `me` is this rank's world rank. Returns the number of collective calls.
int check_group(const CommView& g, const std::vector<int>& group, int me, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(g.size, static_cast<int>(group.size()));
  if (g.size != static_cast<int>(group.size()) || g.rank < 0 || g.rank >= g.size) return 0;
  EXPECT_EQ(group[static_cast<std::size_t>(g.rank)], me);
  int calls = 0;
  // allreduce: small (recursive doubling) and large (ring) messages
  for (std::size_t n : {std::size_t{7}, std::size_t{100003}}) {
    Buf x(Dt::kF32, n);
    for (std::size_t i = 0; i < n; ++i) x.set(i, input(me, i));
    const Result r = g.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
    ++calls;
    EXPECT_EQ(r.code, LOOM_OK) << r.text;
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      float ref = 0;
      for (int w : group) ref += input(w, i);
      bad += x.get(i) != ref ? 1 : 0;
    }
    EXPECT_EQ(bad, 0U) << "allreduce n " << n;
  }
  // allgather: block k is the group's k-th member's, so the order is checked too
  {
    const std::size_t n = 13;
    Buf s(Dt::kF32, n);
    Buf out(Dt::kF32, n * group.size());
    for (std::size_t i = 0; i < n; ++i) s.set(i, input(me, i));
    const Result r = g.allgather(&s.t, &out.t);
    ++calls;
    EXPECT_EQ(r.code, LOOM_OK) << r.text;
    std::size_t bad = 0;
    for (std::size_t k = 0; k < group.size(); ++k) {
      for (std::size_t i = 0; i < n; ++i) bad += out.get(k * n + i) != input(group[k], i) ? 1 : 0;
    }
    EXPECT_EQ(bad, 0U) << "allgather";
  }
  // broadcast from the group's last rank
  {
    const std::size_t n = 5000;
    const int root = g.size - 1;
    Buf x(Dt::kF32, n);
    for (std::size_t i = 0; i < n; ++i) x.set(i, g.rank == root ? input(100 + me, i) : -1.0f);
    const Result r = g.broadcast(root, &x.t);
    ++calls;
    EXPECT_EQ(r.code, LOOM_OK) << r.text;
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += x.get(i) != input(100 + group.back(), i) ? 1 : 0;
    EXPECT_EQ(bad, 0U) << "broadcast";
  }
  // all_to_all with variable counts (send_counts / recv_counts), indexed by group rank
  {
    std::vector<int64_t> sc;
    std::vector<int64_t> rc;
    for (int w : group) {
      sc.push_back(a2a_count(me, w));
      rc.push_back(a2a_count(w, me));
    }
    int64_t ts = 0;
    int64_t tr = 0;
    for (std::size_t k = 0; k < group.size(); ++k) {
      ts += sc[k];
      tr += rc[k];
    }
    Buf s(Dt::kF32, static_cast<std::size_t>(ts));
    Buf out(Dt::kF32, static_cast<std::size_t>(tr));
    std::size_t o = 0;
    for (std::size_t k = 0; k < group.size(); ++k) {
      for (int64_t i = 0; i < sc[k]; ++i)
        s.set(o++, a2a(me, group[k], static_cast<std::size_t>(i)));
    }
    const Result r = g.all_to_all(&s.t, &out.t, sc.data(), rc.data());
    ++calls;
    EXPECT_EQ(r.code, LOOM_OK) << r.text;
    std::size_t bad = 0;
    o = 0;
    for (std::size_t k = 0; k < group.size(); ++k) {
      for (int64_t i = 0; i < rc[k]; ++i) {
        bad += out.get(o++) != a2a(group[k], me, static_cast<std::size_t>(i)) ? 1 : 0;
      }
    }
    EXPECT_EQ(bad, 0U) << "all_to_all";
  }
  const Result b = g.barrier();
  ++calls;
  EXPECT_EQ(b.code, LOOM_OK) << b.text;
  return calls;
}

// A world-wide allreduce on the parent, checked against every rank's input.
void check_world(const CommView& c, std::size_t n, const char* what) {
  SCOPED_TRACE(what);
  Buf x(Dt::kF32, n);
  for (std::size_t i = 0; i < n; ++i) x.set(i, input(c.rank, i));
  const Result r = c.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
  ASSERT_EQ(r.code, LOOM_OK) << r.text;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float ref = 0;
    for (int w = 0; w < c.size; ++w) ref += input(w, i);
    bad += x.get(i) != ref ? 1 : 0;
  }
  EXPECT_EQ(bad, 0U);
}

int parity(int r) { return r % 2; }
int reversed(int r) { return -r; }

// color = rank % 2, key = -rank: on 4 ranks the groups are world {2, 0} and {3, 1}, each
// in reverse order.
TEST(UcxSplit, TwoGroupsByParityWithReversedKeys) {
  Comm c("timeout_s = 30.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  loom_instance* sub = nullptr;
  ASSERT_EQ(loom_comm_split(c.instance, parity(c.rank), reversed(c.rank), &sub), LOOM_OK)
      << loom_last_error();
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(std::string(loom_instance_name(sub)), "world/" + std::to_string(parity(c.rank)));
  EXPECT_STREQ(loom_instance_kind(sub), LOOM_KIND_COMM);
  EXPECT_EQ(std::string(loom_instance_plugin(sub)), transport());
  EXPECT_EQ(loom_instance_count(c.session), 1U);  // the sub-communicator is not declared
  const std::vector<int> group = expected_group(c.size, parity(c.rank), parity, reversed);
  const CommView g(sub);
  if (c.size == 4) {
    EXPECT_EQ(group, c.rank % 2 == 0 ? (std::vector<int>{2, 0}) : (std::vector<int>{3, 1}));
  }
  const int calls = check_group(g, group, c.rank, "parity group");
  EXPECT_EQ(g.stats().rounds, static_cast<uint64_t>(calls));  // its own calls only

  // The parent after the split, and interleaved with the child.
  check_world(c, 1000, "parent after split");
  for (int round = 0; round < 3; ++round) {
    check_group(g, group, c.rank, "child, interleaved");
    check_world(c, 100003, "parent, interleaved");
    const std::vector<int64_t> ranks = c.gather(c.rank);
    for (int k = 0; k < c.size; ++k) EXPECT_EQ(ranks[static_cast<std::size_t>(k)], k);
  }
  EXPECT_EQ(loom_comm_destroy_split(sub), LOOM_OK) << loom_last_error();
  check_world(c, 77, "parent after the child is gone");
}

TEST(UcxSplit, ColorNoneGetsNullAndTheOthersFormOneGroup) {
  Comm c("timeout_s = 30.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const int last = c.size - 1;
  auto color_of = [&](int r) { return r == last ? LOOM_COMM_SPLIT_NONE : 7; };
  auto key_of = [](int) { return 0; };                        // equal keys keep the parent's order
  loom_instance* sub = reinterpret_cast<loom_instance*>(&c);  // must be overwritten
  ASSERT_EQ(loom_comm_split(c.instance, color_of(c.rank), key_of(c.rank), &sub), LOOM_OK)
      << loom_last_error();
  if (c.rank == last) {
    EXPECT_EQ(sub, nullptr);
  } else {
    ASSERT_NE(sub, nullptr);
    const std::vector<int> group = expected_group(c.size, 7, color_of, key_of);
    EXPECT_EQ(static_cast<int>(group.size()), c.size - 1);
    check_group(CommView(sub), group, c.rank, "all but the last rank");
  }
  check_world(c, 4097, "parent with one rank outside the group");
  // Left for loom_close, which destroys it before its parent.
}

// Several communicators over the same ranks at once: a copy of the world with reversed
// keys, the parity groups, and a split of the copy into halves. Same calls with the same
// shapes on each, so only the comm numbers in the tags keep their messages apart.
TEST(UcxSplit, SiblingAndNestedGroupsKeepTheirMessagesApart) {
  Comm c("timeout_s = 30.0\nchunk_bytes = 4096\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  auto all = [](int) { return 0; };
  loom_instance* copy = nullptr;
  loom_instance* par = nullptr;
  ASSERT_EQ(loom_comm_split(c.instance, 0, reversed(c.rank), &copy), LOOM_OK) << loom_last_error();
  ASSERT_EQ(loom_comm_split(c.instance, parity(c.rank), c.rank, &par), LOOM_OK)
      << loom_last_error();
  const CommView a(copy);
  const std::vector<int> ga = expected_group(c.size, 0, all, reversed);
  // Halves of the copy by its own rank order: its ranks 0.. are world ranks size-1 down.
  auto half = [&](int w) {
    const auto pos = std::find(ga.begin(), ga.end(), w) - ga.begin();
    return static_cast<int>(pos) / 2;
  };
  loom_instance* nested = nullptr;
  ASSERT_EQ(loom_comm_split(copy, a.rank / 2, a.rank, &nested), LOOM_OK) << loom_last_error();
  EXPECT_EQ(std::string(loom_instance_name(nested)), "world/0/" + std::to_string(a.rank / 2));
  const std::vector<int> gp =
      expected_group(c.size, parity(c.rank), parity, [](int r) { return r; });
  const std::vector<int> gn =
      expected_group(c.size, half(c.rank), half, reversed);  // keyed by the copy's rank
  for (int round = 0; round < 2; ++round) {
    check_group(a, ga, c.rank, "copy");
    check_group(CommView(par), gp, c.rank, "parity");
    check_group(CommView(nested), gn, c.rank, "nested halves");
    check_world(c, 100003, "parent");
  }
  // Destroying the copy destroys the split made from it first.
  EXPECT_EQ(loom_comm_destroy_split(copy), LOOM_OK) << loom_last_error();
  check_group(CommView(par), gp, c.rank, "parity after the copy is gone");
  EXPECT_EQ(loom_comm_destroy_split(par), LOOM_OK) << loom_last_error();
}

// A parent and its child are different instances: calls on them may run at once from two
// threads, and both must complete with the right results.
TEST(UcxSplit, ParentAndChildCalledFromTwoThreadsAtOnce) {
  Comm c("timeout_s = 30.0\nsmall_message_bytes = 0\nchunk_bytes = 4096\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  loom_instance* sub = nullptr;
  ASSERT_EQ(loom_comm_split(c.instance, parity(c.rank), reversed(c.rank), &sub), LOOM_OK)
      << loom_last_error();
  const CommView g(sub);
  const std::vector<int> group = expected_group(c.size, parity(c.rank), parity, reversed);
  std::thread t([&] {
    for (int i = 0; i < 5; ++i) check_world(c, 30011, "parent thread");
  });
  for (int i = 0; i < 5; ++i) check_group(g, group, c.rank, "child thread");
  t.join();
  EXPECT_EQ(loom_comm_destroy_split(sub), LOOM_OK) << loom_last_error();
}

// Comm numbers come back when a sub-communicator is destroyed; with all of them taken,
// split fails the same way on every rank of the group, and the parent stays usable.
TEST(UcxSplit, CommNumbersAreReusedAndTheirLimitIsAClearError) {
  Comm c("timeout_s = 30.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  for (int i = 0; i < 70; ++i) {
    loom_instance* sub = nullptr;
    ASSERT_EQ(loom_comm_split(c.instance, 0, c.rank, &sub), LOOM_OK) << i << loom_last_error();
    Buf x(Dt::kF32, 3);
    for (std::size_t k = 0; k < 3; ++k) x.set(k, 1.0f);
    const Result r = CommView(sub).allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
    ASSERT_EQ(r.code, LOOM_OK) << r.text;
    EXPECT_EQ(x.get(2), static_cast<float>(c.size));
    ASSERT_EQ(loom_comm_destroy_split(sub), LOOM_OK) << loom_last_error();
  }
  if (c.size == 1) return;     // a group of one uses no comm number
  if (!testing_ucx()) return;  // the limit below is ucx's comm numbers
  std::vector<loom_instance*> held;
  for (int i = 0; i < 63; ++i) {
    loom_instance* sub = nullptr;
    ASSERT_EQ(loom_comm_split(c.instance, 0, 0, &sub), LOOM_OK) << i << loom_last_error();
    held.push_back(sub);
  }
  loom_instance* more = nullptr;
  EXPECT_EQ(loom_comm_split(c.instance, 0, 0, &more), LOOM_ERR_RESOURCE_EXHAUSTED);
  EXPECT_NE(std::string(loom_last_error()).find("sub-communicators"), std::string::npos)
      << loom_last_error();
  EXPECT_EQ(more, nullptr);
  check_world(c, 1000, "parent after the refused split");
  for (loom_instance* s : held) EXPECT_EQ(loom_comm_destroy_split(s), LOOM_OK);
  ASSERT_EQ(loom_comm_split(c.instance, 0, 0, &more), LOOM_OK) << loom_last_error();
  check_group(CommView(more),
              expected_group(
                  c.size, 0, [](int) { return 0; }, [](int) { return 0; }),
              c.rank, "after freeing");
}

// A collective that fails inside a child (the ranks disagree on the size) fails on every
// rank of the child and breaks that child only: it refuses further calls, while the parent
// and a sibling keep working.
TEST(UcxSplit, AFailureInsideAChildLeavesTheParentWorking) {
  if (!testing_ucx()) {
    GTEST_SKIP() << "MPI does not check that the ranks agree on a collective's arguments "
                    "(MpiErrors.AnMpiErrorBreaksThatCommunicatorOnly is mpi's case)";
  }
  Comm c("timeout_s = 20.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  if (c.size == 1) GTEST_SKIP() << "needs two ranks";
  loom_instance* bad = nullptr;
  loom_instance* good = nullptr;
  ASSERT_EQ(loom_comm_split(c.instance, 0, c.rank, &bad), LOOM_OK) << loom_last_error();
  ASSERT_EQ(loom_comm_split(c.instance, 0, reversed(c.rank), &good), LOOM_OK) << loom_last_error();
  const CommView b(bad);
  Buf x(Dt::kF32, 1000 + (b.rank == 0 ? 1 : 0));
  const Result r = b.allreduce(LOOM_REDUCE_SUM, nullptr, &x.t);
  EXPECT_NE(r.code, LOOM_OK);
  EXPECT_NE(r.text.find("world rank"), std::string::npos) << r.text;  // names ranks both ways
  const Result again = b.barrier();
  EXPECT_EQ(again.code, LOOM_ERR_FAILED_PRECONDITION) << again.text;
  check_world(c, 1000, "parent after the child's failure");
  check_group(CommView(good),
              expected_group(
                  c.size, 0, [](int) { return 0; }, reversed),
              c.rank, "sibling after the child's failure");
}

// The table itself: split / destroy_split and the 1.2 args-struct calls, beside the old ones.
TEST(UcxSplit, TheTableAndItsArgumentChecks) {
  Comm c("timeout_s = 30.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const loom_comm_v1* vt = c.vt;
  ASSERT_GE(vt->struct_size, LOOM_COMM_V1_SIZE);
  ASSERT_NE(vt->split, nullptr);
  ASSERT_NE(vt->destroy_split, nullptr);
  // Bad arguments fail on this rank alone, before anything is exchanged.
  EXPECT_EQ(Result(vt->split(c.obj, nullptr)).code, LOOM_ERR_INVALID_ARGUMENT);
  loom_comm_split_args short_args{};
  short_args.struct_size = 8;  // no key, no result
  const Result r = Result(vt->split(c.obj, &short_args));
  EXPECT_EQ(r.code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(r.text.find("struct_size 8"), std::string::npos) << r.text;
  loom_instance* out = nullptr;
  EXPECT_EQ(loom_comm_split(nullptr, 0, 0, &out), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(loom_comm_split(c.instance, 0, 0, nullptr), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(loom_comm_destroy_split(nullptr), LOOM_OK);
  EXPECT_EQ(loom_comm_destroy_split(c.instance), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(loom_last_error()).find("comm.world"), std::string::npos);

  // The raw call, then the child's table is the parent's.
  loom_comm_split_args args{};
  args.struct_size = LOOM_COMM_SPLIT_ARGS_SIZE;
  args.color = 3;
  args.key = c.rank;
  ASSERT_EQ(Result(vt->split(c.obj, &args)).code, LOOM_OK);
  ASSERT_NE(args.result, nullptr);
  EXPECT_EQ(vt->size(args.result), c.size);
  EXPECT_EQ(vt->rank(args.result), c.rank);

  // barrier2 / supports_device2 beside barrier / supports_device, on the child too.
  for (void* obj : {c.obj, args.result}) {
    loom_comm_barrier_args b{LOOM_COMM_BARRIER_ARGS_SIZE, 0, nullptr};
    EXPECT_EQ(Result(vt->barrier2(obj, &b)).code, LOOM_OK);
    EXPECT_EQ(Result(vt->barrier(obj, nullptr)).code, LOOM_OK);
    loom_comm_device_args d{LOOM_COMM_DEVICE_ARGS_SIZE, 0, DLDevice{kDLCPU, 0}, -1};
    EXPECT_EQ(Result(vt->supports_device2(obj, &d)).code, LOOM_OK);
    EXPECT_EQ(d.supported, 1);
    d.device = DLDevice{kDLCUDA, 0};
    EXPECT_EQ(Result(vt->supports_device2(obj, &d)).code, LOOM_OK);
    EXPECT_EQ(d.supported, 0);
    EXPECT_EQ(vt->supports_device(obj, DLDevice{kDLCPU, 0}), 1);
    d.struct_size = 12;  // no room for `supported`
    EXPECT_EQ(Result(vt->supports_device2(obj, &d)).code, LOOM_ERR_INVALID_ARGUMENT);
  }
  EXPECT_EQ(vt->native_handle2, nullptr);  // the host-memory transports have no native handle
  vt->destroy_split(args.result);
  vt->destroy_split(nullptr);
  check_world(c, 10, "parent after the raw split");
}

// The SDK's helpers for code holding a comm reference: comm_split returns a SubComm that
// owns the child (destroy_split when it goes), named after the parent and the color.
TEST(UcxSplit, TheSdkHelpers) {
  Comm c("timeout_s = 30.0\n");
  ASSERT_EQ(c.rc, LOOM_OK) << c.error;
  const loom::sdk::InstanceRef<loom_comm_v1> world("world", c.obj, c.vt);
  {
    loom::sdk::SubComm sub = loom::sdk::comm_split(world, parity(c.rank), reversed(c.rank));
    ASSERT_TRUE(sub);
    EXPECT_EQ(sub.name(), "world/" + std::to_string(parity(c.rank)));
    const std::vector<int> group = expected_group(c.size, parity(c.rank), parity, reversed);
    EXPECT_EQ(sub.size(), static_cast<int32_t>(group.size()));
    check_group(CommView(sub.instance(), sub.vtable()), group, c.rank, "SubComm");
    EXPECT_NO_THROW(loom::sdk::comm_barrier(sub.ref(), nullptr));
    EXPECT_TRUE(loom::sdk::comm_supports_device(sub.ref(), DLDevice{kDLCPU, 0}));
    EXPECT_FALSE(loom::sdk::comm_supports_device(sub.ref(), DLDevice{kDLCUDA, 0}));
    // A split of the SubComm, moved out and back: still one owner.
    loom::sdk::SubComm inner = loom::sdk::comm_split(sub.ref(), 0, 0);
    loom::sdk::SubComm moved = std::move(inner);
    EXPECT_FALSE(inner);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(moved.size(), sub.size());
    EXPECT_EQ(moved.name(), sub.name() + "/0");
  }  // moved, then sub: children first
  const loom::sdk::SubComm none = loom::sdk::comm_split(world, LOOM_COMM_SPLIT_NONE, 0);
  EXPECT_FALSE(none);
  EXPECT_EQ(none.size(), 0);
  check_world(c, 100, "parent after the SDK's splits");
}

}  // namespace
