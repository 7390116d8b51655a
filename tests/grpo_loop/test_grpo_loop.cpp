// The grpo algorithm plugin through librlhost with the real plugins: the key check accepts the
// demo configuration, bad values fail with the key named, a few-step run produces NeMo-RL's
// metrics and step_N/ checkpoints, and a run interrupted and resumed from its checkpoint ends
// with bitwise the same weights as the run straight through.
//
// Runs that need a backend and a generator skip (with the reason) when those plugins are not in
// the build's plugin folder.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/host.h"
#include "rlhost/sdk/checkpoint.hpp"
#include "rlhost/sdk/safetensors.hpp"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path kPlugins = RLH_PLUGIN_DIR;
const fs::path kDemoConfig = fs::path(RLH_SOURCE_DIR) / "examples/configs/grpo_demo_cpu.yaml";

bool have(const std::string& plugin) { return fs::exists(kPlugins / ("lib" + plugin + ".so")); }

// The host's metric lines (rlhost_read_metrics) as {name: {step: value}}.
std::map<std::string, std::map<int64_t, double>> metrics_of(const std::string& lines) {
  std::map<std::string, std::map<int64_t, double>> out;
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const json j = json::parse(line);
    // A min/max over no valid token is infinite, which JSON lines carry as null.
    if (j["value"].is_null()) continue;
    out[j["name"].get<std::string>()][j["step"].get<int64_t>()] = j["value"].get<double>();
  }
  return out;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Loop : ::testing::Test {
  void SetUp() override {
    dir = fs::temp_directory_path() / ("rlh_grpo_loop_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
    model = dir / "tiny_model";
    const std::string cmd = std::string(RLH_TINY_MODEL) + " " + model.string() +
                            " --alphabet '0123456789-=' --seed 3 > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  void TearDown() override { fs::remove_all(dir); }

  static rlh_code code_of(rlh_status* s, std::string* msg = nullptr) {
    rlh::sdk::StatusPtr p(s);
    if (msg != nullptr) *msg = rlh::sdk::status_message(s);
    return s != nullptr ? s->code : RLH_OK;
  }

  // A host with the plugins loaded and the demo config plus `overrides` applied.
  rlhost_t* make_host(const std::vector<std::string>& overrides, bool with_runtime) {
    rlhost_t* h = nullptr;
    EXPECT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, log_level);
    std::vector<std::string> plugins = {"grpo", "environments", "tokenizer_hf", "model_llama"};
    if (with_runtime) plugins.insert(plugins.end(), {"kernels_cpu", "dtensor", "generator"});
    for (const auto& p : plugins) {
      std::string msg;
      EXPECT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str()), &msg), RLH_OK)
          << p << ": " << msg;
    }
    std::string msg;
    EXPECT_EQ(code_of(rlhost_load_config(h, kDemoConfig.c_str()), &msg), RLH_OK) << msg;
    std::vector<std::string> all = {
        "policy.model_name=" + model.string(),
        "checkpointing.checkpoint_dir=" + (dir / "ckpt").string(),
        "logger.log_dir=" + (dir / "logs").string(),
        "++logger.console_enabled=false",
    };
    all.insert(all.end(), overrides.begin(), overrides.end());
    for (const auto& o : all) EXPECT_EQ(code_of(rlhost_apply_override(h, o.c_str()), &msg), RLH_OK) << o << ": " << msg;
    return h;
  }

  // Runs to completion; returns the metrics as {name: {step: value}}.
  std::map<std::string, std::map<int64_t, double>> run(const std::vector<std::string>& overrides) {
    rlhost_t* h = make_host(overrides, true);
    std::string msg;
    const rlh_code c = code_of(rlhost_run(h), &msg);
    EXPECT_EQ(c, RLH_OK) << msg;
    std::string lines;
    EXPECT_EQ(code_of(rlhost_read_metrics(h, rlh::sdk::write_to_string, &lines)), RLH_OK);
    rlhost_destroy(h);
    return metrics_of(lines);
  }

  void require_runtime() {
    for (const char* p : {"dtensor", "generator", "kernels_cpu"})
      if (!have(p)) GTEST_SKIP() << "plugin '" << p << "' is not built (" << kPlugins << "): the loop needs a backend and a generator";
  }

  fs::path dir, model;
  int32_t log_level = RLH_LOG_ERROR;
};

TEST_F(Loop, KeyCheckAcceptsTheDemoConfig) {
  rlhost_t* h = make_host({}, false);
  std::string msg;
  EXPECT_EQ(code_of(rlhost_resolve_config(h, nullptr, nullptr), &msg), RLH_OK) << msg;
  rlhost_destroy(h);
}

TEST_F(Loop, KeyCheckRejectsATypo) {
  rlhost_t* h = make_host({"++grpo.num_prompt_per_step=4"}, false);
  std::string msg;
  EXPECT_EQ(code_of(rlhost_resolve_config(h, nullptr, nullptr), &msg), RLH_E_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("did you mean 'grpo.num_prompts_per_step'"), std::string::npos) << msg;
  rlhost_destroy(h);
}

