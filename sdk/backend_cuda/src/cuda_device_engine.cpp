// The training backends' device path (megatron's and dtensor's): models on one Hopper GPU per
// rank through the CUDA engine (bf16 compute, fp32 master weights, gradients and AdamW moments;
// under FSDP this rank's block of the masters and moments), behind backend_common's
// DeviceEngine seam. Its kernels are the registry's for the device (kernels_cuda,
// kernels_cudnn, a vendor's), which the backend builds and passes in. Built where the CUDA toolchain is (CUDA 12+, sm_90a); the CUDA
// runtime is static, so the plugin still loads on a machine without a GPU and policy.device =
// auto falls back to the CPU engine there.
#include "rlhost/backend_cuda/cuda_device_engine.hpp"

#include <cuda_runtime_api.h>

#include "rlhost/engine_cuda/cuda_engine.hpp"

namespace rlh::backend {

namespace {


// "cuda" -> 0, "cuda:N" -> N (backend_config validated the form).
int device_index(const std::string& device) { return device.size() > 5 ? std::stoi(device.substr(5)) : 0; }

class CudaDeviceEngine final : public DeviceEngine {
 public:
  CudaDeviceEngine(const sdk::TransformerDesc& desc, const DeviceEngineOptions& o)
      : index_(device_index(o.device)), base_(o.optimizer), engine_(desc, options(o)) {}

  std::string describe() const override {
    return "cuda:" + std::to_string(index_) + " (" + engine_.device_name() + ", bf16 compute, fp32 master weights)";
  }
  int64_t num_elements() const override { return engine_.num_elements(); }
  engine::Outputs forward(const engine::MicroBatch& mb, const engine::OutputRequest& req) override {
    return engine_.forward(mb, req);
  }
  engine::StepResult train_step(std::span<const engine::MicroBatch> mbs, const engine::StepOptions& so,
                                double weight_decay, const engine::LossFn& loss_fn) override {
    engine::OptimizerOptions o = base_;
    o.weight_decay = weight_decay;  // the schedule's, this step
    engine_.set_optimizer_options(o);
    return engine_.train_step(mbs, so, loss_fn);
  }
  bool device_loss() const override { return true; }
  engine::StepResult train_step_device_loss(std::span<const engine::MicroBatch> mbs, const engine::StepOptions& so,
                                            double weight_decay, const DeviceLoss& loss) override {
    engine::OptimizerOptions o = base_;
    o.weight_decay = weight_decay;
    engine_.set_optimizer_options(o);
    engine::CudaEngine::DeviceLoss d;
    d.inputs = loss.inputs;
    d.slots = loss.slots;
    d.kept = loss.kept;
    d.run = [&loss](const engine::LossContext& c, const engine::CudaEngine::DeviceLossViews& v) {
      loss.run(c, DeviceLossViews{v.logprob, v.dlogprob, v.loss, v.cu_seqlens, v.inputs, v.stream, v.keep});
    };
    return engine_.train_step(mbs, so, d);
  }
  int64_t steps() const override { return engine_.step(); }
  std::vector<std::vector<float>> parameters() const override { return engine_.save_parameters(); }
  void load_parameters(const std::vector<std::vector<float>>& t) override { engine_.load_parameters(t); }
  rlh_device device() const override { return rlh_device{RLH_DEVICE_CUDA, index_}; }
  void visit_master_views(const std::function<void(size_t, const ParamView&)>& fn) const override {
    engine_.visit_master_views([&fn](size_t i, const engine::CudaEngine::ParamView& v) {
      fn(i, ParamView{v.data, v.pieces, v.piece, v.stride});
    });
  }
  void idle_forward(const engine::OutputRequest& req) override { engine_.idle_forward(req); }
  AdamState adam_state() const override {
    engine::CudaEngine::AdamState s = engine_.adam_state();
    return AdamState{s.step, std::move(s.exp_avg), std::move(s.exp_avg_sq)};
  }
  void load_adam_state(const AdamState& s) override {
    engine_.load_adam_state(engine::CudaEngine::AdamState{s.step, s.exp_avg, s.exp_avg_sq});
  }
  std::string fp8_state() const override { return engine_.fp8_state(); }
  void load_fp8_state(const std::string& bytes) override { engine_.load_fp8_state(bytes); }
  int64_t dp_bytes() const override { return engine_.stats().dp_bytes; }
  int64_t state_bytes() const override { return engine_.stats().state_bytes; }
  int64_t host_state_bytes() const override { return engine_.stats().host_state_bytes; }
  int64_t weight_bytes() const override { return engine_.stats().weight_bytes; }
  int64_t grad_bytes() const override { return engine_.stats().grad_bytes; }
  int64_t stage_bytes() const override {
    const engine::CudaEngineStats s = engine_.stats();
    return s.weight_stage_bytes + s.grad_stage_bytes;
  }
  double dp_seconds() const override { return engine_.stats().dp_seconds; }
  int64_t tp_bytes() const override { return engine_.stats().tp_bytes; }
  double tp_seconds() const override { return engine_.stats().tp_seconds; }

 private:
  static engine::CudaEngineOptions options(const DeviceEngineOptions& o) {
    engine::CudaEngineOptions c;
    c.device = device_index(o.device);
    c.trainable = o.trainable;
    c.recompute = !o.recompute            ? engine::Recompute::none
                  : o.recompute_selective ? engine::Recompute::selective
                                          : engine::Recompute::full;
    c.optimizer = o.optimizer;
    c.moe = o.moe;
    c.fp8 = o.fp8;
    c.batch_invariant = o.batch_invariant;
    c.kernels = o.kernels;
    c.dp = o.dp;
    c.shard_optimizer = o.shard_optimizer;
    c.shard_masters = o.shard_masters;
    c.dp_replicate = o.dp_replicate;
    c.offload_state = o.offload_state;
    c.tp = o.tp;
    c.tp_comm = o.tp_comm;
    return c;
  }
  int index_;
  engine::OptimizerOptions base_;
  engine::CudaEngine engine_;
};

bool available(const std::string& device, std::string* why) {
  return engine::cuda_engine_available(why, device_index(device));
}

std::unique_ptr<DeviceEngine> create(const sdk::TransformerDesc& desc, const DeviceEngineOptions& o) {
  return std::make_unique<CudaDeviceEngine>(desc, o);
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: nothing to place on
    return 0;
  }
  return n;
}

const DeviceEngineFactory kFactory = {&available, &create, &device_count};

}  // namespace

const DeviceEngineFactory* cuda_device_engines() { return &kFactory; }

}  // namespace rlh::backend
