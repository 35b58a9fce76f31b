#include <gtest/gtest.h>

#include <numeric>

#include "determinism.hpp"
#include "moka/error.hpp"
#include "sched/peer_plan.hpp"

using namespace moka::sched;

TEST(SchedPeerPlan, WorkersFollowBytesAndSumToTheCount) {
  const std::vector<int64_t> bytes = {0, 900, 50, 0, 30, 20};
  const auto share = split_workers(bytes, 24);
  EXPECT_EQ(std::accumulate(share.begin(), share.end(), 0), 24);
  const int64_t total = std::accumulate(bytes.begin(), bytes.end(), int64_t{0});
  const int spare = 24 - 4;
  for (size_t p = 0; p < bytes.size(); ++p) {
    if (bytes[p] == 0) {
      EXPECT_EQ(share[p], 0);
      continue;
    }
    const double ideal = 1.0 + spare * static_cast<double>(bytes[p]) / static_cast<double>(total);
    EXPECT_LT(std::abs(share[p] - ideal), 1.0) << p;
  }
  EXPECT_THROW(split_workers(bytes, 3), moka::Error);
  EXPECT_EQ(split_workers({0, 0}, 4), (std::vector<int>{0, 0}));
}

TEST(SchedPeerPlan, RateBasedOrderKeepsEveryFlowOnItsRate) {
  const std::vector<int64_t> chunks = {7, 0, 1, 13, 4};
  const int64_t total = std::accumulate(chunks.begin(), chunks.end(), int64_t{0});
  // Largest lag or lead of any flow behind its constant rate over all prefixes of the order.
  const auto worst_drift = [&](ChunkOrder kind) {
    const auto order = chunk_order(chunks, 1, kind);
    EXPECT_EQ(static_cast<int64_t>(order.size()), total);
    std::vector<int64_t> done(chunks.size(), 0);
    double worst = 0;
    for (size_t m = 0; m < order.size(); ++m) {
      EXPECT_EQ(order[m].index, done[order[m].peer]++);  // in order within a flow
      for (size_t p = 0; p < chunks.size(); ++p)
        worst =
            std::max(worst, std::abs(static_cast<double>(done[p]) - static_cast<double>((m + 1) * chunks[p]) / total));
    }
    EXPECT_EQ(done, chunks);
    return worst;
  };
  EXPECT_LT(worst_drift(ChunkOrder::rate_based), 1.5);
  EXPECT_GT(worst_drift(ChunkOrder::round_robin), 2.0);
}

TEST(SchedPeerPlan, RoundRobinTakesOneChunkPerPeerStartingAfterSelf) {
  const auto order = chunk_order({2, 1, 0, 2}, 1, ChunkOrder::round_robin);
  const std::vector<PeerChunk> expected = {{3, 0}, {0, 0}, {1, 0}, {3, 1}, {0, 1}};
  EXPECT_EQ(order, expected);
}

TEST(SchedPeerPlan, RankPlanIgnoresLocalRowsAndIsDeterministic) {
  const int world = 4;
  std::vector<int64_t> counts(world * world);
  for (size_t k = 0; k < counts.size(); ++k) counts[k] = static_cast<int64_t>((k * 37) % 11) * 100;
  // Each run plans from its own copy of the counts.
  const auto runs = moka::testing::concurrent_runs([counts] {
    const auto copy = counts;
    const auto plan = plan_rank(copy, world, 2, 8, 64);
    return std::make_pair(plan.workers_per_peer, plan.order);
  });
  for (size_t r = 1; r < runs.size(); ++r) EXPECT_EQ(runs[r], runs[0]) << "run " << r;
  const auto a = plan_rank(counts, world, 2, 8, 64);
  EXPECT_EQ(a.workers_per_peer[2], 0);
  for (const auto& c : a.order) EXPECT_NE(c.peer, 2);
  EXPECT_THROW(plan_rank(counts, world, 4, 8, 64), moka::Error);
}
