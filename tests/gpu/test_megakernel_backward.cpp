// The backward megakernel at EP = 1 (cuda/megakernel/megakernel_backward.hpp): every gradient
// (d_x, d_topk_weights, the routed experts' dW_gate/up/down and the shared expert's) against an
// fp64 backward of the same bf16 inputs, on outputs poisoned with NaN bits first; the same bits
// across SM splits and minibatch/macrobatch sizes; a bounded wait that times out is reported.
//
// The saved context is made on the host as the forward leaves it in resident mode: the
// expert-grouped rows of x, g = x W_gate^T and u = x W_up^T (bf16, padding rows zero) in the
// receive schedule's order (core::build_receive_schedule), and the shared expert's g, u.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/activation.hpp"
#include "core/schedule.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/megakernel/megakernel_backward.hpp"
#include "moka/error.hpp"

namespace moka::cuda {
namespace {

float to_float(bf16 v) { return __bfloat162float(v); }

// Random bf16 values in [-range, range], kept as the doubles the reference computes with.
std::vector<double> random_bf16(int64_t n, double range, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> d(-range, range);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = to_float(__float2bfloat16_rn(float(d(rng))));
  return v;
}
std::vector<bf16> bf16_of(const std::vector<double>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16_rn(float(v[i]));
  return o;
}
template <class T>
DeviceArray<T> on_device(const std::vector<T>& v) {
  DeviceArray<T> d(v.size());
  d.upload(v);
  return d;
}

// T = 300 tokens, k = 2 of E = 4 experts: choice 0 is expert 0 (300 rows, padded to 384: it
// crosses the 256-row macrobatch boundary, so its weight gradients carry), choice 1 is expert 1
// for 100 random tokens and expert 3 for the others; expert 2 gets no rows.
std::vector<int32_t> skewed_routing(std::mt19937_64& rng) {
  std::vector<int> tokens(300);
  std::iota(tokens.begin(), tokens.end(), 0);
  std::shuffle(tokens.begin(), tokens.end(), rng);
  std::vector<int32_t> ids(600);
  for (int i = 0; i < 300; ++i) {
    ids[2 * tokens[i]] = 0;
    ids[2 * tokens[i] + 1] = i < 100 ? 1 : 3;
  }
  return ids;
}

// k distinct experts of E per token, uniformly.
std::vector<int32_t> uniform_routing(int64_t T, int64_t k, int64_t E, std::mt19937_64& rng) {
  std::vector<int32_t> ids;
  std::vector<int32_t> experts(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    ids.insert(ids.end(), experts.begin(), experts.begin() + k);
  }
  return ids;
}

// Outputs, poisoned with NaN bits before every run.
template <class T>
struct Poisoned {
  DeviceArray<T> device;
  explicit Poisoned(int64_t n) : device(size_t(n)) {}
  void poison() { MOKA_CUDA_CHECK(cudaMemset(device.data(), 0xFF, device.bytes())); }
};

struct Gradients {
  std::vector<bf16> d_x, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down;
  std::vector<float> d_topk_weights;
};

bool same_bits(const Gradients& a, const Gradients& b) {
  auto eq = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  return eq(a.d_x, b.d_x) && eq(a.d_w_gate, b.d_w_gate) && eq(a.d_w_up, b.d_w_up) && eq(a.d_w_down, b.d_w_down) &&
         eq(a.d_ws_gate, b.d_ws_gate) && eq(a.d_ws_up, b.d_ws_up) && eq(a.d_ws_down, b.d_ws_down) &&
         eq(a.d_topk_weights, b.d_topk_weights);
}

// One layer call's inputs, its saved context and the fp64 reference gradients.
class BackwardCase {
 public:
  // ids: [T, k] expert ids.
  BackwardCase(const MoeShape& shape, int64_t tokens, std::vector<int32_t> ids, uint64_t seed)
      : s_(shape), T_(tokens), rng_(seed), ids_(std::move(ids)) {
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, E = s_.num_experts, k = s_.top_k;
    schedule_ = core::build_receive_schedule({1, T_, k, E, 0, 128}, ids_.data());
    x_ = random_bf16(T_ * H, 1.0, rng_);
    d_out_ = random_bf16(T_ * H, 1.0, rng_);
    std::uniform_real_distribution<float> w01(0.05f, 1.f);
    for (int64_t i = 0; i < T_ * k; ++i) route_weight_.push_back(w01(rng_));
    w_gate_ = random_bf16(E * I * H, 0.1, rng_);
    w_up_ = random_bf16(E * I * H, 0.1, rng_);
    w_down_ = random_bf16(E * H * I, 0.1, rng_);
    ws_gate_ = random_bf16(Is * H, 0.1, rng_);
    ws_up_ = random_bf16(Is * H, 0.1, rng_);
    ws_down_ = random_bf16(H * Is, 0.1, rng_);
    make_context();
    make_reference();
  }

