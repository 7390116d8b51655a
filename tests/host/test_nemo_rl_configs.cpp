// NeMo-RL's own configurations against this repository's plugins, and the key tables behind it.
//
//  - every examples/configs/**/*.yaml of NeMo-RL v0.3.0, v0.4.0, v0.5.0, v0.6.0, v0.7.0 and main
//    (the copy in tests/host/nemo_rl_configs) resolves with every plugin loaded, and the check a run
//    makes at start either passes or refuses it with one line naming the key, its value and what
//    rlhost lacks;
//  - the settings that change behaviour are refused by name, their off values accepted;
//  - every NeMo-RL key has a rule (host/data/nemo_rl_support.tsv), every rule a key, and the
//    plugins the rules name exist.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config_keys.hpp"
#include "nemo_rl_keys.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace fs = std::filesystem;
using rlh::host::NemoRlTables;
using rlh::host::SupportRule;

namespace {

const std::vector<std::string> kRefs = {"v0.3.0", "v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0", "main"};
const std::vector<std::string> kPlugins = {"dataset_jsonl", "dpo",         "dtensor", "environments",
                                           "generator",     "grpo",        "kernels_cpu", "megatron",
                                           "model_llama",   "rm",          "sft",         "tokenizer_hf"};

struct Outcome {
  rlh_code resolve = RLH_OK, check = RLH_OK;
  std::string resolve_msg, check_msg;
  nlohmann::json report;
};

std::string take(rlh_status* s, rlh_code* code) {
  *code = s == nullptr ? RLH_OK : s->code;
  std::string m = s == nullptr ? "" : rlh::sdk::status_message(s);
  rlh_status_destroy(s);
  return m;
}

// Loads every plugin of this repository, the file and the overrides; resolves, then checks.
Outcome load(const fs::path& file, const std::vector<std::string>& overrides = {}) {
  Outcome o;
  rlhost_t* h = nullptr;
  EXPECT_EQ(rlhost_create(&h), nullptr);
  rlhost_set_log_level(h, RLH_LOG_ERROR + 1);  // quiet: the test reads statuses and the report
  for (const auto& p : kPlugins) {
    rlh_code c;
    std::string m = take(rlhost_load_plugin(h, p.c_str()), &c);
    EXPECT_EQ(c, RLH_OK) << m;
  }
  rlh_code c;
  o.resolve_msg = take(rlhost_load_config(h, file.c_str()), &o.resolve);
  for (const auto& ov : overrides)
    if (o.resolve == RLH_OK) o.resolve_msg = take(rlhost_apply_override(h, ov.c_str()), &o.resolve);
  if (o.resolve == RLH_OK) o.resolve_msg = take(rlhost_resolve_config(h, nullptr, nullptr), &o.resolve);
  if (o.resolve == RLH_OK) {
    std::string text;
    o.check_msg = take(rlhost_check_config(h, rlh::sdk::write_to_string, &text), &o.check);
    if (!text.empty()) o.report = nlohmann::json::parse(text);
  }
  (void)c;
  rlhost_destroy(h);
  return o;
}

class NemoRlConfigs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Some configs name "${oc.env:HF_HOME}/..." data files (without a default): give it a value.
    ::setenv("HF_HOME", (fs::temp_directory_path() / "rlh_nemo_rl_hf_home").c_str(), 1);
  }
  static fs::path root() { return fs::path(RLH_NEMO_RL_CONFIGS); }
};

// The one-line refusal: names the key, its value and what is missing.
const std::regex kRefusal(R"(^config key '[A-Za-z0-9_.<>-]+' = .+ \(from .+\) needs .+, which rlhost does not have.*$)");

// The cluster keys against the launcher's world: names both.
const std::regex kClusterMismatch(
    R"(^cluster\.(num_nodes|num_nodes x cluster\.gpus_per_node|gpus_per_node) = .+ \(from .+\), but .+ (started|spans) .+$)");

