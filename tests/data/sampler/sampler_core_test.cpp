// The curriculum sampler's core: the keyed permutation, admission and clusters, the batch
// draw and its sharding over ranks, resume, and the errors of bad calls and bad states.
#include <loom/data/sampler_core.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using loom::data::SortedEntry;
using loom::data::sampler::Clustering;
using loom::data::sampler::DifficultyType;
using loom::data::sampler::Permutation;
using loom::data::sampler::SamplerCore;
using loom::data::sampler::share_begin;
using loom::sdk::Error;

constexpr uint64_t kSeed = 1234;

// N samples with values in [0, distinct) (many ties), sorted by (value, sample id), the ids
// scattered so that the sorted position and the id differ.
std::vector<SortedEntry> universe(uint64_t n, int distinct, uint32_t seed = 7) {
  std::mt19937_64 gen(seed);
  std::vector<SortedEntry> out(n);
  for (uint64_t i = 0; i < n; ++i) {
    out[i] = SortedEntry{static_cast<double>(gen() % static_cast<uint64_t>(distinct)), i};
  }
  std::sort(out.begin(), out.end(), [](const SortedEntry& a, const SortedEntry& b) {
    return a.value < b.value || (a.value == b.value && a.sample < b.sample);
  });
  return out;
}

SamplerCore::DifficultyFn constant(double d) {
  return [d](int64_t) { return d; };
}

// A schedule that rises by `per_step` from `start` and stops at `top`.
SamplerCore::DifficultyFn ramp(double start, double per_step, double top) {
  return [=](int64_t s) { return std::min(top, start + per_step * static_cast<double>(s - 1)); };
}

// The global batch of `step` as every rank's share concatenated in rank order.
std::vector<int64_t> global_batch(SamplerCore& core, int64_t step, int32_t world,
                                  const SamplerCore::DifficultyFn& fn, uint64_t seed = kSeed) {
  std::vector<int64_t> out;
  for (int32_t r = 0; r < world; ++r) {
    const auto share = core.next(step, seed, r, world, fn);
    out.insert(out.end(), share.ids.begin(), share.ids.end());
  }
  return out;
}

bool is_permutation_of(std::vector<int64_t> got, std::vector<int64_t> want) {
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  return got == want;
}

std::vector<int64_t> iota_ids(uint64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

template <class Fn>
loom_code code_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return LOOM_OK;
}

// ---- the permutation

TEST(Permutation, IsABijectionForEverySizeUpTo1000) {
  for (uint64_t n = 1; n <= 1000; ++n) {
    const Permutation p(n, kSeed + n, 3 * n, 5 * n, n % 4);
    std::vector<char> seen(n, 0);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t x = p(i);
      ASSERT_LT(x, n) << "n " << n << " i " << i;
      ASSERT_EQ(seen[x], 0) << "n " << n << ": " << x << " twice";
      seen[x] = 1;
    }
  }
}

TEST(Permutation, IsABijectionForLargeSizes) {
  for (uint64_t n : {uint64_t{1} << 22, (uint64_t{1} << 22) + 1, uint64_t{3000017}}) {
    const Permutation p(n, 99, 0, n, 2);
    std::vector<bool> seen(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t x = p(i);
      ASSERT_LT(x, n);
      ASSERT_FALSE(seen[x]) << "n " << n << ": " << x << " twice";
      seen[x] = true;
    }
  }
}

TEST(Permutation, DependsOnSeedRangeAndPass) {
  const uint64_t n = 200;
  auto order = [&](uint64_t seed, uint64_t lo, uint64_t pass) {
    const Permutation p(n, seed, lo, lo + n, pass);
    std::vector<uint64_t> v(n);
    for (uint64_t i = 0; i < n; ++i) v[i] = p(i);
    return v;
  };
  const auto base = order(1, 0, 0);
  EXPECT_EQ(base, order(1, 0, 0));  // a pure function
  EXPECT_NE(base, order(2, 0, 0));
  EXPECT_NE(base, order(1, 10, 0));
  EXPECT_NE(base, order(1, 0, 1));
  // Not the identity, and not a rotation of it.
  std::vector<uint64_t> id(n);
  std::iota(id.begin(), id.end(), 0);
  EXPECT_NE(base, id);
  int fixed = 0;
  for (uint64_t i = 0; i < n; ++i) fixed += base[i] == i ? 1 : 0;
  EXPECT_LT(fixed, 20);
}

// ---- sharding

TEST(Shares, PartitionTheBatchAndDifferByAtMostOne) {
  for (uint64_t b = 1; b <= 64; ++b) {
    for (uint64_t w = 1; w <= b; ++w) {
      EXPECT_EQ(share_begin(b, w, 0), 0u);
      EXPECT_EQ(share_begin(b, w, w), b);
      uint64_t lo = b, hi = 0;
      for (uint64_t r = 0; r < w; ++r) {
        const uint64_t size = share_begin(b, w, r + 1) - share_begin(b, w, r);
        // round(r b / w) reference in doubles (exact at these sizes).
        EXPECT_EQ(share_begin(b, w, r),
                  static_cast<uint64_t>(
                      std::floor(static_cast<double>(r * b) / static_cast<double>(w) + 0.5)));
        lo = std::min(lo, size);
        hi = std::max(hi, size);
      }
      EXPECT_GE(lo, 1u) << "b " << b << " w " << w;  // no rank gets an empty share
      EXPECT_LE(hi - lo, 1u);
    }
  }
  // Large values do not overflow.
  const uint64_t big = uint64_t{1} << 62;
  EXPECT_EQ(share_begin(big, 3, 3), big);
  EXPECT_EQ(share_begin(big, 4, 1), big / 4);
}

