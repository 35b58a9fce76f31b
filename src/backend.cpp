// Backend selection and the load-balancing helpers of the public API.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/routing_gen.hpp"
#include "cpu/cpu_layer.hpp"
#include "moka/moka.hpp"
#if MOKA_HAVE_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace moka {

const char* to_string(Backend b) {
  switch (b) {
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
    case Backend::automatic: return "auto";
  }
  return "?";
}

const char* to_string(LayerPath p) {
  switch (p) {
    case LayerPath::automatic: return "automatic";
    case LayerPath::single_gpu: return "single_gpu";
    case LayerPath::all_to_all: return "all_to_all";
    case LayerPath::megakernel: return "megakernel";
  }
  return "?";
}

const char* to_string(SaveMode save) { return save == SaveMode::none ? "none" : "gate_up"; }

SaveMode parse_save_mode(const std::string& name) {
  if (name == "gate_up") return SaveMode::gate_up;
  if (name == "none") return SaveMode::none;
  throw Error(ErrorCode::invalid_argument, "unknown save mode '" + name + "' (gate_up, none)");
}

const char* to_string(Precision precision) { return precision == Precision::fp8 ? "fp8" : "bf16"; }

Precision parse_precision(const std::string& name) {
  if (name == "bf16") return Precision::bf16;
  if (name == "fp8") return Precision::fp8;
  throw Error(ErrorCode::invalid_argument, "unknown precision '" + name + "' (bf16, fp8)");
}

Backend parse_backend(const std::string& name) {
  if (name == "cpu") return Backend::cpu;
  if (name == "cuda") return Backend::cuda;
  if (name == "auto") return Backend::automatic;
  throw Error(ErrorCode::invalid_argument, "unknown backend '" + name + "' (cpu, cuda, auto)");
}

bool cuda_backend_available() {
#if MOKA_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

namespace {
Backend resolve(Backend b) {
  if (b == Backend::automatic) return cuda_backend_available() ? Backend::cuda : Backend::cpu;
  require(b != Backend::cuda || cuda_backend_available(), ErrorCode::backend_unavailable,
          "the CUDA backend needs a GPU and a build with nvcc");
  return b;
}

// Checked before any backend is built, so that no CUDA path can run bf16 GEMMs when fp8 was asked for.
void require_precision_on(Backend b, Precision precision) {
  require(b != Backend::cuda || precision == Precision::bf16, ErrorCode::backend_unavailable,
          "LayerOptions::precision = fp8 is not implemented by the CUDA backend yet (its FP8 GEMMs are "
          "issue 33's work); the CPU backend emulates it (Backend::cpu)");
}
}  // namespace

std::unique_ptr<MoeLayer> make_moe_layer(const MoeShape& shape, Backend backend, ProcessGroup* group,
                                         const LayerOptions& options) {
  // An explicit CUDA request is refused whether or not a GPU is visible, automatic once resolved.
  require_precision_on(backend, options.precision);
  const Backend resolved = resolve(backend);
  require_precision_on(resolved, options.precision);
#if MOKA_HAVE_CUDA
  if (resolved == Backend::cuda) return cuda::make_cuda_moe_layer(shape, group, options);
#endif
  return cpu::make_cpu_moe_layer(shape, group, options);
}

std::unique_ptr<Router> make_router(const RouterConfig& config, Backend backend, const LayerOptions& options) {
#if MOKA_HAVE_CUDA
  if (resolve(backend) == Backend::cuda) return cuda::make_cuda_router(config, options);
#else
  resolve(backend);
#endif
  return cpu::make_cpu_router(config, options);
}

LoadStats load_stats(const std::vector<int64_t>& counts) {
  LoadStats s;
  s.counts = counts;
  if (counts.empty()) return s;
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  const double mean = total / double(counts.size());
  s.max_over_mean = mean > 0 ? double(*std::max_element(counts.begin(), counts.end())) / mean : 0.0;
  s.gini = core::gini(std::vector<double>(counts.begin(), counts.end()));
  return s;
}

void update_selection_bias(std::vector<double>& bias, const std::vector<int64_t>& counts, double rate) {
  require(bias.size() == counts.size(), ErrorCode::shape_mismatch, "bias and counts differ in length");
  const double mean = counts.empty() ? 0.0 : std::accumulate(counts.begin(), counts.end(), 0.0) / double(counts.size());
  for (size_t e = 0; e < bias.size(); ++e) {
    const double c = double(counts[e]);
    bias[e] += rate * (c < mean ? 1.0 : (c > mean ? -1.0 : 0.0));
  }
}

}  // namespace moka
