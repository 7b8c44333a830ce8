// PyTorch ops over the FP8 (E4M3) quantisers and the FP8 grouped GEMM (machmoe/fp8.hpp; schemas
// and layouts in docs/OPS.md): CUDA tensors, the current stream, no host synchronisation. E4M3
// codes travel as torch.float8_e4m3fn tensors (the same bytes as the C++ API's uint8 codes), scales
// as float32. Every output size comes from the inputs' shapes alone (the columns layout from
// fp8_columns_layout(R, E, d)), so the fakes (python/machmoe/_fake.py) size them without data.
// The argument rules the C++ API states (d, K multiples of 16, alignment, ranges) are checked
// there and raised as ValueError naming the argument; the checks here are the tensors' own
// (device, dtype, contiguity, shapes agreeing with one another).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/common.hpp"
#include "host/layer/saved_layout.hpp"
#include "machmoe/fp8.hpp"
#include "machmoe/fp8_swiglu.hpp"
#include "machmoe/fp8_wgrad.hpp"

namespace machmoe::bindings {
namespace {

using at::Tensor;

constexpr at::ScalarType kE4M3 = at::kFloat8_e4m3fn;

uint8_t* codes(Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }
const uint8_t* codes(const Tensor& t) { return static_cast<const uint8_t*>(t.data_ptr()); }

// The op's first tensor: `dims`-D, CUDA, of `dtype`, contiguous (any sizes); its device is the op's.
void check_first(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dims) {
  check_dims(t, name, dims);
  check_tensor(t, name, dtype, t.sizes());
}

// A row index [R] (the gathers): 1-D int32, contiguous, on `device`; returns R.
int64_t check_index(const Tensor& t, const char* name, const at::Device& device) {
  check_dims(t, name, 1);
  check_tensor(t, name, at::kInt, t.sizes(), &device);
  return t.size(0);
}

// expert_offsets [E+1] int32 with E >= 1; returns E.
int64_t check_offsets(const Tensor& t, const at::Device& device) {
  check_dims(t, "expert_offsets", 1);
  MACHMOE_CHECK_VALUE(t.size(0) >= 2, "expert_offsets must have E+1 >= 2 elements, got ", t.size(0));
  check_tensor(t, "expert_offsets", at::kInt, t.sizes(), &device);
  return t.size(0) - 1;
}

// x [T, d] bf16, its rows gathered by gather [R] int32 (None: x itself, R = T) ->
// q [R, d] e4m3, scales [R, ceil(d/128)] f32.
std::tuple<Tensor, Tensor> op_fp8_quantize_rows(const Tensor& x, const std::optional<Tensor>& gather) {
  return translate_errors([&] {
    check_first(x, "x", at::kBFloat16, 2);
    const at::Device device = x.device();
    const int64_t T = x.size(0), d = x.size(1);
    const int64_t R = gather ? check_index(*gather, "gather", device) : T;
    const c10::cuda::CUDAGuard guard(device);
    Tensor q = at::empty({R, d}, x.options().dtype(kE4M3));
    Tensor scales = at::empty({R, fp8_tiles(d)}, x.options().dtype(at::kFloat));
    QuantizeRowsArgs a;
    a.x = x.data_ptr();
    a.T = T;
    a.d = d;
    a.ld = d;
    a.gather = gather ? gather->data_ptr<int32_t>() : nullptr;
    a.R = R;
    a.q = codes(q);
    a.scales = scales.data_ptr<float>();
    quantize_rows_fp8(a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(q, scales);
  });
}

// w [E, N, K] bf16 -> q [E, N, K] e4m3, scales [E, ceil(N/128), ceil(K/128)] f32 and, with
// `transposed`, qt [E, K, N] e4m3, qt_scales [E, ceil(K/128), ceil(N/128)] f32 (else None).
std::tuple<Tensor, Tensor, std::optional<Tensor>, std::optional<Tensor>> op_fp8_quantize_weights(const Tensor& w,
                                                                                                 bool transposed) {
  return translate_errors([&] {
    check_first(w, "w", at::kBFloat16, 3);
    const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
    const c10::cuda::CUDAGuard guard(w.device());
    const auto f32 = w.options().dtype(at::kFloat);
    Tensor q = at::empty({E, N, K}, w.options().dtype(kE4M3));
    Tensor scales = at::empty({E, fp8_tiles(N), fp8_tiles(K)}, f32);
    std::optional<Tensor> qt, qt_scales;
    if (transposed) {
      qt = at::empty({E, K, N}, w.options().dtype(kE4M3));
      qt_scales = at::empty({E, fp8_tiles(K), fp8_tiles(N)}, f32);
    }
    QuantizeWeightsArgs a;
    a.w = w.data_ptr();
    a.E = E;
    a.N = N;
    a.K = K;
    a.q = codes(q);
    a.scales = scales.data_ptr<float>();
    a.transposed = transposed;
    a.qt = transposed ? codes(*qt) : nullptr;
    a.scales_t = transposed ? qt_scales->data_ptr<float>() : nullptr;
    quantize_weights_fp8(a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(q, scales, qt, qt_scales);
  });
}

// x [T, d] bf16, gather [R] int32 (None: x itself, R = T), expert_offsets [E+1] int32 ->
// qt [max_chunks, d, 128] e4m3, scales [max_chunks, d] f32, chunk_offsets [E+1] int32, with
// max_chunks = fp8_columns_layout(R, E, d).max_chunks: the most chunks any offsets within R give.
// The chunks past chunk_offsets[E] (their qt and scales rows) are left unwritten.
std::tuple<Tensor, Tensor, Tensor> op_fp8_quantize_columns(const Tensor& x, const std::optional<Tensor>& gather,
                                                           const Tensor& expert_offsets) {
  return translate_errors([&] {
    check_first(x, "x", at::kBFloat16, 2);
    const at::Device device = x.device();
    const int64_t T = x.size(0), d = x.size(1);
    const int64_t R = gather ? check_index(*gather, "gather", device) : T;
    const int64_t E = check_offsets(expert_offsets, device);
    const Fp8ColumnsLayout layout = fp8_columns_layout(R, E, d);  // host arithmetic: no sync
    const c10::cuda::CUDAGuard guard(device);
    Tensor qt = at::empty({layout.max_chunks, d, 128}, x.options().dtype(kE4M3));
    Tensor scales = at::empty({layout.max_chunks, d}, x.options().dtype(at::kFloat));
    Tensor chunk_offsets = at::empty({E + 1}, x.options().dtype(at::kInt));
    QuantizeColumnsArgs a;
    a.x = x.data_ptr();
    a.T = T;
    a.d = d;
    a.ld = d;
    a.gather = gather ? gather->data_ptr<int32_t>() : nullptr;
    a.R = R;
    a.expert_offsets = expert_offsets.data_ptr<int32_t>();
    a.E = E;
    a.chunk_offsets = chunk_offsets.data_ptr<int32_t>();
    a.qt = codes(qt);
    a.scales = scales.data_ptr<float>();
    quantize_columns_fp8(a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(qt, scales, chunk_offsets);
  });
}

// The operands both FP8 GEMM ops share, checked (a_q [T, K], a_scales [T, ceil(K/128)], w_q
// [E, N, K], w_scales [E, ceil(N/128), ceil(K/128)], expert_offsets [E+1], gather [R] or None: R = T)
// and set into the C++ arguments, with the tile-table workspace E > 512 needs (kept alive in
// `tiles`); the caller sets the outputs.
struct Fp8GemmCall {
  GroupedGemmFp8Args args;
  at::Device device = at::kCUDA;
  Tensor tiles;
};
Fp8GemmCall fp8_gemm_call(const Tensor& a_q, const Tensor& a_scales, const Tensor& w_q, const Tensor& w_scales,
                          const Tensor& expert_offsets, int64_t max_ctas, const std::optional<Tensor>& gather) {
  check_first(a_q, "a_q", kE4M3, 2);
  Fp8GemmCall call;
  call.device = a_q.device();
  const at::Device& device = call.device;
  const int64_t T = a_q.size(0), K = a_q.size(1);
  const int64_t R = gather ? check_index(*gather, "gather", device) : T;
  check_dims(w_q, "w_q", 3);
  check_tensor(w_q, "w_q", kE4M3, w_q.sizes(), &device);
  const int64_t E = w_q.size(0), N = w_q.size(1);
  MACHMOE_CHECK_VALUE(w_q.size(2) == K, "w_q must be [E, N, K] with K = ", K, " (a_q's columns), got shape ",
                      w_q.sizes());
  check_tensor(a_scales, "a_scales", at::kFloat, {T, fp8_tiles(K)}, &device);
  check_tensor(w_scales, "w_scales", at::kFloat, {E, fp8_tiles(N), fp8_tiles(K)}, &device);
  check_dims(expert_offsets, "expert_offsets", 1);
  check_tensor(expert_offsets, "expert_offsets", at::kInt, {E + 1}, &device);
  MACHMOE_CHECK_VALUE(max_ctas >= 0 && max_ctas <= std::numeric_limits<int>::max(),
                      "max_ctas must be in [0, 2^31 - 1] (0: one CTA per SM), got ", max_ctas);
  // The tile-offset table's workspace: the launcher writes it only for E > 512.
  if (E > 512) call.tiles = at::empty({E + 1}, expert_offsets.options());
  GroupedGemmFp8Args& g = call.args;
  g.a_q = codes(a_q);
  g.a_scales = a_scales.data_ptr<float>();
  g.R = R;
  g.gather = gather ? gather->data_ptr<int32_t>() : nullptr;
  g.T = T;
  g.w_q = codes(w_q);
  g.w_scales = w_scales.data_ptr<float>();
  g.expert_offsets = expert_offsets.data_ptr<int32_t>();
  g.E = E;
  g.N = N;
  g.K = K;
  g.tile_offsets = call.tiles.defined() ? call.tiles.data_ptr<int32_t>() : nullptr;
  g.max_ctas = static_cast<int>(max_ctas);
  return call;
}

// C [R, N] bf16 = the FP8 grouped GEMM of a_q [T, K] (a_scales [T, ceil(K/128)]) with w_q [E, N, K]
// (w_scales [E, ceil(N/128), ceil(K/128)]) per expert's rows [off[e], off[e+1]), row r reading
// a_q[gather[r]] (gather [R] int32; None: a_q[r], R = T), + bias[e] (bf16 [E, N], without a
// gather only). Rows outside every expert are not written (C is allocated uninitialised, as
// grouped_gemm's).
Tensor op_grouped_gemm_fp8(const Tensor& a_q, const Tensor& a_scales, const Tensor& w_q, const Tensor& w_scales,
                           const Tensor& expert_offsets, int64_t max_ctas, const std::optional<Tensor>& gather,
                           const std::optional<Tensor>& bias) {
  return translate_errors([&] {
    Fp8GemmCall call = fp8_gemm_call(a_q, a_scales, w_q, w_scales, expert_offsets, max_ctas, gather);
    GroupedGemmFp8Args& g = call.args;
    if (bias) check_tensor(*bias, "bias", at::kBFloat16, {g.E, g.N}, &call.device);
    g.bias = bias ? bias->data_ptr() : nullptr;
    const c10::cuda::CUDAGuard guard(call.device);
    Tensor c = at::empty({g.R, g.N}, a_q.options().dtype(at::kBFloat16));
    g.c = c.data_ptr();
    g.ldc = g.N;
    grouped_gemm_fp8(g, at::cuda::getCurrentCUDAStream());
    return c;
  });
}

// The up-projection with the GLU epilogue: (hq [R, N] e4m3, h_scales [R, N/128], act_q [R, N/2]
// e4m3, act_scales [R, N/256]), the tile counts rounded up (machmoe/fp8.hpp, Fp8GemmEpilogue::Glu).
std::tuple<Tensor, Tensor, Tensor, Tensor> op_grouped_gemm_fp8_glu(
    const Tensor& a_q, const Tensor& a_scales, const Tensor& w_q, const Tensor& w_scales,
    const Tensor& expert_offsets, const std::string& activation, at::ArrayRef<double> glu_clamp,
    const std::optional<Tensor>& bias, int64_t max_ctas, const std::optional<Tensor>& gather) {
  return translate_errors([&] {
    Fp8GemmCall call = fp8_gemm_call(a_q, a_scales, w_q, w_scales, expert_offsets, max_ctas, gather);
    GroupedGemmFp8Args& g = call.args;
    if (bias) check_tensor(*bias, "bias", at::kBFloat16, {g.E, g.N}, &call.device);
    const c10::cuda::CUDAGuard guard(call.device);
    const int64_t R = g.R, N = g.N;
    Tensor hq = at::empty({R, N}, a_q.options());
    Tensor h_scales = at::empty({R, fp8_tiles(N)}, a_q.options().dtype(at::kFloat));
    Tensor act_q = at::empty({R, N / 2}, a_q.options());
    Tensor act_scales = at::empty({R, fp8_tiles(N / 2)}, a_q.options().dtype(at::kFloat));
    g.epilogue = Fp8GemmEpilogue::Glu;
    g.activation = parse_activation(activation);
    g.glu_clamp = glu_clamp_from(glu_clamp);
    g.bias = bias ? bias->data_ptr() : nullptr;
    g.hq = static_cast<uint8_t*>(hq.data_ptr());
    g.h_scales = h_scales.data_ptr<float>();
    g.act_q = static_cast<uint8_t*>(act_q.data_ptr());
    g.act_scales = act_scales.data_ptr<float>();
    grouped_gemm_fp8(g, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(hq, h_scales, act_q, act_scales);
  });
}

// The weight-gradient GEMM on two quantize_columns_fp8 outputs of the same rows and experts:
// C [E, M, N] (or [E, N, M] with transpose_c) in out_dtype (float32 or bfloat16),
// C[e] = Σ over expert e's chunks of a_scales·b_scales·(a_qt chunk · b_qt chunkᵀ) (machmoe/fp8_wgrad.hpp).
Tensor op_grouped_wgrad_fp8(const Tensor& a_qt, const Tensor& a_scales, const Tensor& b_qt, const Tensor& b_scales,
                            const Tensor& chunk_offsets, at::ScalarType out_dtype, bool transpose_c,
                            int64_t max_ctas) {
  return translate_errors([&] {
    check_first(a_qt, "a_qt", kE4M3, 3);
    const at::Device device = a_qt.device();
    const int64_t chunks = a_qt.size(0), M = a_qt.size(1);
    MACHMOE_CHECK_VALUE(a_qt.size(2) == 128, "a_qt must be [C, M, 128] (quantize_columns_fp8's layout), got shape ",
                        a_qt.sizes());
    check_tensor(a_scales, "a_scales", at::kFloat, {chunks, M}, &device);
    check_dims(b_qt, "b_qt", 3);
    const int64_t N = b_qt.size(1);
    check_tensor(b_qt, "b_qt", kE4M3, {chunks, N, 128}, &device);
    check_tensor(b_scales, "b_scales", at::kFloat, {chunks, N}, &device);
    check_dims(chunk_offsets, "chunk_offsets", 1);
    check_tensor(chunk_offsets, "chunk_offsets", at::kInt, chunk_offsets.sizes(), &device);
    const int64_t E = chunk_offsets.size(0) - 1;
    MACHMOE_CHECK_VALUE(E >= 1, "chunk_offsets must be [E+1] with E >= 1, got shape ", chunk_offsets.sizes());
    MACHMOE_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
                        "out_dtype must be torch.float32 or torch.bfloat16, got ", out_dtype);
    MACHMOE_CHECK_VALUE(max_ctas >= 0 && max_ctas <= std::numeric_limits<int>::max(),
                        "max_ctas must be in [0, 2^31 - 1] (0: one CTA per SM), got ", max_ctas);
    const c10::cuda::CUDAGuard guard(device);
    Tensor c = transpose_c ? at::empty({E, N, M}, a_scales.options().dtype(out_dtype))
                           : at::empty({E, M, N}, a_scales.options().dtype(out_dtype));
    GroupedWgradFp8Args g;
    g.a_qt = codes(a_qt);
    g.a_scales = a_scales.data_ptr<float>();
    g.M = M;
    g.b_qt = codes(b_qt);
    g.b_scales = b_scales.data_ptr<float>();
    g.N = N;
    g.chunk_offsets = chunk_offsets.data_ptr<int32_t>();
    g.E = E;
    g.max_chunks = chunks;
    g.c = c.data_ptr();
    g.c_dtype = out_dtype == at::kFloat ? DType::FP32 : DType::BF16;
    g.transpose_c = transpose_c;
    g.max_ctas = static_cast<int>(max_ctas);
    grouped_wgrad_fp8(g, at::cuda::getCurrentCUDAStream());
    return c;
  });
}

// The FP8 experts' SwiGLU backward (machmoe/fp8_swiglu.hpp): dA' [R, n] bf16, the forward's
// hq [R, 2n] e4m3 and h_scales [R, ceil(2n/128)] f32, the list's scores [pairs] f32 and
// row_pair [R] int32 -> dH [R, 2n] bf16, A' [R, n] bf16, d_scores [pairs] f32 (zero where no row).
// glu_clamp: empty (SwiGLU) or the clamped SwiGLU's [alpha, limit, up_offset, clamp_after].
std::tuple<Tensor, Tensor, Tensor> op_fp8_swiglu_backward(const Tensor& da, const Tensor& hq, const Tensor& h_scales,
                                                          const Tensor& scores, const Tensor& row_pair,
                                                          at::ArrayRef<double> glu_clamp) {
  return translate_errors([&] {
    check_first(da, "da", at::kBFloat16, 2);
    const at::Device device = da.device();
    const int64_t R = da.size(0), n = da.size(1);
    check_tensor(hq, "hq", kE4M3, {R, 2 * n}, &device);
    check_tensor(h_scales, "h_scales", at::kFloat, {R, (2 * n + 127) / 128}, &device);
    check_dims(scores, "scores", 1);
    check_tensor(scores, "scores", at::kFloat, scores.sizes(), &device);
    MACHMOE_CHECK_VALUE(check_index(row_pair, "row_pair", device) == R, "row_pair must have R = da.shape[0] = ", R,
                        " elements, got ", row_pair.size(0));
    const c10::cuda::CUDAGuard guard(device);
    Tensor dh = at::empty({R, 2 * n}, da.options());
    Tensor a_prime = at::empty({R, n}, da.options());
    Tensor d_scores = at::zeros({scores.size(0)}, scores.options());
    SwigluBackwardFp8Args a;
    a.da = da.data_ptr();
    a.hq = codes(hq);
    a.h_scales = h_scales.data_ptr<float>();
    a.scores = scores.data_ptr<float>();
    a.row_pair = row_pair.data_ptr<int32_t>();
    a.R = R;
    a.n = n;
    a.dh = dh.data_ptr();
    a.a_prime = a_prime.data_ptr();
    a.d_scores = d_scores.data_ptr<float>();
    const GluClamp clamp = glu_clamp_from(glu_clamp);
    a.clamp = glu_clamp.empty() ? nullptr : &clamp;
    swiglu_backward_fp8(a, at::cuda::getCurrentCUDAStream());
    return std::make_tuple(dh, a_prime, d_scores);
  });
}

// The saved block of an FP8 experts call (host/layer/saved_layout.hpp): what the fake kernels
// size it with. No GPU needed.
std::vector<int64_t> op_experts_fp8_saved_layout(int64_t n, int64_t E) {
  return translate_errors([&] {
    ExpertsProblem p;  // T = R = 0 and d = 16 stand for every T, R and d
    p.d = 16, p.n = n, p.E = E, p.precision = Precision::FP8;
    return detail::experts_saved_layout_ints(validate(p));
  });
}

}  // namespace

// The weights' FP8 copies as the C++ calls read them (declared in bindings/common.hpp).
Fp8ExpertWeights fp8_weights_of(at::TensorList w, int64_t E, int64_t d, int64_t n, const at::Device& device) {
  MACHMOE_CHECK_VALUE(w.size() == 8, "fp8_weights must hold 8 tensors (w1_q, w1_scales, w1_qt, w1_scales_t, w2_q, "
                      "w2_scales, w2_qt, w2_scales_t), got ", w.size());
  const int64_t n1 = 2 * n;
  check_tensor(w[0], "fp8_weights[0] (w1_q)", kE4M3, {E, n1, d}, &device);
  check_tensor(w[1], "fp8_weights[1] (w1_scales)", at::kFloat, {E, fp8_tiles(n1), fp8_tiles(d)}, &device);
  check_tensor(w[2], "fp8_weights[2] (w1_qt)", kE4M3, {E, d, n1}, &device);
  check_tensor(w[3], "fp8_weights[3] (w1_scales_t)", at::kFloat, {E, fp8_tiles(d), fp8_tiles(n1)}, &device);
  check_tensor(w[4], "fp8_weights[4] (w2_q)", kE4M3, {E, d, n}, &device);
  check_tensor(w[5], "fp8_weights[5] (w2_scales)", at::kFloat, {E, fp8_tiles(d), fp8_tiles(n)}, &device);
  check_tensor(w[6], "fp8_weights[6] (w2_qt)", kE4M3, {E, n, d}, &device);
  check_tensor(w[7], "fp8_weights[7] (w2_scales_t)", at::kFloat, {E, fp8_tiles(n), fp8_tiles(d)}, &device);
  Fp8ExpertWeights f;
  f.w1 = codes(w[0]), f.w1_scales = w[1].data_ptr<float>(), f.w1_t = codes(w[2]), f.w1_t_scales = w[3].data_ptr<float>();
  f.w2 = codes(w[4]), f.w2_scales = w[5].data_ptr<float>(), f.w2_t = codes(w[6]), f.w2_t_scales = w[7].data_ptr<float>();
  return f;
}

TORCH_LIBRARY_FRAGMENT(machmoe, m) {
  m.def("fp8_quantize_rows(Tensor x, Tensor? gather) -> (Tensor, Tensor)");
  m.def("fp8_quantize_weights(Tensor w, bool transposed) -> (Tensor, Tensor, Tensor?, Tensor?)");
  m.def("fp8_quantize_columns(Tensor x, Tensor? gather, Tensor expert_offsets) -> (Tensor, Tensor, Tensor)");
  m.def("grouped_gemm_fp8(Tensor a_q, Tensor a_scales, Tensor w_q, Tensor w_scales, Tensor expert_offsets,"
        " int max_ctas=0, Tensor? gather=None, Tensor? bias=None) -> Tensor");
  m.def("grouped_gemm_fp8_glu(Tensor a_q, Tensor a_scales, Tensor w_q, Tensor w_scales, Tensor expert_offsets,"
        " str activation, float[] glu_clamp, Tensor? bias=None, int max_ctas=0, Tensor? gather=None)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("grouped_wgrad_fp8(Tensor a_qt, Tensor a_scales, Tensor b_qt, Tensor b_scales, Tensor chunk_offsets,"
        " ScalarType out_dtype, bool transpose_c, int max_ctas=0) -> Tensor");
  m.def("experts_fp8_saved_layout(int n, int E) -> int[]", &op_experts_fp8_saved_layout);
  m.def("fp8_swiglu_backward(Tensor da, Tensor hq, Tensor h_scales, Tensor scores, Tensor row_pair,"
        " float[] glu_clamp=[]) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(machmoe, CUDA, m) {
  m.impl("fp8_quantize_rows", &op_fp8_quantize_rows);
  m.impl("fp8_quantize_weights", &op_fp8_quantize_weights);
  m.impl("fp8_quantize_columns", &op_fp8_quantize_columns);
  m.impl("grouped_gemm_fp8", &op_grouped_gemm_fp8);
  m.impl("grouped_gemm_fp8_glu", &op_grouped_gemm_fp8_glu);
  m.impl("grouped_wgrad_fp8", &op_grouped_wgrad_fp8);
  m.impl("fp8_swiglu_backward", &op_fp8_swiglu_backward);
}

}  // namespace machmoe::bindings
