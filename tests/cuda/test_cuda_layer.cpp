// The CUDA layer (bf16) against the fp64 CPU reference on bf16-rounded inputs: fresh random
// inputs per run, poisoned outputs, every output and gradient checked; determinism, the fused
// SwiGLU epilogue against the unfused path bit for bit, CUDA-graph replay and input errors.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "core/routing_gen.hpp"
#include "cpu/expert_math.hpp"
#include "cuda/cuda_backend.hpp"
#include "gpu_case.hpp"
#include "moka/moka.hpp"

using namespace moka;
using gpu_test::GpuCase;

namespace {

using gpu_test::fresh_seed;
using gpu_test::shape;
using gpu_test::route;
using gpu_test::run_gpu;
using gpu_test::expect_close;
using gpu_test::reference;

struct Case {
  const char* name;
  MoeShape shape;
  int64_t tokens;
  core::RoutingKind routing;
};

class CudaLayerVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(CudaLayerVsReference, ForwardAndEveryGradient) {
  const Case& p = GetParam();
  const uint64_t seed = fresh_seed();
  GpuCase c(p.shape, p.tokens, seed);
  route(c, p.routing, seed + 1);
  c.upload();
  auto layer = make_moe_layer(p.shape, Backend::cuda);
  run_gpu(*layer, c);
  const auto got = c.download();
  reference(c);
  expect_close(got, c.ref, 2e-2);
}

const auto U = core::RoutingKind::uniform;
const auto Z = core::RoutingKind::zipf;
const auto ONE = core::RoutingKind::one_expert;

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLayerVsReference,
                         ::testing::Values(Case{"tiny_T1", shape(256, 128, 16, 4, 128), 1, U},
                                           Case{"tiny_T37", shape(256, 128, 16, 4, 128), 37, U},
                                           Case{"tiny_T300_zipf", shape(256, 128, 16, 4, 128), 300, Z},
                                           Case{"k1_all_on_one_expert", shape(256, 128, 16, 1), 200,
                                                ONE},  // 15 empty experts
                                           Case{"k8", shape(256, 192, 16, 8), 129, U},
                                           Case{"clamped", shape(512, 256, 8, 2, 0, true), 100, U},
                                           Case{"qwen3_30b_dims", shape(2048, 768, 8, 8), 48, U},
                                           Case{"qwen3_235b_dims", shape(4096, 1536, 4, 2), 40, U},
                                           Case{"deepseek_v3_dims", shape(7168, 2048, 4, 2, 2048), 24, U},
                                           Case{"gpt_oss_dims", shape(2880, 2880, 4, 2, 0, true), 40, U},
                                           Case{"mixtral_dims", shape(4096, 14336, 2, 1), 20, U},
                                           // 512 rows per expert: weight gradients on the ping-pong
                                           // multicast kernel (with the shared expert's, K = T)
                                           Case{"multicast_weight_grads", shape(512, 256, 8, 2, 256), 2048, U}),
                         [](const auto& info) { return std::string(info.param.name); });

