// The GRPO loop (see grpo_loop.hpp).
#include "grpo_loop.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "generation_ranks.hpp"
#include "loop_config.hpp"
#include "group_generation.hpp"
#include "loop_ranks.hpp"
#include "ppo_critic.hpp"
#include "rlhost/grpo/advantages.hpp"
#include "rlhost/grpo/config.hpp"
#include "rlhost/grpo/dynamic_sampling.hpp"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/packing.hpp"
#include "rlhost/grpo/reward_shaping.hpp"
#include "rlhost/grpo/seq_logprob_error.hpp"
#include "rlhost/sdk/checkpoint.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/sdk/launch_env.hpp"
#include "rlhost/sdk/metrics.hpp"
#include "rollout.hpp"
#include "rollout_wire.hpp"
#include "token_balance.hpp"

namespace rlh::grpo {

using json = nlohmann::json;
using sdk::Error;
namespace fs = std::filesystem;
namespace mn = sdk::metric_names;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// An environment column named "count/..." counts events (responses past the scoring budget):
// logged as the step's sum, not averaged like a reward (rlhost/environment.h).
bool is_count(const std::string& name) { return name.rfind("count/", 0) == 0; }

// Validation draws with its own RNG key range, apart from every training step's.
constexpr int64_t kValidationStepKey = int64_t{1} << 40;

// The generator component for policy.generation.backend. NeMo-RL names inference engines
// (vllm, sglang, ...) that do not exist here; those fall back to the best generator loaded.
std::string pick_generator(const sdk::Host& host, const std::string& wanted) {
  const rlh_component_desc* d = nullptr;
  rlh_status* s = host.api()->find_component(host.api()->ctx, RLH_KIND_GENERATOR, wanted.c_str(), &d);
  if (s == nullptr) return d->name;
  const std::string msg = sdk::status_message(s);
  const rlh_code code = s->code;
  rlh_status_destroy(s);
  static const char* const kNemoEngines[] = {"vllm", "sglang", "trtllm", "dynamo", "hf", "megatron"};
  if (code == RLH_E_NOT_FOUND &&
      std::find_if(std::begin(kNemoEngines), std::end(kNemoEngines),
                   [&](const char* e) { return wanted == e; }) != std::end(kNemoEngines)) {
    host.find<rlh_generator_api>(RLH_KIND_GENERATOR, nullptr, RLH_STRUCT_SIZE(rlh_generator_api, generate), &d);
    host.info("policy.generation.backend '" + wanted + "' is NeMo-RL's inference engine; using generator '" +
              d->name + "'");
    return d->name;
  }
  throw Error(code == RLH_E_NOT_FOUND ? RLH_E_INVALID_ARGUMENT : code,
              "policy.generation.backend: " + msg);
}

std::string resolve_model(const std::string& name, const char* key = "policy.model_name") {
  try {
    return sdk::resolve_model_path(name).string();
  } catch (const std::exception& e) {
    throw Error(RLH_E_NOT_FOUND, std::string(key) + ": " + e.what());
  }
}

// One training step's samples after generation and filtering.
struct StepSamples {
  std::vector<const Prompt*> prompts;    // per sample
  std::vector<const Response*> responses;
  std::vector<double> reward;            // the main reward after scaling and shaping
  std::vector<double> advantage;
  std::vector<double> loss_multiplier;   // sample_mask
  std::map<std::string, double> reward_means;  // every environment reward, mean over samples
};

}  // namespace

struct GrpoLoop::Impl {
  sdk::Host host;
  GrpoLoopConfig cfg;
  std::string config_yaml;
  Clock::time_point created = Clock::now();
  // Non-colocated generation (generation_ranks.hpp): the launch split into trainer and generator
  // ranks; null when colocated. Declared before the components that use its communicators.
  std::unique_ptr<GenerationRanks> placement;
  const sdk::Host& trainer_host() const { return placement ? placement->trainer_host() : host; }

  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Dataset> train_data, val_data;
  std::unique_ptr<Environment> env;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Generator> gen;
  rlh_model* policy = nullptr;
  rlh_model* reference = nullptr;
  std::unique_ptr<PromptOrder> order;
  std::unique_ptr<LossAdapter> loss;
  std::unique_ptr<sdk::CheckpointManager> ckpt;
  std::string model_dir;
  // PPO (built as `ppo`): its settings and the critic, a value model on the same backend.
  std::optional<PpoConfig> ppo;
  std::unique_ptr<Critic> critic;

  // Data parallelism (docs/parallelism.md): each data-parallel rank of the policy (every launched
  // rank, or under tensor/context/pipeline parallelism each model-parallel group, as the backend
  // names it: loop_ranks.hpp) generates, scores and trains on its share of every global batch
  // (whole prompt groups), and sums what NeMo-RL computes over the whole batch (loss
  // normalisers, metrics) over the data-parallel ranks. World rank 0 writes checkpoints' files;
  // the backend's collectives keep the rest.
  LoopRanks ranks;
  int dp_rank = 0, dp_size = 1;  // ranks.rank, ranks.size

  int64_t step = 0;  // training steps done
  int64_t announced = 0;  // asynchronous GRPO: the last step whose requests were sent ahead
  std::vector<std::pair<int64_t, double>> val_history;  // (step, validation accuracy) this run
  int64_t total_steps = 0;
  int64_t consumed_samples = 0;
  bool first_train_step_logged = false;
  bool generator_stale = true;
  std::map<std::string, double> refit_metrics;  // the last refit's, logged with the next step

  void check_cancel(const char* where) const {
    if (host.cancelled())
      throw Error(RLH_E_CANCELLED, std::string("GRPO cancelled (") + where + ") after step " + std::to_string(step));
  }

