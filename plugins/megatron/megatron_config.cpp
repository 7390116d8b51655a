// The megatron backend's reading of its config section (the `policy` subtree), NeMo-RL's Megatron
// policy worker's keys: policy.megatron_cfg.* with Megatron's optimizer (adam/sgd, no weight
// decay on 1-D tensors, clip_grad) and OptimizerParamScheduler, and the keys shared with dtensor.
#include "megatron_config.hpp"

#include "rlhost/sdk/safetensors_dtype.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::megatron {

using backend::ConfigReader;
using backend::MegatronSchedule;
using backend::OptimizerConfig;
using backend::OptimizerKind;
using sdk::Error;
using json = nlohmann::json;

namespace {

// NeMo-RL megatron_cfg keys (and subtrees) with no effect on the single-rank fp32 CPU engine:
// fusions, precision and memory switches of Megatron-Core, MoE token dispatch and the
// aux-loss-free bias update.
constexpr const char* kNoEffect[] = {
    "megatron_cfg.converter_type", "megatron_cfg.empty_unused_memory_level", "megatron_cfg.pipeline_dtype",
    "megatron_cfg.moe_router_bias_update_rate",
    "megatron_cfg.moe_permute_fusion", "megatron_cfg.moe_token_dispatcher_type", "megatron_cfg.moe_enable_deepep",
    "megatron_cfg.moe_shared_expert_overlap", "megatron_cfg.apply_rope_fusion", "megatron_cfg.bias_activation_fusion",
    "megatron_cfg.gradient_accumulation_fusion", "megatron_cfg.defer_fp32_logits",
    "megatron_cfg.distributed_data_parallel_config", "megatron_cfg.env_vars",
    "megatron_cfg.recompute_method", "megatron_cfg.recompute_num_layers",
    "megatron_cfg.recompute_modules", "megatron_cfg.fine_grained_activation_offloading",
    "megatron_cfg.train_iters", "megatron_cfg.force_reconvert_from_hf", "megatron_cfg.track_moe_metrics",
    "megatron_cfg.optimizer.bf16", "megatron_cfg.optimizer.fp16", "megatron_cfg.optimizer.params_dtype",
    "megatron_cfg.optimizer.use_precision_aware_optimizer",
    "megatron_cfg.optimizer.optimizer_cpu_offload", "megatron_cfg.optimizer.optimizer_offload_fraction",
    "megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d", "megatron_cfg.optimizer.use_torch_optimizer_for_cpu_offload"};

// Megatron-Core's precision-aware optimizer keeps its gradients, master weights and Adam moments
// in these dtypes (use_precision_aware_optimizer; without it Megatron-Core asserts they are
// fp32). rlhost keeps all four in fp32, so it honours fp32 and refuses anything else (bf16
// moments, fp16 or fp8 states) rather than train in more precision than the config asks.
constexpr const char* kFp32States[][2] = {{"main_grads_dtype", "gradients"},
                                           {"main_params_dtype", "master weights"},
                                           {"exp_avg_dtype", "first Adam moments"},
                                           {"exp_avg_sq_dtype", "second Adam moments"}};

void read_optimizer_state_dtypes(ConfigReader& r) {
  for (const auto& [key, what] : kFp32States) {
    const std::string path = std::string("megatron_cfg.optimizer.") + key;
    const std::string v = r.string(path, "fp32");  // absent or null: Megatron-Core's fp32
    if (sdk::st::dtype_from_config_name(v) == sdk::st::DType::F32) continue;
    throw Error(RLH_E_UNIMPLEMENTED, r.full(path) + " = " + v + ": rlhost keeps the optimizer's " + what +
                                         " in fp32 (fp32, float32 or torch.float32; Megatron-Core's "
                                         "precision-aware optimizer states in other dtypes are not implemented)");
  }
}

MegatronSchedule::Decay decay_style(ConfigReader& r, const std::string& path) {
  const std::string s = r.string(path, "constant");
  if (s == "constant") return MegatronSchedule::Decay::constant;
  if (s == "linear") return MegatronSchedule::Decay::linear;
  if (s == "cosine") return MegatronSchedule::Decay::cosine;
  if (s == "inverse-square-root") return MegatronSchedule::Decay::inverse_square_root;
  if (s == "WSD") throw Error(RLH_E_UNIMPLEMENTED, r.full(path) + ": WSD decay is not implemented");
  r.fail(path, "expected constant, linear, cosine or inverse-square-root, got \"" + s + "\"");
}

MegatronSchedule::WdIncrement wd_style(ConfigReader& r, const std::string& path) {
  const std::string s = r.string(path, "constant");
  if (s == "constant") return MegatronSchedule::WdIncrement::constant;
  if (s == "linear") return MegatronSchedule::WdIncrement::linear;
  if (s == "cosine") return MegatronSchedule::WdIncrement::cosine;
  r.fail(path, "expected constant, linear or cosine, got \"" + s + "\"");
}

// Pipeline parallelism (docs/model_parallelism.md): the layers split over pp stages with the 1F1B
// schedule; the first/last stage counts as Megatron reads them; interleaved virtual stages
// (model chunks per rank; the layer split and the micro-batch count are checked where they are
// known: at load and at each train step).
void read_pipeline(ConfigReader& r, backend::BackendConfig& cfg) {
  const std::string pp_key = "megatron_cfg.pipeline_model_parallel_size";
  cfg.parallel.pp = r.is_null(pp_key) ? 1 : r.integer(pp_key, 1);
  if (cfg.parallel.pp < 1) r.fail(pp_key, "must be at least 1, got " + std::to_string(cfg.parallel.pp));
  const std::string vpp_key = "megatron_cfg.virtual_pipeline_model_parallel_size";
  const int64_t vpp = r.is_null(vpp_key) ? 1 : r.integer(vpp_key, 1);
  if (vpp < 1) r.fail(vpp_key, "must be at least 1, got " + std::to_string(vpp));
  if (vpp > 1 && cfg.parallel.pp < 2)
    r.fail(vpp_key, "set to " + std::to_string(vpp) + " needs megatron_cfg.pipeline_model_parallel_size > 1, got " +
                        std::to_string(cfg.parallel.pp));
  cfg.parallel.vpp = vpp;
  auto layers = [&](const char* key) -> int64_t {
    const std::string k = std::string("megatron_cfg.") + key;
    if (!r.has(k) || r.is_null(k)) return 0;
    const int64_t n = r.integer(k, 0);
    if (n < 1) r.fail(k, "must be at least 1 (or null), got " + std::to_string(n));
    return n;
  };
  cfg.parallel.pp_first_layers = layers("num_layers_in_first_pipeline_stage");
  cfg.parallel.pp_last_layers = layers("num_layers_in_last_pipeline_stage");
}

}  // namespace

