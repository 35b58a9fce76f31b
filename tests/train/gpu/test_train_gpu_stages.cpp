// The CUDA training engine's kernels against their CPU twins (run on a GPU: `ctest -L gpu`, or
// `scripts/gpu.sh train` on the device), stage by stage in fp32: RMSNorm, attention (reference and
// fused), cross-entropy, AdamW + EMA, the router-bias update. test_train_gpu_model.cpp compares
// the whole model, test_train_gpu_loop.cpp trains.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda/common/device_memory.hpp"
#include "moka/moka.hpp"
#include "train/cuda/ops/adamw.cuh"
#include "train/cuda/ops/attention.cuh"
#include "train/cuda/ops/cross_entropy.cuh"
#include "train/cuda/ops/reduce.cuh"
#include "train/cuda/ops/rmsnorm.cuh"
#include "train/cuda/ops/selection_bias.cuh"
#include "train/dense_math.hpp"
#include "train/optimizer.hpp"
#include "train_gpu_helpers.hpp"

using namespace moka::train;
namespace kern = moka::train::cuda;
using kern::bf16;
using moka::train::gpu_test::fresh_seed;
using moka::train::gpu_test::rel_error;

namespace {

// A device copy of `host` (poisoned with NaN when made from a count).
struct DeviceFloats {
  moka::cuda::DeviceArray<float> array;
  float* p;
  explicit DeviceFloats(const std::vector<float>& host) : array(host.size()), p(array.data()) {
    array.upload(host, cudaStreamLegacy);
  }
  explicit DeviceFloats(size_t count) : DeviceFloats(std::vector<float>(count, NAN)) {}
  std::vector<float> host() const { return array.download(cudaStreamLegacy); }
};

std::vector<float> normal(size_t n, std::mt19937_64& rng, float std = 1.0f) {
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// rel_error, or where the reference is all zeros (dq and dk at seq 1) the largest |gpu|.
double error_against(const std::vector<float>& gpu, const std::vector<float>& cpu) {
  if (std::any_of(cpu.begin(), cpu.end(), [](float x) { return x != 0.0f; })) return rel_error(gpu, cpu);
  double largest = 0;
  for (float x : gpu) largest = std::isfinite(x) ? std::max(largest, double(std::fabs(x))) : INFINITY;
  return largest;
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
  gdelta16.upload(delta16, cudaStreamLegacy);
  gdy16.upload(dy16, cudaStreamLegacy);
  gdy16_b.upload(dy16_b, cudaStreamLegacy);
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
    if (bf16_operands) rd.b16 = gdelta16.data();
    else rd.f32 = gdelta.p;
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
    const auto dx16_gpu = gdx16.download(cudaStreamLegacy);
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
      : a(dims), n(a.tokens() * a.width()), np(a.batch * a.heads * a.seq * a.seq), q(normal(n, rng)), k(normal(n, rng)),
        v(normal(n, rng)), dout(normal(n, rng)), probs(np), out(n), dq(n), dk(n), dv(n) {
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
    device_targets.upload(targets, cudaStreamLegacy);
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
    slots[i] = {value[i].p + k,
                m[i].p + k,
                v[i].p + k,
                ema_dev[i].p + k,
                bf16_grad[i] ? shadow[i].data() + k : nullptr,
                bf16_grad[i] ? static_cast<const void*>(grad16[i].data() + k) : grad[i].p + k,
                bf16_grad[i],
                int64_t(host[i].value.size()),
                0,
                rules[i].lr_multiplier,
                rules[i].weight_decay_multiplier};
  }
  const int64_t blocks = kern::assign_adamw_blocks(slots.data(), int(T));
  moka::cuda::DeviceArray<kern::TensorSlot> table(T);
  table.upload(slots, cudaStreamLegacy);
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
        grad16[i].upload(g16, cudaStreamLegacy);
      } else {
        grad[i].array.upload(with_lead(i, host[i].grad), cudaStreamLegacy);
      }
    }
    adam.step(host, factor);
    ema.update(host);
    kern::StepScalars sc{cfg.lr * factor, float(1.0 - std::pow(cfg.beta1, step)),
                         float(1.0 - std::pow(cfg.beta2, step))};
    scalars.upload(&sc, 1, cudaStreamLegacy);
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
      const auto s16 = shadow[i].download(cudaStreamLegacy);
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
    gcounts.upload(counts, cudaStreamLegacy);
    gbias.upload(bias, cudaStreamLegacy);
    const double rate = 1e-3;
    kern::update_selection_bias(gcounts.data(), experts, rate, gbias.data(), gbias32.data(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    moka::update_selection_bias(bias, std::vector<int64_t>(counts.begin(), counts.end()), rate);
    EXPECT_EQ(gbias.download(cudaStreamLegacy), bias) << experts << " experts";
    const std::vector<float> bias32(bias.begin(), bias.end());
    EXPECT_EQ(gbias32.download(cudaStreamLegacy), bias32) << experts << " experts";
  }
}
