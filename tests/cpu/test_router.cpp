// Router forward (selection, weights, losses, counts) and fp64 finite-difference backward.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "moka/moka.hpp"

using namespace moka;

namespace {

struct RouterCase {
  RouterConfig config;
  int64_t tokens = 7;
  std::vector<double> x, w, bias, g;  // g: upstream gradient of the top-k weights
  std::vector<int32_t> ids;
  std::vector<double> weights;
  std::vector<int32_t> counts;

  explicit RouterCase(RouterConfig c, uint64_t seed = 3) : config(c) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> nd(0, 1);
    x.resize(tokens * c.hidden);
    w.resize(c.num_experts * c.hidden);
    bias.resize(c.num_experts);
    g.resize(tokens * c.top_k);
    for (auto* v : {&x, &w, &bias, &g})
      for (auto& e : *v) e = nd(rng);
    ids.resize(tokens * c.top_k);
    weights.resize(tokens * c.top_k);
    counts.resize(c.num_experts);
  }
  TensorView bias_view() {
    return config.use_selection_bias ? TensorView(bias.data(), DType::f64, {config.num_experts}) : TensorView{};
  }
  std::unique_ptr<RouterContext> forward(Router& r) {
    RouterOutputs out{TensorView(ids.data(), DType::i32, {tokens, config.top_k}),
                      TensorView(weights.data(), DType::f64, {tokens, config.top_k}),
                      TensorView(counts.data(), DType::i32, {config.num_experts})};
    return r.forward(TensorView(x.data(), DType::f64, {tokens, config.hidden}),
                     TensorView(w.data(), DType::f64, {config.num_experts, config.hidden}), bias_view(), out, Stream{});
  }
  // Training loss the router contributes: <weights, g> + aux + z.
  double loss(Router& r) {
    auto ctx = forward(r);
    const auto l = ctx->losses();
    return std::inner_product(weights.begin(), weights.end(), g.begin(), 0.0) + l.aux_loss + l.z_loss;
  }
};

RouterConfig config(ScoreFunction score, bool renorm, bool bias, double aux, double z) {
  RouterConfig c;
  c.hidden = 6;
  c.num_experts = 8;
  c.top_k = 3;
  c.score = score;
  c.renormalize = renorm;
  c.use_selection_bias = bias;
  c.route_scale = 1.7;
  c.aux_loss_coef = aux;
  c.z_loss_coef = z;
  return c;
}

// Central differences of `loss` in every element of x and w against the analytic dx, dw; the
// selection must not change under the perturbation.
template <typename Loss>
void expect_finite_differences(RouterCase& rc, Loss loss, const std::vector<double>& dx,
                               const std::vector<double>& dw) {
  const auto selected = rc.ids;
  auto check = [&](std::vector<double>& param, const std::vector<double>& analytic, const char* name) {
    for (size_t i = 0; i < param.size(); ++i) {
      const double saved = param[i], eps = 1e-6;
      param[i] = saved + eps;
      const double lp = loss();
      param[i] = saved - eps;
      const double lm = loss();
      param[i] = saved;
      ASSERT_EQ(rc.ids, selected) << "perturbation changed the selection; pick another seed";
      const double numeric = (lp - lm) / (2 * eps);
      ASSERT_NEAR(numeric, analytic[i], 1e-6 * std::max(1.0, std::abs(numeric))) << name << "[" << i << "]";
    }
  };
  check(rc.x, dx, "x");
  check(rc.w, dw, "w_router");
}

class RouterGradCheck : public ::testing::TestWithParam<std::tuple<ScoreFunction, bool, bool>> {};

TEST_P(RouterGradCheck, BackwardMatchesFiniteDifferences) {
  const auto [score, renorm, bias] = GetParam();
  RouterCase rc(config(score, renorm, bias, 0.3, 0.05));
  auto router = make_router(rc.config, Backend::cpu);
  auto ctx = rc.forward(*router);
  EXPECT_GT(ctx->losses().aux_loss, 0);
  EXPECT_GT(ctx->losses().z_loss, 0);
  std::vector<double> dx(rc.x.size()), dw(rc.w.size());
  router->backward(*ctx, TensorView(rc.g.data(), DType::f64, {rc.tokens, 3}),
                   TensorView(dx.data(), DType::f64, {rc.tokens, 6}), TensorView(dw.data(), DType::f64, {8, 6}),
                   Stream{});
  expect_finite_differences(
      rc, [&] { return rc.loss(*router); }, dx, dw);
}