backend::BackendConfig read_config(const json& policy) {
  ConfigReader r(policy, "policy");
  backend::BackendConfig cfg;
  cfg.backend = "megatron";
  cfg.batching.train_micro_batch_size = 4;  // NeMo-RL's grpo_math_1B_megatron.yaml
  cfg.batching.logprob_batch_size = 8;

  if (!r.boolean("megatron_cfg.enabled", true))
    throw Error(RLH_E_INVALID_ARGUMENT,
                "policy.megatron_cfg.enabled is false: this configuration selects another backend "
                "(dtensor reads policy.dtensor_cfg)");
  // NeMo-RL's activation_checkpointing sets Megatron's recompute_granularity to full (every
  // layer, uniform); recompute_granularity alone picks full or selective (norms and the MLP
  // activation, on the device path; the CPU engine recomputes whole layers either way).
  cfg.recompute = r.boolean("megatron_cfg.activation_checkpointing", false);
  const std::string g =
      r.is_null("megatron_cfg.recompute_granularity") ? "" : r.string("megatron_cfg.recompute_granularity", "");
  if (!g.empty()) {
    if (g != "full" && g != "selective")
      r.fail("megatron_cfg.recompute_granularity", "expected full, selective or null, got \"" + g + "\"");
    cfg.recompute_selective = !cfg.recompute && g == "selective";
    cfg.recompute = true;
  }
  // Tensor parallelism (docs/model_parallelism.md): the layers split over tp ranks, the world's other
  // ranks data-parallel; sequence parallelism on top (Megatron's: without tensor parallelism it
  // has no effect, as there).
  const std::string tp_key = "megatron_cfg.tensor_model_parallel_size";
  cfg.parallel.tp = r.is_null(tp_key) ? 1 : r.integer(tp_key, 1);
  if (cfg.parallel.tp < 1) r.fail(tp_key, "must be at least 1, got " + std::to_string(cfg.parallel.tp));
  const bool sp = r.is_null("megatron_cfg.sequence_parallel") ? false : r.boolean("megatron_cfg.sequence_parallel", false);
  cfg.parallel.sequence_parallel = sp && cfg.parallel.tp > 1;
  // Context parallelism (docs/model_parallelism.md): every sequence split over cp ranks, zigzag.
  const std::string cp_key = "megatron_cfg.context_parallel_size";
  cfg.parallel.cp = r.is_null(cp_key) ? 1 : r.integer(cp_key, 1);
  if (cfg.parallel.cp < 1) r.fail(cp_key, "must be at least 1, got " + std::to_string(cfg.parallel.cp));
  read_pipeline(r, cfg);
  // A pipeline stage passes each rank's rows of the context-parallel split to the same cp rank
  // of the next stage (Engine::stage_rows), under sequence parallelism its block of them to the
  // same tp rank.
  // Expert parallelism (docs/model_parallelism.md): each MoE layer's routed experts split over ep ranks
  // carved from the data-parallel ones. Expert tensor parallelism: each expert split over etp
  // ranks (etp = tp, Megatron's default when the key is null; with ep > 1 also 1 or a divisor of
  // tp); an etp below tp without expert parallelism is refused where it matters, at load of an
  // MoE model (a dense model has no experts).
  const std::string ep_key = "megatron_cfg.expert_model_parallel_size", etp_key = "megatron_cfg.expert_tensor_parallel_size";
  cfg.parallel.ep = r.is_null(ep_key) ? 1 : r.integer(ep_key, 1);
  if (cfg.parallel.ep < 1) r.fail(ep_key, "must be at least 1, got " + std::to_string(cfg.parallel.ep));
  const bool etp_given = r.has(etp_key) && !r.is_null(etp_key);
  const int64_t etp = etp_given ? r.integer(etp_key, 1) : 0;
  if (etp > 1 && cfg.parallel.tp % etp != 0)
    throw Error(RLH_E_UNIMPLEMENTED, r.full(etp_key) + " = " + std::to_string(etp) + " with " + r.full(tp_key) + " = " +
                                         std::to_string(cfg.parallel.tp) +
                                         ": expert tensor parallelism over a number of ranks that does not divide the "
                                         "tensor-parallel size is not implemented (set it to a divisor of " +
                                         std::to_string(cfg.parallel.tp) + " or null)");
  if (etp < 0 || (etp == 0 && etp_given)) r.fail(etp_key, "must be at least 1, got " + std::to_string(etp));
  cfg.parallel.etp = etp == 0 ? cfg.parallel.tp : etp;
  // Expert parallelism with tensor parallelism: Megatron-Core's expert_tensor_parallel_size = 1
  // (each expert whole on one rank of an ep group carved from the tp x cp x dp ranks, every tp
  // rank dispatching its own tokens), a divisor of tp between (each expert cut over an etp
  // group, the ep group carved from etp x ep x edp, every tp rank dispatching its own tokens) or
  // = tp (each expert cut over the tp group as without EP, the ep group carved from the ranks of
  // one tp rank). Megatron-Core requires sequence parallelism with all three, and so does this.
  if (cfg.parallel.ep > 1 && cfg.parallel.tp > 1) {
    if (!cfg.parallel.sequence_parallel)
      throw Error(RLH_E_INVALID_ARGUMENT, r.full(ep_key) + " = " + std::to_string(cfg.parallel.ep) + " with " +
                                              r.full(tp_key) + " = " + std::to_string(cfg.parallel.tp) + " needs " +
                                              r.full("megatron_cfg.sequence_parallel") +
                                              " = true (Megatron-Core requires sequence parallelism when using expert "
                                              "and tensor parallelism)");
  }
  // Pipeline parallelism with expert parallelism: an ep group within each stage (Megatron's expert
  // layout varies pp slowest), interleaved virtual stages included (pp_model.cpp's idle
  // micro-batches run one model chunk's layers at a time).
  for (const char* k : kNoEffect) r.mark_subtree(k);
  // FP8 training (NeMo-RL's fp8_cfg): the host refuses enabled = true at start unless a loaded
  // plugin provides FP8 linears (it claims policy.megatron_cfg.fp8_cfg.*: examples/vendor_fp8).
  // The CUDA engine then runs the dense layers' linears through it (Fp8Options); the CPU engine
  // refuses it when the model loads. Disabled, its other keys have no effect.
  if (!r.is_null("megatron_cfg.fp8_cfg.enabled") && r.boolean("megatron_cfg.fp8_cfg.enabled", false)) {
    engine::Fp8Options& f = cfg.fp8;
    f.enabled = true;
    const std::string format = r.is_null("megatron_cfg.fp8_cfg.fp8") ? "e4m3" : r.string("megatron_cfg.fp8_cfg.fp8", "e4m3");
    if (format != "e4m3" && format != "hybrid")
      r.fail("megatron_cfg.fp8_cfg.fp8", "expected e4m3 or hybrid, got \"" + format + "\"");
    f.hybrid = format == "hybrid";
    const std::string recipe = r.is_null("megatron_cfg.fp8_cfg.fp8_recipe")
                                   ? "tensorwise"
                                   : r.string("megatron_cfg.fp8_cfg.fp8_recipe", "tensorwise");
    if (recipe != "tensorwise" && recipe != "blockwise" && recipe != "delayed")
      r.fail("megatron_cfg.fp8_cfg.fp8_recipe", "expected tensorwise, blockwise or delayed, got \"" + recipe + "\"");
    f.blockwise = recipe == "blockwise";
    f.delayed = recipe == "delayed";
    // The CUDA engine's full recompute runs each layer's forward again, which would advance
    // every input's amax history a second time (TransformerEngine restores the forward's scales
    // there; the FP8 provider's handles have no such mode). Selective recompute reruns no linear.
    if (f.delayed && cfg.recompute && !cfg.recompute_selective)
      r.fail("megatron_cfg.fp8_cfg.fp8_recipe",
             "delayed with full activation recompute (megatron_cfg.activation_checkpointing, or "
             "recompute_granularity = full) is not supported: the recomputed forward would advance the amax "
             "histories a second time; use recompute_granularity = selective, or another recipe");
    // Megatron-Core's delayed-scaling settings (TransformerEngine's DelayedScaling), under
    // fp8_cfg with Megatron's names and defaults (history 1, most_recent, margin 0: what a
    // NeMo-RL run gets, since NeMo-RL passes none of them). Set with another recipe they would
    // change nothing, so they are refused there by name.
    for (const char* k : {"fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin"}) {
      const std::string key = std::string("megatron_cfg.fp8_cfg.") + k;
      if (!r.has(key)) {  // absent or null: Megatron's default
        r.mark_subtree(key);
        continue;
      }
      if (!f.delayed) r.fail(key, "applies to fp8_recipe = delayed only (the recipe is \"" + recipe + "\")");
      if (std::string(k) == "fp8_amax_history_len") {
        const int64_t n = r.integer(key, 1);
        if (n < 1 || n > 65536) r.fail(key, "must be in [1, 65536], got " + std::to_string(n));
        f.amax_history_len = n;
      } else if (std::string(k) == "fp8_amax_compute_algo") {
        const std::string algo = r.string(key, "most_recent");
        if (algo != "most_recent" && algo != "max") r.fail(key, "expected most_recent or max, got \"" + algo + "\"");
        f.amax_max = algo == "max";
      } else {
        const int64_t m = r.integer(key, 0);
        if (m < 0 || m > 64) r.fail(key, "must be in [0, 64] (scales get 2^margin headroom), got " + std::to_string(m));
        f.margin = m;
      }
    }
    if (f.blockwise && f.hybrid)
      r.fail("megatron_cfg.fp8_cfg.fp8", "hybrid (e5m2 gradients) with fp8_recipe = blockwise: block-scaled products "
                                         "take e4m3 operands only (cuBLASLt on Hopper); use fp8 = e4m3");
    // TransformerEngine's fp8_param keeps the weights themselves in FP8: the engine keeps bf16
    // weights and quantises them per call, so that setting cannot be honoured.
    if (!r.is_null("megatron_cfg.fp8_cfg.fp8_param") && r.boolean("megatron_cfg.fp8_cfg.fp8_param", false))
      r.fail("megatron_cfg.fp8_cfg.fp8_param", "true is not supported: the CUDA engine keeps bf16 weights and "
                                               "quantises them once per step; set it to false");
    // TransformerEngine's cache clearing: the engine's FP8 weight copies are remade every call.
    r.mark_subtree("megatron_cfg.fp8_cfg.force_clear_fp8_caches");
    for (const char* k : {"num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"}) {
      const std::string key = std::string("megatron_cfg.fp8_cfg.") + k;
      if (r.is_null(key)) continue;
      const int64_t n = r.integer(key, 1);
      if (n < 0) r.fail(key, "must be >= 0, got " + std::to_string(n));
      (std::string(k) == "num_layers_at_start_in_bf16" ? f.bf16_first_layers : f.bf16_last_layers) = n;
    }
    const std::vector<std::string> unknown = r.unread("megatron_cfg.fp8_cfg");
    if (!unknown.empty())
      throw Error(RLH_E_INVALID_ARGUMENT, unknown.front() + ": not an fp8_cfg key rlhost runs (it reads enabled, fp8, "
                                          "fp8_recipe, fp8_param, num_layers_at_start_in_bf16, num_layers_at_end_in_bf16, "
                                          "force_clear_fp8_caches, fp8_amax_history_len, fp8_amax_compute_algo, "
                                          "fp8_margin)");
  }
  r.mark_subtree("megatron_cfg.fp8_cfg");

  // MoE layers (the engine's MoeOptions; no effect on dense models). Defaults are plain training;
  // NeMo-RL's RL recipes freeze the router, route in fp64 and turn load balancing off.
  cfg.moe.freeze_router = r.boolean("megatron_cfg.freeze_moe_router", false);
  const std::string router_dtype = r.string("megatron_cfg.moe_router_dtype", "fp32");
  if (router_dtype != "fp32" && router_dtype != "fp64")
    r.fail("megatron_cfg.moe_router_dtype", "expected fp32 or fp64, got \"" + router_dtype + "\"");
  cfg.moe.router_fp64 = router_dtype == "fp64";
  const std::string balancing = r.string("megatron_cfg.moe_router_load_balancing_type", "none");
  if (balancing == "none") cfg.moe.load_balancing = engine::MoeOptions::LoadBalancing::none;
  else if (balancing == "aux_loss") cfg.moe.load_balancing = engine::MoeOptions::LoadBalancing::aux_loss;
  else if (balancing == "seq_aux_loss") cfg.moe.load_balancing = engine::MoeOptions::LoadBalancing::seq_aux_loss;
  else
    r.fail("megatron_cfg.moe_router_load_balancing_type",
           "expected none, aux_loss or seq_aux_loss, got \"" + balancing + "\"");
  cfg.moe.aux_loss_coef = r.number("megatron_cfg.moe_aux_loss_coeff", 0.0);
  cfg.moe.z_loss_coef = r.number("megatron_cfg.moe_z_loss_coeff", 0.0);
  if (!(cfg.moe.aux_loss_coef >= 0)) r.fail("megatron_cfg.moe_aux_loss_coeff", "must be >= 0");
  if (!(cfg.moe.z_loss_coef >= 0)) r.fail("megatron_cfg.moe_z_loss_coeff", "must be >= 0");
  // Megatron-Core's aux-loss-free balancing moves a router's expert bias by this rate each step
  // (Megatron-Bridge turns it on for DeepSeek-V3's e_score_correction_bias). rlhost keeps that
  // bias as the checkpoint has it, so a positive rate is refused for a model with one
  // (model_loading.cpp); other models have no expert bias for it to move.
  cfg.expert_bias_update_rate = r.number("megatron_cfg.moe_router_bias_update_rate", 0.0);
  if (!(cfg.expert_bias_update_rate >= 0)) r.fail("megatron_cfg.moe_router_bias_update_rate", "must be >= 0");

  // Megatron's optimizer: always present (NeMo-RL's defaults when keys are absent).
  const std::string o = "megatron_cfg.optimizer.";
  OptimizerConfig opt;
  opt.decay_1d_params = false;  // Megatron: no weight decay on biases and norm weights
  const std::string kind = r.string(o + "optimizer", "adam");
  if (kind == "adam") {
    opt.kind = OptimizerKind::adamw;  // Megatron's Adam decouples weight decay (adam_w_mode)
  } else if (kind == "sgd") {
    opt.kind = OptimizerKind::sgd;
  } else {
    r.fail(o + "optimizer", "expected adam or sgd, got \"" + kind + "\"");
  }
  opt.lr = r.number(o + "lr", 5e-6);
  opt.weight_decay = r.number(o + "weight_decay", 0.01);
  opt.beta1 = r.number(o + "adam_beta1", 0.9);
  opt.beta2 = r.number(o + "adam_beta2", 0.999);
  opt.eps = r.number(o + "adam_eps", 1e-8);
  const double sgd_momentum = r.number(o + "sgd_momentum", 0.9);
  if (opt.kind == OptimizerKind::sgd) opt.momentum = sgd_momentum;
  if (!(opt.lr >= 0)) r.fail(o + "lr", "must be >= 0");
  if (!(opt.weight_decay >= 0)) r.fail(o + "weight_decay", "must be >= 0");
  if (!(opt.eps > 0)) r.fail(o + "adam_eps", "must be positive");
  read_optimizer_state_dtypes(r);
  cfg.optimizer = opt;
  // Data parallelism over every launched rank (data_parallel.hpp): Megatron's distributed
  // optimizer (gradient buffer reduce-scattered, AdamW on this rank's block, weights
  // all-gathered), else gradients all-reduced. Megatron's default is off.
  cfg.parallel.distributed_optimizer = r.boolean(o + "use_distributed_optimizer", false);
  backend::read_shared_policy_keys(r, cfg);  // policy.max_grad_norm: clip_grad's fallback
  cfg.optimizer->max_grad_norm =
      r.is_null(o + "clip_grad") ? 0.0 : r.number(o + "clip_grad", cfg.optimizer->max_grad_norm);
  if (!(cfg.optimizer->max_grad_norm >= 0)) r.fail(o + "clip_grad", "must be >= 0");

  const std::string s = "megatron_cfg.scheduler.";
  MegatronSchedule ms;
  ms.min_lr = r.number(o + "min_lr", 0.0);
  ms.warmup_init_lr = r.number(s + "lr_warmup_init", 0.0);
  ms.warmup_iters = r.integer(s + "lr_warmup_iters", 0);
  ms.decay = decay_style(r, s + "lr_decay_style");
  ms.decay_iters = r.integer(s + "lr_decay_iters", 0);
  ms.start_weight_decay = r.number(s + "start_weight_decay", opt.weight_decay);
  ms.end_weight_decay = r.number(s + "end_weight_decay", opt.weight_decay);
  ms.wd_increment = wd_style(r, s + "weight_decay_incr_style");
  ms.wd_incr_iters = ms.decay_iters;
  if (ms.warmup_iters < 0) r.fail(s + "lr_warmup_iters", "must be >= 0");
  if ((ms.decay == MegatronSchedule::Decay::linear || ms.decay == MegatronSchedule::Decay::cosine) &&
      ms.decay_iters <= ms.warmup_iters)
    r.fail(s + "lr_decay_iters", "must exceed lr_warmup_iters for " + r.string(s + "lr_decay_style", "") + " decay");
  if (ms.wd_increment == MegatronSchedule::WdIncrement::constant && ms.start_weight_decay != ms.end_weight_decay)
    r.fail(s + "weight_decay_incr_style", "constant needs start_weight_decay == end_weight_decay (Megatron asserts it)");
  if (ms.wd_increment != MegatronSchedule::WdIncrement::constant && ms.wd_incr_iters <= 0)
    r.fail(s + "lr_decay_iters", "a weight-decay increment runs over lr_decay_iters, which must be positive");
  cfg.schedule.rule = ms;

  std::vector<std::string> unread;
  for (const char* sub : {"megatron_cfg", "sequence_packing", "dynamic_batching"})
    for (auto& k : r.unread(sub)) unread.push_back(std::move(k));
  if (!unread.empty()) {
    std::string line = "keys this backend does not read:";
    for (const auto& k : unread) line += " " + k;
    cfg.notes.push_back(line);
  }
  return cfg;
}

}  // namespace rlh::megatron
