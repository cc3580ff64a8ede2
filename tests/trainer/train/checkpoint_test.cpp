// Checkpoint files (safetensors weights, state blobs) and the trainer config: round trips,
// and clear errors for truncated or corrupted files and bad configs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "config.hpp"
#include "dataset.hpp"
#include "trainer_state.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

fs::path temp_dir() {
  const fs::path d =
      fs::temp_directory_path() / ("loom-trainer-ckpt-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}
std::vector<char> read(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void write(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}
void write(const fs::path& p, const std::vector<char>& b) {
  write(p, std::string(b.begin(), b.end()));
}

struct Params {
  std::vector<float> a{1, 2, 3, 4, 5, 6}, b{-1, 0.5f}, ga = a, gb = b;
  std::vector<ParamTensor> t{{"h.0.w", {2, 3}, a.data(), ga.data(), 6},
                             {"h.0.b", {2}, b.data(), gb.data(), 2}};
};

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, RoundTripsAndHasTheStandardLayout) {
  const auto dir = temp_dir();
  Params p;
  save_safetensors((dir / "m.safetensors").string(), p.t, {{"step", "7"}});
  const auto bytes = read(dir / "m.safetensors");
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  ASSERT_EQ(bytes.size(), 8 + n + 32);
  const std::string header(bytes.data() + 8, n);
  EXPECT_NE(header.find(R"("h.0.w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})"),
            std::string::npos)
      << header;
  Params q;
  std::fill(q.a.begin(), q.a.end(), 0.0f);
  std::fill(q.b.begin(), q.b.end(), 0.0f);
  load_safetensors((dir / "m.safetensors").string(), q.t);
  EXPECT_EQ(q.a, p.a);
  EXPECT_EQ(q.b, p.b);
}

// A checkpoint an earlier loom train wrote (its own writer: the data checksum alone, no
// "loom.checksum") still loads, so a run resumes across the change to libloom's writer.
TEST(Safetensors, LoadsTheEarlierLayoutWithItsDataChecksumAlone) {
  const auto dir = temp_dir();
  Params p;
  std::vector<char> data(32);
  std::memcpy(data.data(), p.a.data(), 24);
  std::memcpy(data.data() + 24, p.b.data(), 8);
  char sum[17];
  std::snprintf(sum, sizeof sum, "%016llx",
                static_cast<unsigned long long>(fnv1a64(data.data(), data.size())));
  std::string header = R"({"h.0.w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                       R"("h.0.b":{"dtype":"F32","shape":[2],"data_offsets":[24,32]},)"
                       R"("__metadata__":{"format":"pt","step":"7","fnv1a64":")" +
                       std::string(sum) + R"("}})";
  while (header.size() % 8 != 0) header.push_back(' ');
  const uint64_t n = header.size();
  std::string file(reinterpret_cast<const char*>(&n), 8);
  file += header + std::string(data.begin(), data.end());
  write(dir / "old.safetensors", file);
  Params q;
  std::fill(q.a.begin(), q.a.end(), 0.0f);
  std::fill(q.b.begin(), q.b.end(), 0.0f);
  load_safetensors((dir / "old.safetensors").string(), q.t);
  EXPECT_EQ(q.a, p.a);
  EXPECT_EQ(q.b, p.b);
}

TEST(Safetensors, RejectsTruncatedCorruptedAndMismatchedFiles) {
  const auto dir = temp_dir();
  Params p;
  save_safetensors((dir / "m.safetensors").string(), p.t);
  const auto good = read(dir / "m.safetensors");
  const auto bad = dir / "bad.safetensors";
  auto expect = [&](const std::vector<char>& b, const std::string& what) {
    write(bad, b);
    Params q;
    const std::string e = error_of([&] { load_safetensors(bad.string(), q.t); });
    EXPECT_NE(e.find(bad.string()), std::string::npos) << e;
    EXPECT_NE(e.find(what), std::string::npos) << "expected '" << what << "' in: " << e;
    EXPECT_EQ(q.a[0], 1.0f) << "nothing is loaded from a bad file";
  };
  expect({good.begin(), good.begin() + 4}, "truncated");
  expect({good.begin(), good.begin() + 40}, "truncated");
  // libloom's reader words a short data area as the tensor that runs past its end.
  expect({good.begin(), good.end() - 1}, "ends at byte 32 but the data area is 31 bytes");
  auto c = good;
  c[c.size() - 3] ^= 0x10;
  expect(c, "checksum");
  c = good;
  c[8] = 'x';
  expect(c, "the header does not start with '{'");
  // A model of another shape.
  Params other;
  other.t[0].shape = {3, 2};
  const std::string e =
      error_of([&] { load_safetensors((dir / "m.safetensors").string(), other.t); });
  EXPECT_NE(e.find("has shape [2,3], the model needs [3,2]"), std::string::npos) << e;
  other = Params();
  other.t.pop_back();
  EXPECT_NE(error_of([&] {
              load_safetensors((dir / "m.safetensors").string(), other.t);
            }).find("not a parameter of this model"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_safetensors((dir / "none").string(), p.t); }).find("cannot open"),
            std::string::npos);
}

