// The routing on CUDA: top-k, capacity, combine weights, slots, loads, the aux loss and the
// gate's dlogits, computed from the device's probabilities with the host functions' exact
// arithmetic (gating.cpp, dispatch.cpp; --fmad=false), so both choose the same experts, drop
// the same pairs and give the same bits. Orders that the host gets from its sequential loops
// (a bucket's tokens ascending, the rows of an expert in (token, choice) order) come from one
// ordered compaction per bucket or expert (warp votes and a block-wide prefix); counts that
// only need a total use integer atomics, whose result does not depend on order. Only O(E)
// numbers go back to the host: the counts the exchange and the expert GEMMs are sized by.
#include <cfloat>
#include <cstring>
#include <vector>

#include <loom/sdk/random.hpp>

#include <loom/moe/gating.hpp>
#include <loom/moe/moe_cuda.hpp>
#include <loom/moe/moe_math.hpp>
#include "cuda_util.cuh"

namespace loom::moe::cuda {
namespace {

constexpr int kRankThreads = 256;  // a multiple of the warp
constexpr int kWarps = kRankThreads / 32;

__device__ uint32_t token_counter(int64_t first_token, int64_t s) {
  return static_cast<uint32_t>(static_cast<uint64_t>(first_token + s));
}

struct TopArgs {
  const float* probs;
  const float* bias;
  int32_t* choice;
  int64_t tokens;
  int E, k;
  bool rsample;
  uint64_t seed;
  int64_t step;
  uint32_t layer;
  int64_t first_token;
};

// One thread per token: the host's top_k_token (score = p or its Gumbel score, plus the bias;
// the strictly greatest untaken score, ties to the lower expert).
__global__ void top_k_kernel(TopArgs a) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < a.tokens;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float* ps = a.probs + s * a.E;
    int32_t* out = a.choice + s * a.k;
    const loom::sdk::CounterRng rng(a.seed, a.step, a.layer, token_counter(a.first_token, s),
                                    kPurposeGumbel);
    for (int j = 0; j < a.k; ++j) {
      int best = -1;
      float best_v = 0.0f;
      for (int e = 0; e < a.E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || out[i] == e;
        if (taken) continue;
        float v = a.rsample ? gumbel_score(ps[e], rng.word(static_cast<uint64_t>(e))) : ps[e];
        if (a.bias != nullptr) v = v + a.bias[e];
        if (best < 0 || v > best_v) {
          best = e;
          best_v = v;
        }
      }
      out[j] = best;
    }
  }
}

// Block g ranks, in index order, the items i in [0, n) whose vals[i * stride + g % stride]
// equals g / stride: out[that index] = (base ? base[g] : 0) + the rank; totals[g] = their
// number. One block per group; every thread of it reaches every barrier (the loop bound is
// the block's).
__global__ void ordered_rank_kernel(const int32_t* vals, int64_t n, int stride, const int64_t* base,
                                    int64_t* out, int64_t* totals) {
  __shared__ int64_t warp_count[kWarps];
  __shared__ int64_t running;
  const int g = static_cast<int>(blockIdx.x);
  const int32_t value = g / stride;
  const int off = g % stride;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32, warp = tid / 32;
  const int64_t first = base == nullptr ? 0 : base[g];
  if (tid == 0) running = 0;
  __syncthreads();
  for (int64_t c = 0; c < n; c += kRankThreads) {
    const int64_t i = c + tid;
    const bool hit = i < n && vals[i * stride + off] == value;
    const unsigned mask = __ballot_sync(0xffffffffu, hit ? 1 : 0);
    if (lane == 0) warp_count[warp] = __popc(mask);
    __syncthreads();
    int64_t before = running + __popc(mask & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) before += warp_count[w];
    if (hit) out[i * stride + off] = first + before;
    __syncthreads();
    if (tid == 0) {
      for (int w = 0; w < kWarps; ++w) running += warp_count[w];
    }
    __syncthreads();
  }
  if (tid == 0 && totals != nullptr) totals[g] = running;
}

// The scratch's regions, in the order route_scratch_words (moe_cuda.hpp) counts them.
struct Scratch {
  int64_t* order;    // [S k] each bucket's tokens, bucket after bucket
  int64_t* pos;      // [S k] a pair's place in its bucket (token order)
  int64_t* rts_key;  // [S] the random keys under use_rts
  int64_t* count;    // [E k] pairs per bucket (expert e, choice rank j) = e * k + j
  int64_t* start;    // [E k] each bucket's first index in order
  int64_t* left;     // [E k] the capacity left to the bucket
  int64_t* offset;   // [E] the first row of each expert
  int64_t* summary;  // [2 E + 2] RouteSummary
  double* mean_p;    // [E] the mean probability per expert
};

