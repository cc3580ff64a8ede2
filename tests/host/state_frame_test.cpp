// The SDK's state frame and export cache (sdk/include/loom/sdk/state.hpp, plugin.hpp), seen
// through the C API with the state_counter test plugin: every single-bit change, truncation
// or extension of an exported blob is DATA_LOSS naming the instance; a blob written before
// frames is still accepted; a size query followed by the copy serialises once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <loom/sdk/state.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;

constexpr std::size_t kFrameHeader = 16;  // "LOOMSTv2" + payload size
constexpr std::size_t kFrameTrailer = 4;  // CRC32C

// state_counter's payload, parsed from a framed (or, with `framed` false, unframed) blob.
struct Counted {
  int64_t steps = -1;
  int64_t serialisations = -1;
  std::vector<uint8_t> payload;
};

Counted parse(const std::vector<unsigned char>& blob, bool framed = true) {
  std::size_t pos = framed ? kFrameHeader : 0;
  auto take = [&](void* out, std::size_t n) {
    if (pos + n > blob.size()) throw std::runtime_error("short blob");
    std::memcpy(out, blob.data() + pos, n);
    pos += n;
  };
  uint64_t magic = 0;
  take(&magic, 8);
  pos += magic + 4;  // magic, version
  Counted c;
  take(&c.steps, 8);
  take(&c.serialisations, 8);
  uint64_t n = 0;
  take(&n, 8);
  c.payload.resize(n);
  take(c.payload.data(), n);
  return c;
}

class StateFrame : public loom_test::ManifestTest {
 protected:
  loom_instance* open_counter(std::size_t payload_bytes) {
    EXPECT_EQ(open("[optimizer.main]\nplugin = \"state_counter\"\npayload_bytes = " +
                   std::to_string(payload_bytes) + "\n"),
              LOOM_OK)
        << error_;
    loom_instance* out = nullptr;
    EXPECT_EQ(loom_find_instance(session_, "optimizer", "main", &out), LOOM_OK)
        << loom_last_error();
    return out;
  }
  static void step(loom_instance* opt) {
    loom_optimizer_step_args args{};
    args.struct_size = LOOM_OPTIMIZER_STEP_ARGS_SIZE;
    args.grad_scale = 1.0;
    ASSERT_EQ(loom_optimizer_step(opt, &args), LOOM_OK) << loom_last_error();
  }
  // Size query, then the copy.
  static std::vector<unsigned char> export_state(loom_instance* opt) {
    size_t size = 0;
    EXPECT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), LOOM_OK) << loom_last_error();
    std::vector<unsigned char> blob(size);
    EXPECT_EQ(loom_instance_export_state(opt, blob.data(), blob.size(), &size), LOOM_OK)
        << loom_last_error();
    EXPECT_EQ(size, blob.size());
    return blob;
  }
  // One call with a buffer large enough.
  static std::vector<unsigned char> export_once(loom_instance* opt) {
    std::vector<unsigned char> blob(1 << 21);
    size_t size = 0;
    EXPECT_EQ(loom_instance_export_state(opt, blob.data(), blob.size(), &size), LOOM_OK)
        << loom_last_error();
    blob.resize(size);
    return blob;
  }
};

TEST(Crc32c, MatchesTheStandardCheckValues) {
  // The CRC-32C check value, and the iSCSI test vectors of RFC 3720 B.4.
  EXPECT_EQ(loom::sdk::crc32c("123456789", 9), 0xE3069283U);
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF), up(32);
  for (int i = 0; i < 32; ++i) up[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(loom::sdk::crc32c(zeros.data(), 32), 0x8A9136AAU);
  EXPECT_EQ(loom::sdk::crc32c(ones.data(), 32), 0x62A8AB43U);
  EXPECT_EQ(loom::sdk::crc32c(up.data(), 32), 0x46DD794EU);
  // The portable tables and whatever crc32c() chose agree on every length and alignment.
  std::vector<unsigned char> data(300);
  std::mt19937 rng(7);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (std::size_t off = 0; off < 9; ++off) {
    for (std::size_t len = 0; len + off <= data.size(); len += 13) {
      const uint32_t portable =
          ~loom::sdk::detail::crc32c_portable(0xFFFFFFFFU, data.data() + off, len);
      EXPECT_EQ(loom::sdk::crc32c(data.data() + off, len), portable) << off << " " << len;
    }
  }
}

