// Safetensors files and `loom quantize`: the strict reader (every defect refused with a
// message naming the file, tensor and problem), the writer, the [[quantize]] rules at
// `loom check`, and `loom quantize` end to end with the tensor-file C API reading the result
// back, and the checksums that guard both ends (an input's, the output's own) and the scale
// checks at open. The quantizer is the quant8 test plugin (INT8 per row or per group).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <loom/checksum.h>
#include <loom/embed.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "loom_test.hpp"
#include "safetensors/safetensors.hpp"
#include "status.hpp"

namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;
namespace st = loom::host::safetensors;

// A safetensors file from its header text and data bytes.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

std::string floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);  // NOLINT
}

std::string hex16(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

// docs/quantization.md's "loom.checksum", written out here apart from the reader: FNV-1a 64
// of the whole file with the 16 digits after "loom.checksum":"fnv1a64: read as '0'. Returns
// the file with those digits set.
constexpr const char* kChecksumText = R"("loom.checksum":"fnv1a64:)";
std::string sealed(std::string b) {
  const auto at = b.find(kChecksumText);
  EXPECT_NE(at, std::string::npos);
  if (at == std::string::npos) return b;
  const size_t d = at + std::string(kChecksumText).size();
  b.replace(d, 16, std::string(16, '0'));
  b.replace(d, 16, hex16(loom_fnv1a64(b.data(), b.size(), LOOM_FNV1A64_OFFSET)));
  return b;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// Replaces the one occurrence of `from` in `b` by `to`.
std::string replaced(std::string b, const std::string& from, const std::string& to) {
  const auto at = b.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(b.find(from, at + 1), std::string::npos) << from;
  if (at != std::string::npos) b.replace(at, from.size(), to);
  return b;
}

// A model checkpoint as loom train writes it (trainer/train/checkpoint.cpp): F32
// tensors in the order given, __metadata__ last with "fnv1a64", the FNV-1a 64 of the data
// area, and the header padded with spaces to a multiple of 8.
struct F32Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};
std::string trainer_checkpoint(const std::vector<F32Tensor>& tensors) {
  nlohmann::ordered_json h;
  std::string data;
  for (const auto& t : tensors) {
    h[t.name] = {{"dtype", "F32"},
                 {"shape", t.shape},
                 {"data_offsets", {data.size(), data.size() + 4 * t.values.size()}}};
    data += floats(t.values);
  }
  h["__metadata__"] = {
      {"format", "pt"},
      {"fnv1a64", hex16(loom_fnv1a64(data.data(), data.size(), LOOM_FNV1A64_OFFSET))}};
  std::string text = h.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  return file_bytes(text, data);
}

class TensorFile : public ::testing::Test {
 protected:
  // Opens a file holding `bytes`; returns the code, the message in error_.
  int32_t open(const std::string& bytes) {
    path_ = dir_.write("model.safetensors", bytes);
    loom_tensor_file* f = nullptr;
    const int32_t rc = loom_tensor_file_open(path_.c_str(), &f);
    error_ = loom_last_error();
    if (rc == LOOM_OK) {
      EXPECT_NE(f, nullptr);
      count_ = loom_tensor_file_count(f);
    } else {
      EXPECT_EQ(f, nullptr);
    }
    loom_tensor_file_close(f);
    return rc;
  }
  // The file is refused as corrupt with a message that names it and says `what`.
  void expect_refused(const std::string& bytes, const std::string& what) {
    EXPECT_EQ(open(bytes), LOOM_ERR_DATA_LOSS) << error_;
    EXPECT_THAT(error_, ::testing::StartsWith(path_.string() + ": "));
    EXPECT_THAT(error_, HasSubstr(what));
  }

  loom_test::TempDir dir_;
  fs::path path_;
  std::string error_;
  size_t count_ = 0;
};

