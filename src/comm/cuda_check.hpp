// CUDA and NCCL return codes become moka::Error with the call's text and location.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "moka/error.hpp"

namespace moka::detail {
[[noreturn]] inline void throw_api_error(ErrorCode code, const char* call, const char* what, const char* file,
                                         int line) {
  throw Error(code, std::string(call) + ": " + what + " at " + file + ":" + std::to_string(line));
}
}  // namespace moka::detail

#define MOKA_CUDA_CHECK(call)                                                                                 \
  do {                                                                                                        \
    if (const cudaError_t moka_e_ = (call); moka_e_ != cudaSuccess)                                           \
      ::moka::detail::throw_api_error(::moka::ErrorCode::cuda, #call, cudaGetErrorString(moka_e_), __FILE__, \
                                      __LINE__);                                                              \
  } while (0)

#define MOKA_NCCL_CHECK(call)                                                                                 \
  do {                                                                                                        \
    if (const ncclResult_t moka_e_ = (call); moka_e_ != ncclSuccess)                                          \
      ::moka::detail::throw_api_error(::moka::ErrorCode::nccl, #call, ncclGetErrorString(moka_e_), __FILE__, \
                                      __LINE__);                                                              \
  } while (0)
