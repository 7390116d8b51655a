// Reading the GRPO loop's configuration (see loop_config.hpp).
#include "loop_config.hpp"

#include <cctype>
#include <cmath>
#include <sstream>

#include "json_read.hpp"
#include "rlhost/grpo/config.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::grpo {

using detail::child;
using detail::positive;

using json = nlohmann::json;
using detail::describe;
using detail::Section;

namespace {

SamplingSettings read_sampling(const Section& g, const SamplingSettings& base, const char* prefix) {
  SamplingSettings s = base;
  const std::string p = prefix;
  g.read(p + "temperature", s.temperature);
  if (s.temperature < 0) throw ConfigError(g.key(p + "temperature") + ": must be >= 0 (0 = greedy)");
  g.read(p + "top_p", s.top_p);
  if (!(s.top_p > 0 && s.top_p <= 1)) throw ConfigError(g.key(p + "top_p") + ": must be in (0, 1]");
  std::optional<int64_t> k;
  if (g.has(p + "top_k")) {
    g.read(p + "top_k", k);
    // NeMo-RL writes null for "off"; vLLM's -1 means the same.
    if (k && *k < -1) throw ConfigError(g.key(p + "top_k") + ": must be null, -1 or >= 0");
    s.top_k = (!k || *k < 0) ? 0 : static_cast<int32_t>(*k);
  }
  if (p.empty()) {
    g.read("min_p", s.min_p);
    if (!(s.min_p >= 0 && s.min_p < 1)) throw ConfigError(g.key("min_p") + ": must be in [0, 1)");
  }
  return s;
}

}  // namespace

PolicyConfig read_policy_config(const json& whole, bool reward_model) {
  const json& pj = child(whole, "policy");
  if (!pj.is_object()) throw ConfigError("policy: missing (the model, tokenizer and backend settings)");
  const Section p(pj, "policy");
  // The backend gives a model loaded with reward_model_cfg.enabled a value head; only the rm
  // loop trains one (a GRPO, SFT or DPO policy would carry an unused head).
  if (const json& e = child(child(pj, "reward_model_cfg"), "enabled"); !reward_model && e.is_boolean() && e.get<bool>())
    throw ConfigError("policy.reward_model_cfg.enabled: true asks for a reward model, but this algorithm trains a "
                      "language model (--plugin rm trains reward models)");
  PolicyConfig c;
  c.section = pj;
  p.read("model_name", c.model_name);
  if (c.model_name.empty())
    throw ConfigError("policy.model_name: missing (an HF checkpoint folder or a hub id in the local cache)");
  const Section tok = p.sub("tokenizer");
  c.tokenizer_name = c.model_name;
  tok.read("name", c.tokenizer_name);
  if (const json* ct = tok.find("chat_template")) {
    c.prompt_format_explicit = true;
    // NeMo-RL: null = a passthrough template (prompts as written), "default" = the tokenizer's.
    if (ct->is_null()) c.prompt_format = PromptFormat::kRaw;
    else if (ct->is_string() && ct->get<std::string>() == "default") c.prompt_format = PromptFormat::kChatTemplate;
    else
      throw ConfigError("policy.tokenizer.chat_template: only null (raw prompts) or \"default\" (the "
                        "tokenizer's template) are supported, got " + describe(*ct));
  }
  if (const json* kw = tok.find("chat_template_kwargs"); kw != nullptr && !kw->is_null()) {
    if (!kw->is_object())
      throw ConfigError("policy.tokenizer.chat_template_kwargs: expected a mapping (e.g. {enable_thinking: false}) "
                        "or null, got " + describe(*kw));
    if (!kw->empty()) c.chat_template_kwargs = kw->dump();
  }

  bool dtensor = false, megatron = false;
  p.sub("dtensor_cfg").read("enabled", dtensor);
  p.sub("megatron_cfg").read("enabled", megatron);
  if (dtensor && megatron)
    throw ConfigError("policy.megatron_cfg.enabled: both dtensor_cfg and megatron_cfg are enabled; enable one");
  if (!dtensor && !megatron)
    throw ConfigError("policy.dtensor_cfg.enabled: no training backend is enabled (set "
                      "policy.dtensor_cfg.enabled or policy.megatron_cfg.enabled to true)");
  c.backend = megatron ? "megatron" : "dtensor";

  if (!p.has("max_total_sequence_length"))
    throw ConfigError("policy.max_total_sequence_length: missing");
  c.max_total_sequence_length = positive(p, "max_total_sequence_length", 1);
  if (p.has("train_global_batch_size")) c.train_global_batch_size = positive(p, "train_global_batch_size", 1);
  c.train_micro_batch_size = positive(p, "train_micro_batch_size", 1);
  c.logprob_batch_size = positive(p, "logprob_batch_size", c.train_micro_batch_size);

  bool packing = false, dynamic = false;
  const Section sp = p.sub("sequence_packing"), db = p.sub("dynamic_batching");
  sp.read("enabled", packing);
  db.read("enabled", dynamic);
  if (packing && dynamic)
    throw ConfigError("policy.sequence_packing.enabled: sequence packing and dynamic batching are "
                      "mutually exclusive (NeMo-RL); enable one");
  if (packing || dynamic) {
    const Section& s = packing ? sp : db;
    if (!s.has("train_mb_tokens")) throw ConfigError(s.key("train_mb_tokens") + ": missing");
    c.train_mb_tokens = positive(s, "train_mb_tokens", 1);
    c.logprob_mb_tokens = s.has("logprob_mb_tokens") ? positive(s, "logprob_mb_tokens", 1) : c.train_mb_tokens;
  }
  return c;
}

