// Options shared by `moka train`, `moka coordcheck` and `moka lr-sweep`: the base (x1) model,
// the optimizer and schedule, the data, and where the plots come from.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "train/trainer.hpp"

namespace moka::cli {

struct TrainCliOptions {
  train::ModelConfig base;
  std::string attention = "mla";
  std::string parameterization = "mup";
  std::string schedule = "wsd";
  std::string backend = "cpu";
  std::string data_dir;
  int64_t max_bytes = 0;
  int64_t steps = 200;
  int64_t warmup = 0;
  train::TrainConfig train;

  // The TrainConfig these options describe, with the model `multiplier` times the base width.
  train::TrainConfig resolve(int64_t multiplier);
  train::TextSplit load_text() const;
};

void add_train_options(CLI::App* cmd, TrainCliOptions& o);

// Runs tools/plot_mup.py `kind` csv png with a python that has matplotlib; reports failure
// on stderr without failing the command (the CSV is the result, the image a view of it).
void draw_plot(const std::string& kind, const std::string& csv, const std::string& png);

std::vector<int64_t> parse_multipliers(const std::string& list);  // "1,2,4,8"

}  // namespace moka::cli
