// `moka train`: trains the MoE language model on the fortunes text with a progress line (loss,
// tokens/s, expert load balance, read every --log-every steps: reading waits for the GPU),
// periodic validation, and safetensors checkpoints (at the end, every --save-every steps, and
// when SIGINT or SIGTERM stops the run). --profile prints where a step's time goes.
#include <signal.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <utility>

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
  int64_t save_every = 0;
  int64_t log_every = 10;
  bool profile = false;
  std::string save, resume;
};

volatile std::sig_atomic_t stop_signal = 0;

extern "C" void request_stop(int signal) { stop_signal = signal; }

// While alive, SIGINT and SIGTERM ask the training loop to stop at the next step boundary (and
// save); the handler then resets, so a second signal ends the process at once. A signal the
// process was started ignoring (nohup, a background job's SIGINT) stays ignored.
class StopOnSignal {
 public:
  StopOnSignal() {
    stop_signal = 0;
    struct sigaction action {};
    action.sa_handler = request_stop;
    action.sa_flags = SA_RESETHAND;
    sigemptyset(&action.sa_mask);
    for (auto [signal, previous] : {std::pair{SIGINT, &previous_int_}, std::pair{SIGTERM, &previous_term_}}) {
      ::sigaction(signal, nullptr, previous);
      if (previous->sa_handler != SIG_IGN) ::sigaction(signal, &action, nullptr);
    }
  }
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;
  ~StopOnSignal() {
    ::sigaction(SIGINT, &previous_int_, nullptr);
    ::sigaction(SIGTERM, &previous_term_, nullptr);
  }
  int signal() const { return stop_signal; }

 private:
  struct sigaction previous_int_ {
  }, previous_term_{};
};

std::string progress_text(const train::StepReport& r, double tokens_per_s) {
  char line[160];
  std::snprintf(line, sizeof line, "loss %.4f | lr %.2e | %.0f tok/s | expert load max/mean %.2f", r.cross_entropy,
                r.lr, tokens_per_s, r.load_max_over_mean);
  return line;
}

