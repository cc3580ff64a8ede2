// The trainer's data layer: BPE and byte tokenizers round-trip text, the dataset file
// round-trips and its reader rejects truncated and corrupted files with a clear error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "corpus.hpp"
#include "dataset.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

fs::path temp_dir() {
  const fs::path d =
      fs::temp_directory_path() / ("loom-trainer-data-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

std::vector<char> read(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write(const fs::path& p, const std::vector<char>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(b.data(), static_cast<std::streamsize>(b.size()));
}

// The message of the DataError that opening `p` throws ("" when it opens).
std::string open_error(const fs::path& p) {
  try {
    Dataset d(p.string());
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(Tokenizer, ByteLevelRoundTripsAnyBytes) {
  Tokenizer t;
  std::string s;
  for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
  const auto ids = t.encode(s);
  ASSERT_EQ(ids.size(), 256u);
  EXPECT_EQ(ids[200], 200);
  EXPECT_EQ(t.decode(ids), s);
}

TEST(Tokenizer, BpeTrainsMergesAndRoundTrips) {
  const std::string corpus = test_corpus::generated_corpus(60000);
  Tokenizer t = Tokenizer::train_bpe({corpus}, 400);
  EXPECT_EQ(t.vocab_size(), 400);
  const auto ids = t.encode(corpus);
  EXPECT_LT(ids.size(), corpus.size() / 2) << "BPE should compress this repetitive text";
  EXPECT_EQ(t.decode(ids), corpus);
  for (uint16_t id : ids) ASSERT_LT(id, 400);
  // Text it never saw, including bytes that are not UTF-8 and whitespace runs.
  std::string other = "Zebras\t\tquietly \xff\xfe jump over 1234 lazy   ducks.\r\n";
  EXPECT_EQ(t.decode(t.encode(other)), other);
  EXPECT_EQ(t.decode(t.encode("")), "");
}

TEST(Tokenizer, SavesAndLoads) {
  const auto dir = temp_dir();
  Tokenizer t = Tokenizer::train_bpe({test_corpus::generated_corpus(20000)}, 300);
  t.save((dir / "tok.json").string());
  Tokenizer u = Tokenizer::load((dir / "tok.json").string());
  EXPECT_EQ(u.merges(), t.merges());
  const std::string s = "The cat sees the river at night.";
  EXPECT_EQ(u.encode(s), t.encode(s));
  // A merge that refers to a token not yet defined is refused.
  write(dir / "bad.json", [] {
    std::string j =
        R"({"format":"loom-tokenizer","version":1,"type":"bpe","vocab_size":257,"merges":[[300,1]]})";
    return std::vector<char>(j.begin(), j.end());
  }());
  try {
    Tokenizer::load((dir / "bad.json").string());
    FAIL() << "expected a DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not yet defined"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer::load((dir / "missing.json").string()), DataError);
}

// A folder where a file belongs is named as such (it opens like a file, then fails to read
// with an error that names no path, or reads as a truncated dataset).
TEST(Tokenizer, AndDatasetRefuseAFolderByName) {
  const auto dir = temp_dir() / "a-folder.bin";
  fs::create_directories(dir);
  try {
    Tokenizer::load(dir.string());
    FAIL() << "expected a DataError";
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()), dir.string() + ": is a folder, not a file");
  }
  EXPECT_EQ(open_error(dir), dir.string() + ": is a folder, not a file");
  // Through a symlink to a folder too.
  const auto link = temp_dir() / "link.bin";
  fs::remove(link);
  fs::create_directory_symlink(dir, link);
  EXPECT_EQ(open_error(link), link.string() + ": is a folder, not a file");
}

// Writes `json` as a tokenizer file and loads it: the DataError's message, "" when it loads.
// Any other exception (nlohmann's type_error, say) escapes and fails the test.
std::string tokenizer_error(const fs::path& p, const std::string& json) {
  write(p, std::vector<char>(json.begin(), json.end()));
  try {
    Tokenizer::load(p.string());
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

// A field of the wrong JSON type is a DataError that names the file and the field (nlohmann's
// accessors would throw a type_error that names neither).
TEST(Tokenizer, LoadNamesTheFileAndTheFieldOfTheWrongType) {
  const fs::path p = temp_dir() / "typed.tokenizer.json";
  const std::string at = p.string() + ": ";
  const std::string merges = R"("merges":[[97,98]])";
  EXPECT_EQ(tokenizer_error(p, R"({"format":[]})"),
            at + R"("format" is a JSON array, expected the string "loom-tokenizer")");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"gpt2","version":1,"vocab_size":256,"merges":[]})"),
            at + R"("format" is "gpt2", expected "loom-tokenizer")");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":"1"})"),
            at + R"("version" is a JSON string, expected an integer)");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":1.5})"),
            at + R"("version" is a JSON number, expected an integer)");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":2})"),
            at + R"("version" is 2; this build reads loom-tokenizer version 1)");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":1,"merges":{}})"),
            at + R"("merges" is a JSON object, expected an array of [a, b] pairs)");
  EXPECT_EQ(tokenizer_error(
                p, R"({"format":"loom-tokenizer","version":1,"vocab_size":"257",)" + merges + "}"),
            at + R"("vocab_size" is a JSON string, expected an integer)");
  EXPECT_EQ(tokenizer_error(
                p, R"({"format":"loom-tokenizer","version":1,"vocab_size":[],)" + merges + "}"),
            at + R"("vocab_size" is a JSON array, expected an integer)");
  EXPECT_EQ(tokenizer_error(
                p, R"({"format":"loom-tokenizer","version":1,"vocab_size":300,)" + merges + "}"),
            at + R"("vocab_size" is 300, but 1 merges make a vocabulary of 257)");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":1,"type":7,)" + merges +
                                   R"(,"vocab_size":257})"),
            at + R"("type" is a JSON number, expected the string "byte" or "bpe")");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":1,"type":"byte",)" + merges +
                                   R"(,"vocab_size":257})"),
            at + R"("type" is "byte", but 1 merges make a "bpe" tokenizer)");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","vocab_size":256,"merges":[]})"),
            at + R"(not a loom-tokenizer file: it has no "version" field)");
  // A merge index past uint32 that would wrap onto a defined token when narrowed to int.
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":1,"vocab_size":257,)"
                               R"("merges":[[4294967393,97]]})"),
            at + "merge 0 refers to a token not yet defined");
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":1,"vocab_size":257,)"
                               R"("merges":[[97,"b"]]})"),
            at + "merge 0 is not a pair of ints");
  // What save() writes still loads.
  EXPECT_EQ(tokenizer_error(p, R"({"format":"loom-tokenizer","version":1,"type":"bpe",)" + merges +
                                   R"(,"vocab_size":257})"),
            "");
}

