// The CUDA training engine against the CPU reference (run on a GPU: `ctest -L gpu`, or
// scripts/train_gpu.sh on the device). Stage by stage in fp32 first (RMSNorm, attention,
// cross-entropy, AdamW + EMA), then the whole model's loss and every parameter gradient, then
// training: the loss falls, and a checkpoint resumes bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "cuda/common/device_memory.hpp"
#include "train/cuda_engine.hpp"
#include "train/cuda_kernels.cuh"
#include "train/dense_math.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;
namespace kern = moka::train::cuda;
using kern::bf16;

namespace {

// A device copy of `host` (poisoned with NaN when made from a count).
struct DeviceFloats {
  moka::cuda::DeviceArray<float> array;
  float* p;
  explicit DeviceFloats(const std::vector<float>& host) : array(host.size()), p(array.data()) { array.upload(host); }
  explicit DeviceFloats(size_t count) : DeviceFloats(std::vector<float>(count, NAN)) {}
  std::vector<float> host() const { return array.download(); }
};

std::vector<float> normal(size_t n, std::mt19937_64& rng, float std = 1.0f) {
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ||gpu - cpu|| / ||cpu||, and infinity when the GPU left a non-finite value.
double rel_error(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  EXPECT_EQ(gpu.size(), cpu.size());
  double diff = 0, ref = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (!std::isfinite(gpu[i])) return INFINITY;
    diff += (double(gpu[i]) - cpu[i]) * (double(gpu[i]) - cpu[i]);
    ref += double(cpu[i]) * cpu[i];
  }
  return std::sqrt(diff / std::max(ref, 1e-300));
}

// rel_error, or where the reference is all zeros (dq and dk at seq 1) the largest |gpu|.
double error_against(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  if (std::any_of(cpu.begin(), cpu.end(), [](float x) { return x != 0.0f; })) return rel_error(gpu, cpu);
  double largest = 0;
  for (float x : gpu) largest = std::isfinite(x) ? std::max(largest, double(std::fabs(x))) : INFINITY;
  return largest;
}

uint64_t fresh_seed() {
  const uint64_t seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  std::cout << "[ seed     ] " << seed << std::endl;
  return seed;
}

// fp32 stages: only the summation order differs from the CPU (warp butterflies vs loops).
constexpr double kFp32Tolerance = 1e-5;

}  // namespace

