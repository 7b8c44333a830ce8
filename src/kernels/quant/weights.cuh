// FP8 quantisation of expert weights in 128x128 blocks, optionally with a transposed copy:
//   w bf16 [E, N, K] -> q e4m3 [E, N, K], scales fp32 [E, ceil(N/128), ceil(K/128)]
//   and (kTransposed) qt e4m3 [E, K, N] = q transposed, scales_t [E, ceil(K/128), ceil(N/128)]
//   with scales_t[e, kb, nb] = scales[e, nb, kb]: qt is made from the same codes as q, so the two
//   dequantise to the same values. Blocks at the edges use only their real elements.
// Included by host/quant/quantize_weights.cu only.
//
// One CTA per block. Thread t loads 16-byte chunks t + 256j (j < 8) of the block, [128 rows][16
// chunks]: each load instruction reads two whole 256-byte row segments per warp. The amax is a
// warp shuffle reduction, then eight warps' values meet in shared memory. Lane pairs exchange
// their quantised halves (fp8_common.cuh) so that q goes out in 16-byte stores. The transposed
// copy goes through two 16 KB shared tiles: the codes [n][k], then 4x4 byte blocks transposed in
// registers (byte_perm) into [k][n], then whole 128-byte qt row segments.
#pragma once

#include "kernels/quant/fp8_common.cuh"

namespace machmoe::kernels::fp8 {

constexpr int kWeightsThreads = 256;
constexpr int kWeightsWarps = kWeightsThreads / kWarpSize;
constexpr int kBlockChunks = kTile * kTile / 8 / kWeightsThreads;  // 8 loads of 16 bytes per thread

struct WeightsParams {
  const __nv_bfloat16* w;  // [E, N, K]
  int64_t N, K;            // K % 16 == 0 (and N % 16 == 0 with the transposed copy)
  int64_t nb_n, nb_k;      // ceil(N / 128), ceil(K / 128)
  uint8_t* q;              // [E, N, K]
  float* scales;           // [E, nb_n, nb_k]
  uint8_t* qt;             // [E, K, N] (kTransposed)
  float* scales_t;         // [E, nb_k, nb_n] (kTransposed)
};

// Shared tile of 128 rows x 128 codes as 32-bit words, 32 per row. Q[n][k] swizzles word kw by
// ((n / 4) % 4) * 8 and QT[k][n] swizzles word nw by ((k / 4) % 8) * 4 (16-byte units stay
// whole): the row-wise writes, the 4x4 block reads and writes of the transpose, and the 16-byte
// row reads are all free of bank conflicts.
__device__ __forceinline__ int q_word(int n, int kw) { return n * 32 + (kw ^ (((n >> 2) & 3) << 3)); }
__device__ __forceinline__ int qt_word(int k, int nw) { return k * 32 + (nw ^ (((k >> 2) & 7) << 2)); }

template <bool kTransposed>
__global__ void __launch_bounds__(kWeightsThreads) fp8_quantize_weights_kernel(const WeightsParams p) {
  __shared__ uint32_t warp_amax[kWeightsWarps];
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int64_t blocks_per_expert = p.nb_n * p.nb_k;
  const int64_t e = blockIdx.x / blocks_per_expert;
  const int64_t nb = (blockIdx.x - e * blocks_per_expert) / p.nb_k;
  const int64_t kb = blockIdx.x - e * blocks_per_expert - nb * p.nb_k;
  const int64_t n0 = nb * kTile, k0 = kb * kTile;
  const int nrows = static_cast<int>(min64(kTile, p.N - n0));
  const int ncols = static_cast<int>(min64(kTile, p.K - k0));  // multiple of 16
  const int unit = tid % 16;                                           // 16-byte chunk within the row
  const bool unit_ok = unit * 8 < ncols;
  const __nv_bfloat16* src = p.w + (e * p.N + n0) * p.K + k0 + unit * 8;

  // Rows tid/16 + 16j: missing rows and columns are zeros (no effect on the amax).
  uint4 v[kBlockChunks];
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kBlockChunks; ++j) {
    const int row = tid / 16 + 16 * j;
    v[j] = make_uint4(0, 0, 0, 0);
    if (row < nrows && unit_ok) v[j] = load16(src + row * p.K);
    m = max(m, abs_max_bits8(v[j]));
  }
  m = group_max_bits<kWarpSize>(m);
  if (lane == 0) warp_amax[warp] = m;
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kWeightsWarps; ++k) m = max(m, warp_amax[k]);
  const TileScale t = tile_scale(m);

  uint2 qv[kBlockChunks];
