// The `reward_model` environment (reward_model_env.cpp): a trained reward model's score of
// prompt + response, through the host's backend and tokenizer components.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/environment.h"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::environments {

class RewardModelEnv {
 public:
  // `cfg` is NeMo-RL's env.reward_model section. Loads the tokenizer and the model (frozen, as a
  // value model) on a dtensor backend instance of its own. Errors name the key.
  RewardModelEnv(const sdk::Host& host, const nlohmann::json& cfg);
  ~RewardModelEnv();
  RewardModelEnv(const RewardModelEnv&) = delete;
  RewardModelEnv& operator=(const RewardModelEnv&) = delete;

  // The reward of each prompt + response: the value at the last token of the two as NeMo-RL's
  // environment tokenizes them (its get_formatted_message_log with no chat template: each
  // tokenized on its own, BOS's text put before the prompt and EOS's after the response where
  // missing, trailing newlines aside).
  std::vector<double> score(const std::vector<std::string>& prompts, const std::vector<std::string>& responses);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The ENVIRONMENT table of `reward_model`: rewards ["reward"], single-turn.
extern const rlh_environment_api kRewardModelEnvApi;

}  // namespace rlh::environments
