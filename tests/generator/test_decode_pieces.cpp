// The generator's pieces on their own: Philox known answers and keying; the sampling parameters
// checks; stop strings across token boundaries; the KV block pool; and the generator's paged cache
// layout as the registry's paged_attention op reads it (kernels_cpu through the C ABI) against
// its attention_fwd. kernels_cpu's sampler, pool and batch-invariant gemm have their own tests
// (tests/kernels/test_decode_ops.cpp).
#include <gtest/gtest.h>

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
  EXPECT_EQ(l.block_floats, 2 * 16 * (2 * 8 + 4 * 32));
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
  EXPECT_EQ(m.block_floats, 2 * 16 * (8 + 8) + 4 * 16 * (24 + 12));
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

TEST_P(PagedAttention, MatchesKernelsCpuAttentionThroughScatteredBlocks) {
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
  // keys(0, 0) + b block_floats; each row's block table [R, T] (here one sequence).
  rlh::engine::Ops& ops = rlh::test::cpu_ops();
  rlh::engine::Ops::PagedCache c;
  c.k = kv.keys(0, 0);
  c.v = kv.values(0, 0);
  c.num_blocks = kv.num_blocks();
  c.block_stride = l.block_floats;
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
  for (int64_t window : {int64_t(0), int64_t(10)}) {
    const float scale = 0.25f;
    // Output rows padded past Hq*Dv: nothing may be written there.
    const int64_t ldo = Hq * Dv + 3;
    std::vector<float> want(static_cast<size_t>(T * Hq * Dv)), lse(static_cast<size_t>(Hq * T)), got(static_cast<size_t>(T * ldo), NAN);
    const int32_t cu[2] = {0, int32_t(T)};
    ops.attention_fwd(want.data(), Hq * Dv, lse.data(), q.data(), Hq * D, k.data(), Hkv * D, v.data(), Hkv * Dv,
                      cu, 1, T, Hq, Hkv, D, Dv, scale, window);
    const int64_t width = int64_t(table.size());
    std::vector<int32_t> tables, pos;
    for (int64_t t = 0; t < T; ++t) {
      tables.insert(tables.end(), table.begin(), table.end());
      pos.push_back(int32_t(t));
    }
    ops.paged_attention(got.data(), ldo, q.data(), Hq * D, T, Hq, c, tables.data(), width, pos.data(), scale,
                        window);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < Hq * Dv; ++i)
        ASSERT_NEAR(got[size_t(t * ldo + i)], want[size_t(t * Hq * Dv + i)], 2e-6f)
            << "window " << window << " row " << t << " at " << i;
      ASSERT_TRUE(std::isnan(got[size_t(t * ldo + Hq * Dv)])) << "wrote past Hq*Dv";
    }
    // One row alone gives the same bits as inside the batch.
    std::vector<float> one(static_cast<size_t>(Hq * Dv));
    ops.paged_attention(one.data(), Hq * Dv, q.data() + 30 * Hq * D, Hq * D, 1, Hq, c, tables.data() + 30 * width,
                        width, pos.data() + 30, scale, window);
    EXPECT_EQ(0, std::memcmp(one.data(), got.data() + 30 * ldo, one.size() * sizeof(float)));
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
