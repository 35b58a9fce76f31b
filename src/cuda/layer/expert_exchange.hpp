// The expert-parallel all-to-all path's data movement (the baseline the megakernel must beat).
// Each call: the device sorts this rank's slots by expert (the send order) and counts routes per
// expert; an NCCL all-to-all of those counts tells every rank how many rows each peer sends to
// each of its experts; the host reads that small table (the one synchronization, as in the
// PyTorch + NCCL path; it never reads the routes) and lists one NCCL transfer per (peer, expert)
// block, so rows land straight in their expert's segment of the grouped buffer, sources in rank
// order inside each expert (the canonical order), and go back the same way for the combine.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/exchange_blocks.hpp"
#include "cuda/common/device_memory.hpp"
#include "cuda/layer/layer_kernels.hpp"
#include "moka/config.hpp"
#include "moka/device_group.hpp"

namespace moka::cuda {

class ExpertExchange {
 public:
  ExpertExchange(DeviceGroup& group, const MoeShape& shape, int64_t tile_rows);
  ExpertExchange(const ExpertExchange&) = delete;
  ExpertExchange& operator=(const ExpertExchange&) = delete;

  // Plans one call from this rank's routing (device [T, k] ids and weights). Synchronizes on the
  // count table. The device's routing check is read then: routing_error() (kNoRoutingError = fine).
  void plan(const int32_t* topk_ids, const float* topk_weights, int64_t tokens, cudaStream_t stream);
  unsigned long long routing_error() const { return error_.load(); }

  // Padded rows of this rank's grouped buffer, and its schedule for the grouped GEMMs:
  // counts [E_local] and offsets [E_local + 1].
  int64_t grouped_rows() const { return blocks_.expert_offset.back(); }
  void upload_schedule(int32_t* counts, int32_t* offsets) const;
  // Position in the send order of slot token*k+j ([T*k]): where combined rows come back.
  const int32_t* send_position_of_slot() const { return send_position_.data(); }

  // grouped[row of each route] = tokens[route's token] (x or d_out rows of `width` bf16).
  void dispatch(const bf16* tokens, bf16* grouped, int64_t width, cudaStream_t stream);
  // per_row[row of each route] = per_slot[route's slot] (the router weights).
  void dispatch_scalars(const float* per_slot, float* per_row, cudaStream_t stream);
  // Rows back to their origin: by_send_position[send position] = grouped[row].
  void combine(const bf16* grouped, bf16* by_send_position, int64_t width, cudaStream_t stream);
  // One float per route back to its slot (d_topk_weights).
  void combine_scalars(const float* per_row, float* per_slot, cudaStream_t stream);

 private:
  // Moves the rows of `from_blocks` of `src` into the `to_blocks` of `dst` (core/exchange_blocks.hpp
  // says why NCCL pairs them one to one).
  void move(const void* src, const std::vector<core::TransferBlock>& from_blocks, void* dst,
            const std::vector<core::TransferBlock>& to_blocks, size_t row_bytes, cudaStream_t stream);
  template <typename T>
  T* staging(int which, size_t elems);

  DeviceGroup& group_;
  MoeShape shape_;
  int64_t tile_rows_, local_experts_;
  int64_t tokens_ = 0;
  // This rank's slots sorted by global expert (the single-rank schedule with tile 1): the send
  // order. send_position_ is its row_of_slot ([T*k], grown with the token count).
  DeviceArray<int32_t> sort_counts_, sort_offsets_, sort_chunk_counts_, send_position_;
  DeviceArray<int32_t> received_counts_;  // [world][E_local]
  PinnedArray<int32_t> host_counts_;      // [E] sent per expert, then [world][E_local] received
  PinnedWord<unsigned long long> error_;  // mapped: the routing check's first bad slot
  core::ExchangeBlocks blocks_{{}, {}, {}, {0}};
  DeviceArray<std::byte> staging_[2];
};

}  // namespace moka::cuda
