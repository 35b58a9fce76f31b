// AdamW with per-tensor LR and weight-decay multipliers, LR schedules, gradient clipping and an
// exponential moving average of the weights.
//
// Weight decay is decoupled from the gradient and from the per-tensor LR multiplier:
//   theta <- theta * (1 - lr_t * wd * wd_mult) - lr_t * lr_mult * m_hat / (sqrt(v_hat) + eps)
// where lr_t = peak LR x schedule. Under muP the hidden matrices' LR multiplier shrinks as 1/m;
// tying the decay to it (PyTorch's lr*wd) would make the decay timescale grow with width, so
// the decay per step lr_t*wd is the same for every tensor and width.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/params.hpp"

namespace moka::train {

enum class ScheduleKind : uint8_t { constant, wsd, cosine };
ScheduleKind parse_schedule(const std::string& name);  // "constant" | "wsd" | "cosine"

// Linear warmup, then: constant; warmup-stable-decay (flat, then linear to min_ratio over the
// last decay_fraction of the steps); or cosine down to min_ratio.
struct LrSchedule {
  ScheduleKind kind = ScheduleKind::wsd;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double decay_fraction = 0.2;
  double min_ratio = 0.0;
  double factor(int64_t step) const;  // step counts from 0
};

struct AdamWConfig {
  double lr = 1e-3;  // peak
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  double clip_norm = 0.0;  // max global gradient norm; 0 = no clipping
};

class AdamW {
 public:
  AdamW(const AdamWConfig& config, const ParamStore<float>& params);
  // Applies one update with peak LR x lr_factor; returns the gradient norm before clipping.
  double step(ParamStore<float>& params, double lr_factor);
  const AdamWConfig& config() const { return config_; }

  // State, exposed for checkpoints.
  int64_t steps_taken = 0;
  std::vector<std::vector<float>> m, v;

 private:
  AdamWConfig config_;
};

double global_grad_norm(const ParamStore<float>& params);

// shadow <- decay * shadow + (1 - decay) * theta after every step.
class WeightEma {
 public:
  WeightEma(double decay, const ParamStore<float>& params);
  void update(const ParamStore<float>& params);
  // Exchanges the live weights and the averages (call twice to restore).
  void swap_with(ParamStore<float>& params);
  double decay() const { return decay_; }
  std::vector<std::vector<float>> shadow;

 private:
  double decay_;
};

}  // namespace moka::train
