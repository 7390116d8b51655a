// The generator's pieces on their own: Philox known answers and keying; sampling against
// kernels_cpu's processed logprobs (the trainer's filter) on rows with ties, flat and peaked
// distributions; the sampled distribution itself; min-p and greedy; stop strings across token
// boundaries; the KV block pool; the worker pool; the row-invariant product; paged attention
// against float64 attention with a float32 error bound.
#include <gtest/gtest.h>

#include <array>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

#include "rlhost/generator/kv_cache.hpp"
#include "rlhost/generator/linear.hpp"
#include "rlhost/generator/paged_attention.hpp"
#include "rlhost/generator/rng.hpp"
#include "rlhost/generator/sampling.hpp"
#include "rlhost/generator/stop_strings.hpp"
#include "rlhost/generator/worker_pool.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"

using namespace rlh::gen;
namespace kcpu = rlh::kcpu;

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
// Sampling against the trainer's processed logprobs

// Rows of logits with the shapes that stress a cut: ties at the k-th value, a flat row, a
// peaked row, random normal rows.
std::vector<std::vector<float>> test_rows(int64_t V) {
  std::mt19937 g(5);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> rows;
  for (int r = 0; r < 6; ++r) {
    std::vector<float> row(static_cast<size_t>(V));
    for (float& x : row) x = 2.f * nd(g);
    rows.push_back(row);
  }
  std::vector<float> ties(static_cast<size_t>(V));
  for (int64_t j = 0; j < V; ++j) ties[size_t(j)] = float(j % 7) * 0.5f;  // many equal values
  rows.push_back(ties);
  rows.push_back(std::vector<float>(static_cast<size_t>(V), 0.25f));  // flat
  std::vector<float> peak(static_cast<size_t>(V), -3.f);
  peak[17] = 9.f;
  peak[3] = 8.5f;
  rows.push_back(peak);
  return rows;
}

TEST(Sampling, KeepsExactlyWhatTheTrainerKeepsAndAgreesOnLogprobs) {
  const int64_t V = 300;
  const auto rows = test_rows(V);
  const int64_t N = int64_t(rows.size());
  // h = identity and W[v, n] = row n's logit v: the kernel's logits are then exactly the rows.
  std::vector<float> h(static_cast<size_t>(N * N), 0.f), W(static_cast<size_t>(V * N));
  for (int64_t n = 0; n < N; ++n) {
    h[size_t(n * N + n)] = 1.f;
    for (int64_t v = 0; v < V; ++v) W[size_t(v * N + n)] = rows[size_t(n)][size_t(v)];
  }
  std::vector<int32_t> all(static_cast<size_t>(N * V));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) all[size_t(n * V + v)] = int32_t(v);
  std::vector<float> scratch(static_cast<size_t>(sample_scratch_floats(V)));
  int checked = 0;
  for (double T : {1.0, 0.6, 1.7})
    for (int64_t k : {int64_t(0), int64_t(1), int64_t(5), int64_t(40), V - 1, V})
      for (double p : {1.0, 0.9, 0.5, 0.999}) {
        kcpu::LogprobOpts o;
        o.temperature = T;
        o.top_k = k;
        o.top_p = p;
        std::vector<float> lp(static_cast<size_t>(N * V)), lse(static_cast<size_t>(N));
        kcpu::linear_logprob_fwd<float>(lp.data(), lse.data(), nullptr, h.data(), W.data(), all.data(), N, N, V, V,
                                        o, kcpu::scratch_default());
        const SamplingParams sp{T, k, p, 0.0};
        for (int64_t n = 0; n < N; ++n) {
          // The kept set: the generator's threshold over the same z.
          std::vector<float> z(static_cast<size_t>(V)), tmp(static_cast<size_t>(V));
          const float inv_t = float(1.0 / T);
          for (int64_t v = 0; v < V; ++v) z[size_t(v)] = rows[size_t(n)][size_t(v)] * inv_t;
          const bool filter = (k > 0 && k < V) || p < 1.0;
          const float tau = filter ? filter_threshold(z.data(), V, k > 0 && k < V ? k : 0, p, tmp.data()) : -INFINITY;
          for (int64_t v = 0; v < V; ++v)
            ASSERT_EQ(z[size_t(v)] >= tau, std::isfinite(lp[size_t(n * V + v)]))
                << "row " << n << " token " << v << " T=" << T << " k=" << k << " p=" << p;
          // Tokens drawn over a grid of u: always kept by the trainer, same logprob.
          std::set<int32_t> seen;
          for (int i = 0; i < 64; ++i) {
            const double u = (i + 0.5) / 64;
            const Sampled s = sample_row(rows[size_t(n)].data(), V, sp, u, scratch.data());
            const float want = lp[size_t(n * V + s.token)];
            ASSERT_TRUE(std::isfinite(want)) << "sampled a token the trainer filters out";
            // kernels_cpu's filtered path sums exp() sequentially in float: ~V ulp apart at worst.
            ASSERT_NEAR(s.logprob, want, 2e-5f) << "row " << n << " T=" << T << " k=" << k << " p=" << p;
            seen.insert(s.token);
            ++checked;
          }
          if (k == 1 && n < 6) {  // random rows have no ties: one token (tied maxima are all kept)
            EXPECT_EQ(seen.size(), 1u);
          }
        }
      }
  EXPECT_GT(checked, 10000);
}

