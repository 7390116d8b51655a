// bench_parallel: data-parallel training steps on CPU ranks under mpirun, through the backend
// plugins' ABI (the path rlhost runs): step time, tokens per second, per-rank training state and
// the bytes each rank's collectives move per step against the analytic count. run.sh runs it at
// 1, 2 and 4 ranks for dtensor FSDP and megatron's distributed optimizer and prints the scaling.
//
//   mpirun -np N bench_parallel --model DIR --backend dtensor|megatron [--seqs 16] [--len 128]
//                                [--mb-seqs 4] [--steps 5] [--warmup 1] [--ddp]
//
// The global batch is --seqs sequences of --len tokens; each rank trains on its share (seqs / N)
// in micro-batches of --mb-seqs sequences. Prints, on rank 0, one line:
//   RESULT backend=.. mode=.. ranks=N step_s=.. tok_s=.. state_bytes=.. comm_bytes=.. analytic_bytes=..
// Analytic traffic per rank per step, ring collectives over S ranks, P parameters of 4 bytes, M
// micro-batches per rank: FSDP 3 (S-1)/S 4P per micro-batch (two all-gathers and one
// reduce-scatter of every unit: gathered for the forward, again for the backward); the
// distributed optimizer 2 (S-1)/S 4P (reduce-scatter of the gradients, all-gather of the
// weights); DDP 2 (S-1)/S 4P (one all-reduce).
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
  bool ddp = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "bench_parallel: %s\nusage: bench_parallel --model DIR --backend dtensor|megatron [--seqs N] "
                       "[--len N] [--mb-seqs N] [--steps N] [--warmup N] [--ddp]\n", why.c_str());
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
    else usage("unknown argument " + k);
  }
  if (a.model.empty()) usage("--model is required");
  if (a.backend != "dtensor" && a.backend != "megatron") usage("--backend is dtensor or megatron");
  if (a.seqs < 1 || a.len < 2 || a.mb_seqs < 1 || a.steps < 1) usage("sizes must be positive");
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

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  rlhost_t* h = nullptr;
  rlh::sdk::check(rlhost_create(&h));
  rlhost_set_log_level(h, RLH_LOG_WARN);
  rlh::sdk::check(rlhost_add_plugin_dir(h, RLH_PLUGIN_DIR));
  for (const char* p : {"model_llama", "kernels_cpu", "dtensor", "megatron", "comm_mpi"})
    rlh::sdk::check(rlhost_load_plugin(h, p), std::string("loading ") + p);
  const rlh_host_api* svc = rlhost_services(h);
  const rlh_comm_api* capi = nullptr;
  rlh_comm* world = nullptr;
  rlh::sdk::check(svc->get_comm(svc->ctx, &capi, &world), "world");
  const int R = capi->rank(world), N = capi->size(world);

  json cfg;
  if (a.backend == "dtensor") {
    cfg = {{"optimizer", {{"name", "torch.optim.AdamW"}, {"kwargs", {{"lr", 1e-4}}}}}};
  } else {
    cfg = {{"megatron_cfg", {{"optimizer", {{"lr", 1e-4}, {"use_distributed_optimizer", !a.ddp}}}}}};
  }
  cfg["train_micro_batch_size"] = a.mb_seqs;
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

  // This rank's share of the global batch.
  const int64_t s0 = a.seqs * R / N, s1 = a.seqs * (R + 1) / N;
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
  const int S = N;  // every rank shards (FSDP shard group = DP group without HSDP)
  const int64_t M = (s1 - s0 + a.mb_seqs - 1) / a.mb_seqs;
  const double P4 = 4.0 * double(params);
  double analytic = 0;
  std::string mode;
  if (a.backend == "dtensor") {
    mode = "fsdp";
    analytic = 3.0 * (S - 1) / S * P4 * double(M);
  } else if (!a.ddp) {
    mode = "distributed_optimizer";
    analytic = 2.0 * (S - 1) / S * P4;
  } else {
    mode = "ddp";
    analytic = 2.0 * (S - 1) / S * P4;
  }
  if (R == 0)
    std::printf("RESULT backend=%s mode=%s ranks=%d params=%lld micro_batches=%lld step_s=%.4f tok_s=%.1f "
                "state_bytes=%.0f comm_bytes=%.0f analytic_bytes=%.0f comm_over_param_bytes=%.3f comm_s=%.4f\n",
                a.backend.c_str(), mode.c_str(), N, (long long)params, (long long)M, step_s,
                double(a.seqs * a.len) / step_s, last.value("memory/state_bytes", 0.0), last.value("dp/comm_bytes", 0.0),
                analytic, last.value("dp/comm_bytes", 0.0) / P4, last.value("dp/comm_seconds", 0.0));
  api->destroy(be);
  rlhost_destroy(h);
  return 0;
}
