#include "train/mup_experiments.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

namespace moka::train {

double loglog_slope(const std::vector<double>& x, const std::vector<double>& y) {
  require(x.size() == y.size() && x.size() >= 2, ErrorCode::invalid_argument, "slope needs two or more points");
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mx += std::log(x[i]);
    my += std::log(y[i]);
  }
  mx /= double(x.size());
  my /= double(y.size());
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double dx = std::log(x[i]) - mx;
    sxy += dx * (std::log(y[i]) - my);
    sxx += dx * dx;
  }
  return sxy / sxx;
}

namespace {
TrainConfig at_width(const TrainConfig& t, int64_t multiplier) {
  TrainConfig c = t;
  c.model = scale_width(t.base, multiplier);
  return c;
}

// Validation loss after the whole schedule; infinity when the run blew up (a too-high LR is a
// result of the sweep, not an error).
double train_and_evaluate(const TrainConfig& c, const TextSplit& text, int eval_batches) {
  try {
    Trainer trainer(c, text);
    for (int64_t s = 0; s < c.schedule.total_steps; ++s) trainer.step();
    const double loss = trainer.evaluate(eval_batches);
    return std::isfinite(loss) ? loss : std::numeric_limits<double>::infinity();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::non_finite) throw;
    return std::numeric_limits<double>::infinity();
  }
}
}  // namespace

CoordCheckResult coord_check(const CoordCheckConfig& config, const TextSplit& text) {
  CoordCheckResult result;
  std::vector<std::vector<ActivationStats>> by_step(config.steps + 1);
  std::vector<double> widths;
  for (int64_t m : config.multipliers) {
    Trainer trainer(at_width(config.train, m), text);
    widths.push_back(double(trainer.config().model.d_model));
    for (int s = 0; s <= config.steps; ++s) {
      ActivationStats stats;
      trainer.step(&stats);
      result.rows.push_back({trainer.config().model.d_model, s, stats});
      by_step[s].push_back(stats);
    }
  }
  for (const auto& stats : by_step) {
    std::array<double, ActivationStats::kCount> slopes{};
    for (int a = 0; a < ActivationStats::kCount; ++a) {
      std::vector<double> values;
      for (const auto& s : stats) values.push_back(s.value(a));
      slopes[a] = loglog_slope(widths, values);
    }
    result.slopes.push_back(slopes);
  }
  return result;
}

Parabola fit_parabola(const std::vector<double>& x, const std::vector<double>& y) {
  require(x.size() == y.size() && x.size() >= 3, ErrorCode::invalid_argument, "a parabola needs three points");
  // Normal equations of [x^2 x 1] in double, solved by Cramer's rule (3x3).
  double s[5] = {0, 0, 0, 0, 0}, t[3] = {0, 0, 0};
  for (size_t i = 0; i < x.size(); ++i) {
    double p = 1;
    for (int k = 0; k < 5; ++k, p *= x[i]) s[k] += p;
    t[0] += y[i] * x[i] * x[i];
    t[1] += y[i] * x[i];
    t[2] += y[i];
  }
  const double M[3][3] = {{s[4], s[3], s[2]}, {s[3], s[2], s[1]}, {s[2], s[1], s[0]}};
  auto det = [](const double m[3][3]) {
    return m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0]) +
           m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]);
  };
  const double D = det(M);
  require(std::abs(D) > 1e-300, ErrorCode::invalid_argument, "parabola fit is singular (need 3 distinct x)");
  double coef[3];
  for (int col = 0; col < 3; ++col) {
    double A[3][3];
    for (int r = 0; r < 3; ++r)
      for (int c = 0; c < 3; ++c) A[r][c] = c == col ? t[r] : M[r][c];
    coef[col] = det(A) / D;
  }
  return {coef[0], coef[1], coef[2]};
}

namespace {
WidthOptimum optimum_of(int64_t width, std::vector<SweepPoint> pts) {
  std::sort(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.lr < b.lr; });
  const auto best = std::min_element(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.loss < b.loss; });
  WidthOptimum o{width, {}, best->lr, false, best->lr, best->loss};
  const auto i = best - pts.begin();
  std::vector<double> x, y;
  for (auto j = std::max<std::ptrdiff_t>(0, i - 2); j <= std::min<std::ptrdiff_t>(std::ptrdiff_t(pts.size()) - 1, i + 2); ++j) {
    if (!std::isfinite(pts[j].loss)) continue;
    x.push_back(std::log(pts[j].lr));
    y.push_back(pts[j].loss);
  }
  if (x.size() < 3) return o;
  o.fit = fit_parabola(x, y);
  // Trust the vertex only inside the fitted range; outside it the parabola extrapolates.
  if (o.fit.has_minimum() && o.fit.argmin() >= x.front() && o.fit.argmin() <= x.back()) {
    o.eta_star = std::exp(o.fit.argmin());
    o.from_fit = true;
  }
  return o;
}
}  // namespace

std::vector<WidthOptimum> find_optima(const std::vector<SweepPoint>& points) {
  std::map<int64_t, std::vector<SweepPoint>> by_width;
  for (const auto& p : points) by_width[p.width].push_back(p);
  std::vector<WidthOptimum> out;
  for (const auto& [w, pts] : by_width) out.push_back(optimum_of(w, pts));
  return out;
}

LrSweepResult lr_sweep(const LrSweepConfig& config, const TextSplit& text,
                       const std::function<void(const SweepPoint&, int, int)>& on_point) {
  require(!config.lrs.empty() && !config.multipliers.empty(), ErrorCode::invalid_argument, "empty sweep grid");
  std::vector<std::pair<int64_t, double>> grid;
  for (int64_t m : config.multipliers)
    for (double lr : config.lrs) grid.emplace_back(m, lr);
  LrSweepResult result;
  result.points.resize(grid.size());
  std::atomic<size_t> next{0};
  std::mutex report;
  int done = 0;
  std::exception_ptr error;
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < grid.size();) {
      TrainConfig c = at_width(config.train, grid[i].first);
      c.adam.lr = grid[i].second;
      c.threads = 1;
      SweepPoint point{c.model.d_model, c.adam.lr, 0.0};
      try {
        point.loss = train_and_evaluate(c, text, config.eval_batches);
      } catch (...) {
        std::lock_guard lock(report);
        if (!error) error = std::current_exception();
        next = grid.size();  // stop the other workers too
        return;
      }
      std::lock_guard lock(report);
      result.points[i] = point;
      if (on_point) on_point(point, ++done, int(grid.size()));
    }
  };
  std::vector<std::thread> pool;
  for (int w = 0; w < std::max(1, config.workers); ++w) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  result.optima = find_optima(result.points);
  result.drift_log2 = std::log2(result.optima.back().eta_star / result.optima.front().eta_star);
  return result;
}

}  // namespace moka::train
