// GPU test helpers: one layer case with fp64 host tensors (the reference's), their bf16 copies
// on the device, and the device outputs read back (as double) for comparison.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/routing_gen.hpp"
#include "cpu/expert_math.hpp"
#include "cuda/common/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "gpu/device_tensors.hpp"
#include "layer_buffers.hpp"
#include "megakernel_options.hpp"
#include "moka/device_group.hpp"
#include "moka/layer.hpp"

namespace moka::gpu_test {

inline std::vector<__nv_bfloat16> to_bf16(const std::vector<double>& v) {
  std::vector<__nv_bfloat16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16(static_cast<float>(v[i]));
  return o;
}
// Rounds values to bf16 in place, so the reference computes on exactly the GPU's inputs.
inline void round_bf16(std::vector<double>& v) {
  for (auto& x : v) x = static_cast<double>(__bfloat162float(__float2bfloat16(static_cast<float>(x))));
}

// A seed that differs every run (fresh random inputs), printed so a failure can be replayed.
inline uint64_t fresh_seed() {
  const uint64_t s = std::random_device{}() ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(s));
  return s;
}

inline MoeShape shape(int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is = 0, bool clamped = false) {
  return MoeShape{H, I, E, k, Is, clamped ? Activation::swiglu_clamped : Activation::swiglu, 7.0f};
}

// A megakernel config for tests, with the tests' wait bound.
inline MegakernelConfig megakernel_config(int comm_sms, int64_t minibatch, int64_t macrobatch) {
  MegakernelConfig c;
  c.num_comm_sms = comm_sms;
  c.minibatch_size = minibatch;
  c.macrobatch_size = macrobatch;
  c.spin_timeout_seconds = fixtures::test_spin_timeout();
  return c;
}

// Whether every 16-bit half of a device buffer holds the NaN a failed call fills its outputs with.
inline bool all_nan(const void* data, size_t bytes) {
  std::vector<uint16_t> h(bytes / 2);
  MOKA_CUDA_CHECK(cudaMemcpy(h.data(), data, bytes, cudaMemcpyDeviceToHost));
  for (uint16_t v : h)
    if (v != 0x7fc0) return false;
  return true;
}

using fixtures::megakernel_options;

// Captures enqueue(stream) (moka calls on the given fresh stream) into a CUDA graph, then
// replays it `replays` times; after(i) runs once replay i has finished.
template <class Enqueue, class After>
void replay_in_graph(Enqueue&& enqueue, int replays, After&& after) {
  cudaStream_t stream;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  MOKA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue(Stream{stream});
  MOKA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOKA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < replays; ++i) {
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());  // the caller's poisoning (other streams) is done
    MOKA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    after(i);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

using DeviceTensor = cli::DeviceBuffer;

// 0xFF bytes (NaN in bf16 and f32) in every output of a case held on the device only.
inline void poison(const cli::LayerTensors& t) {
  for (const DeviceTensor* m : {&t.out, &t.d_x, &t.d_w, &t.dwg, &t.dwu, &t.dwd, &t.dwsg, &t.dwsu, &t.dwsd})
    MOKA_CUDA_CHECK(cudaMemset(m->data(), 0xFF, m->bytes()));
}

