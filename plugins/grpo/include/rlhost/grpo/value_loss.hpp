// NeMo-RL's MseValueLossFn (value_loss_fn: scale, cliprange): the critic's loss in PPO.
//
// Values are the critic's V(state before token t) in the token frame, i.e. the value head's
// output right-shifted by one within each sequence (NeMo-RL's right_shift_values: entry 0 is 0);
// the loss adapter does the shift and shifts the gradient back. With m = token_mask * sample_mask,
// N = global_valid_toks + 1e-8 (masked_mean's guard), R the returns and V_old the values the
// returns were computed with:
//   unclipped:  loss = 0.5 * scale * sum m (V - R)^2 / N
//   cliprange:  Vc = clamp(V, V_old - c, V_old + c)
//               loss = 0.5 * scale * sum m max((V - R)^2, (Vc - R)^2) / N
// (cliprange null or 0 = unclipped, as NeMo-RL's `if self.cliprange and self.cliprange > 0`).
// Gradients follow PyTorch autograd: torch.clamp passes the gradient on its closed interval,
// torch.max splits it evenly on ties.
// Metrics (kSum, each already / N so micro-batches sum to the batch's value, except
// values_min/values_max which are kMin/kMax): loss, vf_clipfrac (the fraction of masked-in
// tokens where the clipped term is the larger), returns_mean, values_mean, values_min,
// values_max, returns_sq_mean, residual_sq_mean, num_valid_samples (sequences in the call).
// explained_variance() combines the summed statistics as NeMo-RL's ppo.py does.
#pragma once

#include <optional>

#include <nlohmann/json.hpp>

#include "rlhost/grpo/clipped_pg_loss.hpp"  // LossResult
#include "rlhost/grpo/packing.hpp"

namespace rlh::grpo {

struct ValueLossConfig {
  double scale = 1.0;
  std::optional<double> cliprange;  // null / 0 = no clipping

  // value_loss_fn (NeMo-RL's MseValueLossConfig forbids other keys: so does this).
  static ValueLossConfig from_json(const nlohmann::json& section, const std::string& where = "value_loss_fn");
  bool clipped() const { return cliprange && *cliprange > 0; }
};

struct ValueLossInputs {
  Packing packing;
  const double* values = nullptr;      // token frame (shifted), the critic's current output
  const double* old_values = nullptr;  // token frame; read only when clipped
  const double* returns = nullptr;     // token frame
  const double* token_mask = nullptr;  // token frame
  const double* sample_mask = nullptr; // per sequence (null = all 1)
  double global_valid_toks = 0;
};

// Writes d loss / d values (token frame) into grad_values.
LossResult value_loss(const ValueLossConfig& cfg, const ValueLossInputs& in, double* grad_values);

// NeMo-RL's critic/explained_var from the summed metrics:
//   1 - (residual_sq_mean - (returns_mean - values_mean)^2) / max(returns_sq_mean - returns_mean^2, 1e-8)
double explained_variance(double returns_mean, double values_mean, double returns_sq_mean, double residual_sq_mean);

}  // namespace rlh::grpo
