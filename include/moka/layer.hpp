// The MoE layer: routed SwiGLU experts (+ optional shared expert), dispatch and combine.
//   out[t] = shared(x[t]) + sum_j w[t,j] * expert_{id[t,j]}(x[t])
//   expert_e(v) = W_down[e] @ act(W_gate[e] @ v, W_up[e] @ v)
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "moka/allocator.hpp"
#include "moka/config.hpp"
#include "moka/error.hpp"
#include "moka/megakernel.hpp"
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

// Which CUDA path runs a layer (docs/ARCHITECTURE.md, "Choosing the path").
//   single_gpu: the staged kernels on one GPU (no group, or a group of one);
//   all_to_all: experts split over a group, token rows moved by NCCL all-to-all (the host reads
//     the split sizes: one synchronization per call);
//   megakernel: one persistent kernel per call overlapping NVLink dispatch/combine with the expert
//     GEMMs, forward and backward (each context keeps its forward's schedule and gate|up rows);
//   automatic: the megakernel where it applies and was measured faster, else the staged path.
enum class LayerPath : uint8_t { automatic, single_gpu, all_to_all, megakernel };
const char* to_string(LayerPath path);

enum class SaveMode : uint8_t { gate_up, none };
const char* to_string(SaveMode save);
SaveMode parse_save_mode(const std::string& name);  // "gate_up" | "none"

// The number format of the experts' GEMMs (forward, dgrad and wgrad). bf16: the tensors' own
// (bf16 on the GPU, f32/f64 on the CPU backend). fp8: DeepSeek-V3's recipe (docs/FP8.md): e4m3
// operands with 1x128 scales on activations and gradients and 128x128 on weights, fp32
// accumulation promoted every 128 of K; the router, activation, combine and every reduction stay
// in the tensors' dtype. The CPU backend emulates it exactly (the reference of the FP8 kernels);
// the CUDA backend refuses it until its kernels exist.
enum class Precision : uint8_t { bf16, fp8 };
const char* to_string(Precision precision);
Precision parse_precision(const std::string& name);  // "bf16" | "fp8"

struct LayerOptions {
  // The GEMM M tile: each expert's rows are padded to a multiple of it on the CPU backend, the
  // megakernel path (which needs 128) and the all-to-all path's row blocks; the single-GPU path
  // packs the experts' rows back to back (its grouped GEMMs bound every tile by its expert's rows).
  int64_t tile_rows = 128;
  int num_threads = 0;                        // CPU backend worker threads per rank; 0 = hardware concurrency
  RowOrder row_order = RowOrder::rate_based;  // order of the rows from different sources
  // CUDA backend: SwiGLU in the gate GEMM's epilogue (an up launch, then a gate launch whose
  // epilogue writes G and H) instead of one gate|up launch and a separate activation pass. Same
  // bits either way. Off by default: on an H200 the fused forward measured 0.70-0.86x the speed
  // of the unfused one (docs/notes/benchmarks-log.md); `moka bench --backend cuda` times both.
  bool fused_swiglu = false;
  LayerPath path = LayerPath::automatic;  // CUDA backend (the CPU backend has one path)
  // What a forward's context keeps for its backward (CUDA backend; docs/ARCHITECTURE.md,
  // "Memory"): gate_up keeps the routed rows' gate and up products (2·rows·I bf16), none keeps the
  // routes and row order only and recomputes gate|up from x in the backward (one more grouped
  // GEMM: for runs that memory limits; the megakernel path's replay backward).
  SaveMode save = SaveMode::gate_up;
  // Per-call device memory (CUDA backend): null = moka's stream-ordered pool. Must outlive the
  // layer and every context it returned.
  DeviceAllocator* allocator = nullptr;
  // The megakernel path: tokens per rank its buffers hold (it requires >= 1; with 0, automatic
  // never picks it) and its knobs (tile_rows and row_order come from the fields above).
  int64_t max_tokens = 0;
  MegakernelConfig megakernel{};
  Precision precision = Precision::bf16;
};

// The GPU time of one stage of a layer call (MoeLayer::stage_times).
struct StageTime {
  std::string direction;  // "forward" or "backward"
  std::string stage;      // the path's name for it: "gate_up", "megakernel", ...
  double ms = 0;          // from the end of the previous stage (or the call's start) to its end
};

// State saved by forward for backward. Opaque; backend-specific. Any number of a layer's contexts
// may be alive at once, their backwards run in any order; destroying one without a backward is
// fine (its device memory goes back on the stream of its last use, which must outlive it).
class MoeContext {
 public:
  virtual ~MoeContext() = default;
  // Device memory this context holds for its backward (0 where the backend keeps none on a device).
  virtual int64_t saved_bytes() const { return 0; }
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
  virtual std::unique_ptr<MoeContext> forward(const MoeInputs& in, const MoeWeights& weights, const TensorView& out,
                                              Stream stream) = 0;
  virtual void backward(const MoeContext& saved, const TensorView& d_out, const MoeWeights& weights,
                        const MoeGradients& grads, Stream stream) = 0;
  // The same backward, the same bits, consuming its context: it may write its own scratch over
  // what the context saved (on the CUDA staged paths the saved gate and up products become dU and
  // w·h: two rows x I buffers fewer at the backward's peak). What a training step wants, with
  // one backward per forward; the context is destroyed before it returns.
  void consume_backward(std::unique_ptr<MoeContext> saved, const TensorView& d_out, const MoeWeights& weights,
                        const MoeGradients& grads, Stream stream) {
    if (!saved) throw Error(ErrorCode::invalid_argument, "consume_backward got no context");
    backward_overwriting(*saved, d_out, weights, grads, stream);
  }

  // Errors the device found in calls that have finished (a bad routing, a megakernel wait that
  // timed out, token counts that disagree across ranks), on every rank, naming the rank and the
  // entry: call after synchronizing the stream; the next forward or backward raises them too.
  // The CPU backend raises every error in the call itself.
  virtual void check_errors() {}
  // Per-stage timing (CUDA backend; the CPU backend records nothing): while on, every call
  // records a timed event at its start and after each of its stages on its stream (about a
  // microsecond each); stage_times() gives the last forward's stages, then the last backward's,
  // once the caller has synchronized their streams. A stage's time includes any wait of the GPU
  // for the host to enqueue its work. Calls on a stream being captured record nothing.
  virtual void record_stage_times(bool /*on*/) {}
  virtual std::vector<StageTime> stage_times() const { return {}; }
  // The megakernel path's extension (config, timeline); null on every other path.
  virtual MegakernelExtension* megakernel() { return nullptr; }

 protected:
  // consume_backward's work: a path that can reuse the saved memory overrides it.
  virtual void backward_overwriting(MoeContext& saved, const TensorView& d_out, const MoeWeights& weights,
                                    const MoeGradients& grads, Stream stream) {
    backward(saved, d_out, weights, grads, stream);
  }
};

// `group` may be null for a single rank. The layer keeps a reference to it.
std::unique_ptr<MoeLayer> make_moe_layer(const MoeShape& shape, Backend backend, ProcessGroup* group = nullptr,
                                         const LayerOptions& options = {});

}  // namespace moka
