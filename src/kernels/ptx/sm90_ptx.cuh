// Our own thin PTX wrappers for the Hopper (sm_90a) features the GEMM engine uses: mbarrier,
// TMA (cp.async.bulk.tensor), cp.async with mbarrier completion, wgmma fences and shared-memory
// matrix descriptors, setmaxnreg, and the async-proxy fence. No template library underneath.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only; host code encodes it through the runtime)

#include <cstdint>

#include "kernels/ptx/sm90_wgmma.cuh"

namespace machmoe::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// v as lane 0 of the warp holds it, which the compiler then knows to be the same in every lane, so
// that what is derived from it can live in uniform registers. For values that are warp-uniform in
// fact but not provably so (threadIdx.x / 128; a counter whose loop also has data-dependent
// exits): derived from them, the consumers' stage index, barrier addresses and wgmma descriptors
// were computed in regular registers and moved to uniform ones by R2UR before every wgmma.
// Measured (on an H100, against the same tree without it): the non-uniform instructions
// per K block fell from 65 to 15 in the ping-pong store kernel, 47 to 21 in the dH ping-pong and
// 29 to 21 in the cooperative kernel; 7B-a down-projection +6-9%, dH +2-3%, dX~ +1-3%, 120B-c
// dX~ +2-4%, the rest within noise. All 32 lanes of the warp must execute it together (a full-mask
// shuffle): the callers sit where whole warps run (kernel entry, the loader warpgroup's tile
// loop, the consumers' main loop).
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
// This thread's warpgroup, threadIdx.x / 128, warp-uniform as above.
__device__ __forceinline__ int warpgroup_index() { return warp_uniform(static_cast<int>(threadIdx.x) / 128); }

// Four 8x8 bf16 matrices to shared memory in one warp instruction: register i of every lane holds
// its two elements of matrix i (row lane / 4, columns 2·(lane % 4) + {0, 1}: the mma/wgmma
// accumulator fragment's layout), and lane l gives the 16-byte row address of row l % 8 of
// matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// The same, transposed: lane l's register i holds element (row l / 4, column 2·(l % 4) + k) of
// matrix i as the fragment has it, and it lands in the matrix's memory row 2·(l % 4) + k, at
// position l / 4: each 16-byte memory row is one fragment COLUMN (8 consecutive fragment rows).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
// Makes initialised barriers visible to the other threads and to the async proxy (TMA).
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival that also announces `bytes` of TMA traffic the barrier must see complete.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Non-blocking probe (try_wait may suspend the thread for a while: wrong for polling two things).
__device__ __forceinline__ bool mbar_test_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  while (!mbar_try_wait(a, parity)) {
  }
}

// ---------------------------------------------------------------- clusters
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// One arrival on the barrier at `bar`'s offset in CTA `cta` of this cluster. Default semantics
// (release at CTA scope): the reads this arrival orders are wgmma operand reads already retired
// by wgmma.wait_group; a cluster-scope release compiled to a full memory barrier per arrival
// (an ERRBAR in the SASS).
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
// Every thread of every CTA of the cluster arrives, then waits: barriers initialised before any
// CTA signals another; no CTA exits while its peer may still signal it or write to it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// Bulk copy of `bytes` (a multiple of 16) from this CTA's shared memory at `src` to the same
// offset in CTA `cta` of the cluster; `bar`'s counterpart there receives the bytes (complete_tx).
// The source may be overwritten once that barrier's phase has completed.
__device__ __forceinline__ void bulk_copy_to_peer(const void* src, uint32_t bytes, uint64_t* bar, uint32_t cta) {
  uint32_t dst, rbar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(smem_addr(src)), "r"(cta));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(smem_addr(bar)), "r"(cta));
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "r"(smem_addr(src)), "r"(bytes), "r"(rbar)
      : "memory");
}

