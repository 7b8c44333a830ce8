// Shared helpers of the C++ tests: per-test seeds, random data, gradient comparison, error checks.
// Seeds: every test derives its own seed from a base seed and its full name, and prints it on
// failure (SCOPED_TRACE). The base seed is fixed unless MACHMOE_TEST_SEED is set (a number, or
// "random" for a fresh one per run).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "machmoe/types.hpp"

namespace mtest {

using Rng = std::mt19937_64;

inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint64_t base_seed() {
  static const uint64_t seed = [] {
    const char* s = std::getenv("MACHMOE_TEST_SEED");
    if (s && *s) {
      if (std::string(s) == "random")
        return (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
      return static_cast<uint64_t>(std::strtoull(s, nullptr, 0));
    }
    return static_cast<uint64_t>(0x6d6163686d6f65ull);  // "machmoe"
  }();
  return seed;
}

// A seed of its own for the running test (and an optional salt, e.g. a trial number).
inline uint64_t test_seed(uint64_t salt = 0) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return mix64(base_seed() ^ h ^ mix64(salt));
}

inline std::string seed_msg(uint64_t seed) {
  std::ostringstream o;
  o << "seed=0x" << std::hex << seed << " (base MACHMOE_TEST_SEED=0x" << base_seed() << ")";
  return o.str();
}

// Uniform in [lo, hi), never exactly zero.
inline std::vector<double> uniform(Rng& rng, size_t count, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(count);
  for (auto& x : v) {
    do x = u(rng);
    while (x == 0.0);
  }
  return v;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

inline double norm(const std::vector<double>& a) { return std::sqrt(dot(a, a)); }

// Gradient comparison. `got` is the analytic gradient, `want` the reference (finite differences).
// Coordinates with mask[i] == 0 are left out. Passes when, over the kept coordinates,
//   ||got - want|| <= rel_tol * ||want|| + abs_tol * sqrt(kept)            (the tensor as a whole)
// and for every kept i
//   |got_i - want_i| <= elem_rel * |want_i| + elem_frac * max|want| + abs_tol  (elementwise
//   sanity).
struct GradTol {
  double rel_tol = 1e-6;
  double elem_rel = 1e-5;
  double elem_frac = 1e-7;
  double abs_tol = 0;  // an estimate of the finite-difference noise of one element
};

inline ::testing::AssertionResult grad_close(const std::string& name,
                                             const std::vector<double>& got,
                                             const std::vector<double>& want,
                                             const std::vector<uint8_t>* mask = nullptr,
                                             const GradTol& tol = GradTol{}) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << name << ": size " << got.size() << " != expected " << want.size();
  double dn = 0, wn = 0, wmax = 0;
  size_t kept = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (mask && !(*mask)[i]) continue;
    if (!std::isfinite(got[i]) || !std::isfinite(want[i]))
      return ::testing::AssertionFailure()
             << name << "[" << i << "]: non-finite, got " << got[i] << " want " << want[i];
    dn += (got[i] - want[i]) * (got[i] - want[i]);
    wn += want[i] * want[i];
    wmax = std::max(wmax, std::fabs(want[i]));
    ++kept;
  }
  dn = std::sqrt(dn);
  wn = std::sqrt(wn);
  const double bound = tol.rel_tol * wn + tol.abs_tol * std::sqrt(double(kept));
  if (std::getenv("MACHMOE_TEST_VERBOSE"))  // the margins the tolerances leave
    std::printf("[grad_close] %-10s rel %.3e bound/||want|| %.3e kept %zu/%zu\n", name.c_str(),
                dn / wn, bound / wn, kept, got.size());
  if (!(dn <= bound))
    return ::testing::AssertionFailure()
           << std::setprecision(6) << name << ": ||got-want||/||want|| = " << dn / wn
           << " (||diff|| " << dn << ", ||want|| " << wn << ", bound " << bound << ", " << kept
           << " of " << got.size() << " coordinates compared)";
  for (size_t i = 0; i < got.size(); ++i) {
    if (mask && !(*mask)[i]) continue;
    const double e = std::fabs(got[i] - want[i]);
    const double b = tol.elem_rel * std::fabs(want[i]) + tol.elem_frac * wmax + tol.abs_tol;
    if (!(e <= b))
      return ::testing::AssertionFailure()
             << std::setprecision(17) << name << "[" << i << "]: got " << got[i] << " want "
             << want[i] << " (|diff| " << e << " > " << b << ")";
  }
  return ::testing::AssertionSuccess();
}

