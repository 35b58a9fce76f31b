// The MoE layer: routed SwiGLU experts (+ optional shared expert), dispatch and combine.
//   out[t] = shared(x[t]) + sum_j w[t,j] * expert_{id[t,j]}(x[t])
//   expert_e(v) = W_down[e] @ act(W_gate[e] @ v, W_up[e] @ v)
#pragma once
#include <memory>
#include <vector>

#include "moka/config.hpp"
#include "moka/process_group.hpp"
#include "moka/stream.hpp"
#include "moka/tensor.hpp"

namespace moka {

enum class Backend : uint8_t { cpu, cuda, automatic };
const char* to_string(Backend b);
Backend parse_backend(const std::string& name);  // "cpu" | "cuda" | "auto"
bool cuda_backend_available();                   // built with CUDA and a GPU is visible

// Per-rank inputs. x: [T, H]; topk_ids: [T, k] int32 global expert ids; topk_weights: [T, k],
// f64 when x is f64, else f32.
struct MoeInputs {
  TensorView x;
  TensorView topk_ids;
  TensorView topk_weights;
};

// Weights of this rank's local experts and the (replicated) shared expert.
// w_gate, w_up: [E_local, I, H]; w_down: [E_local, H, I];
// ws_gate, ws_up: [Is, H]; ws_down: [H, Is] (empty views when the shape has no shared expert).
struct MoeWeights {
  TensorView w_gate, w_up, w_down;
  TensorView ws_gate, ws_up, ws_down;
};

// Gradients, same shapes as their tensors; every present view is overwritten by backward.
// d_ws_* are this rank's partial sums over its own tokens (the data-parallel all-reduce of
// the replicated shared expert is the caller's, as for any replicated parameter).
struct MoeGradients {
  TensorView d_x, d_topk_weights;
  TensorView d_w_gate, d_w_up, d_w_down;
  TensorView d_ws_gate, d_ws_up, d_ws_down;
};

struct LayerOptions {
  int64_t tile_rows = 128;  // each expert's rows are padded to a multiple (the GEMM M tile)
  int num_threads = 0;      // CPU backend worker threads per rank; 0 = hardware concurrency
  RowOrder row_order = RowOrder::rate_based;  // order of the rows from different sources
  // CUDA backend: SwiGLU in the gate GEMM's epilogue (an up launch, then a gate launch whose
  // epilogue writes G and H) instead of one gate|up launch and a separate activation pass. Same
  // bits either way. Off by default: on an H200 the fused forward measured 0.70-0.86x the speed
  // of the unfused one (docs/BENCHMARKS.md); `moka bench --backend cuda` times both.
  bool fused_swiglu = false;
};

// State saved by forward for backward. Opaque; backend-specific.
class MoeContext {
 public:
  virtual ~MoeContext() = default;
  // Routed (token, expert) rows each local expert received in that forward pass (GPU: waits for
  // the forward's stream).
  virtual std::vector<int64_t> local_expert_rows() const = 0;
};

class MoeLayer {
 public:
  virtual ~MoeLayer() = default;
  virtual const MoeShape& shape() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const char* backend_name() const = 0;
  int64_t num_local_experts() const { return shape().num_experts / world_size(); }
  int64_t first_local_expert() const { return rank() * num_local_experts(); }

  // out: [T, H], same dtype as x. Collective over the group: every rank calls it. GPU work is
  // enqueued on `stream`; backward of a context must use the stream of its forward (or one
  // ordered after it).
  virtual std::unique_ptr<MoeContext> forward(const MoeInputs& in, const MoeWeights& weights,
                                              const TensorView& out, Stream stream) = 0;
  virtual void backward(const MoeContext& saved, const TensorView& d_out,
                        const MoeWeights& weights, const MoeGradients& grads, Stream stream) = 0;
};

// `group` may be null for a single rank. The layer keeps a reference to it.
std::unique_ptr<MoeLayer> make_moe_layer(const MoeShape& shape, Backend backend,
                                         ProcessGroup* group = nullptr,
                                         const LayerOptions& options = {});

}  // namespace moka
