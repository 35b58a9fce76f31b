// The forward MoE megakernel (MoK design rebuilt for Hopper; docs/MEGAKERNEL.md): one
// persistent kernel per layer call and GPU overlaps the NVLink dispatch (pull), the routed
// SwiGLU experts, the shared expert and the combine (push). bf16. It is a path of MoeLayer
// (LayerOptions::path = LayerPath::megakernel, or automatic); this header holds its knobs and
// the extension a megakernel layer exposes through MoeLayer::megakernel().
#pragma once
#include <cstdint>
#include <vector>

#include "moka/config.hpp"

namespace moka {

// Knobs of the megakernel (validated: Error invalid_argument naming the field).
struct MegakernelConfig {
  int num_comm_sms = 16;             // CTAs (one per SM) doing dispatch/combine; the rest compute (moka tune)
  int64_t minibatch_size = 4096;     // rows; a multiple of tile_rows; the unit of overlap
  int64_t macrobatch_size = 131072;  // rows of the ring buffer; a multiple of minibatch_size
  // Worst-case share of all EP*T*k routes landing on one rank; sizes the schedule tables:
  // T*k*max(2, ceil(EP*capacity_multiplier)) routed rows (never more than EP*T*k) plus padding.
  double capacity_multiplier = 0.5;
  // GEMM M tile = expert padding = dispatch/combine row block (GPU: 128). A MoeLayer takes it
  // from LayerOptions::tile_rows.
  int64_t tile_rows = 128;
  int64_t tile_n = 128;       // GEMM N tile of gate|up: hidden columns per tile (GPU: 128)
  int64_t down_tile_n = 256;  // GEMM N tile of down: output columns per tile (GPU: 256)
  // Order of one GEMM's tiles in a minibatch: bands of this many row tiles, column tile by column
  // tile inside a band, so the ~100 tiles that run at once share a few operand tiles through L2
  // instead of each streaming its own weight tile from DRAM. 1: row by row.
  int64_t band_row_tiles = 16;
  // Bound of every in-kernel wait and device barrier before a hang is reported as a timeout
  // (the compute CTAs' pipeline waits add it again, clamped to [0.1 s, 1 s], their task-queue waits
  // twice that).
  // 30 s suits training; tests set it to seconds.
  double spin_timeout_seconds = 30.0;
  // Order of the sources' rows in each expert segment, which is the order dispatch pulls them
  // and combine pushes them back: rate-based keeps every peer's flow at its share of the bytes.
  // A MoeLayer takes it from LayerOptions::row_order.
  RowOrder row_order = RowOrder::rate_based;
};

// One task of a timeline (start/end in GPU global-timer nanoseconds).
struct MegakernelTaskSpan {
  int64_t start_ns = 0, end_ns = 0;
  int cta = 0;
  const char* kind = "";  // shared_gate_up, shared_down, dispatch, gate_up, down, combine
  int64_t step = 0, row_tile = 0;
};

// What only the megakernel path has, reached through MoeLayer::megakernel() (null on the other
// paths).
class MegakernelExtension {
 public:
  virtual ~MegakernelExtension() = default;
  virtual const MegakernelConfig& config() const = 0;
  // Whether the backward reads the forward's gate and up rows (resident context: the ring holds
  // every routed row the layer can have; x is pulled again) or pulls x and recomputes gate|up
  // (replay).
  virtual bool backward_is_resident() const = 0;
  // Records per-task start/end stamps in later calls (a little slower); timeline() returns the
  // last call's tasks after its stream is synchronized.
  virtual void record_timeline(bool on) = 0;
  virtual std::vector<MegakernelTaskSpan> timeline() = 0;
};

}  // namespace moka
