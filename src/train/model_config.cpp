#include "train/model_config.hpp"

#include <algorithm>
#include <utility>

#include "moka/error.hpp"

namespace moka::train {

void ModelConfig::validate() const {
  auto positive = [](int64_t v, const char* what) {
    require(v > 0, ErrorCode::invalid_argument, std::string(what) + " must be positive, got " + std::to_string(v));
  };
  positive(vocab, "vocab");
  positive(d_model, "d_model");
  positive(num_heads, "num_heads");
  positive(head_dim, "head_dim");
  positive(num_layers, "num_layers");
  positive(dense_intermediate, "dense_intermediate");
  positive(num_experts, "num_experts");
  positive(top_k, "top_k");
  positive(expert_intermediate, "expert_intermediate");
  if (attention == AttentionKind::mla) {
    positive(q_rank, "q_rank");
    positive(kv_rank, "kv_rank");
  }
  require(top_k <= num_experts, ErrorCode::invalid_argument, "top_k exceeds num_experts");
  require(shared_intermediate >= 0, ErrorCode::invalid_argument, "shared_intermediate must be >= 0");
  int64_t width = 0;
  require(!__builtin_mul_overflow(num_heads, head_dim, &width), ErrorCode::invalid_argument,
          std::to_string(num_heads) + " heads x head_dim " + std::to_string(head_dim) + " overflow 64 bits");
}

ModelConfig scale_width(const ModelConfig& base, int64_t multiplier) {
  require(multiplier >= 1, ErrorCode::invalid_argument, "width multiplier must be >= 1");
  ModelConfig c = base;
  for (auto [size, name] : {std::pair{&c.d_model, "d_model"}, {&c.num_heads, "heads"}, {&c.num_experts, "experts"}}) {
    const int64_t base_size = *size;
    require(!__builtin_mul_overflow(base_size, multiplier, size), ErrorCode::invalid_argument,
            std::string(name) + " " + std::to_string(base_size) + " x width multiplier " + std::to_string(multiplier) +
                " overflows 64 bits");
  }
  return c;
}

TrainingValues training_values(const ModelConfig& c, int64_t batch, int64_t seq) {
  // The parameters of layer 0 (dense FFN) and layer 1 (MoE) from the layout; every later layer
  // repeats layer 1.
  ModelConfig first_layers = c;
  first_layers.num_layers = std::min<int64_t>(c.num_layers, 2);
  TrainingValues v;
  double moe_layer = 0;
  for (const auto& t : tensor_layout(first_layers)) {
    double elements = 1;
    for (int64_t d : t.shape) elements *= double(d);
    v.parameters += elements;
    if (t.name.starts_with("layers.1.")) moe_layer += elements;
  }
  v.parameters += double(c.num_layers - first_layers.num_layers) * moe_layer;
  // A layer keeps its inputs and normed inputs (4 x d_model a token), the attention's latents,
  // q, k, v and context, its seq x seq probabilities per head, its FFN's routed rows (the input
  // and the gate, up and hidden activations) and the shared expert's gate, up and hidden; the
  // head keeps the final residual and normed residual, the logits and their gradient.
  const double tokens = double(batch) * double(seq), d = double(c.d_model);
  const double latents = c.attention == AttentionKind::mla ? double(c.q_rank) + double(c.kv_rank) : 0;
  const double attention = tokens * (4 * d + latents + 4 * double(c.num_heads) * double(c.head_dim)) +
                           double(batch) * double(c.num_heads) * double(seq) * double(seq);
  const auto ffn_rows = [&](double routes, double intermediate) { return tokens * routes * (d + 3 * intermediate); };
  const double moe =
      ffn_rows(double(c.top_k), double(c.expert_intermediate)) + 3 * tokens * double(c.shared_intermediate);
  v.activations = double(c.num_layers) * attention + ffn_rows(1, double(c.dense_intermediate)) +
                  double(c.num_layers - 1) * moe + 2 * tokens * (d + double(c.vocab));
  return v;
}

const char* to_string(TensorClass c) {
  switch (c) {
    case TensorClass::embedding: return "embedding";
    case TensorClass::attention_down: return "attention_down";
    case TensorClass::attention_up: return "attention_up";
    case TensorClass::attention_qkv: return "attention_qkv";
    case TensorClass::attention_out: return "attention_out";
    case TensorClass::router: return "router";
    case TensorClass::expert_fc1: return "expert_fc1";
    case TensorClass::expert_fc2: return "expert_fc2";
    case TensorClass::shared_fc1: return "shared_fc1";
    case TensorClass::shared_fc2: return "shared_fc2";
    case TensorClass::dense_fc1: return "dense_fc1";
    case TensorClass::dense_fc2: return "dense_fc2";
    case TensorClass::norm_gain: return "norm_gain";
    case TensorClass::output_head: return "output_head";
  }
  return "?";
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

TensorSpec matrix(std::string name, TensorClass cls, int64_t fan_out, int64_t fan_in) {
  return {std::move(name), cls, {fan_out, fan_in}, fan_in, fan_out};
}

TensorSpec expert_stack(std::string name, TensorClass cls, int64_t experts, int64_t fan_out, int64_t fan_in) {
  return {std::move(name), cls, {experts, fan_out, fan_in}, fan_in, fan_out};
}

TensorSpec gain(std::string name, int64_t d) { return {std::move(name), TensorClass::norm_gain, {d}, 0, 0}; }

void attention_tensors(const ModelConfig& c, const std::string& p, std::vector<TensorSpec>& out) {
  const int64_t d = c.d_model, aw = c.attention_width();
  if (c.attention == AttentionKind::mla) {
    out.push_back(matrix(p + "q_down", TensorClass::attention_down, c.q_rank, d));
    out.push_back(matrix(p + "q_up", TensorClass::attention_up, aw, c.q_rank));
    out.push_back(matrix(p + "kv_down", TensorClass::attention_down, c.kv_rank, d));
    out.push_back(matrix(p + "k_up", TensorClass::attention_up, aw, c.kv_rank));
    out.push_back(matrix(p + "v_up", TensorClass::attention_up, aw, c.kv_rank));
  } else {
    for (const char* n : {"q", "k", "v"}) out.push_back(matrix(p + n, TensorClass::attention_qkv, aw, d));
  }
  out.push_back(matrix(p + "out", TensorClass::attention_out, d, aw));
}

void moe_tensors(const ModelConfig& c, const std::string& p, std::vector<TensorSpec>& out) {
  const int64_t d = c.d_model, E = c.num_experts, I = c.expert_intermediate;
  out.push_back(matrix(p + "router", TensorClass::router, E, d));
  out.push_back(expert_stack(p + "gate", TensorClass::expert_fc1, E, I, d));
  out.push_back(expert_stack(p + "up", TensorClass::expert_fc1, E, I, d));
  out.push_back(expert_stack(p + "down", TensorClass::expert_fc2, E, d, I));
  if (c.shared_intermediate > 0) {
    const int64_t Is = c.shared_intermediate;
    out.push_back(matrix(p + "shared_gate", TensorClass::shared_fc1, Is, d));
    out.push_back(matrix(p + "shared_up", TensorClass::shared_fc1, Is, d));
    out.push_back(matrix(p + "shared_down", TensorClass::shared_fc2, d, Is));
  }
}

void dense_ffn_tensors(const ModelConfig& c, const std::string& p, std::vector<TensorSpec>& out) {
  const int64_t d = c.d_model, I = c.dense_intermediate;
  out.push_back(matrix(p + "gate", TensorClass::dense_fc1, I, d));
  out.push_back(matrix(p + "up", TensorClass::dense_fc1, I, d));
  out.push_back(matrix(p + "down", TensorClass::dense_fc2, d, I));
}

}  // namespace

std::vector<TensorSpec> tensor_layout(const ModelConfig& c) {
  c.validate();
  std::vector<TensorSpec> out;
  // The embedding is a lookup: its fan-in is the one-hot token, which does not grow.
  out.push_back({"embed", TensorClass::embedding, {c.vocab, c.d_model}, 1, c.d_model});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    out.push_back(gain(p + "attn_norm", c.d_model));
    attention_tensors(c, p + "attn.", out);
    out.push_back(gain(p + "ffn_norm", c.d_model));
    if (l == 0) {
      dense_ffn_tensors(c, p + "ffn.", out);
    } else {
      moe_tensors(c, p + "moe.", out);
    }
  }
  out.push_back(gain("final_norm", c.d_model));
  out.push_back(matrix("head", TensorClass::output_head, c.vocab, c.d_model));
  return out;
}

}  // namespace moka::train