#pragma unroll
  for (int j = 0; j < kBlockChunks; ++j) qv[j] = quantize8(v[j], t);
  // Loads 2i and 2i+1 pair up: lane 2k stores row tid/16 + 32i, lane 2k+1 row tid/16 + 32i + 16,
  // both at the pair's first chunk.
  uint8_t* dst = p.q + (e * p.N + n0) * p.K + k0 + (unit & ~1) * 8;
#pragma unroll
  for (int i = 0; i < kBlockChunks / 2; ++i) {
    const uint4 out = pair_exchange(qv[2 * i], qv[2 * i + 1], lane);
    const int row = tid / 16 + 16 * (2 * i + (lane & 1));
    if (row < nrows && unit_ok) store16(dst + row * p.K, out);
  }
  if (tid == 0) {
    p.scales[(e * p.nb_n + nb) * p.nb_k + kb] = t.s;
    if constexpr (kTransposed) p.scales_t[(e * p.nb_k + kb) * p.nb_n + nb] = t.s;
  }

  if constexpr (kTransposed) {
    __shared__ __align__(16) uint32_t q_tile[kTile * 32];  // [n][k] codes, 16 KB (8-byte stores)
    __shared__ uint4 qt_tile[kTile * 8];      // [k][n] codes, 16 KB
    uint32_t* qt_words = reinterpret_cast<uint32_t*>(qt_tile);
#pragma unroll
    for (int j = 0; j < kBlockChunks; ++j) {
      const int n = tid / 16 + 16 * j;
      *reinterpret_cast<uint2*>(&q_tile[q_word(n, 2 * unit)]) = qv[j];
    }
    __syncthreads();
    // 1024 blocks of 4x4 codes, four per thread: lane = (a, b), a = lane % 4 picks the n block,
    // b = lane / 4 the k word (conflict-free under the swizzles above).
    const int a = lane % 4, b = lane / 4;
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int gp = warp * 4 + it;
      const int nblk = 4 * (gp % 8) + a;  // rows 4·nblk .. +3 of the block (n)
      const int kw = 8 * (gp / 8) + b;    // columns 4·kw .. +3 (k)
      const uint32_t r0 = q_tile[q_word(4 * nblk + 0, kw)], r1 = q_tile[q_word(4 * nblk + 1, kw)];
      const uint32_t r2 = q_tile[q_word(4 * nblk + 2, kw)], r3 = q_tile[q_word(4 * nblk + 3, kw)];
      // r_i byte j = Q[4nblk + i][4kw + j]; c_j byte i = the same code = QT[4kw + j][4nblk + i].
      const uint4 c = transpose4x4_bytes(r0, r1, r2, r3);
      qt_words[qt_word(4 * kw + 0, nblk)] = c.x;
      qt_words[qt_word(4 * kw + 1, nblk)] = c.y;
      qt_words[qt_word(4 * kw + 2, nblk)] = c.z;
      qt_words[qt_word(4 * kw + 3, nblk)] = c.w;
    }
    __syncthreads();
    // qt rows k0 + k, columns n0 + [16g, 16g + 16): eight lanes write one 128-byte row segment.
    uint8_t* dst_t = p.qt + (e * p.K + k0) * p.N + n0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int u = tid + kWeightsThreads * i, k = u / 8, g = u % 8;
      const uint4 val = qt_tile[k * 8 + (g ^ ((k >> 2) & 7))];
      if (k < ncols && 16 * g < nrows) store16(dst_t + k * p.N + 16 * g, val);
    }
  }
}

}  // namespace machmoe::kernels::fp8
