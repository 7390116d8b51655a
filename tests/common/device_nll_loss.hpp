// nll_loss as a CudaEngine::DeviceLoss (train_step's loss on the device): the registry's
// nll_loss op (kernels_cuda's) on the engine's token-aligned logprobs, every token and sample
// counted, normalised by the step's global count. What the engine tests compare with the host
// loss (nll_loss.hpp) and the training benchmark runs beside torch.compile's in-graph loss.
#pragma once

#include <cuda_runtime_api.h>

#include <span>
#include <stdexcept>
#include <vector>

#include "kernels_cuda_abi.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "rlhost/sdk/kernel_registry.hpp"

namespace rlh::test {

class DeviceNll {
 public:
  // For steps over `mbs` (their shapes, in this order) of `global_tokens` predicted tokens.
  DeviceNll(std::span<const engine::MicroBatch> mbs, int64_t global_tokens)
      : g_tok_(sdk::attr_double("global_valid_toks", double(global_tokens))) {
    for (const engine::MicroBatch& mb : mbs) {  // per micro-batch: its token mask [N], sample mask [S]
      at_.push_back(int64_t(inputs_.size()));
      inputs_.insert(inputs_.end(), size_t(mb.num_tokens() + mb.num_sequences()), 1.f);
    }
    int64_t zero = 0;
    const std::vector<rlh_tensor> d_in = {vec(nullptr, &zero, sdk::kF32), vec(nullptr, &zero, sdk::kF32),
                                          vec(nullptr, &zero, sdk::kF32), vec(nullptr, &zero, sdk::kI32)};
    const std::vector<rlh_tensor> d_out(3, vec(nullptr, &zero, sdk::kF32));
    op_ = cuda_registry()->resolve("nll_loss", sdk::cuda_device(0), d_in, d_out, {&g_tok_, 1});
    if (cudaMalloc(&metrics_, 3 * sizeof(float)) != cudaSuccess) throw std::runtime_error("DeviceNll: cudaMalloc");
    loss_.inputs = inputs_;
    loss_.slots = int64_t(mbs.size());
    loss_.kept = &kept_;
    loss_.run = [this](const engine::LossContext& c, const engine::CudaEngine::DeviceLossViews& v) {
      int64_t N = c.microbatch->num_tokens(), S = c.microbatch->num_sequences(), S1 = S + 1, one = 1, three = 3;
      const float* tm = v.inputs + at_[size_t(c.index)];
      const std::vector<rlh_tensor> in = {vec(v.logprob, &N, sdk::kF32), vec(tm, &N, sdk::kF32),
                                          vec(tm + N, &S, sdk::kF32), vec(v.cu_seqlens, &S1, sdk::kI32)};
      const std::vector<rlh_tensor> out = {vec(v.loss, &one, sdk::kF32), vec(v.dlogprob, &N, sdk::kF32),
                                           vec(metrics_, &three, sdk::kF32)};
      op_.run(in, out, {&g_tok_, 1}, v.stream);
      v.keep(v.loss, c.index);
    };
  }
  ~DeviceNll() { cudaFree(metrics_); }
  DeviceNll(const DeviceNll&) = delete;
  DeviceNll& operator=(const DeviceNll&) = delete;

  const engine::CudaEngine::DeviceLoss& loss() const { return loss_; }
  // The last step's loss: its micro-batches' kept losses summed.
  double last_loss() const {
    double l = 0;
    for (float x : kept_) l += x;
    return l;
  }

 private:
  static rlh_tensor vec(const void* p, int64_t* n, rlh_dtype dt) {
    static int64_t unit = 1;
    rlh_tensor t{};
    t.data = const_cast<void*>(p);
    t.device = sdk::cuda_device(0);
    t.ndim = 1;
    t.dtype = dt;
    t.shape = n;
    t.strides = &unit;
    return t;
  }
  rlh_named_value g_tok_;
  std::vector<float> inputs_;
  std::vector<int64_t> at_;
  sdk::Op op_;
  void* metrics_ = nullptr;
  std::vector<float> kept_;
  engine::CudaEngine::DeviceLoss loss_;
};

}  // namespace rlh::test
