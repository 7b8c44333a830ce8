// Launcher of the sm_90a grouped GEMM engine (kernels/gemm/): argument rules, the TMA descriptors,
// and the persistent launch of the kernel and tile configuration that choose_gemm_config
// (host/gemm/config.cpp) picked for the problem's shape.
#include <cuda.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "host/common/check.hpp"
#include "host/common/tensor_map.hpp"
#include "host/gemm/activation_params.hpp"
#include "host/gemm/config.hpp"
#include "host/gemm/tile_offsets.hpp"
#include "kernels/gemm/cooperative.cuh"
#include "kernels/gemm/dact_pingpong.cuh"
#include "kernels/gemm/tile_offsets.cuh"
#include "kernels/gemm/pingpong.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::ceil_div;
using detail::check_launch;
using detail::GemmConfig;
using detail::GemmEpiCode;
using detail::GemmKernelKind;
using detail::require_arg;

// The configuration's constants are the kernels' own.
static_assert(static_cast<int>(GemmEpiCode::Store) == kernels::kEpiStore &&
                  static_cast<int>(GemmEpiCode::GluInter) == kernels::kEpiGluInter &&
                  static_cast<int>(GemmEpiCode::GluConcat) == kernels::kEpiGluConcat &&
                  static_cast<int>(GemmEpiCode::Act) == kernels::kEpiAct &&
                  static_cast<int>(GemmEpiCode::DGluInter) == kernels::kEpiDGluInter &&
                  static_cast<int>(GemmEpiCode::DGluConcat) == kernels::kEpiDGluConcat &&
                  static_cast<int>(GemmEpiCode::DAct) == kernels::kEpiDAct,
              "epilogue codes");
static_assert(detail::kPingPongTileN == kernels::kPingPongBN && detail::kDactPingPongTileN == kernels::kDactPPBN &&
                  detail::kSmemTileExperts == kernels::kGemmSmemTileE &&
                  detail::kDactPingPongSmemTileExperts == kernels::kDactPPSmemTileE &&
                  detail::kDsColumns == kernels::kDsCols,
              "tile widths and shared-memory tile tables");

