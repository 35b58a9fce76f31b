// The training loop: batches from the text, forward/backward, AdamW under an LR schedule,
// aux-loss-free router balancing, EMA of the weights, validation, and checkpoints that resume
// bit-exactly (weights, optimizer moments, EMA, router biases and the step are all saved; the
// data order depends only on the seed and the step). The model and optimizer run on an engine:
// the CPU one (`Model<float>` + `AdamW`, the reference) or the CUDA one (cuda_engine.hpp).
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
  // Seed of the validation batches; unset = `seed`. Runs that differ only in seed set it to one
  // value so they are compared on the same validation text.
  std::optional<uint64_t> validation_seed;
  // CUDA: replay each step as one captured CUDA graph (forward, backward, AdamW, EMA, router-bias
  // update) after a first eager step; the same bits as the eager step (tested on the H200).
  bool cuda_graph = true;
  // CUDA: attention through the fused kernels (no seq x seq matrix in memory, TF32 tensor cores)
  // where they take the head_dim; false: the straightforward fp32 kernels they are tested against.
  bool fused_attention = true;
  // CUDA: the projections and LM head multiply on bf16 tensor cores instead of TF32: cuBLAS reads
  // bf16 copies of the weights (refreshed by AdamW) and of each activation and gradient operand;
  // fp32 master weights, fp32 activations, gradients and accumulation.
  bool bf16_matmuls = false;
  // Time every stage of each step (StepProfile); on the GPU this waits for every step to finish.
  bool profile = false;
  // The number format of the MoE layers' expert GEMMs (LayerOptions::precision): bf16 = the
  // engine's own (f32 on the CPU, bf16 on the GPU); fp8 = DeepSeek-V3's recipe (docs/FP8.md),
  // which the CPU engine emulates exactly; the CUDA engine refuses it until the GPU layer has it.
  // The dense layers' FFNs, attention and the LM head keep the engine's format either way.
  Precision moe_precision = Precision::bf16;
};

struct StepReport {
  int64_t step = 0;  // the step just taken, from 0
  double loss = 0, cross_entropy = 0, grad_norm = 0, lr = 0;
  double load_max_over_mean = 0;  // busiest expert over the mean, worst MoE layer
  int64_t tokens = 0;
};

// Everything a checkpoint holds, as host copies in tensor_layout order: the engine-independent
// form, so a run saved on one backend resumes on the other.
struct TrainState {
  std::vector<std::vector<float>> values, adam_m, adam_v, ema;  // ema empty without EMA
  std::vector<std::vector<double>> selection_biases;            // per MoE layer [E]
  int64_t steps = 0;
};

// One backend's model, AdamW state and EMA.
class TrainEngine {
 public:
  virtual ~TrainEngine() = default;
  // Forward, backward, AdamW with peak LR x lr_factor, then the router-bias and EMA updates.
  // With `read_metrics`, fills loss, cross_entropy, grad_norm and load_max_over_mean (the GPU
  // then waits for the step); without, the GPU step runs on while the host goes on, and those
  // fields stay NaN. `stats` records this step's forward (before the update).
  virtual void step(const Batch& batch, double lr_factor, ActivationStats* stats, bool read_metrics,
                    StepReport& report) = 0;
  // Mean cross-entropy over the batches, with the EMA weights when asked.
  virtual double evaluate(const std::vector<Batch>& batches, bool use_ema) = 0;
  virtual TrainState state() const = 0;
  virtual void set_state(const TrainState& state) = 0;
  // The stages' times over the steps so far (TrainConfig::profile); empty steps otherwise.
  virtual StepProfile profile() const = 0;
};

// The CUDA engine; throws backend_unavailable when moka was built without CUDA or no GPU is
// visible. `rules` come from parameterize(); weights start from ParamStore::initialize(seed),
// the same values the CPU engine starts from.
std::unique_ptr<TrainEngine> make_cuda_engine(const TrainConfig& config, const std::vector<TensorRule>& rules);

class Trainer {
 public:
  // `text` must outlive the trainer.
  Trainer(const TrainConfig& config, const TextSplit& text);
  ~Trainer();

  // One optimizer step. With `stats`, records the activations of this step's forward (before
  // the update), as the coordinate check needs. Without `read_metrics` the report's loss,
  // gradient norm and load are NaN and the GPU is not waited for (TrainEngine::step).
  StepReport step(ActivationStats* stats = nullptr, bool read_metrics = true);
  // Mean cross-entropy over `batches` validation batches, with the EMA weights when asked.
  double evaluate(int batches, bool use_ema = false);

  // The checkpoint records the parameterization and both model configs; load() refuses a file
  // that disagrees with this trainer's config, naming the field.
  void save(const std::string& path) const;
  void load(const std::string& path);

  int64_t steps_done() const { return steps_; }
  TrainState state() const { return engine_->state(); }
  StepProfile profile() const { return engine_->profile(); }
  const TrainConfig& config() const { return config_; }
  const std::vector<TensorRule>& rules() const { return rules_; }

 private:
  TrainConfig config_;
  const TextSplit& text_;
  std::vector<TensorRule> rules_;
  std::unique_ptr<TrainEngine> engine_;
  int64_t steps_ = 0;
};

}  // namespace moka::train