// Every bad value stops the run before any component is created, with one line naming the key.
TEST_F(Loop, BadValuesNameTheKey) {
  // (overrides, key): a retyped value is deleted and added again, past the host's type check.
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"grpo.num_prompts_per_step=0"}, "grpo.num_prompts_per_step"},
      {{"grpo.max_rollout_turns=0"}, "grpo.max_rollout_turns"},
      {{"grpo.val_period=-1"}, "grpo.val_period"},
      {{"~grpo.seed", "++grpo.seed=\"x\""}, "grpo.seed"},
      {{"policy.generation.temperature=-1.0"}, "policy.generation.temperature"},
      {{"policy.generation.top_p=0.0"}, "policy.generation.top_p"},
      {{"policy.generation.max_new_tokens=0"}, "policy.generation.max_new_tokens"},
      {{"policy.train_global_batch_size=100"}, "policy.train_global_batch_size"},
      {{"policy.dtensor_cfg.enabled=false"}, "policy.dtensor_cfg.enabled"},
      {{"~loss_fn.ratio_clip_min", "++loss_fn.ratio_clip_min=\"a\""}, "loss_fn.ratio_clip_min"},
      {{"loss_fn.reference_policy_kl_type=k9"}, "loss_fn.reference_policy_kl_type"},
      {{"checkpointing.metric_name=accuracy"}, "checkpointing.metric_name"},
      {{"checkpointing.model_save_format=torch_save"}, "checkpointing.model_save_format"},
      {{"~policy.tokenizer.chat_template", "++policy.tokenizer.chat_template=\"{{ x }}\""}, "policy.tokenizer.chat_template"},
      {{"++grpo.async_grpo.enabled=true"}, "grpo.async_grpo.enabled"},
      {{"++policy.tokenizer.chat_template_kwargs=3"}, "policy.tokenizer.chat_template_kwargs"},
      // vLLM's per-sequence limit: above max_total_sequence_length (16) the rollouts would not
      // fit the policy's sequences; raw logprobs are not what the generator returns.
      {{"++policy.generation.vllm_cfg.max_model_len=17"}, "policy.generation.vllm_cfg.max_model_len"},
      {{"++policy.generation.vllm_cfg.max_model_len=0"}, "policy.generation.vllm_cfg.max_model_len"},
      {{"++policy.generation.vllm_cfg.logprobs_mode=raw_logprobs"}, "policy.generation.vllm_cfg.logprobs_mode"},
  };
  for (const auto& [overrides, key] : cases) {
    rlhost_t* h = make_host(overrides, false);
    std::string msg;
    EXPECT_NE(code_of(rlhost_run(h), &msg), RLH_OK) << key;
    EXPECT_NE(msg.find(key), std::string::npos) << key << " -> " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
    rlhost_destroy(h);
  }
}

TEST_F(Loop, FewStepsLogMetricsAndCheckpoint) {
  require_runtime();
  auto m = run({"grpo.max_num_steps=4", "grpo.val_period=2", "checkpointing.save_period=2",
                "grpo.num_prompts_per_step=16", "grpo.num_generations_per_prompt=4",
                "grpo.max_val_samples=32", "checkpointing.keep_top_k=1"});
  for (const char* name : {"train/loss", "train/reward", "train/grad_norm", "train/token_mult_prob_error",
                           "train/mean_gen_tokens_per_sample", "timing/train/generation",
                           "timing/train/policy_and_reference_logprobs", "timing/train/policy_training",
                           "timing/train/prepare_for_generation/total", "timing/train/total_step_time",
                           "timing/train/checkpointing"}) {
    ASSERT_TRUE(m.count(name)) << "metric " << name << " missing";
  }
  for (int64_t s = 1; s <= 4; ++s) EXPECT_TRUE(m["train/loss"].count(s)) << "train/loss at step " << s;
  // Validation at start (step 0), every 2 steps and at the end.
  ASSERT_TRUE(m.count("validation/accuracy"));
  EXPECT_TRUE(m["validation/accuracy"].count(0));
  EXPECT_TRUE(m["validation/accuracy"].count(2));
  EXPECT_TRUE(m["validation/accuracy"].count(4));
  for (const auto& [s, v] : m["train/reward"]) EXPECT_TRUE(v >= 0 && v <= 1) << "reward " << v << " at " << s;

  // Checkpoints: keep_top_k=1 keeps the best periodic one plus the latest.
  const fs::path ck = dir / "ckpt";
  ASSERT_TRUE(fs::exists(ck / "step_4")) << "no step_4 in " << ck;
  for (const auto& e : fs::directory_iterator(ck)) {
    const std::string name = e.path().filename().string();
    EXPECT_EQ(name.rfind("step_", 0), 0u) << "leftover " << name;
  }
  const fs::path s4 = ck / "step_4";
  for (const char* f : {"config.yaml", "training_info.json", "checkpoint_manifest.json"})
    EXPECT_TRUE(fs::exists(s4 / f)) << f;
  EXPECT_TRUE(rlh::sdk::verify_checkpoint(s4).ok) << rlh::sdk::verify_checkpoint(s4).error;
  bool weights = false;
  for (const auto& e : fs::recursive_directory_iterator(s4 / "policy"))
    weights |= e.path().extension() == ".safetensors";
  EXPECT_TRUE(weights) << "no safetensors under " << s4 / "policy";
  EXPECT_TRUE(fs::exists(s4 / "policy/tokenizer/tokenizer.json"));
  const json info = json::parse(read_file(s4 / "training_info.json"));
  EXPECT_EQ(info["step"], 4);
  EXPECT_TRUE(info.contains("val:accuracy"));
  EXPECT_TRUE(info.contains("data_order"));
  const std::string yaml = read_file(s4 / "config.yaml");
  EXPECT_NE(yaml.find("num_prompts_per_step: 16"), std::string::npos) << yaml.substr(0, 400);
}

