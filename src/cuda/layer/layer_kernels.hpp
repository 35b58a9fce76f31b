// Launchers of the non-GEMM kernels of the CUDA layer: the device-side routing schedule, row
// gathers, the SwiGLU epilogues and the fixed-order token reductions. All stream-ordered, with
// no host synchronization and no floating-point atomics (results are bitwise reproducible).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <string>

#include "core/activation.hpp"
#include "moka/config.hpp"
#include "moka/error.hpp"

namespace moka::cuda {

using bf16 = __nv_bfloat16;

// Device receive schedule of one rank: the placement equals core::build_receive_schedule's
// (same counts, padded offsets and row-order rule). With world_size > 1 the ids are every
// source rank's ([world_size][T*k], as the megakernel's routing exchange leaves them) and
// routes are counted per (local expert, source).
struct DeviceSchedule {
  int64_t slots = 0;           // T * k per source rank
  int64_t num_experts = 0;     // local experts
  int64_t first_expert = 0;    // global id of local expert 0
  int64_t global_experts = 0;  // ids outside [0, global_experts) are invalid input
  int64_t tile_rows = 128;
  int64_t top_k = 1;
  int world_size = 1;  // source ranks in the ids
  int rank = 0;        // the receiving rank (rate-based ties are staggered from it)
  RowOrder row_order = RowOrder::round_robin;
  int32_t* chunk_counts = nullptr;   // [chunks][E * world_size] scratch
  int32_t* counts = nullptr;         // [E] routed rows per expert
  int32_t* source_counts = nullptr;  // [E][world_size] routes per (expert, source); may be null on one rank
  int32_t* offsets = nullptr;        // [E + 1] padded segment starts
  int32_t* row_of_slot = nullptr;    // [world_size * T * k] grouped row of each source slot; -1 if not local
  // First invalid routing entry, encoded (slot << 2 | code) with code 1 = id out of range,
  // 2 = duplicate id in a token, 3 = non-finite weight; ~0 when none. Device-visible host memory.
  unsigned long long* error = nullptr;
};
inline constexpr int kScheduleChunk = 256;      // slots per block of the counting passes
inline constexpr int kMaxScheduleSources = 64;  // source ranks one device schedule takes
int64_t schedule_chunks(int64_t slots);

// Counts, offsets and rows; on one rank also the routing check (weights must then be given).
// Across ranks each rank checks its own routing before the exchange, so nothing is checked here.
void build_schedule(const DeviceSchedule& s, const int32_t* topk_ids, const float* topk_weights, cudaStream_t stream);

inline constexpr unsigned long long kNoRoutingError = ~0ull;
// The error a DeviceSchedule::error code stands for, naming the entry [t, j] after `context`.
Error routing_error(unsigned long long code, int64_t top_k, int64_t num_experts, const std::string& context);

// dst[row_of_slot[s]] = src[s / k] for every local slot s < slots (rows of `width` bf16;
// a negative row_of_slot entry skips its slot).
void gather_rows(const bf16* src, bf16* dst, const int32_t* row_of_slot, int64_t slots, int64_t top_k, int64_t width,
                 cudaStream_t stream);

// dst[i] = src[index[i]] for i < n (one float per route, e.g. d_topk_weights into slot order).
void gather_scalars(const float* src, float* dst, const int32_t* index, int64_t n, cudaStream_t stream);
// dst[index[i]] = src[i] for i < n.
void scatter_scalars(const float* src, float* dst, const int32_t* index, int64_t n, cudaStream_t stream);

// hidden = act(gate, up) for the rows named by row_of_slot (or rows 0..rows-1 when null): the
// layer's activation pass. LayerOptions::fused_swiglu computes the same bits in the gate GEMM's
// epilogue instead (swiglu_epilogue.cuh).
using ActParams = core::ActParams;
void swiglu_forward_rows(const bf16* gate, const bf16* up, bf16* hidden, const int32_t* row_of_slot, int64_t rows,
                         int64_t width, ActParams act, cudaStream_t stream);

// Backward of the activation for the same rows, hidden = act(gate, up) recomputed (the same bits
// as swiglu_forward_rows wrote). With weights (routed rows):
//   d_weight[s] = <dh_u[row], hidden[row]>,  dh = w[s] * dh_u[row],  scaled_hidden[row] = w[s] * hidden[row].
// Without (shared expert): w = 1, d_weight is not written and scaled_hidden (if given) gets hidden.
// d_gate may be dh_u, d_up up and scaled_hidden gate (in place: every element is read by the
// thread that then writes it, before it writes it).
void swiglu_backward_rows(const bf16* gate, const bf16* up, const bf16* dh_u, const float* weights, float* d_weight,
                          bf16* scaled_hidden, bf16* d_gate, bf16* d_up, const int32_t* row_of_slot, int64_t rows,
                          int64_t width, ActParams act, cudaStream_t stream);

// out[t] = shared[t] + sum_j w[t, j] * y[row_of_slot[t*k + j]], fp32, j in order. shared may be
// null; a null row_of_slot reads y[t*k + j] (the megakernel's combine buffer).
void combine_tokens(const bf16* y, const float* weights, const bf16* shared, bf16* out, const int32_t* row_of_slot,
                    int64_t tokens, int64_t top_k, int64_t width, cudaStream_t stream);

// d_x[t] = (sa[t] + sb[t]) + sum_j (ra[row] + rb[row]), fp32, in that fixed order: the
// gate and up halves of each route's input gradient. sa/sb may be null (no shared expert).
void reduce_input_grads(const bf16* ra, const bf16* rb, const bf16* sa, const bf16* sb, bf16* d_x,
                        const int32_t* row_of_slot, int64_t tokens, int64_t top_k, int64_t width, cudaStream_t stream);

// Zeroes `per_expert` elements of each buffer for every expert with no routed row (the grouped
// weight-gradient GEMM gives such experts no tiles).
void zero_empty_experts(const int32_t* counts, int64_t experts, bf16* a, bf16* b, bf16* c, int64_t per_expert,
                        cudaStream_t stream);

}  // namespace moka::cuda
