// `moka bench --backend cuda`: the bf16 layer on one GPU, timed with CUDA events, next to the
// per-expert cuBLAS-loop baseline, the grouped GEMM alone, dense cuBLAS peak of the same run,
// and its forward with SwiGLU as a separate pass instead of the gate GEMM's epilogue.
#pragma once
#include <iosfwd>
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
  // One GPU: also check the single-GPU path against the cuBLAS loop and time that loop, the
  // grouped GEMM alone and the fused SwiGLU forward (off: the two paths' rows only).
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
// Two rows: the single-GPU path (checked against the cuBLAS loop, with its comparison columns)
// and the megakernel path (checked against the single-GPU path), their fwd+bwd steps timed
// alternately on the same tensors, each with its floor, peak layer memory and torch columns.
std::vector<BenchRow> run_cuda_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o);

// `moka bench --mode core`: the megakernel's GEMM core alone (EP = 1, no communication) against
// the CUTLASS grouped GEMMs on the same grouped rows (uniform routing), after checking both give
// the same rows; the megakernel's minibatch_size comes from o.megakernel.
BenchRow run_cuda_core_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o);

// `moka bench --mode backward-core`: the backward megakernel alone (EP = 1, resident context from
// the forward core's grouped rows, routed experts only), timed alternately with the forward core.
BenchRow run_cuda_backward_core_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o);

// `moka bench --paired-steps`: holds one case on the GPU (the same tensors and routing as
// run_cuda_case), prints "ready" after the warm-up, then times one forward+backward for every
// "step" line read from `in` and prints its milliseconds. bench/torch_baseline.py --paired-with
// drives it, alternating these runs with its own, so that each moka/torch ratio compares two
// runs made moments apart on the same GPU.
void serve_cuda_steps(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o, std::istream& in,
                      std::ostream& out);

// The same layer with its experts split over the worker processes: the all-to-all path (next to
// NCCL all-to-all and peer-copy bandwidth of the dispatch volume) and the megakernel path, their
// fwd+bwd steps timed alternately, as in run_cuda_case. Collective over `workers`; rank 0 returns
// the two rows (each run's time is the slowest rank's), the other ranks none.
std::vector<BenchRow> run_cuda_ep_case(ProcessGroup& workers, const NamedShape& ns, int64_t tokens,
                                       const CudaBenchOptions& o);
// `moka tune`: the megakernel forward for every num_comm_sms x minibatch_size pair (EP over the
// workers, or one GPU without them); rank 0 returns one row per pair, the fastest marked.
std::vector<BenchRow> run_megakernel_tune(ProcessGroup* workers, const NamedShape& ns, int64_t tokens,
                                          const CudaBenchOptions& o, const std::vector<int>& comm_sms,
                                          const std::vector<int64_t>& minibatches);
// `moka incast`: k = 1..N-1 senders (ranks 1..k) each copy `bytes` into rank 0 at once, while
// rank 1 also copies `bytes` to rank N-1 (the victim flow), all through peer copies over NVLink.
// Medians over `iters`; collective over N >= 3 workers, rank 0 returns the rows (k = 0: the
// victim flow alone).
struct IncastRow {
  int senders = 0;
  double receiver_gbs = 0;  // k * bytes / the slowest sender's copy time
  double victim_gbs = 0;    // bytes / the victim copy's time
};
std::vector<IncastRow> run_incast(ProcessGroup& workers, size_t bytes, int iters);
// A worker process uses the GPU of its local rank.
void select_worker_device(int local_rank);

}  // namespace moka::cli
