// Timing and row helpers of the GPU benches (`moka bench --backend cuda` and the kernel lab in
// bench/kernels/), on the public API and the CUDA runtime only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_report.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/device_tensors.hpp"
#include "moka/device_group.hpp"
#include "moka/moka.hpp"

namespace moka::cli {

// Median milliseconds of `fn` over iters, timed with events after warmup runs.
template <typename Fn>
double time_ms(Fn&& fn, int warmup, int iters, cudaStream_t s) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    BENCH_CHECK(cudaEventRecord(a, s));
    fn();
    BENCH_CHECK(cudaEventRecord(b, s));
    BENCH_CHECK(cudaEventSynchronize(b));
    float t = 0;
    BENCH_CHECK(cudaEventElapsedTime(&t, a, b));
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
double median_ratio(const std::vector<double>& a, const std::vector<double>& b);

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
  explicit CaseStream(const std::string& command);
  ~CaseStream() { cudaStreamDestroy(s); }
  CaseStream(const CaseStream&) = delete;
  CaseStream& operator=(const CaseStream&) = delete;
};

// Element by element, the largest of every rank's `v` (the same length on every rank).
std::vector<double> max_over_ranks(ProcessGroup& g, const std::vector<double>& v);
inline double max_over_ranks(ProcessGroup& g, double v) { return max_over_ranks(g, std::vector<double>{v})[0]; }

// The fields every CUDA row shares (bf16, uniform routing, the GPU's name, "<R>x <name>" over
// several ranks).
BenchRow cuda_row(const NamedShape& ns, const std::string& path, int device, int ranks, int64_t tokens, int iters);

// Dense bf16 cuBLAS peak of this GPU, now: 8192^3 on random data (measured once per process).
double dense_peak_tflops(cudaStream_t s);

std::vector<__nv_bfloat16> read_bf16(const void* device_data, size_t bytes);
inline std::vector<__nv_bfloat16> read_bf16(const DeviceBuffer& d) { return read_bf16(d.data(), d.bytes()); }

// max |a - b| / max |b| over bf16 buffers (infinite when a holds a non-finite value).
double rel_diff(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b);

// The knobs of a megakernel run, as one string for its rows.
std::string megakernel_config_text(const MegakernelConfig& c);

// A megakernel-path layer with these knobs (its tile and row order included) for up to
// `max_tokens` tokens per rank.
std::unique_ptr<MoeLayer> megakernel_layer(const MoeShape& shape, DeviceGroup* group, const MegakernelConfig& config,
                                           int64_t max_tokens, DeviceAllocator* allocator = nullptr);

}  // namespace moka::cli
