// Helpers of the C++ GPU tests (test_gpu_layer.cpp, test_gpu_backward.cpp, test_gpu_experts.cpp): GPU
// presence, device buffers, bf16 upload/download, gradient outputs and their poisoning and
// bitwise-rerun check, relative error. The tests skip without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
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

// Bytes of a device buffer, for the bitwise comparison of two calls.
inline std::vector<unsigned char> bytes_of(const void* p, size_t n) {
  std::vector<unsigned char> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// A named output of a backward call: `count` elements of `elem` bytes on the device.
struct GradOut {
  const char* name;
  size_t count, elem;
  DeviceBuffer buf;
  GradOut(const char* nm, size_t cnt, size_t el) : name(nm), count(cnt), elem(el), buf(cnt * el) {}
  size_t bytes() const { return count * elem; }
};

// Poison (0xff: NaN in bf16 and fp32) every output and the workspace: nothing may be left unwritten.
inline void poison(const std::vector<GradOut*>& outs, void* workspace, size_t workspace_bytes) {
  for (GradOut* o : outs) ASSERT_EQ(cudaMemset(o->buf.ptr, 0xff, o->bytes()), cudaSuccess);
  ASSERT_EQ(cudaMemset(workspace, 0xff, workspace_bytes), cudaSuccess);
}

// Determinism: `call` again on the same inputs (workspace re-poisoned with another pattern) must
// give every output but the skipped ones bitwise as before.
inline void expect_bitwise_rerun(const std::vector<GradOut*>& outs, const std::function<bool(size_t)>& skip,
                                 void* workspace, size_t workspace_bytes, const std::function<void()>& call) {
  std::vector<std::vector<unsigned char>> first;
  for (GradOut* o : outs) first.push_back(bytes_of(o->buf.ptr, o->bytes()));
  ASSERT_EQ(cudaMemset(workspace, 0x5a, workspace_bytes), cudaSuccess);
  call();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < outs.size(); ++i) {
    if (skip(i)) continue;
    EXPECT_TRUE(bytes_of(outs[i]->buf.ptr, outs[i]->bytes()) == first[i]) << outs[i]->name << " differs between two calls";
  }
}

// ‖a − b‖ / ‖b‖.
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / den);
}

}  // namespace mtest
