// The dtensor backend's reading of its config section (the `policy` subtree), NeMo-RL's DTensor
// policy worker's keys: policy.dtensor_cfg.*, the torch optimizer policy.optimizer {name,
// kwargs}, the torch scheduler list policy.scheduler, and the keys shared with megatron.
#include "dtensor_config.hpp"

#include "rlhost/sdk/safetensors_dtype.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::dtensor {

using backend::ConfigReader;
using backend::OptimizerConfig;
using backend::OptimizerKind;
using sdk::Error;
using json = nlohmann::json;

namespace {

// NeMo-RL DTensorConfig keys that have no effect on the CPU engine.
constexpr const char* kNoEffect[] = {
    "dtensor_cfg.cpu_offload",  "dtensor_cfg.sequence_parallel", "dtensor_cfg.custom_parallel_plan",
    "dtensor_cfg._v2",          "dtensor_cfg.clear_cache_every_n_steps", "dtensor_cfg.env_vars",
    "dtensor_cfg.automodel_kwargs", "dtensor_cfg.lora_cfg",       "dtensor_cfg.moe_parallelizer",
    "dtensor_cfg.defer_fp32_logits"};

// torch.optim.<name>(**kwargs) for the optimizers the engine implements.
OptimizerConfig read_torch_optimizer(ConfigReader& r) {
  OptimizerConfig o;
  o.decay_1d_params = true;  // torch optimizers over model.parameters(): every tensor decays
  const std::string name = r.string("optimizer.name", "");
  if (name.empty()) r.fail("optimizer.name", "the optimizer needs a name (e.g. torch.optim.AdamW)");
  const std::string cls = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
  const std::string kw = "optimizer.kwargs.";
  // Implementation switches of torch with no effect on the result.
  for (const char* k : {"foreach", "fused", "capturable", "differentiable"}) r.find(kw + k);
  if (r.boolean(kw + "maximize", false))
    throw Error(RLH_E_UNIMPLEMENTED, r.full(kw + "maximize") + ": maximize is not implemented");
  if (cls == "AdamW" || cls == "Adam") {
    o.kind = OptimizerKind::adamw;
    o.lr = r.number(kw + "lr", 1e-3);  // torch's defaults for absent kwargs
    o.weight_decay = r.number(kw + "weight_decay", cls == "AdamW" ? 1e-2 : 0.0);
    o.eps = r.number(kw + "eps", 1e-8);
    if (const json* betas = r.find(kw + "betas")) {
      if (!betas->is_array() || betas->size() != 2 || !(*betas)[0].is_number() || !(*betas)[1].is_number())
        r.fail(kw + "betas", "expected a list of two numbers");
      o.beta1 = (*betas)[0].get<double>();
      o.beta2 = (*betas)[1].get<double>();
    }
    if (r.boolean(kw + "amsgrad", false))
      throw Error(RLH_E_UNIMPLEMENTED, r.full(kw + "amsgrad") + ": AMSGrad is not implemented");
    // torch Adam folds weight decay into the gradient (L2), which the adamw op does not do.
    if (cls == "Adam" && o.weight_decay != 0)
      throw Error(RLH_E_UNIMPLEMENTED, r.full(kw + "weight_decay") +
                                           ": torch.optim.Adam's L2 weight decay is not implemented; use torch.optim.AdamW");
  } else if (cls == "SGD") {
    o.kind = OptimizerKind::sgd;
    o.lr = r.number(kw + "lr", 1e-3);
    o.momentum = r.number(kw + "momentum", 0.0);
    o.weight_decay = r.number(kw + "weight_decay", 0.0);
    if (r.number(kw + "dampening", 0.0) != 0)
      throw Error(RLH_E_UNIMPLEMENTED, r.full(kw + "dampening") + ": SGD dampening is not implemented");
    if (r.boolean(kw + "nesterov", false))
      throw Error(RLH_E_UNIMPLEMENTED, r.full(kw + "nesterov") + ": Nesterov SGD is not implemented");
  } else {
    throw Error(RLH_E_UNIMPLEMENTED, r.full("optimizer.name") + ": '" + name +
                                         "' is not implemented (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD are)");
  }
  if (!(o.lr >= 0)) r.fail(kw + "lr", "must be >= 0");
  if (!(o.weight_decay >= 0)) r.fail(kw + "weight_decay", "must be >= 0");
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1)) r.fail(kw + "betas", "must lie in [0, 1)");
  if (!(o.eps > 0)) r.fail(kw + "eps", "must be positive");
  return o;
}

}  // namespace

