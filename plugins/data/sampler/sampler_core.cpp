#include <loom/data/sampler_core.hpp>

#include <common/number.hpp>
#include <loom/sdk/random.hpp>
#include <loom/sdk/state.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>
#include <utility>

namespace loom::data::sampler {

using loom::common::number;
using loom::sdk::CounterRng;
using loom::sdk::Error;
using loom::sdk::mix64;

namespace {

// CounterRng purposes: the batch draw and the permutations' round keys are separate streams.
constexpr uint32_t kDrawPurpose = 0x73616d70u;  // "samp"
constexpr uint32_t kPermPurpose = 0x7065726du;  // "perm"

constexpr std::string_view kStateMagic = "loom.curriculum_sampler";
constexpr uint32_t kStateVersion = 1;

// Uniform in [0, bound), bound >= 1: masked draws, rejected until below bound (unbiased; at
// most two draws expected).
uint64_t uniform_below(CounterRng& rng, uint64_t bound) {
  if (bound <= 1) return 0;
  const uint64_t mask = ~uint64_t{0} >> std::countl_zero(bound - 1);
  if (bound <= (uint64_t{1} << 32)) {
    for (;;) {
      const uint64_t x = rng.next_u32() & mask;
      if (x < bound) return x;
    }
  }
  for (;;) {
    const uint64_t x = rng.next_u64() & mask;
    if (x < bound) return x;
  }
}

// A state blob that cannot be a sampler's position.
[[noreturn]] void bad(const std::string& what) {
  throw Error(LOOM_ERR_DATA_LOSS, "curriculum_sampler state: " + what);
}

struct Appender {
  std::vector<std::byte> bytes;
  template <class T>
  void pod(const T& v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
};

}  // namespace

// ---- Permutation

Permutation::Permutation(uint64_t n, uint64_t seed, uint64_t lo, uint64_t hi, uint64_t pass)
    : n_(n) {
  const unsigned bits = n > 4 ? static_cast<unsigned>(std::bit_width(n - 1)) : 2u;
  left_bits_ = bits / 2;
  right_bits_ = bits - left_bits_;
  CounterRng rng(seed ^ mix64(lo ^ mix64(hi ^ mix64(pass))), 0, 0, 0, kPermPurpose);
  for (uint64_t& k : keys_) k = rng.next_u64();
}

uint64_t Permutation::encrypt(uint64_t x) const {
  // x = (l << right) | r. Each round maps (l, r) to (r, l ^ F(r)), which swaps the halves'
  // widths when they differ; an even number of rounds brings them back.
  unsigned lw = left_bits_;
  unsigned rw = right_bits_;
  uint64_t l = x >> rw;
  uint64_t r = x & ((uint64_t{1} << rw) - 1);
  for (uint64_t key : keys_) {
    const uint64_t f = mix64(r ^ key) & ((uint64_t{1} << lw) - 1);
    const uint64_t next_r = l ^ f;
    l = r;
    r = next_r;
    std::swap(lw, rw);
  }
  return (l << rw) | r;
}

uint64_t Permutation::operator()(uint64_t i) const {
  if (n_ <= 1) return 0;
  // The network permutes [0, 2^bits), bits = left_bits_ + right_bits_ (odd counts too: the
  // halves differ by one bit); following the cycle from i until it is back inside [0, n)
  // restricts it to a permutation of [0, n).
  uint64_t x = i;
  do {
    x = encrypt(x);
  } while (x >= n_);
  return x;
}

// ---- sharding

uint64_t share_begin(uint64_t b, uint64_t w, uint64_t r) {
  // round(r b / w), halves up, without overflow: r b / w = r q + r m / w with m < w.
  const uint64_t q = b / w;
  const uint64_t m = b % w;
  return r * q + (2 * r * m + w) / (2 * w);
}

// ---- SamplerCore

SamplerCore::SamplerCore(std::span<const SortedEntry> sorted, DifficultyType type,
                         Clustering clustering, std::string source)
    : sorted_(sorted), source_(std::move(source)), type_(type), clustering_(clustering) {
  if (clustering_ == Clustering::kScheduleBased && sorted_.empty()) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, source_ + " has no samples");
  }
}

