// loom-data (run as `loom data prepare --input FILES... --output DATA.bin [--tokenizer byte|bpe]
// [--vocab-size N] [--heldout-fraction F]`): tokenizes text files into the dataset file of
// dataset.hpp and writes the tokenizer beside it (DATA.tokenizer.json).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "dataset.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

int main(int argc, char** argv) {
  CLI::App app{"loom data: prepare datasets for the reference trainer"};
  app.require_subcommand(1);
  auto* prep = app.add_subcommand("prepare", "Tokenize text files into a dataset file");
  std::vector<std::string> inputs;
  std::string output, kind = "byte";
  int vocab = 512;
  double heldout = 0.05;
  prep->add_option("--input", inputs,
                   "Text files or folders (folders: every file in them, "
                   "except .dat and .u8 index files)")
      ->required();
  prep->add_option("--output", output, "The dataset file to write")->required();
  prep->add_option("--tokenizer", kind, "byte or bpe")->check(CLI::IsMember({"byte", "bpe"}));
  prep->add_option("--vocab-size", vocab, "BPE vocabulary size (256..65536)");
  prep->add_option("--heldout-fraction", heldout, "Fraction held out for evaluation [0, 1)");
  auto* info = app.add_subcommand("info", "Validate a dataset file and print its header");
  std::string info_path;
  info->add_option("DATA", info_path, "Dataset file")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (info->parsed()) {
      Dataset ds(info_path);
      std::printf("%s: ok, version %u, vocab %u, %llu train + %llu heldout tokens\n",
                  info_path.c_str(), ds.header().version, ds.vocab_size(),
                  static_cast<unsigned long long>(ds.header().train_tokens),
                  static_cast<unsigned long long>(ds.header().heldout_tokens));
      return 0;
    }
    std::vector<fs::path> files;
    for (const auto& in : inputs) {
      std::error_code ec;
      if (fs::is_directory(in, ec)) {
        std::vector<fs::path> found;
        for (const auto& e : fs::directory_iterator(in, ec)) {
          const auto ext = e.path().extension().string();
          if (e.is_regular_file() && ext != ".dat" && ext != ".u8") found.push_back(e.path());
        }
        std::sort(found.begin(), found.end());
        files.insert(files.end(), found.begin(), found.end());
      } else if (fs::is_regular_file(in, ec)) {
        files.emplace_back(in);
      } else {
        throw DataError(in + ": no such file or folder");
      }
    }
    if (files.empty()) throw DataError("no input files");
    std::vector<std::string> texts;
    size_t bytes = 0;
    for (const auto& f : files) {
      std::ifstream s(f, std::ios::binary);
      if (!s) throw DataError(f.string() + ": cannot read");
      std::stringstream ss;
      ss << s.rdbuf();
      texts.push_back(ss.str());
      bytes += texts.back().size();
    }
    Tokenizer tok = kind == "bpe" ? Tokenizer::train_bpe(texts, vocab) : Tokenizer::byte_level();
    std::vector<uint16_t> all;
    for (const auto& t : texts) {
      auto e = tok.encode(t);
      all.insert(all.end(), e.begin(), e.end());
    }
    std::vector<uint16_t> train, held;
    split_heldout(all, heldout, 1024, train, held);
    if (fs::path(output).has_parent_path()) fs::create_directories(fs::path(output).parent_path());
    write_dataset(output, static_cast<uint32_t>(tok.vocab_size()), train, held);
    const std::string tpath = tokenizer_path_for(output);
    tok.save(tpath);
    std::printf("%s: %zu files, %zu bytes -> %zu tokens (%s, vocab %d): %zu train, %zu heldout\n",
                output.c_str(), files.size(), bytes, all.size(), kind.c_str(), tok.vocab_size(),
                train.size(), held.size());
    std::printf("tokenizer: %s\n", tpath.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "loom data: error: " << e.what() << "\n";
    return 2;
  }
}
