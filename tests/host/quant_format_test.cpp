// loom/sdk/quant_format.hpp: a loom_quant_format checked on its own and against the uint8
// tensor of packed codes it describes (packed byte count, group count), with the field each
// refusal names.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <loom/sdk/quant_format.hpp>
#include <string>
#include <vector>

namespace {

using ::testing::HasSubstr;

class QuantFormat : public ::testing::Test {
 protected:
  void SetUp() override {
    f_.struct_size = LOOM_QUANT_FORMAT_SIZE;
    f_.scheme = LOOM_QUANT_INT;
    f_.bits = 4;
    f_.flags = LOOM_QUANT_SYMMETRIC;
    f_.packing = LOOM_QUANT_PACK_LSB_FIRST;
    f_.axis = 1;
    f_.group_size = 128;
    f_.ndim = 2;
    f_.shape = shape_;
    f_.scale_dtype = {kDLFloat, 16, 1};
  }

  // A uint8 tensor of `bytes` bytes.
  DLTensor bytes_tensor(int64_t bytes, DLDataType dtype = {kDLUInt, 8, 1}) {
    bytes_shape_ = bytes;
    storage_.assign(static_cast<size_t>(bytes > 0 ? bytes : 1), 0);
    DLTensor t{};
    t.data = storage_.data();
    t.device = {kDLCPU, 0};
    t.ndim = 1;
    t.dtype = dtype;
    t.shape = &bytes_shape_;
    return t;
  }

  std::string refusal() {
    try {
      loom::sdk::check_quant_format(&f_, "w");
    } catch (const loom::sdk::Error& e) {
      EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT);
      return e.what();
    }
    return "";
  }

  int64_t shape_[2] = {3, 300};
  int64_t bytes_shape_ = 0;
  std::vector<uint8_t> storage_;
  loom_quant_format f_{};
};

TEST_F(QuantFormat, PackedBytesRoundUpTheBitStream) {
  EXPECT_EQ(loom::sdk::packed_bytes(f_), 450U);  // 900 codes * 4 bits
  f_.bits = 3;
  EXPECT_EQ(loom::sdk::packed_bytes(f_), 338U);  // 2700 bits -> 337.5 bytes
  f_.scheme = LOOM_QUANT_BINARY;
  f_.bits = 1;
  shape_[1] = 7;
  EXPECT_EQ(loom::sdk::packed_bytes(f_), 3U);  // 21 bits
  f_.ndim = 0;                                 // a scalar: one code
  EXPECT_EQ(loom::sdk::packed_bytes(f_), 1U);
  shape_[0] = 0;
  f_.ndim = 2;
  EXPECT_EQ(loom::sdk::packed_bytes(f_), 0U);
}

TEST_F(QuantFormat, GroupCountReplacesTheAxisByItsGroups) {
  EXPECT_EQ(loom::sdk::quant_group_count(f_), 3U * 3U);  // ceil(300 / 128) = 3 per row
  f_.group_size = 300;
  EXPECT_EQ(loom::sdk::quant_group_count(f_), 3U);  // one scale per row
  f_.axis = 0;
  f_.group_size = 1;
  EXPECT_EQ(loom::sdk::quant_group_count(f_), 900U);
  f_.group_size = 0;
  EXPECT_EQ(loom::sdk::quant_group_count(f_), 1U);  // per tensor
}

TEST_F(QuantFormat, ExpectPackedAcceptsTheExactByteCount) {
  DLTensor t = bytes_tensor(450);
  const loom_quant_format checked = loom::sdk::expect_packed(t, f_, "w");
  EXPECT_EQ(checked.bits, 4U);
  EXPECT_EQ(checked.struct_size, LOOM_QUANT_FORMAT_SIZE);
}

TEST_F(QuantFormat, ExpectPackedRefusesAnotherByteCountNamingBoth) {
  DLTensor t = bytes_tensor(449);
  try {
    loom::sdk::expect_packed(t, f_, "weight codes");
    FAIL() << "449 bytes accepted";
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.code(), LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_STREQ(e.what(),
                 "weight codes: packed codes hold 449 bytes, but 900 codes of 4 bits take 450");
  }
  DLTensor u = bytes_tensor(451);
  EXPECT_THROW(loom::sdk::expect_packed(u, f_, "w"), loom::sdk::Error);
}

TEST_F(QuantFormat, ExpectPackedRefusesTensorsThatAreNotBytes) {
  DLTensor t = bytes_tensor(450, {kDLInt, 8, 1});
  EXPECT_THROW(
      {
        try {
          loom::sdk::expect_packed(t, f_, "w");
        } catch (const loom::sdk::Error& e) {
          EXPECT_THAT(e.what(), HasSubstr("must be a uint8 tensor"));
          throw;
        }
      },
      loom::sdk::Error);
  DLTensor v = bytes_tensor(450);
  int64_t strides = 2;
  v.strides = &strides;
  EXPECT_THROW(loom::sdk::expect_packed(v, f_, "w"), loom::sdk::Error);
  DLTensor w = bytes_tensor(450);
  int64_t two_d[2] = {1, 450};
  w.ndim = 2;
  w.shape = two_d;
  EXPECT_THROW(loom::sdk::expect_packed(w, f_, "w"), loom::sdk::Error);
}

