#include "train/trainer.hpp"

#include <algorithm>
#include <optional>

#include "train/checkpoint.hpp"

namespace moka::train {
namespace {

// The reference engine: Model<float> on the CPU backend, AdamW and the EMA on the host.
class CpuEngine final : public TrainEngine {
 public:
  CpuEngine(const TrainConfig& c, const std::vector<TensorRule>& rules)
      : config_(c), model_(c.model, rules, ModelOptions{Backend::cpu, c.threads}), adam_(c.adam, model_.params()) {
    model_.params().initialize(c.seed);
    if (c.ema_decay > 0) ema_.emplace(c.ema_decay, model_.params());
  }

  void step(const Batch& batch, double lr_factor, ActivationStats* stats, StepReport& r) override {
    r.loss = model_.forward(batch, stats);
    r.cross_entropy = model_.last_cross_entropy();
    model_.backward();
    r.grad_norm = adam_.step(model_.params(), lr_factor);
    for (const auto& counts : model_.expert_counts())
      r.load_max_over_mean = std::max(r.load_max_over_mean, load_stats(counts).max_over_mean);
    if (config_.bias_update_rate > 0) model_.update_selection_biases(config_.bias_update_rate);
    if (ema_) ema_->update(model_.params());
  }

  double evaluate(const std::vector<Batch>& batches, bool use_ema) override {
    if (use_ema) ema_->swap_with(model_.params());
    double total = 0;
    for (const auto& b : batches) {
      model_.forward(b);
      total += model_.last_cross_entropy();
    }
    if (use_ema) ema_->swap_with(model_.params());
    return batches.empty() ? 0.0 : total / double(batches.size());
  }

  TrainState state() const override {
    TrainState s;
    for (const auto& p : model_.params()) s.values.push_back(p.value);
    s.adam_m = adam_.m;
    s.adam_v = adam_.v;
    if (ema_) s.ema = ema_->shadow;
    s.selection_biases = model_.selection_biases();
    s.steps = adam_.steps_taken;
    return s;
  }

  void set_state(const TrainState& s) override {
    for (size_t i = 0; i < model_.params().size(); ++i) model_.params()[i].value = s.values[i];
    adam_.m = s.adam_m;
    adam_.v = s.adam_v;
    if (ema_) ema_->shadow = s.ema;
    model_.selection_biases() = s.selection_biases;
    adam_.steps_taken = s.steps;
  }

 private:
  TrainConfig config_;
  Model<float> model_;
  AdamW adam_;
  std::optional<WeightEma> ema_;
};

std::unique_ptr<TrainEngine> make_engine(const TrainConfig& c, const std::vector<TensorRule>& rules) {
  if (c.backend == Backend::cpu) return std::make_unique<CpuEngine>(c, rules);
  require(c.backend == Backend::cuda, ErrorCode::invalid_argument, "training runs on --backend cpu or cuda");
  return make_cuda_engine(c, rules);
}

}  // namespace

#if !MOKA_HAVE_CUDA
std::unique_ptr<TrainEngine> make_cuda_engine(const TrainConfig&, const std::vector<TensorRule>&) {
  throw Error(ErrorCode::backend_unavailable, "moka was built without CUDA: train with --backend cpu");
}
#endif

Trainer::Trainer(const TrainConfig& config, const TextSplit& text)
    : config_(config),
      text_(text),
      rules_(parameterize(config.base, config.model, config.parameterization)),
      engine_(make_engine(config, rules_)) {}

Trainer::~Trainer() = default;

StepReport Trainer::step(ActivationStats* stats) {
  StepReport r;
  r.step = steps_;
  const Batch batch = sample_batch(text_.train, config_.batch, config_.seq, config_.seed, r.step);
  r.tokens = batch.tokens();
  const double factor = config_.schedule.factor(r.step);
  r.lr = config_.adam.lr * factor;
  engine_->step(batch, factor, stats, r);
  ++steps_;
  return r;
}

double Trainer::evaluate(int batches, bool use_ema) {
  require(!use_ema || config_.ema_decay > 0, ErrorCode::invalid_argument,
          "evaluation with EMA weights needs --ema-decay > 0");
  // A seed of its own, so validation batches do not depend on how far training went.
  std::vector<Batch> data;
  for (int i = 0; i < batches; ++i)
    data.push_back(sample_batch(text_.validation, config_.batch, config_.seq, config_.seed + 0x5EED, i));
  return engine_->evaluate(data, use_ema);
}

void Trainer::save(const std::string& path) const {
  const TrainState s = engine_->state();
  SafetensorsFile file;
  for (size_t i = 0; i < rules_.size(); ++i) {
    const auto& name = rules_[i].spec.name;
    const auto& shape = rules_[i].spec.shape;
    file.put(name, s.values[i], shape);
    file.put("adam_m/" + name, s.adam_m[i], shape);
    file.put("adam_v/" + name, s.adam_v[i], shape);
    if (!s.ema.empty()) file.put("ema/" + name, s.ema[i], shape);
  }
  for (size_t l = 0; l < s.selection_biases.size(); ++l)
    file.put("router_bias/" + std::to_string(l), s.selection_biases[l], {int64_t(s.selection_biases[l].size())});
  file.metadata["format"] = "moka-train-checkpoint-1";
  file.metadata["step"] = std::to_string(s.steps);
  file.metadata["parameterization"] = to_string(config_.parameterization);
  file.metadata["d_model"] = std::to_string(config_.model.d_model);
  write_safetensors(path, file);
}

void Trainer::load(const std::string& path) {
  const auto file = read_safetensors(path);
  require(file.metadata.count("step") == 1, ErrorCode::io, path + " is not a moka training checkpoint");
  TrainState s = engine_->state();  // the current state gives every tensor's size
  auto restore = [&](const std::string& name, std::vector<float>& dst) {
    auto values = file.get(name).as<float>();
    require(values.size() == dst.size(), ErrorCode::shape_mismatch, path + ": " + name + " has another shape");
    dst = std::move(values);
  };
  for (size_t i = 0; i < rules_.size(); ++i) {
    const auto& name = rules_[i].spec.name;
    restore(name, s.values[i]);
    restore("adam_m/" + name, s.adam_m[i]);
    restore("adam_v/" + name, s.adam_v[i]);
    if (!s.ema.empty()) restore("ema/" + name, s.ema[i]);
  }
  for (size_t l = 0; l < s.selection_biases.size(); ++l) {
    auto values = file.get("router_bias/" + std::to_string(l)).as<double>();
    require(values.size() == s.selection_biases[l].size(), ErrorCode::shape_mismatch,
            path + ": router biases differ in size");
    s.selection_biases[l] = std::move(values);
  }
  s.steps = std::stoll(file.metadata.at("step"));
  engine_->set_state(s);
  steps_ = s.steps;
}

}  // namespace moka::train