  int64_t rows() const { return schedule_.total_rows(); }
  const core::ReceiveSchedule& schedule() const { return schedule_; }

  // Runs the backward megakernel once into poisoned outputs.
  Gradients run(const MegakernelConfig& config, int num_ctas, core::ContextMode mode = core::ContextMode::resident) {
    MegakernelBackward kernel(s_, config, 1, T_, mode, num_ctas);
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, E = s_.num_experts;
    const int64_t k = s_.top_k;
    Poisoned<bf16> d_x(T_ * H), dg(E * I * H), du(E * I * H), dd(E * H * I), dsg(Is * H), dsu(Is * H), dsd(H * Is);
    Poisoned<float> d_topk(T_ * k);
    Poisoned<bf16> dx_slots(T_ * k * H);
    for (auto* p : {&d_x, &dg, &du, &dd, &dsg, &dsu, &dsd, &dx_slots}) p->poison();
    d_topk.poison();
    const DeviceArray<const bf16*> x_peers = on_device(std::vector<const bf16*>{x_dev_.data()});
    const DeviceArray<const bf16*> d_out_peers = on_device(std::vector<const bf16*>{d_out_dev_.data()});
    const DeviceArray<const float*> weight_peers = on_device(std::vector<const float*>{weights_dev_.data()});
    const DeviceArray<bf16*> dx_peers = on_device(std::vector<bf16*>{dx_slots.device.data()});
    const DeviceArray<float*> dw_peers = on_device(std::vector<float*>{d_topk.device.data()});
    MegakernelBackwardIo io;
    io.offsets = offsets_dev_.data();
    io.slot_of_row = slot_of_row_dev_.data();
    io.x_peers = x_peers.data();
    io.d_out_peers = d_out_peers.data();
    io.weight_peers = weight_peers.data();
    io.dx_slot_peers = dx_peers.data();
    io.dw_slot_peers = dw_peers.data();
    io.x = x_dev_.data();
    io.d_out = d_out_dev_.data();
    io.dx_slots = dx_slots.device.data();
    io.context_x = ctx_x_dev_.data();
    io.context_gate = ctx_g_dev_.data();
    io.context_up = ctx_u_dev_.data();
    io.shared_gate = sg_dev_.data();
    io.shared_up = su_dev_.data();
    io.w_gate = wg_dev_.data();
    io.w_up = wu_dev_.data();
    io.w_down = wd_dev_.data();
    io.ws_gate = wsg_dev_.data();
    io.ws_up = wsu_dev_.data();
    io.ws_down = wsd_dev_.data();
    io.d_x = d_x.device.data();
    io.d_w_gate = dg.device.data();
    io.d_w_up = du.device.data();
    io.d_w_down = dd.device.data();
    io.d_ws_gate = dsg.device.data();
    io.d_ws_up = dsu.device.data();
    io.d_ws_down = dsd.device.data();
    kernel.run(io, T_, nullptr);
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    kernel.check_errors();
    return {d_x.device.download(),  dg.device.download(),  du.device.download(),    dd.device.download(),
            dsg.device.download(), dsu.device.download(), dsd.device.download(), d_topk.device.download()};
  }

  // Every gradient within bf16 tolerance of the fp64 reference: |got - want| <= 2^-5 |want| +
  // 2^-7 max|want| of that gradient (bf16 operands of every GEMM, fp32 sums in tile order).
  void expect_close(const Gradients& g) const {
    check("d_x", g.d_x, ref_.d_x);
    check("d_topk_weights", g.d_topk_weights, ref_.d_topk_weights);
    check("d_w_gate", g.d_w_gate, ref_.d_w_gate);
    check("d_w_up", g.d_w_up, ref_.d_w_up);
    check("d_w_down", g.d_w_down, ref_.d_w_down);
    check("d_ws_gate", g.d_ws_gate, ref_.d_ws_gate);
    check("d_ws_up", g.d_ws_up, ref_.d_ws_up);
    check("d_ws_down", g.d_ws_down, ref_.d_ws_down);
  }