void SamplerCore::require_planned(const char* what) const {
  if (!planned_) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION, std::string(what) + " before plan");
  }
}

void SamplerCore::plan(uint64_t dataset_size, int64_t global_batch, int32_t world_size) {
  if (dataset_size == 0) throw Error(LOOM_ERR_INVALID_ARGUMENT, "plan: dataset_size is 0");
  if (global_batch < 1) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "plan: global_batch is " + std::to_string(global_batch) + ", must be >= 1");
  }
  if (world_size < 1) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "plan: world_size is " + std::to_string(world_size) + ", must be >= 1");
  }
  // The draw keys slot j by a 32-bit counter word, and ids are int64.
  constexpr int64_t kMaxBatch = std::numeric_limits<int32_t>::max();
  if (global_batch > kMaxBatch) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "plan: global_batch " + std::to_string(global_batch) +
                                               " is above the sampler's limit of " +
                                               std::to_string(kMaxBatch));
  }
  if (dataset_size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "plan: dataset_size " + std::to_string(dataset_size) +
                                               " does not fit the int64 sample ids");
  }
  if (global_batch < world_size) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "plan: global_batch " + std::to_string(global_batch) +
                                               " is smaller than " + "world_size " +
                                               std::to_string(world_size) +
                                               ", so some ranks would get no sample");
  }
  if (clustering_ == Clustering::kScheduleBased && dataset_size != sorted_.size()) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "plan: dataset_size " + std::to_string(dataset_size) + " differs from the " +
                    std::to_string(sorted_.size()) + " samples of " + source_ +
                    " (was the index written for another dataset or sample length?)");
  }
  const auto b = static_cast<uint64_t>(global_batch);
  const auto w = static_cast<uint32_t>(world_size);
  if (imported_unplanned_) {
    if (dataset_size != imported_n_ || b != imported_batch_ || w != imported_world_) {
      throw Error(LOOM_ERR_INVALID_ARGUMENT,
                  "plan: dataset_size " + std::to_string(dataset_size) + ", global_batch " +
                      std::to_string(b) + ", world_size " + std::to_string(w) +
                      " differ from the imported state's " + std::to_string(imported_n_) + ", " +
                      std::to_string(imported_batch_) + ", " + std::to_string(imported_world_));
    }
    imported_unplanned_ = false;
    n_ = dataset_size;
    batch_ = b;
    world_ = w;
    planned_ = true;
    return;
  }
  if (planned_ && dataset_size == n_ && b == batch_ && w == world_) return;  // unchanged
  n_ = dataset_size;
  batch_ = b;
  world_ = w;
  planned_ = true;
  pos_ = Position{};
  pre_ = Position{};
  batch_ids_.clear();
  has_seed_ = false;
  pending_redraw_ = false;
  imported_has_seed_ = false;
  drop_derived();
}

int64_t SamplerCore::capacity() const {
  if (!planned_) return 0;
  return static_cast<int64_t>((batch_ + world_ - 1) / world_);
}

uint64_t SamplerCore::admitted_at(double d) const {
  const uint64_t n = sorted_.size();
  if (type_ == DifficultyType::kValue) {
    const auto it = std::upper_bound(sorted_.begin(), sorted_.end(), d,
                                     [](double v, const SortedEntry& e) { return v < e.value; });
    return static_cast<uint64_t>(it - sorted_.begin());
  }
  if (!(d > 0)) return 0;
  if (d >= 100) return n;
  const long double k = std::floor(static_cast<long double>(n) * d / 100.0L);
  return std::min<uint64_t>(n, static_cast<uint64_t>(k));
}

uint64_t SamplerCore::first_cluster_size() const {
  if (type_ == DifficultyType::kValue) return admitted_at(sorted_.front().value);
  return std::max<uint64_t>(1, sorted_.size() / 100);
}

uint64_t SamplerCore::seed_check(uint64_t seed) const {
  return mix64(seed ^ 0x5eed5eed5eed5eedull);
}

void SamplerCore::rebuild() {
  perms_.clear();
  perms_.reserve(pos_.clusters.size());
  for (const Cluster& c : pos_.clusters) {
    perms_.emplace_back(c.size(), seed_, c.lo, c.hi, c.pass);
  }
  rebuild_tree();
}

