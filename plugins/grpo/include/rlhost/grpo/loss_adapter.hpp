// The ABI's loss callback (rlh_loss_fn, backend.h) for the GRPO family, SFT, DPO and RM, on CPU
// tensors: reads the named batch fields and requested outputs of an rlh_microbatch, runs the
// loss of rlh_grpo_core, writes the 0-d loss and d loss / d output into the zeroed gradient
// tensors, and reports metrics through mb->metric.
//
// Batch fields (NeMo-RL's names; token frame = one entry per token, entry t describing token t,
// see packing.hpp; per sequence = one entry per sequence):
//   advantages                 token frame   ClippedPG
//   prev_logprobs              token frame   ClippedPG, unless force_on_policy_ratio
//   generation_logprobs        token frame   ClippedPG
//   reference_policy_logprobs  token frame   ClippedPG when the KL term is on; DPO
//   token_mask                 token frame   all
//   sample_mask                per sequence  all
//   rewards                    per sequence  ClippedPG with positive_example_nll_weight > 0
// Outputs (rlh_output_spec.name), token-aligned like every backend output (backend.h): entry t =
// log p(token t | tokens < t), 0 at position 0 of each sequence. The adapter moves them into the
// loss math's output frame (packing.hpp) and writes the gradients back token-aligned (0 at
// position 0 of each sequence):
//   logprobs             RLH_OUTPUT_LOGPROB: the processed logprob (temperature, top-k/top-p)
//   logprobs_unfiltered  RLH_OUTPUT_LOGPROB_RAW, optional: the KL term's input when top-k/top-p
//                        filtering is on (NeMo-RL's curr_logprobs_unfiltered); if absent the KL
//                        reads `logprobs`
//   values               RLH_OUTPUT_VALUE, the reward model's PreferenceLossFn alone: unshifted
//                        (entry t scores the prefix ending with token t), read as it comes;
//                        for the critic's MseValueLossFn right-shifted within each sequence
//                        (entry t = the value of the state before token t, 0 at position 0,
//                        NeMo-RL's right_shift_values), the gradient shifted back
// The critic's loss reads the batch fields `values` (the values the returns were computed with,
// token frame, shifted the same way), `returns`, token_mask and sample_mask.
// Fields may be float32/float64/bfloat16/float16 or integer/bool masks, shaped [n] or [n, 1];
// gradients are written as float32, float64 or bfloat16 (the grads' dtype).
//
// Metrics: kSum metrics go to mb->metric (the backend sums them over micro-batches and ranks);
// kMin/kMax metrics (probs_ratio_min, ...) cannot be summed, so the adapter keeps them in
// step_extrema() until reset_step(); the algorithm reduces them over ranks itself.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include "rlhost/backend.h"
#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/dpo_loss.hpp"
#include "rlhost/grpo/metrics.hpp"
#include "rlhost/grpo/preference_loss.hpp"
#include "rlhost/grpo/value_loss.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::grpo {

class DeviceLoss;  // device_loss.hpp

struct NllConfig {};  // SFT's NLLLossFn has no settings

struct LossAdapterOptions {
  std::string logprobs_output = "logprobs";
  std::string logprobs_unfiltered_output = "logprobs_unfiltered";
  std::string values_output = "values";  // PreferenceConfig: RLH_OUTPUT_VALUE
};

class LossAdapter {
 public:
  using Config = std::variant<ClippedPGConfig, NllConfig, DpoConfig, PreferenceConfig, ValueLossConfig>;

  explicit LossAdapter(Config cfg, LossAdapterOptions opts = {});
  ~LossAdapter();
  LossAdapter(const LossAdapter&) = delete;
  LossAdapter& operator=(const LossAdapter&) = delete;

  // What to put into rlh_train_args.loss_fn / loss_user.
  static rlh_status* callback(void* user, const rlh_microbatch* mb);
  rlh_loss_fn fn() const { return &LossAdapter::callback; }
  void* user() { return this; }

  // Status factory for errors (the host's make_status); local statuses when unset.
  void set_make_status(sdk::MakeStatusFn make) { make_status_ = make; }
  // Global count of valid tokens of reward>0 samples for the positive-example NLL (see
  // ClippedPGInputs::global_positive_toks); 0 = NeMo-RL's per-call count.
  void set_global_positive_tokens(double n) { global_positive_toks_ = n; }

  // The outputs this loss needs from the backend, for rlh_train_args.specs: `logprobs` as
  // RLH_OUTPUT_LOGPROB with the generation's sampling settings, and, for the ClippedPG loss with
  // its KL term on while top-k/top-p filtering is active (top_k > 0 or top_p < 1),
  // `logprobs_unfiltered` as RLH_OUTPUT_LOGPROB_RAW; for the reward model's PreferenceLossFn,
  // `values` as RLH_OUTPUT_VALUE alone, and so for the critic's ValueLossConfig. The names point into this adapter.
  std::vector<rlh_output_spec> output_specs(double temperature, int32_t top_k, double top_p) const;

  // The loss on the backend's device (device_loss.hpp): once enabled, a micro-batch whose
  // logprob output lives in device memory runs the kernel op `clipped_pg_loss` / `nll_loss`
  // there, resolved through `host`'s kernel providers (`kernels_json`: policy.kernels), and
  // reports its metrics through metric_tensor. `on_host_too` runs the op on host tensors as well
  // (tests: the op path against the host path). ClippedPG and NLL only.
  void enable_device_loss(sdk::Host host, std::string kernels_json, bool on_host_too = false);
  // Whether a backend may hand this loss device tensors of `device`'s kind
  // (rlh_train_args.loss_on_device): the op resolves there for this config and the outputs are
  // `specs` (the logprob output alone). False with *why otherwise (the host loss then runs).
  bool device_loss_supported(rlh_device device, const std::vector<rlh_output_spec>& specs, std::string* why);
  // device_loss_supported answered yes: train steps set rlh_train_args.loss_on_device.
  bool wants_device_tensors() const { return device_ok_; }
  // How a metric the backend reports in its JSON combines over chunks of a step: kMin/kMax for
  // the extrema a device loss reports through metric_tensor, kSum otherwise.
  static Reduce reduce_of(std::string_view name);

  // Min/max metrics of the micro-batches run since the last reset_step().
  Metrics step_extrema() const;
  void reset_step();

  // One micro-batch; throws (rlh::sdk::Error / std::invalid_argument) on bad input.
  void run(const rlh_microbatch& mb);

  const Config& config() const { return cfg_; }

 private:
  void report(const rlh_microbatch& mb, const LossResult& res);  // metrics of one call

  DeviceLoss* device_loss_for(const rlh_device& device, std::string* why);

  Config cfg_;
  LossAdapterOptions opts_;
  sdk::Host device_host_;
  std::string kernels_json_ = "{}";
  bool device_enabled_ = false, op_on_host_ = false, device_ok_ = false;
  std::vector<std::unique_ptr<DeviceLoss>> device_ops_;  // one per device
  sdk::MakeStatusFn make_status_ = nullptr;
  double global_positive_toks_ = 0;
  mutable std::mutex mu_;
  Metrics extrema_;
};

}  // namespace rlh::grpo
