// Dense CPU math of the model around the MoE layers: projections, RMSNorm, causal attention and
// cross-entropy, forward and backward. Work is split over output rows with moka's deterministic
// parallel_for, so results do not depend on the thread count. (The CUDA training path replaces
// these with cuBLAS GEMMs and attention kernels.)
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/parallel.hpp"

namespace moka::train::dense {

using cpu::parallel_for;

// y[r, o] = scale * sum_i x[r, i] w[o, i];  x: [rows, in], w: [out, in].
template <typename T>
void linear(const T* x, const T* w, T scale, int64_t rows, int64_t in, int64_t out, T* y, int threads) {
  parallel_for(rows, threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t o = 0; o < out; ++o) {
        T acc = 0;
        for (int64_t i = 0; i < in; ++i) acc += x[r * in + i] * w[o * in + i];
        y[r * out + o] = scale * acc;
      }
  });
}

// dx = scale * dy w (overwritten); dw += scale * dy^T x.
template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T scale, int64_t rows, int64_t in, int64_t out, T* dx, T* dw,
                     int threads) {
  parallel_for(rows, threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      T* dxr = dx + r * in;
      std::fill(dxr, dxr + in, T(0));
      for (int64_t o = 0; o < out; ++o) {
        const T d = scale * dy[r * out + o];
        for (int64_t i = 0; i < in; ++i) dxr[i] += d * w[o * in + i];
      }
    }
  });
  parallel_for(out, threads, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      T* dwo = dw + o * in;
      for (int64_t r = 0; r < rows; ++r) {
        const T d = scale * dy[r * out + o];
        for (int64_t i = 0; i < in; ++i) dwo[i] += d * x[r * in + i];
      }
    }
  });
}

// y = x / rms(x) * gain per row; saves 1/rms per row for backward.
template <typename T>
void rmsnorm(const T* x, const T* gain, int64_t rows, int64_t d, double eps, T* y, T* inv_rms) {
  for (int64_t r = 0; r < rows; ++r) {
    T ss = 0;
    for (int64_t i = 0; i < d; ++i) ss += x[r * d + i] * x[r * d + i];
    inv_rms[r] = T(1) / std::sqrt(ss / T(d) + T(eps));
    for (int64_t i = 0; i < d; ++i) y[r * d + i] = x[r * d + i] * inv_rms[r] * gain[i];
  }
}

// dx = inv_rms * (gain*dy - xhat * mean(gain*dy*xhat)) (overwritten); dgain += sum_r dy*xhat.
template <typename T>
void rmsnorm_backward(const T* x, const T* gain, const T* inv_rms, const T* dy, int64_t rows, int64_t d, T* dx,
                      T* dgain) {
  for (int64_t r = 0; r < rows; ++r) {
    T dot = 0;
    for (int64_t i = 0; i < d; ++i) dot += gain[i] * dy[r * d + i] * x[r * d + i] * inv_rms[r];
    const T mean = dot / T(d);
    for (int64_t i = 0; i < d; ++i) {
      const T xhat = x[r * d + i] * inv_rms[r];
      dx[r * d + i] = inv_rms[r] * (gain[i] * dy[r * d + i] - xhat * mean);
      dgain[i] += dy[r * d + i] * xhat;
    }
  }
}

struct AttentionDims {
  int64_t batch, seq, heads, head_dim;
  int64_t width() const { return heads * head_dim; }
  int64_t tokens() const { return batch * seq; }
};

// Causal softmax attention per (sequence, head); q, k, v, out: [batch*seq, heads*head_dim];
// probs: [batch, heads, seq, seq] saved for backward. Scale 1/sqrt(head_dim).
template <typename T>
void causal_attention(const T* q, const T* k, const T* v, const AttentionDims& a, T* probs, T* out, int threads) {
  const int64_t S = a.seq, W = a.width(), hd = a.head_dim;
  const T scale = T(1) / std::sqrt(T(hd));
  parallel_for(a.batch * a.heads, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / a.heads, h = bh % a.heads;
      T* P = probs + bh * S * S;
      for (int64_t i = 0; i < S; ++i) {
        const T* qi = q + (b * S + i) * W + h * hd;
        T mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          const T* kj = k + (b * S + j) * W + h * hd;
          T s = 0;
          for (int64_t c = 0; c < hd; ++c) s += qi[c] * kj[c];
          P[i * S + j] = s * scale;
          mx = std::max(mx, P[i * S + j]);
        }
        T sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += (P[i * S + j] = std::exp(P[i * S + j] - mx));
        for (int64_t j = 0; j < S; ++j) P[i * S + j] = j <= i ? P[i * S + j] / sum : T(0);
        T* oi = out + (b * S + i) * W + h * hd;
        std::fill(oi, oi + hd, T(0));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t c = 0; c < hd; ++c) oi[c] += P[i * S + j] * v[(b * S + j) * W + h * hd + c];
      }
    }
  });
}

// dq, dk, dv overwritten. Each (sequence, head) owns disjoint slices, so the split is race-free.
template <typename T>
void causal_attention_backward(const T* q, const T* k, const T* v, const T* probs, const T* d_out,
                               const AttentionDims& a, T* dq, T* dk, T* dv, int threads) {
  const int64_t S = a.seq, W = a.width(), hd = a.head_dim;
  const T scale = T(1) / std::sqrt(T(hd));
  parallel_for(a.batch * a.heads, threads, [&](int64_t lo, int64_t hi) {
    std::vector<T> dp(S);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / a.heads, h = bh % a.heads;
      const T* P = probs + bh * S * S;
      auto at = [&](T* base, int64_t i) { return base + (b * S + i) * W + h * hd; };
      auto cat = [&](const T* base, int64_t i) { return base + (b * S + i) * W + h * hd; };
      for (int64_t i = 0; i < S; ++i) {
        std::fill(at(dq, i), at(dq, i) + hd, T(0));
        std::fill(at(dk, i), at(dk, i) + hd, T(0));
        std::fill(at(dv, i), at(dv, i) + hd, T(0));
      }
      for (int64_t i = 0; i < S; ++i) {
        const T* doi = cat(d_out, i);
        T row_dot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          T s = 0;
          for (int64_t c = 0; c < hd; ++c) s += doi[c] * cat(v, j)[c];
          dp[j] = s;
          row_dot += s * P[i * S + j];
          for (int64_t c = 0; c < hd; ++c) at(dv, j)[c] += P[i * S + j] * doi[c];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const T ds = P[i * S + j] * (dp[j] - row_dot) * scale;
          for (int64_t c = 0; c < hd; ++c) {
            at(dq, i)[c] += ds * cat(k, j)[c];
            at(dk, j)[c] += ds * cat(q, i)[c];
          }
        }
      }
    }
  });
}

// Mean cross-entropy over rows; d_logits = (softmax - onehot) / rows (overwritten).
template <typename T>
double cross_entropy(const T* logits, const int32_t* targets, int64_t rows, int64_t vocab, T* d_logits) {
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const T* l = logits + r * vocab;
    const T mx = *std::max_element(l, l + vocab);
    T sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(l[v] - mx);
    const T lse = mx + std::log(sum);
    total += double(lse - l[targets[r]]);
    for (int64_t v = 0; v < vocab; ++v)
      d_logits[r * vocab + v] = (std::exp(l[v] - lse) - (v == targets[r] ? T(1) : T(0))) / T(rows);
  }
  return total / double(rows);
}

template <typename T>
double mean_abs(const std::vector<T>& x) {
  double s = 0;
  for (T v : x) s += std::abs(double(v));
  return x.empty() ? 0.0 : s / double(x.size());
}

}  // namespace moka::train::dense
