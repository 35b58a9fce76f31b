// The trainer: loss goes down, checkpoints resume bit-exactly, schedules, data and file format.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>

#include "train/checkpoint.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;
using moka::train::testing::tiny_train_config;

TEST(TrainLoop, LossDecreasesOnATinyModel) {
  MOKA_REQUIRE_CORPUS(text);
  moka::train::testing::expect_loss_decreases(tiny_train_config(Parameterization::mup, 1e-2), *text);
}

TEST(TrainLoop, CheckpointResumeIsBitwiseIdentical) {
  MOKA_REQUIRE_CORPUS(text);
  moka::train::testing::expect_resume_is_bitwise(tiny_train_config(Parameterization::mup, 3e-3), *text,
                                                 "moka_resume_test.safetensors");
}

// --precision fp8 on the CPU engine (the FP8 recipe's exact emulation in the MoE layers): the
// loss falls as in fp32; the first step's loss differs from fp32's (the fp8 layers ran) by less
// than the recipe's error.
TEST(TrainLoop, Fp8MoeLayersTrainOnTheCpu) {
  MOKA_REQUIRE_CORPUS(text);
  TrainConfig fp8 = tiny_train_config(Parameterization::mup, 1e-2);
  fp8.moe_precision = moka::Precision::fp8;
  moka::train::testing::expect_loss_decreases(fp8, *text);
  Trainer f32_run(tiny_train_config(Parameterization::mup, 1e-2), *text), fp8_run(fp8, *text);
  const double f32_loss = f32_run.step().cross_entropy, fp8_loss = fp8_run.step().cross_entropy;
  EXPECT_NE(fp8_loss, f32_loss);
  EXPECT_NEAR(fp8_loss, f32_loss, 0.05 * f32_loss);
}

// The CUDA engine has no fp8 MoE layers yet: it refuses, naming the option, and never trains in
// bf16 in its place.
TEST(TrainLoop, Fp8OnTheCudaEngineIsRefused) {
  MOKA_REQUIRE_CORPUS(text);
  TrainConfig c = tiny_train_config(Parameterization::mup, 1e-2);
  c.backend = moka::Backend::cuda;
  c.moe_precision = moka::Precision::fp8;
  try {
    Trainer trainer(c, *text);
    ADD_FAILURE() << "the CUDA engine accepted fp8";
  } catch (const moka::Error& e) {
    EXPECT_EQ(e.code(), moka::ErrorCode::backend_unavailable);
    EXPECT_NE(std::string(e.what()).find("--precision fp8"), std::string::npos) << e.what();
  }
}

// A run that blows up says so, with the step: not the router's complaint about its inputs.
TEST(TrainLoop, DivergedRunNamesTheStep) {
  MOKA_REQUIRE_CORPUS(text);
  Trainer trainer(tiny_train_config(Parameterization::mup, 1e30), *text);
  std::string message;
  try {
    for (int s = 0; s < 100; ++s) trainer.step();
  } catch (const moka::Error& e) {
    EXPECT_EQ(e.code(), moka::ErrorCode::non_finite);
    message = e.what();
  }
  EXPECT_NE(message.find("training diverged at step " + std::to_string(trainer.steps_done() + 1) + ": "),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("check x and w_router"), std::string::npos) << message;
}

// A step whose loss was still finite but whose update left non-finite weights: the validation
// after it names that step too.
TEST(TrainLoop, ValidationAfterADivergedStepNamesTheStep) {
  MOKA_REQUIRE_CORPUS(text);
  // An LR the CLI refuses, which makes every weight non-finite at the first update.
  Trainer trainer(tiny_train_config(Parameterization::mup, INFINITY), *text);
  ASSERT_TRUE(std::isfinite(trainer.step().loss));
  try {
    trainer.evaluate(1);
    ADD_FAILURE() << "evaluated a diverged model without an error";
  } catch (const moka::Error& e) {
    EXPECT_EQ(e.code(), moka::ErrorCode::non_finite);
    EXPECT_NE(std::string(e.what()).find("training diverged at step 1: the router logits became non-finite in "
                                         "validation"),
              std::string::npos)
        << e.what();
  }
}