// The checksum cannot be switched off: a header whose fnv1a64 key is renamed (same length,
// so every offset still holds) and a flipped data byte is refused, not loaded unchecked.
// libloom's writer adds "loom.checksum" over the whole file, which catches the renamed key
// itself; with that key renamed too, the file carries no checksum and is refused for it.
TEST(Safetensors, RefusesAFileWhoseChecksumKeyIsRenamed) {
  const auto dir = temp_dir();
  Params p;
  save_safetensors((dir / "m.safetensors").string(), p.t);
  auto b = read(dir / "m.safetensors");
  std::string text(b.begin(), b.end());
  const size_t at = text.find("\"fnv1a64\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 9, "\"fnv1a65\"");
  text[text.size() - 1] = static_cast<char>(text.back() ^ 0x01);
  write(dir / "renamed.safetensors", text);
  Params q;
  std::string e = error_of([&] { load_safetensors((dir / "renamed.safetensors").string(), q.t); });
  EXPECT_NE(e.find("renamed.safetensors: checksum mismatch"), std::string::npos) << e;
  EXPECT_EQ(q.b[1], 0.5f) << "nothing is loaded from a file that fails its checksum";
  const size_t whole = text.find("\"loom.checksum\"");
  ASSERT_NE(whole, std::string::npos);
  text.replace(whole, 15, "\"loom.checksun\"");
  write(dir / "renamed.safetensors", text);
  e = error_of([&] { load_safetensors((dir / "renamed.safetensors").string(), q.t); });
  EXPECT_NE(e.find("has no data checksum"), std::string::npos) << e;
  EXPECT_EQ(q.b[1], 0.5f) << "nothing is loaded from a file without its checksum";
}

// A header entry of the wrong JSON type is a checkpoint error naming the file and the tensor,
// not a JSON library exception (found by fuzz.checkpoint), in libloom's reader's words.
TEST(Safetensors, ADtypeThatIsNotAStringIsABadEntry) {
  const auto dir = temp_dir();
  Params p;
  save_safetensors((dir / "m.safetensors").string(), p.t);
  auto b = read(dir / "m.safetensors");
  std::string text(b.begin(), b.end());
  const size_t at = text.find("\"dtype\":\"F32\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 13, "\"dtype\":12345");  // the same length: every offset still holds
  write(dir / "dtype.safetensors", text);
  Params q;
  const std::string e =
      error_of([&] { load_safetensors((dir / "dtype.safetensors").string(), q.t); });
  EXPECT_NE(e.find("dtype.safetensors: tensor 'h.0.w': dtype must be a string"), std::string::npos)
      << e;
}

// Bytes toml++ 3.3 would reach undefined behaviour on (found by fuzz.config) are a parse error.
TEST(Config, NonAsciiBytesOutsideStringsAreASyntaxError) {
  const auto cfg = temp_dir() / "bytes.toml";
  write(cfg, std::string("\xd1\x9d"));
  const std::string e = error_of([&] { load_config(cfg.string()); });
  EXPECT_NE(e.find(cfg.string()), std::string::npos) << e;
}

// A folder where a checkpoint file should be is named as such (not a stream error).
TEST(Blob, AFolderInPlaceOfAFileIsNamed) {
  const auto dir = temp_dir() / "a_folder.bin";
  fs::create_directories(dir);
  const std::string e = error_of([&] { load_blob(dir.string(), BlobKind::kOptimizer); });
  EXPECT_NE(e.find(dir.string() + ": is a folder, not the checkpoint file"), std::string::npos)
      << e;
  Params p;
  const std::string m = error_of([&] { load_safetensors(dir.string(), p.t); });
  EXPECT_NE(m.find("is a folder"), std::string::npos) << m;
}

