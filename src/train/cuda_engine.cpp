// CudaEngine's methods: the TrainEngine interface and the GPU tests' hooks, over the engine's
// Impl (cuda/engine_impl.hpp, which lists the files that define its stages).
#include "train/cuda_engine.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "cuda/common/check.hpp"
#include "train/cuda/engine_impl.hpp"

namespace moka::train {
namespace {

float bf16_to_float(bf16 b) {
  uint16_t bits;
  std::memcpy(&bits, &b, 2);
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

}  // namespace

CudaEngine::CudaEngine(const TrainConfig& config, const std::vector<TensorRule>& rules)
    : impl_(std::make_unique<Impl>(config, rules)) {}

CudaEngine::~CudaEngine() = default;

void CudaEngine::step(const Batch& batch, double lr_factor, ActivationStats* stats, bool read_metrics, StepReport& r) {
  impl_->run_step(batch, lr_factor, stats, read_metrics, r);
}

double CudaEngine::evaluate(const std::vector<Batch>& batches, bool use_ema) {
  auto& I = *impl_;
  if (use_ema) I.swap_ema();
  double total = 0;
  for (const auto& b : batches) {
    I.stage_inputs(b);
    I.forward(nullptr);
    I.release_contexts();
    total += I.read_scalar(0);
  }
  if (use_ema) I.swap_ema();
  return batches.empty() ? 0.0 : total / double(batches.size());
}

TrainState CudaEngine::state() const {
  const auto& I = *impl_;
  TrainState s;
  for (const auto& p : I.params) {
    s.values.push_back(p.value.download(I.stream));
    s.adam_m.push_back(p.m.download(I.stream));
    s.adam_v.push_back(p.v.download(I.stream));
    if (!p.ema.empty()) s.ema.push_back(p.ema.download(I.stream));
  }
  for (const auto& L : I.layers)
    if (L.is_moe) s.selection_biases.push_back(L.bias64.download(I.stream));
  s.steps = I.steps_taken;
  return s;
}

void CudaEngine::set_state(const TrainState& s) {
  auto& I = *impl_;
  for (size_t i = 0; i < I.params.size(); ++i) {
    auto& p = I.params[i];
    p.value.upload(s.values[i].data(), p.n, I.stream);
    p.m.upload(s.adam_m[i].data(), p.n, I.stream);
    p.v.upload(s.adam_v[i].data(), p.n, I.stream);
    if (!p.ema.empty()) p.ema.upload(s.ema[i].data(), p.n, I.stream);
  }
  I.refresh_shadows();
  for (auto& L : I.layers)
    if (L.is_moe) {
      const auto& bias = s.selection_biases[L.moe_index];
      const std::vector<float> bias32(bias.begin(), bias.end());
      L.bias64.upload(bias, I.stream);
      L.bias.upload(bias32, I.stream);
    }
  I.steps_taken = s.steps;
}

double CudaEngine::forward_backward(const Batch& batch, double* cross_entropy) {
  auto& I = *impl_;
  I.stage_inputs(batch);
  I.forward(nullptr);
  I.backward();
  I.release_contexts();
  const double ce = I.read_scalar(0);
  if (cross_entropy) *cross_entropy = ce;
  return ce + I.router_losses();
}

StepProfile CudaEngine::profile() const { return impl_->profile; }

std::vector<std::vector<float>> CudaEngine::gradients() const {
  std::vector<std::vector<float>> out;
  for (const auto& p : impl_->params) {
    if (!p.bf16_grad()) {
      out.push_back(p.grad.download(impl_->stream));
      continue;
    }
    const auto g16 = p.grad16.download(impl_->stream);
    std::vector<float> g(g16.size());
    std::transform(g16.begin(), g16.end(), g.begin(), bf16_to_float);
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<std::vector<int32_t>> CudaEngine::routed_experts() const {
  std::vector<std::vector<int32_t>> out;
  for (const auto& L : impl_->layers)
    if (L.is_moe) out.push_back(L.topk_ids.download(impl_->stream));
  return out;
}

void CudaEngine::poison_gradients() {
  // All-ones bytes are a NaN in both f32 and bf16.
  for (auto& p : impl_->params) {
    if (p.bf16_grad()) MOKA_CUDA_CHECK(cudaMemset(p.grad16.data(), 0xFF, p.n * sizeof(bf16)));
    else MOKA_CUDA_CHECK(cudaMemset(p.grad.data(), 0xFF, p.n * sizeof(float)));
  }
}

std::unique_ptr<TrainEngine> make_cuda_engine(const TrainConfig& config, const std::vector<TensorRule>& rules) {
  return std::make_unique<CudaEngine>(config, rules);
}

}  // namespace moka::train
