// fp8_gemm: the FP8 recipe's grouped GEMMs (cuda::GemmOperands::e4m3_*) against the bf16 ones on
// the same rows, one GPU, uniform routing: the layer's forward gate|up (two groups per expert,
// K = hidden) and down (K = intermediate) products, the data gradient dh = d_out W_down (K =
// hidden; e4m3 reads W_down^T's codes) and the weight gradients of gate|up and down (K = an
// expert's rows) over the single-GPU schedule's packed rows, with the e4m3 codes and scales made
// by cuda::quantize_rows_e4m3 / quantize_blocks_e4m3 / quantize_columns_e4m3.
// Per product: both kernels' outputs compared (the relative 2-norm of fp8 - bf16: the recipe's
// quantization error, ~3-6%; a wrong tile shows as O(1)), then the two timed alternately, run by
// run: TFLOP/s on the useful FLOPs, the median of the per-run ratios, and the quantizers'
// bandwidth on the product's A (per call) and weights (once per optimizer step). A comparison above kMaxRelL2 fails the run (exit 2, no row).
#include <cuda_bf16.h>

#include <cmath>
#include <string>

#include "core/fp8.hpp"
#include "cuda/gemm/fp8_quantize.hpp"
#include "cuda/layer/layer_gemms.hpp"
#include "kernel_lab.hpp"

