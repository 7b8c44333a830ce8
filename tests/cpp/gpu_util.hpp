// Helpers of the C++ GPU tests (test_gpu_layer.cpp, test_gpu_backward.cpp): GPU presence, device
// buffers, bf16 upload/download, relative error. The tests skip without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_util.hpp"

namespace mtest {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Device buffer that frees itself (at least 256 bytes, so that empty tensors have an address).
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&ptr, bytes < 256 ? 256 : bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Random values rounded to bf16; returns the doubles the reference sees and uploads the bf16s.
inline std::vector<double> upload_bf16(Rng& rng, size_t count, double scale, DeviceBuffer& dst) {
  std::vector<double> v = uniform(rng, count, -scale, scale);
  std::vector<__nv_bfloat16> h(count);
  for (size_t i = 0; i < count; ++i) {
    h[i] = __float2bfloat16_rn(static_cast<float>(v[i]));
    v[i] = static_cast<double>(__bfloat162float(h[i]));
  }
  EXPECT_EQ(cudaMemcpy(dst.ptr, h.data(), count * 2, cudaMemcpyHostToDevice), cudaSuccess);
  return v;
}

// `count` bf16 (or fp32 with fp32 = true) values from the device, as doubles.
inline std::vector<double> download(const void* src, size_t count, bool fp32 = false) {
  std::vector<double> out(count);
  if (fp32) {
    std::vector<float> h(count);
    EXPECT_EQ(cudaMemcpy(h.data(), src, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < count; ++i) out[i] = h[i];
  } else {
    std::vector<__nv_bfloat16> h(count);
    EXPECT_EQ(cudaMemcpy(h.data(), src, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < count; ++i) out[i] = __bfloat162float(h[i]);
  }
  return out;
}

// ‖a − b‖ / ‖b‖.
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / den);
}

}  // namespace mtest
