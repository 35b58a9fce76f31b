// The device memory of the megakernel layer on one GPU (EP = 1; src/cuda/megakernel/layer.cu):
// every buffer it allocates, with its bytes, from the plans its kernels run. The backward's
// per-call workspace is allocated from backward_workspace_elements itself; the forward's buffers
// follow forward_layer.hpp (allocate_saved, ForwardScratch) and the layer's constructor, which
// name this file. `moka bench`'s memory columns (tools/gpu/bench_memory.cpp) measure what this
// predicts; tests/core/test_megakernel_memory.cpp prints it for the named shapes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/hd.hpp"
#include "core/megakernel_backward_plan.hpp"
#include "core/megakernel_plan.hpp"
#include "moka/config.hpp"

namespace moka::core {

// The GPU's tiling of the backward plan: tile_m 128, 256-column single tiles, 128-column pairs
// (cuda/megakernel/backward.hpp's kBackwardGpuTiling).
inline constexpr BackwardTiling kGpuBackwardTiling{256, 128};

// fp32 elements of one macrobatch boundary's carry on the GPU: dW_gate|up as the pair tiles
// compute them ([H, 2 * I rounded up to 128]: column tile c holds 128 gate columns then 128 up
// columns, read back only by the same tile) and dW_down [H, I].
MOKA_HD int64_t backward_carry_floats(int64_t hidden, int64_t intermediate) {
  return hidden * (2 * ((intermediate + 127) / 128 * 128) + intermediate);
}

// Elements of one backward call's workspace (backward.cu's CallWorkspace): the ring's bf16 rows
// (d_out, x and, unless the dx tiles store into the d_x slots, dx: H wide; dg, du, hs and in
// replay g, u: I wide; over a consumed context only hs),
// the shared expert's bf16 rows (dg, du, hs and in replay g, u: Is wide, whole row tiles; its dx:
// [T, H]), the ring's fp32 route weight and d_w partials, the shared expert's partials and the
// weight-gradient carries (one per macrobatch boundary). `overwrite`: dg and du are written over
// the consumed context's g and u. Every count is at least 1 but the carries' (0: none).
struct BackwardWorkspaceElements {
  int64_t ring_bf16 = 0, shared_bf16 = 0;
  int64_t ring_float = 0, shared_partials = 0, carries = 0;
};
inline BackwardWorkspaceElements backward_workspace_elements(const MegakernelBackwardPlan& p, bool overwrite,
                                                             bool dx_in_ring = true) {
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, ring = p.ring_rows;
  const int64_t shared_rows = p.shared_row_tiles * p.tile_m;
  const int64_t shared_i_rows = p.mode == ContextMode::replay ? 5 : 3;
  const int64_t i_rows = overwrite ? 1 : shared_i_rows;
  auto at_least_one = [](int64_t n) { return n > 0 ? n : int64_t(1); };
  BackwardWorkspaceElements e;
  e.ring_bf16 = ring * ((dx_in_ring ? 3 : 2) * H + i_rows * I);
  e.shared_bf16 = at_least_one(shared_rows * shared_i_rows * Is + (Is > 0 ? p.tokens * H : 0));
  e.ring_float = ring * (1 + p.dgd_col_tiles);
  e.shared_partials = at_least_one(p.tokens * p.shared_dgd_col_tiles);
  e.carries = (p.max_macrobatches - 1) * backward_carry_floats(H, I);
  return e;
}

// Whether a resident context keeps g and u by slot (T*k rows per rank's tokens: a pack after the
// forward's kernel and an unpack before the backward's, 1-4% of the megakernel step on one H200)
// rather than as the kernel's grouped rows (`ring_rows`, each expert padded to whole row tiles):
// where the padding exceeds a tenth of the routed rows, the bound on the bytes a context saves
// (docs/PERFORMANCE.md, "Memory").
inline bool saves_rows_by_slot(int64_t ring_rows, int64_t slots) { return ring_rows * 10 > slots * 11; }

struct MemoryItem {
  std::string name;
  int64_t bytes = 0;
};
inline int64_t total_bytes(const std::vector<MemoryItem>& items) {
  int64_t sum = 0;
  for (const MemoryItem& i : items) sum += i.bytes;
  return sum;
}

// What one layer holds, at EP = 1, for calls of `tokens` (<= max_tokens), by lifetime.
struct MegakernelLayerMemory {
  bool resident = false;  // the backward reads saved g and u (else it replays gate|up)
  int64_t capacity_rows = 0, ring_rows = 0, macrobatches = 0;
  std::vector<MemoryItem> layer;     // the layer's life: its schedule tables, counters (the larger ones)
  std::vector<MemoryItem> saved;     // one context, forward to backward
  std::vector<MemoryItem> forward;   // one forward's scratch beyond what it saves
  std::vector<MemoryItem> backward;  // one consume_backward's workspace
  // Resident: `saved_rows` of `saved` are g and u, allocated with the forward's scratch (grouped
  // rows, the kernel's), or by slot (saves_rows_by_slot): stored so by the kernel, and unpacked
  // by consume_backward into grouped rows of its own before its kernel, one of the two at a
  // time; what the context's schedule comes with at that peak.
  bool by_slot = false;
  int64_t saved_rows = 0, unpack_peak = 0;
};

// `save_gate_up`: LayerOptions::save is SaveMode::gate_up (the backward is resident where the
// ring holds every row of max_tokens); false: SaveMode::none (replay).
inline MegakernelLayerMemory megakernel_layer_memory(const MoeShape& shape, const MegakernelConfig& config,
                                                     int64_t max_tokens, int64_t tokens, bool save_gate_up = true) {
  const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate, k = shape.top_k;
  const int64_t E = shape.num_experts, T = tokens, bf16 = 2, f32 = 4, i32 = 4, i64 = 8;
  const MegakernelDims worst_dims{1, max_tokens, k, H, I, Is, E}, dims{1, tokens, k, H, I, Is, E};
  const MegakernelPlan worst = build_megakernel_plan(config, worst_dims), plan = build_megakernel_plan(config, dims);
  MegakernelLayerMemory m;
  m.resident = save_gate_up && worst.ring_rows >= worst.capacity_rows;
  const ContextMode mode = m.resident ? ContextMode::resident : ContextMode::replay;
  const MegakernelBackwardPlan worst_backward = build_backward_plan(config, {worst_dims, mode, kGpuBackwardTiling});
  const MegakernelBackwardPlan backward = build_backward_plan(config, {dims, mode, kGpuBackwardTiling});
  m.capacity_rows = plan.capacity_rows;
  m.ring_rows = plan.ring_rows;
  m.macrobatches = backward.max_macrobatches;
  const int64_t ring = plan.ring_rows, slots = T * k;

  m.layer = {{"routing ids and slot tables (forward)", (4 + max_tokens * k + 2 * max_tokens * k) * i32},
             {"forward counters", counter_count(worst) * i64},
             {"backward segment table",
              max_segments(worst_backward) * int64_t(sizeof(WeightGradSegment)) + (worst_backward.max_steps + 1) * i64},
             {"backward counters", counter_count(worst_backward) * i64},
             {"shared expert's route weight (ones)", max_tokens * f32}};

  m.saved = {{"schedule (counts, offsets, slot_of_row)", (2 * E + 1 + plan.capacity_rows) * i32}};
  const int64_t grouped_gate_up = 2 * ring * I * bf16, shared_gate_up = 2 * T * Is * bf16;
  m.by_slot = m.resident && saves_rows_by_slot(ring, slots);
  if (m.resident) {
    m.saved_rows = m.by_slot ? 2 * slots * I * bf16 : grouped_gate_up;
    m.saved.push_back({m.by_slot ? "g, u by slot [T*k, I] x2" : "g, u rows [ring, I] x2", m.saved_rows});
    if (Is > 0) m.saved.push_back({"shared g, u [T, Is] x2", shared_gate_up});
  } else if (Is > 0) {
    m.forward.push_back({"shared g, u [T, Is] x2", shared_gate_up});
  }
  if (!m.by_slot)
    m.forward.push_back({m.resident ? "g, u rows [ring, I] x2 (the context's)"
                                    : "g, u rows [ring, I] x2 (replay: freed after the kernel)",
                         grouped_gate_up});
  m.forward.push_back({"ring x [ring, H] (y: by slot into the combine slots)", ring * H * bf16});
  m.forward.push_back({"ring hidden [ring, I]", ring * I * bf16});
  if (Is > 0) m.forward.push_back({"shared hidden, out", T * (Is + H) * bf16});
  m.forward.push_back({"combine slots [T*k, H]", slots * H * bf16});

  // Resident: dg and du are written over grouped g and u rows, the context's or (by slot) the
  // call's own unpacked copy (with one macrobatch). EP = 1: the dx tiles store into the d_x
  // slots, so the ring has no d_x rows.
  const bool overwrite = m.resident && backward.max_macrobatches == 1;
  const BackwardWorkspaceElements w = backward_workspace_elements(backward, overwrite, false);
  if (m.by_slot) m.unpack_peak = std::max(m.saved_rows + grouped_gate_up / 2, m.saved_rows / 2 + grouped_gate_up);
  if (m.resident)
    m.backward.push_back({m.by_slot ? "g, u rows [ring, I] x2 (unpacked; dg, du over them)"
                                    : "g, u rows [ring, I] x2 (the context's; dg, du over them)",
                          grouped_gate_up});
  m.backward.push_back({"d_x slots [T*(k-1), H] (slot 0: d_x itself)", (slots - T) * H * bf16});
  m.backward.push_back(
      {overwrite ? "ring d_out, x (H) and hs (I)"
                 : (m.resident ? "ring d_out, x (H) and dg, du, hs (I)" : "ring d_out, x (H) and g, u, dg, du, hs (I)"),
       w.ring_bf16 * bf16});
  m.backward.push_back({"ring route weights and d_w partials (fp32)", w.ring_float * f32});
  m.backward.push_back({"shared expert's rows", w.shared_bf16 * bf16 + w.shared_partials * f32});
  if (w.carries > 0) m.backward.push_back({"weight-gradient carries (fp32)", w.carries * f32});
  return m;
}

// The peak of `moka bench --depth D` for this path (tools/gpu/bench_memory.cpp): D layers, forward
// through all, then consume_backward through all in reverse, with the bf16 [T, H] activations
// between the layers (outputs, input gradients) from the same allocator; the caller's inputs,
// weights and gradients are not counted. The backward of the last layer is the peak wherever a
// backward's workspace outweighs a forward's scratch: every other context, the consumed one's
// schedule, its workspace, D - 1 outputs and one input gradient.
inline int64_t megakernel_stack_peak_bytes(const MegakernelLayerMemory& m, const MoeShape& shape, int64_t tokens,
                                           int depth) {
  const int64_t activation = tokens * shape.hidden * 2, saved = total_bytes(m.saved);
  const int64_t schedule = saved - m.saved_rows;  // what a context holds while its g, u are grouped rows
  // A forward's own context: by slot, whole from its start; else its grouped g, u are the
  // forward's scratch.
  const int64_t forward = (m.by_slot ? saved : schedule) + total_bytes(m.forward);
  const int64_t backward = std::max(total_bytes(m.backward), m.unpack_peak);
  int64_t peak = 0;
  for (int i = 0; i < depth; ++i) {  // forward i: i contexts before it, outputs 0..min(i, D - 2)
    const int64_t outputs = i + 1 < depth ? i + 1 : i;
    peak = std::max(peak, i * saved + forward + outputs * activation);
  }
  for (int i = depth - 1; i >= 0; --i) {  // backward i: contexts 0..i - 1, outputs 0..i-1, d_x, d_out
    const int64_t activations = i + (i > 0 ? 1 : 0) + (i + 1 < depth ? 1 : 0);
    peak = std::max(peak, i * saved + schedule + backward + activations * activation);
  }
  return depth * total_bytes(m.layer) + peak;
}

}  // namespace moka::core
