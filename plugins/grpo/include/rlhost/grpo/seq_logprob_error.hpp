// NeMo-RL's compute_and_apply_seq_logprob_error_masking (grpo.py; ppo.py's PPO uses it too): how
// far the generator's logprobs of a sample's tokens are from the trainer's (prev_logprobs), per
// sequence, as token_mult_prob_error is per batch:
//   error_s = mean over the loss tokens t of s (token_mask * sample_mask > 0) of exp|gen_t - prev_t|
// A sequence without loss tokens has none (it is left out of the statistics and never masked).
// With a threshold (grpo.seq_logprob_error_threshold), a sequence whose error exceeds it leaves
// the loss: its sample_mask becomes 0. Why: a sample the generator drew from a distribution far
// from the trainer's (kernel or precision mismatch, a stale policy) gives importance ratios the
// clipping cannot repair.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace rlh::grpo {

struct SeqErrorStats {
  double sum = 0, count = 0;
  double max = -std::numeric_limits<double>::infinity(), min = std::numeric_limits<double>::infinity();
  void add(double e);
};

struct SeqLogprobError {
  std::vector<double> error;         // per sequence (0 without loss tokens)
  std::vector<float> sample_mask;    // after the threshold (the input's without one)
  SeqErrorStats all;                 // sequences with loss tokens
  SeqErrorStats kept;                // of those, the ones the threshold keeps
  double masked = 0;                 // sequences the threshold took out of the loss
  double masked_correct = 0;         // of those, the ones with reward 1
  double kept_tokens = 0;            // loss tokens left (PPO refuses a step without any)
};

// One rank's batch: `offsets` [S + 1] into the per-token fields, per-sequence `sample_mask` and
// `rewards`.
SeqLogprobError seq_logprob_error(std::span<const int64_t> offsets, std::span<const float> token_mask,
                                  std::span<const float> sample_mask, std::span<const float> prev_logprobs,
                                  std::span<const float> generation_logprobs, std::span<const double> rewards,
                                  std::optional<double> threshold);

// NeMo-RL's metrics from statistics already summed (and min/max-reduced) over the batch:
// {max,mean,min}_seq_mult_prob_error, the same _after_mask, num_masked_seqs_by_logprob_error and
// masked_correct_pct; 0 where no sequence counts, as NeMo-RL writes them.
std::map<std::string, double> seq_logprob_error_metrics(const SeqErrorStats& all, const SeqErrorStats& kept,
                                                        double masked, double masked_correct, bool thresholded);

}  // namespace rlh::grpo
