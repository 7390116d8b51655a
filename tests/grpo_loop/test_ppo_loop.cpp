// The ppo algorithm plugin end to end through librlhost with the real plugins (label grpo): PPO
// learns a task single-turn GRPO cannot (one response per prompt: GRPO's group baseline is the
// reward itself, so every advantage is 0, while PPO's critic learns a baseline across prompts),
// step_N/ checkpoints hold the policy and the critic and resume bitwise, bad inputs stop with
// one line naming them, and NeMo-RL's own ppo_math_1B.yaml resolves with the plugins and runs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "preference_fixture.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace {

using namespace rlh_test;  // have, code_of, read_file, read_metrics, Metrics, kPlugins

const char* const kPluginNames[] = {"ppo",          "grpo",        "environments", "dataset_jsonl", "tokenizer_hf",
                                    "model_llama", "kernels_cpu", "generator",    "dtensor"};
constexpr rlh_code kAnyError = rlh_code(-1);

struct Ppo : ::testing::Test {
  void SetUp() override {
    for (const char* p : kPluginNames)
      if (!have(p)) GTEST_SKIP() << "plugin '" << p << "' is not built";
    dir = fs::temp_directory_path() / ("rlh_ppo_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    const std::string cmd = std::string(RLH_TINY_MODEL) + " " + (dir / "model").string() +
                            " --alphabet '0123456789=' --seed 11 > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    // "abcd" -> "d": repeat the last digit. Every training prompt is distinct, so with one
    // response per prompt each of GRPO's prompt groups holds one sample. One guess in ten is right
    // before training.
    uint64_t s = 777;
    auto next = [&] {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      return int((s >> 33) % 10);
    };
    std::set<std::string> seen;
    for (const char* split : {"train", "val"}) {
      std::ofstream f(dir / (std::string(split) + ".jsonl"));
      for (int i = 0; i < (std::string(split) == "train" ? 4096 : 128);) {
        std::string p;
        for (int k = 0; k < 4; ++k) p += std::to_string(next());
        if (!seen.insert(p).second) continue;
        f << json{{"input", p}, {"output", p.substr(3)}}.dump() << "\n";
        ++i;
      }
    }
  }
  void TearDown() override {
    if (!dir.empty()) fs::remove_all(dir);
  }

  // The run's configuration in NeMo-RL's layout under `section` (grpo or ppo).
  std::string yaml(const std::string& section) const {
    std::string y = section + R"(:
  num_prompts_per_step: 64
  num_generations_per_prompt: 1
  max_rollout_turns: 1
  max_num_epochs: 1
  max_num_steps: 30
  val_period: 10
  val_at_start: true
  val_at_end: true
  max_val_samples: 128
  val_batch_size: 128
  seed: 3
)";
    if (section == "grpo") {
      y += "  normalize_rewards: true\n  use_leave_one_out_baseline: false\n";
    } else {
      y += R"(  ppo_epochs: 4
  policy_training_start_step: 0
  adv_estimator:
    name: gae
    gae_lambda: 0.95
    gae_gamma: 1.0
    normalize_advantages: true
value:
  train_micro_batch_size: 256
  reward_model_cfg:
    enabled: true
    reward_model_type: regression
  optimizer:
    name: "torch.optim.AdamW"
    kwargs:
      lr: 1.0e-2
      weight_decay: 0.0
      betas: [0.9, 0.999]
      eps: 1.0e-8
value_loss_fn:
  scale: 1.0
  cliprange: 0.2
)";
    }
    y += R"(loss_fn:
  reference_policy_kl_penalty: 0.0
  ratio_clip_min: 0.2
  ratio_clip_max: 0.2
  token_level_loss: true
checkpointing:
  enabled: false
policy:
  model_name: ")" + (dir / "model").string() + R"("
  tokenizer:
    chat_template: null
  train_micro_batch_size: 256
  logprob_batch_size: 256
  max_total_sequence_length: 10
  precision: "float32"
  max_grad_norm: 1.0
  dtensor_cfg:
    enabled: true
  optimizer:
    name: "torch.optim.AdamW"
    kwargs:
      lr: 1.0e-3
      weight_decay: 0.0
      betas: [0.9, 0.999]
      eps: 1.0e-8
  generation:
    backend: "native"
    max_new_tokens: 1
    temperature: 1.0
    top_p: 1.0
    top_k: null
    val_temperature: 0.0
    stop_token_ids: null
    stop_strings: null
data:
  shuffle: true
  train:
    data_path: ")" + (dir / "train.jsonl").string() + R"("
  validation:
    data_path: ")" + (dir / "val.jsonl").string() + R"("
env:
  reveal: {}
logger:
  log_dir: ")" + (dir / "logs").string() + R"("
  console_enabled: false
cluster:
  gpus_per_node: 0
  num_nodes: 1
)";
    return y;
  }

  rlhost_t* host(const std::string& algorithm, const fs::path& config, const std::vector<std::string>& overrides) {
    rlhost_t* h = nullptr;
    EXPECT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR + 1);
    for (const char* p : kPluginNames) {
      if ((std::string(p) == "ppo" || std::string(p) == "grpo") && p != algorithm) continue;
      EXPECT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + std::string(p) + ".so")).c_str())), RLH_OK) << p;
    }
    std::string msg;
    EXPECT_EQ(code_of(rlhost_load_config(h, config.c_str()), &msg), RLH_OK) << msg;
    for (const auto& o : overrides) EXPECT_EQ(code_of(rlhost_apply_override(h, o.c_str()), &msg), RLH_OK) << o << ": " << msg;
    return h;
  }

  Metrics run(const std::string& algorithm, const std::vector<std::string>& overrides = {}, rlh_code want = RLH_OK,
              std::string* error = nullptr) {
    const fs::path file = dir / (algorithm + ".yaml");
    std::ofstream(file) << yaml(algorithm);
    return run_file(algorithm, file, overrides, want, error);
  }

  Metrics run_file(const std::string& algorithm, const fs::path& file, const std::vector<std::string>& overrides,
                   rlh_code want = RLH_OK, std::string* error = nullptr) {
    rlhost_t* h = host(algorithm, file, overrides);
    std::string msg;
    const rlh_code c = code_of(rlhost_run(h), &msg);
    if (want == kAnyError) {
      EXPECT_NE(c, RLH_OK) << "the run did not fail";
    } else {
      EXPECT_EQ(c, want) << msg;
    }
    if (error != nullptr) *error = msg;
    Metrics out = read_metrics(h);
    rlhost_destroy(h);
    return out;
  }

  fs::path dir;
};

