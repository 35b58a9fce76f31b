// The forward MoE megakernel (MoK design rebuilt for Hopper; docs/MEGAKERNEL.md): one
// persistent kernel per layer call and GPU overlaps the NVLink dispatch (pull), the routed
// SwiGLU experts, the shared expert and the combine (push). Forward only; bf16.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moka/config.hpp"
#include "moka/layer.hpp"

namespace moka {

// Knobs of the megakernel (validated: Error invalid_argument naming the field).
struct MegakernelConfig {
  int num_comm_sms = 16;             // CTAs (one per SM) doing dispatch/combine; the rest compute (moka tune)
  int64_t minibatch_size = 4096;     // rows; a multiple of tile_m; the unit of overlap
  int64_t macrobatch_size = 131072;  // rows of the ring buffer; a multiple of minibatch_size
  // Worst-case share of all EP*T*k routes landing on one rank; sizes the schedule tables:
  // T*k*max(2, ceil(EP*capacity_multiplier)) routed rows (never more than EP*T*k) plus padding.
  double capacity_multiplier = 0.5;
  int64_t tile_m = 128;  // GEMM M tile = expert padding = dispatch/combine row block (GPU: 128)
  int64_t tile_n = 128;  // GEMM N tile (hidden columns per gate|up tile, output columns per down; GPU: 128)
  double spin_timeout_seconds = 30.0;  // bound of every in-kernel wait
  // Order of the sources' rows in each expert segment, which is the order dispatch pulls them
  // and combine pushes them back: rate-based keeps every peer's flow at its share of the bytes.
  RowOrder row_order = RowOrder::rate_based;
};

// One task of a timeline (start/end in GPU global-timer nanoseconds).
struct MegakernelTaskSpan {
  int64_t start_ns = 0, end_ns = 0;
  int cta = 0;
  const char* kind = "";  // shared_gate_up, shared_down, dispatch, gate_up, down, combine
  int64_t step = 0, row_tile = 0;
};

class DeviceGroup;

// The CUDA megakernel forward of one MoE layer. forward() only enqueues work on the given
// stream: no host synchronization, capturable in a CUDA graph.
// Errors found on the device (capacity exceeded, an expert id out of range or token counts that
// disagree on any rank, a wait that timed out) are raised by check_errors() after the caller
// has synchronized the stream, on every rank, naming the rank; a later forward() raises them
// too once the earlier call has finished.
class MegakernelForward {
 public:
  virtual ~MegakernelForward() = default;
  // x [T, H] bf16, topk_ids [T, k] i32, topk_weights [T, k] f32, out [T, H] bf16, T <= max_tokens
  // and the same T on every rank. Collective: every rank of the group calls it.
  virtual void forward(const MoeInputs& in, const MoeWeights& weights, const TensorView& out, Stream stream) = 0;
  virtual void check_errors() = 0;
  // Records per-task start/end stamps in later calls (a little slower); timeline() returns the
  // last call's tasks after the stream is synchronized.
  virtual void record_timeline(bool on) = 0;
  virtual std::vector<MegakernelTaskSpan> timeline() = 0;
  // Grouped rows each local expert received in the last call (waits for its stream).
  virtual std::vector<int64_t> local_expert_rows() = 0;
  virtual const MegakernelConfig& config() const = 0;
};

// `group` null: one GPU (dispatch pulls from itself). Collective over the group; allocates its
// symmetric buffers for up to `max_tokens` tokens per rank.
std::unique_ptr<MegakernelForward> make_megakernel_forward(const MoeShape& shape, DeviceGroup* group,
                                                           const MegakernelConfig& config, int64_t max_tokens);

}  // namespace moka