TEST_F(TensorFile, ReadsAValidFileWithItsDataAndMetadata) {
  const std::string h =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]},)"
      R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("e":{"dtype":"I64","shape":[0],"data_offsets":[28,28]}})";
  const std::string data = floats({1, 2, 3, 4, 5, 6}) + std::string("\x80\x3f\x00\xc0", 4);
  path_ = dir_.write("ok.safetensors", file_bytes(h, data));
  loom_tensor_file* f = nullptr;
  ASSERT_EQ(loom_tensor_file_open(path_.c_str(), &f), LOOM_OK) << loom_last_error();
  ASSERT_EQ(loom_tensor_file_count(f), 3U);
  // Data order, not header order.
  EXPECT_STREQ(loom_tensor_file_name(f, 0), "a");
  EXPECT_STREQ(loom_tensor_file_name(f, 1), "b");
  EXPECT_EQ(loom_tensor_file_name(f, 3), nullptr);
  EXPECT_STREQ(loom_tensor_file_metadata(f, "format"), "pt");
  EXPECT_EQ(loom_tensor_file_metadata(f, "nope"), nullptr);
  size_t idx = 9;
  ASSERT_EQ(loom_tensor_file_find(f, "b", &idx), LOOM_OK);
  EXPECT_EQ(idx, 1U);
  EXPECT_EQ(loom_tensor_file_find(f, "zz", &idx), LOOM_ERR_NOT_FOUND);
  EXPECT_THAT(loom_last_error(), HasSubstr("no tensor 'zz'"));

  loom_tensor_info info{};
  info.struct_size = LOOM_TENSOR_INFO_SIZE;
  ASSERT_EQ(loom_tensor_file_info(f, 0, &info), LOOM_OK) << loom_last_error();
  EXPECT_EQ(info.quantized, 0);
  EXPECT_EQ(info.tensor.ndim, 2);
  EXPECT_EQ(info.tensor.shape[0], 2);
  EXPECT_EQ(info.tensor.shape[1], 3);
  EXPECT_EQ(info.tensor.dtype.code, kDLFloat);
  EXPECT_EQ(info.tensor.dtype.bits, 32);
  ASSERT_NE(info.tensor.data, nullptr);
  EXPECT_EQ(static_cast<const float*>(info.tensor.data)[5], 6.0f);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(info.tensor.data) % 4, 0U);  // NOLINT
  EXPECT_EQ(info.parameters, nullptr);
  // BF16 converted: 0x3f80 = 1, 0xc000 = -2.
  float b[2] = {0, 0};
  ASSERT_EQ(loom_tensor_file_read_f32(f, 1, b, 2), LOOM_OK) << loom_last_error();
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -2.0f);
  EXPECT_EQ(loom_tensor_file_read_f32(f, 1, b, 1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(loom_tensor_file_read_f32(f, 2, nullptr, 0), LOOM_ERR_INVALID_ARGUMENT);  // I64
  EXPECT_THAT(loom_last_error(), HasSubstr("not a float dtype"));
  info.struct_size = 8;
  EXPECT_EQ(loom_tensor_file_info(f, 0, &info), LOOM_ERR_INVALID_ARGUMENT);
  loom_tensor_file_close(f);
}

// The trainer's checkpoint layout (trainer/train/checkpoint.cpp): F32 tensors in
// order, __metadata__ last with a checksum, the header padded with spaces to 8 bytes.
TEST_F(TensorFile, WriteReadsBackWithItsMetadataAndAWholeFileChecksum) {
  const std::vector<float> w{1.5F, -2.0F, 0.25F, 3.0F, 4.0F, -0.5F};
  const std::vector<float> b{7.0F};
  const int64_t w_shape[] = {2, 3};
  const loom_tensor_out t[] = {
      {LOOM_TENSOR_OUT_SIZE, 2, "w", "F32", w_shape, w.data()},
      {LOOM_TENSOR_OUT_SIZE, 0, "b", "F32", nullptr, b.data()},
  };
  const char* meta[] = {"format", "pt", "step", "12"};
  path_ = dir_.path() / "out.safetensors";
  ASSERT_EQ(loom_tensor_file_write(path_.c_str(), t, 2, meta, 2), LOOM_OK) << loom_last_error();
  loom_tensor_file* f = nullptr;
  ASSERT_EQ(loom_tensor_file_open(path_.c_str(), &f), LOOM_OK) << loom_last_error();
  EXPECT_STREQ(loom_tensor_file_metadata(f, "step"), "12");
  EXPECT_NE(loom_tensor_file_metadata(f, "loom.checksum"), nullptr);
  size_t i = 0;
  ASSERT_EQ(loom_tensor_file_find(f, "w", &i), LOOM_OK);
  std::vector<float> back(6);
  ASSERT_EQ(loom_tensor_file_read_f32(f, i, back.data(), back.size()), LOOM_OK);
  EXPECT_EQ(back, w);
  ASSERT_EQ(loom_tensor_file_find(f, "b", &i), LOOM_OK);
  float one = 0;
  ASSERT_EQ(loom_tensor_file_read_f32(f, i, &one, 1), LOOM_OK);
  EXPECT_EQ(one, 7.0F);
  loom_tensor_file_close(f);
  // One flipped data byte: the whole-file checksum refuses the file on open.
  std::string bytes;
  {
    std::ifstream in(path_, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[bytes.size() - 2] = static_cast<char>(bytes[bytes.size() - 2] ^ 1);
  expect_refused(bytes, "checksum");
}

TEST_F(TensorFile, WriteRefusesABadTensorAndLeavesTheOldFile) {
  path_ = dir_.write("keep.safetensors", "old");
  const float v = 1;
  const int64_t shape[] = {1};
  const loom_tensor_out bad[] = {{LOOM_TENSOR_OUT_SIZE, 1, "v", "F33", shape, &v}};
  EXPECT_EQ(loom_tensor_file_write(path_.c_str(), bad, 1, nullptr, 0), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("'v') has dtype 'F33'"));
  const char* meta[] = {"loom.checksum", "0"};
  const loom_tensor_out ok[] = {{LOOM_TENSOR_OUT_SIZE, 1, "v", "F32", shape, &v}};
  EXPECT_EQ(loom_tensor_file_write(path_.c_str(), ok, 1, meta, 1), LOOM_ERR_INVALID_ARGUMENT);
  std::ifstream in(path_, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "old");
}

TEST_F(TensorFile, ReadsTheTrainersCheckpointLayoutAndVerifiesItsDataChecksum) {
  const std::string good =
      trainer_checkpoint({{"wte.w", {2, 2}, {1, 2, 3, 4}}, {"h.0.ln.g", {2}, {5, 6}}});
  ASSERT_EQ(open(good), LOOM_OK) << error_;
  EXPECT_EQ(count_, 2U);
  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x01;  // a bit of h.0.ln.g's last value
  expect_refused(flipped, "data checksum mismatch: __metadata__ 'fnv1a64' says ");
  std::string malformed = good;
  malformed[malformed.find(R"("fnv1a64":")") + 11] = 'X';
  expect_refused(malformed, "__metadata__ 'fnv1a64' is 'X");
}

TEST_F(TensorFile, RefusesEachDefectNamingIt) {
  const std::string t = R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})";
  const std::string d16 = floats({1, 2, 3, 4});
  expect_refused("abc", "truncated safetensors file: 3 bytes");
  expect_refused(file_bytes("{" + t + "}", d16).substr(0, 20),
                 "the header length is 57 bytes but only 12 bytes follow it");
  expect_refused(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}",
                 "over the 100 MiB limit");
  expect_refused(file_bytes("", ""), "the header is empty");
  expect_refused(file_bytes("[1]", ""), "does not start with '{'");
  expect_refused(file_bytes(R"({"w":{"dtype":"F32",)", ""), "the header is not valid JSON");
  expect_refused(file_bytes("{" + t + "}", d16.substr(0, 8)),
                 "header says tensor w ends at byte 16 but the data area is 8 bytes");
  expect_refused(file_bytes(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "ab"),
                 "tensor 'w' has dtype 'F8_E4M3', which this reader does not know");
  expect_refused(file_bytes(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", d16),
                 "tensor 'w' is F32 [2, 3] (24 bytes) but its data_offsets [0, 16] span 16 bytes");
  expect_refused(file_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                            d16),
                 "tensors 'a' [0, 12) and 'b' [8, 16) overlap in the data area");
  expect_refused(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                            d16),
                 "bytes [4, 8) of the data area belong to no tensor (before 'b')");
  expect_refused(file_bytes("{" + t + "}", d16 + "xx"), "2 bytes at its end belong to no tensor");
  expect_refused(file_bytes("{" + t + "," + t + "}", d16), "the header names 'w' twice");
  expect_refused(
      file_bytes(R"({"w":{"dtype":"F32","dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", d16),
      "the header's entry 'w' has key 'dtype' twice");
  expect_refused(file_bytes(R"({"w":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}})", d16),
                 "tensor 'w': shape must hold non-negative integers, not -2");
  expect_refused(file_bytes(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})", d16),
                 "the end is before the begin");
  expect_refused(file_bytes(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0]}})", d16),
                 "data_offsets must be two non-negative integers");
  expect_refused(file_bytes(R"({"w":{"dtype":"F32","shape":[4]}})", d16),
                 "tensor 'w' has no 'data_offsets'");
  expect_refused(
      file_bytes(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"x":1}})", d16),
      "tensor 'w' has unknown key 'x'");
  expect_refused(file_bytes(R"({"w":[1]})", ""), "tensor 'w' must be an object");
  expect_refused(file_bytes(R"({"__metadata__":{"k":1}})", ""),
                 "__metadata__ values must be strings; 'k' is a number");
  expect_refused(
      file_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})",
                 d16),
      "too large to address");
  expect_refused(
      file_bytes(R"({"w":{"dtype":"F32","shape":[[[[1]]]],"data_offsets":[0,4]}})", "abcd"),
      "nests JSON deeper");
  // A file that does not exist is not corrupt: NOT_FOUND.
  loom_tensor_file* f = nullptr;
  EXPECT_EQ(loom_tensor_file_open((dir_.path() / "missing").c_str(), &f), LOOM_ERR_NOT_FOUND);
  EXPECT_THAT(loom_last_error(), HasSubstr("cannot open"));
}

