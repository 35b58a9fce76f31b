// The expert-parallel all-to-all path's data movement (the baseline the megakernel must beat):
// every rank learns every rank's routing, builds its receive schedule with the same rule as the
// CPU reference (core::build_receive_schedule), and token rows move with NCCL all-to-all-v:
// dispatch sends each slot's row to its expert's rank in (destination, expert, slot) order and
// lands it on its schedule row; combine returns rows in the reverse order. Split sizes pass
// through the host (one synchronization per call), as in the PyTorch + NCCL path.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/schedule.hpp"
#include "cuda/layer_kernels.hpp"
#include "moka/config.hpp"
#include "moka/device_group.hpp"

namespace moka::cuda {

class ExpertExchange {
 public:
  ExpertExchange(DeviceGroup& group, const MoeShape& shape, int64_t tile_rows);
  ExpertExchange(const ExpertExchange&) = delete;
  ExpertExchange& operator=(const ExpertExchange&) = delete;
  ~ExpertExchange();

  // One call's plan, from every rank's host routing ([world][T*k] ids and weights, already
  // validated): the receive schedule and the device row maps (waits for `stream` first).
  void plan(const std::vector<int32_t>& all_ids, const std::vector<float>& all_weights, int64_t tokens,
            cudaStream_t stream);
  // The plan's schedule for the grouped GEMMs: counts [E_local], offsets [E_local + 1].
  void upload_schedule(int32_t* counts, int32_t* offsets) const;

  int64_t received_rows() const { return received_; }
  int64_t grouped_rows() const { return schedule_.total_rows(); }
  const std::vector<int64_t>& expert_rows() const { return schedule_.expert_rows; }
  // Grouped row of the i-th received route ([received_rows]); the router weight of that route.
  const int32_t* row_of_received() const { return row_of_received_; }
  const float* received_weights() const { return received_weights_; }
  // Position in the combine buffer (send order) of slot token*k+j ([T*k]).
  const int32_t* send_position_of_slot() const { return send_position_; }

  // grouped[row of each received route] = tokens[route's token] (x or d_out rows of `width`).
  void dispatch(const bf16* tokens, bf16* grouped, int64_t width, cudaStream_t stream);
  // Returns grouped rows to their origin: by_send_position[send position] = grouped[row].
  void combine(const bf16* grouped, bf16* by_send_position, int64_t width, cudaStream_t stream);
  // The same for one float per route (d_topk_weights), landing in slot order.
  void combine_scalars(const float* per_received, float* per_slot, cudaStream_t stream);

 private:
  // Row counts (in rows) this rank sends to / receives from every peer.
  void exchange(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                const std::vector<int64_t>& recv_rows, size_t row_bytes, cudaStream_t stream);
  template <typename T>
  T* staging(int which, size_t elems);

  DeviceGroup& group_;
  MoeShape shape_;
  int64_t tile_rows_;
  core::ReceiveSchedule schedule_;
  core::SendPlan send_plan_;
  int64_t tokens_ = 0, received_ = 0;
  std::vector<int64_t> send_rows_, recv_rows_;
  int32_t* row_of_received_ = nullptr;  // device
  int32_t* received_of_row_ = nullptr;  // device, [grouped_rows], -1 for padding
  int32_t* send_position_ = nullptr;    // device
  float* received_weights_ = nullptr;   // device
  size_t map_capacity_ = 0, weight_capacity_ = 0, slot_capacity_ = 0, row_capacity_ = 0;
  void* staging_[3] = {};
  size_t staging_bytes_[3] = {};
};

}  // namespace moka::cuda
