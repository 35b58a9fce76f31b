// Errors: every failure moka reports is a moka::Error carrying a code a caller can branch on
// and a message that names the offending input (expert id, rank, shape, stage).
#pragma once
#include <stdexcept>
#include <string>

namespace moka {

enum class ErrorCode {
  invalid_argument,  // a config value or option outside its valid range
  shape_mismatch,    // tensors (or ranks) disagree on a dimension
  expert_out_of_range,
  duplicate_expert,  // the same expert twice in one token's top-k
  non_finite,        // NaN/Inf in router weights or logits
  unsupported_size,  // a size this backend cannot take (e.g. not a tile multiple)
  capacity_exceeded,
  timeout,       // a bounded wait expired (device spin-wait, peer that stopped answering)
  peer_failure,  // another rank reported an error
  backend_unavailable,
  cuda,
  nccl,
  io,
  internal,
};

const char* to_string(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string(to_string(code)) + ": " + message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Throws Error(code, message) when `condition` is false.
inline void require(bool condition, ErrorCode code, const std::string& message) {
  if (!condition) throw Error(code, message);
}

}  // namespace moka