 private:
  struct Reference {
    std::vector<double> d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down;
  };

  template <class T>
  static void check(const char* name, const std::vector<T>& got, const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size()) << name;
    double scale = 0;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    int64_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      double v;
      if constexpr (std::is_same_v<T, bf16>) v = to_float(got[i]); else v = got[i];
      const double tol = std::fabs(want[i]) * 0x1p-5 + scale * 0x1p-7;
      if (!(std::fabs(v - want[i]) <= tol) && bad++ < 5)
        ADD_FAILURE() << name << "[" << i << "]: got " << v << ", expected " << want[i] << " (max |ref| " << scale << ")";
    }
    EXPECT_EQ(bad, 0) << name << ": elements off the reference";
  }

  // g = bf16(x W^T) of one row (the forward's saved bf16 values).
  void project(const double* x, const std::vector<double>& w, int64_t e, int64_t n, double* out) const {
    const int64_t H = s_.hidden;
    for (int64_t i = 0; i < n; ++i) {
      double acc = 0;
      for (int64_t c = 0; c < H; ++c) acc += w[(e * n + i) * H + c] * x[c];
      out[i] = to_float(__float2bfloat16_rn(float(acc)));
    }
  }

  void make_context() {
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, k = s_.top_k, R = rows();
    std::vector<double> cx(R * H, 0.0), cg(R * I, 0.0), cu(R * I, 0.0), sg(T_ * Is), su(T_ * Is);
    std::vector<int32_t> slot_of_row(size_t(R), -1);
    for (int64_t row = 0; row < R; ++row) {
      if (schedule_.row_source[row] < 0) continue;
      const int64_t slot = schedule_.row_slot[row], t = slot / k, e = schedule_.expert_of_row(row);
      slot_of_row[row] = int32_t(slot);
      std::copy_n(&x_[t * H], H, &cx[row * H]);
      project(&x_[t * H], w_gate_, e, I, &cg[row * I]);
      project(&x_[t * H], w_up_, e, I, &cu[row * I]);
    }
    for (int64_t t = 0; t < T_; ++t) {
      project(&x_[t * H], ws_gate_, 0, Is, &sg[t * Is]);
      project(&x_[t * H], ws_up_, 0, Is, &su[t * Is]);
    }
    ctx_x_ = cx, ctx_g_ = cg, ctx_u_ = cu, sg_ = sg, su_ = su;
    std::vector<int32_t> offsets(schedule_.expert_offset.begin(), schedule_.expert_offset.end());
    offsets_dev_ = on_device(offsets);
    slot_of_row_dev_ = on_device(slot_of_row);
    x_dev_ = on_device(bf16_of(x_));
    d_out_dev_ = on_device(bf16_of(d_out_));
    weights_dev_ = on_device(route_weight_);
    ctx_x_dev_ = on_device(bf16_of(cx));
    ctx_g_dev_ = on_device(bf16_of(cg));
    ctx_u_dev_ = on_device(bf16_of(cu));
    sg_dev_ = on_device(bf16_of(sg));
    su_dev_ = on_device(bf16_of(su));
    wg_dev_ = on_device(bf16_of(w_gate_));
    wu_dev_ = on_device(bf16_of(w_up_));
    wd_dev_ = on_device(bf16_of(w_down_));
    wsg_dev_ = on_device(bf16_of(ws_gate_));
    wsu_dev_ = on_device(bf16_of(ws_up_));
    wsd_dev_ = on_device(bf16_of(ws_down_));
  }

