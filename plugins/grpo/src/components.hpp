// RAII handles over the components an algorithm drives through the host's registry: backend
// (with its models), generator, environment, dataset and tokenizer. Each wraps one C table of the
// ABI; every failing call throws rlh::sdk::Error with the component's message, prefixed by what
// was being done, so a loop error reads "generation: generator 'rlhost': ...".
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/backend.h"
#include "rlhost/grpo/loss_adapter.hpp"
#include "rlhost/grpo/packing.hpp"
#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/generator.h"
#include "rlhost/sdk/checkpoint.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/tokenizer.h"

namespace rlh::grpo {

// A packed batch the algorithm owns: tokens, sequence offsets and named float32 fields (one
// value per token or per sequence), with the C views (rlh_batch, rlh_named_tensor) built on demand.
class PackedBatch {
 public:
  enum class Frame { kToken, kSequence };

  void add_sequence(std::span<const int32_t> ids);
  // Adds (or replaces) a field of one value per token or per sequence; returns its storage.
  std::vector<float>& field(const std::string& name, Frame frame);
  const std::vector<float>* find(const std::string& name) const;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(offsets_.size()) - 1; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }

  // Sequences [begin, end) with every field, as a new batch (a global-batch chunk).
  PackedBatch slice(int64_t begin, int64_t end) const;
  // Sequences `picks` (batch, sequence) of `parts`, in that order, with every field of the first
  // part (every part must have the same fields: data-parallel ranks' shares of one batch).
  static PackedBatch select(const std::vector<const PackedBatch*>& parts,
                            const std::vector<std::pair<size_t, int64_t>>& picks);
  // The fields' names and frames, in the order they were added.
  std::vector<std::pair<std::string, Frame>> field_names() const;

  // The C view; valid until the batch changes. `constraints`: RLH_BATCH_*.
  const rlh_batch& view(uint64_t constraints = RLH_BATCH_NEVER_SPLIT_SEQUENCE);

 private:
  struct Field {
    std::string name;
    Frame frame;
    std::vector<float> data;
    int64_t shape[1] = {0};
    int64_t strides[1] = {1};
  };
  std::vector<int32_t> tokens_;
  std::vector<int64_t> offsets_ = {0};
  // A deque: field() hands out references that must survive adding the next field.
  std::deque<Field> fields_;
  std::vector<rlh_named_tensor> views_;
  rlh_batch batch_{};
};

// A batch's masks as the loss normalisers read them: float64 copies of its token_mask and
// sample_mask, its packing (borrowing the batch's offsets) and the valid token/sequence counts.
struct BatchMasks {
  explicit BatchMasks(const PackedBatch& b);
  std::vector<double> token_mask, sample_mask;
  Packing packing;
  ValidCounts counts;
};

// One backend train_step over a whole global batch: the loss's outputs and callback, the global
// counts it normalises by, micro-batches of `mb_tokens` tokens (when > 0) else `mb_seqs`
// sequences, and the backend's own learning-rate schedule.
// `constraints`: RLH_BATCH_* (DPO adds RLH_BATCH_KEEP_PAIRS so a pair never straddles two
// micro-batches).
// Lets `loss` take device tensors (rlh_train_args.loss_on_device) when policy.device is not cpu
// and a kernel provider on that CUDA device computes it for `specs`; logs which loss runs.
void enable_device_loss(LossAdapter& loss, const sdk::Host& host, const std::vector<rlh_output_spec>& specs);

rlh_train_args train_args(PackedBatch& b, const std::vector<rlh_output_spec>& specs,
                          LossAdapter& loss, const ValidCounts& counts, int64_t mb_tokens,
                          int64_t mb_seqs, bool eval_only = false,
                          uint64_t constraints = RLH_BATCH_NEVER_SPLIT_SEQUENCE);

// A float32 host tensor of one dimension over caller storage.
struct HostVector {
  explicit HostVector(std::vector<float>& v);
  rlh_tensor tensor{};
  int64_t shape[1];
  int64_t strides[1] = {1};
};

