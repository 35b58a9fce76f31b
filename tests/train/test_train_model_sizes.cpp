// The sizes a model config multiplies into: widening and head counts that overflow 64 bits are
// refused, and training_values counts the parameters the layout holds, at any depth, without
// overflowing where the layout's own products would.
#include <gtest/gtest.h>

#include <limits>

#include "train/model_config.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;
using moka::train::testing::tiny_config;

namespace {

double layout_parameters(const ModelConfig& c) {
  double total = 0;
  for (const auto& t : tensor_layout(c)) total += double(t.numel());
  return total;
}

}  // namespace

TEST(TrainModelSizes, ParametersMatchTheLayoutAtEveryDepth) {
  for (const auto attention : {AttentionKind::mla, AttentionKind::mha})
    for (const int64_t shared : {0, 24})
      for (const int64_t layers : {1, 2, 3, 7}) {
        auto c = tiny_config();
        c.attention = attention;
        c.shared_intermediate = shared;
        c.num_layers = layers;
        EXPECT_EQ(training_values(c, 2, 8).parameters, layout_parameters(c)) << layers << " layers";
      }
}

TEST(TrainModelSizes, ActivationsGrowWithTokensAndTheSquareOfTheSequence) {
  const auto c = tiny_config();
  const double base = training_values(c, 2, 8).activations;
  EXPECT_GT(base, 0);
  EXPECT_DOUBLE_EQ(training_values(c, 4, 8).activations, 2 * base);
  EXPECT_GT(training_values(c, 2, 16).activations, 2 * base);
}

TEST(TrainModelSizes, HugeSizesAreCountedWithoutOverflow) {
  auto c = tiny_config();
  c.num_layers = std::numeric_limits<int64_t>::max();
  const auto v = training_values(c, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max());
  EXPECT_GT(v.parameters, 1e19);
  EXPECT_GT(v.activations, 1e57);
}

TEST(TrainModelSizes, OverflowingWidthsAreRefused) {
  const auto c = tiny_config();
  EXPECT_THROW(scale_width(c, std::numeric_limits<int64_t>::max() / 2), moka::Error);
  EXPECT_EQ(scale_width(c, 4).d_model, 4 * c.d_model);
  auto wide_heads = c;
  wide_heads.num_heads = int64_t{1} << 62;
  wide_heads.head_dim = 4;
  EXPECT_THROW(wide_heads.validate(), moka::Error);
  EXPECT_THROW(training_values(wide_heads, 1, 1), moka::Error);
}
