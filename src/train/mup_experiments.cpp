#include "train/mup_experiments.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include <poll.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

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
    for (int64_t s = 0; s < c.schedule.total_steps; ++s) {
      // Stop at the first non-finite loss or gradient: later steps would feed NaN to the routers,
      // whose top-k is then meaningless (the GPU layer reports such routes as errors).
      const auto r = trainer.step();
      if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) return std::numeric_limits<double>::infinity();
    }
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

// Runs job(i) for every i < count in `workers` forked processes that take the next index from a
// shared counter, and reports each result to on_result in the parent as it arrives. CUDA runs
// go here: every process has its own CUDA context, so one model's host-side gaps (launches,
// the per-step synchronization, the moka router's per-call cudaMalloc/cudaFree, which waits
// for the whole device) are filled by the others' kernels; threads of one process would all
// wait on those device-wide synchronizations. A run that throws is reported as infinity (with
// its message on stderr) and its process is replaced, since a CUDA error can leave the context
// unusable. The parent must not have touched CUDA.
void run_in_processes(size_t count, int workers, const std::function<double(size_t)>& job,
                      const std::function<void(size_t, double)>& on_result) {
  void* shared = mmap(nullptr, sizeof(std::atomic<size_t>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  require(shared != MAP_FAILED, ErrorCode::io, "lr-sweep: cannot map the shared work counter");
  auto* next = new (shared) std::atomic<size_t>(0);
  struct Worker {
    pid_t pid;
    int fd;
    std::string pending;
    size_t current = SIZE_MAX;  // the run it started and has not reported
  };
  std::vector<Worker> live;
  auto spawn = [&] {
    int p[2];
    require(pipe(p) == 0, ErrorCode::io, "lr-sweep: pipe failed");
    const pid_t pid = fork();
    require(pid >= 0, ErrorCode::io, "lr-sweep: fork failed");
    if (pid == 0) {
      close(p[0]);
      auto say = [&](const std::string& line) { (void)!write(p[1], line.data(), line.size()); };
      for (size_t i; (i = next->fetch_add(1)) < count;) {
        try {
          say("S " + std::to_string(i) + "\n");
          char line[64];
          std::snprintf(line, sizeof line, "R %zu %.17g\n", i, job(i));
          say(line);
        } catch (const std::exception& e) {
          std::string msg = e.what();
          std::replace(msg.begin(), msg.end(), '\n', ' ');
          say("F " + std::to_string(i) + " " + msg + "\n");
          close(p[1]);
          _exit(2);
        }
      }
      close(p[1]);
      _exit(0);
    }
    close(p[1]);
    live.push_back({pid, p[0], {}, SIZE_MAX});
  };
  for (int w = 0; w < workers; ++w) spawn();
  int lost = 0;
  while (!live.empty()) {
    std::vector<pollfd> polled;
    for (const auto& w : live) polled.push_back({w.fd, POLLIN, 0});
    if (poll(polled.data(), polled.size(), -1) < 0) continue;
    for (size_t k = polled.size(); k-- > 0;) {
      if (!(polled[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Worker& w = live[k];
      char buf[4096];
      const ssize_t n = read(w.fd, buf, sizeof buf);
      if (n > 0) {
        w.pending.append(buf, size_t(n));
        for (size_t nl; (nl = w.pending.find('\n')) != std::string::npos;) {
          const std::string line = w.pending.substr(0, nl);
          w.pending.erase(0, nl + 1);
          size_t index = 0;
          char value[48] = {0};
          if (std::sscanf(line.c_str(), "S %zu", &index) == 1) {
            w.current = index;
          } else if (std::sscanf(line.c_str(), "R %zu %47s", &index, value) == 2 && index < count) {
            w.current = SIZE_MAX;
            on_result(index, std::strtod(value, nullptr));
          } else if (std::sscanf(line.c_str(), "F %zu", &index) == 1 && index < count) {
            w.current = SIZE_MAX;
            std::fprintf(stderr, "lr-sweep: run %zu failed, counted as diverged: %s\n", index, line.c_str());
            on_result(index, std::numeric_limits<double>::infinity());
          }
        }
        continue;
      }
      close(w.fd);
      int status = 0;
      waitpid(w.pid, &status, 0);
      const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (w.current != SIZE_MAX) {  // killed mid-run (a signal): that run counts as diverged
        std::fprintf(stderr, "lr-sweep: run %zu ended its process (status %d), counted as diverged\n", w.current,
                     status);
        on_result(w.current, std::numeric_limits<double>::infinity());
      }
      live.erase(live.begin() + std::ptrdiff_t(k));
      if (!clean && ++lost > int(count)) break;  // every run failing: stop respawning
      if (!clean && next->load() < count) spawn();
    }
  }
  const bool unfinished = next->load() < count;
  munmap(shared, sizeof(std::atomic<size_t>));
  require(!unfinished, ErrorCode::peer_failure, "lr-sweep: worker processes kept failing; see the messages above");
}

LrSweepResult lr_sweep(const LrSweepConfig& config, const TextSplit& text,
                       const std::function<void(const SweepPoint&, int, int)>& on_point) {
  require(!config.lrs.empty() && !config.multipliers.empty(), ErrorCode::invalid_argument, "empty sweep grid");
  // Widest first, so the longest runs start early and the short ones fill in at the end.
  std::vector<int64_t> widest_first = config.multipliers;
  std::sort(widest_first.rbegin(), widest_first.rend());
  std::vector<std::pair<int64_t, double>> grid;
  for (int64_t m : widest_first)
    for (double lr : config.lrs) grid.emplace_back(m, lr);
  auto run = [&](size_t i) {
    TrainConfig c = at_width(config.train, grid[i].first);
    c.adam.lr = grid[i].second;
    c.threads = 1;
    return SweepPoint{c.model.d_model, c.adam.lr, train_and_evaluate(c, text, config.eval_batches)};
  };
  LrSweepResult result;
  result.points.resize(grid.size());
  std::mutex report;
  int done = 0;
  auto record = [&](size_t i, const SweepPoint& point) {
    std::lock_guard lock(report);
    result.points[i] = point;
    if (on_point) on_point(point, ++done, int(grid.size()));
  };
  if (config.train.backend == Backend::cuda && config.workers > 1) {
    run_in_processes(grid.size(), config.workers, [&](size_t i) { return run(i).loss; }, [&](size_t i, double loss) {
      const TrainConfig c = at_width(config.train, grid[i].first);
      record(i, {c.model.d_model, grid[i].second, loss});
    });
  } else {
    std::atomic<size_t> next{0};
    std::exception_ptr error;
    auto worker = [&] {
      for (size_t i; (i = next.fetch_add(1)) < grid.size();) {
        try {
          record(i, run(i));
        } catch (...) {
          std::lock_guard lock(report);
          if (!error) error = std::current_exception();
          next = grid.size();  // stop the other workers too
          return;
        }
      }
    };
    std::vector<std::thread> pool;
    for (int w = 0; w < std::max(1, config.workers); ++w) pool.emplace_back(worker);
    for (auto& t : pool) t.join();
    if (error) std::rethrow_exception(error);
  }
  result.optima = find_optima(result.points);
  result.drift_log2 = std::log2(result.optima.back().eta_star / result.optima.front().eta_star);
  return result;
}

}  // namespace moka::train
