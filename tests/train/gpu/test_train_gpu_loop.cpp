// The CUDA training engine training (run on a GPU: `ctest -L gpu`, or `scripts/gpu.sh train` on the
// device): the loss falls, a checkpoint resumes bit for bit, steps replayed from a CUDA graph equal
// eager steps bit for bit, and the profile counts and times every stage.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "train/trainer.hpp"
#include "train_fixtures.hpp"
#include "train_gpu_helpers.hpp"

using namespace moka::train;
using moka::train::gpu_test::fresh_seed;

TEST(TrainGpuLoop, LossDecreases) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  auto config = moka::train::testing::tiny_train_config(Parameterization::mup, 1e-2);
  config.backend = moka::Backend::cuda;
  config.seed = fresh_seed();
  moka::train::testing::expect_loss_decreases(config, *text);
}

TEST(TrainGpuLoop, CheckpointResumeIsBitwiseIdentical) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  auto config = moka::train::testing::tiny_train_config(Parameterization::mup, 3e-3);
  config.backend = moka::Backend::cuda;
  config.seed = fresh_seed();
  moka::train::testing::expect_resume_is_bitwise(config, *text, "moka_gpu_resume_test.safetensors");
}

namespace {

// A config with every part of the step on: EMA, clipping, a schedule that changes the LR each
// step, a shared expert, the router-bias update and z-loss.
TrainConfig full_step_config() {
  auto config = moka::train::testing::tiny_train_config(Parameterization::mup, 3e-3);
  config.backend = moka::Backend::cuda;
  config.seed = fresh_seed();
  config.schedule = {ScheduleKind::cosine, 2, 10, 0.0, 0.1};
  config.ema_decay = 0.9;
  config.adam.clip_norm = 0.5;
  config.model.shared_intermediate = config.base.shared_intermediate = 8;
  config.model.z_loss_coef = config.base.z_loss_coef = 1e-3;
  return config;
}

void expect_same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                      const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << what << " " << i;
    EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)), 0) << what << " tensor " << i;
  }
}

}  // namespace

// N steps replayed from one captured CUDA graph equal N eager steps bit for bit: every step's
// loss, cross-entropy, gradient norm and load, and the weights, Adam moments, EMA and router
// biases after them. Read every step, and read only at the end (the steps then run without any
// host synchronization).
TEST(TrainGpuLoop, CapturedStepsEqualEagerStepsBitwise) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  const auto config = full_step_config();
  constexpr int kSteps = 10;
  auto run = [&](bool graph, bool read_every_step, std::vector<StepReport>& reports) {
    auto c = config;
    c.cuda_graph = graph;
    Trainer t(c, *text);
    for (int s = 0; s < kSteps; ++s) reports.push_back(t.step(nullptr, read_every_step || s + 1 == kSteps));
    return t.state();
  };
  std::vector<StepReport> eager_reports, graph_reports, quiet_reports;
  const TrainState eager = run(false, true, eager_reports);
  const TrainState graph = run(true, true, graph_reports);
  const TrainState quiet = run(true, false, quiet_reports);
  for (int s = 0; s < kSteps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const auto &e = eager_reports[s], &g = graph_reports[s];
    EXPECT_EQ(std::memcmp(&e.loss, &g.loss, sizeof(double)), 0) << e.loss << " vs " << g.loss;
    EXPECT_EQ(std::memcmp(&e.cross_entropy, &g.cross_entropy, sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(&e.grad_norm, &g.grad_norm, sizeof(double)), 0);
    EXPECT_EQ(e.load_max_over_mean, g.load_max_over_mean);
    EXPECT_TRUE(std::isfinite(e.loss));
    if (s + 1 < kSteps) {
      EXPECT_TRUE(std::isnan(quiet_reports[s].loss)) << "a step read without being asked";
    }
  }
  EXPECT_EQ(std::memcmp(&eager_reports.back().loss, &quiet_reports.back().loss, sizeof(double)), 0);
  for (const auto* other : {&graph, &quiet}) {
    expect_same_bits(eager.values, other->values, "weights");
    expect_same_bits(eager.adam_m, other->adam_m, "adam m");
    expect_same_bits(eager.adam_v, other->adam_v, "adam v");
    expect_same_bits(eager.ema, other->ema, "ema");
    EXPECT_EQ(eager.selection_biases, other->selection_biases);
    EXPECT_EQ(eager.steps, other->steps);
  }
  // The biases moved: the update ran (and so the comparison above can fail).
  bool moved = false;
  for (const auto& layer : eager.selection_biases)
    for (double b : layer) moved |= b != 0.0;
  EXPECT_TRUE(moved);
}

// A captured run resumes from a checkpoint and validates (eager forwards between replays) and
// still equals the eager run.
TEST(TrainGpuLoop, CapturedStepsSurviveEvaluationAndResume) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  auto config = full_step_config();
  config.cuda_graph = true;
  moka::train::testing::expect_resume_is_bitwise(config, *text, "moka_gpu_graph_resume_test.safetensors");
  auto eager_config = config;
  eager_config.cuda_graph = false;
  Trainer graph(config, *text), eager(eager_config, *text);
  for (int s = 0; s < 6; ++s) {
    graph.step(nullptr, false);
    eager.step(nullptr, false);
    if (s % 2 == 1) {
      EXPECT_EQ(graph.evaluate(2, s == 3), eager.evaluate(2, s == 3)) << "step " << s;
    }
  }
  expect_same_bits(eager.state().values, graph.state().values, "weights");
}

// The profile: every stage that runs on the GPU has time and launches; a replayed step waits
// for the host never, an eager one only where the caller reads.
TEST(TrainGpuLoop, ProfileCountsLaunchesAndTimesStages) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  for (const bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "cuda graph" : "eager");
    auto config = full_step_config();
    config.cuda_graph = graph;
    config.profile = true;
    Trainer t(config, *text);
    for (int s = 0; s < 5; ++s) t.step(nullptr, false);
    const StepProfile p = t.profile();
    std::cout << p.table();
    EXPECT_EQ(p.steps, 3);  // the first two steps (allocation, capture) are not profiled
    EXPECT_EQ(p.mode, graph ? "cuda graph" : "eager");
    EXPECT_GT(p.launches_per_step, 50);
    EXPECT_EQ(p.host_syncs, 0);
    int64_t staged = 0;
    for (int i = 0; i < kStageCount; ++i) staged += p.launches[i];
    EXPECT_EQ(staged, p.launches_per_step);
    for (Stage s : {Stage::embedding_forward, Stage::norms_forward, Stage::attention_forward, Stage::moe_forward,
                    Stage::head_loss_forward, Stage::head_loss_backward, Stage::moe_backward, Stage::norms_backward,
                    Stage::attention_backward, Stage::embedding_backward, Stage::optimizer, Stage::router_bias}) {
      EXPECT_GT(p.ms[size_t(s)], 0.0) << stage_name(s);
      EXPECT_GT(p.launches[size_t(s)], 0) << stage_name(s);
    }
    EXPECT_EQ(p.launches[size_t(Stage::optimizer)], 3);  // grad norm partials, their sum, AdamW + EMA
    EXPECT_GT(p.step_ms, 0.0);
  }
}