// A layer case: host reference buffers and device bf16 copies of inputs, weights and outputs.
inline int current_device() {
  int d = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

// Raw bytes of a device tensor (determinism checks compare bits).
inline std::vector<uint8_t> bytes_of(const DeviceTensor& t) {
  std::vector<uint8_t> b(t.bytes());
  MOKA_CUDA_CHECK(cudaMemcpy(b.data(), t.data(), b.size(), cudaMemcpyDeviceToHost));
  return b;
}

struct GpuCase {
  cli::LayerBuffers<double> ref;
  int device = current_device();  // the GPU the case's tensors live on
  DeviceTensor x, ids, w, out, d_out, d_x, d_w;
  DeviceTensor wg, wu, wd, wsg, wsu, wsd, dwg, dwu, dwd, dwsg, dwsu, dwsd;

  GpuCase(const MoeShape& s, int64_t T, uint64_t seed) : GpuCase(random_buffers(s, T, seed)) {}

  // A case from given buffers (one rank's, for any world size), rounded to what the GPU stores.
  explicit GpuCase(cli::LayerBuffers<double> buffers) : ref(std::move(buffers)) {
    for (auto* v : {&ref.x, &ref.d_out, &ref.w_gate, &ref.w_up, &ref.w_down, &ref.ws_gate, &ref.ws_up, &ref.ws_down})
      round_bf16(*v);
    for (auto& v : ref.topk_weights) v = static_cast<double>(static_cast<float>(v));
  }

  static cli::LayerBuffers<double> random_buffers(const MoeShape& s, int64_t T, uint64_t seed) {
    cli::LayerBuffers<double> b(s, 1, T);
    b.randomize(seed);
    return b;
  }

  // The device copies in the order of ref.inputs_and_weights() and ref.outputs(); entry kScalars
  // (topk_weights, d_topk_weights) is f32, every other bf16.
  static constexpr size_t kScalars = 2;
  std::array<DeviceTensor*, 9> device_inputs() { return {&x, &d_out, &w, &wg, &wu, &wd, &wsg, &wsu, &wsd}; }
  std::array<DeviceTensor*, 9> device_outputs() { return {&out, &d_x, &d_w, &dwg, &dwu, &dwd, &dwsg, &dwsu, &dwsd}; }
  std::array<const DeviceTensor*, 9> device_outputs() const {
    return {&out, &d_x, &d_w, &dwg, &dwu, &dwd, &dwsg, &dwsu, &dwsd};
  }
  static size_t element_bytes(size_t i) { return i == kScalars ? 4 : 2; }

  // Uploads inputs (after the caller set ref.topk_ids) and poisons every device output.
  void upload() {
    const auto host_in = ref.inputs_and_weights();
    const auto dev_in = device_inputs();
    for (size_t i = 0; i < dev_in.size(); ++i) {
      const std::vector<double>& h = *host_in[i];
      *dev_in[i] = DeviceTensor(h.size() * element_bytes(i));
      if (i == kScalars) {
        const std::vector<float> f(h.begin(), h.end());
        MOKA_CUDA_CHECK(cudaMemcpy(dev_in[i]->data(), f.data(), dev_in[i]->bytes(), cudaMemcpyHostToDevice));
      } else {
        const auto b = to_bf16(h);
        MOKA_CUDA_CHECK(cudaMemcpy(dev_in[i]->data(), b.data(), dev_in[i]->bytes(), cudaMemcpyHostToDevice));
      }
    }
    ids = DeviceTensor(ref.topk_ids.size() * 4);
    MOKA_CUDA_CHECK(cudaMemcpy(ids.data(), ref.topk_ids.data(), ids.bytes(), cudaMemcpyHostToDevice));
    const auto host_out = ref.outputs();
    const auto dev_out = device_outputs();
    for (size_t i = 0; i < dev_out.size(); ++i) *dev_out[i] = DeviceTensor(host_out[i]->size() * element_bytes(i));
    poison();
  }

  // 0xFF bytes: NaN in bf16 and f32, so an unwritten element fails every comparison.
  void poison() {
    for (DeviceTensor* t : device_outputs()) MOKA_CUDA_CHECK(cudaMemset(t->data(), 0xFF, t->bytes()));
  }

  // The reference's views (shapes), moved onto the device copies.
  TensorView on_device(TensorView v, const DeviceTensor& d, DType dtype) const {
    if (v.empty()) return v;  // an absent shared expert stays absent
    v.data = d.data();
    v.dtype = dtype;
    v.device = Device::cuda(device);
    return v;
  }
  MoeInputs inputs() {
    const MoeInputs h = ref.inputs();
    return {on_device(h.x, x, DType::bf16), on_device(h.topk_ids, ids, DType::i32),
            on_device(h.topk_weights, w, DType::f32)};
  }
  MoeWeights weights() {
    const MoeWeights h = ref.weights();
    return {on_device(h.w_gate, wg, DType::bf16), on_device(h.w_up, wu, DType::bf16),
            on_device(h.w_down, wd, DType::bf16), on_device(h.ws_gate, wsg, DType::bf16),
            on_device(h.ws_up, wsu, DType::bf16), on_device(h.ws_down, wsd, DType::bf16)};
  }
  MoeGradients gradients() {
    const MoeGradients h = ref.gradients();
    return {on_device(h.d_x, d_x, DType::bf16),      on_device(h.d_topk_weights, d_w, DType::f32),
            on_device(h.d_w_gate, dwg, DType::bf16), on_device(h.d_w_up, dwu, DType::bf16),
            on_device(h.d_w_down, dwd, DType::bf16), on_device(h.d_ws_gate, dwsg, DType::bf16),
            on_device(h.d_ws_up, dwsu, DType::bf16), on_device(h.d_ws_down, dwsd, DType::bf16)};
  }
  TensorView out_view() { return on_device(ref.out_view(), out, DType::bf16); }
  TensorView d_out_view() { return on_device(ref.d_out_view(), d_out, DType::bf16); }

  // Device outputs as LayerBuffers<double> (inputs copied from ref), for max_layer_error.
  cli::LayerBuffers<double> download() const {
    cli::LayerBuffers<double> got = ref;
    const auto host_out = got.outputs();
    const auto dev_out = device_outputs();
    for (size_t i = 0; i < dev_out.size(); ++i) {
      std::vector<double>& h = *host_out[i];
      if (i == kScalars) {
        std::vector<float> f(h.size());
        MOKA_CUDA_CHECK(cudaMemcpy(f.data(), dev_out[i]->data(), f.size() * 4, cudaMemcpyDeviceToHost));
        h.assign(f.begin(), f.end());
      } else {
        std::vector<__nv_bfloat16> b(h.size());
        MOKA_CUDA_CHECK(cudaMemcpy(b.data(), dev_out[i]->data(), b.size() * 2, cudaMemcpyDeviceToHost));
        for (size_t j = 0; j < h.size(); ++j) h[j] = __bfloat162float(b[j]);
      }
    }
    return got;
  }

  // Raw bytes of every output (determinism checks compare bits).
  std::vector<uint8_t> output_bytes() const {
    std::vector<uint8_t> all;
    for (const DeviceTensor* t : device_outputs()) {
      const auto b = bytes_of(*t);
      all.insert(all.end(), b.begin(), b.end());
    }
    return all;
  }
};

// Helpers of the CUDA layer's tests (test_cuda_layer*.cpp).
inline void route(GpuCase& c, core::RoutingKind kind, uint64_t seed) {
  const auto& s = c.ref.shape;
  c.ref.topk_ids = core::sample_topk_ids({kind, 0.5, seed}, c.ref.tokens, s.top_k, s.num_experts);
}

// A case of `tokens` random tokens from `seed` with skewed (Zipf) routing, uploaded.
inline GpuCase routed_case(const MoeShape& s, int64_t tokens, uint64_t seed) {
  GpuCase c(s, tokens, seed);
  route(c, core::RoutingKind::zipf, seed + 1);
  c.upload();
  return c;
}

// One forward and backward on `stream`, waited for.
inline void run_gpu(MoeLayer& layer, GpuCase& c, cudaStream_t stream = nullptr) {
  auto ctx = layer.forward(c.inputs(), c.weights(), c.out_view(), Stream{stream});
  layer.backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), Stream{stream});
  MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// bf16 outputs: ~3 roundings deep; max|diff| / max|ref| per tensor.
