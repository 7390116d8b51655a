// The DPO and RM loops (see preference_loop.hpp).
#include "preference_loop.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "json_read.hpp"
#include "loop_config.hpp"
#include "loop_ranks.hpp"
#include "message_log.hpp"
#include "rlhost/grpo/config.hpp"
#include "rlhost/grpo/dpo_loss.hpp"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/packing.hpp"
#include "rlhost/sdk/checkpoint.hpp"
#include "rollout.hpp"

namespace rlh::grpo {

using detail::child;
using detail::positive;

using json = nlohmann::json;
using sdk::Error;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The metrics each loss reports, in NeMo-RL's DPOValMetrics / RMValMetrics order
// (num_valid_samples is the weight of the validation average, not averaged itself).
const std::vector<const char*> kDpoMetrics = {"loss", "sft_loss", "preference_loss", "accuracy",
                                              "rewards_chosen_mean", "rewards_rejected_mean"};
const std::vector<const char*> kRmMetrics = {"loss", "accuracy", "rewards_chosen_mean", "rewards_rejected_mean"};

// NeMo-RL's dpo section (DPOConfig) or rm section (RMConfig), with their defaults, and what the
// loop reads of the others.
struct PreferenceLoopConfig {
  PreferenceAlgorithm algorithm = PreferenceAlgorithm::dpo;
  int64_t max_num_epochs = 1;
  int64_t max_num_steps = 150;  // rm: -1 = as many as the epochs hold
  int64_t val_period = 25;
  int64_t val_batches = 8;  // <= 0 = the whole validation set
  int64_t val_global_batch_size = 8;
  int64_t val_micro_batch_size = 1;
  bool val_at_start = true;
  bool val_at_end = false;
  uint64_t seed = 42;
  DpoConfig loss;
  PolicyConfig policy;
  DataSource train;
  std::optional<DataSource> validation;
  bool shuffle = true;
  // data.max_input_seq_length (default max_total_sequence_length): a pair with a side longer is
  // not trained on (NeMo-RL's preference processor's loss_multiplier 0).
  int64_t max_seq_length = 0;
  sdk::CheckpointConfig checkpointing;
  std::string model_save_dtype = "float32";

