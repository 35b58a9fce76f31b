// The two muP experiments: the coordinate check (do activations keep their size as the model
// widens?) and the LR sweep (does the best LR found at the base width hold at larger widths?).
#pragma once
#include <array>
#include <functional>
#include <vector>

#include "train/trainer.hpp"

namespace moka::train {

// Least-squares slope of log(y) against log(x).
double loglog_slope(const std::vector<double>& x, const std::vector<double>& y);

struct CoordCheckConfig {
  TrainConfig train;  // train.base is the x1 model; train.model is ignored
  std::vector<int64_t> multipliers{1, 2, 4, 8};
  int steps = 5;  // activations are recorded after 0..steps updates
};

struct CoordCheckRow {
  int64_t width = 0;
  int step = 0;
  ActivationStats stats;
};

struct CoordCheckResult {
  std::vector<CoordCheckRow> rows;
  // slopes[step][activation]: slope of log(mean |activation|) against log(width).
  std::vector<std::array<double, ActivationStats::kCount>> slopes;
};

// Trains each width from its own init at a constant LR for `steps` steps (same data and seed).
CoordCheckResult coord_check(const CoordCheckConfig& config, const TextSplit& text);

struct Parabola {
  double a = 0, b = 0, c = 0;  // y = a x^2 + b x + c
  bool has_minimum() const { return a > 0; }
  double argmin() const { return -b / (2 * a); }
};
// Least squares through (x, y); needs 3 or more distinct x.
Parabola fit_parabola(const std::vector<double>& x, const std::vector<double>& y);

// The LR optimum of one loss-vs-LR curve: L(log eta) = a (log eta)^2 + b log eta + c fitted
// through the grid's best finite point and up to two finite neighbours on each side,
// eta* = exp(-b / 2a).
struct LrOptimum {
  Parabola fit;
  double eta_star = 0;
  double best_grid_lr = 0, best_grid_loss = 0;
};
// Throws invalid_argument naming the problem when the curve has no usable optimum: fewer than
// 3 finite points around the best one, a <= 0 (no minimum), or a vertex outside the fitted
// LRs (the optimum lies at or past the grid's edge). `lrs` must be sorted ascending.
LrOptimum fit_lr_optimum(const std::vector<double>& lrs, const std::vector<double>& losses);

// Mean, sample standard deviation (0 for one value), min and max.
struct Spread {
  double mean = 0, std = 0, min = 0, max = 0;
  int count = 0;
};
Spread spread_of(const std::vector<double>& values);

struct LrSweepConfig {
  TrainConfig train;  // train.base is the x1 model; train.adam.lr is replaced by each grid LR
  std::vector<int64_t> multipliers{1, 2, 4, 8};
  std::vector<double> lrs;
  int seeds = 1;  // every (width, LR) is trained with seeds train.seed, train.seed + 1, ...
  int eval_batches = 8;
  int workers = 1;  // runs trained at once: threads on the CPU, processes on the GPU
};

struct SweepPoint {
  int64_t width = 0;
  double lr = 0;
  double loss = 0;  // validation cross-entropy after training; inf when the run diverged
  uint64_t seed = 0;
};

// Per width: the LR optimum of its loss curve (fit_lr_optimum); when that has none, eta* is
// the best grid LR and from_fit is false.
struct WidthOptimum {
  int64_t width = 0;
  Parabola fit;
  double eta_star = 0;
  bool from_fit = false;
  double best_grid_lr = 0, best_grid_loss = 0;
};

// The optima of one seed's runs.
struct SeedOptima {
  uint64_t seed = 0;
  std::vector<WidthOptimum> optima;
  double drift_log2 = 0;
};

struct LrSweepResult {
  std::vector<SweepPoint> points;            // every run, every seed
  std::vector<WidthOptimum> optima;          // from the loss averaged over seeds (diverged in any: inf)
  double drift_log2 = 0;                     // log2(eta*_widest / eta*_base) of `optima`
  std::vector<SeedOptima> per_seed;          // one entry per seed
  std::vector<Spread> log2_eta_star_spread;  // per width (order of `optima`), over seeds
  Spread drift_spread;                       // over seeds
};

// Runs job(i) for every i < count, `workers` at once, and gives each result to on_result (in
// the calling thread or under a lock) as it arrives. In threads, a job that throws stops the
// others and its error is rethrown. In processes (`in_processes`, the CUDA runs: each forked
// process has its own CUDA context, so one run's host-side gaps are filled by the others'
// kernels), a shared counter hands out the next i; a run that throws, or kills its process,
// is reported with an empty result (diverged) and its process replaced.
void run_jobs(size_t count, int workers, bool in_processes, const std::function<std::vector<double>(size_t)>& job,
              const std::function<void(size_t, std::vector<double>)>& on_result);

// Trains c for its whole schedule and returns the validation loss (EMA weights when
// `use_ema`) after each step count in `eval_steps` (ascending, each <= the schedule's total);
// infinity from the first non-finite loss or gradient on (a too-high LR is a result, not an
// error; checked every 16 steps and before each evaluation, since each check waits for the GPU).
std::vector<double> train_and_evaluate_at(const TrainConfig& c, const TextSplit& text,
                                          const std::vector<int64_t>& eval_steps, int eval_batches, bool use_ema);

LrSweepResult lr_sweep(const LrSweepConfig& config, const TextSplit& text,
                       const std::function<void(const SweepPoint&, int done, int total)>& on_point = {});
std::vector<WidthOptimum> find_optima(const std::vector<SweepPoint>& points);

}  // namespace moka::train