INSTANTIATE_TEST_SUITE_P(Variants, RouterGradCheck,
                         ::testing::Combine(::testing::Values(ScoreFunction::softmax, ScoreFunction::sigmoid),
                                            ::testing::Bool(), ::testing::Bool()));

// The aux outputs (logits, probabilities, the two losses without coefficients) with upstream
// gradients of their own, on top of RouterConfig's coefficients: the values against a direct
// computation, the backward against finite differences of
// <weights, g> + <logits, r1> + <probs, r2> + a * balance + b * z + coef_aux * balance + coef_z * z.
class RouterAuxGradCheck : public ::testing::TestWithParam<std::tuple<ScoreFunction, bool, bool>> {};

TEST_P(RouterAuxGradCheck, AuxOutputsAndTheirGradientsMatchFiniteDifferences) {
  const auto [score, renorm, with_coefs] = GetParam();
  RouterCase rc(config(score, renorm, false, with_coefs ? 0.3 : 0.0, with_coefs ? 0.05 : 0.0), 11);
  const int64_t T = rc.tokens, H = 6, E = 8;
  auto router = make_router(rc.config, Backend::cpu);
  std::vector<double> logits(T * E), probs(T * E), losses(2), r1(T * E), r2(T * E);
  std::vector<int64_t> counts64(E);
  std::mt19937_64 rng(17);
  std::normal_distribution<double> nd(0, 1);
  for (auto* v : {&r1, &r2})
    for (auto& e : *v) e = nd(rng);
  const std::vector<double> d_losses{0.7, -0.2};
  auto forward = [&] {
    RouterOutputs out{TensorView(rc.ids.data(), DType::i32, {T, 3}), TensorView(rc.weights.data(), DType::f64, {T, 3}),
                      TensorView(counts64.data(), DType::i64, {E})};
    out.aux = {TensorView(logits.data(), DType::f64, {T, E}), TensorView(probs.data(), DType::f64, {T, E}),
               TensorView(losses.data(), DType::f64, {2})};
    return router->forward(TensorView(rc.x.data(), DType::f64, {T, H}), TensorView(rc.w.data(), DType::f64, {E, H}),
                           TensorView(), out, Stream{});
  };
  auto loss = [&] {
    auto ctx = forward();
    const RouterLosses coef = ctx->losses();
    double l = coef.aux_loss + coef.z_loss + d_losses[0] * losses[0] + d_losses[1] * losses[1];
    for (int64_t i = 0; i < T * 3; ++i) l += rc.weights[i] * rc.g[i];
    for (int64_t i = 0; i < T * E; ++i) l += logits[i] * r1[i] + probs[i] * r2[i];
    return l;
  };
  auto ctx = forward();
  // The values, computed here from x and w.
  double balance = 0, z = 0;
  std::vector<double> mean_p(E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> lg(E), sc(E);
    double mx = -1e300, se = 0, ss = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t h = 0; h < H; ++h) lg[e] += rc.x[t * H + h] * rc.w[e * H + h];
      mx = std::max(mx, lg[e]);
      EXPECT_NEAR(logits[t * E + e], lg[e], 1e-12);
    }
    for (int64_t e = 0; e < E; ++e) se += std::exp(lg[e] - mx);
    for (int64_t e = 0; e < E; ++e)
      ss += sc[e] = score == ScoreFunction::sigmoid ? 1 / (1 + std::exp(-lg[e])) : std::exp(lg[e] - mx) / se;
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_NEAR(probs[t * E + e], sc[e] / ss, 1e-12);
      mean_p[e] += sc[e] / ss / double(T);
    }
    z += std::pow(mx + std::log(se), 2) / double(T);
  }
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = 0;
    for (int32_t id : rc.ids) n += id == e;
    EXPECT_EQ(counts64[e], n);
    balance += double(E) * double(n) / double(T * 3) * mean_p[e];
  }
  EXPECT_NEAR(losses[0], balance, 1e-12);
  EXPECT_NEAR(losses[1], z, 1e-12);
  EXPECT_NEAR(ctx->losses().aux_loss, rc.config.aux_loss_coef * balance, 1e-12);
  EXPECT_NEAR(ctx->losses().z_loss, rc.config.z_loss_coef * z, 1e-12);

  std::vector<double> dx(rc.x.size()), dw(rc.w.size());
  const RouterAuxGradients grads{TensorView(r1.data(), DType::f64, {T, E}), TensorView(r2.data(), DType::f64, {T, E}),
                                 TensorView(const_cast<double*>(d_losses.data()), DType::f64, {2})};
  router->backward(*ctx, TensorView(rc.g.data(), DType::f64, {T, 3}), TensorView(dx.data(), DType::f64, {T, H}),
                   TensorView(dw.data(), DType::f64, {E, H}), Stream{}, false, grads);
  expect_finite_differences(rc, loss, dx, dw);
}