  // One expert's backward for one row (fp64): adds to d_x, returns <dH, h>.
  double row_backward(int64_t e, int64_t n, const double* x, const double* d_out, const double* g, const double* u,
                      double w, const std::vector<double>& wg, const std::vector<double>& wu,
                      const std::vector<double>& wd, double* d_x, double* dwg, double* dwu, double* dwd) const {
    const int64_t H = s_.hidden;
    const core::ActParams act = core::ActParams::of(s_);
    double d_weight = 0;
    for (int64_t i = 0; i < n; ++i) {
      double dh = 0;
      for (int64_t c = 0; c < H; ++c) dh += wd[(e * H + c) * n + i] * d_out[c];
      const double h = core::swiglu_forward<double>(g[i], u[i], act.clamped, act.limit);
      d_weight += dh * h;
      double dg, du;
      core::swiglu_backward<double>(g[i], u[i], w * dh, act.clamped, act.limit, dg, du);
      for (int64_t c = 0; c < H; ++c) {
        d_x[c] += wg[(e * n + i) * H + c] * dg + wu[(e * n + i) * H + c] * du;
        dwg[(e * n + i) * H + c] += dg * x[c];
        dwu[(e * n + i) * H + c] += du * x[c];
        dwd[(e * H + c) * n + i] += w * d_out[c] * h;
      }
    }
    return d_weight;
  }

  void make_reference() {
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, E = s_.num_experts, k = s_.top_k;
    Reference& r = ref_;
    r.d_x.assign(T_ * H, 0.0);
    r.d_topk_weights.assign(T_ * k, 0.0);
    r.d_w_gate.assign(E * I * H, 0.0);
    r.d_w_up.assign(E * I * H, 0.0);
    r.d_w_down.assign(E * H * I, 0.0);
    r.d_ws_gate.assign(Is * H, 0.0);
    r.d_ws_up.assign(Is * H, 0.0);
    r.d_ws_down.assign(H * Is, 0.0);
    for (int64_t row = 0; row < rows(); ++row) {
      if (schedule_.row_source[row] < 0) continue;
      const int64_t slot = schedule_.row_slot[row], t = slot / k, e = schedule_.expert_of_row(row);
      r.d_topk_weights[slot] =
          row_backward(e, I, &x_[t * H], &d_out_[t * H], &ctx_g_[row * I], &ctx_u_[row * I], route_weight_[slot],
                       w_gate_, w_up_, w_down_, &r.d_x[t * H], r.d_w_gate.data(), r.d_w_up.data(), r.d_w_down.data());
    }
    for (int64_t t = 0; t < T_; ++t)
      row_backward(0, Is, &x_[t * H], &d_out_[t * H], &sg_[t * Is], &su_[t * Is], 1.0, ws_gate_, ws_up_, ws_down_,
                   &r.d_x[t * H], r.d_ws_gate.data(), r.d_ws_up.data(), r.d_ws_down.data());
  }

  MoeShape s_;
  int64_t T_;
  std::mt19937_64 rng_;
  std::vector<int32_t> ids_;
  core::ReceiveSchedule schedule_;
  std::vector<double> x_, d_out_, w_gate_, w_up_, w_down_, ws_gate_, ws_up_, ws_down_;
  std::vector<float> route_weight_;
  std::vector<double> ctx_x_, ctx_g_, ctx_u_, sg_, su_;
  Reference ref_;
  DeviceArray<int32_t> offsets_dev_, slot_of_row_dev_;
  DeviceArray<float> weights_dev_;
  DeviceArray<bf16> x_dev_, d_out_dev_, ctx_x_dev_, ctx_g_dev_, ctx_u_dev_, sg_dev_, su_dev_;
  DeviceArray<bf16> wg_dev_, wu_dev_, wd_dev_, wsg_dev_, wsu_dev_, wsd_dev_;
};

MegakernelConfig config(int comm, int64_t minibatch, int64_t macrobatch, double timeout = 10) {
  MegakernelConfig c;
  c.num_comm_sms = comm;
  c.minibatch_size = minibatch;
  c.macrobatch_size = macrobatch;
  c.capacity_multiplier = 1;
  c.spin_timeout_seconds = timeout;  // a hang fails fast
  return c;
}

// H = 320, I = 264: two column tiles of dgd and dx, partial last tiles everywhere; with
// skewed_routing, 768 rows, an empty expert and a weight-gradient carry at 256-row macrobatches.
BackwardCase skewed_case(bool clamped, uint64_t seed) {
  const MoeShape shape{320, 264, 4, 2, 136, clamped ? Activation::swiglu_clamped : Activation::swiglu, 0.5f};
  std::mt19937_64 rng(seed);
  return BackwardCase(shape, 300, skewed_routing(rng), seed);
}

