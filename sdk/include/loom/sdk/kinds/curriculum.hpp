// The "loom.curriculum/1" kind in the SDK (loom/kinds/curriculum.h): the base class a
// difficulty metric or schedule derives from, the checked view of the samples it scores, and
// the table the SDK builds from it.
#ifndef LOOM_SDK_KINDS_CURRICULUM_HPP
#define LOOM_SDK_KINDS_CURRICULUM_HPP

#include <loom/kinds/curriculum.h>
#include <loom/sdk/kinds/table.hpp>
#include <loom/sdk/plugin.hpp>
#include <loom/sdk/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <string>

namespace loom::sdk {

// "loom.curriculum/1" (since 1.3): a difficulty metric, a schedule, or both.
//   every method optional, but a class needs score or at (or both):
//             void score(const loom_curriculum_score_args&)   [any]: the metric half
//             void count(const loom_curriculum_count_args&)   [any]: a metric's first pass
//             void at(loom_curriculum_at_args&)               [instance]: the schedule half
//             void plan(loom_curriculum_plan_args&)           [any]
//   The table sets `roles` itself, from which of score and at the class has (METRIC,
//   SCHEDULE), and defaults seq_len_mode to LOOM_SEQ_LEN_NONE and stats_count to 0; a plan
//   the class has then fills seq_len_mode and stats_count (what it writes to roles is
//   overwritten). What the class lacks stays NULL in the table. Before count and score the
//   SDK checks what it can (curriculum_samples below: tokens 1-D uint16/int32/int64,
//   offsets int64 with samples + 1 elements, non-decreasing and within tokens when in host
//   memory, stats int64 with stats_count elements, scores fp64 with one per sample, all
//   contiguous and on one device), so the class gets clean arguments; that every token is
//   below vocab_size is the class's to check where it matters. score, count and plan are
//   [any]: the class must allow concurrent calls; at step is >= 1.
struct Curriculum {
  static constexpr const char* kKind = LOOM_KIND_CURRICULUM;
  using sdk_kind = Curriculum;
};

// The checked batch of samples a curriculum's count and score receive (the SDK builds it
// from loom_curriculum_samples before calling the class; a class may call it too).
struct CurriculumSamples {
  const DLTensor* tokens = nullptr;   // 1-D, uint16, int32 or int64, contiguous
  const DLTensor* offsets = nullptr;  // 1-D int64, count + 1 elements, same device
  int64_t count = 0;                  // samples: numel(offsets) - 1
  DLDevice device{kDLCPU, 0};         // of tokens and offsets

  // Sample i is tokens [begin(i), end(i)); host memory only (the offsets are read here).
  int64_t begin(int64_t i) const { return data_as<const int64_t>(*offsets)[i]; }
  int64_t end(int64_t i) const { return data_as<const int64_t>(*offsets)[i + 1]; }
};

// Checks a loom_curriculum_samples (`what` names it in messages) and returns its view.
// Throws Error(INVALID_ARGUMENT) naming the tensor and what is wrong.
inline CurriculumSamples curriculum_samples(const loom_curriculum_samples& s,
                                            const std::string& what = "samples") {
  detail::check_struct_size(s.struct_size, LOOM_CURRICULUM_SAMPLES_SIZE, what);
  const DLTensor& tokens = expect_tensor(s.tokens, what + ".tokens");
  const DLTensor& offsets = expect_tensor(s.offsets, what + ".offsets");
  if (tokens.ndim != 1) fail_argument(what + ".tokens is not 1-D: shape " + shape_string(tokens));
  if (!(is_dtype(tokens, kDLUInt, 16) || is_dtype(tokens, kDLInt, 32) ||
        is_dtype(tokens, kDLInt, 64))) {
    fail_argument(what + ".tokens has dtype " + dtype_string(tokens.dtype) +
                  ", expected uint16, int32 or int64");
  }
  expect_contiguous(tokens, what + ".tokens");
  if (offsets.ndim != 1 || offsets.shape[0] < 1) {
    fail_argument(what + ".offsets has shape " + shape_string(offsets) +
                  ", expected 1-D with samples + 1 (>= 1) elements");
  }
  expect_dtype(offsets, DLDataType{kDLInt, 64, 1}, what + ".offsets");
  expect_contiguous(offsets, what + ".offsets");
  expect_same_device(offsets, what + ".offsets", tokens, what + ".tokens");
  CurriculumSamples out;
  out.tokens = &tokens;
  out.offsets = &offsets;
  out.count = offsets.shape[0] - 1;
  out.device = tokens.device;
  if (is_cpu(offsets)) {
    const int64_t n = tokens.shape[0];
    const auto* o = data_as<const int64_t>(offsets);
    for (int64_t i = 0; i <= out.count; ++i) {
      if (o[i] < 0 || o[i] > n || (i > 0 && o[i] < o[i - 1])) {
        fail_argument(what + ".offsets[" + std::to_string(i) + "] = " + std::to_string(o[i]) +
                      (o[i] < 0 || o[i] > n ? " is outside the " + std::to_string(n) + " tokens"
                                            : " is below offsets[" + std::to_string(i - 1) +
                                                  "] = " + std::to_string(o[i - 1])));
      }
    }
  }
  return out;
}

namespace detail {

template <class T>
constexpr bool kCurriculumScores = requires(T& t, const loom_curriculum_score_args& a) {
  t.score(a);
};
template <class T>
constexpr bool kCurriculumCounts = requires(T& t, const loom_curriculum_count_args& a) {
  t.count(a);
};
template <class T>
constexpr bool kCurriculumSchedules = requires(T& t, loom_curriculum_at_args& a) {
  t.at(a);
};
template <class T>
constexpr bool kCurriculumPlans = requires(T& t, loom_curriculum_plan_args& a) {
  t.plan(a);
};

template <class T>
struct CurriculumTable {
  using E = Entry<T>;

