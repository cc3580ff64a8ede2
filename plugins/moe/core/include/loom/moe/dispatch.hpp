// Declared public interface of loom_moe_core: bench/, the trainer and tests may include this
// header (as <loom/moe/dispatch.hpp>); the core's other headers are private to it.
//
// Index dispatch: the kept (token, choice) pairs sorted stably by expert with a counting sort
// (so the rows of expert e are its pairs in (token, choice) order), rows gathered, and the
// weighted combine back in choice order. No one-hot tensors, no atomics.
#pragma once

#include <cstdint>

namespace loom::moe {

// route [S, k] (expert or -1) -> counts[E] (rows per expert) and slot [S, k] (the pair's row,
// -1 when dropped); rows of expert e are [offset_e, offset_e + counts[e]), offset the
// exclusive prefix sum. Returns the total rows. Throws std::invalid_argument on an expert
// outside [-1, E).
int64_t build_slots(const int32_t* route, int64_t tokens, int k, int num_experts, int64_t* counts,
                    int64_t* slot);

// rows[slot(s, j)] = (weights ? weights[s, j] : 1) * x[s], for every kept pair.
template <class T>
void gather_rows(const T* x, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                 const T* weights, T* rows);

// y[s] (= or +=) sum over kept j, in choice order, of (weights ? weights[s, j] : 1) *
// rows[slot(s, j)]; a token without kept pairs gets 0 (or nothing added).
template <class T>
void combine_rows(const T* rows, int64_t tokens, int64_t model_dim, int k, const int64_t* slot,
                  const T* weights, T* y, bool accumulate);

// The combine's adjoint w.r.t. its weights: dweights[s, j] = dy[s] . rows[slot(s, j)] (0 when
// dropped).
template <class T>
void combine_weight_grad(const T* rows, const T* dy, int64_t tokens, int64_t model_dim, int k,
                         const int64_t* slot, T* dweights);

}  // namespace loom::moe
