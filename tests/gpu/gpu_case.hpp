// GPU test helpers: one layer case with fp64 host tensors (the reference's), their bf16 copies
// on the device, and the device outputs read back (as double) for comparison.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/layer_buffers.hpp"
#include "cuda/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "moka/megakernel.hpp"

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

// A megakernel config for tests: waits bounded at 10 s, so a hang fails fast.
inline MegakernelConfig megakernel_config(int comm_sms, int64_t minibatch, int64_t macrobatch) {
  MegakernelConfig c;
  c.num_comm_sms = comm_sms;
  c.minibatch_size = minibatch;
  c.macrobatch_size = macrobatch;
  c.spin_timeout_seconds = 10;
  return c;
}

// Captures `enqueue` (moka calls, on a fresh stream set as moka's) into a CUDA graph, then
// replays it `replays` times; after(i) runs once replay i has finished.
template <class Enqueue, class After>
void replay_in_graph(Enqueue&& enqueue, int replays, After&& after) {
  cudaStream_t stream;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cuda::set_stream(stream);
  cudaGraph_t graph;
  MOKA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue();
  MOKA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  MOKA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < replays; ++i) {
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());  // the caller's poisoning (other streams) is done
    MOKA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    after(i);
  }
  cuda::set_stream(nullptr);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

struct DeviceTensor {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceTensor() = default;
  explicit DeviceTensor(size_t n) : bytes(n) { MOKA_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 16))); }
  ~DeviceTensor() { cudaFree(ptr); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
};

