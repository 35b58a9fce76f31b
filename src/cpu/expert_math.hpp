// Row-level math of one SwiGLU expert, the CPU reference of every GPU stage. Each function
// computes whole output rows in a fixed summation order, so results do not depend on threads.
#pragma once
#include <cstdint>
#include <vector>

#include "core/activation.hpp"
#include "cpu/fp8_gemm.hpp"
#include "moka/config.hpp"
#include "moka/layer.hpp"

namespace moka::cpu {

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// One expert's weights: gate/up [I, H], down [H, I], and the four matrix products its rows take
// (the layer's GEMMs, one row at a time), in T with sequential sums.
template <typename T>
struct ExpertWeights {
  const T* gate;
  const T* up;
  const T* down;
  int64_t hidden, intermediate;

  // g = W_gate x, u = W_up x.
  void gate_up_gemm(const T* x, T* g, T* u) const {
    for (int64_t i = 0; i < intermediate; ++i) {
      g[i] = dot(gate + i * hidden, x, hidden);
      u[i] = dot(up + i * hidden, x, hidden);
    }
  }
  // y = W_down h.
  void down_gemm(const T* h, T* y) const {
    for (int64_t o = 0; o < hidden; ++o) y[o] = dot(down + o * intermediate, h, intermediate);
  }
  // dh = W_down^T d.
  void down_dgrad(const T* d, T* dh) const {
    for (int64_t i = 0; i < intermediate; ++i) dh[i] = 0;
    for (int64_t o = 0; o < hidden; ++o) {
      const T* row = down + o * intermediate;
      for (int64_t i = 0; i < intermediate; ++i) dh[i] += row[i] * d[o];
    }
  }
  // dx = W_gate^T dg + W_up^T du.
  void gate_up_dgrad(const T* dg, const T* du, T* dx) const {
    for (int64_t c = 0; c < hidden; ++c) dx[c] = 0;
    for (int64_t i = 0; i < intermediate; ++i) {
      const T* wg = gate + i * hidden;
      const T* wu = up + i * hidden;
      for (int64_t c = 0; c < hidden; ++c) dx[c] += wg[c] * dg[i] + wu[c] * du[i];
    }
  }
};

// The same expert under the FP8 recipe (docs/FP8.md): its weights quantized in 128x128 blocks in
// both orientations (gate, up, down for the forward; their transposes for the dgrad), and the
// same four products as FP8 GEMMs, each input row quantized 1x128 along K (x and d_out along H,
// h, dG and dU along I) and each output converted from the fp32 accumulator to T.
struct Fp8Expert {
  Fp8Matrix gate, up, down, gate_t, up_t, down_t;
  int64_t hidden = 0, intermediate = 0;

  template <typename T>
  static Fp8Expert of(const ExpertWeights<T>& w) {
    const int64_t H = w.hidden, I = w.intermediate, B = core::kFp8BlockRows;
    return {Fp8Matrix::quantize(w.gate, I, H, B),
            Fp8Matrix::quantize(w.up, I, H, B),
            Fp8Matrix::quantize(w.down, H, I, B),
            Fp8Matrix::quantize_transposed(w.gate, I, H, B),
            Fp8Matrix::quantize_transposed(w.up, I, H, B),
            Fp8Matrix::quantize_transposed(w.down, H, I, B),
            H,
            I};
  }

  template <typename T>
  void gate_up_gemm(const T* x, T* g, T* u) const {
    const auto xq = quantize_row(x, hidden);
    for (int64_t i = 0; i < intermediate; ++i) {
      g[i] = static_cast<T>(fp8_promoted_dot(xq, 0, gate, i));
      u[i] = static_cast<T>(fp8_promoted_dot(xq, 0, up, i));
    }
  }
  template <typename T>
  void down_gemm(const T* h, T* y) const {
    const auto hq = quantize_row(h, intermediate);
    for (int64_t o = 0; o < hidden; ++o) y[o] = static_cast<T>(fp8_promoted_dot(hq, 0, down, o));
  }
  template <typename T>
  void down_dgrad(const T* d, T* dh) const {
    const auto dq = quantize_row(d, hidden);
    for (int64_t i = 0; i < intermediate; ++i) dh[i] = static_cast<T>(fp8_promoted_dot(dq, 0, down_t, i));
  }
  // One GEMM over K = 2I: dG's blocks, then dU's, into one fp32 accumulator.
  template <typename T>
  void gate_up_dgrad(const T* dg, const T* du, T* dx) const {
    const auto dgq = quantize_row(dg, intermediate), duq = quantize_row(du, intermediate);
    for (int64_t c = 0; c < hidden; ++c)
      dx[c] = static_cast<T>(fp8_promoted_dot(duq, 0, up_t, c, fp8_promoted_dot(dgq, 0, gate_t, c)));
  }

