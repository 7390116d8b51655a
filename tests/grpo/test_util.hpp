// Test data for the GRPO-family tests: random ragged batches (reference.hpp layout) and their
// packed form (rlh_grpo_core layout), micro-batch splitting, comparisons.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "reference.hpp"
#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/dpo_loss.hpp"
#include "rlhost/grpo/nll_loss.hpp"

namespace rlh::grpo::test {

// Options for a random batch. Log-ratios lp - prev are drawn from [lr_lo, lr_hi] and kept
// `kink_margin` away from every value in `kinks` (the log of clip bounds), so finite differences
// never straddle a kink.
struct GenOptions {
  std::vector<int> lengths = {7, 1, 9, 5, 12, 2, 8};
  double masked_token_prob = 0.15;  // response tokens with token_mask 0 (e.g. tool output)
  int zero_sample_mask_seq = 3;      // a sequence with sample_mask 0 (-1: none)
  double lr_lo = -0.7, lr_hi = 0.5;
  std::vector<double> kinks;
  double kink_margin = 2e-3;
  double gen_noise = 0.1;
  double ref_noise = 0.4;
  bool per_token_advantages = false;
  uint64_t seed = 1;
};

struct Case {
  RefBatch batch;
  Rows lp;  // current logprobs, next-token frame
};

inline double away_from_kinks(double x, const GenOptions& o) {
  for (double k : o.kinks)
    if (std::abs(x - k) < o.kink_margin) x = k + (x < k ? -o.kink_margin : o.kink_margin);
  return x;
}

inline Case make_case(const GenOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> u01(0, 1), ulp(-3.0, -0.05), ulr(o.lr_lo, o.lr_hi),
      uadv(-2, 2);
  std::normal_distribution<double> ngen(0, o.gen_noise), nref(0, o.ref_noise);
  Case c;
  for (size_t b = 0; b < o.lengths.size(); ++b) {
    const int L = o.lengths[b];
    RefSeq s;
    s.token_mask.assign(L, 0.0);
    s.advantages.assign(L, 0.0);
    s.prev.assign(L, 0.0);
    s.gen.assign(L, 0.0);
    s.ref.assign(L, 0.0);
    const int prompt = std::max(1, L / 3);
    const double a = uadv(rng);
    for (int t = 0; t < L; ++t) {
      if (t >= prompt) s.token_mask[t] = u01(rng) < o.masked_token_prob ? 0.0 : 1.0;
      s.advantages[t] = o.per_token_advantages ? uadv(rng) : a;
    }
    std::vector<double> lp(L > 0 ? L - 1 : 0);
    for (int j = 0; j + 1 < L; ++j) {
      lp[j] = ulp(rng);
      const double lr = away_from_kinks(ulr(rng), o);
      s.prev[j + 1] = lp[j] - lr;
      s.gen[j + 1] = s.prev[j + 1] + ngen(rng);
      s.ref[j + 1] = lp[j] + nref(rng);
    }
    s.sample_mask = static_cast<int>(b) == o.zero_sample_mask_seq ? 0.0 : 1.0;
    s.reward = u01(rng) < 0.5 ? 1.0 : 0.0;
    c.batch.seqs.push_back(std::move(s));
    c.lp.push_back(std::move(lp));
  }
  c.batch.set_global_counts();
  return c;
}

// The packed form of (a subset of) a case, in the given sequence order.
struct Packed {
  std::vector<int> order;  // packed sequence k = case sequence order[k]
  std::vector<int64_t> offsets;
  std::vector<double> lp, lpu, adv, prev, gen, ref, tm, sm, rewards;

  int64_t num_tokens() const { return offsets.back(); }
  Packing packing() const {
    return Packing{num_tokens(), static_cast<int64_t>(order.size()), offsets.data()};
  }
  ClippedPGInputs pg_inputs(const RefBatch& B, bool with_unfiltered = false) const {
    ClippedPGInputs in;
    in.packing = packing();
    in.logprobs = lp.data();
    in.logprobs_unfiltered = with_unfiltered ? lpu.data() : nullptr;
    in.advantages = adv.data();
    in.prev_logprobs = prev.data();
    in.generation_logprobs = gen.data();
    in.reference_policy_logprobs = ref.data();
    in.token_mask = tm.data();
    in.sample_mask = sm.data();
    in.rewards = rewards.data();
    in.global_valid_toks = B.g_tok;
    in.global_valid_seqs = B.g_seq;
    in.global_positive_toks = B.g_pos;
    return in;
  }
};

// `last_output` is what the (unused) last output position of each sequence holds.
inline Packed pack(const RefBatch& B, const Rows& lp, const std::vector<int>& order,
                   const Rows* lpu = nullptr, double last_output = 0.0) {
  Packed p;
  p.order = order;
  p.offsets.push_back(0);
  for (int b : order) {
    const RefSeq& s = B.seqs[b];
    const size_t L = s.length();
    for (size_t t = 0; t < L; ++t) {
      p.adv.push_back(s.advantages[t]);
      p.prev.push_back(s.prev[t]);
      p.gen.push_back(s.gen[t]);
      p.ref.push_back(s.ref[t]);
      p.tm.push_back(s.token_mask[t]);
      const bool last = t + 1 == L;
      p.lp.push_back(last ? last_output : lp[b][t]);
      p.lpu.push_back(last ? last_output : (lpu ? (*lpu)[b][t] : lp[b][t]));
    }
    p.sm.push_back(s.sample_mask);
    p.rewards.push_back(s.reward);
    p.offsets.push_back(p.offsets.back() + static_cast<int64_t>(L));
  }
  return p;
}

inline std::vector<int> iota_order(size_t n) {
  std::vector<int> o(n);
  std::iota(o.begin(), o.end(), 0);
  return o;
}

// Maps a packed output-frame gradient back to rows (and checks the unused positions are 0).
inline Rows unpack_grad(const Packed& p, const std::vector<double>& g, const RefBatch& B) {
  Rows r(B.seqs.size());
  for (size_t b = 0; b < B.seqs.size(); ++b)
    r[b].assign(B.seqs[b].length() > 0 ? B.seqs[b].length() - 1 : 0, 0.0);
  for (size_t k = 0; k < p.order.size(); ++k) {
    const int b = p.order[k];
    const int64_t off = p.offsets[k], L = p.offsets[k + 1] - p.offsets[k];
    for (int64_t j = 0; j + 1 < L; ++j) r[b][j] = g[off + j];
    if (L > 0) {
      EXPECT_EQ(g[off + L - 1], 0.0) << "gradient at the last output of sequence " << b;
    }
  }
  return r;
}

inline void expect_rows_near(const Rows& got, const Rows& want, double abs_tol, double rel_tol,
                             const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t b = 0; b < got.size(); ++b) {
    ASSERT_EQ(got[b].size(), want[b].size());
    for (size_t j = 0; j < got[b].size(); ++j)
      EXPECT_NEAR(got[b][j], want[b][j], abs_tol + rel_tol * std::abs(want[b][j]))
          << what << " at sequence " << b << " position " << j;
  }
}

inline void expect_close(double got, double want, double rel, const std::string& what) {
  if (std::isinf(want)) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  EXPECT_NEAR(got, want, rel * std::max(1.0, std::abs(want))) << what;
}

}  // namespace rlh::grpo::test
