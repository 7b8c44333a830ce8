// The argument rules of machmoe::router_forward / router_backward (include/machmoe/machmoe.hpp), checked
// before any GPU work: each broken rule throws InvalidArgument naming the argument. No GPU needed (the
// results are checked against float64 math by tests/python/test_gpu_router_op.py).
#include <gtest/gtest.h>

#include <cstdint>

#include "machmoe/machmoe.hpp"
#include "test_util.hpp"

namespace {

using machmoe::RouterBackwardArgs;
using machmoe::RouterForwardArgs;
using machmoe::RouterProblem;

struct Call {
  RouterProblem p;
  RouterForwardArgs f;
  RouterBackwardArgs b;
};

Call valid_call() {
  // Addresses are never dereferenced on the host.
  alignas(16) static uint8_t block[256];
  Call c;
  c.p.T = 4, c.p.d = 16, c.p.E = 8, c.p.K = 2;
  auto* f32 = reinterpret_cast<float*>(block);
  auto* i32 = reinterpret_cast<int32_t*>(block);
  c.f.x = block, c.f.router_weight = block, c.f.logits = f32, c.f.scores = f32, c.f.experts = i32;
  c.f.expert_offsets = i32, c.f.aux_loss = f32, c.f.workspace = block;
  c.b.x = block, c.b.router_weight = block, c.b.logits = f32, c.b.scores = f32, c.b.experts = i32;
  c.b.expert_offsets = i32, c.b.dx = block, c.b.d_router_weight = block, c.b.workspace = block;
  return c;
}

TEST(RouterApi, ForwardRefusesBrokenRules) {
  auto call = [](const Call& c) { machmoe::router_forward(c.p, c.f, nullptr); };
  const Call base = valid_call();
  mtest::expect_refused(base, [](Call& c) { c.p.T = -1; }, "T", "T < 0", call);
  mtest::expect_refused(base, [](Call& c) { c.p.d = 0; }, "d", "d = 0", call);
  mtest::expect_refused(base, [](Call& c) { c.p.K = 0; }, "K", "K = 0", call);
  mtest::expect_refused(base, [](Call& c) { c.p.K = 9; }, "K", "K > E", call);
  mtest::expect_refused(base, [](Call& c) { c.p.has_router_bias = true; }, "router_bias", "bias missing", call);
  mtest::expect_refused(base, [](Call& c) { c.f.expert_offsets = nullptr; }, "expert_offsets", "no offsets", call);
  mtest::expect_refused(base, [](Call& c) { c.f.x = nullptr; }, "x", "no x", call);
  mtest::expect_refused(base, [](Call& c) { c.f.logits = nullptr; }, "logits", "no logits", call);
}

TEST(RouterApi, BackwardRefusesBrokenRules) {
  auto call = [](const Call& c) { machmoe::router_backward(c.p, c.b, nullptr); };
  const Call base = valid_call();
  mtest::expect_refused(base, [](Call& c) { c.p.K = 9; }, "K", "K > E", call);
  mtest::expect_refused(base, [](Call& c) { c.b.d_router_weight = nullptr; }, "d_router_weight", "no dWr", call);
  mtest::expect_refused(base, [](Call& c) { c.p.has_router_bias = true; }, "d_router_bias", "no d bias", call);
  mtest::expect_refused(base, [](Call& c) { c.b.dx = nullptr; }, "dx", "no dx", call);
  mtest::expect_refused(base, [](Call& c) { c.b.expert_offsets = nullptr; }, "expert_offsets", "no offsets", call);
}

}  // namespace
