#include "train/model.hpp"

#include <algorithm>

#include "train/dense_math.hpp"

namespace moka::train {

const char* ActivationStats::name(int i) {
  static const char* names[kCount] = {"embedding", "attention_out", "router_logits", "moe_out", "residual", "logits"};
  return names[i];
}

double ActivationStats::value(int i) const {
  const double values[kCount] = {embedding, attention, router_logits, moe_output, residual, logits};
  return values[i];
}

void ActivationStats::average_over_layers(int64_t num_layers) {
  attention /= double(num_layers);
  if (num_layers > 1) {
    router_logits /= double(num_layers - 1);
    moe_output /= double(num_layers - 1);
  }
}

template <typename T>
struct Model<T>::Layer {
  bool is_moe = false;
  Param<T>* attn_norm = nullptr;
  Param<T>* ffn_norm = nullptr;
  // MLA: q_down, q_up, kv_down, k_up, v_up; MHA: q, k, v.
  std::vector<Param<T>*> attn;
  Param<T>* attn_out = nullptr;
  Param<T>* router = nullptr;
  Param<T>*gate = nullptr, *up = nullptr, *down = nullptr;
  Param<T>*shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
  std::unique_ptr<MoeLayer> ffn;
  std::unique_ptr<Router> router_op;
  int moe_index = -1;

  // Saved by forward for backward.
  std::vector<T> attn_in, attn_x, attn_inv_rms, q_latent, kv_latent, q, k, v, probs, context;
  std::vector<T> ffn_in, ffn_x, ffn_inv_rms, topk_weights;
  std::vector<int32_t> topk_ids, counts;
  std::unique_ptr<RouterContext> router_ctx;
  std::unique_ptr<MoeContext> ffn_ctx;
};

template <typename T>
struct Model<T>::Cache {
  Batch batch;
  std::vector<T> residual, final_x, final_inv_rms, logits, d_logits;
};

namespace {
// moka's views are mutable; inputs viewed this way are only read by the layer.
template <typename T>
TensorView view_of(const std::vector<T>& v, std::initializer_list<int64_t> dims) {
  return TensorView(const_cast<T*>(v.data()), dtype_of<T>(), dims);
}

template <typename T>
void add_into(std::vector<T>& acc, const std::vector<T>& x) {
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += x[i];
}

// The moka layers take no forward multiplier, so the parameterization must not ask for one.
template <typename T>
Param<T>* unscaled(Param<T>& p) {
  require(p.rule.forward_multiplier == 1.0, ErrorCode::invalid_argument,
          p.name() + " is computed by a moka layer and cannot take a forward multiplier");
  return &p;
}
}  // namespace

template <typename T>
Model<T>::Model(const ModelConfig& config, const std::vector<TensorRule>& rules, const ModelOptions& options)
    : config_(config), options_(options), params_(rules), cache_(std::make_unique<Cache>()) {
  config_.validate();
  const LayerOptions layer_options{1, options.threads};  // CPU: no row padding needed
  LayerOptions moe_options = layer_options;
  moe_options.precision = options.moe_precision;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    Layer layer;
    layer.is_moe = l > 0;
    layer.attn_norm = &params_.at(p + "attn_norm");
    layer.ffn_norm = &params_.at(p + "ffn_norm");
    const std::vector<std::string> attn_names =
        config_.attention == AttentionKind::mla ? std::vector<std::string>{"q_down", "q_up", "kv_down", "k_up", "v_up"}
                                                : std::vector<std::string>{"q", "k", "v"};
    for (const auto& n : attn_names) layer.attn.push_back(&params_.at(p + "attn." + n));
    layer.attn_out = &params_.at(p + "attn.out");
    const std::string f = layer.is_moe ? p + "moe." : p + "ffn.";
    layer.gate = unscaled(params_.at(f + "gate"));
    layer.up = unscaled(params_.at(f + "up"));
    layer.down = unscaled(params_.at(f + "down"));
    MoeShape shape{config_.d_model, config_.dense_intermediate, 1, 1, 0, Activation::swiglu, 7.0f};
    if (layer.is_moe) {
      shape = {config_.d_model,
               config_.expert_intermediate,
               config_.num_experts,
               config_.top_k,
               config_.shared_intermediate,
               Activation::swiglu,
               7.0f};
      layer.router = unscaled(params_.at(f + "router"));
      if (config_.shared_intermediate > 0) {
        layer.shared_gate = unscaled(params_.at(f + "shared_gate"));
        layer.shared_up = unscaled(params_.at(f + "shared_up"));
        layer.shared_down = unscaled(params_.at(f + "shared_down"));
      }
      // DeepSeek-V3 routing: sigmoid scores, renormalized over the k chosen, so route weights do
      // not shrink as the number of experts grows with width.
      RouterConfig rc{
          config_.d_model,    config_.num_experts, config_.top_k, ScoreFunction::sigmoid, true, true, 1.0, 0.0,
          config_.z_loss_coef};
      layer.router_op = make_router(rc, options.backend, layer_options);
      layer.moe_index = static_cast<int>(selection_bias_.size());
      selection_bias_.emplace_back(config_.num_experts, 0.0);
    }
    layer.ffn = make_moe_layer(shape, options.backend, nullptr, layer.is_moe ? moe_options : layer_options);
    layers_.push_back(std::move(layer));
  }
}

