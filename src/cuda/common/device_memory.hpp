// Owners of CUDA memory. Every allocation of the CUDA backend, the GPU side of src/comm and the
// CUDA training engine goes through these: an object whose later allocation throws frees what
// it already holds, and nothing is freed by hand.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/common/check.hpp"
#include "moka/allocator.hpp"

namespace moka::cuda {

// moka's stream-ordered pool on the current device (device_pool.cpp): what a layer takes its
// per-call memory from when the caller gives no allocator. One per device, shared by every layer
// and thread (CUDA memory pools are thread-safe); it keeps what it reserved for reuse.
DeviceAllocator& default_device_allocator();

// `count` elements of T in device memory (at least 16 bytes so that even an empty array has a
// TMA-aligned address): from cudaMalloc (what an object keeps for its life; zeroed once, so that
// no kernel reads memory nobody wrote, as a tile's loads of the padding rows of a ring would,
// which compute-sanitizer's initcheck verifies), or from a
// stream-ordered DeviceAllocator (a call's scratch, a context's saved rows): then it goes back
// with deallocate on the stream of its last use (release_on; the allocation's stream until
// told). Default-constructed: empty, data() == nullptr. Move-only; freed in the destructor.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t count) : count_(count) {
    void* p = nullptr;
    MOKA_CUDA_CHECK(cudaMalloc(&p, padded_bytes()));
    // Zeroed before the constructor returns: cudaMemset is queued on the legacy default stream,
    // which a caller's non-blocking stream does not wait for.
    cudaError_t zeroed = cudaMemset(p, 0, padded_bytes());
    if (zeroed == cudaSuccess) zeroed = cudaStreamSynchronize(cudaStreamLegacy);
    if (zeroed != cudaSuccess) cudaFree(p);
    MOKA_CUDA_CHECK(zeroed);
    data_ = static_cast<T*>(p);
  }
  DeviceArray(size_t count, DeviceAllocator& from, cudaStream_t stream)
      : count_(count), allocator_(&from), stream_(stream) {
    data_ = static_cast<T*>(from.allocate(padded_bytes(), Stream{stream}));
    require(data_ != nullptr, ErrorCode::cuda,
            "out of device memory: the allocator returned no memory for " + std::to_string(padded_bytes()) + " bytes");
  }
  ~DeviceArray() { release(); }
  DeviceArray(DeviceArray&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), count_(std::exchange(o.count_, 0)),
        allocator_(std::exchange(o.allocator_, nullptr)), stream_(o.stream_) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(count_, o.count_);
    std::swap(allocator_, o.allocator_);
    std::swap(stream_, o.stream_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  // An allocator's array: `stream` is where it is used last (its memory is reused after that
  // stream's work enqueued before the free).
  void release_on(cudaStream_t stream) const { stream_ = stream; }
  // Frees now (stream-ordered for an allocator's array); empty afterwards.
  void release() {
    if (!data_) return;
    if (allocator_) {
      allocator_->deallocate(data_, padded_bytes(), Stream{stream_});
    } else {
      cudaFree(data_);
    }
    data_ = nullptr;
    count_ = 0;
  }

  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }
  bool empty() const { return data_ == nullptr; }

  // Copies ordered on `stream` that are complete when they return (the host buffer may go away
  // at once, and a copy from pageable memory may return before its bytes land otherwise).
  void upload(const T* host, size_t count, cudaStream_t stream) {
    require(count <= count_, ErrorCode::shape_mismatch,
            "device upload of " + std::to_string(count) + " elements into an array of " + std::to_string(count_));
    MOKA_CUDA_CHECK(cudaMemcpyAsync(data_, host, count * sizeof(T), cudaMemcpyHostToDevice, stream));
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  void upload(const std::vector<T>& host, cudaStream_t stream) { upload(host.data(), host.size(), stream); }
  std::vector<T> download(cudaStream_t stream) const {
    std::vector<T> host(count_);
    MOKA_CUDA_CHECK(cudaMemcpyAsync(host.data(), data_, bytes(), cudaMemcpyDeviceToHost, stream));
    MOKA_CUDA_CHECK(cudaStreamSynchronize(stream));
    return host;
  }

 private:
  size_t padded_bytes() const { return std::max<size_t>(count_ * sizeof(T), 16); }

  T* data_ = nullptr;
  size_t count_ = 0;
  DeviceAllocator* allocator_ = nullptr;  // null: cudaMalloc
  mutable cudaStream_t stream_ = nullptr;
};

