// The metric kernels on host tensors (plugins/data/curriculum/metrics.hpp): seqlen and
// vocabulary_rarity against plain scalar loops written here, for every token dtype, and every
// bad input refused with a message naming the tensor and element.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <loom/sdk/status.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "metrics.hpp"
#include "samples.hpp"

namespace {

namespace cl = loom::data::curriculum;
using namespace curriculum_test;

constexpr uint32_t kVocab = 1000;

// Scalar references.
std::vector<double> seqlen_ref(const HostBatch& b, int64_t pad) {
  std::vector<double> out;
  for (std::size_t i = 0; i + 1 < b.offsets.size(); ++i) {
    int64_t n = 0;
    for (int64_t k = b.offsets[i]; k < b.offsets[i + 1]; ++k) n += b.tokens[k] != pad;
    out.push_back(static_cast<double>(n));
  }
  return out;
}

std::vector<int64_t> bincount(const HostBatch& b, uint32_t vocab) {
  std::vector<int64_t> c(vocab, 0);
  for (int64_t k = b.offsets.front(); k < b.offsets.back(); ++k) ++c[b.tokens[k]];
  return c;
}

// -log p summed in long double (an independent accuracy reference).
std::vector<long double> rarity_ref(const HostBatch& b, const std::vector<int64_t>& counts) {
  long double total = 0;
  for (int64_t c : counts) total += c == 0 ? 1 : c;
  std::vector<long double> out;
  for (std::size_t i = 0; i + 1 < b.offsets.size(); ++i) {
    long double s = 0;
    for (int64_t k = b.offsets[i]; k < b.offsets[i + 1]; ++k) {
      const int64_t c = counts[b.tokens[k]];
      s += -std::log(static_cast<long double>(c == 0 ? 1 : c) / total);
    }
    out.push_back(s);
  }
  return out;
}

// The fixed-point values, round(-log p * 2^32), and a sample's score: their int64 sum, left to
// right, times 2^-32 (what the kernels must give bit for bit, in whatever order they add).
std::vector<int64_t> fixed_values(const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c == 0 ? 1 : c;
  std::vector<int64_t> v;
  for (int64_t c : counts) {
    const double x = -std::log(static_cast<double>(c == 0 ? 1 : c) / static_cast<double>(total));
    v.push_back(std::max<int64_t>(0, std::llround(x * 4294967296.0)));
  }
  return v;
}

std::vector<double> rarity_exact(const HostBatch& b, const std::vector<int64_t>& counts) {
  const std::vector<int64_t> v = fixed_values(counts);
  std::vector<double> out;
  for (std::size_t i = 0; i + 1 < b.offsets.size(); ++i) {
    int64_t s = 0;
    for (int64_t k = b.offsets[i]; k < b.offsets[i + 1]; ++k) s += v[b.tokens[k]];
    out.push_back(static_cast<double>(s) / 4294967296.0);
  }
  return out;
}

struct Batch {
  HostBatch host;
  std::vector<unsigned char> bytes;
  Tensor tokens, offsets;
  Batch(HostBatch h, DLDataType dtype) : host(std::move(h)), bytes(pack(host.tokens, dtype)) {
    tokens = Tensor(bytes.data(), static_cast<int64_t>(host.tokens.size()), dtype);
    offsets = Tensor(host.offsets.data(), static_cast<int64_t>(host.offsets.size()), kI64);
  }
  int64_t samples() const { return static_cast<int64_t>(host.offsets.size()) - 1; }
};

template <class F>
void expect_invalid(F&& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing \"" << text << "\"";
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

const DLDataType kTokenTypes[] = {kU16, kI32, kI64};

TEST(CurriculumMetrics, SeqlenMatchesScalar) {
  for (DLDataType dt : kTokenTypes) {
    SCOPED_TRACE(std::to_string(dt.bits));
    Batch b(random_batch(1, 300, 70, kVocab), dt);
    b.host.tokens[5] = 0;  // some pad tokens
    b.bytes = pack(b.host.tokens, dt);
    b.tokens.t.data = b.bytes.data();
    for (int64_t pad : {int64_t{-1}, int64_t{0}, int64_t{3}}) {
      std::vector<double> scores(b.samples(), -7);
      Tensor out(scores.data(), b.samples(), kF64);
      cl::seqlen_score(score_args(b.tokens, b.offsets, kVocab, nullptr, out), pad);
      EXPECT_EQ(scores, seqlen_ref(b.host, pad)) << "pad " << pad;
    }
    // pad -1: the sample's length.
    std::vector<double> scores(b.samples());
    Tensor out(scores.data(), b.samples(), kF64);
    cl::seqlen_score(score_args(b.tokens, b.offsets, kVocab, nullptr, out), -1);
    for (int64_t i = 0; i < b.samples(); ++i) {
      EXPECT_EQ(scores[i], static_cast<double>(b.host.offsets[i + 1] - b.host.offsets[i]));
    }
  }
}

TEST(CurriculumMetrics, RarityMatchesScalar) {
  for (DLDataType dt : kTokenTypes) {
    SCOPED_TRACE(std::to_string(dt.bits));
    Batch b(random_batch(2, 400, 90, kVocab), dt);
    std::vector<int64_t> stats(kVocab, 0);
    Tensor st(stats.data(), kVocab, kI64);
    cl::rarity_count(count_args(b.tokens, b.offsets, kVocab, st));
    const auto counts = bincount(b.host, kVocab);
    ASSERT_EQ(stats, counts);
    // Some tokens never occur (the skew leaves high ids rare): count 0 is taken as 1.
    EXPECT_NE(std::count(counts.begin(), counts.end(), 0), 0);
    std::vector<double> scores(b.samples(), -1);
    Tensor out(scores.data(), b.samples(), kF64);
    cl::rarity_score(score_args(b.tokens, b.offsets, kVocab, st.get(), out));
    EXPECT_EQ(scores, rarity_exact(b.host, counts));
    const auto ref = rarity_ref(b.host, counts);
    for (int64_t i = 0; i < b.samples(); ++i) {
      // Each value is within 2^-33 of -log p: the sum within n * 2^-33 (plus fp64 rounding).
      const auto n = static_cast<double>(b.host.offsets[i + 1] - b.host.offsets[i]);
      EXPECT_NEAR(scores[i], static_cast<double>(ref[i]), n * 0x1p-33 + 1e-12 * scores[i]) << i;
      // Scores are multiples of 2^-32.
      EXPECT_EQ(std::fmod(scores[i] * 4294967296.0, 1.0), 0.0) << i;
      EXPECT_GE(scores[i], 0);
    }
  }
}

// Runs `body` once per SIMD target this CPU supports and the kernels were compiled for.
template <class Fn>
void for_each_target(Fn body) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
}

cl::SampleData u16_data(const std::vector<uint16_t>& tok, const std::vector<int64_t>& off,
                        uint32_t vocab) {
  cl::SampleData d;
  d.tokens = tok.data();
  d.type = cl::TokenType::kU16;
  d.token_count = static_cast<int64_t>(tok.size());
  d.offsets = off.data();
  d.samples = static_cast<int64_t>(off.size()) - 1;
  d.vocab_size = vocab;
  return d;
}

// Every Highway target against the scalar references, bit for bit: seqlen with and without a
// pad token, rarity, counts (long enough to be split into parts), samples of every length
// around the vector widths, and the first bad token wherever it is.
TEST(CurriculumMetrics, EveryTargetMatchesScalarBitForBit) {
  for (const uint32_t vocab : {uint32_t{1000}, uint32_t{50257}}) {
    HostBatch h = random_batch(7, 700, 300, vocab);
    h.offsets.push_back(h.offsets.back());  // an empty last sample
    std::vector<uint16_t> tok(h.tokens.begin(), h.tokens.end());
    for (std::size_t k = 0; k < tok.size(); k += 97) tok[k] = 3;  // pad tokens
    for (std::size_t k = 0; k < tok.size(); ++k) h.tokens[k] = tok[k];
    const auto counts = bincount(h, vocab);
    const auto table = cl::rarity_table(counts.data(), counts.size());
    const auto exact = rarity_exact(h, counts);
    for_each_target([&] {
      const cl::SampleData d = u16_data(tok, h.offsets, vocab);
      std::vector<double> scores(d.samples, -1);
      for (int64_t pad : {int64_t{-1}, int64_t{3}, int64_t{70000}}) {
        ASSERT_EQ(cl::seqlen_cpu(d, pad, scores.data()).kind, cl::Problem::kNone);
        EXPECT_EQ(scores, seqlen_ref(h, pad)) << "pad " << pad;
      }
      ASSERT_EQ(cl::rarity_cpu(d, table, scores.data()).kind, cl::Problem::kNone);
      EXPECT_EQ(scores, exact);
      std::vector<int64_t> stats(vocab, 2);
      ASSERT_EQ(cl::count_cpu(d, stats.data()).kind, cl::Problem::kNone);
      std::vector<int64_t> expected = counts;
      for (auto& c : expected) c += 2;
      EXPECT_EQ(stats, expected);
      // Short samples of every length 0..40 (vector bodies and tails).
      std::vector<int64_t> off = {0};
      for (int64_t n = 0; n <= 40; ++n) off.push_back(off.back() + n);
      HostBatch hs{h.tokens, off};
      const cl::SampleData ds = u16_data(tok, off, vocab);
      std::vector<double> short_scores(ds.samples);
      ASSERT_EQ(cl::seqlen_cpu(ds, 3, short_scores.data()).kind, cl::Problem::kNone);
      EXPECT_EQ(short_scores, seqlen_ref(hs, 3));
      ASSERT_EQ(cl::rarity_cpu(ds, table, short_scores.data()).kind, cl::Problem::kNone);
      EXPECT_EQ(short_scores, rarity_exact(hs, counts));
      // A bad token (== vocab) at the start, middle and end of a sample, and two: the first.
      for (const std::size_t at : {std::size_t{0}, std::size_t{1234}, tok.size() - 1}) {
        std::vector<uint16_t> bad = tok;
        bad[at] = static_cast<uint16_t>(vocab);
        if (at + 50 < bad.size()) bad[at + 50] = 0xFFFF;
        const cl::SampleData db = u16_data(bad, h.offsets, vocab);
        for (const cl::Problem& p :
             {cl::seqlen_cpu(db, 3, scores.data()), cl::rarity_cpu(db, table, scores.data()),
              cl::count_cpu(db, stats.data())}) {
          EXPECT_EQ(p.kind, cl::Problem::kTokenTooLarge);
          EXPECT_EQ(p.index, static_cast<int64_t>(at));
          EXPECT_EQ(p.value, vocab);
        }
        EXPECT_EQ(stats, expected) << "a failed count added to stats";
      }
    });
  }
}

// A sample longer than the fixed-point sum holds exactly is refused, naming the sample.
TEST(CurriculumMetrics, RaritySampleTooLong) {
  const std::vector<uint16_t> tok(20, 1);
  const std::vector<int64_t> off = {0, 5, 11, 20};
  cl::RarityTable table;
  table.value = {7, 9};
  table.max_tokens = 5;
  std::vector<double> scores(3);
  const cl::Problem p = cl::rarity_cpu(u16_data(tok, off, 2), table, scores.data());
  EXPECT_EQ(p.kind, cl::Problem::kSampleTooLong);
  EXPECT_EQ(p.index, 1);
  EXPECT_EQ(p.value, 6);
  EXPECT_EQ(p.previous, 5);
  table.max_tokens = 9;
  ASSERT_EQ(cl::rarity_cpu(u16_data(tok, off, 2), table, scores.data()).kind, cl::Problem::kNone);
  EXPECT_EQ(scores, (std::vector<double>{45 * 0x1p-32, 54 * 0x1p-32, 81 * 0x1p-32}));
}

// The plugin's table cache: the same table while the stats are unchanged, a new one when they
// change, and the same scores as without it.
TEST(CurriculumMetrics, RarityCacheFollowsTheStats) {
  cl::RarityCache cache;
  std::vector<int64_t> counts = {3, 0, 1, 4};
  const auto a = cache.get(counts.data(), 4);
  const auto b = cache.get(counts.data(), 4);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(a->value, cl::rarity_table(counts.data(), 4).value);
  counts[1] = 2;
  const auto c = cache.get(counts.data(), 4);
  EXPECT_NE(c.get(), a.get());
  EXPECT_EQ(c->value, cl::rarity_table(counts.data(), 4).value);
  EXPECT_NE(c->value, a->value);
  EXPECT_EQ(cache.get(counts.data(), 3)->value.size(), 3u);

  Batch bt(random_batch(4, 100, 60, kVocab), kU16);
  std::vector<int64_t> stats = bincount(bt.host, kVocab);
  Tensor st(stats.data(), kVocab, kI64);
  std::vector<double> with(bt.samples()), without(bt.samples());
  Tensor tw(with.data(), bt.samples(), kF64), to(without.data(), bt.samples(), kF64);
  cl::rarity_score(score_args(bt.tokens, bt.offsets, kVocab, st.get(), tw), &cache);
  cl::rarity_score(score_args(bt.tokens, bt.offsets, kVocab, st.get(), to));
  EXPECT_EQ(with, without);
  ++stats[0];  // changed stats: scored with the new table
  cl::rarity_score(score_args(bt.tokens, bt.offsets, kVocab, st.get(), tw), &cache);
  EXPECT_EQ(with, rarity_exact(bt.host, stats));
}

TEST(CurriculumMetrics, CountAddsAndMergesByShard) {
  Batch b(random_batch(3, 200, 50, kVocab), kU16);
  std::vector<int64_t> whole(kVocab, 5);  // counts add to what is there
  Tensor tw(whole.data(), kVocab, kI64);
  cl::rarity_count(count_args(b.tokens, b.offsets, kVocab, tw));
  auto expected = bincount(b.host, kVocab);
  for (auto& c : expected) c += 5;
  EXPECT_EQ(whole, expected);
  // Two shards (offsets views of the first and second half) into one buffer: the same counts.
  std::vector<int64_t> sharded(kVocab, 5);
  Tensor ts(sharded.data(), kVocab, kI64);
  const int64_t half = b.samples() / 2;
  Tensor first(b.host.offsets.data(), half + 1, kI64);
  Tensor second(b.host.offsets.data() + half, b.samples() - half + 1, kI64);
  cl::rarity_count(count_args(b.tokens, first, kVocab, ts));
  cl::rarity_count(count_args(b.tokens, second, kVocab, ts));
  EXPECT_EQ(sharded, expected);
}

TEST(CurriculumMetrics, RarityTable) {
  const std::vector<int64_t> counts = {3, 0, 1, 4};  // 0 counts as 1: total 9
  const auto t = cl::rarity_table(counts.data(), counts.size());
  ASSERT_EQ(t.value.size(), 4u);
  EXPECT_EQ(t.value, fixed_values(counts));
  EXPECT_EQ(t.value[0], std::llround(-std::log(3.0 / 9.0) * 0x1p32));
  EXPECT_EQ(t.value[1], std::llround(std::log(9.0) * 0x1p32));
  EXPECT_EQ(t.value[2], t.value[1]);
  // The longest exact sample: INT64_MAX / the largest value.
  EXPECT_EQ(t.max_tokens, INT64_MAX / t.value[1]);
  // One token that is the whole dataset: -log 1 = 0, no limit.
  const std::vector<int64_t> one = {5};
  const auto t1 = cl::rarity_table(one.data(), 1);
  EXPECT_EQ(t1.value[0], 0);
  EXPECT_EQ(t1.max_tokens, INT64_MAX);
  // The bound for any counts: the rarest token of 2^63 - 1 counts, -log p < 43.7, so at least
  // 2^25 tokens per sample.
  const std::vector<int64_t> skew = {INT64_MAX - 1, 0};
  const auto ts = cl::rarity_table(skew.data(), 2);
  EXPECT_GT(ts.value[1], int64_t{43} << 32);
  EXPECT_LT(ts.value[1], int64_t{44} << 32);
  EXPECT_GE(ts.max_tokens, int64_t{1} << 25);
  const std::vector<int64_t> negative = {3, -1};
  expect_invalid([&] { (void)cl::rarity_table(negative.data(), 2); }, "stats[1] is -1");
  const std::vector<int64_t> huge = {INT64_MAX, 1};
  expect_invalid([&] { (void)cl::rarity_table(huge.data(), 2); }, "beyond 2^63 - 1");
}

TEST(CurriculumMetrics, EmptySamplesAndNoSamples) {
  HostBatch h;
  h.tokens = {1, 2, 3};
  h.offsets = {0, 0, 3, 3};  // empty, 3 tokens, empty
  Batch b(h, kI32);
  std::vector<double> scores(3, -1);
  Tensor out(scores.data(), 3, kF64);
  cl::seqlen_score(score_args(b.tokens, b.offsets, 10, nullptr, out), -1);
  EXPECT_EQ(scores, (std::vector<double>{0, 3, 0}));
  std::vector<int64_t> stats = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  Tensor st(stats.data(), 10, kI64);
  cl::rarity_score(score_args(b.tokens, b.offsets, 10, st.get(), out));
  EXPECT_EQ(scores[0], 0.0);
  EXPECT_EQ(scores[2], 0.0);
  EXPECT_EQ(scores[1], static_cast<double>(3 * std::llround(std::log(10.0) * 0x1p32)) * 0x1p-32);
  EXPECT_NEAR(scores[1], 3 * -std::log(0.1), 3 * 0x1p-33);
  // No samples: offsets of one element.
  Tensor one(h.offsets.data(), 1, kI64);
  Tensor none(scores.data(), 0, kF64);
  cl::seqlen_score(score_args(b.tokens, one, 10, nullptr, none), -1);
  cl::rarity_count(count_args(b.tokens, one, 10, st));
  EXPECT_EQ(stats, std::vector<int64_t>(10, 1));
}

TEST(CurriculumMetrics, BadData) {
  HostBatch h;
  h.tokens = {1, 2, 3, 4, 5, 6};
  h.offsets = {0, 2, 4, 6};
  std::vector<double> scores(3);
  Tensor out(scores.data(), 3, kF64);
  std::vector<int64_t> stats(10, 1);
  Tensor st(stats.data(), 10, kI64);
  auto all = [&](Batch& b, const std::string& text) {
    expect_invalid([&] { cl::seqlen_score(score_args(b.tokens, b.offsets, 10, nullptr, out), -1); },
                   text);
    expect_invalid([&] { cl::rarity_count(count_args(b.tokens, b.offsets, 10, st)); }, text);
    expect_invalid([&] { cl::rarity_score(score_args(b.tokens, b.offsets, 10, st.get(), out)); },
                   text);
  };
  {
    HostBatch bad = h;
    bad.tokens[3] = 10;  // == vocab_size
    Batch b(bad, kU16);
    all(b, "samples.tokens[3] is 10 (in sample 1); tokens must be >= 0 and < vocab_size 10");
    EXPECT_EQ(stats, std::vector<int64_t>(10, 1)) << "a failed count added to stats";
  }
  {
    HostBatch bad = h;
    bad.tokens[4] = -2;
    bad.tokens[5] = 70000;  // the first bad one is reported
    Batch b(bad, kI32);
    all(b, "samples.tokens[4] is -2 (in sample 2)");
  }
  {
    HostBatch bad = h;
    bad.offsets = {0, 4, 2, 6};
    Batch b(bad, kI64);
    all(b, "samples.offsets[2] = 2 is below offsets[1] = 4");
  }
  {
    HostBatch bad = h;
    bad.offsets = {0, 2, 4, 7};
    Batch b(bad, kI64);
    all(b, "samples.offsets[3] = 7 is outside the 6 tokens");
  }
  {
    HostBatch bad = h;
    bad.offsets = {-1, 2, 4, 6};
    Batch b(bad, kI64);
    all(b, "samples.offsets[0] = -1 is outside the 6 tokens");
  }
}

TEST(CurriculumMetrics, BadTensors) {
  HostBatch h;
  h.tokens = {1, 2, 3, 4};
  h.offsets = {0, 2, 4};
  Batch b(h, kI64);
  std::vector<double> scores(2);
  Tensor out(scores.data(), 2, kF64);
  std::vector<int64_t> stats(10, 1);
  Tensor st(stats.data(), 10, kI64);
  auto seqlen = [&](Tensor& tok, Tensor& off, Tensor& sc, uint32_t vocab = 10) {
    cl::seqlen_score(score_args(tok, off, vocab, nullptr, sc), -1);
  };
  std::vector<float> f(4);
  Tensor ftok(f.data(), 4, kF32);
  expect_invalid([&] { seqlen(ftok, b.offsets, out); },
                 "samples.tokens has dtype float32, expected uint16, int32 or int64");
  std::vector<int32_t> o32 = {0, 2, 4};
  Tensor off32(o32.data(), 3, kI32);
  expect_invalid([&] { seqlen(b.tokens, off32, out); },
                 "samples.offsets has dtype int32, expected int64");
  std::vector<float> fs(2);
  Tensor fout(fs.data(), 2, kF32);
  expect_invalid([&] { seqlen(b.tokens, b.offsets, fout); },
                 "scores has dtype float32, expected float64");
  Tensor short_out(scores.data(), 1, kF64);
  expect_invalid([&] { seqlen(b.tokens, b.offsets, short_out); },
                 "scores has 1 elements, expected 2");
  Tensor no_off(h.offsets.data(), 0, kI64);
  expect_invalid([&] { seqlen(b.tokens, no_off, out); }, "samples.offsets is empty");
  expect_invalid([&] { seqlen(b.tokens, b.offsets, out, 0); }, "vocab_size is 0");
  Tensor two_d = b.tokens;
  int64_t shape2[2] = {2, 2};
  two_d.t.ndim = 2;
  two_d.t.shape = shape2;
  expect_invalid([&] { seqlen(two_d, b.offsets, out); }, "samples.tokens has shape [2,2]");
  Tensor cuda_tok = b.tokens;
  cuda_tok.t.device = {kDLCUDA, 0};
  expect_invalid([&] { seqlen(cuda_tok, b.offsets, out); },
                 "samples.offsets is on cpu but samples.tokens is on cuda:0");
  Tensor vulkan_tok = b.tokens;
  Tensor vulkan_off = b.offsets;
  vulkan_tok.t.device = vulkan_off.t.device = {kDLVulkan, 0};
  expect_invalid([&] { seqlen(vulkan_tok, vulkan_off, out); }, "expected host or CUDA memory");
  // Stats: NULL, wrong size, wrong dtype.
  expect_invalid([&] { cl::rarity_score(score_args(b.tokens, b.offsets, 10, nullptr, out)); },
                 "stats is NULL");
  Tensor st_short(stats.data(), 9, kI64);
  expect_invalid(
      [&] { cl::rarity_score(score_args(b.tokens, b.offsets, 10, st_short.get(), out)); },
      "stats has 9 elements, expected 10");
  expect_invalid([&] { cl::rarity_count(count_args(b.tokens, b.offsets, 10, st_short)); },
                 "stats has 9 elements, expected 10");
  Tensor st_f(scores.data(), 10, kF64);
  expect_invalid([&] { cl::rarity_count(count_args(b.tokens, b.offsets, 10, st_f)); },
                 "stats has dtype float64, expected int64");
  // An old struct_size of the samples.
  auto a = score_args(b.tokens, b.offsets, 10, nullptr, out);
  a.samples.struct_size = 8;
  expect_invalid([&] { cl::seqlen_score(a, -1); }, "samples.struct_size is 8");
  // NULL tensors.
  auto n = score_args(b.tokens, b.offsets, 10, nullptr, out);
  n.samples.tokens = nullptr;
  expect_invalid([&] { cl::seqlen_score(n, -1); }, "samples.tokens is NULL");
}

}  // namespace