template <typename T>
Model<T>::~Model() = default;

template <typename T>
std::vector<T> Model<T>::project(const std::vector<T>& x, const Param<T>& w) const {
  const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
  const int64_t rows = static_cast<int64_t>(x.size()) / in;
  std::vector<T> y(rows * out);
  dense::linear(x.data(), w.value.data(), static_cast<T>(w.rule.forward_multiplier), rows, in, out, y.data(),
                options_.threads);
  return y;
}

template <typename T>
std::vector<T> Model<T>::project_backward(const std::vector<T>& x, Param<T>& w, const std::vector<T>& dy) const {
  const int64_t out = w.rule.spec.shape[0], in = w.rule.spec.shape[1];
  const int64_t rows = static_cast<int64_t>(x.size()) / in;
  std::vector<T> dx(rows * in);
  dense::linear_backward(x.data(), w.value.data(), dy.data(), static_cast<T>(w.rule.forward_multiplier), rows, in, out,
                         dx.data(), w.grad.data(), options_.threads);
  return dx;
}

template <typename T>
std::vector<T> Model<T>::attention_forward(Layer& L, const std::vector<T>& x) {
  const auto& b = cache_->batch;
  const dense::AttentionDims dims{b.batch, b.seq, config_.num_heads, config_.head_dim};
  if (config_.attention == AttentionKind::mla) {
    L.q_latent = project(x, *L.attn[0]);
    L.q = project(L.q_latent, *L.attn[1]);
    L.kv_latent = project(x, *L.attn[2]);
    L.k = project(L.kv_latent, *L.attn[3]);
    L.v = project(L.kv_latent, *L.attn[4]);
  } else {
    L.q = project(x, *L.attn[0]);
    L.k = project(x, *L.attn[1]);
    L.v = project(x, *L.attn[2]);
  }
  L.probs.assign(b.batch * config_.num_heads * b.seq * b.seq, T(0));
  L.context.assign(L.q.size(), T(0));
  dense::causal_attention(L.q.data(), L.k.data(), L.v.data(), dims, L.probs.data(), L.context.data(), options_.threads);
  return project(L.context, *L.attn_out);
}

template <typename T>
std::vector<T> Model<T>::attention_backward(Layer& L, const std::vector<T>& x, const std::vector<T>& d_out) {
  const auto& b = cache_->batch;
  const dense::AttentionDims dims{b.batch, b.seq, config_.num_heads, config_.head_dim};
  const auto d_context = project_backward(L.context, *L.attn_out, d_out);
  std::vector<T> dq(L.q.size()), dk(L.k.size()), dv(L.v.size());
  dense::causal_attention_backward(L.q.data(), L.k.data(), L.v.data(), L.probs.data(), d_context.data(), dims,
                                   dq.data(), dk.data(), dv.data(), options_.threads);
  if (config_.attention == AttentionKind::mla) {
    auto d_kv_latent = project_backward(L.kv_latent, *L.attn[3], dk);
    add_into(d_kv_latent, project_backward(L.kv_latent, *L.attn[4], dv));
    auto dx = project_backward(x, *L.attn[2], d_kv_latent);
    add_into(dx, project_backward(x, *L.attn[0], project_backward(L.q_latent, *L.attn[1], dq)));
    return dx;
  }
  auto dx = project_backward(x, *L.attn[0], dq);
  add_into(dx, project_backward(x, *L.attn[1], dk));
  add_into(dx, project_backward(x, *L.attn[2], dv));
  return dx;
}

template <typename T>
MoeWeights Model<T>::ffn_weights(Layer& L) const {
  const int64_t H = config_.d_model;
  const int64_t E = L.is_moe ? config_.num_experts : 1;
  const int64_t I = L.is_moe ? config_.expert_intermediate : config_.dense_intermediate;
  MoeWeights w{L.gate->view({E, I, H}), L.up->view({E, I, H}), L.down->view({E, H, I}), {}, {}, {}};
  if (L.shared_gate) {
    const int64_t Is = config_.shared_intermediate;
    w.ws_gate = L.shared_gate->view({Is, H});
    w.ws_up = L.shared_up->view({Is, H});
    w.ws_down = L.shared_down->view({H, Is});
  }
  return w;
}

