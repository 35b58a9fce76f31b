// rmsnorm.cuh: a warp per row for the forward and the input gradient; the gain gradient, a sum
// over rows, in two fixed-order passes (chunks of rows, then the chunks).
#include "train/cuda/ops/kernel_helpers.cuh"
#include "train/cuda/ops/rmsnorm.cuh"

namespace moka::train::cuda {
namespace {

// One warp per row. Each lane reads back only the elements it wrote, so `sum` may alias x.
__global__ void residual_rmsnorm_kernel(const float* x, ResidualDelta delta, float* sum, float* saved,
                                        const float* gain, int64_t rows, int64_t d, float eps, float* y, bf16* yb,
                                        float* inv_rms) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int64_t row = r * d;
  auto at = [&](int64_t i) {
    float v = x[row + i];
    if (delta.f32) v += delta.f32[row + i];
    if (delta.b16) v += __bfloat162float(delta.b16[row + i]);
    return v;
  };
  float ss = 0;
  for (int64_t i = lane; i < d; i += 32) {
    const float v = at(i);
    if (sum) sum[row + i] = v;
    if (saved) saved[row + i] = v;
    ss += v * v;
  }
  const float* s = sum ? sum : x;
  const float inv = 1.0f / sqrtf(warp_sum(ss) / float(d) + eps);
  if (lane == 0) inv_rms[r] = inv;
  for (int64_t i = lane; i < d; i += 32) {
    const float v = (sum ? s[row + i] : at(i)) * inv * gain[i];
    if (y) y[row + i] = v;
    if (yb) yb[row + i] = __float2bfloat16(v);
  }
}

__device__ float norm_grad_at(const NormGrad& g, int64_t i) {
  if (g.f32) return g.f32[i];
  float v = __bfloat162float(g.b16[0][i]);
  if (g.b16[1]) v += __bfloat162float(g.b16[1][i]);
  return v;
}

__global__ void rmsnorm_backward_rows(const float* x, const float* gain, const float* inv_rms, NormGrad dy,
                                      int64_t rows, int64_t d, bool accumulate, float* dx, bf16* dx16) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float inv = inv_rms[r];
  const float* xr = x + r * d;
  float dot = 0;
  for (int64_t i = lane; i < d; i += 32) dot += gain[i] * norm_grad_at(dy, r * d + i) * xr[i] * inv;
  const float mean = warp_sum(dot) / float(d);
  for (int64_t i = lane; i < d; i += 32) {
    const float v = inv * (gain[i] * norm_grad_at(dy, r * d + i) - xr[i] * inv * mean);
    const float out = accumulate ? dx[r * d + i] + v : v;
    dx[r * d + i] = out;
    if (dx16) dx16[r * d + i] = __float2bfloat16(out);
  }
}

// Pass 1 of the gain gradient: thread (column, chunk) sums dy*xhat over the chunk's rows in
// order; pass 2 sums the chunks in order. The chunks give the GPU d * kNormGainChunks threads:
// d threads alone, each a chain of `rows` dependent adds, leave it nearly idle.
__global__ void rmsnorm_gain_partials(const float* x, const float* inv_rms, NormGrad dy, int64_t rows, int64_t d,
                                      float* partials) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d) return;
  const int64_t per_chunk = (rows + kNormGainChunks - 1) / kNormGainChunks;
  const int64_t first = blockIdx.y * per_chunk, last = min(rows, first + per_chunk);
  float acc = 0;
  for (int64_t r = first; r < last; ++r) acc += norm_grad_at(dy, r * d + i) * x[r * d + i] * inv_rms[r];
  partials[blockIdx.y * d + i] = acc;
}

__global__ void rmsnorm_gain_sum(const float* partials, int64_t d, float* d_gain) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= d) return;
  float acc = 0;
  for (int c = 0; c < kNormGainChunks; ++c) acc += partials[c * d + i];
  d_gain[i] = acc;
}

}  // namespace

void residual_rmsnorm_forward(const float* x, ResidualDelta delta, float* sum, float* saved, const float* gain,
                              int64_t rows, int64_t d, float eps, float* y, bf16* yb, float* inv_rms, cudaStream_t s) {
  residual_rmsnorm_kernel<<<blocks_for(rows, kWarps), kThreads, 0, s>>>(x, delta, sum, saved, gain, rows, d, eps, y, yb,
                                                                        inv_rms);
}

void rmsnorm_backward(const float* x, const float* gain, const float* inv_rms, NormGrad dy, int64_t rows, int64_t d,
                      bool accumulate, float* dx, bf16* dx16, float* d_gain, float* gain_partials, cudaStream_t s) {
  rmsnorm_backward_rows<<<blocks_for(rows, kWarps), kThreads, 0, s>>>(x, gain, inv_rms, dy, rows, d, accumulate, dx,
                                                                      dx16);
  rmsnorm_gain_partials<<<dim3(blocks_for(d), kNormGainChunks), kThreads, 0, s>>>(x, inv_rms, dy, rows, d,
                                                                                  gain_partials);
  rmsnorm_gain_sum<<<blocks_for(d), kThreads, 0, s>>>(gain_partials, d, d_gain);
}

}  // namespace moka::train::cuda