class Backend {
 public:
  // Finds backend component `name` and creates an instance with `config` (the policy section).
  Backend(const sdk::Host& host, const std::string& name, const nlohmann::json& config);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  const std::string& name() const { return name_; }
  // `overrides` (an object, or null for none): the per-model config patched over the section.
  rlh_model* load_model(const std::string& role, const std::string& path, bool trainable,
                        const nlohmann::json& overrides = nullptr);
  // Writes the requested outputs, [num_tokens] float32 each, into `outputs`.
  void forward(rlh_model* model, PackedBatch& batch, const std::vector<rlh_output_spec>& specs,
               std::vector<std::vector<float>>& outputs, int64_t micro_batch_tokens);
  struct TrainResult {
    double loss = 0, grad_norm = 0;
    int64_t micro_batches = 0;
    nlohmann::json metrics = nlohmann::json::object();
  };
  TrainResult train_step(rlh_model* model, const rlh_train_args& args);
  // Visits every weight (HF names); returns the weights' version.
  int64_t visit_weights(rlh_model* model, rlh_weight_fn fn, void* user);
  // visit_weights for a caller that also reads `device`'s memory (BACKEND 0.2's
  // visit_weights_on); a backend without it visits host views. *version is set before the
  // first callback.
  void visit_weights_on(rlh_model* model, const rlh_device& device, rlh_weight_fn fn, void* user, int64_t* version);
  // BACKEND 0.5's visit_weight_pieces: this rank's own pieces with their placement, ungathered
  // (has_weight_pieces: the backend offers the slot). Returns the weights' version.
  bool has_weight_pieces() const;
  int64_t visit_weight_pieces(rlh_model* model, rlh_weight_piece_fn fn, void* user);
  void save_state(rlh_model* model, const std::string& dir);
  void load_state(rlh_model* model, const std::string& dir);
  // `model`'s data-parallel (rank, size) over the launched ranks (BACKEND 0.3's data_parallel);
  // nullopt for a backend without the slot (every launched rank is then data-parallel).
  std::optional<std::pair<int, int>> data_parallel(rlh_model* model);

 private:
  sdk::Host host_;
  std::string name_;
  const rlh_backend_api* api_ = nullptr;
  rlh_backend* self_ = nullptr;
};

class Generator;

// A generator in other processes (non-colocated generation, generation_ranks.hpp): a Generator
// made with one sends its requests and refits there instead of to a component of its own.
class GeneratorLink {
 public:
  virtual ~GeneratorLink() = default;
  virtual void generate(const rlh_generate_args& args, rlh_sample_fn fn, void* user) = 0;
  // Hands the weights over; returns the version now in force there.
  virtual int64_t refit_from(Backend& backend, rlh_model* model) = 0;
};

class Generator {
 public:
  Generator(const sdk::Host& host, const std::string& name, const std::string& model_path,
            const nlohmann::json& config);
  // A generator of other processes, reached through `link`.
  Generator(std::string name, std::unique_ptr<GeneratorLink> link);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  const std::string& name() const { return name_; }
  int64_t version() const { return version_; }
  GeneratorLink* link() const { return link_.get(); }
  // Installs every weight of `backend`'s model as one version, in one update whose buffers this
  // object owns until the next refit, so the generator may keep views of them (may_alias).
  void refit_from(Backend& backend, rlh_model* model);

  struct StagedWeight {
    std::string name;
    rlh_dtype dtype{};
    std::vector<int64_t> shape, strides;
    std::unique_ptr<char[]> bytes;  // not zero-filled: every byte is written by the copy
    size_t num_bytes() const;
  };
  // Every weight of `backend`'s model copied into host buffers (row-major), and its version.
  static std::vector<StagedWeight> stage_on_host(Backend& backend, rlh_model* model, int64_t* version);
  // Installs staged weights (strides are set here) as `version`; kept until the next refit.
  void install(std::vector<StagedWeight> staged, int64_t version);
  // Generates, calling `fn` once per sample; through the split when one is set.
  void generate(const rlh_generate_args& args, rlh_sample_fn fn, void* user);
  // The generator's own generate on this rank.
  void generate_here(const rlh_generate_args& args, rlh_sample_fn fn, void* user);
  // How generate calls are shared with other ranks (group_generation.hpp); none by default.
  using Split = std::function<void(Generator&, const rlh_generate_args&, rlh_sample_fn, void*)>;
  void set_split(Split split) { split_ = std::move(split); }

