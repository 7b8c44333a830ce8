// Launcher of the sm_90a grouped GEMM engine (kernels/sm90_grouped_gemm.cuh): argument rules, the
// tile configuration, the TMA descriptor of the weights, and the persistent launch.
#include <cuda.h>

#include <mutex>
#include <string>

#include "host/check.hpp"
#include "kernels/sm90_grouped_gemm.cuh"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::ceil_div;
using detail::check_cuda;
using detail::check_launch;
using detail::require_arg;

namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder, found through the runtime (no link against libcuda).
EncodeTiledFn encode_tiled() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q),
               "grouped_gemm: cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (q != cudaDriverEntryPointSuccess || !ptr)
      throw Error(ErrorCode::CudaError, "grouped_gemm: the driver has no cuTensorMapEncodeTiled (needs CUDA 12+)");
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// A bf16 matrix [rows, K] with `ld` elements between rows, as a 2-D tensor map: boxes of 64 (K) x
// 128 rows, 128-byte swizzle (what the wgmma descriptors expect), zeros out of bounds.
CUtensorMap tile_tensor_map(const void* ptr, int64_t rows, int64_t K, int64_t ld) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {kernels::kGemmBK, 128};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides,
                                    box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(ErrorCode::CudaError, "grouped_gemm: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(r));
  return map;
}

int epilogue_code(const GroupedGemmArgs& a) {
  switch (a.epilogue) {
    case GemmEpilogue::Store: return kernels::kEpiStore;
    case GemmEpilogue::GLU:
      return a.layout == GateUpLayout::Interleaved ? kernels::kEpiGluInter : kernels::kEpiGluConcat;
    case GemmEpilogue::Activation: return kernels::kEpiAct;
  }
  throw Error(ErrorCode::InvalidArgument, "grouped_gemm: epilogue out of range");
}

template <int BN, int EPI, bool GATHER>
void launch_variant(const CUtensorMap& map_a, const CUtensorMap& map_b, const kernels::GroupedGemmParams& p, int ctas,
                    cudaStream_t stream) {
  constexpr int smem = kernels::GemmSmem<BN>::kBytes;
  static std::once_flag attr_once;
  std::call_once(attr_once, [] {
    check_cuda(cudaFuncSetAttribute(kernels::sm90_grouped_gemm<BN, EPI, GATHER>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "grouped_gemm: cudaFuncSetAttribute");
  });
  const DeviceInfo info = device_info();
  require_arg(info.smem_per_block_optin >= static_cast<size_t>(smem), "grouped_gemm", "device",
              "needs " + std::to_string(smem) + " bytes of shared memory per block, the device allows " +
                  std::to_string(info.smem_per_block_optin));
  kernels::sm90_grouped_gemm<BN, EPI, GATHER><<<ctas, kernels::kGemmThreads, smem, stream>>>(map_a, map_b, p);
}

template <int BN, int EPI>
void launch(const CUtensorMap& map_a, const CUtensorMap& map_b, const kernels::GroupedGemmParams& p, int ctas,
            cudaStream_t stream) {
  if (p.gather) launch_variant<BN, EPI, true>(map_a, map_b, p, ctas, stream);
  else launch_variant<BN, EPI, false>(map_a, map_b, p, ctas, stream);
}

}  // namespace

int64_t grouped_gemm_column_tiles(int64_t N) {
  const int64_t cols = N >= 256 ? 256 : 128;
  return ceil_div(N, cols);
}

void grouped_gemm(const GroupedGemmArgs& a, cudaStream_t stream) {
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
  require_arg(a.ldc >= a.N && a.ldc % 8 == 0, fn, "ldc", "must be >= N and a multiple of 8");
  require_arg(a.a && a.w && a.c && a.expert_offsets && a.tile_offsets, fn, "a/w/c/expert_offsets/tile_offsets",
              "must not be null");
  require_arg(detail::aligned16(a.a) && detail::aligned16(a.w) && detail::aligned16(a.c), fn, "a/w/c",
              "must be 16-byte aligned");
  const int epi = epilogue_code(a);
  if (a.epilogue != GemmEpilogue::Store) {
    const int64_t c2_cols = a.epilogue == GemmEpilogue::GLU ? a.N / 2 : a.N;
    require_arg(a.c2 && a.ldc2 >= c2_cols && a.ldc2 % 8 == 0, fn, "c2/ldc2",
                "needs an activation output with ldc2 >= " + std::to_string(c2_cols) + " and a multiple of 8");
  }
  if (a.epilogue == GemmEpilogue::GLU)
    require_arg(a.N % 16 == 0, fn, "N", "must be a multiple of 16 for a GLU (2n with n a multiple of 8)");

  // Configuration (data, not code): 256-column tiles when N allows, else 128. The concatenated
  // GLU tile holds 128 gate + 128 up columns.
  const bool wide = a.N >= 256 || epi == kernels::kEpiGluConcat;
  const int bn = wide ? 256 : 128;
  const int tile_cols = epi == kernels::kEpiGluConcat ? bn / 2 : bn;
  const int64_t n_cols = epi == kernels::kEpiGluConcat ? a.N / 2 : a.N;
  kernels::GroupedGemmParams p{};
  p.a = static_cast<const __nv_bfloat16*>(a.a);
  p.lda = a.lda;
  p.gather = a.gather;
  p.expert_offsets = a.expert_offsets;
  p.tile_offsets = a.tile_offsets;
  p.bias = static_cast<const __nv_bfloat16*>(a.bias);
  p.c = static_cast<__nv_bfloat16*>(a.c);
  p.ldc = a.ldc;
  p.c2 = static_cast<__nv_bfloat16*>(a.c2);
  p.ldc2 = a.ldc2;
  p.E = static_cast<int>(a.E);
  p.N = static_cast<int>(a.N);
  p.K = static_cast<int>(a.K);
  p.n_tiles = static_cast<int>(ceil_div(n_cols, tile_cols));
  p.act = static_cast<int>(a.activation);

  kernels::grouped_gemm_tile_offsets<<<1, 1024, 0, stream>>>(a.expert_offsets, p.E, p.n_tiles, a.tile_offsets);
  check_launch("grouped_gemm: tile offsets");
  const CUtensorMap map_b = tile_tensor_map(a.w, a.E * a.N, a.K, a.K);
  // Contiguous A goes through TMA too; with a gather the map is unused (any valid map will do).
  const CUtensorMap map_a = a.gather ? map_b : tile_tensor_map(a.a, a.a_rows, a.K, a.lda);
  const int sms = device_info().sm_count;
  const int ctas = a.max_ctas > 0 ? std::min(a.max_ctas, sms) : sms;
  switch (epi) {
    case kernels::kEpiStore: wide ? launch<256, kernels::kEpiStore>(map_a, map_b, p, ctas, stream)
                                  : launch<128, kernels::kEpiStore>(map_a, map_b, p, ctas, stream); break;
    case kernels::kEpiGluInter: wide ? launch<256, kernels::kEpiGluInter>(map_a, map_b, p, ctas, stream)
                                     : launch<128, kernels::kEpiGluInter>(map_a, map_b, p, ctas, stream); break;
    case kernels::kEpiGluConcat: launch<256, kernels::kEpiGluConcat>(map_a, map_b, p, ctas, stream); break;
    case kernels::kEpiAct: wide ? launch<256, kernels::kEpiAct>(map_a, map_b, p, ctas, stream)
                                : launch<128, kernels::kEpiAct>(map_a, map_b, p, ctas, stream); break;
  }
  check_launch(fn);
}

}  // namespace machmoe
