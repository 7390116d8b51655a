// The SFT loop (see sft_loop.hpp).
#include "sft_loop.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "json_read.hpp"
#include "loop_config.hpp"
#include "loop_ranks.hpp"
#include "message_log.hpp"
#include "rlhost/grpo/config.hpp"
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

// NeMo-RL's sft section and what the loop reads of the others.
struct SftConfig {
  int64_t max_num_epochs = 1;
  int64_t max_num_steps = 1000000;
  int64_t val_period = 0;
  int64_t val_batches = 0;  // 0 = the whole validation set
  int64_t val_global_batch_size = 32;
  bool val_at_start = false;
  bool val_at_end = false;  // validate after the last step too (else only every val_period)
  uint64_t seed = 42;
  PolicyConfig policy;
  DataSource train;
  std::optional<DataSource> validation;
  bool shuffle = true;
  // data.add_bos / add_eos / add_generation_prompt as NeMo-RL's sft_processor takes them.
  MessageLogOptions messages;
  bool only_unmask_final = false;  // sft.only_unmask_final
  // data.max_input_seq_length (default max_total_sequence_length): a row of at least this many
  // tokens is not trained on (sft_processor's loss_multiplier 0).
  int64_t max_seq_length = 0;
  sdk::CheckpointConfig checkpointing;
  std::string model_save_dtype = "float32";  // checkpointing.model_save_dtype

  static SftConfig from_json(const json& whole) {
    SftConfig c;
    const detail::Section s(child(whole, "sft"), "sft");
    c.max_num_epochs = positive(s, "max_num_epochs", c.max_num_epochs);
    c.max_num_steps = positive(s, "max_num_steps", c.max_num_steps);
    s.read("val_period", c.val_period);
    if (c.val_period < 0) throw ConfigError("sft.val_period: must be >= 0 (0 = no periodic validation)");
    s.read("val_batches", c.val_batches);
    if (c.val_batches < 0) throw ConfigError("sft.val_batches: must be >= 0 (0 = the whole validation set)");
    c.val_global_batch_size = positive(s, "val_global_batch_size", c.val_global_batch_size);
    s.read("val_at_start", c.val_at_start);
    s.read("val_at_end", c.val_at_end);
    // Train on the final message only (when it is the assistant's), where a conversation row
    // has several assistant turns; a prompt/answer row has one, its last.
    s.read("only_unmask_final", c.only_unmask_final);
    int64_t seed = static_cast<int64_t>(c.seed);
    s.read("seed", seed);
    c.seed = static_cast<uint64_t>(seed);
    c.policy = read_policy_config(whole);
    if (c.policy.train_global_batch_size <= 0)
      throw ConfigError("policy.train_global_batch_size: missing (rows per SFT step)");
    const json& data = child(whole, "data");
    if (!data.is_object()) throw ConfigError("data: missing (the rows to train on)");
    const detail::Section d(data, "data");
    d.read("shuffle", c.shuffle);
    c.messages.format = c.policy.prompt_format;
    d.read("add_bos", c.messages.add_bos);
    d.read("add_eos", c.messages.add_eos);
    d.read("add_generation_prompt", c.messages.add_generation_prompt);
    c.max_seq_length = c.policy.max_total_sequence_length;
    if (const json* m = d.find("max_input_seq_length"); m != nullptr && !m->is_null())
      c.max_seq_length = positive(d, "max_input_seq_length", c.max_seq_length);
    c.train = read_data_source(data, "train", true);
    DataSource v = read_data_source(data, "validation", false);
    if (!v.component.empty()) c.validation = v;
    // NeMo-RL's validate() asserts val_period <= 0 without a validation set; here the key is named.
    if (!c.validation && c.val_period > 0)
      throw ConfigError(s.key("val_period") + ": " + std::to_string(c.val_period) +
                        " but data.validation is missing (set 0, or give validation rows)");
    c.checkpointing = sdk::CheckpointConfig::from_json(child(whole, "checkpointing"), "checkpointing");
    c.model_save_dtype = read_model_save_dtype(child(whole, "checkpointing"));
    return c;
  }
};

}  // namespace

