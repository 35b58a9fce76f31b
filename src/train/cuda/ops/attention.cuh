// Causal softmax attention (dense_math.hpp's causal_attention and its backward), two ways: the
// fp32 reference kernels (attention.cu) and the fused FlashAttention-style ones on TF32 tensor
// cores (flash_attention.cu), tested against the reference.
#pragma once
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

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
void flash_attention_forward(const float* q, const float* k, const float* v, int64_t batch, int64_t seq, int64_t heads,
                             int64_t head_dim, float* lse, float* out, cudaStream_t stream);
void flash_attention_backward(const float* q, const float* k, const float* v, const float* out, const float* lse,
                              const float* d_out, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim,
                              float* row_dot, float* dq, float* dk, float* dv, cudaStream_t stream);

}  // namespace moka::train::cuda
