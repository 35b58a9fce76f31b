#include "gpu/device_tensors.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "core/routing_gen.hpp"
#include "gpu/cuda_check.hpp"

namespace moka::cli {

// The zeros (and an upload's bytes) are waited for before the constructor (upload) returns: the
// benches run on non-blocking streams (CaseStream), which do not wait for the default stream's
// work, so a kernel enqueued there right after could otherwise run before them and have its
// results zeroed behind it (the kernel lab's grouped-row schedules: mk_backward_core's rows of
// 3072 grouped rows for mixtral-8x7b at 16384 tokens).
DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  const size_t allocated = std::max<size_t>(bytes, 16);
  BENCH_CHECK(cudaMalloc(&data_, allocated));
  cudaError_t zeroed = cudaMemsetAsync(data_, 0, allocated, nullptr);
  if (zeroed == cudaSuccess) zeroed = cudaStreamSynchronize(nullptr);
  if (zeroed != cudaSuccess) cudaFree(std::exchange(data_, nullptr));
  BENCH_CHECK(zeroed);
}
DeviceBuffer::~DeviceBuffer() {
  if (data_) cudaFree(data_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}
void DeviceBuffer::upload(const void* host) {
  // From pageable memory cudaMemcpy may return before the bytes land (CUDA's API sync behavior).
  BENCH_CHECK(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaStreamSynchronize(nullptr));
}

namespace {
int current_device() {
  int device = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  return device;
}
}  // namespace

LayerTensors::LayerTensors(const MoeShape& shape, int64_t tokens, int world)
    : s(shape), T(tokens), E(shape.num_experts / world), device(current_device()) {
  const int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate, routes = T * s.top_k;
  for (DeviceBuffer* b : {&x, &out, &d_out, &d_x}) *b = DeviceBuffer(T * H * 2);
  for (DeviceBuffer* b : {&ids, &w, &d_w}) *b = DeviceBuffer(routes * 4);
  for (DeviceBuffer* b : {&wg, &wu, &wd, &dwg, &dwu, &dwd}) *b = DeviceBuffer(E * I * H * 2);
  for (DeviceBuffer* b : {&wsg, &wsu, &wsd, &dwsg, &dwsu, &dwsd}) *b = DeviceBuffer(Is * H * 2);
}

void LayerTensors::randomize(uint64_t seed, const std::vector<int32_t>& topk_ids) {
  std::mt19937_64 rng(seed);
  const double H = double(s.hidden), I = double(s.intermediate), Is = double(s.shared_intermediate);
  x.fill_normal(1.0, rng());
  d_out.fill_normal(1.0, rng());
  wg.fill_normal(1 / std::sqrt(H), rng());
  wu.fill_normal(1 / std::sqrt(H), rng());
  wd.fill_normal(1 / std::sqrt(I), rng());
  if (s.has_shared()) {
    wsg.fill_normal(1 / std::sqrt(H), rng());
    wsu.fill_normal(1 / std::sqrt(H), rng());
    wsd.fill_normal(1 / std::sqrt(Is), rng());
  }
  std::vector<float> route_weights(topk_ids.size());
  std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
  for (float& v : route_weights) v = uniform(rng);
  ids.upload(topk_ids.data());
  w.upload(route_weights.data());
}

void LayerTensors::randomize_uniform(uint64_t seed) {
  randomize(seed, core::sample_topk_ids({core::RoutingKind::uniform, 0.3, seed}, T, s.top_k, s.num_experts));
}

MoeInputs LayerTensors::inputs() const {
  const Device here = Device::cuda(device);
  return {bf16(x.data(), {T, s.hidden}), TensorView(ids.data(), DType::i32, {T, s.top_k}, here),
          TensorView(w.data(), DType::f32, {T, s.top_k}, here)};
}

MoeWeights LayerTensors::weights() const {
  const int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
  MoeWeights r{bf16(wg.data(), {E, I, H}), bf16(wu.data(), {E, I, H}), bf16(wd.data(), {E, H, I}), {}, {}, {}};
  if (s.has_shared()) {
    r.ws_gate = bf16(wsg.data(), {Is, H});
    r.ws_up = bf16(wsu.data(), {Is, H});
    r.ws_down = bf16(wsd.data(), {H, Is});
  }
  return r;
}

MoeGradients LayerTensors::gradients() const {
  const int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
  MoeGradients g{bf16(d_x.data(), {T, H}),
                 TensorView(d_w.data(), DType::f32, {T, s.top_k}, Device::cuda(device)),
                 bf16(dwg.data(), {E, I, H}),
                 bf16(dwu.data(), {E, I, H}),
                 bf16(dwd.data(), {E, H, I}),
                 {},
                 {},
                 {}};
  if (s.has_shared()) {
    g.d_ws_gate = bf16(dwsg.data(), {Is, H});
    g.d_ws_up = bf16(dwsu.data(), {Is, H});
    g.d_ws_down = bf16(dwsd.data(), {H, Is});
  }
  return g;
}

}  // namespace moka::cli
