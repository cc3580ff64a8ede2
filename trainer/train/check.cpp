// loom train --check (what `loom check CONFIG` runs): every problem of a trainer config, of
// the manifest it names and of the dataset, without training.
#include <iostream>
#include <optional>

#include "curriculum_feature.hpp"
#include "moe_layer.hpp"
#include "quantization.hpp"
#include "routing_feature.hpp"
#include "trainer.hpp"

namespace loom::trainer {

// --check (what `loom check CONFIG` runs): every problem of the config, of the manifest it
// names (as `loom check MANIFEST` reports them) and of the dataset, without training. 0 or 2.
int check(const Args& args) {
  TrainConfig c;
  std::vector<std::string> problems;
  try {
    c = read_config(args.config, problems);
  } catch (const ConfigError& e) {
    for (const auto& line : e.errors()) std::cerr << line << "\n";
    return 2;
  }
  for (const auto& line : problems) std::cerr << line << "\n";
  bool ok = problems.empty();
  if (c.manifest.empty()) return 2;  // [manifest] path missing: said above
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  opts.validate_only = 1;
  opts.log_level = LOOM_LOG_WARN;
  opts.plugin_path = args.plugin_path.empty() ? nullptr : args.plugin_path.c_str();
  loom_session* session = nullptr;
  bool manifest_ok = true;
  TrainConfig cc = c;  // the curriculum instances the manifest has, for the checks below
  if (loom_open_file(c.manifest.c_str(), &opts, &session) != LOOM_OK) {
    std::cerr << loom_last_error() << "\n";
    ok = manifest_ok = false;
  } else {
    for (const auto& problem : manifest_name_problems(c)) {
      std::cerr << problem << "\n";
      ok = false;
      if (!c.sampler.empty() && problem.rfind(c.sampler_at + ": [curriculum] sampler", 0) == 0) {
        cc.sampler.clear();
      }
      if (!c.seqlen.empty() && problem.rfind(c.seqlen_at + ": [curriculum] seqlen", 0) == 0) {
        cc.seqlen.clear();
      }
      if (!c.router.empty() && problem.rfind(c.router_at + ": [routing] router", 0) == 0) {
        cc.router.clear();
      }
      if (!c.moe.empty() && problem.rfind(c.moe_at + ": [moe] instance", 0) == 0) cc.moe.clear();
      if (!c.quantizer.empty() &&
          problem.rfind(c.quantizer_at + ": [quantization] quantizer", 0) == 0) {
        cc.quantizer.clear();
      }
    }
  }
  // The MoE instance's expert-parallel size, from the validated manifest.
  int64_t ep_size = 1;
  std::string ep_at;
  if (manifest_ok && !cc.moe.empty()) ep_size = moe_instance_ep_size(session, c, ep_at);
  loom_close(session);
  // A quantized checkpoint: it opens (every header check of the tensor-file reader).
  if (!c.checkpoint.empty()) {
    loom_tensor_file* f = nullptr;
    if (loom_tensor_file_open(c.checkpoint.c_str(), &f) != LOOM_OK) {
      std::cerr << c.checkpoint_at << ": [quantization] checkpoint: " << loom_last_error() << "\n";
      ok = false;
    }
    loom_tensor_file_close(f);
  }
  std::optional<Dataset> ds;
  if (problems.empty()) {  // the dataset checks need a sound config
    try {
      ds.emplace(c.dataset);
      fit_to_dataset(c, *ds);
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";
      ok = false;
      ds.reset();
    }
  }
  // The curriculum's and the router's instances: created (alone: the manifest's [loom],
  // [curriculum.*], [sampler.*] and [router.*]), checked for kind and role, and planned, the
  // sampler over this dataset, the router for every layer at seq_len.
  if (manifest_ok && ds &&
      (!cc.sampler.empty() || !cc.seqlen.empty() || !cc.router.empty() || !cc.quantizer.empty())) {
    loom_open_options co = opts;
    co.validate_only = 0;
    co.sections = kCurriculumSections;
    loom_session* cs = nullptr;
    if (loom_open_file(c.manifest.c_str(), &co, &cs) != LOOM_OK) {
      std::cerr << with_run_values(loom_last_error(), c) << "\n";
      ok = false;
    } else {
      std::vector<std::string> cp;
      Curriculum cur;
      cc.model = c.model;  // the vocabulary size the dataset gave
      cur.open(cs, cc, sample_count(ds->train().size(), c.seq_len), ds->header().payload_checksum,
               1, cp);
      // The router: its kind, and its plan of every layer at seq_len (step 1, training).
      if (!cc.router.empty()) {
        const std::string who = c.router_at + ": [routing] router '" + c.router + "'";
        loom_instance* ri = nullptr;
        if (loom_find_instance(cs, "router", c.router.c_str(), &ri) != LOOM_OK) {
          cp.push_back(who + ": " + loom_last_error());
        } else {
          try {
            PluginRouter router(ri, who, c.seed, c.seq_len, c.model.dim);
            router.set_step(1, 0);
            for (int l = 0; l < c.model.layers; ++l) {
              (void)router.has_weight(l, c.model.layers);
              (void)router.plan(l, c.model.layers, c.batch_size, c.seq_len, true);
            }
          } catch (const std::exception& e) {
            cp.push_back(e.what());
          }
        }
      }
      // The quantizer: its kind, and every selected tensor's shape packed (it refuses a
      // shape its parameters cannot take, naming the tensor).
      if (!cc.quantizer.empty()) {
        const std::string who = c.quantizer_at + ": [quantization] quantizer '" + c.quantizer + "'";
        loom_instance* qi = nullptr;
        if (loom_find_instance(cs, "quantizer", c.quantizer.c_str(), &qi) != LOOM_OK) {
          cp.push_back(who + ": " + loom_last_error());
        } else {
          try {
            auto q = plugin_quantizer(qi, who);
            const int64_t C = c.model.dim;
            for (const auto& name : quantized_tensor_names(c)) {
              int64_t rows = C, cols = C;
              if (name == "wte") rows = c.model.vocab_size;
              if (name == "wpe") rows = c.model.context;
              if (name.find("attn.qkv.w") != std::string::npos) rows = 3 * C;
              if (name.find("mlp.fc.w") != std::string::npos) rows = 4 * C;
              if (name.find("mlp.proj.w") != std::string::npos) cols = 4 * C;
              std::vector<float> zeros(static_cast<size_t>(rows * cols), 0.0f);
              (void)q->pack(name, zeros.data(), rows, cols);
            }
          } catch (const std::exception& e) {
            cp.push_back(e.what());
          }
        }
      }
      for (const auto& line : cp) std::cerr << line << "\n";
      ok = ok && cp.empty();
      if (cp.empty()) {
        for (const auto& w : cur.warnings(cc)) std::cerr << w << "\n";
      }
      loom_close(cs);
    }
  }
  // The MoE instance (alone: the manifest's [loom] and [moe.*], without its comm) and its
  // plan of every [moe] layer (training and evaluation at the batch's tokens); the experts'
  // split over the expert-parallel group is checked here, the group needing the comm.
  if (manifest_ok && problems.empty() && !cc.moe.empty()) {
    std::vector<std::string> mp;
    const std::string text = moe_check_manifest(c);
    const std::string who = c.moe_at + ": [moe] instance '" + c.moe + "'";
    loom_open_options mo = opts;
    mo.validate_only = 0;
    loom_session* ms = nullptr;
    if (text.empty()) {
      mp.push_back(who + ": " + c.manifest +
                   " could not be read as tables, one key per line, to plan the MoE layers");
    } else if (loom_open_string(text.c_str(), c.manifest.c_str(), &mo, &ms) != LOOM_OK) {
      mp.push_back(loom_last_error());
    } else {
      loom_instance* mi = nullptr;
      if (loom_find_instance(ms, "moe", c.moe.c_str(), &mi) != LOOM_OK) {
        mp.push_back(who + ": " + loom_last_error());
      } else {
        const int hidden = c.moe_hidden > 0 ? c.moe_hidden : 4 * c.model.dim;
        const int64_t tokens = static_cast<int64_t>(c.batch_size) * c.seq_len;
        for (size_t i = 0; i < c.moe_layers.size(); ++i) {
          try {
            for (const bool training : {true, false}) {
              const loom_moe_plan_args p = MoeLayer::plan_layer(
                  mi, who, c.moe_layers[i], c.model.layers, c.model.dim, hidden, c.moe_experts[i],
                  tokens, training, c.precision == "bf16");
              if (training && ep_size > 1 && p.experts % ep_size != 0) {
                mp.push_back(c.moe_experts_at + ": [moe] experts: layer " +
                             std::to_string(c.moe_layers[i]) + " has " + std::to_string(p.experts) +
                             " experts, which the expert-parallel group of " + ep_at + " ep_size " +
                             std::to_string(ep_size) + " cannot hold evenly (a multiple of " +
                             std::to_string(ep_size) + " is needed)");
              }
            }
          } catch (const std::exception& e) {
            mp.push_back(e.what());
          }
        }
      }
      loom_close(ms);
    }
    for (const auto& line : mp) std::cerr << line << "\n";
    ok = ok && mp.empty();
  }
  if (problems.empty()) {
    for (const auto& w : config_warnings(c)) std::cerr << w << "\n";
  }
  if (!ok) return 2;
  std::cout << args.config << ": ok (trainer config; manifest " << c.manifest << ", dataset "
            << c.dataset << ")\n";
  return 0;
}

}  // namespace loom::trainer