// Under AddressSanitizer (scripts/test.sh's second build) every fourth file is loaded (the same
// code per file, 12x slower there: two minutes for all ~980); the normal build loads them all.
#ifdef __SANITIZE_ADDRESS__
constexpr int kEveryNth = 4;
#else
constexpr int kEveryNth = 1;
#endif

TEST_F(NemoRlConfigs, EveryExampleResolvesAndStartsOrIsRefusedByName) {
  std::map<std::string, int> files, start;
  std::map<std::string, int> refused_by;  // key -> configs
  int seen = 0;
  for (const auto& ref : kRefs) {
    const fs::path dir = root() / ref / "examples" / "configs";
    ASSERT_TRUE(fs::is_directory(dir)) << dir;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      if (!e.is_regular_file() || e.path().extension() != ".yaml") continue;
      ++files[ref];
      if (seen++ % kEveryNth != 0) continue;
      const Outcome o = load(e.path());
      ASSERT_EQ(o.resolve, RLH_OK) << e.path() << ": " << o.resolve_msg;
      if (o.check == RLH_OK) {
        ++start[ref];
        EXPECT_TRUE(o.report["refused"].empty()) << e.path();
        continue;
      }
      if (o.check == RLH_E_INVALID_ARGUMENT) {
        // Settings rlhost honours, but for another world than this one process: cluster.num_nodes x
        // gpus_per_node asks for more ranks than the launcher (here none) started.
        EXPECT_TRUE(std::regex_match(o.check_msg, kClusterMismatch)) << e.path() << ": " << o.check_msg;
        EXPECT_TRUE(o.report["refused"].empty()) << e.path();
        ++refused_by["cluster"];
        continue;
      }
      EXPECT_EQ(o.check, RLH_E_UNIMPLEMENTED) << e.path() << ": " << o.check_msg;
      EXPECT_TRUE(std::regex_match(o.check_msg, kRefusal)) << e.path() << ": " << o.check_msg;
      ASSERT_FALSE(o.report["refused"].empty()) << e.path();
      EXPECT_EQ(o.report["refused"][0], o.check_msg);
      ++refused_by[o.check_msg.substr(12, o.check_msg.find('\'', 12) - 12)];
    }
  }
  // NeMo-RL's example configurations per version (recipes included): nothing was skipped.
  const std::map<std::string, int> expected = {{"v0.3.0", 38}, {"v0.4.0", 83},  {"v0.5.0", 142},
                                               {"v0.6.0", 177}, {"v0.7.0", 245}, {"main", 295}};
  EXPECT_EQ(files, expected);
  int total = 0;
  for (const auto& [ref, n] : start) total += n;
  RecordProperty("configs_that_start", total);
  // The GRPO math recipes on one device start in every version.
  if (kEveryNth == 1)  // (each is loaded below in any case)
    for (const auto& ref : kRefs) EXPECT_GE(start[ref], 3) << ref;
  for (const auto& ref : kRefs) {
    const Outcome o = load(root() / ref / "examples/configs/grpo_math_1B.yaml");
    EXPECT_EQ(o.check, RLH_OK) << ref << ": " << o.check_msg;
  }
  std::string why;
  for (const auto& [k, n] : refused_by) why += k + "=" + std::to_string(n) + " ";
  RecordProperty("first_refusal_by_key", why);
}

