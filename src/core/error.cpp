#include "moka/error.hpp"

namespace moka {

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid argument";
    case ErrorCode::shape_mismatch: return "shape mismatch";
    case ErrorCode::expert_out_of_range: return "expert id out of range";
    case ErrorCode::duplicate_expert: return "duplicate expert in top-k";
    case ErrorCode::non_finite: return "non-finite value";
    case ErrorCode::unsupported_size: return "unsupported size";
    case ErrorCode::capacity_exceeded: return "capacity exceeded";
    case ErrorCode::timeout: return "timeout";
    case ErrorCode::peer_failure: return "peer failure";
    case ErrorCode::backend_unavailable: return "backend unavailable";
    case ErrorCode::cuda: return "CUDA error";
    case ErrorCode::nccl: return "NCCL error";
    case ErrorCode::io: return "I/O error";
    case ErrorCode::internal: return "internal error";
  }
  return "error";
}

}  // namespace moka
