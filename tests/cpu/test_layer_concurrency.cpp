// A layer holds no state between or across calls: its forwards' contexts own what their
// backwards need, so several forwards may be in flight (backwards in any order) and several
// threads may share one layer. Every result must have the bits of the same call made alone.
#include <thread>
#include <vector>

#include "layer_fixture.hpp"

using namespace moka;
using namespace moka::test;

namespace {

MoeShape concurrency_shape() { return MoeShape{16, 12, 6, 2, 5, Activation::swiglu, 7.0f}; }

template <typename T>
std::vector<T> all_outputs(const Buffers<T>& b) {
  std::vector<T> all;
  for (const std::vector<T>* v : b.outputs()) all.insert(all.end(), v->begin(), v->end());
  return all;
}

// Eight threads share one CPU layer, each running its own inputs (different token counts) through
// forward and backward several times: every run has the bits of that input run alone.
template <typename T>
void check_threads_sharing_one_layer() {
  const MoeShape s = concurrency_shape();
  auto layer = make_moe_layer(s, Backend::cpu, nullptr, LayerOptions{4, 2});
  constexpr int kThreads = 8;
  std::vector<Buffers<T>> inputs;
  std::vector<std::vector<T>> alone;
  for (int i = 0; i < kThreads; ++i) {
    inputs.push_back(random_buffers<T>(s, 1, 37 + 11 * i, 900 + i));
    run_layer(*layer, inputs.back());
    alone.push_back(all_outputs(inputs.back()));
  }
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      for (int run = 0; run < 20; ++run) {
        Buffers<T> b = inputs[i];
        b.poison_outputs();
        run_layer(*layer, b);
        if (all_outputs(b) != alone[i]) ++mismatches[i];
      }
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(mismatches[i], 0) << "thread " << i;
}

TEST(LayerConcurrency, EightThreadsSharingOneCpuLayerF32) { check_threads_sharing_one_layer<float>(); }
TEST(LayerConcurrency, EightThreadsSharingOneCpuLayerF64) { check_threads_sharing_one_layer<double>(); }

// Two forwards in flight on one layer, their backwards in reverse order: the bits of each pair run
// alone.
TEST(LayerConcurrency, TwoForwardsInFlightBackwardsInReverseOrder) {
  const MoeShape s = concurrency_shape();
  auto layer = make_moe_layer(s, Backend::cpu, nullptr, LayerOptions{4, 2});
  Buffers<double> a = random_buffers<double>(s, 1, 29, 31), b = random_buffers<double>(s, 1, 41, 32);
  Buffers<double> a_alone = a, b_alone = b;
  run_layer(*layer, a_alone);
  run_layer(*layer, b_alone);
  auto ctx_a = layer->forward(a.inputs(), a.weights(), a.out_view(), Stream{});
  auto ctx_b = layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{});
  layer->backward(*ctx_b, b.d_out_view(), b.weights(), b.gradients(), Stream{});
  layer->backward(*ctx_a, a.d_out_view(), a.weights(), a.gradients(), Stream{});
  EXPECT_EQ(all_outputs(a), all_outputs(a_alone));
  EXPECT_EQ(all_outputs(b), all_outputs(b_alone));
}

}  // namespace
