// embedding.cuh: a thread per output element; the backward sums each token's positions in the
// order the host listed them, so no atomics are needed.
#include "train/cuda/ops/embedding.cuh"
#include "train/cuda/ops/kernel_helpers.cuh"

namespace moka::train::cuda {
namespace {

__global__ void embed_forward_kernel(const int32_t* tokens, const float* table, float scale, int64_t rows, int64_t d,
                                     float* h) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * d) return;
  h[i] = scale * table[int64_t(tokens[i / d]) * d + i % d];
}

__global__ void embed_backward_kernel(const int32_t* offsets, const int32_t* positions, const float* d_h, float scale,
                                      int64_t vocab, int64_t d, float* grad) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vocab * d) return;
  const int64_t tok = i / d, c = i % d;
  float acc = 0;
  for (int32_t p = offsets[tok]; p < offsets[tok + 1]; ++p) acc += scale * d_h[int64_t(positions[p]) * d + c];
  grad[i] = acc;
}

}  // namespace

void embed_forward(const int32_t* tokens, const float* table, float scale, int64_t rows, int64_t d, float* h,
                   cudaStream_t s) {
  embed_forward_kernel<<<blocks_for(rows * d), kThreads, 0, s>>>(tokens, table, scale, rows, d, h);
}

void embed_backward(const int32_t* offsets, const int32_t* positions, const float* d_h, float scale, int64_t vocab,
                    int64_t d, float* grad, cudaStream_t s) {
  embed_backward_kernel<<<blocks_for(vocab * d), kThreads, 0, s>>>(offsets, positions, d_h, scale, vocab, d, grad);
}

}  // namespace moka::train::cuda
