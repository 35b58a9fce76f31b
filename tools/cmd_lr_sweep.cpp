// `moka lr-sweep`: trains every (width, LR) of a grid, in parallel runs, fits
// L = a (log eta)^2 + b log eta + c per width for eta*, prints the drift
// log2(eta*_widest / eta*_base) and draws loss against LR per width with the optima marked.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <thread>

#include "commands.hpp"
#include "train/mup_experiments.hpp"
#include "train_options.hpp"

namespace moka::cli {
namespace {

struct LrSweepCommand {
  TrainCliOptions options;
  std::string multipliers = "1,2,4,8";
  double lr_min = std::ldexp(1.0, -10), lr_max = std::ldexp(1.0, -4);
  int lr_points = 7;
  int workers = 0;
  int eval_batches = 8;
  std::string csv = "lr_sweep.csv", plot = "lr_sweep.png";
};

std::vector<double> log_grid(double lo, double hi, int n) {
  require(hi > lo, ErrorCode::invalid_argument, "--lr-min must be below --lr-max");
  std::vector<double> out;
  for (int i = 0; i < n; ++i) out.push_back(lo * std::pow(hi / lo, double(i) / double(n - 1)));
  return out;
}

void write_csv(const std::string& path, const std::string& param, const train::LrSweepResult& r) {
  std::ofstream out(path);
  require(bool(out), ErrorCode::io, "cannot write " + path);
  out << "kind,param,width,lr,loss,a,b,c\n";
  for (const auto& p : r.points) out << "point," << param << ',' << p.width << ',' << p.lr << ',' << p.loss << ",,,\n";
  for (const auto& o : r.optima)
    out << "optimum," << param << ',' << o.width << ',' << o.eta_star << ",," << o.fit.a << ',' << o.fit.b << ','
        << o.fit.c << '\n';
}

void run(LrSweepCommand& c) {
  train::LrSweepConfig config;
  config.multipliers = parse_multipliers(c.multipliers);
  config.lrs = log_grid(c.lr_min, c.lr_max, c.lr_points);
  check_output_path("--csv", c.csv);
  if (!c.plot.empty()) check_plotter(c.plot);
  config.train = c.options.resolve(1);
  config.eval_batches = c.eval_batches;
  config.workers = c.workers > 0                           ? c.workers
                   : config.train.backend == Backend::cuda ? 4
                                                           : int(std::max(1u, std::thread::hardware_concurrency()));
  const auto text = c.options.load_text();
  const auto result = train::lr_sweep(config, text, [](const train::SweepPoint& p, int done, int total) {
    std::fprintf(stderr, "[%d/%d] width %lld lr %.3e: validation loss %.4f\n", done, total, (long long)p.width, p.lr,
                 p.loss);
  });
  write_csv(c.csv, c.options.parameterization, result);
  std::printf("%-8s %12s %8s %12s %10s\n", "width", "eta*", "fit", "best grid", "loss");
  for (const auto& o : result.optima)
    std::printf("%-8lld %12.3e %8s %12.3e %10.4f\n", (long long)o.width, o.eta_star, o.from_fit ? "yes" : "no",
                o.best_grid_lr, o.best_grid_loss);
  std::printf("drift log2(eta*_widest / eta*_base) = %.3f\n", result.drift_log2);
  std::cout << "wrote " << c.csv << "\n";
  if (!c.plot.empty()) draw_plot("lrsweep", c.csv, c.plot);
}

}  // namespace

void register_lr_sweep(CLI::App& app) {
  auto c = std::make_shared<LrSweepCommand>();
  auto* cmd = app.add_subcommand("lr-sweep", "Grid over widths x learning rates, optimum per width and its drift");
  add_train_options(cmd, c->options, SharedOptions{.steps = true, .lr = false});
  cmd->add_option("--mults", c->multipliers, "width multipliers of the base model")->capture_default_str();
  cmd->add_option("--lr-min", c->lr_min, "smallest LR of the log grid")->capture_default_str()->check(greater_than(0));
  cmd->add_option("--lr-max", c->lr_max, "largest LR of the log grid")->capture_default_str()->check(greater_than(0));
  cmd->add_option("--lr-points", c->lr_points, "LRs in the grid")->capture_default_str()->check(at_least(2));
  cmd->add_option("--workers", c->workers, "runs at once: CPU threads, or GPU processes with --backend cuda (0 = one per hardware thread on the CPU, 4 on the GPU)")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--eval-batches", c->eval_batches, "validation batches per run")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--csv", c->csv, "CSV output")->capture_default_str();
  cmd->add_option("--plot", c->plot, "plot image ('' = none; needs python3 with matplotlib)")->capture_default_str();
  cmd->callback([c] { run(*c); });
}

}  // namespace moka::cli