Scratch carve(int64_t* base, int E, int k, int64_t S) {
  Scratch v{};
  int64_t* p = base;
  auto take = [&](int64_t n) {
    int64_t* r = p;
    p += n;
    return r;
  };
  v.order = take(S * k);
  v.pos = take(S * k);
  v.rts_key = take(S);
  v.count = take(int64_t{E} * k);
  v.start = take(int64_t{E} * k);
  v.left = take(int64_t{E} * k);
  v.offset = take(E);
  v.summary = take(2 * int64_t{E} + 2);
  v.mean_p = reinterpret_cast<double*>(take(E));
  return v;
}

// One thread: each bucket's start in `order`, the capacity left to it (an expert keeps its
// first C pairs over its buckets j = 0, 1, ...), the drops, each expert's choices and kept
// rows, and the experts' row offsets.
__global__ void bucket_plan_kernel(Scratch v, int E, int k, int64_t capacity, bool drop) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t at = 0, dropped = 0, rows = 0;
  for (int e = 0; e < E; ++e) {
    int64_t used = 0, load = 0;
    for (int j = 0; j < k; ++j) {
      const int b = e * k + j;
      const int64_t n = v.count[b];
      v.start[b] = at;
      at += n;
      const int64_t left = drop ? (capacity > used ? capacity - used : 0) : n;
      v.left[b] = left;
      const int64_t kept = n < left ? n : left;
      used += kept;
      dropped += n - kept;
      load += n;
    }
    v.summary[e] = used;  // send_counts
    v.summary[E + e] = load;
    v.offset[e] = rows;
    rows += used;
  }
  v.summary[2 * E] = dropped;
}

// One thread per pair: order[start of its bucket + its place] = its token.
__global__ void bucket_scatter_kernel(Scratch v, const int32_t* choice, int64_t pairs, int k) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = int64_t{choice[i]} * k + i % k;
    v.order[v.start[b] + v.pos[i]] = i / k;
  }
}

__global__ void rts_key_kernel(Scratch v, int64_t tokens, uint64_t seed, int64_t step,
                               uint32_t layer, int64_t first_token) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < tokens;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const loom::sdk::CounterRng rng(seed, step, layer, token_counter(first_token, s), kPurposeRts);
    v.rts_key[s] = rng.word(0);
  }
}

// One thread per pair: kept when its rank in its bucket's order is below the capacity left to
// the bucket. The order is the host's stable sort of the bucket's tokens (ascending): by the
// random key under use_rts, by probability descending under "probs", as they are under
// "position"; so the rank is the number of members before it in that order.
__global__ void capacity_kernel(Scratch v, const float* probs, const int32_t* choice,
                                int32_t* route, int64_t pairs, int E, int k, int policy) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = choice[i];
    const int64_t b = int64_t{e} * k + i % k;
    const int64_t n = v.count[b], left = v.left[b];
    bool keep = n <= left;
    if (!keep && left > 0) {
      const int64_t s = i / k, p = v.pos[i];
      int64_t rank = p;  // position: the bucket's token order
      if (policy != 0) {
        const int64_t* members = v.order + v.start[b];
        rank = 0;
        if (policy == 1) {
          const int64_t key = v.rts_key[s];
          for (int64_t m = 0; m < n; ++m) {
            const int64_t km = v.rts_key[members[m]];
            rank += (km < key || (km == key && m < p)) ? 1 : 0;
          }
        } else {
          const float ps = probs[s * E + e];
          for (int64_t m = 0; m < n; ++m) {
            const float pm = probs[members[m] * E + e];
            rank += (kept_before(pm, ps) || (!kept_before(ps, pm) && m < p)) ? 1 : 0;
          }
        }
      }
      keep = rank < left;
    }
    route[i] = keep ? e : -1;
  }
}

// One thread per token: the host's combine_weights.
__global__ void weights_kernel(const float* probs, const int32_t* route, float* weights,
                               int64_t tokens, int E, int k, bool normalize_top1) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < tokens;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    token_weights(probs + s * E, route + s * k, k, normalize_top1, FLT_EPSILON, weights + s * k);
  }
}

// One thread per expert: its mean probability, summed in token order in double (aux_loss).
__global__ void mean_prob_kernel(Scratch v, const float* probs, int64_t tokens, int E) {
  for (int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); e < E;
       e += static_cast<int>(gridDim.x * blockDim.x)) {
    double me = 0.0;
    for (int64_t s = 0; s < tokens; ++s) me += static_cast<double>(probs[s * E + e]);
    v.mean_p[e] = me / static_cast<double>(tokens);
  }
}

