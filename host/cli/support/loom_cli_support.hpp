// The command-line conventions that `loom` and the programs it runs (loom-train, loom-data,
// loom-plot, loom-bench-NAME) share, so that they all behave alike:
//  - `--help` prints one help format (options, their value, the default) on stdout, exit 0;
//  - a usage error prints one line, "PROGRAM: PROBLEM (see 'PROGRAM --help')", on stderr and
//    exits 2 (kExitUsage); CLI11's own exit codes never reach the user;
//  - a program that needs arguments prints its usage on stderr and exits 2 when run bare;
//  - numbers in messages are printed in shortest round-trip form;
//  - long work reports progress on stderr every few seconds (Progress).
// Header-only: it depends on CLI11 and the standard library, nothing of Loom's.
#pragma once

#include <CLI/CLI.hpp>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <loom_text.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom_cli {

inline constexpr int kExitUsage = 2;

// Shortest round-trip text for numbers in messages (loom_text.hpp).
using loom_text::number;

// A size as the benchmarks take it: a positive number with an optional K, M or G suffix
// (binary multiples: 1K = 1024). Anything else ("1X", "1MB", "", "-1", "1M5") is refused.
inline std::optional<std::size_t> parse_size(std::string_view s) {
  size_t digits = 0;
  bool dot = false;
  while (digits < s.size() &&
         ((s[digits] >= '0' && s[digits] <= '9') || (s[digits] == '.' && !dot))) {
    dot |= s[digits] == '.';
    ++digits;
  }
  const std::string_view num = s.substr(0, digits), suffix = s.substr(digits);
  if (num.empty() || num == ".") return std::nullopt;
  double mult = 1;
  if (suffix == "K" || suffix == "k") {
    mult = 1024.0;
  } else if (suffix == "M" || suffix == "m") {
    mult = 1024.0 * 1024.0;
  } else if (suffix == "G" || suffix == "g") {
    mult = 1024.0 * 1024.0 * 1024.0;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  const double v = std::strtod(std::string(num).c_str(), nullptr) * mult;
  if (!(v >= 1) || v > 1e18 || v != std::trunc(v)) return std::nullopt;
  return static_cast<std::size_t>(v);
}

// A CLI11 validator for parse_size, so a bad size is a usage error naming the option.
inline CLI::Validator size_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (parse_size(s)) return {};
        return "'" + s + "' is not a size (a positive whole number, optionally with K, M or G)";
      },
      "", "SIZE");
}

// A CLI11 validator for a whole number in [lo, hi]: "'abc' is not a whole number in [1, 100]".
inline CLI::Validator integer_in(long long lo, long long hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        long long v = 0;
        const auto r = std::from_chars(s.data(), s.data() + s.size(), v);
        if (r.ec == std::errc() && r.ptr == s.data() + s.size() && v >= lo && v <= hi) return {};
        return "'" + s + "' is not a whole number in [" + std::to_string(lo) + ", " +
               std::to_string(hi) + "]";
      },
      "", "");
}

// A CLI11 validator for a number in [lo, hi) (or [lo, hi] when `hi_closed`).
inline CLI::Validator number_in(double lo, double hi, bool hi_closed) {
  return CLI::Validator(
      [lo, hi, hi_closed](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        const bool in = v >= lo && (hi_closed ? v <= hi : v < hi);
        if (!s.empty() && end == s.c_str() + s.size() && in) return {};
        return "'" + s + "' is not a number in [" + number(lo) + ", " + number(hi) +
               (hi_closed ? "]" : ")");
      },
      "", "");
}

// The help format: "  --iters N    Timed iterations per size (default: 10)".
class Formatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* opt) const override {
    std::string out;
    if (opt->get_type_size() != 0 && !opt->get_type_name().empty()) {
      out += " " + opt->get_type_name();
      const bool listed = out.size() >= 3 && out.compare(out.size() - 3, 3, "...") == 0;
      if (opt->get_expected_max() == CLI::detail::expected_max_vector_size && !listed) {
        out += " ...";
      }
    }
    if (!opt->get_excludes().empty()) {
      out += " (not with";
      for (const CLI::Option* o : opt->get_excludes()) out += " " + o->get_name();
      out += ")";
    }
    return out;
  }
  std::string make_option_desc(const CLI::Option* opt) const override {
    std::string d = opt->get_description();
    if (opt->get_required()) d += " (required)";
    if (opt->get_type_size() != 0 && !opt->get_default_str().empty() &&
        opt->get_default_str() != "[]") {
      d += " (default: " + opt->get_default_str() + ")";
    }
    return d;
  }
};