DataSource read_data_source(const json& data, const std::string& split, bool required) {
  const std::string origin = "data." + split;
  const json& sec = child(data, split.c_str());
  const json& train = child(data, "train");
  const json& deflt = child(data, "default");
  DataSource d;
  d.origin = origin;
  if (sec.is_object() || (split == "validation" && train.is_object())) {
    const json& own = sec.is_object() ? sec : json::object();
    const bool jsonl = own.contains("data_path") || deflt.contains("data_path") ||
                       (!own.contains("dataset_name") && split == "validation" &&
                        train.contains("data_path"));
    if (jsonl) {
      // The jsonl dataset reads NeMo-RL's whole data section (defaults, train, validation) and
      // picks the split itself.
      if (split == "validation" && !own.contains("data_path")) {
        double holdout = 0;
        Section(train, "data.train").read("split_validation_size", holdout);
        if (holdout <= 0) {
          if (required) throw ConfigError(origin + ": no validation data (set data.validation.data_path or "
                                                   "data.train.split_validation_size)");
          return DataSource{};
        }
      }
      d.component = "jsonl";
      d.config = data;
      d.config["split"] = split;
      return d;
    }
    if (own.contains("dataset_name") && !own["dataset_name"].is_null()) {
      if (!own["dataset_name"].is_string())
        throw ConfigError(origin + ".dataset_name: expected a string, got " + describe(own["dataset_name"]));
      d.component = own["dataset_name"].get<std::string>();
      d.config = own;
      d.config.erase("env_name");  // the loop's key, not the dataset's
      d.config["split"] = split;
      return d;
    }
    if (!sec.is_object() && split == "validation") return DataSource{};
    throw ConfigError(origin + ": set data_path (a JSONL file) or dataset_name (e.g. synthetic_arithmetic)");
  }
  if (required) throw ConfigError(origin + ": missing (the prompts to train on)");
  return DataSource{};
}

static GrpoLoopConfig read_loop_config(const json& whole, const std::string& section);

GrpoLoopConfig GrpoLoopConfig::from_json(const json& whole, const std::string& section) {
  if (section == "grpo") return read_loop_config(whole, section);
  // The shared readers name grpo.*; under ppo the same keys live in ppo.*.
  try {
    return read_loop_config(whole, section);
  } catch (const ConfigError& e) {
    std::string m = e.what();
    if (m.rfind("grpo", 0) == 0) m = section + m.substr(4);
    throw ConfigError(m);
  }
}

