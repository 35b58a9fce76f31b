// What every op of the CUDA training path shares (src/train/cuda/ops/, one op or family per
// file). Each op is a stage of the CPU reference (dense_math.hpp, model.cpp, optimizer.cpp), so a
// GPU stage that goes wrong is found by diffing it against its CPU twin (tests/train/gpu). fp32 in
// and out unless a bf16 pointer is named. Determinism: no floating-point atomics; every output
// element has one writer and a fixed summation order (warp butterflies, per-block partials in
// block order), so a run repeats bit for bit on the same GPU. All launches go to `stream`.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moka::train::cuda {

using bf16 = __nv_bfloat16;

}  // namespace moka::train::cuda