// A file holding one quantized tensor 'w' (symmetric INT, LSB first, F32 scales) of `shape`,
// with `group_size` in its record, the given code bytes and scales [rows, scale_cols], and a
// valid "loom.checksum" unless `checksum` is false.
std::string quantized_file(const std::vector<int64_t>& shape, uint32_t bits, int64_t group_size,
                           const std::string& codes, const std::vector<float>& scales,
                           int64_t scale_cols, bool checksum = true) {
  const nlohmann::json record = {{"version", 1},
                                 {"scheme", "int"},
                                 {"bits", bits},
                                 {"flags", {"symmetric"}},
                                 {"packing", "lsb_first"},
                                 {"axis", 1},
                                 {"group_size", group_size},
                                 {"shape", shape},
                                 {"dtype", "F32"},
                                 {"scale_dtype", "F32"},
                                 {"plugin", "p"},
                                 {"quantizer", "q"},
                                 {"parameters", nlohmann::json::object()}};
  const auto n = static_cast<int64_t>(codes.size());
  nlohmann::json metadata = {{"loom.quant.w", record.dump()}};
  if (checksum) metadata["loom.checksum"] = "fnv1a64:0000000000000000";
  const nlohmann::json header = {
      {"__metadata__", metadata},
      {"w.qcodes", {{"dtype", "U8"}, {"shape", {n}}, {"data_offsets", {0, n}}}},
      {"w.qscale",
       {{"dtype", "F32"},
        {"shape", {shape[0], scale_cols}},
        {"data_offsets", {n, n + static_cast<int64_t>(scales.size() * 4)}}}}};
  const std::string bytes = file_bytes(header.dump(), codes + floats(scales));
  return checksum ? sealed(bytes) : bytes;
}

TEST_F(TensorFile, AHugeGroupSizeIsOneGroupPerRow) {
  // group_size INT64_MAX: the scale shape is [2, 1], computed without overflow.
  const std::string codes = {1, 2, 3, 4, -1, -2, -3, -4};
  path_ = dir_.write("q.safetensors", quantized_file({2, 4}, 8, std::numeric_limits<int64_t>::max(),
                                                     codes, {0.5f, 2.0f}, 1));
  loom_tensor_file* f = nullptr;
  ASSERT_EQ(loom_tensor_file_open(path_.c_str(), &f), LOOM_OK) << loom_last_error();
  std::vector<float> got(8);
  ASSERT_EQ(loom_tensor_file_read_f32(f, 0, got.data(), got.size()), LOOM_OK) << loom_last_error();
  EXPECT_EQ(got, (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f, -2.0f, -4.0f, -6.0f, -8.0f}));
  loom_tensor_file_close(f);
}

TEST_F(TensorFile, RefusesNonZeroPaddingBitsInTheLastCodeByte) {
  // Three 2-bit codes fill 6 bits of the one byte; its top 2 bits must be 0.
  auto read = [&](char byte) {
    path_ =
        dir_.write("q.safetensors", quantized_file({1, 3}, 2, 3, std::string(1, byte), {1.0f}, 1));
    loom_tensor_file* f = nullptr;
    EXPECT_EQ(loom_tensor_file_open(path_.c_str(), &f), LOOM_OK) << loom_last_error();
    std::vector<float> got(3);
    const int32_t rc = loom_tensor_file_read_f32(f, 0, got.data(), got.size());
    error_ = loom_last_error();
    loom_tensor_file_close(f);
    return rc;
  };
  EXPECT_EQ(read(0x39), LOOM_OK) << error_;  // codes 1, -2, -1
  EXPECT_EQ(read(static_cast<char>(0x79)), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(error_, HasSubstr("'w'"));
  EXPECT_THAT(error_, HasSubstr("unused bits of its last code byte are not 0"));
}

// ---- Checksums and scales, checked at open

// Two rows of three INT8 codes, one scale per row.
const std::string kCodes = {1, 2, 3, -1, -2, -3};
std::string two_rows(const std::vector<float>& scales, bool checksum = true) {
  return quantized_file({2, 3}, 8, 3, kCodes, scales, 1, checksum);
}

TEST_F(TensorFile, ReadsAQuantizedFileWithItsChecksum) {
  ASSERT_EQ(open(two_rows({0.5f, 0.0f})), LOOM_OK) << error_;  // a zero scale is valid
  EXPECT_EQ(count_, 1U);
}

TEST_F(TensorFile, RefusesAQuantizedFileWithoutAChecksum) {
  expect_refused(two_rows({0.5f, 0.25f}, false),
                 "has no checksum (__metadata__ 'loom.checksum'), which every file loom "
                 "quantize writes carries");
  EXPECT_THAT(error_, HasSubstr("re-run loom quantize on the original checkpoint"));
  // The key renamed (same length, so the file is otherwise valid): missing, not ignored.
  expect_refused(replaced(two_rows({0.5f, 0.25f}), "loom.checksum", "loom.checksun"),
                 "has no checksum (__metadata__ 'loom.checksum')");
}

TEST_F(TensorFile, RefusesAFlippedByteAnywhereNamingTheFile) {
  const std::string good = two_rows({0.5f, 0.25f});
  const size_t data = good.size() - 6 - 8;  // codes, then the two F32 scales
  std::string code = good;
  code[data + 1] ^= 0x01;
  expect_refused(code, "checksum mismatch: __metadata__ 'loom.checksum' says fnv1a64:");
  EXPECT_THAT(error_, HasSubstr("the file was changed or damaged after it was written"));
  // A header byte the other checks cannot see: the quantizer's recorded name.
  expect_refused(replaced(good, R"(\"quantizer\":\"q\")", R"(\"quantizer\":\"r\")"),
                 "checksum mismatch");
  // The checksum's own digits.
  std::string digit = good;
  const size_t d = digit.find(kChecksumText) + std::string(kChecksumText).size();
  digit[d] = digit[d] == '0' ? '1' : '0';
  expect_refused(digit, "checksum mismatch");
}

TEST_F(TensorFile, RefusesAnUnknownOrMalformedChecksum) {
  const std::string good = two_rows({0.5f, 0.25f});
  expect_refused(replaced(good, "fnv1a64:", "xxh3_64:"),
                 "__metadata__ 'loom.checksum' uses checksum algorithm 'xxh3_64', which this "
                 "reader does not know (it knows fnv1a64)");
  expect_refused(replaced(good, "fnv1a64:", "fnv1a64-"),
                 "__metadata__ 'loom.checksum' is 'fnv1a64-");
  std::string upper = good;
  const size_t d = upper.find(kChecksumText) + std::string(kChecksumText).size();
  for (size_t i = d; i < d + 16; ++i) upper[i] = static_cast<char>(std::toupper(upper[i]));
  upper[d] = 'F';  // at least one letter
  expect_refused(upper, "fnv1a64 takes 16 lowercase hex digits");
}

TEST_F(TensorFile, RefusesScalesThatAreNotFiniteOrAbsurdNamingTheTensor) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::pair<float, const char*> cases[] = {
      {std::nanf(""), "scale [1, 0] is nan"}, {inf, "scale [1, 0] is inf"},
      {1e30f, "scale [1, 0] is 1e+30"},       {1e38f, "scale [1, 0] is 1e+38"},
      {-0.25f, "scale [1, 0] is -0.25"},
  };
  for (const auto& [bad, what] : cases) {
    // The checksum is valid: only the value is wrong.
    expect_refused(two_rows({0.5f, bad}), std::string("quantized tensor 'w': ") + what);
    EXPECT_THAT(error_, HasSubstr("a scale must be finite, at least 0 and below 1e+30"));
    EXPECT_THAT(error_, ::testing::Not(HasSubstr("x[")));  // never the activations
  }
}

