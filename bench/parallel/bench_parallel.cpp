// bench_parallel: training steps on CPU ranks under mpirun, through the backend plugins' ABI
// (the path rlhost runs): step time, tokens per second, per-rank training state and the bytes
// each rank's collectives move per step against the analytic count. run.sh runs it at 1, 2 and 4
// ranks for dtensor FSDP, megatron's distributed optimizer and megatron's model-parallel layouts
// (TP, TP + SP, PP, CP and their products with DP) and prints the scaling.
//
//   mpirun -np N bench_parallel --model DIR --backend dtensor|megatron [--seqs 16] [--len 128]
//                                [--mb-seqs 4] [--steps 5] [--warmup 1] [--ddp]
//                                [--tp T] [--pp P] [--cp C] [--sp] [--ep E]   (megatron)
//                                [--device cpu|cuda]
//
// --device cuda trains on the GPUs in bf16 (the CUDA engine, each rank on its node's GPU by local
// rank; data parallelism only), the device communicator comm_nccl where each rank has its own
// GPU (comm_mpi staging where ranks share one). The device's analytic traffic differs from the
// CPU ranks' (parallelism.md, "on the device"): FSDP per micro-batch 8 f bytes a parameter of every
// layer (bf16 gathered for the forward and again for the backward, fp32 reduce-scattered), less
// the gathers its two layer slots save (the last two layers stay from the forward into the
// backward, the first two from a backward into the next micro-batch's forward: 2L - 2 gathers
// for the first micro-batch, 2L - 4 for the others), and per step 6 f bytes a parameter of the
// root (embedding, final norm, head); the distributed optimizer per step 10 f bytes a parameter (fp32 gradients
// reduce-scattered, fp32 masters and their bf16 copy all-gathered); DDP 8 f (an fp32 all-reduce);
// f = (S-1)/S, the units' padding aside.
//
// The global batch is --seqs sequences of --len tokens; each data-parallel rank (N / (T P C) of
// them, Megatron's order tp-cp-dp-pp) trains on its share in micro-batches of --mb-seqs
// sequences, and every rank of its tp x cp x pp block gets that share. Prints, on rank 0, one line:
//   RESULT backend=.. mode=.. ranks=N tp=T pp=P cp=C sp=0|1 step_s=.. tok_s=.. state_bytes=..
//          comm_bytes=.. analytic_bytes=.. mp_bytes=.. mp_analytic=..
// Analytic traffic per rank per step, ring collectives over S ranks, P parameters of 4 bytes, M
// micro-batches per rank: FSDP 3 (S-1)/S 4P per micro-batch (two all-gathers and one
// reduce-scatter of every unit: gathered for the forward, again for the backward); the
// distributed optimizer 2 (S-1)/S 4P (reduce-scatter of the gradients, all-gather of the
// weights); DDP 2 (S-1)/S 4P (one all-reduce). These are printed for the data-parallel-only runs.
// The model-parallel group's bytes (mp_bytes: tp/, pp/ or cp/comm_bytes) are compared with the
// counts that tests/backend/test_backend_{tp,pp,cp}.cpp check exactly on their fixtures, here for
// a Llama with an untied head, no q/k norms, hidden C, L layers, kv heads of D dims, and R rows
// (tokens) on the rank:
//   TP  2 (T-1)/T 4 [(2 + 4L) R C + 4 R (+ 2 L kv D C when T > kv, + (2L+1) C under SP)] + 2 (T-1)/T 16
//       (the embedding, two layer outputs forward and two input gradients backward per layer, the
//       head's input gradient, the head's max and (l, s, z_t); replicated kv heads; the norms'
//       gradients under SP; the two gradient-norm sums);
//   PP  R C 4 + 8 at two stages (activations forward or their gradient back; the norm's sum);
//   CP  4 (C-1) R' [3 L 2 kv' D + 1], R' = sum_s 2 ceil(n_s / 2C) (zigzag rows), kv' = kv / T
//       (k and v all-gathered forward and backward and reduce-scattered; the head's one output,
//       the logprob: the tests' loss reads the entropy too, a second float per row).
//   EP  (an MoE model, rlh_tiny_model --experts): ep/comm_bytes against the expectation under
//       uniform routing, M L (E-1) E_l 8 + 2 (out + in) C 4 with out = in = L R K (E-1)/E rows (the
//       counts' exchange per micro-batch and MoE layer, the dispatched rows and the returned
//       outputs, forward and backward). Routing is data-dependent, so this is an expectation:
//       tests/backend/test_backend_ep.cpp checks the exact count from the routing record.
// Products of layouts print their group's bytes without an analytic count ("-").
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/backend.h"
#include "rlhost/comm.h"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string model, backend = "dtensor";
  int64_t seqs = 16, len = 128, mb_seqs = 4, steps = 5, warmup = 1;
  int64_t tp = 1, pp = 1, cp = 1, ep = 1;
  bool ddp = false, sp = false;
  std::string device = "cpu";
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "bench_parallel: %s\nusage: bench_parallel --model DIR --backend dtensor|megatron [--seqs N] "
                       "[--len N] [--mb-seqs N] [--steps N] [--warmup N] [--ddp] [--tp T] [--pp P] [--cp C] [--sp] [--ep E] "
                       "[--device cpu|cuda]\n", why.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage(k + " needs a value");
      return argv[++i];
    };
    auto num = [&]() {
      const std::string v = val();
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || n < 0) usage(k + " = '" + v + "' is not a count");
      return int64_t(n);
    };
    if (k == "--model") a.model = val();
    else if (k == "--backend") a.backend = val();
    else if (k == "--seqs") a.seqs = num();
    else if (k == "--len") a.len = num();
    else if (k == "--mb-seqs") a.mb_seqs = num();
    else if (k == "--steps") a.steps = num();
    else if (k == "--warmup") a.warmup = num();
    else if (k == "--ddp") a.ddp = true;
    else if (k == "--tp") a.tp = num();
    else if (k == "--pp") a.pp = num();
    else if (k == "--cp") a.cp = num();
    else if (k == "--sp") a.sp = true;
    else if (k == "--ep") a.ep = num();
    else if (k == "--device") a.device = val();
    else usage("unknown argument " + k);
  }
  if (a.model.empty()) usage("--model is required");
  if (a.backend != "dtensor" && a.backend != "megatron") usage("--backend is dtensor or megatron");
  if (a.seqs < 1 || a.len < 2 || a.mb_seqs < 1 || a.steps < 1 || a.tp < 1 || a.pp < 1 || a.cp < 1 || a.ep < 1)
    usage("sizes must be positive");
  if (a.backend != "megatron" && (a.tp > 1 || a.pp > 1 || a.cp > 1 || a.sp || a.ep > 1))
    usage("--tp, --pp, --cp, --sp and --ep are megatron's");
  if (a.device != "cpu" && a.device != "cuda") usage("--device is cpu or cuda");
  return a;
}

