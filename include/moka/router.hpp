// The router: logits = x @ W_router^T, scores by softmax or sigmoid, top-k selection with an
// optional per-expert bias used for selection only, optional renormalization and route scale,
// optional load-balancing and z losses, per-expert load statistics.
#pragma once
#include <memory>
#include <vector>

#include "moka/config.hpp"
#include "moka/layer.hpp"
#include "moka/tensor.hpp"

namespace moka {

struct RouterLosses {
  double aux_loss = 0.0;  // aux_loss_coef * E * sum_e f_e * P_e
  double z_loss = 0.0;    // z_loss_coef * mean_t logsumexp(logits_t)^2
};

// What a trainer that balances the load with auxiliary losses itself reads of a forward (each
// optional, may be empty), in the router's compute dtype (f64 for f64 x, else f32):
// router_logits [T, E]; router_probs [T, E], the probabilities of the load-balancing loss (the
// softmax scores, or the sigmoid scores normalized per token, as normalized by the sum of the
// token's scores in either case); losses [2], the two losses without coefficients:
// {E * sum_e f_e * P_e (f_e = routes to e / (T * k), P_e the mean over tokens of router_probs),
// mean_t logsumexp(logits_t)^2}. Requested, they are written by the router's own kernels (no
// other launch); their gradients come back through RouterAuxGradients.
struct RouterAuxOutputs {
  TensorView router_logits{};
  TensorView router_probs{};
  TensorView losses{};
};

// Outputs of forward. topk_ids: [T, k] int32; topk_weights: [T, k] (f64 for f64 x, else f32);
// expert_counts: [E] int32 or int64, routes per expert (optional, may be empty);
// expert_load: [E] int64, a running total the routes per expert are added to (optional, may be
// empty): load statistics kept across calls without a separate accumulation by the caller.
struct RouterOutputs {
  TensorView topk_ids;
  TensorView topk_weights;
  TensorView expert_counts;
  TensorView expert_load{};  // optional: callers that do not keep a load leave it out
  RouterAuxOutputs aux{};
};

// The gradients of the loss with respect to the RouterAuxOutputs a forward wrote, in the same
// dtypes and shapes (each optional: empty is zero). d_losses [2] is read by the device: a
// captured step passes it without a host copy.
struct RouterAuxGradients {
  TensorView d_router_logits{};
  TensorView d_router_probs{};
  TensorView d_losses{};
  bool empty() const { return d_router_logits.empty() && d_router_probs.empty() && d_losses.empty(); }
};

// GPU: holds scratch allocated on the forward's stream and freed there by the destructor, so a
// context must be destroyed before that stream is.
class RouterContext {
 public:
  virtual ~RouterContext() = default;
  virtual RouterLosses losses() const = 0;  // GPU: waits for the forward's stream
  // The losses where the device computed them, {aux_loss, z_loss} as two doubles, written in the
  // forward's stream order: a caller that must not wait (a captured CUDA graph) copies them from
  // here. Null on the CPU.
  virtual const double* device_losses() const { return nullptr; }
};

class Router {
 public:
  virtual ~Router() = default;
  virtual const RouterConfig& config() const = 0;
  // x: [T, H]; w_router: [E, H]; selection_bias: [E] or empty. GPU work goes on `stream`.
  virtual std::unique_ptr<RouterContext> forward(const TensorView& x, const TensorView& w_router,
                                                 const TensorView& selection_bias, const RouterOutputs& out,
                                                 Stream stream) = 0;
  // d_topk_weights: [T, k]. The losses of RouterConfig's coefficients enter with gradient 1 (they
  // are added to the training loss); `aux`: the gradients of the RouterAuxOutputs the forward
  // wrote (it must have written every one given here). Overwrites d_w_router [E, H], and d_x
  // [T, H] unless add_to_d_x, which adds the router's part to what d_x holds (the experts' part
  // of x's gradient, with no separate sum by the caller). `stream`: the forward's (its scratch is
  // freed in that stream's order).
  virtual void backward(const RouterContext& saved, const TensorView& d_topk_weights, const TensorView& d_x,
                        const TensorView& d_w_router, Stream stream, bool add_to_d_x = false,
                        const RouterAuxGradients& aux = {}) = 0;
};

std::unique_ptr<Router> make_router(const RouterConfig& config, Backend backend, const LayerOptions& options = {});

// Per-expert load: counts, the busiest expert over the mean, and the Gini coefficient.
struct LoadStats {
  std::vector<int64_t> counts;
  double max_over_mean = 0.0;
  double gini = 0.0;
};
LoadStats load_stats(const std::vector<int64_t>& counts);

// Auxiliary-loss-free balancing (DeepSeek-V3): bias_e += rate * sign(mean_count - count_e).
void update_selection_bias(std::vector<double>& bias, const std::vector<int64_t>& counts, double rate);

}  // namespace moka
