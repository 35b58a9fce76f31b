// The all-to-all path's block lists, exercised without a GPU: every rank's sends must pair one
// to one (in order, equal sizes) with its peers' receives, and moving the rows along the blocks
// must land every route in its expert's segment in the canonical (source, slot) order.
#include <gtest/gtest.h>

#include <map>

#include "core/exchange_blocks.hpp"
#include "core/routing_gen.hpp"
#include "core/schedule.hpp"

using namespace moka::core;

namespace {

struct Route {
  int source = -1;
  int64_t slot = -1;
  bool operator==(const Route&) const = default;
};

class ExchangeBlocksTest : public ::testing::TestWithParam<std::tuple<int, RoutingKind>> {};

TEST_P(ExchangeBlocksTest, PairsSendsWithReceivesAndPlacesRowsCanonically) {
  const auto [R, kind] = GetParam();
  const int64_t T = 53, k = 3, E = 8 * R, El = E / R, tile = 16;
  std::vector<std::vector<int32_t>> ids(R);
  std::vector<int32_t> all;
  for (int r = 0; r < R; ++r) {
    ids[r] = sample_topk_ids({kind, 0.35, 9}, T, k, E, r);
    all.insert(all.end(), ids[r].begin(), ids[r].end());
  }
  // What each rank's device computes: routes per global expert, and the count exchange.
  std::vector<std::vector<int32_t>> sent(R, std::vector<int32_t>(E, 0));
  for (int r = 0; r < R; ++r)
    for (int32_t e : ids[r]) ++sent[r][e];
  std::vector<ExchangeBlocks> blocks;
  for (int me = 0; me < R; ++me) {
    std::vector<int32_t> received(R * El);
    for (int src = 0; src < R; ++src)
      for (int64_t e = 0; e < El; ++e) received[src * El + e] = sent[src][me * El + e];
    blocks.push_back(plan_exchange_blocks(sent[me].data(), received.data(), R, El, tile));
  }
  // NCCL pairing: the n-th non-empty send a -> b has the size of the n-th non-empty receive on b from a.
  for (int a = 0; a < R; ++a)
    for (int b = 0; b < R; ++b) {
      std::vector<int64_t> s, r;
      for (const auto& t : blocks[a].sends)
        if (t.peer == b && t.rows) s.push_back(t.rows);
      for (const auto& t : blocks[b].receives)
        if (t.peer == a && t.rows) r.push_back(t.rows);
      EXPECT_EQ(s, r) << a << " -> " << b;
    }
  // Move (source, slot) labels: the send-ordered buffer is the slots sorted by expert.
  std::vector<std::vector<Route>> send_buffer(R);
  for (int r = 0; r < R; ++r) {
    const SendPlan plan = build_send_plan(ids[r].data(), T, k, E, R);
    for (int64_t slot : plan.slots) send_buffer[r].push_back({r, slot});
  }
  for (int me = 0; me < R; ++me) {
    const auto& mine = blocks[me];
    std::vector<Route> grouped(mine.expert_offset.back());
    std::map<int, size_t> next_send;  // per peer pair, which of the sender's blocks is next
    for (const auto& recv : mine.receives) {
      if (!recv.rows) continue;
      const auto& sender = blocks[recv.peer].sends;
      size_t& n = next_send[recv.peer];
      while (sender[n].peer != me || sender[n].rows == 0) ++n;
      for (int64_t i = 0; i < recv.rows; ++i) grouped[recv.first + i] = send_buffer[recv.peer][sender[n].first + i];
      ++n;
    }
    const ReceiveSchedule s = build_receive_schedule({R, T, k, El, me * El, tile}, all.data());
    EXPECT_EQ(mine.expert_rows, s.expert_rows);
    EXPECT_EQ(mine.expert_offset, s.expert_offset);
    for (int64_t e = 0; e < El; ++e) {
      for (size_t i = 0; i < s.canonical_rows[e].size(); ++i) {
        const int64_t canonical = s.canonical_rows[e][i];
        const Route want{s.row_source[canonical], s.row_slot[canonical]};
        EXPECT_EQ(grouped[mine.expert_offset[e] + i], want) << "rank " << me << " expert " << e << " row " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExchangeBlocksTest,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(RoutingKind::uniform, RoutingKind::zipf,
                                                              RoutingKind::one_expert)));

}  // namespace