  void setup() {
    model_dir = resolve_model(cfg.policy.model_name);
    tok = std::make_unique<Tokenizer>(host, cfg.policy.tokenizer_name);
    tok->set_template_kwargs(cfg.policy.chat_template_kwargs);
    if (cfg.policy.prompt_format == PromptFormat::kChatTemplate && !tok->has_chat_template()) {
      if (cfg.policy.prompt_format_explicit)
        throw Error(RLH_E_INVALID_ARGUMENT, "policy.tokenizer.chat_template: \"default\" but the tokenizer " +
                                                cfg.policy.tokenizer_name + " has no chat template");
      host.info("tokenizer has no chat template: prompts are used as written");
      cfg.policy.prompt_format = PromptFormat::kRaw;
    }
    if (!cfg.data_note.empty()) host.info(cfg.data_note);
    train_data = std::make_unique<Dataset>(host, cfg.train_data.component, cfg.train_data.config, "data.train");
    if (cfg.validation_data)
      val_data = std::make_unique<Dataset>(host, cfg.validation_data->component, cfg.validation_data->config,
                                           "data.validation");
    else if (cfg.val_period > 0 || cfg.val_at_start || cfg.val_at_end)
      host.warn("grpo.val_period: no validation data (data.validation), so no validation runs");
    env = std::make_unique<Environment>(host, cfg.env_name, cfg.env_config);

    backend = std::make_unique<Backend>(trainer_host(), cfg.policy.backend, cfg.policy.section);
    policy = backend->load_model("policy", model_dir, true, policy_save_overrides(cfg.model_save_dtype));
    check_data_parallel();
    if (ppo) {
      critic = std::make_unique<Critic>(host, *backend, *ppo, resolve_model(ppo->model_name, "value.model_name"));
      critic->set_data_parallel(ranks.sums(), dp_rank, dp_size);
    }
    if (cfg.needs_reference() || (ppo && ppo->gae.kl_in_reward()))
      reference = backend->load_model("reference", model_dir, false);
    // A colocated tensor-parallel generator spans G consecutive trainer ranks: they must make the
    // same calls, so they must share a data-parallel rank (checked before the generator splits
    // the world into its groups).
    const int64_t gen_tp = placement ? 1 : cfg.generation.tensor_parallel_size;
    if (gen_tp > 1) check_colocated_generator_groups(gen_tp);
    gen = placement ? placement->remote_generator(cfg.generation.component + " on the generator ranks")
                    : make_generator();
    // tp/cp/pp ranks share the generation of their share: one part per rank, per generator rank
    // of the group when generation runs on ranks of its own, or per tensor-parallel generator.
    split_generation_over(host, *gen, ranks.group,
                          placement ? placement->parts_per_group() : gen_tp > 1 ? int(ranks.group_size() / gen_tp) : 0,
                          gen_tp > 1);

    loss = std::make_unique<LossAdapter>(cfg.loss);
    loss->set_make_status(host.make_status());
    {
      const double T = cfg.generation.train.temperature > 0 ? cfg.generation.train.temperature : 1.0;
      enable_device_loss(*loss, host, loss->output_specs(T, cfg.generation.train.top_k, cfg.generation.train.top_p));
    }

    const int64_t per_batch = cfg.dynamic_sampling.prompts_per_generation_batch();
    order = std::make_unique<PromptOrder>(train_data->size(), cfg.seed, cfg.shuffle);
    if (per_batch > train_data->size())
      throw Error(RLH_E_INVALID_ARGUMENT, "grpo.num_prompts_per_step: " + std::to_string(per_batch) +
                                              " prompts per step, but data.train has only " +
                                              std::to_string(train_data->size()) + " rows");
    const int64_t batches_per_epoch = train_data->size() / per_batch;
    total_steps = std::min(cfg.max_num_steps, cfg.max_num_epochs * batches_per_epoch);

    if (cfg.checkpointing.enabled) {
      ckpt = std::make_unique<sdk::CheckpointManager>(cfg.checkpointing);
      if (ranks.writer()) ckpt->clean_leftovers();
      ranks.barrier();  // nobody lists checkpoints while rank 0 cleans
    }
  }

  // The generator gets policy.generation; the native generator reads its own subsection
  // native_cfg from it (and takes the whole object as its settings when that key is absent).
  // A generator rank's part of the weights for the resharding refit: every tensor whole, or
  // under a tensor-parallel generator this rank's boxes of the generator's own plan (the model as
  // the generator describes it: native_cfg.model_component, else the MODEL component listing it).
  Needs generator_needs() const {
    const int64_t G = cfg.generation.tensor_parallel_size;
    if (G <= 1) return tensor_parallel_needs({}, 1, 0);
    std::string component;
    const json& native = cfg.generation.section.contains("native_cfg") ? cfg.generation.section["native_cfg"] : json();
    if (native.is_object() && native.contains("model_component") && native["model_component"].is_string())
      component = native["model_component"].get<std::string>();
    const int rank = sdk::Comm::world(trainer_host()).rank() % static_cast<int>(G);  // within its generator
    return tensor_parallel_needs(describe_model(host, model_dir, component), static_cast<int>(G), rank);
  }

  std::unique_ptr<Generator> make_generator() const {
    json gen_section = cfg.generation.section;
    if (!gen_section.contains("native_cfg")) gen_section["native_cfg"] = json::object();
    // trainer_host(): on a generator rank, the generator ranks' group is its world (a
    // tensor-parallel generator's groups are split from it).
    return std::make_unique<Generator>(trainer_host(), pick_generator(host, cfg.generation.component), model_dir,
                                       gen_section);
  }

  // The launched ranks that train (without the generator ranks of a non-colocated run), before
  // anything loads (every rank alike).
  void setup_data_parallel() {
    ranks = LoopRanks::of_launch(trainer_host());
  }

  // The data-parallel layout of a step, from the backend once the policy is loaded.
  void check_data_parallel() {
    const int64_t G = cfg.num_generations_per_prompt, gbs = cfg.policy.train_global_batch_size;
    ranks.follow_backend(trainer_host(), *backend, policy);
    dp_size = ranks.size;
    dp_rank = ranks.rank;
    // Generator ranks of their own: which trainer ranks feed which (generation_ranks.hpp).
    if (placement) placement->attach(trainer_host(), ranks);
    if (dp_size <= 1) return;
    const std::string n_ranks = std::to_string(dp_size) + " data-parallel ranks";
    // Each rank trains on gbs / N samples of every global batch, whole prompt groups, as
    // NeMo-RL shards each train_global_batch_size batch over its data-parallel workers.
    // PPO's critic trains on the same shards: its global batches must be the policy's.
    if (ppo && ppo->train_global_batch_size != gbs)
      throw Error(RLH_E_INVALID_ARGUMENT,
                  "value.train_global_batch_size = " + std::to_string(ppo->train_global_batch_size) +
                      " must equal policy.train_global_batch_size = " + std::to_string(gbs) + " with " + n_ranks +
                      " (the critic trains on the policy's shards)");
    if (gbs % (G * dp_size) != 0)
      throw Error(RLH_E_INVALID_ARGUMENT,
                  "policy.train_global_batch_size = " + std::to_string(gbs) + " must be a multiple of "
                  "grpo.num_generations_per_prompt x data-parallel ranks = " + std::to_string(G) + " x " +
                      std::to_string(dp_size) + " (each rank trains on whole prompt groups)");
  }