 private:
  sdk::Host host_;
  std::string name_;
  const rlh_generator_api* api_ = nullptr;
  rlh_generator* self_ = nullptr;
  int64_t version_ = -1;
  std::vector<StagedWeight> staged_;
  Split split_;
  std::unique_ptr<GeneratorLink> link_;
};

class Environment {
 public:
  Environment(const sdk::Host& host, const std::string& name, const nlohmann::json& config);
  ~Environment();
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<std::string>& reward_names() const { return reward_names_; }
  // rewards[i * reward_names().size() + r].
  void score(const std::vector<rlh_env_sample>& samples, std::vector<double>& rewards);
  // One turn of a multi-turn rollout: the rewards of score(), and per sample whether its episode
  // ended (done) and the observation text for the next turn (empty when the environment gives
  // none). A non-finite reward, a done flag other than 0/1, an observation for a sample outside
  // the batch or one over kMaxObservationBytes is an error naming the environment and sample.
  struct Step {
    std::vector<double> rewards;
    std::vector<uint8_t> done;
    std::vector<std::string> observations;
    // The next turn's stop strings per sample (nullopt: the environment gave none).
    std::vector<std::optional<std::vector<std::string>>> stop_strings;
  };
  static constexpr size_t kMaxStopStrings = 64, kMaxStopStringBytes = 1024;
  static constexpr size_t kMaxObservationBytes = size_t{1} << 20;
  void step(const std::vector<rlh_env_sample>& samples, Step& out);

 private:
  sdk::Host host_;
  std::string name_;
  const rlh_environment_api* api_ = nullptr;
  rlh_environment* self_ = nullptr;
  std::vector<std::string> reward_names_;
};

class Dataset {
 public:
  Dataset(const sdk::Host& host, const std::string& name, const nlohmann::json& config,
          std::string origin);
  ~Dataset();
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;

  int64_t size() const { return size_; }
  nlohmann::json row(int64_t index) const;
  const std::string& origin() const { return origin_; }

 private:
  sdk::Host host_;
  std::string origin_;
  const rlh_dataset_api* api_ = nullptr;
  rlh_dataset* self_ = nullptr;
  int64_t size_ = 0;
};

class Tokenizer {
 public:
  Tokenizer(const sdk::Host& host, const std::string& path);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  // Ids outside the vocabulary are dropped first (HF's decode skips them too).
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;
  // Renders the chat template; throws FAILED_PRECONDITION when the tokenizer has none.
  std::string apply_chat_template(const nlohmann::json& messages, bool add_generation_prompt) const;
  // Variables every rendering gets (a JSON object's text; "" for none): the tokenizer ABI's
  // extra_json, as NeMo-RL binds policy.tokenizer.chat_template_kwargs.
  void set_template_kwargs(std::string json_object) { template_kwargs_ = std::move(json_object); }
  bool has_chat_template() const { return has_chat_template_; }
  const std::vector<int32_t>& eos_token_ids() const { return eos_; }
  const std::optional<int32_t>& bos_token_id() const { return bos_; }
  // The tokenizer's own EOS (tokenizer_config's eos_token), which a training row ends with;
  // eos_token_ids() adds generation_config's stop ids.
  const std::optional<int32_t>& eos_token_id() const { return eos_own_; }
  // Their texts ("" without the token), which NeMo-RL's rows add where missing.
  const std::string& bos_token_text() const { return bos_text_; }
  const std::string& eos_token_text() const { return eos_text_; }
  int64_t vocab_size() const { return vocab_size_; }

 private:
  sdk::Host host_;
  const rlh_tokenizer_api* api_ = nullptr;
  rlh_tokenizer* self_ = nullptr;
  bool has_chat_template_ = false;
  std::string template_kwargs_;
  std::vector<int32_t> eos_;
  std::optional<int32_t> bos_, eos_own_;
  std::string bos_text_, eos_text_;
  int64_t vocab_size_ = 0;
};