TEST(MegakernelBackward, GradientsMatchReferenceWithCarriesAndAnEmptyExpert) {
  BackwardCase c = skewed_case(false, 0xbac0001ull);
  ASSERT_EQ(c.schedule().expert_offset, (std::vector<int64_t>{0, 384, 512, 512, 768}));
  c.expect_close(c.run(config(1, 128, 256), 4));
}

// T = 1, k = 8 of 16 experts: eight one-row experts (each a padded tile), eight empty ones;
// clamped SwiGLU with a limit inside the values' range.
BackwardCase eight_routes_of_one_token(uint64_t seed) {
  const MoeShape shape{256, 128, 16, 8, 64, Activation::swiglu_clamped, 0.3f};
  std::mt19937_64 rng(seed);
  return BackwardCase(shape, 1, uniform_routing(1, 8, 16, rng), seed);
}

TEST(MegakernelBackward, ClampedSwigluWithEightRoutesOfOneToken) {
  BackwardCase c = eight_routes_of_one_token(0xbac0002ull);
  c.expect_close(c.run(config(1, 256, 512), 5));
}

TEST(MegakernelBackward, BitsDoNotDependOnSplitsOrBatchSizes) {
  BackwardCase c = skewed_case(true, 0xbac0003ull);
  const Gradients first = c.run(config(1, 128, 256), 4);
  c.expect_close(first);
  EXPECT_TRUE(same_bits(first, c.run(config(2, 256, 512), 9))) << "another split and minibatch/macrobatch";
  EXPECT_TRUE(same_bits(first, c.run(config(3, 128, 1024), 0))) << "every SM, one macrobatch";
  EXPECT_TRUE(same_bits(first, c.run(config(1, 128, 256), 4))) << "the same run again";
}

// Replay mode: x pulled again and g, u recomputed by the forward's gate|up tile (fp32 sums, so
// within bf16 rounding of the host's g, u the resident cases read); the shared expert's too.
TEST(MegakernelBackward, ReplayModeMatchesReferenceAndItsBitsDoNotDependOnSplits) {
  BackwardCase c = skewed_case(false, 0xbac0007ull);
  const Gradients first = c.run(config(1, 128, 256), 4, core::ContextMode::replay);
  c.expect_close(first);
  EXPECT_TRUE(same_bits(first, c.run(config(2, 256, 512), 9, core::ContextMode::replay)));
}

TEST(MegakernelBackward, ReplayModeWithEightRoutesOfOneToken) {
  BackwardCase c = eight_routes_of_one_token(0xbac0008ull);
  c.expect_close(c.run(config(1, 256, 512), 5, core::ContextMode::replay));
}

// Named shapes' layer dimensions with a few experts and tokens: gpt-oss-120b's H = I = 2880
// (no multiple of 256: partial column tiles and half B boxes everywhere), deepseek-v3's H = 7168,
// I = 2048 and shared expert Is = 2048.
void check_dimensions(int64_t H, int64_t I, int64_t Is, int64_t E, int64_t k, int64_t T, uint64_t seed) {
  const MoeShape shape{H, I, E, k, Is, Activation::swiglu, 7.0f};
  std::mt19937_64 rng(seed);
  BackwardCase c(shape, T, uniform_routing(T, k, E, rng), seed);
  c.expect_close(c.run(config(2, 128, 256), 0));
}
TEST(MegakernelBackward, GptOss120bDimensions) { check_dimensions(2880, 2880, 0, 8, 4, 24, 0xbac0005ull); }
TEST(MegakernelBackward, DeepseekV3DimensionsWithSharedExpert) {
  check_dimensions(7168, 2048, 2048, 4, 4, 16, 0xbac0006ull);
}

// A 1 ns bound: a wait not satisfied at its first read times out; every CTA leaves and the host
// raises a timeout naming the task and its counter. The next call (control words reset) works.
TEST(MegakernelBackward, WaitTimeoutIsReported) {
  BackwardCase c = skewed_case(false, 0xbac0004ull);
  try {
    c.run(config(1, 128, 256, 1e-9), 4);
    ADD_FAILURE() << "no wait timed out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::timeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("megakernel backward: "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out after"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("waiting for"), std::string::npos) << e.what();
  }
  c.expect_close(c.run(config(1, 128, 256), 4));
}

}  // namespace
}  // namespace moka::cuda
