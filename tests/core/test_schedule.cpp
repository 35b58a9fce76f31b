#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "core/routing_gen.hpp"
#include "core/schedule.hpp"
#include "determinism.hpp"

using namespace moka::core;

namespace {
std::vector<int32_t> routing(int R, int64_t T, int64_t k, int64_t E, RoutingKind kind, uint64_t seed) {
  std::vector<int32_t> all;
  for (int r = 0; r < R; ++r) {
    auto ids = sample_topk_ids({kind, 0.35, seed}, T, k, E, r);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  return all;
}
}  // namespace

class ScheduleInvariants
    : public ::testing::TestWithParam<std::tuple<int, int64_t, int64_t, RoutingKind, moka::RowOrder>> {};

TEST_P(ScheduleInvariants, EveryRoutePlacedOnceWithCorrectPadding) {
  const auto [R, T, tile, kind, row_order] = GetParam();
  const int64_t k = 3, E = 16;
  const auto all = routing(R, T, k, E, kind, 7);
  std::set<std::tuple<int, int64_t>> seen;
  for (int rank = 0; rank < R; ++rank) {
    ScheduleDims d{R, T, k, E / R, rank * (E / R), tile, row_order, rank};
    const auto s = build_receive_schedule(d, all.data());
    ASSERT_EQ(s.expert_offset.size(), size_t(E / R + 1));
    for (int64_t e = 0; e < E / R; ++e) {
      const int64_t seg = s.expert_offset[e + 1] - s.expert_offset[e];
      EXPECT_EQ(seg % tile, 0);
      EXPECT_GE(seg, s.expert_rows[e]);
      EXPECT_LT(seg - s.expert_rows[e], tile);
      // Real rows first, padding after; each real row routes to this expert.
      for (int64_t r = s.expert_offset[e]; r < s.expert_offset[e + 1]; ++r) {
        const bool real = r < s.expert_offset[e] + s.expert_rows[e];
        EXPECT_EQ(s.row_source[r] >= 0, real);
        if (real) {
          EXPECT_EQ(all[s.row_source[r] * T * k + s.row_slot[r]], d.first_local_expert + e);
          EXPECT_TRUE(seen.insert({s.row_source[r], s.row_slot[r]}).second) << "route placed twice";
        }
      }
    }
  }
  EXPECT_EQ(seen.size(), size_t(R * T * k)) << "every route placed exactly once";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ScheduleInvariants,
    ::testing::Combine(::testing::Values(1, 2, 4, 8), ::testing::Values<int64_t>(0, 1, 37, 256),
                       ::testing::Values<int64_t>(1, 8, 128),
                       ::testing::Values(RoutingKind::uniform, RoutingKind::zipf, RoutingKind::one_expert),
                       ::testing::Values(moka::RowOrder::round_robin, moka::RowOrder::rate_based)));

TEST(Schedule, InterleavesSourcesRoundRobinAndKeepsSlotOrder) {
  // 2 ranks, T=3, k=1, one expert: rank 0 routes tokens 0,1,2; rank 1 routes token 0 and 2.
  const int32_t ids[] = {0, 0, 0, 0, 1, 0};
  ScheduleDims d{2, 3, 1, 1, 0, 4};
  // With 2 experts split over 2 ranks, rank 0 owns expert 0.
  d.num_local_experts = 1;
  const auto s = build_receive_schedule(d, ids);
  ASSERT_EQ(s.expert_rows[0], 5);
  const std::vector<int32_t> src = {0, 1, 0, 1, 0, -1, -1, -1};
  const std::vector<int64_t> slot = {0, 0, 1, 2, 2, -1, -1, -1};
  EXPECT_EQ(s.row_source, src);
  EXPECT_EQ(s.row_slot, slot);
  EXPECT_EQ(s.canonical_rows[0], (std::vector<int64_t>{0, 2, 4, 1, 3}));
}

TEST(Schedule, IsDeterministic) {
  // Each run draws the routing anew and builds every rank's schedule, in both row orders.
  const auto schedules = [] {
    const auto all = routing(4, 100, 2, 8, RoutingKind::zipf, 3);
    std::vector<std::vector<int64_t>> flat;
    for (auto order : {moka::RowOrder::round_robin, moka::RowOrder::rate_based})
      for (int rank = 0; rank < 4; ++rank) {
        const auto s = build_receive_schedule({4, 100, 2, 2, 2 * rank, 16, order, rank}, all.data());
        flat.push_back(s.counts);
        flat.push_back(s.row_slot);
        flat.emplace_back(s.row_source.begin(), s.row_source.end());
        for (const auto& rows : s.canonical_rows) flat.push_back(rows);
      }
    return flat;
  };
  const auto runs = moka::testing::concurrent_runs(schedules);
  for (size_t r = 1; r < runs.size(); ++r) EXPECT_EQ(runs[r], runs[0]) << "run " << r;
}

TEST(Schedule, SendPlanMatchesReceiverOrder) {
  const int R = 4;
  const int64_t T = 50, k = 2, E = 8;
  const auto all = routing(R, T, k, E, RoutingKind::uniform, 5);
  for (int dst = 0; dst < 2 * R; ++dst) {
    const auto order = dst < R ? moka::RowOrder::round_robin : moka::RowOrder::rate_based;
    ScheduleDims d{R, T, k, E / R, (dst % R) * (E / R), 8, order, dst % R};
    const auto s = build_receive_schedule(d, all.data());
    const auto by_src = rows_by_source(s);
    for (int src = 0; src < R; ++src) {
      const auto plan = build_send_plan(all.data() + src * T * k, T, k, E, R);
      const int64_t n = plan.rank_offset[dst % R + 1] - plan.rank_offset[dst % R];
      ASSERT_EQ(n, int64_t(by_src[src].size()));
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(s.row_slot[by_src[src][i]], plan.slots[plan.rank_offset[dst % R] + i]);
    }
  }
}

TEST(RoutingGen, ZipfHitsTargetGini) {
  for (double g : {0.1, 0.2, 0.38}) {
    const auto p = expert_popularity({RoutingKind::zipf, g, 1}, 128);
    EXPECT_NEAR(gini(p), g, 1e-6);
  }
  const auto ids = sample_topk_ids({RoutingKind::zipf, 0.3, 1}, 4000, 4, 64);
  std::vector<double> load(64, 0);
  for (int32_t e : ids) load[e] += 1;
  EXPECT_NEAR(gini(load), 0.3, 0.05);
}