// The share of first choices (k <= 2) or of all choices (k > 2) that went to expert e.
__device__ double load_share(const int64_t* count, int e, int k, int64_t tokens) {
  const bool all = k > 2;
  int64_t c = 0;
  for (int j = 0; j < (all ? k : 1); ++j) c += count[e * k + j];
  const double denom = static_cast<double>(tokens) * (all ? k : 1);
  return static_cast<double>(c) / denom;
}

// One thread: the aux loss, E * sum_e mean_e * share_e, summed in expert order.
__global__ void aux_kernel(Scratch v, int64_t tokens, int E, int k) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double total = 0.0;
  if (tokens > 0) {
    for (int e = 0; e < E; ++e) total += v.mean_p[e] * load_share(v.count, e, k, tokens);
  }
  const double aux = tokens > 0 ? static_cast<double>(E) * total : 0.0;
  v.summary[2 * E + 1] = __double_as_longlong(aux);
}

__device__ void count_one(int64_t* counter) {
  atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);  // lint: integer atomic
}

// Choices per bucket (backward's load shares), with integer atomics.
__global__ void count_choices_kernel(const int32_t* choice, int64_t pairs, int k, int64_t* count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    count_one(count + int64_t{choice[i]} * k + i % k);
  }
}

// One thread per token: the host's gate_dlogits.
__global__ void dlogits_kernel(const int64_t* count, const float* probs, const int32_t* route,
                               const float* dweights, float* dlogits, int64_t tokens, int E, int k,
                               bool normalize_top1, double coef) {
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < tokens;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float* dp = dlogits + s * E;
    for (int e = 0; e < E; ++e) {
      dp[e] = static_cast<float>(coef * static_cast<double>(E) * load_share(count, e, k, tokens) /
                                 static_cast<double>(tokens));
    }
    token_dlogits(probs + s * E, route + s * k, dweights + s * k, E, k, normalize_top1, FLT_EPSILON,
                  dp);
  }
}

// dispatch / combine alone: the first pair outside [-1, E) and the rows per expert.
__global__ void check_route_kernel(const int32_t* route, int64_t pairs, int E,
                                   unsigned long long* first_bad, int64_t* count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t e = route[i];
    if (e < -1 || e >= E) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    } else if (e >= 0) {
      count_one(count + e);
    }
  }
}

__global__ void offsets_kernel(const int64_t* count, int64_t* offset, int E) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t at = 0;
  for (int e = 0; e < E; ++e) {
    offset[e] = at;
    at += count[e];
  }
}

// Every pair's slot: -1, then each expert's kept pairs ranked in (token, choice) order from
// the expert's first row (build_slots).
void write_slots(const int32_t* route, int64_t pairs, int E, const int64_t* offset, int64_t* slot,
                 cudaStream_t st) {
  LOOM_MOE_CUDA(cudaMemsetAsync(slot, 0xff, static_cast<size_t>(pairs) * sizeof(int64_t), st));
  ordered_rank_kernel<<<static_cast<unsigned>(E), kRankThreads, 0, st>>>(route, pairs, 1, offset,
                                                                         slot, nullptr);
  check_launch("ordered_rank(slots)");
}

}  // namespace

void route_on_device(const GateConfig& cfg, const float* probs, int64_t tokens, const float* bias,
                     int64_t capacity, const RouteBuffers& out, int64_t* scratch,
                     RouteSummary& summary, void* stream) {
  const cudaStream_t st = as_stream(stream);
  const int E = cfg.num_experts, k = cfg.k;
  const int64_t S = tokens, pairs = S * k;
  const Scratch v = carve(scratch, E, k, S);
  if (S > 0) {
    TopArgs a{probs,    bias,      out.choice,     S, E, k, cfg.rsample(), cfg.seed,
              cfg.step, cfg.layer, cfg.first_token};
    top_k_kernel<<<blocks_for(S), kThreads, 0, st>>>(a);
    check_launch("top_k");
  }
  // Each bucket's members in token order (their places, and their number).
  ordered_rank_kernel<<<static_cast<unsigned>(E * k), kRankThreads, 0, st>>>(
      out.choice, S, k, nullptr, v.pos, v.count);
  check_launch("ordered_rank(buckets)");
  bucket_plan_kernel<<<1, 1, 0, st>>>(v, E, k, capacity, cfg.drop_tokens);
  check_launch("bucket_plan");
  if (S > 0) {
    // 0: the bucket's token order (position, or nothing to drop); 1: use_rts; 2: probs.
    int policy = cfg.rts() ? 1 : (cfg.drop_policy == DropPolicy::Probs ? 2 : 0);
    if (!cfg.drop_tokens) policy = 0;
    if (policy != 0) {
      bucket_scatter_kernel<<<blocks_for(pairs), kThreads, 0, st>>>(v, out.choice, pairs, k);
      check_launch("bucket_scatter");
    }
    if (policy == 1) {
      rts_key_kernel<<<blocks_for(S), kThreads, 0, st>>>(v, S, cfg.seed, cfg.step, cfg.layer,
                                                         cfg.first_token);
      check_launch("rts_key");
    }
    capacity_kernel<<<blocks_for(pairs), kThreads, 0, st>>>(v, probs, out.choice, out.route, pairs,
                                                            E, k, policy);
    check_launch("capacity");
    weights_kernel<<<blocks_for(S), kThreads, 0, st>>>(probs, out.route, out.weights, S, E, k,
                                                       cfg.normalize_top1);
    check_launch("combine_weights");
    mean_prob_kernel<<<blocks_for(E), kThreads, 0, st>>>(v, probs, S, E);
    check_launch("mean_prob");
    write_slots(out.route, pairs, E, v.offset, out.slot, st);
  }
  aux_kernel<<<1, 1, 0, st>>>(v, S, E, k);
  check_launch("aux");
  std::vector<int64_t> host(static_cast<size_t>(2 * E + 2));
  LOOM_MOE_CUDA(cudaMemcpyAsync(host.data(), v.summary, host.size() * sizeof(int64_t),
                                cudaMemcpyDeviceToHost, st));
  LOOM_MOE_CUDA(cudaStreamSynchronize(st));
  summary.send_counts.assign(host.begin(), host.begin() + E);
  summary.load.assign(host.begin() + E, host.begin() + 2 * E);
  summary.dropped = host[static_cast<size_t>(2 * E)];
  std::memcpy(&summary.aux_loss, &host[static_cast<size_t>(2 * E + 1)], sizeof(double));
  summary.send_rows = 0;
  for (const int64_t c : summary.send_counts) summary.send_rows += c;
}

