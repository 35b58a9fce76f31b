// Options shared by `moka train`, `coordcheck`, `lr-sweep` and `lr-horizon`: the base (x1) model,
// the optimizer and schedule, the data, and where the plots come from.
#pragma once
#include <CLI/CLI.hpp>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "option_checks.hpp"
#include "train/mup_experiments.hpp"
#include "train/trainer.hpp"

namespace moka::cli {

// The most --steps: the progress line counts steps in int, and no run comes near it.
constexpr int64_t kMaxSteps = std::numeric_limits<int>::max();

struct TrainCliOptions {
  TrainCliOptions();  // a d=32 base model with 4 experts, 4 x 32-token batches

  train::ModelConfig base;
  std::string attention = "mla";
  std::string parameterization = "mup";
  std::string schedule = "wsd";
  std::string backend = "cpu";
  std::string cuda_graph = "on";
  std::string attention_kernel = "fused";
  std::string matmul = "tf32";
  std::string precision = "bf16";
  std::string data_dir;
  int64_t max_bytes = 0;
  int64_t steps = 200;
  int64_t warmup = 0;
  train::TrainConfig train;

  // The TrainConfig these options describe, with the model `multiplier` times the base width;
  // refused, naming the flags, when its sizes overflow or exceed this machine's memory.
  train::TrainConfig resolve(int64_t multiplier);
  // The x1 TrainConfig of a command that trains every width of `multipliers` (--mults), up to
  // `runs_at_once` runs at a time: refused unless that many runs of the widest model fit.
  train::TrainConfig resolve_widths(const std::vector<int64_t>& multipliers, int64_t runs_at_once);
  // The text, refused when it holds no full --seq window for training or validation.
  train::TextSplit load_text() const;

 private:
  train::TrainConfig resolve_unchecked(int64_t multiplier);
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

// Checks that `--plot png` can be drawn before any work starts: the path, tools/plot_mup.py
// (which the build copies next to the moka binary) and a python with matplotlib.
void check_plotter(const std::string& png);
// Runs plot_mup.py `kind` csv png (no shell in between); throws when it fails.
void draw_plot(const std::string& kind, const std::string& csv, const std::string& png);

std::vector<int64_t> parse_multipliers(const std::string& list);  // --mults "1,2,4,8"
// A comma-separated list of positive integers given to `option` ("" = empty).
std::vector<int64_t> parse_positive_list(const std::string& option, const std::string& list);

// Refuses, naming the flags, `runs_at_once` runs whose `eval_batches` validation batches (one
// evaluation holds them all) exceed this machine's memory.
void check_validation_memory(const train::TrainConfig& t, int64_t eval_batches, int64_t runs_at_once);

// The most training runs a sweep takes: it keeps every run's configuration, and its progress
// line counts them in int.
constexpr int64_t kMaxRuns = 1'000'000;
// Refuses `runs` above kMaxRuns; `product` names the flags that multiply into it.
void check_run_count(int64_t runs, const std::string& product);

// The options of the commands that train many runs (lr-sweep, lr-horizon): the LR grid, seeds,
// parallel runs and validation size.
struct SweepCliOptions {
  static constexpr int kMaxGridAxis = 1000;  // the most --lr-points and --seeds

  double lr_min = 0x1p-10, lr_max = 0x1p-4;
  int lr_points = 7;
  int seeds = 1;
  int workers = 0;
  int eval_batches = 8;
  std::vector<double> lrs() const;              // lr_points LRs evenly spaced in log between lr_min and lr_max
  int resolved_workers(Backend backend) const;  // 0 = one per hardware thread on the CPU, 4 on the GPU
};
void add_sweep_options(CLI::App* cmd, SweepCliOptions& o);

// {"mean", "std", "min", "max", "count"}.
nlohmann::json spread_json(const train::Spread& s);
// Writes `doc` (indented) to `path` atomically (a failed write leaves the previous file, or none);
// non-finite numbers (diverged runs) come out as null.
void write_json(const std::string& path, const nlohmann::json& doc);

}  // namespace moka::cli
