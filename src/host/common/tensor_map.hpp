// TMA tensor maps for the GEMM launchers (grouped_gemm.cu, grouped_wgrad.cu, grouped_wgrad_fp8.cu):
// bf16 matrices with the 128-byte swizzle that the wgmma descriptors and the staged epilogues
// expect, zeros out of bounds. The driver's encoder is found through the runtime, so the library
// does not link against libcuda.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "host/common/check.hpp"
#include "machmoe/types.hpp"

namespace machmoe::detail {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q),
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (q != cudaDriverEntryPointSuccess || !ptr)
      throw Error(ErrorCode::CudaError, "the driver has no cuTensorMapEncodeTiled (needs CUDA 12+)");
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// Encodes a map of `rank` dims (dims[0] innermost; strides in bytes for dims 1..) or throws.
inline CUtensorMap encode_map(CUtensorMapDataType type, const void* ptr, int rank, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle,
                              const char* fn) {
  CUtensorMap map;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&map, type, rank, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCode::CudaError, std::string(fn) + ": cuTensorMapEncodeTiled failed with CUresult " +
                                          std::to_string(static_cast<int>(r)));
  return map;
}

// A bf16 tensor of `rank` dims (dims[0] innermost, strides in bytes for dims 1..), boxes `box`.
inline CUtensorMap encode_bf16_map(const void* ptr, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                                   const cuuint32_t* box, const char* fn) {
  return encode_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, ptr, rank, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, fn);
}

// An e4m3 matrix [rows, cols] (rows `cols` bytes apart) in boxes of 128 columns x 128 rows with the
// 128-byte swizzle: one box row is one swizzle row and one FP8 scale group (128 codes along the
// reduction dimension). Zeros out of bounds, which partial last K blocks and rows past the end
// rely on. The FP8 GEMMs' K-major operands (cols = K).
inline CUtensorMap e4m3_tile_map(const void* ptr, int64_t rows, int64_t cols, const char* fn) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols)};
  const cuuint32_t box[2] = {128, 128};
  return encode_map(CU_TENSOR_MAP_DATA_TYPE_UINT8, ptr, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, fn);
}

// The column operands of the FP8 weight gradients, e4m3 [chunks, rows, 128] (one 128-row chunk of
// an expert per block, machmoe/fp8.hpp), as a 3-D map {128, rows, chunks} in boxes of one chunk's
// 128 codes x 128 rows, 128-byte swizzle: the box of chunk c, rows r0 .. is the wgmma's K-major
// tile, and rows past the end read as zeros.
inline CUtensorMap e4m3_chunk_map(const void* ptr, int64_t chunks, int64_t rows, const char* fn) {
  const cuuint64_t dims[3] = {128, static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(chunks)};
  const cuuint64_t strides[2] = {128, static_cast<cuuint64_t>(rows) * 128};
  const cuuint32_t box[3] = {128, 128, 1};
  return encode_map(CU_TENSOR_MAP_DATA_TYPE_UINT8, ptr, 3, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B, fn);
}

// An fp32 matrix [rows, cols] (cols % 4 == 0: rows 16-byte multiples apart) in boxes of box_cols
// columns of one row, unswizzled: a chunk's scales of box_cols consecutive columns, zeros past
// the last column.
inline CUtensorMap f32_row_map(const void* ptr, int64_t rows, int64_t cols, int box_cols, const char* fn) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), 1};
  return encode_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, ptr, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE, fn);
}

// A bf16 matrix [rows, cols] with `ld` elements between rows, boxes of box_cols x box_rows.
inline CUtensorMap tensor_map_2d(const void* ptr, int64_t rows, int64_t cols, int64_t ld, int box_cols, int box_rows,
                                 const char* fn) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  return encode_bf16_map(ptr, 2, dims, strides, box, fn);
}

// An [E, rows, cols] bf16 tensor (cols contiguous, experts rows·cols apart) as a 3-D map
// {cols, rows, E} with boxes of box_cols x box_rows of one expert (box_cols = 64: one 128-byte
// swizzle row). The bounds clip a box at the expert's last row and column: a load past them reads
// zeros, a store past them writes nothing, never the next expert's slice.
inline CUtensorMap tensor_map_experts(const void* ptr, int64_t E, int64_t rows, int64_t cols, int box_cols,
                                      int box_rows, const char* fn) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(E)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2, static_cast<cuuint64_t>(rows * cols) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1};
  return encode_bf16_map(ptr, 3, dims, strides, box, fn);
}

// W [E, K, N] (N contiguous, an N-major GEMM operand) in boxes of 64 N x box_k K rows of one
// expert: K rows past the expert's K read as zeros, never the next expert's rows.
inline CUtensorMap tensor_map_nmajor(const void* ptr, int64_t E, int64_t K, int64_t N, int box_k, const char* fn) {
  return tensor_map_experts(ptr, E, K, N, 64, box_k, fn);
}

}  // namespace machmoe::detail
