// Shapes and configuration of an MoE layer and its router.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moka {

// SwiGLU: silu(g) * u. The clamped variant is GPT-OSS's:
//   g' = min(g, limit), u' = clamp(u, -limit, limit), act = g' * sigmoid(1.702 g') * (u' + 1).
enum class Activation : uint8_t { swiglu, swiglu_clamped };

struct MoeShape {
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I, per routed expert
  int64_t num_experts = 0;          // E, global
  int64_t top_k = 0;                // k
  int64_t shared_intermediate = 0;  // Is; 0 = no shared expert
  Activation activation = Activation::swiglu;
  float clamp_limit = 7.0f;  // used by swiglu_clamped only

  bool has_shared() const { return shared_intermediate > 0; }
  // Useful FLOPs of a forward pass over `tokens` tokens: 6*T*k*H*I routed + 6*T*H*Is shared.
  double forward_flops(int64_t tokens) const;
};

// Order of the rows inside each expert's segment of a rank's grouped buffer, which is the order
// in which communication work pulls rows from (and pushes results to) the source ranks.
//   round_robin: one row from every source in turn; sources that run out drop out, so the last
//     blocks come from the heaviest sources only (a round-robin tail).
//   rate_based: sources merged by virtual finish time (row i of a source with n rows is due at
//     (i + 1) / n), ties in staggered order from the receiving rank: every block draws from each
//     source in proportion to its rows, so every flow finishes together (src/sched's rate-based
//     schedule, docs/SCHEDULING.md). Results are bitwise the same either way.
enum class RowOrder : uint8_t { round_robin, rate_based };

enum class ScoreFunction : uint8_t { softmax, sigmoid };

struct RouterConfig {
  int64_t hidden = 0;
  int64_t num_experts = 0;
  int64_t top_k = 0;
  ScoreFunction score = ScoreFunction::softmax;
  bool use_selection_bias = false;  // per-expert bias added for top-k selection only
  bool renormalize = false;         // divide the k selected scores by their sum
  double route_scale = 1.0;         // multiplies the final weights
  double aux_loss_coef = 0.0;       // switch-style load-balancing loss; 0 = off
  double z_loss_coef = 0.0;         // router z-loss; 0 = off
};

struct NamedShape {
  std::string name;
  MoeShape shape;
  RouterConfig router;  // the model's routing style (score function, renormalization)
};

const std::vector<NamedShape>& named_shapes();
// Throws Error(invalid_argument) listing the known names when `name` is unknown.
const NamedShape& named_shape(const std::string& name);

}  // namespace moka
