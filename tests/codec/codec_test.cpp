// The onebit and ef8 codec plugins through the embedding API, and the compressed allreduce
// (sdk/include/loom/sdk/compressed_allreduce.hpp) over an in-process transport of 1 to 4
// ranks, against the scalar reference model of the notes (reference.hpp).
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <loom/sdk/compressed_allreduce.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "reference.hpp"
#include "thread_world.hpp"

namespace {

using loom::sdk::CompressedAllreduce;
using loom::sdk::InstanceRef;

constexpr int kMaxRanks = 4;

class Codecs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string toml = "[loom]\nabi = 1\n";
    for (int i = 0; i < kMaxRanks; ++i) {
      toml += "[codec.onebit" + std::to_string(i) + "]\nplugin = \"onebit\"\n";
      toml += "[codec.ef8_" + std::to_string(i) + "]\nplugin = \"ef8\"\n";
    }
    loom_open_options o{};
    o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
    o.log_level = -1;
    ASSERT_EQ(loom_open_string(toml.c_str(), "codecs.toml", &o, &session_), 0) << loom_last_error();
  }
  static void TearDownTestSuite() {
    loom_close(session_);
    session_ = nullptr;
  }

  static InstanceRef<loom_codec_v1> codec(const std::string& name) {
    loom_instance* inst = nullptr;
    EXPECT_EQ(loom_find_instance(session_, "codec", name.c_str(), &inst), 0) << loom_last_error();
    return {name, loom_instance_object(inst),
            static_cast<const loom_codec_v1*>(loom_instance_vtable(inst))};
  }
  static InstanceRef<loom_codec_v1> onebit(int i = 0) {
    return codec("onebit" + std::to_string(i));
  }
  static InstanceRef<loom_codec_v1> ef8(int i = 0) { return codec("ef8_" + std::to_string(i)); }

 public:
  static InstanceRef<loom_codec_v1> onebit_ref(int i) { return onebit(i); }

 protected:
  static inline loom_session* session_ = nullptr;
};

int64_t shape_storage[16];
DLTensor fp32(float* data, int64_t n, int slot) {
  shape_storage[slot] = n;
  return DLTensor{data, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape_storage[slot], nullptr, 0};
}

loom_codec_layout layout(const InstanceRef<loom_codec_v1>& c, uint64_t elements, int world) {
  loom_codec_layout l{};
  l.struct_size = LOOM_CODEC_LAYOUT_SIZE;
  l.elements = elements;
  l.world_size = world;
  c.call(&loom_codec_v1::layout, &l);
  return l;
}

std::vector<uint8_t> encode(const InstanceRef<loom_codec_v1>& c, std::vector<float>& x,
                            std::vector<float>* e, uint32_t chunks, size_t chunk_bytes) {
  std::vector<uint8_t> out(chunks * chunk_bytes);
  DLTensor xt = fp32(x.data(), static_cast<int64_t>(x.size()), 0);
  DLTensor et = e != nullptr ? fp32(e->data(), static_cast<int64_t>(e->size()), 1) : DLTensor{};
  loom_codec_encode_args a{};
  a.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
  a.chunk_count = chunks;
  a.input = &xt;
  a.error = e != nullptr ? &et : nullptr;
  a.output = out.data();
  c.call(&loom_codec_v1::encode, &a);
  return out;
}

// sum: the codec's decode_sum (the chunks summed into one chunk-length output).
void decode(const InstanceRef<loom_codec_v1>& c, const uint8_t* in, uint32_t chunks,
            std::vector<float>& out, float alpha, bool accumulate, bool sum = false) {
  DLTensor ot = fp32(out.data(), static_cast<int64_t>(out.size()), 2);
  loom_codec_decode_args a{};
  a.struct_size = LOOM_CODEC_DECODE_ARGS_SIZE;
  a.chunk_count = chunks;
  a.input = in;
  a.output = &ot;
  a.alpha = alpha;
  a.accumulate = accumulate ? 1 : 0;
  c.call(sum ? &loom_codec_v1::decode_sum : &loom_codec_v1::decode, &a);
}

