// The optimizer step over every tensor in one launch: optimizer.cpp's AdamW (decoupled weight
// decay, global-norm clipping) with WeightEma's update and the bf16 copies fused in. The tensors
// are a device table of slots; their gradient norm is reduce.cuh's grad_square_partials.
#pragma once
#include "train/cuda/ops/op_common.cuh"
#include "train/optimizer.hpp"

namespace moka::train::cuda {

// One optimized tensor, as the multi-tensor kernels read it (a device table of these).
struct TensorSlot {
  float *value = nullptr, *m = nullptr, *v = nullptr;
  float* ema = nullptr;    // null without EMA
  bf16* shadow = nullptr;  // the bf16 copy the moka layers read, or null
  const void* grad = nullptr;
  bool grad_bf16 = false;
  int64_t n = 0;
  int64_t first_block = 0;  // of the AdamW launch: the blocks of the tensors before it
  double lr_multiplier = 1, weight_decay_multiplier = 1;
};
// Sets every slot's first_block; returns the AdamW launch's block count.
int64_t assign_adamw_blocks(TensorSlot* slots, int count);

// What changes from step to step, read from device memory so a captured step replays it.
struct StepScalars {
  double lr = 0;                                     // peak LR x the schedule's factor
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t
};
// AdamW over every slot in one launch (optimizer.cpp's arithmetic, decoupled weight decay), with
// the global-norm clip factor computed on the device from grad_sum_squares, then (where a slot
// has them) the EMA update and the bf16 copy.
struct AdamWHyper {
  double weight_decay = 0;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  double clip_norm = 0;  // 0 = no clipping
  float ema_decay = 0;
  AdamWHyper(const AdamWConfig& a, double ema)
      : weight_decay(a.weight_decay), beta1(float(a.beta1)), beta2(float(a.beta2)), eps(float(a.eps)),
        clip_norm(a.clip_norm), ema_decay(float(ema)) {}
};
void adamw_update(const AdamWHyper& a, const StepScalars* step, const double* grad_sum_squares, const TensorSlot* slots,
                  int count, int64_t blocks, cudaStream_t stream);

}  // namespace moka::train::cuda
