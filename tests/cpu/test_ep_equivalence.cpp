// The layer split over 1, 2, 4, 8 emulated ranks equals one rank holding every token and expert:
// bitwise for everything computed per row or reduced in the canonical order.
#include <cstring>

#include "layer_fixture.hpp"

using namespace moka;
using namespace moka::test;

namespace {

bool bitwise_equal(const double* a, const double* b, size_t n) { return std::memcmp(a, b, n * sizeof(double)) == 0; }

class EpEquivalence : public ::testing::TestWithParam<std::tuple<int, core::RoutingKind>> {};

TEST_P(EpEquivalence, MatchesSingleRank) {
  const auto [R, routing] = GetParam();
  const MoeShape s{12, 10, 16, 3, 7, Activation::swiglu, 7.0f};
  const int64_t T = 19, H = s.hidden, I = s.intermediate, k = s.top_k, El = s.num_experts / R;

  // Per-rank inputs; rank r's local experts are the global block [r*El, (r+1)*El).
  std::vector<Buffers<double>> ranks;
  for (int r = 0; r < R; ++r) ranks.push_back(random_buffers<double>(s, R, T, 5, routing, r));
  Buffers<double> whole(s, 1, R * T);
  whole.poison_outputs();
  for (int r = 0; r < R; ++r) {
    auto& b = ranks[r];
    std::copy(b.x.begin(), b.x.end(), whole.x.begin() + r * T * H);
    std::copy(b.d_out.begin(), b.d_out.end(), whole.d_out.begin() + r * T * H);
    std::copy(b.topk_ids.begin(), b.topk_ids.end(), whole.topk_ids.begin() + r * T * k);
    std::copy(b.topk_weights.begin(), b.topk_weights.end(), whole.topk_weights.begin() + r * T * k);
  }
  // Global expert weights, split into each rank's block; the shared expert is replicated.
  auto global = random_buffers<double>(s, 1, 1, 99);
  whole.w_gate = global.w_gate;
  whole.w_up = global.w_up;
  whole.w_down = global.w_down;
  whole.ws_gate = global.ws_gate;
  whole.ws_up = global.ws_up;
  whole.ws_down = global.ws_down;
  for (int r = 0; r < R; ++r) {
    auto& b = ranks[r];
    b.w_gate.assign(global.w_gate.begin() + r * El * I * H, global.w_gate.begin() + (r + 1) * El * I * H);
    b.w_up.assign(global.w_up.begin() + r * El * I * H, global.w_up.begin() + (r + 1) * El * I * H);
    b.w_down.assign(global.w_down.begin() + r * El * H * I, global.w_down.begin() + (r + 1) * El * H * I);
    b.ws_gate = global.ws_gate;
    b.ws_up = global.ws_up;
    b.ws_down = global.ws_down;
  }

  run_single(s, whole, 8);
  run_emulated_ranks(R, [&](ProcessGroup& g) {
    auto layer = make_moe_layer(s, Backend::cpu, &g, LayerOptions{8, 1});
    run_layer(*layer, ranks[g.rank()]);
  });

  std::vector<double> shared_sum(whole.d_ws_gate.size(), 0.0);
  for (int r = 0; r < R; ++r) {
    const auto& b = ranks[r];
    EXPECT_TRUE(bitwise_equal(b.out.data(), whole.out.data() + r * T * H, T * H)) << "out, rank " << r;
    EXPECT_TRUE(bitwise_equal(b.d_x.data(), whole.d_x.data() + r * T * H, T * H)) << "d_x, rank " << r;
    EXPECT_TRUE(bitwise_equal(b.d_topk_weights.data(), whole.d_topk_weights.data() + r * T * k, T * k));
    EXPECT_TRUE(bitwise_equal(b.d_w_gate.data(), whole.d_w_gate.data() + r * El * I * H, El * I * H)) << r;
    EXPECT_TRUE(bitwise_equal(b.d_w_up.data(), whole.d_w_up.data() + r * El * I * H, El * I * H)) << r;
    EXPECT_TRUE(bitwise_equal(b.d_w_down.data(), whole.d_w_down.data() + r * El * H * I, El * H * I)) << r;
    for (size_t i = 0; i < shared_sum.size(); ++i) shared_sum[i] += b.d_ws_gate[i];
  }
  // Shared-expert weight gradients are per-rank partial sums (the data-parallel all-reduce is
  // the caller's); summed they equal the single-rank gradient up to summation order.
  EXPECT_LT(cli::max_rel_error(shared_sum, whole.d_ws_gate), 1e-13);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpEquivalence,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(core::RoutingKind::uniform, core::RoutingKind::zipf,
                                                              core::RoutingKind::one_expert)));

TEST(EpEquivalence, ResultsDoNotDependOnThreadsOrTile) {
  const MoeShape s{16, 12, 8, 2, 0, Activation::swiglu, 7.0f};
  auto a = random_buffers<float>(s, 1, 33, 4);
  auto b = a;
  auto l1 = make_moe_layer(s, Backend::cpu, nullptr, LayerOptions{1, 1});
  auto l2 = make_moe_layer(s, Backend::cpu, nullptr, LayerOptions{64, 2});
  run_layer(*l1, a);
  run_layer(*l2, b);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a.d_x.data(), b.d_x.data(), a.d_x.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a.d_w_down.data(), b.d_w_down.data(), a.d_w_down.size() * 4), 0);
}

}  // namespace
