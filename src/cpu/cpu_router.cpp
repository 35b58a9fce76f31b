// The CPU reference router: logits, scores, biased top-k selection, weights, losses, backward.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/validate.hpp"
#include "cpu/cpu_layer.hpp"
#include "cpu/expert_math.hpp"
#include "cpu/parallel.hpp"

namespace moka::cpu {
namespace {

template <typename T>
struct RouterState final : RouterContext {
  int64_t tokens = 0;
  const T* x = nullptr;
  const T* w_router = nullptr;
  std::vector<T> logits, scores;  // [T, E]
  std::vector<int32_t> selected;  // [T, k]
  std::vector<double> fraction;   // f_e: share of routes per expert
  RouterLosses loss_values;
  bool wrote_logits = false, wrote_probs = false, wrote_losses = false;  // RouterAuxOutputs written
  RouterLosses losses() const override { return loss_values; }
};

template <typename T>
class CpuRouter {
 public:
  CpuRouter(const RouterConfig& c, int threads) : c_(c), threads_(threads) {}

  std::unique_ptr<RouterContext> forward(const TensorView& x, const TensorView& w_router, const TensorView& bias,
                                         const RouterOutputs& out) const {
    const DType dt = std::is_same_v<T, double> ? DType::f64 : DType::f32;
    require(x.rank == 2, ErrorCode::shape_mismatch, "router x must be [T, H], got " + x.shape_string());
    const int64_t T_ = x.dim(0), H = c_.hidden, E = c_.num_experts, k = c_.top_k;
    expect_tensor(x, "x", dt, Device::cpu(), {T_, H});
    expect_tensor(w_router, "w_router", dt, Device::cpu(), {E, H});
    if (c_.use_selection_bias) expect_tensor(bias, "selection_bias", dt, Device::cpu(), {E});
    expect_tensor(out.topk_ids, "topk_ids", DType::i32, Device::cpu(), {T_, k});
    expect_tensor(out.topk_weights, "topk_weights", core::router_weight_dtype(dt), Device::cpu(), {T_, k});
    if (!out.expert_counts.empty())
      expect_tensor(out.expert_counts, "expert_counts", out.expert_counts.dtype == DType::i64 ? DType::i64 : DType::i32,
                    Device::cpu(), {E});
    if (!out.expert_load.empty()) expect_tensor(out.expert_load, "expert_load", DType::i64, Device::cpu(), {E});

    auto st = std::make_unique<RouterState<T>>();
    st->tokens = T_;
    st->x = x.as<T>();
    st->w_router = w_router.as<T>();
    st->logits.resize(T_ * E);
    st->scores.resize(T_ * E);
    st->selected.resize(T_ * k);
    const T* b = c_.use_selection_bias ? bias.as<T>() : nullptr;
    T* weights = out.topk_weights.as<T>();
    parallel_for(T_, threads_, [&](int64_t lo, int64_t hi) {
      std::vector<int32_t> order(E);
      for (int64_t t = lo; t < hi; ++t) {
        T* lg = &st->logits[t * E];
        T* sc = &st->scores[t * E];
        for (int64_t e = 0; e < E; ++e) lg[e] = dot(st->w_router + e * H, st->x + t * H, H);
        scores_of(lg, sc, E);
        // Top-k by score + bias, ties to the lower expert id: deterministic.
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t bb) {
          const T ka = sc[a] + (b ? b[a] : T(0)), kb = sc[bb] + (b ? b[bb] : T(0));
          return ka != kb ? ka > kb : a < bb;
        });
        T sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += sc[order[j]];
        for (int64_t j = 0; j < k; ++j) {
          st->selected[t * k + j] = order[j];
          const T s = sc[order[j]];
          weights[t * k + j] = static_cast<T>(c_.route_scale) * (c_.renormalize ? s / sum : s);
        }
      }
    });
    require(std::all_of(st->logits.begin(), st->logits.end(), [](T v) { return std::isfinite(v); }),
            ErrorCode::non_finite, "router logits are not finite (check x and w_router)");
    std::copy(st->selected.begin(), st->selected.end(), out.topk_ids.as<int32_t>());