template <typename T>
std::vector<T> Model<T>::ffn_forward(Layer& L, const std::vector<T>& x, ActivationStats* stats) {
  const int64_t Tn = cache_->batch.tokens(), H = config_.d_model;
  const int64_t k = L.is_moe ? config_.top_k : 1;
  L.topk_ids.assign(Tn * k, 0);
  L.topk_weights.assign(Tn * k, T(1));
  if (L.is_moe) {
    const int64_t E = config_.num_experts;
    const auto& bias_d = selection_bias_[L.moe_index];
    std::vector<T> bias(bias_d.begin(), bias_d.end());
    L.counts.assign(E, 0);
    RouterOutputs out{view_of(L.topk_ids, {Tn, k}), view_of(L.topk_weights, {Tn, k}), view_of(L.counts, {E})};
    L.router_ctx = L.router_op->forward(view_of(x, {Tn, H}), L.router->view({E, H}), view_of(bias, {E}), out, Stream{});
    if (stats) stats->router_logits += dense::mean_abs(project(x, *L.router));
  }
  std::vector<T> y(Tn * H);
  MoeInputs in{view_of(x, {Tn, H}), view_of(L.topk_ids, {Tn, k}), view_of(L.topk_weights, {Tn, k})};
  L.ffn_ctx = L.ffn->forward(in, ffn_weights(L), view_of(y, {Tn, H}), Stream{});
  if (stats && L.is_moe) stats->moe_output += dense::mean_abs(y);
  return y;
}

template <typename T>
std::vector<T> Model<T>::ffn_backward(Layer& L, const std::vector<T>& d_out) {
  const int64_t Tn = cache_->batch.tokens(), H = config_.d_model;
  const int64_t k = L.is_moe ? config_.top_k : 1;
  const int64_t E = L.is_moe ? config_.num_experts : 1;
  const int64_t I = L.is_moe ? config_.expert_intermediate : config_.dense_intermediate;
  std::vector<T> dx(Tn * H), d_weights(Tn * k);
  MoeGradients g{view_of(dx, {Tn, H}),
                 view_of(d_weights, {Tn, k}),
                 L.gate->grad_view({E, I, H}),
                 L.up->grad_view({E, I, H}),
                 L.down->grad_view({E, H, I}),
                 {},
                 {},
                 {}};
  if (L.shared_gate) {
    const int64_t Is = config_.shared_intermediate;
    g.d_ws_gate = L.shared_gate->grad_view({Is, H});
    g.d_ws_up = L.shared_up->grad_view({Is, H});
    g.d_ws_down = L.shared_down->grad_view({H, Is});
  }
  L.ffn->backward(*L.ffn_ctx, view_of(d_out, {Tn, H}), ffn_weights(L), g, Stream{});
  if (!L.is_moe) return dx;
  std::vector<T> dx_router(Tn * H);
  L.router_op->backward(*L.router_ctx, view_of(d_weights, {Tn, k}), view_of(dx_router, {Tn, H}),
                        L.router->grad_view({E, H}), Stream{});
  add_into(dx, dx_router);
  return dx;
}

