// What the two attention implementations (attention.cu, flash_attention.cu) share: the layout of
// q, k, v and out ([batch*seq, heads*head_dim]) and the opt-in to a large block of shared memory.
// Device code: .cu files only.
#pragma once
#include <cstdint>

#include "cuda/common/check.hpp"
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

struct AttnDims {
  int64_t batch, seq, heads, hd;
  __device__ int64_t width() const { return heads * hd; }
  // Row i of sequence b, head h.
  __device__ int64_t at(int64_t b, int64_t h, int64_t i) const { return (b * seq + i) * width() + h * hd; }
};

// `floats` of shared memory for a block of `kernel`, in bytes, or 0 when that is more than a
// block may have: the kernel then reads global memory.
template <typename Kernel>
size_t staging_bytes(Kernel kernel, int64_t floats) {
  const size_t bytes = size_t(floats) * sizeof(float);
  int device = 0, limit = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (bytes > size_t(limit)) return 0;
  MOKA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  return bytes;
}

}  // namespace moka::train::cuda