    std::vector<int64_t> counts(E, 0);
    for (int32_t e : st->selected) ++counts[e];
    for (int64_t e = 0; e < E && !out.expert_counts.empty(); ++e) {
      if (out.expert_counts.dtype == DType::i64) out.expert_counts.as<int64_t>()[e] = counts[e];
      else out.expert_counts.as<int32_t>()[e] = static_cast<int32_t>(counts[e]);
    }
    if (!out.expert_load.empty())
      for (int64_t e = 0; e < E; ++e) out.expert_load.as<int64_t>()[e] += counts[e];
    st->fraction.resize(E);
    for (int64_t e = 0; e < E; ++e) st->fraction[e] = T_ > 0 ? double(counts[e]) / double(T_ * k) : 0.0;
    const RouterLosses raw = raw_losses(*st, c_.aux_loss_coef != 0 || !out.aux.losses.empty(),
                                        c_.z_loss_coef != 0 || !out.aux.losses.empty());
    st->loss_values = {c_.aux_loss_coef * raw.aux_loss, c_.z_loss_coef * raw.z_loss};
    write_aux(*st, out.aux, raw, dt);
    return st;
  }

  void backward(const RouterContext& saved, const TensorView& d_weights, const TensorView& d_x,
                const TensorView& d_w_router, bool add_to_d_x, const RouterAuxGradients& aux) const {
    const auto* stp = dynamic_cast<const RouterState<T>*>(&saved);
    require(stp != nullptr, ErrorCode::invalid_argument, "router backward got a context of another dtype");
    const auto& st = *stp;
    const DType dt = std::is_same_v<T, double> ? DType::f64 : DType::f32;
    const int64_t T_ = st.tokens, H = c_.hidden, E = c_.num_experts, k = c_.top_k;
    expect_tensor(d_weights, "d_topk_weights", core::router_weight_dtype(dt), Device::cpu(), {T_, k});
    expect_tensor(d_x, "d_x", dt, Device::cpu(), {T_, H});
    expect_tensor(d_w_router, "d_w_router", dt, Device::cpu(), {E, H});
    const T* dw = d_weights.as<T>();
    const AuxGradients g = aux_gradients(st, aux, dt);

    std::vector<T> d_logits(T_ * E);
    parallel_for(T_, threads_, [&](int64_t lo, int64_t hi) {
      std::vector<T> ds(E);
      for (int64_t t = lo; t < hi; ++t) {
        const T* sc = &st.scores[t * E];
        const T* lg = &st.logits[t * E];
        T* dl = &d_logits[t * E];
        std::fill(ds.begin(), ds.end(), T(0));
        selection_backward(sc, &st.selected[t * k], dw + t * k, ds.data());
        probs_backward(sc, st, g.balance, g.d_probs ? g.d_probs + t * E : nullptr, ds.data(), T_);
        scores_backward(lg, sc, ds.data(), dl, E);
        z_loss_backward(lg, g.z, dl, E, T_);
        if (g.d_logits)
          for (int64_t e = 0; e < E; ++e) dl[e] += g.d_logits[t * E + e];
      }
    });
    // d_x (+)= d_logits @ W_router, each row summed from zero first so that adding equals a
    // separate sum of the two parts; d_W_router = d_logits^T x (tokens in order).
    T* dx = d_x.as<T>();
    parallel_for(T_, threads_, [&](int64_t lo, int64_t hi) {
      std::vector<T> row(H);
      for (int64_t t = lo; t < hi; ++t) {
        std::fill(row.begin(), row.end(), T(0));
        for (int64_t e = 0; e < E; ++e) {
          const T d = d_logits[t * E + e];
          for (int64_t c = 0; c < H; ++c) row[c] += d * st.w_router[e * H + c];
        }
        for (int64_t c = 0; c < H; ++c) dx[t * H + c] = add_to_d_x ? dx[t * H + c] + row[c] : row[c];
      }
    });
    T* dwr = d_w_router.as<T>();
    parallel_for(E, threads_, [&](int64_t lo, int64_t hi) {
      for (int64_t e = lo; e < hi; ++e) {
        for (int64_t c = 0; c < H; ++c) dwr[e * H + c] = 0;
        for (int64_t t = 0; t < T_; ++t) {
          const T d = d_logits[t * E + e];
          for (int64_t c = 0; c < H; ++c) dwr[e * H + c] += d * st.x[t * H + c];
        }
      }
    });
  }

 private:
  void scores_of(const T* lg, T* sc, int64_t E) const {
    if (c_.score == ScoreFunction::sigmoid) {
      for (int64_t e = 0; e < E; ++e) sc[e] = core::sigmoid(lg[e]);
      return;
    }
    const T mx = *std::max_element(lg, lg + E);
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (sc[e] = std::exp(lg[e] - mx));
    for (int64_t e = 0; e < E; ++e) sc[e] /= sum;
  }