// Merges that double a piece each time would ask for 2^k bytes after k merges: a piece is at
// most 256 bytes, in a loaded file and in training, so every trained tokenizer loads.
TEST(Tokenizer, PiecesAreAtMost256Bytes) {
  const fs::path p = temp_dir() / "doubling.tokenizer.json";
  const auto doubling = [](int n) {  // merge i joins token 255 + i with itself: 2^(i+1) bytes
    std::string m = "[[97,97]";
    for (int i = 1; i < n; ++i)
      m += ",[" + std::to_string(255 + i) + "," + std::to_string(255 + i) + "]";
    return R"({"format":"loom-tokenizer","version":1,"type":"bpe","vocab_size":)" +
           std::to_string(256 + n) + R"(,"merges":)" + m + "]}";
  };
  EXPECT_EQ(tokenizer_error(p, doubling(8)), "");  // the last piece is 256 bytes
  EXPECT_EQ(tokenizer_error(p, doubling(9)),
            p.string() + ": merge 8 makes a piece of 512 bytes; at most 256 are allowed");
  EXPECT_EQ(tokenizer_error(p, doubling(41)),
            p.string() + ": merge 8 makes a piece of 512 bytes; at most 256 are allowed");
  // Training on long repeated runs without whitespace stops each piece at 256 bytes.
  const std::string run(3000, 'x');
  Tokenizer t = Tokenizer::train_bpe({run + " " + run + "\n" + std::string(700, '-')}, 400);
  size_t longest = 0;
  for (int id = 256; id < t.vocab_size(); ++id) {
    const uint16_t token = static_cast<uint16_t>(id);
    longest = std::max(longest, t.decode(std::span<const uint16_t>(&token, 1)).size());
  }
  EXPECT_EQ(longest, 256u);
  t.save(p.string());
  EXPECT_EQ(Tokenizer::load(p.string()).merges(), t.merges());
  const std::string text = run + "\t" + run;
  EXPECT_EQ(t.decode(t.encode(text)), text);
}

