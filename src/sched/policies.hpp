// Scheduling policies of one all-to-all epoch on a single-tier fabric, as fluid plans: the
// rate at which each sender injects each flow over time. What a receiver gets beyond what it
// drains waits in the switch (see fluid_sim.hpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "sched/phases.hpp"
#include "sched/traffic.hpp"

namespace moka::sched {

enum class Policy : uint8_t {
  rate_based,         // constant rate D_ij / T* per pair (incast-free, finishes at T*)
  round_robin,        // each sender splits its line rate over the destinations it has left
  destination_major,  // each sender serves one destination at a time, largest first
  spreadout,          // shifted order i+1, i+2, ... at line rate, no synchronisation
  spreadout_barrier,  // step s: i -> (i+s) mod n for all i, a barrier between steps
  bvn,                // Birkhoff-von Neumann phases (padding + perfect matchings)
  greedy_matching,    // greedy max-weight matchings up to a phase budget, rest rate-based
  max_min_fair,       // processor sharing across the fabric (max-min fair water filling)
};
const std::vector<Policy>& all_policies();
std::string to_string(Policy p);
Policy parse_policy(const std::string& name);

struct PolicyOptions {
  double barrier_s = 0;  // cost of one global barrier (phased policies pay it per phase)
  int phase_budget = 0;  // greedy_matching; 0 = n
};

// Sender i injects flow (i, dst) at `rate` bytes/s during [start, end).
struct RateSegment {
  double start = 0, end = 0;
  int src = 0, dst = 0;
  double rate = 0;
};

struct FluidPlan {
  std::vector<RateSegment> segments;
  double injection_end = 0;  // last byte leaves its sender
  int phases = 0;            // matchings or steps, for phased policies
};

// Shared by the fluid and packet models:
// the destinations of sender i in the order destination_major / spreadout serve them;
std::vector<int> destination_order(Policy p, const TrafficMatrix& d, int sender);
// whether the policy runs in matching phases separated by barriers, and those phases
// (`residual`: what greedy_matching leaves to a final rate-based phase; empty otherwise).
bool is_phased(Policy p);
std::vector<Phase> policy_phases(Policy p, const TrafficMatrix& d, const PolicyOptions& options,
                                 TrafficMatrix& residual);

FluidPlan plan_fluid(Policy p, const TrafficMatrix& d, const Fabric& fabric, const PolicyOptions& options = {});

}  // namespace moka::sched