// checkpointing.ft_save_period saves between the periodic ones (kept by ft_keep_latest_k), and
// checkpoint_must_save_by ("DD:HH:MM:SS", NeMo-RL's TimeoutChecker) saves and stops the run once
// the next step would pass the budget -- here a budget of 0 after the first step; with
// checkpointing off it stops all the same, saving nothing.
TEST_F(Loop, FaultToleranceSavesAndTheSaveDeadline) {
  require_runtime();
  const std::vector<std::string> common = {"grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
                                           "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0",
                                           "checkpointing.save_period=10", "checkpointing.keep_top_k=1"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), common.begin(), common.end());
    return more;
  };
  const fs::path ck = dir / "ckpt";
  auto steps_saved = [&] {
    std::vector<std::string> names;
    if (fs::exists(ck))
      for (const auto& e : fs::directory_iterator(ck)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  auto m = run(with({"grpo.max_num_steps=5", "++checkpointing.ft_save_period=2", "++checkpointing.ft_keep_latest_k=3"}));
  EXPECT_TRUE(m["train/loss"].count(5));
  EXPECT_EQ(steps_saved(), (std::vector<std::string>{"step_2", "step_4", "step_5"}));
  // Without ft_keep_latest_k a fault-tolerance save lasts until the next save (NeMo-RL's retention).
  fs::remove_all(ck);
  run(with({"grpo.max_num_steps=5", "++checkpointing.ft_save_period=2"}));
  EXPECT_EQ(steps_saved(), (std::vector<std::string>{"step_5"}));

  fs::remove_all(ck);
  m = run(with({"grpo.max_num_steps=5", "++checkpointing.checkpoint_must_save_by=\"00:00:00:00\""}));
  EXPECT_EQ(m["train/loss"].size(), 1u) << "the run went on past the deadline";
  EXPECT_TRUE(m["train/loss"].count(1));
  EXPECT_EQ(steps_saved(), (std::vector<std::string>{"step_1"}));
  EXPECT_TRUE(rlh::sdk::verify_checkpoint(ck / "step_1").ok);
  fs::remove_all(ck);
  m = run(with({"grpo.max_num_steps=5", "checkpointing.enabled=false",
                "++checkpointing.checkpoint_must_save_by=\"00:00:00:00\""}));
  EXPECT_EQ(m["train/loss"].size(), 1u);
  EXPECT_FALSE(fs::exists(ck));
  // A budget far away changes nothing.
  m = run(with({"grpo.max_num_steps=2", "checkpointing.enabled=false",
                "++checkpointing.checkpoint_must_save_by=\"30:00:00:00\""}));
  EXPECT_EQ(m["train/loss"].size(), 2u);
  // A malformed budget stops the run at start, naming the key.
  rlhost_t* h = make_host(with({"++checkpointing.checkpoint_must_save_by=\"3:45:00\""}), true);
  std::string msg;
  EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_E_INVALID_ARGUMENT) << msg;
  EXPECT_NE(msg.find("checkpointing.checkpoint_must_save_by: expected \"DD:HH:MM:SS\""), std::string::npos) << msg;
  rlhost_destroy(h);
}

// NeMo-RL's per-sequence logprob error metrics every step, and grpo.seq_logprob_error_threshold
// taking the samples past it out of the loss. The CPU generator and trainer agree to float
// rounding (errors ~1); a threshold below 1 takes every sample out: no gradient.
TEST_F(Loop, SeqLogprobErrorMetricsAndMask) {
  require_runtime();
  const std::vector<std::string> common = {"grpo.max_num_steps=1", "grpo.num_prompts_per_step=8",
                                           "grpo.num_generations_per_prompt=4", "grpo.val_at_start=false",
                                           "grpo.val_at_end=false", "grpo.val_period=0", "checkpointing.enabled=false"};
  auto m = run(common);
  for (const char* name : {"max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error",
                           "max_seq_mult_prob_error_after_mask", "mean_seq_mult_prob_error_after_mask",
                           "min_seq_mult_prob_error_after_mask", "num_masked_seqs_by_logprob_error",
                           "masked_correct_pct"})
    ASSERT_TRUE(m["train/" + std::string(name)].count(1)) << name;
  EXPECT_NEAR(m["train/mean_seq_mult_prob_error"][1], 1.0, 1e-3);
  EXPECT_GE(m["train/min_seq_mult_prob_error"][1], 1.0);
  EXPECT_EQ(m["train/num_masked_seqs_by_logprob_error"][1], 0);
  EXPECT_GT(m["train/grad_norm"][1], 0);
  std::vector<std::string> strict = common;
  strict.push_back("++grpo.seq_logprob_error_threshold=0.5");
  m = run(strict);
  EXPECT_EQ(m["train/num_masked_seqs_by_logprob_error"][1], 32);
  EXPECT_EQ(m["train/mean_seq_mult_prob_error_after_mask"][1], 0);
  EXPECT_EQ(m["train/grad_norm"][1], 0) << "masked samples still trained";
}

// grpo.stop_at_validation_metric / _threshold (NeMo-RL's early stop): reached at the first
// validation, no step runs; reached after a step's validation, that step saves and the run ends.
TEST_F(Loop, StopAtValidationMetric) {
  require_runtime();
  const std::vector<std::string> common = {"grpo.max_num_steps=3", "grpo.num_prompts_per_step=8",
                                           "grpo.num_generations_per_prompt=4", "grpo.max_val_samples=8",
                                           "checkpointing.save_period=10", "++grpo.stop_at_validation_metric=accuracy"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), common.begin(), common.end());
    return more;
  };
  auto m = run(with({"grpo.val_at_start=true", "++grpo.stop_at_validation_threshold=0.0"}));
  EXPECT_TRUE(m["validation/accuracy"].count(0));
  EXPECT_TRUE(m["train/loss"].empty()) << "trained after the initial validation reached the threshold";
  m = run(with({"grpo.val_at_start=false", "grpo.val_period=1", "++grpo.stop_at_validation_threshold=0.0"}));
  EXPECT_EQ(m["train/loss"].size(), 1u);
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step_1")) << "the early stop's step was not saved";
  fs::remove_all(dir / "ckpt");  // else the next run resumes from step_1
  m = run(with({"grpo.val_at_start=false", "grpo.val_period=1", "++grpo.stop_at_validation_threshold=1.5"}));
  EXPECT_EQ(m["train/loss"].size(), 3u);
  EXPECT_EQ(m["validation/accuracy"].size(), 3u);
  // grpo.val_start_at: no periodic validation before step 3 (and so no early stop before it).
  fs::remove_all(dir / "ckpt");
  m = run(with({"grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=1", "++grpo.val_start_at=3",
                "++grpo.stop_at_validation_threshold=0.0"}));
  EXPECT_EQ(m["train/loss"].size(), 3u);
  ASSERT_EQ(m["validation/accuracy"].size(), 1u);
  EXPECT_TRUE(m["validation/accuracy"].count(3));
  for (const auto& [more, want] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"grpo.val_at_start=true"}, "grpo.stop_at_validation_threshold: must be set when"},
           {{"grpo.val_at_start=true", "++grpo.stop_at_validation_threshold=0.5", "grpo.stop_at_validation_metric=acc"},
            "grpo.stop_at_validation_metric: 'acc' is not a validation metric; available: accuracy, avg_length"},
           {{"++grpo.stop_at_validation_threshold=0.5", "grpo.stop_at_validation_metric=pass_k"},
            "grpo.stop_at_validation_metric: pass_k needs"}}) {
    fs::remove_all(dir / "ckpt");
    rlhost_t* h = make_host(with(more), true);
    std::string msg;
    EXPECT_NE(code_of(rlhost_run(h), &msg), RLH_OK) << want;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    rlhost_destroy(h);
  }
}

