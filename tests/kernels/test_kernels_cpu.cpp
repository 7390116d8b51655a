// kernels_cpu against float64 oracles and finite differences, op by op (cases in op_cases.cpp).
//
// For every case:
//   1. the double kernel's forward equals the oracle (tiling/chunking/threading bugs show here),
//   2. the float kernel's forward is within fwd_tol of the oracle,
//   3. the double backward equals central finite differences of the double forward of
//      L = sum(dout * out) over sampled input elements,
//   4. the float backward is within bwd_tol of the double backward.
// Errors are max|got - ref| / max|ref| per tensor; infinities must match, NaN never passes.
// ctest runs this binary three times: native SIMD, capped at AVX2, and generic with the builtin
// GEMM (RLH_KCPU_SIMD / RLH_KCPU_BLAS), so every kernel variant is checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "op_cases.hpp"
#include "rlhost/kernels_cpu/blas.hpp"
#include "rlhost/kernels_cpu/cpu_features.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"
#include "simd.hpp"  // exp_f (internal)

namespace rlh::kcpu::testing {
namespace {

// max|got - ref| / max|ref|; +inf when NaN appears or infinities disagree.
template <class A, class B>
double rel_error(const std::vector<A>& got, const std::vector<B>& ref) {
  double maxref = 0, maxerr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double r = double(ref[i]), g = double(got[i]);
    if (std::isnan(g) || std::isnan(r)) return INFINITY;
    if (std::isinf(r) || std::isinf(g)) {
      if (r != g) return INFINITY;
      continue;
    }
    maxref = std::max(maxref, std::fabs(r));
    maxerr = std::max(maxerr, std::fabs(g - r));
  }
  return maxerr / std::max(maxref, 1e-30);
}

template <class T>
Bufs<T> zeros_like(const std::vector<int64_t>& sizes) {
  Bufs<T> b;
  for (int64_t n : sizes) b.emplace_back(size_t(n), T(0));
  return b;
}

template <class T>
Bufs<T> cast(const Bufs<double>& x) {
  Bufs<T> y;
  for (const auto& v : x) y.emplace_back(v.begin(), v.end());
  return y;
}

Bufs<double> random_inputs(const OpCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> N01(0, 1);
  Bufs<double> in;
  for (size_t i = 0; i < c.in_sizes.size(); ++i) {
    std::vector<double> v(c.in_sizes[i]);
    for (auto& x : v) {
      // Round to float so both precisions see the same operands.
      x = double(float(N01(rng) * c.in_scale[i]));
      if (i < c.in_positive.size() && c.in_positive[i]) x = std::fabs(x);
    }
    in.push_back(std::move(v));
  }
  return in;
}

double loss_of(const OpCase& c, const Bufs<double>& out, const Bufs<double>& dout) {
  double L = 0;
  for (size_t o = 0; o < out.size(); ++o) {
    if (!c.out_loss[o]) continue;
    for (size_t i = 0; i < out[o].size(); ++i)
      if (std::isfinite(out[o][i])) L += dout[o][i] * out[o][i];
  }
  return L;
}

class OpCaseTest : public ::testing::TestWithParam<size_t> {};

TEST_P(OpCaseTest, ForwardMatchesOracleAndBackwardMatchesFiniteDifferences) {
  const std::vector<OpCase> cases = all_op_cases();
  const OpCase& c = cases[GetParam()];
  SCOPED_TRACE(c.name);
  const Bufs<double> in64 = random_inputs(c, 1000 + uint32_t(GetParam()));
  const Bufs<float> in32 = cast<float>(in64);

  Bufs<double> ref = zeros_like<double>(c.out_sizes);
  c.ref64(in64, ref);
  Bufs<double> out64 = zeros_like<double>(c.out_sizes);
  c.fwd64(in64, out64);
  Bufs<float> out32 = zeros_like<float>(c.out_sizes);
  c.fwd32(in32, out32);
  for (size_t o = 0; o < c.out_sizes.size(); ++o) {
    if (!c.out_loss[o]) continue;
    EXPECT_LE(rel_error(out64[o], ref[o]), 1e-10) << "double forward, output " << o;
    EXPECT_LE(rel_error(out32[o], ref[o]), c.fwd_tol) << "float forward, output " << o;
  }

  if (c.fwd_ints32) {  // integer outputs (MoE choices, permutation rows): exactly the oracle's
    std::vector<IntOperand> got = c.ints, want = c.ints;
    c.fwd_ints32(in32, got);
    c.ref_ints64(in64, want);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].values, want[i].values) << "ints " << i;
  }

  const bool has_grad = std::find(c.in_grad.begin(), c.in_grad.end(), true) != c.in_grad.end();
  if (!has_grad) return;
  std::mt19937 rng(7 + uint32_t(GetParam()));
  std::normal_distribution<double> N01(0, 1);
  Bufs<double> dout = zeros_like<double>(c.out_sizes);
  for (size_t o = 0; o < dout.size(); ++o)
    if (c.out_loss[o])
      for (auto& x : dout[o]) x = double(float(N01(rng)));
  Bufs<double> din64 = zeros_like<double>(c.in_sizes);
  c.bwd64(in64, out64, dout, din64);
  Bufs<float> din32 = zeros_like<float>(c.in_sizes);
  c.bwd32(in32, out32, cast<float>(dout), din32);

  for (size_t i = 0; i < c.in_sizes.size(); ++i) {
    if (!c.in_grad[i]) continue;
    EXPECT_LE(rel_error(din32[i], din64[i]), c.bwd_tol) << "float backward, input " << i;
    double gmax = 0;
    for (double g : din64[i]) gmax = std::max(gmax, std::fabs(g));
    // Sampled elements (all of them for small inputs), central differences in double.
    const int64_t n = c.in_sizes[i];
    const int64_t samples = std::min<int64_t>(n, 40);
    double worst = 0;
    int64_t worst_at = -1;
    for (int64_t s = 0; s < samples; ++s) {
      const int64_t e = samples == n ? s : (s * 7919 + 13) % n;
      const double h = 1e-5 * std::max(1.0, std::fabs(in64[i][e]));
      Bufs<double> xp = in64, xm = in64;
      xp[i][e] += h;
      xm[i][e] -= h;
      Bufs<double> op = zeros_like<double>(c.out_sizes), om = zeros_like<double>(c.out_sizes);
      c.fwd64(xp, op);
      c.fwd64(xm, om);
      const double fd = (loss_of(c, op, dout) - loss_of(c, om, dout)) / (2 * h);
      const double err = std::fabs(fd - din64[i][e]) / std::max(gmax, 1e-30);
      if (err > worst) {
        worst = err;
        worst_at = e;
      }
    }
    EXPECT_LE(worst, c.fd_tol) << "finite differences, input " << i << " element " << worst_at;
  }
}

