// bench_moe: training-step and forward-logprob throughput of rlh_engine on an MoE model on the
// CPU, for comparison with PyTorch (bench_torch.py, HF's eager Mixtral block: a Python loop
// over the experts that got tokens; run.sh runs both). Prints one "RESULT key=value ..." line.
//
//   bench_moe [--steps N] [--warmup N] [--threads N] [--profile] [--router-fp64] [--recompute]
//
// Shape (the issue's): Mixtral-style (softmax top-2, renormalised, SwiGLU experts, untied),
// vocab 4096, d 256, 4 layers, 8/4 heads of 32, 16 experts top-2 of ffn 256, batch 16 x 128,
// random weights. Step times are medians over --steps timed steps.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/kernels_cpu/blas.hpp"
#include "rlhost/kernels_cpu/cpu_features.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using Clock = std::chrono::steady_clock;

namespace {
constexpr int64_t V = 4096, C = 256, L = 4, Hq = 8, Hkv = 4, D = 32, E = 16, K = 2, Fe = 256,
                  B = 16, T = 128;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
}  // namespace

int main(int argc, char** argv) {
  int steps = 5, warmup = 1, threads = 2;
  bool profile = false, fp64 = false, recompute = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoi(argv[++i]);
    };
    if (a == "--steps") steps = next();
    else if (a == "--warmup") warmup = next();
    else if (a == "--threads") threads = next();
    else if (a == "--profile") profile = true;
    else if (a == "--router-fp64") fp64 = true;
    else if (a == "--recompute") recompute = true;
    else {
      std::fprintf(stderr, "usage: %s [--steps N] [--warmup N] [--threads N] [--profile] "
                   "[--router-fp64] [--recompute]\n", argv[0]);
      return 2;
    }
  }
  omp_set_num_threads(threads);
  std::printf("cpu: %s\n%s\nthreads: %d\n", kcpu::cpu_features_string().c_str(),
              kcpu::blas_info_string().c_str(), threads);

  const nlohmann::json cfg = {
      {"architectures", {"MixtralForCausalLM"}}, {"vocab_size", V}, {"hidden_size", C},
      {"intermediate_size", Fe}, {"num_hidden_layers", L}, {"num_attention_heads", Hq},
      {"num_key_value_heads", Hkv}, {"head_dim", D}, {"num_local_experts", E},
      {"num_experts_per_tok", K}, {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5},
      {"rope_theta", 10000.0}, {"tie_word_embeddings", false}, {"router_aux_loss_coef", 0.0},
      {"torch_dtype", "float32"}};
  engine::CountingAllocator alloc;
  engine::Ops* cpu = &test::cpu_ops();  // kernels_cpu through the registry, as a backend runs it
  std::unique_ptr<engine::Ops> prof = engine::make_profiling_ops(*cpu);
  engine::EngineOptions eo;
  eo.allocator = &alloc;
  eo.ops = profile ? prof.get() : cpu;
  eo.recompute = recompute;
  eo.moe.router_fp64 = fp64;
  engine::Engine e(model::describe(cfg), eo);
  uint32_t x = 12345;
  for (size_t i = 0; i < e.num_params(); ++i) {
    const bool vec = e.desc().params[i].shape.size() == 1;
    for (float& v : e.param(i)) {
      x = x * 1664525u + 1013904223u;
      v = vec ? 1.0f : 0.08f * (float(x >> 8) * (1.0f / 16777216.0f) - 0.5f);
    }
  }
  const int64_t N = B * T;
  std::vector<int32_t> ids(static_cast<size_t>(N)), cu;
  for (int64_t i = 0; i < N; ++i) ids[size_t(i)] = int32_t((i * 7919 + 13) % V);
  for (int64_t b = 0; b <= B; ++b) cu.push_back(int32_t(b * T));
  engine::MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;

  engine::StepOptions so;
  so.lr = 1e-4;
  so.global_tokens = B * (T - 1);
  auto loss = [](const engine::LossContext& c, const engine::OutputViews& o,
                 engine::OutputGrads& g) {
    engine::LossResult r;
    const auto& cs = c.microbatch->cu_seqlens;
    for (size_t s = 0; s + 1 < cs.size(); ++s)
      for (int32_t t = cs[s] + 1; t < cs[s + 1]; ++t) {
        r.loss -= o.logprob[size_t(t)] / double(c.global_tokens);
        g.logprob[size_t(t)] = float(-1.0 / double(c.global_tokens));
      }
    return r;
  };
  for (int i = 0; i < warmup; ++i) e.train_step({&mb, 1}, so, loss);
  engine::profiling_reset(*prof);
  std::vector<double> train_times, fwd_times;
  engine::StepResult last;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    last = e.train_step({&mb, 1}, so, loss);
    train_times.push_back(seconds_since(t0));
  }
  if (profile) std::printf("train step ops (%d steps):\n%s", steps, engine::profiling_report(*prof).c_str());
  engine::OutputRequest fr;
  e.forward(mb, fr);
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    e.forward(mb, fr);
    fwd_times.push_back(seconds_since(t0));
  }
  double load = 0;
  for (const auto& [k, v] : last.metrics)
    if (k == "moe/max_expert_load") load = v;
  const double train_s = median(train_times), fwd_s = median(fwd_times);
  std::printf("MoE %ld experts top-%ld: loss %.4f, busiest expert %.1f%% of a layer's routed tokens "
              "(balanced %.1f%%), peak memory %.1f MiB\n",
              long(E), long(K), last.loss, 100 * load, 100.0 / double(E),
              double(alloc.peak_bytes()) / (1 << 20));
  std::printf("train step: median %.3f s, %.0f tok/s; forward logprobs: median %.3f s, %.0f tok/s\n",
              train_s, double(N) / train_s, fwd_s, double(N) / fwd_s);
  std::printf("RESULT impl=rlhost shape=moe train_tok_s=%.1f fwd_tok_s=%.1f\n", double(N) / train_s,
              double(N) / fwd_s);
  return 0;
}