// Writes leave no partial file behind on failure and name the file and the reason.
TEST(DurableFile, AFailedWriteNamesTheFileAndLeavesNothing) {
  const auto dir = temp_dir() / "no_such_folder";
  std::string e;
  try {
    write_file_atomic((dir / "x.bin").string(), "abc", 3);
  } catch (const WriteError& err) {
    e = err.what();
  }
  EXPECT_NE(e.find((dir / "x.bin.tmp").string() + ": cannot create the file"), std::string::npos)
      << e;
  const auto ok = temp_dir() / "whole.bin";
  write_file_atomic(ok.string(), "abc", 3);
  EXPECT_EQ(read(ok), (std::vector<char>{'a', 'b', 'c'}));
  EXPECT_FALSE(fs::exists(ok.string() + ".tmp"));
}

// An edited trainer state (its checksum recomputed, so only its values can tell) does not
// resume: the operator's file claimed step 4294967316 in the folder of step 20.
TEST(TrainerState, ValuesOutsideTheRunAreRefused) {
  TrainerState s;
  s.step = 20;
  s.tokens_seen = 20 * 128;
  s.layer_tokens = 2 * s.tokens_seen;
  s.acc_steps = 5;
  s.loss_acc = 12.5;
  s.elapsed_s = 3;
  s.warmup_tokens = 128 * 4;
  s.warmup_layer_tokens = 2 * s.warmup_tokens;
  const TrainerStateLimits limits{20, 128, 2};
  const auto decoded = decode_trainer_state(encode_trainer_state(s), "t.bin");
  EXPECT_NO_THROW(check_trainer_state(decoded, limits, "t.bin"));
  auto expect = [&](TrainerState bad, const std::string& what) {
    const std::string e = error_of([&] {
      check_trainer_state(decode_trainer_state(encode_trainer_state(bad), "t.bin"), limits,
                          "t.bin");
    });
    EXPECT_NE(e.find("t.bin: " + what), std::string::npos) << "expected '" << what << "' in " << e;
  };
  TrainerState bad = s;
  bad.step = 4294967316;
  expect(bad, "step 4294967316 in a checkpoint folder of step 20");
  bad = s;
  bad.tokens_seen = 21 * 128;
  expect(bad, "2688 tokens seen in 20 steps of at most 128");
  bad = s;
  bad.layer_tokens = 3 * s.tokens_seen;
  expect(bad, "7680 layer tokens for 2560 tokens and 2 layers");
  bad = s;
  bad.skipped_steps = 21;
  expect(bad, "21 skipped steps in 20");
  bad = s;
  bad.acc_steps = -1;
  expect(bad, "-1 steps since the last metrics line");
  bad = s;
  bad.loss_acc = -std::numeric_limits<double>::infinity();
  expect(bad, "loss sum");
  bad = s;
  bad.elapsed_s = std::nan("");
  expect(bad, "elapsed time");
  bad = s;
  bad.warmup_tokens = s.tokens_seen + 1;
  expect(bad, "warmup ended at token 2561");
  // A truncated state names the byte where it ends.
  auto bytes = encode_trainer_state(s);
  bytes.resize(30);
  EXPECT_NE(error_of([&] {
              (void)decode_trainer_state(bytes, "t.bin");
            }).find("t.bin: truncated: a field at byte 24 runs past the end (30 bytes)"),
            std::string::npos);
}

TEST(Blob, RoundTripsAndRejectsDamage) {
  const auto dir = temp_dir();
  const std::vector<uint8_t> payload{1, 2, 3, 4, 5, 6, 7, 8, 9};
  const auto f = (dir / "o.bin").string();
  save_blob(f, BlobKind::kOptimizer, payload);
  EXPECT_EQ(load_blob(f, BlobKind::kOptimizer), payload);
  EXPECT_NE(error_of([&] { load_blob(f, BlobKind::kTrainer); }).find("wrong kind"),
            std::string::npos);
  const auto good = read(f);
  write(f, std::vector<char>(good.begin(), good.end() - 2));
  EXPECT_NE(error_of([&] { load_blob(f, BlobKind::kOptimizer); }).find("truncated"),
            std::string::npos);
  write(f, std::vector<char>(good.begin(), good.begin() + 20));
  EXPECT_NE(error_of([&] { load_blob(f, BlobKind::kOptimizer); }).find("truncated"),
            std::string::npos);
  auto c = good;
  c.back() ^= 1;
  write(f, c);
  EXPECT_NE(error_of([&] { load_blob(f, BlobKind::kOptimizer); }).find("checksum"),
            std::string::npos);
  c = good;
  c[0] = 'X';
  write(f, c);
  EXPECT_NE(error_of([&] { load_blob(f, BlobKind::kOptimizer); }).find("bad magic"),
            std::string::npos);
}

