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
  TORCH_CHECK_VALUE(false, "epilogue: unknown value '", s, "'; choose one of store, glu, activation");
}

// a [*, K] bf16 rows; gather [R] int32 or none; expert_offsets [E+1] int32; w [E, N, K] bf16;
// bias [E, N] bf16 or none; num_rows = R (the caller's bound; off[E] <= R on the device).
std::tuple<Tensor, Tensor> op_grouped_gemm(const Tensor& a, const std::optional<Tensor>& gather,
                                           const Tensor& expert_offsets, const Tensor& w,
                                           const std::optional<Tensor>& bias, int64_t num_rows,
                                           const std::string& epilogue, const std::string& activation,
                                           const std::string& layout) {
  return translate_errors([&] {
    TORCH_CHECK_VALUE(a.is_cuda() && a.scalar_type() == at::kBFloat16 && a.dim() == 2 && a.stride(1) == 1,
                      "a must be a 2-D bfloat16 CUDA tensor with unit column stride");
    TORCH_CHECK_VALUE(w.is_cuda() && w.scalar_type() == at::kBFloat16 && w.dim() == 3 && w.is_contiguous(),
                      "w must be a contiguous [E, N, K] bfloat16 CUDA tensor");
    const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
    TORCH_CHECK_VALUE(a.size(1) == K, "a must have K = ", K, " columns, got ", a.size(1));
    TORCH_CHECK_VALUE(expert_offsets.is_cuda() && expert_offsets.scalar_type() == at::kInt &&
                          expert_offsets.numel() == E + 1,
                      "expert_offsets must be an int32 CUDA tensor of E+1 = ", E + 1, " elements");
    TORCH_CHECK_VALUE(num_rows >= 0, "num_rows must be >= 0");
    if (gather) {
      TORCH_CHECK_VALUE(gather->is_cuda() && gather->scalar_type() == at::kInt && gather->numel() >= num_rows,
                        "gather must be an int32 CUDA tensor of at least num_rows elements");
    }
    if (bias) {
      TORCH_CHECK_VALUE(bias->is_cuda() && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(),
                        "bias must be a contiguous bfloat16 CUDA tensor");
      check_shape(*bias, "bias", {E, N});
    }
    const GemmEpilogue epi = parse_epilogue(epilogue);
    const c10::cuda::CUDAGuard guard(a.device());
    Tensor c = at::empty({num_rows, N}, a.options());
    const int64_t c2_cols = epi == GemmEpilogue::GLU ? N / 2 : N;
    Tensor c2 = epi == GemmEpilogue::Store ? at::empty({0}, a.options()) : at::empty({num_rows, c2_cols}, a.options());
    Tensor tiles = at::empty({E + 1}, expert_offsets.options());
    GroupedGemmArgs g;
    g.a = a.data_ptr();
    g.lda = a.stride(0);
    g.a_rows = a.size(0);
    g.gather = gather ? gather->data_ptr<int32_t>() : nullptr;
    g.expert_offsets = expert_offsets.data_ptr<int32_t>();
    g.E = E;
    g.N = N;
    g.K = K;
    g.w = w.data_ptr();
    g.bias = bias ? bias->data_ptr() : nullptr;
    g.c = c.data_ptr();
    g.ldc = N;
    g.c2 = epi == GemmEpilogue::Store ? nullptr : c2.data_ptr();
    g.ldc2 = c2_cols;
    g.epilogue = epi;
    g.activation = parse_activation(activation);
    g.layout = parse_layout(layout);
    g.tile_offsets = tiles.data_ptr<int32_t>();
    if (num_rows > 0) grouped_gemm(g, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(c, c2);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("grouped_gemm(Tensor a, Tensor? gather, Tensor expert_offsets, Tensor w, Tensor? bias, int num_rows,"
        " str epilogue, str activation, str layout) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) { m.impl("grouped_gemm", &op_grouped_gemm); }

}  // namespace machmoe::bindings
