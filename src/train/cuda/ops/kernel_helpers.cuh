// Device code the op kernels share (.cu files only): the launch shape and the warp and block
// sums, each in a fixed order so that every op keeps the determinism rule of op_common.cuh.
#pragma once
#include <cstdint>

#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;

inline unsigned blocks_for(int64_t n, int per_block = kThreads) { return unsigned((n + per_block - 1) / per_block); }

// Warp butterflies: every lane ends with the same value, combined in a fixed pattern.
__device__ inline float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block sum in a fixed order (lanes, then warps in order); every thread gets the result.
__device__ inline double block_sum(double v) {
  __shared__ double part[kWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  double r = 0;
  for (int w = 0; w < kWarps; ++w) r += part[w];
  __syncthreads();
  return r;
}

}  // namespace moka::train::cuda