// The residual add fused into the norm (f32 and bf16 deltas), and the backward from an f32 or
// a two-part bf16 gradient, with its bf16 copy.
TEST(TrainGpuStages, ResidualRmsNormForwardAndBackward) {
  ASSERT_TRUE(moka::cuda_backend_available());
  std::mt19937_64 rng(fresh_seed());
  const int64_t rows = 37, d = 96;
  const auto x = normal(rows * d, rng), delta = normal(rows * d, rng), dy = normal(rows * d, rng);
  const auto dy_b = normal(rows * d, rng);
  auto gain = normal(d, rng, 0.1f);
  for (auto& g : gain) g += 1.0f;
  // bf16 operands: the CPU reference gets the same rounded values.
  std::vector<bf16> delta16(rows * d), dy16(rows * d), dy16_b(rows * d);
  std::vector<float> delta_r(rows * d), dy_r(rows * d);
  for (int64_t i = 0; i < rows * d; ++i) {
    delta16[i] = __float2bfloat16(delta[i]);
    dy16[i] = __float2bfloat16(dy[i]);
    dy16_b[i] = __float2bfloat16(dy_b[i]);
    delta_r[i] = __bfloat162float(delta16[i]);
    dy_r[i] = __bfloat162float(dy16[i]) + __bfloat162float(dy16_b[i]);
  }
  moka::cuda::DeviceArray<bf16> gdelta16(rows * d), gdy16(rows * d), gdy16_b(rows * d), gdx16(rows * d);
  gdelta16.upload(delta16);
  gdy16.upload(dy16);
  gdy16_b.upload(dy16_b);
  for (const bool bf16_operands : {false, true}) {
    SCOPED_TRACE(bf16_operands ? "bf16 delta and gradient" : "f32 delta and gradient");
    const auto& dlt = bf16_operands ? delta_r : delta;
    const auto& grad = bf16_operands ? dy_r : dy;
    std::vector<float> sum(rows * d), y(rows * d), inv(rows), dx(rows * d), dgain(d, 0.0f);
    for (int64_t i = 0; i < rows * d; ++i) sum[i] = x[i] + dlt[i];
    dense::rmsnorm(sum.data(), gain.data(), rows, d, 1e-6, y.data(), inv.data());
    dense::rmsnorm_backward(sum.data(), gain.data(), inv.data(), grad.data(), rows, d, dx.data(), dgain.data());
    DeviceFloats gh(x), gdelta(delta), gsaved(rows * d), gg(gain), gdy(dy), gy(rows * d), ginv(rows), gdgain(d);
    DeviceFloats gdx(std::vector<float>(rows * d, 1.0f));  // backward adds into it
    kern::ResidualDelta rd;
    if (bf16_operands) rd.b16 = gdelta16.data(); else rd.f32 = gdelta.p;
    kern::residual_rmsnorm_forward(gh.p, rd, gh.p, gsaved.p, gg.p, rows, d, 1e-6f, gy.p, nullptr, ginv.p, nullptr);
    kern::NormGrad ng;
    if (bf16_operands) {
      ng.b16[0] = gdy16.data();
      ng.b16[1] = gdy16_b.data();
    } else {
      ng.f32 = gdy.p;
    }
    DeviceFloats gain_partials(kern::kNormGainChunks * d);
    kern::rmsnorm_backward(gsaved.p, gg.p, ginv.p, ng, rows, d, true, gdx.p, gdx16.data(), gdgain.p, gain_partials.p,
                           nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(gh.host(), sum);  // the residual stream, updated in place: one f32 add per element
    EXPECT_EQ(gsaved.host(), sum);
    auto dx_gpu = gdx.host();
    const auto dx16_gpu = gdx16.download();
    for (int64_t i = 0; i < rows * d; ++i)
      ASSERT_EQ(__bfloat162float(dx16_gpu[i]), __bfloat162float(__float2bfloat16(dx_gpu[i]))) << i;
    for (auto& v : dx_gpu) v -= 1.0f;
    EXPECT_LT(rel_error(gy.host(), y), kFp32Tolerance);
    EXPECT_LT(rel_error(ginv.host(), inv), kFp32Tolerance);
    EXPECT_LT(rel_error(dx_gpu, dx), 1e-5 * 4);  // one more rounding: the add into 1.0
    EXPECT_LT(rel_error(gdgain.host(), dgain), kFp32Tolerance);
  }
}

// One attention case on the CPU: random q, k, v, d_out and the reference's out, dq, dk, dv.
struct AttentionCase {
  dense::AttentionDims a;
  size_t n, np;  // elements of q (and each other tensor), of the probabilities
  std::vector<float> q, k, v, dout, probs, out, dq, dk, dv;
  AttentionCase(dense::AttentionDims dims, std::mt19937_64& rng)
      : a(dims), n(a.tokens() * a.width()), np(a.batch * a.heads * a.seq * a.seq), q(normal(n, rng)),
        k(normal(n, rng)), v(normal(n, rng)), dout(normal(n, rng)), probs(np), out(n), dq(n), dk(n), dv(n) {
    dense::causal_attention(q.data(), k.data(), v.data(), a, probs.data(), out.data(), 2);
    dense::causal_attention_backward(q.data(), k.data(), v.data(), probs.data(), dout.data(), a, dq.data(), dk.data(),
                                     dv.data(), 2);
  }
  std::string name() const {
    return "batch " + std::to_string(a.batch) + " seq " + std::to_string(a.seq) + " heads " + std::to_string(a.heads) +
           " head_dim " + std::to_string(a.head_dim);
  }
};

// Both ways the kernels read K and V: staged in shared memory (the first shape) and from global
// memory where one head's K and V exceed a block's shared memory (the second).
TEST(TrainGpuStages, CausalAttentionForwardAndBackward) {
  ASSERT_TRUE(moka::cuda_backend_available());
  std::mt19937_64 rng(fresh_seed());
  // seq > 32 and head_dim > 32 exercise the lane loops of both kernels.
  for (const dense::AttentionDims dims : {dense::AttentionDims{3, 45, 2, 40}, dense::AttentionDims{1, 3000, 1, 16}}) {
    const AttentionCase t(dims, rng);
    const auto& a = t.a;
    SCOPED_TRACE(t.name());
    DeviceFloats gq(t.q), gk(t.k), gv(t.v), gdout(t.dout), gprobs(t.np), gout(t.n), gds(t.np), gdq(t.n), gdk(t.n),
        gdv(t.n);
    kern::attention_forward(gq.p, gk.p, gv.p, a.batch, a.seq, a.heads, a.head_dim, gprobs.p, gout.p, nullptr);
    kern::attention_backward(gq.p, gk.p, gv.p, gprobs.p, gdout.p, a.batch, a.seq, a.heads, a.head_dim, gds.p, gdq.p,
                             gdk.p, gdv.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(rel_error(gprobs.host(), t.probs), kFp32Tolerance);  // zeros above the diagonal included
    EXPECT_LT(rel_error(gout.host(), t.out), kFp32Tolerance);
    EXPECT_LT(rel_error(gdq.host(), t.dq), kFp32Tolerance);
    EXPECT_LT(rel_error(gdk.host(), t.dk), kFp32Tolerance);
    EXPECT_LT(rel_error(gdv.host(), t.dv), kFp32Tolerance);
  }
}

// The fused kernels against the CPU reference: TF32 products (10-bit mantissa, relative rounding
// ~5e-4 per operand) through two chained products and the softmax give ~1e-3; a wrong mask, tile
// edge or scale is O(1). Shapes: the trainer's (seq 128 = two tiles, head_dim 32), seq not a
// multiple of the 64-row tile (45, 130, 200: one, three and four tiles, the last partial), seq 1,
// and every padded head_dim (8 -> 16, 16, 40 -> 64, 100 and 128 -> 128). Run twice: the same bits.
TEST(TrainGpuStages, FusedAttentionMatchesTheReference) {
  ASSERT_TRUE(moka::cuda_backend_available());
  EXPECT_FALSE(kern::flash_attention_supports(0));
  EXPECT_FALSE(kern::flash_attention_supports(kern::kFlashMaxHeadDim + 1));
  constexpr double kTf32Tolerance = 5e-3;
  std::mt19937_64 rng(fresh_seed());
  for (const dense::AttentionDims dims :
       {dense::AttentionDims{2, 128, 3, 32}, dense::AttentionDims{3, 45, 2, 40}, dense::AttentionDims{1, 200, 2, 16},
        dense::AttentionDims{2, 1, 2, 8}, dense::AttentionDims{1, 130, 1, 100}, dense::AttentionDims{1, 70, 2, 128}}) {
    const AttentionCase t(dims, rng);
    const auto& a = t.a;
    SCOPED_TRACE(t.name());
    ASSERT_TRUE(kern::flash_attention_supports(a.head_dim));
    const size_t rows = a.batch * a.heads * a.seq;
    DeviceFloats gq(t.q), gk(t.k), gv(t.v), gdout(t.dout), glse(rows), grow_dot(rows);
    std::vector<float> first[4];
    for (int run = 0; run < 2; ++run) {
      DeviceFloats gout(t.n), gdq(t.n), gdk(t.n), gdv(t.n);  // NaN: a missed element shows
      kern::flash_attention_forward(gq.p, gk.p, gv.p, a.batch, a.seq, a.heads, a.head_dim, glse.p, gout.p, nullptr);
      kern::flash_attention_backward(gq.p, gk.p, gv.p, gout.p, glse.p, gdout.p, a.batch, a.seq, a.heads, a.head_dim,
                                     grow_dot.p, gdq.p, gdk.p, gdv.p, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> results[4] = {gout.host(), gdq.host(), gdk.host(), gdv.host()};
      if (run == 0) {
        EXPECT_LT(error_against(results[0], t.out), kTf32Tolerance);
        EXPECT_LT(error_against(results[1], t.dq), kTf32Tolerance);
        EXPECT_LT(error_against(results[2], t.dk), kTf32Tolerance);
        EXPECT_LT(error_against(results[3], t.dv), kTf32Tolerance);
        for (int r = 0; r < 4; ++r) first[r] = results[r];
      } else {
        for (int r = 0; r < 4; ++r) EXPECT_EQ(results[r], first[r]) << "tensor " << r << " changed between runs";
      }
    }
  }
}

TEST(TrainGpuStages, CrossEntropyAndItsGradient) {
  ASSERT_TRUE(moka::cuda_backend_available());
  std::mt19937_64 rng(fresh_seed());
  for (const int64_t vocab : {256, 100}) {
    const int64_t rows = 70;
    const auto logits = normal(rows * vocab, rng, 3.0f);
    std::vector<int32_t> targets(rows);
    for (auto& t : targets) t = int32_t(rng() % uint64_t(vocab));
    std::vector<float> d_logits(rows * vocab);
    const double loss = dense::cross_entropy(logits.data(), targets.data(), rows, vocab, d_logits.data());
    DeviceFloats gl(logits), grow(rows), gd(rows * vocab);
    moka::cuda::DeviceArray<int32_t> device_targets(rows);
    moka::cuda::DeviceArray<double> device_partial(kern::kReduceBlocks + 1);
    device_targets.upload(targets);
    int32_t* gt = device_targets.data();
    double* partial = device_partial.data();
    kern::cross_entropy(gl.p, gt, rows, vocab, grow.p, gd.p, nullptr);
    kern::reduce_partials(kern::ReduceOp::sum, grow.p, false, rows, partial, nullptr);
    kern::reduce_finish(partial, kern::kReduceBlocks, 1.0 / double(rows), partial + kern::kReduceBlocks, nullptr);
    double gpu_loss = 0;
    ASSERT_EQ(cudaMemcpy(&gpu_loss, partial + kern::kReduceBlocks, sizeof(double), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_NEAR(gpu_loss, loss, kFp32Tolerance * loss) << "vocab " << vocab;
    EXPECT_LT(rel_error(gd.host(), d_logits), kFp32Tolerance) << "vocab " << vocab;
  }
}

// The multi-tensor AdamW (one launch for all tensors, EMA and bf16 copies included) and the
// one-launch gradient norm against the host optimizer, on tensors of several sizes (a block
// straddles no tensor; sizes not a multiple of a thread's 4 elements) with f32 and bf16
// gradients; tensor "b"'s arrays start one element into their allocations, so its threads take
// the element-by-element path (no 16-byte accesses).
TEST(TrainGpuStages, MultiTensorAdamWWithClippingAndEmaMatchesTheHostOptimizer) {
  ASSERT_TRUE(moka::cuda_backend_available());
  std::mt19937_64 rng(fresh_seed());
  std::vector<TensorRule> rules{{{"a", TensorClass::expert_fc1, {24, 40}, 40, 24}},
                                {{"b", TensorClass::attention_out, {1, 7}, 7, 1}},
                                {{"c", TensorClass::expert_fc2, {33, 65}, 65, 33}}};
  for (auto& r : rules) {
    r.init_std = 0.1;
    r.weight_decay_multiplier = 1.0;
  }
  rules[0].lr_multiplier = 0.5;
  rules[2].lr_multiplier = 2.0;
  rules[1].weight_decay_multiplier = 0.0;
  const std::vector<bool> bf16_grad{false, false, true};
  ParamStore<float> host(rules);
  host.initialize(rng());
  AdamWConfig cfg;
  cfg.lr = 3e-3;
  cfg.weight_decay = 0.1;
  cfg.clip_norm = 0.5;  // the random gradients below have norm ~40: clipping is active
  AdamW adam(cfg, host);
  WeightEma ema(0.9, host);
  const size_t T = rules.size();
  std::vector<DeviceFloats> value, m, v, ema_dev, grad;
  std::vector<moka::cuda::DeviceArray<bf16>> shadow, grad16;
  std::vector<kern::TensorSlot> slots(T);
  const std::vector<size_t> lead{0, 1, 0};  // elements before the tensor in its allocations
  auto with_lead = [&](size_t i, const std::vector<float>& x) {
    std::vector<float> out(lead[i], -7.0f);
    out.insert(out.end(), x.begin(), x.end());
    return out;
  };
  for (size_t i = 0; i < T; ++i) {
    const size_t n = host[i].value.size();
    value.emplace_back(with_lead(i, host[i].value));
    m.emplace_back(with_lead(i, std::vector<float>(n, 0.0f)));
    v.emplace_back(with_lead(i, std::vector<float>(n, 0.0f)));
    ema_dev.emplace_back(with_lead(i, host[i].value));
    grad.emplace_back(lead[i] + n);
    shadow.emplace_back(lead[i] + n);
    grad16.emplace_back(lead[i] + n);
  }
  for (size_t i = 0; i < T; ++i) {
    const size_t k = lead[i];
    slots[i] = {value[i].p + k, m[i].p + k, v[i].p + k, ema_dev[i].p + k,
                bf16_grad[i] ? shadow[i].data() + k : nullptr,
                bf16_grad[i] ? static_cast<const void*>(grad16[i].data() + k) : grad[i].p + k, bf16_grad[i],
                int64_t(host[i].value.size()), 0, rules[i].lr_multiplier, rules[i].weight_decay_multiplier};
  }
  const int64_t blocks = kern::assign_adamw_blocks(slots.data(), int(T));
  moka::cuda::DeviceArray<kern::TensorSlot> table(T);
  table.upload(slots);
  moka::cuda::DeviceArray<double> partials(T * kern::kReduceBlocks + 1);
  double* ss = partials.data() + T * kern::kReduceBlocks;
  moka::cuda::DeviceArray<kern::StepScalars> scalars(1);
  for (int step = 1; step <= 3; ++step) {
    const double factor = 0.7;
    for (size_t i = 0; i < T; ++i) {
      host[i].grad = normal(host[i].value.size(), rng);
      if (bf16_grad[i]) {
        std::vector<bf16> g16(host[i].grad.size());
        for (size_t j = 0; j < g16.size(); ++j) {
          g16[j] = __float2bfloat16(host[i].grad[j]);
          host[i].grad[j] = __bfloat162float(g16[j]);
        }
        g16.insert(g16.begin(), lead[i], __float2bfloat16(0.0f));
        grad16[i].upload(g16);
      } else {
        grad[i].array.upload(with_lead(i, host[i].grad));
      }
    }
    adam.step(host, factor);
    ema.update(host);
    kern::StepScalars sc{cfg.lr * factor, float(1.0 - std::pow(cfg.beta1, step)),
                         float(1.0 - std::pow(cfg.beta2, step))};
    scalars.upload(&sc, 1);
    kern::grad_square_partials(table.data(), int(T), partials.data(), nullptr);
    kern::reduce_finish(partials.data(), int64_t(T) * kern::kReduceBlocks, 1.0, ss, nullptr);
    kern::adamw_update(kern::AdamWHyper(cfg, 0.9), scalars.data(), ss, table.data(), int(T), blocks, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  for (size_t i = 0; i < T; ++i) {
    SCOPED_TRACE(rules[i].spec.name);
    const auto k = std::ptrdiff_t(lead[i]);
    // The tensor's part of its allocation; what lies before it must be untouched.
    auto tensor = [&](const DeviceFloats& d) {
      const auto all = d.host();
      for (std::ptrdiff_t j = 0; j < k; ++j) EXPECT_EQ(all[size_t(j)], -7.0f) << "written before the tensor";
      return std::vector<float>(all.begin() + k, all.end());
    };
    EXPECT_LT(rel_error(tensor(value[i]), host[i].value), kFp32Tolerance);
    EXPECT_LT(rel_error(tensor(m[i]), adam.m[i]), kFp32Tolerance);
    EXPECT_LT(rel_error(tensor(v[i]), adam.v[i]), kFp32Tolerance);
    EXPECT_LT(rel_error(tensor(ema_dev[i]), ema.shadow[i]), kFp32Tolerance);
    if (bf16_grad[i]) {
      const auto s16 = shadow[i].download();
      const auto p = tensor(value[i]);
      for (size_t j = 0; j < p.size(); ++j)
        ASSERT_EQ(__bfloat162float(s16[j + size_t(k)]), __bfloat162float(__float2bfloat16(p[j])));
    }
  }
}

// The device's router-bias update is moka::update_selection_bias bit for bit (ties included).
TEST(TrainGpuStages, SelectionBiasUpdateMatchesTheHost) {
  ASSERT_TRUE(moka::cuda_backend_available());
  std::mt19937_64 rng(fresh_seed());
  for (const int64_t experts : {4, 37, 300}) {
    std::vector<int32_t> counts(experts);
    for (auto& c : counts) c = int32_t(rng() % 5);  // small counts: some equal the mean
    counts[0] = 2;
    std::vector<double> bias(experts);
    for (auto& b : bias) b = std::normal_distribution<double>(0.0, 1e-2)(rng);
    moka::cuda::DeviceArray<int32_t> gcounts(experts);
    moka::cuda::DeviceArray<double> gbias(experts);
    moka::cuda::DeviceArray<float> gbias32(experts);
    gcounts.upload(counts);
    gbias.upload(bias);
    const double rate = 1e-3;
    kern::update_selection_bias(gcounts.data(), experts, rate, gbias.data(), gbias32.data(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    moka::update_selection_bias(bias, std::vector<int64_t>(counts.begin(), counts.end()), rate);
    EXPECT_EQ(gbias.download(), bias) << experts << " experts";
    const std::vector<float> bias32(bias.begin(), bias.end());
    EXPECT_EQ(gbias32.download(), bias32) << experts << " experts";
  }
}

namespace {

// The whole model: forward loss and every gradient, GPU vs CPU from the same initial weights.
// The GPU's MoE layers and routers are bf16 (8-bit significand, unit roundoff 2^-9 ~ 2e-3):
// each MoE layer rounds its input, weights, output and weight gradients, and every tensor
// upstream inherits the rounded d_x, so a correct GPU path lands about 1e-2 from the CPU in
// norm. A wrong index, scale or missing term is O(1). Hence 5e-2 per tensor, and 1e-2 on the
// loss (~0.2% of ln 256). The gradients are compared only when both picked the same experts: a
// near-tied token can pick another expert in bf16, which moves one of ~32 rows between experts
// and the router's gradient by up to ~20% (2 of 8 draws on the H200). Such a draw is reported and
// redrawn, at most kDraws times; the router's own choices are tested in CudaRouter.*.
constexpr int kDraws = 8;  // a 1-in-4 event 8 times in a row: ~1.5e-5

bool same_experts_per_token(const std::vector<std::vector<int32_t>>& a, const std::vector<std::vector<int32_t>>& b,
                            int k) {
  if (a.size() != b.size()) return false;
  for (size_t l = 0; l < a.size(); ++l) {
    if (a[l].size() != b[l].size()) return false;
    for (size_t t = 0; t < a[l].size(); t += size_t(k)) {
      std::vector<int32_t> x(a[l].begin() + t, a[l].begin() + t + k), y(b[l].begin() + t, b[l].begin() + t + k);
      std::sort(x.begin(), x.end());
      std::sort(y.begin(), y.end());
      if (x != y) return false;
    }
  }
  return true;
}

// The engine's kernel and precision choices (TrainConfig's CUDA options).
struct EngineChoices {
  bool fused_attention = true;
  bool bf16_matmuls = false;
};

// The model the CPU comparisons use: muP x2 (multipliers != 1, including the head's forward one)
// with a shared expert and z-loss, 4 x 32 tokens.
TrainConfig comparison_config(AttentionKind attention, EngineChoices choices, uint64_t seed) {
  ModelConfig base = moka::train::testing::tiny_config();
  base.attention = attention;
  base.shared_intermediate = 16;
  base.z_loss_coef = 1e-3;
  TrainConfig tc;
  tc.base = base;
  tc.model = scale_width(base, 2);
  tc.parameterization = Parameterization::mup;
  tc.batch = 4;
  tc.seq = 32;
  tc.seed = seed;
  tc.fused_attention = choices.fused_attention;
  tc.bf16_matmuls = choices.bf16_matmuls;
  return tc;
}

Batch random_batch(const TrainConfig& tc, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Batch batch{tc.batch, tc.seq, std::vector<int32_t>(tc.batch * tc.seq), std::vector<int32_t>(tc.batch * tc.seq)};
  for (auto& t : batch.inputs) t = int32_t(32 + rng() % 95);
  for (auto& t : batch.targets) t = int32_t(32 + rng() % 95);
  return batch;
}

void compare_with_cpu(AttentionKind attention, EngineChoices choices = {}, int draw = 1) {
  ASSERT_TRUE(moka::cuda_backend_available());
  const uint64_t seed = fresh_seed();
  const TrainConfig tc = comparison_config(attention, choices, seed);
  const auto rules = parameterize(tc.base, tc.model, tc.parameterization);
  const Batch batch = random_batch(tc, seed);

  Model<float> cpu(tc.model, rules, ModelOptions{moka::Backend::cpu, 2});
  cpu.params().initialize(seed);
  const double cpu_loss = cpu.forward(batch);
  cpu.backward();

  CudaEngine gpu(tc, rules);
  gpu.poison_gradients();
  double gpu_ce = 0;
  const double gpu_loss = gpu.forward_backward(batch, &gpu_ce);
  if (!same_experts_per_token(gpu.routed_experts(), cpu.routed_experts(), tc.model.top_k)) {
    std::cout << "[ redraw   ] seed " << seed << ": a near-tied token picked other experts on the GPU" << std::endl;
    ASSERT_LT(draw, kDraws) << "the GPU picked other experts than the CPU in " << kDraws << " draws in a row";
    compare_with_cpu(attention, choices, draw + 1);
    return;
  }
  EXPECT_NEAR(gpu_ce, cpu.last_cross_entropy(), 1e-2);
  EXPECT_NEAR(gpu_loss, cpu_loss, 1e-2);
  const auto grads = gpu.gradients();
  ASSERT_EQ(grads.size(), cpu.params().size());
  double worst = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& p = cpu.params()[i];
    double norm = 0;
    for (float g : p.grad) norm += double(g) * g;
    EXPECT_GT(norm, 0.0) << p.name() << ": the reference gradient is zero, the comparison would be vacuous";
    const double err = rel_error(grads[i], p.grad);
    worst = std::max(worst, err);
    EXPECT_LT(err, 5e-2) << p.name();
  }
  std::cout << "[ result   ] loss cpu " << cpu_loss << " gpu " << gpu_loss << ", worst gradient error " << worst
            << std::endl;
}

}  // namespace

TEST(TrainGpuModel, LossAndEveryGradientMatchTheCpuMla) { compare_with_cpu(AttentionKind::mla); }
TEST(TrainGpuModel, LossAndEveryGradientMatchTheCpuMha) { compare_with_cpu(AttentionKind::mha); }
TEST(TrainGpuModel, LossAndEveryGradientMatchTheCpuReferenceAttention) {
  compare_with_cpu(AttentionKind::mla, {.fused_attention = false});
}
// bf16 projections round at 2^-9 as the bf16 MoE layers already do: the same bounds.
TEST(TrainGpuModel, LossAndEveryGradientMatchTheCpuBf16Matmuls) {
  compare_with_cpu(AttentionKind::mla, {.bf16_matmuls = true});
}
// bf16 matmuls take effect: the same weights and batch give another loss than TF32 (bf16 keeps 8
// mantissa bits to TF32's 10), close to it.
TEST(TrainGpuModel, Bf16MatmulsChangeTheLoss) {
  ASSERT_TRUE(moka::cuda_backend_available());
  const uint64_t seed = fresh_seed();
  double losses[2] = {0, 0};
  for (const bool bf16 : {false, true}) {
    const TrainConfig tc = comparison_config(AttentionKind::mla, {.bf16_matmuls = bf16}, seed);
    CudaEngine gpu(tc, parameterize(tc.base, tc.model, tc.parameterization));
    double ce = 0;
    losses[bf16] = gpu.forward_backward(random_batch(tc, seed), &ce);
  }
  EXPECT_NE(losses[0], losses[1]) << "--matmul bf16 left the loss bit for bit as TF32's";
  EXPECT_NEAR(losses[0], losses[1], 1e-2);
}

TEST(TrainGpuLoop, LossDecreases) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  auto config = moka::train::testing::tiny_train_config(Parameterization::mup, 1e-2);
  config.backend = moka::Backend::cuda;
  config.seed = fresh_seed();
  moka::train::testing::expect_loss_decreases(config, *text);
}

TEST(TrainGpuLoop, CheckpointResumeIsBitwiseIdentical) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  auto config = moka::train::testing::tiny_train_config(Parameterization::mup, 3e-3);
  config.backend = moka::Backend::cuda;
  config.seed = fresh_seed();
  moka::train::testing::expect_resume_is_bitwise(config, *text, "moka_gpu_resume_test.safetensors");
}

namespace {

// A config with every part of the step on: EMA, clipping, a schedule that changes the LR each
// step, a shared expert, the router-bias update and z-loss.
TrainConfig full_step_config() {
  auto config = moka::train::testing::tiny_train_config(Parameterization::mup, 3e-3);
  config.backend = moka::Backend::cuda;
  config.seed = fresh_seed();
  config.schedule = {ScheduleKind::cosine, 2, 10, 0.0, 0.1};
  config.ema_decay = 0.9;
  config.adam.clip_norm = 0.5;
  config.model.shared_intermediate = config.base.shared_intermediate = 8;
  config.model.z_loss_coef = config.base.z_loss_coef = 1e-3;
  return config;
}

void expect_same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b,
                      const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size()) << what << " " << i;
    EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)), 0) << what << " tensor " << i;
  }
}

}  // namespace

