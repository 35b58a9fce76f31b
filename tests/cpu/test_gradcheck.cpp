// Finite-difference checks of every layer gradient in fp64.
#include <cmath>
#include <functional>

#include "layer_fixture.hpp"

using namespace moka;
using namespace moka::test;

namespace {

// L = sum(out * d_out): backward with d_out gives dL/d(everything).
double loss(const MoeShape& s, Buffers<double>& b) {
  auto layer = make_moe_layer(s, Backend::cpu, nullptr, LayerOptions{4, 1});
  layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{});
  double l = 0;
  for (size_t i = 0; i < b.out.size(); ++i) l += b.out[i] * b.d_out[i];
  return l;
}

// Central differences for every entry of `param` against `analytic`.
void check_gradient(const char* name, const MoeShape& s, Buffers<double>& b, std::vector<double>& param,
                    const std::vector<double>& analytic) {
  ASSERT_EQ(param.size(), analytic.size()) << name;
  const double eps = 1e-6;
  double worst = 0;
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + eps;
    const double lp = loss(s, b);
    param[i] = saved - eps;
    const double lm = loss(s, b);
    param[i] = saved;
    const double numeric = (lp - lm) / (2 * eps);
    const double err = std::abs(numeric - analytic[i]) / std::max(1.0, std::abs(numeric));
    worst = std::max(worst, err);
    ASSERT_LT(err, 1e-6) << name << "[" << i << "]: numeric " << numeric << " analytic " << analytic[i];
  }
  EXPECT_LT(worst, 1e-6) << name;
}

class GradCheck : public ::testing::TestWithParam<Activation> {};

TEST_P(GradCheck, EveryGradientMatchesFiniteDifferences) {
  const MoeShape s = small_shape(GetParam());
  auto b = random_buffers<double>(s, 1, 5, 11);
  // Larger inputs so the clamped variant really clamps some gate/up values.
  for (auto& v : b.x) v *= 2.0;
  run_single(s, b);
  const Buffers<double> grads = b;  // analytic gradients
  check_gradient("x", s, b, b.x, grads.d_x);
  check_gradient("topk_weights", s, b, b.topk_weights, grads.d_topk_weights);
  check_gradient("w_gate", s, b, b.w_gate, grads.d_w_gate);
  check_gradient("w_up", s, b, b.w_up, grads.d_w_up);
  check_gradient("w_down", s, b, b.w_down, grads.d_w_down);
  check_gradient("ws_gate", s, b, b.ws_gate, grads.d_ws_gate);
  check_gradient("ws_up", s, b, b.ws_up, grads.d_ws_up);
  check_gradient("ws_down", s, b, b.ws_down, grads.d_ws_down);
}

INSTANTIATE_TEST_SUITE_P(Activations, GradCheck, ::testing::Values(Activation::swiglu, Activation::swiglu_clamped));

TEST(GradCheck, ClampedVariantActuallyClamps) {
  // Guards the test above: with limit 0.6 and these inputs some pre-activations exceed it.
  const MoeShape s = small_shape(Activation::swiglu_clamped);
  auto b = random_buffers<double>(s, 1, 5, 11);
  int above = 0;
  for (int64_t t = 0; t < 5; ++t)
    for (int64_t i = 0; i < s.intermediate; ++i) {
      double g = 0;
      for (int64_t c = 0; c < s.hidden; ++c) g += b.w_gate[i * s.hidden + c] * 2.0 * b.x[t * s.hidden + c];
      above += g > s.clamp_limit;
    }
  EXPECT_GT(above, 0);
}

}  // namespace
