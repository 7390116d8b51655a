// The dpo algorithm plugin through librlhost with the real plugins (examples/configs/
// dpo_demo_cpu.yaml on a random tiny Llama): DPO on synthetic preferences raises held-out reward
// accuracy from 0 to above 90%, a run interrupted and resumed ends with bitwise the same weights,
// a bad preference row stops the run at start with one line naming file and line, and NeMo-RL's
// own dpo.yaml resolves and passes the key check with the plugin.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "preference_fixture.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using namespace rlh_test;

struct DpoLoop : PreferenceLoopTest {
  DpoLoop() : PreferenceLoopTest("dpo", "examples/configs/dpo_demo_cpu.yaml", 1) {}
};

// Held-out pairs: at step 0 the policy is the reference, so every implicit reward is 0 up to the
// rounding between the training and the forward pass (a few pairs may come out "right" by
// 1e-7); 80 steps of DPO lift the accuracy above 90%.
TEST_F(DpoLoop, SyntheticPreferencesRaiseHeldOutRewardAccuracy) {
  Metrics m = run({"checkpointing.enabled=false"});
  ASSERT_TRUE(m.count("validation-default/accuracy")) << "no validation metrics";
  auto& acc = m["validation-default/accuracy"];
  ASSERT_TRUE(acc.count(0) && acc.count(80));
  EXPECT_LT(acc[0], 0.5);
  EXPECT_NEAR(m["validation-default/rewards_chosen_mean"][0], 0.0, 1e-5);
  EXPECT_NEAR(m["validation-default/rewards_rejected_mean"][0], 0.0, 1e-5);
  EXPECT_NEAR(m["validation-default/preference_loss"][0], std::log(2.0), 1e-5);  // -logsigmoid(0)
  EXPECT_GT(acc[80], 0.9) << "DPO did not learn the preference";
  RecordProperty("validation_accuracy_step_40", std::to_string(acc[40]));
  RecordProperty("validation_accuracy_step_80", std::to_string(acc[80]));
  EXPECT_EQ(m["validation-default/num_valid_samples"][80], 64.0);
  EXPECT_GT(m["validation-default/rewards_chosen_mean"][80], m["validation-default/rewards_rejected_mean"][80]);
  EXPECT_LT(m["validation-default/loss"][80], m["validation-default/loss"][0]);
  for (const char* k : {"train/loss", "train/accuracy", "train/preference_loss", "train/sft_loss",
                        "train/rewards_chosen_mean", "train/rewards_rejected_mean", "train/grad_norm"})
    EXPECT_TRUE(m[k].count(1) && m[k].count(80)) << k;
  EXPECT_EQ(m["train/num_valid_samples"][1], 32.0);  // pairs per step
  EXPECT_EQ(m["train/sft_loss"][80], 0.0);           // sft_loss_weight 0 is not computed
}

// The SFT term and averaged log-probs run end to end (the loss math is checked in test_grpo).
TEST_F(DpoLoop, SftTermAndAveragedLogProbs) {
  Metrics m = run({"checkpointing.enabled=false", "dpo.max_num_steps=2", "dpo.val_period=0",
                   "dpo.val_at_start=false", "dpo.sft_loss_weight=0.5", "dpo.preference_average_log_probs=true"});
  ASSERT_TRUE(m["train/sft_loss"].count(2));
  EXPECT_GT(m["train/sft_loss"][1], 0.0);
  EXPECT_NEAR(m["train/loss"][1], m["train/preference_loss"][1] + 0.5 * m["train/sft_loss"][1], 1e-5);
}

// NeMo-RL's preference processor drops a pair with a side longer than data.max_input_seq_length
// (loss_multiplier 0): with a limit below every pair, nothing is trained on.
TEST_F(DpoLoop, PairsPastMaxInputSeqLengthAreNotTrainedOn) {
  Metrics m = run({"checkpointing.enabled=false", "dpo.max_num_steps=1", "dpo.val_period=0", "dpo.val_at_start=false",
                   "++data.max_input_seq_length=2"});
  ASSERT_TRUE(m["train/loss"].count(1));
  EXPECT_EQ(m["train/loss"][1], 0.0);
  Metrics kept = run({"checkpointing.enabled=false", "dpo.max_num_steps=1", "dpo.val_period=0", "dpo.val_at_start=false"});
  EXPECT_GT(kept["train/loss"][1], 0.0);
}

