// fp64 finite-difference checks: the dense modules one by one, then every tensor of whole models
// (MLA and MHA attention, dense FFN, MoE router and experts, shared expert, z-loss, LM head).
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "train/dense_math.hpp"
#include "train/model.hpp"
#include "train_fixtures.hpp"

using namespace moka::train;

namespace {

std::vector<double> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of `loss` in every entry of `x` against the analytic `grad`.
void expect_gradient(std::vector<double>& x, const std::vector<double>& grad, const std::function<double()>& loss,
                     const char* what) {
  const double eps = 1e-6;
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    x[i] = saved - eps;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * eps);
    EXPECT_NEAR(grad[i], numeric, 1e-6 * (1 + std::abs(numeric))) << what << " entry " << i;
  }
}

}  // namespace

TEST(TrainGradients, Linear) {
  const int64_t rows = 3, in = 5, out = 4;
  auto x = random_vector(rows * in, 1), w = random_vector(out * in, 2), r = random_vector(rows * out, 3);
  const double scale = 0.7;
  auto loss = [&] {
    std::vector<double> y(rows * out);
    dense::linear(x.data(), w.data(), scale, rows, in, out, y.data(), 2);
    return dot(y, r);
  };
  std::vector<double> dx(rows * in), dw(out * in, 0.0);
  dense::linear_backward(x.data(), w.data(), r.data(), scale, rows, in, out, dx.data(), dw.data(), 2);
  expect_gradient(x, dx, loss, "x");
  expect_gradient(w, dw, loss, "w");
}

TEST(TrainGradients, RmsNorm) {
  const int64_t rows = 3, d = 6;
  auto x = random_vector(rows * d, 4), g = random_vector(d, 5), r = random_vector(rows * d, 6);
  std::vector<double> inv(rows), y(rows * d);
  auto loss = [&] {
    dense::rmsnorm(x.data(), g.data(), rows, d, 1e-6, y.data(), inv.data());
    return dot(y, r);
  };
  loss();
  std::vector<double> dx(rows * d), dg(d, 0.0);
  dense::rmsnorm_backward(x.data(), g.data(), inv.data(), r.data(), rows, d, dx.data(), dg.data());
  expect_gradient(x, dx, loss, "x");
  expect_gradient(g, dg, loss, "gain");
}

TEST(TrainGradients, CausalAttention) {
  const dense::AttentionDims a{2, 5, 3, 4};
  const size_t n = size_t(a.tokens() * a.width());
  auto q = random_vector(n, 7), k = random_vector(n, 8), v = random_vector(n, 9), r = random_vector(n, 10);
  std::vector<double> probs(a.batch * a.heads * a.seq * a.seq), out(n);
  auto loss = [&] {
    dense::causal_attention(q.data(), k.data(), v.data(), a, probs.data(), out.data(), 2);
    return dot(out, r);
  };
  loss();
  std::vector<double> dq(n), dk(n), dv(n);
  dense::causal_attention_backward(q.data(), k.data(), v.data(), probs.data(), r.data(), a, dq.data(), dk.data(),
                                   dv.data(), 2);
  expect_gradient(q, dq, loss, "q");
  expect_gradient(k, dk, loss, "k");
  expect_gradient(v, dv, loss, "v");
}

TEST(TrainGradients, CrossEntropy) {
  const int64_t rows = 4, vocab = 7;
  auto logits = random_vector(rows * vocab, 11, 2.0);
  const std::vector<int32_t> targets{0, 3, 6, 3};
  std::vector<double> d(rows * vocab), scratch(rows * vocab);
  dense::cross_entropy(logits.data(), targets.data(), rows, vocab, d.data());
  expect_gradient(
      logits, d, [&] { return dense::cross_entropy(logits.data(), targets.data(), rows, vocab, scratch.data()); },
      "logits");
}

class ModelGradients : public ::testing::TestWithParam<AttentionKind> {};

// Every tensor of a 3-layer model (dense FFN, two MoE layers with shared experts and z-loss),
// under muP at 2x width so the head's forward multiplier and the LR rules are in play.
TEST_P(ModelGradients, EveryTensorMatchesFiniteDifferences) {
  auto base = moka::train::testing::tiny_config();
  base.attention = GetParam();
  base.num_layers = 3;
  base.shared_intermediate = 8;
  base.z_loss_coef = 1e-2;
  base.d_model = 16;
  base.num_heads = 2;
  base.head_dim = 4;
  base.q_rank = base.kv_rank = 6;
  base.dense_intermediate = 12;
  base.expert_intermediate = 6;
  const auto target = scale_width(base, 2);
  Model<double> model(target, parameterize(base, target, Parameterization::mup), {moka::Backend::cpu, 2});
  model.params().initialize(3);
  // Distinct selection biases, so selection differs from plain top-k of the scores.
  for (auto& b : model.selection_biases())
    for (size_t e = 0; e < b.size(); ++e) b[e] = 0.01 * double(e % 3);
  Batch batch{2, 6, {}, {}};
  std::mt19937 rng(5);
  for (int i = 0; i < 12; ++i) {
    batch.inputs.push_back(int32_t(rng() % 256));
    batch.targets.push_back(int32_t(rng() % 256));
  }
  model.forward(batch);
  model.backward();
  const double eps = 1e-6;
  for (auto& p : model.params()) {
    SCOPED_TRACE(p.name());
    // A handful of entries per tensor, spread over it (the embedding: rows of used tokens).
    const size_t n = p.value.size();
    std::vector<size_t> entries;
    if (p.rule.spec.cls == TensorClass::embedding) {
      for (int c = 0; c < 3; ++c) entries.push_back(size_t(batch.inputs[c]) * size_t(target.d_model) + size_t(c));
    } else {
      for (size_t i = 0; i < 5; ++i) entries.push_back((i * 7919 + 13) % n);
    }
    for (size_t i : entries) {
      const double saved = p.value[i];
      p.value[i] = saved + eps;
      const double up = model.forward(batch);
      p.value[i] = saved - eps;
      const double down = model.forward(batch);
      p.value[i] = saved;
      const double numeric = (up - down) / (2 * eps);
      EXPECT_NEAR(p.grad[i], numeric, 1e-6 * (1 + std::abs(numeric))) << "entry " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Attention, ModelGradients, ::testing::Values(AttentionKind::mla, AttentionKind::mha));
