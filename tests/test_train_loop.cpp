// The trainer: loss goes down, checkpoints resume bit-exactly, schedules, data and file format.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "train/checkpoint.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;
using moka::train::testing::tiny_train_config;

TEST(TrainLoop, LossDecreasesOnATinyModel) {
  MOKA_REQUIRE_CORPUS(text);
  auto config = tiny_train_config(Parameterization::mup, 1e-2);
  config.schedule = {ScheduleKind::wsd, 5, 60, 0.2, 0.1};
  Trainer trainer(config, *text);
  const double before = trainer.evaluate(4);
  std::vector<double> losses;
  for (int s = 0; s < 60; ++s) losses.push_back(trainer.step().cross_entropy);
  const double after = trainer.evaluate(4);
  EXPECT_LT(before, std::log(256.0) + 1.0);  // unit-variance logits at init: about ln 256 + 1/2
  EXPECT_LT(after, before - 1.0);
  const double first = std::accumulate(losses.begin(), losses.begin() + 5, 0.0) / 5;
  const double last = std::accumulate(losses.end() - 5, losses.end(), 0.0) / 5;
  EXPECT_LT(last, first - 1.0);
}

namespace {
std::vector<float> all_values(const Trainer& t) {
  std::vector<float> out;
  for (const auto& v : t.state().values) out.insert(out.end(), v.begin(), v.end());
  return out;
}
}  // namespace

TEST(TrainLoop, CheckpointResumeIsBitwiseIdentical) {
  MOKA_REQUIRE_CORPUS(text);
  auto config = tiny_train_config(Parameterization::mup, 3e-3);
  config.schedule = {ScheduleKind::cosine, 2, 8, 0.0, 0.1};
  config.ema_decay = 0.9;
  config.adam.clip_norm = 0.5;
  config.model.shared_intermediate = 8;
  config.base.shared_intermediate = 8;
  const auto path = (std::filesystem::temp_directory_path() / "moka_resume_test.safetensors").string();

  Trainer straight(config, *text);
  for (int s = 0; s < 8; ++s) straight.step();

  Trainer first(config, *text);
  for (int s = 0; s < 4; ++s) first.step();
  first.save(path);
  auto changed = config;
  changed.seed = config.seed;  // same data stream; everything else must come from the file
  Trainer resumed(changed, *text);
  resumed.load(path);
  EXPECT_EQ(resumed.steps_done(), 4);
  for (int s = 0; s < 4; ++s) resumed.step();
  std::filesystem::remove(path);

  const auto a = all_values(straight), b = all_values(resumed);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_EQ(straight.state().selection_biases, resumed.state().selection_biases);
  EXPECT_EQ(straight.evaluate(2, true), resumed.evaluate(2, true));  // EMA weights too
  // A fresh trainer without the checkpoint differs: the comparison can fail.
  Trainer fresh(config, *text);
  for (int s = 0; s < 4; ++s) fresh.step();
  const auto c = all_values(fresh);
  EXPECT_NE(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0);
}

TEST(TrainLoop, SafetensorsRoundTripAndHeaderLayout) {
  SafetensorsFile f;
  f.put("w", std::vector<float>{1.5f, -2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  f.put("b", std::vector<double>{0.25}, {1});
  f.metadata["step"] = "7";
  const auto path = (std::filesystem::temp_directory_path() / "moka_st_test.safetensors").string();
  write_safetensors(path, f);
  EXPECT_EQ(std::filesystem::file_size(path) % 8, 0u);  // 8 + padded header + 24 + 8 bytes
  const auto g = read_safetensors(path);
  std::filesystem::remove(path);
  EXPECT_EQ(g.get("w").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(g.get("w").as<float>(), f.get("w").as<float>());
  EXPECT_EQ(g.get("b").as<double>(), std::vector<double>{0.25});
  EXPECT_EQ(g.metadata.at("step"), "7");
  EXPECT_THROW(g.get("w").as<double>(), moka::Error);
  EXPECT_THROW(g.get("missing"), moka::Error);
}

TEST(TrainLoop, SchedulesWarmUpHoldAndDecay) {
  const LrSchedule wsd{ScheduleKind::wsd, 10, 100, 0.2, 0.1};
  EXPECT_NEAR(wsd.factor(0), 0.1, 1e-12);
  EXPECT_NEAR(wsd.factor(9), 1.0, 1e-12);
  EXPECT_EQ(wsd.factor(50), 1.0);
  EXPECT_EQ(wsd.factor(80), 1.0);
  EXPECT_NEAR(wsd.factor(90), 0.55, 1e-12);
  EXPECT_NEAR(wsd.factor(100), 0.1, 1e-12);
  const LrSchedule cosine{ScheduleKind::cosine, 0, 100, 0.0, 0.0};
  EXPECT_NEAR(cosine.factor(50), 0.5, 1e-12);
  EXPECT_NEAR(cosine.factor(100), 0.0, 1e-12);
  for (int s = 1; s < 100; ++s) EXPECT_LE(cosine.factor(s), cosine.factor(s - 1));
}

TEST(TrainLoop, TrainingOnCudaWithoutAGpuIsRefusedClearly) {
  MOKA_REQUIRE_CORPUS(text);
  if (moka::cuda_backend_available()) GTEST_SKIP() << "a GPU is visible: tests/train_gpu covers this backend";
  auto config = tiny_train_config(Parameterization::mup, 1e-2);
  config.backend = moka::Backend::cuda;
  try {
    Trainer trainer(config, *text);
    FAIL() << "expected backend_unavailable";
  } catch (const moka::Error& e) {
    EXPECT_EQ(e.code(), moka::ErrorCode::backend_unavailable);
    EXPECT_NE(std::string(e.what()).find("--backend"), std::string::npos) << e.what();
  }
}

TEST(TextData, SplitIsDeterministicAndBatchesShiftByOne) {
  MOKA_REQUIRE_CORPUS(text);
  EXPECT_GT(text->train.size(), 10 * text->validation.size());
  EXPECT_GT(text->validation.size(), 0u);
  const auto again = load_fortune_corpus(default_text_dir(), 200'000);
  EXPECT_EQ(again.train, text->train);
  EXPECT_EQ(again.validation, text->validation);
  // Mostly printable English.
  const auto printable = std::count_if(text->train.begin(), text->train.end(),
                                       [](uint8_t c) { return (c >= 32 && c < 127) || c == '\n' || c == '\t'; });
  EXPECT_GT(double(printable) / double(text->train.size()), 0.98);
  const auto b = sample_batch(text->train, 3, 16, 1, 5);
  for (int64_t s = 0; s < 3; ++s)
    for (int64_t t = 0; t + 1 < 16; ++t) EXPECT_EQ(b.targets[s * 16 + t], b.inputs[s * 16 + t + 1]);
  EXPECT_EQ(sample_batch(text->train, 3, 16, 1, 5).inputs, b.inputs);
  EXPECT_NE(sample_batch(text->train, 3, 16, 1, 6).inputs, b.inputs);
}
