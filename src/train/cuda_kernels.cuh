// The dense kernels of the CUDA training path, one per stage of the CPU reference
// (dense_math.hpp, model.cpp, optimizer.cpp), so a GPU stage that goes wrong is found by diffing
// it against its CPU twin (tests/train_gpu). fp32 in and out unless a bf16 pointer is named.
// Determinism: no floating-point atomics; every output element has one writer and a fixed
// summation order (warp butterflies, per-block partials in block order), so a run repeats bit
// for bit on the same GPU. All launches go to `stream`.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "train/optimizer.hpp"

namespace moka::train::cuda {

using bf16 = __nv_bfloat16;

// h[t] = scale * table[tokens[t]]; table: [V, d].
void embed_forward(const int32_t* tokens, const float* table, float scale, int64_t rows, int64_t d, float* h,
                   cudaStream_t stream);
// grad[v] = scale * sum of d_h[t] over the positions t of token v (ascending), for every v:
// `offsets` [V+1] and `positions` [rows] list each token's positions (embed_positions()).
void embed_backward(const int32_t* offsets, const int32_t* positions, const float* d_h, float scale, int64_t vocab,
                    int64_t d, float* grad, cudaStream_t stream);

// The residual add and the RMSNorm after it, in one pass per row: s = x (+ delta, f32 or bf16,
// when one is given), written to `sum` and `saved` where given (`sum` may be x itself: the
// residual stream updated in place); then y = s / rms(s) * gain into y (f32) and/or yb (bf16)
// (either may be null); inv_rms [rows].
struct ResidualDelta {
  const float* f32 = nullptr;
  const bf16* b16 = nullptr;
};
void residual_rmsnorm_forward(const float* x, ResidualDelta delta, float* sum, float* saved, const float* gain,
                              int64_t rows, int64_t d, float eps, float* y, bf16* yb, float* inv_rms,
                              cudaStream_t stream);
// The gradient reaching a norm's output: f32, or the sum of up to two bf16 tensors (the MoE
// layer's and the router's d_x), added in that order in fp32.
struct NormGrad {
  const float* f32 = nullptr;
  const bf16* b16[2] = {nullptr, nullptr};
};
// dx = inv_rms * (gain*dy - xhat * mean(gain*dy*xhat)), written or (accumulate) added, and its
// bf16 copy into dx16 when given; d_gain = sum over rows of dy*xhat (overwritten), summed in
// kNormGainChunks chunks of rows, each in row order, then the chunks in order; gain_partials:
// scratch of kNormGainChunks * d floats.
inline constexpr int kNormGainChunks = 64;
void rmsnorm_backward(const float* x, const float* gain, const float* inv_rms, NormGrad dy, int64_t rows, int64_t d,
                      bool accumulate, float* dx, bf16* dx16, float* d_gain, float* gain_partials,
                      cudaStream_t stream);

// Causal softmax attention, scale 1/sqrt(head_dim); q, k, v, out: [batch*seq, heads*head_dim];
// probs: [batch*heads, seq, seq] (zeros above the diagonal), kept for backward.
void attention_forward(const float* q, const float* k, const float* v, int64_t batch, int64_t seq, int64_t heads,
                       int64_t head_dim, float* probs, float* out, cudaStream_t stream);
// dq, dk, dv overwritten; d_scores: [batch*heads, seq, seq] scratch.
void attention_backward(const float* q, const float* k, const float* v, const float* probs, const float* d_out,
                        int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, float* d_scores, float* dq,
                        float* dk, float* dv, cudaStream_t stream);

// The same attention fused (FlashAttention-style, TF32 tensor cores, fp32 softmax): no seq x seq
// matrix in global memory. The forward saves the output and lse [batch*heads, seq], each query
// row's logsumexp of its scaled scores; the backward recomputes the probabilities from them.
// row_dot: [batch*heads, seq] scratch. For head_dim up to kFlashMaxHeadDim where the GPU has the
// shared memory (flash_attention_supports); the kernels above are the reference they are tested
// against and the path for other shapes.
inline constexpr int64_t kFlashMaxHeadDim = 128;
bool flash_attention_supports(int64_t head_dim);
void flash_attention_forward(const float* q, const float* k, const float* v, int64_t batch, int64_t seq,
                             int64_t heads, int64_t head_dim, float* lse, float* out, cudaStream_t stream);
void flash_attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                              const float* d_out, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                              float* row_dot, float* dq, float* dk, float* dv, cudaStream_t stream);

// Per row: row_loss = logsumexp(logits) - logits[target]; d_logits = (softmax - onehot) / rows.
void cross_entropy(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* row_loss,
                   float* d_logits, cudaStream_t stream);

// Sums over a tensor in a fixed order: kReduceBlocks partial sums of op(x) (x f32, or bf16 when
// `is_bf16`), then reduce_finish: out = scale * sum(partials[0..count)).
enum class ReduceOp : int { sum, abs, square };
inline constexpr int kReduceBlocks = 64;
void reduce_partials(ReduceOp op, const void* x, bool is_bf16, int64_t n, double* partials, cudaStream_t stream);
void reduce_finish(const double* partials, int64_t count, double scale, double* out, cudaStream_t stream);

// dst (bf16) = src (f32).
void to_bf16(const float* src, int64_t n, bf16* dst, cudaStream_t stream);

// One optimized tensor, as the multi-tensor kernels read it (a device table of these).
struct TensorSlot {
  float *value = nullptr, *m = nullptr, *v = nullptr;
  float* ema = nullptr;     // null without EMA
  bf16* shadow = nullptr;   // the bf16 copy the moka layers read, or null
  const void* grad = nullptr;
  bool grad_bf16 = false;
  int64_t n = 0;
  int64_t first_block = 0;  // of the AdamW launch: the blocks of the tensors before it
  double lr_multiplier = 1, weight_decay_multiplier = 1;
};
// Sets every slot's first_block; returns the AdamW launch's block count.
int64_t assign_adamw_blocks(TensorSlot* slots, int count);

// reduce_partials(square) of every slot's gradient in one launch: kReduceBlocks partials per
// slot, slot after slot (the same bits as one reduce_partials per tensor).
void grad_square_partials(const TensorSlot* slots, int count, double* partials, cudaStream_t stream);

// What changes from step to step, read from device memory so a captured step replays it.
struct StepScalars {
  double lr = 0;                                     // peak LR x the schedule's factor
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t
};
// AdamW over every slot in one launch (optimizer.cpp's arithmetic, decoupled weight decay), with
// the global-norm clip factor computed on the device from grad_sum_squares, then (where a slot
// has them) the EMA update and the bf16 copy.
struct AdamWHyper {
  double weight_decay = 0;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  double clip_norm = 0;  // 0 = no clipping
  float ema_decay = 0;
  AdamWHyper(const AdamWConfig& a, double ema)
      : weight_decay(a.weight_decay), beta1(float(a.beta1)), beta2(float(a.beta2)), eps(float(a.eps)),
        clip_norm(a.clip_norm), ema_decay(float(ema)) {}
};
void adamw_update(const AdamWHyper& a, const StepScalars* step, const double* grad_sum_squares,
                  const TensorSlot* slots, int count, int64_t blocks, cudaStream_t stream);

// Aux-loss-free balancing on the device (moka::update_selection_bias's arithmetic): bias
// [experts] (f64) += rate * sign(mean count - count), and bias32 = its f32 copy the router reads.
void update_selection_bias(const int32_t* counts, int64_t experts, double rate, double* bias, float* bias32,
                           cudaStream_t stream);

}  // namespace moka::train::cuda