static GrpoLoopConfig read_loop_config(const json& whole, const std::string& section) {
  if (!whole.is_object()) throw ConfigError("configuration: expected a mapping");
  GrpoLoopConfig c;
  c.whole = whole;
  c.section = section;
  const bool ppo = section == "ppo";
  const json& gj = child(whole, section.c_str());
  const Section g(gj, section);
  c.num_prompts_per_step = positive(g, "num_prompts_per_step", c.num_prompts_per_step);
  c.num_generations_per_prompt = positive(g, "num_generations_per_prompt", c.num_generations_per_prompt);
  c.max_num_epochs = positive(g, "max_num_epochs", c.max_num_epochs);
  c.max_num_steps = positive(g, "max_num_steps", c.max_num_steps);
  g.read("val_period", c.val_period);
  if (c.val_period < 0) throw ConfigError(g.key("val_period") + ": must be >= 0 (0 = no periodic validation)");
  g.read("val_at_start", c.val_at_start);
  g.read("val_at_end", c.val_at_end);
  c.val_batch_size = positive(g, "val_batch_size", c.val_batch_size);
  g.read("max_val_samples", c.max_val_samples);
  if (c.max_val_samples && *c.max_val_samples <= 0)
    throw ConfigError(g.key("max_val_samples") + ": must be positive or null");
  g.read("overlong_filtering", c.overlong_filtering);
  g.read("seq_logprob_error_threshold", c.seq_logprob_error_threshold);
  if (!ppo) {
    std::optional<int64_t> start_at;
    g.read("val_start_at", start_at);
    if (start_at) c.val_start_at = *start_at;
    g.read("stop_at_validation_metric", c.stop_at_validation_metric);
    std::optional<double> threshold;
    g.read("stop_at_validation_threshold", threshold);
    if (c.stop_at_validation_metric) {
      if (!threshold)
        throw ConfigError(g.key("stop_at_validation_threshold") + ": must be set when " +
                          g.key("stop_at_validation_metric") + " is set");
      // pass@k is reported only with several validation rollouts a prompt, which rlhost does not run.
      if (*c.stop_at_validation_metric == "pass_k")
        throw ConfigError(g.key("stop_at_validation_metric") +
                          ": pass_k needs grpo.val_num_generations_per_prompt > 1, which rlhost does not run");
      c.stop_at_validation_threshold = *threshold;
    }
  }
  int64_t seed = static_cast<int64_t>(c.seed);
  g.read("seed", seed);
  c.seed = static_cast<uint64_t>(seed);
  g.read("skip_reference_policy_logprobs_calculation", c.skip_reference_policy_logprobs);
  c.max_rollout_turns = positive(g, "max_rollout_turns", c.max_rollout_turns);
  bool async = false;
  const Section ag = g.sub(ppo ? "async_ppo" : "async_grpo");
  ag.read("enabled", async);
  if (async) {
    // NeMo-RL's async GRPO (and PPO, whose critic trains beside the policy on the trainer
    // ranks): requests k steps ahead (generation_ranks.hpp), so no rollout is older than k
    // weight versions.
    std::optional<int64_t> age;
    ag.read("max_trajectory_age_steps", age);
    if (age && *age < 1)
      throw ConfigError(ag.key("max_trajectory_age_steps") + " = " + std::to_string(*age) + ": must be at least 1");
    if (age) c.async_age = *age;
    bool in_flight = false;
    if (const json* v = ag.find("in_flight_weight_updates"); v != nullptr && !v->is_null())
      ag.read("in_flight_weight_updates", in_flight);
    if (in_flight)
      throw ConfigError(ag.key("in_flight_weight_updates") +
                        ": true is not implemented (weights change between generation requests, never during one); use false");
    std::optional<int64_t> failures;
    ag.read("max_generation_failures", failures);
    if (failures && *failures != 0)
      throw ConfigError(ag.key("max_generation_failures") + " = " + std::to_string(*failures) +
                        ": retrying failed generations is not implemented (the first failure stops the run); use 0 or null");
    if (ppo) {
      // NeMo-RL main's async_ppo keys beside GRPO's: nothing is in flight across a restore here
      // (a resumed run's first step is on-policy), so incomplete targets are always dropped; a
      // generation lead during warm-up is not offered.
      bool drop = true;
      if (const json* v = ag.find("drop_incomplete_targets_on_restore"); v != nullptr && !v->is_null())
        ag.read("drop_incomplete_targets_on_restore", drop);
      if (!drop)
        throw ConfigError(ag.key("drop_incomplete_targets_on_restore") +
                          ": false is not implemented (a restored run keeps no rollouts in flight); use true or null");
      std::optional<int64_t> lead;
      ag.read("warmup_generation_lead_steps", lead);
      if (lead && *lead != 0)
        throw ConfigError(ag.key("warmup_generation_lead_steps") + " = " + std::to_string(*lead) +
                          ": a generation lead during warm-up is not implemented; use 0 or null");
    }
    c.async_grpo = true;
  }
  bool kl_in_reward = false;
  g.read("use_kl_in_reward", kl_in_reward);
  if (kl_in_reward)
    throw ConfigError("grpo.use_kl_in_reward: the KL penalty in the reward is not implemented; use false "
                      "(loss_fn.reference_policy_kl_penalty puts it in the loss)");
  if (!ppo) c.advantages = AdvantageConfig::from_json(gj);  // (PPO's are GAE's: PpoConfig)
  c.dynamic_sampling = DynamicSamplingConfig::from_json(gj);
  if (ppo && c.dynamic_sampling.use_dynamic_sampling)
    throw ConfigError("ppo.use_dynamic_sampling: dynamic sampling is not implemented for PPO; use false");
  c.reward_scaling = RewardScalingConfig::from_json(child(gj, "reward_scaling"));
  c.reward_shaping = RewardShapingConfig::from_json(child(gj, "reward_shaping"));
  c.loss = clipped_pg_config_from_json(child(whole, "loss_fn"));

  c.policy = read_policy_config(whole);
  if (c.policy.train_global_batch_size == 0)
    c.policy.train_global_batch_size = c.num_prompts_per_step * c.num_generations_per_prompt;
  const int64_t samples = c.num_prompts_per_step * c.num_generations_per_prompt;
  if (samples % c.policy.train_global_batch_size != 0)
    throw ConfigError("policy.train_global_batch_size: " + std::to_string(c.policy.train_global_batch_size) +
                      " must divide num_prompts_per_step * num_generations_per_prompt = " +
                      std::to_string(samples));

  // policy.generation
  const json& genj = child(c.policy.section, "generation");
  const Section gen(genj, "policy.generation");
  c.generation.section = genj.is_object() ? genj : json::object();
  std::optional<std::string> backend;
  gen.read("backend", backend);
  c.generation.component = backend.value_or("vllm");
  c.generation.max_new_tokens = c.policy.max_total_sequence_length;
  if (gen.has("max_new_tokens")) c.generation.max_new_tokens = positive(gen, "max_new_tokens", 1);
  {
    const Section co = gen.sub("colocated");
    if (const json* e = co.find("enabled"); e != nullptr && !e->is_null()) co.read("enabled", c.generation.colocated);
    if (!c.generation.colocated) {
      // (PPO too: its critic trains with the policy on the trainer ranks; only generation moves.)
      const Section res = co.sub("resources");
      std::optional<int64_t> gpus, nodes;
      res.read("gpus_per_node", gpus);
      res.read("num_nodes", nodes);
      if (!gpus || *gpus <= 0)
        throw ConfigError(res.key("gpus_per_node") +
                          ": must be a positive number of generator ranks when policy.generation.colocated.enabled is false");
      if (nodes && *nodes <= 0) throw ConfigError(res.key("num_nodes") + ": must be positive or null");
      c.generation.generator_ranks = *gpus * nodes.value_or(1);
      c.generation.resources_text = "policy.generation.colocated.resources: gpus_per_node x num_nodes = " +
                                    std::to_string(*gpus) + " x " + std::to_string(nodes.value_or(1));
    }
  }
  if (const json* tp = gen.sub("vllm_cfg").find("tensor_parallel_size"); tp != nullptr && !tp->is_null()) {
    if (!tp->is_number_integer() || tp->get<int64_t>() < 1)
      throw ConfigError("policy.generation.vllm_cfg.tensor_parallel_size: expected an integer >= 1, got " + describe(*tp));
    c.generation.tensor_parallel_size = tp->get<int64_t>();
    const std::string key = "policy.generation.vllm_cfg.tensor_parallel_size = " + std::to_string(c.generation.tensor_parallel_size);
    // Colocated, the trainer ranks host the groups of G (each group must share one data-parallel
    // rank, checked once the backend names its layout: grpo_loop.cpp).
    if (c.generation.generator_ranks % c.generation.tensor_parallel_size != 0)
      throw ConfigError(key + " does not divide the " + std::to_string(c.generation.generator_ranks) + " generator ranks (" +
                        c.generation.resources_text + ")");
  }
  if (const json* ml = gen.sub("vllm_cfg").find("max_model_len"); ml != nullptr && !ml->is_null()) {
    if (!ml->is_number_integer() || ml->get<int64_t>() < 1)
      throw ConfigError("policy.generation.vllm_cfg.max_model_len: expected an integer >= 1 or null, got " + describe(*ml));
    c.generation.max_model_len = ml->get<int64_t>();
    // Longer rollouts than the policy trains on would not fit its batches (NeMo-RL's configs set
    // it to ${policy.max_total_sequence_length}).
    if (c.generation.max_model_len > c.policy.max_total_sequence_length)
      throw ConfigError("policy.generation.vllm_cfg.max_model_len = " + std::to_string(c.generation.max_model_len) +
                        ": longer than policy.max_total_sequence_length = " +
                        std::to_string(c.policy.max_total_sequence_length) + " (rollouts must fit the policy's sequences)");
  }
  {
    const Section rl(child(whole, "rlhost"), "rlhost");
    rl.read("refit_reshard", c.generation.refit_reshard);
  }
  c.generation.train = read_sampling(gen, SamplingSettings{}, "");
  c.generation.validation = read_sampling(gen, c.generation.train, "val_");
  c.generation.validation.min_p = c.generation.train.min_p;
  if (const json* ids = gen.find("stop_token_ids"); ids != nullptr && !ids->is_null()) {
    if (!ids->is_array()) throw ConfigError("policy.generation.stop_token_ids: expected a list of token ids or null");
    for (const auto& v : *ids) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0)
        throw ConfigError("policy.generation.stop_token_ids: expected token ids, got " + describe(v));
      c.generation.stop_token_ids.push_back(v.get<int32_t>());
    }
  }
  if (const json* ss = gen.find("stop_strings"); ss != nullptr && !ss->is_null()) {
    if (!ss->is_array()) throw ConfigError("policy.generation.stop_strings: expected a list of strings or null");
    for (const auto& v : *ss) {
      if (!v.is_string() || v.get<std::string>().empty())
        throw ConfigError("policy.generation.stop_strings: expected non-empty strings, got " + describe(v));
      c.generation.stop_strings.push_back(v.get<std::string>());
    }
  }

  if (c.async_grpo) {
    // What training on older rollouts needs (NeMo-RL asks for the same): generator ranks of its
    // own, and the importance-sampling correction for rollouts drawn with older weights.
    const std::string on = ppo ? "ppo.async_ppo.enabled" : "grpo.async_grpo.enabled";
    if (c.generation.colocated)
      throw ConfigError(on + ": true needs policy.generation.colocated.enabled: false "
                        "(generation on ranks of its own, docs/parallelism.md)");
    if (!c.loss.use_importance_sampling_correction)
      throw ConfigError(on + ": true needs loss_fn.use_importance_sampling_correction: true "
                        "(the rollouts come from older weights)");
    if (c.dynamic_sampling.use_dynamic_sampling)
      throw ConfigError(section + ".use_dynamic_sampling: true with " + on + " is not implemented; use false");
    if (c.max_rollout_turns > 1)
      throw ConfigError(section + ".max_rollout_turns = " + std::to_string(c.max_rollout_turns) + " with " + on +
                        " is not implemented (single-turn rollouts only)");
  }

  // data
  const json& data = child(whole, "data");
  if (!data.is_object()) throw ConfigError("data: missing (the prompts to train on)");
  const Section ds(data, "data");
  ds.read("shuffle", c.shuffle);
  // GRPO prompts end with the chat template's generation prompt, as NeMo-RL's GRPO recipes set it.
  bool generation_prompt = true;
  ds.read("add_generation_prompt", generation_prompt);
  if (!generation_prompt && c.policy.prompt_format == PromptFormat::kChatTemplate)
    throw ConfigError("data.add_generation_prompt: false is not implemented for GRPO: its prompts end with the "
                      "chat template's generation prompt (use true)");
  c.max_input_seq_length = c.policy.max_total_sequence_length;
  if (ds.has("max_input_seq_length")) c.max_input_seq_length = positive(ds, "max_input_seq_length", 1);

  // env: data.<split>.env_name, data.default.env_name, else the only environment configured.
  const json& env = child(whole, "env");
  if (!env.is_null() && !env.is_object()) throw ConfigError("env: expected a mapping, got " + describe(env));
  if (env.is_object() && env.contains("sliding_puzzle_game") && !env["sliding_puzzle_game"].is_null()) {
    // NeMo-RL's sliding-puzzle example (grpo_sliding_puzzle.yaml, run by run_grpo_sliding_puzzle.py)
    // adds env.sliding_puzzle_game to the math recipe's defaults; its script plays that game and
    // generates the boards from env.sliding_puzzle_game.cfg, leaving the inherited data.* dataset
    // and env_name unread. rlhost does the same with the environments plugin's dataset of that
    // name; validation boards come from another seed.
    c.env_name = "sliding_puzzle_game";
    c.env_config = env["sliding_puzzle_game"];
    if (!c.env_config.is_object()) throw ConfigError("env.sliding_puzzle_game: expected a mapping, got " + describe(c.env_config));
    json game = c.env_config.value("cfg", json::object());
    if (!game.is_object()) throw ConfigError("env.sliding_puzzle_game.cfg: expected a mapping, got " + describe(game));
    c.train_data = DataSource{"sliding_puzzle_game", json{{"cfg", game}, {"split", "train"}}, "data.train"};
    if (!game.contains("seed") || game["seed"].is_number_integer())  // else the dataset names it
      game["seed"] = game.value("seed", int64_t{42}) + 1000003;
    c.validation_data = DataSource{"sliding_puzzle_game", json{{"cfg", game}, {"split", "validation"}}, "data.validation"};
    c.data_note = "env.sliding_puzzle_game: NeMo-RL's sliding-puzzle example: the prompts are the game's boards "
                  "(env.sliding_puzzle_game.cfg), data.* datasets and env_name are not read, as in its script";
  } else {
    std::optional<std::string> env_name;
    ds.sub("default").read("env_name", env_name);
    ds.sub("train").read("env_name", env_name);
    if (!env_name) {
      if (!env.is_object() || env.size() != 1)
        throw ConfigError("data.default.env_name: missing, and env has " +
                          std::to_string(env.is_object() ? env.size() : 0) +
                          " environments (name the one to use)");
      env_name = env.begin().key();
    }
    c.env_name = *env_name;
    if (env.is_object() && env.contains(c.env_name) && !env[c.env_name].is_null())
      c.env_config = env[c.env_name];
    c.train_data = read_data_source(data, "train", true);
    DataSource val = read_data_source(data, "validation", false);
    if (!val.component.empty()) c.validation_data = val;
  }

  // checkpointing
  const json& ck = child(whole, "checkpointing");
  c.checkpointing = sdk::CheckpointConfig::from_json(ck, "checkpointing");
  c.model_save_dtype = read_model_save_dtype(ck);
  return c;
}

