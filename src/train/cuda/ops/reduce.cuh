// Fixed-order sums over a tensor (the loss's mean, the coordinate check's mean |x|) and over every
// optimized tensor's gradient at once (the global norm the AdamW launch clips by).
#pragma once
#include "train/cuda/ops/adamw.cuh"
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

// Sums over a tensor in a fixed order: kReduceBlocks partial sums of op(x) (x f32, or bf16 when
// `is_bf16`), then reduce_finish: out = scale * sum(partials[0..count)).
enum class ReduceOp : int { sum, abs, square };
inline constexpr int kReduceBlocks = 64;
void reduce_partials(ReduceOp op, const void* x, bool is_bf16, int64_t n, double* partials, cudaStream_t stream);
void reduce_finish(const double* partials, int64_t count, double scale, double* out, cudaStream_t stream);

// reduce_partials(square) of every slot's gradient in one launch: kReduceBlocks partials per
// slot, slot after slot (the same bits as one reduce_partials per tensor).
void grad_square_partials(const TensorSlot* slots, int count, double* partials, cudaStream_t stream);

}  // namespace moka::train::cuda
