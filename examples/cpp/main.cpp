// machmoe from C++ without Python: plan a layer, run its forward on the GPU when there is one,
// and check it against the CPU reference; without a GPU, run the reference alone.
//   usage: moe_layer            (prints what it did; exit 0 on success)
#include <cuda_runtime_api.h>
#include <machmoe/machmoe.hpp>
#include <machmoe/reference.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

// bf16 <-> float by bit manipulation (round to nearest even), so that this file needs no CUDA
// headers beyond the runtime API.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Random bf16 values and the doubles they are.
void fill(std::mt19937& rng, size_t n, float scale, std::vector<uint16_t>& h, std::vector<double>& d) {
  std::uniform_real_distribution<float> u(-scale, scale);
  h.resize(n);
  d.resize(n);
  for (size_t i = 0; i < n; ++i) {
    h[i] = to_bf16(u(rng));
    d[i] = from_bf16(h[i]);
  }
}

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main() {
  machmoe::LayerProblem p;
  p.T = 256, p.d = 128, p.n = 64, p.E = 8, p.K = 2;  // SwiGLU, interleaved, softmax over top-K
  // validate() checks the problem once; the validated copy is what the planner and the GPU calls take.
  const machmoe::ValidLayerProblem valid = machmoe::validate(p);
  const machmoe::WorkspacePlan plan = machmoe::plan_workspace(valid);
  std::printf("layer T=%lld d=%lld n=%lld E=%lld K=%lld: saved %zu B, forward workspace %zu B\n",
              (long long)p.T, (long long)p.d, (long long)p.n, (long long)p.E, (long long)p.K, plan.saved_bytes,
              plan.forward_workspace_bytes);

  std::mt19937 rng(1234);
  std::vector<uint16_t> hx, hwr, hw1, hw2;
  std::vector<double> x, wr, w1, w2;
  fill(rng, p.T * p.d, 1.f, hx, x);
  fill(rng, p.E * p.d, 0.5f, hwr, wr);
  fill(rng, p.E * 2 * p.n * p.d, 0.09f, hw1, w1);
  fill(rng, p.E * p.d * p.n, 0.12f, hw2, w2);

  machmoe::ref::LayerConfig c;
  c.shape = {p.T, p.d, p.n, p.E};
  c.K = p.K;
  const auto ref = machmoe::ref::layer_forward(c, x.data(), wr.data(), {w1.data(), nullptr, w2.data(), nullptr}, nullptr);
  std::printf("CPU reference: aux loss %.6f\n", ref.aux);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA GPU: ran the CPU reference only\n");
    return 0;
  }
  void *dx, *dwr, *dw1, *dw2, *dout, *dsaved, *dws;
  float* daux;
  if (!ok(cudaMalloc(&dx, hx.size() * 2), "cudaMalloc") || !ok(cudaMalloc(&dwr, hwr.size() * 2), "cudaMalloc") ||
      !ok(cudaMalloc(&dw1, hw1.size() * 2), "cudaMalloc") || !ok(cudaMalloc(&dw2, hw2.size() * 2), "cudaMalloc") ||
      !ok(cudaMalloc(&dout, hx.size() * 2), "cudaMalloc") || !ok(cudaMalloc(reinterpret_cast<void**>(&daux), 4), "cudaMalloc") ||
      !ok(cudaMalloc(&dsaved, plan.saved_bytes), "cudaMalloc") ||
      !ok(cudaMalloc(&dws, plan.forward_workspace_bytes), "cudaMalloc"))
    return 1;
  cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dwr, hwr.data(), hwr.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dw1, hw1.data(), hw1.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dw2, hw2.data(), hw2.size() * 2, cudaMemcpyHostToDevice);
  machmoe::LayerForwardArgs a;
  a.x = dx, a.router_weight = dwr, a.w1 = dw1, a.w2 = dw2;
  a.out = dout, a.aux_loss = daux, a.saved = dsaved, a.workspace = dws;
  try {
    machmoe::layer_forward(valid, a, nullptr);
  } catch (const machmoe::Error& e) {
    std::fprintf(stderr, "layer_forward: %s\n", e.what());
    return 1;
  }
  std::vector<uint16_t> hout(hx.size());
  float aux = 0;
  if (!ok(cudaMemcpy(hout.data(), dout, hout.size() * 2, cudaMemcpyDeviceToHost), "copy out")) return 1;
  cudaMemcpy(&aux, daux, 4, cudaMemcpyDeviceToHost);
  double num = 0, den = 0;
  for (size_t i = 0; i < hout.size(); ++i) {
    const double diff = from_bf16(hout[i]) - ref.experts.out[i];
    num += diff * diff;
    den += ref.experts.out[i] * ref.experts.out[i];
  }
  const double err = std::sqrt(num / den);
  std::printf("GPU layer_forward: relative error %.2e vs the reference, aux loss %.6f\n", err, aux);
  return err < 1.0 / 128 ? 0 : 1;  // four bf16 roundings of 2^-9 each
}