TEST_F(TensorFile, CopiesAMisalignedTensorSoItsDataIsAligned) {
  // A one-byte U8 tensor first puts the F32 one at an odd offset.
  std::string h = R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("f":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}})";
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');
  path_ = dir_.write("odd.safetensors", file_bytes(h, "\x07" + floats({2.5f})));
  loom_tensor_file* f = nullptr;
  ASSERT_EQ(loom_tensor_file_open(path_.c_str(), &f), LOOM_OK) << loom_last_error();
  loom_tensor_info info{};
  info.struct_size = LOOM_TENSOR_INFO_SIZE;
  ASSERT_EQ(loom_tensor_file_info(f, 1, &info), LOOM_OK);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(info.tensor.data) % 4, 0U);  // NOLINT
  EXPECT_EQ(*static_cast<const float*>(info.tensor.data), 2.5f);
  loom_tensor_file_close(f);
}

// The host decodes every scheme by quant_format.h's rules, with no plugin: hand-packed files
// (the fuzzer's seeds) with their values worked out by hand.
std::vector<float> decoded(const std::string& seed, const char* name) {
  const auto path = std::string(LOOM_SAFETENSORS_CORPUS) + "/" + seed;
  loom_tensor_file* f = nullptr;
  EXPECT_EQ(loom_tensor_file_open(path.c_str(), &f), LOOM_OK) << loom_last_error();
  size_t i = 0;
  EXPECT_EQ(loom_tensor_file_find(f, name, &i), LOOM_OK);
  loom_tensor_info info{};
  info.struct_size = LOOM_TENSOR_INFO_SIZE;
  EXPECT_EQ(loom_tensor_file_info(f, i, &info), LOOM_OK);
  size_t n = 1;
  for (int d = 0; d < info.tensor.ndim; ++d) n *= static_cast<size_t>(info.tensor.shape[d]);
  std::vector<float> v(n);
  EXPECT_EQ(loom_tensor_file_read_f32(f, i, v.data(), n), LOOM_OK) << loom_last_error();
  loom_tensor_file_close(f);
  return v;
}

TEST(QuantDecode, TernaryMsbFirstInGroupsOfThree) {
  // [2, 5], codes 1 2 0 1 0 | 2 1 0 2 1, scales [[0.5, 0.25], [1, 2]].
  EXPECT_THAT(
      decoded("ternary_binary.safetensors", "t"),
      ::testing::ElementsAre(0.5f, -0.5f, 0.0f, 0.25f, 0.0f, -1.0f, 1.0f, 0.0f, -2.0f, 2.0f));
}

TEST(QuantDecode, BinaryLsbFirstOneScale) {
  const float a = 0.75f;
  EXPECT_THAT(decoded("ternary_binary.safetensors", "b"),
              ::testing::ElementsAre(-a, a, -a, -a, a, a, -a, a, a));
}

TEST(QuantDecode, Int4WithZeroPointsInGroupsOfFour) {
  // [2, 6], codes 1..12 (low nibble first), scales [[0.1, 0.2], [0.3, 0.4]], zeros [[8, 7], [1,
  // 0]].
  const auto v = decoded("int4_asym.safetensors", "w");
  const float want[12] = {0.1f * -7, 0.1f * -6, 0.1f * -5, 0.1f * -4, 0.2f * -2, 0.2f * -1,
                          0.3f * 6,  0.3f * 7,  0.3f * 8,  0.3f * 9,  0.4f * 11, 0.4f * 12};
  ASSERT_EQ(v.size(), 12U);
  for (size_t i = 0; i < 12; ++i) EXPECT_FLOAT_EQ(v[i], want[i]) << i;
}

