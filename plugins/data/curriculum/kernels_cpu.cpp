// CPU kernels of the curriculum metrics: samples in parallel on the host's pool. Every sum is an
// integer sum (kernels.hpp), exact in any order, so uint16 tokens (the trainer's datasets) go
// through SIMD code compiled for every target Highway knows and chosen at run time; int32 and
// int64 tokens take plain loops. The vocabulary check stays on every token but costs a
// max-reduction per sample (or block): the first bad token is looked for only when the maximum
// is out of range.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace loom::data::curriculum {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DU16 = hn::ScalableTag<uint16_t>;

// The largest of p[0, n) (0 when n is 0).
HWY_INLINE uint16_t MaxOf(const uint16_t* HWY_RESTRICT p, std::size_t n) {
  const DU16 d;
  const std::size_t N = hn::Lanes(d);
  auto m0 = hn::Zero(d);
  auto m1 = hn::Zero(d);
  std::size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    m0 = hn::Max(m0, hn::LoadU(d, p + i));
    m1 = hn::Max(m1, hn::LoadU(d, p + i + N));
  }
  for (; i + N <= n; i += N) m0 = hn::Max(m0, hn::LoadU(d, p + i));
  auto m = static_cast<uint16_t>(hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1))));
  for (; i < n; ++i) m = std::max(m, p[i]);
  return m;
}

// How many of p[0, n) equal v; their maximum goes to *max.
HWY_INLINE std::size_t CountEqual(const uint16_t* HWY_RESTRICT p, std::size_t n, uint16_t v,
                                  uint16_t* max) {
  const DU16 d;
  const std::size_t N = hn::Lanes(d);
  const auto vv = hn::Set(d, v);
  auto m = hn::Zero(d);
  std::size_t eq = 0;
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto x = hn::LoadU(d, p + i);
    m = hn::Max(m, x);
    eq += hn::CountTrue(d, hn::Eq(x, vv));
  }
  auto mm = static_cast<uint16_t>(hn::GetLane(hn::MaxOfLanes(d, m)));
  for (; i < n; ++i) {
    mm = std::max(mm, p[i]);
    eq += p[i] == v ? 1 : 0;
  }
  *max = mm;
  return eq;
}

// The lowest k in [lo, hi) with tok[k] >= vocab, else hi.
int64_t FirstBadU16(const uint16_t* HWY_RESTRICT tok, int64_t lo, int64_t hi, int64_t vocab) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t e = std::min(hi, b + kBlock);
    if (MaxOf(tok + b, static_cast<std::size_t>(e - b)) < vocab) continue;
    for (int64_t k = b; k < e; ++k) {
      if (tok[k] >= vocab) return k;
    }
  }
  return hi;
}

// seqlen over samples [begin, end): scores[i] = tokens != pad (pad outside [0, 65535]: none
// are). Returns the lowest bad token index of those samples, or -1.
int64_t SeqlenU16(const uint16_t* HWY_RESTRICT tok, const int64_t* HWY_RESTRICT off,
                  std::size_t begin, std::size_t end, int64_t pad, int64_t vocab,
                  double* HWY_RESTRICT scores) {
  const bool padded = pad >= 0 && pad <= 0xFFFF;
  for (std::size_t i = begin; i < end; ++i) {
    const int64_t lo = off[i];
    const auto n = static_cast<std::size_t>(off[i + 1] - lo);
    uint16_t max = 0;
    std::size_t pads = 0;
    if (padded) {
      pads = CountEqual(tok + lo, n, static_cast<uint16_t>(pad), &max);
    } else {
      max = MaxOf(tok + lo, n);
    }
    if (n > 0 && max >= vocab) return FirstBadU16(tok, lo, off[i + 1], vocab);
    scores[i] = static_cast<double>(n - pads);
  }
  return -1;
}

