// Timing and row helpers shared by the GPU parts of `moka bench`, `moka tune` and `moka incast`.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_cuda.hpp"
#include "cuda/common/check.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/layer/layer_kernels.hpp"
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

// a and b called alternately, `warmup` untimed pairs first, then `iters` pairs: each call returns
// its own measurement, and the two series come back in run order. Side by side, drifting clocks
// and temperatures affect both alike.
template <typename A, typename B>
auto alternate(A&& a, B&& b, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) {
    a();
    b();
  }
  std::pair<std::vector<decltype(a())>, std::vector<decltype(b())>> runs;
  for (int i = 0; i < iters; ++i) {
    runs.first.push_back(a());
    runs.second.push_back(b());
  }
  return runs;
}

// Medians of the per-run ratios b / a of two alternated series.
inline double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratio(a.size());
  for (size_t i = 0; i < a.size(); ++i) ratio[i] = b[i] / a[i];
  return median(ratio);
}

// Two functions timed alternately, iteration by iteration: the median of each and the median of
// the per-iteration ratios b/a.
struct Paired {
  double a_ms = 0, b_ms = 0, ratio = 0;
};
template <typename A, typename B>
Paired time_paired(A&& a, B&& b, int warmup, int iters, cudaStream_t s) {
  const auto [ta, tb] =
      alternate([&] { return time_ms(a, 0, 1, s); }, [&] { return time_ms(b, 0, 1, s); }, warmup, iters);
  return {median(ta), median(tb), median_ratio(ta, tb)};
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

// Element by element, the largest of every rank's `v` (the same length on every rank).
inline std::vector<double> max_over_ranks(ProcessGroup& g, const std::vector<double>& v) {
  std::vector<double> all(g.size() * v.size()), most(v);
  g.all_gather(v.data(), all.data(), v.size() * sizeof(double));
  for (int r = 0; r < g.size(); ++r)
    for (size_t i = 0; i < v.size(); ++i) most[i] = std::max(most[i], all[r * v.size() + i]);
  return most;
}
inline double max_over_ranks(ProcessGroup& g, double v) { return max_over_ranks(g, std::vector<double>{v})[0]; }

// The fields every CUDA row shares (bf16, uniform routing, the GPU's name, "<R>x <name>" over
// several ranks).
inline BenchRow cuda_row(const NamedShape& ns, const std::string& path, int device, int ranks, int64_t tokens,
                         int iters) {
  cudaDeviceProp prop;
  MOKA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  BenchRow row;
  row.shape = ns.name;
  row.backend = "cuda";
  row.path = path;
  row.device = ranks > 1 ? std::to_string(ranks) + "x " + prop.name : std::string(prop.name);
  row.dtype = "bf16";
  row.routing = "uniform";
  row.ep = ranks;
  row.tokens_per_rank = tokens;
  row.iters = iters;
  return row;
}

// Dense bf16 cuBLAS peak of this GPU, now: 8192^3 on random data (measured once per process).
double dense_peak_tflops(cudaStream_t s);

inline std::vector<__nv_bfloat16> read_bf16(const Dev& d) {
  std::vector<__nv_bfloat16> h(d.bytes() / 2);
  MOKA_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// max |a - b| / max |b| over bf16 buffers.
inline double rel_diff(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (!std::isfinite(x)) return INFINITY;
    diff = std::max(diff, std::abs(x - y));
    scale = std::max(scale, std::abs(y));
  }
  return scale > 0 ? diff / scale : diff;
}

// One expert's product over its routed rows: m = the expert's row count, A = its segment of the
// grouped buffer `a` ([rows, k], row pitch lda), B = its weights at b_off in buffer `b` ([n, k]),
// D = its segment of the grouped buffer `d` (row pitch ldd).
inline cuda::GroupSpec expert_rows_group(int e, int a, int64_t lda, int b, int64_t b_off, int64_t ldb, int d,
                                         int64_t ldd, int64_t n, int64_t k) {
  cuda::GroupSpec g;
  g.a = a, g.a_step = lda, g.lda = lda;
  g.b = b, g.b_off = b_off, g.ldb = ldb;
  g.d = d, g.d_step = ldd, g.ldd = ldd;
  g.n = int(n), g.k = int(k), g.expert = e, g.count_dim = cuda::CountDim::m;
  return g;
}

// The knobs of a megakernel run, as one string for its rows.
inline std::string megakernel_config_text(const MegakernelConfig& c) {
  return "comm_sms=" + std::to_string(c.num_comm_sms) + " minibatch=" + std::to_string(c.minibatch_size) +
         " macrobatch=" + std::to_string(c.macrobatch_size) + " band_row_tiles=" + std::to_string(c.band_row_tiles) +
         " row_order=" + (c.row_order == RowOrder::rate_based ? "rate_based" : "round_robin");
}

// A megakernel-path layer with these knobs for up to `max_tokens` tokens per rank.
inline std::unique_ptr<MoeLayer> megakernel_layer(const MoeShape& shape, DeviceGroup* group,
                                                  const MegakernelConfig& config, int64_t max_tokens,
                                                  DeviceAllocator* allocator = nullptr) {
  LayerOptions options = fixtures::megakernel_options(config, max_tokens);
  options.allocator = allocator;
  return make_moe_layer(shape, group, options);
}

}  // namespace moka::cli
