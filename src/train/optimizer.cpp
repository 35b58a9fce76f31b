#include "train/optimizer.hpp"

#include <cmath>
#include <numbers>

namespace moka::train {

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "constant") return ScheduleKind::constant;
  if (name == "wsd") return ScheduleKind::wsd;
  if (name == "cosine") return ScheduleKind::cosine;
  throw Error(ErrorCode::invalid_argument, "unknown LR schedule '" + name + "' (constant, wsd, cosine)");
}

double LrSchedule::factor(int64_t step) const {
  if (step < warmup_steps) return double(step + 1) / double(warmup_steps);
  const double after_warmup = double(step - warmup_steps);
  const double span = double(std::max<int64_t>(1, total_steps - warmup_steps));
  switch (kind) {
    case ScheduleKind::constant: return 1.0;
    case ScheduleKind::wsd: {
      const double decay_steps = std::max(1.0, decay_fraction * double(total_steps));
      const double into_decay = double(step) - (double(total_steps) - decay_steps);
      if (into_decay <= 0) return 1.0;
      return 1.0 - (1.0 - min_ratio) * std::min(1.0, into_decay / decay_steps);
    }
    case ScheduleKind::cosine: {
      const double progress = std::min(1.0, after_warmup / span);
      return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
    }
  }
  return 1.0;
}

double global_grad_norm(const ParamStore<float>& params) {
  double ss = 0;
  for (const auto& p : params)
    for (float g : p.grad) ss += double(g) * double(g);
  return std::sqrt(ss);
}

AdamW::AdamW(const AdamWConfig& config, const ParamStore<float>& params) : config_(config) {
  for (const auto& p : params) {
    m.emplace_back(p.value.size(), 0.0f);
    v.emplace_back(p.value.size(), 0.0f);
  }
}

double AdamW::step(ParamStore<float>& params, double lr_factor) {
  const double norm = global_grad_norm(params);
  const double clip = config_.clip_norm > 0 && norm > config_.clip_norm ? config_.clip_norm / norm : 1.0;
  ++steps_taken;
  const double c1 = 1.0 - std::pow(config_.beta1, double(steps_taken));
  const double c2 = 1.0 - std::pow(config_.beta2, double(steps_taken));
  const double lr = config_.lr * lr_factor;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    const float b1 = float(config_.beta1), b2 = float(config_.beta2);
    const float step_size = float(lr * p.rule.lr_multiplier);
    const float decay = float(1.0 - lr * config_.weight_decay * p.rule.weight_decay_multiplier);
    for (size_t j = 0; j < p.value.size(); ++j) {
      const float g = float(clip) * p.grad[j];
      m[i][j] = b1 * m[i][j] + (1 - b1) * g;
      v[i][j] = b2 * v[i][j] + (1 - b2) * g * g;
      const float m_hat = m[i][j] / float(c1), v_hat = v[i][j] / float(c2);
      p.value[j] = p.value[j] * decay - step_size * m_hat / (std::sqrt(v_hat) + float(config_.eps));
    }
  }
  return norm;
}

WeightEma::WeightEma(double decay, const ParamStore<float>& params) : decay_(decay) {
  for (const auto& p : params) shadow.push_back(p.value);
}

void WeightEma::update(const ParamStore<float>& params) {
  const float d = float(decay_);
  for (size_t i = 0; i < params.size(); ++i)
    for (size_t j = 0; j < shadow[i].size(); ++j) shadow[i][j] = d * shadow[i][j] + (1 - d) * params[i].value[j];
}

void WeightEma::swap_with(ParamStore<float>& params) {
  for (size_t i = 0; i < params.size(); ++i) std::swap(shadow[i], params[i].value);
}

}  // namespace moka::train