std::string case_name(const ::testing::TestParamInfo<size_t>& info) {
  std::string s = all_op_cases()[info.param].name;
  std::string out;
  for (char ch : s) out += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  return std::to_string(info.param) + "_" + out;
}

INSTANTIATE_TEST_SUITE_P(AllOps, OpCaseTest,
                         ::testing::Range<size_t>(0, all_op_cases().size()), case_name);

// ---------------------------------------------------------------------------------------------
// Properties the case harness does not cover

// Parameter gradients accumulate: two backward calls give twice one.
TEST(KernelsCpu, ParameterGradientsAccumulate) {
  const int64_t N = 6, C = 10, V = 7;
  std::vector<int32_t> ids = {1, 2, 1, 6, 0, 1};
  std::vector<float> dout(N * C), x(N * C), w(C, 1.5f), rstd(N);
  for (int64_t i = 0; i < N * C; ++i) {
    dout[i] = std::sin(0.3f * i);
    x[i] = std::cos(0.7f * i);
  }
  std::vector<float> y(N * C);
  rmsnorm_fwd<float>(y.data(), C, rstd.data(), x.data(), C, w.data(), N, C, 1e-6f, 0.f);
  std::vector<float> dx(N * C), dw1(C), dw2(C), dt1(V * C), dt2(V * C), db1(C), db2(C);
  rmsnorm_bwd<float>(dx.data(), C, dw1.data(), dout.data(), C, x.data(), C, w.data(), rstd.data(),
                     N, C, 0.f, false);
  dw2 = dw1;
  rmsnorm_bwd<float>(dx.data(), C, dw2.data(), dout.data(), C, x.data(), C, w.data(), rstd.data(),
                     N, C, 0.f, false);
  embedding_bwd<float>(dt1.data(), ids.data(), dout.data(), N, C, V);
  dt2 = dt1;
  embedding_bwd<float>(dt2.data(), ids.data(), dout.data(), N, C, V);
  bias_bwd<float>(db1.data(), dout.data(), C, N, C);
  db2 = db1;
  bias_bwd<float>(db2.data(), dout.data(), C, N, C);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_FLOAT_EQ(dw2[c], 2 * dw1[c]);
    EXPECT_FLOAT_EQ(db2[c], 2 * db1[c]);
  }
  for (int64_t i = 0; i < V * C; ++i) EXPECT_FLOAT_EQ(dt2[i], 2 * dt1[i]);
  // rmsnorm dx with accumulate adds to what is there.
  std::vector<float> dx2 = dx;
  rmsnorm_bwd<float>(dx2.data(), C, nullptr, dout.data(), C, x.data(), C, w.data(), rstd.data(),
                     N, C, 0.f, true);
  for (int64_t i = 0; i < N * C; ++i) EXPECT_FLOAT_EQ(dx2[i], 2 * dx[i]);
}

