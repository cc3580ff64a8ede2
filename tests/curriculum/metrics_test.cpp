// The metric kernels on host tensors (plugins/data/curriculum/metrics.hpp): seqlen and
// vocabulary_rarity against plain scalar loops written here, for every token dtype, and every
// bad input refused with a message naming the tensor and element.
#include <gtest/gtest.h>
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

// The same in fp64, left to right (what the kernels must give bit for bit).
std::vector<double> rarity_exact(const HostBatch& b, const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (int64_t c : counts) total += c == 0 ? 1 : c;
  std::vector<double> out;
  for (std::size_t i = 0; i + 1 < b.offsets.size(); ++i) {
    double s = 0;
    for (int64_t k = b.offsets[i]; k < b.offsets[i + 1]; ++k) {
      const int64_t c = counts[b.tokens[k]];
      s += -std::log(static_cast<double>(c == 0 ? 1 : c) / static_cast<double>(total));
    }
    out.push_back(s);
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
      EXPECT_NEAR(scores[i], static_cast<double>(ref[i]), 1e-9 * (1 + std::fabs(scores[i]))) << i;
      EXPECT_GE(scores[i], 0);
    }
  }
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
  EXPECT_EQ(t[0], -std::log(3.0 / 9.0));
  EXPECT_EQ(t[1], -std::log(1.0 / 9.0));
  EXPECT_EQ(t[2], t[1]);
  EXPECT_EQ(t[3], -std::log(4.0 / 9.0));
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
  EXPECT_EQ(scores[1], 3 * -std::log(0.1));
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
