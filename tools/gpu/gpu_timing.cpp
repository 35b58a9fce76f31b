#include "gpu/gpu_timing.hpp"

#include <algorithm>
#include <cmath>

namespace moka::cli {

double median_ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratio(a.size());
  for (size_t i = 0; i < a.size(); ++i) ratio[i] = b[i] / a[i];
  return median(ratio);
}

CaseStream::CaseStream(const std::string& command) {
  require(cuda_backend_available(), ErrorCode::backend_unavailable, command + " needs a GPU (none is visible)");
  BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
}

std::vector<double> max_over_ranks(ProcessGroup& g, const std::vector<double>& v) {
  std::vector<double> all(g.size() * v.size()), most(v);
  g.all_gather(v.data(), all.data(), v.size() * sizeof(double));
  for (int r = 0; r < g.size(); ++r)
    for (size_t i = 0; i < v.size(); ++i) most[i] = std::max(most[i], all[r * v.size() + i]);
  return most;
}

BenchRow cuda_row(const NamedShape& ns, const std::string& path, int device, int ranks, int64_t tokens, int iters) {
  cudaDeviceProp prop;
  BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
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

double dense_peak_tflops(cudaStream_t s) {
  static double cached = 0;
  if (cached > 0) return cached;
  const int n = 8192;
  DeviceBuffer a(size_t(n) * n * 2), b(a.bytes()), c(a.bytes());
  a.fill_normal(1.0, 1);
  b.fill_normal(1.0, 2);
  cublasHandle_t h;
  BENCH_CHECK(cublasCreate(&h));
  BENCH_CHECK(cublasSetStream(h, s));
  const float one = 1, zero = 0;
  const double ms = time_ms(
      [&] {
        BENCH_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a.data(), CUDA_R_16BF, n, b.data(),
                                 CUDA_R_16BF, n, &zero, c.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
      },
      3, 20, s);
  cublasDestroy(h);
  cached = 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
  return cached;
}

std::vector<__nv_bfloat16> read_bf16(const void* device_data, size_t bytes) {
  std::vector<__nv_bfloat16> h(bytes / 2);
  BENCH_CHECK(cudaMemcpy(h.data(), device_data, bytes, cudaMemcpyDeviceToHost));
  return h;
}

double rel_diff(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (!std::isfinite(x)) return INFINITY;
    diff = std::max(diff, std::abs(x - y));
    scale = std::max(scale, std::abs(y));
  }
  return scale > 0 ? diff / scale : diff;
}

std::string megakernel_config_text(const MegakernelConfig& c) {
  return "comm_sms=" + std::to_string(c.num_comm_sms) + " minibatch=" + std::to_string(c.minibatch_size) +
         " macrobatch=" + std::to_string(c.macrobatch_size) + " band_row_tiles=" + std::to_string(c.band_row_tiles) +
         " row_order=" + (c.row_order == RowOrder::rate_based ? "rate_based" : "round_robin");
}

std::unique_ptr<MoeLayer> megakernel_layer(const MoeShape& shape, DeviceGroup* group, const MegakernelConfig& config,
                                           int64_t max_tokens, DeviceAllocator* allocator) {
  LayerOptions options;
  options.path = LayerPath::megakernel;
  options.max_tokens = max_tokens;
  options.megakernel = config;
  options.tile_rows = config.tile_rows;  // the layer takes these two from its options
  options.row_order = config.row_order;
  options.allocator = allocator;
  return make_moe_layer(shape, group, options);
}

}  // namespace moka::cli