TEST_F(DpoLoop, ResumeContinuesBitwise) {
  check_resume_is_bitwise();
  const json info = json::parse(read_file(dir / "resumed/step_4/training_info.json"));
  EXPECT_TRUE(info.contains("train:accuracy")) << info.dump();
}

// checkpointing.checkpoint_must_save_by: a budget the next step would pass saves and stops (the
// preference loops follow NeMo-RL's dpo_train and rm_train).
TEST_F(DpoLoop, SaveDeadlineSavesAndStops) {
  Metrics m = run({"dpo.max_num_steps=3", "dpo.val_period=0", "dpo.val_at_start=false", "checkpointing.save_period=10",
                   "++checkpointing.checkpoint_must_save_by=\"00:00:00:00\""});
  EXPECT_EQ(m["train/loss"].size(), 1u);
  EXPECT_TRUE(fs::exists(dir / "ckpt/step_1/training_info.json"));
  EXPECT_FALSE(fs::exists(dir / "ckpt/step_3"));
}

TEST_F(DpoLoop, BadPreferenceRowStopsTheRunWithOneLine) {
  std::ofstream(dir / "train.jsonl", std::ios::app) << "{\"prompt\": \"12=\", \"chosen\": \"1\"}\n";
  std::string msg;
  Metrics m = run({"checkpointing.enabled=false"}, RLH_E_INVALID_ARGUMENT, &msg);
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.jsonl:257: missing key 'rejected' (data.train.rejected_key)"), std::string::npos) << msg;
  EXPECT_FALSE(m.count("train/loss"));
}

TEST_F(DpoLoop, ValidationWithoutDataIsRefusedByKey) {
  rlhost_t* h = make_host({"data.validation=null"});
  std::string msg;
  EXPECT_NE(code_of(rlhost_run(h), &msg), RLH_OK);
  EXPECT_NE(msg.find("dpo.val_period: 40 but data.validation is missing"), std::string::npos) << msg;
  rlhost_destroy(h);
}

// NeMo-RL's own dpo.yaml (every version copied into tests/host/nemo_rl_configs) passes the key
// check with the dpo plugin; its HelpSteer3 hub dataset is the one thing a CPU run lacks, named.
TEST(DpoNemoRlConfig, DpoYamlResolvesWithThePlugin) {
  for (const char* p : {"dpo", "dtensor", "megatron", "dataset_jsonl", "tokenizer_hf", "model_llama", "kernels_cpu"})
    if (!have(p)) GTEST_SKIP() << "plugin '" << p << "' is not built";
  for (const char* ref : {"v0.3.0", "v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0", "main"}) {
    const fs::path file = fs::path(RLH_SOURCE_DIR) / "tests/host/nemo_rl_configs" / ref / "examples/configs/dpo.yaml";
    if (!fs::exists(file)) continue;
    rlhost_t* h = nullptr;
    ASSERT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR + 1);
    for (const std::string p : {"dpo", "dtensor", "megatron", "dataset_jsonl", "tokenizer_hf", "model_llama", "kernels_cpu"})
      ASSERT_EQ(code_of(rlhost_load_plugin(h, (kPlugins / ("lib" + p + ".so")).c_str())), RLH_OK) << p;
    std::string msg, text;
    ASSERT_EQ(code_of(rlhost_load_config(h, file.c_str()), &msg), RLH_OK) << ref << ": " << msg;
    ASSERT_EQ(code_of(rlhost_resolve_config(h, nullptr, nullptr), &msg), RLH_OK) << ref << ": " << msg;
    EXPECT_EQ(code_of(rlhost_check_config(h, rlh::sdk::write_to_string, &text), &msg), RLH_OK) << ref << ": " << msg;
    const json report = json::parse(text);
    EXPECT_TRUE(report["refused"].empty()) << ref << ": " << report.dump();
    rlhost_destroy(h);
  }
}

}  // namespace
