// `moka lr-horizon`: how the best peak LR moves with the token budget. Trains the model at every
// LR of a grid (and seed) on warmup then a constant LR, evaluates an EMA of the weights every
// --eval-every steps as the stand-in for a decayed run, fits eta*(B) per budget and
// log eta* = beta log B + gamma over the budgets, checks the fit on held-out budgets,
// extrapolates, and optionally re-runs some budgets as real WSD runs with decay to check the
// stand-in. Writes JSON and draws loss vs LR per budget and eta* vs budget with the fit.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "commands.hpp"
#include "train/lr_horizon.hpp"
#include "train_options.hpp"

namespace moka::cli {
namespace {

struct LrHorizonCommand {
  LrHorizonCommand() {
    options.schedule = "constant";
    options.warmup = 20;
    options.steps = 400;
    options.train.ema_decay = 0.95;
  }
  TrainCliOptions options;
  SweepCliOptions sweep;
  int64_t eval_every = 50;
  int64_t fit_from = 0;
  int holdout = 2;
  std::string wsd_check;
  std::string predict_tokens;
  std::string json = "lr_horizon.json", plot = "lr_horizon.png";
};

nlohmann::json power_law_json(const train::PowerLaw& p) {
  return {{"beta", p.beta}, {"gamma", p.gamma}, {"r2", p.r2}, {"points", p.points}};
}

nlohmann::json result_json(const LrHorizonCommand& c, const train::LrHorizonConfig& config,
                           const train::LrHorizonResult& r) {
  const auto& t = config.train;
  nlohmann::json doc{{"command", "lr-horizon"},
                     {"param", c.options.parameterization},
                     {"d_model", t.model.d_model},
                     {"tokens_per_step", t.batch * t.seq},
                     {"warmup_steps", t.schedule.warmup_steps},
                     {"ema_decay", t.ema_decay},
                     {"fit_from_steps", config.fit_from},
                     {"seeds", config.seeds},
                     {"lrs", r.lrs},
                     {"fit", power_law_json(r.fit)},
                     {"held_out_max_error", r.held_out_max_error},
                     {"beta_per_seed", r.beta_per_seed},
                     {"beta_over_seeds", spread_json(r.beta_spread)},
                     {"runs_seed_lr_budget", r.runs}};
  if (config.holdout > 0) doc["holdout_fit"] = power_law_json(r.holdout_fit);
  for (const auto& b : r.budgets) {
    nlohmann::json j{{"steps", b.steps},       {"tokens", b.tokens},
                     {"loss", b.loss},         {"loss_std", b.loss_std},
                     {"usable", b.usable},     {"fitted", b.fitted},
                     {"held_out", b.held_out}, {"ln_eta_star_over_seeds", spread_json(b.log_eta_star_seeds)}};
    if (b.usable) {
      j["eta_star"] = b.optimum.eta_star;
      j["parabola"] = {{"a", b.optimum.fit.a}, {"b", b.optimum.fit.b}, {"c", b.optimum.fit.c}};
    } else {
      j["why_not"] = b.why_not;
    }
    doc["budgets"].push_back(j);
  }
  doc["held_out"] = nlohmann::json::array();
  for (const auto& h : r.held_out)
    doc["held_out"].push_back({{"tokens", h.tokens},
                               {"measured", h.measured},
                               {"predicted", h.predicted},
                               {"relative_error", h.relative_error}});
  doc["extrapolated"] = nlohmann::json::array();
  for (const auto& [tokens, eta] : r.extrapolated)
    doc["extrapolated"].push_back({{"tokens", tokens}, {"eta_star", eta}});
  doc["wsd_checks"] = nlohmann::json::array();
  for (const auto& w : r.wsd_checks) {
    nlohmann::json j{{"steps", w.steps},       {"tokens", w.tokens}, {"wsd_loss", w.wsd_loss},
                     {"ema_loss", w.ema_loss}, {"usable", w.usable}, {"mean_loss_gap_ema_minus_wsd", w.mean_loss_gap}};
    if (w.usable) {
      j["wsd_eta_star"] = w.wsd_eta_star;
      j["ema_eta_star"] = w.ema_eta_star;
      j["eta_ratio_wsd_over_ema"] = w.eta_ratio;
    } else {
      j["why_not"] = w.why_not;
    }
    doc["wsd_checks"].push_back(j);
  }
  return doc;
}

void print_result(const train::LrHorizonConfig& config, const train::LrHorizonResult& r) {
  const bool seeded = config.seeds > 1;
  std::printf("%-8s %12s %12s", "steps", "tokens", "eta*");
  if (seeded) std::printf("  ln eta* over %d seeds: mean +- std", config.seeds);
  std::printf("\n");
  for (const auto& b : r.budgets) {
    std::printf("%-8lld %12lld ", (long long)b.steps, (long long)b.tokens);
    if (b.usable) std::printf("%12.3e", b.optimum.eta_star);
    else std::printf("%12s", "-");
    if (seeded)
      std::printf("  %.3f +- %.3f (%d)", b.log_eta_star_seeds.mean, b.log_eta_star_seeds.std,
                  b.log_eta_star_seeds.count);
    if (b.held_out) std::printf("  held out");
    if (!b.usable) std::printf("  left out: %s", b.why_not.c_str());
    else if (!b.fitted) std::printf("  not fitted (before --fit-from)");
    std::printf("\n");
  }
  std::printf("fit log eta* = beta log B + gamma over %d budgets: beta %.4f, gamma %.4f, R^2 %.4f\n", r.fit.points,
              r.fit.beta, r.fit.gamma, r.fit.r2);
  if (seeded)
    std::printf("beta over %d seeds: %.4f +- %.4f [%.4f, %.4f]\n", r.beta_spread.count, r.beta_spread.mean,
                r.beta_spread.std, r.beta_spread.min, r.beta_spread.max);
  if (!r.held_out.empty()) {
    std::printf("held-out check (fit on the first %d budgets: beta %.4f):\n", r.holdout_fit.points, r.holdout_fit.beta);
    for (const auto& h : r.held_out)
      std::printf("  B = %lld tokens: measured %.3e, predicted %.3e, error %.1f%%\n", (long long)h.tokens, h.measured,
                  h.predicted, 100 * h.relative_error);
    std::printf("held-out max error %.1f%%\n", 100 * r.held_out_max_error);
  }
  for (const auto& [tokens, eta] : r.extrapolated) std::printf("extrapolated eta*(%.3g tokens) = %.3e\n", tokens, eta);
  for (const auto& w : r.wsd_checks) {
    if (w.usable)
      std::printf(
          "WSD check at %lld steps: decayed runs' eta* %.3e, EMA's %.3e (ratio %.3f); EMA loss - WSD loss %.4f\n",
          (long long)w.steps, w.wsd_eta_star, w.ema_eta_star, w.eta_ratio, w.mean_loss_gap);
    else
      std::printf("WSD check at %lld steps: no optimum (%s); EMA loss - WSD loss %.4f\n", (long long)w.steps,
                  w.why_not.c_str(), w.mean_loss_gap);
  }
}

void run(LrHorizonCommand& c) {
  require(c.options.schedule == "constant", ErrorCode::invalid_argument,
          "--schedule " + c.options.schedule +
              ": lr-horizon trains on warmup then a constant LR (its --wsd-check runs decay over --decay-fraction)");
  train::LrHorizonConfig config;
  config.lrs = c.sweep.lrs();
  config.wsd_check_steps = parse_positive_list("--wsd-check", c.wsd_check);
  for (int64_t t : parse_positive_list("--predict-tokens", c.predict_tokens))
    config.predict_tokens.push_back(double(t));
  if (!c.json.empty()) check_output_path("--json", c.json);
  require(c.plot.empty() || !c.json.empty(), ErrorCode::invalid_argument, "--plot draws from --json: give both");
  if (!c.plot.empty()) check_plotter(c.plot);
  config.workers = c.sweep.resolved_workers(parse_backend(c.options.backend));
  const int64_t constant_lr_runs = int64_t(config.lrs.size()) * c.sweep.seeds;
  check_run_count(constant_lr_runs * int64_t(1 + config.wsd_check_steps.size()),
                  "--lr-points " + std::to_string(c.sweep.lr_points) + " x --seeds " + std::to_string(c.sweep.seeds) +
                      " x (1 + " + std::to_string(config.wsd_check_steps.size()) + " --wsd-check budgets)");
  const int64_t runs_at_once = std::min<int64_t>(config.workers, constant_lr_runs);
  config.train = c.options.resolve_widths({1}, runs_at_once);
  check_validation_memory(config.train, c.sweep.eval_batches, runs_at_once);
  config.seeds = c.sweep.seeds;
  config.eval_every = c.eval_every;
  config.eval_batches = c.sweep.eval_batches;
  config.holdout = c.holdout;
  config.fit_from = c.fit_from;
  const auto budgets = train::check_horizon_config(config);  // before any work
  if (config.predict_tokens.empty())
    config.predict_tokens.push_back(10.0 * double(budgets.back() * config.train.batch * config.train.seq));
  const auto text = c.options.load_text();
  const auto result = train::lr_horizon(config, text, [](const std::string& what, int done, int total) {
    std::fprintf(stderr, "[%d/%d] %s\n", done, total, what.c_str());
  });
  print_result(config, result);
  if (!c.json.empty()) {
    write_json(c.json, result_json(c, config, result));
    std::cout << "wrote " << c.json << "\n";
  }
  if (!c.plot.empty()) draw_plot("horizon", c.json, c.plot);
}

}  // namespace

void register_lr_horizon(CLI::App& app) {
  auto c = std::make_shared<LrHorizonCommand>();
  auto* cmd = app.add_subcommand(
      "lr-horizon", "Best LR against token budget: constant-LR runs, EMA evaluations, fit of log eta* vs log tokens");
  add_train_options(cmd, c->options, SharedOptions{.steps = true, .lr = false});
  add_sweep_options(cmd, c->sweep);
  cmd->add_option("--eval-every", c->eval_every, "steps between EMA evaluations (token budgets)")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--fit-from", c->fit_from, "fit only the budgets from this step on (earlier ones are reported)")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--holdout", c->holdout, "last budgets left out of the fit and predicted")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--wsd-check", c->wsd_check,
                  "budgets (steps, e.g. 200,400) re-run as WSD runs with decay at every LR, to check the EMA stand-in")
      ->capture_default_str();
  cmd->add_option("--predict-tokens", c->predict_tokens, "token budgets to extrapolate eta* to (default: 10x the last)")
      ->capture_default_str();
  cmd->add_option("--json", c->json, "JSON output ('' = none)")->capture_default_str();
  cmd->add_option("--plot", c->plot, "plot image ('' = none; needs python3 with matplotlib)")->capture_default_str();
  cmd->callback([c] { run(*c); });
}

}  // namespace moka::cli
