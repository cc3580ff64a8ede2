// The curriculum sampler's core when an allocation fails in the middle of a step: next()
// is transactional, so the failed call changes nothing (the exported state is the one
// before the call) and calling it again gives the batch an undisturbed run gives. Its own
// executable: it replaces the global operator new to make the k-th allocation fail.
#include <loom/data/sampler_core.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <vector>

namespace {

// Allocations left before one fails; negative: none fails.
long g_allocations_left = -1;

}  // namespace

void* operator new(std::size_t n) {
  if (g_allocations_left == 0) {
    g_allocations_left = -1;
    throw std::bad_alloc();
  }
  if (g_allocations_left > 0) --g_allocations_left;
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

using loom::data::SortedEntry;
using loom::data::sampler::Clustering;
using loom::data::sampler::DifficultyType;
using loom::data::sampler::SamplerCore;

constexpr uint64_t kSeed = 99;
constexpr int32_t kWorld = 2;
constexpr int64_t kBatch = 37;

std::vector<SortedEntry> universe(uint64_t n, int distinct) {
  std::mt19937_64 gen(5);
  std::vector<SortedEntry> out(n);
  for (uint64_t i = 0; i < n; ++i) {
    out[i] = SortedEntry{static_cast<double>(gen() % static_cast<uint64_t>(distinct)), i};
  }
  std::sort(out.begin(), out.end(), [](const SortedEntry& a, const SortedEntry& b) {
    return a.value < b.value || (a.value == b.value && a.sample < b.sample);
  });
  return out;
}

// Rises by 2 a step: a new cluster at most steps, passes restarting mid-batch.
double difficulty(int64_t step) { return std::min(60.0, 2.0 * static_cast<double>(step)); }

std::vector<int64_t> global_batch(SamplerCore& core, int64_t step) {
  std::vector<int64_t> out;
  for (int32_t r = 0; r < kWorld; ++r) {
    const auto share = core.next(step, kSeed, r, kWorld, difficulty);
    out.insert(out.end(), share.ids.begin(), share.ids.end());
  }
  return out;
}

SamplerCore fresh(const std::vector<SortedEntry>& sorted) {
  SamplerCore core(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "test");
  core.plan(sorted.size(), kBatch, kWorld);
  return core;
}

TEST(AllocFailure, FailedNextChangesNothingAndARetryDrawsTheSameBatch) {
  const std::vector<SortedEntry> sorted = universe(150, 60);
  constexpr int64_t kSteps = 30;
  // The undisturbed run: each step's batch and the state after it (want_state[0]: none drawn).
  std::vector<std::vector<int64_t>> want_batch(kSteps + 1);
  std::vector<std::vector<std::byte>> want_state(kSteps + 1);
  {
    SamplerCore core = fresh(sorted);
    want_state[0] = core.export_state();
    for (int64_t s = 1; s <= kSteps; ++s) {
      want_batch[s] = global_batch(core, s);
      want_state[s] = core.export_state();
    }
  }
  int failures = 0;
  for (int64_t s = 1; s <= kSteps; ++s) {
    for (long k = 0; k < 8; ++k) {
      SamplerCore core = fresh(sorted);
      for (int64_t t = 1; t < s; ++t) global_batch(core, t);
      bool threw = false;
      g_allocations_left = k;
      try {
        core.next(s, kSeed, 0, kWorld, difficulty);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      g_allocations_left = -1;
      const std::string where = "step " + std::to_string(s) + ", allocation " + std::to_string(k);
      if (!threw) continue;
      ++failures;
      EXPECT_EQ(core.export_state(), want_state[s - 1]) << where;
      EXPECT_EQ(core.last_step(), s - 1) << where;
      ASSERT_EQ(global_batch(core, s), want_batch[s]) << where;
      EXPECT_EQ(core.export_state(), want_state[s]) << where;
      if (s < kSteps) {
        EXPECT_EQ(global_batch(core, s + 1), want_batch[s + 1]) << where;
      }
    }
  }
  // The test must have made next() fail somewhere (the first step allocates the batch).
  EXPECT_GT(failures, 0);
}

// The same after an import: the redraw of the imported step failing leaves the state as
// imported.
TEST(AllocFailure, FailedRedrawAfterImportKeepsTheImportedState) {
  const std::vector<SortedEntry> sorted = universe(150, 60);
  SamplerCore ref = fresh(sorted);
  for (int64_t t = 1; t <= 9; ++t) global_batch(ref, t);
  const std::vector<std::byte> blob = ref.export_state();
  const std::vector<int64_t> want10 = global_batch(ref, 10);
  int failures = 0;
  for (long k = 0; k < 8; ++k) {
    SamplerCore core = fresh(sorted);
    core.import_state(blob);
    bool threw = false;
    g_allocations_left = k;
    try {
      core.next(10, kSeed, 0, kWorld, difficulty);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    g_allocations_left = -1;
    if (!threw) continue;
    ++failures;
    EXPECT_EQ(core.export_state(), blob) << "allocation " << k;
    EXPECT_EQ(global_batch(core, 10), want10) << "allocation " << k;
  }
  EXPECT_GT(failures, 0);
}

}  // namespace
