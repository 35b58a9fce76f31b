#include <gtest/gtest.h>

#include "sched/phases.hpp"
#include "sched/two_tier.hpp"
#include "sched_fixtures.hpp"

using namespace moka::sched;
using namespace moka::sched::testing;

namespace {
void expect_matching(const Phase& ph) {
  std::vector<int> hits(ph.receiver_of.size(), 0);
  for (int j : ph.receiver_of)
    if (j >= 0) EXPECT_EQ(++hits[j], 1);
}
TrafficMatrix sum_of(const std::vector<Phase>& phases, int n) {
  TrafficMatrix s(n);
  for (const Phase& ph : phases)
    for (int i = 0; i < n; ++i)
      if (ph.receiver_of[i] >= 0) s.at(i, ph.receiver_of[i]) += ph.bytes_of[i];
  return s;
}
}  // namespace

TEST(SchedPhases, PaddingEqualisesEveryLine) {
  const auto d = zipf_matrix(12, 0.4, 5, 128);
  const auto p = pad_to_equal_line_sums(d);
  for (int k = 0; k < d.n; ++k) {
    EXPECT_EQ(p.row_sum(k), d.max_line_sum());
    EXPECT_EQ(p.col_sum(k), d.max_line_sum());
    for (int j = 0; j < d.n; ++j) EXPECT_GE(p.at(k, j), d.at(k, j));
  }
}

TEST(SchedPhases, BvnPhasesSumBackToTheMatrixExactly) {
  for (uint64_t seed : {1, 2, 3}) {
    const auto d = zipf_matrix(16, 0.3, seed, 200);
    const auto phases = bvn_phases(d);
    int64_t weights = 0;
    for (const Phase& ph : phases) {
      expect_matching(ph);
      for (int i = 0; i < d.n; ++i) EXPECT_LE(ph.bytes_of[i], ph.weight);
      weights += ph.weight;
    }
    EXPECT_EQ(sum_of(phases, d.n), d);
    EXPECT_LE(weights, d.max_line_sum());
    EXPECT_LE(static_cast<int>(phases.size()), d.n * d.n - 2 * d.n + 2);
  }
}

TEST(SchedPhases, GreedyPhasesPlusResidualIsTheMatrix) {
  const auto d = zipf_matrix(16, 0.3, 4, 200);
  TrafficMatrix residual;
  const auto phases = greedy_phases(d, 5, residual);
  EXPECT_EQ(phases.size(), 5u);
  for (const Phase& ph : phases) expect_matching(ph);
  auto total = sum_of(phases, d.n);
  for (size_t k = 0; k < d.bytes.size(); ++k) total.bytes[k] += residual.bytes[k];
  EXPECT_EQ(total, d);
  EXPECT_GT(residual.total(), 0);
}

TEST(SchedPhases, TwoTierStaysWithinTenPercentOfItsServerBound) {
  Fabric f;
  f.gpus = 64, f.gpus_per_server = 8;
  const auto d = zipf_matrix(64, 0.3, 7, 4096);   // the default epoch: ~10 ms at 50 GB/s NICs
  const auto r = plan_two_tier(d, f, {1e-6, 0});  // 1 us per server phase
  EXPECT_GE(r.completion_s, r.server_bound_s);
  EXPECT_LT(r.completion_s, 1.10 * r.server_bound_s);
  EXPECT_GT(r.direct_nic_bound_s, r.server_bound_s);  // balancing over NVLink is what pays
  const auto servers = server_matrix(d, f);
  int64_t inter = 0;
  for (int i = 0; i < d.n; ++i)
    for (int j = 0; j < d.n; ++j) inter += f.server_of(i) != f.server_of(j) ? d.at(i, j) : 0;
  EXPECT_EQ(servers.total(), inter);
}
