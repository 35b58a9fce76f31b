// The token embedding: model.cpp's embedding lookup and its gradient.
#pragma once
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

// h[t] = scale * table[tokens[t]]; table: [V, d].
void embed_forward(const int32_t* tokens, const float* table, float scale, int64_t rows, int64_t d, float* h,
                   cudaStream_t stream);
// grad[v] = scale * sum of d_h[t] over the positions t of token v (ascending), for every v:
// `offsets` [V+1] and `positions` [rows] list each token's positions (embed_positions()).
void embed_backward(const int32_t* offsets, const int32_t* positions, const float* d_h, float scale, int64_t vocab,
                    int64_t d, float* grad, cudaStream_t stream);

}  // namespace moka::train::cuda
