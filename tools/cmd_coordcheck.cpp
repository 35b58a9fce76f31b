// `moka coordcheck`: mean |activation| over widths (base x multipliers) after 0..N steps at a
// high constant LR; writes a CSV, draws the curves, and prints the slope of log(metric) against
// log(width) per activation (flat under muP, growing under SP).
#include <cstdio>
#include <iostream>
#include <limits>
#include <sstream>

#include "commands.hpp"
#include "core/atomic_file.hpp"
#include "train/mup_experiments.hpp"
#include "train_options.hpp"

namespace moka::cli {
namespace {

struct CoordCheckCommand {
  TrainCliOptions options;
  std::string multipliers = "1,2,4,8,16";
  int steps = 5;
  std::string csv = "coordcheck.csv", plot = "coordcheck.png";
};

// Built whole, then written atomically: a failed write leaves the previous CSV (or none).
void write_csv(const std::string& path, const std::string& param, const train::CoordCheckResult& r) {
  std::ostringstream out;
  out << "param,width,step,activation,mean_abs\n";
  for (const auto& row : r.rows)
    for (int a = 0; a < train::ActivationStats::kCount; ++a)
      out << param << ',' << row.width << ',' << row.step << ',' << train::ActivationStats::name(a) << ','
          << row.stats.value(a) << '\n';
  core::write_file_atomically(path, out.view());
}

void print_slopes(const train::CoordCheckResult& r) {
  std::printf("slope of log(mean |x|) vs log(width)\n%-6s", "step");
  for (int a = 0; a < train::ActivationStats::kCount; ++a) std::printf("%15s", train::ActivationStats::name(a));
  std::printf("\n");
  for (size_t s = 0; s < r.slopes.size(); ++s) {
    std::printf("%-6zu", s);
    for (double v : r.slopes[s]) std::printf("%15.3f", v);
    std::printf("\n");
  }
}

void run(CoordCheckCommand& c) {
  train::CoordCheckConfig config;
  config.multipliers = parse_multipliers(c.multipliers);
  check_output_path("--csv", c.csv);
  if (!c.plot.empty()) check_plotter(c.plot);
  c.options.steps = c.steps + 1;
  config.train = c.options.resolve_widths(config.multipliers, 1);  // one width after the other
  config.steps = c.steps;
  const auto text = c.options.load_text();
  const auto result = train::coord_check(config, text);
  write_csv(c.csv, c.options.parameterization, result);
  print_slopes(result);
  std::cout << "wrote " << c.csv << "\n";
  if (!c.plot.empty()) draw_plot("coordcheck", c.csv, c.plot);
}

}  // namespace

void register_coordcheck(CLI::App& app) {
  auto c = std::make_shared<CoordCheckCommand>();
  auto* cmd = app.add_subcommand("coordcheck", "muP coordinate check: activation size vs width over a few steps");
  c->options.train.adam.lr = 1e-2;
  c->options.train.adam.weight_decay = 0.0;
  c->options.schedule = "constant";
  add_train_options(cmd, c->options, SharedOptions{.steps = false, .lr = true});
  cmd->add_option("--mults", c->multipliers, "width multipliers of the base model")->capture_default_str();
  // N + 1 optimizer steps run: N stays below the int range's end.
  cmd->add_option("--check-steps", c->steps, "record after 0..N updates")
      ->capture_default_str()
      ->check(CLI::Range(0, std::numeric_limits<int>::max() - 1));
  cmd->add_option("--csv", c->csv, "CSV output")->capture_default_str();
  cmd->add_option("--plot", c->plot, "plot image ('' = none; needs python3 with matplotlib)")->capture_default_str();
  cmd->callback([c] { run(*c); });
}

}  // namespace moka::cli
