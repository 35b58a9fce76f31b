// staged_baselines: the single-GPU staged path against what it replaced, on one GPU and uniform
// routing: its outputs (out, d_x, d_w_down) checked element by element against the per-expert
// cuBLAS loop's (max_rel_error), both paths' forward, backward and fwd+bwd times, and the
// forward gate|up grouped GEMM alone (2E groups, this routing's counts) against the dense peak.
// Both the loop and the grouped GEMM are library internals, hence here and not in `moka bench`.
#include "cuda/cuda_backend.hpp"
#include "kernel_lab.hpp"

namespace moka::lab {
namespace {

struct LayerTimes {
  double fwd = 0, bwd = 0, fwdbwd = 0;
};

LayerTimes time_layer(MoeLayer& layer, const cli::LayerTensors& t, const CaseOptions& o, cudaStream_t s) {
  LayerTimes r;
  std::unique_ptr<MoeContext> ctx;
  r.fwd = cli::time_ms([&] { ctx = layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s}); }, o.warmup,
                       o.iters, s);
  r.bwd = cli::time_ms([&] { layer.backward(*ctx, t.d_out_view(), t.weights(), t.gradients(), Stream{s}); }, o.warmup,
                       o.iters, s);
  r.fwdbwd = cli::time_ms(
      [&] {
        layer.consume_backward(layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s}), t.d_out_view(),
                               t.weights(), t.gradients(), Stream{s});
      },
      o.warmup, o.iters, s);
  layer.check_errors();
  return r;
}

// out, d_x and d_w_down of one forward+backward.
struct StepOutputs {
  std::vector<__nv_bfloat16> out, d_x, d_w_down;
};
StepOutputs step_outputs(MoeLayer& layer, const cli::LayerTensors& t, cudaStream_t s) {
  layer.consume_backward(layer.forward(t.inputs(), t.weights(), t.out_view(), Stream{s}), t.d_out_view(), t.weights(),
                         t.gradients(), Stream{s});
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  layer.check_errors();
  return {cli::read_bf16(t.out), cli::read_bf16(t.d_x), cli::read_bf16(t.dwd)};
}

// The forward gate|up grouped GEMM alone over this routing's grouped rows, as TFLOP/s.
double grouped_gemm_tflops(const MoeShape& sh, const cli::LayerTensors& t, const CaseOptions& o, cudaStream_t s) {
  const int64_t H = sh.hidden, I = sh.intermediate;
  const fixtures::GroupedSchedule sched(t.ids.as<int32_t>(), t.w.as<float>(), sh, t.T, 128, s);
  cli::DeviceBuffer xg(sched.rows * H * 2), gate(sched.rows * I * 2), up(gate.bytes());
  xg.fill_normal(1.0, o.seed + 11);
  std::vector<cuda::GroupSpec> groups;
  for (int e = 0; e < sh.num_experts; ++e)
    for (int which = 0; which < 2; ++which)
      groups.push_back(expert_rows_group(e, 0, H, 1 + which, e * I * H, H, 3 + which, I, I, H));
  cuda::GroupedGemm gemm(groups, cuda::GemmLayout{}, t.device);
  cuda::BufferTable table;
  table.ptr[0] = xg.data(), table.ptr[1] = t.wg.data(), table.ptr[2] = t.wu.data();
  table.ptr[3] = gate.data(), table.ptr[4] = up.data();
  const double ms = cli::time_ms([&] { gemm.run(table, sched.counts.as<int32_t>(), sched.offsets.as<int32_t>(), s); },
                                 o.warmup, o.iters, s);
  return 2.0 * double(t.T * sh.top_k) * 2.0 * double(I) * double(H) / (ms * 1e-3) / 1e12;
}

BenchRow run_case(const NamedShape& ns, int64_t tokens, const CaseOptions& o) {
  const cli::CaseStream stream("staged_baselines");
  const cudaStream_t s = stream.s;
  const MoeShape& sh = ns.shape;
  const double peak = cli::dense_peak_tflops(s);
  cli::LayerTensors t(sh, tokens);
  t.randomize_uniform(o.seed);
  LayerOptions lo;
  lo.path = LayerPath::single_gpu;
  BenchRow row = cli::cuda_row(ns, "single-gpu", t.device, 1, tokens, o.iters);
  auto& e = row.extra;
  {
    auto loop = cuda::make_cuda_baseline_layer(sh, lo);
    const StepOutputs want = step_outputs(*loop, t, s);
    const LayerTimes b = time_layer(*loop, t, o, s);
    e["error_vs"] = "cublas-loop";
    e["baseline_fwd_ms"] = b.fwd;
    e["baseline_bwd_ms"] = b.bwd;
    e["baseline_fwdbwd_ms"] = b.fwdbwd;
    auto layer = make_moe_layer(sh, Backend::cuda, nullptr, lo);
    const StepOutputs got = step_outputs(*layer, t, s);
    row.max_rel_error = std::max({cli::rel_diff(got.out, want.out), cli::rel_diff(got.d_x, want.d_x),
                                  cli::rel_diff(got.d_w_down, want.d_w_down)});
    const LayerTimes m = time_layer(*layer, t, o, s);
    row.fwd_ms = m.fwd;
    row.bwd_ms = m.bwd;
    row.fwdbwd_ms = m.fwdbwd;
    row.tflops = 3.0 * sh.forward_flops(tokens) / (m.fwdbwd * 1e-3) / 1e12;
    e["speedup_vs_cublas_loop"] = b.fwdbwd / m.fwdbwd;
  }  // the layers' workspaces, before the grouped GEMM allocates its own
  const double gemm = grouped_gemm_tflops(sh, t, o, s);
  e["dense_peak_tflops"] = peak;
  e["grouped_gemm_tflops"] = gemm;
  e["grouped_gemm_pct_peak"] = 100.0 * gemm / peak;
  return row;
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  CaseOptions cases;
  CLI::App app{"The single-GPU path against the per-expert cuBLAS loop, and the grouped GEMM alone (one GPU)",
               "staged_baselines"};
  return case_bench_main(app, argc, argv, cases, nullptr,
                         [&](const moka::NamedShape& ns, int64_t t) { return run_case(ns, t, cases); });
}