TEST_F(Ppo, LearnsWithOneResponsePerPromptWhereGrpoCannot) {
  Metrics grpo = run("grpo");
  Metrics ppo = run("ppo");
  const auto& g = grpo["validation/accuracy"];
  const auto& p = ppo["validation/accuracy"];
  std::printf("validation accuracy (greedy, 128 held-out rows), one response per prompt\n"
              "  step   grpo    ppo   ppo critic/explained_var  critic/loss\n");
  for (const auto& [step, a] : p) {
    auto at = [&](const char* k) {
      return ppo[k].count(step) ? ppo[k].at(step) : std::nan("");
    };
    std::printf("  %4lld  %5.3f  %5.3f  %12.3f  %17.4f\n", static_cast<long long>(step), g.count(step) ? g.at(step) : -1.0,
                a, at("train/critic/explained_var"), at("train/critic/loss"));
  }
  ASSERT_FALSE(g.empty());
  ASSERT_FALSE(p.empty());
  // GRPO: with one response per prompt every advantage is 0, so the policy never moves.
  for (const auto& [step, a] : g) EXPECT_EQ(a, g.begin()->second) << "grpo moved at step " << step;
  ASSERT_EQ(grpo["train/loss"].size(), 30u);
  for (const auto& [step, loss] : grpo["train/loss"]) EXPECT_EQ(loss, 0.0) << "grpo's loss at step " << step;
  EXPECT_LE(g.begin()->second, 0.3);
  // PPO: the critic's baseline gives the sampled digit a signed advantage.
  EXPECT_LE(p.begin()->second, 0.3) << "the untrained policy already copies";
  EXPECT_GE(p.rbegin()->second, 0.9) << "ppo did not learn to copy";
  // The metrics under NeMo-RL's names.
  for (const char* k : {"train/critic/loss", "train/critic/grad_norm", "train/critic/explained_var",
                        "train/critic/vf_clipfrac", "train/critic/values_mean", "train/critic/returns_mean",
                        "train/critic/values_min", "train/critic/values_max", "train/advantages/mean",
                        "train/advantages/max", "train/advantages/min", "train/loss", "train/reward"})
    EXPECT_TRUE(ppo.count(k) && ppo[k].count(30)) << k;
  // The critic fits the returns: its loss falls. (Its explained variance is NeMo-RL's formula,
  // which divides by the returns' variance: near 0 once every response is right.)
  EXPECT_LT(ppo["train/critic/loss"][30], ppo["train/critic/loss"][1]);
}

