// topk_router's kernels behind a plain C++ interface (raw pointers, checked by the plugin
// before they get here): CPU in topk_cpu.cpp (the host pool), CUDA in topk_cuda.cu. Both
// compute every value with topk_math.hpp in one fixed order, so they agree bit for bit.
//
// select, for each sequence b:
//   score[b, p] = sum over c = 0, 1, .. of x[b, p, c] * w[c], in double, c in increasing order;
//   kept: the `kept` positions with the largest scores (rank_key: ties by smaller position,
//   NaN last), written in increasing position order to indices[b, :];
//   gates[b, j] = gate(score) in x's dtype; saved[b, j] = the score (double).
// backward (adds to dx and dweight), with ds[b, j] = score_grad(dgates[b, j], saved[b, j]):
//   dx[b, idx[b, j], c] = dx + ds[b, j] * w[c]                 (double, rounded once)
//   dweight[c] = dweight + sum over b of (sum over j of ds[b, j] * x[b, idx[b, j], c])
//   (each sum in increasing index order, in double, the total rounded once).
#pragma once

#include <cstddef>
#include <cstdint>

#include "topk_math.hpp"

namespace loom::routers::topk {

enum class Dtype : int32_t { kF32 = 0, kF64 = 1 };

struct Shape {
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t channels = 0;
  int64_t kept = 0;
  Dtype dtype = Dtype::kF32;
  Gate gate = Gate::kSigmoid;
};

// x-like [batch, positions, channels] with unit channel stride (strides in elements).
struct Tokens {
  const void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t position_stride = 0;
};

struct SelectData {
  Shape shape;
  Tokens x;
  const void* weight = nullptr;  // [channels]
  int32_t* indices = nullptr;    // [batch, kept]
  void* gates = nullptr;         // [batch, kept], x's dtype
  double* saved = nullptr;       // [batch, kept]
  double* scores = nullptr;      // workspace: [batch, seq_len]
};

struct BackwardData {
  Shape shape;
  Tokens x;
  const void* weight = nullptr;
  const int32_t* indices = nullptr;
  const void* dgates = nullptr;  // [batch, kept], x's dtype
  const double* saved = nullptr;
  void* dx = nullptr;  // [batch, seq_len, channels] with dx_* strides
  int64_t dx_batch_stride = 0;
  int64_t dx_position_stride = 0;
  void* dweight = nullptr;    // [channels]
  double* partial = nullptr;  // workspace: [batch, channels]
};

// kept = clamp(floor(capacity * seq_len + 0.5), 1, seq_len), capacity in (0, 1].
int64_t kept_count(double capacity, int64_t seq_len);

// What select saves for backward: the kept scores.
uint64_t saved_bytes(int64_t batch, int64_t kept);
// Scratch of select (the scores) and backward (per-sequence partial sums of dweight),
// rounded up to 256 bytes.
uint64_t workspace_bytes(int64_t batch, int64_t seq_len, int64_t channels);

// ---- CPU (host memory; sequences and channels over the host pool, loom::sdk::parallel_for)
void select_cpu(const SelectData& d);
void backward_cpu(const BackwardData& d);

// ---- CUDA (device memory; queued on `stream`, no synchronisation). CUDA failures throw
// loom::sdk::Error (UNAVAILABLE). `device` is current for the call; the caller's is restored.
namespace cuda {
void select(const SelectData& d, int device, void* stream);
void backward(const BackwardData& d, int device, void* stream);
}  // namespace cuda

}  // namespace loom::routers::topk