// The CPU engine's profile: each stage of a step on the host clock, the stage times summing to
// the step, every step's report filled whether or not it is asked to read (nothing to wait for).
TEST(TrainLoop, CpuProfileTimesEveryStage) {
  MOKA_REQUIRE_CORPUS(text);
  auto config = tiny_train_config(Parameterization::mup, 1e-2);
  config.profile = true;
  config.ema_decay = 0.9;
  Trainer trainer(config, *text);
  for (int s = 0; s < 3; ++s) EXPECT_TRUE(std::isfinite(trainer.step(nullptr, false).loss));
  const StepProfile p = trainer.profile();
  EXPECT_EQ(p.steps, 3);
  EXPECT_EQ(p.mode, "cpu");
  EXPECT_EQ(p.launches_per_step, -1);
  double staged = 0;
  for (int i = 0; i < kStageCount; ++i) staged += p.ms[i];
  for (Stage s :
       {Stage::embedding_forward, Stage::norms_forward, Stage::attention_forward, Stage::moe_forward,
        Stage::head_loss_forward, Stage::head_loss_backward, Stage::moe_backward, Stage::norms_backward,
        Stage::attention_backward, Stage::embedding_backward, Stage::optimizer, Stage::ema, Stage::router_bias})
    EXPECT_GT(p.ms[size_t(s)], 0.0) << stage_name(s);
  EXPECT_LE(staged, p.step_ms * (1 + 1e-9));
  EXPECT_GT(staged, 0.9 * p.step_ms);  // the marks cover the step
  const auto json = p.to_json();
  EXPECT_EQ(json["stages"].size(), size_t(kStageCount));
  EXPECT_EQ(json["stages"][0]["stage"], "embedding forward");
  EXPECT_NE(p.table().find("router bias"), std::string::npos);
  Trainer unprofiled(tiny_train_config(Parameterization::mup, 1e-2), *text);
  unprofiled.step();
  EXPECT_EQ(unprofiled.profile().steps, 0);
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
  if (moka::cuda_backend_available()) GTEST_SKIP() << "a GPU is visible: tests/train/gpu covers this backend";
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

// Sizes no CLI flag reaches (it checks them first), given to the library: clear errors, never an
// overflowed seq + 1 or batch x seq (UBSan) or a huge allocation.
TEST(TextData, SampleBatchRefusesSizesThatOverflow) {
  const std::vector<uint8_t> text(100, 'a');
  const auto error_of = [&](int64_t batch, int64_t seq) {
    try {
      sample_batch(text, batch, seq, 1, 0);
    } catch (const moka::Error& e) {
      EXPECT_EQ(e.code(), moka::ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_NE(error_of(2, kMax).find("shorter than a sequence of 9223372036854775807"), std::string::npos);
  EXPECT_NE(error_of(kMax, 16).find("a batch of 9223372036854775807 x 16 tokens overflows 64 bits"), std::string::npos);
  EXPECT_NE(error_of(0, 16).find("both must be positive"), std::string::npos);
  EXPECT_NE(error_of(3, 0).find("both must be positive"), std::string::npos);
  EXPECT_EQ(error_of(3, 98), "no error");  // the longest sequence 100 bytes hold with its target
}

// Bytes this process has read through read(2) so far (Linux's /proc/self/io "rchar").
static int64_t bytes_read_so_far() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value)
    if (key == "rchar:") return value;
  return -1;
}

TEST(TextData, MaxBytesStopsTheReadingNotJustTheKeeping) {
  // A 16 MB corpus file; --max-bytes 1000 must not read it all first.
  const auto dir = std::filesystem::temp_directory_path() / ("moka_text_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::ofstream f(dir / "big");
    const std::string record(100, 'a');
    for (int i = 0; i < 160'000; ++i) f << record << i << "\n%\n";
  }
  const int64_t before = bytes_read_so_far();
  const TextSplit split = load_fortune_corpus(dir.string(), 1000);
  const int64_t read = bytes_read_so_far() - before;
  std::filesystem::remove_all(dir);
  if (before < 0) GTEST_SKIP() << "no /proc/self/io";
  EXPECT_GE(int64_t(split.train.size() + split.validation.size()), 1000);
  EXPECT_LT(split.records, 20);
  EXPECT_LT(read, 1 << 20) << "read " << read << " bytes of a 16 MB file for 1000";
}
