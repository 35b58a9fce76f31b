#include "train_options.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "commands.hpp"
#include "core/atomic_file.hpp"

extern char** environ;

namespace moka::cli {
namespace {

// A finite number for which `holds`: infinity passes a one-sided bound, and an infinite LR, clip
// or decay gives a run of NaNs (integer options never parse "inf" anyway).
CLI::Validator number_check(const std::string& rule, std::function<bool(double)> holds) {
  return CLI::Validator(
      [rule, holds](std::string& input) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(input, value)) return "'" + input + "' is not a number";
        if (!std::isfinite(value)) return "must be a finite number, got " + input;
        return holds(value) ? std::string() : "must be " + rule + ", got " + input;
      },
      rule);
}

// The shortest text that reads back as v: a bound such as 2147483647 shows every digit.
std::string number_text(double v) {
  char text[32];
  return std::string(text, std::to_chars(text, text + sizeof text, v).ptr);
}

const char* python() {
  const char* p = std::getenv("MOKA_PYTHON");
  return p && *p ? p : "/usr/bin/python3";
}

std::string plot_script() {
  const auto script = std::filesystem::path(self_executable()).parent_path() / "plot_mup.py";
  require(std::filesystem::is_regular_file(script), ErrorCode::io,
          "the plot script " + script.string() +
              " is missing (the build copies tools/plot_mup.py next to the moka binary); --plot '' skips the plot");
  return script.string();
}

// Runs argv[0] (looked up in PATH) with its arguments as they are, no shell, and returns its
// exit status (128 + the signal when a signal ended it).
int run_program(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int err = ::posix_spawnp(&pid, args[0], nullptr, nullptr, args.data(), environ);
  require(err == 0, ErrorCode::io, "cannot run " + argv[0] + ": " + std::strerror(err));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    require(errno == EINTR, ErrorCode::io, "waiting for " + argv[0] + " failed: " + std::strerror(errno));
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Refuses, naming the flags, a run whose sizes overflow the trainer's 64-bit counts, or
// `runs_at_once` runs whose memory exceeds this machine's, before anything is allocated (counted
// in floating point, which no flag values overflow). `width_flags` names the flag that set the
// width multiplier ("" at x1).
void check_training_sizes(const train::TrainConfig& t, const std::string& width_flags, int64_t runs_at_once) {
  const auto& b = t.base;
  const auto text = [](int64_t v) { return std::to_string(v); };
  std::string model_flags = "--layers " + text(b.num_layers) + " --d-model " + text(b.d_model);
  if (!width_flags.empty()) model_flags += " " + width_flags;
  model_flags += " --heads " + text(b.num_heads) + " --head-dim " + text(b.head_dim);
  if (b.attention == train::AttentionKind::mla)
    model_flags += " --q-rank " + text(b.q_rank) + " --kv-rank " + text(b.kv_rank);
  model_flags += " --experts " + text(b.num_experts) + " --expert-intermediate " + text(b.expert_intermediate) +
                 " --dense-intermediate " + text(b.dense_intermediate);
  if (b.shared_intermediate > 0) model_flags += " --shared " + text(b.shared_intermediate);
  const std::string step_flags = "--batch " + text(t.batch) + " --seq " + text(t.seq);
  const auto values = train::training_values(t.model, t.batch, t.seq);
  const double tokens = double(t.batch) * double(t.seq);
  // fp32 weights, gradients and AdamW's two moments.
  const double model_bytes = 16 * values.parameters;
  // A step's token ids and targets (int32), and on the CPU the activations kept for backward
  // (fp32; a GPU keeps them in its own memory).
  const double step_bytes = 8 * tokens + (t.backend == Backend::cpu ? 4 * values.activations : 0);
  // Below 2^62 bytes every element count and byte offset derived from these sizes fits int64.
  constexpr double kMaxBytes = 0x1p62;
  require(model_bytes + 8 * tokens + 4 * values.activations < kMaxBytes, ErrorCode::invalid_argument,
          model_flags + " " + step_flags + ": the sizes these multiply into overflow 64-bit integers");
  require(double(t.schedule.total_steps) * tokens < kMaxBytes, ErrorCode::invalid_argument,
          "--steps " + text(t.schedule.total_steps) + " x " + step_flags +
              ": the run's token count overflows 64-bit integers");
  const double runs = double(runs_at_once);
  const std::string of_runs = runs_at_once > 1 ? " of " + text(runs_at_once) + " runs at once (see --workers)" : "";
  require_host_memory(runs * model_bytes, model_flags, "the model's weights, gradients and AdamW moments" + of_runs);
  require_host_memory(runs * (model_bytes + step_bytes), step_flags, "a training step of this model" + of_runs);
}

}  // namespace