// Gives `app` the shared help format. `name` is the command as the user types it ("loom
// train"), which help and messages use instead of argv[0] (an absolute build path).
inline void configure(CLI::App& app, const std::string& name) {
  app.name(name);
  auto f = std::make_shared<Formatter>();
  f->column_width(34);
  f->label("OPTIONS", "OPTIONS");
  app.formatter(f);
  app.option_defaults()->always_capture_default();
}

// The command name of the deepest subcommand the user gave ("loom data prepare").
inline std::string command_path(const CLI::App& app) {
  std::string out = app.get_name();
  const CLI::App* a = &app;
  for (;;) {
    const CLI::App* next = nullptr;
    for (const CLI::App* s : a->get_subcommands()) {
      if (s->parsed()) next = s;
    }
    if (next == nullptr) return out;
    out += " " + next->get_name();
    a = next;
  }
}

// Prints a usage error the shared way and returns kExitUsage.
inline int usage_error(const std::string& command, std::string problem) {
  for (char& c : problem) {
    if (c == '\n') c = ' ';
  }
  while (!problem.empty() && problem.back() == ' ') problem.pop_back();
  // CLI11 starts its messages with a capital ("The following argument..."); names stay.
  if (problem.size() > 1 && std::isupper(static_cast<unsigned char>(problem[0])) &&
      std::islower(static_cast<unsigned char>(problem[1]))) {
    problem[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(problem[0])));
  }
  std::cerr << command << ": " << problem << " (see '" << command << " --help')\n";
  return kExitUsage;
}

// Parses the command line. Returns -1 when the program should go on, else the exit code:
// 0 after printing help, kExitUsage after a usage error (or a bare run when `bare_is_usage`).
inline int parse(CLI::App& app, int argc, char** argv, bool bare_is_usage) {
  if (argc <= 1 && bare_is_usage) {
    std::cerr << app.help();
    return kExitUsage;
  }
  // CLI11 would say "A subcommand is required" about a mistyped one.
  const auto subs = app.get_subcommands({});
  if (argc > 1 && !subs.empty() && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const CLI::App* s : subs) {
      known |= s->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + s->get_name();
    }
    if (!known) {
      return usage_error(app.get_name(),
                         "unknown command '" + std::string(argv[1]) + "' (one of: " + names + ")");
    }
  }
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(command_path(app), e.what());
  }
}

// A progress line on stderr at most every few seconds: "loom data: training BPE: 1200/4096
// merges (29%), 25.3 merges/s, ETA 1m53s". LOOM_PROGRESS_INTERVAL (seconds) changes the
// interval; 0 prints every update (tests use it).
class Progress {
 public:
  Progress(std::string prefix, std::string unit, double total)
      : prefix_(std::move(prefix)), unit_(std::move(unit)), total_(total) {
    if (const char* e = std::getenv("LOOM_PROGRESS_INTERVAL")) {
      char* end = nullptr;
      const double v = std::strtod(e, &end);
      if (end != e && v >= 0) interval_ = v;
    }
    start_ = last_ = Clock::now();
  }
  // Reports `done` units of `total`; prints when the interval has passed since the last line.
  void update(double done) {
    const auto now = Clock::now();
    if (std::chrono::duration<double>(now - last_).count() < interval_) return;
    last_ = now;
    print(done, now);
  }
  // The last line, when any line was printed before (short work stays silent).
  void finish(double done) {
    if (printed_) print(done, Clock::now());
  }

 private:
  using Clock = std::chrono::steady_clock;
  static std::string duration(double s) {
    char b[32];
    if (!(s < 1e9)) return "?";
    if (s < 60) {
      std::snprintf(b, sizeof(b), "%.0fs", s);
    } else if (s < 3600) {
      std::snprintf(b, sizeof(b), "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
    } else {
      std::snprintf(b, sizeof(b), "%dh%02dm", static_cast<int>(s) / 3600,
                    (static_cast<int>(s) / 60) % 60);
    }
    return b;
  }
  void print(double done, Clock::time_point now) {
    const double t = std::chrono::duration<double>(now - start_).count();
    const double rate = t > 0 ? done / t : 0;
    char line[256];
    const int digits = total_ == std::trunc(total_) ? 0 : 1;  // "1200/4096 merges", "3.5/12.2 MiB"
    std::snprintf(line, sizeof(line), "%s: %.*f/%.*f %s (%.0f%%), %.1f %s/s, ETA %s",
                  prefix_.c_str(), digits, done, digits, total_, unit_.c_str(),
                  total_ > 0 ? 100.0 * done / total_ : 100.0, rate, unit_.c_str(),
                  rate > 0 ? duration((total_ - done) / rate).c_str() : "?");
    std::cerr << line << std::endl;
    printed_ = true;
  }
  std::string prefix_, unit_;
  double total_;
  double interval_ = 5.0;
  bool printed_ = false;
  Clock::time_point start_, last_;
};

}  // namespace loom_cli
