// PPO's critic (NeMo-RL v0.7's ppo.py) for the GRPO loop: a value model on the policy's backend
// (colocated: the same backend instance, its own optimizer from the `value` section), the values
// of a rollout batch, GAE advantages and returns, ppo_epochs of critic training with
// MseValueLossFn, and the critic's part of step_N/ checkpoints (step_N/value, an HF sequence
// classifier with its optimizer state).
//
// The GRPO loop runs PPO when it is built as `ppo` (grpo_loop.hpp): rollouts, refit, rewards,
// scaling/shaping, logprobs, the ClippedPG policy loss, validation, checkpoints and metrics are
// the loop's own; the critic adds what differs.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/grpo/gae.hpp"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/value_loss.hpp"

namespace rlh::grpo {

struct PolicyConfig;

// ppo.* (beyond what the loop shares with grpo.*), value.* and value_loss_fn.*.
struct PpoConfig {
  int64_t ppo_epochs = 4;
  int64_t policy_training_start_step = 0;
  GaeConfig gae;
  ValueLossConfig value_loss;
  std::string model_name;  // value.model_name (default: policy.model_name)
  int64_t train_global_batch_size = 0, train_micro_batch_size = 1, train_mb_tokens = 0;
  nlohmann::json backend_overrides;  // the value section patched over policy for the critic

  // `whole`: the resolved configuration; `policy`: what the loop read of policy.*.
  static PpoConfig from_json(const nlohmann::json& whole, const PolicyConfig& policy, const ClippedPGConfig& loss);
};

class Critic {
 public:
  Critic(const sdk::Host& host, Backend& backend, const PpoConfig& cfg, const std::string& model_dir);

  // Data parallelism (docs/parallelism.md): this rank holds its share of every global batch (the
  // policy's shards, value.train_global_batch_size / size sequences of each); the value loss is
  // normalised by the global counts and the metrics are reduced over `world`, the data-parallel
  // ranks (the loop's LoopRanks::sums(), kept by reference).
  void set_data_parallel(const sdk::Comm& world, int rank, int size);

  // The critic's values of `b` (field "values", token frame, right-shifted like NeMo-RL's), then
  // GAE over rewards (field "rewards" per sequence) into "advantages" and "returns". `metrics`
  // gets advantages/mean, /max, /min over the masked-in tokens.
  void values_and_advantages(PackedBatch& b, int64_t mb_tokens, std::map<std::string, double>& metrics);
  // One pass of critic training over `b` (train_global_batch_size chunks); writes NeMo-RL's
  // critic/* metrics. `reduce` merges the loss's min/max metrics over the ranks.
  void train(PackedBatch& b, int64_t step, std::map<std::string, double>& metrics,
             const std::function<Metrics(const Metrics&)>& reduce = nullptr);

  // Collective under data parallelism; rank 0 writes.
  void save(const std::string& dir);
  void load(const std::string& dir);
  const PpoConfig& config() const { return cfg_; }

 private:
  sdk::Host host_;
  Backend& backend_;
  PpoConfig cfg_;
  rlh_model* model_ = nullptr;
  std::unique_ptr<LossAdapter> loss_;
  const sdk::Comm* world_ = nullptr;  // the loop's; it outlives the critic
  int rank_ = 0, size_ = 1;
};

}  // namespace rlh::grpo