TEST(Sampling, DrawsFollowTheFilteredDistribution) {
  // Inverse CDF over a fine grid of u reproduces the probabilities to within the grid step.
  const int64_t V = 50;
  std::vector<float> logits(static_cast<size_t>(V));
  for (int64_t j = 0; j < V; ++j) logits[size_t(j)] = std::sin(float(j)) * 2.f;
  std::vector<float> scratch(static_cast<size_t>(sample_scratch_floats(V)));
  for (const SamplingParams sp : {SamplingParams{1.0, 0, 1.0, 0.0}, SamplingParams{0.5, 10, 1.0, 0.0},
                                  SamplingParams{1.5, 0, 0.7, 0.0}, SamplingParams{1.0, 0, 1.0, 0.3}}) {
    // Expected probabilities, from the definition in sampling.hpp.
    std::vector<double> z(static_cast<size_t>(V));
    for (int64_t j = 0; j < V; ++j) z[size_t(j)] = double(logits[size_t(j)] * float(1.0 / sp.temperature));
    const double zmax = *std::max_element(z.begin(), z.end());
    std::vector<std::pair<double, int64_t>> order;
    for (int64_t j = 0; j < V; ++j)
      if (sp.min_p == 0 || z[size_t(j)] >= zmax + std::log(sp.min_p)) order.push_back({z[size_t(j)], j});
    std::sort(order.rbegin(), order.rend());
    if (sp.top_k > 0) order.resize(size_t(std::min<int64_t>(sp.top_k, int64_t(order.size()))));
    double tot = 0;
    for (auto& [v, j] : order) tot += std::exp(v - zmax);
    std::vector<double> p(static_cast<size_t>(V), 0.0);
    double before = 0;
    for (auto& [v, j] : order) {
      if (before / tot >= sp.top_p) break;
      p[size_t(j)] = std::exp(v - zmax);
      before += p[size_t(j)];
    }
    double kept = 0;
    for (double x : p) kept += x;
    for (double& x : p) x /= kept;
    const int n = 20000;
    std::vector<int> count(static_cast<size_t>(V), 0);
    for (int i = 0; i < n; ++i) {
      const Sampled s = sample_row(logits.data(), V, sp, (i + 0.5) / n, scratch.data());
      ++count[size_t(s.token)];
      ASSERT_GT(p[size_t(s.token)], 0.0);
      ASSERT_NEAR(s.logprob, std::log(p[size_t(s.token)]), 1e-5);
    }
    for (int64_t j = 0; j < V; ++j) EXPECT_NEAR(double(count[size_t(j)]) / n, p[size_t(j)], 2.0 / n) << j;
  }
}

TEST(Sampling, GreedyTakesTheFirstMaximumWithTheUnfilteredLogprob) {
  std::vector<float> logits = {0.5f, 3.f, -1.f, 3.f, 2.f};
  std::vector<float> scratch(static_cast<size_t>(sample_scratch_floats(5)));
  const Sampled s = sample_row(logits.data(), 5, SamplingParams{0.0, 2, 0.5, 0.5}, 0.99, scratch.data());
  EXPECT_EQ(s.token, 1);
  double lse = 0;
  for (float x : logits) lse += std::exp(double(x));
  EXPECT_NEAR(s.logprob, 3.0 - std::log(lse), 1e-6);
  std::vector<float> bad = {0.f, NAN, 1.f};
  EXPECT_THROW(sample_row(bad.data(), 3, SamplingParams{}, 0.5, scratch.data()), std::runtime_error);
  bad = {0.f, INFINITY, 1.f};
  EXPECT_THROW(sample_row(bad.data(), 3, SamplingParams{0.0, 0, 1.0, 0.0}, 0.5, scratch.data()), std::runtime_error);
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
// Worker pool

TEST(WorkerPool, RunsEveryTaskOnceOnEveryThreadCount) {
  for (int threads : {1, 2, 4}) {
    WorkerPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    // Many short loops back to back (the decode's pattern), with gaps long and short enough for
    // workers to be found spinning and sleeping.
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(2), int64_t(7), int64_t(64), int64_t(1000)})
      for (int round = 0; round < 200; ++round) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::atomic<int> bad_worker{0};
        pool.parallel_for(n, [&](int64_t i, int w) {
          hits[size_t(i)].fetch_add(1);
          if (w < 0 || w >= threads) bad_worker.fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << "task " << i << " n " << n;
        ASSERT_EQ(bad_worker.load(), 0);
        if (round == 100) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // workers asleep
      }
  }
}