  // Colocated policy.generation.vllm_cfg.tensor_parallel_size = G: the generator's groups are G
  // consecutive world ranks (the generator plugin splits the world so), and each group must be a
  // run of one model-parallel group (same data-parallel rank, consecutive within the group), so
  // its ranks generate the same prompts. Collective over the world; every rank decides alike.
  void check_colocated_generator_groups(int64_t G) {
    const std::string key = "policy.generation.vllm_cfg.tensor_parallel_size = " + std::to_string(G);
    const int W = ranks.world_size;
    if (W % G != 0)
      throw Error(RLH_E_INVALID_ARGUMENT, key + " does not divide the " + std::to_string(W) + " colocated ranks");
    std::vector<double> where(size_t(2 * W), 0.0);  // per world rank: data-parallel rank, rank in its group
    where[size_t(2 * ranks.world_rank)] = ranks.rank;
    where[size_t(2 * ranks.world_rank + 1)] = ranks.group ? ranks.group.rank() : 0;
    if (ranks.world) ranks.world.all_reduce(std::span<double>(where), RLH_REDUCE_SUM);
    for (int r = 0; r < W; ++r) {
      const int first = r - r % int(G);
      if (where[size_t(2 * r)] != where[size_t(2 * first)] ||
          int64_t(where[size_t(2 * r + 1)]) % G != r % G)
        throw Error(RLH_E_INVALID_ARGUMENT,
                    key + " with colocated generation: ranks " + std::to_string(first) + ".." +
                        std::to_string(first + G - 1) + " would form one generator, but rank " + std::to_string(r) +
                        " trains on data-parallel share " + std::to_string(int64_t(where[size_t(2 * r)])) +
                        " and rank " + std::to_string(first) + " on share " +
                        std::to_string(int64_t(where[size_t(2 * first)])) +
                        " (G must divide the trainer's tensor x context parallel size; or set "
                        "policy.generation.colocated.enabled = false)");
    }
  }

  // The newest checkpoint that verifies (sizes, CRC32C, step numbers) and loads; a damaged one
  // is skipped with a warning and the one before it is used (resume_from_checkpoints).
  void resume() {
    if (!ckpt) return;  // (every rank reads the same folders; none writes here)
    resume_from_checkpoints(host, *ckpt, [&](const sdk::CheckpointInfo& c) {
      const json& info = c.training_info;
      const std::string where = (c.dir / "training_info.json").string();
      if (!info.is_object() || !info.contains("step") || !info.contains("data_order") ||
          !info["step"].is_number_integer() || !info.value("consumed_samples", json(0)).is_number_integer())
        throw Error(RLH_E_DATA_LOSS, where + ": not a GRPO checkpoint (no step, data_order or consumed_samples)");
      order->restore(info["data_order"], where);
      backend->load_state(policy, (c.dir / "policy").string());
      if (critic) {
        if (!fs::is_directory(c.dir / "value"))
          throw Error(RLH_E_DATA_LOSS, (c.dir / "value").string() + ": missing (not a PPO checkpoint: no critic)");
        critic->load((c.dir / "value").string());
      }
      step = info["step"].get<int64_t>();  // agrees with the folder's (verify_checkpoint)
      consumed_samples = info.value("consumed_samples", int64_t{0});
    });
  }

  // Hands the policy's weights to the generator when they changed since the last refit
  // (NeMo-RL's POLICY_GENERATION_STALE): at the start, after a resume and after training.
  double refit_if_stale() {
    if (!generator_stale) return 0;
    const auto t0 = Clock::now();
    gen->refit_from(*backend, policy);
    generator_stale = false;
    if (placement && ranks.writer()) {  // trainer 0's broadcast to the generator ranks (NeMo-RL's refit)
      refit_metrics["refit_bytes"] = placement->last_refit_bytes();
      refit_metrics["refit_bytes_total"] = placement->last_refit_bytes_total();
      refit_metrics["refit_broadcast_seconds"] = placement->last_refit_seconds();
    }
    return since(t0);
  }

  std::vector<Prompt> prompts_for(const Dataset& data, const std::vector<int64_t>& rows) const {
    std::vector<Prompt> out;
    out.reserve(rows.size());
    for (int64_t r : rows)
      out.push_back(make_prompt(*tok, cfg.policy.prompt_format, data.row(r), r, cfg.max_input_seq_length,
                                data.origin()));
    return out;
  }

  // ---- validation ------------------------------------------------------------------------------

  // NeMo-RL's _validation_early_stop_message: the line to stop with once validation's
  // grpo.stop_at_validation_metric reaches grpo.stop_at_validation_threshold (every rank has the
  // same summed metrics, so all decide alike).
  std::optional<std::string> early_stop(const std::map<std::string, double>& val, bool initial) const {
    if (!cfg.stop_at_validation_metric) return std::nullopt;
    const std::string& name = *cfg.stop_at_validation_metric;
    const auto it = val.find(name);
    if (it == val.end()) {
      std::string have;
      for (const auto& [k, v] : val) have += (have.empty() ? "" : ", ") + k;
      throw Error(RLH_E_INVALID_ARGUMENT, "grpo.stop_at_validation_metric: '" + name +
                                              "' is not a validation metric; available: " + have);
    }
    if (!(it->second >= cfg.stop_at_validation_threshold)) return std::nullopt;
    char line[256];
    std::snprintf(line, sizeof line, "%s %s reached the early-stop threshold (%.4f >= %g); stopping training",
                  initial ? "Initial validation" : "Validation", name.c_str(), it->second,
                  cfg.stop_at_validation_threshold);
    return std::string(line);
  }