  static PreferenceLoopConfig from_json(const json& whole, PreferenceAlgorithm algorithm) {
    PreferenceLoopConfig c;
    c.algorithm = algorithm;
    const bool rm = algorithm == PreferenceAlgorithm::rm;
    const char* const name = rm ? "rm" : "dpo";
    if (rm) {  // NeMo-RL's RMConfig defaults
      c.max_num_steps = -1;
      c.val_period = 16;
      c.val_batches = -1;
      c.val_global_batch_size = 32;
      c.val_at_start = false;
    }
    const json& dj = child(whole, name);
    if (!dj.is_null() && !dj.is_object()) throw ConfigError(std::string(name) + ": expected a mapping");
    const detail::Section s(dj, name);
    c.max_num_epochs = positive(s, "max_num_epochs", c.max_num_epochs);
    if (rm) {
      s.read("max_num_steps", c.max_num_steps);
      if (c.max_num_steps != -1 && c.max_num_steps <= 0)
        throw ConfigError("rm.max_num_steps: expected a positive integer or -1 (no limit but the epochs), got " +
                          std::to_string(c.max_num_steps));
      if (c.max_num_steps == -1) c.max_num_steps = std::numeric_limits<int64_t>::max();
    } else {
      c.max_num_steps = positive(s, "max_num_steps", c.max_num_steps);
    }
    s.read("val_period", c.val_period);
    if (c.val_period < 0) throw ConfigError(s.key("val_period") + ": must be >= 0 (0 = no periodic validation)");
    s.read("val_batches", c.val_batches);  // NeMo-RL: any value <= 0 validates on everything
    c.val_global_batch_size = positive(s, "val_global_batch_size", c.val_global_batch_size);
    c.val_micro_batch_size = positive(s, "val_micro_batch_size", c.val_micro_batch_size);
    s.read("val_at_start", c.val_at_start);
    s.read("val_at_end", c.val_at_end);
    int64_t seed = static_cast<int64_t>(c.seed);
    s.read("seed", seed);
    c.seed = static_cast<uint64_t>(seed);
    if (!rm) {
      c.loss = DpoConfig::from_json(dj.is_object() ? dj : json::object());
      auto finite = [](double v, const char* key, bool nonneg) {
        if (!std::isfinite(v) || (nonneg && v < 0))
          throw ConfigError(std::string("dpo.") + key + ": expected a finite " + (nonneg ? "non-negative " : "") +
                            "number, got " + std::to_string(v));
      };
      finite(c.loss.reference_policy_kl_penalty, "reference_policy_kl_penalty", false);
      finite(c.loss.preference_loss_weight, "preference_loss_weight", true);
      finite(c.loss.sft_loss_weight, "sft_loss_weight", true);
    }
    c.policy = read_policy_config(whole, rm);
    // The policy is a reward model exactly when reward_model_cfg.enabled says so (NeMo-RL's
    // rm.yaml: "do not change"); the backend reads it and adds the value head.
    const json& rmc = child(child(whole, "policy"), "reward_model_cfg");
    const json& enabled = child(rmc, "enabled");
    if (rm && (!enabled.is_boolean() || !enabled.get<bool>()))
      throw ConfigError("policy.reward_model_cfg.enabled: " + (enabled.is_null() ? std::string("missing") : enabled.dump()) +
                        ", but rm trains a reward model (set it true, as NeMo-RL's rm.yaml does)");
    if (rm && !child(rmc, "reward_model_type").is_null() && child(rmc, "reward_model_type") != "bradley_terry")
      throw ConfigError("policy.reward_model_cfg.reward_model_type: " + child(rmc, "reward_model_type").dump() +
                        " is not supported (only \"bradley_terry\")");
    if (c.policy.train_global_batch_size <= 0)
      throw ConfigError("policy.train_global_batch_size: missing (preference pairs per step)");
    const json& data = child(whole, "data");
    if (!data.is_object()) throw ConfigError("data: missing (the preference pairs to train on)");
    const detail::Section d(data, "data");
    d.read("shuffle", c.shuffle);
    c.max_seq_length = c.policy.max_total_sequence_length;
    if (const json* m = d.find("max_input_seq_length"); m != nullptr && !m->is_null())
      c.max_seq_length = positive(d, "max_input_seq_length", c.max_seq_length);
    c.train = read_data_source(data, "train", true);
    DataSource v = read_data_source(data, "validation", false);
    if (!v.component.empty()) c.validation = v;
    // NeMo-RL validates with no validation set only by failing; here the key asking for it is named.
    if (!c.validation) {
      if (c.val_period > 0) throw ConfigError(s.key("val_period") + ": " + std::to_string(c.val_period) +
                                              " but data.validation is missing (set 0, or give validation pairs)");
      if (c.val_at_start) throw ConfigError(s.key("val_at_start") + ": true but data.validation is missing");
      if (c.val_at_end) throw ConfigError(s.key("val_at_end") + ": true but data.validation is missing");
    }
    c.checkpointing = sdk::CheckpointConfig::from_json(child(whole, "checkpointing"), "checkpointing");
    c.model_save_dtype = read_model_save_dtype(child(whole, "checkpointing"));
    return c;
  }
};

}  // namespace

struct PreferenceLoop::Impl {
  sdk::Host host;
  PreferenceLoopConfig cfg;
  std::string config_yaml;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Dataset> train_data, val_data;
  std::unique_ptr<Backend> backend;
  rlh_model* policy = nullptr;
  rlh_model* reference = nullptr;
  std::unique_ptr<PromptOrder> order;
  std::unique_ptr<LossAdapter> loss;
  std::unique_ptr<sdk::CheckpointManager> ckpt;
  std::string model_dir;
  int64_t step = 0, total_steps = 0;
  // Every data-parallel rank trains on its share of each global batch, whole pairs (loop_ranks.hpp).
  LoopRanks ranks;