// vocabulary_rarity over samples [begin, end): the int64 sum of value[token] per sample, four
// independent accumulators (a scalar gather: the table loads are the cost; the table, 8 bytes
// per vocabulary entry, mostly lives in L2). Returns the lowest bad
// token index of those samples, or -1.
int64_t RarityU16(const uint16_t* HWY_RESTRICT tok, const int64_t* HWY_RESTRICT off,
                  std::size_t begin, std::size_t end, const int64_t* HWY_RESTRICT value,
                  int64_t vocab, double* HWY_RESTRICT scores) {
  for (std::size_t i = begin; i < end; ++i) {
    const int64_t lo = off[i];
    const auto n = static_cast<std::size_t>(off[i + 1] - lo);
    const uint16_t* HWY_RESTRICT p = tok + lo;
    if (vocab <= 0xFFFF && n > 0 && MaxOf(p, n) >= vocab) {
      return FirstBadU16(tok, lo, off[i + 1], vocab);
    }
    int64_t a0 = 0;
    int64_t a1 = 0;
    int64_t a2 = 0;
    int64_t a3 = 0;
    std::size_t k = 0;
    // Eight tokens per two 8-byte loads; not vectorised: the compiler's gathers are slower here
    // than scalar loads.
#if defined(__clang__)
#pragma clang loop vectorize(disable) interleave(disable)
#endif
    for (; k + 8 <= n; k += 8) {
      uint64_t w0 = 0;
      uint64_t w1 = 0;
      std::memcpy(&w0, p + k, 8);
      std::memcpy(&w1, p + k + 4, 8);
      a0 += value[w0 & 0xFFFF];
      a1 += value[(w0 >> 16) & 0xFFFF];
      a2 += value[(w0 >> 32) & 0xFFFF];
      a3 += value[w0 >> 48];
      a0 += value[w1 & 0xFFFF];
      a1 += value[(w1 >> 16) & 0xFFFF];
      a2 += value[(w1 >> 32) & 0xFFFF];
      a3 += value[w1 >> 48];
    }
#if defined(__clang__)
#pragma clang loop vectorize(disable) interleave(disable)
#endif
    for (; k < n; ++k) a0 += value[p[k]];
    scores[i] = rarity_score_of((a0 + a1) + (a2 + a3));
  }
  return -1;
}

}  // namespace HWY_NAMESPACE
}  // namespace loom::data::curriculum
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/status.hpp>