TEST_F(StateFrame, SizeQueryThenCopySerialisesOnce) {
  loom_instance* opt = open_counter(64);
  step(opt);
  step(opt);
  const auto first = export_state(opt);
  ASSERT_GT(first.size(), kFrameHeader + kFrameTrailer);
  EXPECT_EQ(std::memcmp(first.data(), "LOOMSTv2", 8), 0);
  EXPECT_EQ(parse(first).steps, 2);
  EXPECT_EQ(parse(first).serialisations, 1);  // the size query's serialisation, reused

  // The cache lasts for one repeat: a lone export serialises, the next is served from it
  // with identical bytes, and the one after serialises again.
  const auto lone = export_once(opt);
  EXPECT_EQ(parse(lone).serialisations, 2);
  const auto repeat = export_once(opt);
  EXPECT_EQ(repeat, lone);
  const auto cached = export_once(opt);  // serialisation 3, kept for a repeat
  EXPECT_EQ(parse(cached).serialisations, 3);

  // Any other call drops it: after a step, the export is fresh and shows the step.
  step(opt);
  const auto after = export_state(opt);
  EXPECT_EQ(parse(after).steps, 3);
  EXPECT_EQ(parse(after).serialisations, 4);
  EXPECT_EQ(parse(after).payload[0], parse(cached).payload[0] + 1);

  // A too-small buffer is refused with the size it needs.
  size_t size = 0;
  ASSERT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), LOOM_OK);
  std::vector<unsigned char> small(size - 1);
  EXPECT_EQ(loom_instance_export_state(opt, small.data(), small.size(), &size),
            LOOM_ERR_OUT_OF_RANGE);
  EXPECT_THAT(loom_last_error(), HasSubstr("needs " + std::to_string(small.size() + 1)));
}

TEST_F(StateFrame, RoundTripIsExact) {
  loom_instance* opt = open_counter(1000);
  for (int i = 0; i < 3; ++i) step(opt);
  const auto blob = export_state(opt);
  loom_test::TempDir other;
  auto r = loom_test::open_file(
      other.write("m.toml", "[optimizer.copy]\nplugin = \"state_counter\"\npayload_bytes = 1000\n"),
      false);
  ASSERT_EQ(r.rc, LOOM_OK) << r.error;
  loom_instance* copy = nullptr;
  ASSERT_EQ(loom_find_instance(r.session, "optimizer", "copy", &copy), LOOM_OK);
  ASSERT_EQ(loom_instance_import_state(copy, blob.data(), blob.size()), LOOM_OK)
      << loom_last_error();
  const auto again = export_state(copy);
  ASSERT_EQ(again.size(), blob.size());
  const Counted a = parse(blob), b = parse(again);
  EXPECT_EQ(b.steps, a.steps);
  EXPECT_EQ(b.serialisations, a.serialisations + 1);  // the import carried the count
  EXPECT_EQ(b.payload, a.payload);
  loom_close(r.session);
}

TEST_F(StateFrame, EverySingleBitFlipIsRejected) {
  loom_instance* opt = open_counter(64);
  step(opt);
  const auto blob = export_state(opt);
  const auto before = parse(blob);
  for (std::size_t bit = 0; bit < blob.size() * 8; ++bit) {
    auto bad = blob;
    bad[bit / 8] ^= static_cast<unsigned char>(1U << (bit % 8));
    ASSERT_EQ(loom_instance_import_state(opt, bad.data(), bad.size()), LOOM_ERR_DATA_LOSS)
        << "bit " << bit << " of " << blob.size() * 8 << " flipped was accepted";
    ASSERT_THAT(loom_last_error(), HasSubstr("optimizer.main (plugin 'state_counter'"))
        << "bit " << bit;
  }
  // Where each part of the frame is hit, the message says what did not match.
  auto bad = blob;
  bad[3] ^= 0x10;
  ASSERT_EQ(loom_instance_import_state(opt, bad.data(), bad.size()), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("frame tag is damaged (1 bits differ"));
  bad = blob;
  bad[8] ^= 0x01;
  ASSERT_EQ(loom_instance_import_state(opt, bad.data(), bad.size()), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("its frame says"));
  bad = blob;
  bad[kFrameHeader + 40] ^= 0x80;
  ASSERT_EQ(loom_instance_import_state(opt, bad.data(), bad.size()), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("import_state: state blob checksum mismatch"));
  bad = blob;
  bad.back() ^= 0x04;
  ASSERT_EQ(loom_instance_import_state(opt, bad.data(), bad.size()), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("checksum mismatch"));

  // None of the refusals changed the state.
  const auto now = parse(export_state(opt));
  EXPECT_EQ(now.steps, before.steps);
  EXPECT_EQ(now.payload, before.payload);
}

