// cuBLAS plumbing shared by the layer forward (router GEMM) and backward (router gradients): one
// handle per (thread, device), and the per-call binding of the caller's stream and of a workspace
// carved from our own block, which keeps every call graph-capturable (cuBLAS would otherwise
// allocate its workspace itself).
#pragma once

#include <cublas_v2.h>

#include <string>
#include <unordered_map>

#include "host/common/check.hpp"

namespace machmoe::detail {

inline void check_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorCode::CudaError, std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(st)));
}

// The cuBLAS element type of a GEMM output in DType t (FP32 or BF16 here).
inline cudaDataType_t cuda_type(DType t) { return t == DType::FP32 ? CUDA_R_32F : CUDA_R_16BF; }

// One cuBLAS handle per (thread, device), created on first use: cuBLAS handles are not meant to
// be shared between threads, and creating one costs milliseconds. An inline function: its
// thread_local map is one object for every translation unit that includes this header.
inline cublasHandle_t cublas_handle() {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "machmoe: cudaGetDevice (cuBLAS handle)");
  auto it = handles.find(dev);
  if (it != handles.end()) return it->second;
  cublasHandle_t h = nullptr;
  check_cublas(cublasCreate(&h), "machmoe: cublasCreate");
  handles.emplace(dev, h);
  return h;
}

// The handle of this thread and device, bound to `stream` and to the workspace [ws, ws + bytes).
inline cublasHandle_t cublas_on(cudaStream_t stream, void* ws, size_t bytes, const char* fn) {
  cublasHandle_t h = cublas_handle();
  check_cublas(cublasSetStream(h, stream), (std::string(fn) + ": cublasSetStream").c_str());
  check_cublas(cublasSetWorkspace(h, ws, bytes), (std::string(fn) + ": cublasSetWorkspace").c_str());
  return h;
}

}  // namespace machmoe::detail
