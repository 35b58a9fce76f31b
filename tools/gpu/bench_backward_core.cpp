// `moka bench --mode backward-core`: the backward megakernel alone on one GPU (EP = 1: its pulls
// and pushes are local copies), resident context mode, over the grouped rows the forward core
// (`--mode core`'s megakernel) leaves: x, g and u of every routed row. The two are timed
// alternately; the backward is set against its floor, 2x the routed forward's FLOPs at the
// GPU's dense peak. Routed experts only (a shape's shared expert is left out, as in --mode core).
#include <random>
#include <vector>

#include "bench_cuda.hpp"
#include "core/routing_gen.hpp"
#include "cuda/megakernel/backward.hpp"
#include "cuda/megakernel/gemm_core.hpp"
#include "gpu/bench_timing.hpp"

namespace moka::cli {
namespace {

// A device array of one pointer: the peer table of a one-rank group.
template <typename T>
Dev peer_table(T* p) {
  Dev table(sizeof(T*));
  MOKA_CUDA_CHECK(cudaMemcpy(table.data(), &p, sizeof(T*), cudaMemcpyHostToDevice));
  return table;
}

}  // namespace

BenchRow run_cuda_backward_core_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o) {
  const CaseStream stream("moka bench --mode backward-core");
  const cudaStream_t s = stream.s;
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MoeShape sh = ns.shape;
  sh.shared_intermediate = 0;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.num_experts, k = sh.top_k;
  const double peak = dense_peak_tflops(s);
  cuda::MegakernelCore core(sh, o.megakernel, tokens);  // checks the shape and knobs first
  cuda::MegakernelBackward backward(sh, o.megakernel, 1, tokens);

  // Inputs: random x, d_out and weights (N(0, 1/fan_in)), uniform routing, random route weights.
  std::mt19937_64 rng(o.seed);
  Dev x(tokens * H * 2), d_out(x.bytes()), ids(tokens * k * 4), route_weights(tokens * k * 4);
  Dev wg(E * I * H * 2), wu(wg.bytes()), wd(wg.bytes());
  x.fill_normal(1.0, rng());
  d_out.fill_normal(1.0, rng());
  wg.fill_normal(1 / std::sqrt(double(H)), rng());
  wu.fill_normal(1 / std::sqrt(double(H)), rng());
  wd.fill_normal(1 / std::sqrt(double(I)), rng());
  const std::vector<int32_t> topk = core::sample_topk_ids({core::RoutingKind::uniform, 0, o.seed}, tokens, k, E);
  std::vector<float> weights(topk.size());
  std::uniform_real_distribution<float> w01(0.f, 1.f);
  for (float& w : weights) w = w01(rng);
  MOKA_CUDA_CHECK(cudaMemcpy(ids.data(), topk.data(), ids.bytes(), cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(route_weights.data(), weights.data(), route_weights.bytes(), cudaMemcpyHostToDevice));

  // The forward core's grouped rows: x gathered into expert segments (zero padding rows), then
  // g, u (and h, y) from one core run: the resident context.
  const cuda::GroupedSchedule sched(ids.as<int32_t>(), route_weights.as<float>(), sh, tokens, o.tile_rows, s);
  const int64_t rows = core.rows();
  require(rows >= sched.rows, ErrorCode::internal, "megakernel core holds fewer rows than the schedule");
  Dev grouped(rows * H * 2), gate(rows * I * 2), up(gate.bytes()), hidden(gate.bytes()), y(grouped.bytes());
  MOKA_CUDA_CHECK(cudaMemsetAsync(grouped.data(), 0, grouped.bytes(), s));
  cuda::gather_rows(x.as<cuda::bf16>(), grouped.as<cuda::bf16>(), sched.row_of_slot.as<int32_t>(), tokens * k, k, H, s);
  const cuda::GroupedExpertRows context{grouped.as<cuda::bf16>(), sched.offsets.as<int32_t>(), gate.as<cuda::bf16>(),
                                        up.as<cuda::bf16>(), hidden.as<cuda::bf16>(), y.as<cuda::bf16>()};
  auto run_forward = [&] { core.run(context, wg.as<cuda::bf16>(), wu.as<cuda::bf16>(), wd.as<cuda::bf16>(), s); };
  run_forward();

  // slot_of_row: the inverse of the schedule's row_of_slot (padding rows -1).
  std::vector<int32_t> row_of_slot(tokens * k), slot_of_row(rows, -1);
  MOKA_CUDA_CHECK(cudaMemcpy(row_of_slot.data(), sched.row_of_slot.data(), row_of_slot.size() * 4,
                             cudaMemcpyDeviceToHost));
  for (size_t slot = 0; slot < row_of_slot.size(); ++slot) slot_of_row[row_of_slot[slot]] = int32_t(slot);
  Dev slot_rows(rows * 4);
  MOKA_CUDA_CHECK(cudaMemcpy(slot_rows.data(), slot_of_row.data(), slot_rows.bytes(), cudaMemcpyHostToDevice));

  Dev d_x(x.bytes()), d_topk(tokens * k * 4), dx_slots(tokens * k * H * 2);
  Dev d_wg(wg.bytes()), d_wu(wg.bytes()), d_wd(wg.bytes());
  const Dev x_peers = peer_table(x.as<cuda::bf16>()), d_out_peers = peer_table(d_out.as<cuda::bf16>());
  const Dev weight_peers = peer_table(route_weights.as<float>()), dx_peers = peer_table(dx_slots.as<cuda::bf16>());
  const Dev dw_peers = peer_table(d_topk.as<float>());
  cuda::MegakernelBackwardIo io;
  io.offsets = sched.offsets.as<int32_t>();
  io.slot_of_row = slot_rows.as<int32_t>();
  io.x_peers = x_peers.as<const cuda::bf16*>();
  io.d_out_peers = d_out_peers.as<const cuda::bf16*>();
  io.weight_peers = weight_peers.as<const float*>();
  io.dx_slot_peers = dx_peers.as<cuda::bf16*>();
  io.dw_slot_peers = dw_peers.as<float*>();
  io.x = x.as<cuda::bf16>();
  io.d_out = d_out.as<cuda::bf16>();
  io.dx_slots = dx_slots.as<cuda::bf16>();
  io.context_x = grouped.as<cuda::bf16>();
  io.context_gate = gate.as<cuda::bf16>();
  io.context_up = up.as<cuda::bf16>();
  io.w_gate = wg.as<cuda::bf16>();
  io.w_up = wu.as<cuda::bf16>();
  io.w_down = wd.as<cuda::bf16>();
  io.d_x = d_x.as<cuda::bf16>();
  io.d_w_gate = d_wg.as<cuda::bf16>();
  io.d_w_up = d_wu.as<cuda::bf16>();
  io.d_w_down = d_wd.as<cuda::bf16>();
  auto run_backward = [&] { backward.run(io, tokens, s); };
  run_backward();
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  core.check_errors();
  backward.check_errors();

  // The forward core first, then the backward: the backward reads the context it leaves.
  const Paired t = time_paired(run_forward, run_backward, o.warmup, o.iters, s);
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  core.check_errors();
  backward.check_errors();
  const double forward_flops = 6.0 * double(tokens * k) * double(H) * double(I);  // routed rows, no padding
  const double backward_flops = 2 * forward_flops, floor_ms = backward_flops / (peak * 1e12) * 1e3;
  std::vector<int32_t> offsets(E + 1);
  MOKA_CUDA_CHECK(cudaMemcpy(offsets.data(), sched.offsets.data(), offsets.size() * 4, cudaMemcpyDeviceToHost));

  BenchRow row = cuda_row(ns, "mk-backward-core", device, 1, tokens, o.iters);
  row.fwd_ms = t.a_ms;
  row.bwd_ms = t.b_ms;
  row.fwdbwd_ms = t.a_ms + t.b_ms;
  row.tflops = (forward_flops + backward_flops) / (row.fwdbwd_ms * 1e-3) / 1e12;
  auto& e = row.extra;
  e["dense_peak_tflops"] = peak;
  e["backward_tflops"] = backward_flops / (t.b_ms * 1e-3) / 1e12;
  e["backward_pct_peak"] = 100.0 * backward_flops / (t.b_ms * 1e-3) / 1e12 / peak;
  e["floor_bwd_ms"] = floor_ms;
  e["bwd_vs_floor"] = t.b_ms / floor_ms;
  e["bwd_vs_fwd_core"] = t.ratio;  // median over paired runs of backward / forward core
  e["grouped_rows"] = offsets[E];
  e["backward_macrobatches"] = core::ceil_div(offsets[E], backward.plan().macrobatch_rows);
  e["megakernel_config"] = megakernel_config_text(o.megakernel);
  e["times"] = "medians of runs alternating the forward core and the backward megakernel";
  return row;
}

}  // namespace moka::cli
