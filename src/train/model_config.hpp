// Shape of the decoder-only MoE language model, the list of its tensors, and width scaling.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moka::train {

enum class AttentionKind : uint8_t { mla, mha };

struct ModelConfig {
  int64_t vocab = 256;  // byte-level tokens
  int64_t d_model = 64;
  int64_t num_heads = 4;
  int64_t head_dim = 16;  // fixed as width grows
  AttentionKind attention = AttentionKind::mla;
  int64_t q_rank = 32;  // MLA latent ranks, fixed as width grows
  int64_t kv_rank = 32;
  int64_t num_layers = 2;  // layer 0 has a dense FFN, the others MoE FFNs
  int64_t dense_intermediate = 128;
  int64_t num_experts = 8;
  int64_t top_k = 2;
  int64_t expert_intermediate = 32;
  int64_t shared_intermediate = 0;  // 0 = no shared expert
  double z_loss_coef = 0.0;
  double norm_eps = 1e-6;

  int64_t attention_width() const { return num_heads * head_dim; }  // validate() checks that it fits
  void validate() const;
};

// The model `multiplier` times as wide as `base`: d_model, heads and experts grow; depth, top-k,
// head_dim, expert and dense FFN sizes and the MLA latent ranks stay. Throws invalid_argument
// when a widened size overflows 64 bits.
ModelConfig scale_width(const ModelConfig& base, int64_t multiplier);

// The values training `c` holds, counted in floating point so that no sizes overflow the count:
// the parameters, and the activations one step of `batch` sequences of `seq` tokens keeps for
// backward on the CPU (what Model and the MoE layers save; scratch buffers not counted).
struct TrainingValues {
  double parameters = 0;
  double activations = 0;
};
TrainingValues training_values(const ModelConfig& c, int64_t batch, int64_t seq);

// What a tensor is, for the parameterization rules.
enum class TensorClass : uint8_t {
  embedding,
  attention_down,  // MLA d -> latent
  attention_up,    // MLA latent -> heads*head_dim
  attention_qkv,   // plain MHA d -> heads*head_dim
  attention_out,
  router,
  expert_fc1,  // routed expert gate/up
  expert_fc2,  // routed expert down
  shared_fc1,
  shared_fc2,
  dense_fc1,
  dense_fc2,
  norm_gain,
  output_head,
};
const char* to_string(TensorClass c);

// One tensor of the model. Matrices are [fan_out, fan_in] (expert stacks [E, fan_out, fan_in]).
struct TensorSpec {
  std::string name;
  TensorClass cls;
  std::vector<int64_t> shape;
  int64_t fan_in = 0, fan_out = 0;  // 0 for norm gains
  int64_t numel() const;
};

std::vector<TensorSpec> tensor_layout(const ModelConfig& c);

}  // namespace moka::train