rlh_status* nll(void*, const rlh_microbatch* mb) {
  const float* lp = static_cast<const float*>(mb->outputs[0].tensor.data);
  float* g = static_cast<float*>(mb->grads[0].data);
  const rlh_batch& b = *mb->batch;
  double loss = 0;
  for (int64_t s = 0; s < b.num_seqs; ++s)
    for (int64_t t = b.seq_offsets[s] + 1; t < b.seq_offsets[s + 1]; ++t) {
      loss -= lp[t] / double(mb->global_num_tokens);
      g[t] = float(-1.0 / double(mb->global_num_tokens));
    }
  *static_cast<float*>(mb->loss->data) = float(loss);
  return nullptr;
}

}  // namespace

int run(const Args& a);

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    return run(a);
  } catch (const std::exception& e) {  // a refused model or device: one line, a non-zero exit
    std::fprintf(stderr, "bench_parallel: %s\n", e.what());
    return 1;
  }
}

int run(const Args& a) {
  rlhost_t* h = nullptr;
  rlh::sdk::check(rlhost_create(&h));
  rlhost_set_log_level(h, RLH_LOG_WARN);
  const char* plugin_path = std::getenv("RLHOST_PLUGIN_PATH");  // a device pack's plugins/
  rlh::sdk::check(rlhost_add_plugin_dir(h, plugin_path != nullptr ? plugin_path : RLH_PLUGIN_DIR));
  for (const char* p : {"model_llama", "kernels_cpu", "dtensor", "megatron", "comm_mpi"})
    rlh::sdk::check(rlhost_load_plugin(h, p), std::string("loading ") + p);
  if (a.device == "cuda") {
    rlh::sdk::check(rlhost_load_plugin(h, "kernels_cuda"), "loading kernels_cuda");
    // cuDNN's attention and NCCL where this build and machine have them (each says why not).
    for (const char* p : {"kernels_cudnn", "comm_nccl"}) rlh::sdk::StatusPtr(rlhost_load_plugin(h, p));
  }
  const rlh_host_api* svc = rlhost_services(h);
  const rlh_comm_api* capi = nullptr;
  rlh_comm* world = nullptr;
  rlh::sdk::check(svc->get_comm(svc->ctx, &capi, &world), "world");
  const int R = capi->rank(world), N = capi->size(world);

  json cfg;
  if (a.backend == "dtensor") {
    cfg = {{"optimizer", {{"name", "torch.optim.AdamW"}, {"kwargs", {{"lr", 1e-4}}}}}};
  } else {
    cfg = {{"megatron_cfg",
            {{"optimizer", {{"lr", 1e-4}, {"use_distributed_optimizer", !a.ddp}}},
             {"tensor_model_parallel_size", a.tp},
             {"pipeline_model_parallel_size", a.pp},
             {"context_parallel_size", a.cp},
             {"expert_model_parallel_size", a.ep},
             {"sequence_parallel", a.sp}}}};
  }
  cfg["train_micro_batch_size"] = a.mb_seqs;
  if (a.device == "cuda") {
    cfg["precision"] = "bfloat16";
    cfg["device"] = "cuda";
  }
  const rlh_component_desc* d = nullptr;
  rlh::sdk::check(svc->find_component(svc->ctx, RLH_KIND_BACKEND, a.backend.c_str(), &d));
  const auto* api = static_cast<const rlh_backend_api*>(d->api);
  rlh_backend* be = nullptr;
  const std::string text = cfg.dump();
  rlh::sdk::check(api->create(svc, text.data(), text.size(), &be), "create");
  rlh_model_args ma{};
  ma.struct_size = RLH_STRUCT_SIZE(rlh_model_args, config_len);
  ma.role = "policy";
  ma.path = a.model.c_str();
  ma.flags = RLH_MODEL_TRAINABLE;
  rlh_model* m = nullptr;
  rlh::sdk::check(api->load_model(be, &ma, &m), "load_model " + a.model);
  int64_t params = 0;
  {
    auto count = [](void* user, const char*, const rlh_tensor* t) -> rlh_status* {
      int64_t n = 1;
      for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
      *static_cast<int64_t*>(user) += n;
      return nullptr;
    };
    rlh::sdk::check(api->visit_weights(be, m, count, &params, nullptr), "visit_weights");
  }
  std::ifstream cfg_in(a.model + "/config.json");
  const json mc = json::parse(cfg_in);
  const int32_t vocab = mc.value("vocab_size", 32);

  // This rank's data-parallel share of the global batch (Megatron's order: tp fastest, then cp,
  // then dp, pp slowest; every rank of a tp x cp x pp block takes its data-parallel rank's share).
  const int64_t block = a.tp * a.cp, dp = N / (block * a.pp), dp_rank = (R / block) % std::max<int64_t>(dp, 1);
  if (dp < 1 || dp * block * a.pp != N) {
    if (R == 0) std::fprintf(stderr, "bench_parallel: %d ranks are not a multiple of tp x cp x pp\n", N);
    return 2;
  }
  const int64_t s0 = a.seqs * dp_rank / dp, s1 = a.seqs * (dp_rank + 1) / dp;
  std::mt19937 rng(7);
  std::vector<int32_t> ids;
  std::vector<int64_t> off = {0};
  for (int64_t s = 0; s < a.seqs; ++s)
    for (int64_t t = 0; t < a.len; ++t) {
      const int32_t id = int32_t(rng() % uint32_t(vocab));
      if (s >= s0 && s < s1) ids.push_back(id);
    }
  for (int64_t s = s0; s < s1; ++s) off.push_back(off.back() + a.len);
  rlh_batch b{};
  b.struct_size = RLH_STRUCT_SIZE(rlh_batch, constraints);
  b.num_tokens = int64_t(ids.size());
  b.num_seqs = s1 - s0;
  b.token_ids = ids.data();
  b.seq_offsets = off.data();
  rlh_output_spec spec{};
  spec.struct_size = RLH_STRUCT_SIZE(rlh_output_spec, ids_field);
  spec.kind = RLH_OUTPUT_LOGPROB_RAW;
  spec.name = "lp";
  spec.temperature = 1.0;
  spec.top_p = 1.0;
  rlh_train_args ta{};
  ta.struct_size = RLH_STRUCT_SIZE(rlh_train_args, reserved0);
  ta.batch = &b;
  ta.specs = &spec;
  ta.num_outputs = 1;
  ta.loss_fn = nll;
  ta.global_num_tokens = a.seqs * a.len;
  ta.global_num_seqs = a.seqs;
  ta.learning_rate = -1;

  std::vector<double> times;
  json last;
  for (int64_t step = 0; step < a.warmup + a.steps; ++step) {
    std::string out;
    rlh_train_result r{};
    r.struct_size = RLH_STRUCT_SIZE(rlh_train_result, user);
    r.write = rlh::sdk::write_to_string;
    r.user = &out;
    rlh::sdk::check(capi->barrier(world), "barrier");
    const auto t0 = Clock::now();
    rlh::sdk::check(api->train_step(be, m, &ta, &r), "train_step");
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step >= a.warmup) times.push_back(dt);
    last = json::parse(out);
  }
  std::sort(times.begin(), times.end());
  const double step_s = times[times.size() / 2];
  const int64_t S = dp;  // the data-parallel group (every rank shards without HSDP)
  const int64_t M = (s1 - s0 + a.mb_seqs - 1) / a.mb_seqs;
  const double P4 = 4.0 * double(params);
  const bool model_parallel = a.tp > 1 || a.pp > 1 || a.cp > 1 || a.ep > 1;
  double analytic = -1;
  std::string mode;
  const double f = double(S - 1) / double(S);
  // The device's units (FSDP): the root (embedding, the head unless tied, final norm) and L
  // equal layers.
  const int64_t hidden = mc.value("hidden_size", int64_t{0}), layers = mc.value("num_hidden_layers", int64_t{1});
  const double root = double(vocab) * double(hidden) * (mc.value("tie_word_embeddings", false) ? 1 : 2) + double(hidden);
  const double layer = (double(params) - root) / double(std::max<int64_t>(layers, 1));
  if (a.backend == "dtensor") {
    mode = "fsdp";
    const double gathers = layers >= 2 ? double(2 * layers - 2) + double(std::max<int64_t>(M - 1, 0)) * double(2 * layers - 4) : 1;
    analytic = a.device == "cuda" ? f * (6 * root + double(M) * 4 * layer * double(layers) + 2 * layer * gathers)
                                  : 3.0 * f * P4 * double(M);
  } else {
    mode = a.ddp ? "ddp" : "distributed_optimizer";
    if (!model_parallel) analytic = a.device == "cuda" ? f * double(params) * (a.ddp ? 8 : 10) : 2.0 * f * P4;
  }
  // The model-parallel group's bytes and their count (see the top of this file).
  const int64_t C = mc.value("hidden_size", int64_t{0}), L = mc.value("num_hidden_layers", int64_t{0});
  const int64_t heads = mc.value("num_attention_heads", int64_t{1});
  const int64_t kv = mc.value("num_key_value_heads", heads), D = mc.value("head_dim", C / heads);
  const int64_t rows = (s1 - s0) * a.len;
  std::string layout = "dp";
  double mp_bytes = 0, mp_analytic = -1;
  const int layouts = (a.tp > 1) + (a.pp > 1) + (a.cp > 1) + (a.ep > 1);
  if (a.tp > 1) {
    layout = a.sp ? "tp+sp" : "tp";
    mp_bytes = last.value("tp/comm_bytes", 0.0);
    if (layouts == 1) {
      const int64_t T = a.tp;
      int64_t floats = (2 + 4 * L) * rows * C + 4 * rows;
      if (T > kv) floats += L * 2 * kv * D * C;
      if (a.sp) floats += (2 * L + 1) * C;
      mp_analytic = double(2 * floats * 4 * (T - 1) / T + 2 * (2 * 8 * (T - 1) / T));
    }
  }
  if (a.pp > 1) {
    layout = layouts == 1 ? "pp" : layout + "xpp";
    mp_bytes = layouts == 1 ? last.value("pp/comm_bytes", 0.0) : mp_bytes;
    if (layouts == 1 && a.pp == 2) mp_analytic = double(rows * C * 4 + 8);
  }
  if (a.cp > 1) {
    layout = layouts == 1 ? "cp" : layout + "xcp";
    mp_bytes = layouts == 1 ? last.value("cp/comm_bytes", 0.0) : mp_bytes;
    if (layouts == 1) {
      const int64_t pieces = 2 * a.cp, rows_cp = (s1 - s0) * (pieces / a.cp) * ((a.len + pieces - 1) / pieces);
      mp_analytic = double(4 * (a.cp - 1) * rows_cp * (3 * L * 2 * std::max<int64_t>(kv / a.tp, 1) * D + 1));
    }
  }
  if (a.ep > 1) {
    layout = layouts == 1 ? "ep" : layout + "xep";
    mp_bytes = layouts == 1 ? last.value("ep/comm_bytes", 0.0) : mp_bytes;
    const int64_t E = mc.value("num_local_experts", mc.value("num_experts", int64_t{0}));
    const int64_t K = mc.value("num_experts_per_tok", int64_t{0});
    if (layouts == 1 && E > 0) {
      const double crossing = double(L * rows * K) * double(a.ep - 1) / double(a.ep);  // out = in, all layers
      mp_analytic = double(M * L * (a.ep - 1) * (E / a.ep) * 8) + 2.0 * (2.0 * crossing) * double(C) * 4.0;
    }
  }
  if (R == 0)
    std::printf("RESULT backend=%s device=%s mode=%s layout=%s ranks=%d tp=%lld pp=%lld cp=%lld ep=%lld experts=%lld sp=%d params=%lld "
                "micro_batches=%lld step_s=%.4f tok_s=%.1f state_bytes=%.0f comm_bytes=%.0f analytic_bytes=%.0f "
                "comm_over_param_bytes=%.3f comm_s=%.4f mp_bytes=%.0f mp_analytic=%.0f\n",
                a.backend.c_str(), a.device.c_str(), mode.c_str(), layout.c_str(), N, (long long)a.tp, (long long)a.pp, (long long)a.cp,
                (long long)a.ep, (long long)mc.value("num_local_experts", mc.value("num_experts", int64_t{0})), a.sp ? 1 : 0, (long long)params, (long long)M, step_s, double(a.seqs * a.len) / step_s,
                last.value("memory/state_bytes", 0.0), last.value("dp/comm_bytes", 0.0), analytic,
                last.value("dp/comm_bytes", 0.0) / P4, last.value("dp/comm_seconds", 0.0), mp_bytes, mp_analytic);
  api->destroy(be);
  rlhost_destroy(h);
  return 0;
}
