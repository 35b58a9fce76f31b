// Options shared by `moka train`, `moka coordcheck` and `moka lr-sweep`: the base (x1) model,
// the optimizer and schedule, the data, and where the plots come from.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "train/trainer.hpp"

namespace moka::cli {

struct TrainCliOptions {
  TrainCliOptions();  // a d=32 base model with 4 experts, 4 x 32-token batches

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
  // The text, refused when it holds no full --seq window for training or validation.
  train::TextSplit load_text() const;
};

// The shared options a command takes besides the model, data and optimizer ones: coordcheck
// derives the step count from --check-steps, lr-sweep takes the LR from its grid.
struct SharedOptions {
  bool steps = true;
  bool lr = true;
};

// Registers the options with o's current values as the defaults --help shows, so a command
// sets its own defaults in `o` first.
void add_train_options(CLI::App* cmd, TrainCliOptions& o, SharedOptions which = {});

// Range checks whose failures CLI11 reports as "--option: must be > 0, got -1".
CLI::Validator at_least(double min);
CLI::Validator greater_than(double min);
CLI::Validator at_most(double max);
CLI::Validator below(double max);

// Fails fast, naming `option`, unless `path` can be written: its directory exists and is
// writable and it is not itself a directory.
void check_output_path(const std::string& option, const std::string& path);

// Checks that `--plot png` can be drawn before any work starts: the path, tools/plot_mup.py
// (which the build copies next to the moka binary) and a python with matplotlib.
void check_plotter(const std::string& png);
// Runs plot_mup.py `kind` csv png (no shell in between); throws when it fails.
void draw_plot(const std::string& kind, const std::string& csv, const std::string& png);

std::vector<int64_t> parse_multipliers(const std::string& list);  // --mults "1,2,4,8"

}  // namespace moka::cli