  std::map<std::string, double> validate(int64_t at_step) {
    std::map<std::string, double> m;
    if (!val_data) return m;
    const auto t0 = Clock::now();
    refit_if_stale();
    const int64_t n = std::min(val_data->size(), cfg.max_val_samples.value_or(val_data->size()));
    double correct = 0, length = 0;
    std::map<std::string, double> sums;
    const auto& names = env->reward_names();
    for (const auto& name : names) sums[name] = 0;
    // Each data-parallel rank validates its contiguous share of the rows (keyed by their global
    // index, so the samples are those of one rank).
    const int64_t lo = n * dp_rank / dp_size, hi = n * (dp_rank + 1) / dp_size;
    for (int64_t b = lo; b < hi; b += cfg.val_batch_size) {
      check_cancel("validation");
      std::vector<int64_t> rows;
      for (int64_t i = b; i < std::min(hi, b + cfg.val_batch_size); ++i) rows.push_back(i);
      Rollout r = run_multi_turn_rollout(*gen, *tok, *env, prompts_for(*val_data, rows), 1, cfg.generation.validation,
                                         cfg.generation, cfg.policy.max_total_sequence_length, cfg.max_rollout_turns,
                                         cfg.seed, kValidationStepKey + at_step, b, nullptr);
      for (const Response& resp : r.responses) {
        for (size_t k = 0; k < names.size(); ++k) sums[names[k]] += resp.rewards[k];
        length += static_cast<double>(resp.ids.size());
      }
    }
    if (dp_size > 1) {
      std::vector<double> all = {length};
      for (const auto& [name, v] : sums) all.push_back(v);
      ranks.sum(all);
      length = all[0];
      size_t k = 1;
      for (auto& [name, v] : sums) v = all[k++];
    }
    correct = sums["reward"];
    m["accuracy"] = correct / static_cast<double>(n);
    m["avg_length"] = length / static_cast<double>(n);
    for (const auto& [name, sum] : sums)
      if (name != "reward") m[name] = is_count(name) ? sum : sum / static_cast<double>(n);
    val_history.emplace_back(at_step, m["accuracy"]);
    host.metric(mn::kValidationAccuracy, m["accuracy"], at_step);
    host.metric(mn::kValidationAvgLength, m["avg_length"], at_step);
    for (const auto& [name, v] : m)
      if (name != "accuracy" && name != "avg_length") host.metric(("validation/" + name).c_str(), v, at_step);
    host.metric(mn::kTimingValidation, since(t0), at_step);
    return m;
  }

  // ---- one step --------------------------------------------------------------------------------

  // Generation batches until the training batch is complete (one without dynamic sampling).
  // Rollouts are kept alive in `rollouts` because StepSamples points into them.
  StepSamples collect(int64_t s, std::vector<Rollout>& rollouts, std::map<std::string, double>& timers,
                      std::map<std::string, double>& metrics) {
    DynamicSampler sampler(cfg.dynamic_sampling);
    const int64_t per_batch = cfg.dynamic_sampling.prompts_per_generation_batch();
    const int64_t G = cfg.num_generations_per_prompt;
    std::vector<std::vector<double>> rewards, advantages, multipliers;
    rollouts.reserve(static_cast<size_t>(cfg.dynamic_sampling.dynamic_sampling_max_gen_batches) + 1);
    int64_t shaped_out_of_range = 0;
    const auto& names = env->reward_names();
    const size_t main_reward = static_cast<size_t>(std::find(names.begin(), names.end(), "reward") - names.begin());
    for (;;) {
      check_cancel("generation");
      auto t0 = Clock::now();
      const std::vector<int64_t> rows = order->next(per_batch);
      std::vector<Prompt> prompts = prompts_for(*train_data, rows);
      timers["data_processing"] += since(t0);
      RolloutTimes rt;
      const int64_t batch_index = sampler.num_gen_batches();
      if (dp_size > 1) {
        // What GRPO computes over a step's batch needs the whole batch: its per-prompt baselines
        // group the samples of equal prompts (a prompt drawn twice in one step is one group, as
        // NeMo-RL groups over the batch), and dynamic sampling keeps the first groups whose
        // rewards vary, in prompt order. The data-parallel ranks generate contiguous shares of
        // the batch (under their global indices: the samples one rank draws) and all-gather it
        // whole; every rank then scores, groups and selects as one rank does and trains on its
        // share of the selection (below).
        const int64_t a = per_batch * dp_rank / dp_size, b = per_batch * (dp_rank + 1) / dp_size;
        Rollout mine;
        mine.samples_per_prompt = G;
        if (b > a) {
          std::vector<Prompt> part(std::make_move_iterator(prompts.begin() + a), std::make_move_iterator(prompts.begin() + b));
          mine = run_multi_turn_rollout(*gen, *tok, *env, std::move(part), G, cfg.generation.train, cfg.generation,
                                        cfg.policy.max_total_sequence_length, cfg.max_rollout_turns, cfg.seed, s,
                                        batch_index * per_batch + a, &rt);
        }
        rollouts.push_back(all_gather_rollout(ranks.sums(), mine));
      } else {
        rollouts.push_back(run_multi_turn_rollout(*gen, *tok, *env, std::move(prompts), G, cfg.generation.train,
                                                  cfg.generation, cfg.policy.max_total_sequence_length,
                                                  cfg.max_rollout_turns, cfg.seed, s, batch_index * per_batch, &rt));
      }
      timers["generation"] += rt.generation;
      timers["reward_calculation"] += rt.reward;

      t0 = Clock::now();
      const Rollout& r = rollouts.back();
      const size_t n = r.responses.size();
      std::vector<double> reward(n);
      std::vector<int64_t> lengths(n);
      std::vector<uint8_t> truncated(n);
      std::vector<int32_t> prompt_tokens;
      std::vector<int64_t> prompt_offsets = {0};
      for (size_t i = 0; i < n; ++i) {
        const Response& resp = r.responses[i];
        reward[i] = resp.rewards[main_reward];
        lengths[i] = static_cast<int64_t>(resp.ids.size());
        truncated[i] = resp.truncated ? 1 : 0;
        const Prompt& p = r.prompts[static_cast<size_t>(resp.prompt)];
        prompt_tokens.insert(prompt_tokens.end(), p.ids.begin(), p.ids.end());
        prompt_offsets.push_back(static_cast<int64_t>(prompt_tokens.size()));
      }
      shaped_out_of_range += scale_rewards(cfg.reward_scaling, reward);
      const ShapedRewards shaped = apply_reward_shaping(cfg.reward_shaping, reward, lengths, truncated);
      const std::vector<int64_t> groups = group_by_prompt(prompt_tokens, prompt_offsets);
      const std::vector<double> ones(n, 1.0);
      // DAPO's filter looks at the spread of the unshaped reward.
      const BaselineStd bs = baseline_and_std_per_prompt(groups, shaped.unshaped, ones,
                                                         cfg.advantages.use_leave_one_out_baseline);
      std::vector<double> adv = grpo_advantages(cfg.advantages, groups, shaped.rewards, ones);
      std::vector<double> mult(n, 1.0);
      for (size_t i = 0; i < n; ++i)
        if (r.prompts[static_cast<size_t>(r.responses[i].prompt)].too_long) mult[i] = 0;
      if (cfg.overlong_filtering) apply_overlong_filtering(truncated, mult);
      rewards.push_back(shaped.rewards);
      advantages.push_back(std::move(adv));
      multipliers.push_back(std::move(mult));
      const bool done = sampler.add(groups, bs.std);
      timers["advantage_calculation"] += since(t0);
      if (done) break;
    }
    if (shaped_out_of_range > 0)
      host.warn(std::to_string(shaped_out_of_range) + " rewards fell outside grpo.reward_scaling's source range");
    const Metrics ds_metrics = sampler.metrics();  // by value: keep it alive while iterating
    for (const Metric& m : ds_metrics.items()) metrics[m.name] = m.value;

    StepSamples out;
    std::map<std::string, double> sums;
    std::vector<std::pair<int64_t, int64_t>> selected = sampler.selection();
    if (dp_size > 1) {
      // Every rank holds the one-rank selection: keep this rank's share of each
      // train_global_batch_size chunk (whole prompt groups: gbs is a multiple of G x ranks), as
      // NeMo-RL shards each global batch over its data-parallel workers.
      const auto gbs = static_cast<size_t>(cfg.policy.train_global_batch_size);
      std::vector<std::pair<int64_t, int64_t>> share;
      for (size_t c0 = 0; c0 < selected.size(); c0 += gbs)
        for (size_t k = c0 + gbs * static_cast<size_t>(dp_rank) / static_cast<size_t>(dp_size);
             k < c0 + gbs * static_cast<size_t>(dp_rank + 1) / static_cast<size_t>(dp_size) && k < selected.size(); ++k)
          share.push_back(selected[k]);
      selected = std::move(share);
    }
    for (const auto& [b, i] : selected) {
      const Rollout& r = rollouts[static_cast<size_t>(b)];
      const Response& resp = r.responses[static_cast<size_t>(i)];
      out.responses.push_back(&resp);
      out.prompts.push_back(&r.prompts[static_cast<size_t>(resp.prompt)]);
      out.reward.push_back(rewards[static_cast<size_t>(b)][static_cast<size_t>(i)]);
      out.advantage.push_back(advantages[static_cast<size_t>(b)][static_cast<size_t>(i)]);
      out.loss_multiplier.push_back(multipliers[static_cast<size_t>(b)][static_cast<size_t>(i)]);
      for (size_t k = 0; k < env->reward_names().size(); ++k) sums[env->reward_names()[k]] += resp.rewards[k];
    }
    for (const auto& [name, sum] : sums)
      out.reward_means[name] = is_count(name) ? sum : sum / static_cast<double>(out.responses.size());
    return out;
  }