// rmsnorm_bwd may write dx over dy (the engine does for q/k norms): same dx and dw.
TEST(KernelsCpu, RmsnormBackwardInPlace) {
  const int64_t N = 9, C = 70;
  std::vector<float> x(N * C), w(C), dy(N * C), rstd(N), y(N * C);
  for (int64_t i = 0; i < N * C; ++i) {
    x[i] = std::sin(0.37f * i);
    dy[i] = std::cos(0.11f * i);
  }
  for (int64_t c = 0; c < C; ++c) w[c] = 0.5f + 0.01f * c;
  rmsnorm_fwd<float>(y.data(), C, rstd.data(), x.data(), C, w.data(), N, C, 1e-6f, 0.f);
  std::vector<float> dx(N * C), dw(C), dw_in(C), inplace = dy;
  rmsnorm_bwd<float>(dx.data(), C, dw.data(), dy.data(), C, x.data(), C, w.data(), rstd.data(), N,
                     C, 0.f, false);
  rmsnorm_bwd<float>(inplace.data(), C, dw_in.data(), inplace.data(), C, x.data(), C, w.data(),
                     rstd.data(), N, C, 0.f, false);
  EXPECT_EQ(dx, inplace);
  EXPECT_EQ(dw, dw_in);
}

// Every case gives bitwise the same float results on 1 and on 2 threads (the docs promise
// results independent of the thread count).
TEST(KernelsCpu, ResultsDoNotDependOnThreadCount) {
  const int saved = num_threads();
  for (const OpCase& c : all_op_cases()) {
    SCOPED_TRACE(c.name);
    const Bufs<float> in = cast<float>(random_inputs(c, 99));
    Bufs<float> out[2], din[2];
    for (int t = 0; t < 2; ++t) {
      set_num_threads(t + 1);
      out[t] = zeros_like<float>(c.out_sizes);
      c.fwd32(in, out[t]);
      din[t] = zeros_like<float>(c.in_sizes);
      if (c.bwd32) {
        Bufs<float> dout = out[t];
        for (auto& v : dout)
          for (size_t i = 0; i < v.size(); ++i) v[i] = std::cos(0.1f * float(i));
        c.bwd32(in, out[t], dout, din[t]);
      }
    }
    for (size_t o = 0; o < out[0].size(); ++o)
      EXPECT_EQ(0, std::memcmp(out[0][o].data(), out[1][o].data(), out[0][o].size() * 4))
          << "output " << o;
    for (size_t i = 0; i < din[0].size(); ++i)
      EXPECT_EQ(0, std::memcmp(din[0][i].data(), din[1][i].data(), din[0][i].size() * 4))
          << "input gradient " << i;
  }
  set_num_threads(saved);
}