// A layer case: host reference buffers and device bf16 copies of inputs, weights and outputs.
inline int current_device() {
  int d = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

struct GpuCase {
  cpu::LayerBuffers<double> ref;
  int device = current_device();  // the GPU the case's tensors live on
  DeviceTensor x, ids, w, out, d_out, d_x, d_w;
  DeviceTensor wg, wu, wd, wsg, wsu, wsd, dwg, dwu, dwd, dwsg, dwsu, dwsd;

  GpuCase(const MoeShape& s, int64_t T, uint64_t seed) : GpuCase(random_buffers(s, T, seed)) {}

  // A case from given buffers (one rank's, for any world size), rounded to what the GPU stores.
  explicit GpuCase(cpu::LayerBuffers<double> buffers) : ref(std::move(buffers)) {
    for (auto* v : {&ref.x, &ref.d_out, &ref.w_gate, &ref.w_up, &ref.w_down, &ref.ws_gate, &ref.ws_up,
                    &ref.ws_down})
      round_bf16(*v);
    for (auto& v : ref.topk_weights) v = static_cast<double>(static_cast<float>(v));
  }

  static cpu::LayerBuffers<double> random_buffers(const MoeShape& s, int64_t T, uint64_t seed) {
    cpu::LayerBuffers<double> b(s, 1, T);
    b.randomize(seed);
    return b;
  }

  // Uploads inputs (after the caller set ref.topk_ids) and poisons every device output.
  void upload() {
    auto up_bf = [](DeviceTensor& d, const std::vector<double>& h) {
      const auto b = to_bf16(h);
      d = DeviceTensor(b.size() * 2);
      MOKA_CUDA_CHECK(cudaMemcpy(d.ptr, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    };
    auto out_bf = [](DeviceTensor& d, size_t n) { d = DeviceTensor(n * 2); };
    up_bf(x, ref.x);
    up_bf(d_out, ref.d_out);
    up_bf(wg, ref.w_gate);
    up_bf(wu, ref.w_up);
    up_bf(wd, ref.w_down);
    up_bf(wsg, ref.ws_gate);
    up_bf(wsu, ref.ws_up);
    up_bf(wsd, ref.ws_down);
    ids = DeviceTensor(ref.topk_ids.size() * 4);
    MOKA_CUDA_CHECK(cudaMemcpy(ids.ptr, ref.topk_ids.data(), ids.bytes, cudaMemcpyHostToDevice));
    std::vector<float> wf(ref.topk_weights.begin(), ref.topk_weights.end());
    w = DeviceTensor(wf.size() * 4);
    MOKA_CUDA_CHECK(cudaMemcpy(w.ptr, wf.data(), w.bytes, cudaMemcpyHostToDevice));
    out_bf(out, ref.out.size());
    out_bf(d_x, ref.d_x.size());
    d_w = DeviceTensor(ref.d_topk_weights.size() * 4);
    out_bf(dwg, ref.d_w_gate.size());
    out_bf(dwu, ref.d_w_up.size());
    out_bf(dwd, ref.d_w_down.size());
    out_bf(dwsg, ref.d_ws_gate.size());
    out_bf(dwsu, ref.d_ws_up.size());
    out_bf(dwsd, ref.d_ws_down.size());
    poison();
  }

  // 0xFF bytes: NaN in bf16 and f32, so an unwritten element fails every comparison.
  void poison() {
    for (DeviceTensor* t : {&out, &d_x, &d_w, &dwg, &dwu, &dwd, &dwsg, &dwsu, &dwsd})
      MOKA_CUDA_CHECK(cudaMemset(t->ptr, 0xFF, t->bytes));
  }

  MoeInputs inputs() {
    const auto& s = ref.shape;
    const Device d = Device::cuda(device);
    return {TensorView(x.ptr, DType::bf16, {ref.tokens, s.hidden}, d),
            TensorView(ids.ptr, DType::i32, {ref.tokens, s.top_k}, d),
            TensorView(w.ptr, DType::f32, {ref.tokens, s.top_k}, d)};
  }
  MoeWeights weights() {
    const auto& s = ref.shape;
    const Device d = Device::cuda(device);
    const int64_t H = s.hidden, I = s.intermediate, E = s.num_experts / ref.world_size;
    const int64_t Is = s.shared_intermediate;
    MoeWeights w_{TensorView(wg.ptr, DType::bf16, {E, I, H}, d), TensorView(wu.ptr, DType::bf16, {E, I, H}, d),
                  TensorView(wd.ptr, DType::bf16, {E, H, I}, d), {}, {}, {}};
    if (s.has_shared()) {
      w_.ws_gate = TensorView(wsg.ptr, DType::bf16, {Is, H}, d);
      w_.ws_up = TensorView(wsu.ptr, DType::bf16, {Is, H}, d);
      w_.ws_down = TensorView(wsd.ptr, DType::bf16, {H, Is}, d);
    }
    return w_;
  }
  MoeGradients gradients() {
    const auto& s = ref.shape;
    const Device d = Device::cuda(device);
    const int64_t H = s.hidden, I = s.intermediate, E = s.num_experts / ref.world_size;
    const int64_t Is = s.shared_intermediate, k = s.top_k;
    MoeGradients g{TensorView(d_x.ptr, DType::bf16, {ref.tokens, H}, d),
                   TensorView(d_w.ptr, DType::f32, {ref.tokens, k}, d),
                   TensorView(dwg.ptr, DType::bf16, {E, I, H}, d),
                   TensorView(dwu.ptr, DType::bf16, {E, I, H}, d),
                   TensorView(dwd.ptr, DType::bf16, {E, H, I}, d),
                   {}, {}, {}};
    if (s.has_shared()) {
      g.d_ws_gate = TensorView(dwsg.ptr, DType::bf16, {Is, H}, d);
      g.d_ws_up = TensorView(dwsu.ptr, DType::bf16, {Is, H}, d);
      g.d_ws_down = TensorView(dwsd.ptr, DType::bf16, {H, Is}, d);
    }
    return g;
  }
  TensorView out_view() { return TensorView(out.ptr, DType::bf16, {ref.tokens, ref.shape.hidden}, Device::cuda(device)); }
  TensorView d_out_view() {
    return TensorView(d_out.ptr, DType::bf16, {ref.tokens, ref.shape.hidden}, Device::cuda(device));
  }

  // Device outputs as LayerBuffers<double> (inputs copied from ref), for max_layer_error.
  cpu::LayerBuffers<double> download() const {
    cpu::LayerBuffers<double> got = ref;
    auto dn_bf = [](const DeviceTensor& d, std::vector<double>& h) {
      std::vector<__nv_bfloat16> b(h.size());
      MOKA_CUDA_CHECK(cudaMemcpy(b.data(), d.ptr, b.size() * 2, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < h.size(); ++i) h[i] = __bfloat162float(b[i]);
    };
    dn_bf(out, got.out);
    dn_bf(d_x, got.d_x);
    dn_bf(dwg, got.d_w_gate);
    dn_bf(dwu, got.d_w_up);
    dn_bf(dwd, got.d_w_down);
    dn_bf(dwsg, got.d_ws_gate);
    dn_bf(dwsu, got.d_ws_up);
    dn_bf(dwsd, got.d_ws_down);
    std::vector<float> f(got.d_topk_weights.size());
    MOKA_CUDA_CHECK(cudaMemcpy(f.data(), d_w.ptr, f.size() * 4, cudaMemcpyDeviceToHost));
    got.d_topk_weights.assign(f.begin(), f.end());
    return got;
  }

  // Raw bytes of every output (determinism checks compare bits).
  std::vector<uint8_t> output_bytes() const {
    std::vector<uint8_t> all;
    for (const DeviceTensor* t : {&out, &d_x, &d_w, &dwg, &dwu, &dwd, &dwsg, &dwsu, &dwsd}) {
      const size_t n = all.size();
      all.resize(n + t->bytes);
      MOKA_CUDA_CHECK(cudaMemcpy(all.data() + n, t->ptr, t->bytes, cudaMemcpyDeviceToHost));
    }
    return all;
  }
};

}  // namespace moka::gpu_test
