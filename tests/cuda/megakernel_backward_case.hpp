// BackwardCase: the inputs, saved context and fp64 reference gradients of one backward megakernel
// call on one or more ranks on one GPU, and its helpers (test_megakernel_backward*.cpp).
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/activation.hpp"
#include "comm/device_barrier.cuh"
#include "core/schedule.hpp"
#include "cuda/common/check.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/megakernel/backward.hpp"
#include "megakernel_options.hpp"
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
  d.upload(v, cudaStreamLegacy);
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

// How the ranks of a run are launched.
struct RankLaunch {
  int num_ctas = 0;    // CTAs per rank (0: one per SM)
  int late_rank = -1;  // the host sleeps late_ms before it enqueues this rank's call (a rank that stops)
  int late_ms = 0;
  int impatient_rank = -1;     // this rank's kernel bounds its waits by 1 ns (its barriers keep the config's bound)
  bool dx_into_slots = false;  // EP = 1: the dx tiles store into the d_x slots (the layer's way)
};

// One rank's gradients of a run, or the error its check_errors raised.
struct RankResult {
  Gradients grads;
  std::exception_ptr error;
};

// One layer call's inputs on `world` ranks (EP = world, rank r holds experts [r E/world,
// (r+1) E/world)), every rank's saved context and the fp64 reference gradients. At EP > 1 the
// ranks run in this process on one GPU: every rank's buffers are separate allocations, the peer
// tables point at all of them, each rank's call runs on its own stream, and the ranks meet in
// the group's device barrier (comm::launch_device_barrier) over per-rank regions.
class BackwardCase {
 public:
  // ids: [world][T][k] global expert ids.
  BackwardCase(const MoeShape& shape, int world, int64_t tokens, std::vector<int32_t> ids, uint64_t seed)
      : s_(shape), world_(world), T_(tokens), rng_(seed), ids_(std::move(ids)) {
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, E = s_.num_experts, k = s_.top_k;
    const int64_t El = E / world_;
    for (int r = 0; r < world_; ++r)
      schedule_.push_back(
          core::build_receive_schedule({world_, T_, k, El, r * El, 128, RowOrder::round_robin, r}, ids_.data()));
    x_ = random_bf16(world_ * T_ * H, 1.0, rng_);
    d_out_ = random_bf16(world_ * T_ * H, 1.0, rng_);
    std::uniform_real_distribution<float> w01(0.05f, 1.f);
    for (int64_t i = 0; i < world_ * T_ * k; ++i) route_weight_.push_back(w01(rng_));
    w_gate_ = random_bf16(E * I * H, 0.1, rng_);
    w_up_ = random_bf16(E * I * H, 0.1, rng_);
    w_down_ = random_bf16(E * H * I, 0.1, rng_);
    ws_gate_ = random_bf16(Is * H, 0.1, rng_);
    ws_up_ = random_bf16(Is * H, 0.1, rng_);
    ws_down_ = random_bf16(H * Is, 0.1, rng_);
    wg_dev_ = on_device(bf16_of(w_gate_));
    wu_dev_ = on_device(bf16_of(w_up_));
    wd_dev_ = on_device(bf16_of(w_down_));
    wsg_dev_ = on_device(bf16_of(ws_gate_));
    wsu_dev_ = on_device(bf16_of(ws_up_));
    wsd_dev_ = on_device(bf16_of(ws_down_));
    ranks_.resize(size_t(world_));
    for (int r = 0; r < world_; ++r) make_context(r);
    make_reference();
  }

  int64_t rows(int rank = 0) const { return schedule_[rank].total_rows(); }
  const core::ReceiveSchedule& schedule(int rank = 0) const { return schedule_[rank]; }

