// What the grouped GEMM kernels (gemm/cooperative.cuh, gemm/pingpong.cuh, gemm/dact_pingpong.cuh)
// share: the parameter block the host fills, the tile, the epilogue codes, the ring of decoded
// tiles, and the shared-memory layout. Header-only, CUDA only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/gemm/pipeline.cuh"
#include "kernels/ptx/sm90_ptx.cuh"

namespace machmoe::kernels {

enum GemmEpilogue : int {
  kEpiStore = 0,      // C = acc (+ bias)
  kEpiGluInter = 1,   // GLU, gate/up interleaved columns: C = H, C2 = act(gate)·up
  kEpiGluConcat = 2,  // GLU, B tile = [BN/2 gate rows; BN/2 up rows] of a concatenated W1
  kEpiAct = 3,        // non-GLU activation: C = H, C2 = act(H)
  // The backward's dH kernel (gemm/epilogue_dact.cuh): the GEMM gives dA' [R, n]; with the
  // saved H it writes C = dH [R, n1], C2 = A' = s·act(H) [R, n] and the per-row dS partials.
  kEpiDGluInter = 4,
  kEpiDGluConcat = 5,
  kEpiDAct = 6,
};

constexpr bool gemm_epi_is_dact(int epi) { return epi >= kEpiDGluInter; }

enum GemmActivation : int { kActSwiGLU = 0, kActGeGLU = 1, kActReGLU = 2, kActReLU2 = 3, kActReLU = 4,
                            kActGELU = 5, kActSiLU = 6, kActClampedSwiGLU = 7 };

// Tiles: 128 rows (one expert's) x BN columns, in K blocks of 64 (one 128-byte swizzle row of bf16).
constexpr int kGemmBM = 128;
constexpr int kGemmBK = 64;
// Three warpgroups: the producer (loads; the epilogue's stores) and two consumers (wgmma).
constexpr int kGemmThreads = 384;
// The dH epilogue writes one dS partial per this many dA' columns (ds_partial [R, ceil(n/128)]),
// whichever kernel and tile width ran (host: grouped_gemm_column_tiles).
constexpr int kDsCols = 128;

struct GroupedGemmParams {
  const __nv_bfloat16* a;        // A rows, leading dimension lda (elements)
  int64_t lda;
  const int32_t* gather;         // [R] row -> A row, or null (row r of A)
  // Expert e's rows are [expert_offsets[e], expert_ends[e]): expert_ends = expert_offsets + 1 for
  // whole experts, or two arrays [E] for a part of each expert's rows (an expert-parallel call's
  // rows of its own tokens, computed while the other ranks' tokens arrive).
  const int32_t* expert_offsets; // [E+1], or [E] with a separate expert_ends
  const int32_t* expert_ends;    // [E]
  const int32_t* tile_offsets;   // [E+1], from grouped_gemm_tile_offsets
  const __nv_bfloat16* bias;     // [E, N] (in W's row order) or null
  __nv_bfloat16* c;              // [R, ldc]: C (store) or H (GLU / act; null: H not written)
  int64_t ldc;
  __nv_bfloat16* c2;             // [R, ldc2]: A = act(H), or null
  int64_t ldc2;
  int E, N, K;                   // N: output columns of C (2n for GLU)
  int n_tiles;                   // column tiles per expert
  int act;                       // GemmActivation
  // dH epilogue (kEpiD*) only: H [R, n1] (ldh), s_r = row_scores[row_pair[r]], and
  // ds_partial [R, ds_cols] fp32
  const __nv_bfloat16* h;
  int64_t ldh;
  const float* row_scores;
  const int32_t* row_pair;
  float* ds_partial;
  int ds_cols;                   // ds_partial's row stride: ceil(N / kDsCols)
  // kActClampedSwiGLU only (machmoe::GluClamp, as the host resolves it, so that the epilogues
  // need no branch): A = min(g'·σ(alpha·g'), act_limit)·(clamp(u, -up_limit, up_limit) + up_offset)
  // with g' = min(g, gate_limit); the limit a variant does not apply is +inf.
  float clamp_alpha, clamp_gate_limit, clamp_act_limit, clamp_up_limit, clamp_up_offset;
};

struct GemmTile {
  int e, row0, rows, n0;  // expert (-1: no more tiles), first row, rows (<= 128), first column
};

// Row stride of the staged tile: BN bf16 + 16 bytes, so that the 8 rows a warp writes at once
// land in different banks (row stride ≡ 4 banks mod 32).
template <int BN>
constexpr int epi_row_bytes() { return BN * 2 + 16; }

// The plain-store, interleaved-GLU and activation epilogues stage their tile (C or H) as BN/64 TMA
// boxes [128 rows][64 columns] with the 128-byte swizzle instead (conflict-free too: the 8 rows
// of a warp's store hit 8 different 16-byte slots), so that a full tile's C/H leaves by TMA
// stores and the epilogue threads only compute and write A.
constexpr int kEpiBoxBytes = 128 * 128;
template <int EPI>
constexpr bool epi_boxed() { return EPI == kEpiStore || EPI == kEpiGluInter || EPI == kEpiAct; }
template <int BN>
constexpr int epi_tile_bytes() { return 128 * epi_row_bytes<BN>(); }

// Up to this many experts a kernel builds the tile-offset table [E+1] itself, in shared memory,
// from expert_offsets (gemm/scheduler.cuh): no separate scan kernel and its launch (two per
// forward and two per backward; ~2 µs each plus the gap between launches).
constexpr int kGemmSmemTileE = 512;

// Tiles the producer may decode ahead of the consumers: more than the stages, so that the
// publishing thread never waits on the consumers while its loads are ahead of them.
constexpr int kTileRing = 8;

// The ring of decoded tiles, from the producer's publishing thread to the threads that run them:
// slot n % kTileRing holds the CTA's tile n. full[slot] takes one arrival (the publisher);
// empty[slot] one from every thread that takes the slot (the kernel sets the count). Phases
// alternate every kTileRing tiles, as StageRing's do every S stages.
struct TileRing {
  uint64_t *full, *empty;  // [kTileRing] each
  GemmTile* slots;         // [kTileRing]
  // Tile n, once every taker of the slot's previous tile (n - kTileRing) has read it.
  __device__ __forceinline__ void publish(int n, const GemmTile& tile) const {
    const int slot = n % kTileRing;
    sm90::mbar_wait(&empty[slot], ((n / kTileRing) & 1) ^ 1);
    slots[slot] = tile;
    sm90::mbar_arrive(&full[slot]);
  }
  // Tile n, once published; this thread's arrival then frees the slot for tile n + kTileRing.
  __device__ __forceinline__ GemmTile take(int n) const {
    const int slot = n % kTileRing;
    sm90::mbar_wait(&full[slot], (n / kTileRing) & 1);
    const GemmTile tile = slots[slot];
    sm90::mbar_arrive(&empty[slot]);
    return tile;
  }
};

// The cooperative kernel's shared memory: S stages of [A tile | B tile], the staged output tile,
// then (kFixed) the barriers, the tile ring, the staged tile's descriptor, the dH epilogue's row
// scores and the tile-offset table.
template <int BN>
struct GemmSmem {
  static constexpr int kABytes = kGemmBM * kGemmBK * 2;  // 16 KB
  static constexpr int kBBytes = BN * kGemmBK * 2;       // 32 KB for BN = 256
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kEpiBytes = epi_tile_bytes<BN>();  // the staged output tile
  // Design budget: Hopper's 227 KB per block (the launcher checks the device's opt-in limit).
  // 1 KB aligns the stages; kFixed - 1 KB holds the barriers, the tile ring, the dH row scores
  // and the tile-offset table (static_assert below).
  static constexpr int kBudget = 227 * 1024;
  static constexpr int kFixed = 4096;
  static constexpr int kStages = (kBudget - kFixed - kEpiBytes) / kStageBytes;
  static constexpr int kBytes = kStages * kStageBytes + kEpiBytes + kFixed;
  static_assert(kStages >= 2, "at least two pipeline stages");
  static_assert(kStages < kTileRing, "the tile ring must hold more tiles than there are stages");
  // barriers (2 per stage, 2 per ring slot, 2 for the epilogue), the ring, the epilogue's tile,
  // the dH epilogue's row scores [128], the tile-offset table [kGemmSmemTileE + 1]: all inside
  // kFixed after the 1 KB alignment slack.
  static_assert((2 * kStages + 2 * kTileRing + 2) * 8 + (kTileRing + 1) * 16 + 128 * 4 + (kGemmSmemTileE + 1) * 4 <=
                    kFixed - 1024,
                "fixed shared-memory area too small");
};

// Where a grouped GEMM kernel's shared memory holds what, for its Smem (GemmSmem, or a ping-pong
// kernel's): from a 1024-byte aligned base, S operand stages (A tiles, then B tiles), the
// epilogue area [Smem::kEpiBytes], the barriers (full / empty per stage, tile_full / tile_empty
// per ring slot), then the epilogue handoff (kEpiHandoff), the tile ring and the tile-offset table.
// kEpiHandoff, the cooperative kernel: its consumers hand each staged tile to separate epilogue
// threads (epi_full / epi_empty, the staged tile's descriptor, the dH epilogue's row scores). The
// ping-pong consumers store their own tiles: no handoff, those pointers are null.
// (One constructor for both on purpose: with the common part carved in a base class or helper
// function, the compiler folded the tile-table address differently and every kernel's SASS
// changed.)
template <class Smem, bool kEpiHandoff>
struct GroupedGemmSmemLayout {
  uint8_t *smem_a, *smem_b;  // [S][kABytes], [S][kBBytes]: the operand stages
  uint8_t* epi;              // [kEpiBytes]: the staged output
  uint64_t *full, *empty;    // [S] each: a stage's data has landed / its wgmmas have retired
  // The tile schedule, decoded by the producer (whose latency is hidden: it runs ahead) and
  // handed to the consumers through a small ring, so that they never stall on the binary search.
  uint64_t *tile_full, *tile_empty;  // [kTileRing] each
  uint64_t* epi_full;   // consumers staged a tile
  uint64_t* epi_empty;  // the epilogue threads are done with it
  GemmTile* ring;       // [kTileRing]
  GemmTile* epi_tile;   // the staged tile
  float* epi_scale;     // [128] the dH epilogue: the staged rows' scores
  int32_t* tile_table;  // [E+1] when E is within the kernel's shared-memory table (gemm_tile_table)
  __device__ __forceinline__ StageRing<Smem::kStages> stages() const { return {full, empty}; }
  __device__ __forceinline__ TileRing tile_ring() const { return {tile_full, tile_empty, ring}; }
  __device__ __forceinline__ explicit GroupedGemmSmemLayout(uint8_t* smem_raw) {
    constexpr int S = Smem::kStages;
    // 1024-byte aligned (the 128-byte swizzle atoms), by an offset from smem_raw rather than an
    // integer round trip, so that the compiler still knows every pointer below is shared memory
    // and emits ld/st.shared (a generic access costs more instructions and goes the L1TEX way).
    uint8_t* smem = smem_raw + ((1024u - (sm90::smem_addr(smem_raw) & 1023u)) & 1023u);
    smem_a = smem;
    smem_b = smem + S * Smem::kABytes;
    epi = smem + S * Smem::kStageBytes;
    full = reinterpret_cast<uint64_t*>(epi + Smem::kEpiBytes);
    empty = full + S;
    tile_full = empty + S;
    tile_empty = tile_full + kTileRing;
    if constexpr (kEpiHandoff) {
      epi_full = tile_empty + kTileRing;
      epi_empty = epi_full + 1;
      ring = reinterpret_cast<GemmTile*>(epi_empty + 1);
      epi_tile = ring + kTileRing;
      epi_scale = reinterpret_cast<float*>(epi_tile + 1);
      tile_table = reinterpret_cast<int32_t*>(epi_scale + 128);
    } else {
      epi_full = epi_empty = nullptr;
      ring = reinterpret_cast<GemmTile*>(tile_empty + kTileRing);
      epi_tile = nullptr;
      epi_scale = nullptr;
      tile_table = reinterpret_cast<int32_t*>(ring + kTileRing);
    }
  }
};

// The cooperative kernel's (gemm/cooperative.cuh).
template <int BN>
using GemmSmemLayout = GroupedGemmSmemLayout<GemmSmem<BN>, true>;

}  // namespace machmoe::kernels
