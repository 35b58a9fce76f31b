// The FP8 recipe's quantizers on the GPU (docs/FP8.md): bf16 values to e4m3 codes and fp32
// scales, code for code and scale for scale what core/fp8.hpp gives for the same values (its
// NaN-propagating amax and amax / 448 at least FLT_MIN run here; the codes are IEEE divisions
// converted by the hardware's round-to-nearest-even, saturating e4m3 conversion, which
// core::float_to_e4m3 reproduces). The scales land where the e4m3 grouped GEMM reads them
// (grouped_gemm.hpp, GroupSpec): the values are core/fp8.hpp's, the layouts CUTLASS's.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace moka::cuda {

// x: bf16 [rows, cols] with row pitch ld -> codes [rows, cols] (pitch cols) and one scale per
// 1x128 tile of a row. The rows are cut into segments, segment s = rows [offsets[s],
// offsets[s + 1]) (an expert's rows in a grouped buffer; offsets: device, segments + 1 entries,
// ascending), whose scales are a [ceil(cols / 128), segment rows] block (rows contiguous) at
// float offsets[s] * ceil(cols / 128): A's layout in the e4m3 grouped GEMM. offsets null: one
// segment of all rows. Rows outside every segment are not read or written. cols and ld: multiples
// of 8, x 16-byte aligned (16-byte loads).
void quantize_rows_e4m3(const void* x, int64_t rows, int64_t cols, int64_t ld, const int32_t* offsets, int segments,
                        uint8_t* codes, float* scales, cudaStream_t stream);

// The weight gradients' operands (dY^T X, K = an expert's rows): x bf16 [rows, cols] (row pitch
// ld), cut into segments as above (offsets null: one segment of all rows) -> each segment's K-major
// copy, quantized per 1x128 tile along its rows (one scale per column per 128 of the segment's
// rows, counted from its first row). codes: [cols, core::transposed_pitch(rows, segments)], row c
// holding column c of segment s's rows, in order, from column core::transposed_column(offsets[s],
// s); scales: [core::transposed_blocks(rows, segments), cols], segment s's blocks from row
// core::transposed_block(offsets[s], s): the layout of the e4m3 tile-scaled grouped GEMM's groups
// sized along k (grouped_gemm.hpp). Rows outside every segment are not read, and the columns and
// scale rows between segments not written. cols and ld: multiples of 8; x and codes 16-byte
// aligned.
void quantize_columns_e4m3(const void* x, int64_t rows, int64_t cols, int64_t ld, const int32_t* offsets, int segments,
                           uint8_t* codes, float* scales, cudaStream_t stream);

// w: bf16 [batch, rows, cols] (an expert's weights [N, K] per batch entry) -> codes of the same
// shape and one scale per 128x128 block, each batch entry's scales a [ceil(cols / 128),
// ceil(rows / 128)] block (row blocks contiguous) at batch index * that size: B's layout in the
// e4m3 grouped GEMM. cols: a multiple of 4. With codes_t and scales_t (both or neither), the same
// pass writes w^T's quantization too, the B of the data gradients (dY W = dY (W^T)^T): codes
// [batch, cols, rows] and scales [ceil(rows / 128), ceil(cols / 128)] per batch entry. A 128x128
// block's scale does not depend on its orientation, so these are the codes and scales of
// quantizing w^T itself (docs/FP8.md); rows: a multiple of 16 then.
void quantize_blocks_e4m3(const void* w, int64_t batch, int64_t rows, int64_t cols, uint8_t* codes, float* scales,
                          uint8_t* codes_t, float* scales_t, cudaStream_t stream);

}  // namespace moka::cuda