  // Asynchronous GRPO: sends step `s`'s generation requests ahead, exactly those collect(s) will
  // make (the same prompts, shares and RNG keys; the data order itself moves in collect),
  // `batches` batches past the order's place now.
  void announce_rollouts(int64_t s, int64_t batches) {
    PromptOrder peek = *order;
    const int64_t per_batch = cfg.dynamic_sampling.prompts_per_generation_batch();
    for (int64_t i = 1; i < batches; ++i) peek.next(per_batch);
    const std::vector<Prompt> prompts = prompts_for(*train_data, peek.next(per_batch));
    std::vector<std::unique_ptr<GenerateRequest>> requests;
    auto request = [&](int64_t a, int64_t b) {
      const std::vector<Prompt> mine(prompts.begin() + a, prompts.begin() + b);
      requests.push_back(make_generate_request(*tok, mine, cfg.num_generations_per_prompt, cfg.generation.train,
                                               cfg.generation, cfg.policy.max_total_sequence_length, cfg.seed, s, a));
    };
    // collect's share: the whole batch on one rank, else this data-parallel rank's contiguous
    // part (none when the batch has fewer prompts than ranks; collect then generates nothing).
    const int64_t a = per_batch * dp_rank / dp_size, b = per_batch * (dp_rank + 1) / dp_size;
    if (b > a) request(a, b);
    // Under model parallelism the group splits each call (split_generation_over): this rank's
    // part, or nothing where another rank of the group feeds the generator ranks.
    std::vector<const rlh_generate_args*> ahead;
    rlh_generate_args part{};
    std::vector<int64_t> offsets;
    if (!requests.empty()) {  // (one request: the share's)
      const rlh_generate_args& whole = requests.front()->args;
      if (!ranks.group || ranks.group.size() <= 1)
        ahead.push_back(&whole);
      else if (const GroupPart p = part_of_call(whole, ranks.group.size(), ranks.group.rank(),
                                                placement->parts_per_group(), &part, &offsets);
               p.end > p.begin)
        ahead.push_back(&part);
    }
    placement->announce(ahead);
  }

  // How many weight versions the step's oldest sample is behind the generator's weights now
  // (0 on policy; up to max_trajectory_age_steps under asynchronous GRPO).
  double weight_lag(const StepSamples& ss) const {
    int64_t oldest = gen->version();
    for (const Response* r : ss.responses) oldest = std::min(oldest, r->weight_version);
    return static_cast<double>(gen->version() - oldest);
  }

  // The training batch: prompt + response per sample, with NeMo-RL's fields.
  PackedBatch build_batch(const StepSamples& ss) const {
    PackedBatch b;
    std::vector<int32_t> seq;
    for (size_t i = 0; i < ss.responses.size(); ++i) {
      seq = ss.prompts[i]->ids;
      seq.insert(seq.end(), ss.responses[i]->ids.begin(), ss.responses[i]->ids.end());
      b.add_sequence(seq);
    }
    auto& token_mask = b.field("token_mask", PackedBatch::Frame::kToken);
    auto& gen_lp = b.field("generation_logprobs", PackedBatch::Frame::kToken);
    auto& adv = b.field("advantages", PackedBatch::Frame::kToken);
    auto& sample_mask = b.field("sample_mask", PackedBatch::Frame::kSequence);
    std::vector<float>* rewards = nullptr;
    if (cfg.loss.positive_example_nll_weight > 0 || critic) rewards = &b.field("rewards", PackedBatch::Frame::kSequence);
    const auto& off = b.offsets();
    for (size_t i = 0; i < ss.responses.size(); ++i) {
      const int64_t start = off[i] + static_cast<int64_t>(ss.prompts[i]->ids.size());
      const Response& r = *ss.responses[i];
      // Multi-turn: the environment's observation tokens stay in the sequence but out of the loss.
      for (size_t t = 0; t < r.ids.size(); ++t) {
        token_mask[static_cast<size_t>(start) + t] = r.mask.empty() || r.mask[t] != 0 ? 1.0f : 0.0f;
        gen_lp[static_cast<size_t>(start) + t] = r.logprobs[t];
      }
      for (int64_t t = off[i]; t < off[i + 1]; ++t) adv[static_cast<size_t>(t)] = static_cast<float>(ss.advantage[i]);
      sample_mask[i] = static_cast<float>(ss.loss_multiplier[i]);
      if (rewards != nullptr) (*rewards)[i] = static_cast<float>(ss.reward[i]);
    }
    return b;
  }