backend::BackendConfig read_config(const json& policy) {
  ConfigReader r(policy, "policy");
  backend::BackendConfig cfg;
  cfg.backend = "dtensor";
  cfg.batching.train_micro_batch_size = 4;  // NeMo-RL's grpo_math_1B.yaml
  cfg.batching.logprob_batch_size = 4;

  if (!r.boolean("dtensor_cfg.enabled", true))
    throw Error(RLH_E_INVALID_ARGUMENT,
                "policy.dtensor_cfg.enabled is false: this configuration selects another backend "
                "(megatron reads policy.megatron_cfg)");
  cfg.recompute = r.boolean("dtensor_cfg.activation_checkpointing", false);
  for (const char* k : {"dtensor_cfg.tensor_parallel_size", "dtensor_cfg.context_parallel_size",
                        "dtensor_cfg.expert_parallel_size"})
    backend::require_single_rank(r, k);
  // FSDP2 over every launched rank (data_parallel.hpp); dp_replicate_size replicas of the
  // sharding (HSDP), checked against the world when the first model loads.
  cfg.parallel.fsdp = true;
  cfg.parallel.dp_replicate = r.integer("dtensor_cfg.dp_replicate_size", 1);
  if (cfg.parallel.dp_replicate < 1)
    r.fail("dtensor_cfg.dp_replicate_size", "must be at least 1, got " + std::to_string(cfg.parallel.dp_replicate));
  // FSDP's CPUOffloadPolicy keeps the sharded states in host memory: where the CPU engine keeps
  // them anyway. On the device path (policy.device = cuda) the fp32 masters and AdamW moments
  // move to page-locked host memory and the update streams them through the device.
  cfg.parallel.cpu_offload = r.boolean("dtensor_cfg.cpu_offload", false);
  if (cfg.parallel.cpu_offload)
    cfg.notes.push_back("policy.dtensor_cfg.cpu_offload: on the CPU engine the sharded parameters, gradients and "
                        "optimizer states are in host memory already; on a GPU the fp32 masters and AdamW moments "
                        "live in host memory and the update streams them through the device");
  // Automodel's gate_precision: the dtype its MoE gate computes the router logits, scores and
  // top-k in. float64 is the engine's fp64 router (megatron's moe_router_dtype: fp64); null and
  // float32 keep its fp32 router (Automodel's null computes the gate in the activations' bf16,
  // so rlhost's is the more precise); any other dtype is refused.
  const std::string gate = r.string("dtensor_cfg.automodel_kwargs.backend.gate_precision", "float32");
  const auto gate_dtype = sdk::st::dtype_from_config_name(gate);
  if (gate_dtype == sdk::st::DType::F64)
    cfg.moe.router_fp64 = true;
  else if (gate_dtype != sdk::st::DType::F32)
    throw Error(RLH_E_UNIMPLEMENTED, r.full("dtensor_cfg.automodel_kwargs.backend.gate_precision") + " = " + gate +
                                         ": the MoE router runs in float32 or float64");
  // Automodel's MoE parallelizer casts the head to lm_head_precision (an FSDP mixed-precision
  // policy of its own): float32 logits from a float32 weight and input. null / bfloat16 are
  // the activations' precision; float32 is honoured where the head runs in float32
  // (model_loading's device check); other dtypes are refused.
  if (!r.is_null("dtensor_cfg.moe_parallelizer.lm_head_precision")) {
    const std::string head = r.string("dtensor_cfg.moe_parallelizer.lm_head_precision", "bfloat16");
    const auto head_dtype = sdk::st::dtype_from_config_name(head);
    if (head_dtype == sdk::st::DType::F32)
      cfg.moe_head_fp32 = true;
    else if (head_dtype != sdk::st::DType::BF16)
      throw Error(RLH_E_UNIMPLEMENTED, r.full("dtensor_cfg.moe_parallelizer.lm_head_precision") + " = " + head +
                                           ": the head runs in the model's precision or in float32");
  }
  for (const char* k : kNoEffect) r.mark_subtree(k);

  // policy.optimizer: absent = NeMo-RL's default AdamW; null = none (NeMo-RL's megatron configs).
  if (!policy.contains("optimizer")) {
    cfg.optimizer = OptimizerConfig{};  // AdamW lr 5e-6, wd 0.01, betas (0.9, 0.999), eps 1e-8
  } else if (policy["optimizer"].is_null()) {
    cfg.optimizer_missing = "policy.optimizer is null (the dtensor backend reads its optimizer there)";
  } else {
    if (!policy["optimizer"].is_object()) r.fail("optimizer", "expected {name, kwargs} or null");
    cfg.optimizer = read_torch_optimizer(r);
  }
  backend::read_shared_policy_keys(r, cfg);
  cfg.schedule.rule = backend::read_torch_schedule(r, "scheduler");

  std::vector<std::string> unread;
  for (const char* sub : {"dtensor_cfg", "optimizer", "sequence_packing", "dynamic_batching"})
    for (auto& k : r.unread(sub)) unread.push_back(std::move(k));
  if (!unread.empty()) {
    std::string line = "keys this backend does not read:";
    for (const auto& k : unread) line += " " + k;
    cfg.notes.push_back(line);
  }
  return cfg;
}

}  // namespace rlh::dtensor
