// Input validation shared by every backend: clear errors before any work is done.
#pragma once
#include <cstdint>
#include <functional>

#include "moka/layer.hpp"
#include "moka/process_group.hpp"

namespace moka::core {

// Sizes a layer can never take (non-positive sizes, k > E, E not divisible by world size...).
void validate_shape(const MoeShape& shape, int world_size);

// One rank's routing: ids in [0, E), no expert twice in a token's top-k, finite weights.
// The error names the token, the slot and the value.
template <typename W>
void validate_routing(const int32_t* ids, const W* weights, int64_t tokens, int64_t top_k, int64_t num_experts);

// Shapes, dtypes and devices of a rank's tensors. `act` is the dtype of x/out; weights share it
// except topk_weights (f64 with f64 activations, else f32).
void validate_layer_tensors(const MoeShape& shape, int world_size, const MoeInputs& in, const MoeWeights& weights,
                            DType act, Device device);
void validate_layer_gradients(const MoeShape& shape, int world_size, int64_t tokens, const MoeGradients& grads,
                              DType act, Device device);
DType router_weight_dtype(DType act);

// What every rank of a group must agree on.
struct LayerSignature {
  int64_t tokens = 0, hidden = 0, intermediate = 0, experts = 0, top_k = 0, shared = 0;
  int32_t dtype = 0;
  bool operator==(const LayerSignature&) const = default;
};
inline LayerSignature layer_signature(const MoeShape& s, int64_t tokens, DType dtype) {
  return {tokens, s.hidden, s.intermediate, s.num_experts, s.top_k, s.shared_intermediate, static_cast<int32_t>(dtype)};
}

// Runs `local_check` on this rank, then exchanges every rank's outcome and signature, so that a
// bad input on any rank (or ranks that disagree) raises the same clear error on every rank,
// naming the rank, instead of leaving the others waiting. `group` may be null (one rank).
void validate_collectively(ProcessGroup* group, const LayerSignature& signature,
                           const std::function<void()>& local_check);

}  // namespace moka::core
