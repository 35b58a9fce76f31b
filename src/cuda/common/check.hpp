// Checked CUDA and cuBLAS calls: every failure becomes a moka::Error naming the call and place.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "moka/error.hpp"

namespace moka::cuda {

[[noreturn]] inline void fail_cuda(cudaError_t e, const char* what, const char* file, int line) {
  throw Error(ErrorCode::cuda,
              std::string(what) + " failed: " + cudaGetErrorString(e) + " at " + file + ":" + std::to_string(line));
}
[[noreturn]] inline void fail_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  throw Error(ErrorCode::cuda, std::string(what) + " failed: cuBLAS status " + std::to_string(int(s)) + " at " + file +
                                   ":" + std::to_string(line));
}

}  // namespace moka::cuda

#define MOKA_CUDA_CHECK(call)                                                                    \
  do {                                                                                           \
    const cudaError_t moka_err_ = (call);                                                        \
    if (moka_err_ != cudaSuccess) ::moka::cuda::fail_cuda(moka_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: a bad configuration shows up here, not at the next synchronization.
#define MOKA_CUDA_CHECK_LAUNCH() MOKA_CUDA_CHECK(cudaGetLastError())

#define MOKA_CUBLAS_CHECK(call)                                                                            \
  do {                                                                                                     \
    const cublasStatus_t moka_st_ = (call);                                                                \
    if (moka_st_ != CUBLAS_STATUS_SUCCESS) ::moka::cuda::fail_cublas(moka_st_, #call, __FILE__, __LINE__); \
  } while (0)
