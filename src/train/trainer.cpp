#include "train/trainer.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "train/checkpoint.hpp"

namespace moka::train {
namespace {

// The CPU engine's stage clock: each mark closes the running stage on the host's steady clock.
class HostStageClock final : public StageMarker {
 public:
  using clock = std::chrono::steady_clock;
  explicit HostStageClock(StepProfile& profile) : profile_(profile) {}
  void start() {
    step_start_ = last_ = clock::now();
    running_ = false;
  }
  void mark(Stage s) override {
    close();
    current_ = s;
    running_ = true;
  }
  void finish() {
    close();
    const double ms = std::chrono::duration<double, std::milli>(clock::now() - step_start_).count();
    profile_.step_ms += ms;
    profile_.host_ms += ms;
    ++profile_.steps;
  }

 private:
  void close() {
    const auto now = clock::now();
    if (running_) profile_.add_stage(current_, std::chrono::duration<double, std::milli>(now - last_).count());
    last_ = now;
  }
  StepProfile& profile_;
  clock::time_point step_start_, last_;
  Stage current_ = Stage::inputs;
  bool running_ = false;
};

// The reference engine: Model<float> on the CPU backend, AdamW and the EMA on the host.
class CpuEngine final : public TrainEngine {
 public:
  CpuEngine(const TrainConfig& c, const std::vector<TensorRule>& rules)
      : config_(c), model_(c.model, rules, ModelOptions{Backend::cpu, c.threads, c.moe_precision}),
        adam_(c.adam, model_.params()) {
    model_.params().initialize(c.seed);
    if (c.ema_decay > 0) ema_.emplace(c.ema_decay, model_.params());
    if (c.profile) {
      profile_.clock = "host steady_clock";
      profile_.mode = "cpu";
      profile_.launches_per_step = -1;
      stage_clock_.emplace(profile_);
      model_.set_stage_marker(&*stage_clock_);
    }
  }

  // The CPU has every number at hand: the report is always filled.
  void step(const Batch& batch, double lr_factor, ActivationStats* stats, bool, StepReport& r) override {
    if (stage_clock_) stage_clock_->start();
    r.loss = model_.forward(batch, stats);
    r.cross_entropy = model_.last_cross_entropy();
    model_.backward();
    mark(Stage::optimizer);
    r.grad_norm = adam_.step(model_.params(), lr_factor);
    mark(Stage::router_bias);
    r.load_max_over_mean = 0;
    for (const auto& counts : model_.expert_counts())
      r.load_max_over_mean = std::max(r.load_max_over_mean, load_stats(counts).max_over_mean);
    if (config_.bias_update_rate > 0) model_.update_selection_biases(config_.bias_update_rate);
    mark(Stage::ema);
    if (ema_) ema_->update(model_.params());
    if (stage_clock_) stage_clock_->finish();
  }

  StepProfile profile() const override { return profile_; }

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
  void mark(Stage s) {
    if (stage_clock_) stage_clock_->mark(s);
  }

  Model<float> model_;
  AdamW adam_;
  std::optional<WeightEma> ema_;
  StepProfile profile_;
  std::optional<HostStageClock> stage_clock_;
};

std::unique_ptr<TrainEngine> make_engine(const TrainConfig& c, const std::vector<TensorRule>& rules) {
  if (c.backend == Backend::cpu) return std::make_unique<CpuEngine>(c, rules);
  require(c.backend == Backend::cuda, ErrorCode::invalid_argument, "training runs on --backend cpu or cuda");
  require(c.moe_precision == Precision::bf16, ErrorCode::backend_unavailable,
          "--precision fp8 trains on --backend cpu only (the FP8 recipe's exact emulation): the CUDA engine's MoE "
          "layers have no fp8 path yet");
  return make_cuda_engine(c, rules);
}

}  // namespace

#if !MOKA_HAVE_CUDA
std::unique_ptr<TrainEngine> make_cuda_engine(const TrainConfig&, const std::vector<TensorRule>&) {
  throw Error(ErrorCode::backend_unavailable, "moka was built without CUDA: train with --backend cpu");
}
#endif

Trainer::Trainer(const TrainConfig& config, const TextSplit& text)
    : config_(config), text_(text), rules_(parameterize(config.base, config.model, config.parameterization)),
      engine_(make_engine(config, rules_)) {}

Trainer::~Trainer() = default;

namespace {

// Too high an LR shows first as a non-finite loss or as the router refusing its logits; either
// way the run diverged, which the router's own message (about its inputs) would hide.
Error diverged_at(int64_t step, const std::string& what) {
  return Error(ErrorCode::non_finite, "training diverged at step " + std::to_string(step) + ": " + what);
}

}  // namespace

StepReport Trainer::step(ActivationStats* stats, bool read_metrics) {
  StepReport r;
  r.loss = r.cross_entropy = r.grad_norm = r.load_max_over_mean = NAN;
  r.step = steps_;
  const Batch batch = sample_batch(text_.train, config_.batch, config_.seq, config_.seed, r.step);
  r.tokens = batch.tokens();
  const double factor = config_.schedule.factor(r.step);
  r.lr = config_.adam.lr * factor;
  try {
    engine_->step(batch, factor, stats, read_metrics, r);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::non_finite) throw;
    throw diverged_at(r.step + 1, "the router logits became non-finite");
  }
  ++steps_;  // the step was taken, diverged or not
  if (read_metrics && !std::isfinite(r.loss)) throw diverged_at(steps_, "the loss is " + std::to_string(r.loss));
  return r;
}

