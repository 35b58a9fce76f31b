#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "train/parameterization.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;
using moka::train::testing::tiny_config;

namespace {

// What the research note's table says about each class when only the width grows.
struct Expected {
  bool fan_in_grows, fan_out_grows;
  bool hidden_lr;  // muP scales its LR by 1/m
};

Expected expected_for(TensorClass c) {
  switch (c) {
    case TensorClass::embedding: return {false, true, false};
    case TensorClass::attention_down: return {true, false, true};
    case TensorClass::attention_up: return {false, true, false};
    case TensorClass::attention_qkv: return {true, true, true};
    case TensorClass::attention_out: return {true, true, true};
    case TensorClass::router: return {true, true, true};
    case TensorClass::expert_fc1: return {true, false, true};
    case TensorClass::expert_fc2: return {false, true, false};
    case TensorClass::shared_fc1: return {true, false, true};
    case TensorClass::shared_fc2: return {false, true, false};
    case TensorClass::dense_fc1: return {true, false, true};
    case TensorClass::dense_fc2: return {false, true, false};
    case TensorClass::norm_gain: return {false, false, false};
    case TensorClass::output_head: return {true, false, false};
  }
  return {};
}

ModelConfig with_everything(AttentionKind attention) {
  auto c = tiny_config();
  c.attention = attention;
  c.shared_intermediate = 16;
  c.num_layers = 3;
  return c;
}

}  // namespace

class ParameterizationRules : public ::testing::TestWithParam<AttentionKind> {};

TEST_P(ParameterizationRules, MupFollowsTheTablePerTensorClass) {
  const auto base = with_everything(GetParam());
  const int64_t m = 4;
  const auto rules = parameterize(base, scale_width(base, m), Parameterization::mup);
  std::set<TensorClass> seen;
  for (const auto& r : rules) {
    SCOPED_TRACE(r.spec.name);
    const auto e = expected_for(r.spec.cls);
    seen.insert(r.spec.cls);
    EXPECT_EQ(r.fan_in_grows, e.fan_in_grows);
    EXPECT_EQ(r.fan_out_grows, e.fan_out_grows);
    EXPECT_DOUBLE_EQ(r.lr_multiplier, e.hidden_lr ? 1.0 / m : 1.0);
    if (r.spec.cls == TensorClass::norm_gain) {
      EXPECT_TRUE(r.init_ones);
      EXPECT_EQ(r.weight_decay_multiplier, 0.0);
      continue;
    }
    EXPECT_EQ(r.weight_decay_multiplier, 1.0);
    if (r.spec.cls == TensorClass::output_head) {
      EXPECT_DOUBLE_EQ(r.forward_multiplier, 1.0 / m);
      EXPECT_DOUBLE_EQ(r.init_std, 1.0 / std::sqrt(double(base.d_model)));  // the base width's
    } else if (r.spec.cls == TensorClass::embedding) {
      EXPECT_DOUBLE_EQ(r.init_std, 1.0);
    } else {
      EXPECT_DOUBLE_EQ(r.forward_multiplier, 1.0);
      EXPECT_DOUBLE_EQ(r.init_std, 1.0 / std::sqrt(double(r.spec.fan_in)));
    }
  }
  // Every class of this attention kind was checked.
  EXPECT_EQ(seen.size(), GetParam() == AttentionKind::mla ? 13u : 12u);
}

TEST_P(ParameterizationRules, SpUsesOneLrAndFanInInit) {
  const auto base = with_everything(GetParam());
  for (const auto& r : parameterize(base, scale_width(base, 8), Parameterization::sp)) {
    SCOPED_TRACE(r.spec.name);
    EXPECT_EQ(r.lr_multiplier, 1.0);
    EXPECT_EQ(r.forward_multiplier, 1.0);
    if (!r.init_ones && r.spec.cls != TensorClass::embedding)
      EXPECT_DOUBLE_EQ(r.init_std, 1.0 / std::sqrt(double(r.spec.fan_in)));
  }
}

TEST_P(ParameterizationRules, MupAtTheBaseWidthIsSp) {
  const auto base = with_everything(GetParam());
  const auto mup = parameterize(base, base, Parameterization::mup);
  const auto sp = parameterize(base, base, Parameterization::sp);
  ASSERT_EQ(mup.size(), sp.size());
  for (size_t i = 0; i < mup.size(); ++i) {
    SCOPED_TRACE(mup[i].spec.name);
    EXPECT_DOUBLE_EQ(mup[i].init_std, sp[i].init_std);
    EXPECT_DOUBLE_EQ(mup[i].lr_multiplier, sp[i].lr_multiplier);
    EXPECT_DOUBLE_EQ(mup[i].forward_multiplier, sp[i].forward_multiplier);
  }
}

INSTANTIATE_TEST_SUITE_P(Attention, ParameterizationRules, ::testing::Values(AttentionKind::mla, AttentionKind::mha));

TEST(Parameterization, WidthScalingGrowsWidthHeadsAndExpertsOnly) {
  const auto base = tiny_config();
  const auto wide = scale_width(base, 4);
  EXPECT_EQ(wide.d_model, 4 * base.d_model);
  EXPECT_EQ(wide.num_heads, 4 * base.num_heads);
  EXPECT_EQ(wide.num_experts, 4 * base.num_experts);
  EXPECT_EQ(wide.head_dim, base.head_dim);
  EXPECT_EQ(wide.top_k, base.top_k);
  EXPECT_EQ(wide.q_rank, base.q_rank);
  EXPECT_EQ(wide.expert_intermediate, base.expert_intermediate);
}

TEST(Parameterization, RefusesTargetsThatChangeFixedDimensions) {
  const auto base = tiny_config();
  auto deeper = scale_width(base, 2);
  deeper.num_layers += 1;
  EXPECT_THROW(parameterize(base, deeper, Parameterization::mup), moka::Error);
  auto other_rank = scale_width(base, 2);
  other_rank.kv_rank *= 2;
  EXPECT_THROW(parameterize(base, other_rank, Parameterization::mup), moka::Error);
  EXPECT_THROW(parameterize(scale_width(base, 2), base, Parameterization::mup), moka::Error);
}
