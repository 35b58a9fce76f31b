// Timing and row helpers shared by the GPU parts of `moka bench`, `moka tune` and `moka incast`.
#pragma once
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "bench_cuda.hpp"
#include "cuda/common/check.hpp"
#include "moka/device_group.hpp"
#include "moka/moka.hpp"
#include "testing/device_tensors.hpp"
#include "testing/megakernel_options.hpp"

namespace moka::cli {

using Dev = cuda::DeviceMemory;
using LayerTensors = cuda::DeviceLayerTensors;

// Median milliseconds of `fn` over iters, timed with events after warmup runs.
template <typename Fn>
double time_ms(Fn&& fn, int warmup, int iters, cudaStream_t s) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  MOKA_CUDA_CHECK(cudaEventCreate(&a));
  MOKA_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    MOKA_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    MOKA_CUDA_CHECK(cudaEventRecord(b, s));
    MOKA_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    MOKA_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(ms);
}

// Two functions timed alternately, iteration by iteration: the median of each and the median of
// the per-iteration ratios b/a (side by side, so drifting clocks affect both alike).
struct Paired {
  double a_ms = 0, b_ms = 0, ratio = 0;
};
template <typename A, typename B>
Paired time_paired(A&& a, B&& b, int warmup, int iters, cudaStream_t s) {
  std::vector<double> ta, tb, ratio;
  for (int i = 0; i < iters; ++i) {
    ta.push_back(time_ms(a, i == 0 ? warmup : 0, 1, s));
    tb.push_back(time_ms(b, i == 0 ? warmup : 0, 1, s));
    ratio.push_back(tb.back() / ta.back());
  }
  return {median(ta), median(tb), median(ratio)};
}


// The stream one single-GPU case runs on (every moka call of the case is given it).
struct CaseStream {
  cudaStream_t s = nullptr;
  explicit CaseStream(const std::string& command) {
    require(cuda_backend_available(), ErrorCode::backend_unavailable, command + " needs a GPU (none is visible)");
    MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  ~CaseStream() {
    cudaStreamDestroy(s);
  }
};

inline double max_over_ranks(ProcessGroup& g, double v) {
  std::vector<double> all(g.size());
  g.all_gather(&v, all.data(), sizeof(double));
  return *std::max_element(all.begin(), all.end());
}

// The fields every expert-parallel CUDA row shares (bf16, uniform routing, "<R>x <GPU name>").
inline BenchRow ep_row(const NamedShape& ns, const std::string& path, int device, int ranks, int64_t tokens, int iters) {
  cudaDeviceProp prop;
  MOKA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  BenchRow row;
  row.shape = ns.name;
  row.backend = "cuda";
  row.path = path;
  row.device = std::to_string(ranks) + "x " + prop.name;
  row.dtype = "bf16";
  row.routing = "uniform";
  row.ep = ranks;
  row.tokens_per_rank = tokens;
  row.iters = iters;
  return row;
}

// A megakernel-path layer with these knobs for up to `max_tokens` tokens per rank.
inline std::unique_ptr<MoeLayer> megakernel_layer(const MoeShape& shape, DeviceGroup* group,
                                                  const MegakernelConfig& config, int64_t max_tokens) {
  return make_moe_layer(shape, group, fixtures::megakernel_options(config, max_tokens));
}

}  // namespace moka::cli
