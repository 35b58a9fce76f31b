// mk_forward_core: the forward megakernel's GEMM core alone (its compute role over rows already
// grouped by expert, no communication) against moka's CUTLASS grouped GEMMs on the same rows
// (up, gate with the SwiGLU epilogue, down: the staged layer's fused forward), on one GPU, timed
// alternately after a check that both give the same hidden and output rows and that the core's
// agree with the CPU reference on a sample of them. Routed experts only.
#include <cstring>

#include "cuda/megakernel/gemm_core.hpp"
#include "kernel_lab.hpp"

namespace moka::lab {
namespace {

struct Options {
  CaseOptions cases;
  MegakernelConfig megakernel;
};

// Buffer indices of the CUTLASS launches' table.
enum Buffer { kGrouped, kGateWeight, kUpWeight, kDownWeight, kGateOut, kUpOut, kHidden, kExpertOut };

// The routed forward products over grouped rows as the staged layer runs them with
// fused_swiglu: U = x W_up^T; G = x W_gate^T with H = act(G, U) in its epilogue; y = H W_down^T.
struct CutlassForward {
  std::unique_ptr<cuda::GroupedGemm> up, gate, down;
  CutlassForward(const MoeShape& sh, int device) {
    const int64_t H = sh.hidden, I = sh.intermediate;
    std::vector<cuda::GroupSpec> up_groups, gate_groups, down_groups;
    for (int e = 0; e < sh.num_experts; ++e) {
      up_groups.push_back(expert_rows_group(e, kGrouped, H, kUpWeight, e * I * H, H, kUpOut, I, I, H));
      cuda::GroupSpec g = expert_rows_group(e, kGrouped, H, kGateWeight, e * I * H, H, kHidden, I, I, H);
      g.c = kUpOut, g.aux = kGateOut;
      gate_groups.push_back(g);
      down_groups.push_back(expert_rows_group(e, kHidden, I, kDownWeight, e * H * I, I, kExpertOut, H, H, I));
    }
    const cuda::GemmLayout forward{cuda::Major::k, cuda::Major::k};
    up = std::make_unique<cuda::GroupedGemm>(up_groups, forward, device);
    gate = std::make_unique<cuda::GroupedGemm>(gate_groups, forward, device, cuda::GemmEngine::cutlass,
                                               cuda::GemmEpilogue{cuda::GemmEpilogue::swiglu, core::ActParams::of(sh)});
    down = std::make_unique<cuda::GroupedGemm>(down_groups, forward, device);
  }
  void run(const cuda::BufferTable& table, const fixtures::GroupedSchedule& sched, cudaStream_t s) {
    const int32_t *counts = sched.counts.as<int32_t>(), *offsets = sched.offsets.as<int32_t>();
    up->run(table, counts, offsets, s);
    gate->run(table, counts, offsets, s);
    down->run(table, counts, offsets, s);
  }
};

// Where one side writes: gate, up, hidden ([rows, I]) and expert output ([rows, H]).
struct Outputs {
  Dev gate, up, hidden, y;
  Outputs(int64_t rows, const MoeShape& sh)
      : gate(rows * sh.intermediate * 2), up(gate.bytes()), hidden(gate.bytes()), y(rows * sh.hidden * 2) {}
};

// The routed rows of a grouped [rows, width] buffer, expert by expert (padding rows dropped).
std::vector<__nv_bfloat16> routed_rows(const Dev& buffer, int64_t width, const std::vector<int32_t>& counts,
                                       const std::vector<int32_t>& offsets) {
  const std::vector<__nv_bfloat16> all = cli::read_bf16(buffer.data(), buffer.bytes());
  std::vector<__nv_bfloat16> rows;
  for (size_t e = 0; e < counts.size(); ++e)
    rows.insert(rows.end(), all.begin() + offsets[e] * width, all.begin() + (offsets[e] + counts[e]) * width);
  return rows;
}

BenchRow run_case(const NamedShape& ns, int64_t tokens, const Options& o) {
  const cli::CaseStream stream("mk_forward_core");
  const cudaStream_t s = stream.s;
  int device = 0, sms = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const MoeShape& sh = ns.shape;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.num_experts, k = sh.top_k;
  const double peak = cli::dense_peak_tflops(s);
  cuda::MegakernelCore core(sh, o.megakernel, tokens);  // checks the shape and knobs first
  const GroupedRowsCase in(sh, tokens, core.rows(), o.cases.seed, s);

  Outputs mk(core.rows(), sh), cl(core.rows(), sh);
  const cuda::GroupedExpertRows mk_rows{in.grouped.as<cuda::bf16>(), in.sched.offsets.as<int32_t>(),
                                        mk.gate.as<cuda::bf16>(),    mk.up.as<cuda::bf16>(),
                                        mk.hidden.as<cuda::bf16>(),  mk.y.as<cuda::bf16>()};
  auto run_core = [&] { core.run(mk_rows, in.wg.as<cuda::bf16>(), in.wu.as<cuda::bf16>(), in.wd.as<cuda::bf16>(), s); };
  CutlassForward cutlass(sh, device);
  cuda::BufferTable table;
  const Dev* buffers[] = {&in.grouped, &in.wg, &in.wu, &in.wd, &cl.gate, &cl.up, &cl.hidden, &cl.y};
  for (int b = 0; b < 8; ++b) table.ptr[b] = buffers[b]->data();
  auto run_cutlass = [&] { cutlass.run(table, in.sched, s); };

  // Check first: the routed rows of hidden and y from both sides.
  run_core();
  run_cutlass();
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  core.check_errors();
  const auto counts = in.counts(), offsets = in.offsets();
  const auto mk_hidden = routed_rows(mk.hidden, I, counts, offsets),
             cl_hidden = routed_rows(cl.hidden, I, counts, offsets);
  const auto mk_y = routed_rows(mk.y, H, counts, offsets), cl_y = routed_rows(cl.y, H, counts, offsets);
  const bool identical = std::memcmp(mk_hidden.data(), cl_hidden.data(), mk_hidden.size() * 2) == 0 &&
                         std::memcmp(mk_y.data(), cl_y.data(), mk_y.size() * 2) == 0;
  const double diff = std::max(cli::rel_diff(mk_hidden, cl_hidden), cli::rel_diff(mk_y, cl_y));
  require(diff <= 2e-2, ErrorCode::internal,
          "megakernel core and CUTLASS disagree on " + ns.name + ": max relative difference " + std::to_string(diff));
  const double cpu_error = routed_rows_cpu_error(in, mk.hidden, mk.y);
  require(cpu_error <= 2e-2, ErrorCode::internal,
          "megakernel core and the CPU reference disagree on " + ns.name + ": max relative difference " +
              std::to_string(cpu_error));

  const cli::Paired t = cli::time_paired(run_cutlass, run_core, o.cases.warmup, o.cases.iters, s);  // a: CUTLASS
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  core.check_errors();
  const double flops = 6.0 * double(tokens * k) * double(H) * double(I);  // routed rows, padding excluded
  auto tflops = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };

