// Result rows of `moka bench`: the table for people and one JSON line per case for
// bench/results/.
#pragma once
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "moka/config.hpp"

namespace moka::cli {

struct BenchRow {
  std::string shape, backend, path, device, dtype, routing;
  int ep = 1;
  int64_t tokens_per_rank = 0;
  int iters = 0;
  double fwd_ms = 0, bwd_ms = 0, fwdbwd_ms = 0;
  double tflops = 0;          // useful FLOPs of forward+backward per rank / fwdbwd time
  std::optional<double> max_rel_error;  // against the reference; none: not checked (JSON null, table "-")
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // further fields, after the common ones
};

double median(std::vector<double> v);
// Appends one epoch's routing (every rank's top-k ids) as a JSON line `moka simulate --replay` reads.
void dump_routing(const std::string& path, const NamedShape& ns, int64_t tokens, int ep,
                  const std::vector<std::vector<int32_t>>& ids);
std::string bench_json(const BenchRow& row);
void print_table(std::ostream& os, const std::vector<BenchRow>& rows);
// The CUDA rows' comparison columns (from their extra JSON): dense peak, grouped GEMM share of
// it, and the speedups over the cuBLAS loop and over PyTorch.
void print_cuda_comparison(std::ostream& os, const std::vector<BenchRow>& rows);
// `moka bench --mode core` rows: the megakernel core and the CUTLASS grouped GEMMs side by side.
void print_core_comparison(std::ostream& os, const std::vector<BenchRow>& rows);

// A progress line on stderr with the seconds since the start, redrawn in place on a terminal and
// printed once per case otherwise.
class Progress {
 public:
  explicit Progress(std::string label);
  void update(const std::string& what, int done, int total);
  void finish();

 private:
  std::string label_;
  bool tty_;
  std::string last_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace moka::cli
