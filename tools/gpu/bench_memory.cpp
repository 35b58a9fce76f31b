// bench_memory.hpp: the device memory of a path's layers as a model holds them.
#include "gpu/bench_memory.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <vector>

#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"

namespace moka::cli {
namespace {

// The bench's allocator for the layers it measures: plain cudaMalloc and cudaFree (after the
// stream's work, so that stream-ordered frees stay correct) with exact counts of the bytes out
// and their peak.
class MeasuringAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, Stream) override {
    void* p = nullptr;
    MOKA_CUDA_CHECK(cudaMalloc(&p, bytes));
    in_use_ += int64_t(bytes);
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void deallocate(void* p, size_t bytes, Stream stream) override {
    MOKA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
    MOKA_CUDA_CHECK(cudaFree(p));
    in_use_ -= int64_t(bytes);
  }
  int64_t in_use() const { return in_use_; }
  int64_t peak() const { return peak_; }

 private:
  int64_t in_use_ = 0, peak_ = 0;
};

LayerMemory layer_memory(const MakeLayer& make, const LayerTensors& t, int depth, cudaStream_t s) {
  auto free_bytes = [] {
    size_t free = 0, total = 0;
    MOKA_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  };
  MeasuringAllocator per_call;
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t before = free_bytes();
  LayerMemory m;
  {
    std::vector<std::unique_ptr<MoeLayer>> layers;
    for (int i = 0; i < depth; ++i) layers.push_back(make(&per_call));
    const int64_t rows = t.T * t.s.hidden;
    auto activation = [&] { return cuda::DeviceArray<__nv_bfloat16>(size_t(rows), per_call, s); };
    auto as_view = [&](const cuda::DeviceArray<__nv_bfloat16>& a) { return t.view_of(a.data(), {t.T, t.s.hidden}); };
    // outputs[i]: layer i's output (the last one is the caller's), the next layer's input.
    std::vector<cuda::DeviceArray<__nv_bfloat16>> outputs;
    std::vector<std::unique_ptr<MoeContext>> contexts;
    for (int i = 0; i < depth; ++i) {
      MoeInputs in = t.inputs();
      if (i > 0) in.x = as_view(outputs.back());
      if (i + 1 < depth) outputs.push_back(activation());
      const TensorView out = i + 1 < depth ? as_view(outputs.back()) : t.out_view();
      contexts.push_back(layers[i]->forward(in, t.weights(), out, Stream{s}));
    }
    for (const auto& c : contexts) m.saved_per_layer = std::max(m.saved_per_layer, c->saved_bytes());
    // Backward from the last layer: d_out of layer i is the input gradient of layer i + 1.
    cuda::DeviceArray<__nv_bfloat16> d_out_of_next;
    for (int i = depth - 1; i >= 0; --i) {
      MoeGradients g = t.gradients();
      cuda::DeviceArray<__nv_bfloat16> d_x;
      if (i > 0) {
        d_x = activation();
        g.d_x = as_view(d_x);
      }
      const TensorView d_out = i + 1 < depth ? as_view(d_out_of_next) : t.d_out_view();
      layers[i]->consume_backward(std::move(contexts[i]), d_out, t.weights(), g, Stream{s});
      if (i > 0) outputs.pop_back();  // layer i's input, read by its backward
      d_out_of_next = std::move(d_x);
    }
    MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
    for (auto& l : layers) l->check_errors();
    m.stack_peak = int64_t(before - free_bytes()) + per_call.peak();
  }
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  if (depth == 1) m.workspace_peak = per_call.peak() - m.saved_per_layer;
  return m;
}

}  // namespace

LayerMemory path_memory(const MakeLayer& make, const LayerTensors& t, int depth, cudaStream_t s) {
  LayerMemory m = layer_memory(make, t, 1, s);
  m.peak = m.stack_peak;
  if (depth > 1) m.stack_peak = layer_memory(make, t, depth, s).stack_peak;
  return m;
}

void set_memory(BenchRow& row, const LayerMemory& m, int depth, const TorchResult& torch) {
  auto& e = row.extra;
  e["depth"] = depth;
  e["saved_bytes_per_layer"] = m.saved_per_layer;
  e["workspace_peak_bytes"] = m.workspace_peak;
  e["stack_peak_memory_bytes"] = m.stack_peak;
  e["torch_saved_bytes_per_layer"] = torch.saved_bytes_per_layer > 0 ? nlohmann::ordered_json(torch.saved_bytes_per_layer)
                                                                      : nlohmann::ordered_json();
  const bool same_depth = torch.depth == depth && torch.stack_peak_memory_bytes > 0;
  e["torch_stack_peak_memory_bytes"] =
      same_depth ? nlohmann::ordered_json(torch.stack_peak_memory_bytes) : nlohmann::ordered_json();
  if (same_depth) e["stack_memory_vs_torch"] = double(m.stack_peak) / double(torch.stack_peak_memory_bytes);
}

}  // namespace moka::cli
