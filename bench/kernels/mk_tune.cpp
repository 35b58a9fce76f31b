// mk_tune: the megakernel layer's forward for every num_comm_sms x minibatch_size pair, on one
// GPU or, under `moka launch -n N`, expert-parallel over N GPUs; one JSON line per pair (each
// run at its slowest rank), the fastest marked "fastest": true. Its outputs are the megakernel
// path's, which the GPU tests check against the CPU reference.
#include <algorithm>

#include "core/routing_gen.hpp"
#include "kernel_lab.hpp"

namespace moka::lab {
namespace {

struct Options {
  std::string shape = "qwen3-30b-a3b";
  int64_t tokens = 4096;
  int iters = 10, warmup = 2;
  uint64_t seed = 1;
  std::vector<int> comm_sms = {8, 16, 24, 32, 48};
  std::vector<int64_t> minibatches = {1024, 2048, 4096, 8192};
  int64_t macrobatch = 131072;
};

// One row per knob pair; rank 0 returns them, the other ranks none.
std::vector<BenchRow> sweep(ProcessGroup* workers, const Options& o) {
  const NamedShape& ns = named_shape(o.shape);
  const MoeShape& sh = ns.shape;
  const int R = workers ? workers->size() : 1, rank = workers ? workers->rank() : 0;
  const cli::CaseStream stream("mk_tune");
  const cudaStream_t s = stream.s;
  cli::LayerTensors t(sh, o.tokens, R);
  t.randomize(o.seed * 1000 + rank, core::sample_topk_ids({core::RoutingKind::uniform, 0.3, o.seed}, o.tokens, sh.top_k,
                                                          sh.num_experts, static_cast<uint64_t>(rank)));
  std::unique_ptr<DeviceGroup> group;
  if (workers) group = make_nccl_group(*workers, t.device);
  std::vector<BenchRow> rows;
  for (int comm : o.comm_sms) {
    for (int64_t minibatch : o.minibatches) {
      MegakernelConfig cfg;
      cfg.num_comm_sms = comm;
      cfg.minibatch_size = minibatch;
      cfg.macrobatch_size = std::max(o.macrobatch / minibatch, int64_t(1)) * minibatch;
      auto mk = cli::megakernel_layer(sh, group.get(), cfg, o.tokens);
      double ms =
          cli::time_ms([&] { mk->forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); }, o.warmup, o.iters, s);
      MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
      mk->check_errors();
      if (workers) ms = cli::max_over_ranks(*workers, ms);
      BenchRow row =
          cli::cuda_row(ns, "megakernel comm_sms=" + std::to_string(comm) + " minibatch=" + std::to_string(minibatch),
                        t.device, R, o.tokens, o.iters);
      row.fwd_ms = ms;
      row.tflops = sh.forward_flops(o.tokens) / (ms * 1e-3) / 1e12;
      row.extra = {{"num_comm_sms", comm}, {"minibatch_size", minibatch}, {"tflops_note", "forward only"}};
      rows.push_back(row);
    }
  }
  if (rank != 0) rows.clear();
  return rows;
}

void run(const Options& o) {
  std::unique_ptr<ProcessGroup> workers = join_workers();
  std::vector<BenchRow> rows;
  try {
    rows = sweep(workers.get(), o);
  } catch (const std::exception& e) {
    if (workers) workers->abort(e.what());  // peers stop with this reason instead of waiting
    throw;
  }
  const auto fastest = std::min_element(rows.begin(), rows.end(),
                                        [](const BenchRow& a, const BenchRow& b) { return a.fwd_ms < b.fwd_ms; });
  for (auto it = rows.begin(); it != rows.end(); ++it) {
    it->extra["fastest"] = it == fastest;
    print_json_line(*it);
  }
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  Options o;
  CLI::App app{"Sweep the megakernel's num_comm_sms and minibatch_size (forward; several GPUs under moka launch)",
               "mk_tune"};
  app.add_option("--shape", o.shape, "Named shape");
  app.add_option("--tokens", o.tokens, "Tokens per rank")->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--iters", o.iters, "Timed iterations per configuration (median reported)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", o.warmup, "Untimed warm-up iterations")->check(CLI::Range(0, 1000000));
  app.add_option("--seed", o.seed, "Random seed");
  app.add_option("--comm-sms", o.comm_sms, "Communication CTA counts to try (comma list)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  app.add_option("--minibatch", o.minibatches, "Minibatch sizes to try (comma list)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--macrobatch", o.macrobatch, "Ring-buffer rows")->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  return lab_main(app, argc, argv, [&] { run(o); });
}