void run(TrainCommand& c) {
  if (!c.save.empty()) check_output_path("--save", c.save);
  require(c.resume.empty() || std::filesystem::is_regular_file(c.resume), ErrorCode::invalid_argument,
          "--resume " + c.resume + ": no such file");
  auto config = c.options.resolve(c.width_mult);
  check_validation_memory(config, c.eval_batches, 1);
  config.profile = c.profile;
  const auto text = c.options.load_text();
  train::Trainer trainer(config, text);
  const int64_t total = config.schedule.total_steps;
  if (!c.resume.empty()) {
    trainer.load(c.resume);
    require(trainer.steps_done() <= total, ErrorCode::invalid_argument,
            "--resume " + c.resume + " is at step " + std::to_string(trainer.steps_done()) + ", past --steps " +
                std::to_string(total));
  }
  auto save = [&] {
    trainer.save(c.save);
    std::cout << "saved " << c.save << " at step " << trainer.steps_done() << std::endl;
  };
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
  const StopOnSignal stop;
  train::StepReport last;  // the last step whose numbers were read
  while (trainer.steps_done() < total) {
    const int64_t step = trainer.steps_done() + 1;
    const bool evaluating = c.eval_every > 0 && (step % c.eval_every == 0 || step == total);
    // Read at the first step, at the throughput clock's start, every --log-every steps and before
    // validating or stopping.
    const bool read = step == 1 || step == kWarmupSteps || step % c.log_every == 0 || step == total || evaluating;
    const auto r = trainer.step(nullptr, read);
    if (!std::isnan(r.loss)) last = r;
    if (stop.signal()) {
      progress.finish();
      if (!c.save.empty()) save();
      // One write (launched workers share stderr), then the exit code a shell gives a process the
      // signal ended: 128 + signal. CLI::RuntimeError carries it out of the parse without a message.
      std::cerr << std::string("moka: training stopped by ") + (stop.signal() == SIGINT ? "SIGINT" : "SIGTERM") +
                       " after step " + std::to_string(r.step + 1) +
                       (c.save.empty() ? " (no --save: nothing saved)" : "; --resume " + c.save + " continues it") +
                       "\n";
      throw CLI::RuntimeError(128 + stop.signal());
    }
    tokens += r.tokens;
    if (r.step + 1 == kWarmupSteps) steady_start = clock::now();
    if (r.step + 1 > kWarmupSteps) steady_tokens += r.tokens;
    const double seconds = std::chrono::duration<double>(clock::now() - start).count();
    progress.update(progress_text(last, double(tokens) / seconds), int(r.step + 1), int(total));  // <= kMaxSteps
    if (evaluating) {
      progress.finish();
      const auto eval_start = clock::now();
      // Evaluated before printing: a diverged run's error does not cut into a half-printed line.
      const double validation = trainer.evaluate(c.eval_batches);
      const double ema_validation = config.ema_decay > 0 ? trainer.evaluate(c.eval_batches, true) : NAN;
      std::cout << "step " << r.step + 1 << ": train loss " << r.cross_entropy << ", validation loss " << validation;
      if (config.ema_decay > 0) std::cout << ", EMA validation loss " << ema_validation;
      std::cout << std::endl;
      if (r.step + 1 > kWarmupSteps) eval_seconds += std::chrono::duration<double>(clock::now() - eval_start).count();
    }
    if (c.save_every > 0 && (r.step + 1) % c.save_every == 0 && r.step + 1 < total) {
      progress.finish();
      save();
    }
  }
  progress.finish();
  if (steady_tokens > 0) {
    const double seconds = std::chrono::duration<double>(clock::now() - steady_start).count() - eval_seconds;
    std::printf("throughput: %.0f tokens/s (steps %lld-%lld, %s backend%s, validation excluded%s)\n",
                double(steady_tokens) / seconds, (long long)kWarmupSteps + 1, (long long)total,
                to_string(config.backend),
                config.backend == Backend::cuda ? (config.cuda_graph ? ", CUDA graph" : ", eager") : "",
                c.profile && config.backend == Backend::cuda ? "; profiled: each step waited for" : "");
  }
  if (c.profile) {
    const auto profile = trainer.profile();
    std::cout << profile.table() << "profile json: " << profile.to_json().dump() << std::endl;
  }
  if (!c.save.empty()) save();
}

}  // namespace

void register_train(CLI::App& app) {
  auto c = std::make_shared<TrainCommand>();
  auto* cmd = app.add_subcommand("train", "Train the MoE language model on the fortunes text");
  add_train_options(cmd, c->options);
  cmd->add_option("--width-mult", c->width_mult, "train the base model widened this many times")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_option("--eval-every", c->eval_every, "validate every N steps (0 = never)")
      ->capture_default_str()
      ->check(at_least(0));
  cmd->add_option("--eval-batches", c->eval_batches, "validation batches")->capture_default_str()->check(at_least(1));
  auto* save = cmd->add_option("--save", c->save,
                               "write a safetensors checkpoint at the end, and on SIGINT/SIGTERM before exiting");
  cmd->add_option("--save-every", c->save_every, "also save every N steps (0 = only at the end)")
      ->capture_default_str()
      ->check(at_least(0))
      ->needs(save);
  cmd->add_option("--resume", c->resume, "continue from a checkpoint of the same model (bit-exact)");
  cmd->add_option("--log-every", c->log_every,
                  "read the loss for the progress line every N steps (reading waits for the GPU)")
      ->capture_default_str()
      ->check(at_least(1));
  cmd->add_flag("--profile", c->profile,
                "time every stage of each step (CUDA events on the GPU, which then waits for every step) and count "
                "kernel launches and host synchronizations; prints a table and a JSON line at the end");
  cmd->callback([c] { run(*c); });
}

}  // namespace moka::cli
