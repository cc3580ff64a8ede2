// loom-data (run as `loom data prepare --input FILES... --output DATA.bin [--tokenizer byte|bpe]
// [--vocab-size N] [--heldout-fraction F]`): tokenizes text files into the dataset file of
// dataset.hpp and writes the tokenizer beside it (DATA.tokenizer.json). Long steps (BPE
// training, encoding) report progress on stderr.
// `loom data analyze MANIFEST --dataset DATA.bin --seq-len L --output DIR [--metric NAME]...`
// runs the manifest's curriculum metrics over the dataset and writes their index files
// (analyzer.hpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <loom_cli_support.hpp>
#include <sstream>

#include <loom/data/metric_index.hpp>
#include "analyzer.hpp"
#include "dataset.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

constexpr size_t kHeldoutBlock = 1024;  // tokens; every k-th block is held out

// The output's folder must exist: prepare writes the files the user named, no folders.
void check_output(const std::string& output) {
  const fs::path parent = fs::path(output).parent_path();
  std::error_code ec;
  if (fs::is_directory(output, ec)) {
    throw DataError(output + ": is a folder; --output names the dataset file to write");
  }
  if (!parent.empty() && !fs::is_directory(parent, ec)) {
    throw DataError(output + ": the folder " + parent.string() +
                    " does not exist (create it first, e.g. mkdir -p " + parent.string() + ")");
  }
}

