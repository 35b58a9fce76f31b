// The public moka::Stream as the cudaStream_t it carries.
#pragma once
#include <cuda_runtime.h>

#include "moka/stream.hpp"

namespace moka::cuda {

inline cudaStream_t to_cuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

}  // namespace moka::cuda