// 4 steps straight against 2, then a resume to 4: steps 3-4 log the same policy and critic
// losses, and step 4's policy and critic (value/) safetensors are bitwise equal.
TEST_F(Ppo, ResumesBitwiseWithTheCritic) {
  auto with = [&](const std::string& ck, int steps) {
    return std::vector<std::string>{"ppo.max_num_steps=" + std::to_string(steps), "ppo.num_prompts_per_step=16",
                                    "ppo.val_at_start=false", "ppo.val_period=0", "ppo.val_at_end=false",
                                    "checkpointing.enabled=true", "++checkpointing.save_period=2",
                                    "++checkpointing.keep_top_k=null", "++checkpointing.metric_name=null",
                                    "++checkpointing.checkpoint_dir=" + (dir / ck).string()};
  };
  Metrics straight = run("ppo", with("straight", 4));
  run("ppo", with("resumed", 2));
  ASSERT_TRUE(fs::exists(dir / "resumed/step_2/value"));
  Metrics second = run("ppo", with("resumed", 4));
  EXPECT_FALSE(second["train/loss"].count(1)) << "the resumed run started over";
  for (int64_t s : {3, 4})
    for (const char* k : {"train/loss", "train/critic/loss", "train/critic/explained_var", "train/reward"}) {
      ASSERT_TRUE(straight[k].count(s) && second[k].count(s)) << k << " at step " << s;
      EXPECT_EQ(second[k][s], straight[k][s]) << k << " at step " << s;
    }
  size_t compared = 0;
  for (const char* part : {"policy", "value"}) {
    const fs::path a = dir / "straight/step_4" / part, b = dir / "resumed/step_4" / part;
    for (const auto& e : fs::recursive_directory_iterator(a)) {
      if (!e.is_regular_file() || e.path().extension() != ".safetensors") continue;
      EXPECT_TRUE(read_file(e.path()) == read_file(b / fs::relative(e.path(), a))) << "differs: " << e.path();
      ++compared;
    }
  }
  EXPECT_GE(compared, 2u);
  // The critic is saved as an HF value model (score.weight) with its config.
  const json cfg = json::parse(read_file(dir / "straight/step_4/value/config.json"));
  EXPECT_NE(cfg.dump().find("ForSequenceClassification"), std::string::npos) << cfg.dump();
  EXPECT_NE(read_file(dir / "straight/step_4/value/model.safetensors").find("score.weight"), std::string::npos);
}

// policy_training_start_step: the critic trains alone for the first steps (the policy, and so
// the greedy validation, stay as they were); the KL penalty in the reward loads the reference and
// puts -coef * KL on every token (the advantages move with the coefficient).
TEST_F(Ppo, CriticWarmupAndKlInTheReward) {
  const std::vector<std::string> common = {"ppo.num_prompts_per_step=16", "ppo.val_period=0", "ppo.val_at_start=true",
                                           "ppo.val_at_end=true"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), common.begin(), common.end());
    return v;
  };
  Metrics warm = run("ppo", with({"ppo.max_num_steps=3", "ppo.policy_training_start_step=3"}));
  EXPECT_EQ(warm["validation/accuracy"].at(3), warm["validation/accuracy"].at(0));
  EXPECT_TRUE(warm["train/loss"].empty()) << "the policy trained during the critic's warm-up";
  EXPECT_EQ(warm["train/critic/loss"].size(), 3u);
  Metrics trained = run("ppo", with({"ppo.max_num_steps=3"}));
  EXPECT_EQ(trained["train/loss"].size(), 3u);
  EXPECT_NE(trained["validation/accuracy"].at(3), trained["validation/accuracy"].at(0));

  const std::vector<std::string> kl = {"ppo.max_num_steps=2", "++loss_fn.use_kl_in_reward=true",
                                       "ppo.adv_estimator.normalize_advantages=false"};
  auto with_coef = [&](const std::string& c) {
    std::vector<std::string> v = with(kl);
    v.push_back("loss_fn.reference_policy_kl_penalty=" + c);
    return v;
  };
  Metrics none = run("ppo", with_coef("0.0")), some = run("ppo", with_coef("0.5"));
  // Step 1: the policy is the reference, KL = 0, the same advantages; step 2: the policy has
  // moved, so the penalty lowers the mean advantage.
  EXPECT_EQ(some["train/advantages/mean"].at(1), none["train/advantages/mean"].at(1));
  EXPECT_LT(some["train/advantages/mean"].at(2), none["train/advantages/mean"].at(2));
}

