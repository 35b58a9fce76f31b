// NCCL return codes become moka::Error like CUDA's (MOKA_CUDA_CHECK comes from cuda/check.hpp).
#pragma once
#include <nccl.h>

#include <string>

#include "cuda/common/check.hpp"

namespace moka::comm {
[[noreturn]] inline void fail_nccl(ncclResult_t r, const char* what, const char* file, int line) {
  throw Error(ErrorCode::nccl,
              std::string(what) + " failed: " + ncclGetErrorString(r) + " at " + file + ":" + std::to_string(line));
}
}  // namespace moka::comm

#define MOKA_NCCL_CHECK(call)                                                                    \
  do {                                                                                           \
    const ncclResult_t moka_res_ = (call);                                                       \
    if (moka_res_ != ncclSuccess) ::moka::comm::fail_nccl(moka_res_, #call, __FILE__, __LINE__); \
  } while (0)
