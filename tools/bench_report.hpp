// Result rows of `moka bench` (and of the kernel lab, bench/kernels/): the table for people and
// one JSON line per case for bench/results/.
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
  double tflops = 0;                    // useful FLOPs of forward+backward per rank / fwdbwd time
  std::optional<double> max_rel_error;  // against the reference; none: not checked (JSON null, table "-")
  // Layer rows (JSON null where none): the floor of this case's forward plus backward
  // (LayerFloor::fwdbwd_ms), the device memory the path's layer holds at its peak around one
  // fwd+bwd (saved context + workspace; CUDA only, see tools/gpu/bench_layer.cpp), and
  // bench/torch_baseline.py's fwd+bwd time and peak memory for the same case (--torch-results).
  // bench_json derives fwdbwd_vs_floor and speedup_vs_torch from them.
  std::optional<double> floor_fwdbwd_ms;
  std::optional<int64_t> peak_memory_bytes;
  std::optional<double> torch_fwdbwd_ms;
  std::optional<int64_t> torch_peak_memory_bytes;
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();  // further fields, after the common ones
};

double median(std::vector<double> v);

// routes[r]: how many of `ids` (one rank's top-k ids) go to the experts rank r hosts, ranks
// holding `experts_per_rank` consecutive experts each.
std::vector<int64_t> routes_per_rank(const std::vector<int32_t>& ids, int64_t experts_per_rank, int ranks);

// The floor of one layer call for the slowest rank, from the route matrix (routes[s * R + r]:
// routes from rank s's tokens to the experts rank r hosts): the most rows any rank computes
// (plus the shared expert over its own tokens) at the dense peak, and the most rows any rank
// must receive over the links (rows it pulls from peers + outputs peers push back for its own
// tokens) at the link rate (`link_gbs`; none: no byte term, as on one rank or the CPU).
struct LayerFloor {
  double flops_ms = 0;  // the forward's FLOPs
  double bytes_ms = 0;  // the forward's bytes; the backward moves as many (d_out rows out, d_x rows back)
  double forward_ms() const;
  double backward_ms() const;  // twice the forward's FLOPs, the same bytes
  double fwdbwd_ms() const { return forward_ms() + backward_ms(); }
};
LayerFloor layer_floor(const MoeShape& sh, int64_t tokens, const std::vector<int64_t>& routes, int ranks,
                       double peak_tflops, std::optional<double> link_gbs);
// The floor's fields of a row: floor_fwdbwd_ms and, in extra, its parts.
void set_floor(BenchRow& row, const LayerFloor& floor, double peak_tflops);

// bench/torch_baseline.py's result for one shape, token count and rank count (the last matching
// line of `path`): its own medians, its peak memory and, when it ran with --paired-with, the
// median of the per-run ratios torch / moka from runs that alternated with moka's
// (the kernel lab's bench/kernels/paired_steps) in the same device call. All zero when `path` is empty or has no
// such line.
struct TorchResult {
  double fwdbwd_ms = 0, fwd_ms = 0;
  int64_t peak_memory_bytes = 0;  // 0: not measured (results of an older script)
  // The memory of a stack of `depth` layers and what one layer saves (0: not measured).
  int64_t stack_peak_memory_bytes = 0, saved_bytes_per_layer = 0;
  int depth = 1;
  double paired_ratio = 0, paired_moka_ms = 0;
  int paired_runs = 0;
};
TorchResult torch_result(const std::string& path, const std::string& shape, int64_t tokens, int ep);
// The torch fields of a row (none when `torch` has no time).
void set_torch(BenchRow& row, const TorchResult& torch);
// Appends one epoch's routing (every rank's top-k ids) as a JSON line `moka simulate --replay`
// reads. The file is rewritten atomically with the line added: a run killed or failing part-way
// leaves the lines of the cases before it whole, never a torn line that would make the dump
// unreadable.
void dump_routing(const std::string& path, const NamedShape& ns, int64_t tokens, int ep,
                  const std::vector<std::vector<int32_t>>& ids);
std::string bench_json(const BenchRow& row);
// The kernel lab's check of a row before it prints it (bench/kernels/): throws Error(internal)
// when its grouped rows (extra "grouped_rows": `tokens` routed shape.top_k times, each of the
// shape.num_experts experts' segments padded to `tile_rows`) are outside [tokens * top_k,
// tokens * top_k + (tile_rows - 1) * num_experts], or when a share of the dense peak (an extra
// field ending in "pct_peak") is above 100 or not a number: such a row did not measure its case.
void check_lab_row(const BenchRow& row, const MoeShape& shape, int64_t tokens, int64_t tile_rows = 128);
void print_table(std::ostream& os, const std::vector<BenchRow>& rows);
// Every layer row's floor, memory and torch columns.
void print_floor_comparison(std::ostream& os, const std::vector<BenchRow>& rows);
// The CUDA rows' comparison columns (from their extra JSON): dense peak, the fused-SwiGLU
// forward's speedup, the links' bandwidth and the speedups over PyTorch.
void print_cuda_comparison(std::ostream& os, const std::vector<BenchRow>& rows);
// Each row's stage times (extra "stages", from --breakdown): one line per path and direction.
void print_stage_breakdown(std::ostream& os, const std::vector<BenchRow>& rows);

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