// The settings the issue found silently ignored: refused at start by name; their off values pass.
TEST_F(NemoRlConfigs, SettingsThatChangeBehaviourAreRefusedByName) {
  const fs::path base = root() / "main/examples/configs/grpo_math_1B.yaml";
  struct Case {
    std::string override_text, key, value, missing;
  };
  const std::vector<Case> refused = {
      {"++policy.megatron_cfg.fp8_cfg.enabled=true", "policy.megatron_cfg.fp8_cfg.enabled", "true", "FP8 training"},
      {"++logger.wandb_enabled=true", "logger.wandb_enabled", "true", "Weights & Biases"},
      {"++logger.mlflow_enabled=true", "logger.mlflow_enabled", "true", "MLflow"},
      {"++policy.generation.vllm_cfg.precision=fp8", "policy.generation.vllm_cfg.precision", "fp8", "FP8 rollouts"},
      {"++policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.enabled", "true", "LoRA"},
      {"++distillation.max_num_steps=3", "distillation.max_num_steps", "3", "distillation algorithm"},
  };
  for (const auto& c : refused) {
    const Outcome o = load(base, {c.override_text});
    ASSERT_EQ(o.resolve, RLH_OK) << c.override_text << ": " << o.resolve_msg;  // printing still works
    EXPECT_EQ(o.check, RLH_E_UNIMPLEMENTED) << c.override_text;
    EXPECT_TRUE(std::regex_match(o.check_msg, kRefusal)) << o.check_msg;
    EXPECT_NE(o.check_msg.find("config key '" + c.key + "' = " + c.value + " (from command line)"), std::string::npos)
        << o.check_msg;
    EXPECT_NE(o.check_msg.find(c.missing), std::string::npos) << o.check_msg;
  }
  // The cluster's size is honoured: checked against what the launcher started (here one
  // process on one node), naming both.
  for (const auto& [ov, what] : std::vector<std::pair<std::string, std::string>>{
           {"++cluster.num_nodes=4", "cluster.num_nodes x cluster.gpus_per_node = 4 x 1 = 4 (from "},
           {"++cluster.gpus_per_node=8", "cluster.num_nodes x cluster.gpus_per_node = 1 x 8 = 8 (from "}}) {
    const Outcome o = load(base, {ov});
    EXPECT_EQ(o.check, RLH_E_INVALID_ARGUMENT) << ov;
    EXPECT_TRUE(std::regex_match(o.check_msg, kClusterMismatch)) << o.check_msg;
    EXPECT_NE(o.check_msg.find(what), std::string::npos) << o.check_msg;
    EXPECT_NE(o.check_msg.find("no launcher (one rank) started 1 rank"), std::string::npos) << o.check_msg;
  }
  EXPECT_EQ(load(base, {"++cluster.num_nodes=1"}).check, RLH_OK);
  for (const char* ok : {"++policy.megatron_cfg.fp8_cfg.enabled=false", "++policy.generation.colocated.enabled=true",
                         "++logger.wandb_enabled=false", "++logger.mlflow_enabled=false"}) {
    const Outcome o = load(base, {ok});
    EXPECT_EQ(o.check, RLH_OK) << ok << ": " << o.check_msg;
    // Accepted without effect: named in the report (and the warning).
    std::string key = std::string(ok).substr(2);
    bool listed = false;
    for (const auto& a : o.report["accepted"]) listed = listed || a.get<std::string>() == key;
    if (key.rfind("policy.generation.colocated", 0) != 0) {
      EXPECT_TRUE(listed) << key << " in " << o.report.dump();
    }
  }
}