TEST(Shares, CapacityIsTheLargestShare) {
  SamplerCore core({}, DifficultyType::kValue, Clustering::kSingleCluster, "test");
  core.plan(100, 10, 4);
  EXPECT_EQ(core.capacity(), 3);
  std::size_t most = 0;
  for (int r = 0; r < 4; ++r) most = std::max(most, core.next(1, kSeed, r, 4, {}).ids.size());
  EXPECT_EQ(most, 3u);
  core.plan(100, 12, 4);
  EXPECT_EQ(core.capacity(), 3);
}

// ---- no repeats, no drops

// With everything admitted (single cluster, and schedule-based at full difficulty), the
// stream of ids over all ranks, cut into passes of N, is a permutation of the dataset in
// each pass, for 1 to 4 ranks, whether B divides N or not.
TEST(Passes, EveryPassIsAPermutationAtFullDifficulty) {
  const uint64_t n = 120;
  const auto sorted = universe(n, 5);
  for (const bool single : {true, false}) {
    for (int32_t world = 1; world <= 4; ++world) {
      for (const int64_t b : {int64_t{12}, int64_t{7}, int64_t{120}, int64_t{250}}) {
        SamplerCore core(single ? std::span<const SortedEntry>{} : std::span(sorted),
                         DifficultyType::kPercentile,
                         single ? Clustering::kSingleCluster : Clustering::kScheduleBased, "t");
        core.plan(n, b, world);
        std::vector<int64_t> stream;
        const int64_t steps = static_cast<int64_t>(3 * n / static_cast<uint64_t>(b)) + 2;
        for (int64_t s = 1; s <= steps; ++s) {
          const auto batch = global_batch(core, s, world, constant(100));
          ASSERT_EQ(batch.size(), static_cast<std::size_t>(b));
          stream.insert(stream.end(), batch.begin(), batch.end());
        }
        for (std::size_t start = 0; start + n <= stream.size(); start += n) {
          const std::vector<int64_t> pass(stream.begin() + static_cast<std::ptrdiff_t>(start),
                                          stream.begin() + static_cast<std::ptrdiff_t>(start + n));
          ASSERT_TRUE(is_permutation_of(pass, iota_ids(n)))
              << "single " << single << " world " << world << " b " << b << " pass " << start / n;
        }
        // Passes differ from each other (the pass counter keys the order).
        ASSERT_GE(stream.size(), 2 * n);
        EXPECT_FALSE(std::equal(stream.begin(), stream.begin() + static_cast<std::ptrdiff_t>(n),
                                stream.begin() + static_cast<std::ptrdiff_t>(n)));
      }
    }
  }
}

// During a curriculum each cluster's ids, taken in order and cut into passes of its size,
// are a permutation of the cluster in every pass; and every id drawn at a step is admitted
// at the largest difficulty scheduled so far.
TEST(Passes, EveryClusterPassIsAPermutationDuringACurriculum) {
  const uint64_t n = 300;
  const auto sorted = universe(n, 40);
  for (const DifficultyType type : {DifficultyType::kValue, DifficultyType::kPercentile}) {
    for (int32_t world = 1; world <= 4; ++world) {
      SamplerCore core(sorted, type, Clustering::kScheduleBased, "t");
      core.plan(n, 16, world);
      // Value: 0 .. 39 by 2.5 a step; percentile: 3 .. 100 by 4 a step (then 100).
      const auto fn = type == DifficultyType::kValue ? ramp(0, 2.5, 39) : ramp(3, 4, 100);
      std::vector<int64_t> stream;
      double top = -1e300;
      for (int64_t s = 1; s <= 120; ++s) {
        top = std::max(top, fn(s));
        const uint64_t admitted = std::max<uint64_t>(core.admitted_at(top), 1);
        std::set<int64_t> allowed;
        for (uint64_t i = 0; i < std::max(admitted, core.position().admitted); ++i) {
          allowed.insert(static_cast<int64_t>(sorted[i].sample));
        }
        const auto batch = global_batch(core, s, world, fn);
        for (const int64_t id : batch) ASSERT_TRUE(allowed.count(id)) << "step " << s;
        stream.insert(stream.end(), batch.begin(), batch.end());
      }
      const auto& clusters = core.position().clusters;
      ASSERT_GE(clusters.size(), 5u);
      EXPECT_EQ(core.position().admitted, n);
      // Which cluster each sample id belongs to.
      std::map<int64_t, std::size_t> cluster_of;
      for (std::size_t c = 0; c < clusters.size(); ++c) {
        for (uint64_t i = clusters[c].lo; i < clusters[c].hi; ++i) {
          cluster_of[static_cast<int64_t>(sorted[i].sample)] = c;
        }
      }
      std::vector<std::vector<int64_t>> per(clusters.size());
      for (const int64_t id : stream) per[cluster_of.at(id)].push_back(id);
      for (std::size_t c = 0; c < clusters.size(); ++c) {
        const uint64_t size = clusters[c].size();
        std::vector<int64_t> members;
        for (uint64_t i = clusters[c].lo; i < clusters[c].hi; ++i) {
          members.push_back(static_cast<int64_t>(sorted[i].sample));
        }
        std::size_t start = 0;
        for (; start + size <= per[c].size(); start += size) {
          const std::vector<int64_t> pass(
              per[c].begin() + static_cast<std::ptrdiff_t>(start),
              per[c].begin() + static_cast<std::ptrdiff_t>(start + size));
          ASSERT_TRUE(is_permutation_of(pass, members)) << "cluster " << c;
        }
        // The unfinished pass has no repeats either.
        const std::set<int64_t> tail(per[c].begin() + static_cast<std::ptrdiff_t>(start),
                                     per[c].end());
        EXPECT_EQ(tail.size(), per[c].size() - start);
        // The position agrees with what was drawn.
        EXPECT_EQ(clusters[c].pass * size + clusters[c].cursor, per[c].size());
      }
    }
  }
}

