// loom-plot (run as `loom plot RUN_DIR... -o FILE.png|FILE.svg`): train and eval loss curves of one
// or several runs and their communication volume, drawn by gnuplot (Debian's gnuplot-nox) from each
// RUN_DIR/metrics.jsonl; beside them the sampler's difficulty and the sequence length per step
// when a run has a curriculum (a `difficulty` field, a `seq_len` that changes), and the expert
// load of its last MoE layer when a run has [moe] layers (a `moe` field).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <loom_cli_support.hpp>
#include <nlohmann/json.hpp>
#include <sstream>

namespace fs = std::filesystem;

namespace {

std::string quote(const std::string& s) {  // a gnuplot string literal
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o.push_back('\\');
    o.push_back(c);
  }
  return o + "\"";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Plot the loss curves and communication volume of training runs"};
  loom_cli::configure(app, "loom plot");
  std::vector<std::string> runs;
  std::string out;
  std::string title;
  app.add_option("RUN_DIR", runs, "Run directories (each with metrics.jsonl)")
      ->required()
      ->type_name("DIR");
  app.add_option("-o,--output", out,
                 "The image to write: FILE.png or FILE.svg (its folder must exist)")
      ->required()
      ->type_name("FILE");
  app.add_option("--title", title, "Title above the plots");
  double loss_max = 0;
  app.add_option("--loss-max", loss_max,
                 "Top of the loss axis (default: a little above the loss a tenth into the "
                 "runs, so early losses do not flatten the rest; set it to show spikes)")
      ->check(loom_cli::number_in(0.0, 1e9, false))
      ->type_name("Y");
  if (const int rc = loom_cli::parse(app, argc, argv, true); rc >= 0) return rc;
  // The format follows the file name; anything else is refused rather than written as PNG.
  const std::string ext = fs::path(out).extension().string();
  std::string terminal;
  if (ext == ".png") {
    terminal = "pngcairo noenhanced size WIDTH,520 font \",10\"";
  } else if (ext == ".svg") {
    terminal = "svg noenhanced size WIDTH,520 font \",10\" dynamic background \"white\"";
  } else {
    return loom_cli::usage_error("loom plot",
                                 "-o " + out + ": the file name must end in .png or .svg");
  }
  try {
    std::error_code ec;
    const fs::path parent = fs::path(out).parent_path();
    if (!parent.empty() && !fs::is_directory(parent, ec)) {
      throw std::runtime_error(out + ": the folder " + parent.string() +
                               " does not exist (create it first)");
    }
    char tmpl[] = "/tmp/loom-plot-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("cannot create a temporary folder");
    const fs::path tmp = tmpl;
    std::vector<std::string> labels;
    std::vector<double> losses;
    double ymin = 1e30, ymax = 0, ymax_all = 0;
    // The curriculum panels: drawn when some run has a difficulty, or a seq_len that changes.
    bool has_difficulty = false, seq_len_varies = false;
    // The expert-load panel: the first run with MoE layers, its last layer's share of the
    // choices per expert at each logged step.
    int moe_run = -1, moe_layer = -1;
    size_t moe_experts = 0;
    for (size_t r = 0; r < runs.size(); ++r) {
      const fs::path m = fs::path(runs[r]) / "metrics.jsonl";
      // A folder opens as a stream but fails on the first read with an error that names no
      // path; say which path is wrong instead.
      if (fs::is_directory(m, ec))
        throw std::runtime_error(m.string() + ": is a folder, not a file");
      std::ifstream in(m);
      if (!in) throw std::runtime_error(m.string() + ": cannot open (is it a run directory?)");
      std::ofstream tr(tmp / ("train" + std::to_string(r) + ".dat"));
      std::ofstream ev(tmp / ("eval" + std::to_string(r) + ".dat"));
      std::string line;
      size_t n = 0, lineno = 0;
      int64_t first_seq_len = -1;
      // A run killed mid-write leaves a torn line (often the last); plot the rest and name
      // each skipped line, the first few of them, so a long damaged file stays readable.
      constexpr size_t kTornShown = 10;
      size_t torn = 0;
      while (std::getline(in, line)) {
        ++lineno;
        if (line.empty()) continue;
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_discarded() || !j.is_object()) {
          if (++torn <= kTornShown) {
            std::cerr << "loom plot: warning: " << m.string() << ":" << lineno
                      << ": not JSON, skipped\n";
          }
          continue;
        }
        const std::string type = j.value("type", "");
        if (type == "train") {
          losses.push_back(j.value("loss", 0.0));
          tr << j.value("step", 0) << " " << j.value("loss", 0.0) << " "
             << j.value("comm_bytes_sent", 0.0) / 1e6 << " "
             << j.value("uncompressed_bytes", 0.0) / 1e6 << " ";
          // Columns 5 and 6: seq_len and difficulty, "?" (missing) where the line has none.
          const auto sl = j.find("seq_len");
          if (sl != j.end() && sl->is_number()) {
            const int64_t v = sl->get<int64_t>();
            if (first_seq_len < 0) first_seq_len = v;
            seq_len_varies = seq_len_varies || v != first_seq_len;
            tr << v << " ";
          } else {
            tr << "? ";
          }
          const auto moe = j.find("moe");
          if (moe != j.end() && moe->is_array() && !moe->empty() && moe->back().is_object() &&
              (moe_run < 0 || moe_run == static_cast<int>(r))) {
            const auto& l = moe->back();
            const auto load = l.find("load");
            if (load != l.end() && load->is_array() && !load->empty() &&
                (moe_run < 0 || load->size() == moe_experts)) {
              std::ofstream md(tmp / "moe.dat", moe_run < 0 ? std::ios::trunc : std::ios::app);
              moe_run = static_cast<int>(r);
              moe_layer = l.value("layer", -1);
              moe_experts = load->size();
              double total = 0;
              for (const auto& v : *load) total += v.is_number() ? v.get<double>() : 0.0;
              md << j.value("step", 0);
              for (const auto& v : *load)
                md << " " << (total > 0 && v.is_number() ? v.get<double>() / total : 0.0);
              md << "\n";
            }
          }
          const auto d = j.find("difficulty");
          if (d != j.end() && d->is_number()) {
            has_difficulty = true;
            tr << d->get<double>() << "\n";
          } else {
            tr << "?\n";
          }
          ++n;
        } else if (type == "eval") {
          ev << j.value("step", 0) << " " << j.value("eval_loss", 0.0) << "\n";
        }
      }
      if (torn > kTornShown) {
        std::cerr << "loom plot: warning: " << m.string() << ": " << torn - kTornShown
                  << " more lines not JSON, skipped\n";
      }
      if (n == 0) throw std::runtime_error(m.string() + ": no train records");
      // The y range: from the lowest loss to a little above the loss a tenth into the run,
      // so the first steps' large losses do not flatten the part worth comparing.
      for (double l : losses) ymin = std::min(ymin, l);
      ymax = std::max(ymax, losses[losses.size() / 10] * 1.15);
      ymax_all = std::max(ymax_all, *std::max_element(losses.begin(), losses.end()));
      losses.clear();
      labels.push_back(fs::path(runs[r]).lexically_normal().filename().string());
      if (labels.back().empty())
        labels.back() = fs::path(runs[r]).parent_path().filename().string();
    }
    ymax = std::min(ymax, ymax_all * 1.02);
    ymin *= 0.97;
    if (loss_max > 0) ymax = std::max(loss_max, ymin * 1.01);
    const int panels =
        2 + (has_difficulty ? 1 : 0) + (seq_len_varies ? 1 : 0) + (moe_run >= 0 ? 1 : 0);
    terminal.replace(terminal.find("WIDTH"), 5, std::to_string(700 * panels));
    std::ostringstream g;
    g << "set terminal " << terminal << "\n"
      << "set output " << quote(out) << "\n"
      << "set datafile missing \"?\"\n"
      << "set multiplot layout 1," << panels << " title " << quote(title) << "\n"
      << "set grid\nset key top right\nset xlabel \"step\"\nset ylabel \"loss (nats/token)\"\n"
      << "set yrange [" << ymin << ":" << ymax << "]\n"
      << "set title \"train (lines) and eval (points) loss\"\nplot ";
    for (size_t r = 0; r < runs.size(); ++r) {
      const auto tf = (tmp / ("train" + std::to_string(r) + ".dat")).string();
      const auto ef = (tmp / ("eval" + std::to_string(r) + ".dat")).string();
      g << (r ? ", " : "") << quote(tf) << " using 1:2 with lines lw 1.5 lc " << r + 1 << " title "
        << quote(labels[r] + " train") << ", " << quote(ef)
        << " using 1:2 with linespoints pt 7 ps 0.8 lc " << r + 1 << " dt 2 title "
        << quote(labels[r] + " eval");
    }
    g << "\nset autoscale y\nset ylabel \"MB sent by rank 0 (cumulative)\"\nset key top left\n"
      << "set title \"gradient-sync communication (dashed: uncompressed fp32 allreduce)\"\nplot ";
    for (size_t r = 0; r < runs.size(); ++r) {
      const auto tf = (tmp / ("train" + std::to_string(r) + ".dat")).string();
      g << (r ? ", " : "") << quote(tf) << " using 1:3 with lines lw 2 lc " << r + 1 << " title "
        << quote(labels[r]) << ", " << quote(tf) << " using 1:4 with lines dt 2 lc " << r + 1
        << " notitle";
    }
    // The curriculum: the sampler's difficulty and the step's sequence length.
    auto curriculum_panel = [&](int column, const char* ylabel, const char* what) {
      g << "\nset autoscale y\nset ylabel " << quote(ylabel) << "\nset key bottom right\n"
        << "set title " << quote(what) << "\nplot ";
      for (size_t r = 0; r < runs.size(); ++r) {
        const auto tf = (tmp / ("train" + std::to_string(r) + ".dat")).string();
        g << (r ? ", " : "") << quote(tf) << " using 1:" << column << " with steps lw 2 lc "
          << r + 1 << " title " << quote(labels[r]);
      }
    };
    if (has_difficulty) {
      curriculum_panel(6, "difficulty", "curriculum: the sampler's difficulty per step");
    }
    if (seq_len_varies) {
      curriculum_panel(5, "sequence length (tokens)", "sequence-length warmup: seq_len per step");
    }
    if (moe_run >= 0) {
      const auto mf = (tmp / "moe.dat").string();
      g << "\nset yrange [0:*]\nset ylabel \"share of the layer's choices\"\nset key top right\n"
        << "set title "
        << quote("expert load: " + labels[static_cast<size_t>(moe_run)] + ", MoE layer " +
                 std::to_string(moe_layer) +
                 " (uniform: " + loom_cli::number(1.0 / static_cast<double>(moe_experts)) + ")")
        << "\nplot ";
      for (size_t e = 0; e < moe_experts; ++e) {
        g << (e ? ", " : "") << quote(mf) << " using 1:" << e + 2 << " with lines lw 1.5 title "
          << quote("expert " + std::to_string(e));
      }
    }
    g << "\nunset multiplot\n";
    const fs::path script = tmp / "plot.gp";
    {
      std::ofstream s(script);
      s << g.str();
    }
    const std::string cmd = "gnuplot " + script.string() + " 2>" + (tmp / "err.txt").string();
    int rc = std::system(cmd.c_str());
    if (rc != 0) {
      std::ifstream e(tmp / "err.txt");
      std::stringstream es;
      es << e.rdbuf();
      fs::remove_all(tmp, ec);
      throw std::runtime_error(
          "gnuplot failed (install gnuplot-nox; scripts/install-deps.sh "
          "does): " +
          es.str());
    }
    fs::remove_all(tmp, ec);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "loom plot: error: " << e.what() << "\n";
    return 2;
  }
}