CLI::Validator at_least(double min) {
  return number_check(">= " + number_text(min), [min](double v) { return v >= min; });
}
CLI::Validator greater_than(double min) {
  return number_check("> " + number_text(min), [min](double v) { return v > min; });
}
CLI::Validator at_most(double max) {
  return number_check("<= " + number_text(max), [max](double v) { return v <= max; });
}
CLI::Validator below(double max) {
  return number_check("< " + number_text(max), [max](double v) { return v < max; });
}

TrainCliOptions::TrainCliOptions() {
  base.d_model = 32;
  base.num_heads = 2;
  base.q_rank = base.kv_rank = 16;
  base.dense_intermediate = 64;
  base.num_experts = 4;
  train.batch = 4;
  train.seq = 32;
}

void add_train_options(CLI::App* cmd, TrainCliOptions& o, SharedOptions which) {
  auto& b = o.base;
  const auto one_or_more = at_least(1);
  cmd->add_option("--d-model", b.d_model, "base (x1) model width")->capture_default_str()->check(one_or_more);
  cmd->add_option("--heads", b.num_heads, "base attention heads")->capture_default_str()->check(one_or_more);
  cmd->add_option("--head-dim", b.head_dim, "head dimension (fixed as width grows)")
      ->capture_default_str()
      ->check(one_or_more);
  cmd->add_option("--attention", o.attention, "mla | mha")->capture_default_str()->check(CLI::IsMember({"mla", "mha"}));
  cmd->add_option("--q-rank", b.q_rank, "MLA query latent rank")->capture_default_str()->check(one_or_more);
  cmd->add_option("--kv-rank", b.kv_rank, "MLA key/value latent rank")->capture_default_str()->check(one_or_more);
  cmd->add_option("--layers", b.num_layers, "layers (the first has a dense FFN)")
      ->capture_default_str()
      ->check(one_or_more);
  cmd->add_option("--dense-intermediate", b.dense_intermediate, "dense FFN size of layer 0")
      ->capture_default_str()
      ->check(one_or_more);
  cmd->add_option("--experts", b.num_experts, "base routed experts")->capture_default_str()->check(one_or_more);
  cmd->add_option("--top-k", b.top_k, "experts per token")->capture_default_str()->check(one_or_more);
  cmd->add_option("--expert-intermediate", b.expert_intermediate, "expert FFN size")
      ->capture_default_str()
      ->check(one_or_more);
  cmd->add_option("--shared", b.shared_intermediate, "shared expert size (0 = none)")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--z-loss", b.z_loss_coef, "router z-loss coefficient")->capture_default_str()->check(at_least(0));
  cmd->add_option("--param", o.parameterization, "sp | mup")->capture_default_str()->check(CLI::IsMember({"sp", "mup"}));
  if (which.lr)
    cmd->add_option("--lr", o.train.adam.lr, "peak learning rate")->capture_default_str()->check(greater_than(0));
  cmd->add_option("--weight-decay", o.train.adam.weight_decay, "decoupled weight decay")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--clip", o.train.adam.clip_norm, "max gradient norm (0 = off)")
      ->capture_default_str()
      ->check(at_least(0));
  if (which.steps)
    cmd->add_option("--steps", o.steps, "optimizer steps")
        ->capture_default_str()
        ->check(one_or_more)
        ->check(at_most(double(kMaxSteps)));
  cmd->add_option("--warmup", o.warmup, "warmup steps")->capture_default_str()->check(at_least(0));
  cmd->add_option("--schedule", o.schedule, "constant | wsd | cosine")
      ->capture_default_str()
      ->check(CLI::IsMember({"constant", "wsd", "cosine"}));
  cmd->add_option("--decay-fraction", o.train.schedule.decay_fraction, "WSD: share of steps decaying")
      ->capture_default_str()
      ->check(at_least(0))
      ->check(at_most(1));
  cmd->add_option("--min-lr-ratio", o.train.schedule.min_ratio, "final LR / peak LR")
      ->capture_default_str()
      ->check(at_least(0))
      ->check(at_most(1));
  cmd->add_option("--batch", o.train.batch, "sequences per step")->capture_default_str()->check(one_or_more);
  cmd->add_option("--seq", o.train.seq, "tokens per sequence")->capture_default_str()->check(one_or_more);
  cmd->add_option("--bias-rate", o.train.bias_update_rate, "aux-loss-free balancing rate")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--ema", o.train.ema_decay, "EMA decay of the weights (0 = off)")
      ->capture_default_str()
      ->check(at_least(0))
      ->check(below(1));
  cmd->add_option("--seed", o.train.seed, "init and data seed")->capture_default_str();
  cmd->add_option("--threads", o.train.threads, "CPU threads per run")->capture_default_str()->check(one_or_more);
  cmd->add_option("--backend", o.backend, "cpu | cuda")->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--cuda-graph", o.cuda_graph,
                  "on: with --backend cuda, capture the training step in one CUDA graph and replay it (the same bits "
                  "as off)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_option("--attention-kernel", o.attention_kernel,
                  "with --backend cuda: fused (FlashAttention-style on tensor cores, head_dim up to 128) | reference "
                  "(fp32, the seq x seq probabilities kept)")
      ->capture_default_str()
      ->check(CLI::IsMember({"fused", "reference"}));
  cmd->add_option("--matmul", o.matmul,
                  "with --backend cuda: the projections' and LM head's tensor-core precision, tf32 | bf16 (fp32 "
                  "weights, activations and accumulation either way)")
      ->capture_default_str()
      ->check(CLI::IsMember({"tf32", "bf16"}));
  cmd->add_option("--precision", o.precision,
                  "the MoE layers' expert GEMMs: bf16 (the backend's own format: fp32 on the CPU) | fp8 (DeepSeek-V3's "
                  "recipe, docs/FP8.md; --backend cpu only, which emulates it exactly)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--data", o.data_dir, "fortune text folder (default: $MOKA_TEXT_DIR or the fortunes package)");
  cmd->add_option("--max-bytes", o.max_bytes, "load only this much text (0 = all)")
      ->capture_default_str()
      ->check(at_least(0));
}

