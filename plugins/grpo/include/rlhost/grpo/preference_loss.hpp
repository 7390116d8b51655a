// NeMo-RL's PreferenceLossFn: the Bradley-Terry loss of a reward model (NeMo-RL's rm).
//
// Sequences 2k (chosen) and 2k+1 (rejected) of a micro-batch form pair k (the backend keeps them
// together: RLH_BATCH_KEEP_PAIRS). The reward of a sequence is the value head's output at its last
// token (RLH_OUTPUT_VALUE is unshifted: the last position scores the whole sequence, where HF's
// *ForSequenceClassification pools). With G = global_valid_seqs / 2 + 1e-8:
//   loss                  = sum_k -logsigmoid(r_2k - r_2k+1) sm_2k^2 / G
//   accuracy              = sum_k [r_2k > r_2k+1] sm_2k / G
//   rewards_chosen_mean   = sum_k r_2k sm_2k / G
//   rewards_rejected_mean = sum_k r_2k+1 sm_2k+1 / G
//   num_valid_samples     = sum_i sm_i / 2 (pairs in this call)
// (NeMo-RL multiplies the per-pair loss by the sample mask and takes its masked mean, hence the
// square; masks are 0/1 there.)
#pragma once

#include "rlhost/grpo/clipped_pg_loss.hpp"  // LossResult
#include "rlhost/grpo/packing.hpp"

namespace rlh::grpo {

// NeMo-RL's rm section holds no loss settings (its PreferenceLossFn takes none).
struct PreferenceConfig {};

struct PreferenceInputs {
  Packing packing;                      // num_seqs even: chosen, rejected, chosen, rejected, ...
  const double* values = nullptr;       // [num_tokens] value output, token-aligned, unshifted
  const double* sample_mask = nullptr;  // per sequence
  double global_valid_seqs = 0;         // sum of sample_mask over the global batch, both members
};

// Writes d loss / d values (non-zero at each sequence's last token only). Throws
// std::invalid_argument for an odd number of sequences or an empty sequence (it has no reward).
LossResult preference_loss(const PreferenceInputs& in, double* grad_values);

}  // namespace rlh::grpo
