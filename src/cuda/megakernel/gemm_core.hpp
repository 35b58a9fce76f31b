// The forward megakernel's compute role alone, on one GPU, over rows already grouped by expert:
// its gate|up tiles (SwiGLU epilogue) and down tiles in the plan's order, through its tickets and
// counters, with no communication CTA (every routed row counts as dispatched before the launch).
// It measures the megakernel's GEMM core against the CUTLASS grouped GEMMs on the same rows
// (`bench/kernels/mk_forward_core`); the shape's shared expert is left out (the CUTLASS grouped GEMMs
// it is compared with cover the routed experts).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_memory.hpp"
#include "cuda/megakernel/launch.hpp"
#include "moka/config.hpp"
#include "moka/megakernel.hpp"

namespace moka::cuda {

// Expert-grouped rows (each expert's segment padded to 128 rows, as build_schedule lays them
// out) and where the core writes; every buffer holds MegakernelCore::rows() rows.
struct GroupedExpertRows {
  const bf16* x = nullptr;                                 // [rows, H] grouped input
  const int32_t* offsets = nullptr;                        // [E + 1] padded segment starts
  bf16 *gate = nullptr, *up = nullptr, *hidden = nullptr;  // [rows, I] each
  bf16* y = nullptr;                                       // [rows, H]
};

class MegakernelCore {
 public:
  // `tokens` routed top_k times each over all shape.num_experts experts (EP = 1).
  MegakernelCore(const MoeShape& shape, const MegakernelConfig& config, int64_t tokens);
  // Rows every buffer of GroupedExpertRows must hold (one ring holding every grouped row).
  int64_t rows() const { return plan_.ring_rows; }
  // Enqueues one run on `stream` (no host synchronization; capturable).
  void run(const GroupedExpertRows& rows, const bf16* w_gate, const bf16* w_up, const bf16* w_down,
           cudaStream_t stream);
  // After the stream is synchronized: throws the kernel's failure (a timed-out wait), if any.
  void check_errors();

 private:
  MoeShape shape_;
  MegakernelConfig config_;
  int64_t tokens_;
  core::MegakernelPlan plan_;
  int num_sms_ = 0;
  DeviceArray<int64_t> initial_counters_, counters_;
  DeviceArray<MegakernelControl> control_;
};

}  // namespace moka::cuda