namespace loom::data::curriculum {

HWY_EXPORT(FirstBadU16);
HWY_EXPORT(SeqlenU16);
HWY_EXPORT(RarityU16);

namespace {

constexpr int64_t kTaskTokens = 1 << 16;
constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();
constexpr int64_t kCountBlock = 4096;  // tokens checked, then counted, at a time

// The offsets' problem with the lowest index (as the CUDA kernels order them), then the first
// sample longer than max_len.
Problem check_offsets(const SampleData& s, int64_t max_len = kNoLimit) {
  const int64_t* off = s.offsets;
  int64_t longest = -1;  // the first sample over max_len
  for (int64_t i = 0; i <= s.samples; ++i) {
    if (off[i] < 0) return {Problem::kOffsetNegative, 0, i, off[i], 0};
    if (off[i] > s.token_count) return {Problem::kOffsetBeyond, 0, i, off[i], 0};
    if (i > 0 && off[i] < off[i - 1]) {
      return {Problem::kOffsetDecreasing, 0, i, off[i], off[i - 1]};
    }
    if (i > 0 && longest < 0 && off[i] - off[i - 1] > max_len) longest = i - 1;
  }
  if (longest >= 0) {
    return {Problem::kSampleTooLong, 0, longest, off[longest + 1] - off[longest], max_len};
  }
  return {};
}

template <class T>
const T* tokens_as(const SampleData& s) {
  return static_cast<const T*>(s.tokens);
}

// Keeps the lowest bad token index seen by any thread.
struct FirstBad {
  std::atomic<int64_t> index{std::numeric_limits<int64_t>::max()};
  void offer(int64_t i) {
    int64_t cur = index.load(std::memory_order_relaxed);
    while (i < cur && !index.compare_exchange_weak(cur, i, std::memory_order_relaxed)) {
    }
  }
  bool any() const { return index.load() != std::numeric_limits<int64_t>::max(); }
};

int64_t token_at(const SampleData& s, int64_t i) {
  switch (s.type) {
    case TokenType::kU16:
      return tokens_as<uint16_t>(s)[i];
    case TokenType::kI32:
      return tokens_as<int32_t>(s)[i];
    case TokenType::kI64:
      return tokens_as<int64_t>(s)[i];
  }
  return 0;
}

Problem token_problem(const SampleData& s, const FirstBad& bad) {
  if (!bad.any()) return {};
  const int64_t i = bad.index.load();
  const int64_t v = token_at(s, i);
  return {v < 0 ? Problem::kTokenNegative : Problem::kTokenTooLarge, 0, i, v, 0};
}

template <class T>
bool in_range(T t, int64_t vocab) {
  if constexpr (std::is_signed_v<T>) {
    if (t < 0) return false;
  }
  return static_cast<int64_t>(t) < vocab;
}

// body(begin, end) over the samples in parallel; returns the lowest bad token index of its
// samples or -1.
template <class Body>
Problem for_samples(const SampleData& s, int64_t max_len, Body&& body) {
  if (Problem p = check_offsets(s, max_len); p.kind != Problem::kNone) return p;
  FirstBad bad;
  // About kTaskTokens tokens per task (at least one sample).
  const int64_t tokens = s.offsets[s.samples] - s.offsets[0];
  const int64_t mean = std::max<int64_t>(1, s.samples > 0 ? tokens / s.samples : 1);
  const auto grain = static_cast<std::size_t>(std::max<int64_t>(1, kTaskTokens / mean));
  loom::sdk::parallel_for(static_cast<std::size_t>(s.samples), grain,
                          [&](std::size_t begin, std::size_t end) {
                            const int64_t k = body(begin, end);
                            if (k >= 0) bad.offer(k);
                          });
  return token_problem(s, bad);
}

// The plain loops for int32 and int64 tokens: per sample, check then sum.
template <class T, class PerToken>
int64_t plain_samples(const SampleData& s, std::size_t begin, std::size_t end, PerToken&& add) {
  const T* tok = tokens_as<T>(s);
  const auto vocab = static_cast<int64_t>(s.vocab_size);
  for (std::size_t i = begin; i < end; ++i) {
    const int64_t lo = s.offsets[i];
    const int64_t hi = s.offsets[i + 1];
    bool ok = true;
    for (int64_t k = lo; k < hi; ++k) ok &= in_range(tok[k], vocab);
    if (!ok) {
      for (int64_t k = lo; k < hi; ++k) {
        if (!in_range(tok[k], vocab)) return k;
      }
    }
    add(i, tok + lo, hi - lo);
  }
  return -1;
}

template <class T>
int64_t plain_first_bad(const SampleData& s, int64_t lo, int64_t hi) {
  const T* tok = tokens_as<T>(s);
  const auto vocab = static_cast<int64_t>(s.vocab_size);
  for (int64_t k = lo; k < hi; ++k) {
    if (!in_range(tok[k], vocab)) return k;
  }
  return hi;
}

int64_t first_bad(const SampleData& s, int64_t lo, int64_t hi) {
  switch (s.type) {
    case TokenType::kU16:
      return HWY_DYNAMIC_DISPATCH(FirstBadU16)(tokens_as<uint16_t>(s), lo, hi,
                                               static_cast<int64_t>(s.vocab_size));
    case TokenType::kI32:
      return plain_first_bad<int32_t>(s, lo, hi);
    case TokenType::kI64:
      return plain_first_bad<int64_t>(s, lo, hi);
  }
  return hi;
}

// Adds the counts of tok[0, n) to h, four tokens per step. (Interleaved sub-histograms, to
// break the store-to-load chains of repeated tokens, measured slower here: their zeroing and
// merging per call cost more than the chains on the analyzer's chunks of 2^20 tokens.)
template <class T>
void histogram(const T* tok, int64_t n, int64_t* h, int64_t step) {
  int64_t k = 0;
#if defined(__clang__)
#pragma clang loop vectorize(disable) interleave(disable)
#endif
  for (; k + 4 <= n; k += 4) {
    h[static_cast<std::size_t>(tok[k])] += step;
    h[static_cast<std::size_t>(tok[k + 1])] += step;
    h[static_cast<std::size_t>(tok[k + 2])] += step;
    h[static_cast<std::size_t>(tok[k + 3])] += step;
  }
  for (; k < n; ++k) h[static_cast<std::size_t>(tok[k])] += step;
}

// Counts tokens [b, e) into h block by block, each block checked first (a max-reduction for
// uint16); stops before the block holding the first bad token and returns that token's index
// (else e). step -1 (unchecked: the tokens were) takes counts back out, undoing a failed count.
int64_t count_checked(const SampleData& s, int64_t b, int64_t e, int64_t* h, int64_t step) {
  for (int64_t x = b; x < e; x += kCountBlock) {
    const int64_t y = std::min(e, x + kCountBlock);
    if (step > 0) {
      if (const int64_t k = first_bad(s, x, y); k < y) return k;
    }
    switch (s.type) {
      case TokenType::kU16:
        histogram(tokens_as<uint16_t>(s) + x, y - x, h, step);
        break;
      case TokenType::kI32:
        histogram(tokens_as<int32_t>(s) + x, y - x, h, step);
        break;
      case TokenType::kI64:
        histogram(tokens_as<int64_t>(s) + x, y - x, h, step);
        break;
    }
  }
  return e;
}

}  // namespace

RarityTable rarity_table(const int64_t* counts, std::size_t vocab_size) {
  int64_t total = 0;
  for (std::size_t t = 0; t < vocab_size; ++t) {
    if (counts[t] < 0) {
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, "stats[" + std::to_string(t) + "] is " +
                                                            std::to_string(counts[t]) +
                                                            "; token counts are >= 0");
    }
    const int64_t c = std::max<int64_t>(counts[t], 1);
    if (total > std::numeric_limits<int64_t>::max() - c) {
      throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT,
                             "stats: the token counts sum beyond 2^63 - 1");
    }
    total += c;
  }
  RarityTable table;
  table.value.resize(vocab_size);
  const auto sum = static_cast<double>(total);
  const double scale = std::ldexp(1.0, kRarityFractionBits);
  int64_t largest = 0;
  for (std::size_t t = 0; t < vocab_size; ++t) {
    const auto c = static_cast<double>(std::max<int64_t>(counts[t], 1));
    // -log(c / C) <= log(2^63) < 43.7: the product is below 2^38, exact in the conversion.
    const int64_t v = std::llround(-std::log(c / sum) * scale);
    table.value[t] = std::max<int64_t>(v, 0);  // c == C gives -0.0: 0
    largest = std::max(largest, table.value[t]);
  }
  table.max_tokens = largest == 0 ? kNoLimit : std::numeric_limits<int64_t>::max() / largest;
  return table;
}