// ---------------------------------------------------------------- cp.async (gathered rows)
// 16-byte copy global -> shared; src_bytes = 0 writes zeros and reads nothing (rows past the end).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// The barrier receives one arrival once all of this thread's earlier cp.async have landed. The
// barrier's expected count must include these arrivals (noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Groups of this thread's cp.async (no mbarrier): commit, then wait until at most N are pending.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------- TMA
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(x), "r"(y)
      : "memory");
}
// 3-D box at (x, y, z) (x innermost): N-major weights [E, K, N] read per expert, so that a K
// block running past the expert's K rows is zero-filled instead of reading the next expert.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(x), "r"(y), "r"(z)
      : "memory");
}
// Shared -> global 2-D box store (bulk async group of this thread); the tensor map clips the box
// at the tensor's edges.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int x, int y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
               ::"l"(map), "r"(smem_addr(src)), "r"(x), "r"(y)
               : "memory");
}
// Shared -> global 3-D box store at (x, y, z) (x innermost), e.g. one expert's slice z of an
// [E, rows, cols] output: the map's bounds clip the box at the slice's own rows and columns.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int x, int y, int z) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];"
               ::"l"(map), "r"(smem_addr(src)), "r"(x), "r"(y), "r"(z)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until all but this thread's N most recent bulk-store groups have read their source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
// Waits until this thread's bulk stores have read their shared-memory source (it may be reused).
__device__ __forceinline__ void bulk_wait_read_all() { bulk_wait_read<0>(); }
// Waits until this thread's bulk stores are complete.
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// Orders this thread's generic-proxy shared-memory accesses (cp.async results, st.shared) with
// later async-proxy accesses (wgmma operand reads, TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---------------------------------------------------------------- wgmma
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major operand tile stored with the 128-byte swizzle:
// rows of 64 bf16 (128 bytes), 8-row core groups 1024 bytes apart. The tile must be 1024-byte
// aligned; stepping k by 16 elements adds 32 bytes to the start address.
__device__ __forceinline__ uint64_t smem_desc_kmajor_sw128(uint32_t addr) {
  uint64_t desc = (addr & 0x3FFFFu) >> 4;       // start address, 16-byte units
  desc |= static_cast<uint64_t>(1) << 16;        // leading-dimension byte offset (unused here)
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;  // stride byte offset: 8 rows x 128 bytes
  desc |= static_cast<uint64_t>(1) << 62;        // swizzle mode: 128 bytes
  return desc;
}

// `desc` with its start address advanced by `bytes` (a multiple of 16). Only the low word
// changes: the 14-bit start-address field cannot carry (shared memory is < 256 KB, so every
// operand address >> 4 fits), so a main loop builds its descriptors once and steps them by a
// 32-bit add, instead of rebuilding each from its address (mask, shift, or, moves: ~6 instructions
// a wgmma in the SASS).
__device__ __forceinline__ uint64_t smem_desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// Descriptor of an MN-major operand tile (transposed wgmma operand, tnspA/tnspB = 1) with the
// 128-byte swizzle: blocks of 64 M (or N) elements, each stored as K rows of 128 bytes (what a
// TMA box {64 MN, K rows} or a row-wise cp.async writes). PTX canonical layout
// ((8,8,m),(8,k)) : ((1,8,LBO),(64,SBO)) in elements: LBO = bytes between the 64-wide MN blocks,
// SBO = 1024 bytes between groups of 8 K rows. Stepping k by 16 adds 16 rows = 2048 bytes.
__device__ __forceinline__ uint64_t smem_desc_mnmajor_sw128(uint32_t addr, uint32_t block_bytes) {
  uint64_t desc = (addr & 0x3FFFFu) >> 4;
  desc |= static_cast<uint64_t>((block_bytes & 0x3FFFFu) >> 4) << 16;  // leading: next 64-wide MN block
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;                     // stride: next 8 K rows
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// Barrier among `count` threads (a multiple of 32) of the CTA, id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// Arrive on a named barrier without waiting: with `count` = the arriving and the syncing threads
// together, it releases threads blocked in named_barrier_sync (a turn handed to another warpgroup).
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// ---------------------------------------------------------------- warp-level mma (small GEMMs)
// Four 8x8 bf16 matrices from shared memory; lane l gives the address of row l % 8 of matrix
// l / 8. Without .trans lane l receives (row l / 4, columns 2(l % 4), +1) of each matrix; with
// .trans (rows 2(l % 4), +1; column l / 4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// d[16x8] += a[16x16] · b[16x8], bf16 operands, fp32 accumulators (per lane: rows l/4 and l/4 + 8,
// columns 2(l % 4), +1).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------- registers
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

}  // namespace machmoe::sm90