TEST(NemoRlKeys, TheListCoversEveryVersionAndEveryKeyHasARule) {
  const NemoRlTables& t = NemoRlTables::embedded();
  EXPECT_EQ(t.refs(), "v0.3.0 v0.4.0 v0.5.0 v0.6.0 v0.7.0 main");
  EXPECT_GT(t.keys().size(), 1500u);
  // Keys the issue found refused as "NeMo-RL does not define it".
  for (const char* k : {"policy.activation_checkpointing_enabled", "grpo.val_num_generations_per_prompt",
                        "loss_fn.mixed_kl_weight", "value_loss_fn.cliprange", "generation.max_new_tokens",
                        "policy.draft.model_name", "grpo.val_start_at", "policy.dequantize_base_checkpoint"})
    EXPECT_TRUE(t.known(k)) << k;
  EXPECT_TRUE(t.known("env.math.num_workers"));                  // under a free-form mapping
  EXPECT_TRUE(t.known("policy.hf_config_overrides.rope_scaling.type"));
  EXPECT_FALSE(t.known("policy.train_global_batch_sise"));
  EXPECT_FALSE(t.known("logger.x"));
  std::map<const SupportRule*, int> used;
  for (const auto& k : t.keys()) {
    const SupportRule* r = t.rule_for(k.name);
    ASSERT_NE(r, nullptr) << "no rule for NeMo-RL key '" << k.name << "'";
    ++used[r];
  }
  for (const auto& r : t.rules()) {
    // A subtree rule under a free-form mapping judges the keys users put there.
    std::string prefix;
    for (const auto& p : r.parts) prefix += (prefix.empty() ? "" : ".") + p;
    const bool under_tree = r.subtree && t.known(prefix + ".x");
    EXPECT_TRUE(used[&r] > 0 || under_tree) << "nemo_rl_support.tsv line " << r.line << ": '" << r.pattern << "' matches no NeMo-RL key";
    for (const auto& p : r.plugins)
      EXPECT_TRUE(p == "host" || fs::exists(fs::path(RLH_PLUGIN_DIR) / ("lib" + p + ".so")))
          << "nemo_rl_support.tsv line " << r.line << " names plugin '" << p << "', which this repository does not build";
  }
}

// policy.megatron_cfg.fp8_cfg.enabled = true needs an FP8 provider: refused at start naming the
// pattern a provider claims unless a loaded component claims it (examples/vendor_fp8 does);
// megatron's own claim on policy.megatron_cfg.* is not one. Off is accepted either way.
TEST(NemoRlKeys, Fp8IsRefusedWithoutAProviderThatClaimsIt) {
  auto check = [](const rlh::host::Json& enabled, std::vector<std::string> owned) {
    const rlh::host::Json cfg = {{"policy", {{"megatron_cfg", {{"fp8_cfg", {{"enabled", enabled}, {"fp8", "e4m3"}}}}}}}};
    return rlh::host::check_keys(cfg, owned, {"host", "megatron"}, [](const std::string&) { return "test.yaml"; });
  };
  const auto none = check(true, {"policy.megatron_cfg.*"});
  ASSERT_EQ(none.refused.size(), 1u);
  EXPECT_TRUE(std::regex_match(none.refused[0], kRefusal)) << none.refused[0];
  for (const char* part : {"config key 'policy.megatron_cfg.fp8_cfg.enabled' = true (from test.yaml)", "FP8 training",
                           "FP8 linear provider", "no loaded plugin claims policy.megatron_cfg.fp8_cfg.*"})
    EXPECT_NE(none.refused[0].find(part), std::string::npos) << none.refused[0];
  EXPECT_EQ(none.refused[0].find('\n'), std::string::npos);
  const auto with = check(true, {"policy.megatron_cfg.*", "policy.megatron_cfg.fp8_cfg.*"});
  EXPECT_TRUE(with.refused.empty()) << with.refused[0];
  EXPECT_TRUE(with.errors.empty());
  for (const auto& owned : {std::vector<std::string>{"policy.megatron_cfg.*"},
                            std::vector<std::string>{"policy.megatron_cfg.*", "policy.megatron_cfg.fp8_cfg.*"}}) {
    const auto off = check(false, owned);
    EXPECT_TRUE(off.refused.empty());
    EXPECT_TRUE(off.errors.empty());
  }
  EXPECT_EQ(NemoRlTables::embedded().rule_for("policy.megatron_cfg.fp8_cfg.enabled")->kind, SupportRule::Kind::provider);
  EXPECT_THROW(NemoRlTables("# refs: vA\na\tleaf\tvA\ts\n", "a\tprovider \tx\n"), rlh::host::ConfigError);
}

