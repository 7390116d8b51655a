// The `generator` plugin: the GENERATOR component "native" (abi/include/rlhost/generator.h) over
// rlh_generator_core.
//
// create() takes the model folder (or a hub id in the local HF cache) and its config section:
//   the model is described by a MODEL component found through the host (config "model_component",
//   else the best loaded one) — the same description the trainer executes; weights come from the
//   folder's safetensors, or, with load_format "dummy", only through update_weights (colocated:
//   the trainer's buffers, as views when may_alias is set).
// Stop strings need text: a TOKENIZER component (config "tokenizer_component", else the best
// loaded) is created on first use for the folder (or config "tokenizer").
// The device (config "device"; "auto" follows policy.device): the CPU (float32 over the CPU's
// kernel registry) or a CUDA device (bf16 over that device's registry: cuda_executor.hpp), in a
// build with the CUDA toolchain.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/generator.h"
#include "rlhost/generator/cuda_executor.hpp"
#include "rlhost/generator/generator.hpp"
#include "rlhost/model.h"
#include "rlhost/sdk/describe_model.hpp"
#include "rlhost/sdk/comm.hpp"
#include "rlhost/sdk/hf_cache.hpp"
#include "rlhost/sdk/input_file.hpp"
#include "rlhost/sdk/kernel_registry.hpp"
#include "rlhost/sdk/launch_env.hpp"
#include "rlhost/sdk/model_weights.hpp"
#include "rlhost/sdk/safetensors_dtype.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "rlhost/sdk/safetensors.hpp"
#include "rlhost/tokenizer.h"

namespace {

using rlh::sdk::Error;
using json = nlohmann::json;
namespace gen = rlh::gen;

// Detokenizer over a TOKENIZER component instance.
class AbiDetokenizer final : public gen::Detokenizer {
 public:
  AbiDetokenizer(const rlh_tokenizer_api* api, rlh_tokenizer* tok) : api_(api), tok_(tok) {}
  ~AbiDetokenizer() override { api_->destroy(tok_); }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    rlh::sdk::check(api_->decode(tok_, ids.data(), ids.size(), RLH_DECODE_SKIP_SPECIAL_TOKENS,
                                 rlh::sdk::write_to_string, &text),
                    "generator: decoding for stop strings");
    return text;
  }

 private:
  const rlh_tokenizer_api* api_;
  rlh_tokenizer* tok_;
};

// A tensor-parallel generator's group over the host's communicator (comm_mpi on CPU ranks).
class CommTpGroup final : public gen::TpGroup {
 public:
  explicit CommTpGroup(rlh::sdk::Comm c) : c_(std::move(c)) {}
  int size() const override { return c_.size(); }
  int rank() const override { return c_.rank(); }
  void all_reduce_sum(float* data, int64_t n) override {
    c_.all_reduce(rlh::sdk::host_tensor(data, rlh::sdk::dtype_of<float>(), std::span<const int64_t>(&n, 1)), RLH_REDUCE_SUM);
  }
  void all_gather(const float* in, int64_t n, float* out) override {
    const int64_t all = n * c_.size();
    c_.all_gather(rlh::sdk::host_tensor(const_cast<float*>(in), rlh::sdk::dtype_of<float>(), std::span<const int64_t>(&n, 1)),
                  rlh::sdk::host_tensor(out, rlh::sdk::dtype_of<float>(), std::span<const int64_t>(&all, 1)));
  }

 private:
  rlh::sdk::Comm c_;
};

// policy.generation.vllm_cfg.tensor_parallel_size (absent or null: 1).
// policy.generation.vllm_cfg.precision: fp8 asks for FP8 rollouts (NeMo-RL's vLLM FP8: blockwise
// weights, the first/last num_*_layers_in_bf16 layers and the head in bf16). Other values keep
// bf16 (the host's rule accepts null, bfloat16, float16, float32 without an FP8 provider).
bool fp8_rollouts(const json& vllm, rlh::engine::Fp8Options* f) {
  if (!vllm.is_object() || !vllm.contains("precision") || !vllm["precision"].is_string() ||
      vllm["precision"].get<std::string>() != "fp8")
    return false;
  f->enabled = true;
  f->blockwise = true;
  auto layers = [&](const char* key) -> int64_t {
    if (!vllm.contains(key) || vllm[key].is_null()) return 0;  // NeMo-RL's default: none in bf16
    if (!vllm[key].is_number_integer() || vllm[key].get<int64_t>() < 0)
      throw Error(RLH_E_INVALID_ARGUMENT, std::string("policy.generation.vllm_cfg.") + key + " must be an integer >= 0");
    return vllm[key].get<int64_t>();
  };
  f->bf16_first_layers = layers("num_first_layers_in_bf16");
  f->bf16_last_layers = layers("num_last_layers_in_bf16");
  return true;
}

