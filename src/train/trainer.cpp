#include "train/trainer.hpp"

#include <algorithm>

#include "train/checkpoint.hpp"

namespace moka::train {

void require_training_backend(Backend backend) {
  require(backend == Backend::cpu, ErrorCode::backend_unavailable,
          std::string("training on the ") + to_string(backend) +
              " backend is not available yet (the CUDA training path is in progress); use --backend cpu");
}

Trainer::Trainer(const TrainConfig& config, const TextSplit& text)
    : config_(config),
      text_(text),
      model_(config.model, parameterize(config.base, config.model, config.parameterization),
             ModelOptions{config.backend, config.threads}),
      adam_(config.adam, model_.params()) {
  require_training_backend(config.backend);
  model_.params().initialize(config.seed);
  if (config.ema_decay > 0) ema_.emplace(config.ema_decay, model_.params());
}

StepReport Trainer::step(ActivationStats* stats) {
  StepReport r;
  r.step = steps_done();
  const Batch batch = sample_batch(text_.train, config_.batch, config_.seq, config_.seed, r.step);
  r.tokens = batch.tokens();
  r.loss = model_.forward(batch, stats);
  r.cross_entropy = model_.last_cross_entropy();
  model_.backward();
  const double factor = config_.schedule.factor(r.step);
  r.lr = config_.adam.lr * factor;
  r.grad_norm = adam_.step(model_.params(), factor);
  for (const auto& counts : model_.expert_counts())
    r.load_max_over_mean = std::max(r.load_max_over_mean, load_stats(counts).max_over_mean);
  if (config_.bias_update_rate > 0) model_.update_selection_biases(config_.bias_update_rate);
  if (ema_) ema_->update(model_.params());
  return r;
}

double Trainer::evaluate(int batches, bool use_ema) {
  require(!use_ema || ema_, ErrorCode::invalid_argument, "evaluation with EMA weights needs --ema-decay > 0");
  if (use_ema) ema_->swap_with(model_.params());
  double total = 0;
  // A seed of its own, so validation batches do not depend on how far training went.
  for (int i = 0; i < batches; ++i) {
    model_.forward(sample_batch(text_.validation, config_.batch, config_.seq, config_.seed + 0x5EED, i));
    total += model_.last_cross_entropy();
  }
  if (use_ema) ema_->swap_with(model_.params());
  return batches > 0 ? total / batches : 0.0;
}

void Trainer::save(const std::string& path) const {
  SafetensorsFile file;
  for (size_t i = 0; i < model_.params().size(); ++i) {
    const auto& p = model_.params()[i];
    const auto& shape = p.rule.spec.shape;
    file.put(p.name(), p.value, shape);
    file.put("adam_m/" + p.name(), adam_.m[i], shape);
    file.put("adam_v/" + p.name(), adam_.v[i], shape);
    if (ema_) file.put("ema/" + p.name(), ema_->shadow[i], shape);
  }
  const auto& biases = model_.selection_biases();
  for (size_t l = 0; l < biases.size(); ++l)
    file.put("router_bias/" + std::to_string(l), biases[l], {int64_t(biases[l].size())});
  file.metadata["format"] = "moka-train-checkpoint-1";
  file.metadata["step"] = std::to_string(steps_done());
  file.metadata["parameterization"] = to_string(config_.parameterization);
  file.metadata["d_model"] = std::to_string(config_.model.d_model);
  write_safetensors(path, file);
}

void Trainer::load(const std::string& path) {
  const auto file = read_safetensors(path);
  require(file.metadata.count("step") == 1, ErrorCode::io, path + " is not a moka training checkpoint");
  for (size_t i = 0; i < model_.params().size(); ++i) {
    auto& p = model_.params()[i];
    auto restore = [&](const std::string& name, std::vector<float>& dst) {
      auto values = file.get(name).as<float>();
      require(values.size() == dst.size(), ErrorCode::shape_mismatch, path + ": " + name + " has another shape");
      dst = std::move(values);
    };
    restore(p.name(), p.value);
    restore("adam_m/" + p.name(), adam_.m[i]);
    restore("adam_v/" + p.name(), adam_.v[i]);
    if (ema_) restore("ema/" + p.name(), ema_->shadow[i]);
  }
  auto& biases = model_.selection_biases();
  for (size_t l = 0; l < biases.size(); ++l) {
    auto values = file.get("router_bias/" + std::to_string(l)).as<double>();
    require(values.size() == biases[l].size(), ErrorCode::shape_mismatch, path + ": router biases differ in size");
    biases[l] = std::move(values);
  }
  adam_.steps_taken = std::stoll(file.metadata.at("step"));
}

}  // namespace moka::train
