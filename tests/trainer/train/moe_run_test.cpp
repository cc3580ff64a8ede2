// The trainer's [moe] layers over the bundled `moe` plugin: a layer of one expert with top-1
// and no capacity limit is the dense MLP it replaces (forward and every gradient, the gate's
// being exactly 0); whole runs of loom-train on a generated corpus train (the loss falls), log
// the aux loss, the load per expert and the dropped choices per layer, run PR-MoE with a
// pyramid of experts, resume bit for bit (with the aux-loss-free bias in the checkpoint), and
// `loom check` reports plans the instance refuses (k > E, capacity_factor <= 0, experts that
// the expert-parallel group cannot hold evenly) before any training. Tiny model, about a
// second each.
#include <gtest/gtest.h>
#include <loom/embed.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "dataset.hpp"
#include "model.hpp"
#include "moe_layer.hpp"
#include "run_env.hpp"

namespace fs = std::filesystem;
using namespace loom::trainer;

namespace {

struct Result {
  int code = -1;
  std::string out;  // stdout and stderr
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

ParamTensor* find(std::vector<ParamTensor>& ps, const std::string& name) {
  for (auto& p : ps) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

double max_rel(const float* a, const float* b, size_t n) {
  double scale = 0, diff = 0;
  for (size_t i = 0; i < n; ++i) {
    scale = std::max(scale, std::fabs(double(a[i])));
    diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

class MoeRun : public ::testing::Test {
 protected:
  static fs::path dir_;

  static void SetUpTestSuite() {
    loom::trainer::test_run::set_environment();
    dir_ = fs::temp_directory_path() / ("loom-trainer-moe-" + std::to_string(::getpid()));
    ASSERT_EQ(loom::trainer::test_run::prepare_dataset(dir_, LOOM_DATA_EXE, 60000), 0)
        << slurp(dir_ / "prepare.log");
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  static Result sh(const std::string& cmd) {
    const fs::path log = dir_ / ("log-" + std::to_string(::getpid()) + ".txt");
    const int st = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
    Result r;
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(log);
    return r;
  }
  // adam, and the MoE instances: [moe.top1] 4 experts top-1; [moe.pr] PR-MoE top-1;
  // [moe.bias] aux-loss-free balancing top-2; [moe.top3] k = 3 (more than a 2-expert layer
  // has); [moe.dropless] 4 experts top-1 without capacity; with `comm`, a ucx comm and
  // [moe.ep], [moe.dropless] over an expert-parallel group of 2.
  static std::string manifest(const std::string& name, bool comm, const std::string& extra = "") {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << (comm ? "[comm.world]\nplugin = \"ucx\"\n" : "")
                     << "[optimizer.main]\nplugin = \"adam\"\n"
                     << "[moe.top1]\nplugin = \"moe\"\nnum_experts = 4\nk = 1\n"
                     << "capacity_factor = 1.25\n"
                     << "[moe.pr]\nplugin = \"moe\"\nk = 1\nuse_residual = true\n"
                     << "[moe.bias]\nplugin = \"moe\"\nnum_experts = 4\nk = 2\n"
                     << "bias_update_rate = 0.001\n"
                     << "[moe.top3]\nplugin = \"moe\"\nk = 3\n"
                     << "[moe.dropless]\nplugin = \"moe\"\nnum_experts = 4\nk = 1\n"
                     << "drop_tokens = false\n"
                     << (comm ? "[moe.ep]\nplugin = \"moe\"\nnum_experts = 4\nk = 1\n"
                                "drop_tokens = false\nep_size = 2\ncomm = \"world\"\n"
                              : "")
                     << extra;
    return p.filename().string();
  }
  // 2 layers, context and seq_len 32, batch 4, 20 steps, metrics every step; [moe] from line 7.
  static std::string config(const std::string& name, const std::string& man, const std::string& moe,
                            const std::string& train_extra = "", bool comm = false) {
    const fs::path p = dir_ / (name + ".toml");
    std::ofstream(p) << "[manifest]\npath = \"" << man << "\"\n"
                     << "comm = \"" << (comm ? "world" : "") << "\"\n"
                     << "[model]\ncontext = 32\nlayers = 2\nheads = 2\ndim = 16\n"
                     << (moe.empty() ? "" : "[moe]\n" + moe) << "[data]\ndataset = \"data.bin\"\n"
                     << "[train]\nsteps = 20\nbatch_size = 4\nseq_len = 32\n"
                     << "lr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\ndecay = \"linear\"\n"
                     << "eval_interval = 10\neval_batches = 1\ncheckpoint_interval = 5\n"
                     << "log_interval = 1\nthreads = 1\nplot = \"none\"\nrun_dir = \"runs/" << name
                     << "\"\n"
                     << train_extra;
    return p.string();
  }
  static Result train(int ranks, const std::string& cfg, const std::string& args = "") {
    std::string cmd = std::string(LOOM_TRAIN_EXE) + " " + cfg + " " + args;
    if (ranks > 1) {
      cmd = std::string(LOOM_MPIRUN) + " --oversubscribe --allow-run-as-root -np " +
            std::to_string(ranks) + " " + cmd;
    }
    return sh(cmd);
  }
  static std::vector<nlohmann::json> metrics(const std::string& run, const std::string& type) {
    std::ifstream f(dir_ / "runs" / run / "metrics.jsonl");
    std::vector<nlohmann::json> v;
    for (std::string line; std::getline(f, line);) {
      auto j = nlohmann::json::parse(line);
      if (j["type"] == type) v.push_back(j);
    }
    return v;
  }
  static double mean_loss(const std::vector<nlohmann::json>& t, size_t from, size_t to) {
    double s = 0;
    for (size_t i = from; i < to; ++i) s += double(t[i]["loss"]);
    return s / static_cast<double>(to - from);
  }
};
fs::path MoeRun::dir_;

// E = 1, k = 1, no capacity limit: the softmax over one expert is exactly 1, so the layer is
// the dense MLP with the same weights (GELU, the tanh form, in both). The model's loss and
// every gradient agree to float rounding (the two run their matmuls in different orders);
// the gate's gradient is exactly 0 (a one-way softmax has none) and the aux loss exactly 1.
TEST_F(MoeRun, OneExpertLayerIsTheDenseMlp) {
  loom_open_options o{};
  o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  o.log_level = -1;
  loom_session* s = nullptr;
  ASSERT_EQ(loom_open_string("[moe.one]\nplugin = \"moe\"\nnum_experts = 1\nk = 1\n"
                             "drop_tokens = false\n",
                             "one.toml", &o, &s),
            LOOM_OK)
      << loom_last_error();
  std::unique_ptr<loom_session, void (*)(loom_session*)> session(s, loom_close);
  loom_instance* inst = nullptr;
  ASSERT_EQ(loom_find_instance(s, "moe", "one", &inst), LOOM_OK) << loom_last_error();
  const ModelConfig cfg{64, 16, 2, 2, 16};
  const int B = 2, T = 16, C = cfg.dim;
  Model dense(cfg, 7), moe(cfg, 7);
  MoeLayerOptions mo;
  mo.who = "test";
  mo.layer = 1;
  mo.num_layers = 2;
  mo.dim = C;
  mo.hidden = 4 * C;
  mo.experts = 1;
  mo.tokens = B * T;
  mo.seed = 7;
  auto layer = std::make_unique<MoeLayer>(inst, mo);
  MoeLayer* m = layer.get();
  ASSERT_EQ(m->experts(), 1);
  ASSERT_EQ(m->plan().top_k, 1);
  // The dense layer-1 MLP's weights into the expert (the same [out, in] layouts).
  {
    auto& dp = dense.parameters();
    auto mp = m->parameters();
    const std::vector<std::pair<std::string, std::string>> pairs{
        {"h.1.mlp.fc.w", "h.1.moe.experts.w1"},
        {"h.1.mlp.fc.b", "h.1.moe.experts.b1"},
        {"h.1.mlp.proj.w", "h.1.moe.experts.w2"},
        {"h.1.mlp.proj.b", "h.1.moe.experts.b2"}};
    for (const auto& [d, e] : pairs) {
      ParamTensor* a = find(dp, d);
      ParamTensor* b = find(mp, e);
      ASSERT_TRUE(a && b) << d << " " << e;
      ASSERT_EQ(a->numel, b->numel);
      // Biases 0 at init: give them values so that their paths are checked too.
      for (size_t i = 0; i < a->numel; ++i) {
        if (d.back() == 'b') a->value[i] = 0.01f * static_cast<float>((i % 7) - 3);
        b->value[i] = a->value[i];
      }
    }
  }
  moe.replace_mlp(1, std::move(layer));
  std::vector<int32_t> x(B * T), y(B * T);
  for (int i = 0; i < B * T; ++i) {
    x[i] = (i * 7 + 3) % cfg.vocab_size;
    y[i] = (i * 11 + 5) % cfg.vocab_size;
  }
  m->set_step(1, 0);
  dense.zero_grad();
  moe.zero_grad();
  const float ld = dense.forward_backward(x.data(), y.data(), B, T);
  const float lm = moe.forward_backward(x.data(), y.data(), B, T);
  EXPECT_NEAR(ld, lm, 1e-6 * std::fabs(ld));
  EXPECT_DOUBLE_EQ(m->aux_loss(), 1.0);
  EXPECT_EQ(m->dropped(), 0);
  ASSERT_EQ(m->load().size(), 1u);
  EXPECT_EQ(m->load()[0], B * T);
  auto& dp = dense.parameters();
  auto& mp = moe.parameters();
  int compared = 0;
  for (auto& p : dp) {
    std::string name = p.name;
    if (name.rfind("h.1.mlp.", 0) == 0) {
      static const std::pair<const char*, const char*> map[] = {
          {"h.1.mlp.fc.w", "h.1.moe.experts.w1"},
          {"h.1.mlp.fc.b", "h.1.moe.experts.b1"},
          {"h.1.mlp.proj.w", "h.1.moe.experts.w2"},
          {"h.1.mlp.proj.b", "h.1.moe.experts.b2"}};
      for (const auto& [d, e] : map) {
        if (name == d) name = e;
      }
    }
    ParamTensor* q = find(mp, name);
    ASSERT_NE(q, nullptr) << name;
    ASSERT_EQ(p.numel, q->numel);
    EXPECT_LT(max_rel(p.grad, q->grad, p.numel), 2e-5) << p.name;
    ++compared;
  }
  EXPECT_EQ(compared, 2 + 2 * 12 + 2);
  ParamTensor* gate = find(mp, "h.1.moe.gate.w");
  ASSERT_NE(gate, nullptr);
  for (size_t i = 0; i < gate->numel; ++i) ASSERT_EQ(gate->grad[i], 0.0f) << i;
  // Evaluation: the same too.
  EXPECT_NEAR(dense.forward_loss(x.data(), y.data(), B, T),
              moe.forward_loss(x.data(), y.data(), B, T), 1e-6 * std::fabs(ld));
}

// Layer 1 of 2 has 4 experts, top-1, capacity factor 1.25: the loss falls over 20 steps, and
// every step records the aux loss (coef x the layer's, about 1 when balanced), the load of
// each expert (summing to the 128 tokens: one choice each) and the dropped choices (at most
// what 4 experts of capacity ceil(1.25 x 128 / 4) = 40 leave of 128).
TEST_F(MoeRun, TinyMoeTrainsAndLogsItsLayers) {
  const auto m = manifest("m_one", false);
  const auto r = train(1, config("one", m, "instance = \"top1\"\nlayers = [1]\n"), "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("MoE layers by 'top1' (moe): 1 (4 experts, top-1)"), std::string::npos)
      << r.out;
  const auto t = metrics("one", "train");
  ASSERT_EQ(t.size(), 20u);
  EXPECT_LT(mean_loss(t, 15, 20), mean_loss(t, 0, 5) - 0.1);
  for (const auto& line : t) {
    ASSERT_TRUE(line.contains("moe")) << line.dump();
    ASSERT_EQ(line["moe"].size(), 1u);
    const auto& l = line["moe"][0];
    EXPECT_EQ(l["layer"], 1);
    EXPECT_EQ(l["experts"], 4);
    ASSERT_EQ(l["load"].size(), 4u);
    int64_t sum = 0;
    for (const auto& v : l["load"]) sum += int64_t(v);
    EXPECT_EQ(sum, 128);
    EXPECT_GE(int64_t(l["dropped"]), 0);
    EXPECT_LE(int64_t(l["dropped"]), 128);
    const double aux = l["aux_loss"];
    EXPECT_GE(aux, 0.99);  // E * sum me * ce >= 1 up to the gate's spread
    EXPECT_LE(aux, 4.0);
    EXPECT_NEAR(double(line["aux_loss"]), 0.01 * aux, 1e-12);
  }
  const auto e = metrics("one", "eval");
  ASSERT_FALSE(e.empty());
  EXPECT_TRUE(std::isfinite(double(e.back()["eval_loss"])));
  const auto s = nlohmann::json::parse(slurp(dir_ / "runs/one/summary.json"));
  EXPECT_EQ(s["moe"]["layers"][0]["experts"], 4);
  // Where the layers' time went: every phase the plugin reports took time, the phases and
  // "other" add up to the calls, which are part of the steps; the same in the printed line.
  const auto& sec = s["moe"]["phases"]["seconds"];
  double parts = 0.0;
  for (const char* k : {"gate", "dispatch", "exchange", "experts", "combine", "other"}) {
    ASSERT_TRUE(sec.contains(k)) << sec.dump();
    EXPECT_GE(double(sec[k]), 0.0) << k;
    parts += double(sec[k]);
  }
  for (const char* k : {"gate", "dispatch", "experts", "combine"})
    EXPECT_GT(double(sec[k]), 0.0) << k;
  EXPECT_NEAR(parts, double(sec["calls"]), 1e-9);
  EXPECT_GT(double(s["moe"]["phases"]["share_of_steps"]["calls"]), 0.0);
  EXPECT_LT(double(s["moe"]["phases"]["share_of_steps"]["calls"]), 1.0);
  EXPECT_EQ(s["moe"]["layers"][0]["phases"], s["moe"]["phases"]);  // one MoE layer
  EXPECT_NE(r.out.find("MoE layers (rank 0): "), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "runs/one/checkpoints/step_00000020/moe.rank0.bin"));
  // The checkpoint holds the layer's parameters by name (and no dense MLP for layer 1).
  const std::string st = slurp(dir_ / "runs/one/checkpoints/step_00000020/model.rank0.safetensors");
  for (const char* n : {"h.1.moe.gate.w", "h.1.moe.experts.w1", "h.1.moe.experts.b1",
                        "h.1.moe.experts.w2", "h.1.moe.experts.b2", "h.0.mlp.fc.w"}) {
    EXPECT_NE(st.find(std::string("\"") + n + "\""), std::string::npos) << n;
  }
  EXPECT_EQ(st.find("\"h.1.mlp.fc.w\""), std::string::npos);
}

// PR-MoE with a pyramid: layer 0 has 2 experts, layer 1 has 4, each beside its residual MLP;
// it trains, and its parameters are the gate, the experts, the residual MLP and the
// coefficient of each layer.
TEST_F(MoeRun, PyramidResidualMoeTrains) {
  const auto m = manifest("m_pr", false);
  const auto r = train(
      1, config("pr", m, "instance = \"pr\"\nlayers = [0, 1]\nexperts = [2, 4]\nhidden = 32\n"),
      "--fresh");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("0 (2 experts, top-1, residual), 1 (4 experts, top-1, residual)"),
            std::string::npos)
      << r.out;
  const auto t = metrics("pr", "train");
  ASSERT_EQ(t.size(), 20u);
  EXPECT_LT(mean_loss(t, 15, 20), mean_loss(t, 0, 5) - 0.1);
  EXPECT_EQ(t.back()["moe"][0]["load"].size(), 2u);
  EXPECT_EQ(t.back()["moe"][1]["load"].size(), 4u);
  const std::string st = slurp(dir_ / "runs/pr/checkpoints/step_00000020/model.rank0.safetensors");
  for (const char* n : {"h.0.moe.res.fc.w", "h.0.moe.res.proj.b", "h.1.moe.coef.w",
                        "h.1.moe.coef.b", "h.1.moe.experts.w2"}) {
    EXPECT_NE(st.find(std::string("\"") + n + "\""), std::string::npos) << n;
  }
  // Parameters: the embeddings, 2 blocks without their dense MLPs, the final LayerNorm, and
  // per MoE layer the gate E x C, E experts of C -> H -> C, the residual MLP and the
  // coefficient 2 x C + 2.
  const int64_t V = Dataset((dir_ / "data.bin").string()).vocab_size();
  const int64_t C = 16, H = 32;
  const int64_t block = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C;
  const int64_t mlp = 2 * H * C + H + C;
  auto layer = [&](int64_t E) { return E * C + E * mlp + mlp + 2 * C + 2; };
  const auto s = nlohmann::json::parse(slurp(dir_ / "runs/pr/summary.json"));
  EXPECT_EQ(int64_t(s["parameters"]), V * C + 32 * C + 2 * block + 2 * C + layer(2) + layer(4));
}

// 20 steps with aux-loss-free balancing (the bias moves every step) against the same run
// stopped after step 12 and resumed from its step-10 checkpoint: every metric, and the step-20
// weights, optimizer state and [moe] state, bit for bit.
TEST_F(MoeRun, InterruptedAndResumedMatchesUninterruptedBitForBit) {
  const auto m = manifest("m_res", false);
  const std::string moe = "instance = \"bias\"\nlayers = [0, 1]\nexperts = [4, 4]\n";
  const auto full = train(1, config("full", m, moe), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  const auto part = train(1, config("part", m, moe), "--fresh --stop-after 12");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto rest = train(1, config("part", m, moe), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resumed from"), std::string::npos) << rest.out;
  for (const char* type : {"train", "eval"}) {
    const auto a = metrics("full", type), b = metrics("part", type);
    ASSERT_EQ(a.size(), b.size()) << type;
    for (size_t i = 0; i < a.size(); ++i) {
      for (const char* k : {"step", "loss", "eval_loss", "grad_norm", "aux_loss", "moe"}) {
        if (a[i].contains(k)) {
          EXPECT_EQ(a[i][k], b[i][k]) << type << " " << k << " #" << i;
        }
      }
    }
  }
  // The bias moved: the loads differ between the first and the last step.
  const auto t = metrics("full", "train");
  EXPECT_NE(t.front()["moe"][0]["load"], t.back()["moe"][0]["load"]);
  for (const char* f : {"model.rank0.safetensors", "optimizer.rank0.bin", "moe.rank0.bin"}) {
    const fs::path a = dir_ / "runs/full/checkpoints/step_00000020" / f;
    ASSERT_TRUE(fs::exists(a)) << f;
    EXPECT_EQ(slurp(a), slurp(dir_ / "runs/part/checkpoints/step_00000020" / f)) << f;
  }
  // A checkpoint with [moe] state refuses a config without [moe], and the other way round.
  const auto dense = train(1, config("part", m, ""), "--resume");
  EXPECT_EQ(dense.code, 2) << dense.out;
  EXPECT_NE(dense.out.find("was written with [moe] layers, which this config lacks"),
            std::string::npos)
      << dense.out;
}

// bf16 mode ([train] precision = "bf16"): the MoE layers' plugin gets bf16 tensors (the weights
// rounded from the fp32 master weights, x, y, dy and dx) and fp32 weight gradients; the run
// trains, its first loss is within 1% of fp32's (and not the same bits), and stopped after step
// 12 and resumed it matches the uninterrupted run bit for bit.
TEST_F(MoeRun, Bf16TrainsNearFp32AndResumesBitForBit) {
  const auto m = manifest("m_bf16", false);
  const std::string moe = "instance = \"bias\"\nlayers = [0, 1]\nexperts = [4, 4]\n";
  const auto fp = train(1, config("fp", m, moe), "--fresh");
  ASSERT_EQ(fp.code, 0) << fp.out;
  const auto full = train(1, config("bf_full", m, moe, "precision = \"bf16\"\n"), "--fresh");
  ASSERT_EQ(full.code, 0) << full.out;
  const auto tf = metrics("fp", "train"), tb = metrics("bf_full", "train");
  ASSERT_EQ(tb.size(), 20u);
  EXPECT_LT(mean_loss(tb, 15, 20), mean_loss(tb, 0, 5) - 0.1);
  EXPECT_NE(double(tb[0]["loss"]), double(tf[0]["loss"]));
  EXPECT_NEAR(double(tb[0]["loss"]), double(tf[0]["loss"]), 0.01 * double(tf[0]["loss"]));
  const auto part =
      train(1, config("bf_part", m, moe, "precision = \"bf16\"\n"), "--fresh --stop-after 12");
  ASSERT_EQ(part.code, 0) << part.out;
  const auto rest = train(1, config("bf_part", m, moe, "precision = \"bf16\"\n"), "--resume");
  ASSERT_EQ(rest.code, 0) << rest.out;
  const auto tp = metrics("bf_part", "train");
  ASSERT_EQ(tp.size(), tb.size());
  for (size_t i = 0; i < tb.size(); ++i) {
    EXPECT_EQ(tb[i]["loss"], tp[i]["loss"]) << i;
    EXPECT_EQ(tb[i]["moe"], tp[i]["moe"]) << i;
  }
  for (const char* f : {"model.rank0.safetensors", "optimizer.rank0.bin", "moe.rank0.bin"}) {
    EXPECT_EQ(slurp(dir_ / "runs/bf_full/checkpoints/step_00000020" / f),
              slurp(dir_ / "runs/bf_part/checkpoints/step_00000020" / f))
        << f;
  }
}

// loom check plans every MoE layer: k = 3 in a layer of 2 experts, a capacity factor of 0 and
// 3 experts over an expert-parallel group of 2 are reported, naming the layer, before any
// training; a sound config passes.
TEST_F(MoeRun, CheckReportsPlansTheInstanceRefuses) {
  const auto m = manifest("m_check", false);
  const auto ok = train(1, config("c_ok", m, "instance = \"top1\"\nlayers = [0, 1]\n"), "--check");
  EXPECT_EQ(ok.code, 0) << ok.out;
  const auto k3 = train(
      1, config("c_k3", m, "instance = \"top3\"\nlayers = [0, 1]\nexperts = [4, 2]\n"), "--check");
  EXPECT_EQ(k3.code, 2) << k3.out;
  EXPECT_NE(k3.out.find(":10:12: [moe] instance 'top3': plan (layer 1, experts 2): "),
            std::string::npos)
      << k3.out;
  EXPECT_EQ(k3.out.find("plan (layer 0"), std::string::npos) << k3.out;
  const auto mc = manifest("m_cap", false, "[moe.cap0]\nplugin = \"moe\"\ncapacity_factor = 0.0\n");
  const auto cap = train(1, config("c_cap", mc, "instance = \"cap0\"\nlayers = [1]\n"), "--check");
  EXPECT_EQ(cap.code, 2) << cap.out;
  EXPECT_NE(cap.out.find("capacity_factor"), std::string::npos) << cap.out;
  const auto me = manifest("m_ep", true);
  const auto ep =
      train(1, config("c_ep", me, "instance = \"ep\"\nlayers = [1]\nexperts = 3\n"), "--check");
  EXPECT_EQ(ep.code, 2) << ep.out;
  EXPECT_NE(ep.out.find(":12:11: [moe] experts: layer 1 has 3 experts, which the "
                        "expert-parallel group of "),
            std::string::npos)
      << ep.out;
  EXPECT_NE(ep.out.find("ep_size 2 cannot hold evenly"), std::string::npos) << ep.out;
}

// Dropless top-1 over 4 experts without the aux loss (the aux loss of a rank's half batch is
// not half the whole batch's: it multiplies two means), so each token's loss does not depend
// on which rank holds it: 2 ranks with the experts split between them (ep_size 2) follow the
// 1-rank run's loss curve to float rounding (the gradient sums run in another order), and
// stopped and resumed it matches itself bit for bit (each rank's experts in its own files).
// An optimizer that averages every gradient itself (onebit_adam) is refused under ep_size 2.
TEST_F(MoeRun, ExpertParallelTwoRanksFollowOneRank) {
  if (std::string(LOOM_MPIRUN).empty()) GTEST_SKIP() << "mpirun not found";
  const std::string extra = "aux_loss_coef = 0.0\n";
  const auto one = train(
      1, config("ep1", manifest("m_ep1", false), "instance = \"dropless\"\nlayers = [1]\n" + extra),
      "--fresh");
  ASSERT_EQ(one.code, 0) << one.out;
  const auto two = train(
      2,
      config("ep2", manifest("m_ep2", true), "instance = \"ep\"\nlayers = [1]\n" + extra, "", true),
      "--fresh");
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_NE(two.out.find("ep_size 2"), std::string::npos) << two.out;
  const auto a = metrics("ep1", "train"), b = metrics("ep2", "train");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i]["loss"], lb = b[i]["loss"];
    worst = std::max(worst, std::fabs(la - lb) / std::fabs(la));
    EXPECT_EQ(a[i]["moe"][0]["load"], b[i]["moe"][0]["load"]) << "step " << i + 1;
  }
  EXPECT_LT(worst, 1e-4);
  const auto ea = metrics("ep1", "eval"), eb = metrics("ep2", "eval");
  ASSERT_EQ(ea.size(), eb.size());
  for (size_t i = 0; i < ea.size(); ++i) {
    EXPECT_NEAR(double(ea[i]["eval_loss"]), double(eb[i]["eval_loss"]), 1e-4);
  }
  // 2 ranks with every expert on each (an instance without a comm): the trainer averages the
  // experts' gradients over the ranks as the others' (a reduce_gradients over the instance's
  // own world of one would leave each rank's experts trained on its half batch alone).
  const auto dp = train(2,
                        config("dp2", manifest("m_ep2", true),
                               "instance = \"dropless\"\nlayers = [1]\n" + extra, "", true),
                        "--fresh");
  ASSERT_EQ(dp.code, 0) << dp.out;
  const auto d = metrics("dp2", "train");
  ASSERT_EQ(d.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(double(a[i]["loss"]), double(d[i]["loss"]), 1e-4 * double(a[i]["loss"]))
        << "step " << i + 1;
  }
  // Each rank saves its own two experts; stopped after step 12 and resumed from step 10, the
  // expert-parallel run matches its uninterrupted self bit for bit.
  const std::string part = config("ep2part", manifest("m_ep2", true),
                                  "instance = \"ep\"\nlayers = [1]\n" + extra, "", true);
  const auto p1 = train(2, part, "--fresh --stop-after 12");
  ASSERT_EQ(p1.code, 0) << p1.out;
  const auto p2 = train(2, part, "--resume");
  ASSERT_EQ(p2.code, 0) << p2.out;
  const auto c = metrics("ep2part", "train");
  ASSERT_EQ(c.size(), b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b[i]["loss"], c[i]["loss"]) << "step " << i + 1;
    EXPECT_EQ(b[i]["grad_norm"], c[i]["grad_norm"]) << "step " << i + 1;
  }
  for (const char* f : {"model.rank0.safetensors", "model.rank1.safetensors", "moe.rank0.bin",
                        "moe.rank1.bin", "optimizer.rank1.bin"}) {
    const fs::path x = dir_ / "runs/ep2/checkpoints/step_00000020" / f;
    ASSERT_TRUE(fs::exists(x)) << f;
    EXPECT_EQ(slurp(x), slurp(dir_ / "runs/ep2part/checkpoints/step_00000020" / f)) << f;
  }
  EXPECT_NE(slurp(dir_ / "runs/ep2/checkpoints/step_00000020/model.rank0.safetensors"),
            slurp(dir_ / "runs/ep2/checkpoints/step_00000020/model.rank1.safetensors"));
  const auto m1 = manifest("m_ep1bit", true,
                           "[codec.sign]\nplugin = \"onebit\"\n"
                           "[optimizer.compressed]\nplugin = \"onebit_adam\"\ncomm = \"world\"\n"
                           "codec = \"sign\"\n");
  std::string cfg = config("ep1bit", m1, "instance = \"ep\"\nlayers = [1]\n", "", true);
  {
    std::ifstream in(cfg);
    std::stringstream t;
    t << in.rdbuf();
    std::string text = t.str();
    text.insert(text.find("comm = "), "optimizer = \"compressed\"\n");
    std::ofstream(cfg) << text;
  }
  const auto bad = train(2, cfg, "--fresh");
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("ep_size 2 shards the experts over the ranks, but the optimizer "
                         "'onebit_adam' averages every gradient over all ranks itself"),
            std::string::npos)
      << bad.out;
}

}  // namespace
