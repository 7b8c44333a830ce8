// Host-side checks shared by the launchers: argument rules that name the function and argument,
// and CUDA error translation. Everything throws machmoe::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
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
// MACHMOE_WGRAD_PAIR=0 turns off the weight gradients' CTA pairs (for A/B and debugging).
bool wgrad_pairs_enabled();
// The plain-store grouped GEMM with contiguous A (down-projection, dX~) runs through the
// ping-pong kernel (kernels/gemm/pingpong.cuh) where the shape rule of
// host/gemm/grouped_gemm.cu says so (MACHMOE_GEMM_PINGPONG unset: -1). MACHMOE_GEMM_PINGPONG=0 turns it
// off; =1 forces it wherever it applies, =2 in clusters of two CTAs multicasting the weights, =5/=6
// the same two with the tile stored by boxes through a two-box ring the consumers take in turn.
// Any other value is refused (Error, InvalidArgument).
int gemm_pingpong_mode();
// The dH kernel (ActivationBackward with a gather) runs as the ping-pong kernel of
// kernels/gemm/dact_pingpong.cuh where host/gemm/grouped_gemm.cu's shape rule says so
// (MACHMOE_DH_PINGPONG unset: -1); =0 never, =1 wherever it applies. Other values are refused.
// (Removed after measuring them slower than this kernel alone: session 28's CTA-pair variant
// multicasting W2, 4-12% at d <= 1536 and 11% at 30B-b; sessions 28-30's variant with the epilogue
// from the accumulators and H / dH / A' moved by TMA, 20-27% at d <= 1536.)
int gemm_dh_pingpong_mode();

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The timing probes' bits (MACHMOE_GEMM_PROBE, 11 bits: 1-128 the grouped GEMM's and weight
// gradients', 256 and 512 the weight gradients' only, 1024 the ping-pong kernel's cycle counters;
// scripts/gpu_probe.sh) in a
// -DMACHMOE_GEMM_PROBES=ON build, read once; 0 in a normal build, where the kernels compile the
// probes out.
inline int gemm_probe_from_env() {
#if MACHMOE_GEMM_PROBES
  static const int probe = [] {
    const char* v = std::getenv("MACHMOE_GEMM_PROBE");
    return v ? std::atoi(v) & 2047 : 0;
  }();
  return probe;
#else
  return 0;
#endif
}

}  // namespace machmoe::detail
