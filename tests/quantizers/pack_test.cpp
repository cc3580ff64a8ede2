// Packing of codes (quant_core.hpp) against the bit stream loom/quant_format.h defines, taken
// literally one bit at a time: every bit width 1..8, both orders, odd sizes, codes that
// straddle bytes, ranges that start mid-byte.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "quant_core.hpp"

namespace {

using loom::quant::pack_codes;
using loom::quant::packed_size;
using loom::quant::read_code;
using loom::quant::unpack_codes;

// The header's definition: element i occupies stream bits [i b, (i + 1) b); LSB_FIRST: stream
// bit k is bit k % 8 of byte k / 8 and the code's least significant bit comes first;
// MSB_FIRST: stream bit k is bit 7 - k % 8 and the code's most significant bit comes first.
std::vector<uint8_t> pack_by_definition(const std::vector<uint8_t>& codes, uint32_t bits,
                                        int32_t packing) {
  std::vector<uint8_t> out(packed_size(codes.size(), bits), 0);
  for (std::size_t i = 0; i < codes.size(); ++i) {
    for (uint32_t j = 0; j < bits; ++j) {
      const uint64_t k = i * bits + j;
      const uint32_t bit = packing == LOOM_QUANT_PACK_LSB_FIRST ? (codes[i] >> j) & 1u
                                                                : (codes[i] >> (bits - 1 - j)) & 1u;
      const uint32_t pos = packing == LOOM_QUANT_PACK_LSB_FIRST ? k % 8 : 7 - k % 8;
      out[k / 8] = static_cast<uint8_t>(out[k / 8] | (bit << pos));
    }
  }
  return out;
}

std::vector<uint8_t> random_codes(std::size_t n, uint32_t bits, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> c(n);
  for (auto& v : c) v = static_cast<uint8_t>(rng() & ((1u << bits) - 1u));
  return c;
}

TEST(QuantPack, HeaderExamplesForFourBits) {
  const std::vector<uint8_t> codes = {0x1, 0x2, 0xA, 0xF, 0x7};
  std::vector<uint8_t> lsb(packed_size(5, 4), 0xEE);
  pack_codes(codes.data(), 0, 5, 4, LOOM_QUANT_PACK_LSB_FIRST, lsb.data());
  lsb.back() &= 0x0F;  // unused bits are the caller's (the quantizers zero the last byte)
  EXPECT_EQ(lsb, (std::vector<uint8_t>{0x21, 0xFA, 0x07}));
  std::vector<uint8_t> msb(3, 0);
  pack_codes(codes.data(), 0, 5, 4, LOOM_QUANT_PACK_MSB_FIRST, msb.data());
  EXPECT_EQ(msb, (std::vector<uint8_t>{0x12, 0xAF, 0x70}));
}

TEST(QuantPack, ThreeBitCodesStraddleBytes) {
  // codes 5, 3, 6 (101, 011, 110): LSB_FIRST stream bits 1,0,1, 1,1,0, 0,1,1 -> byte0 bits
  // 0..7 = 1 0 1 1 1 0 0 1 = 0x9D, byte1 bit 0 = 1.
  const std::vector<uint8_t> codes = {5, 3, 6};
  std::vector<uint8_t> out(2, 0);
  pack_codes(codes.data(), 0, 3, 3, LOOM_QUANT_PACK_LSB_FIRST, out.data());
  EXPECT_EQ(out, (std::vector<uint8_t>{0x9D, 0x01}));
  EXPECT_EQ(read_code(out.data(), 2, 3, LOOM_QUANT_PACK_LSB_FIRST), 6u);
  // MSB_FIRST: stream 101 011 11|0 -> 0xAF, 0x00
  std::fill(out.begin(), out.end(), 0);
  pack_codes(codes.data(), 0, 3, 3, LOOM_QUANT_PACK_MSB_FIRST, out.data());
  EXPECT_EQ(out, (std::vector<uint8_t>{0xAF, 0x00}));
  EXPECT_EQ(read_code(out.data(), 2, 3, LOOM_QUANT_PACK_MSB_FIRST), 6u);
}

TEST(QuantPack, EveryWidthAndOrderMatchesTheDefinition) {
  for (uint32_t bits = 1; bits <= 8; ++bits) {
    for (int32_t packing : {LOOM_QUANT_PACK_LSB_FIRST, LOOM_QUANT_PACK_MSB_FIRST}) {
      for (std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{7}, std::size_t{13},
                            std::size_t{64}, std::size_t{101}}) {
        SCOPED_TRACE("bits " + std::to_string(bits) + " packing " + std::to_string(packing) +
                     " n " + std::to_string(n));
        const auto codes = random_codes(n, bits, static_cast<uint32_t>(bits * 1000 + n));
        const auto want = pack_by_definition(codes, bits, packing);
        std::vector<uint8_t> got(want.size(), 0);
        pack_codes(codes.data(), 0, n, bits, packing, got.data());
        EXPECT_EQ(got, want);
        std::vector<uint8_t> back(n, 0xFF);
        unpack_codes(got.data(), 0, n, bits, packing, back.data());
        EXPECT_EQ(back, codes);
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_EQ(read_code(want.data(), i, bits, packing), codes[i]) << "element " << i;
        }
      }
    }
  }
}

