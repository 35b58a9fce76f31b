// The CUDA backend's entry points (used by src/backend.cpp, the GPU tests and `moka bench`).
#pragma once
#include <cuda_runtime.h>

#include <memory>

#include "moka/layer.hpp"
#include "moka/router.hpp"

namespace moka::cuda {

int device_count();

// The bf16 layer on the current device, on the path LayerOptions::path picks; with a group of
// several ranks its experts are split over them (a new NCCL communicator). Inputs, weights and gradients are device
// TensorViews: bf16, topk_weights/d_topk_weights f32.
// One forward may be in flight per layer: its context refers to the layer's workspace, and
// backward with an older context is an error. On one rank the first call with a token count
// allocates the workspace (not capturable); later calls with that count only launch kernels on
// the given stream and can be captured in a CUDA graph. Across ranks each call synchronizes once
// (the exchanged count table), so it is not capturable.
std::unique_ptr<MoeLayer> make_cuda_moe_layer(const MoeShape& shape, ProcessGroup* group, const LayerOptions& options);
// The same layer with every grouped GEMM replaced by a per-expert cuBLAS loop that reads the
// group sizes on the host: the comparison baseline of `moka bench`.
std::unique_ptr<MoeLayer> make_cuda_baseline_layer(const MoeShape& shape, const LayerOptions& options);

std::unique_ptr<Router> make_cuda_router(const RouterConfig& config, const LayerOptions& options);

}  // namespace moka::cuda
