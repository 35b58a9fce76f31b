// `moka bench --mode core`: the megakernel's GEMM core alone (its compute role over rows already
// grouped by expert, no communication) against moka's CUTLASS grouped GEMMs on the same rows
// (up, gate with the SwiGLU epilogue, down: the staged layer's fused forward), on one GPU, timed
// alternately after a check that both give the same hidden and output rows.
#include <cstring>
#include <random>

#include "bench_cuda.hpp"
#include "core/routing_gen.hpp"
#include "cuda/megakernel/gemm_core.hpp"
#include "gpu/bench_timing.hpp"

namespace moka::cli {
namespace {

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
  void run(const cuda::BufferTable& table, const cuda::GroupedSchedule& sched, cudaStream_t s) {
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
  const std::vector<__nv_bfloat16> all = read_bf16(buffer);
  std::vector<__nv_bfloat16> rows;
  for (size_t e = 0; e < counts.size(); ++e)
    rows.insert(rows.end(), all.begin() + offsets[e] * width, all.begin() + (offsets[e] + counts[e]) * width);
  return rows;
}

template <typename T>
std::vector<T> download(const Dev& d, size_t count) {
  std::vector<T> h(count);
  MOKA_CUDA_CHECK(cudaMemcpy(h.data(), d.data(), count * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace

BenchRow run_cuda_core_case(const NamedShape& ns, int64_t tokens, const CudaBenchOptions& o) {
  const CaseStream stream("moka bench --mode core");
  const cudaStream_t s = stream.s;
  int device = 0, sms = 0;
  MOKA_CUDA_CHECK(cudaGetDevice(&device));
  MOKA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const MoeShape& sh = ns.shape;
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.num_experts, k = sh.top_k;
  const double peak = dense_peak_tflops(s);
  cuda::MegakernelCore core(sh, o.megakernel, tokens);  // checks the shape and knobs first

  // Inputs: random x and weights (N(0, 1/fan_in)), uniform routing, unit route weights.
  std::mt19937_64 rng(o.seed);
  Dev x(tokens * H * 2), ids(tokens * k * 4), route_weights(tokens * k * 4);
  Dev wg(E * I * H * 2), wu(wg.bytes()), wd(wg.bytes());
  x.fill_normal(1.0, rng());
  wg.fill_normal(1 / std::sqrt(double(H)), rng());
  wu.fill_normal(1 / std::sqrt(double(H)), rng());
  wd.fill_normal(1 / std::sqrt(double(I)), rng());
  const std::vector<int32_t> topk = core::sample_topk_ids({core::RoutingKind::uniform, 0, o.seed}, tokens, k, E);
  const std::vector<float> ones(topk.size(), 1.0f);
  MOKA_CUDA_CHECK(cudaMemcpy(ids.data(), topk.data(), ids.bytes(), cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(route_weights.data(), ones.data(), route_weights.bytes(), cudaMemcpyHostToDevice));

  // The grouped rows both sides read: x gathered into expert segments, zero padding rows.
  const cuda::GroupedSchedule sched(ids.as<int32_t>(), route_weights.as<float>(), sh, tokens, o.tile_rows, s);
  const int64_t rows = core.rows();
  require(rows >= sched.rows, ErrorCode::internal, "megakernel core holds fewer rows than the schedule");
  Dev grouped(rows * H * 2);
  MOKA_CUDA_CHECK(cudaMemsetAsync(grouped.data(), 0, grouped.bytes(), s));
  cuda::gather_rows(x.as<cuda::bf16>(), grouped.as<cuda::bf16>(), sched.row_of_slot.as<int32_t>(), tokens * k, k, H, s);

  Outputs mk(rows, sh), cl(rows, sh);
  const cuda::GroupedExpertRows mk_rows{grouped.as<cuda::bf16>(), sched.offsets.as<int32_t>(), mk.gate.as<cuda::bf16>(),
                                        mk.up.as<cuda::bf16>(), mk.hidden.as<cuda::bf16>(), mk.y.as<cuda::bf16>()};
  auto run_core = [&] { core.run(mk_rows, wg.as<cuda::bf16>(), wu.as<cuda::bf16>(), wd.as<cuda::bf16>(), s); };
  CutlassForward cutlass(sh, device);
  cuda::BufferTable table;
  const Dev* buffers[] = {&grouped, &wg, &wu, &wd, &cl.gate, &cl.up, &cl.hidden, &cl.y};
  for (int b = 0; b < 8; ++b) table.ptr[b] = buffers[b]->data();
  auto run_cutlass = [&] { cutlass.run(table, sched, s); };

  // Check first: the routed rows of hidden and y from both sides.
  run_core();
  run_cutlass();
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  core.check_errors();
  const auto counts = download<int32_t>(sched.counts, E), offsets = download<int32_t>(sched.offsets, E + 1);
  const auto mk_hidden = routed_rows(mk.hidden, I, counts, offsets), cl_hidden = routed_rows(cl.hidden, I, counts, offsets);
  const auto mk_y = routed_rows(mk.y, H, counts, offsets), cl_y = routed_rows(cl.y, H, counts, offsets);
  const bool identical = std::memcmp(mk_hidden.data(), cl_hidden.data(), mk_hidden.size() * 2) == 0 &&
                         std::memcmp(mk_y.data(), cl_y.data(), mk_y.size() * 2) == 0;
  const double diff = std::max(rel_diff(mk_hidden, cl_hidden), rel_diff(mk_y, cl_y));
  require(diff <= 2e-2, ErrorCode::internal,
          "megakernel core and CUTLASS disagree on " + ns.name + ": max relative difference " + std::to_string(diff));

  const Paired t = time_paired(run_cutlass, run_core, o.warmup, o.iters, s);  // a: CUTLASS, b: core
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  core.check_errors();
  const double flops = 6.0 * double(tokens * k) * double(H) * double(I);  // routed rows, padding excluded
  auto tflops = [&](double ms) { return flops / (ms * 1e-3) / 1e12; };

  BenchRow row = cuda_row(ns, "mk-core", device, 1, tokens, o.iters);
  row.fwd_ms = t.b_ms;
  row.tflops = tflops(t.b_ms);
  row.max_rel_error = diff;
  auto& e = row.extra;
  e["error_vs"] = "cutlass-grouped";
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

}  // namespace moka::cli
