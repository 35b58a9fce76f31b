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

namespace moka::train::cuda {

using bf16 = __nv_bfloat16;

// h[t] = scale * table[tokens[t]]; table: [V, d].
void embed_forward(const int32_t* tokens, const float* table, float scale, int64_t rows, int64_t d, float* h,
                   cudaStream_t stream);
// grad[v] = scale * sum of d_h[t] over the positions t of token v (ascending), for every v:
// `offsets` [V+1] and `positions` [rows] list each token's positions (embed_positions()).
void embed_backward(const int32_t* offsets, const int32_t* positions, const float* d_h, float scale, int64_t vocab,
                    int64_t d, float* grad, cudaStream_t stream);

// y = x / rms(x) * gain per row, into y (f32) and/or yb (bf16) (either may be null); inv_rms [rows].
void rmsnorm_forward(const float* x, const float* gain, int64_t rows, int64_t d, float eps, float* y, bf16* yb,
                     float* inv_rms, cudaStream_t stream);
// dx = inv_rms * (gain*dy - xhat * mean(gain*dy*xhat)), written or (accumulate) added;
// d_gain = sum over rows of dy*xhat (overwritten).
void rmsnorm_backward(const float* x, const float* gain, const float* inv_rms, const float* dy, int64_t rows,
                      int64_t d, bool accumulate, float* dx, float* d_gain, cudaStream_t stream);

// Causal softmax attention, scale 1/sqrt(head_dim); q, k, v, out: [batch*seq, heads*head_dim];
// probs: [batch*heads, seq, seq] (zeros above the diagonal), kept for backward.
void attention_forward(const float* q, const float* k, const float* v, int64_t batch, int64_t seq, int64_t heads,
                       int64_t head_dim, float* probs, float* out, cudaStream_t stream);
// dq, dk, dv overwritten; d_scores: [batch*heads, seq, seq] scratch.
void attention_backward(const float* q, const float* k, const float* v, const float* probs, const float* d_out,
                        int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, float* d_scores, float* dq,
                        float* dk, float* dv, cudaStream_t stream);

// Per row: row_loss = logsumexp(logits) - logits[target]; d_logits = (softmax - onehot) / rows.
void cross_entropy(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* row_loss,
                   float* d_logits, cudaStream_t stream);

// Sums over a tensor in a fixed order: kReduceBlocks partial sums of op(x) (x f32, or bf16 when
// `is_bf16`), then reduce_finish: out = scale * sum(partials[0..count)).
enum class ReduceOp : int { sum, abs, square };
inline constexpr int kReduceBlocks = 64;
void reduce_partials(ReduceOp op, const void* x, bool is_bf16, int64_t n, double* partials, cudaStream_t stream);
void reduce_finish(const double* partials, int64_t count, double scale, double* out, cudaStream_t stream);

// dst (f32) += src (bf16); dst (bf16) = src (f32).
void add_bf16(const bf16* src, int64_t n, float* dst, cudaStream_t stream);
void to_bf16(const float* src, int64_t n, bf16* dst, cudaStream_t stream);

// One tensor's AdamW update (optimizer.cpp's arithmetic, decoupled weight decay), with the
// global-norm clip factor computed on the device from grad_sum_squares, then (when given) the
// EMA update and the bf16 copy the moka layers read.
struct AdamWArgs {
  double lr = 0, lr_multiplier = 1, weight_decay = 0, weight_decay_multiplier = 1;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t
  double clip_norm = 0;                              // 0 = no clipping
  float ema_decay = 0;
};
void adamw_update(const AdamWArgs& a, const double* grad_sum_squares, const void* grad, bool grad_bf16, int64_t n,
                  float* value, float* m, float* v, float* ema, bf16* shadow, cudaStream_t stream);

}  // namespace moka::train::cuda