double Trainer::evaluate(int batches, bool use_ema) {
  require(!use_ema || config_.ema_decay > 0, ErrorCode::invalid_argument,
          "evaluation with EMA weights needs --ema-decay > 0");
  // A seed of its own, so validation batches do not depend on how far training went.
  std::vector<Batch> data;
  for (int i = 0; i < batches; ++i)
    data.push_back(sample_batch(text_.validation, config_.batch, config_.seq,
                                config_.validation_seed.value_or(config_.seed) + 0x5EED, i));
  try {
    return engine_->evaluate(data, use_ema);
  } catch (const Error& e) {
    // The last step's update left non-finite weights, which its own (earlier) loss did not show.
    if (e.code() != ErrorCode::non_finite) throw;
    throw diverged_at(steps_, "the router logits became non-finite in validation");
  }
}

namespace {

constexpr const char* kCheckpointFormat = "moka-train-checkpoint-2";

// What a checkpoint must share with the run that resumes it: the parameterization and every
// field of the trained and the base model (muP derives each tensor's rule from the base).
std::map<std::string, std::string> checkpoint_identity(const TrainConfig& c) {
  std::map<std::string, std::string> fields{{"parameterization", to_string(c.parameterization)}};
  auto add_model = [&](const std::string& prefix, const ModelConfig& m) {
    // JSON numbers print doubles so that they read back exactly.
    auto add = [&](const char* name, const nlohmann::json& value) { fields[prefix + name] = value.dump(); };
    add("vocab", m.vocab);
    add("d_model", m.d_model);
    add("num_heads", m.num_heads);
    add("head_dim", m.head_dim);
    add("attention", m.attention == AttentionKind::mla ? "mla" : "mha");
    add("q_rank", m.q_rank);
    add("kv_rank", m.kv_rank);
    add("num_layers", m.num_layers);
    add("dense_intermediate", m.dense_intermediate);
    add("num_experts", m.num_experts);
    add("top_k", m.top_k);
    add("expert_intermediate", m.expert_intermediate);
    add("shared_intermediate", m.shared_intermediate);
    add("z_loss_coef", m.z_loss_coef);
    add("norm_eps", m.norm_eps);
  };
  add_model("model.", c.model);
  add_model("base.", c.base);
  return fields;
}

}  // namespace

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
  file.metadata = checkpoint_identity(config_);
  file.metadata["format"] = kCheckpointFormat;
  file.metadata["step"] = std::to_string(s.steps);
  write_safetensors(path, file);
}

void Trainer::load(const std::string& path) {
  const auto file = read_safetensors(path);
  auto metadata = [&](const std::string& key) -> const std::string& {
    const auto it = file.metadata.find(key);
    require(it != file.metadata.end(), ErrorCode::io,
            path + " is not a moka training checkpoint: its metadata has no " + key);
    return it->second;
  };
  require(metadata("format") == kCheckpointFormat, ErrorCode::invalid_argument,
          path + " has checkpoint format " + metadata("format") + "; this moka reads " + kCheckpointFormat);
  for (const auto& [key, value] : checkpoint_identity(config_))
    require(metadata(key) == value, ErrorCode::invalid_argument,
            path + " was saved with " + key + " = " + metadata(key) + ", but this run has " + value);
  TrainState s = engine_->state();  // the current state gives every tensor's shape
  const std::string& step = metadata("step");
  const auto [end, ec] = std::from_chars(step.data(), step.data() + step.size(), s.steps);
  require(ec == std::errc() && end == step.data() + step.size() && s.steps >= 0, ErrorCode::io,
          path + ": metadata step '" + step + "' is not a step count");
  auto restore = [&]<typename T>(const std::string& name, const std::vector<int64_t>& shape, std::vector<T>& dst) {
    const auto it = file.tensors.find(name);
    require(it != file.tensors.end(), ErrorCode::io, path + " has no tensor '" + name + "'");
    const StoredTensor& t = it->second;
    require(t.dtype == dtype_of<T>() && t.shape == shape, ErrorCode::shape_mismatch,
            path + ": tensor '" + name + "' is " + to_string(t.dtype) + " " + nlohmann::json(t.shape).dump() +
                ", this model's is " + to_string(dtype_of<T>()) + " " + nlohmann::json(shape).dump());
    dst = t.as<T>();
  };
  for (size_t i = 0; i < rules_.size(); ++i) {
    const auto& name = rules_[i].spec.name;
    const auto& shape = rules_[i].spec.shape;
    restore(name, shape, s.values[i]);
    restore("adam_m/" + name, shape, s.adam_m[i]);
    restore("adam_v/" + name, shape, s.adam_v[i]);
    if (!s.ema.empty()) restore("ema/" + name, shape, s.ema[i]);
  }
  for (size_t l = 0; l < s.selection_biases.size(); ++l)
    restore("router_bias/" + std::to_string(l), {int64_t(s.selection_biases[l].size())}, s.selection_biases[l]);
  engine_->set_state(s);
  steps_ = s.steps;
}

}  // namespace moka::train
