// The bench tools' own CUDA runtime and cuBLAS calls, checked: a failure becomes a moka::Error
// (code cuda) naming the call. The tools reach the library through include/moka only, so they
// cannot borrow the library's internal checks.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "moka/error.hpp"

namespace moka::cli {

inline void check_call(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw Error(ErrorCode::cuda, std::string(call) + ": " + cudaGetErrorString(status));
}
inline void check_call(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorCode::cuda, std::string(call) + ": cuBLAS status " + std::to_string(int(status)));
}

}  // namespace moka::cli

#define BENCH_CHECK(call) ::moka::cli::check_call((call), #call)
