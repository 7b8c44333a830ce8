// Which GEMM kernel runs a problem, and with what tile configuration: one plain function from the
// problem's shape to a configuration, per GEMM family, with no CUDA in it (tested on the CPU,
// tests/cpp/test_gemm_config.cpp). The launchers (grouped_gemm.cu, grouped_wgrad.cu) only execute
// the configuration they are given.
#pragma once

#include <cstdint>

#include "machmoe/machmoe.hpp"

namespace machmoe::detail {

// The kernels' epilogue codes (kernels/gemm/epilogue.cuh's GemmEpilogue; grouped_gemm.cu asserts
// that the two agree).
enum class GemmEpiCode : int {
  Store = 0,       // C = acc (+ bias)
  GluInter = 1,    // GLU, gate/up interleaved columns: C = H, C2 = act(gate)·up
  GluConcat = 2,   // GLU, the B tile is [BN/2 gate rows; BN/2 up rows] of a concatenated W1
  Act = 3,         // non-GLU activation: C = H, C2 = act(H)
  DGluInter = 4,   // the dH kernel's epilogues (ActivationBackward)
  DGluConcat = 5,
  DAct = 6,
};

// The grouped GEMM kernels (kernels/gemm/):
//   Cooperative  (cooperative.cuh): both consumer warpgroups on one 128 x BN tile; every epilogue.
//   PingPong     (pingpong.cuh): one 128 x 192 tile per consumer warpgroup; plain store, contiguous A.
//   DactPingPong (dact_pingpong.cuh): one 128 x 128 tile per consumer warpgroup; the dH epilogue,
//                gathered A.
enum class GemmKernelKind : int { Cooperative = 0, PingPong = 1, DactPingPong = 2 };

// Tile widths and shared-memory tile-offset capacities of the kernels (kernels/gemm/*.cuh;
// grouped_gemm.cu asserts that they agree).
constexpr int kPingPongTileN = 192;
constexpr int kDactPingPongTileN = 128;
constexpr int kSmemTileExperts = 512;             // cooperative and ping-pong kernels
constexpr int kDactPingPongSmemTileExperts = 384;  // the dH ping-pong kernel (shorter of shared memory)
constexpr int kDsColumns = 128;                    // dA' columns per dS partial (the dH epilogue)

// What the choice depends on: the problem's shape and epilogue, never the data or the device.
struct GemmShape {
  int64_t E = 0, N = 0, K = 0;
  GemmEpilogue epilogue = GemmEpilogue::Store;
  Activation activation = Activation::SwiGLU;
  GateUpLayout layout = GateUpLayout::Interleaved;
  bool gather = false;     // A's rows come through a gather index
  bool has_c = true;       // C (or H) is written
  GemmKernel kernel = GemmKernel::Auto;  // the caller's choice (GroupedGemmArgs::kernel)
};

struct GemmConfig {
  GemmKernelKind kernel = GemmKernelKind::Cooperative;
  GemmEpiCode epi = GemmEpiCode::Store;
  int bn = 256;            // columns of the weight tile (the kernels' BN)
  int tile_cols = 256;     // columns of C per tile: bn, or bn / 2 for the concatenated GLU
  int64_t n_tiles = 1;     // column tiles per expert
  // The kernel builds its tile-offset table [E+1] in shared memory up to this many experts; above
  // it the launcher first runs grouped_gemm_tile_offsets into the caller's workspace.
  int smem_tile_experts = kSmemTileExperts;
  bool global_tile_offsets = false;  // E > smem_tile_experts
};

// The configuration of one grouped GEMM. With kernel = Auto the shape rules below choose; a
// forced kernel that cannot run this problem is refused (Error, InvalidArgument), naming why.
// Expects arguments the launcher has already checked (E, N, K in range).
GemmConfig choose_gemm_config(const GemmShape& shape);

// Where the ping-pong kernel beats the cooperative one for the plain store with contiguous A:
// C's width N at most max_n, or the reduction K at most max_k (at any N).
struct PingPongRule {
  int64_t max_n, max_k;
  bool wins(int64_t N, int64_t K) const { return N <= max_n || K <= max_k; }
};
// On an H200 (2026-11, kernel tables of twelve model configurations): the ping-pong kernel wins
// 1-12% where the epilogue is a large share of a tile (short K) or N is a multiple of 192 (d =
// 768, 1536); at d = 4096 and 7168 with K >= 1024 it loses 2-5% (up to 18% on an H100): 192-wide
// tiles read 15% more from L2 and leave a third of a tile idle at N = 4096.
constexpr PingPongRule kPingPongWhere{2048, 512};

// Where the dH kernel's ping-pong form beats the cooperative one: the reduction K = d at most
// max_k. On an H100 (2026-11): 2-5% faster at d = 768 and 1536, 7-9% slower at d = 4096, where
// the long main loop hides the cooperative kernel's epilogue anyway and the 128-wide tile gathers
// each dout row twice as often.
struct DactPingPongRule {
  int64_t max_k;
  bool wins(int64_t K) const { return K <= max_k; }
};
constexpr DactPingPongRule kDactPingPongWhere{2048};

// The weight-gradient GEMM (kernels/gemm/wgrad.cuh): one CTA per output tile, or clusters of two
// CTAs computing the two column tiles of the same rows, each gathering half of the shared A tile.
constexpr int kWgradTileM = 128;  // rows of C (the M dimension) per tile
struct WgradShape {
  int64_t E = 0, M = 0, N = 0;
  int max_ctas = 0;        // the caller's bound (0: none); pairs need two
  WgradKernel kernel = WgradKernel::Auto;
};
struct WgradConfig {
  int bn = 256;            // columns of C per tile
  int64_t m_tiles = 1, n_tiles = 1;  // per expert
  bool cta_pairs = false;
  int64_t units = 0;       // work units: tiles, or tile pairs with cta_pairs
};
// With kernel = Auto: CTA pairs wherever there are two or more column tiles (and two CTAs are
// allowed). They halve each SM's cp.async gather, which bounds these kernels: +4-8% on an H100
// (2026-11).
WgradConfig choose_wgrad_config(const WgradShape& shape);

}  // namespace machmoe::detail
