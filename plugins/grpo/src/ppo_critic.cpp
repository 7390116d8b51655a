// PPO's critic (see ppo_critic.hpp).
#include "ppo_critic.hpp"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <optional>
#include <vector>

#include "json_read.hpp"
#include "loop_config.hpp"
#include "rlhost/grpo/packing.hpp"
#include "token_balance.hpp"

namespace rlh::grpo {

using json = nlohmann::json;
using detail::child;
using detail::describe;
using detail::positive;
using detail::Section;
namespace fs = std::filesystem;

PpoConfig PpoConfig::from_json(const json& whole, const PolicyConfig& policy, const ClippedPGConfig& loss) {
  PpoConfig c;
  const json& pj = child(whole, "ppo");
  const Section s(pj, "ppo");
  c.ppo_epochs = positive(s, "ppo_epochs", c.ppo_epochs);
  s.read("policy_training_start_step", c.policy_training_start_step);
  if (c.policy_training_start_step < 0) throw ConfigError("ppo.policy_training_start_step: must be >= 0");
  c.gae = GaeConfig::from_json(child(pj, "adv_estimator"), loss);
  c.value_loss = ValueLossConfig::from_json(child(whole, "value_loss_fn"));

  const json& vj = child(whole, "value");
  if (!vj.is_object()) throw ConfigError("value: missing (PPO's critic: its model_name, optimizer and batch sizes)");
  const Section v(vj, "value");
  c.model_name = policy.model_name;
  v.read("model_name", c.model_name);
  std::optional<std::string> tok;
  v.sub("tokenizer").read("name", tok);
  if (tok && *tok != policy.tokenizer_name)
    throw ConfigError("value.tokenizer.name: \"" + *tok + "\" differs from policy.tokenizer.name \"" +
                      policy.tokenizer_name + "\"; the critic scores the policy's token ids, so it needs the same tokenizer");
  c.train_global_batch_size = v.has("train_global_batch_size") ? positive(v, "train_global_batch_size", 1)
                                                               : policy.train_global_batch_size;
  c.train_micro_batch_size = positive(v, "train_micro_batch_size", policy.train_micro_batch_size);
  if (v.has("max_total_sequence_length") &&
      positive(v, "max_total_sequence_length", 1) < policy.max_total_sequence_length)
    throw ConfigError("value.max_total_sequence_length: shorter than policy.max_total_sequence_length = " +
                      std::to_string(policy.max_total_sequence_length) + "; the critic must value every rollout token");
  bool packing = false, dynamic = false;
  const Section sp = v.sub("sequence_packing"), db = v.sub("dynamic_batching");
  sp.read("enabled", packing);
  db.read("enabled", dynamic);
  if (packing && dynamic)
    throw ConfigError("value.sequence_packing.enabled: sequence packing and dynamic batching are mutually exclusive; enable one");
  if (packing || dynamic) {
    const Section& on = packing ? sp : db;
    if (!on.has("train_mb_tokens")) throw ConfigError(on.key("train_mb_tokens") + ": missing");
    c.train_mb_tokens = positive(on, "train_mb_tokens", 1);
  }
  // The critic is a value model: NeMo-RL's value worker requires reward_model_cfg.enabled (a
  // regression head); the backend adds the head for the role "critic" anyway.
  const Section rm = v.sub("reward_model_cfg");
  bool enabled = true;
  rm.read("enabled", enabled);
  if (!enabled)
    throw ConfigError("value.reward_model_cfg.enabled: false, but PPO's critic is a value model (a score head); set it "
                      "true as NeMo-RL's value worker requires");
  std::optional<std::string> type;
  rm.read("reward_model_type", type);
  if (type && *type != "regression")
    throw ConfigError("value.reward_model_cfg.reward_model_type: \"" + *type +
                      "\" is not a critic's head; PPO's value model is \"regression\"");
  // Colocated on the policy's backend: the critic's section must not ask for the other one.
  for (const char* b : {"dtensor_cfg", "megatron_cfg"}) {
    bool on = false;
    v.sub(b).read("enabled", on);
    const std::string name = std::string(b) == "dtensor_cfg" ? "dtensor" : "megatron";
    if (on && name != policy.backend)
      throw ConfigError("value." + std::string(b) + ".enabled: true, but the critic runs colocated on the policy's "
                        "backend, " + policy.backend);
  }
  // What the backend reads for the critic (optimizer, scheduler, max_grad_norm, precision,
  // dtensor_cfg / megatron_cfg, ...): the value section over the policy's.
  c.backend_overrides = vj;
  for (const char* k : {"model_name", "tokenizer", "train_global_batch_size", "train_micro_batch_size",
                        "max_total_sequence_length", "make_sequence_length_divisible_by", "reward_model_cfg"})
    c.backend_overrides.erase(k);
  return c;
}

Critic::Critic(const sdk::Host& host, Backend& backend, const PpoConfig& cfg, const std::string& model_dir)
    : host_(host), backend_(backend), cfg_(cfg) {
  model_ = backend_.load_model("critic", model_dir, true, cfg_.backend_overrides);
  loss_ = std::make_unique<LossAdapter>(cfg_.value_loss);
  loss_->set_make_status(host_.make_status());
}

void Critic::set_data_parallel(const sdk::Comm& world, int rank, int size) {
  world_ = &world;
  rank_ = rank;
  size_ = size;
}

void Critic::values_and_advantages(PackedBatch& b, int64_t mb_tokens, std::map<std::string, double>& metrics) {
  std::vector<std::vector<float>> out;
  backend_.forward(model_, b, loss_->output_specs(1.0, 0, 1.0), out, mb_tokens);  // RLH_OUTPUT_VALUE
  const Packing p{b.num_tokens(), b.num_seqs(), b.offsets().data()};
  // The head's entry t values the state after token t; V_t (before token t) is entry t-1.
  const std::vector<double> v = to_token_frame(p, std::vector<double>(out[0].begin(), out[0].end()));
  std::vector<float>& vf = b.field("values", PackedBatch::Frame::kToken);
  for (size_t t = 0; t < v.size(); ++t) vf[t] = static_cast<float>(v[t]);
  // GAE over the global batch: its advantage normalisation is a mean and variance over every
  // rank's tokens, so under data parallelism the shares are all-gathered (token_balance.hpp's
  // bytes) and this rank keeps its own tokens of the result.
  std::optional<PackedBatch> gathered;
  int64_t first_token = 0;
  if (size_ > 1) {
    std::vector<PackedBatch> parts;
    const std::vector<std::vector<uint8_t>> all = all_gather_bytes(*world_, serialize_batch(b));
    for (int r = 0; r < size_; ++r) {
      parts.push_back(deserialize_batch(all[static_cast<size_t>(r)], "rank " + std::to_string(r)));
      if (r < rank_) first_token += parts.back().num_tokens();
    }
    std::vector<const PackedBatch*> views;
    std::vector<std::pair<size_t, int64_t>> picks;
    for (size_t r = 0; r < parts.size(); ++r) {
      views.push_back(&parts[r]);
      for (int64_t i = 0; i < parts[r].num_seqs(); ++i) picks.emplace_back(r, i);
    }
    gathered = PackedBatch::select(views, picks);
  }
  const PackedBatch& whole = gathered ? *gathered : b;
  // GAE reads what the loss will read (the float32 fields).
  auto doubles = [&](const char* name) -> std::vector<double> {
    const std::vector<float>* f = whole.find(name);
    return f != nullptr ? std::vector<double>(f->begin(), f->end()) : std::vector<double>();
  };
  const std::vector<double> values = doubles("values"), all_mask = doubles("token_mask"), rewards = doubles("rewards"),
                            lp = doubles("prev_logprobs"), ref = doubles("reference_policy_logprobs");
  GaeInputs in;
  in.packing = Packing{whole.num_tokens(), whole.num_seqs(), whole.offsets().data()};
  in.rewards = rewards.data();
  in.values = values.data();
  in.token_mask = all_mask.data();
  in.logprobs = lp.empty() ? nullptr : lp.data();
  in.reference_logprobs = ref.empty() ? nullptr : ref.data();
  GaeResult r = gae(cfg_.gae, in);
  if (gathered) {  // this rank's tokens
    const auto lo = r.advantages.begin() + first_token, hi = lo + b.num_tokens();
    r.advantages = std::vector<double>(lo, hi);
    r.returns = std::vector<double>(r.returns.begin() + first_token, r.returns.begin() + first_token + b.num_tokens());
  }
  const std::vector<float>& mask = *b.find("token_mask");
  std::vector<float>& adv = b.field("advantages", PackedBatch::Frame::kToken);
  std::vector<float>& ret = b.field("returns", PackedBatch::Frame::kToken);
  double sum = 0, n = 0, lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (size_t t = 0; t < r.advantages.size(); ++t) {
    adv[t] = static_cast<float>(r.advantages[t]);
    ret[t] = static_cast<float>(r.returns[t]);
    if (mask[t] != 0) {
      sum += adv[t];
      n += 1;
      lo = std::min(lo, double(adv[t]));
      hi = std::max(hi, double(adv[t]));
    }
  }
  if (size_ > 1) {  // over the global batch
    double s[2] = {sum, n}, l[1] = {lo}, h[1] = {hi};
    world_->all_reduce(std::span<double>(s, 2), RLH_REDUCE_SUM);
    world_->all_reduce(std::span<double>(l, 1), RLH_REDUCE_MIN);
    world_->all_reduce(std::span<double>(h, 1), RLH_REDUCE_MAX);
    sum = s[0], n = s[1], lo = l[0], hi = h[0];
  }
  metrics["advantages/mean"] = n > 0 ? sum / n : 0.0;
  metrics["advantages/max"] = n > 0 ? hi : 0.0;
  metrics["advantages/min"] = n > 0 ? lo : 0.0;
}

void Critic::train(PackedBatch& b, int64_t step, std::map<std::string, double>& metrics,
                   const std::function<Metrics(const Metrics&)>& reduce) {
  const std::vector<rlh_output_spec> specs = loss_->output_specs(1.0, 0, 1.0);
  // The critic's global batches are value.train_global_batch_size sequences, this rank's share
  // of each (the loop checks the size divides), normalised by the global batch's counts.
  const ChunkedTrain t = train_in_chunks(
      backend_, model_, b, cfg_.train_global_batch_size / size_, *loss_, specs, cfg_.train_mb_tokens,
      cfg_.train_micro_batch_size, step, "critic train step",
      [&](const PackedBatch&, const BatchMasks& m) {
        std::vector<double> c = {m.counts.tokens, m.counts.seqs};
        if (size_ > 1) world_->all_reduce(std::span<double>(c), RLH_REDUCE_SUM);
        return ValidCounts{c[0], c[1]};
      },
      reduce);
  metrics["critic/loss"] = t.loss;
  metrics["critic/grad_norm"] = t.grad_norm;
  for (const auto& [k, v] : t.summed) metrics["critic/" + k] = v;
  for (const Metric& m : t.extrema.items()) metrics["critic/" + m.name] = m.value;
  auto sum = [&](const char* k) { return t.summed.count(k) ? t.summed.at(k) : 0.0; };
  metrics["critic/explained_var"] =
      explained_variance(sum("returns_mean"), sum("values_mean"), sum("returns_sq_mean"), sum("residual_sq_mean"));
}

void Critic::save(const std::string& dir) {
  if (rank_ == 0) fs::create_directories(dir);
  backend_.save_state(model_, dir);
}

void Critic::load(const std::string& dir) { backend_.load_state(model_, dir); }

}  // namespace rlh::grpo