// A heldout split with no tokens cannot evaluate anything: say so now, with the fix, rather
// than when training starts.
void check_heldout(const std::string& output, size_t tokens, size_t heldout, double fraction) {
  if (heldout > 0) return;
  if (fraction == 0) {
    throw DataError(output +
                    ": --heldout-fraction 0 holds out no tokens, and the trainer evaluates on "
                    "the heldout split (use e.g. --heldout-fraction 0.05)");
  }
  const size_t blocks = (tokens + kHeldoutBlock - 1) / kHeldoutBlock;
  std::string fix;
  if (blocks < 2) {
    fix = "give more text: at least " + std::to_string(kHeldoutBlock + 1) + " tokens";
  } else {
    const double f = std::ceil(100.0 / static_cast<double>(blocks)) / 100.0;
    fix = "use --heldout-fraction " + loom_cli::number(f) + " or more, or give more text";
  }
  throw DataError(output + ": the heldout split would have 0 tokens: " + std::to_string(tokens) +
                  " tokens make " + std::to_string(blocks) + " block(s) of " +
                  std::to_string(kHeldoutBlock) + ", fewer than one held-out block at " +
                  "--heldout-fraction " + loom_cli::number(fraction) + " (" + fix + ")");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Prepare datasets for the reference trainer"};
  loom_cli::configure(app, "loom data");
  app.require_subcommand(1);
  auto* prep = app.add_subcommand("prepare", "Tokenize text files into a dataset file");
  std::vector<std::string> inputs;
  std::string output, kind = "byte";
  int vocab = 512;
  double heldout = 0.05;
  prep->add_option("--input", inputs,
                   "Text files or folders (folders: every file in them, "
                   "except .dat and .u8 index files)")
      ->required()
      ->type_name("PATH");
  prep->add_option("--output", output, "The dataset file to write (its folder must exist)")
      ->required()
      ->type_name("FILE");
  prep->add_option("--tokenizer", kind, "byte (vocabulary 256) or bpe (--vocab-size)")
      ->check(CLI::IsMember({"byte", "bpe"}).description(""))
      ->type_name("byte|bpe");
  auto* vocab_opt = prep->add_option("--vocab-size", vocab, "BPE vocabulary size (bpe only)")
                        ->check(loom_cli::integer_in(256, 65536))
                        ->type_name("N");
  prep->add_option("--heldout-fraction", heldout, "Fraction of the tokens held out for evaluation")
      ->check(loom_cli::number_in(0.0, 1.0, false))
      ->type_name("F");
  auto* info = app.add_subcommand("info", "Validate a dataset file and print its header");
  std::string info_path;
  info->add_option("DATA", info_path, "Dataset file")->required()->type_name("FILE");
  auto* ana = app.add_subcommand(
      "analyze", "Score every sample of a dataset with curriculum metrics; write index files");
  loom::trainer::analyze::Options aopt;
  int64_t chunk = 0;
  int threads = 0;
  ana->add_option("MANIFEST", aopt.manifest,
                  "The Loom manifest: its [curriculum.NAME] metric instances (and [comm.world] "
                  "for several ranks)")
      ->required()
      ->type_name("FILE");
  ana->add_option("--dataset", aopt.dataset, "The dataset file (loom data prepare)")
      ->required()
      ->type_name("FILE");
  ana->add_option("--seq-len", aopt.seq_len, "Tokens per sample (the trainer's seq_len)")
      ->required()
      ->check(loom_cli::integer_in(1, int64_t{1} << 30))
      ->type_name("L")
      ->default_str("");
  ana->add_option("--output", aopt.output, "The folder for the index files (must exist)")
      ->required()
      ->type_name("DIR");
  ana->add_option("--metric", aopt.metrics,
                  "A metric instance to run (repeatable; default: every metric of the manifest)")
      ->type_name("NAME");
  ana->add_option("--comm", aopt.comm,
                  "The comm instance that joins the ranks (default: world, when declared)")
      ->type_name("NAME");
  ana->add_option("--threads", threads, "Threads per rank (default: the cores of this rank)")
      ->check(loom_cli::integer_in(1, 1024))
      ->type_name("N")
      ->default_str("");
  ana->add_option("--chunk-samples", chunk,
                  "Samples per chunk a thread scores at once, at most 2^24 (default: about 1 "
                  "Mi tokens)")
      ->check(loom_cli::integer_in(1, int64_t{1} << 24))
      ->type_name("K")
      ->default_str("");
  ana->add_option("--plugin-path", aopt.plugin_path, "Extra plugin folders, ':'-separated")
      ->type_name("DIRS");
  ana->footer(loom::trainer::analyze::kHelpFooter);
  if (const int rc = loom_cli::parse(app, argc, argv, true); rc >= 0) return rc;
  if (ana->parsed()) {
    aopt.threads = static_cast<unsigned>(threads);
    aopt.chunk_samples = static_cast<uint64_t>(chunk);
    try {
      return loom::trainer::analyze::run(aopt);
    } catch (const std::exception& e) {
      std::cerr << "loom data analyze: error: " << e.what() << "\n";
      return 2;
    }
  }
  if (prep->parsed() && kind == "byte" && vocab_opt->count() > 0) {
    return loom_cli::usage_error("loom data prepare",
                                 "--vocab-size applies to --tokenizer bpe; the byte tokenizer's "
                                 "vocabulary is always 256");
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
    check_output(output);
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
        if (found.empty()) throw DataError(in + ": the folder has no text files");
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
    Tokenizer tok = Tokenizer::byte_level();
    if (kind == "bpe") {
      loom_cli::Progress p("loom data: training BPE", "merges", vocab - 256);
      int last = 0;
      tok = Tokenizer::train_bpe(texts, vocab, [&](int done, int) { p.update(last = done); });
      p.finish(last);
      if (tok.vocab_size() < vocab) {
        std::fprintf(stderr,
                     "loom data: the text has no pair left to merge after %d merges: vocabulary "
                     "%d, not %d\n",
                     tok.vocab_size() - 256, tok.vocab_size(), vocab);
      }
    }
    std::vector<uint16_t> all;
    {
      loom_cli::Progress p("loom data: encoding", "MiB", static_cast<double>(bytes) / (1 << 20));
      size_t before = 0;
      for (const auto& t : texts) {
        auto e = tok.encode(
            t, [&](size_t done) { p.update(static_cast<double>(before + done) / (1 << 20)); });
        before += t.size();
        all.insert(all.end(), e.begin(), e.end());
      }
      p.finish(static_cast<double>(bytes) / (1 << 20));
    }
    std::vector<uint16_t> train, held;
    split_heldout(all, heldout, kHeldoutBlock, train, held);
    check_heldout(output, all.size(), held.size(), heldout);
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
