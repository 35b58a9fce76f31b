// CudaEngine's state and the declarations of its stages (cuda_engine.hpp says what the engine
// does). The definitions are split by stage, each file one part of the step:
//   engine_params.cpp     the parameters (master weights, moments, EMA, bf16 shadows, gradients),
//                         the layers' saved activations and scratch, the AdamW + EMA step
//   engine_attention.cpp  the cuBLAS projections and the attention block, forward and backward
//   engine_ffn.cpp        the FFN block: moka's MoE layer and router, the router-bias update
//   engine_step.cpp       the inputs, the whole forward and backward, the step and its CUDA graph,
//                         the metrics
// and ../cuda_engine.cpp holds CudaEngine's methods over them.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/common/device_memory.hpp"
#include "train/cuda/device_stage_clock.hpp"
#include "train/cuda/ops/adamw.cuh"
#include "train/cuda/ops/op_common.cuh"
#include "train/cuda_engine.hpp"

namespace moka::train {

// Names for the engine's files only: nothing else includes this header.
using cuda::bf16;

using ::moka::cuda::DeviceArray;
using ::moka::cuda::PinnedArray;

struct DeviceParam {
  TensorRule rule;
  int64_t n = 0;
  DeviceArray<float> value, m, v, ema, grad;  // grad: tensors of the dense path
  // shadow: the bf16 copy the moka layers (and, with bf16 matmuls, the projections) read;
  // grad16: the bf16 gradient of the moka layers' tensors.
  DeviceArray<bf16> shadow, grad16;
  bool bf16_grad() const { return !grad16.empty(); }
  const void* grad_data() const { return bf16_grad() ? static_cast<const void*>(grad16.data()) : grad.data(); }
  float fwd() const { return float(rule.forward_multiplier); }
};

struct CudaEngine::Impl {
  struct Layer {
    bool is_moe = false;
    int moe_index = -1;
    int64_t experts = 1, top_k = 1, intermediate = 0;
    DeviceParam *attn_norm = nullptr, *ffn_norm = nullptr, *attn_out = nullptr, *router = nullptr;
    DeviceParam *gate = nullptr, *up = nullptr, *down = nullptr;
    DeviceParam *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
    std::vector<DeviceParam*> attn;  // MLA: q_down, q_up, kv_down, k_up, v_up; MHA: q, k, v
    std::unique_ptr<MoeLayer> ffn;
    std::unique_ptr<Router> router_op;
    std::unique_ptr<MoeContext> ffn_ctx;
    std::unique_ptr<RouterContext> router_ctx;
    // Saved by forward for backward.
    // probs [B*H, S, S] for the reference attention, lse [B*H, S] for the fused one.
    DeviceArray<float> attn_in, attn_x, attn_inv_rms, q_latent, kv_latent, q, k, v, probs, lse, context;
    DeviceArray<float> ffn_in, ffn_inv_rms, topk_weights;
    DeviceArray<bf16> ffn_x;
    DeviceArray<int32_t> topk_ids, counts;
    // The router's selection bias: f64 as the CPU keeps it, and the f32 copy the router reads.
    DeviceArray<double> bias64;
    DeviceArray<float> bias;
  };

  TrainConfig config;
  ModelConfig c;
  int device = 0;
  int64_t N = 0;  // tokens per batch
  cublasHandle_t cublas = nullptr;
  std::vector<DeviceParam> params;
  std::vector<Layer> layers;
  int64_t moe_layers = 0;
  int64_t steps_taken = 0;
  // The engine's stream: every kernel, cuBLAS call and moka layer/router call of a step. A
  // blocking stream, so the engine's host copies (cudaMemcpy) stay ordered with it.
  cudaStream_t stream = nullptr;
  // cuBLAS's workspace, set by the engine so that a captured step allocates nothing.
  DeviceArray<unsigned char> cublas_workspace;

  // A step's inputs in one device block, copied in one transfer from a pinned staging copy:
  // StepScalars, then tokens [N], targets [N], embedding offsets [V+1] and positions [N] (each
  // token's positions in ascending order: the embedding backward sums them in the CPU
  // reference's order without atomics).
  static constexpr int64_t kScalarWords = sizeof(cuda::StepScalars) / sizeof(int32_t);
  int64_t input_words = 0;
  DeviceArray<int32_t> inputs;
  PinnedArray<int32_t> staging;
  cudaEvent_t staging_copied = nullptr;  // the last copy out of `staging` has run
  cuda::StepScalars scalars_now;
  const cuda::StepScalars* step_scalars() const { return reinterpret_cast<const cuda::StepScalars*>(inputs.data()); }
  const int32_t* tokens() const { return inputs.data() + kScalarWords; }
  const int32_t* targets() const { return tokens() + N; }
  const int32_t* embed_offsets() const { return targets() + N; }
  const int32_t* embed_positions() const { return embed_offsets() + c.vocab + 1; }