float scale_of(const std::vector<uint8_t>& bytes, size_t offset) {
  float s;
  std::memcpy(&s, bytes.data() + offset, 4);
  return s;
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST_F(Codecs, OnebitLayoutFollowsTheNotesPadding) {
  // Units n * lcm(n, 8): 2 -> 16, 4 -> 32, 8 -> 64, 16 -> 256, 6 -> 144, 3 -> 72.
  const std::pair<int, uint64_t> units[] = {{1, 8},   {2, 16}, {3, 72},   {4, 32},
                                            {6, 144}, {8, 64}, {16, 256}, {32, 1024}};
  for (auto [n, unit] : units) {
    const auto l = layout(onebit(), 1, n);
    EXPECT_EQ(l.padded_elements, unit) << "n=" << n;
    EXPECT_EQ(l.chunk_bytes, 4 + unit / n / 8) << "n=" << n;
    EXPECT_EQ(layout(onebit(), unit, n).padded_elements, unit);
    EXPECT_EQ(layout(onebit(), unit + 1, n).padded_elements, 2 * unit);
  }
  const auto e = layout(ef8(), 13, 3);
  EXPECT_EQ(e.padded_elements, 15u);
  EXPECT_EQ(e.chunk_bytes, 4u + 5u);
}

// decode(encode(x + e)) + new e == x + e: what error feedback promises, for both codecs.
TEST_F(Codecs, RoundTripPlusErrorIsTheInput) {
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto [c, name] : {std::pair{onebit(), "onebit"}, std::pair{ef8(), "ef8"}}) {
    SCOPED_TRACE(name);
    const auto l = layout(c, 1000, 4);
    std::vector<float> x(l.padded_elements), e(l.padded_elements);
    for (auto& v : x) v = g(rng);
    for (auto& v : e) v = 0.1f * g(rng);
    std::vector<float> target(x.size());
    for (size_t i = 0; i < x.size(); ++i) target[i] = x[i] + e[i];
    const auto bytes = encode(c, x, &e, 4, l.chunk_bytes);
    std::vector<float> out(x.size());
    decode(c, bytes.data(), 4, out, 1.0f, false);
    double worst = 0, decoded_err = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(out[i]) + e[i] - target[i]));
      decoded_err = std::max(decoded_err, std::fabs(static_cast<double>(out[i]) - target[i]));
    }
    EXPECT_LT(worst, 1e-6);
    if (std::string(name) == "ef8") {
      EXPECT_LT(decoded_err, 0.03);  // half a step of max|b| / 127
    }
  }
}

// §1.6 of the notes, one codec call at a time (n = 2, numel = 13, N = 16, c = 8).
TEST_F(Codecs, OnebitReproducesTheNotesTestVector) {
  std::vector<float> x0 = {0.5, -1, 0.25, 2, -0.5, 0.0, 1.5, -2, 0.75, -0.25, 1, -1.5, 0.125};
  std::vector<float> x1 = {1, -0.5, -0.25, 1, 0.5, -1, 0.5, -1, -0.75, 0.25, 2, -0.5, -0.125};
  x0.resize(16, 0.0f);
  x1.resize(16, 0.0f);
  const auto l = layout(onebit(), 13, 2);
  ASSERT_EQ(l.padded_elements, 16u);
  ASSERT_EQ(l.chunk_bytes, 5u);
  std::vector<float> we0(16, 0.0f), we1(16, 0.0f), se0(8, 0.0f), se1(8, 0.0f);
  const auto p0 = encode(onebit(0), x0, &we0, 2, 5);
  const auto p1 = encode(onebit(1), x1, &we1, 2, 5);
  EXPECT_NEAR(scale_of(p0, 0), 0.990679f, 1e-6);
  EXPECT_NEAR(scale_of(p1, 0), 0.778746f, 1e-6);
  EXPECT_EQ(scale_of(p0, 5), scale_of(p0, 0));  // the same scale in every chunk
  EXPECT_EQ(p0[4], 182);
  EXPECT_EQ(p0[9], 175);
  EXPECT_EQ(p1[4], 154);
  EXPECT_EQ(p1[9], 103);
  const float we_want[4] = {-0.490679f, -0.009321f, -0.740679f, 1.009321f};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(we0[i], we_want[i], 1e-6) << i;

  // Servers: rank j averages chunk j of both ranks and adds its server error.
  std::vector<uint8_t> gathered;
  std::vector<float>* se[2] = {&se0, &se1};
  for (int j = 0; j < 2; ++j) {
    std::vector<float> a(8);
    decode(onebit(j), p0.data() + j * 5, 1, a, 0.5f, false);
    decode(onebit(j), p1.data() + j * 5, 1, a, 0.5f, true);
    const auto s = encode(onebit(j), a, se[j], 1, 5);
    EXPECT_NEAR(scale_of(s, 0), 0.70243f, 1e-5) << "server " << j;
    gathered.insert(gathered.end(), s.begin(), s.end());
  }
  EXPECT_EQ(gathered[4], 182);
  EXPECT_EQ(gathered[9], 175);
  const float se_want[4] = {0.182282f, -0.182282f, -0.596464f, 0.182282f};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(se0[i], se_want[i], 1e-5) << i;

  std::vector<float> out(16);
  decode(onebit(0), gathered.data(), 2, out, 1.0f, false);
  const float s = 0.70243f;
  const float want[13] = {s, -s, s, s, -s, s, s, -s, s, -s, s, -s, s};
  for (int i = 0; i < 13; ++i) EXPECT_NEAR(out[i], want[i], 1e-5) << i;
}

