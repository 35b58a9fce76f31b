#include "cuda/layer/layer_gemms.hpp"

#include <utility>
#include <vector>

namespace moka::cuda::staged {

// Forward is D = A B^T with both operands K-major; backward reads the same tensors as MN-major
// operands (GemmLayout), so nothing is transposed. The shared expert's dense products are extra
// fixed-size groups, so they overlap with the routed tiles in the same persistent launch.
LayerGemmSpecs layer_gemm_specs(const MoeShape& shape, int64_t local_experts, int64_t tokens) {
  const int64_t H = shape.hidden, I = shape.intermediate, E = local_experts, T = tokens;
  const int64_t Is = shape.shared_intermediate;
  const int Ti = static_cast<int>(T), Hi = static_cast<int>(H), Ii = static_cast<int>(I), Isi = static_cast<int>(Is);
  // A product over a routed expert's rows: m = the expert's row count, A = its segment of a
  // grouped buffer [rows, k], B = its weights at b_off with stored row pitch ldb.
  auto rows_of = [](int e, int a, int64_t lda, int b, int64_t b_off, int64_t ldb, int d, int64_t ldd, int n, int k) {
    GroupSpec g;
    g.a = a, g.a_step = lda, g.lda = lda;
    g.b = b, g.b_off = b_off, g.ldb = ldb;
    g.d = d, g.d_step = ldd, g.ldd = ldd;
    g.n = n, g.k = k, g.expert = e, g.count_dim = CountDim::m;
    return g;
  };
  // A weight gradient D[m, n] = sum over a routed expert's rows r of A[r, m] B[r, n]: k = the
  // expert's row count, A and B are the grouped buffers [rows, m] and [rows, n] read as
  // MN-major operands from the segment's first row (padding rows lie past k: never read).
  auto sum_over_rows = [](int e, int a, int b, int d, int64_t d_off, int m, int n) {
    GroupSpec g;
    g.a = a, g.a_step = m, g.lda = m;
    g.b = b, g.b_step = n, g.ldb = n;
    g.d = d, g.d_off = d_off, g.ldd = n;
    g.m = m, g.n = n, g.expert = e, g.count_dim = CountDim::k;
    return g;
  };
  auto fixed = [](int a, int64_t lda, int b, int64_t ldb, int d, int64_t ldd, int m, int n, int k) {
    GroupSpec g;
    g.a = a, g.lda = lda, g.b = b, g.ldb = ldb, g.d = d, g.ldd = ldd;
    g.m = m, g.n = n, g.k = k;
    return g;
  };
  std::vector<GroupSpec> gate, up, down, dh, dx, wgrad_down, wgrad_gate_up;
  for (int e = 0; e < E; ++e) {
    // Forward: x_g W_gate^T, x_g W_up^T, hidden W_down^T (W [out, in] = [n, k]: K-major).
    gate.push_back(rows_of(e, kGroupedInput, H, kGateWeight, e * I * H, H, kGateOut, I, Ii, Hi));
    up.push_back(rows_of(e, kGroupedInput, H, kUpWeight, e * I * H, H, kUpOut, I, Ii, Hi));
    down.push_back(rows_of(e, kHidden, I, kDownWeight, e * H * I, I, kExpertOut, H, Hi, Ii));
    // Data gradients: dY_g W_down, dG W_gate, dU W_up (W [out, in] = [k, n]: MN-major).
    dh.push_back(rows_of(e, kGroupedOutGrad, H, kDownWeight, e * H * I, I, kHiddenGradUnweighted, I, Ii, Hi));
    dx.push_back(rows_of(e, kGateGrad, I, kGateWeight, e * I * H, H, kInputGradViaGate, H, Hi, Ii));
    dx.push_back(rows_of(e, kUpGrad, I, kUpWeight, e * I * H, H, kInputGradViaUp, H, Hi, Ii));
    // Weight gradients: dG^T x_g, dU^T x_g, dY_g^T (w * hidden).
    wgrad_gate_up.push_back(sum_over_rows(e, kGateGrad, kGroupedInput, kGateWeightGrad, e * I * H, Ii, Hi));
    wgrad_gate_up.push_back(sum_over_rows(e, kUpGrad, kGroupedInput, kUpWeightGrad, e * I * H, Ii, Hi));
    wgrad_down.push_back(sum_over_rows(e, kGroupedOutGrad, kWeightedHidden, kDownWeightGrad, e * H * I, Hi, Ii));
  }
  if (shape.has_shared()) {
    gate.push_back(fixed(kInput, H, kSharedGateWeight, H, kSharedGateOut, Is, Ti, Isi, Hi));
    up.push_back(fixed(kInput, H, kSharedUpWeight, H, kSharedUpOut, Is, Ti, Isi, Hi));
    down.push_back(fixed(kSharedHidden, Is, kSharedDownWeight, Is, kSharedOut, H, Ti, Hi, Isi));
    dh.push_back(fixed(kOutGrad, H, kSharedDownWeight, Is, kSharedHiddenGrad, Is, Ti, Isi, Hi));
    dx.push_back(fixed(kSharedGateGrad, Is, kSharedGateWeight, H, kSharedInputGradViaGate, H, Ti, Hi, Isi));
    dx.push_back(fixed(kSharedUpGrad, Is, kSharedUpWeight, H, kSharedInputGradViaUp, H, Ti, Hi, Isi));
    // k = T: the token-major tensors [T, features] are the MN-major operands.
    wgrad_gate_up.push_back(fixed(kSharedGateGrad, Is, kInput, H, kSharedGateWeightGrad, H, Isi, Hi, Ti));
    wgrad_gate_up.push_back(fixed(kSharedUpGrad, Is, kInput, H, kSharedUpWeightGrad, H, Isi, Hi, Ti));
    wgrad_down.push_back(fixed(kOutGrad, H, kSharedHidden, Is, kSharedDownWeightGrad, Is, Hi, Isi, Ti));
  }
  std::vector<GroupSpec> gate_up;  // one launch, each expert's two groups side by side
  for (size_t i = 0; i < gate.size(); ++i) gate_up.insert(gate_up.end(), {gate[i], up[i]});
  // Each launch's operand layout and kernel schedule (GemmSchedule), one line per role. The
  // weight gradients (K = an expert's rows) take the ping-pong kernel in 2x1 clusters multicasting
  // B, whose two consumer warpgroups overlap one tile's epilogue with the next tile's mainloop,
  // where the mean rows per expert is 512 to 1024 (the counts are the device's): the whole layer's
  // backward measured 0.93-0.98x there on an H200 (deepseek-v3, gpt-oss-120b and qwen3-235b-a22b
  // at 16384 tokens, mixtral-8x7b at 4096) but 1.01-1.06x at 128-256 rows (4096 tokens). Everything
  // else stays cooperative: ping-pong won qwen3-30b-a3b's down and dx (K = 768) alone in
  // bench/kernels/gemm_schedules but lost 4-5% in the layer, and lost at longer K everywhere
  // (bench/results/gemm-schedules-h200-2026-12-03-s17.jsonl, layer-paired-h200-2026-12-03-s17.jsonl).
  const int64_t rows_per_expert = E > 0 ? T * shape.top_k / E : 0;
  constexpr GemmSchedule coop = GemmSchedule::cooperative;
  const GemmSchedule wgrad =
      rows_per_expert >= 512 && rows_per_expert <= 1024 ? GemmSchedule::pingpong_multicast : coop;
  LayerGemmSpecs specs;
  specs.gate_up = {std::move(gate_up), {Major::k, Major::k, coop}};
  specs.gate = {std::move(gate), {Major::k, Major::k, coop}};  // its SwiGLU epilogue: cooperative only
  specs.up = {std::move(up), {Major::k, Major::k, coop}};
  specs.down = {std::move(down), {Major::k, Major::k, coop}};
  specs.data_grad_h = {std::move(dh), {Major::k, Major::mn, coop}};
  specs.data_grad_x = {std::move(dx), {Major::k, Major::mn, coop}};
  specs.weight_grad_down = {std::move(wgrad_down), {Major::mn, Major::mn, wgrad}};
  specs.weight_grad_gate_up = {std::move(wgrad_gate_up), {Major::mn, Major::mn, wgrad}};
  return specs;
}

std::unique_ptr<LayerGemms> build_layer_gemms(const MoeShape& shape, int64_t local_experts, int64_t tokens,
                                              const ActParams* fused_swiglu, int device, GemmEngine engine) {
  auto gemms = std::make_unique<LayerGemms>();
  LayerGemms& ws = *gemms;
  ws.tokens = tokens;
  LayerGemmSpecs specs = layer_gemm_specs(shape, local_experts, tokens);
  auto build = [&](const LayerGemmSpec& spec) {
    return std::make_unique<GroupedGemm>(spec.groups, spec.layout, device, engine);
  };
  if (fused_swiglu) {
    // U first; then the gate product, whose epilogue reads U as its C operand and writes G
    // (aux) and H (D): three buffers laid out alike.
    for (GroupSpec& g : specs.gate.groups) {
      const bool routed = g.expert >= 0;
      g.aux = g.d, g.c = routed ? kUpOut : kSharedUpOut, g.d = routed ? kHidden : kSharedHidden;
    }
    ws.up = build(specs.up);
    ws.gate = std::make_unique<GroupedGemm>(specs.gate.groups, specs.gate.layout, device, engine,
                                            GemmEpilogue{GemmEpilogue::swiglu, *fused_swiglu});
  } else {
    ws.gate_up = build(specs.gate_up);
  }
  ws.down = build(specs.down);
  ws.data_grad_h = build(specs.data_grad_h);
  ws.data_grad_x = build(specs.data_grad_x);
  ws.weight_grad_down = build(specs.weight_grad_down);
  ws.weight_grad_gate_up = build(specs.weight_grad_gate_up);
  return gemms;
}

}  // namespace moka::cuda::staged