  bool rm() const { return cfg.algorithm == PreferenceAlgorithm::rm; }
  const char* what() const { return rm() ? "RM" : "DPO"; }
  const std::vector<const char*>& loss_metrics() const { return rm() ? kRmMetrics : kDpoMetrics; }

  void check_cancel() const {
    if (host.cancelled()) throw Error(RLH_E_CANCELLED, std::string(what()) + " cancelled after step " + std::to_string(step));
  }

  // The tokens of context + completion as NeMo-RL's preference processor builds them
  // (message_log.hpp with its defaults: BOS and EOS added where missing, no generation prompt),
  // and the mask on the completion's last message (its collate: the final assistant turn).
  void render(const json& context, const json& completion, std::vector<int32_t>& ids, std::vector<float>& mask,
              const std::string& where) const {
    json all = context;
    for (const auto& m : completion) all.push_back(m);
    if (all.size() > kMaxConversationMessages)
      throw Error(RLH_E_INVALID_ARGUMENT, where + " has " + std::to_string(all.size()) + " messages, more than the " +
                                              std::to_string(kMaxConversationMessages) + " a conversation row takes");
    MessageLogOptions o;
    o.format = cfg.policy.prompt_format;
    o.max_tokens = cfg.max_seq_length + 1;  // a side that long drops the pair: no need to render the rest
    message_log_row(formatted_message_log(*tok, all, o), all, true, ids, mask);
  }

  // Row `index` as two sequences (chosen, rejected) with their token masks and sample masks.
  void add_pair(PackedBatch& b, std::vector<std::vector<float>>& masks, std::vector<float>& sample_mask,
                const Dataset& data, int64_t index) const {
    const json row = data.row(index);
    const std::string where = data.origin() + ": row " + std::to_string(index);
    // dataset_jsonl checks every row when it indexes the file; another dataset component's rows
    // are checked here, one line naming the row.
    auto it = row.find("context");
    auto cs = row.find("completions");
    auto messages = [](const json& v) {
      if (!v.is_array() || v.empty()) return false;
      for (const auto& m : v)
        if (!m.is_object() || !m.contains("content") || !m["content"].is_string() || !m.contains("role") ||
            !m["role"].is_string())
          return false;
      return true;
    };
    if (it == row.end() || !messages(*it) || cs == row.end() || !cs->is_array() || cs->size() != 2 ||
        !(*cs)[0].is_object() || !(*cs)[1].is_object() || !messages((*cs)[0].value("completion", json())) ||
        !messages((*cs)[1].value("completion", json())))
      throw Error(RLH_E_INVALID_ARGUMENT,
                  where + " is not a preference row ('context' messages and two 'completions', chosen first; "
                          "data.train.dataset_name: BinaryPreferenceDataset or PreferenceDataset)");
    std::vector<int32_t> ids[2];
    std::vector<float> mask[2];
    for (int k = 0; k < 2; ++k)
      render(*it, (*cs)[k]["completion"], ids[k], mask[k], where + (k == 0 ? " (chosen)" : " (rejected)"));
    // NeMo-RL: a pair with either side past data.max_input_seq_length is not trained on
    // (loss_multiplier 0 for both); sides past max_total_sequence_length are cut to fit.
    const auto max_len = static_cast<size_t>(cfg.policy.max_total_sequence_length);
    const float keep = std::max(ids[0].size(), ids[1].size()) > static_cast<size_t>(cfg.max_seq_length) ? 0.0f : 1.0f;
    for (int k = 0; k < 2; ++k) {
      if (ids[k].size() > max_len) {
        ids[k].resize(max_len);
        mask[k].resize(max_len);
      }
      b.add_sequence(ids[k]);
      masks.push_back(std::move(mask[k]));
      sample_mask.push_back(keep);
    }
  }

