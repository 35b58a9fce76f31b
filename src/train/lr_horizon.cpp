#include "train/lr_horizon.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>

namespace moka::train {

double PowerLaw::at(double x) const { return std::exp(gamma) * std::pow(x, beta); }

PowerLaw fit_power_law(const std::vector<double>& x, const std::vector<double>& y) {
  require(x.size() == y.size(), ErrorCode::invalid_argument, "power-law fit: x and y differ in length");
  require(x.size() >= 2, ErrorCode::invalid_argument,
          "power-law fit: " + std::to_string(x.size()) + " point(s); it needs 2 or more");
  std::vector<double> lx, ly;
  for (size_t i = 0; i < x.size(); ++i) {
    require(x[i] > 0 && y[i] > 0 && std::isfinite(x[i]) && std::isfinite(y[i]), ErrorCode::invalid_argument,
            "power-law fit: every value must be positive and finite");
    lx.push_back(std::log(x[i]));
    ly.push_back(std::log(y[i]));
  }
  const Spread sx = spread_of(lx), sy = spread_of(ly);
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < lx.size(); ++i) {
    sxy += (lx[i] - sx.mean) * (ly[i] - sy.mean);
    sxx += (lx[i] - sx.mean) * (lx[i] - sx.mean);
    syy += (ly[i] - sy.mean) * (ly[i] - sy.mean);
  }
  require(sxx > 0, ErrorCode::invalid_argument, "power-law fit: every x is the same");
  PowerLaw p;
  p.beta = sxy / sxx;
  p.gamma = sy.mean - p.beta * sx.mean;
  p.points = int(x.size());
  double residual = 0;
  for (size_t i = 0; i < lx.size(); ++i) residual += std::pow(ly[i] - (p.beta * lx[i] + p.gamma), 2);
  p.r2 = syy > 0 ? 1.0 - residual / syy : 1.0;
  return p;
}

namespace {
std::string number_text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}
}  // namespace

std::vector<int64_t> check_horizon_config(const LrHorizonConfig& config) {
  require(config.lrs.size() >= 3, ErrorCode::invalid_argument, "the token-horizon study needs 3 or more LRs");
  require(std::is_sorted(config.lrs.begin(), config.lrs.end()), ErrorCode::invalid_argument, "LRs must ascend");
  require(config.seeds >= 1, ErrorCode::invalid_argument, "the token-horizon study needs one or more seeds");
  require(config.holdout >= 0, ErrorCode::invalid_argument, "--holdout must be >= 0");
  const double decay = config.train.ema_decay;
  require(decay > 0 && decay < 1, ErrorCode::invalid_argument,
          "the token-horizon study evaluates an EMA of the weights: --ema must be in (0, 1)");
  require(config.eval_every >= 1, ErrorCode::invalid_argument, "--eval-every must be >= 1");
  std::vector<int64_t> steps;
  for (int64_t s = config.eval_every; s <= config.train.schedule.total_steps; s += config.eval_every)
    if (std::pow(decay, double(s)) <= 0.01) steps.push_back(s);
  const auto fitted = std::count_if(steps.begin(), steps.end(), [&](int64_t s) { return s >= config.fit_from; });
  require(size_t(fitted) >= size_t(config.holdout) + 2, ErrorCode::invalid_argument,
          "the study has " + std::to_string(fitted) + " budget(s) to fit (every --eval-every " +
              std::to_string(config.eval_every) + " steps up to --steps " +
              std::to_string(config.train.schedule.total_steps) + ", from the first step where --ema " +
              number_text(decay) + " keeps <= 1% of the initial weights, and from --fit-from " +
              std::to_string(config.fit_from) + "); the fit needs 2 plus --holdout " + std::to_string(config.holdout));
  for (int64_t s : config.wsd_check_steps)
    require(std::find(steps.begin(), steps.end(), s) != steps.end(), ErrorCode::invalid_argument,
            "--wsd-check " + std::to_string(s) + " is not one of the evaluated budgets (multiples of --eval-every " +
                std::to_string(config.eval_every) + " where the EMA has forgotten its start)");
  return steps;
}

namespace {

int64_t tokens_of(const TrainConfig& c, int64_t steps) { return steps * c.batch * c.seq; }

// The optimum of one curve, or the reason it has none.
std::optional<LrOptimum> try_optimum(const std::vector<double>& lrs, const std::vector<double>& losses,
                                     std::string* why_not = nullptr) {
  try {
    return fit_lr_optimum(lrs, losses);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) throw;
    if (why_not) *why_not = e.what();
    return std::nullopt;
  }
}

std::optional<PowerLaw> try_power_law(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() < 2) return std::nullopt;
  return fit_power_law(x, y);
}

}  // namespace