// policy.generation.vllm_cfg.kv_cache_dtype (vLLM's names): fp8 / fp8_e4m3 ask for an FP8 e4m3
// cache; null, auto, bfloat16 and float32 keep the executor's own; anything else (fp8_e5m2) is
// refused, naming the key.
bool kv_cache_fp8(const json& vllm) {
  if (!vllm.is_object() || !vllm.contains("kv_cache_dtype") || vllm["kv_cache_dtype"].is_null()) return false;
  if (!vllm["kv_cache_dtype"].is_string())
    throw Error(RLH_E_INVALID_ARGUMENT, "policy.generation.vllm_cfg.kv_cache_dtype must be a string (auto, fp8, "
                                        "fp8_e4m3), not " + vllm["kv_cache_dtype"].dump());
  const std::string v = vllm["kv_cache_dtype"].get<std::string>();
  if (v == "fp8" || v == "fp8_e4m3") return true;
  if (v == "auto" || v == "bfloat16" || v == "float32") return false;
  throw Error(RLH_E_UNIMPLEMENTED, "policy.generation.vllm_cfg.kv_cache_dtype = " + v +
                                       ": the generator's caches are fp8 (fp8_e4m3), or the executor's own dtype (auto)");
}

int64_t tensor_parallel_size(const json& vllm) {
  if (!vllm.is_object() || !vllm.contains("tensor_parallel_size") || vllm["tensor_parallel_size"].is_null()) return 1;
  const json& v = vllm["tensor_parallel_size"];
  if (!v.is_number_integer() || v.get<int64_t>() < 1)
    throw Error(RLH_E_INVALID_ARGUMENT, "policy.generation.vllm_cfg.tensor_parallel_size must be an integer >= 1, not " + v.dump());
  return v.get<int64_t>();
}

struct NativeGenerator {
  rlh::sdk::Host host;
  // Tensor parallelism: this rank's group (G consecutive ranks of the host's world).
  std::unique_ptr<CommTpGroup> tp;
  std::string model_dir;
  std::string tokenizer_path, tokenizer_component;
  // The kernels the decode draws its ops from (destroyed after the generator that uses them).
  std::unique_ptr<rlh::sdk::KernelRegistry> registry;
  std::unique_ptr<rlh::engine::Ops> ops;
  std::unique_ptr<gen::Generator> gen;  // after tp (the generator uses the group)
  std::unique_ptr<AbiDetokenizer> detok;

  const gen::Detokenizer& detokenizer() {
    if (detok) return *detok;
    const rlh_component_desc* d = nullptr;
    const auto* api = host.find<rlh_tokenizer_api>(
        RLH_KIND_TOKENIZER, tokenizer_component.empty() ? nullptr : tokenizer_component.c_str(),
        RLH_STRUCT_SIZE(rlh_tokenizer_api, decode), &d);
    rlh_tokenizer* tok = nullptr;
    const std::string path = tokenizer_path.empty() ? model_dir : tokenizer_path;
    rlh::sdk::check(api->create(host.api(), path.c_str(), &tok),
                    "generator: stop strings need the tokenizer of '" + path + "'");
    detok = std::make_unique<AbiDetokenizer>(api, tok);
    return *detok;
  }
};

NativeGenerator* as_gen(rlh_generator* g) { return reinterpret_cast<NativeGenerator*>(g); }

// ---------------------------------------------------------------------------------------------
// Config

const char* const kKeys[] = {"max_num_seqs",     "max_num_batched_tokens", "block_size",     "kv_cache_bytes",
                             "max_model_len",    "num_threads",            "load_format",    "model_component",
                             "tokenizer",        "tokenizer_component",    "moe_router_dtype", "device",
                             "gpu_memory_utilization", "cuda_graphs",      "batch_invariant", "kv_cache_sleep"};

int64_t get_int(const json& c, const char* key, int64_t def) {
  if (!c.contains(key)) return def;
  if (!c[key].is_number_integer())
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator config: '") + key + "' must be an integer");
  return c[key].get<int64_t>();
}
std::string get_str(const json& c, const char* key, const std::string& def) {
  if (!c.contains(key)) return def;
  if (!c[key].is_string()) throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator config: '") + key + "' must be a string");
  return c[key].get<std::string>();
}

