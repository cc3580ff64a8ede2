// topk_router's CPU kernels (topk_kernels.hpp): scalar double loops in the fixed order the
// CUDA kernels use (this file is compiled with -ffp-contract=off), work split over the host
// pool by sequence or by channel block, never inside a sum, so the thread count changes no
// bit.
#include <loom/sdk/parallel.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "topk_kernels.hpp"

namespace loom::routers::topk {
namespace {

template <class T>
void select_typed(const SelectData& d) {
  const Shape& s = d.shape;
  const auto* x = static_cast<const T*>(d.x.data);
  const auto* w = static_cast<const T*>(d.weight);
  auto* gates = static_cast<T*>(d.gates);
  const std::size_t tokens = static_cast<std::size_t>(s.batch * s.seq_len);
  // Scores: one token per item, the channel sum in increasing order.
  loom::sdk::parallel_for(tokens, 64, [&](std::size_t begin, std::size_t end) {
    for (std::size_t t = begin; t < end; ++t) {
      const int64_t b = static_cast<int64_t>(t) / s.seq_len;
      const int64_t p = static_cast<int64_t>(t) % s.seq_len;
      const T* row = x + b * d.x.batch_stride + p * d.x.position_stride;
      double acc = 0.0;
      for (int64_t c = 0; c < s.channels; ++c)
        acc = add(acc, mul(to_double(row[c]), to_double(w[c])));
      d.scores[t] = acc;
    }
  });
  // Top-k per sequence: the kept smallest (key, position), then in position order.
  loom::sdk::parallel_for(
      static_cast<std::size_t>(s.batch), 1, [&](std::size_t begin, std::size_t end) {
        std::vector<uint64_t> keys(static_cast<std::size_t>(s.seq_len));
        std::vector<int32_t> order(static_cast<std::size_t>(s.seq_len));
        for (std::size_t b = begin; b < end; ++b) {
          const double* sc = d.scores + b * static_cast<std::size_t>(s.seq_len);
          for (int64_t p = 0; p < s.seq_len; ++p) {
            keys[static_cast<std::size_t>(p)] = rank_key(sc[p]);
            order[static_cast<std::size_t>(p)] = static_cast<int32_t>(p);
          }
          auto before = [&](int32_t a, int32_t c) {
            const uint64_t ka = keys[static_cast<std::size_t>(a)];
            const uint64_t kc = keys[static_cast<std::size_t>(c)];
            return ka != kc ? ka < kc : a < c;
          };
          const auto kth = order.begin() + s.kept;
          if (s.kept < s.seq_len) std::nth_element(order.begin(), kth, order.end(), before);
          std::sort(order.begin(), kth);
          const std::size_t row = b * static_cast<std::size_t>(s.kept);
          for (int64_t j = 0; j < s.kept; ++j) {
            const int32_t p = order[static_cast<std::size_t>(j)];
            const double score = sc[p];
            d.indices[row + static_cast<std::size_t>(j)] = p;
            d.saved[row + static_cast<std::size_t>(j)] = score;
            gates[row + static_cast<std::size_t>(j)] = static_cast<T>(gate_of(score, s.gate));
          }
        }
      });
}

template <class T>
void backward_typed(const BackwardData& d) {
  const Shape& s = d.shape;
  const auto* x = static_cast<const T*>(d.x.data);
  const auto* w = static_cast<const T*>(d.weight);
  const auto* dgates = static_cast<const T*>(d.dgates);
  auto* dx = static_cast<T*>(d.dx);
  auto* dw = static_cast<T*>(d.dweight);
  const std::size_t n = static_cast<std::size_t>(s.batch * s.kept);
  std::vector<double> ds(n);
  for (std::size_t i = 0; i < n; ++i) ds[i] = score_grad(to_double(dgates[i]), d.saved[i], s.gate);
  // dx: each kept token once (rows are strictly increasing), sequences over the pool.
  loom::sdk::parallel_for(
      static_cast<std::size_t>(s.batch), 1, [&](std::size_t begin, std::size_t end) {
        for (std::size_t b = begin; b < end; ++b) {
          for (int64_t j = 0; j < s.kept; ++j) {
            const std::size_t k =
                b * static_cast<std::size_t>(s.kept) + static_cast<std::size_t>(j);
            T* row = dx + static_cast<int64_t>(b) * d.dx_batch_stride +
                     int64_t{d.indices[k]} * d.dx_position_stride;
            for (int64_t c = 0; c < s.channels; ++c) {
              row[c] = static_cast<T>(add(to_double(row[c]), mul(ds[k], to_double(w[c]))));
            }
          }
        }
      });
  // dweight: channel blocks over the pool; per channel the sum over j within a sequence, then
  // over sequences, each in increasing order (as the CUDA kernels' partials and total).
  constexpr std::size_t kBlock = 64;
  const std::size_t blocks = (static_cast<std::size_t>(s.channels) + kBlock - 1) / kBlock;
  loom::sdk::parallel_for(blocks, 1, [&](std::size_t begin, std::size_t end) {
    double part[kBlock];
    double total[kBlock];
    for (std::size_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = static_cast<int64_t>(blk * kBlock);
      const int64_t cn = std::min<int64_t>(static_cast<int64_t>(kBlock), s.channels - c0);
      std::fill(total, total + cn, 0.0);
      for (int64_t b = 0; b < s.batch; ++b) {
        std::fill(part, part + cn, 0.0);
        for (int64_t j = 0; j < s.kept; ++j) {
          const std::size_t k = static_cast<std::size_t>(b * s.kept + j);
          const T* row =
              x + b * d.x.batch_stride + int64_t{d.indices[k]} * d.x.position_stride + c0;
          for (int64_t c = 0; c < cn; ++c) part[c] = add(part[c], mul(ds[k], to_double(row[c])));
        }
        for (int64_t c = 0; c < cn; ++c) total[c] = add(total[c], part[c]);
      }
      for (int64_t c = 0; c < cn; ++c)
        dw[c0 + c] = static_cast<T>(add(to_double(dw[c0 + c]), total[c]));
    }
  });
}

}  // namespace

int64_t kept_count(double capacity, int64_t seq_len) {
  const double k = std::floor(capacity * static_cast<double>(seq_len) + 0.5);
  if (!(k >= 1.0)) return 1;
  if (k >= static_cast<double>(seq_len)) return seq_len;
  return static_cast<int64_t>(k);
}

uint64_t saved_bytes(int64_t batch, int64_t kept) {
  return static_cast<uint64_t>(batch) * static_cast<uint64_t>(kept) * sizeof(double);
}

uint64_t workspace_bytes(int64_t batch, int64_t seq_len, int64_t channels) {
  const uint64_t n =
      static_cast<uint64_t>(batch) * static_cast<uint64_t>(std::max(seq_len, channels));
  return (n * sizeof(double) + 255) / 256 * 256;
}

void select_cpu(const SelectData& d) {
  if (d.shape.dtype == Dtype::kF64) {
    select_typed<double>(d);
  } else {
    select_typed<float>(d);
  }
}

void backward_cpu(const BackwardData& d) {
  if (d.shape.dtype == Dtype::kF64) {
    backward_typed<double>(d);
  } else {
    backward_typed<float>(d);
  }
}

}  // namespace loom::routers::topk