TEST(SafetensorsWriter, WritesAlignedDataAndReadsBack) {
  loom_test::TempDir dir;
  const auto path = (dir.path() / "w.safetensors").string();
  const uint8_t bytes[3] = {1, 2, 3};
  const float f[2] = {1.5f, -2.0f};
  const double g[1] = {3.25};
  st::write_file(path,
                 {{"u", st::Dtype::U8, {3}, bytes},
                  {"f", st::Dtype::F32, {2}, f},
                  {"g", st::Dtype::F64, {1, 1}, g}},
                 {{"k", "v"}});
  const st::MappedFile m(path);
  ASSERT_EQ(m.header().tensors.size(), 3U);
  EXPECT_EQ(m.header().data_offset % 8, 0U);
  // Largest elements first: g, f, u.
  EXPECT_EQ(m.header().tensors[0].name, "g");
  EXPECT_EQ(m.header().tensors[1].name, "f");
  EXPECT_EQ(m.header().tensors[2].name, "u");
  EXPECT_EQ(m.header().metadata.at("k"), "v");
  EXPECT_EQ(std::memcmp(m.data(*m.header().find("f")), f, 8), 0);
  EXPECT_EQ(m.data(*m.header().find("u"))[2], 3);
  // Only the file itself is left: the temporary was renamed.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

// Every one-bit change to a file loom quantize writes (length, header, padding, data, the
// checksum's key and digits) is refused at open: the checksum no longer matches, or, where
// the flip hit the key's name, a quantized file has none.
TEST(SafetensorsWriter, ItsChecksumCoversEveryByte) {
  loom_test::TempDir dir;
  const auto path = (dir.path() / "w.safetensors").string();
  const uint8_t bytes[3] = {1, 2, 3};
  const float f[2] = {1.5f, -2.0f};
  st::write_file(path, {{"u", st::Dtype::U8, {3}, bytes}, {"f", st::Dtype::F32, {2}, f}},
                 {{"loom.quantize", "test"}});
  const std::string good = slurp(path);
  EXPECT_EQ(sealed(good), good);  // the documented definition
  EXPECT_EQ(good.find(kChecksumText), 8U + std::string(R"({"__metadata__":{)").size());
  EXPECT_TRUE(st::MappedFile(path).checksums().file);
  const auto bad = dir.path() / "bad.safetensors";
  for (size_t i = 0; i < good.size(); ++i) {
    for (const int bit : {0, 5}) {
      std::string b = good;
      b[i] = static_cast<char>(b[i] ^ (1 << bit));
      dir.write("bad.safetensors", b);
      loom_tensor_file* t = nullptr;
      EXPECT_EQ(loom_tensor_file_open(bad.c_str(), &t), LOOM_ERR_DATA_LOSS)
          << "byte " << i << " bit " << bit;
      EXPECT_THAT(loom_last_error(), ::testing::StartsWith(bad.string() + ": "));
      loom_tensor_file_close(t);
    }
  }
}

TEST(SafetensorsWriter, TheChecksumKeyIsTheWritersOwn) {
  loom_test::TempDir dir;
  const float v[1] = {1};
  EXPECT_THROW(
      st::write_file((dir.path() / "c.safetensors").string(), {{"v", st::Dtype::F32, {1}, v}},
                     {{"loom.checksum", "fnv1a64:0123456789abcdef"}}),
      loom::host::Error);
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(SafetensorsWriter, TheFileModeFollowsTheUmask) {
  loom_test::TempDir dir;
  const float v[2] = {1, 2};
  for (const mode_t mask : {mode_t{077}, mode_t{022}}) {
    const mode_t old = ::umask(mask);
    const auto path = (dir.path() / "m.safetensors").string();
    st::write_file(path, {{"v", st::Dtype::F32, {2}, v}}, {});
    ::umask(old);
    struct stat sb {};
    ASSERT_EQ(::stat(path.c_str(), &sb), 0);
    EXPECT_EQ(sb.st_mode & 0777, 0666 & ~mask) << std::oct << mask;
  }
}

TEST(SafetensorsWriter, LeavesNothingBehindWithoutCommit) {
  loom_test::TempDir dir;
  const auto path = (dir.path() / "w.safetensors").string();
  {
    st::Writer w(path, {{"x", st::Dtype::F32, {1}, nullptr}}, {});
    EXPECT_THROW(w.commit(), loom::host::Error);  // x was never written
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir.path()));
  EXPECT_THROW(
      st::write_file(path, {{"a", st::Dtype::U8, {1}, "a"}, {"a", st::Dtype::U8, {1}, "b"}}, {}),
      loom::host::Error);
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

// ---- [[quantize]] rules at `loom check`

class QuantizeRules : public loom_test::ManifestTest {};

constexpr const char* kInstances = R"([quantizer.w8]
plugin = "quant8"
)";

TEST_F(QuantizeRules, AValidRuleListChecks) {
  EXPECT_EQ(check(std::string(kInstances) + R"(
[[quantize]]
tensors = ["wte.*"]
copy = true

[[quantize]]
tensors = ["h.*.mlp.*.w", "h.?.attn.*"]
quantizer = "w8"
)"),
            LOOM_OK)
      << error_;
}

TEST_F(QuantizeRules, EachMistakeIsReportedAtItsPlace) {
  EXPECT_NE(check(std::string(kInstances) + R"(
[[quantize]]
tensors = ["h.*"]
quantizer = "w4"

[[quantize]]
quantizer = "w8"

[[quantize]]
tensors = []
quantizer = "w8"
mode = 1

[[quantize]]
tensors = ["x", 3]
copy = true
quantizer = "w8"
)"),
            LOOM_OK);
  const auto l = loom_test::lines(error_);
  ASSERT_EQ(l.size(), 6U) << error_;
  EXPECT_EQ(
      l[0],
      at(6, 13) +
          "[[quantize]] rule 1: quantizer 'w4' is not declared (did you mean 'w8'?); declared: w8");
  EXPECT_THAT(l[1], ::testing::StartsWith(at(8, 1) + "[[quantize]] rule 2 is missing 'tensors'"));
  EXPECT_THAT(l[2], ::testing::StartsWith(
                        at(12, 11) + "[[quantize]] rule 3: tensors must be a non-empty array"));
  EXPECT_THAT(l[3], ::testing::StartsWith(at(14, 1) + "unknown key 'mode' in [[quantize]] rule 3"));
  EXPECT_THAT(
      l[4], ::testing::StartsWith(at(17, 17) + "[[quantize]] rule 4: each tensors entry must be"));
  EXPECT_EQ(
      l[5],
      at(19, 13) +
          "[[quantize]] rule 4 has both quantizer and copy = true: a rule does one or the other");
}

TEST_F(QuantizeRules, QuantizeMustBeAnArrayOfTables) {
  EXPECT_NE(check("[quantize]\ntensors = [\"x\"]\n"), LOOM_OK);
  EXPECT_THAT(error_, ::testing::StartsWith(at(1, 2) + "'quantize' must be an array of tables"));
}

// ---- `loom quantize` end to end

struct Result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

class QuantizeCli : public ::testing::Test {
 protected:
  Result loom(const std::string& args) {
    const auto err_file = dir_.path() / "stderr.txt";
    const std::string cmd = quote(LOOM_CLI_PATH) + " " + args + " --plugin-path " +
                            quote(loom_test::plugin_dir().string()) + " 2>" +
                            quote(err_file.string());
    Result r;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    if (pipe == nullptr) return r;
    std::array<char, 4096> buf{};
    size_t n = 0;
    while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
    const int status = ::pclose(pipe);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream in(err_file);
    std::ostringstream os;
    os << in.rdbuf();
    r.err = os.str();
    return r;
  }
  std::string p(const std::string& name) const { return quote((dir_.path() / name).string()); }

  // A small model: two 2-D weights (one with rows of 40 = 2 groups of 16 and 8), a bias,
  // an embedding and an int tensor.
  void write_model() {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto randn = [&](size_t n) {
      std::vector<float> v(n);
      for (auto& x : v) x = normal(rng);
      return v;
    };
    fc_ = randn(6 * 40);
    proj_ = randn(4 * 6);
    wte_ = randn(5 * 4);
    const std::vector<float> bias(6, 0.25f);
    const int64_t ids[2] = {3, 4};
    st::write_file((dir_.path() / "in.safetensors").string(),
                   {{"h.0.mlp.fc.w", st::Dtype::F32, {6, 40}, fc_.data()},
                    {"h.0.mlp.fc.b", st::Dtype::F32, {6}, bias.data()},
                    {"h.0.attn.proj.w", st::Dtype::F32, {4, 6}, proj_.data()},
                    {"wte.w", st::Dtype::F32, {5, 4}, wte_.data()},
                    {"ids", st::Dtype::I64, {2}, ids}},
                   {{"format", "pt"}});
  }
  // `loom quantize q.toml in.safetensors out.safetensors` with one rule: every tensor to w8.
  Result quantize_all() {
    dir_.write("q.toml",
               std::string(kInstances) + "[[quantize]]\ntensors = [\"*\"]\nquantizer = \"w8\"\n");
    return loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  }

  loom_test::TempDir dir_;
  std::vector<float> fc_, proj_, wte_;
};

constexpr const char* kManifest = R"([quantizer.g16]
plugin = "quant8"
group_size = 16

[quantizer.asym]
plugin = "quant8"
symmetric = false

[[quantize]]
tensors = ["wte.*"]
copy = true

[[quantize]]
tensors = ["h.*.mlp.*"]
quantizer = "g16"

[[quantize]]
tensors = ["h.*.attn.*.w"]
quantizer = "asym"

[[quantize]]
tensors = ["lm_head.*"]
quantizer = "g16"
)";