  int64_t logprob_mb_tokens() const {
    return cfg.policy.logprob_mb_tokens > 0 ? cfg.policy.logprob_mb_tokens
                                            : cfg.policy.logprob_batch_size * cfg.policy.max_total_sequence_length;
  }

  rlh_output_spec spec(int32_t kind, const char* name) const {
    rlh_output_spec s{};
    s.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
    s.kind = kind;
    s.name = name;
    s.temperature = cfg.generation.train.temperature > 0 ? cfg.generation.train.temperature : 1.0;
    s.top_k = kind == RLH_OUTPUT_LOGPROB ? cfg.generation.train.top_k : 0;
    s.top_p = kind == RLH_OUTPUT_LOGPROB ? cfg.generation.train.top_p : 1.0;
    return s;
  }

  // prev_logprobs under the current policy and reference_policy_logprobs under the reference.
  void logprobs(PackedBatch& b) {
    std::vector<std::vector<float>> out;
    backend->forward(policy, b, {spec(RLH_OUTPUT_LOGPROB, "logprobs")}, out, logprob_mb_tokens());
    b.field("prev_logprobs", PackedBatch::Frame::kToken) = std::move(out[0]);
    if (reference != nullptr) {
      // The KL term compares unfiltered distributions (NeMo-RL's curr_logprobs_unfiltered).
      backend->forward(reference, b, {spec(RLH_OUTPUT_LOGPROB_RAW, "logprobs")}, out, logprob_mb_tokens());
      b.field("reference_policy_logprobs", PackedBatch::Frame::kToken) = std::move(out[0]);
    }
  }

  // NeMo-RL's compute_and_apply_seq_logprob_error_masking, between the logprobs and the
  // advantages: the per-sequence error metrics over the global batch, every step, and with
  // seq_logprob_error_threshold the samples past it out of the loss (their sample_mask 0).
  // NeMo-RL logs zeros where force_on_policy_ratio skips prev_logprobs; rlhost always has them.
  void mask_by_logprob_error(PackedBatch& b, const StepSamples& ss, std::map<std::string, double>& metrics) {
    const SeqLogprobError e =
        seq_logprob_error(b.offsets(), *b.find("token_mask"), *b.find("sample_mask"), *b.find("prev_logprobs"),
                          *b.find("generation_logprobs"), ss.reward, cfg.seq_logprob_error_threshold);
    std::vector<double> sums = {e.all.sum, e.all.count, e.kept.sum, e.kept.count, e.masked, e.masked_correct, e.kept_tokens};
    ranks.sum(sums);
    std::vector<double> hi = {e.all.max, e.kept.max}, lo = {e.all.min, e.kept.min};
    if (dp_size > 1) {
      ranks.sums().all_reduce(std::span<double>(hi), RLH_REDUCE_MAX);
      ranks.sums().all_reduce(std::span<double>(lo), RLH_REDUCE_MIN);
    }
    const SeqErrorStats all{sums[0], sums[1], hi[0], lo[0]}, kept{sums[2], sums[3], hi[1], lo[1]};
    for (const auto& [k, v] : seq_logprob_error_metrics(all, kept, sums[4], sums[5], cfg.seq_logprob_error_threshold.has_value()))
      metrics[k] = v;
    if (cfg.seq_logprob_error_threshold) b.field("sample_mask", PackedBatch::Frame::kSequence) = e.sample_mask;
    // NeMo-RL's PPO stops rather than take an optimizer step on an empty batch.
    if (critic && sums[6] == 0)
      throw Error(RLH_E_ABORTED, "ppo step " + std::to_string(step + 1) +
                                     ": no response token is left to train on (ppo.overlong_filtering and "
                                     "ppo.seq_logprob_error_threshold took every sample out)");
  }

  // Optimizer steps over train_global_batch_size chunks; sums as NeMo-RL's grpo_train does.
  void train(PackedBatch& b, std::map<std::string, double>& metrics) {
    const double T = cfg.generation.train.temperature > 0 ? cfg.generation.train.temperature : 1.0;
    const std::vector<rlh_output_spec> specs =
        loss->output_specs(T, cfg.generation.train.top_k, cfg.generation.train.top_p);
    // At DP > 1 this rank holds gbs / N samples of every global batch, in batch order.
    const int64_t gbs = cfg.policy.train_global_batch_size / dp_size;
    // The loss normalises by the global batch's counts: summed over the ranks' shares.
    auto counts = [&](const PackedBatch& chunk, const BatchMasks& masks) {
      std::vector<double> c = {masks.counts.tokens, masks.counts.seqs, 0.0};
      if (cfg.loss.positive_example_nll_weight > 0) {
        const std::vector<float>& rw = *chunk.find("rewards");
        std::vector<double> rwd(rw.begin(), rw.end());
        c[2] = positive_valid_tokens(masks.packing, masks.token_mask.data(), masks.sample_mask.data(), rwd.data());
      }
      ranks.sum(c);
      if (cfg.loss.positive_example_nll_weight > 0) loss->set_global_positive_tokens(c[2]);
      return ValidCounts{c[0], c[1]};
    };
    // Settings keep their last value; everything else sums over global batches, as NeMo-RL's
    // grpo_train does.
    auto extrema = [&](const Metrics& m) { return reduce_extrema(m); };
    ChunkedTrain t;
    if (dp_size > 1 && cfg.policy.train_mb_tokens > 0) {
      // Sequence packing or dynamic batching: the ranks' tokens are balanced (token_balance.hpp).
      BalancedBatch bb = balance_tokens(ranks.sums(), b, gbs);
      t = train_in_chunks(*backend, policy, bb.batch, bb.bounds, *loss, specs, cfg.policy.train_mb_tokens,
                          cfg.policy.train_micro_batch_size, step + 1, "train step", counts, extrema);
      metrics["dp_tokens_max"] = static_cast<double>(bb.max_tokens);
      metrics["dp_tokens_min"] = static_cast<double>(bb.min_tokens);
      metrics["dp_tokens_max_unbalanced"] = static_cast<double>(bb.plain_max_tokens);
      metrics["dp_tokens_min_unbalanced"] = static_cast<double>(bb.plain_min_tokens);
    } else {
      t = train_in_chunks(*backend, policy, b, gbs, *loss, specs, cfg.policy.train_mb_tokens,
                          cfg.policy.train_micro_batch_size, step + 1, "train step", counts, extrema);
    }
    metrics["loss"] = t.loss;
    metrics["grad_norm"] = t.grad_norm;
    for (const auto& [k, v] : t.summed) metrics[k] = v;
    for (const Metric& m : t.extrema.items()) metrics[m.name] = m.value;
  }