TEST(WorkerPool, UsesItsWorkersAndKeepsTheirIndicesApart) {
  WorkerPool pool(2);
  // Tasks that wait for each other can only finish if two threads run them at once.
  std::atomic<int> arrived{0};
  std::set<int> workers;
  std::mutex mu;
  pool.parallel_for(2, [&](int64_t, int w) {
    arrived.fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    workers.insert(w);
  });
  EXPECT_EQ(arrived.load(), 2);
  EXPECT_EQ(workers, (std::set<int>{0, 1})) << "two tasks running at once hold two worker indices";
}

TEST(WorkerPool, RethrowsTheFirstFailureAfterTheOtherTasksRan) {
  WorkerPool pool(3);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.parallel_for(50, [&](int64_t i, int) {
    ran.fetch_add(1);
    if (i == 17) throw std::runtime_error("task 17");
  }), std::runtime_error);
  EXPECT_EQ(ran.load(), 50);
  // The pool is usable afterwards and does not throw the old failure again.
  std::atomic<int> again{0};
  pool.parallel_for(10, [&](int64_t, int) { again.fetch_add(1); });
  EXPECT_EQ(again.load(), 10);
}

TEST(WorkerPool, NestedAndConcurrentLoopsRunSeriallyWhereTheyAreCalled) {
  WorkerPool pool(2);
  std::atomic<int> inner{0};
  pool.parallel_for(8, [&](int64_t, int w) {
    // From inside a task: serial, on the same thread, reported as worker 0.
    const std::thread::id me = std::this_thread::get_id();
    pool.parallel_for(4, [&](int64_t, int iw) {
      EXPECT_EQ(iw, 0);
      EXPECT_EQ(std::this_thread::get_id(), me);
      inner.fetch_add(1);
    });
    (void)w;
  });
  EXPECT_EQ(inner.load(), 32);
  // Two threads calling at once: both complete every task.
  std::atomic<int> a{0}, b{0};
  std::thread other([&] {
    for (int r = 0; r < 300; ++r) pool.parallel_for(16, [&](int64_t, int) { b.fetch_add(1); });
  });
  for (int r = 0; r < 300; ++r) pool.parallel_for(16, [&](int64_t, int) { a.fetch_add(1); });
  other.join();
  EXPECT_EQ(a.load(), 300 * 16);
  EXPECT_EQ(b.load(), 300 * 16);
}

TEST(WorkerPool, ScopeBindsAPoolToTheThreadAndOpenMpStaysSerialInside) {
  WorkerPool three(3);
  EXPECT_NE(&WorkerPool::current(), &three);
  {
    const WorkerPool::Scope bind(three);
    EXPECT_EQ(&WorkerPool::current(), &three);
    WorkerPool two(2);
    {
      const WorkerPool::Scope inner(two);
      EXPECT_EQ(&WorkerPool::current(), &two);
    }
    EXPECT_EQ(&WorkerPool::current(), &three);
  }
  EXPECT_NE(&WorkerPool::current(), &three);
  // OpenMP regions opened by a task (kernels_cpu's ops) do not start a team of their own.
  std::atomic<int> teams_wider_than_one{0};
  three.parallel_for(6, [&](int64_t, int) {
#pragma omp parallel
    {
      if (omp_get_num_threads() > 1) teams_wider_than_one.fetch_add(1);
    }
  });
  EXPECT_EQ(teams_wider_than_one.load(), 0);
  const int before = omp_get_max_threads();
  {
    const WorkerPool::SerialOpenMp serial;
    EXPECT_EQ(omp_get_max_threads(), 1);
  }
  EXPECT_EQ(omp_get_max_threads(), before);
}

// ---------------------------------------------------------------------------------------------
// Row-invariant product

