// The megakernel's routing exchange, schedule checks and status merge: small kernels around the
// persistent kernel (the receive schedule itself is build_schedule, layer_kernels.cu).
#include <algorithm>

#include "cuda/common/check.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/memory_order.cuh"

namespace moka::cuda {
namespace {

using mk::atomic_load;
using mk::MemoryOrder;
using mk::Scope;

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void exchange_kernel(RoutingExchange x, const int32_t* ids) {
  const int64_t slots = x.tokens * x.top_k, region = routing_region_ints(x.max_tokens, x.top_k);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int peer = 0; peer < x.world_size; ++peer) {
    int32_t* dst = x.peers[peer] + x.rank * region;
    if (i == 0) dst[0] = static_cast<int32_t>(x.tokens);
    if (i < slots) dst[4 + i] = ids[i];
  }
}

__global__ void gather_ids_kernel(ScheduleCheck c, int32_t* ids) {
  const int64_t slots = c.tokens * c.top_k, region = routing_region_ints(c.max_tokens, c.top_k);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= slots * c.world_size) return;
  const int64_t source = i / slots, slot = i % slots;
  const int32_t id = c.routing[source * region + 4 + slot];
  ids[i] = id;
  if (id < 0 || id >= c.global_experts) atomicMax(&c.control->bad_route, ~static_cast<unsigned long long>(i));
}

__global__ void invert_rows_kernel(ScheduleCheck c) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= c.tokens * c.top_k * c.world_size) return;
  const int32_t row = c.row_of_slot[i];
  if (row >= 0 && row < c.capacity_rows) c.slot_of_row[row] = static_cast<int32_t>(i);
}

// One thread: the first problem in a fixed order (a barrier timeout, token counts, ids,
// capacity), so every rank reports the same input error. A barrier that timed out comes first:
// the peers' x and ids may still be changing, and the status keeps the megakernel from pulling.
__global__ void finish_kernel(ScheduleCheck c) {
  core::MegakernelStatus s;
  const int64_t region = routing_region_ints(c.max_tokens, c.top_k), slots = c.tokens * c.top_k;
  const uint64_t missing = c.barrier_error ? atomic_load<MemoryOrder::relaxed, Scope::sys>(c.barrier_error) : 0;
  if (missing != 0) {
    s.code = core::StatusCode::peer_missing;
    s.source_rank = static_cast<int64_t>(missing) - 1;
  }
  for (int source = 0; source < c.world_size && s.code == core::StatusCode::ok; ++source) {
    const int32_t tokens = c.routing[source * region];
    if (tokens != c.tokens) {
      s.code = core::StatusCode::tokens_mismatch;
      s.source_rank = source;
      s.value = tokens;
      s.limit = c.tokens;
    }
  }
  if (s.code == core::StatusCode::ok && c.control->bad_route != 0) {
    const int64_t i = static_cast<int64_t>(~c.control->bad_route);
    s.code = core::StatusCode::invalid_expert;
    s.source_rank = i / slots;
    s.token = (i % slots) / c.top_k;
    s.choice = i % c.top_k;
    s.value = c.routing[s.source_rank * region + 4 + i % slots];
    s.limit = c.global_experts;
  }
  const int64_t rows = c.offsets[c.local_experts];
  if (s.code == core::StatusCode::ok && rows > c.capacity_rows) {
    s.code = core::StatusCode::capacity_exceeded;
    s.rows = rows;
    s.capacity = c.capacity_rows;
  }
  if (s.code != core::StatusCode::ok) {
    c.control->claim = 1;
    c.control->status = s;
  }
}

__global__ void publish_kernel(const MegakernelControl* control, core::MegakernelStatus* slot) {
  *slot = control->status;
}

__global__ void merge_kernel(core::MegakernelStatus* const* slots, int world, MergedStatus* merged) {
  MergedStatus m;
  for (int r = 0; r < world && m.rank < 0; ++r) {
    const core::MegakernelStatus s = *slots[r];
    if (s.code != core::StatusCode::ok) {
      m.rank = r;
      m.status = s;
    }
  }
  *merged = m;
}