INSTANTIATE_TEST_SUITE_P(Variants, RouterAuxGradCheck,
                         ::testing::Combine(::testing::Values(ScoreFunction::softmax, ScoreFunction::sigmoid),
                                            ::testing::Bool(), ::testing::Bool()));

// A gradient for an aux output the forward did not write is an error, not a silent zero.
TEST(Router, AuxGradientsNeedTheirOutputs) {
  RouterCase rc(config(ScoreFunction::softmax, false, false, 0, 0));
  auto router = make_router(rc.config, Backend::cpu);
  auto ctx = rc.forward(*router);
  std::vector<double> dx(rc.x.size()), dw(rc.w.size()), d_losses{1.0, 1.0};
  RouterAuxGradients grads;
  grads.d_losses = TensorView(d_losses.data(), DType::f64, {2});
  EXPECT_THROW(router->backward(*ctx, TensorView(rc.g.data(), DType::f64, {rc.tokens, 3}),
                                TensorView(dx.data(), DType::f64, {rc.tokens, 6}),
                                TensorView(dw.data(), DType::f64, {8, 6}), Stream{}, false, grads),
               Error);
}

TEST(Router, SelectsByScorePlusBiasButWeighsByScoreAlone) {
  RouterConfig c = config(ScoreFunction::sigmoid, false, true, 0, 0);
  c.route_scale = 1.0;
  RouterCase rc(c);
  std::fill(rc.bias.begin(), rc.bias.end(), 0.0);
  rc.bias[5] = 100.0;  // expert 5 always selected, first
  auto router = make_router(c, Backend::cpu);
  rc.forward(*router);
  for (int64_t t = 0; t < rc.tokens; ++t) {
    EXPECT_EQ(rc.ids[t * 3], 5);
    double logit = 0;
    for (int64_t h = 0; h < 6; ++h) logit += rc.w[5 * 6 + h] * rc.x[t * 6 + h];
    EXPECT_NEAR(rc.weights[t * 3], 1 / (1 + std::exp(-logit)), 1e-12);
  }
  EXPECT_EQ(rc.counts[5], rc.tokens);
  EXPECT_EQ(std::accumulate(rc.counts.begin(), rc.counts.end(), 0), rc.tokens * 3);
}

