// The single-GPU receive schedule of a case's routing, built on the device: what the GPU tests
// and the kernel lab (bench/kernels) group a case's routed rows with.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/check.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "gpu/device_tensors.hpp"
#include "moka/layer.hpp"

namespace moka::fixtures {

// Routed rows per expert, padded segment starts and each slot's grouped row (build_schedule,
// which also checks the routing).
struct GroupedSchedule {
  int64_t rows;  // rows a grouped buffer needs: every route plus each expert's worst padding
  cli::DeviceBuffer chunk_counts, counts, offsets, row_of_slot, error;
  GroupedSchedule(const int32_t* ids, const float* weights, const MoeShape& sh, int64_t tokens, int64_t tile_rows,
                  cudaStream_t s)
      : rows(tokens * sh.top_k + sh.num_experts * (tile_rows - 1)),
        chunk_counts(cuda::schedule_chunks(tokens * sh.top_k) * sh.num_experts * 4), counts(sh.num_experts * 4),
        offsets((sh.num_experts + 1) * 4), row_of_slot(tokens * sh.top_k * 4), error(8) {
    // On `s`, ordered before the routing check (the default stream's is not, when s is non-blocking).
    MOKA_CUDA_CHECK(cudaMemsetAsync(error.data(), 0xFF, 8, s));
    cuda::DeviceSchedule d;
    d.slots = tokens * sh.top_k, d.num_experts = sh.num_experts, d.global_experts = sh.num_experts;
    d.tile_rows = tile_rows, d.top_k = sh.top_k;
    d.chunk_counts = chunk_counts.as<int32_t>(), d.counts = counts.as<int32_t>();
    d.offsets = offsets.as<int32_t>(), d.row_of_slot = row_of_slot.as<int32_t>();
    d.error = error.as<unsigned long long>();
    cuda::build_schedule(d, ids, weights, s);
  }
};

}  // namespace moka::fixtures