  PackedBatch make_batch(const Dataset& data, const std::vector<int64_t>& rows) {
    PackedBatch b;
    std::vector<std::vector<float>> masks;
    std::vector<float> keep;
    for (int64_t r : rows) add_pair(b, masks, keep, data, r);
    auto& tm = b.field("token_mask", PackedBatch::Frame::kToken);
    size_t at = 0;
    for (const auto& m : masks) {
      std::copy(m.begin(), m.end(), tm.begin() + static_cast<std::ptrdiff_t>(at));
      at += m.size();
    }
    b.field("sample_mask", PackedBatch::Frame::kSequence) = keep;
    if (rm()) return b;  // a reward model compares its own scores: no reference
    // Reference logprobs of the frozen starting model (NeMo-RL's get_reference_policy_logprobs).
    rlh_output_spec spec{};
    spec.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
    spec.kind = RLH_OUTPUT_LOGPROB_RAW;
    spec.name = "logprobs";
    spec.temperature = 1.0;
    spec.top_p = 1.0;
    std::vector<std::vector<float>> out;
    backend->forward(reference, b, {spec}, out,
                     cfg.policy.train_mb_tokens > 0
                         ? cfg.policy.train_mb_tokens
                         : 2 * cfg.policy.train_micro_batch_size * cfg.policy.max_total_sequence_length);
    b.field("reference_policy_logprobs", PackedBatch::Frame::kToken) = std::move(out[0]);
    return b;
  }

  Backend::TrainResult step_on(PackedBatch& b, bool eval_only) {
    const BatchMasks masks(b);
    const std::vector<rlh_output_spec> specs = loss->output_specs(1.0, 0, 1.0);
    // Micro-batches count sequences: a pair is two (NeMo-RL's mbs * 2).
    const int64_t mb_pairs = eval_only ? cfg.val_micro_batch_size : cfg.policy.train_micro_batch_size;
    // `b` is this rank's share: the loss normalises by the global batch's counts (the backend
    // sums the loss and the loss's metrics over the ranks).
    const ValidCounts global = ranks.sum(masks.counts);
    const rlh_train_args a = train_args(b, specs, *loss, global, cfg.policy.train_mb_tokens, 2 * mb_pairs,
                                        eval_only, RLH_BATCH_NEVER_SPLIT_SEQUENCE | RLH_BATCH_KEEP_PAIRS);
    Backend::TrainResult r = backend->train_step(policy, a);
    stop_on_nonfinite(r.loss, eval_only ? 0.0 : r.grad_norm, eval_only ? step : step + 1,
                      eval_only ? "validation at step" : "train step");
    return r;
  }

  static double metric_of(const Backend::TrainResult& r, const char* name) {
    if (!r.metrics.contains("metrics") || !r.metrics["metrics"].is_object()) return 0;
    const json& m = r.metrics["metrics"];
    return m.contains(name) && m[name].is_number() ? m[name].get<double>() : 0.0;
  }

