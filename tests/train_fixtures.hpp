// Shared pieces of the training tests: a CI-sized model and a slice of the text corpus.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>

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
  static const TextSplit* slice = [] () -> const TextSplit* {
    if (!std::filesystem::is_directory(default_text_dir())) return nullptr;
    static TextSplit s = load_fortune_corpus(default_text_dir(), 200'000);
    return &s;
  }();
  return slice;
}

#define MOKA_REQUIRE_CORPUS(var)                                                              \
  const ::moka::train::TextSplit* var = ::moka::train::testing::corpus_slice();              \
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

}  // namespace moka::train::testing
