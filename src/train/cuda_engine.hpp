// The CUDA training engine: the model of model.hpp on one GPU. fp32 master weights, gradients,
// AdamW moments and EMA live on the device. Dense GEMMs (projections, LM head) are cuBLAS TF32
// (or bf16: TrainConfig::bf16_matmuls) with fp32 accumulation; attention (fused on TF32 tensor
// cores, or the fp32 reference), RMSNorm, embedding, cross-entropy and AdamW are the kernels of
// cuda/ops/; the FFNs and routers are moka's CUDA MoE layer and router (bf16 in and out,
// fed from bf16 copies of the master weights that the AdamW kernel refreshes). Everything runs on
// the engine's own stream (cuBLAS is set to it and the moka layers and routers are given it).
// A step waits for nothing: its inputs go through a pinned staging copy in one asynchronous
// transfer, the learning rate and bias corrections are read from device memory, the router-bias
// update runs on the device, and the loss, gradient norm and expert counts stay there until a
// step asks for them. So the whole step (forward, backward, AdamW with the EMA, router-bias
// update) can be captured in one CUDA graph and replayed (TrainConfig::cuda_graph).
#pragma once
#include <memory>
#include <vector>

#include "train/trainer.hpp"

namespace moka::train {

class CudaEngine final : public TrainEngine {
 public:
  CudaEngine(const TrainConfig& config, const std::vector<TensorRule>& rules);
  ~CudaEngine() override;

  void step(const Batch& batch, double lr_factor, ActivationStats* stats, bool read_metrics,
            StepReport& report) override;
  double evaluate(const std::vector<Batch>& batches, bool use_ema) override;
  TrainState state() const override;
  void set_state(const TrainState& state) override;
  StepProfile profile() const override;

  // For the GPU tests: forward and backward only (no update); returns the loss (cross-entropy
  // plus router losses) and writes the cross-entropy.
  double forward_backward(const Batch& batch, double* cross_entropy);
  // Host f32 copies of every gradient, in tensor_layout order.
  std::vector<std::vector<float>> gradients() const;
  // NaN into every gradient buffer, so a backward that misses an element shows.
  void poison_gradients();
  // Top-k expert ids [tokens * k] of each MoE layer in the last forward (as Model's).
  std::vector<std::vector<int32_t>> routed_experts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moka::train