  // The roles from the class's methods, then the class's plan for the rest.
  static void plan_into(T& obj, loom_curriculum_plan_args& full) {
    full.seq_len_mode = LOOM_SEQ_LEN_NONE;
    full.stats_count = 0;
    if constexpr (kCurriculumPlans<T>) obj.plan(full);
    full.roles = (kCurriculumScores<T> ? LOOM_CURRICULUM_METRIC : 0u) |
                 (kCurriculumSchedules<T> ? LOOM_CURRICULUM_SCHEDULE : 0u);
    if (full.seq_len_mode > LOOM_SEQ_LEN_RESHAPE) {
      plugin_bug("plan", "set seq_len_mode " + std::to_string(full.seq_len_mode) +
                             ", which is not a LOOM_SEQ_LEN_* value");
    }
    if (!kCurriculumScores<T> && full.stats_count != 0) {
      plugin_bug("plan", "set stats_count " + std::to_string(full.stats_count) +
                             " but it has no score (a schedule has no stats)");
    }
  }
  static uint64_t stats_count(T& obj, uint32_t vocab_size) {
    loom_curriculum_plan_args p{};
    p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
    p.vocab_size = vocab_size;
    plan_into(obj, p);
    return p.stats_count;
  }
  static void check_stats(const DLTensor* stats, uint64_t want, const CurriculumSamples& s,
                          const char* what) {
    const DLTensor& t = expect_tensor(stats, what);
    expect_dtype(t, DLDataType{kDLInt, 64, 1}, what);
    expect_contiguous(t, what);
    if (static_cast<uint64_t>(numel(t)) != want) {
      fail_argument(std::string(what) + " has " + std::to_string(numel(t)) +
                    " elements, expected the plan's stats_count " + std::to_string(want));
    }
    expect_device(t, s.device, what);
  }

  // What the ABI promises of at's answer (loom/kinds/curriculum.h): a finite difficulty, and
  // seq_len >= 1 for a sequence-length schedule (seq_len_mode TRUNCATE or RESHAPE) or 0 for
  // one whose difficulty is not a length. A class that breaks it is a plugin bug.
  static void check_at(T& obj, const loom_curriculum_at_args& a) {
    const std::string step = " at step " + std::to_string(a.step);
    if (!std::isfinite(a.difficulty)) {
      plugin_bug("at", "gave difficulty " + std::string(std::isnan(a.difficulty) ? "NaN" : "inf") +
                           step + "; a schedule's difficulty must be finite");
    }
    loom_curriculum_plan_args p{};
    p.struct_size = LOOM_CURRICULUM_PLAN_ARGS_SIZE;
    plan_into(obj, p);
    if (p.seq_len_mode == LOOM_SEQ_LEN_NONE) {
      if (a.seq_len != 0) {
        plugin_bug("at", "gave seq_len " + std::to_string(a.seq_len) + step +
                             " but its seq_len_mode is NONE (the seq_len must be 0)");
      }
    } else if (a.seq_len < 1) {
      plugin_bug("at", "gave seq_len " + std::to_string(a.seq_len) + step +
                           " but it is a sequence-length schedule (seq_len_mode " +
                           (p.seq_len_mode == LOOM_SEQ_LEN_TRUNCATE ? "TRUNCATE" : "RESHAPE") +
                           "), whose seq_len must be >= 1");
    }
  }

