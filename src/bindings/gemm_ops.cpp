// PyTorch op over the grouped GEMM engine (docs/OPS.md): CUDA bf16 tensors, current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "bindings/common.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

GemmEpilogue parse_epilogue(const std::string& s) {
  if (s == "store") return GemmEpilogue::Store;
  if (s == "glu") return GemmEpilogue::GLU;
  if (s == "activation") return GemmEpilogue::Activation;
  MACHMOE_CHECK_VALUE(false, "epilogue: unknown value '", s, "'; choose one of store, glu, activation");
}

// The ops' `kernel` argument (GemmKernel; tests and comparisons force one, "auto" lets the shape
// rule choose).
GemmKernel parse_kernel(const std::string& s) {
  if (s == "auto") return GemmKernel::Auto;
  if (s == "cooperative") return GemmKernel::Cooperative;
  if (s == "pingpong") return GemmKernel::PingPong;
  MACHMOE_CHECK_VALUE(false, "kernel: unknown value '", s, "'; choose one of auto, cooperative, pingpong");
}

WgradKernel parse_wgrad_kernel(const std::string& s) {
  if (s == "auto") return WgradKernel::Auto;
  if (s == "single") return WgradKernel::SingleCta;
  if (s == "pairs") return WgradKernel::CtaPairs;
  MACHMOE_CHECK_VALUE(false, "kernel: unknown value '", s, "'; choose one of auto, single, pairs");
}

void check_bf16_matrix(const Tensor& t, const char* name, int dims) {
  check_dims(t, name, dims);
  check_bf16(t, name, t.sizes());  // dtype, device and contiguity; any shape of `dims` dimensions
}

void check_int32(const Tensor& t, const char* name, int64_t min_numel) {
  MACHMOE_CHECK_VALUE(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous() && t.numel() >= min_numel, name,
                    " must be a contiguous int32 CUDA tensor of at least ", min_numel, " elements");
}

// The arguments both GEMM ops share: A rows (lda apart; a_rows of them), the gather index or none,
// the expert offsets, W [E, *, *] and the tile-offset workspace (returned: it must outlive the call).
GroupedGemmArgs gemm_args(const Tensor& a, int64_t lda, const std::optional<Tensor>& gather,
                          const Tensor& expert_offsets, const Tensor& w, int64_t E, int64_t N, int64_t K,
                          Tensor& tiles) {
  tiles = at::empty({E + 1}, expert_offsets.options());
  GroupedGemmArgs g;
  g.a = a.data_ptr();
  g.lda = lda;
  g.a_rows = a.size(0);
  g.gather = gather ? gather->data_ptr<int32_t>() : nullptr;
  g.expert_offsets = expert_offsets.data_ptr<int32_t>();
  g.E = E;
  g.N = N;
  g.K = K;
  g.w = w.data_ptr();
  g.tile_offsets = tiles.data_ptr<int32_t>();
  return g;
}

