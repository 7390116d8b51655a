// Loading a model into a backend: the HF folder, its description (from the host's MODEL
// component, so the backend holds no per-architecture code), the weights (through the model
// core's parameter table), the kernels, the engine and the optimizer.
#include <fstream>
#include <random>
#include <sstream>

#include "backend_internal.hpp"
#include "rlhost/kernels.h"
#include "rlhost/model.h"
#include "rlhost/sdk/model_weights.hpp"
#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/sdk/input_file.hpp"
#include "rlhost/sdk/launch_env.hpp"

namespace rlh::backend {

using sdk::Error;
using json = nlohmann::json;

namespace {

// Model side files (config.json): regular files only, at most 64 MiB (issue 18: a FIFO or
// /dev/zero named config.json must not block or fill memory).
std::string read_file(const std::string& path) {
  try {
    return sdk::read_input_file(path, 64u << 20, "model file");
  } catch (const sdk::InputError& e) {
    throw Error(RLH_E_NOT_FOUND, e.what());
  }
}

std::string join(const char* const* names) {
  std::string out;
  for (size_t i = 0; names != nullptr && names[i] != nullptr && i < 4096; ++i)
    out += (out.empty() ? "" : ", ") + std::string(names[i]);
  return out.empty() ? "none" : out;
}

bool lists(const char* const* names, const std::string& arch) {
  for (size_t i = 0; names != nullptr && names[i] != nullptr && i < 4096; ++i)
    if (arch == names[i]) return true;
  return false;
}

}  // namespace

std::string causal_lm_of(const std::string& arch) {
  for (const char* tail : {"ForSequenceClassification", "ForTokenClassification"}) {
    const std::string t = tail;
    if (arch.size() > t.size() && arch.compare(arch.size() - t.size(), t.size(), t) == 0)
      return arch.substr(0, arch.size() - t.size()) + "ForCausalLM";
  }
  return {};
}

bool has_value_head(const Model& m) { return m.desc.find_param(-1, sdk::ParamRole::value_head) != nullptr; }

namespace {

// Whether a model is loaded as a value model (a scalar head on the final-normed hidden state,
// RLH_OUTPUT_VALUE), and why: its checkpoint has score.weight; its config.json names a
// *ForSequenceClassification / *ForTokenClassification architecture; it is loaded in the role
// of a reward model or critic; or its section asks (NeMo-RL's policy.reward_model_cfg.enabled).
std::string value_head_reason(const rlh_model_args& args, const std::string& role, const json& section,
                              const std::string& config_text, const sdk::st::Checkpoint& ckpt) {
  if (ckpt.find(kScoreWeight).info != nullptr) return "its checkpoint has " + std::string(kScoreWeight);
  const json cfg = json::parse(config_text, nullptr, false);
  if (cfg.is_object() && cfg.contains("architectures") && cfg["architectures"].is_array() &&
      !cfg["architectures"].empty() && cfg["architectures"][0].is_string() &&
      !causal_lm_of(cfg["architectures"][0].get<std::string>()).empty())
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(args.path) + ": config.json names " +
                                            cfg["architectures"][0].get<std::string>() + " but the checkpoint has no " +
                                            kScoreWeight);
  if (role == "reward_model" || role == "critic") return "it is loaded as the " + role;
  const json& rm = section.is_object() && section.contains("reward_model_cfg") ? section["reward_model_cfg"] : json();
  if (rm.is_object() && rm.contains("enabled") && !rm["enabled"].is_null()) {
    if (!rm["enabled"].is_boolean())
      throw Error(RLH_E_INVALID_ARGUMENT, "policy.reward_model_cfg.enabled: expected true or false, got " + rm["enabled"].dump());
    if (rm["enabled"].get<bool>()) {
      const json& type = rm.contains("reward_model_type") ? rm["reward_model_type"] : json();
      if (!type.is_null() && type != "bradley_terry")
        throw Error(RLH_E_UNIMPLEMENTED, "policy.reward_model_cfg.reward_model_type: " + type.dump() +
                                             " is not supported (only \"bradley_terry\": one scalar per sequence)");
      return "policy.reward_model_cfg.enabled is true";
    }
  }
  return {};
}

// The value head's parameter: HF's `score` linear of *ForSequenceClassification with one label,
// [1, hidden], no bias.
sdk::ParamDesc value_head_param(const sdk::TransformerDesc& d) {
  sdk::ParamDesc p;
  p.name = kScoreWeight;
  p.shape = {1, d.hidden_size};
  p.dtype = d.torch_dtype;
  p.layer = -1;
  p.role = sdk::ParamRole::value_head;
  p.hf_names = {kScoreWeight};
  p.hf_shapes = {p.shape};
  return p;
}

}  // namespace

