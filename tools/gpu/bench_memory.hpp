// `moka bench`'s measure of a path's device memory as a model holds it (docs/PERFORMANCE.md,
// "Memory"): a stack of layers, forwards first, then backwards, with a counting allocator.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "bench_report.hpp"
#include "gpu/device_tensors.hpp"
#include "moka/allocator.hpp"
#include "moka/layer.hpp"

namespace moka::cli {

// What a path's layers hold in device memory, as a model holds them: `depth` layers (the same
// weights; each layer's output the next one's input), forward through all, then backward
// through all in reverse. `stack_peak`: the most held at once: what the layers keep for their
// life (buffers, GEMM workspaces, rings: the drop of cudaMemGetInfo's free bytes from before the
// layers were built to after the step, every call's memory back) plus the peak of the per-call
// memory (contexts, scratch, and in a stack of more than one the layer outputs and input
// gradients between the layers, which a model holds too). `saved_per_layer`: what one context
// keeps between its forward and its backward (MoeContext::saved_bytes); `workspace_peak`: the
// per-call memory's peak beyond the saved contexts, in a stack of one. The caller's inputs,
// weights and gradients exist before and are not counted, as torch's numbers do not count its
// own. Run it after the path was timed (lazily loaded modules and NCCL buffers not counted).
struct LayerMemory {
  int64_t stack_peak = 0, saved_per_layer = 0, workspace_peak = 0;
  int64_t peak = 0;  // stack_peak of a stack of one (path_memory)
};
using MakeLayer = std::function<std::unique_ptr<MoeLayer>(DeviceAllocator*)>;

// A path's memory in a stack of one (peak_memory_bytes, saved and workspace bytes) and of `depth`.
LayerMemory path_memory(const MakeLayer& make, const LayerTensors& t, int depth, cudaStream_t s);

// The memory columns of a row (extra JSON; docs/PERFORMANCE.md "Memory"), torch's beside them.
void set_memory(BenchRow& row, const LayerMemory& m, int depth, const TorchResult& torch);

}  // namespace moka::cli