// The reference model path: with a KL penalty the loop loads and runs the reference policy.
TEST_F(Loop, KlPenaltyAndOnPolicyRatios) {
  require_runtime();
  auto m = run({"grpo.max_num_steps=2", "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
                "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.enabled=false",
                "loss_fn.reference_policy_kl_penalty=0.1"});
  ASSERT_TRUE(m.count("train/kl_penalty")) << "no KL metric with a reference policy";
  // Step 1 trains on weights equal to the reference: KL 0. Step 2 has moved away.
  EXPECT_NEAR(m["train/kl_penalty"][1], 0.0, 1e-6);
  EXPECT_GT(m["train/kl_penalty"][2], 0.0);
  // One optimizer step per GRPO step: the loss sees the very weights prev_logprobs came from, so
  // every probability ratio is 1 (this fails when fields and outputs are misaligned).
  EXPECT_NEAR(m["train/probs_ratio_min"][1], 1.0, 1e-5);
  EXPECT_NEAR(m["train/probs_ratio_max"][1], 1.0, 1e-5);
  EXPECT_NEAR(m["train/probs_ratio_min"][2], 1.0, 1e-5);
}

// N steps straight == N/2 steps, stop, resume from the checkpoint, N/2 more: bitwise.
TEST_F(Loop, ResumeContinuesBitwise) {
  require_runtime();
  const std::vector<std::string> common = {"grpo.num_prompts_per_step=16", "grpo.num_generations_per_prompt=4",
                                           "grpo.val_at_start=false", "grpo.val_at_end=false",
                                           "grpo.val_period=0", "checkpointing.save_period=2"};
  auto with = [&](std::vector<std::string> v, const std::string& ck, int steps) {
    v.insert(v.end(), common.begin(), common.end());
    v.push_back("checkpointing.checkpoint_dir=" + (dir / ck).string());
    v.push_back("grpo.max_num_steps=" + std::to_string(steps));
    return v;
  };
  auto straight = run(with({}, "straight", 4));
  auto first = run(with({}, "resumed", 2));
  ASSERT_TRUE(fs::exists(dir / "resumed/step_2"));
  auto second = run(with({}, "resumed", 4));
  // The resumed run logs steps 3 and 4 only, with the straight run's values.
  ASSERT_TRUE(second.count("train/loss"));
  EXPECT_FALSE(second["train/loss"].count(1));
  for (int64_t s : {3, 4}) {
    EXPECT_EQ(second["train/loss"][s], straight["train/loss"][s]) << "step " << s;
    EXPECT_EQ(second["train/reward"][s], straight["train/reward"][s]) << "step " << s;
  }
  // Final weights, file by file.
  const fs::path a = dir / "straight/step_4/policy", b = dir / "resumed/step_4/policy";
  size_t compared = 0;
  for (const auto& e : fs::recursive_directory_iterator(a)) {
    if (!e.is_regular_file() || e.path().extension() != ".safetensors") continue;
    const fs::path other = b / fs::relative(e.path(), a);
    ASSERT_TRUE(fs::exists(other)) << other;
    EXPECT_TRUE(read_file(e.path()) == read_file(other)) << "differs: " << fs::relative(e.path(), a);
    ++compared;
  }
  EXPECT_GT(compared, 0u) << "no weights compared under " << a;
}

// checkpointing.model_save_dtype=bfloat16: step_N/policy's HF weights are the bf16 rounding of
// the float32 masters, which sit in policy/master_weights/ and are what a resume reads: the run
// interrupted and resumed ends as the float32-saving run straight through, bit for bit.
TEST_F(Loop, Bf16ExportResumesFromTheMasters) {
  require_runtime();
  const std::vector<std::string> common = {"grpo.num_prompts_per_step=16", "grpo.num_generations_per_prompt=4",
                                           "grpo.val_at_start=false", "grpo.val_at_end=false",
                                           "grpo.val_period=0", "checkpointing.save_period=2"};
  auto with = [&](std::vector<std::string> v, const std::string& ck, int steps) {
    v.insert(v.end(), common.begin(), common.end());
    v.push_back("checkpointing.checkpoint_dir=" + (dir / ck).string());
    v.push_back("grpo.max_num_steps=" + std::to_string(steps));
    return v;
  };
  const std::string bf16 = "++checkpointing.model_save_dtype=bfloat16";
  auto straight = run(with({}, "straight", 4));
  run(with({bf16}, "resumed", 2));
  auto second = run(with({bf16}, "resumed", 4));
  for (int64_t s : {3, 4}) {
    EXPECT_EQ(second["train/loss"][s], straight["train/loss"][s]) << "step " << s;
    EXPECT_EQ(second["train/reward"][s], straight["train/reward"][s]) << "step " << s;
  }
  const fs::path a = dir / "straight/step_4/policy", b = dir / "resumed/step_4/policy";
  ASSERT_TRUE(fs::exists(b / "master_weights/model.safetensors"));
  EXPECT_TRUE(read_file(a / "model.safetensors") == read_file(b / "master_weights/model.safetensors"))
      << "the resumed run's masters differ from the straight run's weights";
  EXPECT_TRUE(read_file(a / "optimizer.safetensors") == read_file(b / "optimizer.safetensors"));
  EXPECT_EQ(json::parse(read_file(b / "config.json"))["torch_dtype"], "bfloat16");
  EXPECT_TRUE(rlh::sdk::verify_checkpoint(dir / "resumed/step_4").ok);
  // The export: bf16, each element the round-to-nearest-even of the master.
  const auto exported = rlh::sdk::st::File::open((b / "model.safetensors").string());
  const auto masters = rlh::sdk::st::File::open((a / "model.safetensors").string());
  size_t bf16_tensors = 0, differ = 0;
  for (const auto& t : exported.tensors()) {
    if (t.dtype != rlh::sdk::st::DType::BF16) continue;
    ++bf16_tensors;
    const std::vector<float> f = masters.read_f32(t.name);
    const auto bytes = exported.data(t);
    ASSERT_EQ(bytes.size(), 2 * f.size()) << t.name;
    for (size_t i = 0; i < f.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &f[i], 4);
      const uint16_t want = uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
      uint16_t got;
      std::memcpy(&got, bytes.data() + 2 * i, 2);
      differ += got != want;
    }
  }
  EXPECT_EQ(bf16_tensors, masters.tensors().size()) << "every weight of the tiny model is a parameter";
  EXPECT_EQ(differ, 0u);
  // A bad value stops the run with the key named.
  rlhost_t* h = make_host({"++checkpointing.model_save_dtype=float16"}, true);
  std::string msg;
  EXPECT_NE(code_of(rlhost_run(h), &msg), RLH_OK);
  EXPECT_NE(msg.find("checkpointing.model_save_dtype"), std::string::npos) << msg;
  rlhost_destroy(h);
}

