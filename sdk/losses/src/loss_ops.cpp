// ClippedPGConfig <-> the clipped_pg_loss op's attributes (see loss_ops.hpp, docs/ops.md).
#include "rlhost/losses/loss_ops.hpp"

#include <cstring>

#include "rlhost/losses/config_error.hpp"

namespace rlh::losses {

namespace {

rlh_named_value num_attr(const char* name, double v) {
  rlh_named_value a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_named_value, size);
  a.name = name;
  a.type = RLH_VALUE_DOUBLE;
  a.double_value = v;
  return a;
}

// TruncatedIsType <-> the attribute tis_type: 0 none, 1 tis, 2 icepop, 3 seq-mask-tis.
double tis_code(const std::optional<TruncatedIsType>& t) {
  if (!t) return 0;
  switch (*t) {
    case TruncatedIsType::kTis: return 1;
    case TruncatedIsType::kIcePop: return 2;
    case TruncatedIsType::kSeqMaskTis: return 3;
  }
  return 0;
}

}  // namespace

bool clipped_pg_metric_reported(const ClippedPGConfig& cfg, size_t index) {
  const char* name = kClippedPgMetrics[index].name;
  if (std::strcmp(name, "is_oob_ratio") == 0) return cfg.truncated_importance_sampling_type.has_value();
  if (std::strncmp(name, "probs_ratio_clip_", 17) == 0)  // PPO / GSPO ratios only
    return !cfg.force_on_policy_ratio && !cfg.disable_ppo_ratio;
  return true;
}

std::vector<rlh_named_value> clipped_pg_attrs(const ClippedPGConfig& c, const LossCounts& n) {
  return {
      num_attr("global_valid_toks", n.valid_toks),
      num_attr("global_valid_seqs", n.valid_seqs),
      num_attr("global_positive_toks", n.positive_toks),
      num_attr("disable_ppo_ratio", c.disable_ppo_ratio),
      num_attr("token_level_loss", c.token_level_loss),
      num_attr("sequence_level_importance_ratios", c.sequence_level_importance_ratios),
      num_attr("ratio_clip_min", c.ratio_clip_min),
      num_attr("ratio_clip_max", c.ratio_clip_max),
      num_attr("ratio_clip_c", c.ratio_clip_c.value_or(0.0)),
      num_attr("kl_penalty", c.kl_coefficient()),
      num_attr("kl_type", double(int(c.reference_policy_kl_type) + 1)),
      num_attr("kl_input_clamp", c.kl_input_clamp_value.value_or(0.0)),
      num_attr("kl_output_clamp", c.kl_output_clamp_value.value_or(0.0)),
      num_attr("use_importance_sampling_correction", c.use_importance_sampling_correction),
      num_attr("tis_type", tis_code(c.truncated_importance_sampling_type)),
      num_attr("tis_ratio", c.truncated_importance_sampling_ratio.value_or(0.0)),
      num_attr("tis_ratio_min", c.truncated_importance_sampling_ratio_min.value_or(-1.0)),
      num_attr("use_on_policy_kl_approximation", c.use_on_policy_kl_approximation),
      num_attr("force_on_policy_ratio", c.force_on_policy_ratio),
      num_attr("use_cispo", c.use_cispo),
      num_attr("positive_example_nll_weight", c.positive_example_nll_weight),
      num_attr("constant_normalizer", c.constant_normalizer.value_or(0.0)),
  };
}

std::vector<rlh_named_value> nll_attrs(const LossCounts& n) {
  return {num_attr("global_valid_toks", n.valid_toks)};
}

ClippedPGConfig clipped_pg_config_from_attrs(const AttrReader& num, LossCounts* counts) {
  ClippedPGConfig c;
  if (counts) {
    counts->valid_toks = num("global_valid_toks", 0);
    counts->valid_seqs = num("global_valid_seqs", 0);
    counts->positive_toks = num("global_positive_toks", 0);
  }
  auto flag = [&](const char* n, bool d) { return num(n, d ? 1 : 0) != 0; };
  auto opt = [&](const char* n, const std::optional<double>& d, double off) -> std::optional<double> {
    const double v = num(n, d.value_or(off));
    if (v == off) return std::nullopt;
    return v;
  };
  c.disable_ppo_ratio = flag("disable_ppo_ratio", c.disable_ppo_ratio);
  c.token_level_loss = flag("token_level_loss", c.token_level_loss);
  c.sequence_level_importance_ratios = flag("sequence_level_importance_ratios", c.sequence_level_importance_ratios);
  c.ratio_clip_min = num("ratio_clip_min", c.ratio_clip_min);
  c.ratio_clip_max = num("ratio_clip_max", c.ratio_clip_max);
  c.ratio_clip_c = opt("ratio_clip_c", c.ratio_clip_c, 0.0);
  // kl_penalty is the coefficient the loss uses (0 with use_kl_in_reward).
  c.use_kl_in_reward = false;
  c.reference_policy_kl_penalty = num("kl_penalty", c.reference_policy_kl_penalty);
  const double kl_type = num("kl_type", 3);
  if (kl_type != 1 && kl_type != 2 && kl_type != 3)
    throw ConfigError("loss_fn.reference_policy_kl_type: attribute kl_type must be 1, 2 or 3 (k1, k2, k3)");
  c.reference_policy_kl_type = static_cast<KlType>(int(kl_type) - 1);
  c.kl_input_clamp_value = opt("kl_input_clamp", c.kl_input_clamp_value, 0.0);
  c.kl_output_clamp_value = opt("kl_output_clamp", c.kl_output_clamp_value, 0.0);
  c.use_importance_sampling_correction =
      flag("use_importance_sampling_correction", c.use_importance_sampling_correction);
  const double tis = num("tis_type", 0);
  if (tis == 1) c.truncated_importance_sampling_type = TruncatedIsType::kTis;
  else if (tis == 2) c.truncated_importance_sampling_type = TruncatedIsType::kIcePop;
  else if (tis == 3) c.truncated_importance_sampling_type = TruncatedIsType::kSeqMaskTis;
  else if (tis != 0)
    throw ConfigError("loss_fn.truncated_importance_sampling_type: attribute tis_type must be 0..3");
  c.truncated_importance_sampling_ratio = opt("tis_ratio", std::nullopt, 0.0);
  c.truncated_importance_sampling_ratio_min = opt("tis_ratio_min", std::nullopt, -1.0);
  c.use_on_policy_kl_approximation = flag("use_on_policy_kl_approximation", c.use_on_policy_kl_approximation);
  c.force_on_policy_ratio = flag("force_on_policy_ratio", c.force_on_policy_ratio);
  c.use_cispo = flag("use_cispo", c.use_cispo);
  c.positive_example_nll_weight = num("positive_example_nll_weight", c.positive_example_nll_weight);
  c.constant_normalizer = opt("constant_normalizer", std::nullopt, 0.0);
  c.validate();
  return c;
}

LossCounts nll_counts_from_attrs(const AttrReader& num) {
  LossCounts n;
  n.valid_toks = num("global_valid_toks", 0);
  return n;
}

}  // namespace rlh::losses
