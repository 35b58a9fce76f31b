// Owning device tensors of one layer case (inputs, weights, gradients) with the views the API
// takes: used by `moka bench --backend cuda` and the GPU tests at full model sizes, where host
// copies of the weights would not fit.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "moka/layer.hpp"

namespace moka::cuda {

// Device bytes behind a tensor of any dtype (the fixtures hold tensors of several): a
// DeviceArray, typed where it is used.
class DeviceMemory : public DeviceArray<std::byte> {
 public:
  using DeviceArray<std::byte>::DeviceArray;
  template <typename T>
  T* as() const { return reinterpret_cast<T*>(data()); }
  // N(0, stddev) bf16 contents (never zeros: they hide unwritten outputs and time faster).
  void fill_normal(double stddev, uint64_t seed) {
    fill_normal_bf16(as<bf16>(), int64_t(bytes() / sizeof(bf16)), seed, float(stddev), nullptr);
  }
};

// The single-GPU receive schedule of a case's routing: routed rows per expert, padded segment
// starts and each slot's grouped row (build_schedule, which also checks the routing).
struct GroupedSchedule {
  int64_t rows;  // rows a grouped buffer needs: every route plus each expert's worst padding
  DeviceMemory chunk_counts, counts, offsets, row_of_slot, error;
  GroupedSchedule(const int32_t* ids, const float* weights, const MoeShape& sh, int64_t tokens, int64_t tile_rows,
                  cudaStream_t s)
      : rows(tokens * sh.top_k + sh.num_experts * (tile_rows - 1)),
        chunk_counts(schedule_chunks(tokens * sh.top_k) * sh.num_experts * 4), counts(sh.num_experts * 4),
        offsets((sh.num_experts + 1) * 4), row_of_slot(tokens * sh.top_k * 4), error(8) {
    MOKA_CUDA_CHECK(cudaMemset(error.data(), 0xFF, 8));
    DeviceSchedule d;
    d.slots = tokens * sh.top_k, d.num_experts = sh.num_experts, d.global_experts = sh.num_experts;
    d.tile_rows = tile_rows, d.top_k = sh.top_k;
    d.chunk_counts = chunk_counts.as<int32_t>(), d.counts = counts.as<int32_t>();
    d.offsets = offsets.as<int32_t>(), d.row_of_slot = row_of_slot.as<int32_t>();
    d.error = error.as<unsigned long long>();
    build_schedule(d, ids, weights, s);
  }
};

struct DeviceLayerTensors {
  MoeShape s;
  int64_t T, E;
  int device;
  DeviceMemory x, ids, w, out, d_out, d_x, d_w, wg, wu, wd, wsg, wsu, wsd, dwg, dwu, dwd, dwsg, dwsu, dwsd;

  // `world`: the experts are split over that many ranks; this rank holds E / world of them.
  DeviceLayerTensors(const MoeShape& sh, int64_t t, int world = 1)
      : s(sh), T(t), E(sh.num_experts / world), device(current_device()), x(t * sh.hidden * 2),
        ids(t * sh.top_k * 4), w(t * sh.top_k * 4), out(x.bytes()), d_out(x.bytes()), d_x(x.bytes()), d_w(w.bytes()),
        wg(E * sh.intermediate * sh.hidden * 2),
        wu(wg.bytes()), wd(wg.bytes()), wsg(sh.shared_intermediate * sh.hidden * 2), wsu(wsg.bytes()), wsd(wsg.bytes()),
        dwg(wg.bytes()), dwu(wg.bytes()), dwd(wg.bytes()), dwsg(wsg.bytes()), dwsu(wsg.bytes()), dwsd(wsg.bytes()) {}

  // Random x, d_out, weights N(0, 1/fan_in), router weights U(0.1, 1), the given routing.
  void randomize(uint64_t seed, const std::vector<int32_t>& topk_ids) {
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
    std::vector<float> wt(topk_ids.size());
    std::uniform_real_distribution<float> uw(0.1f, 1.0f);
    for (auto& v : wt) v = uw(rng);
    MOKA_CUDA_CHECK(cudaMemcpy(ids.data(), topk_ids.data(), ids.bytes(), cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(w.data(), wt.data(), w.bytes(), cudaMemcpyHostToDevice));
  }

  // 0xFF bytes (NaN in bf16 and f32) in every output.
  void poison() {
    for (DeviceMemory* m : {&out, &d_x, &d_w, &dwg, &dwu, &dwd, &dwsg, &dwsu, &dwsd})
      MOKA_CUDA_CHECK(cudaMemset(m->data(), 0xFF, m->bytes()));
  }

  MoeInputs inputs() const {
    return {view(x, DType::bf16, {T, s.hidden}), view(ids, DType::i32, {T, s.top_k}),
            view(w, DType::f32, {T, s.top_k})};
  }
  MoeWeights weights() const {
    const int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
    MoeWeights r{view(wg, DType::bf16, {E, I, H}), view(wu, DType::bf16, {E, I, H}), view(wd, DType::bf16, {E, H, I}),
                 {}, {}, {}};
    if (s.has_shared()) {
      r.ws_gate = view(wsg, DType::bf16, {Is, H});
      r.ws_up = view(wsu, DType::bf16, {Is, H});
      r.ws_down = view(wsd, DType::bf16, {H, Is});
    }
    return r;
  }
  MoeGradients gradients() const {
    const int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
    MoeGradients g{view(d_x, DType::bf16, {T, H}), view(d_w, DType::f32, {T, s.top_k}),
                   view(dwg, DType::bf16, {E, I, H}), view(dwu, DType::bf16, {E, I, H}),
                   view(dwd, DType::bf16, {E, H, I}), {}, {}, {}};
    if (s.has_shared()) {
      g.d_ws_gate = view(dwsg, DType::bf16, {Is, H});
      g.d_ws_up = view(dwsu, DType::bf16, {Is, H});
      g.d_ws_down = view(dwsd, DType::bf16, {H, Is});
    }
    return g;
  }
  TensorView out_view() const { return view(out, DType::bf16, {T, s.hidden}); }
  TensorView d_out_view() const { return view(d_out, DType::bf16, {T, s.hidden}); }

  // A bf16 tensor of this case's device at `data` (the bench's activations between layers).
  TensorView view_of(void* data, std::initializer_list<int64_t> dims) const {
    return TensorView(data, DType::bf16, dims, Device::cuda(device));
  }
  TensorView view(const DeviceMemory& m, DType t, std::initializer_list<int64_t> dims) const {
    return TensorView(m.data(), t, dims, Device::cuda(device));
  }
  static int current_device() {
    int d = 0;
    MOKA_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
};

}  // namespace moka::cuda
