// NeMo-RL's GeneralizedAdvantageEstimator (ppo.adv_estimator.name: gae) on a packed batch.
//
// Per sequence, in the token frame (packing.hpp: entry t describes token t), with m_t the
// token_mask (1 on generated tokens) and V_t the critic's value of the state before token t
// (the value head's output at t-1; see value_loss.hpp):
//   r_t   = m_t * ( -kl_coef * KL_t  [use_kl_in_reward]  + R * [t is the last m=1 token] )
//   delta = r_t + gamma * V_next - V_t
//   A_t   = delta + gamma * lambda * A_next
//   where V_next and A_next are carried forward from the next masked-in token (NeMo-RL's
//   carry-forward masking: prompt and observation tokens neither add a TD error nor break the
//   chain), both 0 past the sequence's last token.
//   returns_t = A_t + V_t (the critic's targets, before any whitening).
// KL_t is NeMo-RL's calculate_kl(prev_logprobs, reference_logprobs, kl_type) with its default
// clamps (input 20, output 10). Advantages are then optionally whitened over every masked-in
// token of the batch, (A - mean) / sqrt(var_unbiased + 1e-8) with masked_mean's 1e-8 guard, and
// set to 0 where m_t = 0.
// VAPO's decoupled lambdas: returns use gae_lambda_value, advantages gae_lambda_policy, or the
// length-adaptive lambda 1 - 1/(alpha * len) clamped to [0, 1] with len >= 1/alpha when
// length_adaptive_alpha > 0 (len = the sequence's masked-in tokens); null = gae_lambda.
#pragma once

#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/kl.hpp"
#include "rlhost/grpo/packing.hpp"

namespace rlh::grpo {

struct GaeConfig {
  double gamma = 1.0;   // gae_gamma
  double lambda = 0.95;  // gae_lambda
  bool normalize_advantages = true;
  std::optional<double> lambda_value, lambda_policy;
  double length_adaptive_alpha = 0.0;
  // From loss_fn: the KL penalty in the reward.
  bool use_kl_in_reward = false;
  double kl_coef = 0.0;
  KlType kl_type = KlType::kK3;

  // ppo.adv_estimator (name must be "gae") and loss_fn's KL settings; ConfigError names the key.
  static GaeConfig from_json(const nlohmann::json& adv_estimator, const ClippedPGConfig& loss,
                             const std::string& where = "ppo.adv_estimator");
  bool kl_in_reward() const { return use_kl_in_reward && kl_coef > 0; }
};

struct GaeInputs {
  Packing packing;
  const double* rewards = nullptr;     // per sequence (the scalar reward after scaling/shaping)
  const double* values = nullptr;      // token frame: V(state before token t), 0 at position 0
  const double* token_mask = nullptr;  // token frame
  // Token frame; read only when kl_in_reward().
  const double* logprobs = nullptr;
  const double* reference_logprobs = nullptr;
};

struct GaeResult {
  std::vector<double> advantages;  // token frame, 0 where token_mask is 0
  std::vector<double> returns;     // token frame (meaningful where token_mask is 1)
};

// Throws std::invalid_argument for missing inputs or a malformed packing.
GaeResult gae(const GaeConfig& cfg, const GaeInputs& in);

}  // namespace rlh::grpo