  BenchRow row = cli::cuda_row(ns, "mk-core", device, 1, tokens, o.cases.iters);
  row.fwd_ms = t.b_ms;
  row.tflops = tflops(t.b_ms);
  row.max_rel_error = diff;
  auto& e = row.extra;
  e["error_vs"] = "cutlass-grouped";
  e["cpu_reference_max_rel_error"] = cpu_error;  // on a sample of the routed rows
  e["dense_peak_tflops"] = peak;
  e["core_ms"] = t.b_ms;
  e["cutlass_ms"] = t.a_ms;
  e["core_tflops"] = tflops(t.b_ms);
  e["cutlass_tflops"] = tflops(t.a_ms);
  e["core_pct_peak"] = 100.0 * tflops(t.b_ms) / peak;
  e["cutlass_pct_peak"] = 100.0 * tflops(t.a_ms) / peak;
  e["core_vs_cutlass_throughput"] = 1.0 / t.ratio;  // 1 / the median over paired runs of core_ms / cutlass_ms
  e["core_identical_to_cutlass"] = identical;
  e["core_ctas"] = sms;
  e["grouped_rows"] = offsets[E];
  e["megakernel_config"] = "minibatch=" + std::to_string(o.megakernel.minibatch_size) +
                           " band_row_tiles=" + std::to_string(o.megakernel.band_row_tiles);
  e["times"] = "medians of runs alternating CUTLASS and core";
  return row;
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  Options o;
  CLI::App app{"The forward megakernel's GEMM core against the CUTLASS grouped GEMMs on the same rows (one GPU)",
               "mk_forward_core"};
  return case_bench_main(app, argc, argv, o.cases, &o.megakernel,
                         [&](const moka::NamedShape& ns, int64_t t) { return run_case(ns, t, o); });
}