// Issue 18: a checkpoint whose weights changed after it was saved (same size, so only the CRC in
// the manifest shows it), or whose training_info.json names another step, is skipped with a
// warning naming it; the run resumes from the checkpoint before and continues exactly as that
// checkpoint's run did; the skipped folder is never overwritten, and no damaged state is copied
// forward into a new checkpoint.
TEST_F(Loop, DamagedCheckpointsAreSkippedAndNeverOverwritten) {
  require_runtime();
  const std::vector<std::string> common = {"grpo.num_prompts_per_step=16", "grpo.num_generations_per_prompt=4",
                                           "grpo.val_at_start=false", "grpo.val_at_end=false",
                                           "grpo.val_period=0", "checkpointing.save_period=2"};
  auto with = [&](const std::string& ck, int steps) {
    std::vector<std::string> v = common;
    v.push_back("checkpointing.checkpoint_dir=" + (dir / ck).string());
    v.push_back("grpo.max_num_steps=" + std::to_string(steps));
    return v;
  };
  auto straight = run(with("weights", 4));
  fs::copy(dir / "weights", dir / "step", fs::copy_options::recursive);
  for (const char* damage : {"weights", "step"}) {
    SCOPED_TRACE(damage);
    const fs::path ck = dir / damage;
    ASSERT_TRUE(fs::exists(ck / "step_4"));
    fs::path victim;
    if (std::string(damage) == "weights") {
      for (const auto& e : fs::recursive_directory_iterator(ck / "step_4/policy"))
        if (e.path().filename() == "model.safetensors") victim = e.path();
      ASSERT_FALSE(victim.empty());
      std::string bytes = read_file(victim);
      bytes[bytes.size() - 3] ^= 0x40;  // a weight's high bits: a different value, the same size
      std::ofstream(victim, std::ios::binary | std::ios::trunc) << bytes;
    } else {
      victim = ck / "step_4/training_info.json";
      std::string text = read_file(victim);
      const size_t at = text.find("\"step\":4");
      ASSERT_NE(at, std::string::npos) << text;
      text[at + 7] = '1';  // "step":1, the same size
      std::ofstream(victim, std::ios::binary | std::ios::trunc) << text;
    }
    const std::string damaged = read_file(victim);
    log_level = RLH_LOG_INFO;
    testing::internal::CaptureStderr();
    auto resumed = run(with(damage, 6));
    const std::string log = testing::internal::GetCapturedStderr();
    log_level = RLH_LOG_ERROR;
    EXPECT_NE(log.find("checkpoint skipped: " + (ck / "step_4").string()), std::string::npos) << log;
    EXPECT_NE(log.find("resumed from " + (ck / "step_2").string()), std::string::npos) << log;
    EXPECT_NE(log.find("checkpoint for step 4 not saved: " + (ck / "step_4").string()), std::string::npos) << log;
    // Steps 3..6 ran again from step 2's state: steps 3 and 4 as the first run had them.
    EXPECT_FALSE(resumed["train/loss"].count(2));
    for (int64_t s : {3, 4}) EXPECT_EQ(resumed["train/loss"][s], straight["train/loss"][s]) << "step " << s;
    EXPECT_TRUE(resumed["train/loss"].count(6));
    // Nothing lost: the damaged step_4 is as it was; step_6 is a new, valid checkpoint.
    EXPECT_TRUE(read_file(victim) == damaged);
    EXPECT_TRUE(rlh::sdk::verify_checkpoint(ck / "step_6").ok) << rlh::sdk::verify_checkpoint(ck / "step_6").error;
    EXPECT_TRUE(rlh::sdk::verify_checkpoint(ck / "step_2").ok);
  }
}

// Issue 18: a model's chat template is code from its repository; one that would trap (SIGFPE) or
// build gigabytes stops the GRPO run with one line naming the template, before any step.
TEST_F(Loop, HostileChatTemplateStopsTheRunWithOneLine) {
  require_runtime();
  for (const char* tpl : {"{{ (-9223372036854775807 - 1) // -1 }}", "{{ 'x'|center(1000000000000) }}"}) {
    json cfg = json::parse(read_file(model / "tokenizer_config.json"));
    cfg["chat_template"] = tpl;
    std::ofstream(model / "tokenizer_config.json", std::ios::trunc) << cfg.dump();
    rlhost_t* h = make_host({"policy.tokenizer.chat_template=default", "grpo.max_num_steps=1"}, true);
    std::string msg;
    EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_E_INVALID_ARGUMENT) << msg;
    EXPECT_NE(msg.find("chat template: line 1: "), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    rlhost_destroy(h);
    EXPECT_FALSE(fs::exists(dir / "ckpt" / "step_1"));
  }
}

