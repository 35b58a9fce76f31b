// Where a layer's per-call device memory comes from: the scratch of one forward or backward and
// what a forward's context saves for its backward. A caller that owns the GPU's memory (PyTorch's
// caching allocator, a training engine's arena) passes its own through LayerOptions::allocator, so
// that moka's memory is shared with everything else the model allocates; without one the CUDA
// backend takes it from a stream-ordered pool of its own (one per device, shared by every layer).
#pragma once
#include <cstddef>

#include "moka/stream.hpp"

namespace moka {

// Stream-ordered device memory (the contract of cudaMallocAsync / cudaFreeAsync): allocate's
// memory may be used by work enqueued on `stream` after the call; deallocate's may be reused by
// work enqueued on `stream` after the call (the layer passes the stream of the memory's last use).
// Called from any thread that calls a layer: an implementation shared by several layers or threads
// must be thread-safe. allocate throws (or returns null, which the layer reports as out of memory)
// when it cannot satisfy a request; bytes is never 0.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual void* allocate(size_t bytes, Stream stream) = 0;
  virtual void deallocate(void* pointer, size_t bytes, Stream stream) = 0;
};

}  // namespace moka