void check_validation_memory(const train::TrainConfig& t, int64_t eval_batches, int64_t runs_at_once) {
  // Token ids and targets, int32 each.
  const double bytes = double(runs_at_once) * double(eval_batches) * double(t.batch) * double(t.seq) * 8;
  const std::string of_runs =
      runs_at_once > 1 ? " of " + std::to_string(runs_at_once) + " runs at once (see --workers)" : "";
  require_host_memory(bytes,
                      "--eval-batches " + std::to_string(eval_batches) + " --batch " + std::to_string(t.batch) +
                          " --seq " + std::to_string(t.seq),
                      "the validation batches" + of_runs);
}

void check_run_count(int64_t runs, const std::string& product) {
  require(runs <= kMaxRuns, ErrorCode::invalid_argument,
          product + " = " + std::to_string(runs) + " training runs, more than the " + std::to_string(kMaxRuns) +
              " a sweep takes");
}

train::TrainConfig TrainCliOptions::resolve(int64_t multiplier) {
  auto t = resolve_unchecked(multiplier);
  check_training_sizes(t, multiplier > 1 ? "--width-mult " + std::to_string(multiplier) : "", 1);
  return t;
}

train::TrainConfig TrainCliOptions::resolve_widths(const std::vector<int64_t>& multipliers, int64_t runs_at_once) {
  const int64_t widest = *std::max_element(multipliers.begin(), multipliers.end());
  const std::string width_flags = widest > 1 ? "--mults x" + std::to_string(widest) : "";
  check_training_sizes(resolve_unchecked(widest), width_flags, runs_at_once);
  return resolve_unchecked(1);
}

train::TrainConfig TrainCliOptions::resolve_unchecked(int64_t multiplier) {
  require(base.top_k <= base.num_experts, ErrorCode::invalid_argument,
          "--top-k " + std::to_string(base.top_k) + " exceeds --experts " + std::to_string(base.num_experts));
  train::TrainConfig t = train;
  t.backend = parse_backend(backend);
  t.cuda_graph = cuda_graph == "on";
  t.fused_attention = attention_kernel == "fused";
  t.bf16_matmuls = matmul == "bf16";
  t.moe_precision = parse_precision(precision);
  t.base = base;
  t.base.attention = attention == "mla" ? train::AttentionKind::mla : train::AttentionKind::mha;
  t.model = train::scale_width(t.base, multiplier);
  t.parameterization = train::parse_parameterization(parameterization);
  t.schedule.kind = train::parse_schedule(schedule);
  t.schedule.total_steps = steps;
  t.schedule.warmup_steps = warmup;
  return t;
}