TEST(Router, AddsEachCallsCountsToTheExpertLoad) {
  RouterCase rc(config(ScoreFunction::softmax, false, false, 0, 0));
  auto router = make_router(rc.config, Backend::cpu);
  const int64_t E = rc.config.num_experts;
  std::vector<int64_t> load(E);
  std::iota(load.begin(), load.end(), int64_t(1) << 40);  // a running total beyond int32
  const std::vector<int64_t> before = load;
  RouterOutputs out{TensorView(rc.ids.data(), DType::i32, {rc.tokens, 3}),
                    TensorView(rc.weights.data(), DType::f64, {rc.tokens, 3}),
                    TensorView(rc.counts.data(), DType::i32, {E}), TensorView(load.data(), DType::i64, {E})};
  const TensorView x(rc.x.data(), DType::f64, {rc.tokens, 6}), w(rc.w.data(), DType::f64, {E, 6});
  router->forward(x, w, TensorView(), out, Stream{});
  router->forward(x, w, TensorView(), out, Stream{});
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(load[e], before[e] + 2 * rc.counts[e]) << "expert " << e;
  out.expert_load = TensorView(rc.counts.data(), DType::i32, {E});
  EXPECT_THROW(router->forward(x, w, TensorView(), out, Stream{}), Error);
}

// add_to_d_x adds the router's part of x's gradient to what d_x holds: the same bits as
// overwriting a separate buffer and summing the two afterwards.
TEST(Router, BackwardAddsToDxWhenAsked) {
  RouterCase rc(config(ScoreFunction::softmax, true, false, 0.3, 0.05));
  auto router = make_router(rc.config, Backend::cpu);
  auto ctx = rc.forward(*router);
  const TensorView g(rc.g.data(), DType::f64, {rc.tokens, 3});
  std::vector<double> dx(rc.x.size()), dw(rc.w.size()), dw_added(rc.w.size());
  router->backward(*ctx, g, TensorView(dx.data(), DType::f64, {rc.tokens, 6}),
                   TensorView(dw.data(), DType::f64, {8, 6}), Stream{});
  std::vector<double> experts_part(rc.x.size()), sum(rc.x.size());
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0, 1);
  for (size_t i = 0; i < sum.size(); ++i) sum[i] = (experts_part[i] = nd(rng)) + dx[i];
  router->backward(*ctx, g, TensorView(experts_part.data(), DType::f64, {rc.tokens, 6}),
                   TensorView(dw_added.data(), DType::f64, {8, 6}), Stream{}, /*add_to_d_x=*/true);
  EXPECT_EQ(experts_part, sum);
  EXPECT_EQ(dw_added, dw);
}

TEST(Router, RenormalizedWeightsSumToRouteScaleAndTiesGoToLowerIds) {
  RouterConfig c = config(ScoreFunction::softmax, true, false, 0, 0);
  RouterCase rc(c);
  std::fill(rc.w.begin(), rc.w.end(), 0.0);  // all logits equal: a full tie
  auto router = make_router(c, Backend::cpu);
  rc.forward(*router);
  for (int64_t t = 0; t < rc.tokens; ++t) {
    EXPECT_EQ(rc.ids[t * 3 + 0], 0);
    EXPECT_EQ(rc.ids[t * 3 + 1], 1);
    EXPECT_EQ(rc.ids[t * 3 + 2], 2);
    EXPECT_NEAR(rc.weights[t * 3] + rc.weights[t * 3 + 1] + rc.weights[t * 3 + 2], 1.7, 1e-12);
  }
}

TEST(Router, NonFiniteLogitsAreAnError) {
  RouterCase rc(config(ScoreFunction::softmax, false, false, 0, 0));
  rc.x[0] = NAN;
  auto router = make_router(rc.config, Backend::cpu);
  try {
    rc.forward(*router);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::non_finite);
  }
}

TEST(LoadBalance, StatsAndBiasUpdate) {
  const auto s = load_stats({4, 4, 4, 4});
  EXPECT_DOUBLE_EQ(s.max_over_mean, 1.0);
  EXPECT_DOUBLE_EQ(s.gini, 0.0);
  const auto skew = load_stats({0, 0, 0, 16});
  EXPECT_DOUBLE_EQ(skew.max_over_mean, 4.0);
  EXPECT_NEAR(skew.gini, 0.75, 1e-12);
  std::vector<double> bias(3, 0.0);
  update_selection_bias(bias, {1, 5, 3}, 0.01);
  EXPECT_EQ(bias, (std::vector<double>{0.01, -0.01, 0.0}));
}

}  // namespace