  // Probabilities the balancing loss uses: softmax scores, or sigmoid scores normalized per token.
  static void normalized(const T* sc, T* p, int64_t E) {
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += sc[e];
    for (int64_t e = 0; e < E; ++e) p[e] = sc[e] / sum;
  }

  static T logsumexp(const T* lg, int64_t E) {
    const T mx = *std::max_element(lg, lg + E);
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(lg[e] - mx);
    return mx + std::log(sum);
  }

  // The two losses without their coefficients, each only where asked for (else 0).
  RouterLosses raw_losses(const RouterState<T>& st, bool balance, bool z) const {
    RouterLosses l;
    const int64_t T_ = st.tokens, E = c_.num_experts;
    if (T_ == 0) return l;
    if (balance) {
      std::vector<double> P(E, 0.0);
      std::vector<T> p(E);
      for (int64_t t = 0; t < T_; ++t) {
        normalized(&st.scores[t * E], p.data(), E);
        for (int64_t e = 0; e < E; ++e) P[e] += double(p[e]) / double(T_);
      }
      double s = 0;
      for (int64_t e = 0; e < E; ++e) s += st.fraction[e] * P[e];
      l.aux_loss = double(E) * s;
    }
    if (z) {
      double sum = 0;
      for (int64_t t = 0; t < T_; ++t) {
        const double v = double(logsumexp(&st.logits[t * E], E));
        sum += v * v;
      }
      l.z_loss = sum / double(T_);
    }
    return l;
  }

  // The RouterAuxOutputs the caller asked for, checked and written; the state remembers which.
  void write_aux(RouterState<T>& st, const RouterAuxOutputs& aux, const RouterLosses& raw, DType dt) const {
    const int64_t T_ = st.tokens, E = c_.num_experts;
    if (!aux.router_logits.empty()) {
      expect_tensor(aux.router_logits, "router_logits", dt, Device::cpu(), {T_, E});
      std::copy(st.logits.begin(), st.logits.end(), aux.router_logits.as<T>());
      st.wrote_logits = true;
    }
    if (!aux.router_probs.empty()) {
      expect_tensor(aux.router_probs, "router_probs", dt, Device::cpu(), {T_, E});
      for (int64_t t = 0; t < T_; ++t) normalized(&st.scores[t * E], aux.router_probs.as<T>() + t * E, E);
      st.wrote_probs = true;
    }
    if (!aux.losses.empty()) {
      expect_tensor(aux.losses, "losses", dt, Device::cpu(), {2});
      aux.losses.as<T>()[0] = static_cast<T>(raw.aux_loss);
      aux.losses.as<T>()[1] = static_cast<T>(raw.z_loss);
      st.wrote_losses = true;
    }
  }

  // The gradients backward applies: the losses' coefficients plus the caller's gradients of the
  // returned losses, and the caller's gradients of the returned logits and probabilities.
  struct AuxGradients {
    double balance = 0, z = 0;
    const T* d_probs = nullptr;
    const T* d_logits = nullptr;
  };
  AuxGradients aux_gradients(const RouterState<T>& st, const RouterAuxGradients& aux, DType dt) const {
    const int64_t T_ = st.tokens, E = c_.num_experts;
    AuxGradients g{c_.aux_loss_coef, c_.z_loss_coef};
    auto given = [&](const TensorView& t, bool wrote, const char* name, std::initializer_list<int64_t> shape) {
      if (t.empty()) return false;
      require(wrote, ErrorCode::invalid_argument,
              std::string("router backward got ") + name + " for an output its forward did not write");
      expect_tensor(t, name, dt, Device::cpu(), shape);
      return true;
    };
    if (given(aux.d_losses, st.wrote_losses, "d_losses", {2})) {
      g.balance += double(aux.d_losses.as<T>()[0]);
      g.z += double(aux.d_losses.as<T>()[1]);
    }
    if (given(aux.d_router_probs, st.wrote_probs, "d_router_probs", {T_, E})) g.d_probs = aux.d_router_probs.as<T>();
    if (given(aux.d_router_logits, st.wrote_logits, "d_router_logits", {T_, E}))
      g.d_logits = aux.d_router_logits.as<T>();
    return g;
  }

