// loom_router_core on the host: gather/scatter (the kept rows, the untouched dropped rows,
// the adjoint identity, strided layouts, every element width, thread counts), the `layers`
// parameter and the layer-token counter of advance.
#include <gtest/gtest.h>
#include <loom/sdk/status.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <loom/routers/router_core.hpp>
#include "tensors.hpp"

namespace {

using namespace routers_test;
namespace lr = loom::routers;

template <class Fn>
std::string error_of(Fn&& fn, loom_code* code = nullptr) {
  try {
    fn();
  } catch (const loom::sdk::Error& e) {
    if (code != nullptr) *code = e.code();
    return e.what();
  }
  return "";
}

// Storage of a [B, S, C] tensor as [B, S, C] (batch-major) or [S, B, C] (position-major).
struct Layout {
  bool position_major = false;
  std::vector<int64_t> strides(int64_t b, int64_t s, int64_t c) const {
    (void)s;
    if (position_major) return {c, b * c, 1};
    return {};
  }
  std::size_t offset(int64_t b, int64_t p, int64_t batch, int64_t positions, int64_t c) const {
    return static_cast<std::size_t>(position_major ? (p * batch + b) * c : (b * positions + p) * c);
  }
};

struct MoveCase {
  int bits;
  int64_t batch, seq_len, kept, channels;
  bool position_major;
};

// gather, then scatter over a different background: the kept rows hold full's rows, and
// every dropped row of the background is untouched; bytes compared exactly.
void check_round_trip(const MoveCase& c, uint64_t seed) {
  SCOPED_TRACE("bits " + std::to_string(c.bits) + " B " + std::to_string(c.batch) + " S " +
               std::to_string(c.seq_len) + " K " + std::to_string(c.kept) + " C " +
               std::to_string(c.channels) + (c.position_major ? " [S, B, C]" : " [B, S, C]"));
  const std::size_t e = static_cast<std::size_t>(c.bits) / 8;
  const Layout lay{c.position_major};
  const auto full_n = static_cast<std::size_t>(c.batch * c.seq_len * c.channels);
  const auto kept_n = static_cast<std::size_t>(c.batch * c.kept * c.channels);
  std::vector<unsigned char> full = random_bytes(full_n * e, seed);
  std::vector<unsigned char> kept(kept_n * e, 0xEE);
  std::vector<int32_t> idx = random_rows(c.batch, c.seq_len, c.kept, seed + 1);
  const DLDataType dt = uint_type(c.bits);
  View fv(full.data(), {c.batch, c.seq_len, c.channels}, dt,
          lay.strides(c.batch, c.seq_len, c.channels));
  View kv(kept.data(), {c.batch, c.kept, c.channels}, dt, lay.strides(c.batch, c.kept, c.channels));
  View iv(idx.data(), {c.batch, c.kept}, kI32);
  lr::gather(loom::sdk::router_move(move_args(fv, kv, iv)));
  const std::size_t row = static_cast<std::size_t>(c.channels) * e;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 0; j < c.kept; ++j) {
      const int32_t p = idx[static_cast<std::size_t>(b * c.kept + j)];
      const std::size_t fo = lay.offset(b, p, c.batch, c.seq_len, c.channels) * e;
      const std::size_t ko = lay.offset(b, j, c.batch, c.kept, c.channels) * e;
      ASSERT_EQ(std::memcmp(kept.data() + ko, full.data() + fo, row), 0)
          << "kept[" << b << ", " << j << "] != full[" << b << ", " << p << "]";
    }
  }
  // Scatter over a background: kept positions become full's rows, the others stay.
  const std::vector<unsigned char> background = random_bytes(full_n * e, seed + 2);
  std::vector<unsigned char> out = background;
  View ov(out.data(), {c.batch, c.seq_len, c.channels}, dt,
          lay.strides(c.batch, c.seq_len, c.channels));
  lr::scatter(loom::sdk::router_move(move_args(ov, kv, iv)));
  for (int64_t b = 0; b < c.batch; ++b) {
    std::vector<bool> is_kept(static_cast<std::size_t>(c.seq_len), false);
    for (int64_t j = 0; j < c.kept; ++j) {
      is_kept[static_cast<std::size_t>(idx[static_cast<std::size_t>(b * c.kept + j)])] = true;
    }
    for (int64_t p = 0; p < c.seq_len; ++p) {
      const std::size_t o = lay.offset(b, p, c.batch, c.seq_len, c.channels) * e;
      const unsigned char* want =
          is_kept[static_cast<std::size_t>(p)] ? full.data() + o : background.data() + o;
      ASSERT_EQ(std::memcmp(out.data() + o, want, row), 0)
          << "out[" << b << ", " << p << "] (" << (is_kept[p] ? "kept" : "dropped") << ")";
    }
  }
}