LrHorizonResult analyze_horizon(const LrHorizonConfig& config, const std::vector<int64_t>& budget_steps,
                                const std::vector<std::vector<std::vector<double>>>& runs) {
  const size_t n_lr = config.lrs.size(), n_budget = budget_steps.size();
  require(!runs.empty(), ErrorCode::invalid_argument, "token-horizon analysis: no runs");
  for (const auto& seed : runs) {
    require(seed.size() == n_lr, ErrorCode::invalid_argument, "token-horizon analysis: one run per LR and seed");
    for (const auto& run : seed)
      require(run.size() == n_budget, ErrorCode::invalid_argument,
              "token-horizon analysis: one loss per budget in every run");
  }
  LrHorizonResult r;
  r.lrs = config.lrs;
  r.runs = runs;
  const double inf = std::numeric_limits<double>::infinity();
  // seed_eta[seed][budget]: that seed's optimum, NaN when its curve has none.
  std::vector<std::vector<double>> seed_eta(runs.size(), std::vector<double>(n_budget, std::nan("")));
  for (size_t b = 0; b < n_budget; ++b) {
    BudgetOptimum bo;
    bo.steps = budget_steps[b];
    bo.tokens = tokens_of(config.train, bo.steps);
    for (size_t l = 0; l < n_lr; ++l) {
      std::vector<double> over_seeds;
      for (const auto& seed : runs) over_seeds.push_back(seed[l][b]);
      const bool all_finite =
          std::all_of(over_seeds.begin(), over_seeds.end(), [](double v) { return std::isfinite(v); });
      const Spread s = spread_of(over_seeds);
      bo.loss.push_back(all_finite ? s.mean : inf);
      bo.loss_std.push_back(all_finite ? s.std : 0.0);
    }
    if (auto o = try_optimum(config.lrs, bo.loss, &bo.why_not)) {
      bo.usable = true;
      bo.optimum = *o;
    }
    std::vector<double> log_etas;
    for (size_t s = 0; s < runs.size(); ++s) {
      std::vector<double> curve;
      for (size_t l = 0; l < n_lr; ++l) curve.push_back(runs[s][l][b]);
      if (auto o = try_optimum(config.lrs, curve)) {
        seed_eta[s][b] = o->eta_star;
        log_etas.push_back(std::log(o->eta_star));
      }
    }
    bo.log_eta_star_seeds = spread_of(log_etas);
    r.budgets.push_back(std::move(bo));
  }

  std::vector<size_t> usable;  // the fitted budgets
  size_t from_fit_from = 0;
  for (size_t b = 0; b < n_budget; ++b) {
    if (budget_steps[b] < config.fit_from) continue;
    ++from_fit_from;
    if (!r.budgets[b].usable) continue;
    r.budgets[b].fitted = true;
    usable.push_back(b);
  }
  require(usable.size() >= 2 + size_t(config.holdout), ErrorCode::invalid_argument,
          std::to_string(usable.size()) + " of " + std::to_string(from_fit_from) +
              " budgets to fit have an LR optimum inside the grid; the fit needs 2 plus --holdout " +
              std::to_string(config.holdout) + " (widen the LR grid or train longer)");
  auto fit_over = [&](const std::vector<size_t>& budgets) {
    std::vector<double> x, y;
    for (size_t b : budgets) {
      x.push_back(double(r.budgets[b].tokens));
      y.push_back(r.budgets[b].optimum.eta_star);
    }
    return fit_power_law(x, y);
  };
  r.fit = fit_over(usable);
  if (config.holdout > 0) {
    const std::vector<size_t> earlier(usable.begin(), usable.end() - config.holdout);
    r.holdout_fit = fit_over(earlier);
    for (auto it = usable.end() - config.holdout; it != usable.end(); ++it) {
      BudgetOptimum& bo = r.budgets[*it];
      bo.held_out = true;
      HeldOutCheck h{bo.tokens, bo.optimum.eta_star, r.holdout_fit.at(double(bo.tokens)), 0};
      h.relative_error = std::abs(h.predicted / h.measured - 1.0);
      r.held_out_max_error = std::max(r.held_out_max_error, h.relative_error);
      r.held_out.push_back(h);
    }
  }
  std::vector<double> betas;
  for (const auto& etas : seed_eta) {
    std::vector<double> x, y;
    for (size_t b = 0; b < n_budget; ++b)
      if (std::isfinite(etas[b]) && budget_steps[b] >= config.fit_from) {
        x.push_back(double(r.budgets[b].tokens));
        y.push_back(etas[b]);
      }
    const auto fit = try_power_law(x, y);
    r.beta_per_seed.push_back(fit ? fit->beta : std::nan(""));
    if (fit) betas.push_back(fit->beta);
  }
  r.beta_spread = spread_of(betas);
  for (double t : config.predict_tokens) r.extrapolated.emplace_back(t, r.fit.at(t));
  return r;
}

