// `moka bench --backend cuda`: the bf16 layer on one GPU, timed with CUDA events, next to the
// per-expert cuBLAS-loop baseline, the grouped GEMM alone and dense cuBLAS peak of the same run.
#pragma once
#include <string>
#include <vector>

#include "bench_report.hpp"
#include "moka/config.hpp"

namespace moka::cli {

struct CudaBenchOptions {
  int iters = 20;
  int warmup = 3;
  uint64_t seed = 1;
  int64_t tile_rows = 128;
  std::string torch_results;  // JSON lines of bench/torch_baseline.py to print ratios against
};

// Available only in builds with the CUDA backend (throws backend_unavailable otherwise).
BenchRow run_cuda_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o);

// The CUDA rows' comparison columns (from their extra JSON): dense peak, grouped GEMM share of
// it, and the speedups over the cuBLAS loop and over PyTorch.
void print_cuda_comparison(std::ostream& os, const std::vector<BenchRow>& rows);

}  // namespace moka::cli