TEST(RouterCore, GatherScatterEveryWidthAndLayout) {
  int n = 0;
  for (const int bits : {8, 16, 32, 64}) {
    for (const bool pm : {false, true}) {
      check_round_trip({bits, 3, 37, 11, 5, pm}, 100 + n++);
      check_round_trip({bits, 2, 16, 16, 8, pm}, 100 + n++);  // everything kept
      check_round_trip({bits, 1, 9, 1, 1, pm}, 100 + n++);    // one row of one element
    }
  }
}

TEST(RouterCore, GatherScatterOnThreads) {
  // Large enough to split into many parallel blocks; the same bytes on 1, 2 and 7 threads.
  for (const std::size_t threads : {1u, 2u, 7u}) {
    const TestPool pool(threads);
    check_round_trip({32, 4, 4096, 1000, 64, false}, 7);
    check_round_trip({16, 3, 2048, 700, 96, true}, 8);
  }
}

TEST(RouterCore, LongSequences) {
  const TestPool pool(4);
  check_round_trip({16, 2, 32768, 4096, 8, false}, 9);
  check_round_trip({8, 1, 65536 + 3, 30000, 3, true}, 10);
}

// Every aligned move through the non-temporal stores (threshold 1 byte), then unaligned rows
// (memcpy) under the same threshold; the threshold restored after.
TEST(RouterCore, StreamingStoresCopyTheSameBytes) {
  const TestPool pool(3);
  lr::set_streaming_threshold(1);
  check_round_trip({32, 3, 500, 200, 64, false}, 21);  // 256-byte rows
  check_round_trip({16, 2, 300, 100, 8, true}, 22);    // 16-byte rows, [S, B, C]
  check_round_trip({8, 2, 300, 100, 40, false}, 23);   // 40-byte rows: memcpy
  check_round_trip({64, 2, 100, 37, 3, false}, 24);    // 24-byte rows: memcpy
  // gather streams 8 rows at a time when rows are whole cache lines: groups that cross a
  // sequence's end (kept 101 and 99, not multiples of 8), a remainder, and [S, B, C].
  check_round_trip({32, 3, 301, 101, 16, false}, 25);  // 64-byte rows
  check_round_trip({64, 2, 300, 99, 8, true}, 26);     // 64-byte rows, [S, B, C]
  check_round_trip({16, 1, 40, 13, 512, false}, 27);   // 1024-byte rows, one thread's worth
  check_round_trip({32, 2, 64, 64, 16, false}, 28);    // every row kept: contiguous runs
  check_round_trip({32, 2, 100, 95, 16, false}, 29);   // mostly dense: runs and gaps
  lr::set_streaming_threshold(0);
}

// <gather x, y> == <x, scatter y over zeros>, in fp64, with integer-valued data so both
// sides are exact.
TEST(RouterCore, ScatterIsTheAdjointOfGather) {
  const TestPool pool(3);
  for (const bool pm : {false, true}) {
    const int64_t B = 3, S = 300, K = 77, C = 12;
    const Layout lay{pm};
    std::mt19937_64 rng(5);
    std::uniform_int_distribution<int> v(-1000, 1000);
    std::vector<double> x(static_cast<std::size_t>(B * S * C));
    std::vector<double> y(static_cast<std::size_t>(B * K * C));
    for (auto& a : x) a = v(rng);
    for (auto& a : y) a = v(rng);
    std::vector<int32_t> idx = random_rows(B, S, K, 6);
    std::vector<double> gx(y.size(), -1.0);
    std::vector<double> sy(x.size(), 0.0);
    View xv(x.data(), {B, S, C}, kF64, lay.strides(B, S, C));
    View gv(gx.data(), {B, K, C}, kF64, lay.strides(B, K, C));
    View yv(y.data(), {B, K, C}, kF64, lay.strides(B, K, C));
    View sv(sy.data(), {B, S, C}, kF64, lay.strides(B, S, C));
    View iv(idx.data(), {B, K}, kI32);
    lr::gather(loom::sdk::router_move(move_args(xv, gv, iv)));
    lr::scatter(loom::sdk::router_move(move_args(sv, yv, iv)));
    double lhs = 0, rhs = 0;
    for (std::size_t i = 0; i < y.size(); ++i) lhs += gx[i] * y[i];
    for (std::size_t i = 0; i < x.size(); ++i) rhs += x[i] * sy[i];
    EXPECT_EQ(lhs, rhs);
    EXPECT_NE(lhs, 0.0);
  }
}

