#include "train/mup_experiments.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
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
constexpr int64_t kFiniteCheckEvery = 16;

TrainConfig at_width(const TrainConfig& t, int64_t multiplier) {
  TrainConfig c = t;
  c.model = scale_width(t.base, multiplier);
  return c;
}

}  // namespace

std::vector<double> train_and_evaluate_at(const TrainConfig& c, const TextSplit& text,
                                          const std::vector<int64_t>& eval_steps, int eval_batches, bool use_ema) {
  require(std::is_sorted(eval_steps.begin(), eval_steps.end()) &&
              (eval_steps.empty() || (eval_steps.front() >= 1 && eval_steps.back() <= c.schedule.total_steps)),
          ErrorCode::invalid_argument, "evaluation steps must ascend within the schedule");
  std::vector<double> losses(eval_steps.size(), std::numeric_limits<double>::infinity());
  try {
    Trainer trainer(c, text);
    size_t next = 0;
    while (next < eval_steps.size()) {
      // Stop at a non-finite loss (Trainer::step throws non_finite) or gradient: a diverged run's
      // later losses mean nothing. The numbers are read (a wait for the device) only every
      // kFiniteCheckEvery steps and before an evaluation, so the GPU runs ahead of the host in
      // between; the steps a diverged run takes past its first NaN stay harmless (NaN scores still
      // route to valid experts).
      const int64_t step = trainer.steps_done() + 1;
      const bool check = step % kFiniteCheckEvery == 0 || step == eval_steps[next];
      const auto r = trainer.step(nullptr, check);
      if (check && !std::isfinite(r.grad_norm)) break;
      for (; next < eval_steps.size() && eval_steps[next] == trainer.steps_done(); ++next) {
        const double loss = trainer.evaluate(eval_batches, use_ema);
        if (std::isfinite(loss)) losses[next] = loss;
      }
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::non_finite) throw;
  }
  return losses;
}

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

LrOptimum fit_lr_optimum(const std::vector<double>& lrs, const std::vector<double>& losses) {
  require(lrs.size() == losses.size(), ErrorCode::invalid_argument, "LR optimum: one loss per LR");
  require(std::is_sorted(lrs.begin(), lrs.end()), ErrorCode::invalid_argument, "LR optimum: LRs must ascend");
  LrOptimum o;
  const auto best = std::min_element(losses.begin(), losses.end());
  require(best != losses.end() && std::isfinite(*best), ErrorCode::invalid_argument, "LR optimum: every run diverged");
  const auto i = best - losses.begin();
  o.best_grid_lr = lrs[i];
  o.best_grid_loss = *best;
  std::vector<double> x, y;
  for (auto j = std::max<std::ptrdiff_t>(0, i - 2);
       j <= std::min<std::ptrdiff_t>(std::ptrdiff_t(lrs.size()) - 1, i + 2); ++j) {
    if (!std::isfinite(losses[j])) continue;
    x.push_back(std::log(lrs[j]));
    y.push_back(losses[j]);
  }
  require(x.size() >= 3, ErrorCode::invalid_argument,
          "LR optimum: " + std::to_string(x.size()) + " finite points around the best LR; the parabola needs 3");
  o.fit = fit_parabola(x, y);
  require(o.fit.has_minimum(), ErrorCode::invalid_argument,
          "LR optimum: the fitted parabola opens downward (a = " + std::to_string(o.fit.a) + " <= 0), no minimum");
  // Trust the vertex only inside the fitted range; outside it the parabola extrapolates.
  require(o.fit.argmin() >= x.front() && o.fit.argmin() <= x.back(), ErrorCode::invalid_argument,
          "LR optimum: the vertex lies outside the fitted LRs (the optimum is at the grid's edge)");
  o.eta_star = std::exp(o.fit.argmin());
  return o;
}

Spread spread_of(const std::vector<double>& values) {
  Spread s;
  s.count = int(values.size());
  if (values.empty()) return s;
  s.min = *std::min_element(values.begin(), values.end());
  s.max = *std::max_element(values.begin(), values.end());
  for (double v : values) s.mean += v;
  s.mean /= double(values.size());
  if (values.size() > 1) {
    double ss = 0;
    for (double v : values) ss += (v - s.mean) * (v - s.mean);
    s.std = std::sqrt(ss / double(values.size() - 1));
  }
  return s;
}

namespace {
WidthOptimum optimum_of(int64_t width, std::vector<SweepPoint> pts) {
  std::sort(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.lr < b.lr; });
  std::vector<double> lrs, losses;
  for (const auto& p : pts) {
    lrs.push_back(p.lr);
    losses.push_back(p.loss);
  }
  const auto best =
      std::min_element(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.loss < b.loss; });
  WidthOptimum o{width, {}, best->lr, false, best->lr, best->loss};
  try {
    const LrOptimum fitted = fit_lr_optimum(lrs, losses);
    o.fit = fitted.fit;
    o.eta_star = fitted.eta_star;
    o.from_fit = true;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) throw;  // no usable vertex: the best grid LR stands
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