void SamplerCore::rebuild_tree() {
  // Fenwick tree: tree_[i] (1-based) sums the remaining counts of clusters (i - lowbit(i), i].
  const std::size_t count = pos_.clusters.size();
  tree_.assign(count + 1, 0);
  remaining_ = 0;
  for (std::size_t i = 1; i <= count; ++i) {
    const uint64_t r = pos_.clusters[i - 1].remaining();
    remaining_ += r;
    tree_[i] += r;
    const std::size_t parent = i + (i & (~i + 1));
    if (parent <= count) tree_[parent] += tree_[i];
  }
}

void SamplerCore::admit(double d) {
  if (clustering_ == Clustering::kSingleCluster) {
    if (pos_.clusters.empty()) {
      pos_.clusters.push_back(Cluster{0, n_, 0, 0});
      pos_.admitted = n_;
    }
    return;
  }
  pos_.difficulty = pos_.step == 0 ? d : std::max(pos_.difficulty, d);
  uint64_t target = admitted_at(pos_.difficulty);
  // The rule for a schedule that admits nothing yet: start with the easiest samples rather
  // than stall (docs/data.md).
  if (pos_.clusters.empty() && target == 0) target = first_cluster_size();
  if (target > pos_.admitted) {
    pos_.clusters.push_back(Cluster{pos_.admitted, target, 0, 0});
    pos_.admitted = target;
  }
}

void SamplerCore::draw(int64_t step, uint64_t seed, const DifficultyFn& difficulty) {
  double d = std::numeric_limits<double>::quiet_NaN();
  if (clustering_ == Clustering::kScheduleBased) {
    d = difficulty(step);
    if (std::isnan(d)) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION,
                  "the schedule gave difficulty NaN at step " + std::to_string(step));
    }
    if (type_ == DifficultyType::kPercentile && !(d >= 0 && d <= 100)) {
      throw Error(LOOM_ERR_FAILED_PRECONDITION, "the schedule gave difficulty " + number(d) +
                                                    " at step " + std::to_string(step) +
                                                    "; percentile difficulties are in [0, 100]");
    }
  }
  if (pos_.consumed > std::numeric_limits<uint64_t>::max() - batch_) {
    throw Error(LOOM_ERR_OUT_OF_RANGE,
                "step " + std::to_string(step) + ": the count of samples drawn would overflow");
  }
  // Transactional: the position, the batch and the seed change only once the whole batch is
  // drawn. Whatever is thrown below (bad_alloc: the copy, a new cluster, its permutation, the
  // tree) restores them and drops the derived data, which the next draw rebuilds.
  Position before_step = pos_;
  const bool had_seed = has_seed_;
  const uint64_t old_seed = seed_;
  try {
    if (!has_seed_ || seed != seed_ || perms_.size() != pos_.clusters.size()) {
      seed_ = seed;
      has_seed_ = true;
      rebuild();
    }
    const std::size_t before = pos_.clusters.size();
    admit(d);
    if (pos_.clusters.size() != before) {
      // A new cluster: its permutation, and the tree again (cheap: integers only).
      for (std::size_t c = before; c < pos_.clusters.size(); ++c) {
        const Cluster& cl = pos_.clusters[c];
        perms_.emplace_back(cl.size(), seed_, cl.lo, cl.hi, cl.pass);
      }
      rebuild_tree();
    }

    std::vector<int64_t>& ids = spare_ids_;
    ids.resize(batch_);
    const std::size_t count = pos_.clusters.size();
    const std::size_t top = std::bit_floor(count);
    const auto step_high = static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32);
    for (uint64_t j = 0; j < batch_; ++j) {
      if (remaining_ == 0) {
        // Every admitted cluster is spent: all start their next pass.
        for (Cluster& c : pos_.clusters) {
          ++c.pass;
          c.cursor = 0;
        }
        rebuild();
      }
      // CounterRng's step word holds the step's low 32 bits; its high bits go in the layer
      // word (0 below step 2^32), so draws never repeat however long the run.
      CounterRng rng(seed_, step, step_high, static_cast<uint32_t>(j), kDrawPurpose);
      uint64_t u = uniform_below(rng, remaining_);
      // The cluster that holds remaining-sample u: descend the Fenwick tree.
      std::size_t idx = 0;
      for (std::size_t bit = top; bit != 0; bit >>= 1) {
        const std::size_t next = idx + bit;
        if (next <= count && tree_[next] <= u) {
          idx = next;
          u -= tree_[next];
        }
      }
      // idx is 0-based cluster index now.
      Cluster& cl = pos_.clusters[idx];
      const uint64_t offset = perms_[idx](cl.cursor);
      ++cl.cursor;
      for (std::size_t i = idx + 1; i <= count; i += i & (~i + 1)) --tree_[i];
      --remaining_;
      ids[j] = static_cast<int64_t>(cl.lo + offset);
    }
    // Positions in the sorted list to sample ids, in a loop of its own so that the loads
    // (random over a list that can be far larger than the caches) overlap.
    if (!sorted_.empty()) {
      for (int64_t& id : ids) id = static_cast<int64_t>(sorted_[static_cast<uint64_t>(id)].sample);
    }
  } catch (...) {
    pos_ = std::move(before_step);
    has_seed_ = had_seed;
    seed_ = old_seed;
    drop_derived();
    throw;
  }
  // Commit (nothing here throws).
  pos_.step = step;
  pos_.consumed += batch_;
  pre_ = std::move(before_step);
  batch_ids_.swap(spare_ids_);
}