// One thread reads the status words (mapped host memory: every CTA of the fill reading them
// over PCIe took ~0.12 ms on an H200) into a device flag.
__global__ void failure_flag_kernel(const core::StatusCode* code, const unsigned long long* routing_error,
                                    int* failed) {
  *failed = atomic_load<MemoryOrder::relaxed, Scope::sys>(code) != core::StatusCode::ok ||
            (routing_error && atomic_load<MemoryOrder::relaxed, Scope::sys>(routing_error) != kNoRoutingError);
}

// 16-byte stores (the outputs are whole tensors: 16-byte aligned allocations; a tail of 2-byte
// halves is stored singly).
__global__ void fill_nan_kernel(const int* failed, const CallOutputs outputs) {
  if (*failed == 0) return;
  constexpr uint16_t kNanHalf = 0x7fc0;
  const uint4 nan4 = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
  const size_t first = size_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = size_t(gridDim.x) * blockDim.x;
  for (int o = 0; o < outputs.count; ++o) {
    const size_t vectors = outputs.bytes[o] / sizeof(uint4);
    for (size_t i = first; i < vectors; i += stride) static_cast<uint4*>(outputs.at[o])[i] = nan4;
    auto* halves = static_cast<uint16_t*>(outputs.at[o]);
    for (size_t i = vectors * 8 + first; i < outputs.bytes[o] / 2; i += stride) halves[i] = kNanHalf;
  }
}

}  // namespace

void fill_nan_on_failure(const core::StatusCode* code, const unsigned long long* routing_error, int* flag,
                         const CallOutputs& outputs, cudaStream_t stream) {
  constexpr int kThreads = 512;
  size_t largest = 0;
  for (int o = 0; o < outputs.count; ++o) largest = std::max(largest, outputs.bytes[o]);
  // Enough CTAs to fill at full bandwidth on a failure; few where the outputs are small.
  const size_t per_cta = size_t(kThreads) * sizeof(uint4) * 8;
  const int ctas = int(std::clamp<size_t>((largest + per_cta - 1) / per_cta, 1, 1024));
  failure_flag_kernel<<<1, 1, 0, stream>>>(code, routing_error, flag);
  MOKA_CUDA_CHECK_LAUNCH();
  fill_nan_kernel<<<ctas, kThreads, 0, stream>>>(flag, outputs);
  MOKA_CUDA_CHECK_LAUNCH();
}

void exchange_routing(const RoutingExchange& x, const int32_t* topk_ids, cudaStream_t stream) {
  exchange_kernel<<<grid_for(x.tokens * x.top_k), kThreads, 0, stream>>>(x, topk_ids);
  MOKA_CUDA_CHECK_LAUNCH();
}

void gather_source_ids(const ScheduleCheck& c, int32_t* ids, cudaStream_t stream) {
  gather_ids_kernel<<<grid_for(c.tokens * c.top_k * c.world_size), kThreads, 0, stream>>>(c, ids);
  MOKA_CUDA_CHECK_LAUNCH();
}

void finish_schedule(const ScheduleCheck& c, cudaStream_t stream) {
  MOKA_CUDA_CHECK(cudaMemsetAsync(c.slot_of_row, 0xff, c.capacity_rows * sizeof(int32_t), stream));
  invert_rows_kernel<<<grid_for(c.tokens * c.top_k * c.world_size), kThreads, 0, stream>>>(c);
  MOKA_CUDA_CHECK_LAUNCH();
  finish_kernel<<<1, 1, 0, stream>>>(c);
  MOKA_CUDA_CHECK_LAUNCH();
}

void publish_status(const MegakernelControl* control, core::MegakernelStatus* own_slot, cudaStream_t stream) {
  publish_kernel<<<1, 1, 0, stream>>>(control, own_slot);
  MOKA_CUDA_CHECK_LAUNCH();
}

void merge_status(core::MegakernelStatus* const* peer_slots, int world_size, MergedStatus* merged,
                  cudaStream_t stream) {
  merge_kernel<<<1, 1, 0, stream>>>(peer_slots, world_size, merged);
  MOKA_CUDA_CHECK_LAUNCH();
}

}  // namespace moka::cuda
