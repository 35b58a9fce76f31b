#include <gtest/gtest.h>

#include <map>

#include "determinism.hpp"
#include "sched/fluid_sim.hpp"
#include "sched_fixtures.hpp"

using namespace moka::sched;
using namespace moka::sched::testing;

namespace {
double completion(Policy p, const TrafficMatrix& d, const Fabric& f) {
  return simulate_policy_fluid(p, d, f).completion_s;
}
}  // namespace

TEST(SchedFluid, LowerBoundNamesTheBindingPort) {
  const auto d = incast_counterexample();
  const auto lb = lower_bound(d, unit_fabric(16));
  EXPECT_DOUBLE_EQ(lb.seconds, 6.0);
  EXPECT_EQ(lb.port, 3);
  EXPECT_TRUE(lb.receiver);
  TrafficMatrix rows(4);
  rows.at(0, 1) = rows.at(0, 2) = rows.at(0, 3) = 2;
  const auto sender_bound = lower_bound(rows, unit_fabric(4, 1.0));
  EXPECT_DOUBLE_EQ(sender_bound.seconds, 6.0);
  EXPECT_EQ(sender_bound.port, 0);
  EXPECT_FALSE(sender_bound.receiver);
}

TEST(SchedFluid, CounterexampleMatchesTheResearchNote) {
  const auto d = incast_counterexample();
  const auto f = unit_fabric(16);
  EXPECT_NEAR(completion(Policy::rate_based, d, f), 6.0, 1e-9);
  EXPECT_NEAR(completion(Policy::max_min_fair, d, f), 7.0, 1e-9);
  EXPECT_NEAR(completion(Policy::round_robin, d, f), 7.0, 1e-9);
  EXPECT_NEAR(completion(Policy::spreadout_barrier, d, f), 11.0, 1e-9);
  const auto rr = simulate_policy_fluid(Policy::round_robin, d, f);
  EXPECT_EQ(rr.hot_receiver, 3);
  EXPECT_NEAR(rr.peak_hot_queue(), 3 * 2.0, 1e-9);  // 3 units of 2 bytes
  EXPECT_LT(simulate_policy_fluid(Policy::rate_based, d, f).peak_hot_queue(), 1e-9);
}

TEST(SchedFluid, UniformAndPermutationFinishAtTStarUnderEveryPolicy) {
  for (int n : {4, 9, 16}) {
    const auto f = unit_fabric(n, 3.0);
    const auto uniform = uniform_matrix(n, 6);
    const auto perm = permutation_matrix(n, 5, static_cast<uint64_t>(n));
    TrafficMatrix shift(n);
    for (int i = 0; i < n; ++i) shift.at(i, (i + 3) % n) = 5;
    for (Policy p : all_policies()) {
      SCOPED_TRACE(to_string(p) + " n=" + std::to_string(n));
      const auto u = simulate_policy_fluid(p, uniform, f);
      EXPECT_NEAR(u.completion_over_tstar(), 1.0, 1e-9);
      EXPECT_LT(u.peak_hot_queue(), 1e-6);
      // SpreadOut's steps are cyclic shifts: a permutation that is not a shift needs one step
      // per distinct shift, so SpreadOut is held to T* on a shift permutation.
      const TrafficMatrix& permutation = p == Policy::spreadout_barrier ? shift : perm;
      EXPECT_NEAR(simulate_policy_fluid(p, permutation, f).completion_over_tstar(), 1.0, 1e-9);
    }
  }
}

TEST(SchedFluid, RoundRobinHotQueueIsZeroEarlyAndGrowsConvexlyLate) {
  Fabric f;
  f.gpus = 64;
  const auto d = zipf_matrix(64, 0.3, 11, 512);
  const int points = 401;
  const auto plan = plan_fluid(Policy::round_robin, d, f);
  const auto rr = simulate_fluid(plan, d, f, points);
  const int hot = rr.hot_receiver;
  std::vector<double> q(points);
  for (int k = 0; k < points; ++k) q[k] = rr.series[k][hot];
  const int peak = static_cast<int>(std::max_element(q.begin(), q.end()) - q.begin());
  EXPECT_NEAR(q[peak], rr.peak_hot_queue(), 0.01 * rr.peak_hot_queue());
  // The epoch of the senders: the queue peaks when they finish injecting, and is empty for
  // the first 30% of their epoch.
  const int injection_end = static_cast<int>(plan.injection_end / rr.completion_s * (points - 1));
  EXPECT_NEAR(peak, injection_end, 2);
  for (int k = 0; k < 0.3 * injection_end; ++k) EXPECT_LT(q[k], 1e-9 * rr.peak_hot_queue()) << k;
  int rise = 0;
  while (q[rise] < 1e-6 * q[peak]) ++rise;
  EXPECT_GT(rise, 0.3 * injection_end);
  EXPECT_GT(peak, rise + 10);
  // Convex rise: the curve stays below its chord from the start of the rise to the peak.
  for (double at : {0.25, 0.5, 0.75}) {
    const int k = rise + static_cast<int>(at * (peak - rise));
    EXPECT_LT(q[k], at * q[peak]) << at;
  }
  const auto rate = simulate_policy_fluid(Policy::rate_based, d, f);
  EXPECT_LT(rate.peak_hot_queue(), 1e-6 * rr.peak_hot_queue());
}

TEST(SchedFluid, EveryPlanIsDeterministic) {
  Fabric f;
  f.gpus = 16;
  // Every policy's plan of a freshly drawn matrix, flattened, the policies planned in either
  // order (state one plan left behind would change the next).
  const auto plans = [&](bool reversed) {
    const auto d = zipf_matrix(16, 0.35, 2, 256);
    auto policies = all_policies();
    if (reversed) std::reverse(policies.begin(), policies.end());
    std::map<Policy, std::vector<double>> out;
    for (Policy p : policies) {
      const auto plan = plan_fluid(p, d, f, {1e-6, 4});
      auto& flat = out[p];
      flat = {plan.injection_end, double(plan.phases)};
      for (const auto& s : plan.segments)
        flat.insert(flat.end(), {s.start, s.end, double(s.src), double(s.dst), s.rate});
    }
    return out;
  };
  const auto runs = moka::testing::concurrent_runs([&] { return plans(false); });
  for (size_t r = 1; r < runs.size(); ++r) EXPECT_EQ(runs[r], runs[0]) << "run " << r;
  EXPECT_EQ(plans(true), runs[0]);
}

TEST(SchedFluid, RoutingCountsAndLocality) {
  // Token 0 of rank 0 picks experts 2 and 3, both on rank 1 (2 experts per rank).
  const std::vector<std::vector<int32_t>> ids = {{2, 3, 0, 2}, {0, 1, 1, 2}};
  const auto per_route = traffic_from_routing(ids, 2, 4, 10, CountMode::per_route);
  const auto per_gpu = traffic_from_routing(ids, 2, 4, 10, CountMode::per_gpu);
  EXPECT_EQ(per_route.at(0, 1), 30);
  EXPECT_EQ(per_gpu.at(0, 1), 20);
  EXPECT_EQ(per_route.at(1, 0), 30);
  EXPECT_EQ(per_gpu.at(1, 0), 20);
  SyntheticTraffic s;
  s.gpus = 16, s.tokens_per_rank = 256;
  const int64_t remote = synthetic_traffic(s).total();
  s.routing.locality = 0.6;
  EXPECT_LT(synthetic_traffic(s).total(), 0.7 * remote);  // local choices never cross the fabric
}
