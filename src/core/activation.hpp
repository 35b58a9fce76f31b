// The expert activation, forward and backward, for one element; shared by every backend.
#pragma once
#include <cmath>

#include "core/hd.hpp"
#include "moka/config.hpp"

namespace moka::core {

inline constexpr float kClampedSwigluAlpha = 1.702f;  // GPT-OSS

// The activation's parameters as the CUDA kernels take them (from MoeShape::activation and
// clamp_limit).
struct ActParams {
  bool clamped = false;
  float limit = 7.0f;
  static ActParams of(const MoeShape& s) { return {s.activation == Activation::swiglu_clamped, s.clamp_limit}; }
};

template <typename T>
MOKA_HD T sigmoid(T v) {
  return T(1) / (T(1) + exp(-v));
}

// The sigmoid that act(g, u) and its gradient share: of g, or of alpha * min(g, limit) when
// `clamped` (the GPT-OSS form). The _given forms below take it, so that a caller needing both
// directions (the backward megakernel's dgd epilogue) evaluates it once, with the same bits.
template <typename T>
MOKA_HD T swiglu_sigmoid(T g, bool clamped, T limit) {
  if (!clamped) return sigmoid(g);
  return sigmoid(T(kClampedSwigluAlpha) * (g < limit ? g : limit));
}

// act(g, u) = silu(g) * u, or the clamped GPT-OSS form when `clamped`; s = swiglu_sigmoid(g).
template <typename T>
MOKA_HD T swiglu_forward_given(T g, T u, T s, bool clamped, T limit) {
  if (!clamped) return g * s * u;
  const T gc = g < limit ? g : limit;
  const T uc = u < -limit ? -limit : (u > limit ? limit : u);
  return gc * s * (uc + T(1));
}

// The one-direction forms branch once on `clamped` and inline each side with a constant flag:
// the code of two separate formulas, which the compiler keeps as tight as a single one.
template <typename T>
MOKA_HD T swiglu_forward(T g, T u, bool clamped, T limit) {
  if (!clamped) return swiglu_forward_given(g, u, swiglu_sigmoid(g, false, limit), false, limit);
  return swiglu_forward_given(g, u, swiglu_sigmoid(g, true, limit), true, limit);
}

// Given d_act = dL/d act(g, u), writes dL/dg and dL/du (s = swiglu_sigmoid(g)). The clamp
// passes no gradient where it clamps (the derivative of min/max there).
template <typename T>
MOKA_HD void swiglu_backward_given(T g, T u, T s, T d_act, bool clamped, T limit, T& d_g, T& d_u) {
  if (!clamped) {
    d_u = d_act * g * s;
    d_g = d_act * u * s * (T(1) + g * (T(1) - s));
    return;
  }
  const bool g_clamped = !(g < limit);
  const bool u_clamped = u < -limit || u > limit;
  const T gc = g_clamped ? limit : g;
  const T uc = u < -limit ? -limit : (u > limit ? limit : u);
  const T alpha = T(kClampedSwigluAlpha);
  const T glu = gc * s;
  d_u = u_clamped ? T(0) : d_act * glu;
  d_g = g_clamped ? T(0) : d_act * (uc + T(1)) * s * (T(1) + alpha * gc * (T(1) - s));
}

template <typename T>
MOKA_HD void swiglu_backward(T g, T u, T d_act, bool clamped, T limit, T& d_g, T& d_u) {
  if (!clamped) return swiglu_backward_given(g, u, swiglu_sigmoid(g, false, limit), d_act, false, limit, d_g, d_u);
  swiglu_backward_given(g, u, swiglu_sigmoid(g, true, limit), d_act, true, limit, d_g, d_u);
}

}  // namespace moka::core
