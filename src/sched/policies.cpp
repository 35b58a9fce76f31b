#include "sched/policies.hpp"

#include <algorithm>
#include <numeric>

#include "moka/error.hpp"
#include "sched/phases.hpp"

namespace moka::sched {

namespace {
const std::vector<std::pair<Policy, const char*>> kPolicyNames = {
    {Policy::rate_based, "rate-based"},
    {Policy::round_robin, "round-robin"},
    {Policy::destination_major, "destination-major"},
    {Policy::spreadout, "spreadout"},
    {Policy::spreadout_barrier, "spreadout-barrier"},
    {Policy::bvn, "bvn"},
    {Policy::greedy_matching, "greedy-matching"},
    {Policy::max_min_fair, "max-min-fair"},
};
}  // namespace

const std::vector<Policy>& all_policies() {
  static const std::vector<Policy> policies = [] {
    std::vector<Policy> p;
    for (const auto& [policy, name] : kPolicyNames) p.push_back(policy);
    return p;
  }();
  return policies;
}

std::string to_string(Policy p) {
  for (const auto& [policy, name] : kPolicyNames)
    if (policy == p) return name;
  throw Error(ErrorCode::internal, "unnamed policy");
}

Policy parse_policy(const std::string& name) {
  for (const auto& [policy, policy_name] : kPolicyNames)
    if (name == policy_name) return policy;
  throw Error(ErrorCode::invalid_argument, "unknown policy '" + name + "'");
}

namespace {

std::vector<int> shifted_destinations(int n, int i) {
  std::vector<int> order(n - 1);
  for (int s = 1; s < n; ++s) order[s - 1] = (i + s) % n;
  return order;
}

double pair_bw(const Fabric& f, int i, int j) { return std::min(f.send_bw_of(i), f.recv_bw_of(j)); }
double as_double(int64_t bytes) { return static_cast<double>(bytes); }

// Every pair at D_ij / T, starting at `start`, so the whole matrix ends at start + T.
void add_constant_rates(const TrafficMatrix& d, double start, double span, FluidPlan& plan) {
  for (int i = 0; i < d.n; ++i)
    for (int j = 0; j < d.n; ++j)
      if (d.at(i, j) > 0) plan.segments.push_back({start, start + span, i, j, as_double(d.at(i, j)) / span});
  plan.injection_end = std::max(plan.injection_end, start + span);
}

FluidPlan rate_based(const TrafficMatrix& d, const Fabric& f) {
  FluidPlan plan;
  const double tstar = lower_bound(d, f).seconds;
  if (tstar > 0) add_constant_rates(d, 0, tstar, plan);
  return plan;
}

// Each sender sends its flows one after another at line rate, in `order_of(i)`.
FluidPlan one_destination_at_a_time(Policy p, const TrafficMatrix& d, const Fabric& f) {
  FluidPlan plan;
  for (int i = 0; i < d.n; ++i) {
    double t = 0;
    const double bw = f.send_bw_of(i);
    for (int j : destination_order(p, d, i)) {
      if (d.at(i, j) == 0) continue;
      const double dt = as_double(d.at(i, j)) / bw;
      plan.segments.push_back({t, t + dt, i, j, bw});
      t += dt;
    }
    plan.injection_end = std::max(plan.injection_end, t);
  }
  return plan;
}

// Processor sharing inside each sender: the line rate split equally over unfinished flows.
FluidPlan round_robin(const TrafficMatrix& d, const Fabric& f) {
  FluidPlan plan;
  for (int i = 0; i < d.n; ++i) {
    std::vector<int> flows;
    for (int j : shifted_destinations(d.n, i))
      if (d.at(i, j) > 0) flows.push_back(j);
    std::stable_sort(flows.begin(), flows.end(), [&](int a, int b) { return d.at(i, a) < d.at(i, b); });
    double t = 0, sent_per_flow = 0;
    const double bw = f.send_bw_of(i);
    for (size_t k = 0; k < flows.size(); ++k) {
      const double active = static_cast<double>(flows.size() - k);
      const double dt = (as_double(d.at(i, flows[k])) - sent_per_flow) * active / bw;
      if (dt <= 0) continue;  // equal sizes finish together
      for (size_t m = k; m < flows.size(); ++m) plan.segments.push_back({t, t + dt, i, flows[m], bw / active});
      t += dt;
      sent_per_flow = as_double(d.at(i, flows[k]));
    }
    plan.injection_end = std::max(plan.injection_end, t);
  }
  return plan;
}

// Phases one after another, each as long as its slowest pair, a barrier between phases.
void add_phases(const std::vector<Phase>& phases, const Fabric& f, double barrier_s, FluidPlan& plan) {
  double t = plan.injection_end;
  for (const Phase& ph : phases) {
    if (plan.phases++ > 0) t += barrier_s;
    double longest = 0;
    for (int i = 0; i < static_cast<int>(ph.receiver_of.size()); ++i) {
      if (ph.bytes_of[i] == 0) continue;
      const int j = ph.receiver_of[i];
      const double dt = as_double(ph.bytes_of[i]) / pair_bw(f, i, j);
      plan.segments.push_back({t, t + dt, i, j, pair_bw(f, i, j)});
      longest = std::max(longest, dt);
    }
    t += longest;
  }
  plan.injection_end = t;
}

std::vector<Phase> shift_steps(const TrafficMatrix& d) {
  std::vector<Phase> steps;
  for (int s = 1; s < d.n; ++s) {
    Phase ph{std::vector<int>(d.n), std::vector<int64_t>(d.n), 0};
    for (int i = 0; i < d.n; ++i) ph.receiver_of[i] = (i + s) % d.n, ph.bytes_of[i] = d.at(i, (i + s) % d.n);
    if (std::any_of(ph.bytes_of.begin(), ph.bytes_of.end(), [](int64_t b) { return b > 0; })) steps.push_back(ph);
  }
  return steps;
}

FluidPlan phased(const std::vector<Phase>& phases, const Fabric& f, double barrier_s) {
  FluidPlan plan;
  add_phases(phases, f, barrier_s, plan);
  return plan;
}

FluidPlan phased_plan(Policy p, const TrafficMatrix& d, const Fabric& f, const PolicyOptions& o) {
  TrafficMatrix residual(d.n);
  FluidPlan plan = phased(policy_phases(p, d, o, residual), f, o.barrier_s);
  const double tail = lower_bound(residual, f).seconds;
  if (tail > 0) add_constant_rates(residual, plan.injection_end + (plan.phases > 0 ? o.barrier_s : 0), tail, plan);
  return plan;
}

// Max-min fair rates of the active flows under sender and receiver port capacities
// (progressive filling: raise all rates together, freeze the flows of each port that fills).
class WaterFilling {
 public:
  WaterFilling(const TrafficMatrix& d, const Fabric& f) : n_(d.n), capacity_(2 * d.n) {
    for (int k = 0; k < n_; ++k) capacity_[k] = f.send_bw_of(k), capacity_[n_ + k] = f.recv_bw_of(k);
  }

