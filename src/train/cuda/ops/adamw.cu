// adamw.cuh: a thread per kAdamWPerThread elements of one slot, in 16-byte accesses where the
// slot's arrays allow; the clip factor, learning rate and bias corrections read on the device.
#include "train/cuda/ops/adamw.cuh"
#include "train/cuda/ops/kernel_helpers.cuh"

namespace moka::train::cuda {
namespace {

constexpr int kAdamWPerThread = 4;  // elements per AdamW thread: one 16-byte access per f32 array

// AdamW (optimizer.cpp's arithmetic) of one element, then its EMA and bf16 copy where the slot
// has them.
struct AdamWStep {
  float clip, step_size, decay, bias_correction1, bias_correction2;
};
__device__ __forceinline__ void adamw_element(const AdamWHyper& a, const AdamWStep& s, float raw, float& m, float& v,
                                              float& p, float* ema) {
  const float g = s.clip * raw;
  m = a.beta1 * m + (1 - a.beta1) * g;
  v = a.beta2 * v + (1 - a.beta2) * g * g;
  const float m_hat = m / s.bias_correction1, v_hat = v / s.bias_correction2;
  p = p * s.decay - s.step_size * m_hat / (sqrtf(v_hat) + a.eps);
  if (ema) *ema = a.ema_decay * *ema + (1 - a.ema_decay) * p;
}

__device__ __forceinline__ float grad_at(const TensorSlot& t, int64_t i) {
  return t.grad_bf16 ? __bfloat162float(static_cast<const bf16*>(t.grad)[i]) : static_cast<const float*>(t.grad)[i];
}

// Whether every array of the slot can be read kAdamWPerThread elements at a time (16 bytes of
// f32, 8 of bf16).
__device__ bool adamw_vectorizable(const TensorSlot& t) {
  const auto f32 = reinterpret_cast<uintptr_t>(t.value) | reinterpret_cast<uintptr_t>(t.m) |
                   reinterpret_cast<uintptr_t>(t.v) | reinterpret_cast<uintptr_t>(t.ema);
  const auto narrow = reinterpret_cast<uintptr_t>(t.shadow) | (t.grad_bf16 ? reinterpret_cast<uintptr_t>(t.grad) : 0);
  const auto wide = t.grad_bf16 ? 0 : reinterpret_cast<uintptr_t>(t.grad);
  return (f32 | wide) % 16 == 0 && narrow % 8 == 0;
}

// Block b updates kThreads x kAdamWPerThread elements of the slot whose blocks hold b (a binary
// search over the slots' first blocks); each thread takes kAdamWPerThread consecutive elements
// in 16-byte loads and stores where the slot's arrays allow, one by one otherwise: the same
// arithmetic per element either way, so the same bits.
__global__ void adamw_kernel(AdamWHyper a, const StepScalars* step, const double* grad_sum_squares,
                             const TensorSlot* slots, int count) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (slots[mid].first_block <= int64_t(blockIdx.x)) lo = mid;
    else hi = mid - 1;
  }
  const TensorSlot& t = slots[lo];
  const int64_t first = ((int64_t(blockIdx.x) - t.first_block) * blockDim.x + threadIdx.x) * kAdamWPerThread;
  if (first >= t.n) return;
  const double lr = step->lr;
  const double norm = sqrt(*grad_sum_squares);
  const AdamWStep s{float(a.clip_norm > 0 && norm > a.clip_norm ? a.clip_norm / norm : 1.0),
                    float(lr * t.lr_multiplier), float(1.0 - lr * a.weight_decay * t.weight_decay_multiplier),
                    step->bias_correction1, step->bias_correction2};
  if (first + kAdamWPerThread <= t.n && adamw_vectorizable(t)) {
    float4 m = *reinterpret_cast<const float4*>(t.m + first), v = *reinterpret_cast<const float4*>(t.v + first);
    float4 p = *reinterpret_cast<const float4*>(t.value + first);
    float4 e = t.ema ? *reinterpret_cast<const float4*>(t.ema + first) : float4{};
    float raw[kAdamWPerThread];
    if (t.grad_bf16) {
      const uint2 packed = *reinterpret_cast<const uint2*>(static_cast<const bf16*>(t.grad) + first);
      const auto* g16 = reinterpret_cast<const bf16*>(&packed);
      for (int i = 0; i < kAdamWPerThread; ++i) raw[i] = __bfloat162float(g16[i]);
    } else {
      const float4 g = *reinterpret_cast<const float4*>(static_cast<const float*>(t.grad) + first);
      raw[0] = g.x, raw[1] = g.y, raw[2] = g.z, raw[3] = g.w;
    }
    float* ema = t.ema ? &e.x : nullptr;
    adamw_element(a, s, raw[0], m.x, v.x, p.x, ema);
    adamw_element(a, s, raw[1], m.y, v.y, p.y, ema ? &e.y : nullptr);
    adamw_element(a, s, raw[2], m.z, v.z, p.z, ema ? &e.z : nullptr);
    adamw_element(a, s, raw[3], m.w, v.w, p.w, ema ? &e.w : nullptr);
    *reinterpret_cast<float4*>(t.m + first) = m;
    *reinterpret_cast<float4*>(t.v + first) = v;
    *reinterpret_cast<float4*>(t.value + first) = p;
    if (t.ema) *reinterpret_cast<float4*>(t.ema + first) = e;
    if (t.shadow) {
      bf16 out[kAdamWPerThread] = {__float2bfloat16(p.x), __float2bfloat16(p.y), __float2bfloat16(p.z),
                                   __float2bfloat16(p.w)};
      *reinterpret_cast<uint2*>(t.shadow + first) = *reinterpret_cast<const uint2*>(out);
    }
    return;
  }
  for (int64_t j = first; j < t.n && j < first + kAdamWPerThread; ++j) {
    float m = t.m[j], v = t.v[j], p = t.value[j];
    adamw_element(a, s, grad_at(t, j), m, v, p, t.ema ? t.ema + j : nullptr);
    t.m[j] = m, t.v[j] = v, t.value[j] = p;
    if (t.shadow) t.shadow[j] = __float2bfloat16(p);
  }
}

}  // namespace

int64_t assign_adamw_blocks(TensorSlot* slots, int count) {
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) {
    slots[i].first_block = blocks;
    blocks += blocks_for(slots[i].n, kThreads * kAdamWPerThread);
  }
  return blocks;
}

void adamw_update(const AdamWHyper& a, const StepScalars* step, const double* grad_sum_squares, const TensorSlot* slots,
                  int count, int64_t blocks, cudaStream_t s) {
  adamw_kernel<<<unsigned(blocks), kThreads, 0, s>>>(a, step, grad_sum_squares, slots, count);
}

}  // namespace moka::train::cuda
