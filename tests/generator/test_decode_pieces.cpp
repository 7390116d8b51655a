// The generator's pieces on their own: Philox known answers and keying; the sampling parameters
// checks; stop strings across token boundaries; the KV block pool; and the generator's paged cache
// layout as the registry's kv_cache_write and paged_attention ops read it (kernels_cpu through the
// C ABI), against float64 attention with a float32 error bound. kernels_cpu's sampler, pool and
// batch-invariant gemm have their own tests (tests/kernels/test_decode_ops.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>

#include "kernels_cpu_abi.hpp"
#include "rlhost/generator/kv_cache.hpp"
#include "rlhost/generator/rng.hpp"
#include "rlhost/generator/sampling.hpp"
#include "rlhost/generator/stop_strings.hpp"

using namespace rlh::gen;

namespace {

// ---------------------------------------------------------------------------------------------
// RNG

TEST(Rng, PhiloxKnownAnswers) {
  // Random123's kat_vectors for philox4x32-10.
  using A4 = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (A4{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (A4{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (A4{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Rng, UniformIsKeyedByEveryField) {
  const DrawKey k{42, 3, 1000, 2};
  const double u = uniform01(k, 5);
  EXPECT_EQ(u, uniform01(k, 5));  // a pure function
  EXPECT_NE(u, uniform01(k, 6));
  EXPECT_NE(u, uniform01(DrawKey{43, 3, 1000, 2}, 5));
  EXPECT_NE(u, uniform01(DrawKey{42, 4, 1000, 2}, 5));
  EXPECT_NE(u, uniform01(DrawKey{42, 3, 1001, 2}, 5));
  EXPECT_NE(u, uniform01(DrawKey{42, 3, 1000, 3}, 5));
  EXPECT_NE(u, uniform01(DrawKey{42, 3, 1000 + (int64_t(1) << 32), 2}, 5));  // high prompt bits count
  // Moments and range over many draws (deterministic: no flakiness).
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = uniform01(DrawKey{7, 0, i % 97, i / 97}, i % 13);
    ASSERT_GE(x, 0.0);
    ASSERT_LT(x, 1.0);
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  EXPECT_NEAR(sq / n - (sum / n) * (sum / n), 1.0 / 12, 0.002);
}

// ---------------------------------------------------------------------------------------------
// Sampling parameters (the draw itself is kernels_cpu's sample op: tests/kernels/test_decode_ops.cpp)

TEST(Sampling, ParametersAreCheckedNamingTheField) {
  EXPECT_THROW(validate(SamplingParams{-1.0, 0, 1.0, 0.0}), std::invalid_argument);
  EXPECT_THROW(validate(SamplingParams{1.0, -2, 1.0, 0.0}), std::invalid_argument);
  EXPECT_THROW(validate(SamplingParams{1.0, 0, 0.0, 0.0}), std::invalid_argument);
  EXPECT_THROW(validate(SamplingParams{1.0, 0, 1.0, -0.1}), std::invalid_argument);
  EXPECT_NO_THROW(validate(SamplingParams{1.0, -1, 1.0, 0.0}));  // vLLM's "off"
}

// ---------------------------------------------------------------------------------------------
// Stop strings

// Each id is a byte (0 decodes to nothing, like a skipped special token); bytes that do not form
// valid UTF-8 at the start of the decoded window come out as U+FFFD, as HF decoders do.
class ByteDetok : public Detokenizer {
 public:
  mutable int calls = 0;
  mutable size_t longest = 0;
  std::string decode(std::span<const int32_t> ids) const override {
    ++calls;
    longest = std::max(longest, ids.size());
    std::string s;
    size_t i = 0;
    while (i < ids.size() && ids[i] != 0 && (ids[i] & 0xC0) == 0x80) {  // a continuation byte first
      s += "\xEF\xBF\xBD";
      ++i;
    }
    for (; i < ids.size(); ++i)
      if (ids[i] != 0) s += char(ids[i]);
    return s;
  }
};

std::vector<int32_t> bytes(const std::string& s) {
  std::vector<int32_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

TEST(StopStrings, MatchAcrossTokensAndEmptyTokens) {
  ByteDetok d;
  const StopStrings stops({"end", "\xC3\xA9t\xC3\xA9"});  // "end", "été"
  std::vector<int32_t> ids = bytes("the fr");
  EXPECT_FALSE(stops.matches(ids, d));
  ids.push_back('e');
  ids.push_back('n');
  EXPECT_FALSE(stops.matches(ids, d));
  // 40 tokens that decode to nothing between "en" and "d": still one match.
  for (int i = 0; i < 40; ++i) ids.push_back(0);
  EXPECT_FALSE(stops.matches(ids, d));
  ids.push_back('d');
  EXPECT_TRUE(stops.matches(ids, d));
  // A multi-byte stop string completed by its last byte.
  std::vector<int32_t> u = bytes("un \xC3\xA9t");
  EXPECT_FALSE(stops.matches(u, d));
  u.push_back(0xC3);
  EXPECT_FALSE(stops.matches(u, d));
  u.push_back(0xA9);
  EXPECT_TRUE(stops.matches(u, d));
  // Windowed: a long response is not decoded whole at every step.
  std::vector<int32_t> long_ids = bytes(std::string(5000, 'x'));
  d.longest = 0;
  EXPECT_FALSE(stops.matches(long_ids, d));
  EXPECT_LT(d.longest, 64u);
  EXPECT_THROW(StopStrings({"a", ""}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// KV block pool

TEST(KvCache, BlocksAreBudgetedAndReusedLastInFirstOut) {
  const KvLayout l = KvLayout::make(16, {2, 4}, {8, 32});
  EXPECT_EQ(l.offset[1], 2 * 2 * 16 * 8);
  EXPECT_EQ(l.block_elems, 2 * 16 * (2 * 8 + 4 * 32));
  KvCache kv(l, l.block_bytes() * 3 + 7);
  EXPECT_EQ(kv.num_blocks(), 3);
  const int32_t a = kv.allocate(), b = kv.allocate(), c = kv.allocate();
  EXPECT_EQ(kv.allocate(), -1);
  EXPECT_EQ(std::set<int32_t>({a, b, c}).size(), 3u);
  kv.release(b);
  EXPECT_EQ(kv.allocate(), b);
  EXPECT_EQ(kv.peak_used(), 3);
  // A shared block is free again only after its last holder lets go.
  kv.share(c);
  kv.release(c);
  EXPECT_EQ(kv.num_free(), 0);
  kv.release(c);
  EXPECT_EQ(kv.num_free(), 1);
  EXPECT_THROW(kv.release(c), std::logic_error);
  EXPECT_THROW(kv.share(c), std::logic_error);
  // Keys and values of different blocks and layers never overlap.
  EXPECT_EQ(kv.values(a, 0), kv.keys(a, 0) + 2 * 16 * 8);
  EXPECT_EQ(kv.keys(a, 1), kv.keys(a, 0) + 2 * 2 * 16 * 8);
  EXPECT_THROW(KvCache(l, l.block_bytes() - 1), std::invalid_argument);
  EXPECT_THROW(kv.release(99), std::logic_error);

  // Values of their own width (MLA: Dk = 24, Dv = 12): V follows K's Dk-wide rows.
  const KvLayout m = KvLayout::make(16, {2, 4}, {8, 24}, {8, 12});
  EXPECT_EQ(m.value_dim, (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(m.offset[1], 2 * 2 * 16 * 8);
  EXPECT_EQ(m.block_elems, 2 * 16 * (8 + 8) + 4 * 16 * (24 + 12));
  KvCache mk(m, m.block_bytes() * 2);
  const int32_t mb = mk.allocate(), next = mk.allocate();
  EXPECT_EQ(mk.values(mb, 1), mk.keys(mb, 1) + 4 * 16 * 24);
  EXPECT_EQ(mk.keys(next, 0), mk.values(mb, 1) + 4 * 16 * 12) << "blocks back to back";
  EXPECT_THROW(KvLayout::make(16, {2}, {8}, {8, 8}), std::invalid_argument);
  EXPECT_THROW(KvLayout::make(16, {2}, {8}, {0}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Paged attention

// GQA with equal widths, and MLA's shape: as many kv heads as query heads, keys wider than
// values (Dk = nope + rope = 24, Dv = 12).
class PagedAttention : public ::testing::TestWithParam<std::array<int64_t, 5>> {};  // Hq, Hkv, Dk, Dv, block

// The float64 attention of one row and query head against a float32 result, with a bound on
// what float32 arithmetic can do to it whatever the order of its sums, the FMA contraction or
// the SIMD width (so it holds for every ISA path and every BLAS; comparing with kernels_cpu's
// float32 attention instead failed by 2.004e-6 against 2e-6 under OpenBLAS's Haswell kernels).
// With u = 2^-24 and gamma(n) = n u / (1 - n u) (Higham, Accuracy and Stability, 3.1):
//   score:    |s^ - s| <= e_j = gamma(D + 1) scale sum_d |q_d k_jd|   (dot product, then * scale)
//   exp:      exp_fast(x^)(1 + r), |r| <= 8u (Cephes expf, ~2 ulp documented; 4 ulp allowed),
//             x^ = s^ - max s^ rounded once: relative u |x^| more; the weights are then
//             exp(s_j - m)(1 + rho_j), |rho_j| <= exp(e_j + u |x_j| + 8u) - 1 =: rho_j
//   softmax:  the sum of T positive weights and 1/sum: gamma(T) + u; so p^_j = p_j (1 + d_j),
//             |d_j| <= 2 rho_max + gamma(T) + u (first order; 1 % margin for the second)
//   output:   sum_j p^_j v_jd with gamma(T), then * (1/sum) rounded: u |o|
// gives |o^_d - o_d| <= 1.01 (2 rho_max + 2 gamma(T) + 2u) sum_j p_j |v_jd| + u |o_d| + tiny,
// tiny covering exp_fast's flush to 0 below -87.3 (weights < 2e-38).
struct AttentionRef {
  std::vector<double> out, bound;  // [T][Hq][Dv]
};

AttentionRef attention_ref(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, double scale, int64_t window,
                           double softcap = 0) {
  const double u = std::ldexp(1.0, -24);
  auto gamma = [u](double n) { return n * u / (1 - n * u); };
  AttentionRef r;
  r.out.assign(size_t(T * Hq * Dv), 0.0);
  r.bound.assign(size_t(T * Hq * Dv), 0.0);
  const int64_t G = Hq / Hkv;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hq = 0; hq < Hq; ++hq) {
      const int64_t h = hq / G, lo = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0, n = t - lo + 1;
      std::vector<double> s(static_cast<size_t>(n)), e(static_cast<size_t>(n));
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0, mag = 0;
        for (int64_t d = 0; d < D; ++d) {
          const double qd = q[size_t((t * Hq + hq) * D + d)], kd = k[size_t(((lo + j) * Hkv + h) * D + d)];
          dot += qd * kd;
          mag += std::fabs(qd * kd);
        }
        s[size_t(j)] = scale * dot;
        e[size_t(j)] = gamma(double(D + 1)) * scale * mag;
        if (softcap > 0) {  // Gemma-2: tanh's slope is at most 1; its float rounding adds a few ulps of the cap
          s[size_t(j)] = softcap * std::tanh(s[size_t(j)] / softcap);
          e[size_t(j)] += 4 * u * softcap;
        }
        mx = std::max(mx, s[size_t(j)]);
      }
      const double emax = *std::max_element(e.begin(), e.end());
      double sum = 0, rho = 0;
      for (int64_t j = 0; j < n; ++j) {
        rho = std::max(rho, std::expm1(e[size_t(j)] + u * (std::fabs(s[size_t(j)] - mx) + 2 * emax) + 8 * u));
        s[size_t(j)] = std::exp(s[size_t(j)] - mx);
        sum += s[size_t(j)];
      }
      for (int64_t d = 0; d < Dv; ++d) {
        double o = 0, a = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double vj = v[size_t(((lo + j) * Hkv + h) * Dv + d)];
          o += s[size_t(j)] / sum * vj;
          a += s[size_t(j)] / sum * std::fabs(vj);
        }
        const size_t at = size_t((t * Hq + hq) * Dv + d);
        r.out[at] = o;
        r.bound[at] = 1.01 * (2 * rho + 2 * gamma(double(n)) + 2 * u) * a + u * std::fabs(o) + 1e-37 * double(n);
      }
    }
  return r;
}

TEST_P(PagedAttention, MatchesFloat64AttentionThroughScatteredBlocks) {
  const auto [Hq, Hkv, D, Dv, bs] = GetParam();
  const int64_t T = 45;
  std::mt19937 g(9);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(T * Hq * D)), k(static_cast<size_t>(T * Hkv * D)), v(static_cast<size_t>(T * Hkv * Dv));
  for (float& x : q) x = nd(g);
  for (float& x : k) x = nd(g);
  for (float& x : v) x = nd(g);
  const KvLayout l = KvLayout::make(bs, {Hkv}, {D}, {Dv});
  KvCache kv(l, l.block_bytes() * 12);
  // A block table in scrambled order.
  std::vector<int32_t> all;
  for (int i = 0; i < 12; ++i) all.push_back(kv.allocate());
  std::vector<int32_t> table = {all[7], all[2], all[11], all[0], all[5], all[9]};
  // The ops read and write the cache as the generator lays it out: block b of layer 0 at
  // keys(0, 0) + b block_elems; each row's block table [R, T] (here one sequence).
  rlh::engine::Ops& ops = rlh::test::cpu_ops();
  rlh::engine::Ops::PagedCache c;
  c.k = kv.keys(0, 0);
  c.v = kv.values(0, 0);
  c.num_blocks = kv.num_blocks();
  c.block_stride = l.block_elems;
  c.block_size = bs;
  c.Hkv = Hkv;
  c.Dk = D;
  c.Dv = Dv;
  std::vector<int32_t> slots;
  for (int64_t t = 0; t < T; ++t) slots.push_back(int32_t(table[size_t(t / bs)] * bs + t % bs));
  // Keys written in two uneven steps, like a chunked prefill (kv_cache_write).
  ops.kv_cache_write(k.data(), Hkv * D, v.data(), Hkv * Dv, 20, slots.data(), c);
  ops.kv_cache_write(k.data() + 20 * Hkv * D, Hkv * D, v.data() + 20 * Hkv * Dv, Hkv * Dv, T - 20, slots.data() + 20, c);
  // Transposed keys, row-major values: what the layout promises.
  for (int64_t t = 0; t < T; t += 7)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int32_t b = table[size_t(t / bs)];
      ASSERT_EQ(kv.keys(b, 0)[h * D * bs + 3 % D * bs + t % bs], k[size_t(t * Hkv * D + h * D + 3 % D)]);
      ASSERT_EQ(kv.values(b, 0)[(h * bs + t % bs) * Dv + 1], v[size_t(t * Hkv * Dv + h * Dv + 1)]);
    }
  for (const auto& [window, softcap] : {std::pair<int64_t, float>{0, 0.f}, {10, 0.f}, {0, 2.5f}, {10, 1.5f}}) {
    const float scale = 0.25f;
    // Output rows padded past Hq*Dv: nothing may be written there.
    const int64_t ldo = Hq * Dv + 3;
    std::vector<float> got(static_cast<size_t>(T * ldo), NAN);
    const AttentionRef want = attention_ref(q, k, v, T, Hq, Hkv, D, Dv, scale, window, softcap);
    const int64_t width = int64_t(table.size());
    std::vector<int32_t> tables, pos;
    for (int64_t t = 0; t < T; ++t) {
      tables.insert(tables.end(), table.begin(), table.end());
      pos.push_back(int32_t(t));
    }
    ops.paged_attention(got.data(), ldo, q.data(), Hq * D, T, Hq, c, tables.data(), width, pos.data(), scale,
                        window, softcap);
    double worst = 0;  // the largest error as a share of its bound, printed for the record
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < Hq * Dv; ++i) {
        const size_t at = size_t(t * Hq * Dv + i);
        const double err = std::fabs(double(got[size_t(t * ldo + i)]) - want.out[at]);
        ASSERT_LE(err, want.bound[at]) << "window " << window << " softcap " << softcap << " row " << t << " at " << i << ": got "
                                       << got[size_t(t * ldo + i)] << ", float64 " << want.out[at];
        worst = std::max(worst, err / want.bound[at]);
      }
      ASSERT_TRUE(std::isnan(got[size_t(t * ldo + Hq * Dv)])) << "wrote past Hq*Dv";
    }
    RecordProperty("window" + std::to_string(window) + "_softcap" + std::to_string(int(softcap * 10)) +
                       "_error_share_of_bound",
                   std::to_string(worst));
    // One row alone gives the same bits as inside the batch.
    std::vector<float> one(static_cast<size_t>(Hq * Dv));
    ops.paged_attention(one.data(), Hq * Dv, q.data() + 30 * Hq * D, Hq * D, 1, Hq, c, tables.data() + 30 * width,
                        width, pos.data() + 30, scale, window, softcap);
    EXPECT_EQ(0, std::memcmp(one.data(), got.data() + 30 * ldo, one.size() * sizeof(float)));
  }
}

// The FP8 e4m3 value nearest to y, ties to the even code, finite values past 448 saturated
// (docs/ops.md kv_cache_write): by search over every finite code, independent of the provider's
// bit arithmetic.
double e4m3_value(int c) {
  const int E = (c >> 3) & 15, m = c & 7;
  const double a = E == 0 ? std::ldexp(double(m), -9) : std::ldexp(1.0 + m / 8.0, E - 7);
  return c & 0x80 ? -a : a;
}
uint8_t e4m3_nearest(double y) {
  int best = 0;
  for (int c = 1; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    const double d = std::fabs(e4m3_value(c) - y), b = std::fabs(e4m3_value(best) - y);
    if (d < b || (d == b && (c & 1) == 0 && (best & 1) == 1)) best = c;
  }
  if (e4m3_value(best) == 0) return std::signbit(y) ? 0x80 : 0x00;  // zero keeps the sign
  return uint8_t(best);
}

// kv_cache_write into FP8 caches stores each key's code of k / k_scale (and the values'), and
// paged_attention over them is the attention of their values: with power-of-two scales bit for
// bit the float32 cache holding those values, with others within float32 rounding.
TEST_P(PagedAttention, Fp8CachesHoldRoundedCodesAndAttendToTheirValues) {
  const auto [Hq, Hkv, D, Dv, bs] = GetParam();
  const int64_t T = 37;
  std::mt19937 g(11);
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(T * Hq * D)), k(size_t(T * Hkv * D)), v(size_t(T * Hkv * Dv));
  for (float& x : q) x = nd(g);
  for (float& x : k) x = 3.f * nd(g);
  for (float& x : v) x = nd(g);
  k[5] = 1000.f;   // past 448 k_scale: saturates
  k[6] = -0.003f;  // subnormal codes at both key scales (|x / k_scale| < 2^-6)
  v[7] = 0.296875f;  // at v_scale 2, 0.1484375: halfway between 0.140625 and 0.15625 (ties to even)
  const KvLayout l8 = KvLayout::make(bs, {Hkv}, {D}, {Dv}, true, 1), l32 = KvLayout::make(bs, {Hkv}, {D}, {Dv});
  // A quarter of the float32 cache's bytes, up to the 64-byte rounding of a block.
  EXPECT_GE(l8.block_bytes() * 4, l32.block_bytes());
  EXPECT_LE(l8.block_bytes() * 4, l32.block_bytes() + 3 * 64);
  KvCache kv8(l8, l8.block_bytes() * 8), kv32(l32, l32.block_bytes() * 8);
  std::vector<int32_t> table;  // the same block ids in both (fresh pools), in scrambled order
  for (int i = 0; i < 8; ++i) {
    table.push_back(kv8.allocate());
    ASSERT_EQ(kv32.allocate(), table.back());
  }
  std::swap(table[0], table[5]);
  std::swap(table[2], table[3]);
  rlh::engine::Ops& ops = rlh::test::cpu_ops();
  for (const auto& [ks, vs] : {std::pair<float, float>{0.5f, 2.f}, {0.37f, 1.3f}}) {
    rlh::engine::Ops::PagedCache c8, c32;
    for (auto* c : {&c8, &c32}) {
      c->num_blocks = kv8.num_blocks();
      c->block_size = bs;
      c->Hkv = Hkv;
      c->Dk = D;
      c->Dv = Dv;
    }
    c8.block_stride = l8.block_elems;
    c8.k8 = kv8.keys_bytes(0, 0);
    c8.v8 = kv8.values_bytes(0, 0);
    c8.k_scale = ks;
    c8.v_scale = vs;
    c32.block_stride = l32.block_elems;
    c32.k = kv32.keys(0, 0);
    c32.v = kv32.values(0, 0);
    std::vector<int32_t> slots;
    for (int64_t t = 0; t < T; ++t) slots.push_back(int32_t(table[size_t(t / bs)] * bs + t % bs));
    ops.kv_cache_write(k.data(), Hkv * D, v.data(), Hkv * Dv, T, slots.data(), c8);
    // The codes, and the float32 cache of their values.
    std::vector<float> kval(k.size()), vval(v.size());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int32_t b = table[size_t(t / bs)];
        for (int64_t d = 0; d < D; ++d) {
          const size_t at = size_t((t * Hkv + h) * D + d);
          const uint8_t code = kv8.keys_bytes(b, 0)[(h * D + d) * bs + t % bs];
          ASSERT_EQ(int(code), int(e4m3_nearest(double(k[at]) / double(ks)))) << "key " << at << " = " << k[at];
          kval[at] = float(double(ks) * e4m3_value(code));
        }
        for (int64_t d = 0; d < Dv; ++d) {
          const size_t at = size_t((t * Hkv + h) * Dv + d);
          const uint8_t code = kv8.values_bytes(b, 0)[(h * bs + t % bs) * Dv + d];
          ASSERT_EQ(int(code), int(e4m3_nearest(double(v[at]) / double(vs)))) << "value " << at << " = " << v[at];
          vval[at] = float(double(vs) * e4m3_value(code));
        }
      }
    ops.kv_cache_write(kval.data(), Hkv * D, vval.data(), Hkv * Dv, T, slots.data(), c32);
    std::vector<int32_t> tables, pos;
    for (int64_t t = 0; t < T; ++t) {
      tables.insert(tables.end(), table.begin(), table.end());
      pos.push_back(int32_t(t));
    }
    for (const auto& [window, softcap] : {std::pair<int64_t, float>{0, 0.f}, {9, 2.f}}) {
      std::vector<float> got(size_t(T * Hq * Dv)), want(got.size());
      const int64_t width = int64_t(table.size());
      ops.paged_attention(got.data(), Hq * Dv, q.data(), Hq * D, T, Hq, c8, tables.data(), width, pos.data(), 0.25f,
                          window, softcap);
      ops.paged_attention(want.data(), Hq * Dv, q.data(), Hq * D, T, Hq, c32, tables.data(), width, pos.data(), 0.25f,
                          window, softcap);
      const bool pow2 = ks == 0.5f;
      for (size_t i = 0; i < got.size(); ++i) {
        if (pow2)
          ASSERT_EQ(got[i], want[i]) << "scales " << ks << ", " << vs << " window " << window << " at " << i;
        else
          ASSERT_NEAR(got[i], want[i], 2e-5 * (1 + std::fabs(want[i]))) << "scales " << ks << ", " << vs << " at " << i;
      }
    }
  }
}

// Blocks of 8 take the generic loops; blocks of 16 the register paths (scores of a block in one
// register; values of widths 16, 32, 64, 128 in 1, 2, 4, 8 registers; other widths generic).
INSTANTIATE_TEST_SUITE_P(GqaAndMla, PagedAttention,
                         ::testing::Values(std::array<int64_t, 5>{4, 2, 16, 16, 8}, std::array<int64_t, 5>{4, 4, 24, 12, 8},
                                           std::array<int64_t, 5>{2, 2, 8, 20, 8}, std::array<int64_t, 5>{4, 2, 16, 16, 16},
                                           std::array<int64_t, 5>{4, 4, 24, 12, 16}, std::array<int64_t, 5>{4, 2, 32, 32, 16},
                                           std::array<int64_t, 5>{2, 1, 64, 64, 16}, std::array<int64_t, 5>{2, 2, 192, 128, 16}));

}  // namespace