TEST(KernelsCpu, ExpIsAccurateOverTheFloatRange) {
  double worst = 0;
  for (float x = -87.0f; x < 88.5f; x += 0.0137f) {
    const double ref = std::exp(double(x));
    worst = std::max(worst, std::fabs(double(exp_f(x)) - ref) / ref);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(exp_f(-100.f), 0.f);
  EXPECT_EQ(exp_f(-INFINITY), 0.f);
  EXPECT_TRUE(std::isinf(exp_f(100.f)));
  EXPECT_TRUE(std::isnan(exp_f(NAN)));
  EXPECT_EQ(exp_f(0.f), 1.f);
}

// MoE kernels: what the random cases cannot reach (ties, refusals).
TEST(KernelsCpu, MoeRouterTiesAndRefusals) {
  // Equal scores: the lower expert index wins, in descending order of score.
  const std::vector<float> z = {0.5f, 2.f, 0.5f, 2.f, 0.5f};  // one token, E = 5
  std::vector<float> w(3), p(5), lse(1);
  std::vector<int32_t> ex(3);
  moe_router_fwd<float>(w.data(), ex.data(), p.data(), lse.data(), z.data(), 5, nullptr, 1, 5, 3,
                        RouterOpts{});
  EXPECT_EQ(ex, (std::vector<int32_t>{1, 3, 0}));
  // Replay reads the experts; a repeat or an index outside [0, E) is refused.
  RouterOpts replay;
  replay.replay = true;
  ex = {4, 2, 0};
  moe_router_fwd<float>(w.data(), ex.data(), p.data(), lse.data(), z.data(), 5, nullptr, 1, 5, 3,
                        replay);
  EXPECT_EQ(ex, (std::vector<int32_t>{4, 2, 0}));
  EXPECT_FLOAT_EQ(w[0], p[4]);
  ex = {4, 2, 4};
  EXPECT_THROW(moe_router_fwd<float>(w.data(), ex.data(), p.data(), lse.data(), z.data(), 5,
                                     nullptr, 1, 5, 3, replay),
               std::invalid_argument);
  ex = {4, 2, 5};
  EXPECT_THROW(moe_router_fwd<float>(w.data(), ex.data(), p.data(), lse.data(), z.data(), 5,
                                     nullptr, 1, 5, 3, replay),
               std::invalid_argument);
  // The gradient of lse exists for softmax scores only.
  RouterOpts sig;
  sig.scoring = 1;
  std::vector<float> dz(5), dw(3, 1.f), dlse(1, 1.f);
  ex = {1, 3, 0};
  EXPECT_THROW(moe_router_bwd<float>(dz.data(), 5, dw.data(), p.data(), ex.data(), nullptr,
                                     dlse.data(), 1, 5, 3, sig),
               std::invalid_argument);
}

TEST(KernelsCpu, MoePermuteRefusals) {
  std::vector<int32_t> experts = {0, 2, 1, 3}, row(4), off(4);
  EXPECT_THROW(moe_permute_index(row.data(), off.data(), experts.data(), 2, 2, 3),
               std::invalid_argument);  // expert 3 of 3
  std::vector<float> y(2 * 3), yp(4 * 3, 1.f), w(4, 1.f);
  std::vector<int32_t> not_perm = {0, 1, 1, 3};
  EXPECT_THROW(moe_unpermute_fwd<float>(y.data(), 3, yp.data(), 3, not_perm.data(), w.data(), 2, 2,
                                        3, false),
               std::invalid_argument);
  std::vector<int32_t> bad_off = {0, 3, 2};
  EXPECT_THROW(grouped_gemm<float>(false, true, 2, bad_off.data(), 2, 3, 3, 1.f, yp.data(), 3,
                                   yp.data(), 3, 9, 0.f, y.data(), 3, 0),
               std::invalid_argument);
}

TEST(KernelsCpu, InvalidArgumentsThrow) {
  std::vector<float> t(4 * 3), out(2 * 3);
  std::vector<int32_t> ids = {0, 4};
  EXPECT_THROW(embedding_fwd<float>(out.data(), ids.data(), t.data(), 2, 3, 4),
               std::invalid_argument);
  std::vector<int32_t> bad_cu = {0, 3, 2};
  std::vector<float> q(3 * 4), lse(3);
  EXPECT_THROW(attention_fwd<float>(q.data(), 4, lse.data(), q.data(), 4, q.data(), 4, q.data(), 4,
                                    bad_cu.data(), 2, 2, 1, 1, 4, 4, 1.f, 0, scratch_default()),
               std::invalid_argument);
  EXPECT_THROW(gemm<float>(false, false, 2, 2, 3, 1.f, t.data(), 2, t.data(), 2, 0.f, out.data(), 2),
               std::invalid_argument);
}

}  // namespace
}  // namespace rlh::kcpu::testing