// N steps replayed from one captured CUDA graph equal N eager steps bit for bit: every step's
// loss, cross-entropy, gradient norm and load, and the weights, Adam moments, EMA and router
// biases after them. Read every step, and read only at the end (the steps then run without any
// host synchronization).
TEST(TrainGpuLoop, CapturedStepsEqualEagerStepsBitwise) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  const auto config = full_step_config();
  constexpr int kSteps = 10;
  auto run = [&](bool graph, bool read_every_step, std::vector<StepReport>& reports) {
    auto c = config;
    c.cuda_graph = graph;
    Trainer t(c, *text);
    for (int s = 0; s < kSteps; ++s) reports.push_back(t.step(nullptr, read_every_step || s + 1 == kSteps));
    return t.state();
  };
  std::vector<StepReport> eager_reports, graph_reports, quiet_reports;
  const TrainState eager = run(false, true, eager_reports);
  const TrainState graph = run(true, true, graph_reports);
  const TrainState quiet = run(true, false, quiet_reports);
  for (int s = 0; s < kSteps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const auto &e = eager_reports[s], &g = graph_reports[s];
    EXPECT_EQ(std::memcmp(&e.loss, &g.loss, sizeof(double)), 0) << e.loss << " vs " << g.loss;
    EXPECT_EQ(std::memcmp(&e.cross_entropy, &g.cross_entropy, sizeof(double)), 0);
    EXPECT_EQ(std::memcmp(&e.grad_norm, &g.grad_norm, sizeof(double)), 0);
    EXPECT_EQ(e.load_max_over_mean, g.load_max_over_mean);
    EXPECT_TRUE(std::isfinite(e.loss));
    if (s + 1 < kSteps) {
      EXPECT_TRUE(std::isnan(quiet_reports[s].loss)) << "a step read without being asked";
    }
  }
  EXPECT_EQ(std::memcmp(&eager_reports.back().loss, &quiet_reports.back().loss, sizeof(double)), 0);
  for (const auto* other : {&graph, &quiet}) {
    expect_same_bits(eager.values, other->values, "weights");
    expect_same_bits(eager.adam_m, other->adam_m, "adam m");
    expect_same_bits(eager.adam_v, other->adam_v, "adam v");
    expect_same_bits(eager.ema, other->ema, "ema");
    EXPECT_EQ(eager.selection_biases, other->selection_biases);
    EXPECT_EQ(eager.steps, other->steps);
  }
  // The biases moved: the update ran (and so the comparison above can fail).
  bool moved = false;
  for (const auto& layer : eager.selection_biases)
    for (double b : layer) moved |= b != 0.0;
  EXPECT_TRUE(moved);
}

