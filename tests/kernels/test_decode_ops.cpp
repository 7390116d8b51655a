// kernels_cpu's decode-sized ops on their own (plugins/kernels_cpu/src/decode_ops.hpp): the
// sampler against kernels_cpu's processed logprobs (the trainer's filter) on rows with ties, flat
// and peaked distributions, the sampled distribution itself, min-p and greedy; the worker pool
// they run on; the batch-invariant gemm (float32 against float64, every row bitwise the same
// whatever the rows beside it, the column split or the thread count) and its float64 form.
// Paged attention is checked through the C ABI against attention_fwd by the generator's tests
// (tests/generator/test_decode_pieces.cpp), with the generator's cache layout.
#include <gtest/gtest.h>

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

#include "decode_ops.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"
#include "worker_pool.hpp"

namespace kcpu = rlh::kcpu;

namespace {

// One row through kcpu::sample.
struct Sampled {
  int32_t token = -1;
  float logprob = 0.f;
};
Sampled sample_row(const float* logits, int64_t V, const kcpu::SampleParams& p, double u) {
  static kcpu::WorkerPool pool(1);
  Sampled s;
  kcpu::sample(logits, V, 1, V, &u, p, &s.token, &s.logprob, pool);
  return s;
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
        const kcpu::SampleParams sp{T, k, p, 0.0};
        for (int64_t n = 0; n < N; ++n) {
          // The kept set: the generator's threshold over the same z.
          std::vector<float> z(static_cast<size_t>(V)), tmp(static_cast<size_t>(V));
          const float inv_t = float(1.0 / T);
          for (int64_t v = 0; v < V; ++v) z[size_t(v)] = rows[size_t(n)][size_t(v)] * inv_t;
          const bool filter = (k > 0 && k < V) || p < 1.0;
          const float tau = filter ? kcpu::sample_filter_threshold(z.data(), V, k > 0 && k < V ? k : 0, p, tmp.data()) : -INFINITY;
          for (int64_t v = 0; v < V; ++v)
            ASSERT_EQ(z[size_t(v)] >= tau, std::isfinite(lp[size_t(n * V + v)]))
                << "row " << n << " token " << v << " T=" << T << " k=" << k << " p=" << p;
          // Tokens drawn over a grid of u: always kept by the trainer, same logprob.
          std::set<int32_t> seen;
          for (int i = 0; i < 64; ++i) {
            const double u = (i + 0.5) / 64;
            const Sampled s = sample_row(rows[size_t(n)].data(), V, sp, u);
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

// Gemma-2's final soft-cap: the sampler caps the logits as the trainer's head does (before the
// temperature and the filters), so it keeps what the trainer keeps, with the same logprobs.
TEST(Sampling, SoftCappedLogitsAgreeWithTheTrainersHead) {
  const int64_t V = 300;
  const auto rows = test_rows(V);
  const int64_t N = int64_t(rows.size());
  std::vector<float> h(static_cast<size_t>(N * N), 0.f), W(static_cast<size_t>(V * N));
  for (int64_t n = 0; n < N; ++n) {
    h[size_t(n * N + n)] = 1.f;
    for (int64_t v = 0; v < V; ++v) W[size_t(v * N + n)] = rows[size_t(n)][size_t(v)];
  }
  std::vector<int32_t> all(static_cast<size_t>(N * V));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) all[size_t(n * V + v)] = int32_t(v);
  int checked = 0;
  for (double cap : {1.5, 30.0})
    for (double T : {1.0, 0.7})
      for (int64_t k : {int64_t(0), int64_t(5)})
        for (double p : {1.0, 0.9}) {
          kcpu::LogprobOpts o;
          o.temperature = T;
          o.top_k = k;
          o.top_p = p;
          o.softcap = cap;
          std::vector<float> lp(static_cast<size_t>(N * V)), lse(static_cast<size_t>(N));
          kcpu::linear_logprob_fwd<float>(lp.data(), lse.data(), nullptr, h.data(), W.data(), all.data(), N, N, V, V,
                                          o, kcpu::scratch_default());
          kcpu::SampleParams sp{T, k, p, 0.0};
          sp.softcap = cap;
          for (int64_t n = 0; n < N; ++n)
            for (int i = 0; i < 32; ++i) {
              const double u = (i + 0.5) / 32;
              const Sampled s = sample_row(rows[size_t(n)].data(), V, sp, u);
              const float want = lp[size_t(n * V + s.token)];
              ASSERT_TRUE(std::isfinite(want)) << "sampled a token the trainer filters out (cap " << cap << ")";
              ASSERT_NEAR(s.logprob, want, 2e-5f) << "row " << n << " cap " << cap << " T=" << T << " k=" << k;
              ++checked;
            }
        }
  EXPECT_GT(checked, 3000);
  // A cap changes the distribution (it is not ignored): a peaked row flattens.
  kcpu::SampleParams plain{1.0, 0, 1.0, 0.0}, capped = plain;
  capped.softcap = 1.0;
  const auto& peak = rows.back();
  EXPECT_GT(sample_row(peak.data(), V, plain, 0.5).logprob, sample_row(peak.data(), V, capped, 0.5).logprob + 1.f);
}

TEST(Sampling, DrawsFollowTheFilteredDistribution) {
  // Inverse CDF over a fine grid of u reproduces the probabilities to within the grid step.
  const int64_t V = 50;
  std::vector<float> logits(static_cast<size_t>(V));
  for (int64_t j = 0; j < V; ++j) logits[size_t(j)] = std::sin(float(j)) * 2.f;
    for (const kcpu::SampleParams sp : {kcpu::SampleParams{1.0, 0, 1.0, 0.0}, kcpu::SampleParams{0.5, 10, 1.0, 0.0},
                                        kcpu::SampleParams{1.5, 0, 0.7, 0.0}, kcpu::SampleParams{1.0, 0, 1.0, 0.3}}) {
    // Expected probabilities, from the definition in docs/ops.md (sample).
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
      const Sampled s = sample_row(logits.data(), V, sp, (i + 0.5) / n);
      ++count[size_t(s.token)];
      ASSERT_GT(p[size_t(s.token)], 0.0);
      ASSERT_NEAR(s.logprob, std::log(p[size_t(s.token)]), 1e-5);
    }
    for (int64_t j = 0; j < V; ++j) EXPECT_NEAR(double(count[size_t(j)]) / n, p[size_t(j)], 2.0 / n) << j;
  }
}

TEST(Sampling, GreedyTakesTheFirstMaximumWithTheUnfilteredLogprob) {
  std::vector<float> logits = {0.5f, 3.f, -1.f, 3.f, 2.f};
  const Sampled s = sample_row(logits.data(), 5, kcpu::SampleParams{0.0, 2, 0.5, 0.5}, 0.99);
  EXPECT_EQ(s.token, 1);
  double lse = 0;
  for (float x : logits) lse += std::exp(double(x));
  EXPECT_NEAR(s.logprob, 3.0 - std::log(lse), 1e-6);
  std::vector<float> bad = {0.f, NAN, 1.f};
  EXPECT_THROW(sample_row(bad.data(), 3, kcpu::SampleParams{}, 0.5), std::runtime_error);
  bad = {0.f, INFINITY, 1.f};
  EXPECT_THROW(sample_row(bad.data(), 3, kcpu::SampleParams{0.0, 0, 1.0, 0.0}, 0.5), std::runtime_error);
}

// Given ids (a trainer's deterministic logprobs): no draw; a drawn token scores its own
// logprob, bitwise; a token the filter cuts scores -inf; an id outside the vocabulary is token
// -1 with logprob 0 (a packed batch's last positions, which have no next token).
TEST(Sampling, GivenIdsScoreWhatADrawWouldHaveScored) {
  static kcpu::WorkerPool pool(1);
  const std::vector<std::vector<float>> rows = test_rows(40);
  const kcpu::SampleParams filtered{0.8, 6, 0.9, 0.0};
  for (const kcpu::SampleParams& p : {kcpu::SampleParams{1.3, 0, 1.0, 0.0}, filtered, kcpu::SampleParams{0.0, 0, 1.0, 0.0}}) {
    for (const auto& row : rows) {
      const Sampled d = sample_row(row.data(), 40, p, 0.37);
      int32_t tok = -7;
      float lp = 1.f;
      kcpu::sample(row.data(), 40, 1, 40, nullptr, p, &tok, &lp, pool, &d.token);
      EXPECT_EQ(tok, d.token);
      EXPECT_EQ(std::memcmp(&lp, &d.logprob, 4), 0) << lp << " vs " << d.logprob;
    }
  }
  // the filter's cut: the row's smallest logit is outside top-6
  const auto& row = rows[0];
  const int32_t lowest = int32_t(std::min_element(row.begin(), row.end()) - row.begin());
  int32_t tok = -7;
  float lp = 0.f;
  kcpu::sample(row.data(), 40, 1, 40, nullptr, filtered, &tok, &lp, pool, &lowest);
  EXPECT_EQ(tok, lowest);
  EXPECT_EQ(lp, -INFINITY);
  const int32_t outside[2] = {-1, 40};
  int32_t toks[2] = {5, 5};
  float lps[2] = {1.f, 1.f};
  const float two[80] = {};
  kcpu::sample(two, 40, 2, 40, nullptr, kcpu::SampleParams{}, toks, lps, pool, outside);
  EXPECT_EQ(toks[0], -1);
  EXPECT_EQ(toks[1], -1);
  EXPECT_EQ(lps[0], 0.f);
  EXPECT_EQ(lps[1], 0.f);
}

// ---------------------------------------------------------------------------------------------
// The worker pool

TEST(WorkerPool, RunsEveryTaskOnceOnEveryThreadCount) {
  for (int threads : {1, 2, 4}) {
    kcpu::WorkerPool pool(threads);
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
  kcpu::WorkerPool pool(2);
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
  kcpu::WorkerPool pool(3);
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
  kcpu::WorkerPool pool(2);
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
  kcpu::WorkerPool three(3);
  EXPECT_NE(&kcpu::WorkerPool::current(), &three);
  {
    const kcpu::WorkerPool::Scope bind(three);
    EXPECT_EQ(&kcpu::WorkerPool::current(), &three);
    kcpu::WorkerPool two(2);
    {
      const kcpu::WorkerPool::Scope inner(two);
      EXPECT_EQ(&kcpu::WorkerPool::current(), &two);
    }
    EXPECT_EQ(&kcpu::WorkerPool::current(), &three);
  }
  EXPECT_NE(&kcpu::WorkerPool::current(), &three);
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
    const kcpu::WorkerPool::SerialOpenMp serial;
    EXPECT_EQ(omp_get_max_threads(), 1);
  }
  EXPECT_EQ(omp_get_max_threads(), before);
}

// ---------------------------------------------------------------------------------------------
// The batch-invariant gemm (gemm with batch_invariant = 1)

TEST(GemmRows, MatchesFloat64AndEveryRowIsBatchInvariant) {
  std::mt19937 g(3);
  std::normal_distribution<float> nd;
  for (auto [N, K] : std::vector<std::pair<int64_t, int64_t>>{{37, 19}, {300, 64}, {1024, 256}, {129, 1000}}) {
    const int64_t Mmax = 70;
    std::vector<float> W(static_cast<size_t>(N * K)), x(static_cast<size_t>(Mmax * K));
    for (float& v : W) v = nd(g);
    for (float& v : x) v = nd(g);
    std::vector<float> y1(static_cast<size_t>(N));
    kcpu::WorkerPool one(1);
    kcpu::gemm_rows(y1.data(), N, x.data() + 5 * K, K, W.data(), K, 1, N, K, one);  // row 5 alone
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
        kcpu::WorkerPool pool(threads);
        std::vector<float> y(static_cast<size_t>(M * (N + 3)), NAN);
        kcpu::gemm_rows(y.data(), N + 3, x.data(), K, W.data(), K, M, N, K, pool);  // padded rows: ldy > N
        if (M > 5) {
          ASSERT_EQ(0, std::memcmp(y.data() + 5 * (N + 3), y1.data(), size_t(N) * sizeof(float)))
              << "N=" << N << " K=" << K << " M=" << M << " threads=" << threads;
        }
        ASSERT_TRUE(std::isnan(y[size_t(N)])) << "wrote past N";
      }
    // Splitting the columns (fused vs separate projections) changes nothing either.
    std::vector<float> ya(static_cast<size_t>(4 * N)), yb(static_cast<size_t>(4 * N));
    kcpu::gemm_rows(ya.data(), N, x.data(), K, W.data(), K, 4, N, K, one);
    const int64_t cut = N / 3;
    kcpu::gemm_rows(yb.data(), N, x.data(), K, W.data(), K, 4, cut, K, one);
    kcpu::gemm_rows(yb.data() + cut, N, x.data(), K, W.data() + cut * K, K, 4, N - cut, K, one);
    EXPECT_EQ(0, std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float)));
  }
}


TEST(GemmRows, Float64IsExactOnWidenedFloatsAndRowInvariant) {
  std::mt19937 g(4);
  std::normal_distribution<float> nd;
  const int64_t M = 9, N = 13, K = 203;
  std::vector<double> x(static_cast<size_t>(M * K)), W(static_cast<size_t>(N * K));
  for (double& v : x) v = double(nd(g));
  for (double& v : W) v = double(nd(g));
  kcpu::WorkerPool pool(2);
  std::vector<double> y(static_cast<size_t>(M * N)), y1(static_cast<size_t>(N));
  kcpu::gemm_rows(y.data(), N, x.data(), K, W.data(), K, M, N, K, pool);
  kcpu::gemm_rows(y1.data(), N, x.data() + 4 * K, K, W.data(), K, 1, N, K, pool);
  EXPECT_EQ(0, std::memcmp(y.data() + 4 * N, y1.data(), size_t(N) * sizeof(double)));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      long double ref = 0;
      for (int64_t k = 0; k < K; ++k) ref += (long double)x[size_t(m * K + k)] * W[size_t(n * K + k)];
      EXPECT_NEAR(y[size_t(m * N + n)], double(ref), 1e-12 * K);
    }
}

}  // namespace