sdk::TransformerDesc describe_model(const sdk::Host& host, const std::string& dir, const std::string& config_text,
                                    const rlh_model_args& args) {
  std::string doc;
  if (args.description_json != nullptr) {
    doc.assign(args.description_json, args.description_len);
  } else {
    std::string arch;
    try {
      const json cfg = json::parse(config_text);
      if (cfg.contains("architectures") && cfg["architectures"].is_array() && !cfg["architectures"].empty() &&
          cfg["architectures"][0].is_string())
        arch = cfg["architectures"][0].get<std::string>();
    } catch (const json::exception& e) {
      throw Error(RLH_E_INVALID_ARGUMENT, dir + "/config.json: invalid JSON: " + e.what());
    }
    // The ABI finds components by name or takes the best-scoring one; it cannot list every MODEL
    // component, so the best-scoring one must be the one that lists the architecture.
    const rlh_component_desc* d = nullptr;
    const rlh_model_api* api = nullptr;
    try {
      api = host.find<rlh_model_api>(RLH_KIND_MODEL, nullptr, RLH_STRUCT_SIZE(rlh_model_api, describe), &d);
    } catch (const Error& e) {
      throw Error(RLH_E_FAILED_PRECONDITION, "no model component can describe " +
                                                 (arch.empty() ? std::string("the model") : "architecture '" + arch + "'") +
                                                 " of " + dir + " (load a model plugin such as model_llama): " + e.what());
    }
    // A value model's checkpoint (HF *ForSequenceClassification / *ForTokenClassification) is
    // its causal LM's decoder plus score.weight: described as that causal LM, the head added by
    // load_model.
    std::string text = config_text;
    if (const std::string lm = causal_lm_of(arch); !lm.empty() && !lists(api->architectures, arch) &&
                                                   lists(api->architectures, lm)) {
      json cfg = json::parse(config_text);
      cfg["architectures"][0] = lm;
      text = cfg.dump();
      arch = lm;
    }
    if (!arch.empty() && !lists(api->architectures, arch))
      throw Error(RLH_E_UNIMPLEMENTED, "architecture '" + arch + "' of " + dir +
                                           "/config.json is not listed by the loaded model component '" + d->name +
                                           "' (it lists " + join(api->architectures) + ")");
    sdk::check(api->describe(host.api(), text.data(), text.size(), sdk::write_to_string, &doc),
               dir + "/config.json");
  }
  try {
    return json::parse(doc).get<sdk::TransformerDesc>();
  } catch (const std::exception& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, "model description of " + dir + ": " + e.what());
  }
}

// The CPU engine's ops: every kernel provider that runs on the CPU (kernels_cpu, the reference,
// last), op by op, with the pins of policy.kernels.
void select_kernels(const sdk::Host& host, const BackendFlavor& flavor, Model& m) {
  m.registry = sdk::make_kernel_registry(host, sdk::kCPU, m.config.kernel_pins, flavor.name, "{}", m.config.kernel_verify);
  if (m.registry->providers().empty())
    throw Error(RLH_E_FAILED_PRECONDITION, std::string(flavor.name) +
                                               ": no kernel provider runs on the CPU (load kernels_cpu: --plugin kernels_cpu, "
                                               "or put it on the plugin path)");
  m.ops = engine::make_registry_ops(*m.registry, &m.alloc);
  m.kernels = m.registry->choices_summary();
}

Optimizer::StepInfo Model::next_update(double lr_override) const {
  if (optimizer) return optimizer->next(lr_override);
  if (shard_opt) return shard_opt->next(lr_override);
  if (!config.optimizer) return {};
  const Schedule::Point p = config.schedule.at(version(), *config.optimizer);
  return {lr_override >= 0 ? lr_override : p.lr, p.weight_decay};
}

