// PPO's math (gae.hpp, value_loss.hpp): GAE and MseValueLossFn against long-double references
// written from NeMo-RL's tensor code on padded [B, S] rows (its loop over reversed(range(S)) with
// carry-forward masking, _reward_whiten, the clipped MSE), the value loss's gradient against
// central differences of that reference, the clipping edge cases (inside, outside on either
// side, exactly on a bound, ties), and the loss adapter's right shift of the value head.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "rlhost/grpo/config.hpp"
#include "rlhost/grpo/gae.hpp"
#include "rlhost/grpo/kl.hpp"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/value_loss.hpp"

namespace rlh::grpo {
namespace {

using LD = long double;

// A ragged batch: per sequence, a prompt (mask 0) then response tokens (mask 1, some 0 as an
// observation would be), values, rewards, logprobs.
struct Batch {
  std::vector<int64_t> off = {0};
  std::vector<double> mask, values, lp, ref, old_values, returns, sm, rewards;
};

Batch make_batch(uint64_t seed, std::vector<int> lens = {6, 1, 9, 4, 12, 3}) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0, 1);
  std::uniform_real_distribution<double> u01(0, 1);
  Batch b;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int L = lens[i], prompt = L > 2 ? 2 : 1;
    for (int t = 0; t < L; ++t) {
      double m = t >= prompt ? 1.0 : 0.0;
      if (m != 0 && t + 1 < L && u01(rng) < 0.2) m = 0;  // an observation token
      b.mask.push_back(m);
      b.values.push_back(t == 0 ? 0.0 : n01(rng));  // shifted: V at position 0 is 0
      b.lp.push_back(-std::abs(n01(rng)));
      b.ref.push_back(-std::abs(n01(rng)) * 1.5);
      b.old_values.push_back(b.values.back() + 0.3 * n01(rng));
      b.returns.push_back(n01(rng));
    }
    b.off.push_back(b.off.back() + L);
    b.sm.push_back(i == 3 ? 0.0 : 1.0);
    b.rewards.push_back(n01(rng));
  }
  return b;
}

Packing packing(const Batch& b) { return Packing{int64_t(b.mask.size()), int64_t(b.off.size()) - 1, b.off.data()}; }

// NeMo-RL's compute_advantage on padded rows [B, S] (padding: mask 0, value 0), long double.
struct RefGae {
  std::vector<std::vector<LD>> adv, ret;
};
RefGae reference_gae(const Batch& b, LD gamma, LD lam, bool whiten, bool kl, LD kl_coef,
                     std::optional<LD> lam_value = {}, std::optional<LD> lam_policy = {}, LD alpha = 0) {
  const size_t B = b.off.size() - 1;
  size_t S = 0;
  for (size_t i = 0; i < B; ++i) S = std::max<size_t>(S, size_t(b.off[i + 1] - b.off[i]));
  auto row = [&](const std::vector<double>& v, size_t i) {
    std::vector<LD> r(S, 0);
    for (int64_t t = b.off[i]; t < b.off[i + 1]; ++t) r[size_t(t - b.off[i])] = v[size_t(t)];
    return r;
  };
  std::vector<std::vector<LD>> M, V, R;
  for (size_t i = 0; i < B; ++i) {
    M.push_back(row(b.mask, i));
    V.push_back(row(b.values, i));
    std::vector<LD> r(S, 0);
    if (kl) {
      auto lp = row(b.lp, i), rf = row(b.ref, i);
      for (size_t t = 0; t < S; ++t) {
        LD logr = std::clamp<LD>(rf[t] - lp[t], -20, 20);
        LD k3 = std::exp(logr) - 1 - logr;
        r[t] -= kl_coef * std::clamp<LD>(k3, -10, 10);
      }
    }
    // last_response_idx = S - 1 - argmax(fliplr(mask)); only when the row has a response.
    for (size_t t = S; t-- > 0;)
      if (M[i][t] != 0) {
        r[t] += b.rewards[i];
        break;
      }
    for (size_t t = 0; t < S; ++t) r[t] *= M[i][t];
    R.push_back(r);
  }
  auto pass = [&](auto lam_of) {
    std::vector<std::vector<LD>> A(B, std::vector<LD>(S));
    for (size_t i = 0; i < B; ++i) {
      LD nv = 0, last = 0;
      const LD l = lam_of(i);
      for (size_t t = S; t-- > 0;) {
        LD delta = R[i][t] + gamma * nv - V[i][t];
        LD now = delta + gamma * l * last;
        nv = V[i][t] * M[i][t] + (1 - M[i][t]) * nv;
        last = now * M[i][t] + (1 - M[i][t]) * last;
        A[i][t] = last;
      }
    }
    return A;
  };
  RefGae out;
  const bool dec = lam_value || lam_policy || alpha > 0;
  auto Av = pass([&](size_t) { return dec ? lam_value.value_or(lam) : lam; });
  auto Ap = dec ? pass([&](size_t i) {
    if (alpha > 0) {
      LD len = 0;
      for (LD m : M[i]) len += m;
      LD x = alpha * len;
      if (x < 1) x = 1;
      return std::clamp<LD>(1 - 1 / x, 0, 1);
    }
    return lam_policy.value_or(lam);
  })
                : Av;
  out.ret = Av;
  for (size_t i = 0; i < B; ++i)
    for (size_t t = 0; t < S; ++t) out.ret[i][t] += V[i][t];
  out.adv = Ap;
  if (whiten) {
    LD cnt = 0, sum = 0;
    for (size_t i = 0; i < B; ++i)
      for (size_t t = 0; t < S; ++t) cnt += M[i][t], sum += Ap[i][t] * M[i][t];
    LD mean = sum / (cnt + 1e-8L), sq = 0;
    for (size_t i = 0; i < B; ++i)
      for (size_t t = 0; t < S; ++t) sq += (Ap[i][t] - mean) * (Ap[i][t] - mean) * M[i][t];
    LD var = sq / (cnt + 1e-8L) * (cnt / (cnt - 1));
    for (size_t i = 0; i < B; ++i)
      for (size_t t = 0; t < S; ++t) out.adv[i][t] = (Ap[i][t] - mean) / std::sqrt(var + 1e-8L);
  }
  for (size_t i = 0; i < B; ++i)
    for (size_t t = 0; t < S; ++t)
      if (M[i][t] == 0) out.adv[i][t] = 0;
  return out;
}