void SamplerCore::drop_derived() noexcept {
  perms_.clear();
  tree_.clear();
  remaining_ = 0;
}

SamplerCore::Share SamplerCore::next(int64_t step, uint64_t seed, int32_t rank, int32_t world_size,
                                     const DifficultyFn& difficulty) {
  require_planned("next");
  if (world_size != static_cast<int32_t>(world_)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "next: world_size " + std::to_string(world_size) +
                                               " differs from plan's " + std::to_string(world_));
  }
  if (rank < 0 || rank >= world_size) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "next: rank " + std::to_string(rank) +
                                               " is out of range [0, " +
                                               std::to_string(world_size) + ")");
  }
  if (has_seed_ && seed != seed_) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION,
                "next: seed " + std::to_string(seed) + " differs from the seed " +
                    std::to_string(seed_) + " of the batches drawn before");
  }
  if (!has_seed_ && imported_has_seed_ && seed_check(seed) != imported_seed_check_) {
    throw Error(LOOM_ERR_FAILED_PRECONDITION,
                "next: seed " + std::to_string(seed) +
                    " is not the seed of the run whose state was imported");
  }
  const int64_t last = last_step();
  const bool again = step == last && last > 0;
  if (!again && step != last + 1) {
    throw Error(
        LOOM_ERR_FAILED_PRECONDITION,
        "next: step " + std::to_string(step) + " is not the next step (" +
            std::to_string(last + 1) + ")" +
            (last > 0 ? " nor the last one again (" + std::to_string(last) + ")" : std::string()) +
            "; a resumed run imports the exported state first");
  }
  if (pending_redraw_) {
    // The state holds the position before its last step: draw that step again, then the
    // one asked for if it is the next.
    // A draw that throws leaves the position as it was; if the second one throws, go back
    // to before the first (pre_ still is that position: pending, it equals pos_).
    Position saved = pos_;
    try {
      draw(last, seed, difficulty);
      if (step == last + 1) draw(step, seed, difficulty);
    } catch (...) {
      pos_ = std::move(saved);
      has_seed_ = false;
      drop_derived();
      throw;
    }
    pending_redraw_ = false;
    imported_has_seed_ = false;
  } else if (!again) {
    draw(step, seed, difficulty);
  }
  const uint64_t lo = share_begin(batch_, world_, static_cast<uint64_t>(rank));
  const uint64_t hi = share_begin(batch_, world_, static_cast<uint64_t>(rank) + 1);
  Share share;
  share.ids = std::span<const int64_t>(batch_ids_).subspan(lo, hi - lo);
  share.difficulty = clustering_ == Clustering::kSingleCluster
                         ? std::numeric_limits<double>::quiet_NaN()
                         : pos_.difficulty;
  share.epoch = (pos_.consumed - batch_) / n_;
  share.consumed = pos_.consumed;
  return share;
}

// ---- state