namespace {

// job(i) for every i < count in `workers` forked processes that take the next index from a
// shared counter; results come back over a pipe per process as text lines. CUDA runs go here:
// every process has its own CUDA context, so one model's host-side gaps (launches, the
// per-step synchronization, the moka router's per-call cudaMalloc/cudaFree, which waits for
// the whole device) are filled by the others' kernels; threads of one process would all wait
// on those device-wide synchronizations. A run that throws is reported empty (with its message
// on stderr) and its process is replaced, since a CUDA error can leave the context unusable.
// The parent must not have touched CUDA.
void run_in_processes(size_t count, int workers, const std::function<std::vector<double>(size_t)>& job,
                      const std::function<void(size_t, std::vector<double>)>& on_result) {
  void* shared = mmap(nullptr, sizeof(std::atomic<size_t>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  require(shared != MAP_FAILED, ErrorCode::io, "training runs: cannot map the shared work counter");
  auto* next = new (shared) std::atomic<size_t>(0);
  struct Worker {
    pid_t pid;
    int fd;
    std::string pending;
    size_t current = SIZE_MAX;  // the run it started and has not reported
  };
  std::vector<Worker> live;
  // A pipe or fork that fails stops the workers started (none runs on unsupervised) and says why.
  const auto fail_to_start = [&](const std::string& what, int err) {
    const std::string why = std::strerror(err);
    for (const auto& w : live) kill(w.pid, SIGKILL);
    for (const auto& w : live) {
      close(w.fd);
      waitpid(w.pid, nullptr, 0);
    }
    munmap(shared, sizeof(std::atomic<size_t>));
    return Error(ErrorCode::capacity_exceeded, "training runs: cannot start a worker process (" + what + ": " + why +
                                                   "); stopped the " + std::to_string(live.size()) +
                                                   " started (--workers sets how many)");
  };
  auto spawn = [&] {
    int p[2];
    if (pipe(p) != 0) throw fail_to_start("pipe", errno);
    const pid_t pid = fork();
    if (pid < 0) {
      const int err = errno;
      close(p[0]);
      close(p[1]);
      throw fail_to_start("fork", err);
    }
    if (pid == 0) {
      close(p[0]);
      auto say = [&](const std::string& line) { (void)!write(p[1], line.data(), line.size()); };
      for (size_t i; (i = next->fetch_add(1)) < count;) {
        try {
          say("S " + std::to_string(i) + "\n");
          std::string line = "R " + std::to_string(i);
          for (double v : job(i)) {
            char value[32];
            std::snprintf(value, sizeof value, " %.17g", v);
            line += value;
          }
          say(line + "\n");
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
          std::istringstream line(w.pending.substr(0, nl));
          w.pending.erase(0, nl + 1);
          char kind = 0;
          size_t index = SIZE_MAX;
          line >> kind >> index;
          if (!line || index >= count) continue;
          if (kind == 'S') {
            w.current = index;
          } else if (kind == 'R') {
            w.current = SIZE_MAX;
            std::vector<double> values;
            for (std::string v; line >> v;) values.push_back(std::strtod(v.c_str(), nullptr));
            on_result(index, std::move(values));
          } else if (kind == 'F') {
            w.current = SIZE_MAX;
            std::string message;
            std::getline(line, message);
            std::fprintf(stderr, "training run %zu failed, counted as diverged:%s\n", index, message.c_str());
            on_result(index, {});
          }
        }
        continue;
      }
      close(w.fd);
      int status = 0;
      waitpid(w.pid, &status, 0);
      const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (w.current != SIZE_MAX) {  // killed mid-run (a signal): that run counts as diverged
        std::fprintf(stderr, "training run %zu ended its process (status %d), counted as diverged\n", w.current,
                     status);
        on_result(w.current, {});
      }
      live.erase(live.begin() + std::ptrdiff_t(k));
      if (!clean && ++lost > int(count)) break;  // every run failing: stop respawning
      if (!clean && next->load() < count) spawn();
    }
  }
  const bool unfinished = next->load() < count;
  munmap(shared, sizeof(std::atomic<size_t>));
  require(!unfinished, ErrorCode::peer_failure, "training runs: worker processes kept failing; see the messages above");
}

void run_in_threads(size_t count, int workers, const std::function<std::vector<double>(size_t)>& job,
                    const std::function<void(size_t, std::vector<double>)>& on_result) {
  std::atomic<size_t> next{0};
  std::mutex report;
  std::exception_ptr error;
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < count;) {
      try {
        auto values = job(i);
        std::lock_guard lock(report);
        on_result(i, std::move(values));
      } catch (...) {
        std::lock_guard lock(report);
        if (!error) error = std::current_exception();
        next = count;  // stop the other workers too
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  std::string start_failure;
  for (int w = 0; w < workers; ++w) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error& e) {
      // The limit on processes and threads or the memory for stacks is reached: stop the workers
      // started and join them (a joinable std::thread destroyed ends the process in terminate).
      start_failure = "training runs: cannot start worker thread " + std::to_string(w) + " of " +
                      std::to_string(workers) + ": " + e.what() +
                      " (the limit on processes and threads, ulimit -u, or memory for thread stacks; --workers "
                      "sets how many)";
      next = count;
      break;
    }
  }
  for (auto& t : pool) t.join();
  require(start_failure.empty(), ErrorCode::capacity_exceeded, start_failure);
  if (error) std::rethrow_exception(error);
}

}  // namespace

void run_jobs(size_t count, int workers, bool in_processes, const std::function<std::vector<double>(size_t)>& job,
              const std::function<void(size_t, std::vector<double>)>& on_result) {
  workers = int(std::clamp<size_t>(count, 1, size_t(std::max(1, workers))));  // no more workers than runs
  if (in_processes) run_in_processes(count, workers, job, on_result);
  else run_in_threads(count, workers, job, on_result);
}

namespace {
double log2_drift(const std::vector<WidthOptimum>& optima) {
  return std::log2(optima.back().eta_star / optima.front().eta_star);
}
}  // namespace

LrSweepResult lr_sweep(const LrSweepConfig& config, const TextSplit& text,
                       const std::function<void(const SweepPoint&, int, int)>& on_point) {
  require(!config.lrs.empty() && !config.multipliers.empty(), ErrorCode::invalid_argument, "empty sweep grid");
  require(config.seeds >= 1, ErrorCode::invalid_argument, "a sweep needs one or more seeds");
  // Widest first, so the longest runs start early and the short ones fill in at the end.
  std::vector<int64_t> widest_first = config.multipliers;
  std::sort(widest_first.rbegin(), widest_first.rend());
  std::vector<SweepPoint> grid;  // loss filled in as runs finish
  std::vector<TrainConfig> configs;
  for (int64_t m : widest_first)
    for (double lr : config.lrs)
      for (int s = 0; s < config.seeds; ++s) {
        TrainConfig c = at_width(config.train, m);
        c.adam.lr = lr;
        c.seed = config.train.seed + uint64_t(s);
        c.validation_seed = config.train.seed;  // every seed on the same validation batches
        c.threads = 1;
        grid.push_back({c.model.d_model, lr, 0.0, c.seed});
        configs.push_back(c);
      }
  LrSweepResult result;
  result.points = grid;
  int done = 0;
  const bool in_processes = config.train.backend == Backend::cuda && config.workers > 1;
  run_jobs(
      grid.size(), config.workers, in_processes,
      [&](size_t i) {
        const TrainConfig& c = configs[i];
        return train_and_evaluate_at(c, text, {c.schedule.total_steps}, config.eval_batches, false);
      },
      [&](size_t i, std::vector<double> losses) {
        result.points[i].loss = losses.size() == 1 ? losses[0] : std::numeric_limits<double>::infinity();
        if (on_point) on_point(result.points[i], ++done, int(grid.size()));
      });

  // The seed-averaged curve gives the headline optimum; each seed's own optima give the spread.
  std::map<std::pair<int64_t, double>, std::vector<double>> by_cell;
  std::map<uint64_t, std::vector<SweepPoint>> by_seed;
  for (const auto& p : result.points) {
    by_cell[{p.width, p.lr}].push_back(p.loss);
    by_seed[p.seed].push_back(p);
  }
  std::vector<SweepPoint> averaged;
  for (const auto& [cell, losses] : by_cell) {
    double mean = 0;
    for (double l : losses) mean += l / double(losses.size());
    averaged.push_back({cell.first, cell.second, mean, 0});
  }
  result.optima = find_optima(averaged);
  result.drift_log2 = log2_drift(result.optima);
  std::vector<std::vector<double>> log2_eta(result.optima.size());
  std::vector<double> drifts;
  for (const auto& [seed, points] : by_seed) {
    SeedOptima so{seed, find_optima(points), 0};
    so.drift_log2 = log2_drift(so.optima);
    for (size_t w = 0; w < so.optima.size(); ++w) log2_eta[w].push_back(std::log2(so.optima[w].eta_star));
    drifts.push_back(so.drift_log2);
    result.per_seed.push_back(std::move(so));
  }
  for (const auto& values : log2_eta) result.log2_eta_star_spread.push_back(spread_of(values));
  result.drift_spread = spread_of(drifts);
  return result;
}

}  // namespace moka::train