void gate_dlogits(const GateConfig& cfg, int64_t tokens, const float* probs, const int32_t* choice,
                  const int32_t* route, const float* dweights, double aux_loss_coef, float* dlogits,
                  int64_t* scratch, void* stream) {
  if (tokens <= 0) return;
  const cudaStream_t st = as_stream(stream);
  const int E = cfg.num_experts, k = cfg.k;
  int64_t* count = scratch;  // [E k]
  LOOM_MOE_CUDA(cudaMemsetAsync(count, 0, static_cast<size_t>(E * k) * sizeof(int64_t), st));
  count_choices_kernel<<<blocks_for(tokens * k), kThreads, 0, st>>>(choice, tokens * k, k, count);
  check_launch("count_choices");
  dlogits_kernel<<<blocks_for(tokens), kThreads, 0, st>>>(
      count, probs, route, dweights, dlogits, tokens, E, k, cfg.normalize_top1, aux_loss_coef);
  check_launch("gate_dlogits");
}

AloneSlots alone_slots(const int32_t* route, int64_t tokens, int k, int num_experts, int64_t* slot,
                       int64_t* scratch, void* stream) {
  const cudaStream_t st = as_stream(stream);
  const int E = num_experts;
  const int64_t pairs = tokens * k;
  // scratch: first_bad, count [E], offset [E]
  auto* first_bad = reinterpret_cast<unsigned long long*>(scratch);
  int64_t* count = scratch + 1;
  int64_t* offset = count + E;
  LOOM_MOE_CUDA(cudaMemsetAsync(first_bad, 0xff, sizeof(unsigned long long), st));
  LOOM_MOE_CUDA(cudaMemsetAsync(count, 0, static_cast<size_t>(E) * sizeof(int64_t), st));
  if (pairs > 0) {
    check_route_kernel<<<blocks_for(pairs), kThreads, 0, st>>>(route, pairs, E, first_bad, count);
    check_launch("check_route");
  }
  offsets_kernel<<<1, 1, 0, st>>>(count, offset, E);
  check_launch("offsets");
  if (pairs > 0) write_slots(route, pairs, E, offset, slot, st);
  std::vector<int64_t> host(static_cast<size_t>(E + 1));
  LOOM_MOE_CUDA(cudaMemcpyAsync(host.data(), scratch, host.size() * sizeof(int64_t),
                                cudaMemcpyDeviceToHost, st));
  LOOM_MOE_CUDA(cudaStreamSynchronize(st));
  AloneSlots r;
  r.counts.assign(host.begin() + 1, host.end());
  for (const int64_t c : r.counts) r.send_rows += c;
  if (host[0] != -1) {  // all ones: no pair was outside [-1, E)
    r.bad_pair = host[0];
    int32_t value = 0;
    LOOM_MOE_CUDA(
        cudaMemcpyAsync(&value, route + r.bad_pair, sizeof value, cudaMemcpyDeviceToHost, st));
    LOOM_MOE_CUDA(cudaStreamSynchronize(st));
    r.bad_value = value;
  }
  return r;
}

}  // namespace loom::moe::cuda
