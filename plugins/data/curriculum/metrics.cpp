#include "metrics.hpp"

#include <loom/sdk/no_cuda.hpp>
#include <loom/sdk/status.hpp>
#include <loom/sdk/tensor.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "kernels.hpp"

namespace loom::data::curriculum {

namespace {

// loom::sdk::fail_argument, declared [[noreturn]] for the switches below.
[[noreturn]] void fail_argument(const std::string& message) {
  throw loom::sdk::Error(LOOM_ERR_INVALID_ARGUMENT, message);
}

// The CUDA kernels (kernels_cuda_stub.cpp without CUDA; check_samples refuses CUDA tensors
// first then).
Problem cuda_seqlen(const SampleData& s, int64_t pad, double* scores, int device, void* stream) {
  return cuda::seqlen(s, pad, scores, device, stream);
}
Problem cuda_count(const SampleData& s, int64_t* stats, int device, void* stream) {
  return cuda::count(s, stats, device, stream);
}
Problem cuda_rarity(const SampleData& s, const RarityTable& table, double* scores, int device,
                    void* stream) {
  return cuda::rarity(s, table, scores, device, stream);
}
void stats_to_host(const int64_t* stats, std::size_t n, int64_t* out, int device, void* stream) {
  cuda::copy_to_host(out, stats, sizeof(int64_t) * n, device, stream);
}
void offsets_to_host(const SampleData& s, int64_t* out, int device, void* stream) {
  cuda::copy_to_host(out, s.offsets, sizeof(int64_t) * static_cast<std::size_t>(s.samples + 1),
                     device, stream);
}

// The samples' tensors checked (description, dtype, layout, device); the data are checked by
// the kernels.
struct Checked {
  SampleData data;
  DLDevice device{kDLCPU, 0};
};

Checked check_samples(const loom_curriculum_samples& s, uint32_t vocab_size) {
  if (s.struct_size < LOOM_CURRICULUM_SAMPLES_SIZE) {
    fail_argument("samples.struct_size is " + std::to_string(s.struct_size) +
                  ", expected >= " + std::to_string(LOOM_CURRICULUM_SAMPLES_SIZE));
  }
  if (vocab_size == 0) fail_argument("vocab_size is 0; it must be >= 1");
  const DLTensor& tok = loom::sdk::expect_tensor(s.tokens, "samples.tokens");
  const DLTensor& off = loom::sdk::expect_tensor(s.offsets, "samples.offsets");
  Checked c;
  if (tok.ndim != 1) {
    fail_argument("samples.tokens has shape " + loom::sdk::shape_string(tok) + "; it must be 1-D");
  }
  loom::sdk::expect_contiguous(tok, "samples.tokens");
  if (loom::sdk::is_dtype(tok, kDLUInt, 16)) {
    c.data.type = TokenType::kU16;
  } else if (loom::sdk::is_dtype(tok, kDLInt, 32)) {
    c.data.type = TokenType::kI32;
  } else if (loom::sdk::is_dtype(tok, kDLInt, 64)) {
    c.data.type = TokenType::kI64;
  } else {
    fail_argument("samples.tokens has dtype " + loom::sdk::dtype_string(tok.dtype) +
                  ", expected uint16, int32 or int64");
  }
  if (off.ndim != 1) {
    fail_argument("samples.offsets has shape " + loom::sdk::shape_string(off) + "; it must be 1-D");
  }
  loom::sdk::expect_dtype(off, DLDataType{kDLInt, 64, 1}, "samples.offsets");
  loom::sdk::expect_contiguous(off, "samples.offsets");
  if (off.shape[0] < 1) {
    fail_argument("samples.offsets is empty; it needs samples + 1 elements (at least 1)");
  }
  loom::sdk::expect_same_device(off, "samples.offsets", tok, "samples.tokens");
  if (!loom::sdk::is_cpu(tok) && !loom::sdk::is_cuda(tok)) {
    fail_argument("samples.tokens is on " + loom::sdk::device_string(tok.device) +
                  "; expected host or CUDA memory");
  }
  if (loom::sdk::is_cuda(tok) && !have_cuda()) {
    loom::sdk::throw_built_without_cuda("samples.tokens is on " +
                                        loom::sdk::device_string(tok.device));
  }
  c.device = tok.device;
  c.data.tokens = loom::sdk::data_as<const void>(tok);
  c.data.token_count = tok.shape[0];
  c.data.offsets = loom::sdk::data_as<const int64_t>(off);
  c.data.samples = off.shape[0] - 1;
  c.data.vocab_size = vocab_size;
  return c;
}

// An output or stats tensor: 1-D, contiguous, `dtype`, `n` elements, on the samples' device.
void check_vector(const DLTensor* t, const char* what, DLDataType dtype, int64_t n,
                  const Checked& c) {
  const DLTensor& v = loom::sdk::expect_tensor(t, what);
  if (v.ndim != 1) {
    fail_argument(std::string(what) + " has shape " + loom::sdk::shape_string(v) +
                  "; it must be 1-D");
  }
  loom::sdk::expect_dtype(v, dtype, what);
  loom::sdk::expect_contiguous(v, what);
  loom::sdk::expect_numel(v, n, what);
  loom::sdk::expect_device(v, c.device, what);
}

// The sample holding token index `token` (the offsets are valid when a token problem is
// reported); device offsets are read back first (an error path only).
int64_t sample_of(const SampleData& s, int64_t token, const Checked& c, void* stream) {
  std::vector<int64_t> host;
  const int64_t* off = s.offsets;
  if (loom::sdk::is_cuda(c.device)) {
    host.resize(static_cast<std::size_t>(s.samples) + 1);
    offsets_to_host(s, host.data(), c.device.device_id, stream);
    off = host.data();
  }
  int64_t lo = 0;
  int64_t hi = s.samples;  // the sample i with off[i] <= token < off[i + 1]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (off[mid] <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

void raise(const Problem& p, const Checked& c, void* stream) {
  const std::string idx = std::to_string(p.index);
  const std::string val = std::to_string(p.value);
  switch (p.kind) {
    case Problem::kNone:
      return;
    case Problem::kOffsetNegative:
    case Problem::kOffsetBeyond:
      // The SDK's wording for host offsets, so both devices read the same.
      fail_argument("samples.offsets[" + idx + "] = " + val + " is outside the " +
                    std::to_string(c.data.token_count) + " tokens");
    case Problem::kOffsetDecreasing:
      fail_argument("samples.offsets[" + idx + "] = " + val + " is below offsets[" +
                    std::to_string(p.index - 1) + "] = " + std::to_string(p.previous));
    case Problem::kSampleTooLong:
      fail_argument("sample " + idx + " has " + val + " tokens; vocabulary_rarity sums at most " +
                    std::to_string(p.previous) +
                    " tokens per sample exactly (its -log p values are int64 multiples of "
                    "2^-32): score shorter samples");
    case Problem::kTokenNegative:
    case Problem::kTokenTooLarge: {
      const int64_t sample = sample_of(c.data, p.index, c, stream);
      fail_argument("samples.tokens[" + idx + "] is " + val + " (in sample " +
                    std::to_string(sample) + "); tokens must be >= 0 and < vocab_size " +
                    std::to_string(c.data.vocab_size));
    }
    default:
      fail_argument("samples: unknown problem " + std::to_string(p.kind));
  }
}

}  // namespace

void seqlen_score(const loom_curriculum_score_args& args, int64_t pad_token) {
  const Checked c = check_samples(args.samples, args.vocab_size);
  check_vector(args.scores, "scores", DLDataType{kDLFloat, 64, 1}, c.data.samples, c);
  double* scores = loom::sdk::data_as<double>(*args.scores);
  Problem p;
  if (loom::sdk::is_cuda(c.device)) {
    p = cuda_seqlen(c.data, pad_token, scores, c.device.device_id, args.stream);
  } else {
    p = seqlen_cpu(c.data, pad_token, scores);
  }
  raise(p, c, args.stream);
}

void rarity_count(const loom_curriculum_count_args& args) {
  const Checked c = check_samples(args.samples, args.vocab_size);
  check_vector(args.stats, "stats", DLDataType{kDLInt, 64, 1}, args.vocab_size, c);
  int64_t* stats = loom::sdk::data_as<int64_t>(*args.stats);
  Problem p;
  if (loom::sdk::is_cuda(c.device)) {
    p = cuda_count(c.data, stats, c.device.device_id, args.stream);
  } else {
    p = count_cpu(c.data, stats);
  }
  raise(p, c, args.stream);
}

std::shared_ptr<const RarityTable> RarityCache::get(const int64_t* counts, std::size_t vocab_size) {
  std::shared_ptr<const Entry> e;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    e = entry_;
  }
  if (e && e->counts.size() == vocab_size &&
      std::memcmp(e->counts.data(), counts, sizeof(int64_t) * vocab_size) == 0) {
    return {e, &e->table};
  }
  auto fresh = std::make_shared<Entry>();
  fresh->counts.assign(counts, counts + vocab_size);
  fresh->table = rarity_table(counts, vocab_size);
  std::shared_ptr<const Entry> done = std::move(fresh);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    entry_ = done;
  }
  return {done, &done->table};
}