  // The loss's min/max metrics over every rank's micro-batches (each rank has some: it trains
  // on whole prompt groups of every chunk).
  Metrics reduce_extrema(const Metrics& mine) const {
    if (dp_size == 1) return mine;
    std::vector<double> lo, hi;
    for (const Metric& m : mine.items()) (m.reduce == Reduce::kMin ? lo : hi).push_back(m.value);
    std::vector<double> n = {double(lo.size()), double(hi.size())}, n_max = n;
    ranks.sums().all_reduce(std::span<double>(n_max), RLH_REDUCE_MAX);
    if (n_max != n)
      throw Error(RLH_E_INTERNAL, "grpo: the loss's min/max metrics differ between data-parallel ranks");
    if (!lo.empty()) ranks.sums().all_reduce(std::span<double>(lo), RLH_REDUCE_MIN);
    if (!hi.empty()) ranks.sums().all_reduce(std::span<double>(hi), RLH_REDUCE_MAX);
    Metrics out;
    size_t i = 0, j = 0;
    for (const Metric& m : mine.items()) out.add(m.name, m.reduce == Reduce::kMin ? lo[i++] : hi[j++], m.reduce);
    return out;
  }

  void save_checkpoint(int64_t s, const std::map<std::string, double>& val,
                       const std::map<std::string, double>& train_metrics) {
    // Rank 0 owns the folder (begin, side files, commit); every rank takes part in the
    // backend's save_state, which gathers the sharded state and has rank 0 write it.
    std::optional<sdk::PendingCheckpoint> pending;
    std::string dir;
    if (ranks.writer()) {
      pending.emplace(ckpt->begin(s));
      dir = pending->dir().string();
    }
    dir = ranks.broadcast_text(dir);
    const fs::path policy_dir = fs::path(dir) / "policy";
    if (ranks.writer()) fs::create_directories(policy_dir);
    backend->save_state(policy, policy_dir.string());
    if (critic) critic->save((fs::path(dir) / "value").string());  // NeMo-RL's step_N/value
    if (!ranks.writer()) return;
    // The tokenizer beside the weights, as NeMo-RL saves it (policy/tokenizer).
    const fs::path tok_src = fs::is_directory(cfg.policy.tokenizer_name) ? fs::path(cfg.policy.tokenizer_name)
                                                                        : fs::path(model_dir);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                          "chat_template.jinja", "generation_config.json"})
      if (fs::exists(tok_src / f)) {
        fs::create_directories(policy_dir / "tokenizer");
        fs::copy_file(tok_src / f, policy_dir / "tokenizer" / f, fs::copy_options::overwrite_existing);
      }
    json info = {{"step", s},
                 {"total_steps", total_steps},
                 {"consumed_samples", consumed_samples},
                 {"epoch", order->epoch()},
                 {"data_order", order->state()},
                 {"seed", cfg.seed}};
    for (const auto& [k, v] : val) info["val:" + k] = v;
    if (val.count("accuracy")) info["val_reward"] = val.at("accuracy");
    for (const auto& [k, v] : train_metrics) info["train:" + k] = v;
    pending->write_training_info(info);
    pending->write_config_yaml(config_yaml);
    const fs::path done = pending->commit();
    host.info("saved checkpoint " + done.string());
  }

  void run() {
    if (!cfg.generation.colocated) {
      placement = GenerationRanks::create(host, cfg.generation.generator_ranks, cfg.generation.resources_text,
                                          cfg.generation.tensor_parallel_size);
      placement->set_reshard(cfg.generation.refit_reshard);
      if (placement->is_generator()) {  // this rank only generates, for its trainer rank
        model_dir = resolve_model(cfg.policy.model_name);
        std::unique_ptr<Generator> mine = make_generator();
        placement->serve(*mine, [this] { return generator_needs(); });
        return;
      }
    }
    try {
      train_all();
    } catch (...) {
      if (placement) placement->abandon();  // its generator rank stops too
      throw;
    }
    if (placement) placement->finish();
  }

  void train_all() {
    setup_data_parallel();
    setup();
    resume();
    host.metric("rlhost/total_steps", static_cast<double>(total_steps), 0);
    if (step >= total_steps) {
      host.info("nothing to do: step " + std::to_string(step) + " of " + std::to_string(total_steps) +
                " already done");
      return;
    }
    SaveSchedule saves(cfg.checkpointing.must_save_by_s);  // where NeMo-RL's grpo_train starts its deadline
    if (cfg.val_at_start && step == 0 && val_data) {
      const std::optional<std::string> stop = early_stop(validate(0), true);
      host.metric("rlhost/step_finished", 0, 0);
      if (stop) {
        host.info(*stop);
        return;
      }
    }
    while (step < total_steps) {
      check_cancel("step start");
      const int64_t s = step + 1;
      const auto t_step = Clock::now();
      std::map<std::string, double> timers, metrics;

      const double refit = refit_if_stale();
      timers["prepare_for_generation/total"] = refit;
      timers["prepare_for_generation/transfer_and_update_weights"] = refit;

      std::vector<Rollout> rollouts;
      StepSamples ss = collect(s, rollouts, timers, metrics);
      if (cfg.async_grpo) {
        // The next max_trajectory_age_steps steps' rollouts are requested by now (the first step
        // of a run asks for all of them, later ones for the newest): the generator ranks draw
        // each with the weights in force when they reach it, while the trainers train.
        const int64_t last = std::min(total_steps, s + cfg.async_age);
        for (int64_t t = std::max(announced + 1, s + 1); t <= last; ++t) announce_rollouts(t, t - s);
        announced = std::max(announced, last);
      }
      for (const auto& [k, v] : refit_metrics) metrics[k] = v;
      if (cfg.async_grpo) metrics["generation_weight_lag"] = weight_lag(ss);

      check_cancel("logprobs");
      auto t0 = Clock::now();
      PackedBatch batch = build_batch(ss);
      timers["training_prep"] += since(t0);
      t0 = Clock::now();
      logprobs(batch);
      timers["policy_and_reference_logprobs"] = since(t0);
      mask_by_logprob_error(batch, ss, metrics);
      if (critic) {  // PPO: the critic's values, then GAE advantages and returns
        t0 = Clock::now();
        critic->values_and_advantages(batch, logprob_mb_tokens(), metrics);
        timers["value_inference"] = since(t0);
      }

      check_cancel("training");
      if (!first_train_step_logged) {
        first_train_step_logged = true;
        timers["startup"] = since(created);
      }
      t0 = Clock::now();
      if (critic) {
        // NeMo-RL's ppo.py: ppo_epochs passes over the batch, the critic first, then the policy
        // (from policy_training_start_step on: the steps before warm the critic up alone).
        // Metrics are the last pass's.
        const bool train_policy = step >= ppo->policy_training_start_step;
        double value_time = 0;
        for (int64_t e = 0; e < ppo->ppo_epochs; ++e) {
          const auto tv = Clock::now();
          critic->train(batch, s, metrics, [&](const Metrics& m) { return reduce_extrema(m); });
          value_time += since(tv);
          if (train_policy) train(batch, metrics);
        }
        timers["value_training"] = value_time;
        if (train_policy) generator_stale = true;
      } else {
        train(batch, metrics);
        generator_stale = true;
      }
      timers["policy_training"] = since(t0);
      step = s;

      // Rollout statistics, NeMo-RL's names, over the global batch (every rank's share).
      double gen_tokens = 0, prompt_tokens = 0, total_tokens = 0, truncated = 0;
      double env_tokens = 0, turns = 0, terminated = 0;  // multi-turn (NeMo-RL's rollout metrics)
      for (size_t i = 0; i < ss.responses.size(); ++i) {
        const double generated = static_cast<double>(ss.responses[i]->generated_tokens());
        gen_tokens += generated;
        env_tokens += static_cast<double>(ss.responses[i]->ids.size()) - generated;
        turns += static_cast<double>(ss.responses[i]->turns);
        terminated += ss.responses[i]->terminated ? 1 : 0;
        prompt_tokens += static_cast<double>(ss.prompts[i]->ids.size());
        truncated += ss.responses[i]->truncated ? 1 : 0;
      }
      double reward_sum = 0;
      for (double r : ss.reward) reward_sum += r;
      std::vector<double> sums = {static_cast<double>(ss.responses.size()), gen_tokens, prompt_tokens, truncated, reward_sum};
      for (const auto& [name, v] : ss.reward_means) sums.push_back(v * static_cast<double>(ss.responses.size()));
      sums.insert(sums.end(), {env_tokens, turns, terminated});
      ranks.sum(sums);
      const double n = sums[0];
      gen_tokens = sums[1];
      prompt_tokens = sums[2];
      truncated = sums[3];
      env_tokens = sums[sums.size() - 3];
      turns = sums[sums.size() - 2];
      terminated = sums[sums.size() - 1];
      total_tokens = gen_tokens + env_tokens + prompt_tokens;
      consumed_samples += static_cast<int64_t>(n);
      metrics["reward"] = sums[4] / n;
      size_t k = 5;
      for (const auto& [name, v] : ss.reward_means) {
        const double global = sums[k++] / n;
        if (name != "reward") metrics[name] = global;
      }
      metrics["mean_gen_tokens_per_sample"] = gen_tokens / n;
      metrics["mean_prompt_length"] = prompt_tokens / n;
      metrics["total_num_tokens"] = total_tokens;
      metrics["truncated_fraction"] = truncated / n;
      if (cfg.max_rollout_turns > 1) {
        metrics["avg_turns_per_sample"] = turns / n;
        metrics["natural_termination_rate"] = terminated / n;
        metrics["mean_env_tokens_per_sample"] = env_tokens / n;
      }

      // A checkpoint carries the validation of its own step only, as NeMo-RL's grpo_train (without
      // one it ranks last for keep_top_k).
      std::map<std::string, double> val;
      const bool last = step == total_steps;
      std::optional<std::string> stop;  // the validation metric reached its threshold
      // NeMo-RL's should_run_validation: periodic from grpo.val_start_at on, or the last step.
      if (val_data && ((cfg.val_period > 0 && step >= cfg.val_start_at && step % cfg.val_period == 0) ||
                       (last && cfg.val_at_end))) {
        val = validate(step);
        stop = early_stop(val, false);
      }
      const bool saved = saves.after_step(ranks, host, ckpt.get(), step, last, stop.has_value());
      if (saved) {
        t0 = Clock::now();
        save_checkpoint(step, val, metrics);
        timers["checkpointing"] = since(t0);
      }
      timers["total_step_time"] = since(t_step);

      for (const auto& [k, v] : metrics) host.metric(("train/" + k).c_str(), v, step);
      for (const auto& [k, v] : timers) host.metric(("timing/train/" + k).c_str(), v, step);
      host.metric("rlhost/step_finished", 0, step);
      if (stop && !last) {
        host.info(*stop);
        break;
      }
      if (saves.out_of_time() && !last) {
        host.info(stop_for_deadline(step, saved));
        break;
      }
    }
    if (!val_history.empty()) {
      auto best = val_history.front();
      for (const auto& v : val_history)
        if (v.second >= best.second) best = v;
      char line[256];
      std::snprintf(line, sizeof line,
                    "validation accuracy: %.3f at step %lld -> %.3f at step %lld (best %.3f at step %lld)",
                    val_history.front().second, static_cast<long long>(val_history.front().first),
                    val_history.back().second, static_cast<long long>(val_history.back().first), best.second,
                    static_cast<long long>(best.first));
      host.info(line);
    }
  }
};

