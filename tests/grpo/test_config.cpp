// loss_fn / dpo config reading: NeMo-RL's defaults, types, and its assertions as one-line errors.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/config.hpp"
#include "rlhost/grpo/dpo_loss.hpp"

namespace rlh::grpo {
namespace {

using nlohmann::json;

// The message of the ConfigError `fn` throws ("" if none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(ClippedPGConfig, DefaultsAreNeMoRls) {
  for (const ClippedPGConfig& c :
       {ClippedPGConfig{}, clipped_pg_config_from_json(json::object()),
        clipped_pg_config_from_json(json())}) {
    EXPECT_FALSE(c.disable_ppo_ratio);
    EXPECT_TRUE(c.token_level_loss);
    EXPECT_FALSE(c.sequence_level_importance_ratios);
    EXPECT_EQ(c.ratio_clip_min, 0.2);
    EXPECT_EQ(c.ratio_clip_max, 0.2);
    EXPECT_FALSE(c.ratio_clip_c.has_value());
    EXPECT_EQ(c.reference_policy_kl_penalty, 0.01);
    EXPECT_EQ(c.reference_policy_kl_type, KlType::kK3);
    EXPECT_EQ(c.kl_input_clamp_value, 20.0);
    EXPECT_EQ(c.kl_output_clamp_value, 10.0);
    EXPECT_FALSE(c.use_kl_in_reward);
    EXPECT_FALSE(c.use_importance_sampling_correction);
    EXPECT_FALSE(c.truncated_importance_sampling_type.has_value());
    EXPECT_FALSE(c.truncated_importance_sampling_ratio.has_value());
    EXPECT_FALSE(c.truncated_importance_sampling_ratio_min.has_value());
    EXPECT_FALSE(c.use_on_policy_kl_approximation);
    EXPECT_FALSE(c.force_on_policy_ratio);
    EXPECT_FALSE(c.use_cispo);
    EXPECT_EQ(c.positive_example_nll_weight, 0.0);
    EXPECT_FALSE(c.constant_normalizer.has_value());
  }
}

TEST(ClippedPGConfig, ReadsTheGrpoMath1BSection) {
  // examples/configs/grpo_math_1B.yaml's loss_fn, as the config tree hands it over.
  const json j = json::parse(R"({
    "reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k3",
    "kl_input_clamp_value": 20.0, "kl_output_clamp_value": 10.0,
    "ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": null,
    "use_on_policy_kl_approximation": false, "use_importance_sampling_correction": true,
    "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 5,
    "truncated_importance_sampling_ratio_min": 0.5, "sequence_level_importance_ratios": false,
    "token_level_loss": true, "force_on_policy_ratio": false, "use_kl_in_reward": false,
    "use_cispo": false, "disable_ppo_ratio": false, "positive_example_nll_weight": 0.0,
    "some_future_key": [1, 2]})");
  const ClippedPGConfig c = clipped_pg_config_from_json(j);
  EXPECT_EQ(c.ratio_clip_max, 0.28);
  EXPECT_EQ(c.truncated_importance_sampling_type, TruncatedIsType::kIcePop);
  EXPECT_EQ(c.truncated_importance_sampling_ratio, 5.0);  // an integer is a number
  EXPECT_EQ(c.truncated_importance_sampling_ratio_min, 0.5);
  EXPECT_TRUE(c.use_importance_sampling_correction);
  const ClippedPGConfig nulls = clipped_pg_config_from_json(
      json{{"kl_input_clamp_value", nullptr}, {"kl_output_clamp_value", nullptr},
           {"reference_policy_kl_type", "k1"}, {"constant_normalizer", 4096}});
  EXPECT_FALSE(nulls.kl_input_clamp_value);
  EXPECT_FALSE(nulls.kl_output_clamp_value);
  EXPECT_EQ(nulls.reference_policy_kl_type, KlType::kK1);
  EXPECT_EQ(nulls.constant_normalizer, 4096.0);
}

TEST(ClippedPGConfig, WrongTypesNameTheKey) {
  EXPECT_EQ(error_of([] { clipped_pg_config_from_json(json{{"ratio_clip_min", "0.2"}}); }),
            "loss_fn.ratio_clip_min: expected a number, got string \"0.2\"");
  EXPECT_EQ(error_of([] { clipped_pg_config_from_json(json{{"token_level_loss", 1}}); }),
            "loss_fn.token_level_loss: expected true or false, got number 1");
  EXPECT_EQ(error_of([] { clipped_pg_config_from_json(json{{"ratio_clip_max", nullptr}}); }),
            "loss_fn.ratio_clip_max: expected a number, got null");
  EXPECT_EQ(error_of([] { clipped_pg_config_from_json(json{{"reference_policy_kl_type", "k4"}}); }),
            "loss_fn.reference_policy_kl_type: expected \"k1\", \"k2\" or \"k3\", got \"k4\"");
  EXPECT_EQ(error_of([] {
              clipped_pg_config_from_json(json{{"use_importance_sampling_correction", true},
                                              {"truncated_importance_sampling_type", "clip"},
                                              {"truncated_importance_sampling_ratio", 2}});
            }),
            "loss_fn.truncated_importance_sampling_type: must be 'tis', 'icepop', or "
            "'seq-mask-tis', got 'clip'");
  EXPECT_EQ(error_of([] { clipped_pg_config_from_json(json::array()); }),
            "loss_fn: expected a mapping, got array []");
}