LrHorizonResult lr_horizon(const LrHorizonConfig& config, const TextSplit& text, const HorizonProgress& progress) {
  const std::vector<int64_t> budgets = check_horizon_config(config);

  struct Job {
    TrainConfig train;
    size_t seed = 0, lr = 0, check = SIZE_MAX;  // check: index into wsd_check_steps
  };
  std::vector<Job> jobs;
  for (size_t s = 0; s < size_t(config.seeds); ++s)
    for (size_t l = 0; l < config.lrs.size(); ++l) {
      Job j{config.train, s, l};
      j.train.adam.lr = config.lrs[l];
      j.train.seed = config.train.seed + s;
      j.train.validation_seed = config.train.seed;     // every seed on the same validation batches
      j.train.schedule.kind = ScheduleKind::constant;  // warmup, then stable; never decays
      j.train.threads = 1;
      jobs.push_back(j);
    }
  for (size_t k = 0; k < config.wsd_check_steps.size(); ++k)
    for (size_t l = 0; l < config.lrs.size(); ++l) {
      Job j{config.train, 0, l, k};
      j.train.adam.lr = config.lrs[l];
      j.train.schedule.kind = ScheduleKind::wsd;
      j.train.schedule.total_steps = config.wsd_check_steps[k];
      j.train.ema_decay = 0;
      j.train.threads = 1;
      jobs.push_back(j);
    }

  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<std::vector<double>>> runs(config.seeds, std::vector<std::vector<double>>(config.lrs.size()));
  std::vector<std::vector<double>> wsd_loss(config.wsd_check_steps.size(), std::vector<double>(config.lrs.size(), inf));
  int done = 0;
  const bool in_processes = config.train.backend == Backend::cuda && config.workers > 1;
  run_jobs(
      jobs.size(), config.workers, in_processes,
      [&](size_t i) {
        const Job& j = jobs[i];
        return j.check == SIZE_MAX
                   ? train_and_evaluate_at(j.train, text, budgets, config.eval_batches, true)
                   : train_and_evaluate_at(j.train, text, {j.train.schedule.total_steps}, config.eval_batches, false);
      },
      [&](size_t i, std::vector<double> losses) {
        const Job& j = jobs[i];
        char what[96];
        if (j.check == SIZE_MAX) {
          if (losses.size() != budgets.size()) losses.assign(budgets.size(), inf);  // the run failed
          runs[j.seed][j.lr] = std::move(losses);
          std::snprintf(what, sizeof what, "lr %.3e seed %llu", j.train.adam.lr, (unsigned long long)j.train.seed);
        } else {
          wsd_loss[j.check][j.lr] = losses.size() == 1 ? losses[0] : inf;
          std::snprintf(what, sizeof what, "WSD run of %lld steps, lr %.3e", (long long)j.train.schedule.total_steps,
                        j.train.adam.lr);
        }
        if (progress) progress(what, ++done, int(jobs.size()));
      });

  LrHorizonResult r = analyze_horizon(config, budgets, runs);
  for (size_t k = 0; k < config.wsd_check_steps.size(); ++k) {
    WsdCheck w;
    w.steps = config.wsd_check_steps[k];
    w.tokens = tokens_of(config.train, w.steps);
    w.wsd_loss = wsd_loss[k];
    const size_t b = size_t(std::find(budgets.begin(), budgets.end(), w.steps) - budgets.begin());
    for (size_t l = 0; l < config.lrs.size(); ++l) w.ema_loss.push_back(runs[0][l][b]);
    std::vector<double> gaps;
    for (size_t l = 0; l < config.lrs.size(); ++l)
      if (std::isfinite(w.wsd_loss[l]) && std::isfinite(w.ema_loss[l])) gaps.push_back(w.ema_loss[l] - w.wsd_loss[l]);
    w.mean_loss_gap = spread_of(gaps).mean;
    std::string why_wsd, why_ema;
    const auto wsd = try_optimum(config.lrs, w.wsd_loss, &why_wsd);
    const auto ema = try_optimum(config.lrs, w.ema_loss, &why_ema);
    if (wsd && ema) {
      w.usable = true;
      w.wsd_eta_star = wsd->eta_star;
      w.ema_eta_star = ema->eta_star;
      w.eta_ratio = w.wsd_eta_star / w.ema_eta_star;
    } else {
      w.why_not = !wsd ? "decayed runs: " + why_wsd : "EMA: " + why_ema;
    }
    r.wsd_checks.push_back(std::move(w));
  }
  return r;
}

}  // namespace moka::train