TEST_F(QuantizeCli, QuantizesReportsAndTheCApiReadsItBack) {
  write_model();
  dir_.write("q.toml", kManifest);
  const auto r =
      loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // The rule that matched nothing is a warning at its place.
  EXPECT_THAT(r.err, HasSubstr((dir_.path() / "q.toml").string() +
                               ":21:1: warning: [[quantize]] rule 4 matches no tensor"));
  const auto lines = loom_test::lines(r.out);
  ASSERT_EQ(lines.size(), 7U) << r.out;
  // In the input's data order (its writer put the 8-byte I64 first). fc.w: 240 codes + 6 x 3
  // scales; proj.w: 24 codes + 4 scales + 4 zero points.
  EXPECT_EQ(lines[1], "[1/5] ids: copied, 16 B (no rule matches)");
  EXPECT_THAT(lines[2],
              ::testing::MatchesRegex(R"(\[2/5\] h\.0\.mlp\.fc\.w: g16, 960 B -> 312 B )"
                                      R"(\(3\.08x\), mse [0-9.e-]+, max abs error [0-9.e-]+)"));
  EXPECT_EQ(lines[3],
            "[3/5] h.0.mlp.fc.b: copied, 24 B (1-D: only 2-D [N, K] weights are quantized)");
  EXPECT_THAT(lines[4], HasSubstr("[4/5] h.0.attn.proj.w: asym, 96 B -> 44 B"));
  EXPECT_EQ(lines[5], "[5/5] wte.w: copied, 80 B (copy = true)");
  EXPECT_THAT(lines[6], HasSubstr("5 tensors, 2 quantized;"));

  // The reported max abs errors, to compare with what the C API decodes.
  auto reported = [&](const std::string& line) {
    const auto at = line.find("max abs error ");
    return std::stod(line.substr(at + 14));
  };
  const double fc_max = reported(lines[2]);
  const double proj_max = reported(lines[4]);
  EXPECT_GT(fc_max, 0.0);
  EXPECT_LT(fc_max, 0.05);  // INT8 of unit normals: at most half a step of max|x| / 127

  loom_tensor_file* f = nullptr;
  const auto out = (dir_.path() / "out.safetensors").string();
  ASSERT_EQ(loom_tensor_file_open(out.c_str(), &f), LOOM_OK) << loom_last_error();
  ASSERT_EQ(loom_tensor_file_count(f), 5U);
  EXPECT_STREQ(loom_tensor_file_metadata(f, "format"), "pt");
  // The input's checksum covered the old bytes: the output has its own, of its bytes.
  const char* sum = loom_tensor_file_metadata(f, "loom.checksum");
  ASSERT_NE(sum, nullptr);
  EXPECT_NE(std::string(sum), st::MappedFile((dir_.path() / "in.safetensors").string())
                                  .header()
                                  .metadata.at("loom.checksum"));
  EXPECT_EQ(sealed(slurp(out)), slurp(out));
  EXPECT_EQ(loom_tensor_file_metadata(f, "fnv1a64"), nullptr);
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("note:")));  // the input had a checksum
  size_t idx = 0;
  ASSERT_EQ(loom_tensor_file_find(f, "h.0.mlp.fc.w", &idx), LOOM_OK);
  loom_tensor_info info{};
  info.struct_size = LOOM_TENSOR_INFO_SIZE;
  ASSERT_EQ(loom_tensor_file_info(f, idx, &info), LOOM_OK) << loom_last_error();
  EXPECT_EQ(info.quantized, 1);
  EXPECT_EQ(info.tensor.data, nullptr);
  EXPECT_EQ(info.tensor.shape[0], 6);
  EXPECT_EQ(info.tensor.shape[1], 40);
  EXPECT_EQ(info.format.scheme, LOOM_QUANT_INT);
  EXPECT_EQ(info.format.bits, 8U);
  EXPECT_EQ(info.format.flags, LOOM_QUANT_SYMMETRIC);
  EXPECT_EQ(info.format.group_size, 16);
  EXPECT_EQ(info.format.axis, 1);
  EXPECT_EQ(info.codes.shape[0], 240);
  EXPECT_EQ(info.scales.ndim, 2);
  EXPECT_EQ(info.scales.shape[0], 6);
  EXPECT_EQ(info.scales.shape[1], 3);  // ceil(40 / 16)
  EXPECT_EQ(info.zero_points.data, nullptr);
  EXPECT_STREQ(info.plugin, "quant8");
  EXPECT_STREQ(info.quantizer, "g16");
  EXPECT_EQ(nlohmann::json::parse(info.parameters)["group_size"], 16);
  // The scale of row 0's first group is max|x| / 127 over its 16 elements.
  float amax = 0;
  for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(fc_[static_cast<size_t>(j)]));
  EXPECT_FLOAT_EQ(static_cast<const float*>(info.scales.data)[0], amax / 127.0f);

  // Decoded by the host with no plugin: within the reported error, and that error is hit.
  auto check_decoded = [&](const char* name, const std::vector<float>& want, double max_err) {
    size_t i = 0;
    ASSERT_EQ(loom_tensor_file_find(f, name, &i), LOOM_OK);
    std::vector<float> got(want.size());
    ASSERT_EQ(loom_tensor_file_read_f32(f, i, got.data(), got.size()), LOOM_OK)
        << loom_last_error();
    double worst = 0;
    for (size_t k = 0; k < want.size(); ++k)
      worst = std::max(worst, std::fabs(double(got[k]) - want[k]));
    EXPECT_LE(worst, max_err * (1 + 1e-3) + 1e-7) << name;
    EXPECT_GE(worst, max_err * (1 - 1e-2)) << name;
  };
  check_decoded("h.0.mlp.fc.w", fc_, fc_max);
  check_decoded("h.0.attn.proj.w", proj_, proj_max);
  check_decoded("wte.w", wte_, 0.0);

  ASSERT_EQ(loom_tensor_file_find(f, "h.0.attn.proj.w", &idx), LOOM_OK);
  ASSERT_EQ(loom_tensor_file_info(f, idx, &info), LOOM_OK);
  EXPECT_EQ(info.format.flags, 0U);
  EXPECT_EQ(info.format.group_size, 6);
  ASSERT_NE(info.zero_points.data, nullptr);
  EXPECT_EQ(info.zero_points.dtype.code, kDLUInt);
  EXPECT_EQ(info.zero_points.shape[0], 4);
  loom_tensor_file_close(f);

  // The raw entries and the record as the format documents them.
  const st::MappedFile raw(out);
  EXPECT_NE(raw.header().find("h.0.mlp.fc.w.qcodes"), nullptr);
  EXPECT_NE(raw.header().find("h.0.attn.proj.w.qzero"), nullptr);
  EXPECT_EQ(raw.header().find("h.0.mlp.fc.w"), nullptr);
  const auto rec = nlohmann::json::parse(raw.header().metadata.at("loom.quant.h.0.mlp.fc.w"));
  EXPECT_EQ(rec["scheme"], "int");
  EXPECT_EQ(rec["packing"], "lsb_first");
  EXPECT_EQ(rec["shape"], nlohmann::json({6, 40}));
  EXPECT_EQ(rec["dtype"], "F32");
  EXPECT_EQ(rec["plugin"], "quant8");
}