struct BadCombo {
  const char* name;
  json cfg;
  const char* message_part;
};

TEST(ClippedPGConfig, NeMoRlAssertionsAreOneLineErrors) {
  const BadCombo cases[] = {
      {"gspo_token_level", json{{"sequence_level_importance_ratios", true}},
       "mutually exclusive with token_level_loss"},
      {"cispo_reinforce", json{{"use_cispo", true}, {"disable_ppo_ratio", true}},
       "use_cispo is incompatible with disable_ppo_ratio"},
      {"cispo_force", json{{"use_cispo", true}, {"force_on_policy_ratio", true}},
       "use_cispo is incompatible with force_on_policy_ratio"},
      {"cispo_gspo",
       json{{"use_cispo", true}, {"sequence_level_importance_ratios", true}, {"token_level_loss", false}},
       "use_cispo is incompatible with sequence_level_importance_ratios"},
      {"cispo_dual", json{{"use_cispo", true}, {"ratio_clip_c", 3}},
       "use_cispo is incompatible with dual clipping"},
      {"cispo_seq_level", json{{"use_cispo", true}, {"token_level_loss", false}},
       "use_cispo requires token_level_loss=true"},
      {"dual_clip_not_above_one", json{{"ratio_clip_c", 1.0}}, "ratio_clip_c must exceed 1"},
      {"tis_without_is",
       json{{"truncated_importance_sampling_type", "tis"}, {"truncated_importance_sampling_ratio", 2}},
       "only supported when use_importance_sampling_correction is true"},
      {"tis_without_ratio",
       json{{"use_importance_sampling_correction", true}, {"truncated_importance_sampling_type", "tis"}},
       "truncated_importance_sampling_ratio should be positive"},
      {"tis_min_above_max",
       json{{"use_importance_sampling_correction", true},
            {"truncated_importance_sampling_type", "tis"},
            {"truncated_importance_sampling_ratio", 2},
            {"truncated_importance_sampling_ratio_min", 3}},
       "truncated_importance_sampling_ratio_min must be <="},
      {"icepop_without_min",
       json{{"use_importance_sampling_correction", true},
            {"truncated_importance_sampling_type", "icepop"},
            {"truncated_importance_sampling_ratio", 2}},
       "truncated_importance_sampling_ratio_min should be set"},
      {"seq_mask_tis_gspo",
       json{{"use_importance_sampling_correction", true},
            {"truncated_importance_sampling_type", "seq-mask-tis"},
            {"truncated_importance_sampling_ratio", 2},
            {"truncated_importance_sampling_ratio_min", 0.5},
            {"sequence_level_importance_ratios", true},
            {"token_level_loss", false}},
       "seq-mask-tis uses token-level IS correction"},
      {"ratio_without_type", json{{"truncated_importance_sampling_ratio", 2}},
       "truncated_importance_sampling_type is null"},
      {"dr_grpo_sequence_level", json{{"constant_normalizer", 1024}, {"token_level_loss", false}},
       "constant_normalizer (Dr.GRPO) requires token_level_loss=true"},
      {"dr_grpo_nonpositive", json{{"constant_normalizer", 0}}, "constant_normalizer must be positive"},
  };
  for (const BadCombo& c : cases) {
    const std::string msg = error_of([&] { clipped_pg_config_from_json(c.cfg); });
    EXPECT_NE(msg.find(c.message_part), std::string::npos) << c.name << ": " << msg;
    EXPECT_EQ(msg.rfind("loss_fn: ", 0), 0u) << c.name << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << c.name;
  }
}

TEST(DpoConfig, DefaultsAndTypes) {
  const DpoConfig d = DpoConfig::from_json(json::object());
  EXPECT_EQ(d.reference_policy_kl_penalty, 0.05);
  EXPECT_EQ(d.preference_loss_weight, 1.0);
  EXPECT_EQ(d.sft_loss_weight, 0.0);
  EXPECT_FALSE(d.preference_average_log_probs);
  EXPECT_FALSE(d.sft_average_log_probs);
  const DpoConfig e = DpoConfig::from_json(
      json{{"reference_policy_kl_penalty", 0.1}, {"preference_average_log_probs", true},
           {"max_num_epochs", 1}});
  EXPECT_EQ(e.reference_policy_kl_penalty, 0.1);
  EXPECT_TRUE(e.preference_average_log_probs);
  EXPECT_EQ(error_of([] { DpoConfig::from_json(json{{"sft_loss_weight", true}}); }),
            "dpo.sft_loss_weight: expected a number, got boolean true");
}

}  // namespace
}  // namespace rlh::grpo
