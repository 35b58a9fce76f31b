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
  int steps = 5;      // activations are recorded after 0..steps updates
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

struct LrSweepConfig {
  TrainConfig train;  // train.base is the x1 model; train.adam.lr is replaced by each grid LR
  std::vector<int64_t> multipliers{1, 2, 4, 8};
  std::vector<double> lrs;
  int eval_batches = 8;
  int workers = 1;      // runs trained at once: threads on the CPU, processes on the GPU
};

struct SweepPoint {
  int64_t width = 0;
  double lr = 0;
  double loss = 0;  // validation cross-entropy after training; inf when the run diverged
};

// Per width: L(log eta) fitted with a parabola through the grid's best point and up to two
// neighbours on each side (diverged runs left out), eta* = exp(-b/2a); when the fit has no
// minimum, eta* is the best grid LR.
struct WidthOptimum {
  int64_t width = 0;
  Parabola fit;
  double eta_star = 0;
  bool from_fit = false;
  double best_grid_lr = 0, best_grid_loss = 0;
};

struct LrSweepResult {
  std::vector<SweepPoint> points;
  std::vector<WidthOptimum> optima;
  double drift_log2 = 0;  // log2(eta*_widest / eta*_base)
};

// Runs job(i) for i < count in `workers` forked processes (a shared counter hands out the next
// i) and gives each result to on_result in the parent. A run that throws, or kills its process,
// counts as infinity (diverged) and its process is replaced. The CUDA sweep's runner.
void run_in_processes(size_t count, int workers, const std::function<double(size_t)>& job,
                      const std::function<void(size_t, double)>& on_result);

LrSweepResult lr_sweep(const LrSweepConfig& config, const TextSplit& text,
                       const std::function<void(const SweepPoint&, int done, int total)>& on_point = {});
std::vector<WidthOptimum> find_optima(const std::vector<SweepPoint>& points);

}  // namespace moka::train
