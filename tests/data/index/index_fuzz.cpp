// libFuzzer target for the index-file reader (loom::data::MetricIndex::open). The input is
// one byte of mode then the bytes of one of the three files of a small valid index; the
// other two files stay valid. Mode bits 0-1 pick the file; bit 2 recomputes the payload and
// header checksums over the input first, so mutations get past the checksums to the checks
// behind them (sizes, names, sorted order, cross-file agreement, finite values).
// Besides crashes and sanitizer reports, it checks that open() either throws IndexError
// naming one of the files or returns an index whose contents satisfy the format's rules.
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <loom/data/metric_index.hpp>

namespace fs = std::filesystem;
using loom::data::IndexFile;

namespace {

const IndexFile kFiles[3] = {IndexFile::sample_to_metric, IndexFile::sorted,
                             IndexFile::percentiles};
fs::path g_dir;
std::vector<unsigned char> g_valid[3];

[[noreturn]] void invariant_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "index_fuzz: invariant violated: %s: %s\n", what, detail.c_str());
  std::abort();
}

std::string path_of(int k) { return loom::data::index_file_path(g_dir.string(), "m", kFiles[k]); }

void store(int k, const unsigned char* data, size_t size) {
  std::ofstream out(path_of(k), std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

std::vector<unsigned char> load(int k) {
  std::ifstream in(path_of(k), std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void cleanup() { fs::remove_all(g_dir); }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // The three files are rewritten on every run: keep them in memory where there is a tmpfs
  // (about 15 times the executions per second of a disk-backed /tmp).
  std::error_code shm_ec;
  const fs::path scratch =
      fs::is_directory("/dev/shm", shm_ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
  g_dir = scratch / ("loom_index_fuzz_" + std::to_string(::getpid()));
  fs::create_directories(g_dir);
  std::atexit(cleanup);
  loom::data::IndexInfo info;
  info.samples = 24;
  info.dataset_checksum = 42;
  info.sample_tokens = 16;
  info.vocab_size = 256;
  info.metric = "m";
  info.plugin = "seqlen";
  std::vector<double> values(info.samples);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>((i * 7) % 5);
  loom::data::write_metric_index(g_dir.string(), info, values,
                                 loom::data::sort_by_value(values, 2));
  for (int k = 0; k < 3; ++k) g_valid[k] = load(k);
  // Seeds: each valid file in both modes, written into the corpus folder (the last
  // argument that is not a flag) when that folder is empty.
  std::string corpus;
  for (int i = 1; i < *argc; ++i) {
    if ((*argv)[i][0] != '-') corpus = (*argv)[i];
  }
  std::error_code ec;
  if (!corpus.empty() && fs::is_directory(corpus, ec) && fs::is_empty(corpus, ec)) {
    for (int k = 0; k < 3; ++k) {
      for (unsigned char mode :
           {static_cast<unsigned char>(k), static_cast<unsigned char>(k | 4)}) {
        std::ofstream out(fs::path(corpus) / ("seed_" + std::to_string(mode)), std::ios::binary);
        out.put(static_cast<char>(mode));
        out.write(reinterpret_cast<const char*>(g_valid[k].data()),
                  static_cast<std::streamsize>(g_valid[k].size()));
      }
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int k = data[0] & 3;
  if (k == 3) return 0;
  std::vector<unsigned char> file(data + 1, data + size);
  if ((data[0] & 4) != 0 && file.size() >= loom::data::kIndexHeaderBytes) {
    const uint64_t payload = loom::data::index_fnv1a64(file.data() + 256, file.size() - 256);
    std::memcpy(file.data() + 184, &payload, 8);
    const uint64_t header = loom::data::index_fnv1a64(file.data(), 248);
    std::memcpy(file.data() + 248, &header, 8);
  }
  for (int j = 0; j < 3; ++j) {
    if (j == k) {
      store(j, file.data(), file.size());
    } else {
      store(j, g_valid[j].data(), g_valid[j].size());
    }
  }
  try {
    const auto idx = loom::data::MetricIndex::open(g_dir.string(), "m");
    const auto& info = idx.info();
    if (idx.sample_to_metric().size() != info.samples || idx.sorted().size() != info.samples ||
        idx.percentiles().size() != 101) {
      invariant_failed("sizes", std::to_string(info.samples));
    }
    for (size_t i = 0; i < idx.sorted().size(); ++i) {
      const auto& e = idx.sorted()[i];
      if (e.sample >= info.samples || !std::isfinite(e.value) ||
          idx.sample_to_metric()[e.sample] != e.value ||
          (i > 0 && !loom::data::sorted_before(idx.sorted()[i - 1], e))) {
        invariant_failed("sorted entry", std::to_string(i));
      }
    }
  } catch (const loom::data::IndexError& e) {
    const std::string msg = e.what();
    bool named = false;
    for (int j = 0; j < 3; ++j) named = named || msg.rfind(path_of(j) + ": ", 0) == 0;
    if (!named) invariant_failed("error names no file", msg);
  }
  return 0;
}
