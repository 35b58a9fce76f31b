// The training loop: batches from the text, forward/backward, AdamW under an LR schedule,
// aux-loss-free router balancing, EMA of the weights, validation, and checkpoints that resume
// bit-exactly (weights, optimizer moments, EMA, router biases and the step are all saved; the
// data order depends only on the seed and the step).
#pragma once
#include <memory>
#include <optional>
#include <string>

#include "train/model.hpp"
#include "train/optimizer.hpp"
#include "train/text_data.hpp"

namespace moka::train {

struct TrainConfig {
  ModelConfig base;   // the width the hyperparameters were tuned at (muP's reference)
  ModelConfig model;  // the model trained
  Parameterization parameterization = Parameterization::mup;
  AdamWConfig adam;
  LrSchedule schedule;
  int64_t batch = 8, seq = 64;
  uint64_t seed = 1;
  int threads = 1;
  Backend backend = Backend::cpu;
  double bias_update_rate = 1e-3;  // aux-loss-free balancing step; 0 = off
  double ema_decay = 0.0;          // 0 = no EMA
};

struct StepReport {
  int64_t step = 0;  // the step just taken, from 0
  double loss = 0, cross_entropy = 0, grad_norm = 0, lr = 0;
  double load_max_over_mean = 0;  // busiest expert over the mean, worst MoE layer
  int64_t tokens = 0;
};

class Trainer {
 public:
  // `text` must outlive the trainer.
  Trainer(const TrainConfig& config, const TextSplit& text);

  // One optimizer step. With `stats`, records the activations of this step's forward (before
  // the update), as the coordinate check needs.
  StepReport step(ActivationStats* stats = nullptr);
  // Mean cross-entropy over `batches` validation batches, with the EMA weights when asked.
  double evaluate(int batches, bool use_ema = false);

  void save(const std::string& path) const;
  void load(const std::string& path);

  int64_t steps_done() const { return adam_.steps_taken; }
  Model<float>& model() { return model_; }
  const TrainConfig& config() const { return config_; }

 private:
  TrainConfig config_;
  const TextSplit& text_;
  Model<float> model_;
  AdamW adam_;
  std::optional<WeightEma> ema_;
};

// Refuses backends the trainer cannot use yet (the dense parts are CPU code for now).
void require_training_backend(Backend backend);

}  // namespace moka::train
