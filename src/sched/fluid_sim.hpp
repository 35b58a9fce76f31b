// Exact event-driven fluid model of a single-tier non-blocking fabric: senders inject at the
// plan's piecewise-constant rates, each receiver port drains at its line rate, and whatever
// exceeds the drain queues in the switch in front of that port (unbounded buffer, no
// back-pressure: the packet model adds those). Queues are piecewise linear, so peaks,
// averages and completion are exact up to floating point.
#pragma once
#include <string>
#include <vector>

#include "sched/policies.hpp"

namespace moka::sched {

struct SimResult {
  std::string policy;
  double completion_s = 0;  // last byte delivered
  double tstar_s = 0;
  int hot_receiver = 0;
  std::vector<double> peak_queue;  // bytes, per receiver port
  std::vector<double> mean_queue;  // bytes, time-averaged over [0, completion]
  double pause_s = 0;              // packet model: sender time spent blocked by back-pressure
  int phases = 0;
  // Queue bytes per receiver port at series_times (uniform grid over [0, completion]).
  std::vector<double> series_times;
  std::vector<std::vector<double>> series;  // [time][port]

  double completion_over_tstar() const { return completion_s / tstar_s; }
  double peak_hot_queue() const { return peak_queue.at(hot_receiver); }
};

SimResult simulate_fluid(const FluidPlan& plan, const TrafficMatrix& d, const Fabric& fabric, int series_points = 0);

// Shorthand: plan and simulate one policy.
SimResult simulate_policy_fluid(Policy p, const TrafficMatrix& d, const Fabric& fabric,
                                const PolicyOptions& options = {}, int series_points = 0);

}  // namespace moka::sched