TEST(RouterCore, BadMovesNameWhat) {
  std::vector<float> full(2 * 8 * 4), kept(2 * 9 * 4);
  std::vector<int32_t> idx(2 * 9, 0);
  View fv(full.data(), {2, 8, 4}, kF32);
  View kv(kept.data(), {2, 9, 4}, kF32);
  View iv(idx.data(), {2, 9}, kI32);
  EXPECT_NE(error_of([&] {
              lr::gather(loom::sdk::router_move(move_args(fv, kv, iv)));
            }).find("kept has 9 positions per sequence but full has only 8"),
            std::string::npos);
  // Rows that do not increase, or leave the sequence.
  View kv3(kept.data(), {2, 3, 4}, kF32);
  std::vector<int32_t> bad = {0, 2, 2, 1, 3, 5};
  View bv(bad.data(), {2, 3}, kI32);
  EXPECT_NE(error_of([&] {
              lr::scatter(loom::sdk::router_move(move_args(fv, kv3, bv)));
            }).find("indices[0, 2] = 2 does not increase"),
            std::string::npos);
  bad = {0, 1, 2, 1, 3, 8};
  EXPECT_NE(error_of([&] {
              lr::gather(loom::sdk::router_move(move_args(fv, kv3, bv)));
            }).find("indices[1, 2] = 8 is outside the 8 positions"),
            std::string::npos);
  // A device neither host nor CUDA.
  bad = {0, 1, 2, 1, 3, 5};
  View fo(full.data(), {2, 8, 4}, kF32, {}, DLDevice{kDLVulkan, 0});
  View ko(kept.data(), {2, 3, 4}, kF32, {}, DLDevice{kDLVulkan, 0});
  View io(bad.data(), {2, 3}, kI32, {}, DLDevice{kDLVulkan, 0});
  loom_code code = LOOM_OK;
  EXPECT_NE(error_of([&] { lr::gather(loom::sdk::router_move(move_args(fo, ko, io))); }, &code)
                .find("routers move host or CUDA memory"),
            std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  if (!lr::have_cuda()) {
    View fc(full.data(), {2, 8, 4}, kF32, {}, DLDevice{kDLCUDA, 0});
    View kc(kept.data(), {2, 3, 4}, kF32, {}, DLDevice{kDLCUDA, 0});
    View ic(bad.data(), {2, 3}, kI32, {}, DLDevice{kDLCUDA, 0});
    EXPECT_NE(error_of([&] { lr::gather(loom::sdk::router_move(move_args(fc, kc, ic))); }, &code)
                  .find("built without CUDA"),
              std::string::npos);
    EXPECT_EQ(code, LOOM_ERR_UNIMPLEMENTED);
  }
}

TEST(RouterCore, RoutedLayersDefaultIsTheMiddleLayers) {
  const lr::RoutedLayers d;
  EXPECT_TRUE(d.is_default());
  EXPECT_EQ(d.of(6), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_FALSE(d.routed(0, 6));
  EXPECT_TRUE(d.routed(1, 6));
  EXPECT_TRUE(d.routed(4, 6));
  EXPECT_FALSE(d.routed(5, 6));
  EXPECT_TRUE(d.of(2).empty());
  EXPECT_TRUE(d.of(1).empty());
  EXPECT_FALSE(d.routed(0, 1));
}

TEST(RouterCore, RoutedLayersExplicit) {
  const lr::RoutedLayers l({0, 2, 5});
  EXPECT_EQ(l.of(6), (std::vector<int32_t>{0, 2, 5}));
  EXPECT_TRUE(l.routed(0, 6));
  EXPECT_FALSE(l.routed(1, 6));
  EXPECT_TRUE(l.routed(5, 6));
  const lr::RoutedLayers big({1, 3, 7});
  loom_code code = LOOM_OK;
  const std::string msg = error_of([&] { (void)big.routed(1, 6); }, &code);
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("layers[2] = 7 is outside the model's 6 layers (0 .. 5)"), std::string::npos)
      << msg;
  EXPECT_NE(error_of([&] { (void)big.of(7); }).find("layers[2] = 7 is outside the model's 7"),
            std::string::npos);
  EXPECT_EQ(big.of(8), (std::vector<int32_t>{1, 3, 7}));
  EXPECT_NE(error_of([&] { (void)l.routed(6, 6); }).find("layer 6 is outside"), std::string::npos);
}

TEST(RouterCore, RoutedLayersRefusesBadLists) {
  try {
    lr::RoutedLayers({1, 3, 3});
    FAIL() << "accepted a repeated layer";
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.param(), "layers");
    EXPECT_NE(std::string(e.what()).find("layers[2] = 3 is not above layers[1] = 3"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NE(error_of([] {
              lr::RoutedLayers({2, 1});
            }).find("strictly increasing"),
            std::string::npos);
  EXPECT_NE(error_of([] { lr::RoutedLayers({-1}); }).find("layers[0] = -1 is negative"),
            std::string::npos);
  const auto spec = lr::RoutedLayers::param();
  EXPECT_EQ(spec.name(), "layers");
  EXPECT_EQ(spec.type(), LOOM_PARAM_INT_LIST);
}

loom_router_advance_args adv(int64_t step) {
  loom_router_advance_args a{};
  a.struct_size = LOOM_ROUTER_ADVANCE_ARGS_SIZE;
  a.step = step;
  a.batch = 1;
  a.seq_len = 1;
  a.num_layers = 1;
  return a;
}

TEST(RouterCore, LayerTokenCounterAdvances) {
  lr::LayerTokenCounter c;
  auto a = adv(1);
  c.advance(a, 100);
  EXPECT_EQ(a.layer_tokens, 100);
  EXPECT_EQ(a.consumed_layer_tokens, 100u);
  a = adv(2);
  c.advance(a, 50);
  EXPECT_EQ(a.consumed_layer_tokens, 150u);
  // The last step again: nothing changes.
  a = adv(2);
  c.advance(a, 50);
  EXPECT_EQ(a.layer_tokens, 50);
  EXPECT_EQ(a.consumed_layer_tokens, 150u);
  EXPECT_EQ(c.step(), 2);
  EXPECT_EQ(c.consumed(), 150u);
  // A skipped step or an older one.
  for (const int64_t s : {4, 1}) {
    loom_code code = LOOM_OK;
    a = adv(s);
    const std::string msg = error_of([&] { c.advance(a, 1); }, &code);
    EXPECT_EQ(code, LOOM_ERR_FAILED_PRECONDITION) << s;
    EXPECT_NE(
        msg.find("step " + std::to_string(s) + " does not follow the last step accounted (2)"),
        std::string::npos)
        << msg;
  }
  EXPECT_EQ(c.consumed(), 150u);
  // A fresh counter starts at step 1.
  lr::LayerTokenCounter fresh;
  a = adv(2);
  loom_code code = LOOM_OK;
  EXPECT_NE(error_of([&] { fresh.advance(a, 1); }, &code).find("none yet, so the next is 1"),
            std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_FAILED_PRECONDITION);
  // Sums that overflow.
  EXPECT_EQ(lr::LayerTokenCounter::layer_tokens(3, 4, [](int32_t l) { return int64_t{l} + 1; }),
            30);
  EXPECT_NE(error_of(
                [] {
                  (void)lr::LayerTokenCounter::layer_tokens(INT64_MAX / 2, 3,
                                                            [](int32_t) { return int64_t{1}; });
                },
                &code)
                .find("do not fit"),
            std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_OUT_OF_RANGE);
}

TEST(RouterCore, LayerTokenCounterStateRoundTrip) {
  lr::LayerTokenCounter c;
  for (int64_t s = 1; s <= 5; ++s) {
    auto a = adv(s);
    c.advance(a, 1000 + s);
  }
  Blob blob;
  {
    loom::sdk::StateWriter w(&blob.writer);
    c.export_state(w);
  }
  lr::LayerTokenCounter r;
  r.import_state(blob.bytes);
  EXPECT_EQ(r.step(), 5);
  EXPECT_EQ(r.consumed(), c.consumed());
  // The resumed counter continues where the first one stopped, and repeats its last step.
  auto a = adv(5);
  r.advance(a, 1005);
  EXPECT_EQ(a.consumed_layer_tokens, c.consumed());
  a = adv(6);
  r.advance(a, 7);
  EXPECT_EQ(a.consumed_layer_tokens, c.consumed() + 7);
  // Truncated, extended and foreign blobs change nothing.
  std::vector<std::byte> cut(blob.bytes.begin(), blob.bytes.end() - 1);
  loom_code code = LOOM_OK;
  (void)error_of([&] { r.import_state(cut); }, &code);
  EXPECT_EQ(code, LOOM_ERR_DATA_LOSS);
  std::vector<std::byte> longer = blob.bytes;
  longer.push_back(std::byte{0});
  (void)error_of([&] { r.import_state(longer); }, &code);
  EXPECT_EQ(code, LOOM_ERR_DATA_LOSS);
  std::vector<std::byte> foreign = blob.bytes;
  foreign[8] = std::byte{'X'};
  (void)error_of([&] { r.import_state(foreign); }, &code);
  EXPECT_EQ(code, LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(r.step(), 6);
}

// The step is checked on import: negative, or so large that the next advance's step + 1
// would overflow int64, is refused naming the field, and the counter keeps its state; the
// largest step allowed imports, and advancing past it is refused, not overflowed.
TEST(RouterCore, LayerTokenCounterStepStaysInRange) {
  const auto state = [](int64_t step, uint64_t consumed) {
    Blob blob;
    loom::sdk::StateWriter w(&blob.writer);
    w.write_header(lr::LayerTokenCounter::kMagic, lr::LayerTokenCounter::kVersion);
    w.write_pod(step);
    w.write_pod(consumed);
    return blob.bytes;
  };
  lr::LayerTokenCounter c;
  auto a = adv(1);
  c.advance(a, 10);
  for (const int64_t step : {INT64_MAX, int64_t{-1}, INT64_MIN}) {
    loom_code code = LOOM_OK;
    EXPECT_EQ(error_of([&] { c.import_state(state(step, 5)); }, &code),
              "router state has step " + std::to_string(step) +
                  "; it must be in 0 .. 9223372036854775806 (the next advance accounts step + 1)");
    EXPECT_EQ(code, LOOM_ERR_DATA_LOSS);
    EXPECT_EQ(c.step(), 1);
    EXPECT_EQ(c.consumed(), 10u);
  }
  c.import_state(state(INT64_MAX - 1, 5));
  EXPECT_EQ(c.step(), INT64_MAX - 1);
  // A step that does not follow is still told apart (step + 1 did overflow here).
  loom_code code = LOOM_OK;
  a = adv(1);
  EXPECT_NE(error_of([&] { c.advance(a, 1); }, &code).find("does not follow"), std::string::npos);
  EXPECT_EQ(code, LOOM_ERR_FAILED_PRECONDITION);
  // The last step again is fine; the one after would be a state no import accepts.
  a = adv(INT64_MAX - 1);
  c.advance(a, 1);
  EXPECT_EQ(a.consumed_layer_tokens, 5u);
  a = adv(INT64_MAX);
  EXPECT_EQ(error_of([&] { c.advance(a, 1); }, &code),
            "router advance: step 9223372036854775807 is the largest int64, so no step could "
            "follow it; the last step a router accounts is 9223372036854775806");
  EXPECT_EQ(code, LOOM_ERR_OUT_OF_RANGE);
  EXPECT_EQ(c.step(), INT64_MAX - 1);
  EXPECT_EQ(c.consumed(), 5u);
}

}  // namespace