GrpoLoop::GrpoLoop(const sdk::Host& host, const std::string& config_text, const std::string& algorithm)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  const json whole = parse_loop_config(config_text, algorithm.c_str());
  impl_->cfg = GrpoLoopConfig::from_json(whole, algorithm);
  if (algorithm == "ppo") {
    GrpoLoopConfig& c = impl_->cfg;
    impl_->ppo = PpoConfig::from_json(whole, c.policy, c.loss);
    // NeMo-RL's ppo.py asserts this: skipping the reference leaves no KL to compute.
    if (c.skip_reference_policy_logprobs && c.loss.reference_policy_kl_penalty != 0)
      throw ConfigError("ppo.skip_reference_policy_logprobs_calculation: true needs loss_fn.reference_policy_kl_penalty "
                        "= 0 (there is no reference to take a KL against)");
  } else if (impl_->cfg.loss.use_kl_in_reward) {
    throw ConfigError("loss_fn.use_kl_in_reward: the KL penalty in the reward is not implemented for GRPO (PPO has it); use false");
  }
  impl_->config_yaml = to_yaml(nlohmann::ordered_json::parse(config_text));
}

GrpoLoop::~GrpoLoop() = default;

void GrpoLoop::run() { impl_->run(); }

}  // namespace rlh::grpo
