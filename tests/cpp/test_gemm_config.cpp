// The grouped GEMMs' kernel choice (src/host/gemm/config.hpp) on the CPU: which kernel and tile
// configuration each GEMM of the layer gets at real model shapes, the rules' boundaries, and the
// refusal of a forced kernel that cannot run a problem.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "host/gemm/config.hpp"
#include "host/layer/shared_pairs.hpp"
#include "machmoe/machmoe.hpp"

namespace {

using namespace machmoe;
using detail::choose_gemm_config;
using detail::choose_wgrad_config;
using detail::GemmConfig;
using detail::GemmEpiCode;
using detail::GemmKernelKind;
using detail::GemmShape;
using detail::WgradShape;

constexpr int64_t kE = 128;  // experts: below both shared-memory tile-table capacities

// The layer's four grouped GEMMs at hidden size d and expert width n (GLU: n1 = 2n).
GemmShape up_projection(int64_t d, int64_t n, GateUpLayout layout = GateUpLayout::Interleaved) {
  GemmShape s;  // H = x[tokens] · W1ᵀ: gathered x [T, d], W1 [E, 2n, d]
  s.E = kE, s.N = 2 * n, s.K = d, s.epilogue = GemmEpilogue::GLU, s.layout = layout, s.gather = true;
  return s;
}
GemmShape down_projection(int64_t d, int64_t n) {
  GemmShape s;  // Y = A · W2ᵀ: contiguous A [R, n], W2 [E, d, n]
  s.E = kE, s.N = d, s.K = n;
  return s;
}
GemmShape dh(int64_t d, int64_t n) {
  GemmShape s;  // dA' = dout[tokens] · W2 with the dH epilogue: gathered dout [T, d], W2 [E, d, n]
  s.E = kE, s.N = n, s.K = d, s.epilogue = GemmEpilogue::ActivationBackward, s.gather = true;
  return s;
}
GemmShape dx(int64_t d, int64_t n) {
  GemmShape s;  // dX~ = dH · W1: contiguous dH [R, 2n], W1 [E, 2n, d] read N-major
  s.E = kE, s.N = d, s.K = 2 * n;
  return s;
}

struct ModelShape {
  int64_t d, n;
  GemmKernelKind down, dx, dh;  // what the shape rules choose
};
// Ping-pong for the store where N = d <= 2048 or K <= 512; the dH ping-pong where d <= 2048.
const ModelShape kModels[] = {
    {768, 256, GemmKernelKind::PingPong, GemmKernelKind::PingPong, GemmKernelKind::DactPingPong},
    {1536, 256, GemmKernelKind::PingPong, GemmKernelKind::PingPong, GemmKernelKind::DactPingPong},
    {4096, 512, GemmKernelKind::PingPong, GemmKernelKind::Cooperative, GemmKernelKind::Cooperative},
    {7168, 2048, GemmKernelKind::Cooperative, GemmKernelKind::Cooperative, GemmKernelKind::Cooperative},
    {2880, 2880, GemmKernelKind::Cooperative, GemmKernelKind::Cooperative, GemmKernelKind::Cooperative},
    {2048, 1024, GemmKernelKind::PingPong, GemmKernelKind::PingPong, GemmKernelKind::DactPingPong},
};

int bn_of(GemmKernelKind k, int64_t N) {
  return k == GemmKernelKind::PingPong ? 192 : k == GemmKernelKind::DactPingPong ? 128 : N >= 256 ? 256 : 128;
}

TEST(GemmConfig, ModelShapes) {
  for (const ModelShape& m : kModels) {
    const std::string at = "d=" + std::to_string(m.d) + " n=" + std::to_string(m.n);
    const GemmConfig up = choose_gemm_config(up_projection(m.d, m.n));
    EXPECT_EQ(up.kernel, GemmKernelKind::Cooperative) << at;
    EXPECT_EQ(up.epi, GemmEpiCode::GluInter) << at;
    EXPECT_EQ(up.bn, 256) << at;
    EXPECT_EQ(up.n_tiles, (2 * m.n + 255) / 256) << at;

    const GemmConfig down = choose_gemm_config(down_projection(m.d, m.n));
    EXPECT_EQ(down.kernel, m.down) << at;
    EXPECT_EQ(down.epi, GemmEpiCode::Store) << at;
    EXPECT_EQ(down.bn, bn_of(m.down, m.d)) << at;
    EXPECT_EQ(down.n_tiles, (m.d + down.bn - 1) / down.bn) << at;

    const GemmConfig back = choose_gemm_config(dh(m.d, m.n));
    EXPECT_EQ(back.kernel, m.dh) << at;
    EXPECT_EQ(back.epi, GemmEpiCode::DGluInter) << at;
    EXPECT_EQ(back.bn, bn_of(m.dh, m.n)) << at;
    EXPECT_EQ(back.n_tiles, (m.n + back.bn - 1) / back.bn) << at;

    const GemmConfig dxc = choose_gemm_config(dx(m.d, m.n));
    EXPECT_EQ(dxc.kernel, m.dx) << at;
    EXPECT_EQ(dxc.bn, bn_of(m.dx, m.d)) << at;
    for (const GemmConfig& c : {up, down, back, dxc}) EXPECT_FALSE(c.global_tile_offsets) << at;
  }
}

TEST(GemmConfig, PingPongRuleBoundaries) {
  auto kernel = [](int64_t N, int64_t K) {
    GemmShape s;
    s.E = kE, s.N = N, s.K = K;
    return choose_gemm_config(s).kernel;
  };
  EXPECT_EQ(kernel(2048, 4096), GemmKernelKind::PingPong);     // N at the bound
  EXPECT_EQ(kernel(2056, 4096), GemmKernelKind::Cooperative);  // just above
  EXPECT_EQ(kernel(2056, 512), GemmKernelKind::PingPong);      // K at the bound, any N
  EXPECT_EQ(kernel(7168, 512), GemmKernelKind::PingPong);
  EXPECT_EQ(kernel(7168, 520), GemmKernelKind::Cooperative);
  EXPECT_EQ(kernel(8, 8), GemmKernelKind::PingPong);
}

TEST(GemmConfig, PingPongNeedsThePlainStoreWithContiguousA) {
  GemmShape s = down_projection(768, 256);
  s.gather = true;  // gathered A: the cooperative kernel
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::Cooperative);
  s = down_projection(768, 256);
  s.epilogue = GemmEpilogue::Activation;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::Cooperative);
  EXPECT_EQ(choose_gemm_config(s).epi, GemmEpiCode::Act);
  // The ping-pong kernel's weight boxes reach row E·N + 191 of the [E*N, K] view: inside int32.
  s = down_projection(2048, 256);
  s.E = ((int64_t{1} << 31) - 1 - 192) / 2048;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::PingPong);
  s.E += 1;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::Cooperative);
}