std::vector<std::byte> SamplerCore::export_state() const {
  require_planned("export_state");
  // The position before the last step drawn, and that step: import draws it again, so a
  // resumed instance can hand out another rank's share of it as well as the next batch.
  const Position& p = pending_redraw_ ? pos_ : pre_;
  const int64_t drawn = last_step();
  const bool seeded = has_seed_ || imported_has_seed_;
  const uint64_t check = has_seed_ ? seed_check(seed_) : imported_seed_check_;
  Appender out;
  out.pod<uint64_t>(kStateMagic.size());
  out.bytes.insert(out.bytes.end(), reinterpret_cast<const std::byte*>(kStateMagic.data()),
                   reinterpret_cast<const std::byte*>(kStateMagic.data()) + kStateMagic.size());
  out.pod<uint32_t>(kStateVersion);
  out.pod<uint32_t>(clustering_ == Clustering::kSingleCluster ? 1 : 0);
  out.pod<uint32_t>(type_ == DifficultyType::kPercentile ? 1 : 0);
  out.pod<uint64_t>(n_);
  out.pod<uint64_t>(batch_);
  out.pod<uint32_t>(world_);
  out.pod<uint32_t>(seeded ? 1 : 0);
  out.pod<uint64_t>(seeded ? check : 0);
  out.pod<int64_t>(drawn);
  out.pod<uint64_t>(p.consumed);
  out.pod<uint64_t>(p.admitted);
  out.pod<double>(p.difficulty);
  out.pod<uint64_t>(p.clusters.size());
  for (const Cluster& c : p.clusters) {
    out.pod<uint64_t>(c.lo);
    out.pod<uint64_t>(c.hi);
    out.pod<uint64_t>(c.pass);
    out.pod<uint64_t>(c.cursor);
  }
  return std::move(out.bytes);
}

void SamplerCore::check_position(const Position& p, int64_t drawn) const {
  if (drawn <= 1) {
    if (p.consumed != 0 || p.admitted != 0 || !p.clusters.empty()) {
      bad("a state before its second step has drawn samples");
    }
    return;
  }
  if (p.clusters.empty()) bad("no clusters after " + std::to_string(drawn - 1) + " steps");
  uint64_t expect_lo = 0;
  uint64_t taken = 0;
  bool overflow = false;
  for (std::size_t i = 0; i < p.clusters.size(); ++i) {
    const Cluster& c = p.clusters[i];
    if (c.lo != expect_lo || c.hi <= c.lo || c.cursor > c.hi - c.lo) {
      bad("cluster " + std::to_string(i) + " [" + std::to_string(c.lo) + ", " +
          std::to_string(c.hi) + ") cursor " + std::to_string(c.cursor) +
          " is not a non-empty range following the one before");
    }
    expect_lo = c.hi;
    uint64_t t = 0;
    overflow |= __builtin_mul_overflow(c.pass, c.hi - c.lo, &t);
    overflow |= __builtin_add_overflow(t, c.cursor, &t);
    overflow |= __builtin_add_overflow(taken, t, &taken);
  }
  if (p.admitted != expect_lo || p.admitted > imported_n_) {
    bad("admitted count " + std::to_string(p.admitted) + " does not match its clusters");
  }
  if (clustering_ == Clustering::kSingleCluster &&
      (p.clusters.size() != 1 || p.admitted != imported_n_)) {
    bad("a single-cluster state must have one cluster of every sample");
  }
  if (clustering_ == Clustering::kScheduleBased && p.admitted > sorted_.size()) {
    bad("more samples admitted than " + source_ + " has");
  }
  if (overflow || taken != p.consumed) {
    bad("its clusters' passes and cursors do not add up to the " + std::to_string(p.consumed) +
        " samples drawn");
  }
  if (clustering_ == Clustering::kScheduleBased &&
      (std::isnan(p.difficulty) ||
       (type_ == DifficultyType::kPercentile && !(p.difficulty >= 0 && p.difficulty <= 100)))) {
    bad("difficulty " + number(p.difficulty) + " is out of range");
  }
}

