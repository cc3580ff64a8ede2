// Declared public interface of loom_sampler_core: bench/, the trainer and tests may include this
// header (as <loom/data/sampler_core.hpp>); the core's other headers are private to it.
//
// The curriculum sampler's core, free of the plugin ABI: which sample ids each data-parallel
// rank trains on at each step, as a pure function of the sampler's position (docs/data.md,
// "The curriculum sampler").
//
// - The universe is an index's sorted list (ascending metric value, ties by sample id) or,
//   for a single cluster, the ids 0 .. N-1 themselves.
// - Admission: at difficulty d the first admitted(d) entries of the sorted list take part
//   (value: value <= d; percentile: floor(N d / 100)); the largest difficulty seen so far
//   counts, so admission never shrinks. Each growth of the admitted prefix is a new cluster,
//   a range [lo, hi) of the sorted list.
// - Each cluster visits its range in a keyed pseudo-random order per pass (Permutation: a
//   function of (seed, lo, hi, pass)), so the position is a few integers per cluster.
// - Slot j of step s's global batch picks a cluster with probability proportional to what
//   it has left this pass (a counter-based draw of (seed, s, j)) and takes its next id;
//   when every cluster is spent, all of them start their next pass.
// - Rank r of W takes slots [round(r B / W), round((r + 1) B / W)).
#pragma once

#include <loom/sdk/status.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <loom/data/metric_index.hpp>

namespace loom::data::sampler {

// A keyed bijection of [0, n): a Feistel network over the smallest number of bits that
// holds n - 1 (at least 2; so fewer than 2n values for n > 4), its halves a bit apart when
// that number is odd, walked until it lands inside [0, n) (cycle walking). The round keys come from
// loom::sdk::CounterRng under (seed, lo, hi, pass), so a cluster's order in a pass needs O(1)
// memory and nothing is stored to reproduce it.
class Permutation {
 public:
  Permutation() = default;
  Permutation(uint64_t n, uint64_t seed, uint64_t lo, uint64_t hi, uint64_t pass);

  uint64_t size() const { return n_; }
  // The element at position i (i < size()).
  uint64_t operator()(uint64_t i) const;

 private:
  static constexpr int kRounds = 6;
  uint64_t encrypt(uint64_t x) const;

  uint64_t n_ = 0;
  unsigned left_bits_ = 1;
  unsigned right_bits_ = 1;
  uint64_t keys_[kRounds] = {};
};

enum class DifficultyType { kValue, kPercentile };
enum class Clustering { kScheduleBased, kSingleCluster };

// A range [lo, hi) of the sorted list with its pass counter and how much of that pass it
// has handed out.
struct Cluster {
  uint64_t lo = 0;
  uint64_t hi = 0;
  uint64_t pass = 0;
  uint64_t cursor = 0;
  uint64_t size() const { return hi - lo; }
  uint64_t remaining() const { return hi - lo - cursor; }
  bool operator==(const Cluster&) const = default;
};

// Where the sampler is after `step` batches.
struct Position {
  int64_t step = 0;       // batches drawn (the last step drawn; 0: none)
  uint64_t consumed = 0;  // samples drawn over all ranks
  uint64_t admitted = 0;  // entries of the sorted list admitted so far (the last cluster's hi)
  double difficulty = 0;  // the largest difficulty seen (meaningful once step > 0)
  std::vector<Cluster> clusters;
  bool operator==(const Position&) const = default;
};

// Rank r's share of a global batch of b over w ranks: [share_begin(r), share_begin(r + 1)).
uint64_t share_begin(uint64_t b, uint64_t w, uint64_t r);

class SamplerCore {
 public:
  // The difficulty the schedule gives a step (called for each step drawn).
  using DifficultyFn = std::function<double(int64_t step)>;

  // `sorted`: the universe, borrowed (it must outlive the core); empty for a single cluster.
  // `source` names where it came from, for error messages (e.g. "index 'data/idx' metric
  // 'voc'").
  SamplerCore(std::span<const SortedEntry> sorted, DifficultyType type, Clustering clustering,
              std::string source);

  // Fixes the dataset size, global batch and world size. The first plan after a state was
  // imported (before any plan) must give that state's values and keeps its position (other
  // values throw INVALID_ARGUMENT); after that, the same values change nothing and others
  // restart at step 0.
  void plan(uint64_t dataset_size, int64_t global_batch, int32_t world_size);
  bool planned() const { return planned_; }
  // The most ids one rank receives: ceil(B / W); 0 before plan.
  int64_t capacity() const;

  struct Share {
    std::span<const int64_t> ids;  // this rank's ids, valid until the next call
    double difficulty;             // NaN for a single cluster
    uint64_t epoch;                // consumed before this batch / N
    uint64_t consumed;             // samples drawn, this batch included
  };
  // Rank `rank`'s share of step `step`: the step after the last one drawn, or the last one
  // again. `difficulty` is called for each step drawn (not for a single cluster).
  Share next(int64_t step, uint64_t seed, int32_t rank, int32_t world_size,
             const DifficultyFn& difficulty);

  // The number of sorted-list entries admitted at difficulty d (before the empty rule).
  uint64_t admitted_at(double d) const;
  // What the rule for a first step that admits nothing admits instead.
  uint64_t first_cluster_size() const;

  // The state payload (the SDK frames and checksums it) and its import. Import checks the
  // blob against itself and, when planned, against the plan; a state imported before plan
  // is checked by plan.
  std::vector<std::byte> export_state() const;
  void import_state(std::span<const std::byte> blob);

  // Where the sampler is (after the last step drawn).
  const Position& position() const { return pos_; }
  int64_t last_step() const { return pending_redraw_ ? pre_.step + 1 : pos_.step; }

 private:
  void require_planned(const char* what) const;
  void admit(double d);
  void draw(int64_t step, uint64_t seed, const DifficultyFn& difficulty);
  void rebuild();                // the permutations and the tree from pos_.clusters
  void rebuild_tree();           // the tree alone
  void drop_derived() noexcept;  // forget the permutations and the tree (a draw rebuilds them)
  void check_position(const Position& p, int64_t drawn) const;
  uint64_t seed_check(uint64_t seed) const;

  std::span<const SortedEntry> sorted_;
  std::string source_;

  uint64_t n_ = 0;
  uint64_t batch_ = 0;

  Position pos_;  // after the last step drawn
  Position pre_;  // before it (what export writes, so the last step can be drawn again)
  std::vector<int64_t> batch_ids_;  // the global batch of pos_.step
  std::vector<int64_t> spare_ids_;  // where a draw writes the next batch before it commits
  uint64_t seed_ = 0;
  uint64_t imported_seed_check_ = 0;
  // An imported state waiting for plan to confirm its sizes.
  uint64_t imported_n_ = 0;
  uint64_t imported_batch_ = 0;

  // Derived from pos_.clusters: one permutation per cluster (its current pass) and a
  // Fenwick tree of the clusters' remaining counts.
  std::vector<Permutation> perms_;
  std::vector<uint64_t> tree_;
  uint64_t remaining_ = 0;

  DifficultyType type_;
  Clustering clustering_;
  uint32_t world_ = 0;
  uint32_t imported_world_ = 0;
  bool planned_ = false;
  bool has_seed_ = false;
  // After import: pre_ is the position and step pre_.step + 1 is still to be redrawn.
  bool pending_redraw_ = false;
  bool imported_has_seed_ = false;
  bool imported_unplanned_ = false;
};

}  // namespace loom::data::sampler