  // Scratch.
  DeviceArray<float> h, d_res, d_tmp, branch, final_x, final_inv_rms, logits, d_logits, row_loss, d_topk_weights;
  DeviceArray<float> d_context, dq, dk, dv, d_q_latent, d_kv_latent, stats_x, stats_logits;
  // The attention backward's scratch: d_scores [B*H, S, S] (reference) or row_dot [B*H, S] (fused).
  DeviceArray<float> d_scores, row_dot;
  DeviceArray<bf16> moe_out, d_out16, dx16, dx_router16;
  DeviceArray<bf16> matmul16[2];          // with bf16 matmuls: the bf16 activation and gradient operands
  DeviceArray<double> partials, scalars;  // scalars: [0] cross-entropy, [1] grad sum of squares, [2] stats
  DeviceArray<double> router_losses_dev;  // per MoE layer {aux, z} of the last forward
  DeviceArray<float> gain_partials;       // the norm backward's scratch
  DeviceParam *embed = nullptr, *final_norm = nullptr, *head = nullptr;
  // The optimizer's view of every tensor (a device table of slots, one AdamW launch).
  std::vector<cuda::TensorSlot> slots;
  DeviceArray<cuda::TensorSlot> slot_table;
  int64_t adamw_blocks = 0;

  // The captured step, replayed from the second step on (TrainConfig::cuda_graph).
  cudaGraphExec_t graph = nullptr;
  bool warmed_up = false;  // an eager step has run: workspaces and library state are in place
  // Profiling (TrainConfig::profile).
  StepProfile profile;
  std::unique_ptr<DeviceStageClock> clock;
  std::vector<DeviceStageClock::Mark> graph_marks;  // the captured step's marks
  int64_t host_syncs = 0;                           // the device waits inside steps so far
  // The fused attention kernels, where asked for and they take the head_dim (else the reference).
  bool fused_attention = false;

  // engine_params.cpp
  Impl(const TrainConfig& cfg, const std::vector<TensorRule>& rules);
  ~Impl();
  DeviceParam& at(const std::string& name);
  void build_layers();
  void add_matmul_shadows();
  void allocate_scratch();
  void build_slots();
  void refresh_shadows();
  void swap_ema();
  void optimizer_step();

  // engine_attention.cpp
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha, const void* A,
            int64_t lda, const void* B, int64_t ldb, float beta, float* C, int64_t ldc, bool bf16_operands = false);
  const bf16* matmul_operand(const float* x, int64_t n, int buffer);
  void linear(const float* x, const DeviceParam& w, float* y);
  void linear_backward(const float* x, DeviceParam& w, const float* dy, float* dx, bool accumulate);
  void attention_forward(Layer& L);
  void attention_backward(Layer& L);

  // engine_ffn.cpp
  std::array<TensorView, 6> ffn_views(const Layer& L, bool grads) const;
  MoeWeights ffn_weights(const Layer& L) const;
  TensorView dev_view(void* p, DType t, std::initializer_list<int64_t> dims) const;
  void ffn_forward(Layer& L, ActivationStats* stats);
  void ffn_backward(Layer& L);
  void release_contexts();
  void router_bias_step();

  // engine_step.cpp
  double mean_abs(const void* x, bool is_bf16, int64_t n);
  double read_scalar(int i);
  void wait_for_device();
  void mark(Stage s) {
    if (clock) clock->mark(s);
  }
  void stage_inputs(const Batch& b);
  void forward(ActivationStats* stats);
  void backward();
  void step_body(ActivationStats* stats);
  cudaGraph_t capture_step();
  void read_metrics(StepReport& r);
  double router_losses() const;
  std::vector<std::vector<int64_t>> expert_counts() const;
  void run_step(const Batch& batch, double lr_factor, ActivationStats* stats, bool metrics, StepReport& r);
  static constexpr int64_t kUnprofiledSteps = 2;
};

}  // namespace moka::train