inline void expect_close(const cli::LayerBuffers<double>& got, const cli::LayerBuffers<double>& ref, double tol) {
  auto check = [&](const char* name, const std::vector<double>& a, const std::vector<double>& r) {
    if (r.empty()) return;
    const double e = cli::max_rel_error(a, r);
    EXPECT_LE(e, tol) << name << " relative error " << e;
  };
  check("out", got.out, ref.out);
  check("d_x", got.d_x, ref.d_x);
  check("d_topk_weights", got.d_topk_weights, ref.d_topk_weights);
  check("d_w_gate", got.d_w_gate, ref.d_w_gate);
  check("d_w_up", got.d_w_up, ref.d_w_up);
  check("d_w_down", got.d_w_down, ref.d_w_down);
  check("d_ws_gate", got.d_ws_gate, ref.d_ws_gate);
  check("d_ws_up", got.d_ws_up, ref.d_ws_up);
  check("d_ws_down", got.d_ws_down, ref.d_ws_down);
}

// The fp64 CPU reference's outputs and gradients into c.ref.
inline void reference(GpuCase& c) {
  auto cpu = make_moe_layer(c.ref.shape, Backend::cpu);
  auto ctx = cpu->forward(c.ref.inputs(), c.ref.weights(), c.ref.out_view(), Stream{});
  cpu->backward(*ctx, c.ref.d_out_view(), c.ref.weights(), c.ref.gradients(), Stream{});
}

}  // namespace moka::gpu_test
