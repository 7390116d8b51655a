// Reads NeMo-RL's loss_fn section into the SDK loss library's ClippedPGConfig (see
// clipped_pg_loss.hpp); the math itself lives in sdk/losses.
#include <optional>
#include <string>

#include "json_read.hpp"
#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/config.hpp"
#include "rlhost/grpo/kl.hpp"

namespace rlh::grpo {

ClippedPGConfig clipped_pg_config_from_json(const nlohmann::json& loss_fn) {
  detail::Section s(loss_fn, "loss_fn");
  ClippedPGConfig c;
  s.read("disable_ppo_ratio", c.disable_ppo_ratio);
  s.read("token_level_loss", c.token_level_loss);
  s.read("sequence_level_importance_ratios", c.sequence_level_importance_ratios);
  s.read("ratio_clip_min", c.ratio_clip_min);
  s.read("ratio_clip_max", c.ratio_clip_max);
  s.read("ratio_clip_c", c.ratio_clip_c);
  s.read("reference_policy_kl_penalty", c.reference_policy_kl_penalty);
  std::string kl_type = kl_type_name(c.reference_policy_kl_type);
  s.read("reference_policy_kl_type", kl_type);
  c.reference_policy_kl_type = parse_kl_type(kl_type, s.key("reference_policy_kl_type"));
  s.read("kl_input_clamp_value", c.kl_input_clamp_value);
  s.read("kl_output_clamp_value", c.kl_output_clamp_value);
  s.read("use_kl_in_reward", c.use_kl_in_reward);
  s.read("use_importance_sampling_correction", c.use_importance_sampling_correction);
  std::optional<std::string> tis;
  s.read("truncated_importance_sampling_type", tis);
  if (tis) {
    if (*tis == "tis") {
      c.truncated_importance_sampling_type = TruncatedIsType::kTis;
    } else if (*tis == "icepop") {
      c.truncated_importance_sampling_type = TruncatedIsType::kIcePop;
    } else if (*tis == "seq-mask-tis") {
      c.truncated_importance_sampling_type = TruncatedIsType::kSeqMaskTis;
    } else {
      throw ConfigError(s.key("truncated_importance_sampling_type") +
                        ": must be 'tis', 'icepop', or 'seq-mask-tis', got '" + *tis + "'");
    }
  }
  s.read("truncated_importance_sampling_ratio", c.truncated_importance_sampling_ratio);
  s.read("truncated_importance_sampling_ratio_min", c.truncated_importance_sampling_ratio_min);
  s.read("use_on_policy_kl_approximation", c.use_on_policy_kl_approximation);
  s.read("force_on_policy_ratio", c.force_on_policy_ratio);
  s.read("use_cispo", c.use_cispo);
  s.read("positive_example_nll_weight", c.positive_example_nll_weight);
  s.read("constant_normalizer", c.constant_normalizer);
  c.validate();
  return c;
}

}  // namespace rlh::grpo
