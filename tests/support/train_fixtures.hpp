// Shared pieces of the training tests: a CI-sized model and a slice of the text corpus.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>

#include "train/text_data.hpp"
#include "train/trainer.hpp"

namespace moka::train::testing {

// d=32 with 2 heads of 16, 4 experts (d/8), top-2: the x1 model of the CI width checks.
inline ModelConfig tiny_config() {
  ModelConfig c;
  c.d_model = 32;
  c.num_heads = 2;
  c.head_dim = 16;
  c.q_rank = 16;
  c.kv_rank = 16;
  c.num_layers = 2;
  c.dense_intermediate = 64;
  c.num_experts = 4;
  c.top_k = 2;
  c.expert_intermediate = 32;
  return c;
}

// The first ~200 KB of the fortunes corpus, loaded once; null when scripts/fetch_data.sh has not
// installed it (the caller skips).
inline const TextSplit* corpus_slice() {
  static const TextSplit* slice = []() -> const TextSplit* {
    if (!std::filesystem::is_directory(default_text_dir())) return nullptr;
    static TextSplit s = load_fortune_corpus(default_text_dir(), 200'000);
    return &s;
  }();
  return slice;
}

#define MOKA_REQUIRE_CORPUS(var)                                                \
  const ::moka::train::TextSplit* var = ::moka::train::testing::corpus_slice(); \
  if (!var) GTEST_SKIP() << "text corpus not installed: run scripts/fetch_data.sh"

inline TrainConfig tiny_train_config(Parameterization p, double lr) {
  TrainConfig t;
  t.base = t.model = tiny_config();
  t.parameterization = p;
  t.adam.lr = lr;
  t.schedule = {ScheduleKind::constant, 0, 1000, 0.0, 0.0};
  t.batch = 4;
  t.seq = 32;
  t.threads = 2;
  return t;
}

inline std::vector<float> all_values(const Trainer& t) {
  std::vector<float> out;
  for (const auto& v : t.state().values) out.insert(out.end(), v.begin(), v.end());
  return out;
}

// Validation loss falls by more than 1 nat in 60 steps (WSD), on the backend `config` names.
inline void expect_loss_decreases(TrainConfig config, const TextSplit& text) {
  config.schedule = {ScheduleKind::wsd, 5, 60, 0.2, 0.1};
  Trainer trainer(config, text);
  const double before = trainer.evaluate(4);
  std::vector<double> losses;
  for (int s = 0; s < 60; ++s) losses.push_back(trainer.step().cross_entropy);
  const double after = trainer.evaluate(4);
  std::cout << "[ result   ] validation loss " << before << " -> " << after << std::endl;
  EXPECT_LT(before, std::log(256.0) + 1.0);  // unit-variance logits at init: about ln 256 + 1/2
  EXPECT_LT(after, before - 1.0);
  const double first = std::accumulate(losses.begin(), losses.begin() + 5, 0.0) / 5;
  const double last = std::accumulate(losses.end() - 5, losses.end(), 0.0) / 5;
  EXPECT_LT(last, first - 1.0);
}

// A checkpoint at step 4 resumed to step 8 equals 8 straight steps bit for bit (weights, Adam
// moments, router biases, EMA), with clipping, a cosine schedule and a shared expert on; a run
// without the checkpoint differs, so the comparison can fail.
inline void expect_resume_is_bitwise(TrainConfig config, const TextSplit& text, const std::string& file_name) {
  config.schedule = {ScheduleKind::cosine, 2, 8, 0.0, 0.1};
  config.ema_decay = 0.9;
  config.adam.clip_norm = 0.5;
  config.model.shared_intermediate = config.base.shared_intermediate = 8;
  const auto path = (std::filesystem::temp_directory_path() / file_name).string();

  Trainer straight(config, text);
  for (int s = 0; s < 8; ++s) straight.step();
  Trainer first(config, text);
  for (int s = 0; s < 4; ++s) first.step();
  first.save(path);
  Trainer resumed(config, text);  // everything but the config must come from the file
  resumed.load(path);
  EXPECT_EQ(resumed.steps_done(), 4);
  for (int s = 0; s < 4; ++s) resumed.step();
  std::filesystem::remove(path);

  const auto a = all_values(straight), b = all_values(resumed);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_EQ(straight.state().selection_biases, resumed.state().selection_biases);
  EXPECT_EQ(straight.state().adam_v, resumed.state().adam_v);
  EXPECT_EQ(straight.evaluate(2, true), resumed.evaluate(2, true));  // EMA weights too
  Trainer fresh(config, text);
  for (int s = 0; s < 4; ++s) fresh.step();
  const auto c = all_values(fresh);
  EXPECT_NE(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0);
}

}  // namespace moka::train::testing