// Issue 18: a non-finite loss stops training (NeMo-RL stops on a NaN loss too): one line naming the
// step, a non-zero status, and no checkpoint of that step. Here the model's output layer is
// finite but so large that the logits overflow.
TEST_F(Loop, NonFiniteLossStopsTrainingWithoutACheckpoint) {
  require_runtime();
  if (!have("sft")) GTEST_SKIP() << "plugin 'sft' is not built";
  {
    const fs::path st = model / "model.safetensors";
    std::string b = read_file(st);
    uint64_t n = 0;
    std::memcpy(&n, b.data(), 8);
    const json hdr = json::parse(b.substr(8, n));
    const auto& off = hdr.at("lm_head.weight").at("data_offsets");
    const float big = 3e38f;
    for (uint64_t at = 8 + n + off[0].get<uint64_t>(); at < 8 + n + off[1].get<uint64_t>(); at += 4)
      std::memcpy(b.data() + at, &big, 4);
    std::ofstream(st, std::ios::binary | std::ios::trunc) << b;
  }
  rlhost_t* h = nullptr;
  ASSERT_EQ(rlhost_create(&h), nullptr);
  rlhost_set_log_level(h, RLH_LOG_ERROR);
  for (const std::string p : {"sft", "dtensor", "environments", "tokenizer_hf", "model_llama", "kernels_cpu"})
    ASSERT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str())), RLH_OK) << p;
  std::string msg;
  ASSERT_EQ(code_of(rlhost_load_config(h, (fs::path(RLH_SOURCE_DIR) / "examples/configs/sft_demo_cpu.yaml").c_str()),
                    &msg), RLH_OK) << msg;
  const fs::path ck = dir / "nan_ck";
  for (const std::string& o : {"policy.model_name=" + model.string(), std::string("sft.max_num_steps=3"),
                              std::string("checkpointing.save_period=1"), "checkpointing.checkpoint_dir=" + ck.string(),
                              "logger.log_dir=" + (dir / "nan_logs").string(), std::string("++logger.console_enabled=false")})
    ASSERT_EQ(code_of(rlhost_apply_override(h, o.c_str()), &msg), RLH_OK) << o << ": " << msg;
  EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_E_ABORTED) << msg;
  EXPECT_NE(msg.find("train step 1: the loss is NaN"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  rlhost_destroy(h);
  EXPECT_FALSE(fs::exists(ck / "step_1"));
}

// NeMo-RL's math recipes (dtensor and megatron) run as shipped on a user's own HF checkpoint and
// JSONL data: only the model, the data file and the sizes are overridden.
TEST_F(Loop, MathRecipesRunOnAUsersCheckpointAndJsonl) {
  require_runtime();
  const fs::path math_model = dir / "math_model";
  const std::string cmd = std::string(RLH_TINY_MODEL) + " " + math_model.string() +
                          " --alphabet '0123456789+-*/=?. abcdefghijklmnopqrstuvwxyzW' --max-positions 128 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  {
    std::ofstream f(dir / "train.jsonl");
    for (int i = 0; i < 40; ++i)
      f << json{{"problem", "What is " + std::to_string(i % 10) + "+" + std::to_string(i / 10) + "?"},
                {"expected_answer", std::to_string(i % 10 + i / 10)}}.dump() << "\n";
  }
  for (const std::string backend : {"dtensor", "megatron"}) {
    if (!have(backend)) continue;
    rlhost_t* h = nullptr;
    ASSERT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR);
    for (const std::string p : {"grpo", "environments", "dataset_jsonl", "tokenizer_hf", "model_llama", "kernels_cpu",
                                "generator", backend.c_str()})
      ASSERT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str())), RLH_OK) << p;
    const std::string file = backend == "dtensor" ? "grpo_math_1B.yaml" : "grpo_math_1B_megatron.yaml";
    std::string msg;
    ASSERT_EQ(code_of(rlhost_load_config(h, (fs::path(RLH_SOURCE_DIR) / "examples/configs" / file).c_str()), &msg),
              RLH_OK) << msg;
    const fs::path ck = dir / ("ck_" + backend);
    for (const std::string& o : {"policy.model_name=" + math_model.string(),
                                "data.train.data_path=" + (dir / "train.jsonl").string(),
                                std::string("grpo.num_prompts_per_step=4"), std::string("grpo.num_generations_per_prompt=2"),
                                std::string("grpo.max_num_steps=2"), std::string("grpo.max_val_samples=2"),
                                std::string("policy.max_total_sequence_length=40"),
                                "checkpointing.checkpoint_dir=" + ck.string(),
                                "logger.log_dir=" + (dir / ("logs_" + backend)).string(),
                                std::string("++logger.console_enabled=false")})
      ASSERT_EQ(code_of(rlhost_apply_override(h, o.c_str()), &msg), RLH_OK) << o << ": " << msg;
    EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_OK) << file << ": " << msg;
    rlhost_destroy(h);
    EXPECT_TRUE(fs::exists(ck / "step_2" / "policy")) << file << ": no final checkpoint";
  }
}

// rlhost_cancel from another thread stops the loop between phases with RLH_E_CANCELLED.
TEST_F(Loop, CancelStopsTheRun) {
  require_runtime();
  rlhost_t* h = make_host({"grpo.max_num_steps=100000", "grpo.val_at_start=false", "checkpointing.enabled=false",
                           "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=2"},
                          true);
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    rlhost_cancel(h);
  });
  std::string msg;
  const rlh_code c = code_of(rlhost_run(h), &msg);
  canceller.join();
  EXPECT_EQ(c, RLH_E_CANCELLED) << msg;
  EXPECT_NE(msg.find("cancelled"), std::string::npos) << msg;
  rlhost_destroy(h);
}