TEST_F(StateFrame, BitFlipsInALargeStateAreRejected) {
  loom_instance* opt = open_counter(1 << 20);
  step(opt);
  const auto blob = export_state(opt);
  std::mt19937_64 rng(42);
  for (int i = 0; i < 400; ++i) {
    const std::size_t bit = rng() % (blob.size() * 8);
    auto bad = blob;
    bad[bit / 8] ^= static_cast<unsigned char>(1U << (bit % 8));
    ASSERT_EQ(loom_instance_import_state(opt, bad.data(), bad.size()), LOOM_ERR_DATA_LOSS)
        << "bit " << bit;
  }
  ASSERT_EQ(loom_instance_import_state(opt, blob.data(), blob.size()), LOOM_OK)
      << loom_last_error();
}

TEST_F(StateFrame, TruncationAndExtensionAreRejected) {
  loom_instance* opt = open_counter(64);
  step(opt);
  const auto blob = export_state(opt);
  for (std::size_t n = 0; n < blob.size(); ++n) {
    ASSERT_EQ(loom_instance_import_state(opt, blob.data(), n), LOOM_ERR_DATA_LOSS)
        << "the first " << n << " of " << blob.size() << " bytes were accepted";
  }
  ASSERT_EQ(loom_instance_import_state(opt, blob.data(), blob.size() - 1), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("(truncated after export)"));
  ASSERT_EQ(loom_instance_import_state(opt, blob.data(), 5), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("shorter than the 20-byte frame"));
  auto longer = blob;
  longer.push_back(0);
  ASSERT_EQ(loom_instance_import_state(opt, longer.data(), longer.size()), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("extended or damaged"));
  ASSERT_EQ(loom_instance_import_state(opt, blob.data(), blob.size()), LOOM_OK);
}

TEST_F(StateFrame, UnframedBlobsFromBeforeFramesAreStillAccepted) {
  loom_instance* opt = open_counter(64);
  for (int i = 0; i < 4; ++i) step(opt);
  const auto framed = export_state(opt);
  // What the same plugin wrote before the SDK framed its state: the payload alone.
  const std::vector<unsigned char> legacy(framed.begin() + kFrameHeader,
                                          framed.end() - kFrameTrailer);
  loom_test::TempDir other;
  auto r = loom_test::open_file(
      other.write("m.toml", "[optimizer.old]\nplugin = \"state_counter\"\npayload_bytes = 64\n"),
      false);
  ASSERT_EQ(r.rc, LOOM_OK) << r.error;
  loom_instance* old = nullptr;
  ASSERT_EQ(loom_find_instance(r.session, "optimizer", "old", &old), LOOM_OK);
  ASSERT_EQ(loom_instance_import_state(old, legacy.data(), legacy.size()), LOOM_OK)
      << loom_last_error();
  const auto restored = parse(export_state(old));
  EXPECT_EQ(restored.steps, 4);
  EXPECT_EQ(restored.payload, parse(legacy, false).payload);
  // Such a blob still gets the plugin's own checks: a short one is refused.
  EXPECT_EQ(loom_instance_import_state(old, legacy.data(), legacy.size() - 1), LOOM_ERR_DATA_LOSS);
  loom_close(r.session);
}

}  // namespace