void expect_gae(const Batch& b, const GaeConfig& c, const RefGae& ref) {
  GaeInputs in;
  in.packing = packing(b);
  in.rewards = b.rewards.data();
  in.values = b.values.data();
  in.token_mask = b.mask.data();
  in.logprobs = b.lp.data();
  in.reference_logprobs = b.ref.data();
  const GaeResult r = gae(c, in);
  for (size_t i = 0; i + 1 < b.off.size(); ++i)
    for (int64_t t = b.off[i]; t < b.off[i + 1]; ++t) {
      const size_t s = size_t(t - b.off[i]);
      EXPECT_NEAR(r.advantages[size_t(t)], double(ref.adv[i][s]), 1e-9) << "seq " << i << " pos " << s;
      if (b.mask[size_t(t)] != 0) {
        EXPECT_NEAR(r.returns[size_t(t)], double(ref.ret[i][s]), 1e-9) << "seq " << i;
      }
    }
}

TEST(Gae, MatchesNemoRlOnPaddedRows) {
  for (uint64_t seed : {1, 2, 3}) {
    const Batch b = make_batch(seed);
    for (double gamma : {1.0, 0.9})
      for (double lam : {0.95, 1.0, 0.0})
        for (bool whiten : {true, false}) {
          GaeConfig c;
          c.gamma = gamma;
          c.lambda = lam;
          c.normalize_advantages = whiten;
          expect_gae(b, c, reference_gae(b, gamma, lam, whiten, false, 0));
        }
  }
}

TEST(Gae, KlInRewardAndDecoupledLambdas) {
  const Batch b = make_batch(7);
  GaeConfig c;
  c.use_kl_in_reward = true;
  c.kl_coef = 0.05;
  SCOPED_TRACE("kl");
  expect_gae(b, c, reference_gae(b, 1.0, 0.95, true, true, 0.05));
  c.use_kl_in_reward = false;  // a coefficient alone puts nothing in the reward
  expect_gae(b, c, reference_gae(b, 1.0, 0.95, true, false, 0));
  GaeConfig d;
  d.lambda_value = 1.0;
  d.lambda_policy = 0.8;
  SCOPED_TRACE("decoupled");
  expect_gae(b, d, reference_gae(b, 1.0, 0.95, true, false, 0, 1.0L, 0.8L));
  GaeConfig e;
  e.length_adaptive_alpha = 0.3;
  e.normalize_advantages = false;
  SCOPED_TRACE("adaptive");
  expect_gae(b, e, reference_gae(b, 1.0, 0.95, false, false, 0, {}, {}, 0.3L));
}