namespace {

// A [rows, K] (or W [E*N, K]) in boxes of 64 K x 128 rows: a K-major operand tile.
CUtensorMap tile_tensor_map(const void* ptr, int64_t rows, int64_t K, int64_t ld) {
  return detail::tensor_map_2d(ptr, rows, K, ld, kernels::kGemmBK, 128, "grouped_gemm");
}

// A kernel's dynamic shared memory: the device must allow `smem` bytes per block (checked first,
// so that a too-small device gets this message), and the kernel is opted in to them.
void prepare_smem(const void* kernel, int smem) {
  const DeviceInfo info = device_info();
  require_arg(info.smem_per_block_optin >= static_cast<size_t>(smem), "grouped_gemm", "device",
              "needs " + std::to_string(smem) + " bytes of shared memory per block, the device allows " +
                  std::to_string(info.smem_per_block_optin));
  detail::allow_dynamic_smem(kernel, smem, "grouped_gemm: cudaFuncSetAttribute");
}

template <int BN, int EPI, bool GATHER, bool B_NMAJOR>
void launch_variant(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c,
                    const kernels::GroupedGemmParams& p, int ctas, cudaStream_t stream) {
  constexpr int smem = kernels::GemmSmem<BN>::kBytes;
  auto* kernel = kernels::sm90_grouped_gemm<BN, EPI, GATHER, B_NMAJOR>;
  prepare_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<ctas, kernels::kGemmThreads, smem, stream>>>(map_a, map_b, map_c, p);
}

template <bool B_NMAJOR>
void launch_pingpong(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c,
                     const kernels::GroupedGemmParams& p, int ctas, cudaStream_t stream) {
  constexpr int bn = kernels::kPingPongBN;
  constexpr int smem = kernels::GemmPingPongSmem<bn>::kBytes;
  auto* kernel = kernels::sm90_grouped_gemm_pingpong<bn, B_NMAJOR>;
  prepare_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<ctas, kernels::kGemmThreads, smem, stream>>>(map_a, map_b, map_c, p);
}

// The dH kernel as a ping-pong GEMM (one 128 x 128 tile per consumer warpgroup).
template <int EPI>
void launch_dact_pingpong(const CUtensorMap& map_b, const kernels::GroupedGemmParams& p, int ctas, cudaStream_t stream) {
  constexpr int smem = kernels::GemmDactPingPongSmem::kBytes;
  auto* kernel = kernels::sm90_grouped_gemm_dact_pingpong<EPI>;
  prepare_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<ctas, kernels::kGemmThreads, smem, stream>>>(map_b, p);
}

// The cooperative kernel's variants that exist: the forward's epilogues read K-major W; Store
// takes either; the dH epilogues read W2 N-major (W2 [E, d, n] is [E, K, N] for dA' = dout·W2).
template <int BN, int EPI>
void launch_cooperative(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c,
                        const kernels::GroupedGemmParams& p, bool n_major, int ctas, cudaStream_t stream) {
  constexpr bool kMajorK = !kernels::gemm_epi_is_dact(EPI);
  constexpr bool kMajorN = EPI == kernels::kEpiStore || kernels::gemm_epi_is_dact(EPI);
  if (n_major) {
    if constexpr (kMajorN) {
      if (p.gather) launch_variant<BN, EPI, true, true>(map_a, map_b, map_c, p, ctas, stream);
      else launch_variant<BN, EPI, false, true>(map_a, map_b, map_c, p, ctas, stream);
      return;
    }
  } else {
    if constexpr (kMajorK) {
      if (p.gather) launch_variant<BN, EPI, true, false>(map_a, map_b, map_c, p, ctas, stream);
      else launch_variant<BN, EPI, false, false>(map_a, map_b, map_c, p, ctas, stream);
      return;
    }
  }
  throw Error(ErrorCode::Unsupported, "grouped_gemm: this epilogue does not take w_n_major=" +
                                          std::to_string(static_cast<int>(n_major)));
}

// The argument rules (everything the kernels rely on); throws Error(InvalidArgument) naming the
// argument.
void check_args(const GroupedGemmArgs& a) {
  constexpr const char* fn = "grouped_gemm";
  require_arg(a.E >= 1 && a.E <= (1 << 24), fn, "E", "must be in [1, 2^24], got " + std::to_string(a.E));
  require_arg(a.N >= 8 && a.N % 8 == 0 && a.N <= (1 << 24), fn, "N",
              "must be a positive multiple of 8 (16-byte rows), got " + std::to_string(a.N));
  require_arg(a.K >= 8 && a.K % 8 == 0, fn, "K", "must be a positive multiple of 8 (16-byte rows), got " +
                                                   std::to_string(a.K));
  require_arg(a.E * a.N <= (int64_t{1} << 31) - 1, fn, "E*N", "must fit in int32 (TMA row coordinates)");
  require_arg(a.lda >= a.K && a.lda % 8 == 0, fn, "lda", "must be >= K and a multiple of 8");
  require_arg(a.a_rows >= 1 && a.a_rows <= (int64_t{1} << 31) - 1, fn, "a_rows",
              "must be in [1, 2^31) (rows of A: T for a gather, R otherwise)");
  // The gather addresses rows in 16-byte units held in 32 bits (fewer loader registers).
  require_arg(a.gather == nullptr || a.a_rows * (a.lda / 8) <= (int64_t{1} << 32) - 1, fn, "a_rows*lda",
              "a gathered A must hold fewer than 2^35 elements (64 GiB of bf16)");
  require_arg(a.c == nullptr || (a.ldc >= a.N && a.ldc % 8 == 0), fn, "ldc", "must be >= N and a multiple of 8");
  // c may be null for the GLU and activation epilogues: inference, H is not written (only A).
  const bool h_optional = a.epilogue == GemmEpilogue::GLU || a.epilogue == GemmEpilogue::Activation;
  require_arg(a.a && a.w && (a.c || h_optional) && a.expert_offsets && a.tile_offsets, fn,
              "a/w/c/expert_offsets/tile_offsets", "must not be null (c only with the GLU/activation epilogues)");
  require_arg(detail::aligned16(a.a) && detail::aligned16(a.w) && (a.c == nullptr || detail::aligned16(a.c)), fn, "a/w/c",
              "must be 16-byte aligned");
  require_arg(a.epilogue >= GemmEpilogue::Store && a.epilogue <= GemmEpilogue::ActivationBackward, fn, "epilogue",
              "out of range");
  if (a.epilogue != GemmEpilogue::Store) {
    const int64_t c2_cols = a.epilogue == GemmEpilogue::GLU ? a.N / 2 : a.N;  // A, or A' [R, N]
    require_arg(a.c2 && a.ldc2 >= c2_cols && a.ldc2 % 8 == 0 && detail::aligned16(a.c2), fn, "c2/ldc2",
                "needs an activation output with ldc2 >= " + std::to_string(c2_cols) +
                    " and a multiple of 8, 16-byte aligned (16-byte stores)");
  }
  check_glu_clamp(fn, a.activation, a.glu_clamp);
  require_arg(a.activation != Activation::ClampedSwiGLU || a.epilogue != GemmEpilogue::Activation, fn, "activation",
              "clamped_swiglu is a GLU: it takes the GLU epilogue (or ActivationBackward)");
  if (a.epilogue == GemmEpilogue::GLU)
    require_arg(a.N % 16 == 0, fn, "N", "must be a multiple of 16 for a GLU (2n with n a multiple of 8)");
  const bool dact = a.epilogue == GemmEpilogue::ActivationBackward;
  require_arg(!a.w_n_major || a.epilogue == GemmEpilogue::Store || dact, fn, "w_n_major",
              "is taken by the Store and ActivationBackward epilogues only");
  require_arg(!dact || a.w_n_major, fn, "w_n_major", "must be set with ActivationBackward (W2 [E, d, n] is N-major)");
  if (dact) {
    const int64_t n1 = is_glu(a.activation) ? 2 * a.N : a.N;
    require_arg(a.h && a.ldh >= n1 && a.ldh % 8 == 0 && detail::aligned16(a.h), fn, "h/ldh",
                "ActivationBackward needs H with ldh >= " + std::to_string(n1) + ", a multiple of 8, 16-byte aligned");
    require_arg(a.ldc >= n1, fn, "ldc", "must be >= n1 = " + std::to_string(n1) + " (dH has H's columns)");
    require_arg(a.row_scores && a.row_pair && a.ds_partial, fn, "row_scores/row_pair/ds_partial",
                "must not be null with ActivationBackward");
    require_arg(a.bias == nullptr, fn, "bias", "must be null with ActivationBackward");
  }
}

}  // namespace

