// The CUDA layer's paths (LayerOptions::path) and how one is chosen. The staged layer
// (layer/cuda_layer.cu) is the single_gpu and all_to_all paths; the megakernel layer
// (megakernel/layer.cu) runs its forward and its backward as persistent kernels.
#pragma once
#include <cstdint>
#include <memory>

#include "core/megakernel_plan.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "moka/device_group.hpp"
#include "moka/layer.hpp"

namespace moka::cuda {

// `group` null or of one rank: single_gpu, else all_to_all. `owned`: a group the layer keeps
// alive (the one `group` points to), or null.
std::unique_ptr<MoeLayer> make_staged_layer(const MoeShape& shape, DeviceGroup* group,
                                            std::unique_ptr<DeviceGroup> owned, const LayerOptions& options,
                                            GemmEngine engine);
std::unique_ptr<MoeLayer> make_megakernel_layer(const MoeShape& shape, DeviceGroup* group,
                                                std::unique_ptr<DeviceGroup> owned, const LayerOptions& options);

// The worst-case megakernel plan for up to `max_tokens` tokens per rank; Error (naming the field)
// when the GPU megakernel cannot run this shape and configuration over `world` ranks.
core::MegakernelPlan supported_plan(const MoeShape& s, const MegakernelConfig& c, int world, int64_t max_tokens);

// The path LayerOptions::path resolves to for a layer over `world` ranks on `device`. Raises
// invalid_argument when an explicit path cannot run there (single_gpu over several ranks,
// all_to_all on one); the megakernel layer checks its own requirements when built.
LayerPath choose_path(const MoeShape& shape, int world, int device, const LayerOptions& options);

}  // namespace moka::cuda