struct SftLoop::Impl {
  sdk::Host host;
  SftConfig cfg;
  std::string config_yaml;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<Dataset> train_data, val_data;
  std::unique_ptr<Backend> backend;
  rlh_model* policy = nullptr;
  std::unique_ptr<PromptOrder> order;
  std::unique_ptr<LossAdapter> loss;
  std::unique_ptr<sdk::CheckpointManager> ckpt;
  std::string model_dir;
  int64_t step = 0, total_steps = 0;
  // Every data-parallel rank trains on its share of each global batch (loop_ranks.hpp).
  LoopRanks ranks;

  void check_cancel() const {
    if (host.cancelled()) throw Error(RLH_E_CANCELLED, "SFT cancelled after step " + std::to_string(step));
  }

  // The conversation (system prompt, prompt, answer as the assistant's turn) as NeMo-RL's
  // sft_processor tokenizes it (message_log.hpp), with token_mask on the assistant's tokens:
  // with add_generation_prompt false (NeMo-RL's recipes) the assistant turn's header is trained
  // on with its answer, with true it belongs to the prompt.
  void add_row(PackedBatch& b, std::vector<std::vector<float>>& masks, std::vector<float>& sample_mask,
               const Dataset& data, int64_t index) const {
    const json row = data.row(index);
    json messages = json::array();
    if (auto conv = row.find("messages"); conv != row.end()) {
      // A conversation (the jsonl dataset's 'messages' files, NeMo-RL's ResponseDataset over
      // chat data): every assistant turn is trained on (all but the last without their EOS,
      // which only the conversation's end gets).
      bool ok = conv->is_array() && !conv->empty(), assistant = false;
      for (const auto& m : ok ? *conv : json::array()) {
        ok = ok && m.is_object() && m.contains("role") && m["role"].is_string() && m.contains("content") &&
             m["content"].is_string();
        if (!ok) break;
        messages.push_back({{"role", m["role"]}, {"content", m["content"]}});
        assistant = assistant || m["role"] == "assistant";
      }
      if (!ok || !assistant)
        throw Error(RLH_E_INVALID_ARGUMENT, data.origin() + ": row " + std::to_string(index) +
                                                (ok ? ": the conversation has no assistant message to train on"
                                                    : ": 'messages' must be a list of {role, content} strings"));
    } else {
      auto p = row.find("prompt");
      auto a = row.find("answer");
      if (p == row.end() || !p->is_string() || a == row.end() || !a->is_string())
        throw Error(RLH_E_INVALID_ARGUMENT, data.origin() + ": row " + std::to_string(index) +
                                                " needs string 'prompt' and 'answer' (or a 'messages' conversation)");
      if (auto sp = row.find("system_prompt"); sp != row.end() && sp->is_string())
        messages.push_back({{"role", "system"}, {"content", *sp}});
      messages.push_back({{"role", "user"}, {"content", *p}});
      messages.push_back({{"role", "assistant"}, {"content", *a}});
    }
    if (messages.size() > kMaxConversationMessages)
      throw Error(RLH_E_INVALID_ARGUMENT, data.origin() + ": row " + std::to_string(index) + " has " +
                                              std::to_string(messages.size()) + " messages, more than the " +
                                              std::to_string(kMaxConversationMessages) + " a conversation row takes");
    std::vector<int32_t> ids;
    std::vector<float> m;
    MessageLogOptions o = cfg.messages;
    o.max_tokens = cfg.max_seq_length;  // a row that long is not trained on: no need to render the rest
    message_log_row(formatted_message_log(*tok, messages, o), messages, cfg.only_unmask_final, ids, m);
    float keep = 1.0f;
    if (static_cast<int64_t>(ids.size()) >= cfg.max_seq_length) keep = 0.0f;  // NeMo-RL: not trained on
    if (static_cast<int64_t>(ids.size()) > cfg.policy.max_total_sequence_length) {
      ids.resize(static_cast<size_t>(cfg.policy.max_total_sequence_length));
      m.resize(ids.size());
    }
    b.add_sequence(ids);
    masks.push_back(std::move(m));
    sample_mask.push_back(keep);
  }