TEST_F(QuantizeCli, AFailureLeavesNoOutputBehind) {
  std::vector<float> w(4 * 8, 1.0f);
  w[13] = std::nanf("");
  st::write_file((dir_.path() / "in.safetensors").string(),
                 {{"w", st::Dtype::F32, {4, 8}, w.data()}}, {});
  dir_.write("q.toml",
             std::string(kInstances) + "[[quantize]]\ntensors = [\"*\"]\nquantizer = \"w8\"\n");
  dir_.write("out.safetensors", "old");
  const auto r =
      loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("tensor 'w': quantizer.w8"));
  EXPECT_THAT(r.err, HasSubstr("element (1, 5) is not finite"));
  std::ifstream old((dir_.path() / "out.safetensors").string());
  std::string text;
  old >> text;
  EXPECT_EQ(text, "old");  // untouched
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_.path()))
    files += e.path().filename() != "stderr.txt";
  EXPECT_EQ(files, 3U);  // in, q.toml, out: no temporary left
}

TEST_F(QuantizeCli, CopiesAnEmptyMatchedTensorUnchanged) {
  const std::vector<float> w(4 * 8, 0.5f);
  st::write_file((dir_.path() / "in.safetensors").string(),
                 {{"w", st::Dtype::F32, {4, 8}, w.data()}, {"e", st::Dtype::F32, {0, 8}, w.data()}},
                 {});
  dir_.write("q.toml",
             std::string(kInstances) + "[[quantize]]\ntensors = [\"*\"]\nquantizer = \"w8\"\n");
  const auto r =
      loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("e: copied, 0 B (empty: copied unchanged)"));
  const st::MappedFile raw((dir_.path() / "out.safetensors").string());
  const auto* e = raw.header().find("e");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{0, 8}));
  EXPECT_NE(raw.header().find("w.qcodes"), nullptr);
}

TEST_F(QuantizeCli, RefusesAnF64ValueBeyondFloat32Range) {
  std::vector<double> w(2 * 3, 1.0);
  w[4] = 1e300;
  st::write_file((dir_.path() / "in.safetensors").string(),
                 {{"w", st::Dtype::F64, {2, 3}, w.data()}}, {});
  dir_.write("q.toml",
             std::string(kInstances) + "[[quantize]]\ntensors = [\"*\"]\nquantizer = \"w8\"\n");
  const auto r =
      loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr("tensor 'w': element (1, 1) = 1"));
  EXPECT_THAT(r.err, HasSubstr("e+300 is out of float32 range"));
  EXPECT_FALSE(fs::exists(dir_.path() / "out.safetensors"));
}

TEST_F(QuantizeCli, MissingArgumentsAreAUsageError) {
  const auto r = loom("quantize " + p("q.toml"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr("loom quantize: "));
  EXPECT_THAT(r.err, HasSubstr("IN is required"));
}

TEST_F(QuantizeCli, RefusesABadInputOrManifest) {
  dir_.write("q.toml",
             std::string(kInstances) + "[[quantize]]\ntensors = [\"*\"]\nquantizer = \"w9\"\n");
  auto r = loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("q.toml:5:13: [[quantize]] rule 1: quantizer 'w9' is not declared"));
  dir_.write("q.toml",
             std::string(kInstances) + "[[quantize]]\ntensors = [\"*\"]\nquantizer = \"w8\"\n");
  dir_.write("in.safetensors",
             file_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234"));
  r = loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("header says tensor w ends at byte 8 but the data area is 4 bytes"));
  EXPECT_FALSE(fs::exists(dir_.path() / "out.safetensors"));
  dir_.write("m.toml", kInstances);
  r = loom("quantize " + p("m.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("the manifest has no [[quantize]] rules"));
}

// ---- Integrity at both ends of `loom quantize`

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.1f * static_cast<float>(i) - 1.0f;
  return v;
}

TEST_F(QuantizeCli, RefusesACheckpointWithAFlippedDataByteNamingIt) {
  const std::string good = trainer_checkpoint(
      {{"h.0.mlp.fc.w", {4, 8}, ramp(32)}, {"h.0.ln.g", {8}, std::vector<float>(8, 1.0f)}});
  dir_.write("in.safetensors", good);
  auto r = quantize_all();
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, ::testing::Not(HasSubstr("note:")));  // verified, nothing to say
  fs::remove(dir_.path() / "out.safetensors");
  std::string flipped = good;
  flipped[flipped.size() - 40] ^= 0x10;  // one bit of the weight
  dir_.write("in.safetensors", flipped);
  r = quantize_all();
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr("loom quantize: " + (dir_.path() / "in.safetensors").string() +
                               ": data checksum mismatch: __metadata__ 'fnv1a64' says "));
  EXPECT_FALSE(fs::exists(dir_.path() / "out.safetensors"));
}

TEST_F(QuantizeCli, RefusesAnInputWhoseLoomChecksumIsWrongOrUnknown) {
  const auto w = ramp(32);
  st::write_file((dir_.path() / "in.safetensors").string(),
                 {{"w", st::Dtype::F32, {4, 8}, w.data()}}, {});
  const std::string good = slurp(dir_.path() / "in.safetensors");
  std::string flipped = good;
  flipped[flipped.size() - 1] ^= 0x01;
  dir_.write("in.safetensors", flipped);
  auto r = quantize_all();
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr((dir_.path() / "in.safetensors").string() +
                               ": checksum mismatch: __metadata__ 'loom.checksum'"));
  dir_.write("in.safetensors", replaced(good, "fnv1a64:", "sha-256:"));
  r = quantize_all();
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr((dir_.path() / "in.safetensors").string() +
                               ": __metadata__ 'loom.checksum' uses checksum algorithm 'sha-256', "
                               "which this reader does not know"));
  EXPECT_FALSE(fs::exists(dir_.path() / "out.safetensors"));
}