train::TextSplit TrainCliOptions::load_text() const {
  auto text = train::load_fortune_corpus(data_dir.empty() ? train::default_text_dir() : data_dir, max_bytes);
  const auto shortest = int64_t(std::min(text.train.size(), text.validation.size()));
  require(shortest > train.seq + 1, ErrorCode::invalid_argument,
          "--seq " + std::to_string(train.seq) + " needs more text than the " + std::to_string(text.train.size()) +
              " train / " + std::to_string(text.validation.size()) +
              " validation bytes loaded (see --max-bytes, --data)");
  return text;
}

void check_plotter(const std::string& png) {
  check_output_path("--plot", png);
  require(run_program({python(), plot_script(), "check"}) == 0, ErrorCode::invalid_argument,
          std::string("--plot needs ") + python() +
              " with matplotlib (Debian: apt install python3-matplotlib, as scripts/setup.sh does; MOKA_PYTHON "
              "names another python); --plot '' skips the plot");
}

void draw_plot(const std::string& kind, const std::string& csv, const std::string& png) {
  const int status = run_program({python(), plot_script(), kind, csv, png});
  require(status == 0, ErrorCode::io,
          "plotting " + png + " failed: plot_mup.py exited with status " + std::to_string(status) +
              " (the data is in " + csv + ")");
}

std::vector<int64_t> parse_positive_list(const std::string& option, const std::string& list) {
  std::vector<int64_t> out;
  if (list.empty()) return out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    int64_t m = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), m);
    require(ec == std::errc() && end == item.data() + item.size() && m >= 1, ErrorCode::invalid_argument,
            option + ": '" + item + "' is not a positive integer (the list looks like 1,2,4,8)");
    out.push_back(m);
  }
  return out;
}

std::vector<int64_t> parse_multipliers(const std::string& list) {
  auto out = parse_positive_list("--mults", list);
  require(!out.empty(), ErrorCode::invalid_argument, "--mults is empty");
  return out;
}

std::vector<double> SweepCliOptions::lrs() const {
  require(lr_max > lr_min, ErrorCode::invalid_argument, "--lr-min must be below --lr-max");
  std::vector<double> out;
  for (int i = 0; i < lr_points; ++i)
    out.push_back(lr_min * std::pow(lr_max / lr_min, double(i) / double(lr_points - 1)));
  return out;
}

int SweepCliOptions::resolved_workers(Backend backend) const {
  if (workers > 0) return workers;
  return backend == Backend::cuda ? 4 : int(std::max(1u, std::thread::hardware_concurrency()));
}

void add_sweep_options(CLI::App* cmd, SweepCliOptions& o) {
  cmd->add_option("--lr-min", o.lr_min, "smallest LR of the log grid")->capture_default_str()->check(greater_than(0));
  cmd->add_option("--lr-max", o.lr_max, "largest LR of the log grid")->capture_default_str()->check(greater_than(0));
  cmd->add_option("--lr-points", o.lr_points, "LRs in the grid")
      ->capture_default_str()
      ->check(at_least(2))
      ->check(at_most(double(SweepCliOptions::kMaxGridAxis)));
  cmd->add_option("--seeds", o.seeds,
                  "runs per grid point (seeds --seed, --seed + 1, ...); spreads over seeds are reported")
      ->capture_default_str()
      ->check(at_least(1))
      ->check(at_most(double(SweepCliOptions::kMaxGridAxis)));
  cmd->add_option("--workers", o.workers,
                  "runs at once: CPU threads, or GPU processes with --backend cuda (0 = one per hardware thread on "
                  "the CPU, 4 on the GPU)")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--eval-batches", o.eval_batches, "validation batches per evaluation")
      ->capture_default_str()
      ->check(at_least(1));
}

nlohmann::json spread_json(const train::Spread& s) {
  return {{"mean", s.mean}, {"std", s.std}, {"min", s.min}, {"max", s.max}, {"count", s.count}};
}

void write_json(const std::string& path, const nlohmann::json& doc) {
  core::write_file_atomically(path, doc.dump(2) + "\n");
}

}  // namespace moka::cli
