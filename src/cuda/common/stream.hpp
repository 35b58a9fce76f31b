// The public moka::Stream as the cudaStream_t it carries.
#pragma once
#include <cuda_runtime.h>

#include "cuda/common/check.hpp"
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

// Orders the calls of one object that keeps device buffers between them (a layer's schedule
// tables, counters, error words) across the streams its callers use: a call on another stream
// than the last one waits for the last call's work first. Calls on a stream being captured
// neither wait nor record (the capture's own order holds there). Not thread-safe: the owner
// holds its lock around before() ... after().
class CallOrder {
 public:
  CallOrder() = default;
  CallOrder(const CallOrder&) = delete;
  CallOrder& operator=(const CallOrder&) = delete;
  ~CallOrder() {
    if (done_) cudaEventDestroy(done_);
  }
  void before(cudaStream_t s) {
    // done_ exists once a call recorded it; last_ may be the legacy default stream (null).
    if (done_ && last_ != s && !is_capturing(s)) MOKA_CUDA_CHECK(cudaStreamWaitEvent(s, done_, 0));
  }
  void after(cudaStream_t s) {
    if (is_capturing(s)) return;
    if (!done_) MOKA_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    MOKA_CUDA_CHECK(cudaEventRecord(done_, s));
    last_ = s;
  }

 private:
  cudaStream_t last_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

}  // namespace moka::cuda
