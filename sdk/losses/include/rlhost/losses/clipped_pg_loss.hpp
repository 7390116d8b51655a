// NeMo-RL's ClippedPGLossFn: PPO/GRPO clipped surrogate with asymmetric and dual clip,
// token- or sequence-level reduction, KL to the reference policy (k1/k2/k3, clamps, on-policy
// approximation), off-policy importance-sampling correction (tis / icepop / seq-mask-tis), GSPO,
// CISPO, REINFORCE/RLOO, force_on_policy_ratio and VAPO's positive-example NLL — plus Dr.GRPO's
// constant normaliser, an rlhost option. docs/grpo-loss.md has every formula as implemented.
//
// The only differentiated input is the current policy's per-token logprob (and, when top-k/top-p
// filtering is on, its unfiltered twin used by the KL term); the call returns the loss of one
// micro-batch, d loss / d logprob for every output position, and the metrics.
#pragma once

#include <optional>

#include "rlhost/losses/kl.hpp"
#include "rlhost/losses/metrics.hpp"
#include "rlhost/losses/packing.hpp"

namespace rlh::losses {

enum class TruncatedIsType { kTis, kIcePop, kSeqMaskTis };
const char* truncated_is_name(TruncatedIsType t);  // "tis" | "icepop" | "seq-mask-tis"

// NeMo-RL's loss_fn section (ClippedPGLossConfig), with its defaults.
struct ClippedPGConfig {
  bool disable_ppo_ratio = false;
  bool token_level_loss = true;
  bool sequence_level_importance_ratios = false;
  double ratio_clip_min = 0.2;
  double ratio_clip_max = 0.2;
  std::optional<double> ratio_clip_c;  // dual clip, > 1; null = off
  double reference_policy_kl_penalty = 0.01;
  KlType reference_policy_kl_type = KlType::kK3;
  std::optional<double> kl_input_clamp_value = 20.0;
  std::optional<double> kl_output_clamp_value = 10.0;
  bool use_kl_in_reward = false;  // the KL goes into the reward: no KL term in the loss
  bool use_importance_sampling_correction = false;
  std::optional<TruncatedIsType> truncated_importance_sampling_type;
  std::optional<double> truncated_importance_sampling_ratio;
  std::optional<double> truncated_importance_sampling_ratio_min;
  bool use_on_policy_kl_approximation = false;
  bool force_on_policy_ratio = false;
  bool use_cispo = false;
  double positive_example_nll_weight = 0.0;
  // rlhost: Dr.GRPO's constant normaliser (loss_fn.constant_normalizer, e.g. the generation
  // budget). When set, the token-level reduction divides by global_valid_seqs * this constant
  // instead of global_valid_toks. Requires token_level_loss. null = off (NeMo-RL behaviour).
  std::optional<double> constant_normalizer;

  // NeMo-RL's assertions, as ConfigError.
  void validate() const;
  // The coefficient of the KL term in the loss (0 with use_kl_in_reward, as NeMo-RL sets it).
  double kl_coefficient() const { return use_kl_in_reward ? 0.0 : reference_policy_kl_penalty; }
  bool needs_prev_logprobs() const { return !force_on_policy_ratio; }
  bool needs_reference_logprobs() const { return kl_coefficient() != 0.0; }
};

// One micro-batch. Output-frame arrays have num_tokens entries (entry t = log p(token t+1)); the
// token-frame fields have num_tokens entries (entry t describes token t); see packing.hpp.
struct ClippedPGInputs {
  Packing packing;
  const double* logprobs = nullptr;             // output frame, differentiated
  const double* logprobs_unfiltered = nullptr;  // output frame, optional: the KL's input when
                                                // top-k/top-p filters `logprobs` (else logprobs)
  const double* advantages = nullptr;                 // token frame
  const double* prev_logprobs = nullptr;              // token frame; unused with force_on_policy
  const double* generation_logprobs = nullptr;        // token frame
  const double* reference_policy_logprobs = nullptr;  // token frame; needed when the KL is on
  const double* token_mask = nullptr;                 // token frame
  const double* sample_mask = nullptr;                // per sequence
  const double* rewards = nullptr;                    // per sequence; positive-example NLL only
  double global_valid_toks = 0;  // sum of token_mask[1:] * sample_mask over the global batch
  double global_valid_seqs = 0;  // sum of sample_mask over the global batch
  // Positive-example NLL normaliser. NeMo-RL divides by the number of valid tokens of reward>0
  // samples *in the current call*, which depends on micro-batching. > 0: use this global count
  // instead (micro-batch invariant); 0: NeMo-RL's per-call count.
  double global_positive_toks = 0;
};

struct LossResult {
  double loss = 0;
  Metrics metrics;
};

// The positive-example NLL's global normaliser for (a rank's share of) a batch: the valid tokens
// (token_mask[t+1] * sample_mask) of samples with reward > 0. Ranks sum it; see
// ClippedPGInputs::global_positive_toks.
double positive_valid_tokens(const Packing& p, const double* token_mask, const double* sample_mask,
                             const double* rewards);

// Computes the loss of one micro-batch. grad_logprobs [num_tokens] receives d loss / d logprobs
// (0 where an output enters no loss). When inputs.logprobs_unfiltered is set, the KL gradient
// goes to grad_logprobs_unfiltered [num_tokens] instead (required then). Throws
// std::invalid_argument on missing inputs or a malformed layout.
LossResult clipped_pg_loss(const ClippedPGConfig& cfg, const ClippedPGInputs& in,
                           double* grad_logprobs, double* grad_logprobs_unfiltered = nullptr);

}  // namespace rlh::losses