TEST(QuantPack, RangesStartingMidByteKeepTheirNeighbours) {
  for (uint32_t bits = 1; bits <= 8; ++bits) {
    for (int32_t packing : {LOOM_QUANT_PACK_LSB_FIRST, LOOM_QUANT_PACK_MSB_FIRST}) {
      const std::size_t n = 37;
      const auto codes = random_codes(n, bits, 77 + bits);
      const auto want = pack_by_definition(codes, bits, packing);
      // Pieces of 5, 11, 2, 19 elements, written out of order over a buffer of ones.
      std::vector<uint8_t> got(want.size(), 0);
      const std::size_t cuts[] = {0, 5, 16, 18, 37};
      for (int piece : {2, 0, 3, 1}) {
        pack_codes(codes.data() + cuts[piece], cuts[piece], cuts[piece + 1] - cuts[piece], bits,
                   packing, got.data());
      }
      EXPECT_EQ(got, want) << "bits " << bits;
      std::vector<uint8_t> part(11);
      unpack_codes(want.data(), 5, 11, bits, packing, part.data());
      EXPECT_EQ(part, std::vector<uint8_t>(codes.begin() + 5, codes.begin() + 16));
    }
  }
}

TEST(QuantPack, HighBitsOfACodeAreIgnored) {
  const std::vector<uint8_t> codes = {0xFF, 0xF0, 0x13};
  std::vector<uint8_t> out(2, 0);
  pack_codes(codes.data(), 0, 3, 4, LOOM_QUANT_PACK_LSB_FIRST, out.data());
  EXPECT_EQ(out, (std::vector<uint8_t>{0x0F, 0x03}));
}

TEST(QuantPack, AlignedRowsStartOnBytes) {
  for (uint32_t bits = 1; bits <= 8; ++bits) {
    for (int64_t cols : {1, 2, 3, 5, 8, 12}) {
      const int64_t r = loom::quant::aligned_rows(cols, bits);
      EXPECT_EQ((r * cols * bits) % 8, 0);
      for (int64_t s = 1; s < r; ++s) EXPECT_NE((s * cols * bits) % 8, 0);
    }
  }
}

TEST(QuantPack, SignExtend) {
  EXPECT_EQ(loom::quant::sign_extend(0xF, 4), -1);
  EXPECT_EQ(loom::quant::sign_extend(0x8, 4), -8);
  EXPECT_EQ(loom::quant::sign_extend(0x7, 4), 7);
  EXPECT_EQ(loom::quant::sign_extend(0x81, 8), -127);
  EXPECT_EQ(loom::quant::sign_extend(0x2, 2), -2);
}

TEST(QuantGroups, LastGroupMayBeShorter) {
  const auto g = loom::quant::Groups::of(2, 10, 4);
  EXPECT_EQ(g.groups_per_row, 3);
  EXPECT_EQ(g.count(), 6);
  EXPECT_FALSE(g.whole());
  std::vector<int64_t> seen;
  loom::quant::for_each_group(g, 0, 2, [&](int64_t r, int64_t i, int64_t c0, int64_t c1) {
    seen.insert(seen.end(), {r, i, c0, c1});
  });
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 0, 0, 4, 0, 1, 4, 8, 0, 2, 8, 10,
                                        1, 0, 0, 4, 1, 1, 4, 8, 1, 2, 8, 10}));
  const auto row = loom::quant::Groups::of(3, 7, 0);
  EXPECT_EQ(row.group, 7);
  EXPECT_EQ(row.groups_per_row, 1);
  EXPECT_TRUE(row.whole());
}

}  // namespace