TEST(Config, ReadsResolvesAndValidates) {
  const auto dir = temp_dir();
  const auto cfg = dir / "t.toml";
  write(cfg,
        "[manifest]\npath = \"m.toml\"\n[model]\ndim = 64\ncontext = 64\n[data]\n"
        "dataset = \"d/x.bin\"\n[train]\nsteps = 10\nseq_len = 32\nlr = 1e-3\nmin_lr = 0\n"
        "warmup_steps = 2\ndecay = \"linear\"\n");
  TrainConfig c = load_config(cfg.string());
  EXPECT_EQ(c.manifest, (dir / "m.toml").string());
  EXPECT_EQ(c.dataset, (dir / "d/x.bin").string());
  EXPECT_EQ(c.model.dim, 64);
  EXPECT_EQ(c.run_dir, (dir / "runs" / "t").string());
  EXPECT_DOUBLE_EQ(lr_at(c, 1), 0.5e-3);
  EXPECT_DOUBLE_EQ(lr_at(c, 2), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(c, 6), 0.5e-3);
  EXPECT_DOUBLE_EQ(lr_at(c, 10), 0.0);
  c.decay = "cosine";
  EXPECT_NEAR(lr_at(c, 6), 0.5e-3, 1e-12);
  EXPECT_NEAR(lr_at(c, 4), 1e-3 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25)), 1e-12);

  auto err = [&](const std::string& text) {
    write(cfg, text);
    return error_of([&] { load_config(cfg.string()); });
  };
  const std::string base = "[manifest]\npath = \"m.toml\"\n[data]\ndataset = \"x\"\n";
  EXPECT_NE(err(base + "[train]\nstepz = 3\n").find(":6:1: [train] stepz: unknown key"),
            std::string::npos)
      << err(base + "[train]\nstepz = 3\n");
  EXPECT_NE(err(base + "[train]\nsteps = -3\n").find("out of range"), std::string::npos);
  EXPECT_NE(err(base + "[train]\nlr = \"big\"\n").find("expected a number"), std::string::npos);
  EXPECT_NE(err(base + "[train]\ndecay = \"step\"\n").find("not one of"), std::string::npos);
  EXPECT_NE(err(base + "[train]\nmask_unused_positions = 1\n")
                .find(":6:25: [train] mask_unused_positions: expected true or false"),
            std::string::npos)
      << err(base + "[train]\nmask_unused_positions = 1\n");
  EXPECT_NE(err(base + "[train]\nseq_len = 512\n").find("exceeds [model] context"),
            std::string::npos);
  EXPECT_NE(err(base + "[optimizer]\nx = 1\n").find("unknown top-level"), std::string::npos);
  EXPECT_NE(err("[data]\ndataset = \"x\"\n").find("[manifest] path is required"),
            std::string::npos);
  // A manifest given where a config belongs: one message saying so, not a list of mistakes.
  const std::string manifest = "[loom]\nabi = 1\n[optimizer.main]\nplugin = \"adam\"\n";
  EXPECT_EQ(
      err(manifest).find(cfg.string() + ":1:1: this is a Loom manifest, not a trainer config"), 0U)
      << err(manifest);
  EXPECT_EQ(err(manifest).find("unknown"), std::string::npos) << err(manifest);
  EXPECT_NE(err("[optimizer.main]\nplugin = \"adam\"\n").find("not a trainer config"),
            std::string::npos);
  EXPECT_NE(err("[manifest\n").find(cfg.string() + ":1:"), std::string::npos) << err("[manifest\n");
  EXPECT_NE(error_of([&] { load_config((dir / "none.toml").string()); }).find("cannot open"),
            std::string::npos);
}

}  // namespace
