// The process's thread count with every bundled plugin loaded and run, under
// LOOM_NUM_THREADS=2 (set by CMake): loading plugins starts no thread, their kernels run on
// the host's one pool (one worker, named loom-pool, beside the calling thread), and nothing
// else starts threads while they run. Before the host pool, each plugin library started a
// pool of its own on its first kernel: one more worker per library here.
#include <dirent.h>
#include <gtest/gtest.h>
#include <loom/embed.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

namespace {

// Thread name -> how many threads of this process have it (/proc/self/task/*/comm).
std::map<std::string, int> threads() {
  std::map<std::string, int> out;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return out;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    std::getline(in, name);
    ++out[name];
  }
  closedir(dir);
  return out;
}

int total(const std::map<std::string, int>& t) {
  int n = 0;
  for (const auto& [name, count] : t) n += count;
  return n;
}

int count(const std::map<std::string, int>& t, const std::string& name) {
  const auto it = t.find(name);
  return it == t.end() ? 0 : it->second;
}

std::string show(const std::map<std::string, int>& t) {
  std::string s;
  for (const auto& [name, n] : t) s += name + " x" + std::to_string(n) + "; ";
  return s;
}

// The threads that are not the pool's.
std::map<std::string, int> others(std::map<std::string, int> t) {
  t.erase("loom-pool");
  return t;
}

std::set<std::string> bundled_plugins() {
  char* json = nullptr;
  EXPECT_EQ(loom_describe_plugins(nullptr, nullptr, &json), LOOM_OK) << loom_last_error();
  std::set<std::string> names;
  if (json == nullptr) return names;
  const auto doc = nlohmann::json::parse(json);
  loom_free_string(json);
  for (const auto& p : doc.at("plugins")) names.insert(p.at("name").get<std::string>());
  EXPECT_TRUE(doc.at("errors").empty()) << doc.at("errors").dump();
  return names;
}

TEST(ThreadBudget, PluginsRunOnTheHostsPoolAndStartNoThreadsOfTheirOwn) {
  const char* env = std::getenv("LOOM_NUM_THREADS");
  ASSERT_TRUE(env != nullptr && std::string(env) == "2") << "run with LOOM_NUM_THREADS=2";
  ::unsetenv("LOOM_PLUGIN_PATH");  // the bundled plugins only
  const auto start = threads();
  ASSERT_EQ(count(start, "loom-pool"), 0);

  // Loading (and describing) every bundled plugin starts nothing.
  const std::set<std::string> plugins = bundled_plugins();
  ASSERT_TRUE(plugins.count("adam") == 1 && plugins.count("lamb") == 1)
      << "the bundled optimizers are not built";
  const auto loaded = threads();
  EXPECT_EQ(loaded, start) << "loading the plugins started threads: " << show(loaded);

  // An instance of each: the 1-bit optimizers over the ucx transport with each codec.
  std::string toml = "[optimizer.adam]\nplugin = \"adam\"\n[optimizer.lamb]\nplugin = \"lamb\"\n";
  std::vector<std::string> optimizers = {"adam", "lamb"};
  const bool onebit = plugins.count("ucx") == 1 && plugins.count("onebit") == 1;
  if (onebit) {
    toml += "[comm.world]\nplugin = \"ucx\"\n[codec.onebit]\nplugin = \"onebit\"\n";
    std::vector<std::string> codecs = {"onebit"};
    if (plugins.count("ef8") == 1) {
      toml += "[codec.ef8]\nplugin = \"ef8\"\n";
      codecs.emplace_back("ef8");
    }
    for (const char* p : {"onebit_adam", "zero_one_adam", "onebit_lamb"}) {
      if (plugins.count(p) == 0) continue;
      for (const auto& c : codecs) {
        const std::string name = std::string(p) + "_" + c;
        const char* freeze = std::string(p) == "zero_one_adam" ? "var_freeze_step" : "freeze_step";
        toml += "[optimizer." + name + "]\nplugin = \"" + p + "\"\ncomm = \"world\"\ncodec = \"" +
                c + "\"\n" + freeze + " = 2\n";
        optimizers.push_back(name);
      }
    }
  }
  loom_session* session = nullptr;
  ASSERT_EQ(loom_open_string(toml.c_str(), "budget.toml", nullptr, &session), LOOM_OK)
      << loom_last_error();
  const auto opened = threads();

  // Steps on tensors large enough that every kernel splits its work (past the freeze step, so
  // the 1-bit optimizers compress through their codec).
  constexpr size_t kN = size_t{1} << 18;
  std::vector<float> param(kN, 0.5F);
  std::vector<float> grad(kN);
  for (size_t i = 0; i < kN; ++i) grad[i] = static_cast<float>(i % 13) * 0.01F - 0.06F;
  for (const auto& name : optimizers) {
    loom_instance* inst = nullptr;
    ASSERT_EQ(loom_find_instance(session, "optimizer", name.c_str(), &inst), LOOM_OK)
        << loom_last_error();
    float* params[1] = {param.data()};
    const float* grads[1] = {grad.data()};
    const int64_t numels[1] = {static_cast<int64_t>(kN)};
    for (int step = 0; step < 4; ++step) {
      ASSERT_EQ(loom_optimizer_step_f32(inst, params, grads, numels, 1, 1e-3), LOOM_OK)
          << name << ": " << loom_last_error();
    }
  }
  const auto ran = threads();
  EXPECT_EQ(loom_thread_count(), 2U);
  EXPECT_EQ(count(ran, "loom-pool"), 1) << show(ran);
  EXPECT_EQ(others(ran), others(opened))
      << "running the plugins started threads other than the pool's: before " << show(opened)
      << "after " << show(ran);
  // All told: the caller, the pool's worker, and what the transport keeps (its progress
  // thread, when it has one).
  EXPECT_LE(total(ran), total(start) + 1 + (onebit ? 2 : 0)) << show(ran);
  loom_close(session);
}

}  // namespace
