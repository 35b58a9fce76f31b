// Token-horizon LR transfer ("Let's Scale Step by Step", second half): how the best peak LR
// moves with the token budget B. A proxy is trained at several LRs on warmup then a constant LR
// (a WSD schedule that never decays); an exponential moving average of its weights stands in
// for the decayed model, evaluated at many budgets within each run, so one run per LR gives the
// whole loss-vs-LR curve at every budget. Per budget eta*(B) comes from a parabola in log eta;
// then log eta* = beta log B + gamma is fitted over the budgets and extrapolated.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "train/mup_experiments.hpp"

namespace moka::train {

// log y = beta log x + gamma by least squares, with the coefficient of determination of that
// line in log-log space.
struct PowerLaw {
  double beta = 0, gamma = 0, r2 = 0;
  int points = 0;
  double at(double x) const;  // exp(gamma) x^beta
};
// Throws invalid_argument naming the problem: fewer than 2 points, a non-positive value, or
// all x equal.
PowerLaw fit_power_law(const std::vector<double>& x, const std::vector<double>& y);

struct LrHorizonConfig {
  TrainConfig train;        // the proxy; train.ema_decay > 0; schedule: warmup, then constant
  std::vector<double> lrs;  // ascending
  int seeds = 1;            // every LR trained with seeds train.seed, train.seed + 1, ...
  int64_t eval_every = 50;  // steps between EMA evaluations (budgets)
  int eval_batches = 8;
  int64_t fit_from = 0;                  // budgets (steps) below this are evaluated and reported, not fitted
  int holdout = 2;                       // the last usable budgets, left out of the fit and predicted
  std::vector<int64_t> wsd_check_steps;  // budgets re-run as real WSD runs with decay
  std::vector<double> predict_tokens;    // budgets to extrapolate eta* to
  int workers = 1;                       // threads on the CPU, processes on the GPU
};

// Checks the config and returns the budgets (in steps) it evaluates: every eval_every steps up
// to the schedule's end, from the first at which the EMA keeps at most 1% of the initial
// weights (decay^steps <= 0.01). Throws invalid_argument naming the problem: fewer than
// holdout + 2 budgets from fit_from on, an EMA decay outside (0, 1), fewer than 3 LRs or LRs
// not ascending, no seeds, a WSD check that is not one of the budgets.
std::vector<int64_t> check_horizon_config(const LrHorizonConfig& config);

// One budget's curve and optimum.
struct BudgetOptimum {
  int64_t steps = 0, tokens = 0;
  std::vector<double> loss;      // per LR: EMA validation loss averaged over seeds (inf: diverged)
  std::vector<double> loss_std;  // per LR, over seeds (0 with one seed)
  bool usable = false;           // has a fitted optimum inside the grid
  std::string why_not;           // when not usable
  bool fitted = false;           // usable and at or past fit_from: in the power-law fit
  LrOptimum optimum;
  bool held_out = false;      // among the last `holdout` fitted budgets (then not in holdout_fit)
  Spread log_eta_star_seeds;  // ln eta* over the seeds whose curve has an optimum here
};

struct HeldOutCheck {
  int64_t tokens = 0;
  double measured = 0, predicted = 0;
  double relative_error = 0;  // |predicted / measured - 1|
};

struct WsdCheck {
  int64_t steps = 0, tokens = 0;
  std::vector<double> wsd_loss, ema_loss;  // per LR, first seed: decayed run vs EMA stand-in
  bool usable = false;
  std::string why_not;
  double wsd_eta_star = 0, ema_eta_star = 0;
  double eta_ratio = 0;      // wsd / ema
  double mean_loss_gap = 0;  // mean over LRs finite in both of (ema - wsd)
};

struct LrHorizonResult {
  std::vector<double> lrs;
  std::vector<BudgetOptimum> budgets;
  // runs[seed][lr][budget]: every EMA evaluation.
  std::vector<std::vector<std::vector<double>>> runs;
  PowerLaw fit;                        // seed-averaged optima of every fitted budget
  PowerLaw holdout_fit;                // the same without the held-out budgets (holdout > 0)
  std::vector<HeldOutCheck> held_out;  // predictions of the held-out budgets by holdout_fit
  double held_out_max_error = 0;
  std::vector<double> beta_per_seed;                    // NaN where that seed's optima allow no fit
  Spread beta_spread;                                   // over the seeds that have one
  std::vector<std::pair<double, double>> extrapolated;  // (tokens, eta*) by `fit`
  std::vector<WsdCheck> wsd_checks;
};

// One training run finished: `what` names it ("lr 1.0e-03 seed 2", "wsd 400 steps lr ...").
using HorizonProgress = std::function<void(const std::string& what, int done, int total)>;

LrHorizonResult lr_horizon(const LrHorizonConfig& config, const TextSplit& text, const HorizonProgress& progress = {});

// The analysis alone, from runs[seed][lr][budget] (what lr_horizon trains): the per-budget
// optima, the fit with its held-out check, the spread of beta over seeds and the extrapolation.
// Throws invalid_argument when fewer than holdout + 2 usable budgets from fit_from on remain.
LrHorizonResult analyze_horizon(const LrHorizonConfig& config, const std::vector<int64_t>& budget_steps,
                                const std::vector<std::vector<std::vector<double>>>& runs);

}  // namespace moka::train