  void fill(const std::vector<std::pair<int, int>>& flows, std::vector<double>& rate) {
    std::vector<double> left = capacity_;
    std::vector<std::vector<int>> flows_of(2 * n_);
    for (int k = 0; k < static_cast<int>(flows.size()); ++k) {
      flows_of[flows[k].first].push_back(k);
      flows_of[n_ + flows[k].second].push_back(k);
    }
    std::vector<int> unfrozen_on(2 * n_);
    for (int l = 0; l < 2 * n_; ++l) unfrozen_on[l] = static_cast<int>(flows_of[l].size());
    std::vector<bool> frozen(flows.size(), false);
    rate.assign(flows.size(), 0);
    double level = 0;
    for (size_t unfrozen = flows.size(); unfrozen > 0;) {
      int bottleneck = -1;
      for (int l = 0; l < 2 * n_; ++l)
        if (unfrozen_on[l] > 0 &&
            (bottleneck < 0 || left[l] * unfrozen_on[bottleneck] < left[bottleneck] * unfrozen_on[l]))
          bottleneck = l;
      const double step = left[bottleneck] / unfrozen_on[bottleneck];
      level += step;
      for (int l = 0; l < 2 * n_; ++l) left[l] -= step * unfrozen_on[l];
      for (int k : flows_of[bottleneck]) {
        if (frozen[k]) continue;
        frozen[k] = true, rate[k] = level, --unfrozen;
        --unfrozen_on[flows[k].first], --unfrozen_on[n_ + flows[k].second];
      }
    }
  }

