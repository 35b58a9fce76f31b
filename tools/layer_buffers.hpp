// Owning host buffers for one rank's layer tensors, with the views the API takes, and the error
// measures that check a result against a reference: what `moka bench` builds its CPU cases and
// reference results with, and what the tests and the GPU checks build theirs with.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "moka/layer.hpp"

namespace moka::cli {

// max_i |a_i - ref_i| / max_i |ref_i|; NaN anywhere in `a` gives +inf so it can never pass.
template <typename A, typename R>
double max_rel_error(const A* a, const R* ref, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double av = static_cast<double>(a[i]), rv = static_cast<double>(ref[i]);
    if (!std::isfinite(av)) return std::numeric_limits<double>::infinity();
    diff = std::max(diff, std::abs(av - rv));
    scale = std::max(scale, std::abs(rv));
  }
  return scale > 0 ? diff / scale : diff;
}

template <typename A, typename R>
double max_rel_error(const std::vector<A>& a, const std::vector<R>& ref) {
  return max_rel_error(a.data(), ref.data(), static_cast<int64_t>(std::min(a.size(), ref.size())));
}

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::f64 : DType::f32;
}

template <typename T>
struct LayerBuffers {
  MoeShape shape;
  int world_size = 1;
  int64_t tokens = 0;
  std::vector<T> x, out, d_out, topk_weights, d_x, d_topk_weights;
  std::vector<int32_t> topk_ids;
  std::vector<T> w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
  std::vector<T> d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down;

  LayerBuffers(const MoeShape& s, int world, int64_t T_) : shape(s), world_size(world), tokens(T_) {
    const int64_t H = s.hidden, I = s.intermediate, k = s.top_k, El = s.num_experts / world;
    const int64_t Is = s.shared_intermediate;
    x.resize(T_ * H);
    out.resize(T_ * H);
    d_out.resize(T_ * H);
    d_x.resize(T_ * H);
    topk_ids.resize(T_ * k);
    topk_weights.resize(T_ * k);
    d_topk_weights.resize(T_ * k);
    for (auto* v : {&w_gate, &w_up, &d_w_gate, &d_w_up}) v->resize(El * I * H);
    for (auto* v : {&w_down, &d_w_down}) v->resize(El * H * I);
    for (auto* v : {&ws_gate, &ws_up, &ws_down, &d_ws_gate, &d_ws_up, &d_ws_down}) v->resize(Is * H);
  }

  // Random x, d_out (N(0,1)), weights N(0, 1/fan_in), router weights U(0.1, 1).
  void randomize(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> n01(0.0, 1.0);
    auto fill = [&](std::vector<T>& v, double std) {
      for (auto& e : v) e = static_cast<T>(n01(rng) * std);
    };
    fill(x, 1.0);
    fill(d_out, 1.0);
    const double H = double(shape.hidden), I = double(shape.intermediate);
    fill(w_gate, 1 / std::sqrt(H));
    fill(w_up, 1 / std::sqrt(H));
    fill(w_down, 1 / std::sqrt(I));
    if (shape.has_shared()) {
      fill(ws_gate, 1 / std::sqrt(H));
      fill(ws_up, 1 / std::sqrt(H));
      fill(ws_down, 1 / std::sqrt(double(shape.shared_intermediate)));
    }
    std::uniform_real_distribution<double> uw(0.1, 1.0);
    for (auto& w : topk_weights) w = static_cast<T>(uw(rng));
  }

  // Every output poisoned with NaN, so a value the layer forgot to write fails any check.
  void poison_outputs() {
    for (auto* v : outputs()) std::fill(v->begin(), v->end(), std::numeric_limits<T>::quiet_NaN());
  }

  // Floating-point inputs and weights, and every output, in a fixed order (for copies and checks).
  std::array<std::vector<T>*, 9> inputs_and_weights() {
    return {&x, &d_out, &topk_weights, &w_gate, &w_up, &w_down, &ws_gate, &ws_up, &ws_down};
  }
  std::array<const std::vector<T>*, 9> inputs_and_weights() const {
    return {&x, &d_out, &topk_weights, &w_gate, &w_up, &w_down, &ws_gate, &ws_up, &ws_down};
  }
  std::array<std::vector<T>*, 9> outputs() {
    return {&out, &d_x, &d_topk_weights, &d_w_gate, &d_w_up, &d_w_down, &d_ws_gate, &d_ws_up, &d_ws_down};
  }
  std::array<const std::vector<T>*, 9> outputs() const {
    return {&out, &d_x, &d_topk_weights, &d_w_gate, &d_w_up, &d_w_down, &d_ws_gate, &d_ws_up, &d_ws_down};
  }

  MoeInputs inputs() {
    const int64_t H = shape.hidden, k = shape.top_k;
    return {view(x, {tokens, H}), TensorView(topk_ids.data(), DType::i32, {tokens, k}),
            view(topk_weights, {tokens, k})};
  }
  MoeWeights weights() {
    const int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_experts / world_size;
    const int64_t Is = shape.shared_intermediate;
    MoeWeights w{view(w_gate, {El, I, H}), view(w_up, {El, I, H}), view(w_down, {El, H, I}), {}, {}, {}};
    if (shape.has_shared()) {
      w.ws_gate = view(ws_gate, {Is, H});
      w.ws_up = view(ws_up, {Is, H});
      w.ws_down = view(ws_down, {H, Is});
    }
    return w;
  }
  MoeGradients gradients() {
    const int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_experts / world_size, k = shape.top_k;
    const int64_t Is = shape.shared_intermediate;
    MoeGradients g{view(d_x, {tokens, H}),
                   view(d_topk_weights, {tokens, k}),
                   view(d_w_gate, {El, I, H}),
                   view(d_w_up, {El, I, H}),
                   view(d_w_down, {El, H, I}),
                   {},
                   {},
                   {}};
    if (shape.has_shared()) {
      g.d_ws_gate = view(d_ws_gate, {Is, H});
      g.d_ws_up = view(d_ws_up, {Is, H});
      g.d_ws_down = view(d_ws_down, {H, Is});
    }
    return g;
  }
  TensorView out_view() { return view(out, {tokens, shape.hidden}); }
  TensorView d_out_view() { return view(d_out, {tokens, shape.hidden}); }

  static TensorView view(std::vector<T>& v, std::initializer_list<int64_t> dims) {
    return TensorView(v.data(), dtype_of<T>(), dims);
  }
};

// The same tensors in another precision (inputs and weights; outputs are left to compute).
template <typename To, typename From>
LayerBuffers<To> convert_buffers(const LayerBuffers<From>& src) {
  LayerBuffers<To> dst(src.shape, src.world_size, src.tokens);
  const auto from = src.inputs_and_weights();
  auto to = dst.inputs_and_weights();
  for (size_t i = 0; i < to.size(); ++i) to[i]->assign(from[i]->begin(), from[i]->end());
  dst.topk_ids = src.topk_ids;
  return dst;
}

// Largest relative error over every output of a layer's forward and backward.
template <typename A, typename R>
double max_layer_error(const LayerBuffers<A>& a, const LayerBuffers<R>& ref) {
  double e = 0;
  const auto got = a.outputs();
  const auto want = ref.outputs();
  for (size_t i = 0; i < got.size(); ++i)
    if (!want[i]->empty()) e = std::max(e, max_rel_error(*got[i], *want[i]));
  return e;
}

}  // namespace moka::cli
