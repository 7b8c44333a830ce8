// Host-side checks shared by the launchers: argument rules that name the function and argument,
// and CUDA error translation. Everything throws machmoe::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "machmoe/types.hpp"

namespace machmoe::detail {

inline void require_arg(bool ok, const char* fn, const char* arg, const std::string& rule) {
  if (!ok) throw Error(ErrorCode::InvalidArgument, std::string(fn) + ": " + arg + " " + rule);
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw Error(ErrorCode::CudaError, std::string(what) + ": " + cudaGetErrorString(err));
}

// After a launch: configuration errors surface here (no synchronisation).
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Opts `func` in to `bytes` of dynamic shared memory on the current device, once per device
// (host/common/device.cu).
void allow_dynamic_smem(const void* func, int bytes, const char* what);
// Blocks of `func` (threads, dynamic shared memory) resident per SM on the current device:
// cudaOccupancyMaxActiveBlocksPerMultiprocessor, asked once per kernel, shape and device rather
// than on every launch (host/common/device.cu).
int blocks_per_sm(const void* func, int threads, size_t smem, const char* what);
// The most clusters of `config` (its cluster dimension, block and shared-memory size) the current
// device runs at once (cudaOccupancyMaxActiveClusters; cached per kernel and device). Throws
// when not even one fits.
int max_active_clusters(const void* func, const cudaLaunchConfig_t& config, const char* what);
// A launch configuration for clusters of `cluster_x` CTAs along x (grid set by the caller). Not
// copyable: config.attrs points into it.
struct ClusterLaunch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attr[1];
  ClusterLaunch(unsigned cluster_x, unsigned threads, size_t smem, cudaStream_t stream) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster_x;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool aligned4(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) == 0; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace machmoe::detail
