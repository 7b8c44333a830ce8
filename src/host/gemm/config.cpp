// The grouped GEMMs' kernel choice (config.hpp): plain C++, no CUDA.
#include "host/gemm/config.hpp"

#include <string>

namespace machmoe::detail {
namespace {

GemmEpiCode epilogue_code(const GemmShape& s) {
  const bool interleaved = s.layout == GateUpLayout::Interleaved;
  switch (s.epilogue) {
    case GemmEpilogue::Store: return GemmEpiCode::Store;
    case GemmEpilogue::GLU: return interleaved ? GemmEpiCode::GluInter : GemmEpiCode::GluConcat;
    case GemmEpilogue::Activation: return GemmEpiCode::Act;
    case GemmEpilogue::ActivationBackward:
      if (!is_glu(s.activation)) return GemmEpiCode::DAct;
      return interleaved ? GemmEpiCode::DGluInter : GemmEpiCode::DGluConcat;
  }
  throw Error(ErrorCode::InvalidArgument, "grouped_gemm: epilogue out of range");
}

[[noreturn]] void refuse(const char* fn, const char* kernel, const std::string& why) {
  throw Error(ErrorCode::InvalidArgument, std::string(fn) + ": kernel " + kernel + " does not apply: " + why);
}

}  // namespace

GemmConfig choose_gemm_config(const GemmShape& s) {
  GemmConfig c;
  c.epi = epilogue_code(s);
  // The ping-pong kernel: the plain store with contiguous A, C written. Its weight boxes reach
  // row E·N + 191 of the [E*N, K] view, which must stay inside int32 (TMA coordinates).
  const bool store_applies = c.epi == GemmEpiCode::Store && !s.gather && s.has_c &&
                             s.E * s.N + kPingPongTileN <= (int64_t{1} << 31) - 1;
  // The dH ping-pong kernel: the dH epilogue with gathered A (its rows are routed tokens).
  const bool dact = s.epilogue == GemmEpilogue::ActivationBackward;
  const bool dact_applies = dact && s.gather;
  switch (s.kernel) {
    case GemmKernel::Auto:
      if (store_applies && kPingPongWhere.wins(s.N, s.K)) c.kernel = GemmKernelKind::PingPong;
      else if (dact_applies && kDactPingPongWhere.wins(s.K)) c.kernel = GemmKernelKind::DactPingPong;
      break;
    case GemmKernel::Cooperative: break;
    case GemmKernel::PingPong:
      if (store_applies) c.kernel = GemmKernelKind::PingPong;
      else if (dact_applies) c.kernel = GemmKernelKind::DactPingPong;
      else
        refuse("grouped_gemm", "PingPong",
               dact ? "the dH ping-pong kernel needs gathered A rows"
                    : "the ping-pong kernels run the Store epilogue with contiguous A and C written "
                      "(and E*N + 192 < 2^31), or ActivationBackward with gathered A");
      break;
    default: throw Error(ErrorCode::InvalidArgument, "grouped_gemm: kernel out of range");
  }
  switch (c.kernel) {
    case GemmKernelKind::PingPong: c.bn = kPingPongTileN; break;
    case GemmKernelKind::DactPingPong:
      c.bn = kDactPingPongTileN;
      c.smem_tile_experts = kDactPingPongSmemTileExperts;
      break;
    case GemmKernelKind::Cooperative:
      // 256 columns when N allows, else 128; the concatenated GLU tile always holds 128 gate +
      // 128 up columns.
      c.bn = s.N >= 256 || c.epi == GemmEpiCode::GluConcat ? 256 : 128;
      break;
  }
  c.tile_cols = c.epi == GemmEpiCode::GluConcat ? c.bn / 2 : c.bn;
  const int64_t n_cols = c.epi == GemmEpiCode::GluConcat ? s.N / 2 : s.N;
  c.n_tiles = (n_cols + c.tile_cols - 1) / c.tile_cols;
  c.global_tile_offsets = s.E > c.smem_tile_experts;
  return c;
}

WgradConfig choose_wgrad_config(const WgradShape& s) {
  WgradConfig c;
  c.bn = s.N >= 256 ? 256 : 128;
  c.m_tiles = (s.M + kWgradTileM - 1) / kWgradTileM;
  c.n_tiles = (s.N + c.bn - 1) / c.bn;
  const bool pairs_apply = c.n_tiles >= 2 && (s.max_ctas == 0 || s.max_ctas >= 2);
  switch (s.kernel) {
    case WgradKernel::Auto: c.cta_pairs = pairs_apply; break;
    case WgradKernel::SingleCta: break;
    case WgradKernel::CtaPairs:
      if (!pairs_apply)
        refuse("grouped_gemm_wgrad", "CtaPairs",
               c.n_tiles < 2 ? "CTA pairs need two or more column tiles (N > " + std::to_string(c.bn) + ")"
                             : std::string("CTA pairs need max_ctas = 0 or >= 2"));
      c.cta_pairs = true;
      break;
    default: throw Error(ErrorCode::InvalidArgument, "grouped_gemm_wgrad: kernel out of range");
  }
  c.units = s.E * c.m_tiles * (c.cta_pairs ? (c.n_tiles + 1) / 2 : c.n_tiles);
  return c;
}

}  // namespace machmoe::detail
