// The operand stage ring of the GEMM kernels: S shared-memory stages, each guarded by two
// mbarriers, full[s] (the stage's loads have landed: TMA bytes and/or cp.async arrivals) and
// empty[s] (every consumer that reads the stage has released it). Producer and consumers walk the
// stages in the same order, block by block; a running block count `it` gives the stage (it % S)
// and the phase of its barriers ((it / S) & 1), which flips each time the ring wraps around.
//
//   producer:  acquire(slot) (or poll try_acquire), then commit the stage's loads on
//              full_barrier(stage): expect_tx + TMA, and/or cp.async arrivals;
//   consumers: wait(slot), read the stage (wgmma), release(stage) once the reads have retired.
//
// All four GEMM kernels use it (gemm/cooperative.cuh, gemm/pingpong.cuh, gemm/dact_pingpong.cuh,
// gemm/wgrad.cuh); each chooses the arrival counts (init) and who releases.
#pragma once

#include <cstdint>

#include "kernels/ptx/sm90_ptx.cuh"

namespace machmoe::kernels {

template <int S>
struct StageRing {
  static constexpr int kStages = S;
  uint64_t* full;   // [S]
  uint64_t* empty;  // [S]

  // Block `it`'s place in the ring: the stage index and the phase bit its barriers are in.
  struct Slot {
    int stage;
    uint32_t phase;
  };
  static __device__ __forceinline__ Slot slot(int it) { return {it % S, static_cast<uint32_t>((it / S) & 1)}; }

  // By one thread, before the CTA's first barrier: arrivals that complete a phase of each barrier.
  __device__ __forceinline__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
    for (int s = 0; s < S; ++s) {
      sm90::mbar_init(&full[s], full_arrivals);
      sm90::mbar_init(&empty[s], empty_arrivals);
    }
  }

  // Producer: wait until the consumers have released the slot's stage (the previous round's
  // phase of empty; the first round passes at once).
  __device__ __forceinline__ void acquire(Slot k) const { sm90::mbar_wait(&empty[k.stage], k.phase ^ 1); }
  // The same without blocking: whether the stage is free now.
  __device__ __forceinline__ bool try_acquire(Slot k) const {
    return sm90::mbar_test_wait(sm90::smem_addr(&empty[k.stage]), k.phase ^ 1);
  }
  // Where the stage's loads complete (TMA's complete_tx, cp.async's arrive.noinc).
  __device__ __forceinline__ uint64_t* full_barrier(int stage) const { return &full[stage]; }
  // The producer thread's commit: `bytes` of TMA loads will land on the stage (and this arrival).
  __device__ __forceinline__ void commit_tx(int stage, uint32_t bytes) const {
    sm90::mbar_arrive_expect_tx(&full[stage], bytes);
  }
  // A plain arrival on full (a commit with no TMA bytes).
  __device__ __forceinline__ void commit(int stage) const { sm90::mbar_arrive(&full[stage]); }
  // This thread's cp.async copies of the stage arrive on full once they land.
  __device__ __forceinline__ void commit_cp_async(int stage) const { sm90::cp_async_arrive_noinc(&full[stage]); }

  // Consumer: wait until the slot's stage has landed.
  __device__ __forceinline__ void wait(Slot k) const { sm90::mbar_wait(&full[k.stage], k.phase); }
  // One consumer arrival: this reader is done with the stage.
  __device__ __forceinline__ void release(int stage) const { sm90::mbar_arrive(&empty[stage]); }
};

}  // namespace machmoe::kernels
