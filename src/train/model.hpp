// The decoder-only MoE language model: token embedding, then per layer
//   h += Attention(RMSNorm(h));  h += FFN(RMSNorm(h))
// with MLA-style attention (low-rank latents for q and kv; plain MHA as an option; no positional
// encoding: the causal mask alone gives order), a dense SwiGLU FFN in layer 0 and moka MoE
// layers after it (router with aux-loss-free selection-bias balancing, optional shared expert),
// then RMSNorm, the LM head and cross-entropy. Forward and backward in f32 or f64 (gradient
// checks). The MoE layers and routers come from make_moe_layer / make_router, so they run on
// whichever moka backend is asked for; the dense FFN of layer 0 is a one-expert, top-1 moka MoE
// layer with route weight 1.
#pragma once
#include <memory>
#include <vector>

#include "moka/moka.hpp"
#include "train/model_config.hpp"
#include "train/params.hpp"
#include "train/step_profile.hpp"

namespace moka::train {

// `batch` sequences of `seq` tokens, row-major; targets are the inputs shifted by one.
struct Batch {
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> inputs, targets;
  int64_t tokens() const { return batch * seq; }
};

// Mean |x| of the coordinate-check activations; attention, router logits and MoE output are
// averaged over the layers that have them.
struct ActivationStats {
  double embedding = 0, attention = 0, router_logits = 0, moe_output = 0, residual = 0, logits = 0;
  static constexpr int kCount = 6;
  static const char* name(int i);
  double value(int i) const;
  // Turns the per-layer sums of attention, router logits and MoE output into means (layer 0
  // has no router or MoE).
  void average_over_layers(int64_t num_layers);
};

struct ModelOptions {
  Backend backend = Backend::cpu;
  int threads = 1;
  Precision moe_precision = Precision::bf16;  // the MoE layers' expert GEMMs (TrainConfig)
};

template <typename T>
class Model {
 public:
  Model(const ModelConfig& config, const std::vector<TensorRule>& rules, const ModelOptions& options = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  ParamStore<T>& params() { return params_; }
  const ParamStore<T>& params() const { return params_; }

  // Mean cross-entropy plus the routers' z/aux losses; keeps what backward needs.
  double forward(const Batch& batch, ActivationStats* stats = nullptr);
  // Gradients of the last forward's loss, written into params().grad (zeroed first).
  void backward();
  double last_cross_entropy() const { return cross_entropy_; }

  // Routes per expert of each MoE layer in the last forward.
  std::vector<std::vector<int64_t>> expert_counts() const;
  // Top-k expert ids [tokens * k] of each MoE layer in the last forward.
  std::vector<std::vector<int32_t>> routed_experts() const;
  // Aux-loss-free balancing: per MoE layer, bias_e += rate * sign(mean load - load_e).
  void update_selection_biases(double rate);
  std::vector<std::vector<double>>& selection_biases() { return selection_bias_; }
  const std::vector<std::vector<double>>& selection_biases() const { return selection_bias_; }
  // Stage boundaries of forward and backward go to `marker` (null: none); it must outlive them.
  void set_stage_marker(StageMarker* marker) { marker_ = marker; }

 private:
  struct Layer;
  struct Cache;
  std::vector<T> project(const std::vector<T>& x, const Param<T>& w) const;
  std::vector<T> project_backward(const std::vector<T>& x, Param<T>& w, const std::vector<T>& dy) const;
  std::vector<T> attention_forward(Layer& layer, const std::vector<T>& x);
  std::vector<T> attention_backward(Layer& layer, const std::vector<T>& x, const std::vector<T>& d_out);
  std::vector<T> ffn_forward(Layer& layer, const std::vector<T>& x, ActivationStats* stats);
  std::vector<T> ffn_backward(Layer& layer, const std::vector<T>& d_out);
  MoeWeights ffn_weights(Layer& layer) const;
  void mark(Stage s) {
    if (marker_) marker_->mark(s);
  }

  ModelConfig config_;
  ModelOptions options_;
  ParamStore<T> params_;
  std::vector<Layer> layers_;
  std::vector<std::vector<double>> selection_bias_;  // per MoE layer [E]
  std::unique_ptr<Cache> cache_;
  double cross_entropy_ = 0;
  StageMarker* marker_ = nullptr;
};

extern template class Model<float>;
extern template class Model<double>;

}  // namespace moka::train