  // Runs the backward megakernel once on every rank into poisoned outputs; each rank's
  // check_errors after the device is synchronized.
  std::vector<RankResult> run_ranks(const MegakernelConfig& config, RankLaunch launch,
                                    core::ContextMode mode = core::ContextMode::resident) {
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, k = s_.top_k;
    const int64_t El = s_.num_experts / world_;
    struct Outputs {
      Poisoned<bf16> d_x, dg, du, dd, dsg, dsu, dsd, dx_slots;
      Poisoned<float> d_topk;
    };
    std::vector<std::unique_ptr<Outputs>> out;
    std::vector<const bf16*> x_peers, d_out_peers;
    std::vector<const float*> weight_peers;
    std::vector<bf16*> dx_peers;
    std::vector<float*> dw_peers;
    for (int r = 0; r < world_; ++r) {
      out.push_back(std::unique_ptr<Outputs>(
          new Outputs{Poisoned<bf16>(T_ * H), Poisoned<bf16>(El * I * H), Poisoned<bf16>(El * I * H),
                      Poisoned<bf16>(El * H * I), Poisoned<bf16>(Is * H), Poisoned<bf16>(Is * H),
                      Poisoned<bf16>(H * Is), Poisoned<bf16>(T_ * k * H), Poisoned<float>(T_ * k)}));
      Outputs& o = *out.back();
      for (auto* p : {&o.d_x, &o.dg, &o.du, &o.dd, &o.dsg, &o.dsu, &o.dsd, &o.dx_slots}) p->poison();
      o.d_topk.poison();
      x_peers.push_back(ranks_[r].x.data());
      d_out_peers.push_back(ranks_[r].d_out.data());
      weight_peers.push_back(ranks_[r].weights.data());
      dx_peers.push_back(o.dx_slots.device.data());
      dw_peers.push_back(o.d_topk.device.data());
    }
    const DeviceArray<const bf16*> x_table = on_device(x_peers), d_out_table = on_device(d_out_peers);
    const DeviceArray<const float*> weight_table = on_device(weight_peers);
    const DeviceArray<bf16*> dx_table = on_device(dx_peers);
    const DeviceArray<float*> dw_table = on_device(dw_peers);

    // The device barrier's regions (zeroed: epoch 0, no error) and the status slots.
    std::vector<DeviceArray<uint64_t>> regions;
    std::vector<uint64_t*> region_ptrs;
    for (int r = 0; r < world_; ++r) {
      regions.emplace_back(size_t(comm::barrier_region_words(world_)));
      MOKA_CUDA_CHECK(cudaMemset(regions.back().data(), 0, regions.back().bytes()));
      region_ptrs.push_back(regions.back().data());
    }
    const DeviceArray<uint64_t*> region_table = on_device(region_ptrs);
    DeviceArray<BackwardStatus> status(static_cast<size_t>(world_));
    MOKA_CUDA_CHECK(cudaMemset(status.data(), 0, status.bytes()));
    std::vector<BackwardStatus*> status_ptrs;
    for (int r = 0; r < world_; ++r) status_ptrs.push_back(status.data() + r);
    const DeviceArray<BackwardStatus*> status_table = on_device(status_ptrs);

    std::vector<std::unique_ptr<MegakernelBackward>> kernels;
    std::vector<cudaStream_t> streams(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r) {
      BackwardRanks ranks;
      if (world_ > 1) {
        const comm::BarrierView view{region_table.data(), r, world_,
                                     static_cast<uint64_t>(config.spin_timeout_seconds * 1e9)};
        ranks.barrier = [view](cudaStream_t s) { comm::launch_device_barrier(view, s); };
        ranks.barrier_error = region_ptrs[r] + comm::barrier_error_word(world_);
        ranks.status_peers = status_table.data();
        ranks.own_status = status_ptrs[r];
      }
      MegakernelConfig rank_config = config;
      if (r == launch.impatient_rank) rank_config.spin_timeout_seconds = 1e-9;
      kernels.push_back(
          std::make_unique<MegakernelBackward>(s_, rank_config, world_, T_, mode, launch.num_ctas, ranks));
      MOKA_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    }
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());  // allocations and zeroing done before any call
    for (int r = 0; r < world_; ++r) {
      if (r == launch.late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(launch.late_ms));
      const RankDevice& d = ranks_[r];
      Outputs& o = *out[r];
      MegakernelBackwardIo io;
      io.offsets = d.offsets.data();
      io.slot_of_row = d.slot_of_row.data();
      io.x_peers = x_table.data();
      io.d_out_peers = d_out_table.data();
      io.weight_peers = weight_table.data();
      io.dx_slot_peers = dx_table.data();
      io.dw_slot_peers = dw_table.data();
      io.x = d.x.data();
      io.d_out = d.d_out.data();
      io.dx_slots = o.dx_slots.device.data();
      io.dx_into_slots = launch.dx_into_slots;
      io.context_x = d.ctx_x.data();
      io.context_gate = d.ctx_g.data();
      io.context_up = d.ctx_u.data();
      io.shared_gate = d.sg.data();
      io.shared_up = d.su.data();
      io.w_gate = wg_dev_.data() + r * El * I * H;
      io.w_up = wu_dev_.data() + r * El * I * H;
      io.w_down = wd_dev_.data() + r * El * H * I;
      io.ws_gate = wsg_dev_.data();
      io.ws_up = wsu_dev_.data();
      io.ws_down = wsd_dev_.data();
      io.d_x = o.d_x.device.data();
      io.d_w_gate = o.dg.device.data();
      io.d_w_up = o.du.device.data();
      io.d_w_down = o.dd.device.data();
      io.d_ws_gate = o.dsg.device.data();
      io.d_ws_up = o.dsu.device.data();
      io.d_ws_down = o.dsd.device.data();
      kernels[r]->run(io, T_, streams[r]);
    }
    MOKA_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<RankResult> results(static_cast<size_t>(world_));
    for (int r = 0; r < world_; ++r) {
      MOKA_CUDA_CHECK(cudaStreamDestroy(streams[r]));
      try {
        kernels[r]->check_errors();
      } catch (const Error&) {
        results[r].error = std::current_exception();
      }
      const Outputs& o = *out[r];
      results[r].grads = {o.d_x.device.download(cudaStreamLegacy), o.dg.device.download(cudaStreamLegacy),
                          o.du.device.download(cudaStreamLegacy),  o.dd.device.download(cudaStreamLegacy),
                          o.dsg.device.download(cudaStreamLegacy), o.dsu.device.download(cudaStreamLegacy),
                          o.dsd.device.download(cudaStreamLegacy), o.d_topk.device.download(cudaStreamLegacy)};
    }
    return results;
  }

  // Every rank's gradients; the first rank's error, if any, is thrown.
  std::vector<Gradients> run_all(const MegakernelConfig& config, int num_ctas,
                                 core::ContextMode mode = core::ContextMode::resident) {
    std::vector<Gradients> grads;
    for (RankResult& r : run_ranks(config, {num_ctas}, mode)) {
      if (r.error) std::rethrow_exception(r.error);
      grads.push_back(std::move(r.grads));
    }
    return grads;
  }
  Gradients run(const MegakernelConfig& config, int num_ctas, core::ContextMode mode = core::ContextMode::resident) {
    return run_all(config, num_ctas, mode)[0];
  }

  // Every gradient of `rank` within bf16 tolerance of the fp64 reference: |got - want| <= 2^-5
  // |want| + 2^-7 max|want| of that gradient (bf16 operands of every GEMM, fp32 sums in tile
  // order).
  void expect_close(const Gradients& g, int rank = 0) const {
    const Reference& r = ref_[rank];
    SCOPED_TRACE("rank " + std::to_string(rank));
    check("d_x", g.d_x, r.d_x);
    check("d_topk_weights", g.d_topk_weights, r.d_topk_weights);
    check("d_w_gate", g.d_w_gate, r.d_w_gate);
    check("d_w_up", g.d_w_up, r.d_w_up);
    check("d_w_down", g.d_w_down, r.d_w_down);
    check("d_ws_gate", g.d_ws_gate, r.d_ws_gate);
    check("d_ws_up", g.d_ws_up, r.d_ws_up);
    check("d_ws_down", g.d_ws_down, r.d_ws_down);
  }
  void expect_close(const std::vector<Gradients>& g) const {
    ASSERT_EQ(int(g.size()), world_);
    for (int r = 0; r < world_; ++r) expect_close(g[r], r);
  }

 private:
  // One rank's gradients (its tokens' d_x and d_topk_weights, its local experts' dW, the shared
  // expert's dW over its tokens).
  struct Reference {
    std::vector<double> d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down;
  };
  // One rank's inputs and saved context on the device.
  struct RankDevice {
    DeviceArray<int32_t> offsets, slot_of_row;
    DeviceArray<float> weights;
    DeviceArray<bf16> x, d_out, ctx_x, ctx_g, ctx_u, sg, su;
  };

  template <class T>
  static void check(const char* name, const std::vector<T>& got, const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size()) << name;
    double scale = 0;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    int64_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      double v;
      if constexpr (std::is_same_v<T, bf16>) v = to_float(got[i]);
      else v = got[i];
      const double tol = std::fabs(want[i]) * 0x1p-5 + scale * 0x1p-7;
      if (!(std::fabs(v - want[i]) <= tol) && bad++ < 5)
        ADD_FAILURE() << name << "[" << i << "]: got " << v << ", expected " << want[i] << " (max |ref| " << scale
                      << ")";
    }
    EXPECT_EQ(bad, 0) << name << ": elements off the reference";
  }

  // out = bf16(x W^T) of one row with global expert e (the forward's saved bf16 values).
  void project(const double* x, const std::vector<double>& w, int64_t e, int64_t n, double* out) const {
    const int64_t H = s_.hidden;
    for (int64_t i = 0; i < n; ++i) {
      double acc = 0;
      for (int64_t c = 0; c < H; ++c) acc += w[(e * n + i) * H + c] * x[c];
      out[i] = to_float(__float2bfloat16_rn(float(acc)));
    }
  }
  const double* token_x(int64_t source, int64_t t) const { return &x_[(source * T_ + t) * s_.hidden]; }

  // Rank r's context as a resident forward leaves it: grouped rows of x, g, u (padding zero)
  // from every source, slot_of_row = source * T*k + token*k + j, and its shared expert's g, u.
  void make_context(int r) {
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, k = s_.top_k, R = rows(r);
    const core::ReceiveSchedule& sc = schedule_[r];
    const int64_t first_expert = r * (s_.num_experts / world_);
    std::vector<double> cx(R * H, 0.0), cg(R * I, 0.0), cu(R * I, 0.0), sg(T_ * Is), su(T_ * Is);
    std::vector<int32_t> slot_of_row(size_t(R), -1);
    for (int64_t row = 0; row < R; ++row) {
      if (sc.row_source[row] < 0) continue;
      const int64_t source = sc.row_source[row], slot = sc.row_slot[row], t = slot / k;
      const int64_t e = first_expert + sc.expert_of_row(row);
      slot_of_row[row] = int32_t(source * T_ * k + slot);
      std::copy_n(token_x(source, t), H, &cx[row * H]);
      project(token_x(source, t), w_gate_, e, I, &cg[row * I]);
      project(token_x(source, t), w_up_, e, I, &cu[row * I]);
    }
    for (int64_t t = 0; t < T_; ++t) {
      project(token_x(r, t), ws_gate_, 0, Is, &sg[t * Is]);
      project(token_x(r, t), ws_up_, 0, Is, &su[t * Is]);
    }
    ctx_g_.push_back(cg);
    ctx_u_.push_back(cu);
    sg_.push_back(sg);
    su_.push_back(su);
    RankDevice& d = ranks_[r];
    d.offsets = on_device(std::vector<int32_t>(sc.expert_offset.begin(), sc.expert_offset.end()));
    d.slot_of_row = on_device(slot_of_row);
    d.x = on_device(bf16_of(std::vector<double>(token_x(r, 0), token_x(r, 0) + T_ * H)));
    d.d_out = on_device(bf16_of(std::vector<double>(d_out_.begin() + r * T_ * H, d_out_.begin() + (r + 1) * T_ * H)));
    d.weights =
        on_device(std::vector<float>(route_weight_.begin() + r * T_ * k, route_weight_.begin() + (r + 1) * T_ * k));
    d.ctx_x = on_device(bf16_of(cx));
    d.ctx_g = on_device(bf16_of(cg));
    d.ctx_u = on_device(bf16_of(cu));
    d.sg = on_device(bf16_of(sg));
    d.su = on_device(bf16_of(su));
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

  // Each receiving rank's rows (its local experts' weight gradients), each row's d_x and
  // d_topk_weights into its source rank's, and each rank's shared expert over its tokens.
  void make_reference() {
    const int64_t H = s_.hidden, I = s_.intermediate, Is = s_.shared_intermediate, k = s_.top_k;
    const int64_t El = s_.num_experts / world_;
    ref_.assign(size_t(world_), Reference{});
    for (Reference& r : ref_) {
      r.d_x.assign(T_ * H, 0.0);
      r.d_topk_weights.assign(T_ * k, 0.0);
      r.d_w_gate.assign(El * I * H, 0.0);
      r.d_w_up.assign(El * I * H, 0.0);
      r.d_w_down.assign(El * H * I, 0.0);
      r.d_ws_gate.assign(Is * H, 0.0);
      r.d_ws_up.assign(Is * H, 0.0);
      r.d_ws_down.assign(H * Is, 0.0);
    }
    // The local experts' weights of rank r, so row_backward indexes them by local expert.
    const auto local = [&](const std::vector<double>& w, int r) {
      return std::vector<double>(w.begin() + r * El * I * H, w.begin() + (r + 1) * El * I * H);
    };
    for (int r = 0; r < world_; ++r) {
      const core::ReceiveSchedule& sc = schedule_[r];
      const std::vector<double> wg = local(w_gate_, r), wu = local(w_up_, r), wd = local(w_down_, r);
      Reference& dst = ref_[r];
      for (int64_t row = 0; row < rows(r); ++row) {
        if (sc.row_source[row] < 0) continue;
        const int64_t source = sc.row_source[row], slot = sc.row_slot[row], t = slot / k, e = sc.expert_of_row(row);
        Reference& origin = ref_[source];
        origin.d_topk_weights[slot] =
            row_backward(e, I, token_x(source, t), &d_out_[(source * T_ + t) * H], &ctx_g_[r][row * I],
                         &ctx_u_[r][row * I], route_weight_[source * T_ * k + slot], wg, wu, wd, &origin.d_x[t * H],
                         dst.d_w_gate.data(), dst.d_w_up.data(), dst.d_w_down.data());
      }
    }
    for (int r = 0; r < world_; ++r)
      for (int64_t t = 0; t < T_; ++t)
        row_backward(0, Is, token_x(r, t), &d_out_[(r * T_ + t) * H], &sg_[r][t * Is], &su_[r][t * Is], 1.0, ws_gate_,
                     ws_up_, ws_down_, &ref_[r].d_x[t * H], ref_[r].d_ws_gate.data(), ref_[r].d_ws_up.data(),
                     ref_[r].d_ws_down.data());
  }

  MoeShape s_;
  int world_;
  int64_t T_;
  std::mt19937_64 rng_;
  std::vector<int32_t> ids_;
  std::vector<core::ReceiveSchedule> schedule_;
  // Every rank's tokens, back to back: [world][T][H] (route weights [world][T][k]).
  std::vector<double> x_, d_out_, w_gate_, w_up_, w_down_, ws_gate_, ws_up_, ws_down_;
  std::vector<float> route_weight_;
  std::vector<std::vector<double>> ctx_g_, ctx_u_, sg_, su_;  // per rank
  std::vector<Reference> ref_;
  std::vector<RankDevice> ranks_;
  DeviceArray<bf16> wg_dev_, wu_dev_, wd_dev_, wsg_dev_, wsu_dev_, wsd_dev_;
};

MegakernelConfig config(int comm, int64_t minibatch, int64_t macrobatch,
                        double timeout = fixtures::test_spin_timeout()) {
  MegakernelConfig c;
  c.num_comm_sms = comm;
  c.minibatch_size = minibatch;
  c.macrobatch_size = macrobatch;
  c.capacity_multiplier = 1;
  c.spin_timeout_seconds = timeout;  // a hang fails fast
  return c;
}

}  // namespace
}  // namespace moka::cuda