bool router_dtype_is_fp64(const std::string& v, const std::string& key) {
  if (v != "fp32" && v != "fp64")
    throw Error(RLH_E_INVALID_ARGUMENT, key + ": expected fp32 or fp64, got \"" + v + "\"");
  return v == "fp64";
}

// policy.kernels pins and verify, shared with the trainer's engines (absent: no pins, verify).
std::string kernels_section(const rlh::sdk::Host& host) {
  try {
    return host.config_json("policy.kernels");
  } catch (const Error& e) {
    if (e.code() == RLH_E_NOT_FOUND || e.code() == RLH_E_FAILED_PRECONDITION) return "{}";
    throw;
  }
}

// A value of the host's configuration (absent: null).
json host_config(const rlh::sdk::Host& host, const char* key) {
  try {
    return json::parse(host.config_json(key));
  } catch (const Error& e) {
    if (e.code() == RLH_E_NOT_FOUND || e.code() == RLH_E_FAILED_PRECONDITION) return json();
    throw;
  }
}

// dtensor's router precision: policy.dtensor_cfg.automodel_kwargs.backend.gate_precision.
bool dtensor_gate_fp64(const rlh::sdk::Host& host, std::string* source) {
  const char* key = "policy.dtensor_cfg.automodel_kwargs.backend.gate_precision";
  const json v = host_config(host, key);
  if (v.is_null()) return false;  // absent or null: fp32
  const std::string g = v.is_string() ? v.get<std::string>() : v.dump();
  *source = key;
  const auto dtype = rlh::sdk::st::dtype_from_config_name(g);
  if (dtype == rlh::sdk::st::DType::F64) return true;
  if (dtype == rlh::sdk::st::DType::F32) return false;
  throw Error(RLH_E_INVALID_ARGUMENT, std::string(key) + ": expected float32 or float64, got " + g);
}

// The MoE router's precision: the section's moe_router_dtype, else the training backend's: with
// policy.megatron_cfg.enabled megatron's moe_router_dtype (default fp32, as plugins/megatron
// reads it), else dtensor's (the default backend) Automodel gate_precision (float64 is the fp64
// router, null or float32 the fp32 one, as plugins/dtensor reads it). The generator must route
// as the trainer does (docs/generator.md). `source` says where the setting came from, for the log.
bool router_fp64(const rlh::sdk::Host& host, const json& cfg, std::string* source) {
  if (cfg.contains("moe_router_dtype")) {
    *source = "native_cfg.moe_router_dtype";
    return router_dtype_is_fp64(get_str(cfg, "moe_router_dtype", "fp32"), "generator config: moe_router_dtype");
  }
  *source = "default";
  const json megatron = host_config(host, "policy.megatron_cfg");
  // The GRPO loop picks megatron exactly when this is true (plugins/grpo/src/loop_config.cpp);
  // else (no megatron section included) the backend is dtensor.
  if (!megatron.is_object() || !megatron.contains("enabled") || megatron["enabled"] != json(true))
    return dtensor_gate_fp64(host, source);
  *source = "policy.megatron_cfg.moe_router_dtype";
  const json& v = megatron.contains("moe_router_dtype") ? megatron["moe_router_dtype"] : json("fp32");
  if (!v.is_string())
    throw Error(RLH_E_INVALID_ARGUMENT, "policy.megatron_cfg.moe_router_dtype: expected fp32 or fp64");
  return router_dtype_is_fp64(v.get<std::string>(), "policy.megatron_cfg.moe_router_dtype");
}

bool get_bool(const json& c, const char* key, bool def) {
  if (!c.contains(key)) return def;
  if (!c[key].is_boolean()) throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator config: '") + key + "' must be true or false");
  return c[key].get<bool>();
}

