// Per-sequence logprob error and its mask (seq_logprob_error.hpp).
#include "rlhost/grpo/seq_logprob_error.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace rlh::grpo {

void SeqErrorStats::add(double e) {
  sum += e;
  count += 1;
  max = std::max(max, e);
  min = std::min(min, e);
}

SeqLogprobError seq_logprob_error(std::span<const int64_t> offsets, std::span<const float> token_mask,
                                  std::span<const float> sample_mask, std::span<const float> prev_logprobs,
                                  std::span<const float> generation_logprobs, std::span<const double> rewards,
                                  std::optional<double> threshold) {
  if (offsets.empty()) throw std::invalid_argument("seq_logprob_error: no offsets");
  const size_t S = offsets.size() - 1;
  const size_t T = static_cast<size_t>(offsets.back());
  if (sample_mask.size() != S || rewards.size() != S || token_mask.size() != T || prev_logprobs.size() != T ||
      generation_logprobs.size() != T)
    throw std::invalid_argument("seq_logprob_error: field sizes do not match the batch");
  SeqLogprobError out;
  out.error.assign(S, 0.0);
  out.sample_mask.assign(sample_mask.begin(), sample_mask.end());
  for (size_t s = 0; s < S; ++s) {
    double num = 0, den = 0;
    for (int64_t t = offsets[s]; t < offsets[s + 1]; ++t) {
      const double m = double(token_mask[size_t(t)]) * double(sample_mask[s]);
      if (m == 0) continue;
      num += std::exp(std::fabs(double(generation_logprobs[size_t(t)]) - double(prev_logprobs[size_t(t)])) * m) * m;
      den += m;
    }
    const bool valid = den > 0;
    if (valid) {
      out.error[s] = num / den;
      out.all.add(out.error[s]);
    }
    const bool keep = !threshold || out.error[s] <= *threshold;
    if (!keep && sample_mask[s] != 0) {
      out.sample_mask[s] = 0.0f;
      out.masked += 1;
      out.masked_correct += rewards[s] == 1.0 ? 1 : 0;
    }
    if (keep && valid) {
      out.kept.add(out.error[s]);
      out.kept_tokens += den;
    }
  }
  return out;
}

std::map<std::string, double> seq_logprob_error_metrics(const SeqErrorStats& all, const SeqErrorStats& kept,
                                                        double masked, double masked_correct, bool thresholded) {
  auto put = [](std::map<std::string, double>& m, const std::string& suffix, const SeqErrorStats& s) {
    const bool any = s.count > 0;
    m["max_seq_mult_prob_error" + suffix] = any ? s.max : 0.0;
    m["mean_seq_mult_prob_error" + suffix] = any ? s.sum / s.count : 0.0;
    m["min_seq_mult_prob_error" + suffix] = any ? s.min : 0.0;
  };
  std::map<std::string, double> m;
  put(m, "", all);
  put(m, "_after_mask", thresholded ? kept : all);
  m["num_masked_seqs_by_logprob_error"] = masked;
  m["masked_correct_pct"] = masked > 0 ? masked_correct / masked : 0.0;
  return m;
}

}  // namespace rlh::grpo