std::vector<double> download_bf16(const void* p, int64_t n) {
  std::vector<__nv_bfloat16> b(n);
  MOKA_CUDA_CHECK(cudaMemcpy(b.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return std::vector<double>(b.begin(), b.end());
}

// sum_c |d_out_c y_jc| for each route j of the one-token reference r, y_j = its expert's output:
// the size of the terms d_topk_weights[j] = <d_out, y_j> sums. Its rounding error is bounded by a
// small multiple of this, not of |d_topk_weights[j]|, which cancellation can make tiny.
std::vector<double> d_topk_weight_term_sizes(cli::LayerBuffers<double>& r, const MoeShape& one) {
  const int64_t H = one.hidden, I = one.intermediate;
  std::vector<double> g(I), u(I), h(I), y(H), sizes;
  for (int64_t j = 0; j < one.top_k; ++j) {
    const auto w = cpu::routed_expert<double>(r.weights(), one, j);
    cpu::gate_up_row(w, cpu::ActivationSpec::of(one), r.x.data(), g.data(), u.data(), h.data());
    cpu::down_row(w, h.data(), y.data());
    double size = 0;
    for (int64_t c = 0; c < H; ++c) size += std::abs(r.d_out[c] * y[c]);
    sizes.push_back(size);
  }
  return sizes;
}

// Full named shapes (every expert) at 512 tokens, device tensors only: forward+backward against
// the per-expert cuBLAS baseline (an independent GEMM path) on every element of out, d_x,
// d_topk_weights and the shared-expert gradients and on the routed weight gradients of three
// sampled experts (the first, the last, and one in the middle: full routed gradients would be
// tens of GB on the host); and against the fp64 reference on two sampled tokens: each alone
// through the CPU layer with only its own k experts' weights (ids remapped to 0..k-1) and the
// shared expert.
TEST(CudaLayer, NamedShapesMatchBaselineAndSampledReference) {
  for (const auto& ns : named_shapes()) {
    if (ns.name == "tiny") continue;
    SCOPED_TRACE(ns.name);
    const MoeShape& sh = ns.shape;
    const int64_t T = 512, H = sh.hidden, I = sh.intermediate, k = sh.top_k, Is = sh.shared_intermediate;
    const int64_t E = sh.num_experts, per_expert = I * H;
    const uint64_t seed = fresh_seed();
    const auto ids = core::sample_topk_ids({U, 0.3, seed}, T, k, E);
    cli::LayerTensors t(sh, T);
    t.randomize(seed, ids);
    gpu_test::poison(t);
    auto run = [&](MoeLayer& l) {
      auto ctx = l.forward(t.inputs(), t.weights(), t.out_view(), Stream{});
      l.backward(*ctx, t.d_out_view(), t.weights(), t.gradients(), Stream{});
      MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    };
    // What is compared: whole small outputs, sampled experts' slices of the routed gradients.
    const std::vector<int64_t> experts = {0, E / 2, E - 1};
    auto snapshot = [&] {
      std::vector<std::vector<double>> v;
      for (const cli::DeviceBuffer* m : {&t.out, &t.d_x, &t.dwsg, &t.dwsu, &t.dwsd})
        v.push_back(download_bf16(m->data(), int64_t(m->bytes() / 2)));
      for (const cli::DeviceBuffer* m : {&t.dwg, &t.dwu, &t.dwd})
        for (int64_t e : experts) v.push_back(download_bf16(m->as<__nv_bfloat16>() + e * per_expert, per_expert));
      std::vector<float> dw(T * k);
      MOKA_CUDA_CHECK(cudaMemcpy(dw.data(), t.d_w.data(), t.d_w.bytes(), cudaMemcpyDeviceToHost));
      v.emplace_back(dw.begin(), dw.end());
      return v;
    };
    auto layer = make_moe_layer(sh, Backend::cuda);
    run(*layer);
    const auto got = snapshot();
    layer.reset();  // frees its workspace before the baseline allocates its own
    gpu_test::poison(t);
    auto base = cuda::make_cuda_baseline_layer(sh, {});
    run(*base);
    const auto want = snapshot();
    const char* names[] = {"out",         "d_x",           "d_ws_gate",     "d_ws_up",       "d_ws_down",
                           "d_w_gate[0]", "d_w_gate[E/2]", "d_w_gate[E-1]", "d_w_up[0]",     "d_w_up[E/2]",
                           "d_w_up[E-1]", "d_w_down[0]",   "d_w_down[E/2]", "d_w_down[E-1]", "d_topk_weights"};
    for (size_t i = 0; i < got.size(); ++i) {
      if (!want[i].empty()) {
        EXPECT_LE(cli::max_rel_error(got[i], want[i]), 1e-2) << names[i] << " vs cuBLAS loop";
      }
    }
    const std::vector<double>& dw_got = got.back();
    for (int64_t tok : {int64_t(0), T - 1}) {
      MoeShape one = sh;
      one.num_experts = k;
      cli::LayerBuffers<double> r(one, 1, 1);
      auto rows = [&](const cli::DeviceBuffer& m, int64_t row, int64_t width) {
        return download_bf16(m.as<__nv_bfloat16>() + row * width, width);
      };
      r.x = rows(t.x, tok, H);
      r.d_out = rows(t.d_out, tok, H);
      std::vector<float> wt(k);
      MOKA_CUDA_CHECK(cudaMemcpy(wt.data(), t.w.as<float>() + tok * k, k * 4, cudaMemcpyDeviceToHost));
      r.topk_weights.assign(wt.begin(), wt.end());
      r.w_gate.clear(), r.w_up.clear(), r.w_down.clear();
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = ids[tok * k + j];
        r.topk_ids[j] = int32_t(j);
        for (auto [dst, src, n] : {std::tuple{&r.w_gate, &t.wg, I * H}, std::tuple{&r.w_up, &t.wu, I * H},
                                   std::tuple{&r.w_down, &t.wd, H * I}}) {
          const auto v = rows(*src, e, n);
          dst->insert(dst->end(), v.begin(), v.end());
        }
      }
      if (sh.has_shared()) {
        r.ws_gate = download_bf16(t.wsg.data(), Is * H);
        r.ws_up = download_bf16(t.wsu.data(), Is * H);
        r.ws_down = download_bf16(t.wsd.data(), H * Is);
      }
      auto cpu = make_moe_layer(one, Backend::cpu);
      auto ctx = cpu->forward(r.inputs(), r.weights(), r.out_view(), Stream{});
      cpu->backward(*ctx, r.d_out_view(), r.weights(), r.gradients(), Stream{});
      const std::vector<double> out_t(got[0].begin() + tok * H, got[0].begin() + (tok + 1) * H);
      const std::vector<double> dx_t(got[1].begin() + tok * H, got[1].begin() + (tok + 1) * H);
      const std::vector<double> dw_t(dw_got.begin() + tok * k, dw_got.begin() + (tok + 1) * k);
      EXPECT_LE(cli::max_rel_error(out_t, r.out), 2e-2) << "out of token " << tok;
      EXPECT_LE(cli::max_rel_error(dx_t, r.d_x), 2e-2) << "d_x of token " << tok;
      const std::vector<double> sizes = d_topk_weight_term_sizes(r, one);
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_LE(std::abs(dw_t[j] - r.d_topk_weights[j]), 2e-3 * sizes[j])
            << "d_topk_weights of token " << tok << ", route " << j;
      }
    }
  }
}