// a [*, K] bf16 rows; gather [R] int32 or none; expert_offsets [E+1] int32; w [E, N, K] bf16;
// bias [E, N] bf16 or none; num_rows = R (the caller's bound; off[E] <= R on the device).
std::tuple<Tensor, Tensor> op_grouped_gemm(const Tensor& a, const std::optional<Tensor>& gather,
                                           const Tensor& expert_offsets, const Tensor& w,
                                           const std::optional<Tensor>& bias, int64_t num_rows,
                                           const std::string& epilogue, const std::string& activation,
                                           const std::string& layout, const std::string& kernel,
                                           at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    MACHMOE_CHECK_VALUE(a.is_cuda() && a.scalar_type() == at::kBFloat16 && a.dim() == 2 && a.stride(1) == 1,
                      "a must be a 2-D bfloat16 CUDA tensor with unit column stride");
    MACHMOE_CHECK_VALUE(w.is_cuda() && w.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.is_contiguous(),
                      "w must be a contiguous [E, N, K] bfloat16 CUDA tensor");
    const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
    MACHMOE_CHECK_VALUE(a.size(1) == K, "a must have K = ", K, " columns, got ", a.size(1));
    check_int32(expert_offsets, "expert_offsets", E + 1);
    MACHMOE_CHECK_VALUE(expert_offsets.numel() == E + 1, "expert_offsets must have E+1 = ", E + 1, " elements");
    MACHMOE_CHECK_VALUE(num_rows >= 0, "num_rows must be >= 0");
    if (gather) check_int32(*gather, "gather", num_rows);
    if (bias) {
      MACHMOE_CHECK_VALUE(bias->is_cuda() && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(),
                        "bias must be a contiguous bfloat16 CUDA tensor");
      check_shape(*bias, "bias", {E, N});
    }
    const GemmEpilogue epi = parse_epilogue(epilogue);
    const c10::cuda::CUDAGuard guard(a.device());
    Tensor c = at::empty({num_rows, N}, a.options());
    const int64_t c2_cols = epi == GemmEpilogue::GLU ? N / 2 : N;
    Tensor c2 = epi == GemmEpilogue::Store ? at::empty({0}, a.options()) : at::empty({num_rows, c2_cols}, a.options());
    Tensor tiles;
    GroupedGemmArgs g = gemm_args(a, a.stride(0), gather, expert_offsets, w, E, N, K, tiles);
    g.bias = bias ? bias->data_ptr() : nullptr;
    g.c = c.data_ptr();
    g.ldc = N;
    g.c2 = epi == GemmEpilogue::Store ? nullptr : c2.data_ptr();
    g.ldc2 = c2_cols;
    g.epilogue = epi;
    g.activation = parse_activation(activation);
    g.glu_clamp = glu_clamp_from(glu_clamp);
    g.layout = parse_layout(layout);
    g.kernel = parse_kernel(kernel);
    if (num_rows > 0) grouped_gemm(g, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(c, c2);
  });
}

// The backward's GEMMs with N-major weights. dact = false: C [num_rows, N] = A[rows] · W[e] with
// w_kn [E, K, N] (dX~ = dH·W1). dact = true: the dH kernel, w_kn = W2 [E, d, n], h [*, n1],
// returns (dH [num_rows, n1], A' [num_rows, n], ds_partial [num_rows, ceil(n / 128)]).
std::tuple<Tensor, Tensor, Tensor> op_grouped_gemm_nmajor(const Tensor& a, const std::optional<Tensor>& gather,
                                                          const Tensor& expert_offsets, const Tensor& w_kn,
                                                          int64_t num_rows, const std::optional<Tensor>& h,
                                                          const std::optional<Tensor>& row_scores,
                                                          const std::optional<Tensor>& row_pair,
                                                          const std::string& activation, const std::string& layout,
                                                          const std::string& kernel, at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    check_bf16_matrix(a, "a", 2);
    check_bf16_matrix(w_kn, "w_kn", 3);
    const int64_t E = w_kn.size(0), K = w_kn.size(1), N = w_kn.size(2);
    MACHMOE_CHECK_VALUE(a.size(1) == K, "a must have K = ", K, " columns, got ", a.size(1));
    check_int32(expert_offsets, "expert_offsets", E + 1);
    MACHMOE_CHECK_VALUE(num_rows >= 0, "num_rows must be >= 0");
    if (gather) check_int32(*gather, "gather", num_rows);
    const bool dact = h.has_value();
    MACHMOE_CHECK_VALUE(dact == row_scores.has_value() && dact == row_pair.has_value(),
                      "h, row_scores and row_pair go together (the dH epilogue)");
    const Activation act = parse_activation(activation);
    const int64_t n1 = is_glu(act) ? 2 * N : N;
    const c10::cuda::CUDAGuard guard(a.device());
    Tensor tiles;
    GroupedGemmArgs g = gemm_args(a, K, gather, expert_offsets, w_kn, E, N, K, tiles);
    g.w_n_major = true;
    g.activation = act;
    g.glu_clamp = glu_clamp_from(glu_clamp);
    g.layout = parse_layout(layout);
    g.kernel = parse_kernel(kernel);
    Tensor c, c2, ds;
    if (!dact) {
      c = at::empty({num_rows, N}, a.options());
      c2 = at::empty({0}, a.options());
      ds = at::empty({0}, a.options().dtype(at::kFloat));
      g.epilogue = GemmEpilogue::Store;
      g.ldc = N;
    } else {
      check_bf16_matrix(*h, "h", 2);
      MACHMOE_CHECK_VALUE(h->size(1) == n1 && h->size(0) >= num_rows, "h must be [>= num_rows, ", n1, "]");
      MACHMOE_CHECK_VALUE(row_scores->is_cuda() && row_scores->scalar_type() == at::kFloat && row_scores->is_contiguous(),
                        "row_scores must be a contiguous float32 CUDA tensor");
      check_int32(*row_pair, "row_pair", num_rows);
      c = at::empty({num_rows, n1}, a.options());
      c2 = at::empty({num_rows, N}, a.options());
      ds = at::empty({num_rows, grouped_gemm_column_tiles(N)}, a.options().dtype(at::kFloat));
      g.epilogue = GemmEpilogue::ActivationBackward;
      g.ldc = n1;
      g.c2 = c2.data_ptr();
      g.ldc2 = N;
      g.h = h->data_ptr();
      g.ldh = n1;
      g.row_scores = row_scores->data_ptr<float>();
      g.row_pair = row_pair->data_ptr<int32_t>();
      g.ds_partial = ds.data_ptr<float>();
    }
    g.c = c.data_ptr();
    if (num_rows > 0) grouped_gemm(g, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(c, c2, ds);
  });
}