  // NeMo-RL's validate_one_dataset: per batch, the loss's metrics (averages over the batch's
  // valid pairs); over batches, their average weighted by each batch's valid pairs.
  std::map<std::string, double> validate(int64_t at) {
    const auto t0 = Clock::now();
    const int64_t bs = cfg.val_global_batch_size;
    int64_t batches = (val_data->size() + bs - 1) / bs;
    if (cfg.val_batches > 0) batches = std::min(batches, cfg.val_batches);
    std::map<std::string, double> sum;
    double pairs = 0;
    for (int64_t k = 0; k < batches; ++k) {
      check_cancel();
      std::vector<int64_t> rows;
      for (int64_t i = k * bs; i < std::min(val_data->size(), (k + 1) * bs); ++i) rows.push_back(i);
      PackedBatch b = make_batch(*val_data, ranks.share(rows));  // this rank's pairs of the batch
      const Backend::TrainResult r = step_on(b, true);
      const double n = metric_of(r, "num_valid_samples");
      for (const char* m : loss_metrics()) sum[m] += (std::string(m) == "loss" ? r.loss : metric_of(r, m)) * n;
      pairs += n;
    }
    std::map<std::string, double> out;
    for (const char* m : loss_metrics()) out[m] = pairs > 0 ? sum[m] / pairs : 0.0;
    out["num_valid_samples"] = pairs;
    if (pairs == 0) host.warn("validation at step " + std::to_string(at) + ": no valid pairs (all too long?)");
    for (const auto& [k, v] : out) host.metric(("validation-default/" + k).c_str(), v, at);
    host.metric("timing/validation-default/total_validation_time", since(t0), at);
    return out;
  }

  void save(int64_t s, const std::optional<std::map<std::string, double>>& val, const std::map<std::string, double>& train) {
    // Rank 0 owns the folder; every rank takes part in the backend's save_state.
    std::optional<sdk::PendingCheckpoint> owned =
        begin_policy_checkpoint(ranks, *ckpt, s, *backend, policy, cfg.policy.tokenizer_name, model_dir);
    if (!owned) return;
    sdk::PendingCheckpoint& pending = *owned;
    json info = {{"step", s}, {"total_steps", total_steps}, {"epoch", order->epoch()},
                 {"data_order", order->state()}, {"seed", cfg.seed}};
    // checkpointing.metric_name reads these: "train:loss", "val:validation-default_loss", ...
    for (const auto& [k, v] : train) info["train:" + k] = v;
    if (val)
      for (const auto& [k, v] : *val) info["val:validation-default_" + k] = v;
    pending.write_training_info(info);
    pending.write_config_yaml(config_yaml);
    host.info("saved checkpoint " + pending.commit().string());
  }

