// NeMo-RL's DPOLossFn: preference loss on (chosen, rejected) pairs plus an optional SFT term.
//
// Sequences 2k (chosen) and 2k+1 (rejected) of a micro-batch form pair k (the backend keeps them
// together: RLH_BATCH_KEEP_PAIRS). With r_i = sum_t token_mask[t+1] (lp - lp_ref)[t] (divided by
// max(sum token_mask, 1) with preference_average_log_probs) and G = global_valid_seqs / 2:
//   preference_loss = sum_k -logsigmoid(beta (r_2k - r_2k+1)) sm_2k^2 / (G + 1e-8)
//   sft_loss        = sum_k nll_2k sm_2k / (G + 1e-8)   (per-sample NLL of the chosen response)
//   loss            = preference_loss_weight * preference_loss + sft_loss_weight * sft_loss
// reference_policy_logprobs is a token-frame field like every other (entry t = log p_ref(token t));
// NeMo-RL's DPO rolls it left by one, which is the same pairing.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include "rlhost/grpo/clipped_pg_loss.hpp"  // LossResult
#include "rlhost/grpo/packing.hpp"

namespace rlh::grpo {

// NeMo-RL's DPOLossConfig (the `dpo` section), with its defaults.
struct DpoConfig {
  double reference_policy_kl_penalty = 0.05;  // beta
  double preference_loss_weight = 1.0;
  double sft_loss_weight = 0.0;
  bool preference_average_log_probs = false;
  bool sft_average_log_probs = false;

  static DpoConfig from_json(const nlohmann::json& dpo);
};

struct DpoInputs {
  Packing packing;  // num_seqs even: chosen, rejected, chosen, rejected, ...
  const double* logprobs = nullptr;                   // output frame, differentiated
  const double* reference_policy_logprobs = nullptr;  // token frame
  const double* token_mask = nullptr;                 // token frame
  const double* sample_mask = nullptr;                // per sequence
  double global_valid_seqs = 0;                       // sum of sample_mask, both members
};

// Metrics: loss, sft_loss, preference_loss, accuracy, rewards_chosen_mean,
// rewards_rejected_mean, num_valid_samples (pairs in this call).
LossResult dpo_loss(const DpoConfig& cfg, const DpoInputs& in, double* grad_logprobs);

}  // namespace rlh::grpo