// The time a run is blocked in the transport: a rank whose peer starts 200 ms late waits for
// it (at least half of those 200 ms), the late rank less; total_traffic sums the runs.
TEST_F(Codecs, TrafficCountsTheTimeBlockedOnALatePeer) {
  test::ThreadWorld world(2);
  uint64_t waited[2] = {0, 0};
  uint64_t total[2] = {0, 0};
  world.run([&](int r) {
    CompressedAllreduce ar(world.comm(r), onebit(r), 4096);
    std::vector<float> buf(4096, 1.0f + static_cast<float>(r));
    int64_t shape = 4096;
    DLTensor t = DLTensor{buf.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    ar.run(t);  // both ranks in step
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ar.run(t);
    waited[r] = ar.last_traffic().wait_ns;
    total[r] = ar.total_traffic().wait_ns;
  });
  EXPECT_GE(waited[0], 100'000'000u);
  EXPECT_LT(waited[1], waited[0]);
  for (int r = 0; r < 2; ++r) EXPECT_GE(total[r], waited[r]);
}

// The same vector through the compressed allreduce on two in-process ranks, two steps (the
// second step's figures come from the notes' model, onebit_model.py).
TEST_F(Codecs, CompressedAllreduceReproducesTheNotesTestVector) {
  const std::vector<float> x[2] = {
      {0.5, -1, 0.25, 2, -0.5, 0.0, 1.5, -2, 0.75, -0.25, 1, -1.5, 0.125},
      {1, -0.5, -0.25, 1, 0.5, -1, 0.5, -1, -0.75, 0.25, 2, -0.5, -0.125}};
  test::ThreadWorld world(2);
  std::vector<float> out[2][2];
  std::vector<float> we0(16), se0(8);
  world.run([&](int r) {
    CompressedAllreduce ar(world.comm(r), onebit(r), 13);
    EXPECT_EQ(ar.padded_numel(), 16);
    EXPECT_EQ(ar.chunk_numel(), 8);
    EXPECT_EQ(ar.chunk_bytes(), 5u);
    for (int step = 0; step < 2; ++step) {
      std::vector<float> buf = x[r];
      DLTensor t = DLTensor{buf.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, nullptr, nullptr, 0};
      int64_t shape = 13;
      t.shape = &shape;
      ar.run(t);
      out[r][step] = buf;
      // Wire volume: phase 1 sends 1 of 2 chunks, phase 2 sends 1 chunk to 1 peer.
      EXPECT_EQ(ar.last_traffic().bytes_sent, 10u);
      EXPECT_EQ(ar.last_traffic().rounds, 2u);
      if (r == 0 && step == 0) {
        const DLTensor e = ar.worker_error();
        std::memcpy(we0.data(), e.data, 16 * 4);
        const DLTensor s = ar.server_error();
        std::memcpy(se0.data(), s.data, 8 * 4);
      }
    }
  });
  const float s = 0.70243f;
  const float step1[13] = {s, -s, s, s, -s, s, s, -s, s, -s, s, -s, s};
  const float a = 1.362012f, b = 1.069988f;
  const float step2[13] = {a, -a, -a, a, a, -a, a, -a, -b, b, b, -b, -b};
  for (int i = 0; i < 13; ++i) {
    EXPECT_NEAR(out[0][0][i], step1[i], 1e-5) << i;
    EXPECT_NEAR(out[0][1][i], step2[i], 1e-5) << i;
    EXPECT_EQ(bits_of(out[0][0][i]), bits_of(out[1][0][i]));
    EXPECT_EQ(bits_of(out[0][1][i]), bits_of(out[1][1][i]));
  }
  const float we_want[4] = {-0.490679f, -0.009321f, -0.740679f, 1.009321f};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(we0[i], we_want[i], 1e-6) << i;
  const float se_want[4] = {0.182282f, -0.182282f, -0.596464f, 0.182282f};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(se0[i], se_want[i], 1e-5) << i;
}

// One call: run(), or (incremental) begin(), start() from the last segment down (segment 0
// left to end()), end(), undoable.
void call(CompressedAllreduce& ar, const DLTensor& in, DLTensor& out, bool incremental) {
  if (!incremental) {
    ar.run(in, out);
    return;
  }
  ar.begin(in, out, nullptr, /*undoable=*/true);
  for (size_t k = ar.segment_count(); k-- > 1;) ar.start(k);
  ar.end();
}

// A call started from the middle segment, then undone: the errors are the last call's again.
void undone_call(CompressedAllreduce& ar, float* input, int64_t numel) {
  std::vector<float> out(static_cast<size_t>(numel));
  int64_t shape = numel;
  const DLTensor in{input, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  DLTensor o{out.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  ar.begin(in, o, nullptr, /*undoable=*/true);
  ar.start(ar.segment_count() / 2);
  ar.end();
  ar.undo();
}

// The compressed allreduce against the reference model at sizes that need padding, on 1 to 4
// ranks, three steps (so the error buffers matter), bit for bit, and the same on every rank.
// `incremental`: begin() and end() (one segment, started by end()), undoable, then a fourth
// call undone: the errors of the third again.
void check_against_reference(InstanceRef<loom_codec_v1> (*codec)(int), bool onebit_codec, int n,
                             int64_t numel, bool incremental = false) {
  SCOPED_TRACE("ranks=" + std::to_string(n) + " numel=" + std::to_string(numel) +
               (incremental ? " incremental" : ""));
  test::ThreadWorld world(n);
  std::vector<std::vector<std::vector<float>>> inputs(3);  // [step][rank]
  std::mt19937 rng(static_cast<unsigned>(numel * 31 + n));
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  for (auto& step : inputs) {
    step.resize(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      step[r].resize(static_cast<size_t>(numel));
      for (auto& v : step[r]) v = u(rng) + 0.01f * static_cast<float>(r);
    }
  }
  ref::Codec rc{onebit_codec};
  const uint64_t padded = rc.padded(static_cast<uint64_t>(numel), static_cast<uint64_t>(n));
  std::vector<std::vector<float>> we(n, std::vector<float>(padded, 0.0f));
  std::vector<std::vector<float>> se(n, std::vector<float>(padded / n, 0.0f));
  std::vector<std::vector<float>> want(3);
  for (int step = 0; step < 3; ++step)
    want[step] = ref::compressed_allreduce(rc, inputs[step], we, se);

  std::atomic<int> mismatches{0};
  world.run([&](int r) {
    CompressedAllreduce ar(world.comm(r), codec(r), numel);
    EXPECT_EQ(static_cast<uint64_t>(ar.padded_numel()), padded);
    for (int step = 0; step < 3; ++step) {
      std::vector<float> out(static_cast<size_t>(numel));
      int64_t shape = numel;
      const DLTensor in{
          inputs[step][r].data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
      DLTensor o{out.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
      call(ar, in, o, incremental);
      for (int64_t i = 0; i < numel; ++i) {
        if (bits_of(out[i]) != bits_of(want[step][i])) ++mismatches;
      }
    }
    if (incremental) undone_call(ar, inputs[0][r].data(), numel);
    const DLTensor e = ar.worker_error();
    if (std::memcmp(e.data, we[r].data(), padded * 4) != 0) ++mismatches;
    const DLTensor s = ar.server_error();
    if (std::memcmp(s.data, se[r].data(), padded / n * 4) != 0) ++mismatches;
  });
  EXPECT_EQ(mismatches.load(), 0);
}

// Pipelined in segments (Options::segment_elements): each segment is the reference algorithm
// on its own slice, with its own error buffers, bit for bit; the exchanges run in the
// background on the thread transport (it has start/test/wait), so segment k's exchanges
// overlap the encode of k + 1 and the decode of k - 1. Three steps, so the errors matter.
// `incremental`: through begin(), start() from the last segment down and end() (an owner
// overlapping a backward), undoable, then a fourth call undone: the errors of the third again.
void check_segments_against_reference(InstanceRef<loom_codec_v1> (*codec)(int), bool onebit_codec,
                                      int n, int64_t numel, int64_t segment,
                                      bool incremental = false) {
  SCOPED_TRACE("ranks=" + std::to_string(n) + " numel=" + std::to_string(numel) +
               " segment=" + std::to_string(segment) + (incremental ? " incremental" : ""));
  test::ThreadWorld world(n);
  std::vector<std::vector<std::vector<float>>> inputs(3);
  std::mt19937 rng(static_cast<unsigned>(numel * 17 + n));
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  for (auto& step : inputs) {
    step.resize(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      step[r].resize(static_cast<size_t>(numel));
      for (auto& v : step[r]) v = u(rng) + 0.01f * static_cast<float>(r);
    }
  }
  ref::Codec rc{onebit_codec};
  const auto unit = static_cast<int64_t>(rc.padded(1, static_cast<uint64_t>(n)));
  const int64_t seg = (segment + unit - 1) / unit * unit;
  struct Part {
    int64_t at, len, padded;
  };
  std::vector<Part> parts;
  for (int64_t at = 0; at < numel; at += seg) {
    const int64_t len = std::min(seg, numel - at);
    parts.push_back(
        {at, len,
         static_cast<int64_t>(rc.padded(static_cast<uint64_t>(len), static_cast<uint64_t>(n)))});
  }
  ASSERT_GE(parts.size(), 3U);
  // Per segment: the reference's errors, then the expected output of each step.
  std::vector<std::vector<std::vector<float>>> we(parts.size()), se(parts.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    we[k].assign(n, std::vector<float>(static_cast<size_t>(parts[k].padded), 0.0f));
    se[k].assign(n, std::vector<float>(static_cast<size_t>(parts[k].padded / n), 0.0f));
  }
  std::vector<std::vector<float>> want(3, std::vector<float>(static_cast<size_t>(numel)));
  for (int step = 0; step < 3; ++step) {
    for (size_t k = 0; k < parts.size(); ++k) {
      std::vector<std::vector<float>> xs(n);
      for (int r = 0; r < n; ++r) {
        xs[r].assign(inputs[step][r].begin() + parts[k].at,
                     inputs[step][r].begin() + parts[k].at + parts[k].len);
      }
      const std::vector<float> o = ref::compressed_allreduce(rc, xs, we[k], se[k]);
      std::copy(o.begin(), o.end(), want[step].begin() + parts[k].at);
    }
  }
  std::atomic<int> mismatches{0};
  world.run([&](int r) {
    CompressedAllreduce::Options opt;
    opt.segment_elements = segment;
    CompressedAllreduce ar(world.comm(r), codec(r), numel, opt);
    EXPECT_EQ(ar.segment_count(), parts.size());
    EXPECT_EQ(ar.segment_numel(), seg);
    for (int step = 0; step < 3; ++step) {
      std::vector<float> out(static_cast<size_t>(numel));
      int64_t shape = numel;
      const DLTensor in{
          inputs[step][r].data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
      DLTensor o{out.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
      call(ar, in, o, incremental);
      for (int64_t i = 0; i < numel; ++i) {
        if (bits_of(out[i]) != bits_of(want[step][i])) ++mismatches;
      }
    }
    if (incremental) undone_call(ar, inputs[0][r].data(), numel);
    const auto* e = static_cast<const float*>(ar.worker_error().data);
    const auto* s = static_cast<const float*>(ar.server_error().data);
    for (size_t k = 0; k < parts.size(); ++k) {
      if (std::memcmp(e + parts[k].at, we[k][r].data(), parts[k].padded * 4) != 0) ++mismatches;
      if (std::memcmp(s + parts[k].at / n, se[k][r].data(), parts[k].padded / n * 4) != 0) {
        ++mismatches;
      }
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(Codecs, SegmentedCompressedAllreduceMatchesTheReferencePerSegment) {
  for (int n : {1, 2, 3, 4}) {
    check_segments_against_reference(&Codecs::onebit, true, n, 100003, 20000);
    check_segments_against_reference(&Codecs::ef8, false, n, 100003, 30001);
  }
  // One element short of a whole number of segments, and segments of the codec's unit.
  check_segments_against_reference(&Codecs::onebit, true, 4, 32 * 5 - 1, 1);
}

// Started a segment at a time in another order, and a call undone.
TEST_F(Codecs, IncrementalCompressedAllreduceMatchesTheReferencePerSegment) {
  for (int n : {1, 2, 3, 4}) {
    check_against_reference(&Codecs::onebit, true, n, 1000003, true);
    check_segments_against_reference(&Codecs::onebit, true, n, 100003, 20000, true);
    check_segments_against_reference(&Codecs::ef8, false, n, 100003, 30001, true);
  }
  check_segments_against_reference(&Codecs::onebit, true, 4, 32 * 5 - 1, 1, true);
}

// A state from one segmentation does not import into another; the same one does.
TEST_F(Codecs, SegmentedStateImportsOnlyIntoTheSameSegments) {
  test::ThreadWorld world(2);
  world.run([&](int r) {
    CompressedAllreduce::Options opt;
    opt.segment_elements = 1000;
    CompressedAllreduce a(world.comm(r), onebit(r), 10000, opt);
    CompressedAllreduce same(world.comm(r), onebit(r), 10000, opt);
    CompressedAllreduce whole(world.comm(r), onebit(r), 10000);
    std::vector<std::byte> blob;
    const loom_state_writer w{LOOM_STATE_WRITER_SIZE, 0, &blob,
                              [](void* ctx, const void* data, size_t bytes) -> loom_status* {
                                auto* v = static_cast<std::vector<std::byte>*>(ctx);
                                const auto* p = static_cast<const std::byte*>(data);
                                v->insert(v->end(), p, p + bytes);
                                return nullptr;
                              }};
    loom::sdk::StateWriter out(&w);
    a.export_state(out);
    loom::sdk::StateReader in(blob);
    EXPECT_NO_THROW(same.import_state(in));
    loom::sdk::StateReader again(blob);
    try {
      whole.import_state(again);
      ADD_FAILURE() << "imported a segmented state into one segment";
    } catch (const loom::sdk::Error& e) {
      EXPECT_NE(std::string(e.what()).find("segments of 1008 elements"), std::string::npos)
          << e.what();
    }
  });
}

TEST_F(Codecs, OnebitCompressedAllreduceMatchesReference) {
  for (int n : {1, 2, 3, 4}) {
    for (int64_t numel : {int64_t{1}, int64_t{13}, int64_t{(1 << 20) + 7}}) {
      check_against_reference(&Codecs::onebit, true, n, numel);
    }
  }
}

// A codec built against ABI 1.0 has no decode_sum field: its table ends at decode. The
// compressed allreduce must see that from struct_size and decode chunk by chunk, with the
// same bits as the one-pass path.
loom_codec_v1 onebit_tables_v10[kMaxRanks];
std::atomic<int> stale_decode_sum_calls{0};
loom_status* stale_decode_sum(void*, const loom_codec_decode_args*) {
  ++stale_decode_sum_calls;
  return nullptr;
}
InstanceRef<loom_codec_v1> onebit_as_abi_1_0(int i) {
  InstanceRef<loom_codec_v1> full = Codecs::onebit_ref(i);
  loom_codec_v1& t = onebit_tables_v10[i];
  t = *full.vtable();
  t.struct_size = LOOM_STRUCT_SIZE(loom_codec_v1, decode);
  t.decode_sum = &stale_decode_sum;  // beyond struct_size: must never be called
  return {full.name(), full.instance(), &t};
}

TEST_F(Codecs, OnebitWithoutDecodeSumTakesTheFallbackPath) {
  EXPECT_FALSE(onebit_as_abi_1_0(0).provides(&loom_codec_v1::decode_sum));
  for (int n : {2, 4}) check_against_reference(&onebit_as_abi_1_0, true, n, (1 << 16) + 7);
  EXPECT_EQ(stale_decode_sum_calls.load(), 0);
}

// A third codec composes with the compressed allreduce without changing it.
TEST_F(Codecs, Ef8CompressedAllreduceMatchesReference) {
  for (int n : {1, 3, 4}) {
    for (int64_t numel : {int64_t{1}, int64_t{13}, int64_t{100003}}) {
      check_against_reference(&Codecs::ef8, false, n, numel);
    }
  }
}

// Error feedback keeps the accumulated drift sum(out) - sum(mean) bounded over 500 steps; the
// same run without feedback (errors reset every step) drifts far. The notes' model gives
// about 1.3 against 95 for this setup (n = 2, numel = 13, inputs N(0.3, 1)).
TEST_F(Codecs, ErrorFeedbackBoundsDrift) {
  double drift[2] = {0, 0};
  for (int feedback = 0; feedback < 2; ++feedback) {
    test::ThreadWorld world(2);
    std::vector<std::vector<float>> xs(500 * 2, std::vector<float>(13));
    std::mt19937 rng(1);
    std::normal_distribution<float> g(0.3f, 1.0f);
    for (auto& x : xs) {
      for (auto& v : x) v = g(rng);
    }
    std::vector<double> sum_out(13, 0.0), sum_mean(13, 0.0);
    world.run([&](int r) {
      CompressedAllreduce ar(world.comm(r), onebit(r), 13);
      for (int step = 0; step < 500; ++step) {
        if (feedback == 0) ar.reset();
        std::vector<float> buf = xs[step * 2 + r];
        int64_t shape = 13;
        DLTensor t{buf.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
        ar.run(t);
        if (r == 0) {
          for (int i = 0; i < 13; ++i) {
            sum_out[i] += buf[i];
            sum_mean[i] += (static_cast<double>(xs[step * 2][i]) + xs[step * 2 + 1][i]) / 2;
          }
        }
      }
    });
    for (int i = 0; i < 13; ++i)
      drift[feedback] = std::max(drift[feedback], std::fabs(sum_out[i] - sum_mean[i]));
  }
  std::printf("max drift over 500 steps: %.4f with error feedback, %.4f without\n", drift[1],
              drift[0]);
  EXPECT_LT(drift[1], 5.0);
  EXPECT_GT(drift[0], 30.0);
}

TEST_F(Codecs, StateExportImportRoundTrips) {
  test::ThreadWorld world(1);
  world.run([&](int r) {
    CompressedAllreduce ar(world.comm(r), onebit(r), 13);
    std::vector<float> buf(13, 0.7f);
    buf[3] = -2.0f;
    int64_t shape = 13;
    DLTensor t{buf.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
    ar.run(t);
    const auto blob = ar.export_errors();
    EXPECT_EQ(blob.size(), (16u + 16u) * 4);  // n = 1: N = 16, server slice = 16
    CompressedAllreduce other(world.comm(r), onebit(r), 13);
    other.import_errors(blob);
    EXPECT_EQ(other.export_errors(), blob);
    EXPECT_THROW(other.import_errors(std::span<const std::byte>(blob.data(), 8)), loom::sdk::Error);
    other.reset();
    const DLTensor e = other.worker_error();
    for (int i = 0; i < 16; ++i) EXPECT_EQ(static_cast<const float*>(e.data)[i], 0.0f);
  });
}

// onebit provides decode_sum (the compressed allreduce's one-pass server step); it equals
// decoding chunk by chunk with accumulate. ef8 does not provide it, so the compressed
// allreduce takes the fallback path with ef8 (covered by Ef8CompressedAllreduceMatchesReference).
TEST_F(Codecs, OnebitDecodeSumEqualsChunkByChunkDecode) {
  ASSERT_TRUE(onebit().provides(&loom_codec_v1::decode_sum));
  EXPECT_FALSE(ef8().provides(&loom_codec_v1::decode_sum));
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.1f, 1.0f);
  for (uint32_t chunks : {1u, 3u, 4u}) {
    const size_t c = 1000 * 8;
    std::vector<float> x(c * chunks);
    for (auto& v : x) v = g(rng);
    const size_t chunk_bytes = 4 + c / 8;
    const auto enc = encode(onebit(), x, nullptr, chunks, chunk_bytes);
    for (bool accumulate : {false, true}) {
      std::vector<float> want(c);
      for (auto& v : want) v = g(rng);
      std::vector<float> got = want;
      for (uint32_t j = 0; j < chunks; ++j) {
        decode(onebit(), enc.data() + j * chunk_bytes, 1, want, 0.5f, accumulate || j > 0);
      }
      decode(onebit(), enc.data(), chunks, got, 0.5f, accumulate, /*sum=*/true);
      for (size_t i = 0; i < c; ++i) ASSERT_EQ(bits_of(got[i]), bits_of(want[i])) << i;
    }
  }
  // The output must be one chunk of a multiple of 8 elements.
  std::vector<float> odd(12);
  std::vector<uint8_t> in(2 * 6);
  try {
    decode(onebit(), in.data(), 2, odd, 1.0f, false, /*sum=*/true);
    ADD_FAILURE() << "no error";
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("onebit decode_sum: output has 12 elements"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(Codecs, BadInputsGiveClearErrors) {
  auto code_of = [](auto&& fn) {
    try {
      fn();
    } catch (const loom::sdk::Error& e) {
      return static_cast<int>(e.code());
    }
    return 0;
  };
  // Layout for a world of 0.
  EXPECT_EQ(code_of([&] { layout(onebit(), 13, 0); }), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(code_of([&] { layout(ef8(), 13, -2); }), LOOM_ERR_INVALID_ARGUMENT);
  // Input not padded.
  std::vector<float> x(13, 1.0f);
  EXPECT_EQ(code_of([&] { encode(onebit(), x, nullptr, 1, 5); }), LOOM_ERR_INVALID_ARGUMENT);
  // Non-finite input: error, and the error buffer is left as it was.
  std::vector<float> y(16, 1.0f), e(16, 0.25f);
  y[5] = std::nanf("");
  EXPECT_EQ(code_of([&] { encode(onebit(), y, &e, 1, 6); }), LOOM_ERR_INVALID_ARGUMENT);
  for (float v : e) EXPECT_EQ(v, 0.25f);
  y[5] = INFINITY;
  EXPECT_EQ(code_of([&] { encode(ef8(), y, &e, 1, 20); }), LOOM_ERR_INVALID_ARGUMENT);
  // Error buffer of another size.
  std::vector<float> z(16, 1.0f), short_e(8, 0.0f);
  EXPECT_EQ(code_of([&] { encode(onebit(), z, &short_e, 1, 6); }), LOOM_ERR_INVALID_ARGUMENT);
  // Garbage chunks (NaN scale) are DATA_LOSS.
  std::vector<uint8_t> junk(6, 0xFF);
  std::vector<float> out(8);
  EXPECT_EQ(code_of([&] { decode(onebit(), junk.data(), 1, out, 1.0f, false); }),
            LOOM_ERR_DATA_LOSS);
  // Device the codec cannot use.
  std::vector<float> w(16, 1.0f);
  int64_t shape = 16;
  DLTensor gpu{w.data(), {kDLROCM, 0}, 1, {kDLFloat, 32, 1}, &shape, nullptr, 0};
  std::vector<uint8_t> sink(6);
  loom_codec_encode_args a{};
  a.struct_size = LOOM_CODEC_ENCODE_ARGS_SIZE;
  a.chunk_count = 1;
  a.input = &gpu;
  a.output = sink.data();
  EXPECT_EQ(code_of([&] { onebit().call(&loom_codec_v1::encode, &a); }), LOOM_ERR_UNIMPLEMENTED);
  EXPECT_EQ(onebit().call(&loom_codec_v1::supports_device, DLDevice{kDLROCM, 0}), 0);
  // fp16 input.
  DLTensor half{w.data(), {kDLCPU, 0}, 1, {kDLFloat, 16, 1}, &shape, nullptr, 0};
  a.input = &half;
  EXPECT_EQ(code_of([&] { onebit().call(&loom_codec_v1::encode, &a); }), LOOM_ERR_INVALID_ARGUMENT);

  // The compressed allreduce: ranks with different sizes fail on every rank, clearly.
  test::ThreadWorld world(2);
  std::atomic<int> failures{0};
  world.run([&](int r) {
    try {
      CompressedAllreduce ar(world.comm(r), onebit(r), r == 0 ? 13 : 14);
    } catch (const loom::sdk::Error& err) {
      if (err.code() == LOOM_ERR_INVALID_ARGUMENT &&
          std::string(err.what()).find("elements") != std::string::npos) {
        ++failures;
      }
    }
  });
  EXPECT_EQ(failures.load(), 2);
  // A tensor of the wrong length or dtype.
  test::ThreadWorld one(1);
  one.run([&](int r) {
    CompressedAllreduce ar(one.comm(r), onebit(r), 13);
    std::vector<float> buf(12);
    int64_t n12 = 12;
    DLTensor t{buf.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, &n12, nullptr, 0};
    EXPECT_EQ(code_of([&] { ar.run(t); }), LOOM_ERR_INVALID_ARGUMENT);
    int64_t n13 = 13;
    std::vector<double> dbl(13);
    DLTensor d{dbl.data(), {kDLCPU, 0}, 1, {kDLFloat, 64, 1}, &n13, nullptr, 0};
    EXPECT_EQ(code_of([&] { ar.run(d); }), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(code_of([&] { CompressedAllreduce bad(one.comm(r), onebit(r), 0); }),
              LOOM_ERR_INVALID_ARGUMENT);
    // Device memory needs the Context constructor (host allocators) and device ops.
    CompressedAllreduce::Options cuda;
    cuda.device = DLDevice{kDLCUDA, 0};
    EXPECT_EQ(code_of([&] { CompressedAllreduce bad(one.comm(r), onebit(r), 13, cuda); }),
              LOOM_ERR_INVALID_ARGUMENT);
  });
}

}  // namespace