void rarity_score(const loom_curriculum_score_args& args, RarityCache* cache) {
  const Checked c = check_samples(args.samples, args.vocab_size);
  if (args.stats == nullptr) {
    fail_argument("stats is NULL; vocabulary_rarity scores with the token counts of count()");
  }
  check_vector(args.stats, "stats", DLDataType{kDLInt, 64, 1}, args.vocab_size, c);
  check_vector(args.scores, "scores", DLDataType{kDLFloat, 64, 1}, c.data.samples, c);
  const int64_t* stats = loom::sdk::data_as<const int64_t>(*args.stats);
  double* scores = loom::sdk::data_as<double>(*args.scores);
  // The table is built on the host, from a copy of device stats.
  std::vector<int64_t> host_stats;
  const bool on_cuda = loom::sdk::is_cuda(c.device);
  if (on_cuda) {
    host_stats.resize(args.vocab_size);
    stats_to_host(stats, host_stats.size(), host_stats.data(), c.device.device_id, args.stream);
  }
  const int64_t* counts = on_cuda ? host_stats.data() : stats;
  std::shared_ptr<const RarityTable> table;
  if (cache != nullptr) {
    table = cache->get(counts, args.vocab_size);
  } else {
    table = std::make_shared<const RarityTable>(rarity_table(counts, args.vocab_size));
  }
  Problem p;
  if (on_cuda) {
    p = cuda_rarity(c.data, *table, scores, c.device.device_id, args.stream);
  } else {
    p = rarity_cpu(c.data, *table, scores);
  }
  raise(p, c, args.stream);
}

}  // namespace loom::data::curriculum
