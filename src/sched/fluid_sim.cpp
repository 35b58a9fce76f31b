#include "sched/fluid_sim.hpp"

#include <algorithm>

namespace moka::sched {

namespace {

struct RateChange {
  double time;
  double delta;
  bool operator<(const RateChange& o) const { return time < o.time; }
};

struct PortTrace {
  double last_delivery = 0;  // the port's last byte leaves the switch
  double peak = 0;
  double integral = 0;  // of queue bytes over time
};

// Walks one receiver port through its arrival-rate changes. The queue is linear between
// changes (arrivals minus drain, floored at zero), so everything is computed in closed form.
// `samples` (optional) receives the queue at the sorted `sample_times`.
PortTrace walk_port(const std::vector<RateChange>& changes, double drain, const std::vector<double>& sample_times,
                    std::vector<double>* samples) {
  PortTrace trace;
  double queue = 0, arrival = 0, t = 0;
  size_t next_sample = 0;
  const auto advance = [&](double until) {
    const double net = arrival - drain;
    for (; samples && next_sample < sample_times.size() && sample_times[next_sample] <= until; ++next_sample)
      (*samples)[next_sample] = std::max(0.0, queue + net * (sample_times[next_sample] - t));
    const double dt = until - t;
    const double end_queue = queue + net * dt;
    if (end_queue >= 0) {
      trace.integral += 0.5 * (queue + end_queue) * dt;
      queue = end_queue;
    } else {
      trace.integral += 0.5 * queue * (queue / -net);
      queue = 0;
    }
    trace.peak = std::max(trace.peak, queue);
    t = until;
  };
  for (const RateChange& c : changes) {
    advance(c.time);
    arrival += c.delta;
  }
  arrival = 0;
  trace.last_delivery = t + queue / drain;
  advance(std::max(trace.last_delivery, sample_times.empty() ? t : sample_times.back()));
  return trace;
}

}  // namespace

SimResult simulate_fluid(const FluidPlan& plan, const TrafficMatrix& d, const Fabric& f, int series_points) {
  SimResult r;
  r.tstar_s = lower_bound(d, f).seconds;
  r.hot_receiver = hottest_receiver(d, f);
  r.phases = plan.phases;
  std::vector<std::vector<RateChange>> changes(d.n);
  for (const RateSegment& s : plan.segments) {
    changes[s.dst].push_back({s.start, s.rate});
    changes[s.dst].push_back({s.end, -s.rate});
  }
  std::vector<PortTrace> traces(d.n);
  r.completion_s = plan.injection_end;
  for (int j = 0; j < d.n; ++j) {
    std::stable_sort(changes[j].begin(), changes[j].end());
    traces[j] = walk_port(changes[j], f.recv_bw_of(j), {}, nullptr);
    r.completion_s = std::max(r.completion_s, traces[j].last_delivery);
  }
  for (const PortTrace& t : traces) {
    r.peak_queue.push_back(t.peak);
    r.mean_queue.push_back(r.completion_s > 0 ? t.integral / r.completion_s : 0);
  }
  if (series_points < 2) return r;
  for (int k = 0; k < series_points; ++k) r.series_times.push_back(r.completion_s * k / (series_points - 1));
  r.series.assign(series_points, std::vector<double>(d.n));
  std::vector<double> samples(series_points);
  for (int j = 0; j < d.n; ++j) {
    walk_port(changes[j], f.recv_bw_of(j), r.series_times, &samples);
    for (int k = 0; k < series_points; ++k) r.series[k][j] = samples[k];
  }
  return r;
}

SimResult simulate_policy_fluid(Policy p, const TrafficMatrix& d, const Fabric& f, const PolicyOptions& o,
                                int series_points) {
  SimResult r = simulate_fluid(plan_fluid(p, d, f, o), d, f, series_points);
  r.policy = to_string(p);
  return r;
}

}  // namespace moka::sched
