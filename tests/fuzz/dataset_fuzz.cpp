// libFuzzer target for the trainer's dataset files (trainer/data/dataset.cpp): the
// memory-mapped token file (Dataset) and the tokenizer file beside it (Tokenizer::load).
// The input is one byte of mode, then the file:
//  - bit 0 clear: a dataset file, opened with Dataset from an in-memory file; with bit 1 set
//    the header and payload checksums are recomputed over the input first, so mutations get
//    past them to the checks behind (sizes, counts, dtype, tokens);
//  - bit 0 set: a tokenizer file (JSON), read with Tokenizer::load.
// Besides crashes and sanitizer reports, it checks:
//  - every DataError names the file;
//  - an accepted dataset's header describes the file exactly and every token is below its
//    vocab size;
//  - an accepted tokenizer decodes what it encodes back to the same bytes.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dataset.hpp"
#include "fuzz_common.hpp"

namespace {

using loom::trainer::DataError;

constexpr const char* kTarget = "dataset_fuzz";
constexpr size_t kHeader = loom::trainer::kDatasetHeaderBytes;
// Larger tokenizers are skipped: a merge table is a pair per line of JSON, and encoding
// with thousands of merges only repeats what a few hundred reach.
constexpr size_t kMaxTokenizerBytes = 1 << 16;
volatile size_t g_sink = 0;

loom_fuzz::MemFile* g_file = nullptr;

void check_named(const DataError& e) {
  const std::string m = e.what();
  if (m.rfind(g_file->path() + ": ", 0) != 0) {
    loom_fuzz::invariant_failed(kTarget, "an error that does not name the file", m);
  }
}

void dataset(std::vector<uint8_t> file, bool fix_checksums) {
  if (fix_checksums && file.size() >= kHeader) {
    const uint64_t payload = loom::trainer::fnv1a64(file.data() + kHeader, file.size() - kHeader);
    std::memcpy(file.data() + 40, &payload, 8);
    const uint64_t header = loom::trainer::fnv1a64(file.data(), 48);
    std::memcpy(file.data() + 48, &header, 8);
  }
  g_file->set(file.data(), file.size());
  try {
    const loom::trainer::Dataset d(g_file->path());
    const auto& h = d.header();
    if (kHeader + 2 * (h.train_tokens + h.heldout_tokens) != file.size() ||
        d.train().size() != h.train_tokens || d.heldout().size() != h.heldout_tokens ||
        h.vocab_size == 0 || h.vocab_size > 65536) {
      loom_fuzz::invariant_failed(kTarget, "accepted header", std::to_string(file.size()));
    }
    for (const auto part : {d.train(), d.heldout()}) {
      for (const uint16_t t : part) {
        if (t >= h.vocab_size) loom_fuzz::invariant_failed(kTarget, "token", std::to_string(t));
      }
    }
  } catch (const DataError& e) {
    check_named(e);
  }
}

void tokenizer(const uint8_t* data, size_t size) {
  if (size > kMaxTokenizerBytes) return;
  g_file->set(data, size);
  loom::trainer::Tokenizer t;
  try {
    t = loom::trainer::Tokenizer::load(g_file->path());
  } catch (const DataError& e) {
    check_named(e);
    return;
  }
  using namespace std::string_literals;  // the text holds a NUL byte
  const std::string text = "the quick brown fox\n jumps over\tthe lazy dog \xff\x00 aaaa bbbb "s;
  const std::vector<uint16_t> tokens = t.encode(text);
  for (const uint16_t tok : tokens) {
    if (tok >= t.vocab_size()) loom_fuzz::invariant_failed(kTarget, "encoded token", text);
  }
  if (t.decode(tokens) != text)
    loom_fuzz::invariant_failed(kTarget, "decode(encode(s)) != s", text);
  g_sink = g_sink + tokens.size();
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::vector<loom_fuzz::Seed> seeds() {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("loom_dataset_fuzz_seeds_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<loom_fuzz::Seed> out;
  auto add = [&](const std::string& name, uint8_t mode, const std::string& path) {
    std::vector<uint8_t> b{mode};
    const auto f = file_bytes(path);
    b.insert(b.end(), f.begin(), f.end());
    out.push_back({name, std::move(b)});
  };
  struct Data {
    const char* name;
    uint32_t vocab;
    std::vector<uint16_t> train, heldout;
  };
  const Data sets[] = {
      {"bytes", 256, {104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100}, {10, 33}},
      {"wide_vocab", 65536, {0, 65535, 300, 7}, {65534}},
      {"no_heldout", 3, {0, 1, 2, 2, 1, 0}, {}},
      {"empty", 1, {}, {}},
  };
  for (const auto& s : sets) {
    const std::string path = dir + "/" + s.name + ".bin";
    loom::trainer::write_dataset(path, s.vocab, s.train, s.heldout);
    add(std::string("dataset_") + s.name, 0, path);
    add(std::string("dataset_fixed_") + s.name, 2, path);
  }
  const std::string bl = dir + "/byte.json";
  loom::trainer::Tokenizer::byte_level().save(bl);
  add("tokenizer_byte", 1, bl);
  const std::string bpe = dir + "/bpe.json";
  loom::trainer::Tokenizer::train_bpe({"the cat sat on the mat", "the the the cat cat"}, 270)
      .save(bpe);
  add("tokenizer_bpe", 1, bpe);
  std::filesystem::remove_all(dir);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  loom_fuzz::write_seeds_if_asked(seeds());
  g_file = new loom_fuzz::MemFile("dataset_fuzz");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  if ((data[0] & 1) != 0) {
    tokenizer(data + 1, size - 1);
  } else {
    dataset(std::vector<uint8_t>(data + 1, data + size), (data[0] & 2) != 0);
  }
  return 0;
}