void SamplerCore::import_state(std::span<const std::byte> blob) {
  loom::sdk::StateReader in(blob);
  in.read_header(kStateMagic, kStateVersion);
  const auto clustering = in.read_pod<uint32_t>();
  const auto type = in.read_pod<uint32_t>();
  const bool single = clustering_ == Clustering::kSingleCluster;
  if (clustering != (single ? 1u : 0u)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string("state was exported by a sampler with clustering_type ") +
                    (clustering == 1 ? "'single_cluster'" : "'schedule_based'") + ", this one is " +
                    (single ? "'single_cluster'" : "'schedule_based'"));
  }
  const bool percentile = type_ == DifficultyType::kPercentile;
  if (!single && type != (percentile ? 1u : 0u)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                std::string("state was exported by a sampler with difficulty_type ") +
                    (type == 1 ? "'percentile'" : "'value'") + ", this one is " +
                    (percentile ? "'percentile'" : "'value'"));
  }
  const auto n = in.read_pod<uint64_t>();
  const auto b = in.read_pod<uint64_t>();
  const auto w = in.read_pod<uint32_t>();
  const auto seeded = in.read_pod<uint32_t>();
  const auto check = in.read_pod<uint64_t>();
  const auto drawn = in.read_pod<int64_t>();
  Position p;
  p.consumed = in.read_pod<uint64_t>();
  p.admitted = in.read_pod<uint64_t>();
  p.difficulty = in.read_pod<double>();
  const auto count = in.read_pod<uint64_t>();
  if (count > in.remaining() / (4 * sizeof(uint64_t))) {
    throw Error(LOOM_ERR_DATA_LOSS, "state blob is truncated: " + std::to_string(count) +
                                        " clusters do not fit in the " +
                                        std::to_string(in.remaining()) + " bytes left");
  }
  p.clusters.resize(count);
  for (Cluster& c : p.clusters) {
    c.lo = in.read_pod<uint64_t>();
    c.hi = in.read_pod<uint64_t>();
    c.pass = in.read_pod<uint64_t>();
    c.cursor = in.read_pod<uint64_t>();
  }
  in.expect_end();

  if (n == 0 || b == 0 || w == 0 || b < w) {
    bad("plan sizes " + std::to_string(n) + ", " + std::to_string(b) + ", " + std::to_string(w) +
        " are not valid");
  }
  if (drawn < 0) bad("step " + std::to_string(drawn) + " is negative");
  if (seeded > 1 || (seeded == 1) != (drawn > 0)) bad("seed flag does not match its step");
  uint64_t expect_consumed = 0;
  if (drawn > 1 && __builtin_mul_overflow(static_cast<uint64_t>(drawn - 1), b, &expect_consumed)) {
    bad("step " + std::to_string(drawn) + " overflows the sample count");
  }
  if (p.consumed != expect_consumed) {
    bad(std::to_string(p.consumed) + " samples drawn before step " + std::to_string(drawn) +
        " of " + std::to_string(b) + " each");
  }
  if (planned_ && (n != n_ || b != batch_ || w != world_)) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT,
                "state was planned with dataset_size " + std::to_string(n) + ", global_batch " +
                    std::to_string(b) + ", world_size " + std::to_string(w) + "; this sampler " +
                    "with " + std::to_string(n_) + ", " + std::to_string(batch_) + ", " +
                    std::to_string(world_));
  }
  if (!single && n != sorted_.size()) {
    throw Error(LOOM_ERR_INVALID_ARGUMENT, "state was planned with dataset_size " +
                                               std::to_string(n) + ", " + source_ + " has " +
                                               std::to_string(sorted_.size()) + " samples");
  }
  const uint64_t saved_n = imported_n_;
  imported_n_ = n;
  try {
    p.step = drawn > 0 ? drawn - 1 : 0;
    check_position(p, drawn);
  } catch (...) {
    imported_n_ = saved_n;
    throw;
  }
  // Accepted: the position before step `drawn`, which the next call draws again.
  if (!planned_) {
    imported_unplanned_ = true;
    imported_batch_ = b;
    imported_world_ = w;
  }
  pos_ = p;
  pre_ = p;
  batch_ids_.clear();
  has_seed_ = false;
  imported_has_seed_ = seeded == 1;
  imported_seed_check_ = check;
  pending_redraw_ = drawn > 0;
  drop_derived();
}

}  // namespace loom::data::sampler
