// The public moka::Stream as the cudaStream_t it carries.
#pragma once
#include <cuda_runtime.h>

#include "moka/stream.hpp"

namespace moka::cuda {

inline cudaStream_t to_cuda(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

// Whether work enqueued on `stream` is being captured into a graph (where event queries are not
// allowed). A query the runtime refuses (the legacy stream while another thread captures) counts
// as capturing, and its error is cleared.
inline bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace moka::cuda
