// gemm_schedules' check: two bf16 device buffers compared element by element on the device, on
// the caller's stream (no host copy of outputs that reach gigabytes, and no copy on another
// stream: the first ping-pong check raced its reference copy on the legacy stream against the
// next run's clearing on the case's non-blocking one).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moka::lab {

// What comparing `got` with `want` found. Both buffers were filled with kUnwrittenBits before
// their kernels ran, so an element a kernel did not write still holds them.
inline constexpr uint16_t kUnwrittenBits = 0xFFFF;  // a bf16 NaN
struct BufferDiff {
  unsigned long long differing = 0;              // elements whose bits differ
  unsigned long long unwritten = 0;              // ... where got was never written and want was
  unsigned long long extra = 0;                  // ... where got was written and want was not
  unsigned long long non_finite = 0;             // ... where both were written and one is not finite
  unsigned long long first = ~0ull;              // the smallest index of a differing element (~0: none)
  unsigned int max_diff_bits = 0;                // float bits of max |got - want| over the other differing elements
  unsigned int max_want_bits = 0;                // float bits of max |want| over every written, finite want
  unsigned short first_got = 0, first_want = 0;  // the bf16 bits at `first`
};

// Resets *result and queues the comparison of `count` bf16 elements on `s`; *result (device
// memory) holds the outcome once `s` reaches that point.
void compare_bf16(const void* got, const void* want, size_t count, BufferDiff* result, cudaStream_t s);

float float_of_bits(unsigned int bits);
float float_of_bf16_bits(unsigned short bits);

}  // namespace moka::lab