TEST(CudaLayer, TenRunsGiveIdenticalBits) {
  const MoeShape s = shape(1024, 512, 32, 8, 256);
  GpuCase c(s, 1000, fresh_seed());
  route(c, Z, 3);
  c.upload();
  auto layer = make_moe_layer(s, Backend::cuda);
  run_gpu(*layer, c);
  const auto first = c.output_bytes();
  for (int i = 0; i < 9; ++i) {
    c.poison();
    run_gpu(*layer, c);
    ASSERT_EQ(c.output_bytes(), first) << "run " << i + 2 << " differs";
  }
}

// SwiGLU in the gate GEMM's epilogue (LayerOptions::fused_swiglu) against the default unfused
// path (one gate|up launch, then the activation pass): every output
// and gradient bit for bit, with and without the clamp and a shared expert, rows off the tile,
// and empty experts (zipf routing, more experts than routes).
TEST(CudaLayer, FusedSwigluGivesTheUnfusedBits) {
  const struct {
    const char* name;
    MoeShape shape;
    int64_t tokens;
  } cases[] = {{"tiny_shared", shape(256, 128, 16, 4, 128), 37},
               {"clamped_shared", shape(512, 1408, 8, 2, 520, true), 100},
               {"gpt_oss_dims", shape(2880, 2880, 4, 2, 0, true), 40},
               {"qwen3_30b_dims_sparse", shape(2048, 768, 64, 8), 5}};
  for (const auto& p : cases) {
    SCOPED_TRACE(p.name);
    const uint64_t seed = fresh_seed();
    GpuCase c(p.shape, p.tokens, seed);
    route(c, Z, seed + 1);
    c.upload();
    LayerOptions fused_options;
    fused_options.fused_swiglu = true;
    auto fused = make_moe_layer(p.shape, Backend::cuda, nullptr, fused_options);
    run_gpu(*fused, c);
    const auto fused_bits = c.output_bytes();
    fused.reset();
    c.poison();
    auto unfused = make_moe_layer(p.shape, Backend::cuda);
    run_gpu(*unfused, c);
    EXPECT_TRUE(c.output_bytes() == fused_bits) << "outputs or gradients differ from the unfused path's";
    // Both right, not just equal: against the fp64 reference.
    const auto got = c.download();
    reference(c);
    expect_close(got, c.ref, 2e-2);
  }
}

TEST(CudaLayer, GraphCaptureReplaysForwardAndBackward) {
  const MoeShape s = shape(1024, 512, 32, 4, 256);
  GpuCase c(s, 700, fresh_seed());
  route(c, U, 5);
  c.upload();
  auto layer = make_moe_layer(s, Backend::cuda);
  run_gpu(*layer, c);  // builds the GEMMs for this token count (not capturable)
  const auto eager = c.output_bytes();
  c.poison();
  gpu_test::replay_in_graph(
      [&](Stream s) {
        auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), s);
        layer->backward(*ctx, c.d_out_view(), c.weights(), c.gradients(), s);
      },
      3,
      [&](int i) {
        EXPECT_EQ(c.output_bytes(), eager) << "replay " << i;
        c.poison();
      });
}

TEST(CudaLayer, BadRoutingIsReportedNamingTheEntry) {
  const MoeShape s = shape(256, 128, 16, 4);
  GpuCase c(s, 10, 1);
  route(c, U, 2);
  c.ref.topk_ids[3 * 4 + 2] = 99;
  c.upload();
  auto layer = make_moe_layer(s, Backend::cuda);
  auto ctx = layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  try {
    layer->forward(c.inputs(), c.weights(), c.out_view(), Stream{});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::expert_out_of_range);
    EXPECT_NE(std::string(e.what()).find("[3, 2]"), std::string::npos) << e.what();
  }
}

TEST(CudaLayer, RejectsHostTensorsAndWrongDtypes) {
  const MoeShape s = shape(256, 128, 16, 4);
  GpuCase c(s, 10, 1);
  route(c, U, 2);
  c.upload();
  auto layer = make_moe_layer(s, Backend::cuda);
  auto in = c.inputs();
  in.x.device = Device::cpu();
  EXPECT_THROW(layer->forward(in, c.weights(), c.out_view(), Stream{}), Error);
  in = c.inputs();
  in.topk_weights.dtype = DType::bf16;
  EXPECT_THROW(layer->forward(in, c.weights(), c.out_view(), Stream{}), Error);
}