Problem seqlen_cpu(const SampleData& s, int64_t pad_token, double* scores) {
  const auto vocab = static_cast<int64_t>(s.vocab_size);
  return for_samples(s, kNoLimit, [&](std::size_t begin, std::size_t end) -> int64_t {
    switch (s.type) {
      case TokenType::kU16:
        return HWY_DYNAMIC_DISPATCH(SeqlenU16)(tokens_as<uint16_t>(s), s.offsets, begin, end,
                                               pad_token, vocab, scores);
      case TokenType::kI32:
        return plain_samples<int32_t>(s, begin, end,
                                      [&](std::size_t i, const int32_t* t, int64_t n) {
                                        int64_t c = 0;
                                        for (int64_t k = 0; k < n; ++k)
                                          c += t[k] != pad_token ? 1 : 0;
                                        scores[i] = static_cast<double>(c);
                                      });
      case TokenType::kI64:
        return plain_samples<int64_t>(s, begin, end,
                                      [&](std::size_t i, const int64_t* t, int64_t n) {
                                        int64_t c = 0;
                                        for (int64_t k = 0; k < n; ++k)
                                          c += t[k] != pad_token ? 1 : 0;
                                        scores[i] = static_cast<double>(c);
                                      });
    }
    return -1;
  });
}

Problem rarity_cpu(const SampleData& s, const RarityTable& table, double* scores) {
  const auto vocab = static_cast<int64_t>(s.vocab_size);
  const int64_t* value = table.value.data();
  return for_samples(s, table.max_tokens, [&](std::size_t begin, std::size_t end) -> int64_t {
    auto sum = [&](std::size_t i, const auto* t, int64_t n) {
      int64_t a = 0;
      for (int64_t k = 0; k < n; ++k) a += value[static_cast<std::size_t>(t[k])];
      scores[i] = rarity_score_of(a);
    };
    switch (s.type) {
      case TokenType::kU16:
        return HWY_DYNAMIC_DISPATCH(RarityU16)(tokens_as<uint16_t>(s), s.offsets, begin, end, value,
                                               vocab, scores);
      case TokenType::kI32:
        return plain_samples<int32_t>(s, begin, end, sum);
      case TokenType::kI64:
        return plain_samples<int64_t>(s, begin, end, sum);
    }
    return -1;
  });
}