  static loom_status* plan(void* instance, loom_curriculum_plan_args* args) noexcept {
    return E::checked(instance, args, LOOM_CURRICULUM_PLAN_ARGS_SIZE, "plan args",
                      [](loom_curriculum_plan_args& a, const Instance<T>& self) {
                        fill(&a, "plan args", [&](loom_curriculum_plan_args& full) {
                          plan_into(self.shared(), full);
                        });
                      });
  }
  static loom_status* count(void* instance, const loom_curriculum_count_args* args) noexcept {
    return E::checked(instance, args, LOOM_CURRICULUM_COUNT_ARGS_SIZE, "count args",
                      [](const loom_curriculum_count_args& a, const Instance<T>& self) {
                        T& obj = self.shared();
                        const CurriculumSamples s = curriculum_samples(a.samples);
                        const uint64_t want = stats_count(obj, a.vocab_size);
                        if (want == 0 && a.stats == nullptr) {
                          // Nothing to count into: a metric whose plan asks for no stats.
                        } else {
                          check_stats(a.stats, want, s, "stats");
                        }
                        obj.count(a);
                      });
  }
  static loom_status* score(void* instance, const loom_curriculum_score_args* args) noexcept {
    return E::checked(instance, args, LOOM_CURRICULUM_SCORE_ARGS_SIZE, "score args",
                      [](const loom_curriculum_score_args& a, const Instance<T>& self) {
                        T& obj = self.shared();
                        const CurriculumSamples s = curriculum_samples(a.samples);
                        const uint64_t want = stats_count(obj, a.vocab_size);
                        if (want == 0) {
                          if (a.stats != nullptr)
                            fail_argument("stats is set but the metric's stats_count is 0");
                        } else {
                          check_stats(a.stats, want, s, "stats");
                        }
                        const DLTensor& scores = expect_tensor(a.scores, "scores");
                        expect_dtype(scores, DLDataType{kDLFloat, 64, 1}, "scores");
                        expect_contiguous(scores, "scores");
                        expect_numel(scores, s.count, "scores");
                        expect_device(scores, s.device, "scores");
                        obj.score(a);
                      });
  }
  static loom_status* at(void* instance, loom_curriculum_at_args* args) noexcept {
    return E::checked(
        instance, args, LOOM_CURRICULUM_AT_ARGS_SIZE, "at args",
        [](loom_curriculum_at_args& a, const Instance<T>& self) {
          if (a.step < 1) {
            fail_argument("at: step is " + std::to_string(a.step) + "; steps start at 1");
          }
          fill(&a, "at args", [&](loom_curriculum_at_args& full) {
            T& obj = self.object();
            full.difficulty = 0;
            full.seq_len = 0;
            obj.at(full);
            check_at(obj, full);
          });
        });
  }

  static const loom_curriculum_v1* get() {
    static_assert(kCurriculumScores<T> || kCurriculumSchedules<T>,
                  "a Curriculum needs void score(const loom_curriculum_score_args&) (a metric), "
                  "void at(loom_curriculum_at_args&) (a schedule), or both");
    static_assert(!kCurriculumCounts<T> || kCurriculumScores<T>,
                  "a Curriculum with count needs score: count is a metric's first pass");
    static const loom_curriculum_v1 table = [] {
      loom_curriculum_v1 v{};
      v.struct_size = LOOM_CURRICULUM_V1_SIZE;
      v.plan = &plan;
      if constexpr (kCurriculumCounts<T>) v.count = &count;
      if constexpr (kCurriculumScores<T>) v.score = &score;
      if constexpr (kCurriculumSchedules<T>) v.at = &at;
      return v;
    }();
    return &table;
  }
};

template <>
struct KindTraits<Curriculum> {
  template <class T>
  static const void* table() {
    return CurriculumTable<T>::get();
  }
};

}  // namespace detail
}  // namespace loom::sdk

#endif  // LOOM_SDK_KINDS_CURRICULUM_HPP
