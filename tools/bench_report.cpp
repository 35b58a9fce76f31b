#include "bench_report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "moka/moka.hpp"

namespace moka::cli {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string bench_json(const BenchRow& r) {
  nlohmann::ordered_json j;
  j["shape"] = r.shape;
  j["backend"] = r.backend;
  j["path"] = r.path;
  j["ep"] = r.ep;
  j["tokens_per_rank"] = r.tokens_per_rank;
  j["dtype"] = r.dtype;
  j["routing"] = r.routing;
  j["iters"] = r.iters;
  j["fwd_ms"] = r.fwd_ms;
  j["bwd_ms"] = r.bwd_ms;
  j["fwdbwd_ms"] = r.fwdbwd_ms;
  j["tflops"] = r.tflops;
  j["max_rel_error"] = r.max_rel_error ? nlohmann::ordered_json(*r.max_rel_error) : nlohmann::ordered_json();
  j["commit"] = build_commit();
  j["device"] = r.device;
  j.update(r.extra);
  return j.dump();
}

void print_cuda_comparison(std::ostream& os, const std::vector<BenchRow>& rows) {
  // vs_torch: ratio of the two medians; vs_torch_paired: median of per-run ratios (see TorchResult).
  char line[320];
  // fused_fwd: forward speedup of the SwiGLU epilogue over the unfused path (median of paired
  // runs; "!" when their bits differ).
  std::snprintf(line, sizeof(line), "%-16s %7s %4s %9s %10s %8s %11s %10s %10s %10s %10s %10s %16s\n", "shape",
                "tokens", "ep", "peak_TF", "gemm_TF", "gemm_%", "vs_cublas", "fused_fwd", "a2a_GB/s", "copy_GB/s",
                "torch_ms", "vs_torch", "vs_torch_paired");
  os << line;
  for (const auto& r : rows) {
    const auto& j = r.extra;
    std::snprintf(line, sizeof(line),
                  "%-16s %7lld %4d %9.1f %10.1f %7.1f%% %10.2fx %9.2fx%s %10.1f %10.1f %10.2f %9.2fx %9.2fx (n=%d)\n",
                  r.shape.c_str(), static_cast<long long>(r.tokens_per_rank), r.ep, j.value("dense_peak_tflops", 0.0),
                  j.value("grouped_gemm_tflops", 0.0), j.value("grouped_gemm_pct_peak", 0.0),
                  j.value("speedup_vs_cublas_loop", 0.0), j.value("fused_swiglu_fwd_speedup", 0.0),
                  j.value("fused_swiglu_identical", true) ? " " : "!", j.value("nccl_all_to_all_gbs", 0.0),
                  j.value("peer_copy_gbs", 0.0), j.value("torch_fwdbwd_ms", 0.0), j.value("speedup_vs_torch", 0.0),
                  j.value("speedup_vs_torch_paired", 0.0), j.value("paired_runs", 0));
    os << line;
  }
}

void print_core_comparison(std::ostream& os, const std::vector<BenchRow>& rows) {
  // core/cutlass: throughput ratio (median of paired runs); "!" when the bits differ.
  char line[256];
  std::snprintf(line, sizeof(line), "%-16s %7s %9s %9s %11s %9s %11s %7s %10s %13s\n", "shape", "tokens", "peak_TF",
                "core_ms", "cutlass_ms", "core_TF", "cutlass_TF", "core_%", "cutlass_%", "core/cutlass");
  os << line;
  for (const auto& r : rows) {
    const auto& j = r.extra;
    std::snprintf(line, sizeof(line), "%-16s %7lld %9.1f %9.3f %11.3f %9.1f %11.1f %6.1f%% %9.1f%% %12.3fx%s\n",
                  r.shape.c_str(), static_cast<long long>(r.tokens_per_rank), j.value("dense_peak_tflops", 0.0),
                  j.value("core_ms", 0.0), j.value("cutlass_ms", 0.0), j.value("core_tflops", 0.0),
                  j.value("cutlass_tflops", 0.0), j.value("core_pct_peak", 0.0), j.value("cutlass_pct_peak", 0.0),
                  j.value("core_vs_cutlass_throughput", 0.0), j.value("core_identical_to_cutlass", false) ? "" : " !");
    os << line;
  }
}

void print_table(std::ostream& os, const std::vector<BenchRow>& rows) {
  os << std::left << std::setw(16) << "shape" << std::setw(10) << "path" << std::setw(8) << "backend"
     << std::setw(4) << "ep" << std::right << std::setw(8) << "tokens" << std::setw(11) << "fwd ms"
     << std::setw(11) << "bwd ms" << std::setw(11) << "fwd+bwd ms" << std::setw(10) << "TFLOP/s"
     << std::setw(12) << "max rel err" << "\n";
  for (const auto& r : rows) {
    os << std::left << std::setw(16) << r.shape << std::setw(10) << r.path << std::setw(8) << r.backend
       << std::setw(4) << r.ep << std::right << std::setw(8) << r.tokens_per_rank << std::fixed
       << std::setprecision(3) << std::setw(11) << r.fwd_ms << std::setw(11) << r.bwd_ms << std::setw(11)
       << r.fwdbwd_ms << std::setprecision(4) << std::setw(10) << r.tflops << std::scientific
       << std::setprecision(2) << std::setw(12);
    if (r.max_rel_error) {
      os << *r.max_rel_error;
    } else {
      os << "-";
    }
    os << std::defaultfloat << "\n";
  }
}

Progress::Progress(std::string label) : label_(std::move(label)), tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::update(const std::string& what, int done, int total) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  char elapsed[32];
  std::snprintf(elapsed, sizeof elapsed, " %.1f s", seconds);
  const std::string line =
      label_ + " " + what + " [" + std::to_string(done) + "/" + std::to_string(total) + "]" + elapsed;
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s", line.c_str());
  } else if (what != last_) {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  last_ = what;
}

void Progress::finish() {
  if (tty_) std::fprintf(stderr, "\r\033[K");
}

void dump_routing(const std::string& path, const NamedShape& ns, int64_t tokens, int ep,
                  const std::vector<std::vector<int32_t>>& ids) {
  nlohmann::ordered_json j;
  j["shape"] = ns.name;
  j["world_size"] = ep;
  j["tokens_per_rank"] = tokens;
  j["top_k"] = ns.shape.top_k;
  j["num_experts"] = ns.shape.num_experts;
  j["hidden"] = ns.shape.hidden;
  j["topk_ids"] = ids;
  std::ofstream f(path, std::ios::app);
  require(f.good(), ErrorCode::io, "cannot write routing dump " + path);
  f << j.dump() << "\n";
}

}  // namespace moka::cli