// Tokens are uint16: at most 65280 merges (vocab 65536); the one after is named.
TEST(Tokenizer, LoadRefusesMoreMergesThanUint16Tokens) {
  const fs::path p = temp_dir() / "wide.tokenizer.json";
  const auto file = [](int n) {
    std::string m = "[97,98]";
    for (int i = 1; i < n; ++i) m += ",[97,98]";
    return R"({"format":"loom-tokenizer","version":1,"type":"bpe","vocab_size":)" +
           std::to_string(256 + n) + R"(,"merges":[)" + m + "]}";
  };
  EXPECT_EQ(tokenizer_error(p, file(65280)), "");
  EXPECT_EQ(tokenizer_error(p, file(65281)),
            p.string() +
                ": merge 65280 is one too many: tokens are uint16, so a tokenizer has at most "
                "65280 merges (vocab 65536)");
}

TEST(Tokenizer, RejectsBadVocabSize) {
  EXPECT_THROW(Tokenizer::train_bpe({"abc"}, 100), DataError);
  EXPECT_THROW(Tokenizer::train_bpe({"abc"}, 70000), DataError);
}

TEST(Dataset, SplitHoldsOutEveryKthBlock) {
  std::vector<uint16_t> tokens(100);
  for (int i = 0; i < 100; ++i) tokens[i] = static_cast<uint16_t>(i);
  std::vector<uint16_t> train, held;
  split_heldout(tokens, 0.25, 10, train, held);  // blocks 3 and 7 held out
  ASSERT_EQ(held.size(), 20u);
  EXPECT_EQ(held[0], 30);
  EXPECT_EQ(held[10], 70);
  EXPECT_EQ(train.size(), 80u);
  EXPECT_THROW(split_heldout(tokens, 1.5, 10, train, held), DataError);
}

TEST(Dataset, RoundTrips) {
  const auto dir = temp_dir();
  const std::vector<uint16_t> train{1, 2, 3, 299}, held{7, 8};
  write_dataset((dir / "d.bin").string(), 300, train, held);
  Dataset d((dir / "d.bin").string());
  EXPECT_EQ(d.vocab_size(), 300u);
  EXPECT_EQ(std::vector<uint16_t>(d.train().begin(), d.train().end()), train);
  EXPECT_EQ(std::vector<uint16_t>(d.heldout().begin(), d.heldout().end()), held);
  EXPECT_EQ(fs::file_size(dir / "d.bin"), kDatasetHeaderBytes + 12);
  EXPECT_THROW(write_dataset((dir / "e.bin").string(), 256, std::vector<uint16_t>{256},
                             std::vector<uint16_t>{}),
               DataError);
}

TEST(Dataset, RejectsTruncatedAndCorruptedFiles) {
  const auto dir = temp_dir();
  std::vector<uint16_t> train(1000), held(100);
  for (size_t i = 0; i < train.size(); ++i) train[i] = static_cast<uint16_t>(i % 256);
  write_dataset((dir / "good.bin").string(), 256, train, held);
  const auto good = read(dir / "good.bin");
  const auto bad = dir / "bad.bin";
  auto expect_error = [&](const std::vector<char>& bytes, const std::string& what) {
    write(bad, bytes);
    const std::string e = open_error(bad);
    EXPECT_NE(e.find(bad.string()), std::string::npos) << "names the file: " << e;
    EXPECT_NE(e.find(what), std::string::npos) << "says '" << what << "': " << e;
  };
  // Truncated: inside the header, at its end, inside the payload.
  for (size_t n : {size_t{0}, size_t{10}, size_t{63}}) {
    expect_error({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)}, "truncated");
  }
  for (size_t n : {size_t{64}, size_t{65}, good.size() - 1}) {
    expect_error({good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)}, "truncated");
  }
  auto flip = [&](size_t at) {
    auto b = good;
    b[at] = static_cast<char>(b[at] ^ 0x5a);
    return b;
  };
  expect_error(flip(0), "bad magic");
  expect_error(flip(8), "version");
  expect_error(flip(16), "header checksum");
  expect_error(flip(30), "header checksum");
  expect_error(flip(100), "payload checksum");
  expect_error(flip(good.size() - 1), "payload checksum");
  auto longer = good;
  longer.push_back(0);
  expect_error(longer, "trailing");
  EXPECT_NE(open_error(dir / "nope.bin").find("loom data prepare"), std::string::npos);
  EXPECT_EQ(open_error(dir / "good.bin"), "");
}

TEST(Dataset, TokenizerPathSitsBesideTheDataset) {
  EXPECT_EQ(tokenizer_path_for("/a/b/fortunes.bin"), "/a/b/fortunes.tokenizer.json");
}

}  // namespace
