// Element-wise float -> E4M3 with the device's conversion (cvt.rn.satfinite.e4m3x2.f32), the
// rounding every FP8 quantiser uses: x fp32 [n] -> q e4m3 [n]. It exists so that a GPU test can
// hold the CPU reference's own conversion (ref::float_to_e4m3) against the hardware on millions
// of inputs, NaN and Inf included. Not a hot path. Included by host/quant/quantize_rows.cu only.
#pragma once

#include "kernels/quant/fp8_common.cuh"

namespace machmoe::kernels::fp8 {

constexpr int kConvertThreads = 256;

__global__ void __launch_bounds__(kConvertThreads) fp8_convert_kernel(const float* x, uint8_t* q, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    q[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
}

}  // namespace machmoe::kernels::fp8