// `count` elements of T in page-locked host memory (cudaHostAlloc). Mapped: the device reads and
// writes it through device() without a copy (error words the host polls without synchronizing).
template <typename T>
class PinnedArray {
 public:
  enum Mapping { unmapped, mapped };
  PinnedArray() = default;
  PinnedArray(size_t count, Mapping mapping) : count_(count) {
    void* p = nullptr;
    MOKA_CUDA_CHECK(cudaHostAlloc(&p, std::max<size_t>(count, 1) * sizeof(T),
                                  mapping == mapped ? cudaHostAllocMapped : cudaHostAllocDefault));
    host_ = static_cast<T*>(p);
    if (mapping == mapped) {
      void* d = nullptr;
      MOKA_CUDA_CHECK(cudaHostGetDevicePointer(&d, p, 0));
      device_ = static_cast<T*>(d);
    }
  }
  ~PinnedArray() { cudaFreeHost(host_); }
  PinnedArray(PinnedArray&& o) noexcept
      : host_(std::exchange(o.host_, nullptr)), device_(std::exchange(o.device_, nullptr)),
        count_(std::exchange(o.count_, 0)) {}
  PinnedArray& operator=(PinnedArray&& o) noexcept {
    std::swap(host_, o.host_);
    std::swap(device_, o.device_);
    std::swap(count_, o.count_);
    return *this;
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;

  T* host() const { return host_; }
  T* device() const { return device_; }  // null unless mapped
  size_t size() const { return count_; }

 private:
  T* host_ = nullptr;
  T* device_ = nullptr;
  size_t count_ = 0;
};

// One mapped host word the device writes (a status or error code) and the host reads without
// synchronizing. Starts as `initial`.
template <typename T>
class PinnedWord {
 public:
  explicit PinnedWord(T initial = T{}) : word_(1, PinnedArray<T>::mapped) { *word_.host() = initial; }
  T* host() const { return word_.host(); }
  T* device() const { return word_.device(); }
  // The current value (the device may have written it since the last read).
  T load() const {
    if constexpr (std::is_scalar_v<T>) {
      return *const_cast<const volatile T*>(word_.host());
    } else {
      return *word_.host();
    }
  }
  void store(const T& value) { *word_.host() = value; }

 private:
  PinnedArray<T> word_;
};

// `count` elements of T allocated and freed in stream order (cudaMallocAsync / cudaFreeAsync on
// `stream`): no device-wide synchronization per call, as cudaFree would force, and capturable in
// a CUDA graph. Every use must be ordered on `stream` (or after it).
template <typename T>
class StreamScratch {
 public:
  StreamScratch(size_t count, cudaStream_t stream) : stream_(stream) {
    void* p = nullptr;
    MOKA_CUDA_CHECK(cudaMallocAsync(&p, count * sizeof(T), stream_));
    data_ = static_cast<T*>(p);
  }
  ~StreamScratch() { cudaFreeAsync(data_, stream_); }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  T* data() const { return data_; }

 private:
  T* data_ = nullptr;
  cudaStream_t stream_;
};

// A peer's device buffer mapped into this process (cudaIpcOpenMemHandle); unmapped in the
// destructor. Move-only.
class IpcMapping {
 public:
  IpcMapping() = default;
  explicit IpcMapping(const cudaIpcMemHandle_t& handle) {
    MOKA_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr_, handle, cudaIpcMemLazyEnablePeerAccess));
  }
  ~IpcMapping() {
    if (ptr_) cudaIpcCloseMemHandle(ptr_);
  }
  IpcMapping(IpcMapping&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)) {}
  IpcMapping& operator=(IpcMapping&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    return *this;
  }
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  void* data() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

}  // namespace moka::cuda
