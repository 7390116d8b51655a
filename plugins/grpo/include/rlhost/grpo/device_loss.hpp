// The loss as a kernel op where the backend's tensors live (rlh_train_args.loss_on_device,
// backend.h): ClippedPG as `clipped_pg_loss`, SFT's NLL as `nll_loss` (docs/ops.md), resolved
// through the host's kernel providers with the registry every executor uses (policy.kernels
// pins apply). On a CUDA backend this keeps the loss on the GPU, so a train step waits for the
// host once; the op's reference is the same loss library the host callback runs.
//
// One op and one metrics buffer per device. The op reads the micro-batch's float32 device
// fields (advantages, generation_logprobs, token_mask, sample_mask, prev_logprobs,
// reference_policy_logprobs, rewards as the config needs them) and the int32 device field
// "cu_seqlens", writes the loss and the logprob gradient into the micro-batch's tensors, and
// reports its metrics through metric_tensor: 0-d views of the buffer, which the backend copies
// stream-ordered before the next micro-batch writes it again.
#pragma once

#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "rlhost/backend.h"
#include "rlhost/grpo/clipped_pg_loss.hpp"
#include "rlhost/grpo/metrics.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::grpo {

struct NllConfig;

class DeviceLoss {
 public:
  // Resolves the loss op of `pg` (ClippedPG; nullptr: SFT's NLL) on `device`. Returns null and
  // *why when no provider computes it there (another device kind, an option the device op
  // lacks): the caller keeps its host loss. `kernels_json`: the policy.kernels section.
  static std::unique_ptr<DeviceLoss> resolve(const sdk::Host& host, const std::string& kernels_json,
                                             const ClippedPGConfig* pg, rlh_device device, std::string* why);
  ~DeviceLoss();
  DeviceLoss(const DeviceLoss&) = delete;
  DeviceLoss& operator=(const DeviceLoss&) = delete;

  rlh_device device() const { return device_; }
  const std::string& provider() const { return op_.provider(); }

  // One micro-batch: `k_lp` is the index of the logprob output. With metric_tensor the metrics
  // go there; without it (host memory only) they are read back and returned, NeMo-RL's names
  // with their reductions, for the caller to report as its host path does.
  Metrics run(const ClippedPGConfig* pg, const rlh_microbatch& mb, int k_lp, double global_positive_toks);

 private:
  DeviceLoss() = default;
  std::unique_ptr<sdk::KernelRegistry> registry_;
  sdk::Op op_;
  rlh_device device_{};
  const rlh_kernels_api* api_ = nullptr;  // the op's provider, for its device memory
  rlh_kernels* instance_ = nullptr;
  float* metrics_ = nullptr;  // [metric count] on device_ (provider memory, or host_metrics_)
  std::vector<float> host_metrics_;
  std::vector<int32_t> host_cu_;  // cu_seqlens from seq_offsets when the batch lacks the field
};

}  // namespace rlh::grpo