bool without_update(const Model& m, const sdk::ParamDesc& p) {
  // The engines give a frozen router no gradient; no decay either.
  return !p.trainable || (m.config.moe.freeze_router &&
                          (p.role == sdk::ParamRole::router || p.role == sdk::ParamRole::router_bias));
}

std::unique_ptr<Optimizer> make_optimizer(Model& m) {
  const auto frozen = [&m](const sdk::ParamDesc& p) { return without_update(m, p); };
  return std::make_unique<Optimizer>(*m.config.optimizer, m.config.schedule, *m.engine, *m.ops, frozen, &m.state_alloc);
}

namespace {

// policy.device: puts the model on the flavor's device path and returns true, or returns false
// for the CPU engine. "auto" falls back to the CPU engine (with a note saying why) where the
// device path cannot take the model; an explicit device fails instead, naming the reason.
bool place_on_device(Backend& b, Model& m, const std::vector<std::vector<float>>& weights) {
  const std::string& d = m.config.device;
  if (d == "cpu") return false;
  const bool automatic = d == "auto";
  const DeviceEngineFactory* f = b.flavor->device_engines;
  const std::string where = std::string(b.flavor->name) + ": policy.device = " + d;
  auto decline = [&](rlh_code code, const std::string& why) {
    if (!automatic) throw Error(code, where + ": " + why);
    b.host.info(std::string(b.flavor->name) + ": " + m.role + " runs on the CPU engine (" + why + ")");
    return false;
  };
  // Context parallelism has no device path (the CUDA engine splits no sequence): named first,
  // whatever the precision or the build.
  if (b.dp && b.dp->cp_size() > 1)
    return decline(RLH_E_UNIMPLEMENTED, "context parallelism (context_parallel_size = " +
                                            std::to_string(b.dp->cp_size()) + ") runs on the CPU engine only");
  // Nor has expert parallelism (the CUDA engine dispatches no experts to other ranks).
  if (b.dp && b.dp->ep_size() > 1)
    return decline(RLH_E_UNIMPLEMENTED, "expert parallelism (expert_model_parallel_size = " +
                                            std::to_string(b.dp->ep_size()) + ") runs on the CPU engine only");
  if (!m.config.bf16()) {
    if (automatic) return false;  // float32 training is the CPU engine's
    throw Error(RLH_E_INVALID_ARGUMENT, where + " computes in bfloat16 with float32 master weights: set "
                                                "policy.precision = bfloat16 (it is " + m.config.precision + ")");
  }
  // Automodel's float32 head of MoE models (dtensor's moe_parallelizer.lm_head_precision): the
  // CUDA engine's head multiplies bf16 operands, so the setting is honoured on the CPU engine
  // only, never dropped.
  if (m.config.moe_head_fp32 && std::any_of(m.desc.layers.begin(), m.desc.layers.end(), [](const sdk::LayerDesc& l) {
        return l.mlp.kind == sdk::MlpKind::moe;
      }))
    return decline(RLH_E_UNIMPLEMENTED, "policy.dtensor_cfg.moe_parallelizer.lm_head_precision = float32: the CUDA "
                                        "engine's head multiplies bf16 operands (float32 logits); a float32 head runs "
                                        "on the CPU engine");
  if (f == nullptr) {
    if (automatic) return false;
    throw Error(RLH_E_UNIMPLEMENTED, where + ": this backend has no device path in this build (the CUDA engine "
                                             "is megatron's and dtensor's, built where the CUDA toolchain is)");
  }
  // Several ranks: data parallelism (DDP, the distributed optimizer, FSDP / HSDP) and tensor
  // parallelism of dense models (the engine refuses the rest by name at creation: MoE and MLA
  // layers, a value head, FP8) over device communicators; the other layouts are the CPU
  // engine's so far. Sequence parallelism is not the engine's (it splits no sequence).
  if (b.dp && b.dp->tp_size() > 1 && m.config.parallel.sequence_parallel)
    return decline(RLH_E_UNIMPLEMENTED, "sequence parallelism (megatron_cfg.sequence_parallel with "
                                        "tensor_model_parallel_size = " + std::to_string(b.dp->tp_size()) +
                                            ") runs on the CPU engine only");
  if (b.dp && b.dp->pp_size() > 1)
    return decline(RLH_E_UNIMPLEMENTED, "pipeline parallelism (pipeline_model_parallel_size = " +
                                            std::to_string(b.dp->pp_size()) + ") runs on the CPU engine only");
  // "cuda" without an index (and auto): the device of this rank's place on its node, so the ranks
  // of a multi-GPU node spread over its GPUs (sdk::local_device); "cuda:N" as written.
  const std::string target = (automatic || d == "cuda") && f->device_count != nullptr
                                 ? "cuda:" + std::to_string(sdk::local_device(f->device_count(), sdk::detect_launch()))
                                 : automatic ? "cuda" : d;
  std::string why;
  if (!f->available(target, &why)) return decline(RLH_E_UNAVAILABLE, why);
  if (m.trainable && m.config.optimizer->kind != OptimizerKind::adamw)
    return decline(RLH_E_UNIMPLEMENTED, "the device path runs AdamW only, the optimizer is " +
                                            std::string(to_string(m.config.optimizer->kind)));
  // The device's kernels: every provider that runs there, op by op, pins applied.
  const int index = target.size() > 5 ? std::stoi(target.substr(5)) : 0;  // "cuda" or "cuda:N" (validated)
  m.registry = sdk::make_kernel_registry(b.host, sdk::cuda_device(index), m.config.kernel_pins, b.flavor->name,
                                         "{}", m.config.kernel_verify);
  if (m.registry->providers().empty())
    return decline(RLH_E_FAILED_PRECONDITION, "no kernel provider runs on " + target +
                                                  " (load kernels_cuda: --plugin kernels_cuda, or put it on the plugin path)");
  DeviceEngineOptions o;
  o.device = target;
  o.kernels = m.registry.get();
  o.trainable = m.trainable;
  o.recompute = m.config.recompute;
  o.recompute_selective = m.config.recompute_selective;
  o.moe = m.config.moe;
  o.fp8 = m.config.fp8;
  o.batch_invariant = m.config.batch_invariant;
  // dtensor_cfg.cpu_offload: the masters and moments in host memory (a frozen model has none).
  o.offload_state = m.config.parallel.cpu_offload && m.trainable;
  if (m.config.optimizer) {
    const OptimizerConfig& oc = *m.config.optimizer;
    o.optimizer.beta1 = oc.beta1;
    o.optimizer.beta2 = oc.beta2;
    o.optimizer.eps = oc.eps;
    o.optimizer.weight_decay = oc.weight_decay;
    o.optimizer.decay_1d_params = oc.decay_1d_params;
    o.optimizer.max_grad_norm = oc.max_grad_norm;
  }
  if (b.dp) {
    m.dp = b.dp.get();  // (m.tp() reads this rank's tp rank from it)
    const rlh_device dev = sdk::cuda_device(index);
    const int T = b.dp->tp_size();
    if (T == 1 && !b.device_dp)  // collective over the world, like the groups
      b.device_dp = std::make_unique<CommDeviceDp>(sdk::make_device_comm(b.host, dev, "", b.flavor->name), dev);
    if (T > 1 && !b.device_tp) {
      // Tensor parallelism: the world is T x dp ranks (nothing else of model parallelism gets
      // here). Split on the device as the host groups are (collective: every rank, in the same
      // order): the tp group, the ranks of one data-parallel rank in tp order; the data-parallel
      // group, the ranks of one tp rank in data-parallel order.
      b.device_world = std::make_unique<CommDeviceDp>(sdk::make_device_comm(b.host, dev, "", b.flavor->name), dev);
      b.device_tp = std::make_unique<CommDeviceDp>(
          b.device_world->comm().split(b.dp->dp.rank(), b.dp->tp.rank(), "tp (device)"), dev);
      b.device_dp = std::make_unique<CommDeviceDp>(
          b.device_world->comm().split(b.dp->tp.rank(), b.dp->dp.rank(), "dp (device)"), dev);
    }
    if (b.device_dp->size() != b.dp->size() || (T > 1 && b.device_dp->rank() != b.dp->rank()))
      throw Error(RLH_E_INTERNAL, where + ": the device data-parallel group is rank " + std::to_string(b.device_dp->rank()) +
                                      " of " + std::to_string(b.device_dp->size()) + ", the host's " +
                                      std::to_string(b.dp->rank()) + " of " + std::to_string(b.dp->size()));
    if (T > 1 && (b.device_tp->size() != T || b.device_tp->rank() != b.dp->tp_rank()))
      throw Error(RLH_E_INTERNAL, where + ": the device tensor-parallel group is rank " + std::to_string(b.device_tp->rank()) +
                                      " of " + std::to_string(b.device_tp->size()) + ", the host's " +
                                      std::to_string(b.dp->tp_rank()) + " of " + std::to_string(T));
    // (At TP x DP 1 the data-parallel group is this rank alone: no gradient sum to run.)
    o.dp = b.device_dp->size() > 1 ? b.device_dp.get() : nullptr;
    if (m.tp()) {
      o.tp = m.tp();
      o.tp_comm = b.device_tp.get();
    }
    // FSDP (dtensor): the fp32 masters and moments as this rank's block of the shard group's
    // (the world without HSDP); HSDP sums the gradient blocks over the replicas too.
    const bool fsdp = m.config.parallel.fsdp;
    if (fsdp && b.dp->replicate) {
      if (!b.device_shard) {  // collective: the host groups' membership and order, on the device
        b.device_shard = std::make_unique<CommDeviceDp>(
            b.device_dp->comm().split(b.dp->replicate.rank(), b.dp->shard.rank(), "dp shard (device)"), dev);
        b.device_replicate = std::make_unique<CommDeviceDp>(
            b.device_dp->comm().split(b.dp->shard.rank(), b.dp->replicate.rank(), "dp replicate (device)"), dev);
      }
      if (b.device_shard->size() != b.dp->shard.size() || b.device_replicate->size() != b.dp->replicate.size())
        throw Error(RLH_E_INTERNAL, where + ": the device shard / replicate groups have " +
                                        std::to_string(b.device_shard->size()) + " / " +
                                        std::to_string(b.device_replicate->size()) + " ranks, the host's " +
                                        std::to_string(b.dp->shard.size()) + " / " + std::to_string(b.dp->replicate.size()));
      o.dp = b.device_shard.get();
      o.dp_replicate = b.device_replicate.get();
    }
    o.shard_optimizer = fsdp || m.config.parallel.distributed_optimizer;
    o.shard_masters = fsdp;
    m.dp_mode = fsdp ? Model::Dp::fsdp : o.shard_optimizer ? Model::Dp::distributed_optimizer : Model::Dp::ddp;
  }
  try {
    m.device = f->create(m.desc, o);
  } catch (const std::invalid_argument& e) {
    return decline(RLH_E_UNIMPLEMENTED, m.desc.architecture + ": " + e.what());
  } catch (const std::exception& e) {
    throw Error(RLH_E_UNAVAILABLE, where + ": " + e.what());
  }
  device_load_parameters(m, weights);  // this rank's pieces under tensor parallelism
  const std::string chosen = m.registry->choices_summary();  // empty until the engine resolves its ops
  m.kernels = m.device->describe() + "; kernels: " + (chosen.empty() ? "chosen per op at first use" : chosen);
  return true;
}

}  // namespace

