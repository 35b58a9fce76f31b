// `moka tune` on the GPU: the megakernel forward over a grid of its knobs.
#include <algorithm>

#include "core/routing_gen.hpp"
#include "gpu/bench_timing.hpp"

namespace moka::cli {

std::vector<BenchRow> run_megakernel_tune(ProcessGroup* workers, const NamedShape& ns, int64_t tokens,
                                          const CudaBenchOptions& o, const std::vector<int>& comm_sms,
                                          const std::vector<int64_t>& minibatches) {
  const MoeShape& sh = ns.shape;
  const int R = workers ? workers->size() : 1, rank = workers ? workers->rank() : 0;
  cudaStream_t s;
  MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  LayerTensors t(sh, tokens, R);
  t.randomize(o.seed * 1000 + rank,
              core::sample_topk_ids({core::RoutingKind::uniform, 0.3, o.seed}, tokens, sh.top_k, sh.num_experts,
                                    static_cast<uint64_t>(rank)));
  std::unique_ptr<DeviceGroup> group;
  if (workers) group = make_nccl_group(*workers, t.device);
  std::vector<BenchRow> rows;
  for (int comm : comm_sms) {
    for (int64_t minibatch : minibatches) {
      MegakernelConfig cfg = o.megakernel;
      cfg.num_comm_sms = comm;
      cfg.minibatch_size = minibatch;
      cfg.macrobatch_size = std::max(cfg.macrobatch_size / minibatch, int64_t(1)) * minibatch;
      auto mk = megakernel_layer(sh, group.get(), cfg, tokens);
      double ms = time_ms([&] { mk->forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); }, o.warmup, o.iters, s);
      MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
      mk->check_errors();
      if (workers) ms = max_over_ranks(*workers, ms);
      BenchRow row = cuda_row(ns, "megakernel comm_sms=" + std::to_string(comm) + " minibatch=" + std::to_string(minibatch),
                            t.device, R, tokens, o.iters);
      row.fwd_ms = ms;
      row.tflops = sh.forward_flops(tokens) / (ms * 1e-3) / 1e12;
      row.extra = {{"num_comm_sms", comm}, {"minibatch_size", minibatch}, {"tflops_note", "forward only"}};
      rows.push_back(row);
    }
  }
  group.reset();
  MOKA_CUDA_CHECK(cudaStreamDestroy(s));
  if (rank != 0) rows.clear();
  return rows;
}

}  // namespace moka::cli