// Where the generator runs: the section's "device", else the policy's (policy.device; "auto"
// there, or no setting, picks a usable Hopper GPU when the policy computes in bfloat16, as the
// megatron backend's device path does, else the CPU). Returns -1 for the CPU, else the CUDA
// device; `source` says why, for the log.
int pick_device(const rlh::sdk::Host& host, const json& cfg, std::string* source) {
  std::string d = get_str(cfg, "device", "auto");
  *source = "native_cfg.device";
  bool from_policy = false;
  if (d == "auto") {
    const json pd = host_config(host, "policy.device");
    if (pd.is_string() && pd.get<std::string>() != "auto") {
      d = pd.get<std::string>();
      *source = "policy.device";
      from_policy = true;
    }
  }
  const std::string key = from_policy ? "policy.device" : "generator config: device";
  if (d == "cpu") return -1;
  if (d == "cuda" || d.rfind("cuda:", 0) == 0) {
    int dev = 0;  // "cuda": this rank's device on its node, as the backends place the policy
#ifdef RLH_GENERATOR_CUDA
    dev = rlh::sdk::local_device(rlh::gen::cuda_device_count(), rlh::sdk::detect_launch());
#endif
    if (d.size() > 5) {
      const std::string n = d.substr(5);
      if (n.empty() || n.size() > 3 || n.find_first_not_of("0123456789") != std::string::npos)
        throw Error(RLH_E_INVALID_ARGUMENT, key + ": expected auto, cpu, cuda or cuda:N, got \"" + d + "\"");
      dev = std::stoi(n);
    }
#ifndef RLH_GENERATOR_CUDA
    throw Error(RLH_E_UNIMPLEMENTED, key + " = " + d + ": this build of the generator has no CUDA path (built without the CUDA toolchain)");
#else
    std::string why;
    if (!rlh::gen::cuda_generator_available(&why, dev)) throw Error(RLH_E_UNAVAILABLE, key + " = " + d + ": " + why);
    return dev;
#endif
  }
  if (d != "auto") throw Error(RLH_E_INVALID_ARGUMENT, key + ": expected auto, cpu, cuda or cuda:N, got \"" + d + "\"");
  // auto: the GPU where the policy computes in bfloat16 and one is usable
  const json prec = host_config(host, "policy.precision");
  *source = "auto";
  if (!prec.is_string() || (prec.get<std::string>() != "bfloat16" && prec.get<std::string>() != "bf16")) return -1;
#ifdef RLH_GENERATOR_CUDA
  const int local = rlh::sdk::local_device(rlh::gen::cuda_device_count(), rlh::sdk::detect_launch());
  if (rlh::gen::cuda_generator_available(nullptr, local)) {
    *source = "auto: policy.precision bfloat16 and a usable GPU";
    return local;
  }
#endif
  return -1;
}

// The description of the folder's config.json, from a MODEL component through the host.
rlh::sdk::TransformerDesc describe(const rlh::sdk::Host& host, const std::string& dir, const std::string& component) {
  return rlh::sdk::describe_model_folder(host, dir, component, "generator");
}

// ---------------------------------------------------------------------------------------------
// The table

