// The g and u rows a resident megakernel forward saves for its backward by slot (T*k rows per
// rank's tokens, no per-expert padding), unpacked into the grouped, padded rows the backward
// megakernel reads before it runs (launch.hpp).
#include <string>

#include "cuda/common/check.hpp"
#include "cuda/megakernel/launch.hpp"

namespace moka::cuda {
namespace {

constexpr int kWarps = 8;  // rows per CTA: one warp copies one row

__global__ void unpack_saved_rows_kernel(SavedRows r) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= r.grouped_rows || row >= *r.schedule_rows) return;
  const int32_t slot = r.slot_of_row[row];
  bf16* grouped = r.grouped + row * r.width;
  auto* to = reinterpret_cast<uint4*>(grouped);
  if (slot < 0 || slot >= r.slots) {  // a padding row
    for (int64_t v = threadIdx.x % 32; v < r.width / 8; v += 32) to[v] = uint4{};
    return;
  }
  const auto* from = reinterpret_cast<const uint4*>(r.by_slot + int64_t(slot) * r.width);
  for (int64_t v = threadIdx.x % 32; v < r.width / 8; v += 32) to[v] = from[v];  // 16-byte vectors
}

}  // namespace

void unpack_saved_rows(const SavedRows& rows, cudaStream_t stream) {
  require(rows.width % 8 == 0, ErrorCode::unsupported_size,
          "saved g and u rows need a width that is a multiple of 8, got " + std::to_string(rows.width));
  for (const bf16* p : {rows.grouped, rows.by_slot})
    require(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0, ErrorCode::invalid_argument,
            "saved g and u rows need 16-byte aligned buffers");
  require(rows.slot_of_row != nullptr && rows.schedule_rows != nullptr, ErrorCode::invalid_argument,
          "saved g and u rows need the schedule's slot_of_row and row count");
  if (rows.grouped_rows == 0 || rows.slots == 0) return;
  const auto ctas = static_cast<unsigned>((rows.grouped_rows + kWarps - 1) / kWarps);
  unpack_saved_rows_kernel<<<ctas, kWarps * 32, 0, stream>>>(rows);
  MOKA_CUDA_CHECK_LAUNCH();
}

}  // namespace moka::cuda
