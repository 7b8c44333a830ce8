// PTX wrappers the FP8 GEMM needs beyond sm90_ptx.cuh: the e4m3 wgmma forms (generated,
// sm90_wgmma_fp8.cuh) and a 4-byte cp.async, with which the loader warp copies a stage's fp32
// row scales (one float per row of the A tile, rows K-blocks apart in the [R, ceil(K/128)] scale
// tensor, so no TMA box fits them: a box's row stride must be a multiple of 16 bytes).
#pragma once

#include <cstdint>

#include "kernels/ptx/sm90_ptx.cuh"
#include "kernels/ptx/sm90_wgmma_fp8.cuh"

namespace machmoe::sm90 {

// 4-byte copy global -> shared (through L1: .ca is the only cache mode that takes 4 bytes);
// src_bytes = 0 writes zeros and reads nothing (rows past the tensor's end). Completion is
// reported like cp_async_16's: cp_async_arrive_noinc on the stage's barrier.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Waits until every cp.async this thread issued has landed (the loader warp before it exits, so
// that no copy of the last stages is still owned by a finished warp).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

}  // namespace machmoe::sm90