// A captured run resumes from a checkpoint and validates (eager forwards between replays) and
// still equals the eager run.
TEST(TrainGpuLoop, CapturedStepsSurviveEvaluationAndResume) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  auto config = full_step_config();
  config.cuda_graph = true;
  moka::train::testing::expect_resume_is_bitwise(config, *text, "moka_gpu_graph_resume_test.safetensors");
  auto eager_config = config;
  eager_config.cuda_graph = false;
  Trainer graph(config, *text), eager(eager_config, *text);
  for (int s = 0; s < 6; ++s) {
    graph.step(nullptr, false);
    eager.step(nullptr, false);
    if (s % 2 == 1) {
      EXPECT_EQ(graph.evaluate(2, s == 3), eager.evaluate(2, s == 3)) << "step " << s;
    }
  }
  expect_same_bits(eager.state().values, graph.state().values, "weights");
}

// The profile: every stage that runs on the GPU has time and launches; a replayed step waits
// for the host never, an eager one only where the caller reads.
TEST(TrainGpuLoop, ProfileCountsLaunchesAndTimesStages) {
  const TextSplit* text = moka::train::testing::corpus_slice();
  ASSERT_NE(text, nullptr) << "text corpus missing: set MOKA_TEXT_DIR";
  for (const bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "cuda graph" : "eager");
    auto config = full_step_config();
    config.cuda_graph = graph;
    config.profile = true;
    Trainer t(config, *text);
    for (int s = 0; s < 5; ++s) t.step(nullptr, false);
    const StepProfile p = t.profile();
    std::cout << p.table();
    EXPECT_EQ(p.steps, 3);  // the first two steps (allocation, capture) are not profiled
    EXPECT_EQ(p.mode, graph ? "cuda graph" : "eager");
    EXPECT_GT(p.launches_per_step, 50);
    EXPECT_EQ(p.host_syncs, 0);
    int64_t staged = 0;
    for (int i = 0; i < kStageCount; ++i) staged += p.launches[i];
    EXPECT_EQ(staged, p.launches_per_step);
    for (Stage s : {Stage::embedding_forward, Stage::norms_forward, Stage::attention_forward, Stage::moe_forward,
                    Stage::head_loss_forward, Stage::head_loss_backward, Stage::moe_backward,
                    Stage::norms_backward, Stage::attention_backward, Stage::embedding_backward,
                    Stage::optimizer, Stage::router_bias}) {
      EXPECT_GT(p.ms[size_t(s)], 0.0) << stage_name(s);
      EXPECT_GT(p.launches[size_t(s)], 0) << stage_name(s);
    }
    EXPECT_EQ(p.launches[size_t(Stage::optimizer)], 3);  // grad norm partials, their sum, AdamW + EMA
    EXPECT_GT(p.step_ms, 0.0);
  }
}
