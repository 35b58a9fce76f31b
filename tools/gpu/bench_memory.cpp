// bench_memory.hpp: the device memory of a path's layers as a model holds them.
#include "gpu/bench_memory.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <utility>
#include <nlohmann/json.hpp>
#include <vector>

#include "gpu/cuda_check.hpp"

namespace moka::cli {
namespace {

// The bench's allocator for the layers it measures: plain cudaMalloc and cudaFree (after the
// stream's work, so that stream-ordered frees stay correct) with exact counts of the bytes out
// and their peak.
class MeasuringAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, Stream) override {
    void* p = nullptr;
    BENCH_CHECK(cudaMalloc(&p, bytes));
    in_use_ += int64_t(bytes);
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void deallocate(void* p, size_t bytes, Stream stream) override {
    BENCH_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
    BENCH_CHECK(cudaFree(p));
    in_use_ -= int64_t(bytes);
  }
  int64_t in_use() const { return in_use_; }
  int64_t peak() const { return peak_; }

 private:
  int64_t in_use_ = 0, peak_ = 0;
};

// One bf16 activation between stacked layers, from the measured allocator, given back on the
// stream that last used it.
class Activation {
 public:
  Activation() = default;
  Activation(DeviceAllocator& allocator, int64_t values, cudaStream_t s)
      : allocator_(&allocator), bytes_(size_t(values) * sizeof(__nv_bfloat16)), stream_(s) {
    data_ = allocator.allocate(bytes_, Stream{s});
  }
  Activation(Activation&& other) noexcept { *this = std::move(other); }
  Activation& operator=(Activation&& other) noexcept {
    std::swap(allocator_, other.allocator_);
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    std::swap(stream_, other.stream_);
    return *this;
  }
  ~Activation() {
    if (data_) allocator_->deallocate(data_, bytes_, Stream{stream_});
  }
  void* data() const { return data_; }

 private:
  DeviceAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
};

LayerMemory layer_memory(const MakeLayer& make, const LayerTensors& t, int depth, cudaStream_t s) {
  auto free_bytes = [] {
    size_t free = 0, total = 0;
    BENCH_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  };
  MeasuringAllocator per_call;
  BENCH_CHECK(cudaDeviceSynchronize());
  const size_t before = free_bytes();
  LayerMemory m;
  {
    std::vector<std::unique_ptr<MoeLayer>> layers;
    for (int i = 0; i < depth; ++i) layers.push_back(make(&per_call));
    const int64_t rows = t.T * t.s.hidden;
    auto activation = [&] { return Activation(per_call, rows, s); };
    auto as_view = [&](const Activation& a) { return t.bf16(a.data(), {t.T, t.s.hidden}); };
    // outputs[i]: layer i's output (the last one is the caller's), the next layer's input.
    std::vector<Activation> outputs;
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
    Activation d_out_of_next;
    for (int i = depth - 1; i >= 0; --i) {
      MoeGradients g = t.gradients();
      Activation d_x;
      if (i > 0) {
        d_x = activation();
        g.d_x = as_view(d_x);
      }
      const TensorView d_out = i + 1 < depth ? as_view(d_out_of_next) : t.d_out_view();
      layers[i]->consume_backward(std::move(contexts[i]), d_out, t.weights(), g, Stream{s});
      if (i > 0) outputs.pop_back();  // layer i's input, read by its backward
      d_out_of_next = std::move(d_x);
    }
    BENCH_CHECK(cudaStreamSynchronize(s));
    for (auto& l : layers) l->check_errors();
    m.stack_peak = int64_t(before - free_bytes()) + per_call.peak();
  }
  BENCH_CHECK(cudaDeviceSynchronize());
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
  e["torch_saved_bytes_per_layer"] =
      torch.saved_bytes_per_layer > 0 ? nlohmann::ordered_json(torch.saved_bytes_per_layer) : nlohmann::ordered_json();
  const bool same_depth = torch.depth == depth && torch.stack_peak_memory_bytes > 0;
  e["torch_stack_peak_memory_bytes"] =
      same_depth ? nlohmann::ordered_json(torch.stack_peak_memory_bytes) : nlohmann::ordered_json();
  if (same_depth) e["stack_memory_vs_torch"] = double(m.stack_peak) / double(torch.stack_peak_memory_bytes);
}

}  // namespace moka::cli
