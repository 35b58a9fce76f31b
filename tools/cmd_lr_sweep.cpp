// `moka lr-sweep`: trains every (width, LR, seed) of a grid, in parallel runs, fits
// L = a (log eta)^2 + b log eta + c per width for eta*, prints the drift
// log2(eta*_widest / eta*_base) with its spread over seeds, and draws loss against LR per width
// with the optima marked (error bars over seeds).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "commands.hpp"
#include "core/atomic_file.hpp"
#include "train/mup_experiments.hpp"
#include "train_options.hpp"

namespace moka::cli {
namespace {

struct LrSweepCommand {
  TrainCliOptions options;
  SweepCliOptions sweep;
  std::string multipliers = "1,2,4,8";
  std::string csv = "lr_sweep.csv", json = "lr_sweep.json", plot = "lr_sweep.png";
};

// Rows: every run ("point", with its seed), the optimum of the seed-averaged curve per width
// ("optimum") and each seed's own ("seed_optimum"). Built whole, then written atomically: a failed
// write leaves the previous CSV (or none).
void write_csv(const std::string& path, const std::string& param, const train::LrSweepResult& r) {
  std::ostringstream out;
  out << "kind,param,width,lr,loss,seed,a,b,c\n";
  for (const auto& p : r.points)
    out << "point," << param << ',' << p.width << ',' << p.lr << ',' << p.loss << ',' << p.seed << ",,,\n";
  auto optimum = [&](const char* kind, const train::WidthOptimum& o, const std::string& seed) {
    out << kind << ',' << param << ',' << o.width << ',' << o.eta_star << ",," << seed << ',' << o.fit.a << ','
        << o.fit.b << ',' << o.fit.c << '\n';
  };
  for (const auto& o : r.optima) optimum("optimum", o, "");
  for (const auto& s : r.per_seed)
    for (const auto& o : s.optima) optimum("seed_optimum", o, std::to_string(s.seed));
  core::write_file_atomically(path, out.view());
}

nlohmann::json result_json(const LrSweepCommand& c, const train::LrSweepResult& r) {
  nlohmann::json doc{{"command", "lr-sweep"},      {"param", c.options.parameterization},
                     {"seeds", c.sweep.seeds},     {"lrs", c.sweep.lrs()},
                     {"drift_log2", r.drift_log2}, {"drift_log2_over_seeds", spread_json(r.drift_spread)}};
  for (const auto& p : r.points)
    doc["points"].push_back({{"width", p.width}, {"lr", p.lr}, {"seed", p.seed}, {"loss", p.loss}});
  for (size_t w = 0; w < r.optima.size(); ++w) {
    const auto& o = r.optima[w];
    nlohmann::json per_seed = nlohmann::json::array();
    for (const auto& s : r.per_seed) per_seed.push_back(s.optima[w].eta_star);
    doc["optima"].push_back({{"width", o.width},
                             {"eta_star", o.eta_star},
                             {"from_fit", o.from_fit},
                             {"best_grid_lr", o.best_grid_lr},
                             {"best_grid_loss", o.best_grid_loss},
                             {"eta_star_per_seed", per_seed},
                             {"log2_eta_star_over_seeds", spread_json(r.log2_eta_star_spread[w])}});
  }
  for (const auto& s : r.per_seed) doc["drift_log2_per_seed"].push_back(s.drift_log2);
  return doc;
}

void run(LrSweepCommand& c) {
  train::LrSweepConfig config;
  config.multipliers = parse_multipliers(c.multipliers);
  config.lrs = c.sweep.lrs();
  check_output_path("--csv", c.csv);
  if (!c.json.empty()) check_output_path("--json", c.json);
  if (!c.plot.empty()) check_plotter(c.plot);
  config.workers = c.sweep.resolved_workers(parse_backend(c.options.backend));
  // The widest width's runs start first, all at once where the workers allow.
  const int64_t widest_runs = int64_t(config.lrs.size()) * c.sweep.seeds;
  check_run_count(int64_t(config.multipliers.size()) * widest_runs,
                  "--mults (" + std::to_string(config.multipliers.size()) + " widths) x --lr-points " +
                      std::to_string(c.sweep.lr_points) + " x --seeds " + std::to_string(c.sweep.seeds));
  const int64_t runs_at_once = std::min<int64_t>(config.workers, widest_runs);
  config.train = c.options.resolve_widths(config.multipliers, runs_at_once);
  check_validation_memory(config.train, c.sweep.eval_batches, runs_at_once);
  config.eval_batches = c.sweep.eval_batches;
  config.seeds = c.sweep.seeds;
  const auto text = c.options.load_text();
  const auto result = train::lr_sweep(config, text, [](const train::SweepPoint& p, int done, int total) {
    std::fprintf(stderr, "[%d/%d] width %lld lr %.3e seed %llu: validation loss %.4f\n", done, total,
                 (long long)p.width, p.lr, (unsigned long long)p.seed, p.loss);
  });
  write_csv(c.csv, c.options.parameterization, result);
  if (!c.json.empty()) write_json(c.json, result_json(c, result));
  const bool seeded = config.seeds > 1;
  std::printf("%-8s %12s %8s %12s %10s", "width", "eta*", "fit", "best grid", "loss");
  if (seeded) std::printf("   log2 eta* over %d seeds: mean +- std [min, max]", config.seeds);
  std::printf("\n");
  for (size_t w = 0; w < result.optima.size(); ++w) {
    const auto& o = result.optima[w];
    std::printf("%-8lld %12.3e %8s %12.3e %10.4f", (long long)o.width, o.eta_star, o.from_fit ? "yes" : "no",
                o.best_grid_lr, o.best_grid_loss);
    const auto& s = result.log2_eta_star_spread[w];
    if (seeded) std::printf("   %.2f +- %.2f [%.2f, %.2f]", s.mean, s.std, s.min, s.max);
    std::printf("\n");
  }
  std::printf("drift log2(eta*_widest / eta*_base) = %.3f", result.drift_log2);
  const auto& d = result.drift_spread;
  if (seeded) std::printf("; over %d seeds %.3f +- %.3f [%.3f, %.3f]", d.count, d.mean, d.std, d.min, d.max);
  std::printf("\n");
  std::cout << "wrote " << c.csv << (c.json.empty() ? "" : " and " + c.json) << "\n";
  if (!c.plot.empty()) draw_plot("lrsweep", c.csv, c.plot);
}

}  // namespace

void register_lr_sweep(CLI::App& app) {
  auto c = std::make_shared<LrSweepCommand>();
  auto* cmd = app.add_subcommand("lr-sweep", "Grid over widths x learning rates, optimum per width and its drift");
  add_train_options(cmd, c->options, SharedOptions{.steps = true, .lr = false});
  add_sweep_options(cmd, c->sweep);
  cmd->add_option("--mults", c->multipliers, "width multipliers of the base model")->capture_default_str();
  cmd->add_option("--csv", c->csv, "CSV output")->capture_default_str();
  cmd->add_option("--json", c->json, "JSON output ('' = none)")->capture_default_str();
  cmd->add_option("--plot", c->plot, "plot image ('' = none; needs python3 with matplotlib)")->capture_default_str();
  cmd->callback([c] { run(*c); });
}

}  // namespace moka::cli