// ---- ranks agree

TEST(Ranks, OneInstanceForAllRanksEqualsOneInstancePerRank) {
  const uint64_t n = 500;
  const auto sorted = universe(n, 30);
  for (int32_t world = 1; world <= 4; ++world) {
    const auto fn = ramp(0, 0.5, 29);
    SamplerCore all(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
    all.plan(n, 24, world);
    std::vector<SamplerCore> each;
    for (int32_t r = 0; r < world; ++r) {
      each.emplace_back(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
      each.back().plan(n, 24, world);
    }
    for (int64_t s = 1; s <= 80; ++s) {
      for (int32_t r = 0; r < world; ++r) {
        const auto a = all.next(s, kSeed, r, world, fn);
        const std::vector<int64_t> av(a.ids.begin(), a.ids.end());
        const auto e = each[static_cast<std::size_t>(r)].next(s, kSeed, r, world, fn);
        const std::vector<int64_t> ev(e.ids.begin(), e.ids.end());
        ASSERT_EQ(av, ev) << "world " << world << " step " << s << " rank " << r;
        EXPECT_EQ(a.consumed, e.consumed);
        EXPECT_EQ(a.epoch, e.epoch);
        EXPECT_EQ(a.difficulty, e.difficulty);
      }
    }
  }
}

TEST(Ranks, TheSameSeedGivesTheSameBatchesAnotherSeedOthers) {
  const uint64_t n = 100;
  SamplerCore a({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  SamplerCore b({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  SamplerCore c({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  a.plan(n, 10, 1);
  b.plan(n, 10, 1);
  c.plan(n, 10, 1);
  const auto x = global_batch(a, 1, 1, {}, 5);
  EXPECT_EQ(x, global_batch(b, 1, 1, {}, 5));
  EXPECT_NE(x, global_batch(c, 1, 1, {}, 6));
}

// ---- resume

struct Drawn {
  std::vector<std::vector<int64_t>> batches;  // per step, every rank's share concatenated
  std::vector<uint64_t> consumed, epoch;
  std::vector<double> difficulty;
};

Drawn run_steps(SamplerCore& core, int64_t from, int64_t to, int32_t world,
                const SamplerCore::DifficultyFn& fn) {
  Drawn out;
  for (int64_t s = from; s <= to; ++s) {
    std::vector<int64_t> all;
    for (int32_t r = 0; r < world; ++r) {
      const auto share = core.next(s, kSeed, r, world, fn);
      all.insert(all.end(), share.ids.begin(), share.ids.end());
      if (r == 0) {
        out.consumed.push_back(share.consumed);
        out.epoch.push_back(share.epoch);
        out.difficulty.push_back(share.difficulty);
      }
    }
    out.batches.push_back(all);
  }
  return out;
}

void expect_same(const Drawn& a, const Drawn& b, const std::string& what) {
  ASSERT_EQ(a.batches.size(), b.batches.size()) << what;
  for (std::size_t i = 0; i < a.batches.size(); ++i) {
    ASSERT_EQ(a.batches[i], b.batches[i]) << what << ": batch " << i;
    EXPECT_EQ(a.consumed[i], b.consumed[i]) << what;
    EXPECT_EQ(a.epoch[i], b.epoch[i]) << what;
    if (std::isnan(a.difficulty[i])) {
      EXPECT_TRUE(std::isnan(b.difficulty[i])) << what;
    } else {
      EXPECT_EQ(a.difficulty[i], b.difficulty[i]) << what;
    }
  }
}

TEST(Resume, MidEpochAndMidScheduleIsBitIdentical) {
  const uint64_t n = 400;
  const auto sorted = universe(n, 50);
  struct Case {
    DifficultyType type;
    Clustering clustering;
    SamplerCore::DifficultyFn fn;
  };
  const std::vector<Case> cases = {
      {DifficultyType::kValue, Clustering::kScheduleBased, ramp(0, 1.5, 49)},
      {DifficultyType::kPercentile, Clustering::kScheduleBased, ramp(1, 3, 100)},
      {DifficultyType::kValue, Clustering::kSingleCluster, {}},
  };
  for (const Case& c : cases) {
    for (const int32_t world : {1, 3}) {
      const std::span<const SortedEntry> u =
          c.clustering == Clustering::kSingleCluster ? std::span<const SortedEntry>{} : sorted;
      SamplerCore full(u, c.type, c.clustering, "t");
      full.plan(n, 30, world);
      const Drawn whole = run_steps(full, 1, 90, world, c.fn);
      // Resume after steps 1, 7 (mid-schedule, mid-pass), 20 (one pass and a half) and 60.
      for (const int64_t k : {int64_t{1}, int64_t{7}, int64_t{20}, int64_t{60}}) {
        SamplerCore first(u, c.type, c.clustering, "t");
        first.plan(n, 30, world);
        run_steps(first, 1, k, world, c.fn);
        const auto blob = first.export_state();
        EXPECT_EQ(blob, first.export_state());  // export does not move the position
        // Into a fresh instance planned first.
        SamplerCore second(u, c.type, c.clustering, "t");
        second.plan(n, 30, world);
        second.import_state(blob);
        EXPECT_EQ(second.last_step(), k);
        // The last step again (each rank's share of it) and then the rest.
        const Drawn rest = run_steps(second, k, 90, world, c.fn);
        Drawn want;
        for (int64_t s = k; s <= 90; ++s) {
          const auto i = static_cast<std::size_t>(s - 1);
          want.batches.push_back(whole.batches[i]);
          want.consumed.push_back(whole.consumed[i]);
          want.epoch.push_back(whole.epoch[i]);
          want.difficulty.push_back(whole.difficulty[i]);
        }
        expect_same(rest, want, "resume at " + std::to_string(k));
        // A fresh instance that imports before plan and asks for the next step directly.
        SamplerCore third(u, c.type, c.clustering, "t");
        third.import_state(blob);
        third.plan(n, 30, world);
        const Drawn next = run_steps(third, k + 1, 90, world, c.fn);
        Drawn want_next = want;
        want_next.batches.erase(want_next.batches.begin());
        want_next.consumed.erase(want_next.consumed.begin());
        want_next.epoch.erase(want_next.epoch.begin());
        want_next.difficulty.erase(want_next.difficulty.begin());
        expect_same(next, want_next, "resume before plan at " + std::to_string(k));
        // The state of a resumed run equals the uninterrupted run's at the same step.
        SamplerCore at_end(u, c.type, c.clustering, "t");
        at_end.plan(n, 30, world);
        run_steps(at_end, 1, 90, world, c.fn);
        EXPECT_EQ(third.export_state(), at_end.export_state());
        EXPECT_EQ(third.position(), at_end.position());
      }
    }
  }
}

TEST(Resume, ExportRightAfterImportIsTheSameState) {
  const auto sorted = universe(64, 8);
  SamplerCore a(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
  a.plan(64, 8, 2);
  run_steps(a, 1, 11, 2, ramp(0, 1, 7));
  const auto blob = a.export_state();
  SamplerCore b(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
  b.plan(64, 8, 2);
  b.import_state(blob);
  EXPECT_EQ(b.export_state(), blob);
  // A state before any step resumes at step 1.
  SamplerCore c(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
  c.plan(64, 8, 2);
  SamplerCore d(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
  d.plan(64, 8, 2);
  d.import_state(c.export_state());
  EXPECT_EQ(d.last_step(), 0);
  expect_same(run_steps(d, 1, 5, 2, ramp(0, 1, 7)), run_steps(c, 1, 5, 2, ramp(0, 1, 7)),
              "from step 0");
}

TEST(Resume, AnotherSeedIsRefused) {
  SamplerCore a({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  a.plan(50, 5, 1);
  a.next(1, kSeed, 0, 1, {});
  a.next(2, kSeed, 0, 1, {});
  EXPECT_NE(error_of([&] { a.next(3, kSeed + 1, 0, 1, {}); }).find("differs from the seed"),
            std::string::npos);
  SamplerCore b({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  b.plan(50, 5, 1);
  b.import_state(a.export_state());
  EXPECT_NE(error_of([&] { b.next(3, kSeed + 1, 0, 1, {}); }).find("not the seed of the run"),
            std::string::npos);
  EXPECT_EQ(b.next(3, kSeed, 0, 1, {}).consumed, 15u);
}

// ---- tiny clusters and the empty start

TEST(TinyClusters, BatchesStayFullFromAOneSampleCluster) {
  const uint64_t n = 40;
  // Values 0 (one sample), 1 (two samples), 2 (the rest).
  std::vector<SortedEntry> sorted;
  sorted.push_back({0.0, 17});
  sorted.push_back({1.0, 3});
  sorted.push_back({1.0, 30});
  for (uint64_t i = 0, k = 0; k < n - 3; ++i) {
    if (i == 17 || i == 3 || i == 30) continue;
    sorted.push_back({2.0, i});
    ++k;
  }
  std::sort(sorted.begin(), sorted.end(), [](const SortedEntry& a, const SortedEntry& b) {
    return a.value < b.value || (a.value == b.value && a.sample < b.sample);
  });
  for (const int32_t world : {1, 2, 4}) {
    SamplerCore core(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
    core.plan(n, 8, world);
    // Steps 1-3: only the one-sample cluster; 4-6: three samples; then everything.
    const auto fn = [](int64_t s) { return s <= 3 ? 0.0 : (s <= 6 ? 1.0 : 2.0); };
    for (int64_t s = 1; s <= 3; ++s) {
      const auto batch = global_batch(core, s, world, fn);
      EXPECT_EQ(batch, std::vector<int64_t>(8, 17)) << "step " << s;
    }
    // One pass per id drawn: the 24th id is pass 23's.
    EXPECT_EQ(core.position().clusters[0].pass, 23u);
    EXPECT_EQ(core.position().clusters[0].cursor, 1u);
    std::vector<int64_t> stream;
    for (int64_t s = 4; s <= 6; ++s) {
      const auto batch = global_batch(core, s, world, fn);
      ASSERT_EQ(batch.size(), 8u);
      stream.insert(stream.end(), batch.begin(), batch.end());
    }
    // The new two-sample cluster goes first (the one-sample cluster is spent this pass),
    // then all three samples in passes of three.
    EXPECT_TRUE(is_permutation_of({stream[0], stream[1]}, {3, 30}));
    for (std::size_t start = 2; start + 3 <= stream.size(); start += 3) {
      EXPECT_TRUE(
          is_permutation_of({stream[start], stream[start + 1], stream[start + 2]}, {3, 17, 30}))
          << "at " << start;
    }
    const auto later = global_batch(core, 7, world, fn);
    EXPECT_EQ(later.size(), 8u);
    EXPECT_EQ(core.position().clusters.size(), 3u);
  }
}

TEST(TinyClusters, NothingAdmittedAtStepOneStartsWithTheEasiest) {
  const uint64_t n = 250;
  const auto sorted = universe(n, 10);
  const uint64_t smallest =
      static_cast<uint64_t>(std::count_if(sorted.begin(), sorted.end(), [&](const SortedEntry& e) {
        return e.value == sorted[0].value;
      }));
  ASSERT_GT(smallest, 1u);
  // Value type: a difficulty below every value admits the samples of the smallest value.
  SamplerCore v(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
  v.plan(n, 16, 2);
  EXPECT_EQ(v.admitted_at(-1), 0u);
  EXPECT_EQ(v.first_cluster_size(), smallest);
  std::set<int64_t> easiest;
  for (uint64_t i = 0; i < smallest; ++i) easiest.insert(static_cast<int64_t>(sorted[i].sample));
  for (int64_t s = 1; s <= 4; ++s) {
    for (const int64_t id : global_batch(v, s, 2, constant(-1))) {
      EXPECT_TRUE(easiest.count(id)) << id;
    }
  }
  ASSERT_EQ(v.position().clusters.size(), 1u);
  EXPECT_EQ(v.position().clusters[0].hi, smallest);
  // Growth continues from there once the schedule admits more.
  global_batch(v, 5, 2, constant(3));
  ASSERT_EQ(v.position().clusters.size(), 2u);
  EXPECT_EQ(v.position().clusters[1].lo, smallest);
  EXPECT_EQ(v.position().clusters[1].hi, v.admitted_at(3));
  // Percentile type: difficulty 0 admits the first percent (at least one sample).
  SamplerCore p(sorted, DifficultyType::kPercentile, Clustering::kScheduleBased, "t");
  p.plan(n, 16, 1);
  EXPECT_EQ(p.first_cluster_size(), 2u);  // floor(250 / 100)
  const auto batch = global_batch(p, 1, 1, constant(0));
  const std::set<int64_t> first{static_cast<int64_t>(sorted[0].sample),
                                static_cast<int64_t>(sorted[1].sample)};
  for (const int64_t id : batch) EXPECT_TRUE(first.count(id));
  const auto small = universe(50, 3);
  SamplerCore q(small, DifficultyType::kPercentile, Clustering::kScheduleBased, "t");
  q.plan(50, 4, 1);
  EXPECT_EQ(q.first_cluster_size(), 1u);  // floor(50 / 100) = 0, so one sample
  EXPECT_EQ(global_batch(q, 1, 1, constant(0)),
            std::vector<int64_t>(4, static_cast<int64_t>(small[0].sample)));
}

// ---- admission against a plain reference

TEST(Admission, PercentileAndValueMatchAPlainReference) {
  for (const uint64_t n : {uint64_t{1}, uint64_t{7}, uint64_t{100}, uint64_t{1013}}) {
    const auto sorted = universe(n, 17, static_cast<uint32_t>(n));
    SamplerCore v(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
    SamplerCore p(sorted, DifficultyType::kPercentile, Clustering::kScheduleBased, "t");
    for (double d = -2; d <= 20; d += 0.25) {
      uint64_t want = 0;
      for (const SortedEntry& e : sorted) want += e.value <= d ? 1 : 0;
      EXPECT_EQ(v.admitted_at(d), want) << "value n " << n << " d " << d;
    }
    for (int k = 0; k <= 1000; ++k) {
      const double d = k / 10.0;
      const auto want = static_cast<uint64_t>(std::floor(static_cast<double>(n) * k / 1000.0));
      EXPECT_EQ(p.admitted_at(d), want) << "percentile n " << n << " d " << d;
    }
    EXPECT_EQ(p.admitted_at(100), n);
  }
  // The samples drawn at a fixed difficulty are exactly the admitted ones (all of them, in
  // one pass).
  const uint64_t n = 200;
  const auto sorted = universe(n, 20);
  for (const DifficultyType type : {DifficultyType::kValue, DifficultyType::kPercentile}) {
    const double d = type == DifficultyType::kValue ? 9.0 : 37.0;
    SamplerCore core(sorted, type, Clustering::kScheduleBased, "t");
    core.plan(n, 1, 1);
    std::vector<int64_t> want;
    const uint64_t count =
        type == DifficultyType::kValue
            ? static_cast<uint64_t>(std::count_if(
                  sorted.begin(), sorted.end(), [&](const SortedEntry& e) { return e.value <= d; }))
            : n * 37 / 100;
    for (uint64_t i = 0; i < count; ++i) want.push_back(static_cast<int64_t>(sorted[i].sample));
    std::vector<int64_t> got;
    for (int64_t s = 1; s <= static_cast<int64_t>(count); ++s) {
      got.push_back(core.next(s, kSeed, 0, 1, constant(d)).ids[0]);
    }
    EXPECT_TRUE(is_permutation_of(got, want));
  }
}

TEST(Admission, ADifficultyThatFallsKeepsWhatWasAdmitted) {
  const auto sorted = universe(100, 10);
  SamplerCore core(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "t");
  core.plan(100, 10, 1);
  const auto fn = [](int64_t s) { return s == 1 ? 6.0 : 2.0; };
  core.next(1, kSeed, 0, 1, fn);
  const uint64_t admitted = core.position().admitted;
  const auto share = core.next(2, kSeed, 0, 1, fn);
  EXPECT_EQ(core.position().admitted, admitted);
  EXPECT_EQ(share.difficulty, 6.0);
}

// ---- reported position

TEST(Position, EpochAndConsumedCountSamples) {
  SamplerCore core({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  core.plan(25, 10, 2);
  for (int64_t s = 1; s <= 6; ++s) {
    const auto share = core.next(s, kSeed, 1, 2, {});
    EXPECT_EQ(share.consumed, static_cast<uint64_t>(10 * s));
    EXPECT_EQ(share.epoch, static_cast<uint64_t>(10 * (s - 1) / 25));
    EXPECT_TRUE(std::isnan(share.difficulty));
  }
}

// ---- bad input

// A state payload in the sampler's layout (sampler_core.cpp, export_state): a value-type,
// schedule-based sampler planned with (n, b, 1), about to draw step `drawn` from the given
// clusters.
std::vector<std::byte> state_payload(uint64_t n, uint64_t b, uint64_t check, int64_t drawn,
                                     uint64_t consumed, double difficulty,
                                     const std::vector<loom::data::sampler::Cluster>& clusters) {
  std::vector<std::byte> out;
  auto pod = [&out](const auto& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof v);
  };
  const std::string magic = "loom.curriculum_sampler";
  pod(uint64_t{magic.size()});
  for (char c : magic) out.push_back(static_cast<std::byte>(c));
  pod(uint32_t{1});  // version
  pod(uint32_t{0});  // schedule_based
  pod(uint32_t{0});  // value
  pod(n);
  pod(b);
  pod(uint32_t{1});  // world_size
  pod(uint32_t{1});  // seeded
  pod(check);
  pod(drawn);
  pod(consumed);
  pod(clusters.empty() ? uint64_t{0} : clusters.back().hi);  // admitted
  pod(difficulty);
  pod(uint64_t{clusters.size()});
  for (const auto& c : clusters) {
    pod(c.lo);
    pod(c.hi);
    pod(c.pass);
    pod(c.cursor);
  }
  return out;
}

TEST(Position, StepsPast2To32DrawAfresh) {
  // 16 samples of value 0 then 16 of value 1 (sample id = sorted position), two clusters of
  // 16 at the start of a pass, a batch of 32: which cluster each slot came from is the
  // step's draw alone. The step's high 32 bits must change it (the generator's step word has
  // 32 bits).
  std::vector<SortedEntry> sorted(32);
  for (uint64_t i = 0; i < 32; ++i) sorted[i] = SortedEntry{i < 16 ? 0.0 : 1.0, i};
  // The seed's check value, from a state the sampler exported.
  SamplerCore seeded(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "test");
  seeded.plan(32, 32, 1);
  global_batch(seeded, 1, 1, constant(1));
  const std::vector<std::byte> real = seeded.export_state();
  uint64_t magic_len = 0;
  std::memcpy(&magic_len, real.data(), sizeof magic_len);
  uint64_t check = 0;
  std::memcpy(&check, real.data() + 8 + magic_len + 36, sizeof check);

  auto clusters_of_step = [&](int64_t step) {
    const uint64_t passes = static_cast<uint64_t>(step) - 1;  // one full pass per step
    SamplerCore core(sorted, DifficultyType::kValue, Clustering::kScheduleBased, "test");
    core.plan(32, 32, 1);
    core.import_state(state_payload(32, 32, check, step, passes * 32, 1.0,
                                    {{0, 16, passes, 0}, {16, 32, passes, 0}}));
    const auto share = core.next(step, kSeed, 0, 1, constant(1));
    std::string from;
    for (int64_t id : share.ids) from += id < 16 ? 'a' : 'b';
    EXPECT_EQ(std::count(from.begin(), from.end(), 'a'), 16) << step;
    return from;
  };
  const int64_t two32 = int64_t{1} << 32;
  const std::string at2 = clusters_of_step(2);
  EXPECT_EQ(at2, clusters_of_step(2));  // a pure function of the position
  EXPECT_NE(at2, clusters_of_step(two32 + 2));
  EXPECT_NE(at2, clusters_of_step(2 * two32 + 2));
  EXPECT_NE(clusters_of_step(two32 + 2), clusters_of_step(2 * two32 + 2));
}

TEST(BadInput, StepsMustFollowOneAnother) {
  SamplerCore core({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  EXPECT_EQ(code_of([&] { core.next(1, kSeed, 0, 1, {}); }), LOOM_ERR_FAILED_PRECONDITION);
  core.plan(100, 10, 2);
  EXPECT_NE(
      error_of([&] { core.next(0, kSeed, 0, 2, {}); }).find("step 0 is not the next step (1)"),
      std::string::npos);
  EXPECT_EQ(code_of([&] { core.next(2, kSeed, 0, 2, {}); }), LOOM_ERR_FAILED_PRECONDITION);
  core.next(1, kSeed, 0, 2, {});
  core.next(1, kSeed, 1, 2, {});
  core.next(2, kSeed, 0, 2, {});
  const std::string skip = error_of([&] { core.next(4, kSeed, 0, 2, {}); });
  EXPECT_NE(skip.find("step 4 is not the next step (3) nor the last one again (2)"),
            std::string::npos)
      << skip;
  EXPECT_EQ(code_of([&] { core.next(1, kSeed, 0, 2, {}); }), LOOM_ERR_FAILED_PRECONDITION);
  // The failures moved nothing.
  EXPECT_EQ(core.next(3, kSeed, 0, 2, {}).consumed, 30u);
}

TEST(BadInput, RankAndWorldSizeAreChecked) {
  SamplerCore core({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  core.plan(100, 10, 3);
  EXPECT_NE(error_of([&] { core.next(1, kSeed, 3, 3, {}); }).find("rank 3 is out of range [0, 3)"),
            std::string::npos);
  EXPECT_EQ(code_of([&] { core.next(1, kSeed, -1, 3, {}); }), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(error_of([&] { core.next(1, kSeed, 0, 4, {}); }).find("world_size 4 differs"),
            std::string::npos);
}

TEST(BadInput, PlanChecksItsSizes) {
  const auto sorted = universe(100, 5);
  SamplerCore core(sorted, DifficultyType::kValue, Clustering::kScheduleBased,
                   "index 'idx' metric 'm'");
  const std::string mismatch = error_of([&] { core.plan(101, 10, 1); });
  EXPECT_NE(mismatch.find("dataset_size 101 differs from the 100 samples of index 'idx'"),
            std::string::npos)
      << mismatch;
  EXPECT_EQ(code_of([&] { core.plan(0, 10, 1); }), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(code_of([&] { core.plan(100, 0, 1); }), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(code_of([&] { core.plan(100, 10, 0); }), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(error_of([&] { core.plan(100, 3, 4); }).find("some ranks would get no sample"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { core.plan(100, int64_t{1} << 31, 1); }).find("above the sampler's limit"),
      std::string::npos);
  SamplerCore single({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  EXPECT_NE(error_of([&] { single.plan(uint64_t{1} << 63, 10, 1); }).find("int64 sample ids"),
            std::string::npos);
  EXPECT_FALSE(core.planned());
  EXPECT_FALSE(single.planned());
  EXPECT_THROW(SamplerCore({}, DifficultyType::kValue, Clustering::kScheduleBased, "x"), Error);
}

TEST(BadInput, ScheduleDifficultiesAreChecked) {
  const auto sorted = universe(100, 5);
  SamplerCore p(sorted, DifficultyType::kPercentile, Clustering::kScheduleBased, "t");
  p.plan(100, 10, 1);
  EXPECT_NE(error_of([&] {
              p.next(1, kSeed, 0, 1, constant(101));
            }).find("percentile difficulties are in [0, 100]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { p.next(1, kSeed, 0, 1, constant(NAN)); }).find("NaN at step 1"),
            std::string::npos);
  // A failing schedule call moves nothing.
  EXPECT_EQ(p.last_step(), 0);
  EXPECT_EQ(p.next(1, kSeed, 0, 1, constant(50)).consumed, 10u);
}

TEST(BadInput, PlanAgainWithOtherSizesRestarts) {
  SamplerCore core({}, DifficultyType::kValue, Clustering::kSingleCluster, "t");
  core.plan(100, 10, 1);
  const auto first = global_batch(core, 1, 1, {});
  core.next(2, kSeed, 0, 1, {});
  core.plan(100, 10, 1);  // the same: keeps the position
  EXPECT_EQ(core.last_step(), 2);
  core.plan(100, 20, 1);
  EXPECT_EQ(core.last_step(), 0);
  core.plan(100, 10, 1);
  EXPECT_EQ(global_batch(core, 1, 1, {}), first);
}

class BadState : public ::testing::Test {
 protected:
  void SetUp() override {
    sorted_ = universe(120, 12);
    SamplerCore core(sorted_, DifficultyType::kValue, Clustering::kScheduleBased, "t");
    core.plan(120, 12, 2);
    run_steps(core, 1, 9, 2, ramp(0, 1, 11));
    blob_ = core.export_state();
  }
  SamplerCore fresh(uint64_t batch = 12) {
    SamplerCore core(sorted_, DifficultyType::kValue, Clustering::kScheduleBased, "t");
    core.plan(120, static_cast<int64_t>(batch), 2);
    return core;
  }
  // The payload's fields after the 8-byte length and the 23-byte magic and the version.
  static constexpr std::size_t kFields = 8 + 23 + 4;
  static constexpr std::size_t kConsumed = kFields + 4 + 4 + 8 + 8 + 4 + 4 + 8 + 8;
  static constexpr std::size_t kClusters = kConsumed + 8 + 8 + 8 + 8;
  template <class T>
  std::vector<std::byte> with(std::size_t offset, T value) const {
    std::vector<std::byte> b = blob_;
    std::memcpy(b.data() + offset, &value, sizeof(T));
    return b;
  }

  std::vector<SortedEntry> sorted_;
  std::vector<std::byte> blob_;
};

TEST_F(BadState, EveryTruncationIsRefused) {
  for (std::size_t len = 0; len < blob_.size(); ++len) {
    SamplerCore core = fresh();
    const std::vector<std::byte> cut(blob_.begin(),
                                     blob_.begin() + static_cast<std::ptrdiff_t>(len));
    const loom_code code = code_of([&] { core.import_state(cut); });
    EXPECT_TRUE(code == LOOM_ERR_DATA_LOSS || code == LOOM_ERR_INVALID_ARGUMENT)
        << "length " << len << " code " << code;
    EXPECT_EQ(core.last_step(), 0);  // the instance is untouched
  }
  std::vector<std::byte> longer = blob_;
  longer.push_back(std::byte{0});
  SamplerCore core = fresh();
  EXPECT_NE(error_of([&] { core.import_state(longer); }).find("trailing"), std::string::npos);
}

TEST_F(BadState, InconsistentFieldsAreRefused) {
  {
    SamplerCore ok = fresh();
    ok.import_state(blob_);  // the unchanged blob is fine
  }
  auto refused = [&](const std::vector<std::byte>& b, const std::string& what) {
    SamplerCore core = fresh();
    const std::string e = error_of([&] { core.import_state(b); });
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_EQ(core.last_step(), 0);
  };
  std::vector<std::byte> magic = blob_;
  magic[10] = std::byte{'X'};
  refused(magic, "is not a 'loom.curriculum_sampler' state");
  refused(with<uint32_t>(8 + 23, 9), "has version 9");
  refused(with<uint32_t>(kFields, 1), "clustering_type 'single_cluster'");
  refused(with<uint64_t>(kConsumed, 5), "samples drawn before step");
  refused(with<uint64_t>(kClusters + 8 * 3, 1000), "cursor");              // cluster 0's cursor
  refused(with<uint64_t>(kClusters + 8 * 0, 1), "not a non-empty range");  // cluster 0's lo
  refused(with<uint64_t>(kClusters + 8 * 2, 3), "do not add up");          // cluster 0's pass
  refused(with<uint64_t>(kConsumed + 24, uint64_t{1} << 60), "clusters do not fit");
  refused(with<int64_t>(kConsumed - 8, -3), "negative");
  // A state planned with another global batch.
  SamplerCore other = fresh(24);
  EXPECT_NE(error_of([&] { other.import_state(blob_); }).find("global_batch 12"),
            std::string::npos);
  // A state for another dataset size before plan: plan refuses.
  SamplerCore late(sorted_, DifficultyType::kValue, Clustering::kScheduleBased, "t");
  late.import_state(blob_);
  EXPECT_NE(error_of([&] { late.plan(120, 12, 3); }).find("differ from the imported state"),
            std::string::npos);
  // Another difficulty type.
  SamplerCore pct(sorted_, DifficultyType::kPercentile, Clustering::kScheduleBased, "t");
  pct.plan(120, 12, 2);
  EXPECT_NE(error_of([&] { pct.import_state(blob_); }).find("difficulty_type 'value'"),
            std::string::npos);
}

}  // namespace