  // d scores from d weights through renormalization and route scale.
  void selection_backward(const T* sc, const int32_t* sel, const T* dw, T* ds) const {
    const int64_t k = c_.top_k;
    const T scale = static_cast<T>(c_.route_scale);
    if (!c_.renormalize) {
      for (int64_t j = 0; j < k; ++j) ds[sel[j]] += scale * dw[j];
      return;
    }
    T S = 0, dot_ws = 0;
    for (int64_t j = 0; j < k; ++j) {
      S += sc[sel[j]];
      dot_ws += dw[j] * sc[sel[j]];
    }
    for (int64_t j = 0; j < k; ++j) ds[sel[j]] += scale * (dw[j] / S - dot_ws / (S * S));
  }

  // d scores from the probabilities p = s / sum(s): the balancing loss's (coefficient `balance`;
  // it treats the route fractions f_e as constants: they are counts) plus the caller's d_probs.
  void probs_backward(const T* sc, const RouterState<T>& st, double balance, const T* d_probs, T* ds,
                      int64_t T_) const {
    if (balance == 0 && !d_probs) return;
    const int64_t E = c_.num_experts;
    std::vector<T> dp(E), p(E);
    for (int64_t e = 0; e < E; ++e)
      dp[e] = static_cast<T>(balance * double(E) * st.fraction[e] / double(T_)) + (d_probs ? d_probs[e] : T(0));
    normalized(sc, p.data(), E);
    T sum = 0, dpp = 0;
    for (int64_t e = 0; e < E; ++e) {
      sum += sc[e];
      dpp += dp[e] * p[e];
    }
    for (int64_t e = 0; e < E; ++e) ds[e] += (dp[e] - dpp) / sum;
  }

  void scores_backward(const T* lg, const T* sc, const T* ds, T* dl, int64_t E) const {
    (void)lg;
    if (c_.score == ScoreFunction::sigmoid) {
      for (int64_t e = 0; e < E; ++e) dl[e] = ds[e] * sc[e] * (T(1) - sc[e]);
      return;
    }
    T dot_sp = 0;
    for (int64_t e = 0; e < E; ++e) dot_sp += ds[e] * sc[e];
    for (int64_t e = 0; e < E; ++e) dl[e] = sc[e] * (ds[e] - dot_sp);
  }

  void z_loss_backward(const T* lg, double z, T* dl, int64_t E, int64_t T_) const {
    if (z == 0) return;
    const T lse = logsumexp(lg, E);
    const T coef = static_cast<T>(2.0 * z / double(T_)) * lse;
    for (int64_t e = 0; e < E; ++e) dl[e] += coef * std::exp(lg[e] - lse);
  }

  RouterConfig c_;
  int threads_;
};

class CpuRouterByDtype final : public Router {
 public:
  CpuRouterByDtype(const RouterConfig& c, int threads) : config_(c), f32_(c, threads), f64_(c, threads) {
    require(c.hidden > 0 && c.num_experts > 0 && c.top_k > 0, ErrorCode::invalid_argument,
            "router hidden, num_experts and top_k must be positive");
    require(c.top_k <= c.num_experts, ErrorCode::invalid_argument, "router top_k exceeds num_experts");
    require(std::isfinite(c.route_scale), ErrorCode::invalid_argument, "route_scale must be finite");
  }
  const RouterConfig& config() const override { return config_; }
  std::unique_ptr<RouterContext> forward(const TensorView& x, const TensorView& w, const TensorView& bias,
                                         const RouterOutputs& out, Stream) override {
    if (x.dtype == DType::f64) return f64_.forward(x, w, bias, out);
    require(x.dtype == DType::f32, ErrorCode::invalid_argument, "the CPU router computes in f32 or f64");
    return f32_.forward(x, w, bias, out);
  }
  void backward(const RouterContext& saved, const TensorView& dw, const TensorView& dx, const TensorView& dwr, Stream,
                bool add_to_d_x, const RouterAuxGradients& aux) override {
    if (dx.dtype == DType::f64) return f64_.backward(saved, dw, dx, dwr, add_to_d_x, aux);
    f32_.backward(saved, dw, dx, dwr, add_to_d_x, aux);
  }

 private:
  RouterConfig config_;
  CpuRouter<float> f32_;
  CpuRouter<double> f64_;
};

}  // namespace

std::unique_ptr<Router> make_cpu_router(const RouterConfig& config, const LayerOptions& options) {
  return std::make_unique<CpuRouterByDtype>(config, resolve_threads(options.num_threads, 1));
}

}  // namespace moka::cpu