template <typename T>
double Model<T>::forward(const Batch& batch, ActivationStats* stats) {
  require(batch.inputs.size() == size_t(batch.tokens()) && batch.targets.size() == size_t(batch.tokens()),
          ErrorCode::shape_mismatch, "batch inputs/targets do not hold batch*seq tokens");
  auto& c = *cache_;
  c.batch = batch;
  const int64_t Tn = batch.tokens(), H = config_.d_model, V = config_.vocab;
  const auto& embed = params_.at("embed");
  const T embed_scale = static_cast<T>(embed.rule.forward_multiplier);
  mark(Stage::embedding_forward);
  c.residual.assign(Tn * H, T(0));
  for (int64_t t = 0; t < Tn; ++t) {
    const int32_t tok = batch.inputs[t];
    require(tok >= 0 && tok < V, ErrorCode::invalid_argument, "token id " + std::to_string(tok) + " outside vocab");
    for (int64_t i = 0; i < H; ++i) c.residual[t * H + i] = embed_scale * embed.value[tok * H + i];
  }
  if (stats) *stats = ActivationStats{dense::mean_abs(c.residual)};
  double router_losses = 0;
  for (auto& L : layers_) {
    mark(Stage::norms_forward);
    L.attn_in = c.residual;
    L.attn_x.resize(Tn * H);
    L.attn_inv_rms.resize(Tn);
    dense::rmsnorm(L.attn_in.data(), L.attn_norm->value.data(), Tn, H, config_.norm_eps, L.attn_x.data(),
                   L.attn_inv_rms.data());
    mark(Stage::attention_forward);
    const auto a = attention_forward(L, L.attn_x);
    if (stats) stats->attention += dense::mean_abs(a);
    mark(Stage::norms_forward);
    add_into(c.residual, a);
    L.ffn_in = c.residual;
    L.ffn_x.resize(Tn * H);
    L.ffn_inv_rms.resize(Tn);
    dense::rmsnorm(L.ffn_in.data(), L.ffn_norm->value.data(), Tn, H, config_.norm_eps, L.ffn_x.data(),
                   L.ffn_inv_rms.data());
    mark(Stage::moe_forward);
    add_into(c.residual, ffn_forward(L, L.ffn_x, stats));
    if (L.router_ctx) router_losses += L.router_ctx->losses().aux_loss + L.router_ctx->losses().z_loss;
  }
  mark(Stage::head_loss_forward);
  c.final_x.resize(Tn * H);
  c.final_inv_rms.resize(Tn);
  dense::rmsnorm(c.residual.data(), params_.at("final_norm").value.data(), Tn, H, config_.norm_eps, c.final_x.data(),
                 c.final_inv_rms.data());
  c.logits = project(c.final_x, params_.at("head"));
  c.d_logits.resize(Tn * V);
  cross_entropy_ = dense::cross_entropy(c.logits.data(), batch.targets.data(), Tn, V, c.d_logits.data());
  if (stats) {
    stats->average_over_layers(config_.num_layers);
    stats->residual = dense::mean_abs(c.residual);
    stats->logits = dense::mean_abs(c.logits);
  }
  return cross_entropy_ + router_losses;
}

template <typename T>
void Model<T>::backward() {
  auto& c = *cache_;
  require(!c.logits.empty(), ErrorCode::invalid_argument, "backward called before forward");
  mark(Stage::head_loss_backward);
  params_.zero_grads();
  const int64_t Tn = c.batch.tokens(), H = config_.d_model;
  const auto d_final = project_backward(c.final_x, params_.at("head"), c.d_logits);
  std::vector<T> d_residual(Tn * H), d_branch_in(Tn * H);
  dense::rmsnorm_backward(c.residual.data(), params_.at("final_norm").value.data(), c.final_inv_rms.data(),
                          d_final.data(), Tn, H, d_residual.data(), params_.at("final_norm").grad.data());
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) {
    Layer& L = *it;
    mark(Stage::moe_backward);
    const auto d_ffn_x = ffn_backward(L, d_residual);
    mark(Stage::norms_backward);
    dense::rmsnorm_backward(L.ffn_in.data(), L.ffn_norm->value.data(), L.ffn_inv_rms.data(), d_ffn_x.data(), Tn, H,
                            d_branch_in.data(), L.ffn_norm->grad.data());
    add_into(d_residual, d_branch_in);
    mark(Stage::attention_backward);
    const auto d_attn_x = attention_backward(L, L.attn_x, d_residual);
    mark(Stage::norms_backward);
    dense::rmsnorm_backward(L.attn_in.data(), L.attn_norm->value.data(), L.attn_inv_rms.data(), d_attn_x.data(), Tn, H,
                            d_branch_in.data(), L.attn_norm->grad.data());
    add_into(d_residual, d_branch_in);
  }
  mark(Stage::embedding_backward);
  auto& embed = params_.at("embed");
  const T embed_scale = static_cast<T>(embed.rule.forward_multiplier);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t i = 0; i < H; ++i) embed.grad[c.batch.inputs[t] * H + i] += embed_scale * d_residual[t * H + i];
}

template <typename T>
std::vector<std::vector<int64_t>> Model<T>::expert_counts() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& L : layers_)
    if (L.is_moe) out.emplace_back(L.counts.begin(), L.counts.end());
  return out;
}

template <typename T>
std::vector<std::vector<int32_t>> Model<T>::routed_experts() const {
  std::vector<std::vector<int32_t>> out;
  for (const auto& L : layers_)
    if (L.is_moe) out.push_back(L.topk_ids);
  return out;
}

template <typename T>
void Model<T>::update_selection_biases(double rate) {
  const auto counts = expert_counts();
  for (size_t i = 0; i < counts.size(); ++i) update_selection_bias(selection_bias_[i], counts[i], rate);
}

template class Model<float>;
template class Model<double>;

}  // namespace moka::train