// A non-finite loss or gradient norm stops the loop (NeMo-RL stops on a NaN loss too): throws
// Error(RLH_E_ABORTED) naming the step. The backend applies no update from a non-finite gradient
// and nothing of this step is checkpointed, so the last checkpoint is the state to resume from.
void stop_on_nonfinite(double loss, double grad_norm, int64_t step, const std::string& what);

// Optimizer steps of `model` over chunks of `gbs` sequences of `b` (NeMo-RL's global batches),
// reduced as NeMo-RL's training loops do: loss and grad_norm summed over chunks; the backend's
// metrics and the loss callback's (under "metrics"), settings (lr, wd, weight_decay, step,
// clip_coef) keeping their last value and the rest summed; the loss's min/max metrics merged
// (through `reduce`, e.g. over data-parallel ranks, when given). `counts(chunk, masks)` gives the
// counts the loss normalises by (the global batch's: data-parallel sums, ...). A non-finite loss
// stops with `what` and `step` (stop_on_nonfinite).
struct ChunkedTrain {
  double loss = 0, grad_norm = 0;
  std::map<std::string, double> summed;  // every other metric
  Metrics extrema;
};
ChunkedTrain train_in_chunks(Backend& backend, rlh_model* model, PackedBatch& b, int64_t gbs, LossAdapter& loss,
                             const std::vector<rlh_output_spec>& specs, int64_t mb_tokens, int64_t mb_seqs,
                             int64_t step, const std::string& what,
                             const std::function<ValidCounts(const PackedBatch&, const BatchMasks&)>& counts,
                             const std::function<Metrics(const Metrics&)>& reduce = nullptr);
// The same over chunks of any sizes: sequences [bounds[k], bounds[k + 1]) (token balancing gives
// a rank a different number of sequences per global batch).
ChunkedTrain train_in_chunks(Backend& backend, rlh_model* model, PackedBatch& b, const std::vector<int64_t>& bounds,
                             LossAdapter& loss, const std::vector<rlh_output_spec>& specs, int64_t mb_tokens,
                             int64_t mb_seqs, int64_t step, const std::string& what,
                             const std::function<ValidCounts(const PackedBatch&, const BatchMasks&)>& counts,
                             const std::function<Metrics(const Metrics&)>& reduce = nullptr);

// Resumes a loop from the newest checkpoint that verifies and loads (CheckpointManager::resume):
// `load` restores the loop's state from one (throwing Error(RLH_E_DATA_LOSS) for a damaged one).
// Each skipped checkpoint is one warning naming it. When none loads, the loop starts from step 0
// -- unless a load failed part way, which could leave the model half-loaded: then it stops.
std::optional<sdk::CheckpointInfo> resume_from_checkpoints(const sdk::Host& host, sdk::CheckpointManager& ckpt,
                                                           const std::function<void(const sdk::CheckpointInfo&)>& load);

// Whether the loop may save checkpoint `step` now; a newer checkpoint kept from before a
// fallback resume is not overwritten: one warning, and the step is not saved.
bool may_save_checkpoint(const sdk::Host& host, const sdk::CheckpointManager& ckpt, int64_t step);
// The line a loop logs when it stops early because checkpointing.checkpoint_must_save_by's time
// is up (sdk::SaveDeadline) after `step`.
std::string stop_for_deadline(int64_t step, bool saved);

// What the supervised loops (sft, dpo, rm) share.
// policy.model_name as a local folder (a hub id through the HF cache); NOT_FOUND names the key.
std::string resolve_policy_dir(const std::string& model_name);
// Saves the policy's state into `dir` with the tokenizer files beside it (from tokenizer_name when
// it is a folder, else from model_dir), so the folder loads as an HF model folder. Collective at
// several data-parallel ranks (save_state); only the `writer` (rank 0) touches the folder.
void save_policy_folder(Backend& backend, rlh_model* policy, const std::string& dir, const std::string& tokenizer_name,
                        const std::string& model_dir, bool writer = true);

}  // namespace rlh::grpo
