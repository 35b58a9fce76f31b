// mk_backward_core: the backward megakernel alone on one GPU (EP = 1: its pulls and pushes are
// local copies), resident context mode, over the grouped rows the forward core (mk_forward_core's
// megakernel) leaves: x, g and u of every routed row. The two are timed alternately; the backward
// is set against its floor, 2x the routed forward's FLOPs at the GPU's dense peak. Routed experts
// only (a shape's shared expert is left out, as in mk_forward_core). Its gradients are checked
// against the CPU emulation by the GPU tests (MegakernelBackward*).
#include "cuda/megakernel/backward.hpp"
#include "cuda/megakernel/gemm_core.hpp"
#include "kernel_lab.hpp"

namespace moka::lab {
namespace {

struct Options {
  CaseOptions cases;
  MegakernelConfig megakernel;
};

// A device array of one pointer: the peer table of a one-rank group.
template <typename T>
Dev peer_table(T* p) {
  Dev table(sizeof(T*));
  table.upload(&p);  // in place on return, before the backward reads it on the case's stream
  return table;
}

// slot_of_row: the inverse of the schedule's row_of_slot (padding rows -1).
Dev slot_of_row(const GroupedRowsCase& in, int64_t rows) {
  std::vector<int32_t> row_of_slot(in.tokens * in.shape.top_k), slots(rows, -1);
  MOKA_CUDA_CHECK(
      cudaMemcpy(row_of_slot.data(), in.sched.row_of_slot.data(), row_of_slot.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t slot = 0; slot < row_of_slot.size(); ++slot) slots[row_of_slot[slot]] = int32_t(slot);
  Dev d(rows * 4);
  d.upload(slots.data());
  return d;
}

BenchRow run_case(const NamedShape& ns, int64_t tokens, const Options& o) {
  const cli::CaseStream stream("mk_backward_core");
  const cudaStream_t s = stream.s;
  int device = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MoeShape sh = ns.shape;
  sh.shared_intermediate = 0;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.num_experts, k = sh.top_k;
  const double peak = cli::dense_peak_tflops(s);
  cuda::MegakernelCore core(sh, o.megakernel, tokens);  // checks the shape and knobs first
  cuda::MegakernelBackward backward(sh, o.megakernel, 1, tokens);
  const int64_t rows = core.rows();
  const GroupedRowsCase in(sh, tokens, rows, o.cases.seed, s);

  // The forward core's grouped rows: g, u (and h, y) from one core run, the resident context.
  Dev gate(rows * I * 2), up(gate.bytes()), hidden(gate.bytes()), y(in.grouped.bytes());
  const cuda::GroupedExpertRows context{in.grouped.as<cuda::bf16>(), in.sched.offsets.as<int32_t>(),
                                        gate.as<cuda::bf16>(),       up.as<cuda::bf16>(),
                                        hidden.as<cuda::bf16>(),     y.as<cuda::bf16>()};
  auto run_forward = [&] {
    core.run(context, in.wg.as<cuda::bf16>(), in.wu.as<cuda::bf16>(), in.wd.as<cuda::bf16>(), s);
  };
  run_forward();

  const Dev slot_rows = slot_of_row(in, rows);
  Dev d_x(in.x.bytes()), d_topk(tokens * k * 4), dx_slots(tokens * k * H * 2);
  Dev d_wg(in.wg.bytes()), d_wu(in.wg.bytes()), d_wd(in.wg.bytes());
  const Dev x_peers = peer_table(in.x.as<cuda::bf16>()), d_out_peers = peer_table(in.d_out.as<cuda::bf16>());
  const Dev weight_peers = peer_table(in.route_weights.as<float>()), dx_peers = peer_table(dx_slots.as<cuda::bf16>());
  const Dev dw_peers = peer_table(d_topk.as<float>());
  cuda::MegakernelBackwardIo io;
  io.offsets = in.sched.offsets.as<int32_t>();
  io.slot_of_row = slot_rows.as<int32_t>();
  io.x_peers = x_peers.as<const cuda::bf16*>();
  io.d_out_peers = d_out_peers.as<const cuda::bf16*>();
  io.weight_peers = weight_peers.as<const float*>();
  io.dx_slot_peers = dx_peers.as<cuda::bf16*>();
  io.dw_slot_peers = dw_peers.as<float*>();
  io.x = in.x.as<cuda::bf16>();
  io.d_out = in.d_out.as<cuda::bf16>();
  io.dx_slots = dx_slots.as<cuda::bf16>();
  io.context_x = in.grouped.as<cuda::bf16>();
  io.context_gate = gate.as<cuda::bf16>();
  io.context_up = up.as<cuda::bf16>();
  io.w_gate = in.wg.as<cuda::bf16>();
  io.w_up = in.wu.as<cuda::bf16>();
  io.w_down = in.wd.as<cuda::bf16>();
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
  const cli::Paired t = cli::time_paired(run_forward, run_backward, o.cases.warmup, o.cases.iters, s);
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  core.check_errors();
  backward.check_errors();
  const double forward_flops = 6.0 * double(tokens * k) * double(H) * double(I);  // routed rows, no padding
  const double backward_flops = 2 * forward_flops, floor_ms = backward_flops / (peak * 1e12) * 1e3;
  const int32_t grouped_rows = in.offsets()[E];

  BenchRow row = cli::cuda_row(ns, "mk-backward-core", device, 1, tokens, o.cases.iters);
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
  e["grouped_rows"] = grouped_rows;
  e["backward_macrobatches"] = core::ceil_div(grouped_rows, backward.plan().macrobatch_rows);
  e["megakernel_config"] = cli::megakernel_config_text(o.megakernel);
  e["times"] = "medians of runs alternating the forward core and the backward megakernel";
  return row;
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  Options o;
  CLI::App app{"The backward megakernel alone on the forward core's grouped rows (one GPU)", "mk_backward_core"};
  return case_bench_main(app, argc, argv, o.cases, &o.megakernel,
                         [&](const moka::NamedShape& ns, int64_t t) { return run_case(ns, t, o); });
}