std::string read_model_save_dtype(const json& ck) {
  const Section s(ck, "checkpointing");
  std::string fmt = "safetensors";
  s.read("model_save_format", fmt);
  if (fmt != "safetensors")
    throw ConfigError("checkpointing.model_save_format: only \"safetensors\" (HF) is written, got \"" + fmt + "\"");
  std::optional<std::string> dtype;
  s.read("model_save_dtype", dtype);
  if (!dtype) return "float32";
  if (*dtype != "float32" && *dtype != "bfloat16")
    throw ConfigError("checkpointing.model_save_dtype: expected float32 or bfloat16, got \"" + *dtype + "\"");
  return *dtype;
}

json policy_save_overrides(const std::string& model_save_dtype) {
  return model_save_dtype == "float32" ? json() : json{{"save_dtype", model_save_dtype}};
}

// ---- config.yaml -------------------------------------------------------------------------------

namespace {

bool plain_key(const std::string& k) {
  if (k.empty()) return false;
  for (char ch : k)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.' || ch == '/'))
      return false;
  return true;
}

void emit(std::ostringstream& out, const nlohmann::ordered_json& j, int indent) {
  const std::string pad(static_cast<size_t>(indent), ' ');
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      out << pad << (plain_key(it.key()) ? it.key() : json(std::string(it.key())).dump()) << ":";
      const auto& v = it.value();
      if ((v.is_object() || v.is_array()) && !v.empty()) {
        out << "\n";
        emit(out, v, indent + 2);
      } else {
        out << " " << (v.is_object() ? "{}" : v.is_array() ? "[]" : v.dump()) << "\n";
      }
    }
  } else if (j.is_array()) {
    for (const auto& v : j) {
      if ((v.is_object() || v.is_array()) && !v.empty()) {
        out << pad << "-\n";
        emit(out, v, indent + 2);
      } else {
        out << pad << "- " << (v.is_object() ? "{}" : v.is_array() ? "[]" : v.dump()) << "\n";
      }
    }
  } else {
    out << pad << j.dump() << "\n";
  }
}

}  // namespace

nlohmann::json parse_loop_config(const std::string& config_text, const char* algorithm) {
  try {
    return nlohmann::json::parse(config_text);
  } catch (const nlohmann::json::exception& e) {
    throw sdk::Error(RLH_E_INVALID_ARGUMENT, std::string(algorithm) + ": the configuration is not valid JSON: " + e.what());
  }
}

std::string to_yaml(const nlohmann::ordered_json& j) {
  std::ostringstream out;
  emit(out, j, 0);
  return out.str();
}

}  // namespace rlh::grpo
