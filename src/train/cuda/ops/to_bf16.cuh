// dst (bf16) = src (f32): the bf16 copies of the master weights (outside the AdamW launch, which
// refreshes them itself) and, with bf16 matmuls, of each GEMM's activation and gradient operands.
#pragma once
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

void to_bf16(const float* src, int64_t n, bf16* dst, cudaStream_t stream);

}  // namespace moka::train::cuda