rlh_status* gen_create(const rlh_host_api* host, const char* model_path, const char* config_json, size_t config_len,
                       rlh_generator** out) {
  return rlh::sdk::guard(host ? host->make_status : nullptr, [&] {
    if (!out) throw Error(RLH_E_INVALID_ARGUMENT, "generator create: out is NULL");
    *out = nullptr;
    if (!model_path || !*model_path) throw Error(RLH_E_INVALID_ARGUMENT, "generator create: a model path is required");
    json cfg = json::object();
    json vllm;  // policy.generation.vllm_cfg, when the whole section was passed
    if (config_json && config_len) {
      try {
        cfg = json::parse(std::string(config_json, config_len));
      } catch (const json::exception& e) {
        throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator config: invalid JSON: ") + e.what());
      }
      if (!cfg.is_object()) throw Error(RLH_E_INVALID_ARGUMENT, "generator config: expected a JSON object");
      // The whole policy.generation section may be passed (it has native_cfg or vllm_cfg: what
      // the GRPO loop passes, or `rlhost generate --generator-config '{"vllm_cfg": ...}'`): then
      // only its native_cfg is ours (and vllm_cfg's memory share, enforce_eager, precision,
      // kv_cache_dtype and tensor_parallel_size are read).
      if (cfg.contains("vllm_cfg")) vllm = cfg["vllm_cfg"];
      if (cfg.contains("native_cfg") || cfg.contains("vllm_cfg")) {
        if (cfg.contains("native_cfg") && !cfg["native_cfg"].is_object())
          throw Error(RLH_E_INVALID_ARGUMENT, "generator config: native_cfg must be an object");
        json sub = cfg.contains("native_cfg") ? cfg["native_cfg"] : json::object();
        cfg = sub;
      }
    }
    for (const auto& [k, v] : cfg.items()) {
      bool known = false;
      for (const char* key : kKeys) known = known || k == key;
      if (!known) {
        std::string all;
        for (const char* key : kKeys) all += std::string(all.empty() ? "" : ", ") + key;
        throw Error(RLH_E_INVALID_ARGUMENT, "generator config: unknown key '" + k + "' (known: " + all + ")");
      }
    }
    auto g = std::make_unique<NativeGenerator>();
    g->host = rlh::sdk::Host(host);
    try {
      g->model_dir = rlh::sdk::resolve_model_path(model_path).string();
    } catch (const std::runtime_error& e) {
      throw Error(RLH_E_NOT_FOUND, std::string("generator: ") + e.what());
    }
    g->tokenizer_path = get_str(cfg, "tokenizer", "");
    g->tokenizer_component = get_str(cfg, "tokenizer_component", "");
    const std::string load_format = get_str(cfg, "load_format", "auto");
    if (load_format != "auto" && load_format != "dummy")
      throw Error(RLH_E_INVALID_ARGUMENT, "generator config: load_format must be 'auto' or 'dummy', not '" + load_format + "'");

    gen::Options o;
    o.max_num_seqs = get_int(cfg, "max_num_seqs", o.max_num_seqs);
    o.max_num_batched_tokens = get_int(cfg, "max_num_batched_tokens", o.max_num_batched_tokens);
    o.block_size = get_int(cfg, "block_size", o.block_size);
    o.kv_cache_bytes = get_int(cfg, "kv_cache_bytes", o.kv_cache_bytes);
    o.max_model_len = get_int(cfg, "max_model_len", o.max_model_len);
    // The decode's threads are the kernel provider's (kernels_cpu's pool for the batch-invariant
    // gemm, paged attention and sampling): passed in its instance config.
    const int64_t num_threads = get_int(cfg, "num_threads", 0);
    if (num_threads < 0 || num_threads > 4096)
      throw Error(RLH_E_INVALID_ARGUMENT, "generator config: num_threads must be in [0, 4096] (0: OMP_NUM_THREADS), not " +
                                              std::to_string(num_threads));
    std::string router_source;
    o.moe_router_fp64 = router_fp64(g->host, cfg, &router_source);

    rlh::sdk::TransformerDesc desc = describe(g->host, g->model_dir, get_str(cfg, "model_component", ""));
    const std::string kernels = kernels_section(g->host);
    std::string device_source;
    const int device = pick_device(g->host, cfg, &device_source);
    const bool batch_invariant = get_bool(cfg, "batch_invariant", device < 0);
    if (device < 0) {
      for (const char* k : {"gpu_memory_utilization", "cuda_graphs", "kv_cache_sleep"})
        if (cfg.contains(k))
          throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator config: '") + k + "' applies to a CUDA device, but the generator runs on the CPU (" + device_source + ")");
      if (!batch_invariant)
        throw Error(RLH_E_INVALID_ARGUMENT, "generator config: batch_invariant false: the CPU generator is always batch-invariant");
      o.kv_cache_fp8 = kv_cache_fp8(vllm);
      rlh::engine::Fp8Options f8;
      if (fp8_rollouts(vllm, &f8))
        throw Error(RLH_E_UNIMPLEMENTED, "policy.generation.vllm_cfg.precision = fp8: FP8 rollouts run on a CUDA device, "
                                         "but the generator runs on the CPU (" + device_source + ")");
      g->registry = rlh::sdk::make_kernel_registry(g->host, rlh::sdk::kCPU, rlh::sdk::kernel_pins_from_json(kernels),
                                                   "generator", "{\"num_threads\": " + std::to_string(num_threads) + "}",
                                                   rlh::sdk::kernel_verify_from_json(kernels));
      if (g->registry->providers().empty())
        throw Error(RLH_E_FAILED_PRECONDITION,
                    "generator: no kernel provider runs on the CPU (load kernels_cpu: --plugin kernels_cpu, or put it on the plugin path)");
      g->ops = rlh::engine::make_registry_ops(*g->registry);
      o.ops = g->ops.get();
    } else {
#ifdef RLH_GENERATOR_CUDA
      g->registry = rlh::sdk::make_kernel_registry(g->host, rlh::sdk::cuda_device(device),
                                                   rlh::sdk::kernel_pins_from_json(kernels), "generator", "{}",
                                                   rlh::sdk::kernel_verify_from_json(kernels));
      if (g->registry->providers().empty())
        throw Error(RLH_E_FAILED_PRECONDITION, "generator: no kernel provider runs on cuda:" + std::to_string(device) +
                                                   " (load kernels_cuda: --plugin kernels_cuda, or put it on the plugin path)");
      gen::CudaExecutorOptions co;
      co.kernels = g->registry.get();
      co.device = device;
      // vLLM's settings where the section does not say: the share of the GPU's memory the
      // generator fills (weights, activations, KV cache), and enforce_eager (no CUDA graphs).
      co.gpu_memory_utilization = 0.9;
      if (cfg.contains("gpu_memory_utilization")) {
        if (!cfg["gpu_memory_utilization"].is_number())
          throw Error(RLH_E_INVALID_ARGUMENT, "generator config: 'gpu_memory_utilization' must be a number in (0, 1]");
        co.gpu_memory_utilization = cfg["gpu_memory_utilization"].get<double>();
      } else if (vllm.is_object() && vllm.contains("gpu_memory_utilization") && !vllm["gpu_memory_utilization"].is_null()) {
        if (!vllm["gpu_memory_utilization"].is_number())
          throw Error(RLH_E_INVALID_ARGUMENT, "policy.generation.vllm_cfg.gpu_memory_utilization must be a number in (0, 1]");
        co.gpu_memory_utilization = vllm["gpu_memory_utilization"].get<double>();
      }
      if (vllm.is_object() && vllm.contains("enforce_eager") && !vllm["enforce_eager"].is_null() &&
          !vllm["enforce_eager"].is_boolean())
        throw Error(RLH_E_INVALID_ARGUMENT, "policy.generation.vllm_cfg.enforce_eager must be true or false");
      if (!(co.gpu_memory_utilization > 0 && co.gpu_memory_utilization <= 1))
        throw Error(RLH_E_INVALID_ARGUMENT, "generator config: gpu_memory_utilization must be in (0, 1], not " +
                                                std::to_string(co.gpu_memory_utilization));
      co.kv_cache_bytes = cfg.contains("kv_cache_bytes") ? o.kv_cache_bytes : 0;
      co.cuda_graphs = get_bool(cfg, "cuda_graphs", !(vllm.is_object() && vllm.contains("enforce_eager") &&
                                                      vllm["enforce_eager"] == json(true)));
      co.batch_invariant = batch_invariant;
      // Sleep mode for the KV cache (vLLM's, which NeMo-RL uses when colocated): its memory is
      // the trainer's between rollouts. Off by default: taking it back costs a map and a clear.
      co.kv_cache_sleep = get_bool(cfg, "kv_cache_sleep", false);
      fp8_rollouts(vllm, &co.fp8);
      co.kv_cache_fp8 = kv_cache_fp8(vllm);
      // On a GPU the host's defaults (64 sequences, 512-token steps) leave it mostly idle: a
      // GRPO rollout of 64 x 8 ran in 8 waves, 2.3x the time of one. Where the section does not
      // say, 512 sequences and 8192-token steps (vLLM's V1 takes 1024 / 16384 on GPUs this size;
      // ours plans its activations and captures graphs per power-of-two batch up front).
      if (!cfg.contains("max_num_seqs")) o.max_num_seqs = 512;
      if (!cfg.contains("max_num_batched_tokens")) o.max_num_batched_tokens = 8192;
      co.max_num_seqs = o.max_num_seqs;
      co.max_num_batched_tokens = o.max_num_batched_tokens;
      rlh::sdk::Host h = g->host;
      co.log = [h](const std::string& m) { h.warn(m); };
      o.executor = gen::cuda_executor(co);
#endif
    }
    // Tensor parallelism: the host's world (the generator ranks, under non-colocated generation)
    // in groups of G consecutive ranks, each one generator; every rank of a group makes the
    // same calls (generation_ranks.cpp shares each request with its group).
    if (const int64_t tp = tensor_parallel_size(vllm); tp > 1) {
      const std::string key = "policy.generation.vllm_cfg.tensor_parallel_size = " + std::to_string(tp);
      if (device >= 0)
        throw Error(RLH_E_UNIMPLEMENTED, key + ": tensor-parallel generation runs on the CPU generator only (device " +
                                             device_source + " picked a CUDA device)");
      rlh::sdk::Comm world = rlh::sdk::Comm::world(g->host);
      const int W = world.size(), rank = world.rank();
      if (W % tp != 0)
        throw Error(RLH_E_INVALID_ARGUMENT, key + " does not divide the " + std::to_string(W) + " generator ranks");
      g->tp = std::make_unique<CommTpGroup>(
          world.split(int(rank / tp), rank, "generator tensor-parallel group " + std::to_string(rank / tp)));
      o.tp = g->tp.get();
    }
    g->gen = std::make_unique<gen::Generator>(desc, o);
    if (device < 0 && host && host->alloc && host->free_memory) {  // the host counts the KV pool
      gen::PoolAllocator a;
      a.allocate = [host](size_t bytes) {
        void* p = nullptr;
        rlh::sdk::check(host->alloc(host->ctx, rlh_device{RLH_DEVICE_CPU, 0}, bytes, 64, &p), "generator: KV cache");
        return p;
      };
      a.deallocate = [host](void* p, size_t) { host->free_memory(host->ctx, rlh_device{RLH_DEVICE_CPU, 0}, p); };
      g->gen->set_kv_allocator(std::move(a));
    }
    if (load_format == "auto") {
      try {
        const auto ckpt = rlh::sdk::st::Checkpoint::open(g->model_dir);
        const rlh::sdk::LoadResult w = rlh::sdk::load_weights_f32(desc, ckpt);
        g->gen->weights().load(w.tensors, 0);
      } catch (const Error&) {
        throw;
      } catch (const std::runtime_error& e) {
        throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator: ") + e.what());
      }
    }
    g->host.info("generator native: kernels " + g->registry->choices_summary());
    g->host.info("generator native: runs on " + g->gen->executor().name() + " (" + device_source + ")");
    if (g->tp)
      g->host.info("generator native: tensor parallel over " + std::to_string(g->tp->size()) + " ranks (this one " +
                   std::to_string(g->tp->rank()) + "): " + std::to_string(g->gen->model().desc().layers[0].attention.num_heads) +
                   " query heads and " + std::to_string(g->gen->model().vocab_rows()) + " vocabulary rows here");
    g->host.info("generator native: " + desc.architecture + ", " + std::to_string(desc.num_layers) + " layers, vocab " +
                 std::to_string(desc.vocab_size) + ", weights " + (load_format == "auto" ? "from " + g->model_dir : "by refit") +
                 ", MoE router " + (o.moe_router_fp64 ? "fp64" : "fp32") + " (" + router_source + ")");
    *out = reinterpret_cast<rlh_generator*>(g.release());
  });
}

