// CUDA and NCCL return codes become moka::Error with the call's text and location.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "moka/error.hpp"

#define MOKA_CUDA_CHECK(call)                                                                      \
  do {                                                                                             \
    const cudaError_t moka_err_ = (call);                                                          \
    if (moka_err_ != cudaSuccess)                                                                  \
      throw ::moka::Error(::moka::ErrorCode::cuda, std::string(#call) + ": " +                     \
                                                       cudaGetErrorString(moka_err_) + " at " +    \
                                                       __FILE__ + ":" + std::to_string(__LINE__)); \
  } while (0)

#define MOKA_NCCL_CHECK(call)                                                                      \
  do {                                                                                             \
    const ncclResult_t moka_res_ = (call);                                                         \
    if (moka_res_ != ncclSuccess)                                                                  \
      throw ::moka::Error(::moka::ErrorCode::nccl, std::string(#call) + ": " +                     \
                                                       ncclGetErrorString(moka_res_) + " at " +    \
                                                       __FILE__ + ":" + std::to_string(__LINE__)); \
  } while (0)