TEST(GemmConfig, DactPingPongRuleBoundaries) {
  GemmShape s = dh(2048, 256);
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::DactPingPong);
  s.K = 2056;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::Cooperative);
  EXPECT_EQ(choose_gemm_config(s).bn, 256);
  s = dh(768, 256);
  s.gather = false;  // the dH ping-pong kernel gathers its rows
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::Cooperative);
  // Every activation and layout keeps the rule; the epilogue code follows them.
  s = dh(768, 256);
  s.activation = Activation::GELU;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::DactPingPong);
  EXPECT_EQ(choose_gemm_config(s).epi, GemmEpiCode::DAct);
  s.activation = Activation::SwiGLU;
  s.layout = GateUpLayout::Concatenated;
  EXPECT_EQ(choose_gemm_config(s).epi, GemmEpiCode::DGluConcat);
}

TEST(GemmConfig, CooperativeTileWidth) {
  GemmShape s = up_projection(4096, 64);  // N = 128: a 128-wide tile
  EXPECT_EQ(choose_gemm_config(s).bn, 128);
  s.N = 248;
  EXPECT_EQ(choose_gemm_config(s).bn, 128);
  EXPECT_EQ(choose_gemm_config(s).n_tiles, 2);
  s.N = 256;
  EXPECT_EQ(choose_gemm_config(s).bn, 256);
  // The concatenated GLU: always 128 gate + 128 up columns, tiles over n = N / 2.
  s = up_projection(4096, 64, GateUpLayout::Concatenated);
  const GemmConfig c = choose_gemm_config(s);
  EXPECT_EQ(c.epi, GemmEpiCode::GluConcat);
  EXPECT_EQ(c.bn, 256);
  EXPECT_EQ(c.tile_cols, 128);
  EXPECT_EQ(c.n_tiles, 1);
  s.N = 2 * 320;
  EXPECT_EQ(choose_gemm_config(s).n_tiles, 3);
}

TEST(GemmConfig, TileOffsetTableAboveTheSharedMemoryCapacity) {
  GemmShape s = up_projection(768, 256);
  s.E = 512;
  EXPECT_FALSE(choose_gemm_config(s).global_tile_offsets);
  s.E = 513;
  EXPECT_TRUE(choose_gemm_config(s).global_tile_offsets);
  s = dh(768, 256);  // the dH ping-pong kernel keeps fewer in shared memory
  s.E = 384;
  EXPECT_FALSE(choose_gemm_config(s).global_tile_offsets);
  s.E = 385;
  EXPECT_TRUE(choose_gemm_config(s).global_tile_offsets);
  s.K = 4096;  // the cooperative dH kernel: 512 again
  EXPECT_FALSE(choose_gemm_config(s).global_tile_offsets);
}

TEST(GemmConfig, ForcedKernels) {
  GemmShape s = down_projection(7168, 2048);
  s.kernel = GemmKernel::PingPong;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::PingPong);
  EXPECT_EQ(choose_gemm_config(s).bn, 192);
  s = down_projection(768, 256);
  s.kernel = GemmKernel::Cooperative;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::Cooperative);
  EXPECT_EQ(choose_gemm_config(s).bn, 256);
  s = dh(7168, 2048);
  s.kernel = GemmKernel::PingPong;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::DactPingPong);
  s = dh(768, 256);
  s.kernel = GemmKernel::Cooperative;
  EXPECT_EQ(choose_gemm_config(s).kernel, GemmKernelKind::Cooperative);
  EXPECT_EQ(choose_gemm_config(s).bn, 256);
}