TEST(Linear, MatchesFloat64AndEveryRowIsBatchInvariant) {
  std::mt19937 g(3);
  std::normal_distribution<float> nd;
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{37, 19}, {300, 64}, {1024, 256}, {129, 1000}}) {
    const int64_t Mmax = 70;
    std::vector<float> W(static_cast<size_t>(N * K)), x(static_cast<size_t>(Mmax * K));
    for (float& v : W) v = nd(g);
    for (float& v : x) v = nd(g);
    std::vector<float> y1(static_cast<size_t>(N));
    linear(y1.data(), N, x.data() + 5 * K, K, W.data(), K, 1, N, K);  // row 5 alone
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        ref += double(x[size_t(5 * K + k)]) * double(W[size_t(n * K + k)]);
        mag += std::fabs(double(x[size_t(5 * K + k)]) * double(W[size_t(n * K + k)]));
      }
      ASSERT_NEAR(y1[size_t(n)], ref, 1e-6 * mag + 1e-6);
    }
    for (int threads : {1, 2, 3})
      for (int64_t M : {int64_t(2), int64_t(3), int64_t(6), int64_t(16), int64_t(17), Mmax}) {
        WorkerPool pool(threads);
        const WorkerPool::Scope bind(pool);
        std::vector<float> y(static_cast<size_t>(M * (N + 3)), NAN);
        linear(y.data(), N + 3, x.data(), K, W.data(), K, M, N, K);  // padded rows: ldy > N
        if (M > 5) {
          ASSERT_EQ(0, std::memcmp(y.data() + 5 * (N + 3), y1.data(), size_t(N) * sizeof(float)))
              << "N=" << N << " K=" << K << " M=" << M << " threads=" << threads;
        }
        ASSERT_TRUE(std::isnan(y[size_t(N)])) << "wrote past N";
      }
    // Splitting the columns (fused vs separate projections) changes nothing either.
    std::vector<float> ya(static_cast<size_t>(4 * N)), yb(static_cast<size_t>(4 * N));
    linear(ya.data(), N, x.data(), K, W.data(), K, 4, N, K);
    const int64_t cut = N / 3;
    linear(yb.data(), N, x.data(), K, W.data(), K, 4, cut, K);
    linear(yb.data() + cut, N, x.data(), K, W.data() + cut * K, K, 4, N - cut, K);
    EXPECT_EQ(0, std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)));
  }
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
                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dv, double scale, int64_t window) {
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
  std::vector<CacheRow> rows;
  for (int64_t t = 0; t < T; ++t) rows.push_back(CacheRow{table.data(), int32_t(t)});
  // Keys written in two uneven steps, like a chunked prefill.
  kv_write(kv, 0, {rows.data(), 20}, k.data(), Hkv * D, v.data(), Hkv * Dv);
  kv_write(kv, 0, {rows.data() + 20, size_t(T - 20)}, k.data() + 20 * Hkv * D, Hkv * D, v.data() + 20 * Hkv * Dv,
           Hkv * Dv);
  for (int64_t window : {int64_t(0), int64_t(10)}) {
    const float scale = 0.25f;
    // Output rows padded past Hq*Dv: nothing may be written there.
    const int64_t ldo = Hq * Dv + 3;
    std::vector<float> got(static_cast<size_t>(T * ldo), NAN);
    const AttentionRef want = attention_ref(q, k, v, T, Hq, Hkv, D, Dv, scale, window);
    paged_attention(got.data(), ldo, q.data(), Hq * D, rows, kv, 0, Hq, scale, window);
    double worst = 0;  // the largest error as a share of its bound, printed for the record
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < Hq * Dv; ++i) {
        const size_t at = size_t(t * Hq * Dv + i);
        const double err = std::fabs(double(got[size_t(t * ldo + i)]) - want.out[at]);
        ASSERT_LE(err, want.bound[at]) << "window " << window << " row " << t << " at " << i << ": got "
                                       << got[size_t(t * ldo + i)] << ", float64 " << want.out[at];
        worst = std::max(worst, err / want.bound[at]);
      }
      ASSERT_TRUE(std::isnan(got[size_t(t * ldo + Hq * Dv)])) << "wrote past Hq*Dv";
    }
    RecordProperty("window" + std::to_string(window) + "_error_share_of_bound", std::to_string(worst));
    // One row alone gives the same bits as inside the batch.
    std::vector<float> one(static_cast<size_t>(Hq * Dv));
    paged_attention(one.data(), Hq * Dv, q.data() + 30 * Hq * D, Hq * D, {rows.data() + 30, 1}, kv, 0, Hq, scale, window);
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