// The demo's first stage: SFT lowers its loss, logs validation/val_loss, and its checkpoint's
// policy/ folder is a model GRPO starts from.
TEST_F(Loop, SftCheckpointStartsGrpo) {
  require_runtime();
  if (!have("sft")) GTEST_SKIP() << "plugin 'sft' is not built";
  const fs::path sft_model = dir / "sft_model";
  const std::string cmd = std::string(RLH_TINY_MODEL) + " " + sft_model.string() +
                          " --alphabet '0123456789+-*=' --seed 4 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  rlhost_t* h = nullptr;
  ASSERT_EQ(rlhost_create(&h), nullptr);
  rlhost_set_log_level(h, RLH_LOG_ERROR);
  for (const std::string p : {"sft", "dtensor", "environments", "tokenizer_hf", "model_llama", "kernels_cpu"})
    ASSERT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str())), RLH_OK) << p;
  std::string msg;
  ASSERT_EQ(code_of(rlhost_load_config(h, (fs::path(RLH_SOURCE_DIR) / "examples/configs/sft_demo_cpu.yaml").c_str()),
                    &msg), RLH_OK) << msg;
  const fs::path ck = dir / "sft_ck";
  for (const std::string& o : {"policy.model_name=" + sft_model.string(), std::string("sft.max_num_steps=20"),
                              std::string("sft.val_period=10"), std::string("checkpointing.save_period=20"),
                              "checkpointing.checkpoint_dir=" + ck.string(),
                              "logger.log_dir=" + (dir / "sft_logs").string(), std::string("++logger.console_enabled=false")})
    ASSERT_EQ(code_of(rlhost_apply_override(h, o.c_str()), &msg), RLH_OK) << o << ": " << msg;
  ASSERT_EQ(code_of(rlhost_run(h), &msg), RLH_OK) << msg;
  std::string lines;
  ASSERT_EQ(code_of(rlhost_read_metrics(h, rlh::sdk::write_to_string, &lines)), RLH_OK);
  rlhost_destroy(h);
  auto m = metrics_of(lines);
  ASSERT_TRUE(m["train/loss"].count(1) && m["train/loss"].count(20));
  EXPECT_LT(m["train/loss"][20], 0.8 * m["train/loss"][1]) << "SFT did not lower the loss";
  EXPECT_TRUE(m["validation/val_loss"].count(10) && m["validation/val_loss"].count(20));
  const fs::path policy = ck / "step_20" / "policy";
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    EXPECT_TRUE(fs::exists(policy / f)) << policy / f;

  auto g = run({"policy.model_name=" + policy.string(), "grpo.max_num_steps=2", "grpo.num_prompts_per_step=8",
                "grpo.num_generations_per_prompt=4", "checkpointing.enabled=false"});
  EXPECT_TRUE(g["train/loss"].count(2)) << "GRPO did not run from the SFT checkpoint";
}

// SFT validates every val_period steps and after the last step only with sft.val_at_end (NeMo-RL's
// sft_train), a checkpoint carries its own step's validation only, and checkpoint_must_save_by
// stops it as it stops GRPO.
TEST_F(Loop, SftValAtEndAndTheSaveDeadline) {
  require_runtime();
  if (!have("sft")) GTEST_SKIP() << "plugin 'sft' is not built";
  const fs::path sft_model = dir / "sft_model";
  const std::string cmd = std::string(RLH_TINY_MODEL) + " " + sft_model.string() +
                          " --alphabet '0123456789+-*=' --seed 4 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto sft = [&](const std::vector<std::string>& more) {
    rlhost_t* h = nullptr;
    EXPECT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR);
    for (const std::string p : {"sft", "dtensor", "environments", "tokenizer_hf", "model_llama", "kernels_cpu"})
      EXPECT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str())), RLH_OK) << p;
    std::string msg;
    EXPECT_EQ(code_of(rlhost_load_config(h, (fs::path(RLH_SOURCE_DIR) / "examples/configs/sft_demo_cpu.yaml").c_str()),
                      &msg), RLH_OK) << msg;
    std::vector<std::string> all = {"policy.model_name=" + sft_model.string(), "sft.val_period=2",
                                    "checkpointing.save_period=1", "checkpointing.keep_top_k=null",
                                    "checkpointing.checkpoint_dir=" + (dir / "sft_ck").string(),
                                    "logger.log_dir=" + (dir / "sft_logs").string(), "++logger.console_enabled=false"};
    all.insert(all.end(), more.begin(), more.end());
    for (const auto& o : all) EXPECT_EQ(code_of(rlhost_apply_override(h, o.c_str()), &msg), RLH_OK) << o << ": " << msg;
    EXPECT_EQ(code_of(rlhost_run(h), &msg), RLH_OK) << msg;
    std::string lines;
    EXPECT_EQ(code_of(rlhost_read_metrics(h, rlh::sdk::write_to_string, &lines)), RLH_OK);
    rlhost_destroy(h);
    return metrics_of(lines);
  };
  auto m = sft({"sft.max_num_steps=3"});
  EXPECT_EQ(m["validation/val_loss"].size(), 1u);
  EXPECT_TRUE(m["validation/val_loss"].count(2));
  const json s1 = json::parse(read_file(dir / "sft_ck/step_1/training_info.json"));
  const json s2 = json::parse(read_file(dir / "sft_ck/step_2/training_info.json"));
  EXPECT_FALSE(s1.contains("val:val_loss")) << s1.dump();  // no validation at step 1
  EXPECT_TRUE(s2.contains("val:val_loss")) << s2.dump();
  fs::remove_all(dir / "sft_ck");
  m = sft({"sft.max_num_steps=3", "++sft.val_at_end=true"});
  EXPECT_EQ(m["validation/val_loss"].size(), 2u);
  EXPECT_TRUE(m["validation/val_loss"].count(3));
  fs::remove_all(dir / "sft_ck");
  m = sft({"sft.max_num_steps=3", "++checkpointing.checkpoint_must_save_by=\"00:00:00:00\""});
  EXPECT_EQ(m["train/loss"].size(), 1u);
  EXPECT_TRUE(fs::exists(dir / "sft_ck/step_1"));
  EXPECT_FALSE(fs::exists(dir / "sft_ck/step_2"));
}

