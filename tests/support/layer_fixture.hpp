// Helpers shared by the layer tests: run a layer on host buffers, one rank or several emulated.
#pragma once
#include <gtest/gtest.h>

#include "core/routing_gen.hpp"
#include "layer_buffers.hpp"
#include "moka/moka.hpp"

namespace moka::test {

template <typename T>
using Buffers = cli::LayerBuffers<T>;

inline MoeShape small_shape(Activation act = Activation::swiglu, int64_t shared = 5) {
  return MoeShape{8, 6, 4, 2, shared, act, 0.6f};
}

// Random inputs with distinct top-k ids drawn by `routing`.
template <typename T>
Buffers<T> random_buffers(const MoeShape& s, int world, int64_t tokens, uint64_t seed,
                          core::RoutingKind routing = core::RoutingKind::uniform, int rank = 0) {
  Buffers<T> b(s, world, tokens);
  b.randomize(seed * 97 + rank);
  b.topk_ids = core::sample_topk_ids({routing, 0.35, seed}, tokens, s.top_k, s.num_experts, rank);
  b.poison_outputs();
  return b;
}

// Inputs of every rank of an emulated group (rank r drawn from seed and r).
template <typename T>
std::vector<Buffers<T>> random_rank_buffers(const MoeShape& s, int world, int64_t tokens, uint64_t seed,
                                            core::RoutingKind routing) {
  std::vector<Buffers<T>> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(random_buffers<T>(s, world, tokens, seed, routing, r));
  return ranks;
}

// Forward + backward of one rank (no group).
template <typename T>
void run_layer(MoeLayer& layer, Buffers<T>& b) {
  auto ctx = layer.forward(b.inputs(), b.weights(), b.out_view(), Stream{});
  layer.backward(*ctx, b.d_out_view(), b.weights(), b.gradients(), Stream{});
}

template <typename T>
void run_single(const MoeShape& s, Buffers<T>& b, int64_t tile_rows = 4) {
  auto layer = make_moe_layer(s, Backend::cpu, nullptr, LayerOptions{tile_rows, 2});
  run_layer(*layer, b);
}

}  // namespace moka::test