void gen_destroy(rlh_generator* self) { delete as_gen(self); }

rlh_status* gen_update_weights(rlh_generator* self, const rlh_weight_update* u) {
  NativeGenerator* g = as_gen(self);
  return rlh::sdk::guard(g ? g->host.make_status() : nullptr, [&] {
    if (!g) throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: generator is NULL");
    if (!u || u->struct_size < RLH_STRUCT_SIZE(rlh_weight_update, may_alias))
      throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: missing or too small rlh_weight_update");
    if (u->num_weights > 0 && !u->weights) throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: weights is NULL");
    g->gen->model().update_weights(u->version, {u->weights, u->num_weights}, u->may_alias != 0);
  });
}

rlh_status* gen_weights_device(rlh_generator* self, rlh_device* out) {
  NativeGenerator* g = as_gen(self);
  return rlh::sdk::guard(g ? g->host.make_status() : nullptr, [&] {
    if (!g) throw Error(RLH_E_INVALID_ARGUMENT, "weights_device: generator is NULL");
    if (!out) throw Error(RLH_E_INVALID_ARGUMENT, "weights_device: out is NULL");
    const rlh::gen::DeviceWeightSink* sink = g->gen->weights().device_sink();
    *out = sink ? sink->device() : rlh_device{RLH_DEVICE_CPU, 0};
  });
}