TEST(Gae, TerminalRewardOnlyWithLambdaOneIsMonteCarlo) {
  // gamma = lambda = 1, no whitening: A_t = R - V_t on every response token, returns = R.
  Batch b = make_batch(11, {5, 7});
  GaeConfig c;
  c.lambda = 1.0;
  c.normalize_advantages = false;
  GaeInputs in{packing(b), b.rewards.data(), b.values.data(), b.mask.data()};
  const GaeResult r = gae(c, in);
  for (size_t i = 0; i < 2; ++i)
    for (int64_t t = b.off[i]; t < b.off[i + 1]; ++t)
      if (b.mask[size_t(t)] != 0) {
        EXPECT_NEAR(r.returns[size_t(t)], b.rewards[i], 1e-12);
        EXPECT_NEAR(r.advantages[size_t(t)], b.rewards[i] - b.values[size_t(t)], 1e-12);
      } else {
        EXPECT_EQ(r.advantages[size_t(t)], 0.0);
      }
}

TEST(Gae, EdgesAndConfig) {
  // A sequence with no response token gets no reward and zero advantages; one masked-in token
  // in the whole batch whitens to 0 instead of NeMo-RL's division by zero.
  Batch b;
  b.off = {0, 3, 5};
  b.mask = {0, 0, 0, 0, 1};
  b.values = {0, 0.5, 0.2, 0, 0.7};
  b.rewards = {3.0, 1.0};
  GaeConfig c;
  GaeInputs in{packing(b), b.rewards.data(), b.values.data(), b.mask.data()};
  GaeResult r = gae(c, in);
  for (double a : r.advantages) EXPECT_NEAR(a, 0.0, 1e-4);  // (a - a / (1 + 1e-8)) * 1e4
  EXPECT_NEAR(r.returns[4], 1.0, 1e-12);
  c.normalize_advantages = false;
  r = gae(c, in);
  EXPECT_NEAR(r.advantages[4], 0.3, 1e-12);
  c.use_kl_in_reward = true;
  c.kl_coef = 0.1;
  EXPECT_THROW(gae(c, in), std::invalid_argument);  // no logprobs

  ClippedPGConfig loss;
  const GaeConfig g = GaeConfig::from_json({{"name", "gae"}, {"gae_lambda", 0.9}, {"gae_gamma", 0.99}}, loss);
  EXPECT_EQ(g.lambda, 0.9);
  EXPECT_EQ(g.gamma, 0.99);
  auto msg = [&](const nlohmann::json& j) {
    try {
      GaeConfig::from_json(j, loss);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg({{"name", "raw_reward"}}).find("ppo.adv_estimator.name"), std::string::npos);
  EXPECT_NE(msg({{"gae_lambda", 1.5}}).find("ppo.adv_estimator.gae_lambda"), std::string::npos);
  EXPECT_NE(msg({{"gae_gamma", "x"}}).find("ppo.adv_estimator.gae_gamma"), std::string::npos);
  EXPECT_NE(msg({{"length_adaptive_alpha", -1}}).find("length_adaptive_alpha"), std::string::npos);
}

// ---- the value loss -------------------------------------------------------------------------

// NeMo-RL's MseValueLossFn on the batch, long double; values given as a vector to perturb.
LD reference_value_loss(const Batch& b, const std::vector<LD>& v, LD scale, std::optional<LD> clip, LD N,
                        std::map<std::string, LD>* m = nullptr) {
  LD loss = 0, clipfrac = 0;
  for (size_t i = 0; i + 1 < b.off.size(); ++i)
    for (int64_t t = b.off[i]; t < b.off[i + 1]; ++t) {
      const size_t k = size_t(t);
      const LD mk = b.mask[k] * b.sm[i], R = b.returns[k];
      LD f = (v[k] - R) * (v[k] - R);
      if (clip && *clip > 0) {
        const LD vc = std::min(std::max(v[k], LD(b.old_values[k]) - *clip), LD(b.old_values[k]) + *clip);
        const LD q = (vc - R) * (vc - R);
        if (q > f) clipfrac += mk;
        f = std::max(f, q);
      }
      loss += f * mk;
    }
  if (m != nullptr) (*m)["vf_clipfrac"] = clipfrac / (N + 1e-8L);
  return 0.5L * scale * loss / (N + 1e-8L);
}

double valid_tokens(const Batch& b) {
  double n = 0;
  for (size_t i = 0; i + 1 < b.off.size(); ++i)
    for (int64_t t = b.off[i] + 1; t < b.off[i + 1]; ++t) n += b.mask[size_t(t)] * b.sm[i];
  return n;
}

LossResult run_value_loss(const Batch& b, const ValueLossConfig& c, std::vector<double>& grad, double N) {
  ValueLossInputs in;
  in.packing = packing(b);
  in.values = b.values.data();
  in.old_values = b.old_values.data();
  in.returns = b.returns.data();
  in.token_mask = b.mask.data();
  in.sample_mask = b.sm.data();
  in.global_valid_toks = N;
  grad.assign(b.values.size(), 0);
  return value_loss(c, in, grad.data());
}

TEST(ValueLoss, ValueMetricsAndGradientMatchTheReference) {
  for (uint64_t seed : {1, 2, 5})
    for (std::optional<double> clip : {std::optional<double>(), std::optional<double>(0.0), std::optional<double>(0.2)}) {
      const Batch b = make_batch(seed);
      const double N = valid_tokens(b) + 3;  // a global count larger than this micro-batch's
      ValueLossConfig c;
      c.scale = 0.4;
      c.cliprange = clip;
      std::vector<double> g;
      const LossResult r = run_value_loss(b, c, g, N);
      std::vector<LD> v(b.values.begin(), b.values.end());
      std::map<std::string, LD> m;
      std::optional<LD> lclip;
      if (clip) lclip = *clip;
      const LD ref = reference_value_loss(b, v, 0.4L, lclip, N, &m);
      EXPECT_NEAR(r.loss, double(ref), 1e-12);
      EXPECT_NEAR(*r.metrics.get("vf_clipfrac"), double(m["vf_clipfrac"]), 1e-12);
      // Central differences (the random values sit away from the clip bounds by construction:
      // old = v + 0.3 n, so |v - old| = c only with probability 0).
      for (size_t k = 0; k < v.size(); ++k) {
        const LD h = 1e-6L;
        auto vp = v, vm = v;
        vp[k] += h;
        vm[k] -= h;
        const LD fd = (reference_value_loss(b, vp, 0.4L, lclip, N) - reference_value_loss(b, vm, 0.4L, lclip, N)) / (2 * h);
        EXPECT_NEAR(g[k], double(fd), 1e-8) << "token " << k;
      }
      if (clip && *clip > 0) {
        EXPECT_GT(*r.metrics.get("vf_clipfrac"), 0.0);
      }
    }
}

TEST(ValueLoss, ClippingEdgeCases) {
  // One sequence: position 0 prompt, then five response tokens, each a clipping case.
  Batch b;
  b.off = {0, 6};
  b.mask = {0, 1, 1, 1, 1, 1};
  b.sm = {1};
  const double c = 0.2;
  //             prompt  inside  above(R far) below(R far) on bound  above, R between
  b.values = {0, 0.10, 1.00, -1.00, 0.20, 0.50};
  b.old_values = {0, 0.00, 0.00, 0.00, 0.00, 0.00};
  b.returns = {0, 0.05, 2.00, 0.90, 0.40, 0.10};
  ValueLossConfig cfg;
  cfg.cliprange = c;
  std::vector<double> g;
  const double N = 5;
  const LossResult r = run_value_loss(b, cfg, g, N);
  const double k = 0.5 / (N + 1e-8);
  EXPECT_EQ(g[0], 0.0);
  // inside the range: clamp is the identity, a tie: the gradient is the plain MSE's.
  EXPECT_NEAR(g[1], k * 2 * (0.10 - 0.05), 1e-15);
  // v = 1 above old + c, R = 2: unclipped (1)^2 < clipped (1.8)^2 -> clipped term, no gradient.
  EXPECT_EQ(g[2], 0.0);
  // v = -1 below old - c, R = 0.9: unclipped 3.61 > clipped 1.21 -> unclipped gradient.
  EXPECT_NEAR(g[3], k * 2 * (-1.0 - 0.9), 1e-15);
  // exactly on the bound v = old + c: clamp passes the gradient (closed interval), tie.
  EXPECT_NEAR(g[4], k * 2 * (0.20 - 0.40), 1e-15);
  // v = 0.5 above, R = 0.1: unclipped 0.16 > clipped 0.01 -> unclipped gradient.
  EXPECT_NEAR(g[5], k * 2 * (0.50 - 0.10), 1e-15);
  EXPECT_NEAR(*r.metrics.get("vf_clipfrac"), 1.0 / (N + 1e-8), 1e-15);  // token 2 only
  // A tie between a clamped and an unclamped term splits the gradient: v = 0.5, old = 0,
  // c = 0.25 -> vc = 0.25; R = 0.375 -> (0.125)^2 both (exact in binary).
  Batch t;
  t.off = {0, 2};
  t.mask = {0, 1};
  t.sm = {1};
  t.values = {0, 0.5};
  t.old_values = {0, 0.0};
  t.returns = {0, 0.375};
  ValueLossConfig quarter;
  quarter.cliprange = 0.25;
  run_value_loss(t, quarter, g, 1);
  EXPECT_NEAR(g[1], 0.5 / (1 + 1e-8) * 0.5 * 2 * (0.5 - 0.375), 1e-15);
  // cliprange 0 / null: plain MSE, no old values needed.
  ValueLossConfig plain;
  ValueLossInputs in{packing(b), b.values.data(), nullptr, b.returns.data(), b.mask.data(), b.sm.data(), N};
  std::vector<double> g2(b.values.size());
  EXPECT_NO_THROW(value_loss(plain, in, g2.data()));
  EXPECT_THROW(value_loss(cfg, in, g2.data()), std::invalid_argument);
}

TEST(ValueLoss, MicroBatchesSumAndExplainedVariance) {
  const Batch b = make_batch(9);
  const double N = valid_tokens(b);
  ValueLossConfig c;
  c.cliprange = 0.2;
  std::vector<double> g;
  const LossResult whole = run_value_loss(b, c, g, N);
  // Split into sequences [0, 3) and [3, 6); per-call kSum metrics add up to the whole's.
  Batch parts[2];
  for (int p = 0; p < 2; ++p) {
    Batch& q = parts[p];
    for (size_t i = size_t(3 * p); i < size_t(3 * p + 3); ++i) {
      for (int64_t t = b.off[i]; t < b.off[i + 1]; ++t) {
        const size_t k = size_t(t);
        q.mask.push_back(b.mask[k]);
        q.values.push_back(b.values[k]);
        q.old_values.push_back(b.old_values[k]);
        q.returns.push_back(b.returns[k]);
      }
      q.off.push_back(q.off.back() + (b.off[i + 1] - b.off[i]));
      q.sm.push_back(b.sm[i]);
    }
  }
  Metrics sum;
  for (Batch& q : parts) sum.merge(run_value_loss(q, c, g, N).metrics);
  for (const char* k : {"loss", "vf_clipfrac", "returns_mean", "values_mean", "returns_sq_mean", "residual_sq_mean",
                        "values_min", "values_max", "num_valid_samples"})
    EXPECT_NEAR(*sum.get(k), *whole.metrics.get(k), 1e-12) << k;
  // explained variance: 1 - Var(R - V) / Var(R) over the masked-in tokens, as a direct sum.
  LD n = 0, sr = 0, sr2 = 0, sd = 0, sd2 = 0;
  for (size_t i = 0; i + 1 < b.off.size(); ++i)
    for (int64_t t = b.off[i]; t < b.off[i + 1]; ++t) {
      const LD m = b.mask[size_t(t)] * b.sm[i], R = b.returns[size_t(t)], d = R - b.values[size_t(t)];
      n += m, sr += m * R, sr2 += m * R * R, sd += m * d, sd2 += m * d * d;
    }
  const LD ev = 1 - (sd2 / n - (sd / n) * (sd / n)) / (sr2 / n - (sr / n) * (sr / n));
  const double got = explained_variance(*whole.metrics.get("returns_mean"), *whole.metrics.get("values_mean"),
                                        *whole.metrics.get("returns_sq_mean"), *whole.metrics.get("residual_sq_mean"));
  EXPECT_NEAR(got, double(ev), 1e-6);
}

TEST(ValueLoss, Config) {
  const ValueLossConfig c = ValueLossConfig::from_json({{"scale", 0.4}, {"cliprange", 0.2}});
  EXPECT_EQ(c.scale, 0.4);
  EXPECT_TRUE(c.clipped());
  EXPECT_FALSE(ValueLossConfig::from_json({{"cliprange", nullptr}}).clipped());
  auto msg = [](const nlohmann::json& j) {
    try {
      ValueLossConfig::from_json(j);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(msg({{"clip_range", 0.2}}).find("value_loss_fn.clip_range"), std::string::npos);
  EXPECT_NE(msg({{"cliprange", -0.1}}).find("value_loss_fn.cliprange"), std::string::npos);
  EXPECT_NE(msg({{"scale", "big"}}).find("value_loss_fn.scale"), std::string::npos);
}

// ---- the adapter's shift ----------------------------------------------------------------------

rlh_tensor f32(float* data, int64_t* shape, int64_t* stride) {
  rlh_tensor t{};
  t.data = data;
  t.device = rlh_device{RLH_DEVICE_CPU, 0};
  t.ndim = 1;
  t.dtype = rlh_dtype{RLH_DTYPE_FLOAT, 32, 1};
  t.shape = shape;
  t.strides = stride;
  return t;
}

TEST(ValueLoss, AdapterShiftsTheHeadRightAndTheGradientBack) {
  // Two sequences of 3 and 2 tokens; the head's entry t values the prefix ending at t.
  std::vector<int64_t> off = {0, 3, 5};
  std::vector<int32_t> ids(5, 1);
  std::vector<float> head = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f}, tm = {0, 1, 1, 0, 1}, sm = {1, 1},
                     ret = {0, 1.0f, -1.0f, 0, 2.0f}, grad(5, 0.0f);
  float loss = -1;
  int64_t n5[1] = {5}, n2[1] = {2}, one[1] = {1}, none[1] = {1};
  rlh_named_tensor fields[3] = {{"token_mask", f32(tm.data(), n5, one)},
                                {"sample_mask", f32(sm.data(), n2, one)},
                                {"returns", f32(ret.data(), n5, one)}};
  rlh_named_tensor outputs[1] = {{"values", f32(head.data(), n5, one)}};
  rlh_tensor grads[1] = {f32(grad.data(), n5, one)};
  rlh_tensor loss_t = f32(&loss, none, one);
  loss_t.ndim = 0;
  rlh_batch batch{};
  batch.struct_size = sizeof(rlh_batch);
  batch.num_tokens = 5;
  batch.num_seqs = 2;
  batch.token_ids = ids.data();
  batch.seq_offsets = off.data();
  batch.fields = fields;
  batch.num_fields = 3;
  rlh_microbatch mb{};
  mb.struct_size = sizeof(rlh_microbatch);
  mb.batch = &batch;
  mb.outputs = outputs;
  mb.num_outputs = 1;
  mb.grads = grads;
  mb.loss = &loss_t;
  mb.global_num_tokens = 3;
  mb.global_num_seqs = 2;
  LossAdapter a(ValueLossConfig{});
  ASSERT_EQ(a.output_specs(1.0, 0, 1.0).at(0).kind, RLH_OUTPUT_VALUE);
  rlh_status* s = a.fn()(a.user(), &mb);
  ASSERT_EQ(s, nullptr);
  // V = shifted head: seq 0 -> [0, 0.1, 0.2], seq 1 -> [0, 0.4]. Masked-in: (0.1 vs 1), (0.2 vs
  // -1), (0.4 vs 2).
  const double N = 3 + 1e-8;
  const double want = 0.5 * ((0.1 - 1) * (0.1 - 1) + (0.2 + 1) * (0.2 + 1) + (0.4 - 2) * (0.4 - 2)) / N;
  EXPECT_NEAR(loss, want, 1e-6);
  // d/dhead[t] = d/dV[t+1]; the last head entry of each sequence values nothing trained.
  EXPECT_NEAR(grad[0], (0.1 - 1) / N, 1e-6);
  EXPECT_NEAR(grad[1], (0.2 + 1) / N, 1e-6);
  EXPECT_EQ(grad[2], 0.0f);
  EXPECT_NEAR(grad[3], (0.4 - 2) / N, 1e-6);
  EXPECT_EQ(grad[4], 0.0f);
  // Clipping needs the old values field: missing, one line naming it.
  LossAdapter clipped(ValueLossConfig{1.0, 0.2});
  s = clipped.fn()(clipped.user(), &mb);
  ASSERT_NE(s, nullptr);
  EXPECT_NE(std::string(s->message).find("'values'"), std::string::npos) << s->message;
  rlh_status_destroy(s);
}

}  // namespace
}  // namespace rlh::grpo