  PackedBatch make_batch(const Dataset& data, const std::vector<int64_t>& rows) const {
    PackedBatch b;
    std::vector<std::vector<float>> masks;
    std::vector<float> keep;
    for (int64_t r : rows) add_row(b, masks, keep, data, r);
    auto& tm = b.field("token_mask", PackedBatch::Frame::kToken);
    size_t at = 0;
    for (const auto& m : masks) {
      std::copy(m.begin(), m.end(), tm.begin() + static_cast<std::ptrdiff_t>(at));
      at += m.size();
    }
    b.field("sample_mask", PackedBatch::Frame::kSequence) = keep;
    return b;
  }

  Backend::TrainResult step_on(PackedBatch& b, bool eval_only) {
    const BatchMasks masks(b);
    const std::vector<rlh_output_spec> specs = loss->output_specs(1.0, 0, 1.0);
    // `b` is this rank's share: the loss normalises by the global batch's counts.
    const ValidCounts global = ranks.sum(masks.counts);
    const rlh_train_args a = train_args(b, specs, *loss, global, cfg.policy.train_mb_tokens,
                                        cfg.policy.train_micro_batch_size, eval_only);
    Backend::TrainResult r = backend->train_step(policy, a);
    // A validation loss has no gradient norm (0); either being non-finite stops the run.
    stop_on_nonfinite(r.loss, eval_only ? 0.0 : r.grad_norm, eval_only ? step : step + 1,
                      eval_only ? "validation at step" : "train step");
    return r;
  }

  double validate(int64_t at) {
    const auto t0 = Clock::now();
    const int64_t bs = cfg.val_global_batch_size;
    int64_t batches = (val_data->size() + bs - 1) / bs;
    if (cfg.val_batches > 0) batches = std::min(batches, cfg.val_batches);
    double sum = 0;
    for (int64_t k = 0; k < batches; ++k) {
      check_cancel();
      std::vector<int64_t> rows;
      for (int64_t i = k * bs; i < std::min(val_data->size(), (k + 1) * bs); ++i) rows.push_back(i);
      // Each rank evaluates its share of the batch; the backend sums the loss over the ranks.
      PackedBatch b = make_batch(*val_data, ranks.share(rows));
      sum += step_on(b, true).loss;
    }
    const double val_loss = sum / static_cast<double>(batches);  // NeMo-RL: mean over val batches
    host.metric("validation/val_loss", val_loss, at);
    host.metric("timing/validation/total_validation_time", since(t0), at);
    return val_loss;
  }

