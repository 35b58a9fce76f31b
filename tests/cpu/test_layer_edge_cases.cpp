// Edge cases of the routing, checked against a naive per-token formula written independently
// of the library's stages.
#include <cmath>

#include "layer_fixture.hpp"

using namespace moka;
using namespace moka::test;

namespace {

double silu_glu(double g, double u) { return g / (1 + std::exp(-g)) * u; }

// out[t] = shared(x_t) + sum_j w_tj * W_down[e] silu(W_gate[e] x_t) * (W_up[e] x_t).
std::vector<double> naive_forward(const MoeShape& s, const Buffers<double>& b) {
  const int64_t H = s.hidden, I = s.intermediate, k = s.top_k, Is = s.shared_intermediate;
  std::vector<double> out(b.tokens * H, 0.0);
  auto expert = [&](const double* wg, const double* wu, const double* wd, int64_t inner, const double* x, double scale,
                    double* y) {
    for (int64_t i = 0; i < inner; ++i) {
      double g = 0, u = 0;
      for (int64_t c = 0; c < H; ++c) {
        g += wg[i * H + c] * x[c];
        u += wu[i * H + c] * x[c];
      }
      const double h = silu_glu(g, u);
      for (int64_t o = 0; o < H; ++o) y[o] += scale * wd[o * inner + i] * h;
    }
  };
  for (int64_t t = 0; t < b.tokens; ++t) {
    const double* x = &b.x[t * H];
    if (Is > 0) expert(b.ws_gate.data(), b.ws_up.data(), b.ws_down.data(), Is, x, 1.0, &out[t * H]);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = b.topk_ids[t * k + j];
      expert(&b.w_gate[e * I * H], &b.w_up[e * I * H], &b.w_down[e * H * I], I, x, b.topk_weights[t * k + j],
             &out[t * H]);
    }
  }
  return out;
}

void expect_matches_naive(const MoeShape& s, Buffers<double>& b, int64_t tile) {
  run_single(s, b, tile);
  EXPECT_LT(cli::max_rel_error(b.out, naive_forward(s, b)), 1e-12);
  for (const auto* g : {&b.d_x, &b.d_topk_weights, &b.d_w_gate, &b.d_w_up, &b.d_w_down})
    for (double v : *g) ASSERT_TRUE(std::isfinite(v)) << "unwritten or non-finite gradient";
}

TEST(EdgeCases, ZeroTokens) {
  const MoeShape s = small_shape();
  auto b = random_buffers<double>(s, 1, 0, 1);
  run_single(s, b);
  for (double v : b.d_w_gate) EXPECT_EQ(v, 0.0);
  for (double v : b.d_ws_down) EXPECT_EQ(v, 0.0);
}

TEST(EdgeCases, OneToken) {
  const MoeShape s = small_shape();
  auto b = random_buffers<double>(s, 1, 1, 2);
  expect_matches_naive(s, b, 4);
}

TEST(EdgeCases, AllTokensOnOneExpertAndEmptyExpertsGetZeroGradients) {
  MoeShape s = small_shape();
  s.top_k = 1;
  auto b = random_buffers<double>(s, 1, 9, 3, core::RoutingKind::one_expert);
  expect_matches_naive(s, b, 4);
  const int64_t per_expert = s.intermediate * s.hidden;
  for (int64_t e = 1; e < s.num_experts; ++e)
    for (int64_t i = 0; i < per_expert; ++i) ASSERT_EQ(b.d_w_gate[e * per_expert + i], 0.0) << "expert " << e;
  double norm = 0;
  for (int64_t i = 0; i < per_expert; ++i) norm += std::abs(b.d_w_gate[i]);
  EXPECT_GT(norm, 0.0);
}

TEST(EdgeCases, TokensNotAMultipleOfTheTileAndTopKEqualsExperts) {
  MoeShape s = small_shape(Activation::swiglu, 0);
  s.top_k = s.num_experts;
  auto b = random_buffers<double>(s, 1, 13, 4);
  expect_matches_naive(s, b, 8);
}

TEST(EdgeCases, EmptyRankInEmulatedGroup) {
  // Every token of every rank routes to rank 0's experts: rank 1 receives nothing.
  const MoeShape s{8, 6, 4, 1, 0, Activation::swiglu, 7.0f};
  std::vector<Buffers<double>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(random_buffers<double>(s, 2, 6, 8, core::RoutingKind::uniform, r));
    for (auto& id : ranks[r].topk_ids) id = 1;
  }
  run_emulated_ranks(2, [&](ProcessGroup& g) {
    auto layer = make_moe_layer(s, Backend::cpu, &g, LayerOptions{4, 1});
    auto& b = ranks[g.rank()];
    auto ctx = layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{});
    layer->backward(*ctx, b.d_out_view(), b.weights(), b.gradients(), Stream{});
    const auto rows = ctx->local_expert_rows();
    if (g.rank() == 1) EXPECT_EQ(rows, (std::vector<int64_t>{0, 0}));
    if (g.rank() == 0) EXPECT_EQ(rows, (std::vector<int64_t>{0, 12}));
  });
  for (double v : ranks[1].d_w_down) EXPECT_EQ(v, 0.0);
  for (double v : ranks[0].out) EXPECT_TRUE(std::isfinite(v));
}

}  // namespace

namespace {

// A training step's form of the backward: the context handed over and destroyed.
TEST(EdgeCases, ConsumeBackwardGivesTheResultsOfBackward) {
  const MoeShape s = small_shape();
  auto kept = random_buffers<double>(s, 1, 13, 3);
  auto consumed = kept;
  run_single(s, kept);
  auto layer = make_moe_layer(s, Backend::cpu, nullptr, LayerOptions{4, 2});
  layer->consume_backward(layer->forward(consumed.inputs(), consumed.weights(), consumed.out_view(), Stream{}),
                          consumed.d_out_view(), consumed.weights(), consumed.gradients(), Stream{});
  EXPECT_EQ(consumed.out, kept.out);
  EXPECT_EQ(consumed.d_x, kept.d_x);
  EXPECT_EQ(consumed.d_topk_weights, kept.d_topk_weights);
  EXPECT_EQ(consumed.d_w_gate, kept.d_w_gate);
  EXPECT_EQ(consumed.d_ws_down, kept.d_ws_down);
  try {
    layer->consume_backward(nullptr, consumed.d_out_view(), consumed.weights(), consumed.gradients(), Stream{});
    FAIL() << "a missing context was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  }
}

}  // namespace
