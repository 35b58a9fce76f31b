// The backward megakernel (cuda/megakernel/backward.hpp) at EP = 1 and at EP = 2 with
// both ranks on one GPU: every gradient (d_x, d_topk_weights, the routed experts' dW_gate/up/down
// and the shared expert's) against an fp64 backward of the same bf16 inputs, on outputs poisoned
// with NaN bits first; the same bits across SM splits and minibatch/macrobatch sizes; a bounded
// wait that times out and a rank that stops are reported.
//
// The saved context is made on the host as the forward leaves it in resident mode: the
// expert-grouped rows of x, g = x W_gate^T and u = x W_up^T (bf16, padding rows zero) in the
// receive schedule's order (core::build_receive_schedule, every source rank's rows), and the
// shared expert's g, u.

#include "megakernel_backward_case.hpp"

namespace moka::cuda {
namespace {

// H = 320, I = 264: two column tiles of dgd and dx, partial last tiles everywhere; with
// skewed_routing, 768 rows, an empty expert and a weight-gradient carry at 256-row macrobatches.
BackwardCase skewed_case(bool clamped, uint64_t seed) {
  const MoeShape shape{320, 264, 4, 2, 136, clamped ? Activation::swiglu_clamped : Activation::swiglu, 0.5f};
  std::mt19937_64 rng(seed);
  return BackwardCase(shape, 1, 300, skewed_routing(rng), seed);
}

TEST(MegakernelBackward, GradientsMatchReferenceWithCarriesAndAnEmptyExpert) {
  BackwardCase c = skewed_case(false, 0xbac0001ull);
  ASSERT_EQ(c.schedule().expert_offset, (std::vector<int64_t>{0, 384, 512, 512, 768}));
  c.expect_close(c.run(config(1, 128, 256), 4));
}

// T = 1, k = 8 of 16 experts: eight one-row experts (each a padded tile), eight empty ones;
// clamped SwiGLU with a limit inside the values' range.
BackwardCase eight_routes_of_one_token(uint64_t seed) {
  const MoeShape shape{256, 128, 16, 8, 64, Activation::swiglu_clamped, 0.3f};
  std::mt19937_64 rng(seed);
  return BackwardCase(shape, 1, 1, uniform_routing(1, 8, 16, rng), seed);
}

TEST(MegakernelBackward, ClampedSwigluWithEightRoutesOfOneToken) {
  BackwardCase c = eight_routes_of_one_token(0xbac0002ull);
  c.expect_close(c.run(config(1, 256, 512), 5));
}

TEST(MegakernelBackward, BitsDoNotDependOnSplitsOrBatchSizes) {
  BackwardCase c = skewed_case(true, 0xbac0003ull);
  const Gradients first = c.run(config(1, 128, 256), 4);
  c.expect_close(first);
  EXPECT_TRUE(same_bits(first, c.run(config(2, 256, 512), 9))) << "another split and minibatch/macrobatch";
  EXPECT_TRUE(same_bits(first, c.run(config(3, 128, 1024), 0))) << "every SM, one macrobatch";
  EXPECT_TRUE(same_bits(first, c.run(config(1, 128, 256), 4))) << "the same run again";
}

// EP = 1 as the layer runs it: the dx tiles store each row's d_x straight into its slot (no d_x
// rows in the ring, no row copies in the push): the bits of the push's copies, in both context
// modes, across macrobatches (carries) and in one.
TEST(MegakernelBackward, DxIntoSlotsGivesThePushesBits) {
  BackwardCase c = skewed_case(false, 0xbac0009ull);
  auto run = [&](const MegakernelConfig& cfg, core::ContextMode mode, bool into_slots) {
    RankLaunch launch;
    launch.num_ctas = 4;
    launch.dx_into_slots = into_slots;
    std::vector<RankResult> r = c.run_ranks(cfg, launch, mode);
    if (r[0].error) std::rethrow_exception(r[0].error);
    return r[0].grads;
  };
  for (const core::ContextMode mode : {core::ContextMode::resident, core::ContextMode::replay})
    for (const MegakernelConfig& cfg : {config(1, 128, 256), config(2, 128, 1024)}) {
      SCOPED_TRACE(std::string(mode == core::ContextMode::replay ? "replay" : "resident") + ", macrobatch " +
                   std::to_string(cfg.macrobatch_size));
      const Gradients into_slots = run(cfg, mode, true);
      c.expect_close(into_slots);
      EXPECT_TRUE(same_bits(into_slots, run(cfg, mode, false)));
    }
}

// Replay mode: x pulled again and g, u recomputed by the forward's gate|up tile (fp32 sums, so
// within bf16 rounding of the host's g, u the resident cases read); the shared expert's too.
TEST(MegakernelBackward, ReplayModeMatchesReferenceAndItsBitsDoNotDependOnSplits) {
  BackwardCase c = skewed_case(false, 0xbac0007ull);
  const Gradients first = c.run(config(1, 128, 256), 4, core::ContextMode::replay);
  c.expect_close(first);
  EXPECT_TRUE(same_bits(first, c.run(config(2, 256, 512), 9, core::ContextMode::replay)));
}

TEST(MegakernelBackward, ReplayModeWithEightRoutesOfOneToken) {
  BackwardCase c = eight_routes_of_one_token(0xbac0008ull);
  c.expect_close(c.run(config(1, 256, 512), 5, core::ContextMode::replay));
}

// Named shapes' layer dimensions with a few experts and tokens: gpt-oss-120b's H = I = 2880
// (no multiple of 256: partial column tiles and half B boxes everywhere), deepseek-v3's H = 7168,
// I = 2048 and shared expert Is = 2048.
void check_dimensions(int64_t H, int64_t I, int64_t Is, int64_t E, int64_t k, int64_t T, uint64_t seed) {
  const MoeShape shape{H, I, E, k, Is, Activation::swiglu, 7.0f};
  std::mt19937_64 rng(seed);
  BackwardCase c(shape, 1, T, uniform_routing(T, k, E, rng), seed);
  c.expect_close(c.run(config(2, 128, 256), 0));
}
TEST(MegakernelBackward, GptOss120bDimensions) { check_dimensions(2880, 2880, 0, 8, 4, 24, 0xbac0005ull); }
TEST(MegakernelBackward, DeepseekV3DimensionsWithSharedExpert) {
  check_dimensions(7168, 2048, 2048, 4, 4, 16, 0xbac0006ull);
}

// A 1 ns bound: a wait not satisfied at its first read times out; every CTA leaves and the host
// raises a timeout naming the task and its counter. The next call (control words reset) works.
TEST(MegakernelBackward, WaitTimeoutIsReported) {
  BackwardCase c = skewed_case(false, 0xbac0004ull);
  try {
    c.run(config(1, 128, 256, 1e-9), 4);
    ADD_FAILURE() << "no wait timed out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("megakernel backward: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out after"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("waiting for"), std::string::npos) << e.what();
  }
  c.expect_close(c.run(config(1, 128, 256), 4));
}

}  // namespace
}  // namespace moka::cuda
