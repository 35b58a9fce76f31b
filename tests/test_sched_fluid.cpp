#include <gtest/gtest.h>

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
