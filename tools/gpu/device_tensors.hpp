// Device tensors of one layer case, on the public API and the CUDA runtime only: owning buffers
// with random contents and the TensorViews a MoeLayer takes. `moka bench`, the kernel lab and the
// GPU tests allocate their device memory with these. At full model sizes host copies of the
// weights would not fit, so everything is made on the device.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "moka/layer.hpp"

namespace moka::cli {

// cudaMalloc'ed bytes on the current device, freed by their owner. Zeroed once, so that no
// kernel reads memory nobody wrote (compute-sanitizer's initcheck runs the GPU tests), and at
// least 16 bytes, so that even an empty buffer has an address a TMA descriptor takes: as the
// library's own arrays. The zeros (and upload's bytes) are in place when the call returns, so
// work on any stream, a non-blocking one included, may follow it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  // N(0, stddev) bf16 values over the whole buffer: never zeros, which hide unwritten outputs
  // and time faster than real data.
  void fill_normal(double stddev, uint64_t seed);
  void upload(const void* host);  // bytes() from the host

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// One rank's inputs, weights, outputs and gradients of a bf16 layer case.
struct LayerTensors {
  MoeShape s;
  int64_t T, E;  // tokens, local experts
  int device;
  DeviceBuffer x, ids, w, out, d_out, d_x, d_w, wg, wu, wd, wsg, wsu, wsd, dwg, dwu, dwd, dwsg, dwsu, dwsd;

  // `world`: the experts are split over that many ranks; this rank holds E / world of them.
  LayerTensors(const MoeShape& shape, int64_t tokens, int world = 1);
  // Random x, d_out, weights N(0, 1/fan_in), route weights U(0.1, 1), the given routing.
  void randomize(uint64_t seed, const std::vector<int32_t>& topk_ids);
  // The same with uniform routing: bench/torch_baseline.py routes uniformly at random too, so
  // expert loads match in distribution (the draws themselves differ).
  void randomize_uniform(uint64_t seed);

  MoeInputs inputs() const;
  MoeWeights weights() const;
  MoeGradients gradients() const;
  TensorView out_view() const { return bf16(out.data(), {T, s.hidden}); }
  TensorView d_out_view() const { return bf16(d_out.data(), {T, s.hidden}); }
  // A bf16 tensor of this case's device at `data` (activations between stacked layers).
  TensorView bf16(void* data, std::initializer_list<int64_t> dims) const {
    return TensorView(data, DType::bf16, dims, Device::cuda(device));
  }
};

}  // namespace moka::cli