Problem count_cpu(const SampleData& s, int64_t* stats) {
  if (Problem p = check_offsets(s); p.kind != Problem::kNone) return p;
  const std::size_t vocab = s.vocab_size;
  const int64_t lo = s.offsets[0];
  const int64_t n = s.offsets[s.samples] - lo;
  // A fixed number of parts, each counted into its own histogram (at most 64 MiB of them),
  // then summed: integer sums, so the result does not depend on the split. One part counts
  // straight into stats. A count that fails adds nothing: the parts' histograms are dropped,
  // or the one part's counts taken back out of stats.
  constexpr int64_t kMinPart = 1 << 18;
  constexpr std::size_t kHistogramBytes = std::size_t{64} << 20;
  const std::size_t max_parts = std::max<std::size_t>(
      1, std::min(loom::sdk::thread_count(), kHistogramBytes / (sizeof(int64_t) * vocab)));
  // A part counts at least 16 tokens per vocabulary entry, so zeroing and merging its
  // histogram stays small beside the counting (an analyzer's chunk of 2^20 tokens over a
  // 50257-token vocabulary is one part: the analyzer runs its chunks in parallel already).
  const int64_t min_part = std::max<int64_t>(kMinPart, 16 * static_cast<int64_t>(vocab));
  const auto parts = static_cast<std::size_t>(
      std::clamp<int64_t>(n / min_part, 1, static_cast<int64_t>(max_parts)));
  FirstBad bad;
  if (parts == 1) {
    const int64_t stop = count_checked(s, lo, lo + n, stats, 1);
    if (stop == lo + n) return {};
    bad.offer(stop);
    // Take back the counts of the blocks before the bad one (integers: exactly).
    count_checked(s, lo, lo + (stop - lo) / kCountBlock * kCountBlock, stats, -1);
    return token_problem(s, bad);
  }
  std::vector<int64_t> hist(parts * vocab, 0);
  loom::sdk::parallel_for(parts, 1, [&](std::size_t begin, std::size_t end) {
    for (std::size_t p = begin; p < end; ++p) {
      const int64_t b = lo + n * static_cast<int64_t>(p) / static_cast<int64_t>(parts);
      const int64_t e = lo + n * static_cast<int64_t>(p + 1) / static_cast<int64_t>(parts);
      const int64_t stop = count_checked(s, b, e, hist.data() + p * vocab, 1);
      if (stop < e) bad.offer(stop);
    }
  });
  if (bad.any()) return token_problem(s, bad);
  for (std::size_t p = 0; p < parts; ++p) {
    const int64_t* h = hist.data() + p * vocab;
    for (std::size_t t = 0; t < vocab; ++t) stats[t] += h[t];
  }
  return {};
}

}  // namespace loom::data::curriculum
#endif  // HWY_ONCE
