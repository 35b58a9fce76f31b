// The grouped GEMMs of the staged CUDA layer (cuda_layer.cu) and the buffer table they share:
// one group per (expert, operand) for the routed experts, fixed-size groups for the shared one.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "moka/config.hpp"

namespace moka::cuda::staged {

// Indices of the BufferTable every grouped GEMM of the layer shares. "Grouped" buffers hold one
// row per routed (token, expert) pair in expert segments; "Shared" names the shared expert.
// The buffers in the groups the stages use them in (clang-format would put one a line).
// clang-format off
enum Buf : int {
  // Forward: the caller's x and weights, then what the stages write.
  kInput, kGroupedInput, kGateWeight, kUpWeight, kDownWeight,
  kGateOut, kUpOut, kHidden, kExpertOut,
  kSharedGateWeight, kSharedUpWeight, kSharedDownWeight,
  kSharedGateOut, kSharedUpOut, kSharedHidden, kSharedOut,
  // Backward: d_out, dh_u = dY W_down (before the route weight), dG, dU, w * hidden, and the two
  // halves of d_x (through W_gate and through W_up), for the routed and the shared expert.
  kOutGrad, kGroupedOutGrad, kHiddenGradUnweighted, kGateGrad, kUpGrad, kWeightedHidden,
  kInputGradViaGate, kInputGradViaUp,
  kSharedHiddenGrad, kSharedGateGrad, kSharedUpGrad, kSharedInputGradViaGate, kSharedInputGradViaUp,
  // The caller's weight gradients.
  kGateWeightGrad, kUpWeightGrad, kDownWeightGrad,
  kSharedGateWeightGrad, kSharedUpWeightGrad, kSharedDownWeightGrad,
  kNumBufs
};
// clang-format on
static_assert(kNumBufs <= kMaxGemmBuffers);

// The grouped GEMMs of a layer for one token count (the shared expert's dense groups take T).
// They keep device scratch of their own (per-group arrays, CUTLASS's workspace), so the layer
// orders every call's device work after the previous call's (order_after_last_call).
struct LayerGemms {
  int64_t tokens = 0;
  // Forward gate/up: `up` then `gate` (SwiGLU epilogue) when fused, else `gate_up` (both plain).
  std::unique_ptr<GroupedGemm> up, gate, gate_up;
  // The weight gradients in two launches, down's first: its operands (d_out's and w·h's rows) go
  // back before x's rows are gathered for gate's and up's.
  std::unique_ptr<GroupedGemm> down, data_grad_h, data_grad_x, weight_grad_down, weight_grad_gate_up;
};

// One of the layer's grouped GEMMs before it is built: its groups and its layout (operand
// majorness and kernel schedule).
struct LayerGemmSpec {
  std::vector<GroupSpec> groups;
  GemmLayout layout;
};
// Every grouped GEMM a layer may run, as build_layer_gemms builds them (bench/kernels/
// gemm_schedules times each): the forward's gate_up (each expert's gate and up groups side by
// side), or, fused, up alone and gate alone (here with the plain epilogue: build_layer_gemms adds
// the SwiGLU one), down; the data gradients dh = dY W_down and dx = dG W_gate, dU W_up; the weight
// gradients of down and of gate and up (one launch). The shared expert's products are fixed-size
// groups at the end of each.
struct LayerGemmSpecs {
  LayerGemmSpec gate_up, gate, up, down, data_grad_h, data_grad_x, weight_grad_down, weight_grad_gate_up;
};
LayerGemmSpecs layer_gemm_specs(const MoeShape& shape, int64_t local_experts, int64_t tokens);

// The GEMMs of a layer of `shape` with `local_experts` experts for `tokens` tokens per call;
// `fused_swiglu` (null: off) puts the activation in the gate GEMM's epilogue, after an up launch.
std::unique_ptr<LayerGemms> build_layer_gemms(const MoeShape& shape, int64_t local_experts, int64_t tokens,
                                              const ActParams* fused_swiglu, int device, GemmEngine engine);

}  // namespace moka::cuda::staged