std::unique_ptr<Model> load_model(Backend& b, const rlh_model_args& args) {
  auto m = std::make_unique<Model>();
  m->owner = &b;
  m->role = args.role != nullptr ? args.role : "policy";
  m->trainable = (args.flags & RLH_MODEL_TRAINABLE) != 0;

  // Per-model overrides (a reference model's precision, a critic's optimizer) patch the section.
  if (args.config_json != nullptr && args.config_len > 0) {
    json patch;
    try {
      patch = json::parse(std::string(args.config_json, args.config_len));
    } catch (const json::exception& e) {
      throw Error(RLH_E_INVALID_ARGUMENT, "model '" + m->role + "': config_json is not valid JSON: " + e.what());
    }
    if (!patch.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "model '" + m->role + "': config_json must be an object");
    m->config = b.flavor->read_config(merge_patch(b.policy, patch));
  } else {
    m->config = b.config;
  }
  if (m->trainable && !m->config.optimizer)
    throw Error(RLH_E_FAILED_PRECONDITION, "model '" + m->role + "' is trainable but " + m->config.optimizer_missing);

  const std::string path = args.path;
  try {
    m->dir = sdk::resolve_model_path(path).string();
  } catch (const std::exception& e) {
    throw Error(RLH_E_NOT_FOUND, e.what());  // names the path and where it looked
  }
  const std::string config_text = read_file(m->dir + "/config.json");
  m->desc = describe_model(b.host, m->dir, config_text, args);

  sdk::LoadResult weights;
  std::string value_why;
  bool fresh_head = false;
  try {
    m->checkpoint = sdk::st::Checkpoint::open(m->dir);
    value_why = value_head_reason(args, m->role, args.config_json != nullptr && args.config_len > 0
                                                     ? merge_patch(b.policy, json::parse(std::string(args.config_json, args.config_len)))
                                                     : b.policy,
                                  config_text, m->checkpoint);
    if (!value_why.empty()) {
      fresh_head = m->checkpoint.find(kScoreWeight).info == nullptr;
      // An HF value model keeps no lm_head: the decoder's output goes to score alone. Its
      // engine head then reads the embedding (as if tied) and logprob outputs are refused.
      if (!m->desc.tie_word_embeddings && m->checkpoint.find("lm_head.weight").info == nullptr &&
          !fresh_head) {
        std::erase_if(m->desc.params, [](const sdk::ParamDesc& p) { return p.role == sdk::ParamRole::lm_head; });
        m->desc.tie_word_embeddings = true;
        m->value_only = true;
      }
      if (!fresh_head) m->desc.params.push_back(value_head_param(m->desc));
    }
    weights = sdk::load_weights_f32(m->desc, m->checkpoint);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("model '") + path + "': " + e.what());
  }
  m->passthrough = weights.unused;
  if (fresh_head) {
    // HF's initialisation of a new score head (nn.Linear under _init_weights): normal(0,
    // initializer_range), here from a fixed seed so that a run is reproducible.
    m->desc.params.push_back(value_head_param(m->desc));
    std::mt19937_64 rng(0x5C0BE);
    std::normal_distribution<double> normal(0.0, m->desc.initializer_range);
    std::vector<float> w(size_t(m->desc.hidden_size));
    for (float& x : w) x = float(normal(rng));
    weights.tensors.push_back(std::move(w));
  }
  if (!value_why.empty())
    b.host.info(std::string(b.flavor->name) + ": " + m->role + " has a value head (" + kScoreWeight + ", " +
                (fresh_head ? "newly initialised" : "from the checkpoint") + ") because " + value_why);

  // Several launched ranks: the data-parallel groups, once per backend (collective).
  const int64_t tp = m->config.parallel.tp, cp = m->config.parallel.cp, pp = m->config.parallel.pp,
                ep = m->config.parallel.ep;
  if (!b.dp && launched_world_size() > 1) {
    try {
      b.dp = make_dp_groups(b.host, m->config.parallel.dp_replicate, b.flavor->name, tp, cp, pp, ep,
                            ep > 1 ? m->config.parallel.etp : 0);
    } catch (const Error& e) {
      if (tp <= 1 && cp <= 1 && pp <= 1 && ep <= 1) throw;
      std::string keys;  // the model-parallel sizes that are set, by name
      for (const auto& [name, n] : {std::pair<const char*, int64_t>{"tensor_model_parallel_size", tp},
                                    {"context_parallel_size", cp}, {"pipeline_model_parallel_size", pp},
                                    {"expert_model_parallel_size", ep}})
        if (n > 1) keys += (keys.empty() ? "" : ", ") + std::string(name) + " = " + std::to_string(n);
      // (The expert layout's etp x ep x pp must divide the world too: etp named where it is not tp.)
      if (ep > 1 && m->config.parallel.etp != tp)
        keys += ", expert_tensor_parallel_size = " + std::to_string(m->config.parallel.etp);
      throw Error(e.code(), "policy.megatron_cfg." + keys + ": " + e.what());
    }
  }
  check_context_parallel(b, *m);
  if (m->config.expert_bias_update_rate > 0)
    for (const sdk::ParamDesc& p : m->desc.params)
      if (p.role == sdk::ParamRole::expert_score_bias)
        throw Error(RLH_E_UNIMPLEMENTED,
                    m->desc.architecture + " (" + m->dir + "): policy.megatron_cfg.moe_router_bias_update_rate = " +
                        nlohmann::json(m->config.expert_bias_update_rate).dump() + ": " + p.name +
                        " would move by aux-loss-free balancing, which rlhost does not run (set 0: the bias "
                        "stays as the checkpoint has it, as NeMo-RL's GRPO recipes keep it)");
  if (tp > 1 && (!b.dp || b.dp->tp_size() != tp))
    throw Error(RLH_E_INVALID_ARGUMENT,
                std::string(b.flavor->name) + ": policy.megatron_cfg.tensor_model_parallel_size = " + std::to_string(tp) +
                    " needs a multiple of " + std::to_string(tp) + " launched ranks split that way, but " +
                    (b.dp ? "this backend's groups have tensor-parallel size " + std::to_string(b.dp->tp_size())
                          : std::string("one rank was started")));
  if (tp > 1) {
    // Every rank's layout (checkpoints gather the pieces of all of them); refused settings
    // name themselves here, before any weight is placed.
    // With expert parallelism the experts are whole on their ep rank (etp = 1) or cut over an
    // etp group (etp dividing tp, the config's rule); without it over the tp group only.
    const int64_t etp = m->config.parallel.etp;
    for (const sdk::LayerDesc& l : m->desc.layers)
      if (l.mlp.kind == sdk::MlpKind::moe && etp != tp && ep <= 1)
        throw Error(RLH_E_UNIMPLEMENTED, m->desc.architecture + " (" + m->dir +
                                             "): policy.megatron_cfg.expert_tensor_parallel_size = " + std::to_string(etp) +
                                             " with tensor_model_parallel_size = " + std::to_string(tp) +
                                             ": the experts are split over the tensor-parallel group only without expert "
                                             "parallelism (set it to " + std::to_string(tp) + " or null)");
    try {
      for (int64_t r = 0; r < tp; ++r)
        m->tp_layouts.push_back(sdk::make_tp_layout(m->desc, tp, r, "policy.megatron_cfg.tensor_model_parallel_size",
                                                    ep > 1 ? etp : tp));
    } catch (const std::invalid_argument& e) {
      throw Error(RLH_E_UNIMPLEMENTED, m->desc.architecture + " (" + m->dir + "): " + e.what());
    }
    m->tp_comm = std::make_unique<CommTpGroup>(b.dp->tp);
  }
  if (pp > 1 && ep <= 1) make_pipeline_stage(b, *m);  // (with EP below: its stage is cut from the ep layout's)
  if (!b.dp && m->config.parallel.dp_replicate > 1)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(b.flavor->name) + ": policy.dtensor_cfg.dp_replicate_size = " +
                                            std::to_string(m->config.parallel.dp_replicate) +
                                            " replicas need as many data-parallel ranks (or a multiple), but one rank was started");
  if (place_on_device(b, *m, weights.tensors)) {
    b.host.info(std::string(b.flavor->name) + ": loaded " + m->role + " " + m->desc.architecture + " from " + m->dir +
                " (" + std::to_string(m->device->num_elements()) + " parameters, " +
                (m->trainable ? "adamw optimizer" : std::string("frozen")) +
                (m->config.fp8.enabled ? std::string(", FP8 linears (") +
                                             (m->config.fp8.blockwise ? std::string("blockwise")
                                              : m->config.fp8.delayed
                                                  ? "tensorwise delayed scaling, amax history " +
                                                        std::to_string(m->config.fp8.amax_history_len) +
                                                        (m->config.fp8.amax_max ? " (max)" : " (most_recent)") +
                                                        (m->config.fp8.margin ? ", margin " + std::to_string(m->config.fp8.margin) : std::string())
                                                  : std::string("tensorwise")) +
                                             (m->config.fp8.hybrid ? ", hybrid)" : ", e4m3)")
                                       : std::string()) +
                (m->config.recompute ? (m->config.recompute_selective ? ", selective recompute" : ", full recompute") : "") +
                (m->tp() ? ", tensor parallel over " + std::to_string(m->dp->tp_size()) + " ranks on the device"
                         : std::string()) +
                (m->dp ? ", data parallel over " + std::to_string(m->dp->size()) + " ranks (" +
                             (m->dp_mode == Model::Dp::fsdp ? "FSDP: fp32 masters and moments sharded" +
                                                                  (m->dp->replicate ? ", " + std::to_string(m->dp->replicate.size()) + " replicas" : std::string())
                              : m->dp_mode == Model::Dp::distributed_optimizer ? std::string("distributed optimizer")
                                                                               : std::string("gradients all-reduced")) +
                             ", on the device)"
                       : std::string()) +
                ", on " + m->kernels + ")");
    return m;
  }
  // FP8 is the CUDA engine's (through a device kernel provider): a model placed on the CPU
  // engine would train in float32 under an FP8 setting, so it is refused instead.
  if (m->config.fp8.enabled)
    throw Error(RLH_E_UNIMPLEMENTED, std::string(b.flavor->name) + ": policy.megatron_cfg.fp8_cfg.enabled = true: FP8 "
                                         "linears run on the CUDA engine only (policy.device = cuda, policy.precision = "
                                         "bfloat16, one rank per GPU without model parallelism); " + m->role +
                                         " would run on the CPU engine (policy.device = " + m->config.device + ")");
  if (m->config.precision != "float32" && m->config.precision != "fp32")
    b.host.info(std::string(b.flavor->name) + ": policy.precision = " + m->config.precision + ": " + m->role +
                " runs on the CPU engine, which computes and keeps master weights in float32");
  select_kernels(b.host, *b.flavor, *m);
  engine::EngineOptions eo;
  eo.recompute = m->config.recompute;
  eo.moe = m->config.moe;
  eo.allocator = &m->alloc;
  eo.state_allocator = &m->state_alloc;
  eo.ops = m->ops.get();
  prepare_data_parallel(b, *m, eo);
  prepare_expert_parallel(b, *m, eo);  // after the data-parallel mode: the experts' padding
  if (pp > 1 && ep > 1) make_pipeline_stage(b, *m);
  eo.tp = m->tp();
  eo.tp_comm = m->tp_comm.get();
  eo.cp_comm = m->cp_comm.get();
  eo.sequence_parallel = m->config.parallel.sequence_parallel;
  eo.pp = m->pp();
  // The engine computes the clip coefficient; the optimizer applies it (optimizer.hpp).
  eo.optimizer.max_grad_norm = m->config.optimizer ? m->config.optimizer->max_grad_norm : 0.0;
  try {
    m->engine = std::make_unique<engine::Engine>(m->desc, eo);
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_UNIMPLEMENTED, m->desc.architecture + " (" + m->dir + "): " + e.what());
  }
  if (m->dp_mode == Model::Dp::none) {
    m->engine->load_parameters(weights.tensors);
    if (m->trainable) m->optimizer = make_optimizer(*m);
  } else {
    finish_data_parallel(*m, weights.tensors);
  }
  weights.tensors.clear();

  static const char* const kDpModes[] = {"", "gradients all-reduced", "distributed optimizer",
                                         "FSDP: parameters, gradients and optimizer state sharded"};
  const std::string dp_note =
      m->dp ? (m->tp() ? ", tensor parallel over " + std::to_string(m->dp->tp_size()) + " ranks" : std::string()) +
                  (m->ep() ? ", experts over " + std::to_string(m->dp->ep_size()) + " ranks" : std::string()) +
                  (m->cp_comm ? ", context parallel over " + std::to_string(m->dp->cp_size()) + " ranks" : std::string()) +
                  (m->tp() && m->config.parallel.sequence_parallel ? ", sequence parallel" : "") +
                  (m->pp() ? ", pipeline stage " + std::to_string(m->pp()->rank) + " of " + std::to_string(m->pp()->size) +
                                 " (" + pp_layers_note(*m->pp()) + ")"
                           : std::string()) +
                  ", data parallel over " + std::to_string(m->dp->size()) + " ranks (" + kDpModes[int(m->dp_mode)] +
                  (m->dp_mode == Model::Dp::fsdp && m->dp->replicate ? ", " + std::to_string(m->dp->replicate.size()) + " replicas" : "") + ")"
            : "";
  b.host.info(std::string(b.flavor->name) + ": loaded " + m->role + " " + m->desc.architecture + " from " + m->dir +
              " (" + std::to_string(m->engine->num_elements()) + " parameters" + dp_note + ", " +
              (m->trainable ? std::string(to_string(m->config.optimizer->kind)) + " optimizer" : std::string("frozen")) +
              (m->config.recompute ? ", recompute" : "") + ", kernels " + m->kernels + ")");
  return m;
}

}  // namespace rlh::backend