int64_t grouped_gemm_column_tiles(int64_t N) { return ceil_div(N, int64_t{kernels::kDsCols}); }

void grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
  constexpr const char* fn = "grouped_gemm";
  check_args(a);
  detail::GemmShape shape;
  shape.E = a.E;
  shape.N = a.N;
  shape.K = a.K;
  shape.epilogue = a.epilogue;
  shape.activation = a.activation;
  shape.layout = a.layout;
  shape.gather = a.gather != nullptr;
  shape.has_c = a.c != nullptr;
  shape.kernel = a.kernel;
  const GemmConfig cfg = detail::choose_gemm_config(shape);
  const int epi = static_cast<int>(cfg.epi);

  kernels::GroupedGemmParams p{};
  p.a = static_cast<const __nv_bfloat16*>(a.a);
  p.lda = a.lda;
  p.gather = a.gather;
  p.expert_offsets = a.expert_offsets;
  p.expert_ends = a.expert_row_ends ? a.expert_row_ends : a.expert_offsets + 1;
  p.tile_offsets = a.tile_offsets;
  p.bias = static_cast<const __nv_bfloat16*>(a.bias);
  p.c = static_cast<__nv_bfloat16*>(a.c);
  p.ldc = a.ldc;
  p.c2 = static_cast<__nv_bfloat16*>(a.c2);
  p.ldc2 = a.ldc2;
  p.E = static_cast<int>(a.E);
  p.N = static_cast<int>(a.N);
  p.K = static_cast<int>(a.K);
  p.n_tiles = static_cast<int>(cfg.n_tiles);
  detail::set_activation(p, a.activation, a.glu_clamp);
  p.h = static_cast<const __nv_bfloat16*>(a.h);
  p.ldh = a.ldh;
  p.row_scores = a.row_scores;
  p.row_pair = a.row_pair;
  p.ds_partial = a.ds_partial;
  p.ds_cols = static_cast<int>(grouped_gemm_column_tiles(a.N));

  // Above the kernel's shared-memory capacity the tile-offset table comes from a scan kernel.
  if (cfg.global_tile_offsets) {
    detail::launch_gemm_tile_offsets(p.expert_offsets, p.expert_ends, p.E, p.n_tiles, a.tile_offsets,
                                     "grouped_gemm: tile offsets", stream);
  }
  const int sms = device_info().sm_count;
  const int ctas = a.max_ctas > 0 ? std::min(a.max_ctas, sms) : sms;
  namespace k = kernels;
  if (cfg.kernel == GemmKernelKind::DactPingPong) {
    const CUtensorMap map_b = detail::tensor_map_nmajor(a.w, a.E, a.K, a.N, kernels::kGemmBK, fn);
    switch (epi) {
      case k::kEpiDGluInter: launch_dact_pingpong<k::kEpiDGluInter>(map_b, p, ctas, stream); break;
      case k::kEpiDGluConcat: launch_dact_pingpong<k::kEpiDGluConcat>(map_b, p, ctas, stream); break;
      default: launch_dact_pingpong<k::kEpiDAct>(map_b, p, ctas, stream); break;
    }
    check_launch(fn);
    return;
  }
  if (cfg.kernel == GemmKernelKind::PingPong) {  // W in boxes of 64 rows (K-major) or {64 N, 64 K}; C in boxes of 64 x 64
    const CUtensorMap map_b = a.w_n_major ? detail::tensor_map_nmajor(a.w, a.E, a.K, a.N, kernels::kGemmBK, fn)
                                          : detail::tensor_map_2d(a.w, a.E * a.N, a.K, a.K, kernels::kGemmBK, 64, fn);
    const CUtensorMap map_a = tile_tensor_map(a.a, a.a_rows, a.K, a.lda);
    const CUtensorMap map_c = detail::tensor_map_2d(a.c, int64_t{1} << 31, a.N, a.ldc, 64, 64, fn);
    if (a.w_n_major) launch_pingpong<true>(map_a, map_b, map_c, p, ctas, stream);
    else launch_pingpong<false>(map_a, map_b, map_c, p, ctas, stream);
    check_launch(fn);
    return;
  }
  const CUtensorMap map_b = a.w_n_major ? detail::tensor_map_nmajor(a.w, a.E, a.K, a.N, kernels::kGemmBK, fn)
                                        : tile_tensor_map(a.w, a.E * a.N, a.K, a.K);
  // Contiguous A goes through TMA too; with a gather the map is unused (any valid map will do).
  const CUtensorMap map_a = a.gather ? map_b : tile_tensor_map(a.a, a.a_rows, a.K, a.lda);
  // Full tiles' C (store) or H (interleaved GLU, activation) leave by TMA: C [rows, N] in boxes of
  // 64 columns x 128 rows. Only whole 128-row tiles inside an expert go this way, so the row bound
  // only has to cover them: the rows of C are not known on the host (R = off[E] is on the device).
  const bool boxed = epi == kernels::kEpiStore || epi == kernels::kEpiGluInter || epi == kernels::kEpiAct;
  const CUtensorMap map_c =
      boxed && a.c ? detail::tensor_map_2d(a.c, int64_t{1} << 31, a.N, a.ldc, 64, 128, fn) : map_b;
  const bool nm = a.w_n_major;
  const bool wide = cfg.bn == 256;
  auto run = [&](auto bn, auto epi_code) {
    launch_cooperative<decltype(bn)::value, decltype(epi_code)::value>(map_a, map_b, map_c, p, nm, ctas, stream);
  };
  auto with_width = [&](auto epi_code) {
    if (wide) run(std::integral_constant<int, 256>{}, epi_code);
    else run(std::integral_constant<int, 128>{}, epi_code);
  };
  switch (epi) {
    case k::kEpiStore: with_width(std::integral_constant<int, k::kEpiStore>{}); break;
    case k::kEpiGluInter: with_width(std::integral_constant<int, k::kEpiGluInter>{}); break;
    // (always 256 wide: 128 gate + 128 up columns)
    case k::kEpiGluConcat: run(std::integral_constant<int, 256>{}, std::integral_constant<int, k::kEpiGluConcat>{}); break;
    case k::kEpiAct: with_width(std::integral_constant<int, k::kEpiAct>{}); break;
    case k::kEpiDGluInter: with_width(std::integral_constant<int, k::kEpiDGluInter>{}); break;
    case k::kEpiDGluConcat: with_width(std::integral_constant<int, k::kEpiDGluConcat>{}); break;
    case k::kEpiDAct: with_width(std::integral_constant<int, k::kEpiDAct>{}); break;
  }
  check_launch(fn);
}

namespace detail {

void launch_gemm_tile_offsets(const int32_t* begins, const int32_t* ends, int E, int n_tiles, int32_t* tile_offsets,
                              const char* what, cudaStream_t stream) {
  kernels::grouped_gemm_tile_offsets<<<1, 1024, 0, stream>>>(begins, ends, E, n_tiles, tile_offsets);
  check_launch(what);
}

}  // namespace detail

}  // namespace machmoe