namespace moka::lab {
namespace {

constexpr double kMaxRelL2 = 0.1;

// ||a - b|| / ||b|| over two bf16 buffers of the same size.
double rel_l2(const Dev& a, const Dev& b) {
  const auto x = cli::read_bf16(a), y = cli::read_bf16(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double p = __bfloat162float(x[i]), q = __bfloat162float(y[i]);
    num += (p - q) * (p - q), den += q * q;
  }
  return std::sqrt(num / den);
}

// Runs both kernels once and checks the e4m3 outputs against the bf16 ones (kMaxRelL2: a wrong
// tile is O(1) off), then times the two run by run and records `name`'s fields: the medians' ms
// and TFLOP/s on `flops`, the median of the per-run speedups, the relative 2-norm.
template <class RunBf16, class RunFp8>
void compare_and_time(const std::string& shape, const std::string& name, const std::vector<Dev>& out_bf16,
                      const std::vector<Dev>& out_fp8, RunBf16&& run_bf16, RunFp8&& run_fp8, double flops,
                      const CaseOptions& o, cudaStream_t s, nlohmann::ordered_json& extra) {
  run_bf16();
  run_fp8();
  MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
  double err = 0;
  for (size_t i = 0; i < out_bf16.size(); ++i) err = std::max(err, rel_l2(out_fp8[i], out_bf16[i]));
  require(err <= kMaxRelL2, ErrorCode::internal,
          shape + " " + name + ": the e4m3 GEMM is " + std::to_string(err) + " (relative 2-norm) off the bf16 one");
  const cli::Paired t = cli::time_paired(run_bf16, run_fp8, o.warmup, o.iters, s);
  extra[name + "_fp8_ms"] = t.b_ms;
  extra[name + "_bf16_ms"] = t.a_ms;
  extra[name + "_fp8_tflops"] = flops / (t.b_ms * 1e-3) / 1e12;
  extra[name + "_bf16_tflops"] = flops / (t.a_ms * 1e-3) / 1e12;
  extra[name + "_fp8_speedup"] = 1.0 / t.ratio;
  extra[name + "_fp8_vs_bf16_rel_l2"] = err;
}

// One product over every expert's rows: A = the grouped rows [rows, K], B = `weights`
// [E, N, K] (one or two matrices: gate and up), D [rows, N] per matrix. `transposed`: the
// weights are stored [E, K, N] (W_down for dh = d_out W_down): bf16 reads them in place as an
// MN-major B, as the layer does; e4m3 reads W^T's codes, which the weights' quantizer writes in
// the same pass as W's.
struct Product {
  const char* name;
  int64_t n, k;
  std::vector<const Dev*> weights;
  bool transposed = false;
};

void run_product(const Product& p, const NamedShape& ns, const fixtures::GroupedSchedule& sched, const CaseOptions& o,
                 int device, cudaStream_t s, nlohmann::ordered_json& extra) {
  const int64_t E = ns.shape.num_experts, rows = sched.rows, kb = core::fp8_tiles(p.k, 128),
                nb = core::fp8_tiles(p.n, 128), W = int64_t(p.weights.size());
  const int32_t* counts = sched.counts.as<int32_t>();
  const int32_t* offsets = sched.offsets.as<int32_t>();
  Dev a(rows * p.k * 2), a_codes(rows * p.k), a_scales(rows * kb * 4);
  a.fill_normal(1.0, o.seed + 21);
  // Buffers: 0 A, 1 A's scales, then per matrix w: weights 2 + 3w, their scales 3 + 3w, D 4 + 3w.
  std::vector<Dev> codes, scales, out_bf16, out_fp8;
  cuda::BufferTable bf16_table, fp8_table;
  bf16_table.ptr[0] = a.data(), fp8_table.ptr[0] = a_codes.data(), fp8_table.ptr[1] = a_scales.data();
  std::vector<cuda::GroupSpec> bf16_groups, fp8_groups;
  std::vector<Dev> stored_codes, stored_scales;  // W's own codes when the product reads W^T's
  auto quantize_weights = [&] {
    for (int64_t w = 0; w < W; ++w) {
      const void* in = p.weights[w]->data();
      if (p.transposed)
        cuda::quantize_blocks_e4m3(in, E, p.k, p.n, stored_codes[w].as<uint8_t>(), stored_scales[w].as<float>(),
                                   codes[w].as<uint8_t>(), scales[w].as<float>(), s);
      else
        cuda::quantize_blocks_e4m3(in, E, p.n, p.k, codes[w].as<uint8_t>(), scales[w].as<float>(), nullptr, nullptr, s);
    }
  };
  for (int64_t w = 0; w < W; ++w) {
    codes.emplace_back(E * p.n * p.k);
    scales.emplace_back(E * nb * kb * 4);
    if (p.transposed) {
      stored_codes.emplace_back(E * p.n * p.k);
      stored_scales.emplace_back(E * nb * kb * 4);
    }
    out_bf16.emplace_back(rows * p.n * 2);
    out_fp8.emplace_back(rows * p.n * 2);
    const int wb = int(2 + 3 * w), sb = wb + 1, db = wb + 2;
    bf16_table.ptr[wb] = p.weights[w]->data(), bf16_table.ptr[db] = out_bf16[w].data();
    fp8_table.ptr[wb] = codes[w].data(), fp8_table.ptr[sb] = scales[w].data(), fp8_table.ptr[db] = out_fp8[w].data();
  }
  for (int e = 0; e < E; ++e)
    for (int64_t w = 0; w < W; ++w) {
      const int wb = int(2 + 3 * w);
      cuda::GroupSpec g = expert_rows_group(e, 0, p.k, wb, e * p.n * p.k, p.k, wb + 2, p.n, p.n, p.k);
      g.sfa = 1, g.sfb = wb + 1, g.sfb_off = e * nb * kb;
      fp8_groups.push_back(g);
      if (p.transposed) g.ldb = p.n;  // bf16: W [K, N] per expert, MN-major
      bf16_groups.push_back(g);
    }
  cuda::GroupedGemm bf16(bf16_groups, cuda::GemmLayout{cuda::Major::k, p.transposed ? cuda::Major::mn : cuda::Major::k},
                         device);
  cuda::GroupedGemm fp8(fp8_groups,
                        cuda::GemmLayout{cuda::Major::k, cuda::Major::k, cuda::GemmSchedule::cooperative,
                                         cuda::GemmOperands::e4m3_block_scaled},
                        device);
  auto quantize = [&] {
    cuda::quantize_rows_e4m3(a.data(), rows, p.k, p.k, offsets, int(E), a_codes.as<uint8_t>(), a_scales.as<float>(), s);
  };
  auto run_bf16 = [&] { bf16.run(bf16_table, counts, offsets, s); };
  auto run_fp8 = [&] { fp8.run(fp8_table, counts, offsets, s); };
  quantize_weights();
  quantize();
  // Useful FLOPs: every row is a route (packed segments: rows = tokens * top_k).
  const double flops = 2.0 * double(rows) * double(W * p.n) * double(p.k);
  const std::string name = p.name;
  compare_and_time(ns.name, name, out_bf16, out_fp8, run_bf16, run_fp8, flops, o, s, extra);
  const double quantize_ms = cli::time_ms(quantize, o.warmup, o.iters, s);
  const double weights_ms = cli::time_ms(quantize_weights, o.warmup, o.iters, s);
  // The row quantizer reads bf16 and writes codes and scales: 3 bytes per element and a float per tile.
  extra[name + "_quantize_rows_ms"] = quantize_ms;
  extra[name + "_quantize_rows_gbps"] = double(rows) * double(3 * p.k + 4 * kb) / (quantize_ms * 1e-3) / 1e9;
  extra[name + "_quantize_weights_ms"] = weights_ms;
  const double weight_bytes = double(p.n * p.k) * (p.transposed ? 4 : 3) + double(nb * kb) * (p.transposed ? 8 : 4);
  extra[name + "_quantize_weights_gbps"] = double(W * E) * weight_bytes / (weights_ms * 1e-3) / 1e9;
}

// A weight gradient over every expert's rows, K = the expert's row count: D_e [m, n] = sum over
// its rows r of A[r, m] B[r, n], for `a_count` A matrices sharing B (dW_gate, dW_up = dG^T x,
// dU^T x) or one (dW_down = d_out^T (w h)). bf16 reads the grouped rows in place as MN-major
// operands in the layer's kernel schedule; e4m3 reads their K-major copies, made per call by
// cuda::quantize_columns_e4m3 (timed on their own: the columns quantizer's bandwidth).
struct WeightGradient {
  const char* name;
  int64_t m, n;
  int a_count;
};

void run_weight_gradient(const WeightGradient& p, const NamedShape& ns, int64_t tokens,
                         const fixtures::GroupedSchedule& sched, const CaseOptions& o, int device, cudaStream_t s,
                         nlohmann::ordered_json& extra) {
  const int64_t E = ns.shape.num_experts, rows = sched.rows, A = p.a_count;
  const int64_t pitch = core::transposed_pitch(rows, E), blocks = core::transposed_blocks(rows, E);
  const int32_t* counts = sched.counts.as<int32_t>();
  const int32_t* offsets = sched.offsets.as<int32_t>();
  Dev b(rows * p.n * 2), b_codes(p.n * pitch), b_scales(blocks * p.n * 4);
  b.fill_normal(1.0, o.seed + 31);
  // bf16 buffers: 0 B, then per A matrix i: A 1 + 2i, D 2 + 2i. e4m3: 0 B's codes, 1 its scales,
  // then A's codes 2 + 3i, scales 3 + 3i, D 4 + 3i.
  std::vector<Dev> a, a_codes, a_scales, out_bf16, out_fp8;
  cuda::BufferTable bf16_table, fp8_table;
  bf16_table.ptr[0] = b.data(), fp8_table.ptr[0] = b_codes.data(), fp8_table.ptr[1] = b_scales.data();
  for (int64_t i = 0; i < A; ++i) {
    a.emplace_back(rows * p.m * 2);
    a.back().fill_normal(1.0, o.seed + 32 + uint64_t(i));
    a_codes.emplace_back(p.m * pitch);
    a_scales.emplace_back(blocks * p.m * 4);
    out_bf16.emplace_back(E * p.m * p.n * 2);
    out_fp8.emplace_back(E * p.m * p.n * 2);
    for (const Dev* d : {&out_bf16.back(), &out_fp8.back()})
      MOKA_CUDA_CHECK(cudaMemsetAsync(d->data(), 0, d->bytes(), s));
    bf16_table.ptr[1 + 2 * i] = a[i].data(), bf16_table.ptr[2 + 2 * i] = out_bf16[i].data();
    fp8_table.ptr[2 + 3 * i] = a_codes[i].data(), fp8_table.ptr[3 + 3 * i] = a_scales[i].data();
    fp8_table.ptr[4 + 3 * i] = out_fp8[i].data();
  }
  std::vector<cuda::GroupSpec> bf16_groups, fp8_groups;
  for (int e = 0; e < E; ++e)
    for (int64_t i = 0; i < A; ++i) {
      cuda::GroupSpec g;
      g.expert = e, g.count_dim = cuda::CountDim::k, g.m = int(p.m), g.n = int(p.n);
      g.d_off = e * p.m * p.n, g.ldd = p.n;
      cuda::GroupSpec bf = g, f8 = g;
      bf.a = int(1 + 2 * i), bf.a_step = p.m, bf.lda = p.m, bf.b = 0, bf.b_step = p.n, bf.ldb = p.n;
      bf.d = int(2 + 2 * i);
      f8.a = int(2 + 3 * i), f8.a_step = 1, f8.lda = pitch, f8.sfa = int(3 + 3 * i);
      f8.b = 0, f8.b_step = 1, f8.ldb = pitch, f8.sfb = 1, f8.d = int(4 + 3 * i);
      bf16_groups.push_back(bf);
      fp8_groups.push_back(f8);
    }
  const cuda::GemmSchedule layer_schedule =
      cuda::staged::layer_gemm_specs(ns.shape, E, tokens).weight_grad_gate_up.layout.schedule;
  cuda::GroupedGemm bf16(bf16_groups, cuda::GemmLayout{cuda::Major::mn, cuda::Major::mn, layer_schedule}, device);
  cuda::GroupedGemm fp8(fp8_groups,
                        cuda::GemmLayout{cuda::Major::k, cuda::Major::k, cuda::GemmSchedule::cooperative,
                                         cuda::GemmOperands::e4m3_tile_scaled},
                        device);
  auto quantize = [&] {
    cuda::quantize_columns_e4m3(b.data(), rows, p.n, p.n, offsets, int(E), b_codes.as<uint8_t>(), b_scales.as<float>(),
                                s);
    for (int64_t i = 0; i < A; ++i)
      cuda::quantize_columns_e4m3(a[i].data(), rows, p.m, p.m, offsets, int(E), a_codes[i].as<uint8_t>(),
                                  a_scales[i].as<float>(), s);
  };
  auto run_bf16 = [&] { bf16.run(bf16_table, counts, offsets, s); };
  auto run_fp8 = [&] { fp8.run(fp8_table, counts, offsets, s); };
  quantize();
  const double flops = 2.0 * double(rows) * double(A * p.m) * double(p.n);
  const std::string name = p.name;
  compare_and_time(ns.name, name, out_bf16, out_fp8, run_bf16, run_fp8, flops, o, s, extra);
  const double quantize_ms = cli::time_ms(quantize, o.warmup, o.iters, s);
  // Per copy: bf16 rows read, codes written, a float per column per 128 rows.
  const double copy_bytes = double(rows) * double(A * p.m + p.n) * 3.0 + double(blocks) * double(A * p.m + p.n) * 4.0;
  extra[name + "_quantize_columns_ms"] = quantize_ms;
  extra[name + "_quantize_columns_gbps"] = copy_bytes / (quantize_ms * 1e-3) / 1e9;
}

BenchRow run_case(const NamedShape& ns, int64_t tokens, const CaseOptions& o) {
  const cli::CaseStream stream("fp8_gemm");
  const cudaStream_t s = stream.s;
  const MoeShape& sh = ns.shape;
  const double peak = cli::dense_peak_tflops(s);
  cli::LayerTensors t(sh, tokens);
  t.randomize_uniform(o.seed);
  // The single-GPU path's schedule: each expert's rows packed after the previous one's.
  const fixtures::GroupedSchedule sched(t.ids.as<int32_t>(), t.w.as<float>(), sh, tokens, 1, s);
  BenchRow row = cli::cuda_row(ns, "fp8-grouped-gemm", t.device, 1, tokens, o.iters);
  row.dtype = "fp8";
  auto& e = row.extra;
  e["dense_bf16_peak_tflops"] = peak;
  run_product({"gate_up", sh.intermediate, sh.hidden, {&t.wg, &t.wu}}, ns, sched, o, t.device, s, e);
  run_product({"down", sh.hidden, sh.intermediate, {&t.wd}}, ns, sched, o, t.device, s, e);
  run_product({"dh", sh.intermediate, sh.hidden, {&t.wd}, true}, ns, sched, o, t.device, s, e);
  run_weight_gradient({"wgrad_gate_up", sh.intermediate, sh.hidden, 2}, ns, tokens, sched, o, t.device, s, e);
  run_weight_gradient({"wgrad_down", sh.hidden, sh.intermediate, 1}, ns, tokens, sched, o, t.device, s, e);
  return row;
}

}  // namespace
}  // namespace moka::lab

int main(int argc, char** argv) {
  using namespace moka::lab;
  CaseOptions cases;
  cases.shapes = {"deepseek-v3", "qwen3-235b-a22b", "mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-120b"};
  CLI::App app{
      "The FP8 recipe's grouped GEMMs (e4m3: forward, data and weight gradients) against bf16 on the same rows (one "
      "GPU)",
      "fp8_gemm"};
  return case_bench_main(app, argc, argv, cases, nullptr,
                         [&](const moka::NamedShape& ns, int64_t t) { return run_case(ns, t, cases); });
}
