// The loss: dense_math.hpp's cross-entropy of the LM head's logits, and its gradient.
#pragma once
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

// Per row: row_loss = logsumexp(logits) - logits[target]; d_logits = (softmax - onehot) / rows.
void cross_entropy(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float* row_loss,
                   float* d_logits, cudaStream_t stream);

}  // namespace moka::train::cuda
