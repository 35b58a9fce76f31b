// RMSNorm with the residual add before it fused in (dense_math.hpp's rmsnorm and its backward).
#pragma once
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

// The residual add and the RMSNorm after it, in one pass per row: s = x (+ delta, f32 or bf16,
// when one is given), written to `sum` and `saved` where given (`sum` may be x itself: the
// residual stream updated in place); then y = s / rms(s) * gain into y (f32) and/or yb (bf16)
// (either may be null); inv_rms [rows].
struct ResidualDelta {
  const float* f32 = nullptr;
  const bf16* b16 = nullptr;
};
void residual_rmsnorm_forward(const float* x, ResidualDelta delta, float* sum, float* saved, const float* gain,
                              int64_t rows, int64_t d, float eps, float* y, bf16* yb, float* inv_rms,
                              cudaStream_t stream);
// The gradient reaching a norm's output: f32, or the sum of up to two bf16 tensors (the MoE
// layer's and the router's d_x), added in that order in fp32.
struct NormGrad {
  const float* f32 = nullptr;
  const bf16* b16[2] = {nullptr, nullptr};
};
// dx = inv_rms * (gain*dy - xhat * mean(gain*dy*xhat)), written or (accumulate) added, and its
// bf16 copy into dx16 when given; d_gain = sum over rows of dy*xhat (overwritten), summed in
// kNormGainChunks chunks of rows, each in row order, then the chunks in order; gain_partials:
// scratch of kNormGainChunks * d floats.
inline constexpr int kNormGainChunks = 64;
void rmsnorm_backward(const float* x, const float* gain, const float* inv_rms, NormGrad dy, int64_t rows, int64_t d,
                      bool accumulate, float* dx, bf16* dx16, float* d_gain, float* gain_partials, cudaStream_t stream);

}  // namespace moka::train::cuda