  void save(int64_t s, std::optional<double> val_loss, double train_loss) {
    // Rank 0 owns the folder; every rank takes part in the backend's save_state.
    std::optional<sdk::PendingCheckpoint> owned =
        begin_policy_checkpoint(ranks, *ckpt, s, *backend, policy, cfg.policy.tokenizer_name, model_dir);
    if (!owned) return;
    sdk::PendingCheckpoint& pending = *owned;
    json info = {{"step", s}, {"total_steps", total_steps}, {"epoch", order->epoch()},
                 {"data_order", order->state()}, {"seed", cfg.seed}, {"train:loss", train_loss}};
    if (val_loss) info["val:val_loss"] = *val_loss;
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
    loss = std::make_unique<LossAdapter>(NllConfig{});
    loss->set_make_status(host.make_status());
    enable_device_loss(*loss, host, loss->output_specs(1.0, 0, 1.0));
    const int64_t gbs = cfg.policy.train_global_batch_size;
    if (gbs > train_data->size())
      throw Error(RLH_E_INVALID_ARGUMENT, "policy.train_global_batch_size: " + std::to_string(gbs) +
                                              " rows per step, but data.train has only " +
                                              std::to_string(train_data->size()));
    order = std::make_unique<PromptOrder>(train_data->size(), cfg.seed, cfg.shuffle);
    total_steps = std::min(cfg.max_num_steps, cfg.max_num_epochs * (train_data->size() / gbs));
    if (cfg.checkpointing.enabled) {
      ckpt = std::make_unique<sdk::CheckpointManager>(cfg.checkpointing);
      if (ranks.writer()) ckpt->clean_leftovers();
      ranks.barrier();  // nobody lists checkpoints while rank 0 cleans
      // The newest checkpoint that verifies and loads; damaged ones are skipped with a warning.
      resume_from_checkpoints(host, *ckpt, [&](const sdk::CheckpointInfo& c) {
        const std::string where = (c.dir / "training_info.json").string();
        const json& info = c.training_info;
        if (!info.is_object() || !info.contains("step") || !info.contains("data_order") ||
            !info["step"].is_number_integer())
          throw Error(RLH_E_DATA_LOSS, where + ": not an SFT checkpoint (no step or data_order)");
        order->restore(info["data_order"], where);
        backend->load_state(policy, (c.dir / "policy").string());
        step = info["step"].get<int64_t>();
      });
    }
    host.metric("rlhost/total_steps", static_cast<double>(total_steps), 0);
    if (!val_data && (cfg.val_at_start || cfg.val_at_end))
      host.warn("sft.val_at_start / sft.val_at_end: no validation data (data.validation), so no validation runs");
    SaveSchedule saves(cfg.checkpointing.must_save_by_s);  // where NeMo-RL's sft_train starts its deadline
    if (val_data && cfg.val_at_start && step == 0) {
      validate(0);
      host.metric("rlhost/step_finished", 0, 0);
    }
    while (step < total_steps) {
      check_cancel();
      const auto t_step = Clock::now();
      // Every rank draws the same global batch (the seeded order) and trains on its share.
      PackedBatch b = make_batch(*train_data, ranks.share(order->next(gbs)));
      auto t0 = Clock::now();
      const Backend::TrainResult r = step_on(b, false);
      const double t_train = since(t0);
      ++step;
      const bool last = step == total_steps;
      // A checkpoint carries the validation of its own step only (NeMo-RL's; without one it
      // ranks last for keep_top_k).
      std::optional<double> val;
      if (val_data && ((cfg.val_period > 0 && step % cfg.val_period == 0) || (cfg.val_at_end && last)))
        val = validate(step);
      const bool saved = saves.after_step(ranks, host, ckpt.get(), step, last);
      if (saved) save(step, val, r.loss);
      host.metric("train/loss", r.loss, step);
      host.metric("train/grad_norm", r.grad_norm, step);
      for (const char* k : {"lr", "num_tokens"})
        if (r.metrics.contains(k) && r.metrics[k].is_number()) host.metric((std::string("train/") + k).c_str(), r.metrics[k].get<double>(), step);
      if (r.metrics.contains("metrics") && r.metrics["metrics"].is_object())
        for (const auto& [k, v] : r.metrics["metrics"].items())
          if (v.is_number() && k != "loss") host.metric(("train/" + k).c_str(), v.get<double>(), step);
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

SftLoop::SftLoop(const sdk::Host& host, const std::string& config_text) : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  const json whole = parse_loop_config(config_text, "sft");
  impl_->cfg = SftConfig::from_json(whole);
  impl_->config_yaml = to_yaml(nlohmann::ordered_json::parse(config_text));
}

SftLoop::~SftLoop() = default;

void SftLoop::run() { impl_->run(); }

}  // namespace rlh::grpo