 private:
  int n_;
  std::vector<double> capacity_;
};

// Max-min fair never offers a port more than its capacity, so no queue forms anywhere: the
// plan records only the completion time (segments would be one per flow and rate change).
FluidPlan max_min_fair(const TrafficMatrix& d, const Fabric& f) {
  std::vector<std::pair<int, int>> flows;
  std::vector<double> left, rate;
  for (int i = 0; i < d.n; ++i)
    for (int j = 0; j < d.n; ++j)
      if (d.at(i, j) > 0) flows.emplace_back(i, j), left.push_back(as_double(d.at(i, j)));
  WaterFilling water(d, f);
  FluidPlan plan;
  double t = 0;
  while (!flows.empty()) {
    water.fill(flows, rate);
    double dt = left[0] / rate[0];
    for (size_t k = 1; k < flows.size(); ++k) dt = std::min(dt, left[k] / rate[k]);
    t += dt;
    for (size_t k = flows.size(); k-- > 0;) {
      left[k] -= rate[k] * dt;
      if (left[k] <= 1e-9 * rate[k] * t) {  // finished, up to rounding
        flows.erase(flows.begin() + static_cast<std::ptrdiff_t>(k));
        left.erase(left.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
  }
  plan.injection_end = t;
  return plan;
}

}  // namespace

std::vector<int> destination_order(Policy p, const TrafficMatrix& d, int i) {
  auto order = shifted_destinations(d.n, i);
  if (p == Policy::destination_major)
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return d.at(i, a) > d.at(i, b); });
  return order;
}

bool is_phased(Policy p) { return p == Policy::spreadout_barrier || p == Policy::bvn || p == Policy::greedy_matching; }

std::vector<Phase> policy_phases(Policy p, const TrafficMatrix& d, const PolicyOptions& o, TrafficMatrix& residual) {
  residual = TrafficMatrix(d.n);
  switch (p) {
    case Policy::spreadout_barrier: return shift_steps(d);
    case Policy::bvn: return bvn_phases(d);
    case Policy::greedy_matching: return greedy_phases(d, o.phase_budget > 0 ? o.phase_budget : d.n, residual);
    default: throw Error(ErrorCode::invalid_argument, to_string(p) + " is not a phased policy");
  }
}

FluidPlan plan_fluid(Policy p, const TrafficMatrix& d, const Fabric& f, const PolicyOptions& o) {
  require(d.n == f.gpus, ErrorCode::shape_mismatch, "traffic matrix and fabric disagree on the GPU count");
  switch (p) {
    case Policy::rate_based: return rate_based(d, f);
    case Policy::round_robin: return round_robin(d, f);
    case Policy::destination_major:
    case Policy::spreadout: return one_destination_at_a_time(p, d, f);
    case Policy::spreadout_barrier:
    case Policy::bvn:
    case Policy::greedy_matching: return phased_plan(p, d, f, o);
    case Policy::max_min_fair: return max_min_fair(d, f);
  }
  throw Error(ErrorCode::internal, "unhandled policy");
}

}  // namespace moka::sched
