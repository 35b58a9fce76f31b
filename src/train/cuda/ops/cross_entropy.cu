// cross_entropy.cuh: a warp per row (max, sum of exponentials, then the gradient). The mean over
// rows is reduce.cuh's fixed-order sum of row_loss.
#include <cfloat>

#include "train/cuda/ops/cross_entropy.cuh"
#include "train/cuda/ops/kernel_helpers.cuh"

namespace moka::train::cuda {
namespace {

__global__ void cross_entropy_kernel(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                                     float* row_loss, float* d_logits) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float* l = logits + r * vocab;
  float mx = -FLT_MAX;
  for (int64_t v = lane; v < vocab; v += 32) mx = fmaxf(mx, l[v]);
  mx = warp_max(mx);
  float sum = 0;
  for (int64_t v = lane; v < vocab; v += 32) sum += expf(l[v] - mx);
  const float lse = mx + logf(warp_sum(sum));
  const int32_t t = targets[r];
  if (lane == 0) row_loss[r] = lse - l[t];
  for (int64_t v = lane; v < vocab; v += 32)
    d_logits[r * vocab + v] = (expf(l[v] - lse) - (v == t ? 1.0f : 0.0f)) / float(rows);
}

}  // namespace

void cross_entropy(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* row_loss,
                   float* d_logits, cudaStream_t s) {
  cross_entropy_kernel<<<blocks_for(rows, kWarps), kThreads, 0, s>>>(logits, targets, rows, vocab, row_loss, d_logits);
}

}  // namespace moka::train::cuda