// A token whose router scores are all NaN (NaN input) must not index past the experts: every
// id stays in range (the CUDA context survives) and its weights are NaN, which the layer's
// routing check then reports naming the entry.
TEST(CudaRouter, NanScoresGiveValidIdsAndNanWeights) {
  RouterConfig rc = named_shape("qwen3-30b-a3b").router;
  rc.hidden = 256;
  const int64_t T = 8, H = rc.hidden, E = rc.num_experts, k = rc.top_k;
  std::vector<float> x(T * H, 0.5f), w(E * H, 0.01f);
  for (int64_t h = 0; h < H; ++h) x[3 * H + h] = std::nanf("");
  std::vector<__nv_bfloat16> xb(x.size()), wb(w.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = __float2bfloat16(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wb[i] = __float2bfloat16(w[i]);
  gpu_test::DeviceTensor gx(T * H * 2), gw(E * H * 2), gids(T * k * 4), gwt(T * k * 4), gc(E * 4);
  MOKA_CUDA_CHECK(cudaMemcpy(gx.data(), xb.data(), gx.bytes(), cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(gw.data(), wb.data(), gw.bytes(), cudaMemcpyHostToDevice));
  const Device d = Device::cuda(0);
  auto gpu = make_router(rc, Backend::cuda);
  gpu->forward(TensorView(gx.data(), DType::bf16, {T, H}, d), TensorView(gw.data(), DType::bf16, {E, H}, d),
               TensorView(),
               {TensorView(gids.data(), DType::i32, {T, k}, d), TensorView(gwt.data(), DType::f32, {T, k}, d),
                TensorView(gc.data(), DType::i32, {E}, d)},
               Stream{});
  MOKA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> ids(T * k);
  std::vector<float> wt(T * k);
  MOKA_CUDA_CHECK(cudaMemcpy(ids.data(), gids.data(), gids.bytes(), cudaMemcpyDeviceToHost));
  MOKA_CUDA_CHECK(cudaMemcpy(wt.data(), gwt.data(), gwt.bytes(), cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < T * k; ++i) {
    EXPECT_TRUE(ids[i] >= 0 && ids[i] < E) << "id " << ids[i] << " at " << i;
    EXPECT_EQ(std::isnan(wt[i]), i / k == 3) << "weight " << wt[i] << " at " << i;
  }
}

// The router adds each call's counts to a running int64 load (the same counts it writes to
// expert_counts), and its backward reads its own copy of the ids, not the caller's buffer.
TEST(CudaRouter, AddsCountsToTheExpertLoadAndKeepsItsOwnIds) {
  RouterConfig rc = named_shape("qwen3-30b-a3b").router;
  rc.hidden = 256;
  const int64_t T = 64, H = rc.hidden, E = rc.num_experts, k = rc.top_k;
  std::mt19937_64 rng(fresh_seed());
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> x(T * H), w(E * H);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = nd(rng) / 16;
  std::vector<int64_t> load(E);
  for (int64_t e = 0; e < E; ++e) load[e] = (int64_t(1) << 40) + e;  // a running total beyond int32
  const std::vector<float> dwt(T * k, 0.5f);
  gpu_test::DeviceTensor gx(T * H * 2), gw(E * H * 2), gids(T * k * 4), gwt(T * k * 4), gc(E * 4), gload(E * 8),
      gdwt(T * k * 4), gdx(T * H * 2), gdw(E * H * 2);
  const auto xb = gpu_test::to_bf16(x), wb = gpu_test::to_bf16(w);
  MOKA_CUDA_CHECK(cudaMemcpy(gx.data(), xb.data(), gx.bytes(), cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(gw.data(), wb.data(), gw.bytes(), cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(gload.data(), load.data(), gload.bytes(), cudaMemcpyHostToDevice));
  MOKA_CUDA_CHECK(cudaMemcpy(gdwt.data(), dwt.data(), gdwt.bytes(), cudaMemcpyHostToDevice));
  const Device d = Device::cuda(0);
  auto gpu = make_router(rc, Backend::cuda);
  const TensorView xv(gx.data(), DType::bf16, {T, H}, d), wv(gw.data(), DType::bf16, {E, H}, d);
  const RouterOutputs out{TensorView(gids.data(), DType::i32, {T, k}, d), TensorView(gwt.data(), DType::f32, {T, k}, d),
                          TensorView(gc.data(), DType::i32, {E}, d), TensorView(gload.data(), DType::i64, {E}, d)};
  gpu->forward(xv, wv, TensorView(), out, Stream{});
  auto ctx = gpu->forward(xv, wv, TensorView(), out, Stream{});
  std::vector<int64_t> got(E);
  std::vector<int32_t> counts(E);
  MOKA_CUDA_CHECK(cudaMemcpy(got.data(), gload.data(), gload.bytes(), cudaMemcpyDeviceToHost));
  MOKA_CUDA_CHECK(cudaMemcpy(counts.data(), gc.data(), gc.bytes(), cudaMemcpyDeviceToHost));
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    total += counts[e];
    EXPECT_EQ(got[e], load[e] + 2 * counts[e]) << "expert " << e;
  }
  EXPECT_EQ(total, T * k);
  const TensorView dwv(gdwt.data(), DType::f32, {T, k}, d), dxv(gdx.data(), DType::bf16, {T, H}, d),
      dwrv(gdw.data(), DType::bf16, {E, H}, d);
  gpu->backward(*ctx, dwv, dxv, dwrv, Stream{});
  const auto dx = gpu_test::bytes_of(gdx), dw = gpu_test::bytes_of(gdw);
  MOKA_CUDA_CHECK(cudaMemset(gids.data(), 0xff, gids.bytes()));  // the caller reuses its ids buffer
  gpu->backward(*ctx, dwv, dxv, dwrv, Stream{});
  EXPECT_EQ(gpu_test::bytes_of(gdx), dx);
  EXPECT_EQ(gpu_test::bytes_of(gdw), dw);
  // Adding onto d_x that holds the router's part already: twice that part, rounded once.
  gpu->backward(*ctx, dwv, dxv, dwrv, Stream{}, /*add_to_d_x=*/true);
  std::vector<__nv_bfloat16> once(T * H), twice(T * H);
  std::memcpy(once.data(), dx.data(), dx.size());
  MOKA_CUDA_CHECK(cudaMemcpy(twice.data(), gdx.data(), gdx.bytes(), cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < T * H; ++i) {
    const float want = 2 * __bfloat162float(once[i]);
    ASSERT_NEAR(__bfloat162float(twice[i]), want, 1e-2f * std::abs(want) + 1e-6f) << "d_x[" << i << "]";
  }
  EXPECT_EQ(gpu_test::bytes_of(gdw), dw);
  EXPECT_THROW(gpu->forward(xv, wv, TensorView(), {out.topk_ids, out.topk_weights, {}, out.expert_counts}, Stream{}),
               Error);
  RouterConfig too_many = rc;  // the selection keeps one bit per expert and lane: E <= 2048
  too_many.num_experts = 4096;
  EXPECT_THROW(make_router(too_many, Backend::cuda), Error);
}

// Threads sharing one router (its cuBLAS handle and workspace), each on its own non-blocking
// stream with its own tokens: every call gives the bits it gives alone.
TEST(CudaRouter, ThreadsSharingARouterGetTheBitsOfCallsAlone) {
  RouterConfig rc = named_shape("qwen3-30b-a3b").router;
  rc.hidden = 512;
  const int64_t T = 4096, H = rc.hidden, E = rc.num_experts, k = rc.top_k;
  constexpr int kThreads = 3, kCalls = 12;
  const Device d = Device::cuda(0);
  auto router = make_router(rc, Backend::cuda);
  std::mt19937_64 rng(fresh_seed());
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> w(E * H);
  for (auto& v : w) v = nd(rng) / 16;
  gpu_test::DeviceTensor gw(E * H * 2);
  const auto wb = gpu_test::to_bf16(w);
  MOKA_CUDA_CHECK(cudaMemcpy(gw.data(), wb.data(), gw.bytes(), cudaMemcpyHostToDevice));
  const TensorView wv(gw.data(), DType::bf16, {E, H}, d);
  struct Case {
    gpu_test::DeviceTensor x, ids, weights, d_weights, d_x, d_w;
  };
  std::vector<Case> cases;
  for (int c = 0; c < kThreads; ++c) {
    std::vector<double> x(T * H);
    for (auto& v : x) v = nd(rng);
    std::vector<float> dwt(T * k);
    for (auto& v : dwt) v = float(nd(rng));
    cases.push_back({gpu_test::DeviceTensor(T * H * 2), gpu_test::DeviceTensor(T * k * 4),
                     gpu_test::DeviceTensor(T * k * 4), gpu_test::DeviceTensor(T * k * 4),
                     gpu_test::DeviceTensor(T * H * 2), gpu_test::DeviceTensor(E * H * 2)});
    const auto xb = gpu_test::to_bf16(x);
    MOKA_CUDA_CHECK(cudaMemcpy(cases[c].x.data(), xb.data(), T * H * 2, cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(cases[c].d_weights.data(), dwt.data(), T * k * 4, cudaMemcpyHostToDevice));
  }
  auto call = [&](Case& c, cudaStream_t s) {
    const Stream stream{s};
    auto ctx = router->forward(
        TensorView(c.x.data(), DType::bf16, {T, H}, d), wv, TensorView(),
        {TensorView(c.ids.data(), DType::i32, {T, k}, d), TensorView(c.weights.data(), DType::f32, {T, k}, d), {}, {}},
        stream);
    router->backward(*ctx, TensorView(c.d_weights.data(), DType::f32, {T, k}, d),
                     TensorView(c.d_x.data(), DType::bf16, {T, H}, d), TensorView(c.d_w.data(), DType::bf16, {E, H}, d),
                     stream);
  };
  auto results = [&](const Case& c) {
    return std::vector<std::vector<uint8_t>>{gpu_test::bytes_of(c.ids), gpu_test::bytes_of(c.weights),
                                             gpu_test::bytes_of(c.d_x), gpu_test::bytes_of(c.d_w)};
  };
  std::vector<std::vector<std::vector<uint8_t>>> alone;
  for (auto& c : cases) {
    call(c, nullptr);
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    alone.push_back(results(c));
  }
  std::vector<std::thread> threads;
  std::vector<std::vector<std::vector<std::vector<uint8_t>>>> seen(kThreads);
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      cudaStream_t s = nullptr;
      MOKA_CUDA_CHECK(cudaSetDevice(0));
      MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      for (int i = 0; i < kCalls; ++i) {
        call(cases[t], s);
        MOKA_CUDA_CHECK(cudaStreamSynchronize(s));
        seen[t].push_back(results(cases[t]));
      }
      MOKA_CUDA_CHECK(cudaStreamDestroy(s));
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    for (int i = 0; i < kCalls; ++i) EXPECT_EQ(seen[t][i], alone[t]) << "thread " << t << ", call " << i;
}

// The aux outputs (logits, probabilities, losses without coefficients, int64 counts) against the
// CPU router's in fp64 on the same bf16 inputs, and the backward with the caller's gradients of
// all three (d_losses read by the device) on top of RouterConfig's coefficients; the routes
// keep the bits of a call without aux outputs. Every named style (softmax and sigmoid scores).
TEST(CudaRouter, AuxOutputsAndTheirGradientsMatchTheReference) {
  for (const auto& ns : named_shapes()) {
    SCOPED_TRACE(ns.name);
    RouterConfig rc = ns.router;
    rc.hidden = 256;
    rc.aux_loss_coef = 0.01;
    const int64_t T = 45, H = rc.hidden, E = rc.num_experts, k = rc.top_k;
    std::mt19937_64 rng(fresh_seed());
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> x(T * H), w(E * H), dwt(T * k), r1(T * E), r2(T * E);
    for (auto& v : x) v = nd(rng);
    for (auto& v : w) v = nd(rng) / 16;
    for (auto* v : {&dwt, &r1, &r2})
      for (auto& e : *v) e = static_cast<double>(static_cast<float>(nd(rng)));
    gpu_test::round_bf16(x);
    gpu_test::round_bf16(w);
    const std::vector<double> d_losses{0.5, 0.25};
    rc.use_selection_bias = false;
    auto cpu = make_router(rc, Backend::cpu);
    std::vector<int32_t> ids(T * k);
    std::vector<int64_t> counts(E);
    std::vector<double> wt(T * k), logits(T * E), probs(T * E), losses(2), dx(T * H), dw(E * H);
    RouterOutputs cout_{TensorView(ids.data(), DType::i32, {T, k}), TensorView(wt.data(), DType::f64, {T, k}),
                        TensorView(counts.data(), DType::i64, {E})};
    cout_.aux = {TensorView(logits.data(), DType::f64, {T, E}), TensorView(probs.data(), DType::f64, {T, E}),
                 TensorView(losses.data(), DType::f64, {2})};
    auto cctx = cpu->forward(TensorView(x.data(), DType::f64, {T, H}), TensorView(w.data(), DType::f64, {E, H}),
                             TensorView(), cout_, Stream{});

    const Device d = Device::cuda(0);
    gpu_test::DeviceTensor gx(T * H * 2), gw(E * H * 2), gids(T * k * 4), gwt(T * k * 4), gc(E * 8), glogits(T * E * 4),
        gprobs(T * E * 4), glosses(2 * 4), gdwt(T * k * 4), gr1(T * E * 4), gr2(T * E * 4), gdl(2 * 4), gdx(T * H * 2),
        gdw(E * H * 2);
    for (const auto* t : {&glogits, &gprobs, &glosses, &gc, &gdx, &gdw})  // NaN where nothing is written
      MOKA_CUDA_CHECK(cudaMemset(t->data(), 0xFF, t->bytes()));
    const auto xb = gpu_test::to_bf16(x), wb = gpu_test::to_bf16(w);
    MOKA_CUDA_CHECK(cudaMemcpy(gx.data(), xb.data(), gx.bytes(), cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(gw.data(), wb.data(), gw.bytes(), cudaMemcpyHostToDevice));
    auto upload_f32 = [](gpu_test::DeviceTensor& dst, const std::vector<double>& v) {
      const std::vector<float> f(v.begin(), v.end());
      MOKA_CUDA_CHECK(cudaMemcpy(dst.data(), f.data(), dst.bytes(), cudaMemcpyHostToDevice));
    };
    upload_f32(gdwt, dwt), upload_f32(gr1, r1), upload_f32(gr2, r2), upload_f32(gdl, d_losses);
    auto gpu = make_router(rc, Backend::cuda);
    const TensorView xv(gx.data(), DType::bf16, {T, H}, d), wv(gw.data(), DType::bf16, {E, H}, d);
    RouterOutputs out{TensorView(gids.data(), DType::i32, {T, k}, d), TensorView(gwt.data(), DType::f32, {T, k}, d),
                      TensorView(gc.data(), DType::i64, {E}, d)};
    gpu->forward(xv, wv, TensorView(), out, Stream{});  // without aux outputs first
    const auto ids_plain = gpu_test::bytes_of(gids), weights_plain = gpu_test::bytes_of(gwt);
    out.aux = {TensorView(glogits.data(), DType::f32, {T, E}, d), TensorView(gprobs.data(), DType::f32, {T, E}, d),
               TensorView(glosses.data(), DType::f32, {2}, d)};
    auto gctx = gpu->forward(xv, wv, TensorView(), out, Stream{});
    EXPECT_EQ(gpu_test::bytes_of(gids), ids_plain);
    EXPECT_EQ(gpu_test::bytes_of(gwt), weights_plain);
    std::vector<int32_t> hid(T * k);
    MOKA_CUDA_CHECK(cudaMemcpy(hid.data(), gids.data(), gids.bytes(), cudaMemcpyDeviceToHost));
    if (hid != ids) continue;  // values and gradients compare only with identical selections (near-ties)
    std::vector<int64_t> hc(E);
    std::vector<float> hl(T * E), hp(T * E), hlo(2);
    MOKA_CUDA_CHECK(cudaMemcpy(hc.data(), gc.data(), gc.bytes(), cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(hl.data(), glogits.data(), glogits.bytes(), cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(hp.data(), gprobs.data(), gprobs.bytes(), cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(hlo.data(), glosses.data(), glosses.bytes(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(hc, counts);
    EXPECT_LE(cli::max_rel_error(hl, logits), 1e-4);
    EXPECT_LE(cli::max_rel_error(hp, probs), 1e-4);
    EXPECT_NEAR(hlo[0], losses[0], 1e-4 * losses[0]);
    EXPECT_NEAR(hlo[1], losses[1], 1e-4 * losses[1]);
    EXPECT_NEAR(gctx->losses().aux_loss, 0.01 * losses[0], 1e-4 * 0.01 * losses[0]);

    const RouterAuxGradients cgrads{TensorView(r1.data(), DType::f64, {T, E}),
                                    TensorView(r2.data(), DType::f64, {T, E}),
                                    TensorView(const_cast<double*>(d_losses.data()), DType::f64, {2})};
    cpu->backward(*cctx, TensorView(dwt.data(), DType::f64, {T, k}), TensorView(dx.data(), DType::f64, {T, H}),
                  TensorView(dw.data(), DType::f64, {E, H}), Stream{}, false, cgrads);
    const RouterAuxGradients ggrads{TensorView(gr1.data(), DType::f32, {T, E}, d),
                                    TensorView(gr2.data(), DType::f32, {T, E}, d),
                                    TensorView(gdl.data(), DType::f32, {2}, d)};
    gpu->backward(*gctx, TensorView(gdwt.data(), DType::f32, {T, k}, d), TensorView(gdx.data(), DType::bf16, {T, H}, d),
                  TensorView(gdw.data(), DType::bf16, {E, H}, d), Stream{}, false, ggrads);
    EXPECT_LE(cli::max_rel_error(download_bf16(gdx.data(), T * H), dx), 3e-2);
    EXPECT_LE(cli::max_rel_error(download_bf16(gdw.data(), E * H), dw), 3e-2);
    // A gradient for an output the forward did not write is an error.
    auto plain = gpu->forward(xv, wv, TensorView(), {out.topk_ids, out.topk_weights, {}}, Stream{});
    EXPECT_THROW(gpu->backward(*plain, TensorView(gdwt.data(), DType::f32, {T, k}, d),
                               TensorView(gdx.data(), DType::bf16, {T, H}, d),
                               TensorView(gdw.data(), DType::bf16, {E, H}, d), Stream{}, false, ggrads),
                 Error);
  }
}

// The router against the CPU router (fp64 on bf16-rounded inputs): same ids (where scores are
// not near-tied), close weights, and close input/weight gradients; with both losses, either, or
// none (their sums then do not run), and token counts that leave a block's last warps idle.
struct RouterLossCase {
  double aux, z;
  int64_t tokens;
};
class CudaRouterLosses : public ::testing::TestWithParam<RouterLossCase> {};
INSTANTIATE_TEST_SUITE_P(Losses, CudaRouterLosses,
                         ::testing::Values(RouterLossCase{0.01, 0.001, 64}, RouterLossCase{0, 0, 61},
                                           RouterLossCase{0.01, 0, 37}, RouterLossCase{0, 0.001, 9}));

TEST_P(CudaRouterLosses, MatchesReferenceForEveryNamedStyle) {
  for (const auto& ns : named_shapes()) {
    SCOPED_TRACE(ns.name);
    RouterConfig rc = ns.router;
    rc.hidden = 256;
    rc.aux_loss_coef = GetParam().aux;
    rc.z_loss_coef = GetParam().z;
    const int64_t T = GetParam().tokens, H = rc.hidden, E = rc.num_experts, k = rc.top_k;
    std::mt19937_64 rng(fresh_seed());
    std::normal_distribution<double> nd(0, 1);
    std::vector<double> x(T * H), w(E * H), bias(E), dwt(T * k);
    for (auto& v : x) v = nd(rng);
    for (auto& v : w) v = nd(rng) / 16;
    for (auto& v : bias) v = rc.use_selection_bias ? nd(rng) * 0.01 : 0.0;
    for (auto& v : dwt) v = nd(rng);
    gpu_test::round_bf16(x);
    gpu_test::round_bf16(w);
    for (auto& v : bias) v = static_cast<double>(static_cast<float>(v));
    for (auto& v : dwt) v = static_cast<double>(static_cast<float>(v));
    // Reference.
    std::vector<int32_t> ids(T * k), counts(E);
    std::vector<double> wt(T * k), dx(T * H), dw(E * H);
    auto cpu = make_router(rc, Backend::cpu);
    auto cctx = cpu->forward(TensorView(x.data(), DType::f64, {T, H}), TensorView(w.data(), DType::f64, {E, H}),
                             rc.use_selection_bias ? TensorView(bias.data(), DType::f64, {E}) : TensorView(),
                             {TensorView(ids.data(), DType::i32, {T, k}), TensorView(wt.data(), DType::f64, {T, k}),
                              TensorView(counts.data(), DType::i32, {E})},
                             Stream{});
    // The GPU uses the reference's own selection for its backward comparison to be meaningful.
    gpu_test::DeviceTensor gx(T * H * 2), gw(E * H * 2), gb(E * 4), gids(T * k * 4), gwt(T * k * 4), gc(E * 4),
        gdwt(T * k * 4), gdx(T * H * 2), gdw(E * H * 2);
    const auto xb = gpu_test::to_bf16(x), wb = gpu_test::to_bf16(w);
    MOKA_CUDA_CHECK(cudaMemcpy(gx.data(), xb.data(), gx.bytes(), cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(gw.data(), wb.data(), gw.bytes(), cudaMemcpyHostToDevice));
    const std::vector<float> bf(bias.begin(), bias.end()), dwf(dwt.begin(), dwt.end());
    MOKA_CUDA_CHECK(cudaMemcpy(gb.data(), bf.data(), gb.bytes(), cudaMemcpyHostToDevice));
    MOKA_CUDA_CHECK(cudaMemcpy(gdwt.data(), dwf.data(), gdwt.bytes(), cudaMemcpyHostToDevice));
    const Device d = Device::cuda(0);
    auto gpu = make_router(rc, Backend::cuda);
    auto gctx =
        gpu->forward(TensorView(gx.data(), DType::bf16, {T, H}, d), TensorView(gw.data(), DType::bf16, {E, H}, d),
                     rc.use_selection_bias ? TensorView(gb.data(), DType::f32, {E}, d) : TensorView(),
                     {TensorView(gids.data(), DType::i32, {T, k}, d), TensorView(gwt.data(), DType::f32, {T, k}, d),
                      TensorView(gc.data(), DType::i32, {E}, d)},
                     Stream{});
    std::vector<int32_t> hid(T * k), hc(E);
    std::vector<float> hw(T * k);
    MOKA_CUDA_CHECK(cudaMemcpy(hid.data(), gids.data(), gids.bytes(), cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(hw.data(), gwt.data(), gwt.bytes(), cudaMemcpyDeviceToHost));
    MOKA_CUDA_CHECK(cudaMemcpy(hc.data(), gc.data(), gc.bytes(), cudaMemcpyDeviceToHost));
    {  // the same bits from a second call
      const auto ids_once = gpu_test::bytes_of(gids), weights_once = gpu_test::bytes_of(gwt);
      gpu->forward(TensorView(gx.data(), DType::bf16, {T, H}, d), TensorView(gw.data(), DType::bf16, {E, H}, d),
                   rc.use_selection_bias ? TensorView(gb.data(), DType::f32, {E}, d) : TensorView(),
                   {TensorView(gids.data(), DType::i32, {T, k}, d), TensorView(gwt.data(), DType::f32, {T, k}, d), {}},
                   Stream{});
      EXPECT_EQ(gpu_test::bytes_of(gids), ids_once);
      EXPECT_EQ(gpu_test::bytes_of(gwt), weights_once);
    }
    int64_t same = 0;
    for (int64_t i = 0; i < T * k; ++i) same += hid[i] == ids[i];
    EXPECT_GE(double(same) / double(T * k), 0.97) << "top-k ids differ beyond near-ties";
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e) total += hc[e];
    EXPECT_EQ(total, T * k);
    if (same != T * k) continue;  // gradients compare only with identical selections
    double werr = 0;
    for (int64_t i = 0; i < T * k; ++i) werr = std::max(werr, std::abs(double(hw[i]) - wt[i]));
    EXPECT_LE(werr, 1e-4 * rc.route_scale + 2e-3);
    const auto gl = gctx->losses(), cl = cctx->losses();
    EXPECT_NEAR(gl.aux_loss, cl.aux_loss, 1e-3 * std::abs(cl.aux_loss) + 1e-6);
    EXPECT_NEAR(gl.z_loss, cl.z_loss, 1e-2 * std::abs(cl.z_loss) + 1e-6);
    cpu->backward(*cctx, TensorView(dwt.data(), DType::f64, {T, k}), TensorView(dx.data(), DType::f64, {T, H}),
                  TensorView(dw.data(), DType::f64, {E, H}), Stream{});
    gpu->backward(*gctx, TensorView(gdwt.data(), DType::f32, {T, k}, d), TensorView(gdx.data(), DType::bf16, {T, H}, d),
                  TensorView(gdw.data(), DType::bf16, {E, H}, d), Stream{});
    EXPECT_LE(cli::max_rel_error(download_bf16(gdx.data(), T * H), dx), 3e-2);
    EXPECT_LE(cli::max_rel_error(download_bf16(gdw.data(), E * H), dw), 3e-2);
  }
}

}  // namespace