TEST_F(QuantizeCli, QuantizesAThirdPartyFileWithoutAChecksumWithANote) {
  dir_.write("in.safetensors",
             file_bytes(R"({"w":{"dtype":"F32","shape":[4,8],"data_offsets":[0,128]}})",
                        floats(ramp(32))));
  const auto r = quantize_all();
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr((dir_.path() / "in.safetensors").string() +
                               ": note: no checksum in its __metadata__"));
  const std::string out = slurp(dir_.path() / "out.safetensors");
  EXPECT_EQ(sealed(out), out);  // the output has one all the same
}

TEST_F(QuantizeCli, RefusesToWriteAScaleTheReaderWouldRefuse) {
  auto w = ramp(32);
  w[13] = 1e33f;  // finite, but its row's scale, 1e33 / 127, is past the limit
  st::write_file((dir_.path() / "in.safetensors").string(),
                 {{"w", st::Dtype::F32, {4, 8}, w.data()}}, {});
  const auto r = quantize_all();
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.err, HasSubstr("tensor 'w': quantizer.w8"));
  EXPECT_THAT(r.err, HasSubstr(": scale [1, 0] is 7.87402e+30: a scale must be finite"));
  EXPECT_THAT(r.err, HasSubstr("the reader refuses such a file, so nothing is written"));
  EXPECT_FALSE(fs::exists(dir_.path() / "out.safetensors"));
}

// The output's own checksum and scales, read back through the C API: a flipped code byte,
// and a NaN or absurd scale with the checksum recomputed (what a broken writer would leave),
// are the file's fault, named at open.
TEST_F(QuantizeCli, AFlippedCodeByteOrABadScaleInTheOutputIsRefusedAtOpen) {
  const auto w = ramp(32);
  st::write_file((dir_.path() / "in.safetensors").string(),
                 {{"w", st::Dtype::F32, {4, 8}, w.data()}}, {});
  ASSERT_EQ(quantize_all().exit_code, 0);
  const auto out = dir_.path() / "out.safetensors";
  const std::string good = slurp(out);
  uint64_t codes = 0, scales = 0;
  {
    const st::MappedFile raw(out.string());
    codes = raw.header().data_offset + raw.header().find("w.qcodes")->begin;
    scales = raw.header().data_offset + raw.header().find("w.qscale")->begin;
    EXPECT_EQ(raw.header().find("w.qscale")->shape, (std::vector<int64_t>{4, 1}));
  }
  auto open_error = [&](const std::string& bytes) {
    dir_.write("out.safetensors", bytes);
    loom_tensor_file* f = nullptr;
    const int32_t rc = loom_tensor_file_open(out.c_str(), &f);
    loom_tensor_file_close(f);
    EXPECT_EQ(rc, LOOM_ERR_DATA_LOSS);
    const std::string e = loom_last_error();
    EXPECT_THAT(e, ::testing::StartsWith(out.string() + ": "));
    return e;
  };
  std::string code = good;
  code[codes + 5] ^= 0x04;
  EXPECT_THAT(open_error(code), HasSubstr("checksum mismatch"));
  for (const float bad : {std::nanf(""), 1e30f}) {
    std::string scale = good;
    std::memcpy(scale.data() + scales + 2 * sizeof(float), &bad, sizeof bad);
    const std::string e = open_error(sealed(scale));
    EXPECT_THAT(e, HasSubstr(": quantized tensor 'w': scale [2, 0] is "));
    EXPECT_THAT(e, HasSubstr(std::isnan(bad) ? "is nan" : "is 1e+30"));
  }
}

#ifdef LOOM_HAVE_QUANT_PLUGINS
// The bundled plugins: zeroquant INT4 in groups of 16 and xtc ternary per row, decoded by the
// host to exactly the error the run reported (the host's decoder and the plugins' dequantize
// agree).
TEST_F(QuantizeCli, QuantizesWithZeroquantAndXtc) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> a(8 * 64), b(8 * 64);
  for (auto& x : a) x = normal(rng);
  for (auto& x : b) x = normal(rng);
  st::write_file((dir_.path() / "in.safetensors").string(),
                 {{"h.0.mlp.fc.w", st::Dtype::F32, {8, 64}, a.data()},
                  {"h.0.mlp.proj.w", st::Dtype::F32, {8, 64}, b.data()}},
                 {});
  dir_.write("q.toml", R"([quantizer.w4]
plugin = "zeroquant"
bits = 4
group_size = 16

[quantizer.tern]
plugin = "xtc"

[[quantize]]
tensors = ["*.fc.w"]
quantizer = "w4"

[[quantize]]
tensors = ["*.proj.w"]
quantizer = "tern"
)");
  const auto r =
      loom("quantize " + p("q.toml") + " " + p("in.safetensors") + " " + p("out.safetensors"));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const auto lines = loom_test::lines(r.out);
  ASSERT_EQ(lines.size(), 4U) << r.out;
  // 4-bit codes: 256 bytes + 8 x 4 scales; 2-bit: 128 bytes + 8 scales.
  EXPECT_THAT(lines[1], HasSubstr("h.0.mlp.fc.w: w4, 2048 B -> 384 B"));
  EXPECT_THAT(lines[2], HasSubstr("h.0.mlp.proj.w: tern, 2048 B -> 160 B"));
  loom_tensor_file* f = nullptr;
  ASSERT_EQ(loom_tensor_file_open((dir_.path() / "out.safetensors").c_str(), &f), LOOM_OK)
      << loom_last_error();
  const std::vector<float>* want[2] = {&a, &b};
  for (size_t t = 0; t < 2; ++t) {
    loom_tensor_info info{};
    info.struct_size = LOOM_TENSOR_INFO_SIZE;
    ASSERT_EQ(loom_tensor_file_info(f, t, &info), LOOM_OK);
    EXPECT_EQ(info.format.scheme, t == 0 ? LOOM_QUANT_INT : LOOM_QUANT_TERNARY);
    EXPECT_EQ(info.format.bits, t == 0 ? 4U : 2U);
    EXPECT_STREQ(info.plugin, t == 0 ? "zeroquant" : "xtc");
    std::vector<float> got(want[t]->size());
    ASSERT_EQ(loom_tensor_file_read_f32(f, t, got.data(), got.size()), LOOM_OK);
    double worst = 0;
    for (size_t k = 0; k < got.size(); ++k) {
      worst = std::max(worst, std::fabs(double(got[k]) - (*want[t])[k]));
    }
    const auto at = lines[1 + t].find("max abs error ");
    const double reported = std::stod(lines[1 + t].substr(at + 14));
    EXPECT_NEAR(worst, reported, reported * 1e-2) << lines[1 + t];
  }
  loom_tensor_file_close(f);
}
#endif

}  // namespace
