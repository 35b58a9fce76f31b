// to_bf16.cuh: a thread per element, round to nearest even.
#include "train/cuda/ops/kernel_helpers.cuh"
#include "train/cuda/ops/to_bf16.cuh"

namespace moka::train::cuda {
namespace {

__global__ void to_bf16_kernel(const float* src, int64_t n, bf16* dst) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __float2bfloat16(src[i]);
}

}  // namespace

void to_bf16(const float* src, int64_t n, bf16* dst, cudaStream_t s) {
  to_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(src, n, dst);
}

}  // namespace moka::train::cuda