TEST_F(Ppo, BadInputsStopWithOneLineNamingThem) {
  struct Case {
    std::vector<std::string> overrides;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{"value.reward_model_cfg.enabled=false"}, "value.reward_model_cfg.enabled"},
      {{"value.reward_model_cfg.reward_model_type=bradley_terry"}, "value.reward_model_cfg.reward_model_type"},
      {{"ppo.adv_estimator.name=raw_reward"}, "ppo.adv_estimator.name"},
      {{"ppo.adv_estimator.gae_lambda=1.5"}, "ppo.adv_estimator.gae_lambda"},
      {{"value_loss_fn.cliprange=-0.5"}, "value_loss_fn.cliprange"},
      {{"ppo.ppo_epochs=0"}, "ppo.ppo_epochs"},
      {{"++value.model_name=" + (dir / "missing").string()}, "value.model_name"},
      {{"++value.tokenizer.name=/elsewhere"}, "value.tokenizer.name"},
      {{"++value.megatron_cfg.enabled=true"}, "value.megatron_cfg.enabled"},
      {{"++ppo.use_dynamic_sampling=true"}, "ppo.use_dynamic_sampling"},
      {{"++value_loss_fn.clip_range=0.2"}, "value_loss_fn.clip_range"},
      {{"++ppo.gae_lambda=0.9"}, "ppo.gae_lambda"},
      {{"++ppo.skip_reference_policy_logprobs_calculation=true", "loss_fn.reference_policy_kl_penalty=0.1"},
       "ppo.skip_reference_policy_logprobs_calculation"},
      // Every sample's mean exp|logprob error| is >= 1: nothing is left to train on (NeMo-RL's
      // PPO stops rather than step on an empty batch).
      {{"++ppo.seq_logprob_error_threshold=0.5"}, "ppo.seq_logprob_error_threshold"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> o = c.overrides;
    o.push_back("ppo.max_num_steps=1");
    std::string msg;
    run("ppo", o, kAnyError, &msg);  // any failure; the message is checked below
    std::printf("  %s -> %s\n", c.overrides[0].c_str(), msg.c_str());
    EXPECT_NE(msg.find(c.want), std::string::npos) << c.overrides[0] << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

}  // namespace

namespace {

// NeMo-RL's own ppo_math_1B.yaml (every copied version) passes the key check with the ppo plugin
// and its components: each key is honoured or refused by name. Then v0.7.0's file runs two PPO
// steps on the tiny model with only its model, data, sizes and precision overridden.
TEST_F(Ppo, NemoRlsPpoMath1BResolvesAndRuns) {
  int checked = 0;
  for (const char* ref : {"v0.3.0", "v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0", "main"}) {
    const fs::path file = fs::path(RLH_SOURCE_DIR) / "tests/host/nemo_rl_configs" / ref / "examples/configs/ppo_math_1B.yaml";
    if (!fs::exists(file)) continue;
    rlhost_t* h = host("ppo", file, {});
    std::string msg;
    EXPECT_EQ(code_of(rlhost_resolve_config(h, nullptr, nullptr), &msg), RLH_OK) << ref << ": " << msg;
    rlhost_destroy(h);
    ++checked;
  }
  EXPECT_GE(checked, 2);
  const fs::path file = fs::path(RLH_SOURCE_DIR) / "tests/host/nemo_rl_configs/v0.7.0/examples/configs/ppo_math_1B.yaml";
  const std::vector<std::string> o = {
      "ppo.num_prompts_per_step=8", "ppo.num_generations_per_prompt=2", "ppo.max_num_steps=2", "ppo.val_period=2",
      "ppo.max_val_samples=16", "ppo.val_batch_size=16", "ppo.reward_shaping.max_response_length=4",
      "ppo.reward_shaping.overlong_buffer_length=2", "policy.model_name=" + (dir / "model").string(),
      "policy.train_global_batch_size=16", "policy.max_total_sequence_length=8", "policy.precision=float32",
      "value.precision=float32", "policy.generation.max_new_tokens=2", "++policy.tokenizer.chat_template=null",
      "data.train.dataset_name=null", "++data.train.data_path=" + (dir / "train.jsonl").string(),
      "data.validation.dataset_name=null", "++data.validation.data_path=" + (dir / "val.jsonl").string(),
      "data.default.env_name=reveal", "++env.reveal={}", "checkpointing.checkpoint_dir=" + (dir / "ckpt").string(),
      "logger.log_dir=" + (dir / "logs").string()};
  Metrics m = run_file("ppo", file, o);
  EXPECT_TRUE(m["train/critic/loss"].count(2));
  EXPECT_TRUE(m["validation/accuracy"].count(2));
  EXPECT_TRUE(fs::exists(dir / "ckpt/step_2/value/model.safetensors"));
}

}  // namespace
