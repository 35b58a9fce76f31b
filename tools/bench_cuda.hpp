// `moka bench --backend cuda`: the bf16 layer's paths on one GPU or over worker processes, timed
// with CUDA events, against the dense cuBLAS peak of the same run, torch's results and each
// other; on the public API only (the kernel lab in bench/kernels/ reaches further in).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "bench_report.hpp"
#include "moka/config.hpp"
#include "moka/layer.hpp"
#include "moka/megakernel.hpp"
#include "moka/process_group.hpp"

namespace moka::cli {

struct CudaBenchOptions {
  int iters = 20;
  int warmup = 3;
  uint64_t seed = 1;
  int64_t tile_rows = 128;
  std::string torch_results;  // JSON lines of bench/torch_baseline.py to print ratios against
  // Layer runs also time the megakernel path with this config, side by side with the staged
  // path; `timeline` (a file) receives the first case's forward task spans.
  MegakernelConfig megakernel;
  // The megakernel backward's saved context: "resident" grows the ring (macrobatch) to hold every
  // routed row of the case, "replay" requires a ring that does not, "auto" keeps the knobs.
  std::string context = "auto";
  // One GPU: also time the single-GPU path's forward with SwiGLU in the gate GEMM's epilogue
  // (off: the two paths' rows only).
  bool baselines = true;
  std::string timeline;
  // Expert-parallel runs: "uniform", "zipf" (per-expert load Gini `gini`) or "one-rank" (every
  // token's experts among rank 0's). Torch columns are attached to uniform runs only.
  std::string routing = "uniform";
  double gini = 0.3;
  std::string dump_routing;  // expert-parallel runs: append every rank's ids (rank 0 writes)
  // Memory: what the staged paths' contexts keep (LayerOptions::save), and the stack of layers
  // whose fwd+bwd peak is measured besides one layer's.
  SaveMode save = SaveMode::gate_up;
  int depth = 1;
  // Layer runs: also time each path's stages (MoeLayer::stage_times), `iters` more steps each.
  bool breakdown = false;
};

// Available only in builds with the CUDA backend (throws backend_unavailable otherwise).
// Two rows: the single-GPU path (with its fused-SwiGLU comparison) and the megakernel path
// (checked against the single-GPU path), their fwd+bwd steps timed alternately on the same
// tensors, each with its floor, peak layer memory and torch columns.
std::vector<BenchRow> run_cuda_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o);

// The same layer with its experts split over the worker processes: the all-to-all path (next to
// NCCL all-to-all and peer-copy bandwidth of the dispatch volume) and the megakernel path, their
// fwd+bwd steps timed alternately, as in run_cuda_case. Collective over `workers`; rank 0 returns
// the two rows (each run's time is the slowest rank's), the other ranks none.
std::vector<BenchRow> run_cuda_ep_case(ProcessGroup& workers, const NamedShape& ns, int64_t tokens,
                                       const CudaBenchOptions& o);
// A worker process uses the GPU of its local rank.
void select_worker_device(int local_rank);

}  // namespace moka::cli
