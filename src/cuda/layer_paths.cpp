// Choosing the CUDA layer's path (docs/ARCHITECTURE.md, "Choosing the path") and the layer
// factories of the CUDA backend.
#include "cuda/layer_paths.hpp"

#include <cuda_runtime.h>

#include "core/megakernel_plan.hpp"
#include "cuda/common/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/megakernel/launch.hpp"

namespace moka::cuda {
namespace {

// Measured at EP=2 on H200s (docs/notes/benchmarks-log.md): the megakernel forward is 0.97-2.06x the
// all-to-all path's for every named shape with an expert intermediate size up to 2880, and
// 0.69-0.72x for mixtral-8x7b (14336), whose few wide experts its 128 x 128 tiles cover worse
// than CUTLASS's 128 x 256.
constexpr int64_t kMegakernelMaxIntermediate = 8192;

// Every rank's buffers are mapped into every other rank's GPU: on one node, every other visible
// GPU must be a peer of this one (NVLink or PCIe peer access).
bool peers_reachable(int world, int device) {
  int devices = 0;
  MOKA_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < world) return false;
  for (int d = 0; d < devices; ++d) {
    int ok = 0;
    if (d != device) MOKA_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, device, d));
    if (d != device && !ok) return false;
  }
  return true;
}

// Whether the megakernel path can run this layer: the buffers' size is known, its tiles fit the
// shape, the configuration is valid on this GPU, and the ranks reach each other's memory.
bool megakernel_applies(const MoeShape& s, int world, int device, const LayerOptions& o) {
  MegakernelConfig c = o.megakernel;
  c.tile_rows = o.tile_rows;
  try {
    supported_plan(s, c, world, o.max_tokens);
    core::validate_megakernel_grid(c, context_sm_count());
  } catch (const Error&) {
    return false;
  }
  return peers_reachable(world, device);
}

}  // namespace

LayerPath choose_path(const MoeShape& shape, int world, int device, const LayerOptions& options) {
  const LayerPath staged = world == 1 ? LayerPath::single_gpu : LayerPath::all_to_all;
  switch (options.path) {
    case LayerPath::single_gpu:
      require(world == 1, ErrorCode::invalid_argument,
              "LayerOptions::path single_gpu runs on one rank, the group has " + std::to_string(world) +
                  " (all_to_all splits the experts over it)");
      return staged;
    case LayerPath::all_to_all:
      require(world > 1, ErrorCode::invalid_argument,
              "LayerOptions::path all_to_all needs a group of more than one rank (one GPU: single_gpu)");
      return staged;
    case LayerPath::megakernel: return LayerPath::megakernel;
    case LayerPath::automatic: break;
  }
  // One GPU: the single-GPU path. Measured on one H200 (docs/notes/benchmarks-log.md, "The layer's fwd+bwd
  // step at EP = 1"): the megakernel path's fwd+bwd is 0.49-0.66x its speed for every named
  // shape at 4096 and 16384 tokens (the forward 1.02-1.36x slower, the backward 1.6-2.4x): with
  // no communication to hide, the comm SMs and the backward megakernel only cost.
  if (world == 1) return staged;
  const bool faster = shape.intermediate <= kMegakernelMaxIntermediate;
  return faster && megakernel_applies(shape, world, device, options) ? LayerPath::megakernel : staged;
}

namespace {
std::unique_ptr<MoeLayer> make_layer(const MoeShape& shape, DeviceGroup* group, std::unique_ptr<DeviceGroup> owned,
                                     const LayerOptions& options) {
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  if (choose_path(shape, group ? group->size() : 1, device, options) == LayerPath::megakernel)
    return make_megakernel_layer(shape, group, std::move(owned), options);
  return make_staged_layer(shape, group, std::move(owned), options, GemmEngine::cutlass);
}
}  // namespace

std::unique_ptr<MoeLayer> make_cuda_moe_layer(const MoeShape& shape, ProcessGroup* group, const LayerOptions& options) {
  if (group == nullptr || group->size() == 1) return make_layer(shape, nullptr, nullptr, options);
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  std::unique_ptr<DeviceGroup> owned = make_nccl_group(*group, device);
  DeviceGroup* g = owned.get();
  return make_layer(shape, g, std::move(owned), options);
}

}  // namespace moka::cuda

namespace moka {
std::unique_ptr<MoeLayer> make_moe_layer(const MoeShape& shape, DeviceGroup* group, const LayerOptions& options) {
  return cuda::make_layer(shape, group, nullptr, options);
}
}  // namespace moka
