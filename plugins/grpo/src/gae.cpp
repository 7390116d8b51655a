// NeMo-RL's GeneralizedAdvantageEstimator (see gae.hpp).
#include "rlhost/grpo/gae.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "json_read.hpp"

namespace rlh::grpo {

using detail::Section;

GaeConfig GaeConfig::from_json(const nlohmann::json& j, const ClippedPGConfig& loss, const std::string& where) {
  const Section s(j, where);
  GaeConfig c;
  std::string name = "gae";
  s.read("name", name);
  if (name != "gae")
    throw ConfigError(s.key("name") + ": \"" + name + "\" is not implemented for PPO; use \"gae\" (the critic's "
                      "returns need it; NeMo-RL's raw_reward trains no critic)");
  s.read("gae_gamma", c.gamma);
  s.read("gae_lambda", c.lambda);
  s.read("normalize_advantages", c.normalize_advantages);
  s.read("gae_lambda_value", c.lambda_value);
  s.read("gae_lambda_policy", c.lambda_policy);
  s.read("length_adaptive_alpha", c.length_adaptive_alpha);
  auto unit = [&](const char* k, double v) {
    if (!(v >= 0 && v <= 1)) throw ConfigError(s.key(k) + ": must be in [0, 1], got " + std::to_string(v));
  };
  unit("gae_gamma", c.gamma);
  unit("gae_lambda", c.lambda);
  if (c.lambda_value) unit("gae_lambda_value", *c.lambda_value);
  if (c.lambda_policy) unit("gae_lambda_policy", *c.lambda_policy);
  if (!(c.length_adaptive_alpha >= 0) || !std::isfinite(c.length_adaptive_alpha))
    throw ConfigError(s.key("length_adaptive_alpha") + ": must be >= 0 (0 = off)");
  c.use_kl_in_reward = loss.use_kl_in_reward;
  c.kl_coef = loss.reference_policy_kl_penalty;
  c.kl_type = loss.reference_policy_kl_type;
  return c;
}

namespace {

// One GAE pass over sequence [b, e) with carry-forward masking; lambda per sequence.
void gae_pass(const double* r, const double* v, const double* m, int64_t b, int64_t e, double gamma, double lam,
              double* adv) {
  double next_v = 0, last = 0;
  for (int64_t t = e - 1; t >= b; --t) {
    const double delta = r[t] + gamma * next_v - v[t];
    const double now = delta + gamma * lam * last;
    next_v = v[t] * m[t] + (1 - m[t]) * next_v;
    last = now * m[t] + (1 - m[t]) * last;
    adv[t] = last;
  }
}

}  // namespace

GaeResult gae(const GaeConfig& cfg, const GaeInputs& in) {
  validate(in.packing);
  if (in.rewards == nullptr || in.values == nullptr || in.token_mask == nullptr)
    throw std::invalid_argument("gae: missing rewards, values or token_mask");
  if (cfg.kl_in_reward() && (in.logprobs == nullptr || in.reference_logprobs == nullptr))
    throw std::invalid_argument("gae: the KL penalty in the reward needs logprobs and reference_logprobs");
  const int64_t n = in.packing.num_tokens, ns = in.packing.num_seqs;
  const int64_t* off = in.packing.seq_offsets;
  const double* m = in.token_mask;

  // Token-level rewards: -kl_coef * KL on every token, the reward at the last masked-in token,
  // then zero outside the mask.
  std::vector<double> r(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < ns; ++i) {
    for (int64_t t = off[i]; t < off[i + 1]; ++t)
      if (cfg.kl_in_reward())
        r[t] = -cfg.kl_coef * kl_token(cfg.kl_type, in.logprobs[t], in.reference_logprobs[t], 20.0, 10.0, 1.0, 0.0).value;
    for (int64_t t = off[i + 1] - 1; t >= off[i]; --t)
      if (m[t] != 0) {
        r[t] += in.rewards[i];
        break;
      }
    for (int64_t t = off[i]; t < off[i + 1]; ++t) r[t] *= m[t];
  }

  GaeResult out;
  out.advantages.assign(static_cast<size_t>(n), 0.0);
  out.returns.assign(static_cast<size_t>(n), 0.0);
  const bool decoupled = cfg.lambda_value || cfg.lambda_policy || cfg.length_adaptive_alpha > 0;
  const double lam_value = cfg.lambda_value.value_or(cfg.lambda);
  std::vector<double> tmp(decoupled ? static_cast<size_t>(n) : 0);
  for (int64_t i = 0; i < ns; ++i) {
    double lam_policy = cfg.lambda_policy.value_or(cfg.lambda);
    if (cfg.length_adaptive_alpha > 0) {
      double len = 0;
      for (int64_t t = off[i]; t < off[i + 1]; ++t) len += m[t];
      lam_policy = std::clamp(1.0 - 1.0 / std::max(cfg.length_adaptive_alpha * len, 1.0), 0.0, 1.0);
    }
    gae_pass(r.data(), in.values, m, off[i], off[i + 1], cfg.gamma, decoupled ? lam_value : cfg.lambda,
             out.returns.data());  // advantages with the value lambda, made returns below
    if (decoupled) gae_pass(r.data(), in.values, m, off[i], off[i + 1], cfg.gamma, lam_policy, out.advantages.data());
  }
  for (int64_t t = 0; t < n; ++t) {
    if (!decoupled) out.advantages[t] = out.returns[t];
    out.returns[t] += in.values[t];
  }

  if (cfg.normalize_advantages) {
    // NeMo-RL's _reward_whiten: masked_mean (sum / (count + 1e-8)) and the unbiased masked_var.
    double cnt = 0, sum = 0;
    for (int64_t t = 0; t < n; ++t) {
      cnt += m[t];
      sum += out.advantages[t] * m[t];
    }
    const double mean = sum / (cnt + 1e-8);
    double sq = 0;
    for (int64_t t = 0; t < n; ++t) sq += (out.advantages[t] - mean) * (out.advantages[t] - mean) * m[t];
    // One masked-in token has no unbiased variance (NeMo-RL divides by zero); it whitens to 0.
    const double var = cnt > 1 ? sq / (cnt + 1e-8) * (cnt / (cnt - 1)) : 0.0;
    const double rstd = 1.0 / std::sqrt(var + 1e-8);
    for (int64_t t = 0; t < n; ++t) out.advantages[t] = (out.advantages[t] - mean) * rstd;
  }
  for (int64_t t = 0; t < n; ++t)
    if (m[t] == 0) out.advantages[t] = 0;
  return out;
}

}  // namespace rlh::grpo