// SFT on a file of conversations (NeMo-RL's ResponseDataset over chat data with "messages"):
// multi-turn rows train on every assistant turn and the loss falls; a conversation with no
// assistant turn stops the run with one line naming the row.
TEST_F(Loop, SftTrainsOnMessagesConversations) {
  require_runtime();
  if (!have("sft") || !have("dataset_jsonl")) GTEST_SKIP() << "plugins 'sft' and 'dataset_jsonl' are needed";
  const fs::path sft_model = dir / "sft_model";
  const std::string cmd = std::string(RLH_TINY_MODEL) + " " + sft_model.string() +
                          " --alphabet '0123456789+-*=' --seed 4 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto turn = [](const std::string& role, const std::string& content) { return json{{"role", role}, {"content", content}}; };
  std::ofstream out(dir / "chat.jsonl");
  for (int i = 0; i < 32; ++i) {
    const int a = i % 10, b = (i * 7) % 10;
    json msgs = json::array({turn("user", std::to_string(a) + "+" + std::to_string(b) + "="), turn("assistant", std::to_string(a + b))});
    if (i % 2 == 1) {  // two turns
      msgs.push_back(turn("user", std::to_string(b) + "*" + std::to_string(a) + "="));
      msgs.push_back(turn("assistant", std::to_string(a * b)));
    }
    out << json{{"messages", msgs}}.dump() << "\n";
  }
  out << json{{"messages", json::array({turn("user", "1+1=")})}}.dump() << "\n";  // row 32: nothing to train on
  out.close();
  auto sft = [&](const std::vector<std::string>& extra, std::string* msg) {
    rlhost_t* h = nullptr;
    EXPECT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR);
    for (const std::string p : {"sft", "dtensor", "dataset_jsonl", "tokenizer_hf", "model_llama", "kernels_cpu"})
      EXPECT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str())), RLH_OK) << p;
    EXPECT_EQ(code_of(rlhost_load_config(h, (fs::path(RLH_SOURCE_DIR) / "examples/configs/sft_demo_cpu.yaml").c_str()), msg),
              RLH_OK) << *msg;
    std::vector<std::string> o = {"policy.model_name=" + sft_model.string(), "~data.train", "~data.validation",
                                  "++data.train.dataset_name=ResponseDataset",
                                  "++data.train.data_path=" + (dir / "chat.jsonl").string(), "sft.val_period=0",
                                  "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16",
                                  "checkpointing.enabled=false", "logger.log_dir=" + (dir / "sft_logs").string(),
                                  "++logger.console_enabled=false"};
    o.insert(o.end(), extra.begin(), extra.end());
    for (const std::string& x : o) EXPECT_EQ(code_of(rlhost_apply_override(h, x.c_str()), msg), RLH_OK) << x << ": " << *msg;
    const rlh_code c = code_of(rlhost_run(h), msg);
    std::string lines;
    EXPECT_EQ(code_of(rlhost_read_metrics(h, rlh::sdk::write_to_string, &lines)), RLH_OK);
    rlhost_destroy(h);
    return std::make_pair(c, metrics_of(lines)["train/loss"]);
  };
  std::string msg;
  // 32 good rows first (the epoch's order is shuffled: stop before the bad row is drawn by
  // turning shuffling off), 2 steps of 16, repeated over epochs.
  auto [code, loss] = sft({"data.shuffle=false", "sft.max_num_steps=2", "sft.max_num_epochs=1"}, &msg);
  ASSERT_EQ(code, RLH_OK) << msg;
  ASSERT_TRUE(loss.count(1) && loss.count(2)) << "no SFT steps on the conversations";
  EXPECT_TRUE(std::isfinite(loss[1]) && loss[1] > 0);
  // NeMo-RL's sft_processor: a row of at least data.max_input_seq_length tokens is not trained
  // on (every row here has 5 or more).
  auto [capped, masked] = sft({"data.shuffle=false", "sft.max_num_steps=1", "++data.max_input_seq_length=5"}, &msg);
  ASSERT_EQ(capped, RLH_OK) << msg;
  ASSERT_TRUE(masked.count(1));
  EXPECT_EQ(masked[1], 0.0);
  auto [bad, none] = sft({"data.shuffle=false", "sft.max_num_steps=3", "sft.max_num_epochs=1",
                          "policy.train_global_batch_size=11", "policy.train_micro_batch_size=11"}, &msg);
  EXPECT_EQ(bad, RLH_E_INVALID_ARGUMENT) << msg;
  EXPECT_NE(msg.find("row 32: the conversation has no assistant message to train on"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// DAPO dynamic sampling: generation batches repeat until enough prompt groups with varying
// rewards are cached; the training batch still holds num_prompts_per_step groups.
TEST_F(Loop, DynamicSamplingFillsTheBatch) {
  require_runtime();
  auto m = run({"grpo.max_num_steps=2", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=8",
                "++grpo.use_dynamic_sampling=true", "++grpo.batch_multiplier=2.0",
                "++grpo.dynamic_sampling_max_gen_batches=20", "grpo.val_at_start=false",
                "grpo.val_at_end=false", "checkpointing.enabled=false"});
  ASSERT_TRUE(m.count("train/dynamic_sampling_num_gen_batches")) << "no dynamic sampling metrics";
  for (int64_t s : {1, 2}) {
    EXPECT_GE(m["train/dynamic_sampling_num_gen_batches"][s], 1.0);
    // 4 prompts x 8 samples, every group with some reward spread: 0 < mean reward < 1.
    EXPECT_GT(m["train/reward"][s], 0.0);
    EXPECT_LT(m["train/reward"][s], 1.0);
    EXPECT_EQ(m["train/num_valid_samples"][s], 32.0);
  }
}

}  // namespace
