// The routers' aux-loss-free balancing on the device, so that the step needs no host copy of the
// expert counts.
#pragma once
#include "train/cuda/ops/op_common.cuh"

namespace moka::train::cuda {

// Aux-loss-free balancing on the device (moka::update_selection_bias's arithmetic): bias
// [experts] (f64) += rate * sign(mean count - count), and bias32 = its f32 copy the router reads.
void update_selection_bias(const int32_t* counts, int64_t experts, double rate, double* bias, float* bias32,
                           cudaStream_t stream);

}  // namespace moka::train::cuda
