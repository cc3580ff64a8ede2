// CPU kernels of the curriculum metrics: samples in parallel on the host's pool, each sample
// summed sequentially (the order the CUDA kernels use, so scores agree bit for bit). Not
// vectorised: the work per token is a table gather and one dependent fp64 addition, whose
// order is fixed by the bit-identity rule.
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.hpp"

namespace loom::data::curriculum {
namespace {

constexpr std::size_t kSampleGrain = 64;

// The offsets' problem with the lowest index (as the CUDA kernels order them).
Problem check_offsets(const SampleData& s) {
  Problem p;
  const int64_t* off = s.offsets;
  for (int64_t i = 0; i <= s.samples; ++i) {
    if (off[i] < 0) return {Problem::kOffsetNegative, 0, i, off[i], 0};
    if (off[i] > s.token_count) return {Problem::kOffsetBeyond, 0, i, off[i], 0};
    if (i > 0 && off[i] < off[i - 1]) {
      return {Problem::kOffsetDecreasing, 0, i, off[i], off[i - 1]};
    }
  }
  return p;
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
  const int64_t i = bad.index.load();
  if (i == std::numeric_limits<int64_t>::max()) return {};
  const int64_t v = token_at(s, i);
  return {v < 0 ? Problem::kTokenNegative : Problem::kTokenTooLarge, 0, i, v, 0};
}

// fn(sample, token) over each sample's tokens in order; a bad token stops its sample.
// Returns per sample through `done(sample, ok)`.
template <class T, class PerSample>
void for_samples(const SampleData& s, FirstBad& bad, PerSample&& per_sample) {
  const T* tok = tokens_as<T>(s);
  const int64_t* off = s.offsets;
  const auto vocab = static_cast<int64_t>(s.vocab_size);
  loom::sdk::parallel_for(static_cast<std::size_t>(s.samples), kSampleGrain,
                          [&](std::size_t begin, std::size_t end) {
                            for (std::size_t i = begin; i < end; ++i) {
                              const int64_t lo = off[i];
                              const int64_t hi = off[i + 1];
                              const int64_t stop = per_sample(i, tok, lo, hi, vocab);
                              if (stop < hi) bad.offer(stop);
                            }
                          });
}

template <class Fn>
Problem dispatch(const SampleData& s, Fn&& fn) {
  if (Problem p = check_offsets(s); p.kind != Problem::kNone) return p;
  FirstBad bad;
  switch (s.type) {
    case TokenType::kU16:
      fn(static_cast<const uint16_t*>(nullptr), bad);
      break;
    case TokenType::kI32:
      fn(static_cast<const int32_t*>(nullptr), bad);
      break;
    case TokenType::kI64:
      fn(static_cast<const int64_t*>(nullptr), bad);
      break;
  }
  return token_problem(s, bad);
}

template <class T>
bool in_range(T t, int64_t vocab) {
  if constexpr (std::is_signed_v<T>) {
    if (t < 0) return false;
  }
  return static_cast<int64_t>(t) < vocab;
}

}  // namespace

std::vector<double> rarity_table(const int64_t* counts, std::size_t vocab_size) {
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
  std::vector<double> table(vocab_size);
  const auto sum = static_cast<double>(total);
  for (std::size_t t = 0; t < vocab_size; ++t) {
    const auto c = static_cast<double>(std::max<int64_t>(counts[t], 1));
    table[t] = -std::log(c / sum);
  }
  return table;
}

Problem seqlen_cpu(const SampleData& s, int64_t pad_token, double* scores) {
  return dispatch(s, [&](auto type_tag, FirstBad& bad) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
    for_samples<T>(s, bad, [&](std::size_t i, const T* tok, int64_t lo, int64_t hi, int64_t vocab) {
      int64_t n = 0;
      for (int64_t k = lo; k < hi; ++k) {
        if (!in_range(tok[k], vocab)) return k;
        n += static_cast<int64_t>(tok[k]) != pad_token ? 1 : 0;
      }
      scores[i] = static_cast<double>(n);
      return hi;
    });
  });
}

Problem count_cpu(const SampleData& s, int64_t* stats) {
  if (Problem p = check_offsets(s); p.kind != Problem::kNone) return p;
  const std::size_t vocab = s.vocab_size;
  const int64_t lo = s.offsets[0];
  const int64_t n = s.offsets[s.samples] - lo;
  // A fixed number of parts, each counted into its own histogram (at most 64 MiB of them),
  // then summed: integer sums, so the result does not depend on the split. One part counts
  // straight into stats.
  constexpr int64_t kMinPart = 1 << 16;
  constexpr std::size_t kHistogramBytes = std::size_t{64} << 20;
  const std::size_t max_parts = std::max<std::size_t>(
      1, std::min(loom::sdk::thread_count(), kHistogramBytes / (sizeof(int64_t) * vocab)));
  const auto parts = static_cast<std::size_t>(
      std::clamp<int64_t>(n / kMinPart, 1, static_cast<int64_t>(max_parts)));
  FirstBad bad;
  std::vector<int64_t> hist;
  auto run = [&](auto type_tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
    const T* tok = tokens_as<T>(s);
    const auto v = static_cast<int64_t>(vocab);
    // Every token checked first, so a count that fails adds nothing.
    loom::sdk::parallel_for(static_cast<std::size_t>(n), kMinPart,
                            [&](std::size_t begin, std::size_t end) {
                              for (std::size_t k = begin; k < end; ++k) {
                                if (!in_range(tok[lo + static_cast<int64_t>(k)], v)) {
                                  bad.offer(lo + static_cast<int64_t>(k));
                                  return;
                                }
                              }
                            });
    if (bad.index.load() != std::numeric_limits<int64_t>::max()) return;
    if (parts == 1) {
      for (int64_t k = lo; k < lo + n; ++k) ++stats[static_cast<std::size_t>(tok[k])];
      return;
    }
    hist.assign(parts * vocab, 0);
    loom::sdk::parallel_for(parts, 1, [&](std::size_t begin, std::size_t end) {
      for (std::size_t p = begin; p < end; ++p) {
        const int64_t b = lo + n * static_cast<int64_t>(p) / static_cast<int64_t>(parts);
        const int64_t e = lo + n * static_cast<int64_t>(p + 1) / static_cast<int64_t>(parts);
        int64_t* h = hist.data() + p * vocab;
        for (int64_t k = b; k < e; ++k) ++h[static_cast<std::size_t>(tok[k])];
      }
    });
    for (std::size_t p = 0; p < parts; ++p) {
      const int64_t* h = hist.data() + p * vocab;
      for (std::size_t t = 0; t < vocab; ++t) stats[t] += h[t];
    }
  };
  switch (s.type) {
    case TokenType::kU16:
      run(static_cast<const uint16_t*>(nullptr));
      break;
    case TokenType::kI32:
      run(static_cast<const int32_t*>(nullptr));
      break;
    case TokenType::kI64:
      run(static_cast<const int64_t*>(nullptr));
      break;
  }
  return token_problem(s, bad);
}

Problem rarity_cpu(const SampleData& s, const double* table, double* scores) {
  return dispatch(s, [&](auto type_tag, FirstBad& bad) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type_tag)>>;
    for_samples<T>(s, bad, [&](std::size_t i, const T* tok, int64_t lo, int64_t hi, int64_t vocab) {
      double sum = 0.0;
      for (int64_t k = lo; k < hi; ++k) {
        if (!in_range(tok[k], vocab)) return k;
        sum += table[static_cast<std::size_t>(tok[k])];
      }
      scores[i] = sum;
      return hi;
    });
  });
}

}  // namespace loom::data::curriculum
