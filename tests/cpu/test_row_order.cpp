// The rate-based row order (src/sched's schedule applied to moka's own communication order):
// the device-usable position formula equals the planner's merge, it gives every block of rows a
// share of each source in proportion to its rows, and it changes no result bit.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/schedule.hpp"
#include "cpu/megakernel_emulation.hpp"
#include "layer_fixture.hpp"
#include "sched/peer_plan.hpp"

using namespace moka;

namespace {

TEST(RowOrder, RateBasedPositionIsThePlannersVirtualFinishTimeMerge) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const int R = 1 + static_cast<int>(rng() % 9);
    const int receiver = static_cast<int>(rng() % R);
    std::vector<int64_t> counts(R);
    for (auto& c : counts) c = (rng() % 4 == 0) ? 0 : static_cast<int64_t>(rng() % 40);
    if (trial % 7 == 0) std::fill(counts.begin(), counts.end(), 6);  // all ties
    const auto order = sched::chunk_order(counts, receiver, sched::ChunkOrder::rate_based);
    for (size_t pos = 0; pos < order.size(); ++pos)
      ASSERT_EQ(core::rate_based_position(counts.data(), R, receiver, order[pos].peer, order[pos].index),
                static_cast<int64_t>(pos))
          << "trial " << trial << " source " << order[pos].peer << " index " << order[pos].index;
  }
}

TEST(RowOrder, EveryBlockDrawsFromSourcesInProportion) {
  // Sources with 96, 32 and 32 rows: every 5-row block of the rate-based order holds 3, 1, 1
  // (round-robin instead ends with a tail of source 0 only).
  const std::vector<int64_t> counts{96, 32, 32};
  std::vector<int> source_at(160);
  for (int src = 0; src < 3; ++src)
    for (int64_t i = 0; i < counts[src]; ++i) source_at[core::rate_based_position(counts.data(), 3, 2, src, i)] = src;
  for (int block = 0; block < 32; ++block) {
    int from0 = 0;
    for (int r = 0; r < 5; ++r) from0 += source_at[block * 5 + r] == 0;
    EXPECT_EQ(from0, 3) << "block " << block;
  }
  std::vector<int> rr(160);
  for (int src = 0; src < 3; ++src)
    for (int64_t i = 0; i < counts[src]; ++i) rr[core::interleaved_position(counts.data(), 3, src, i)] = src;
  EXPECT_EQ(std::count(rr.end() - 64, rr.end(), 0), 64) << "round-robin's last 64 rows all come from source 0";
}

class RowOrderResults : public ::testing::TestWithParam<int> {};

TEST_P(RowOrderResults, LayerAndMegakernelGiveTheSameBitsUnderEitherOrder) {
  const int R = GetParam();
  const MoeShape s{8, 6, 8, 2, 5, Activation::swiglu, 7.0f};
  std::vector<test::Buffers<double>> rr, rate;
  for (int r = 0; r < R; ++r) rr.push_back(test::random_buffers<double>(s, R, 23, 4, core::RoutingKind::zipf, r));
  rate = rr;
  auto mk = rr;
  for (auto [buffers, order] : {std::pair{&rr, RowOrder::round_robin}, std::pair{&rate, RowOrder::rate_based}}) {
    run_emulated_ranks(R, [&, buffers = buffers, order = order](ProcessGroup& g) {
      test::run_layer(*make_moe_layer(s, Backend::cpu, &g, LayerOptions{4, 1, order}), (*buffers)[g.rank()]);
    });
  }
  cpu::MegakernelEmulationOptions o;
  o.config.tile_rows = 4;
  o.config.tile_n = 4;
  o.config.down_tile_n = 4;
  o.config.minibatch_size = 8;
  o.config.macrobatch_size = 16;
  o.config.capacity_multiplier = 1.0;
  o.config.num_comm_sms = 2;
  o.num_compute_workers = 2;
  o.config.row_order = RowOrder::round_robin;
  run_emulated_ranks(R, [&](ProcessGroup& g) {
    auto& b = mk[g.rank()];
    cpu::megakernel_forward<double>(&g, s, b.inputs(), b.weights(), b.out_view(), o);
  });
  for (int r = 0; r < R; ++r) {
    const auto a = rr[r].outputs(), b = rate[r].outputs();
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_EQ(std::memcmp(a[i]->data(), b[i]->data(), a[i]->size() * sizeof(double)), 0) << "output " << i;
    EXPECT_EQ(std::memcmp(mk[r].out.data(), rate[r].out.data(), mk[r].out.size() * sizeof(double)), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RowOrderResults, ::testing::Values(2, 4));

}  // namespace
