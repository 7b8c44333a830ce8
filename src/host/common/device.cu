// Device facts and a self-test kernel: the first thing the GPU tests run, so that a library built
// for the wrong architecture or a broken driver says so plainly before any layer test.
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "host/common/check.hpp"
#include "machmoe/machmoe.hpp"

namespace machmoe {
using detail::check_cuda;
namespace {

// Each thread writes a value that depends on its index and on the SM it ran on, through 128-bit
// stores (the width every later kernel relies on).
__global__ void self_test_kernel(int4* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (i < n) out[i] = make_int4(i, 3 * i + 1, static_cast<int>(smid), -i);
}

}  // namespace

namespace {
DeviceInfo query_device_info(int device) {
  DeviceInfo info;
  info.device = device;
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, info.device), "device_info: cudaGetDeviceProperties");
  info.sm_count = prop.multiProcessorCount;
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  info.smem_per_block_optin = prop.sharedMemPerBlockOptin;
  info.l2_bytes = static_cast<size_t>(prop.l2CacheSize);
  std::strncpy(info.name, prop.name, sizeof(info.name) - 1);
  return info;
}
}  // namespace

// Device properties never change while a process runs, and cudaGetDeviceProperties is slow: the
// GEMM launcher asks on every call, so the answer is cached per device.
DeviceInfo device_info() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "device_info: cudaGetDevice");
  static std::mutex mu;
  static std::unordered_map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it == cache.end()) it = cache.emplace(device, query_device_info(device)).first;
  return it->second;
}

namespace detail {

namespace {
// value(key) on the current device, computed once per (key, device) under a lock: the driver's
// per-kernel attributes and occupancy answers hold per device, and a process may use several.
template <typename Key, typename Compute>
int once_per_device(const Key& key, const char* what, Compute compute) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), what);
  static std::mutex mu;
  static std::map<std::pair<Key, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  const auto k = std::make_pair(key, device);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  const int v = compute();
  cache.emplace(k, v);
  return v;
}
}  // namespace

// cudaFuncSetAttribute acts on the current device only: a process that launches on two GPUs must
// set it on each (a once-per-process flag left the second device's launches failing).
void allow_dynamic_smem(const void* func, int bytes, const char* what) {
  once_per_device(func, what, [&] {
    check_cuda(cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
    return bytes;
  });
}

int blocks_per_sm(const void* func, int threads, size_t smem, const char* what) {
  return once_per_device(std::make_tuple(func, threads, smem), what, [&] {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, func, threads, smem), what);
    return n;
  });
}

int max_active_clusters(const void* func, const cudaLaunchConfig_t& config, const char* what) {
  return once_per_device(func, what, [&] {
    // The occupancy query wants a grid that is a multiple of the cluster size: take the cluster
    // dimension from the config's own attribute rather than assume where it sits.
    unsigned cluster = 0;
    for (unsigned i = 0; i < config.numAttrs; ++i)
      if (config.attrs[i].id == cudaLaunchAttributeClusterDimension) cluster = config.attrs[i].val.clusterDim.x;
    if (cluster == 0)
      throw Error(ErrorCode::InvalidArgument, std::string(what) + ": the launch config has no cluster dimension");
    cudaLaunchConfig_t probe = config;
    probe.gridDim = dim3(cluster * 1024);
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveClusters(&n, func, &probe), what);
    if (n < 1)
      throw Error(ErrorCode::Unsupported, std::string(what) + ": the device cannot run one cluster of this kernel");
    return n;
  });
}

}  // namespace detail

void device_self_test(cudaStream_t stream) {
  const DeviceInfo info = device_info();
  if (info.cc_major != 9 || info.cc_minor != 0)
    throw Error(ErrorCode::Unsupported,
                std::string("device_self_test: machmoe's kernels are built for sm_90a (H100/H200); "
                            "device '") + info.name + "' has compute capability " +
                    std::to_string(info.cc_major) + "." + std::to_string(info.cc_minor));
  constexpr int n = 1000;
  int4* d_out = nullptr;
  check_cuda(cudaMalloc(&d_out, n * sizeof(int4)), "device_self_test: cudaMalloc");
  self_test_kernel<<<(n + 127) / 128, 128, 0, stream>>>(d_out, n);
  cudaError_t err = cudaGetLastError();
  std::vector<int4> h_out(n);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(h_out.data(), d_out, n * sizeof(int4), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  cudaFree(d_out);
  check_cuda(err, "device_self_test: kernel");
  for (int i = 0; i < n; ++i)
    if (h_out[i].x != i || h_out[i].y != 3 * i + 1 || h_out[i].w != -i ||
        h_out[i].z < 0 || h_out[i].z >= info.sm_count)
      throw Error(ErrorCode::CudaError,
                  "device_self_test: wrong value at element " + std::to_string(i));
}

}  // namespace machmoe