  void run() {
    ranks = LoopRanks::of_launch(host);
    model_dir = resolve_policy_dir(cfg.policy.model_name);
    tok = std::make_unique<Tokenizer>(host, cfg.policy.tokenizer_name);
    tok->set_template_kwargs(cfg.policy.chat_template_kwargs);
    if (cfg.policy.prompt_format == PromptFormat::kChatTemplate && !tok->has_chat_template()) {
      if (cfg.policy.prompt_format_explicit)
        throw Error(RLH_E_INVALID_ARGUMENT, "policy.tokenizer.chat_template: \"default\" but the tokenizer has none");
      cfg.policy.prompt_format = PromptFormat::kRaw;
    }
    train_data = std::make_unique<Dataset>(host, cfg.train.component, cfg.train.config, "data.train");
    if (cfg.validation)
      val_data = std::make_unique<Dataset>(host, cfg.validation->component, cfg.validation->config, "data.validation");
    backend = std::make_unique<Backend>(host, cfg.policy.backend, cfg.policy.section);
    policy = backend->load_model("policy", model_dir, true, policy_save_overrides(cfg.model_save_dtype));
    ranks.follow_backend(host, *backend, policy);  // tp/cp/pp groups share a data-parallel rank
    // The reference is always the starting model, also on resume (NeMo-RL's init_reference_model).
    if (!rm()) reference = backend->load_model("reference", model_dir, false);
    loss = rm() ? std::make_unique<LossAdapter>(PreferenceConfig{}) : std::make_unique<LossAdapter>(cfg.loss);
    loss->set_make_status(host.make_status());
    const int64_t gbs = cfg.policy.train_global_batch_size;
    if (gbs > train_data->size())
      throw Error(RLH_E_INVALID_ARGUMENT, "policy.train_global_batch_size: " + std::to_string(gbs) +
                                              " pairs per step, but data.train has only " +
                                              std::to_string(train_data->size()));
    order = std::make_unique<PromptOrder>(train_data->size(), cfg.seed, cfg.shuffle);
    total_steps = std::min(cfg.max_num_steps, cfg.max_num_epochs * (train_data->size() / gbs));
    if (cfg.checkpointing.enabled) {
      ckpt = std::make_unique<sdk::CheckpointManager>(cfg.checkpointing);
      if (ranks.writer()) ckpt->clean_leftovers();
      ranks.barrier();  // nobody lists checkpoints while rank 0 cleans
      resume_from_checkpoints(host, *ckpt, [&](const sdk::CheckpointInfo& c) {
        const std::string where = (c.dir / "training_info.json").string();
        const json& info = c.training_info;
        if (!info.is_object() || !info.contains("step") || !info.contains("data_order") ||
            !info["step"].is_number_integer())
          throw Error(RLH_E_DATA_LOSS, where + ": not a " + what() + " checkpoint (no step or data_order)");
        order->restore(info["data_order"], where);
        backend->load_state(policy, (c.dir / "policy").string());
        step = info["step"].get<int64_t>();
      });
    }
    host.metric("rlhost/total_steps", static_cast<double>(total_steps), 0);
    SaveSchedule saves(cfg.checkpointing.must_save_by_s);  // where NeMo-RL's dpo_train / rm_train start their deadline
    if (val_data && cfg.val_at_start && step == 0) {
      validate(0);
      host.metric("rlhost/step_finished", 0, 0);
    }
    while (step < total_steps) {
      check_cancel();
      const auto t_step = Clock::now();
      auto t0 = Clock::now();
      // Every rank draws the same global batch (the seeded order) and trains on its share.
      PackedBatch b = make_batch(*train_data, ranks.share(order->next(gbs)));
      const double t_ref = since(t0);
      t0 = Clock::now();
      const Backend::TrainResult r = step_on(b, false);
      const double t_train = since(t0);
      ++step;
      const bool last = step == total_steps;
      std::map<std::string, double> train = {{"loss", r.loss}, {"grad_norm", r.grad_norm}};
      for (const char* m : loss_metrics())
        if (std::string(m) != "loss") train[m] = metric_of(r, m);
      train["num_valid_samples"] = metric_of(r, "num_valid_samples");
      std::optional<std::map<std::string, double>> val;
      if (val_data && ((cfg.val_period > 0 && step % cfg.val_period == 0) || (cfg.val_at_end && last)))
        val = validate(step);
      const bool saved = saves.after_step(ranks, host, ckpt.get(), step, last);
      if (saved) save(step, val, train);
      for (const auto& [k, v] : train) host.metric(("train/" + k).c_str(), v, step);
      for (const char* k : {"lr", "num_tokens"})
        if (r.metrics.contains(k) && r.metrics[k].is_number())
          host.metric((std::string("train/") + k).c_str(), r.metrics[k].get<double>(), step);
      if (!rm()) host.metric("timing/train/reference_logprobs", t_ref, step);
      host.metric("timing/train/policy_training", t_train, step);
      host.metric("timing/train/total_step_time", since(t_step), step);
      host.metric("rlhost/step_finished", 0, step);
      if (saves.out_of_time() && !last) {
        host.info(stop_for_deadline(step, saved));
        break;
      }
    }
  }
};

PreferenceLoop::PreferenceLoop(const sdk::Host& host, const std::string& config_text, PreferenceAlgorithm algorithm)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  const json whole = parse_loop_config(config_text, algorithm == PreferenceAlgorithm::rm ? "rm" : "dpo");
  impl_->cfg = PreferenceLoopConfig::from_json(whole, algorithm);
  impl_->config_yaml = to_yaml(nlohmann::ordered_json::parse(config_text));
}

PreferenceLoop::~PreferenceLoop() = default;

void PreferenceLoop::run() { impl_->run(); }

}  // namespace rlh::grpo
