// `moka tune`: sweeps the megakernel's num_comm_sms and minibatch_size for one shape and token
// count (forward, CUDA; --gpus N for expert parallelism over N GPUs) and prints the fastest.
#include <iostream>

#include "bench_cuda.hpp"
#include "bench_report.hpp"
#include "commands.hpp"
#include "moka/distributed.hpp"
#include "moka/moka.hpp"

namespace moka::cli {
namespace {

struct TuneOptions {
  std::string shape = "qwen3-30b-a3b";
  int64_t tokens = 4096;
  int gpus = 1;
  int iters = 10, warmup = 2;
  std::vector<int> comm_sms = {8, 16, 24, 32, 48};
  std::vector<int64_t> minibatches = {1024, 2048, 4096, 8192};
  int64_t macrobatch = 131072;
  bool json = false;
};

void run_tune(const TuneOptions& o) {
  if (ran_as_workers(o.gpus, "tune")) return;
  const NamedShape& shape = named_shape(o.shape);
  require(cuda_backend_available(), ErrorCode::backend_unavailable, "moka tune needs a GPU (none is visible)");
  std::unique_ptr<ProcessGroup> workers = join_workers(true);
  CudaBenchOptions co;
  co.iters = o.iters;
  co.warmup = o.warmup;
  co.megakernel.macrobatch_size = o.macrobatch;
  std::vector<BenchRow> rows;
  try {
    rows = run_megakernel_tune(workers.get(), shape, o.tokens, co, o.comm_sms, o.minibatches);
  } catch (const std::exception& e) {
    if (workers) workers->abort(e.what());
    throw;
  }
  if (rows.empty()) return;  // not rank 0
  for (const auto& r : rows) {
    if (o.json) std::cout << bench_json(r) << "\n";
  }
  if (!o.json) print_table(std::cout, rows);
  const auto best = std::min_element(rows.begin(), rows.end(),
                                     [](const BenchRow& a, const BenchRow& b) { return a.fwd_ms < b.fwd_ms; });
  std::cout << "best: " << best->path << " forward " << best->fwd_ms << " ms\n";
}

}  // namespace

void register_tune(CLI::App& app) {
  auto o = std::make_shared<TuneOptions>();
  auto* cmd = app.add_subcommand("tune", "Sweep the megakernel's num_comm_sms and minibatch_size (CUDA)");
  cmd->add_option("--shape", o->shape, "Named shape");
  cmd->add_option("--tokens", o->tokens, "Tokens per rank")->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--gpus", o->gpus, "Worker processes, one per GPU (expert parallelism)")->check(CLI::Range(1, 64));
  cmd->add_option("--iters", o->iters, "Timed iterations per configuration (median reported)")
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--warmup", o->warmup, "Untimed warm-up iterations")->check(CLI::Range(0, 1000000));
  cmd->add_option("--comm-sms", o->comm_sms, "Communication CTA counts to try (comma list)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--minibatch", o->minibatches, "Minibatch sizes to try (comma list)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--macrobatch", o->macrobatch, "Ring-buffer rows")->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_flag("--json", o->json, "One JSON line per configuration");
  cmd->callback([o] { run_tune(*o); });
}

}  // namespace moka::cli