// C [E, M, N] (or [E, N, M] with transpose_c) = Σ over each expert's rows of a[gather[r]]ᵀ ⊗ b[r].
Tensor op_grouped_gemm_wgrad(const Tensor& a, const std::optional<Tensor>& a_gather, const Tensor& b,
                             const Tensor& expert_offsets, bool transpose_c, bool fp32, const std::string& kernel) {
  return translate_errors([&] {
    check_bf16_matrix(a, "a", 2);
    check_bf16_matrix(b, "b", 2);
    const int64_t E = expert_offsets.numel() - 1, M = a.size(1), N = b.size(1);
    MACHMOE_CHECK_VALUE(E >= 1, "expert_offsets must have E+1 >= 2 elements");
    check_int32(expert_offsets, "expert_offsets", E + 1);
    if (a_gather) check_int32(*a_gather, "a_gather", 0);
    const c10::cuda::CUDAGuard guard(a.device());
    Tensor c = transpose_c ? at::empty({E, N, M}, a.options().dtype(fp32 ? at::kFloat : at::kBFloat16))
                           : at::empty({E, M, N}, a.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
    GroupedWgradArgs w;
    w.a = a.data_ptr();
    w.lda = M;
    w.a_rows = a.size(0);
    w.a_gather = a_gather ? a_gather->data_ptr<int32_t>() : nullptr;
    w.b = b.data_ptr();
    w.ldb = N;
    w.b_rows = b.size(0);
    w.expert_offsets = expert_offsets.data_ptr<int32_t>();
    w.E = E;
    w.M = M;
    w.N = N;
    w.c = c.data_ptr();
    w.c_dtype = fp32 ? DType::FP32 : DType::BF16;
    w.transpose_c = transpose_c;
    w.kernel = parse_wgrad_kernel(kernel);
    grouped_gemm_wgrad(w, at::cuda::getCurrentCUDAStream());
    return c;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("grouped_gemm(Tensor a, Tensor? gather, Tensor expert_offsets, Tensor w, Tensor? bias, int num_rows,"
        " str epilogue, str activation, str layout, str kernel=\"auto\", float[] glu_clamp=[]) -> (Tensor, Tensor)");
  m.def("grouped_gemm_nmajor(Tensor a, Tensor? gather, Tensor expert_offsets, Tensor w_kn, int num_rows,"
        " Tensor? h, Tensor? row_scores, Tensor? row_pair, str activation, str layout, str kernel=\"auto\","
        " float[] glu_clamp=[])"
        " -> (Tensor, Tensor, Tensor)");
  m.def("grouped_gemm_wgrad(Tensor a, Tensor? a_gather, Tensor b, Tensor expert_offsets, bool transpose_c,"
        " bool fp32, str kernel=\"auto\") -> Tensor");
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("grouped_gemm", &op_grouped_gemm);
  m.impl("grouped_gemm_nmajor", &op_grouped_gemm_nmajor);
  m.impl("grouped_gemm_wgrad", &op_grouped_gemm_wgrad);
}

}  // namespace machmoe::bindings