rlh_status* gen_generate(rlh_generator* self, const rlh_generate_args* a, rlh_sample_fn fn, void* user) {
  NativeGenerator* g = as_gen(self);
  return rlh::sdk::guard(g ? g->host.make_status() : nullptr, [&] {
    if (!g) throw Error(RLH_E_INVALID_ARGUMENT, "generate: generator is NULL");
    if (!a || a->struct_size < RLH_STRUCT_SIZE(rlh_generate_args, sampling))
      throw Error(RLH_E_INVALID_ARGUMENT, "generate: missing or too small rlh_generate_args");
    if (!fn) throw Error(RLH_E_INVALID_ARGUMENT, "generate: no sample callback");
    const rlh_sampling* s = a->sampling;
    if (!s || s->struct_size < RLH_STRUCT_SIZE(rlh_sampling, num_stop_strings))
      throw Error(RLH_E_INVALID_ARGUMENT, "generate: missing or too small rlh_sampling");
    if (a->num_prompts < 0) throw Error(RLH_E_INVALID_ARGUMENT, "generate: num_prompts must be >= 0");
    if (a->num_prompts == 0) return;
    if (!a->prompt_offsets) throw Error(RLH_E_INVALID_ARGUMENT, "generate: prompt_offsets is NULL");
    const int64_t total = a->prompt_offsets[a->num_prompts];
    if (total < 0 || (total > 0 && !a->prompt_ids)) throw Error(RLH_E_INVALID_ARGUMENT, "generate: prompt_ids is NULL");
    if ((s->num_stop_token_ids && !s->stop_token_ids) || (s->num_stop_strings && !s->stop_strings))
      throw Error(RLH_E_INVALID_ARGUMENT, "generate: stop lists have a count but no array");

    gen::Request r;
    r.prompt_ids = {a->prompt_ids, size_t(total)};
    r.prompt_offsets = {a->prompt_offsets, size_t(a->num_prompts) + 1};
    r.samples_per_prompt = a->samples_per_prompt;
    r.first_prompt_index = a->first_prompt_index;
    r.sampling.temperature = s->temperature;
    r.sampling.top_k = s->top_k;
    r.sampling.top_p = s->top_p;
    r.sampling.min_p = s->min_p;
    r.max_new_tokens = s->max_new_tokens;
    r.seed = s->seed;
    r.step = s->step;
    r.stop_token_ids.assign(s->stop_token_ids, s->stop_token_ids + s->num_stop_token_ids);
    for (size_t i = 0; i < s->num_stop_strings; ++i) {
      if (!s->stop_strings[i]) throw Error(RLH_E_INVALID_ARGUMENT, "generate: stop string " + std::to_string(i) + " is NULL");
      r.stop_strings.emplace_back(s->stop_strings[i]);
    }
    if (!r.stop_strings.empty()) r.detokenizer = &g->detokenizer();

    const gen::Stats st = g->gen->generate(
        r,
        [&](const gen::Sample& smp) {
          rlh_sample out{};
          out.struct_size = RLH_STRUCT_SIZE(rlh_sample, weight_version);
          out.prompt_index = smp.prompt_index;
          out.sample_index = smp.sample_index;
          out.ids = smp.ids.data();
          out.logprobs = smp.logprobs.data();
          out.num_tokens = int64_t(smp.ids.size());
          out.truncated = smp.truncated ? 1 : 0;
          out.weight_version = smp.weight_version;
          rlh_status* st = fn(user, &out);
          if (st) {
            rlh::sdk::StatusPtr owned(st);
            throw Error(st->code, "generate: the sample callback failed: " + rlh::sdk::status_message(st));
          }
        },
        [&] {
          if (!g->tp) return g->host.cancelled();
          // A tensor-parallel group stops together: any rank's cancellation, agreed once a step
          // (the steps' collectives would wait forever for a rank that left alone).
          float any = g->host.cancelled() ? 1.f : 0.f;
          g->tp->all_reduce_sum(&any, 1);
          return any > 0;
        });
    g->host.log(RLH_LOG_DEBUG, "generator native: " + std::to_string(st.steps) + " steps, " +
                                   std::to_string(st.sampled_tokens) + " tokens sampled, " +
                                   std::to_string(st.prefill_tokens) + " prefilled, " +
                                   std::to_string(st.shared_prompt_tokens) + " prompt tokens shared, " +
                                   std::to_string(st.preemptions) + " preemptions, KV blocks " +
                                   std::to_string(st.kv_blocks_peak) + " of " + std::to_string(st.kv_blocks) +
                                   " at most, " + std::to_string(st.max_running) + " sequences at most");
  });
}

const rlh_generator_api kApi = [] {
  rlh_generator_api api{};
  api.struct_size = RLH_STRUCT_SIZE(rlh_generator_api, weights_device);
  api.create = gen_create;
  api.destroy = gen_destroy;
  api.update_weights = gen_update_weights;
  api.generate = gen_generate;
  api.weights_device = gen_weights_device;
  return api;
}();

const char* const kConfigKeys[] = {"policy.generation.native_cfg.*", nullptr};

const rlh_component_desc kComponent = rlh::sdk::component_desc(
    RLH_KIND_GENERATOR, "native", "0.1.0", RLH_GENERATOR_API_VERSION_MAJOR, RLH_GENERATOR_API_VERSION_MINOR, &kApi,
    "Generator on the CPU or a CUDA device: paged KV cache, continuous batching, vLLM/NeMo-RL sampling and processed logprobs",
    kConfigKeys);

const rlh_component_desc* const kComponents[] = {&kComponent};

}  // namespace

RLH_DEFINE_PLUGIN(rlh::sdk::plugin_desc("generator", "0.1.0", "rlhost", kComponents,
                                        "Native CPU generator sharing the trainer's description, kernels and weights"))