// Elementwise closeness for values computed two ways in exact-ish double arithmetic.
inline ::testing::AssertionResult all_close(const std::string& name, const std::vector<double>& got,
                                            const std::vector<double>& want, double rtol = 1e-12,
                                            double atol = 1e-12) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << name << ": size " << got.size() << " != expected " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(want[i]);
    if (!both_nan && !(std::fabs(got[i] - want[i]) <= atol + rtol * std::fabs(want[i])))
      return ::testing::AssertionFailure() << std::setprecision(17) << name << "[" << i << "]: got "
                                           << got[i] << " want " << want[i];
  }
  return ::testing::AssertionSuccess();
}

// Runs f and checks it throws machmoe::Error with `code`; returns the message ("" otherwise).
inline std::string expect_error(machmoe::ErrorCode code, const std::function<void()>& f,
                                const std::string& what) {
  try {
    f();
  } catch (const machmoe::Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code))
        << what << ": wrong ErrorCode, message: " << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw a non-machmoe exception: " << e.what();
    return "";
  } catch (...) {
    ADD_FAILURE() << what << ": threw something that is not a std::exception";
    return "";
  }
  ADD_FAILURE() << what << ": did not throw";
  return "";
}

// True when `word` occurs in `s` not surrounded by identifier characters.
inline bool contains_word(const std::string& s, const std::string& word) {
  auto ident = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t p = s.find(word); p != std::string::npos; p = s.find(word, p + 1)) {
    const bool l = p == 0 || !ident(s[p - 1]);
    const bool r = p + word.size() >= s.size() || !ident(s[p + word.size()]);
    if (l && r) return true;
  }
  return false;
}

// An argument-rule check: `call` on `base` changed by `change` must throw InvalidArgument whose
// message names `arg` (as a word). `what` labels the case in failures.
template <class Args, class Change, class Call>
void expect_refused(const Args& base, Change change, const std::string& arg, const std::string& what, Call call) {
  Args a = base;
  change(a);
  const std::string msg = expect_error(machmoe::ErrorCode::InvalidArgument, [&] { call(a); }, what);
  EXPECT_TRUE(contains_word(msg, arg)) << what << ": message does not name " << arg << ": " << msg;
}

// ---------------------------------------------------------------- finite differences
struct Eval {
  double L = 0, Lmag = 0;
  std::vector<int64_t> sig;
};  // sig: the kink signature
struct FD {
  std::vector<double> g;
  std::vector<uint8_t> mask;
  size_t kept = 0;
  double Lmag = 0;
};
constexpr double kStep = 1e-6;
// Central differences of eval().L w.r.t. every element of v (changed in place and restored).
// A coordinate is masked out when the signature (routing selection, relu signs) differs at ±h.
inline FD fd_grad(std::vector<double>& v, const std::function<Eval()>& eval) {
  const Eval base = eval();
  FD r{std::vector<double>(v.size()), std::vector<uint8_t>(v.size(), 0), 0, base.Lmag};
  for (size_t i = 0; i < v.size(); ++i) {
    const double old = v[i], h = kStep * std::max(1.0, std::fabs(old));
    const double vp = old + h, vm = old - h;
    v[i] = vp;
    const Eval p = eval();
    v[i] = vm;
    const Eval m = eval();
    v[i] = old;
    r.g[i] = (p.L - m.L) / (vp - vm);
    r.mask[i] = p.sig == base.sig && m.sig == base.sig;
    r.kept += r.mask[i];
  }
  return r;
}
// The noise of one central difference: rounding of L (|L| <= Lmag) over the step, with margin. The
// truncation error (h^2 |L'''|) is far below it at h = 1e-6.
inline GradTol fd_tol(double Lmag) {
  GradTol t;
  t.abs_tol = 16 * std::numeric_limits<double>::epsilon() * std::max(Lmag, 1.0) / kStep;
  return t;
}
inline void check_fd(const std::string& name, const std::vector<double>& got,
                     std::vector<double>& param, const std::function<Eval()>& ev) {
  const FD fd = fd_grad(param, ev);
  EXPECT_GE(double(fd.kept), 0.75 * double(param.size()))
      << name << ": too many kinked coordinates";
  EXPECT_TRUE(grad_close(name, got, fd.g, &fd.mask, fd_tol(fd.Lmag)));
}

}  // namespace mtest