void expect_refused(const GemmShape& s, const std::string& why) {
  try {
    choose_gemm_config(s);
    ADD_FAILURE() << why << ": accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << why;
    EXPECT_NE(std::string(e.what()).find("PingPong"), std::string::npos) << e.what();
  }
}

TEST(GemmConfig, ForcedPingPongRefusedWhereItCannotRun) {
  GemmShape s = up_projection(768, 256);
  s.kernel = GemmKernel::PingPong;
  expect_refused(s, "GLU");
  s = down_projection(768, 256);
  s.gather = true;
  s.kernel = GemmKernel::PingPong;
  expect_refused(s, "gathered store");
  s = dh(768, 256);
  s.gather = false;
  s.kernel = GemmKernel::PingPong;
  expect_refused(s, "dH without a gather");
}

TEST(WgradConfig, CtaPairsFromTwoColumnTiles) {
  auto config = [](int64_t M, int64_t N, int max_ctas = 0, WgradKernel k = WgradKernel::Auto) {
    WgradShape s;
    s.E = kE, s.M = M, s.N = N, s.max_ctas = max_ctas, s.kernel = k;
    return choose_wgrad_config(s);
  };
  // dW2 [E, d, n] and dW1ᵀ [E, d, 2n] at the model shapes
  for (const ModelShape& m : kModels) {
    for (int64_t N : {m.n, 2 * m.n}) {
      const auto c = config(m.d, N);
      EXPECT_EQ(c.bn, N >= 256 ? 256 : 128);
      EXPECT_EQ(c.m_tiles, (m.d + 127) / 128);
      EXPECT_EQ(c.cta_pairs, c.n_tiles >= 2) << "d=" << m.d << " N=" << N;
      EXPECT_EQ(c.units, kE * c.m_tiles * (c.cta_pairs ? (c.n_tiles + 1) / 2 : c.n_tiles));
    }
  }
  EXPECT_FALSE(config(768, 256).cta_pairs);  // one 256-wide tile
  EXPECT_TRUE(config(768, 264).cta_pairs);   // two
  EXPECT_FALSE(config(768, 128).cta_pairs);  // one 128-wide tile
  EXPECT_TRUE(config(768, 136).cta_pairs);   // two 128-wide tiles
  EXPECT_EQ(config(768, 136).bn, 128);
  EXPECT_EQ(config(768, 768).units, kE * 6 * 2);  // three column tiles: two pairs
  EXPECT_FALSE(config(768, 768, 1).cta_pairs);    // one CTA allowed
  EXPECT_TRUE(config(768, 768, 2).cta_pairs);
  EXPECT_FALSE(config(768, 768, 0, WgradKernel::SingleCta).cta_pairs);
  EXPECT_TRUE(config(768, 768, 0, WgradKernel::CtaPairs).cta_pairs);
  for (auto [N, max_ctas] : {std::pair<int64_t, int>{256, 0}, {768, 1}}) {
    try {
      config(768, N, max_ctas, WgradKernel::CtaPairs);
      ADD_FAILURE() << "CtaPairs accepted at N = " << N << ", max_ctas = " << max_ctas;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find("CtaPairs"), std::string::npos) << e.what();
    }
  }
}

}  // namespace

// A layer's shared expert (all T rows) is cut into runs for the weight-gradient GEMMs until its
// output tiles number ~256, with runs of >= 1024 rows; shapes of 7B-a (d 1536, n 256) and 30B-b
// (d 4096, n 512), T = 24576 and 32768.
TEST(SharedWgradRuns, CutsFewDeepTilesIntoMany) {
  using machmoe::detail::shared_wgrad_runs;
  EXPECT_EQ(shared_wgrad_runs(24576, 1, 1536, 512), 6);    // dW1: 12 x 4 = 48 tiles -> 288
  EXPECT_EQ(shared_wgrad_runs(24576, 1, 1536, 256), 11);   // dW2: 24 tiles -> 264
  EXPECT_EQ(shared_wgrad_runs(24576, 2, 1536, 256), 6);    // two shared experts: 48 tiles
  EXPECT_EQ(shared_wgrad_runs(32768, 1, 4096, 1024), 1);   // 256 tiles already
  EXPECT_EQ(shared_wgrad_runs(32768, 1, 4096, 512), 2);    // 128 tiles
  EXPECT_EQ(shared_wgrad_runs(2047, 1, 1536, 512), 1);     // runs would be shorter than 1024 rows
  EXPECT_EQ(shared_wgrad_runs(5000, 2, 256, 128), 4);      // T / 1024 bounds it
  EXPECT_EQ(shared_wgrad_runs(0, 1, 256, 128), 1);
}
