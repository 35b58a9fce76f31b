// `moka train`: trains the MoE language model on the fortunes text with a progress line (loss,
// tokens/s, expert load balance), periodic validation, and safetensors checkpoints.
#include <chrono>
#include <cstdio>
#include <iostream>

#include "bench_report.hpp"
#include "commands.hpp"
#include "train_options.hpp"

namespace moka::cli {
namespace {

struct TrainCommand {
  TrainCliOptions options;
  int64_t width_mult = 1;
  int64_t eval_every = 50;
  int eval_batches = 8;
  std::string save, resume;
};

std::string progress_text(const train::StepReport& r, double tokens_per_s) {
  char line[160];
  std::snprintf(line, sizeof line, "loss %.4f | lr %.2e | %.0f tok/s | expert load max/mean %.2f", r.cross_entropy,
                r.lr, tokens_per_s, r.load_max_over_mean);
  return line;
}

void run(TrainCommand& c) {
  const auto config = c.options.resolve(c.width_mult);
  const auto text = c.options.load_text();
  train::Trainer trainer(config, text);
  if (!c.resume.empty()) trainer.load(c.resume);
  std::cout << "moka train: d_model " << config.model.d_model << ", " << config.model.num_experts << " experts, "
            << to_string(config.parameterization) << ", " << text.train.size() << " train / " << text.validation.size()
            << " validation bytes\n";
  Progress progress("train");
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  // Throughput counts from the end of step kWarmupSteps: the first steps allocate workspaces.
  constexpr int64_t kWarmupSteps = 5;
  auto steady_start = start;
  int64_t tokens = 0, steady_tokens = 0;
  double eval_seconds = 0;
  const int64_t total = config.schedule.total_steps;
  while (trainer.steps_done() < total) {
    const auto r = trainer.step();
    tokens += r.tokens;
    if (r.step + 1 == kWarmupSteps) steady_start = clock::now();
    if (r.step + 1 > kWarmupSteps) steady_tokens += r.tokens;
    const double seconds = std::chrono::duration<double>(clock::now() - start).count();
    progress.update(progress_text(r, double(tokens) / seconds), int(r.step + 1), int(total));
    if (c.eval_every > 0 && ((r.step + 1) % c.eval_every == 0 || r.step + 1 == total)) {
      progress.finish();
      const auto eval_start = clock::now();
      std::cout << "step " << r.step + 1 << ": train loss " << r.cross_entropy << ", validation loss "
                << trainer.evaluate(c.eval_batches);
      if (config.ema_decay > 0) std::cout << ", EMA validation loss " << trainer.evaluate(c.eval_batches, true);
      std::cout << std::endl;
      if (r.step + 1 > kWarmupSteps) eval_seconds += std::chrono::duration<double>(clock::now() - eval_start).count();
    }
  }
  progress.finish();
  if (steady_tokens > 0) {
    const double seconds = std::chrono::duration<double>(clock::now() - steady_start).count() - eval_seconds;
    std::printf("throughput: %.0f tokens/s (steps %lld-%lld, %s backend, validation excluded)\n",
                double(steady_tokens) / seconds, (long long)kWarmupSteps + 1, (long long)total,
                to_string(config.backend));
  }
  if (!c.save.empty()) {
    trainer.save(c.save);
    std::cout << "saved " << c.save << "\n";
  }
}

}  // namespace

void register_train(CLI::App& app) {
  auto c = std::make_shared<TrainCommand>();
  auto* cmd = app.add_subcommand("train", "Train the MoE language model on the fortunes text");
  add_train_options(cmd, c->options);
  cmd->add_option("--width-mult", c->width_mult, "train the base model widened this many times")
      ->capture_default_str();
  cmd->add_option("--eval-every", c->eval_every, "validate every N steps (0 = only never)")->capture_default_str();
  cmd->add_option("--eval-batches", c->eval_batches, "validation batches")->capture_default_str();
  cmd->add_option("--save", c->save, "write a safetensors checkpoint at the end");
  cmd->add_option("--resume", c->resume, "continue from a checkpoint (bit-exact)");
  cmd->callback([c] { run(*c); });
}

}  // namespace moka::cli