 private:
  template <typename T>
  static Fp8Matrix quantize_row(const T* row, int64_t k) {
    return Fp8Matrix::quantize(row, 1, k, core::kFp8RowTileRows);
  }
};

// Local expert e's weights out of the layer's [E_local, ...] weight tensors.
template <typename T>
ExpertWeights<T> routed_expert(const MoeWeights& w, const MoeShape& s, int64_t e) {
  const int64_t H = s.hidden, I = s.intermediate;
  return {w.w_gate.as<T>() + e * I * H, w.w_up.as<T>() + e * I * H, w.w_down.as<T>() + e * H * I, H, I};
}

template <typename T>
ExpertWeights<T> shared_expert(const MoeWeights& w, const MoeShape& s) {
  return {w.ws_gate.as<T>(), w.ws_up.as<T>(), w.ws_down.as<T>(), s.hidden, s.shared_intermediate};
}

// Column slices for tiled callers: gate_up_row on gate_up_columns(w, c0, c1) computes
// g/u/h[c0, c1) (pass outputs offset by c0); down_row on down_columns(w, c0, c1) computes
// y[c0, c1). Every element is the same dot product as in the whole-row call, bit for bit.
template <typename T>
ExpertWeights<T> gate_up_columns(const ExpertWeights<T>& w, int64_t c0, int64_t c1) {
  return {w.gate + c0 * w.hidden, w.up + c0 * w.hidden, nullptr, w.hidden, c1 - c0};
}
template <typename T>
ExpertWeights<T> down_columns(const ExpertWeights<T>& w, int64_t c0, int64_t c1) {
  return {nullptr, nullptr, w.down + c0 * w.intermediate, c1 - c0, w.intermediate};
}

struct ActivationSpec {
  bool clamped = false;
  double limit = 7.0;
  static ActivationSpec of(const MoeShape& s) {
    return {s.activation == Activation::swiglu_clamped, static_cast<double>(s.clamp_limit)};
  }
};

// g = W_gate x, u = W_up x, h = act(g, u) for one row. W: ExpertWeights or Fp8Expert.
template <typename W, typename T>
void gate_up_row(const W& w, ActivationSpec act, const T* x, T* g, T* u, T* h) {
  w.gate_up_gemm(x, g, u);
  for (int64_t i = 0; i < w.intermediate; ++i)
    h[i] = core::swiglu_forward<T>(g[i], u[i], act.clamped, static_cast<T>(act.limit));
}

// y = W_down h for one row.
template <typename W, typename T>
void down_row(const W& w, const T* h, T* y) {
  w.down_gemm(h, y);
}

// The combine epilogue of one token: out[c] = shared[c] + sum_j weights[j] * routed[j*H + c],
// j in fixed order (`shared` may be null). `routed` holds the token's k slot rows.
template <typename T>
void weighted_sum_row(const T* shared, const T* weights, const T* routed, int64_t k, int64_t H, T* out) {
  for (int64_t c = 0; c < H; ++c) {
    T acc = shared ? shared[c] : T(0);
    for (int64_t j = 0; j < k; ++j) acc += weights[j] * routed[j * H + c];
    out[c] = acc;
  }
}

// Backward of one routed row whose output was scaled by `route_weight`:
//   dh_u = W_down^T d_out;  d_route_weight = <dh_u, h>  (= <d_out, y>);  dh = route_weight*dh_u;
//   (dg, du) = act'(g, u) dh;  dx = W_gate^T dg + W_up^T du.
// Scratch `dh` has I entries. Returns d_route_weight.
template <typename W, typename T>
T backward_row(const W& w, ActivationSpec act, const T* g, const T* u, const T* h, const T* d_out, T route_weight,
               T* dh, T* dg, T* du, T* dx) {
  const int64_t I = w.intermediate;
  w.down_dgrad(d_out, dh);
  const T d_weight = dot(dh, h, I);
  for (int64_t i = 0; i < I; ++i) {
    core::swiglu_backward<T>(g[i], u[i], route_weight * dh[i], act.clamped, static_cast<T>(act.limit), dg[i], du[i]);
  }
  w.gate_up_dgrad(dg, du, dx);
  return d_weight;
}

// Weight gradients of one expert over its rows in the given (canonical) order. Row r of the
// row-major activations a[r * width]. `scale[r]` multiplies d_out rows (the route weight).
// Output rows [row_begin, row_end) of each of the three gradients, so callers can split work.
template <typename T>
void gate_up_weight_grad_rows(const std::vector<int64_t>& rows, const T* dg, const T* du, const T* x, int64_t H,
                              int64_t I, int64_t i_begin, int64_t i_end, T* d_gate, T* d_up) {
  for (int64_t i = i_begin; i < i_end; ++i) {
    T* ag = d_gate + i * H;
    T* au = d_up + i * H;
    for (int64_t c = 0; c < H; ++c) ag[c] = au[c] = 0;
    for (int64_t r : rows) {
      const T gi = dg[r * I + i], ui = du[r * I + i];
      const T* xr = x + r * H;
      for (int64_t c = 0; c < H; ++c) {
        ag[c] += gi * xr[c];
        au[c] += ui * xr[c];
      }
    }
  }
}

template <typename T>
void down_weight_grad_rows(const std::vector<int64_t>& rows, const T* scale, const T* d_out, const T* h, int64_t H,
                           int64_t I, int64_t o_begin, int64_t o_end, T* d_down) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    T* acc = d_down + o * I;
    for (int64_t i = 0; i < I; ++i) acc[i] = 0;
    for (int64_t r : rows) {
      const T d = scale[r] * d_out[r * H + o];
      const T* hr = h + r * I;
      for (int64_t i = 0; i < I; ++i) acc[i] += d * hr[i];
    }
  }
}

}  // namespace moka::cpu