TEST_F(QuantFormat, DescriptorFieldsAreChecked) {
  EXPECT_EQ(refusal(), "");
  f_.bits = 1;  // symmetric int needs a sign bit and a magnitude
  EXPECT_THAT(refusal(), HasSubstr("symmetric int codes of 1 bits"));
  f_.bits = 9;
  EXPECT_THAT(refusal(), HasSubstr("9 bits"));
  f_.bits = 4;
  f_.flags = 0x10;
  EXPECT_THAT(refusal(), HasSubstr("unknown quant format flags 0x10"));
  f_.flags = LOOM_QUANT_SYMMETRIC;
  f_.scheme = LOOM_QUANT_TERNARY;
  EXPECT_THAT(refusal(), HasSubstr("ternary codes have 2 bits, not 4"));
  f_.bits = 2;
  EXPECT_EQ(refusal(), "");
  f_.scheme = 9;
  EXPECT_THAT(refusal(), HasSubstr("unknown quant scheme 9"));
  f_.scheme = LOOM_QUANT_INT;
  f_.packing = 0;
  EXPECT_THAT(refusal(), HasSubstr("unknown packing order 0"));
  f_.packing = LOOM_QUANT_PACK_MSB_FIRST;
  f_.axis = 2;
  EXPECT_THAT(refusal(), HasSubstr("axis 2 is not a dimension of a 2-d tensor"));
  f_.axis = 1;
  shape_[0] = -1;
  EXPECT_THAT(refusal(), HasSubstr("shape[0] = -1 is negative"));
  shape_[0] = 3;
  f_.scale_dtype = {kDLInt, 8, 1};
  EXPECT_THAT(refusal(), HasSubstr("scale dtype"));
  f_.scale_dtype = {kDLBfloat, 16, 1};
  f_.zero_point_dtype = {kDLUInt, 8, 1};  // symmetric: no zero points
  EXPECT_THAT(refusal(), HasSubstr("symmetric codes have no zero points"));
  f_.struct_size = 8;
  EXPECT_THAT(refusal(), HasSubstr("struct_size 8"));
  EXPECT_THROW(loom::sdk::check_quant_format(nullptr, "w"), loom::sdk::Error);
}

TEST_F(QuantFormat, AsymmetricCodesNeedAZeroPointDtype) {
  f_.flags = 0;
  f_.bits = 1;  // asymmetric 1-bit codes are allowed
  EXPECT_THAT(refusal(), HasSubstr("zero point dtype"));
  f_.zero_point_dtype = {kDLUInt, 8, 1};
  EXPECT_EQ(refusal(), "");
  f_.zero_point_dtype = f_.scale_dtype;  // fractional zero points
  EXPECT_EQ(refusal(), "");
  f_.zero_point_dtype = {kDLFloat, 64, 1};
  EXPECT_THAT(refusal(), HasSubstr("is not uint8, int8 or the scale dtype"));
}

TEST_F(QuantFormat, OverflowingShapesAreRefusedNotWrapped) {
  shape_[0] = INT64_MAX;
  shape_[1] = INT64_MAX;
  try {
    (void)loom::sdk::packed_bytes(f_, "w");
    FAIL() << "overflow not detected";
  } catch (const loom::sdk::Error& e) {
    EXPECT_EQ(e.code(), LOOM_ERR_OUT_OF_RANGE);
  }
}

// The layout the header documents, written out from its definition: 4-bit codes 1, 2, 3 are
// bytes 0x21, 0x03 with LOOM_QUANT_PACK_LSB_FIRST (low nibble first) and 0x12, 0x30 with
// LOOM_QUANT_PACK_MSB_FIRST (high nibble first); 3-bit codes straddle bytes.
std::vector<uint8_t> pack(const std::vector<uint32_t>& codes, uint32_t bits, bool lsb_first) {
  std::vector<uint8_t> out((codes.size() * bits + 7) / 8, 0);
  for (size_t i = 0; i < codes.size(); ++i) {
    for (uint32_t j = 0; j < bits; ++j) {
      const uint32_t code_bit = lsb_first ? j : bits - 1 - j;  // the code's bit at stream i*bits+j
      if (((codes[i] >> code_bit) & 1U) == 0) continue;
      const size_t k = i * bits + j;
      out[k / 8] = static_cast<uint8_t>(out[k / 8] | (1U << (lsb_first ? k % 8 : 7 - k % 8)));
    }
  }
  return out;
}

TEST(QuantPacking, NibbleOrderMatchesTheHeader) {
  EXPECT_EQ(pack({1, 2, 3}, 4, true), (std::vector<uint8_t>{0x21, 0x03}));
  EXPECT_EQ(pack({1, 2, 3}, 4, false), (std::vector<uint8_t>{0x12, 0x30}));
  // 3-bit codes 5, 6, 7: stream 101 011 111 (LSB first) -> byte0 = 0b11110101, byte1 = 0b1.
  EXPECT_EQ(pack({5, 6, 7}, 3, true), (std::vector<uint8_t>{0xF5, 0x01}));
  // MSB first: 101 110 111 -> 0b10111011, 0b10000000.
  EXPECT_EQ(pack({5, 6, 7}, 3, false), (std::vector<uint8_t>{0xBB, 0x80}));
  // And the byte count the SDK computes for them.
  const int64_t shape[] = {3};
  loom_quant_format f{};
  f.struct_size = LOOM_QUANT_FORMAT_SIZE;
  f.scheme = LOOM_QUANT_INT;
  f.bits = 3;
  f.packing = LOOM_QUANT_PACK_LSB_FIRST;
  f.ndim = 1;
  f.shape = shape;
  EXPECT_EQ(loom::sdk::packed_bytes(f), pack({5, 6, 7}, 3, true).size());
}

}  // namespace
