// random_ltd's selection on the host: per sequence, the keys of every position
// (select_key.hpp, into the plan's workspace), the kept-th smallest key T by nth_element, then one
// ordered pass that keeps the keys below T and the first (kept - #below) keys equal to T.
#include <loom/sdk/parallel.hpp>
#include <loom/sdk/status.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "select.hpp"
#include "select_key.hpp"

namespace loom::routers::ltd {

uint64_t workspace_bytes(int64_t batch, int64_t seq_len, int64_t kept) {
  if (kept >= seq_len) return 0;
  int64_t n = 0;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(batch, seq_len, &n) ||
      __builtin_mul_overflow(n, int64_t{sizeof(uint64_t)}, &bytes)) {
    throw loom::sdk::Error(LOOM_ERR_OUT_OF_RANGE,
                           "random_ltd: the keys of " + std::to_string(batch) + " sequences of " +
                               std::to_string(seq_len) + " positions do not fit 64-bit sizes");
  }
  return static_cast<uint64_t>(bytes);
}

namespace {

// The kept smallest of keys[0 .. S), ties by smaller position, in position order.
void choose(const uint64_t* keys, int64_t S, int64_t K, std::vector<uint64_t>& scratch,
            int32_t* out) {
  if (K >= S) {
    std::iota(out, out + S, 0);
    return;
  }
  scratch.assign(keys, keys + S);
  std::nth_element(scratch.begin(), scratch.begin() + (K - 1), scratch.end());
  const uint64_t t = scratch[static_cast<std::size_t>(K - 1)];
  // Keys below t: all of scratch[0, K - 1) and none after.
  int64_t below = 0;
  for (int64_t i = 0; i < K - 1; ++i) below += scratch[static_cast<std::size_t>(i)] < t ? 1 : 0;
  int64_t equal_left = K - below;  // keys equal to t still to keep, by position
  int64_t j = 0;
  for (int64_t p = 0; p < S; ++p) {
    const uint64_t k = keys[p];
    if (k < t || (k == t && equal_left-- > 0)) out[j++] = static_cast<int32_t>(p);
  }
  if (j != K) {
    throw loom::sdk::Error(LOOM_ERR_INTERNAL, "random_ltd: selected " + std::to_string(j) +
                                                  " positions, expected " + std::to_string(K));
  }
}

// The keys of sequence b into keys[0 .. S), then its kept positions into out.
void select_row(const SelectJob& job, int64_t b, uint64_t* keys, std::vector<uint64_t>& scratch,
                int32_t* out) {
  const int64_t S = job.seq_len;
  const int64_t K = job.kept;
  if (K >= S) {
    std::iota(out, out + S, 0);
    return;
  }
  const KeyStream ks = key_stream(job.seed, job.step, job.layer, job.first_sample + b);
  const int64_t pairs = S / 2;
  for (int64_t m = 0; m < pairs; ++m) {
    key_pair(ks, static_cast<uint32_t>(m), &keys[2 * m], &keys[2 * m + 1]);
  }
  if (S % 2 != 0) keys[S - 1] = key_of(ks, static_cast<uint32_t>(S - 1));
  choose(keys, S, K, scratch, out);
}

}  // namespace

void select_cpu(const SelectJob& job, int32_t* indices, uint64_t* workspace) {
  // A sequence per task: a long one is thousands of Philox blocks and an nth_element. The
  // keys go to the workspace (row b at b * seq_len) when there is one; nth_element's copy is
  // a buffer per task (not thread_local: the plugin is a dlopen'ed library, and a dynamic TLS
  // block left behind by an unloaded one is what LeakSanitizer's exit scan trips over).
  const std::size_t grain = job.seq_len >= 4096 ? 1 : static_cast<std::size_t>(4096 / job.seq_len);
  loom::sdk::parallel_for(
      static_cast<std::size_t>(job.batch), grain, [&](std::size_t lo, std::size_t hi) {
        std::vector<uint64_t> scratch;
        std::vector<uint64_t> own;
        if (workspace == nullptr && job.kept < job.seq_len) {
          own.resize(static_cast<std::size_t>(job.seq_len));
        }
        for (std::size_t b = lo; b < hi; ++b) {
          uint64_t* keys =
              workspace != nullptr ? workspace + static_cast<int64_t>(b) * job.seq_len : own.data();
          select_row(job, static_cast<int64_t>(b), keys, scratch,
                     indices + static_cast<int64_t>(b) * job.kept);
        }
      });
}

void select_keys_cpu(const uint64_t* keys, int64_t batch, int64_t seq_len, int64_t kept,
                     int32_t* indices) {
  std::vector<uint64_t> scratch;
  for (int64_t b = 0; b < batch; ++b) {
    choose(keys + b * seq_len, seq_len, kept, scratch, indices + b * kept);
  }
}

}  // namespace loom::routers::ltd