// vllm_cfg.precision: bf16 precisions pass without an FP8 provider, fp8 is refused naming the
// claim and what passes without it, and a loaded provider's claim lets fp8 through.
TEST(NemoRlKeys, Fp8RolloutsNeedAProviderThatClaimsThePrecision) {
  auto check = [](const char* precision, std::vector<std::string> owned) {
    const rlh::host::Json cfg = {{"policy", {{"generation", {{"vllm_cfg", {{"precision", precision}}}}}}}};
    return rlh::host::check_keys(cfg, owned, {"host", "generator"}, [](const std::string&) { return "test.yaml"; });
  };
  for (const char* ok : {"bfloat16", "float32"}) EXPECT_TRUE(check(ok, {}).refused.empty()) << ok;
  const auto none = check("fp8", {"policy.generation.native_cfg.*"});
  ASSERT_EQ(none.refused.size(), 1u);
  EXPECT_TRUE(std::regex_match(none.refused[0], kRefusal)) << none.refused[0];
  for (const char* part : {"'policy.generation.vllm_cfg.precision' = fp8", "FP8 rollouts",
                           "no loaded plugin claims policy.generation.vllm_cfg.precision",
                           "it accepts null, bfloat16, float16, float32 without one"})
    EXPECT_NE(none.refused[0].find(part), std::string::npos) << none.refused[0];
  const auto with = check("fp8", {"policy.generation.vllm_cfg.precision"});
  EXPECT_TRUE(with.refused.empty()) << with.refused[0];
  EXPECT_TRUE(with.errors.empty());
}

TEST(NemoRlKeys, RulesPickTheMostSpecificPatternAndJudgeValues) {
  const std::string keys =
      "# refs (NVIDIA-NeMo/RL): vA\na\tmap\tvA\tschema\na.b\tleaf\tvA\tschema\na.c\tmap\tvA\tschema\n"
      "a.c.d\tleaf\tvA\tschema\nt\ttree\tvA\tschema\n";
  const std::string rules =
      "a.*\timpl\tgrpo\na.b\tonly 1|null|bfloat16\tb things\na.*.d\toff\td things\nt\tonly {}|null\tt\nt.*\trefuse\tt\n";
  NemoRlTables t(keys, rules);
  EXPECT_EQ(t.rule_for("a.b")->detail, "b things");
  EXPECT_EQ(t.rule_for("a.c.d")->detail, "d things");
  EXPECT_EQ(t.rule_for("a")->kind, SupportRule::Kind::impl);
  EXPECT_EQ(t.rule_for("t")->kind, SupportRule::Kind::only);
  EXPECT_EQ(t.rule_for("t.x.y")->kind, SupportRule::Kind::refuse);
  EXPECT_TRUE(t.known("t.x.y"));
  EXPECT_FALSE(t.known("a.z"));
  const SupportRule& only = *t.rule_for("a.b");
  EXPECT_TRUE(only.accepts(1));
  EXPECT_TRUE(only.accepts(1.0));
  EXPECT_TRUE(only.accepts(nullptr));
  EXPECT_TRUE(only.accepts("bfloat16"));
  EXPECT_FALSE(only.accepts(2));
  EXPECT_FALSE(only.accepts("fp8"));
  const SupportRule& off = *t.rule_for("a.c.d");
  for (const auto& v : {rlh::host::Json(false), rlh::host::Json(nullptr), rlh::host::Json(0), rlh::host::Json(""),
                        rlh::host::Json::array(), rlh::host::Json::object()})
    EXPECT_TRUE(off.accepts(v)) << v.dump();
  EXPECT_FALSE(off.accepts(true));
  EXPECT_FALSE(off.accepts(4));
  EXPECT_FALSE(off.accepts("x"));
  EXPECT_THROW(NemoRlTables(keys, "a.b\tmaybe\tx\n"), rlh::host::ConfigError);
  EXPECT_THROW(NemoRlTables(keys, "a.b\tnoop\t\n"), rlh::host::ConfigError);
}

}  // namespace
