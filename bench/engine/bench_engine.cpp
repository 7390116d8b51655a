// bench_engine: training-step and forward-logprob throughput of rlh_engine on the CPU, plus the
// measured sgemm ceiling of this machine, for comparison with PyTorch (bench_torch.py; run.sh
// runs both). Prints one "RESULT key=value ..." line per measurement for run.sh to parse.
//
//   bench_engine --shape tiny|small [--steps N] [--warmup N] [--threads N] [--recompute]
//                [--profile]
// Step times are medians over --steps timed steps.
// Shapes (Llama-style, untied, random weights):
//   tiny:  vocab 4096,  d 256, 4 layers,  8/4 heads of 32, ffn 768,  batch 16 x 128
//   small: vocab 32000, d 768, 12 layers, 12/4 heads of 64, ffn 2048, batch 2 x 128
// FLOPs per token: 6 * matmul params (forward 2, backward 4) + causal attention 6 * L * T * H * D
// (forward QK^T and PV = 2 * T/2 * H * D * 2 per token; backward twice that), the convention of
// perf.md's MFU table.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/kernels_cpu/blas.hpp"
#include "rlhost/kernels_cpu/cpu_features.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  const char* name;
  int64_t V, C, L, Hq, Hkv, D, F, B, T;
};
const Shape kShapes[] = {{"tiny", 4096, 256, 4, 8, 4, 32, 768, 16, 128},
                         {"small", 32000, 768, 12, 12, 4, 64, 2048, 2, 128}};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// sgemm GFLOP/s through kernels_cpu (OpenBLAS split over our threads): the machine's ceiling.
double sgemm_ceiling(int64_t n) {
  std::vector<float> a(size_t(n * n), 0.5f), b(size_t(n * n), 0.25f), c(size_t(n * n));
  kcpu::gemm<float>(false, true, n, n, n, 1.f, a.data(), n, b.data(), n, 0.f, c.data(), n);
  int it = 0;
  const auto t0 = Clock::now();
  while (seconds_since(t0) < 2.0 || it < 3) {
    kcpu::gemm<float>(false, true, n, n, n, 1.f, a.data(), n, b.data(), n, 0.f, c.data(), n);
    ++it;
  }
  return 2.0 * n * n * n * it / seconds_since(t0) / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_name = "small";
  int steps = 5, warmup = 1, threads = 2;
  bool recompute = false, profile = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--shape") shape_name = next();
    else if (a == "--steps") steps = std::atoi(next());
    else if (a == "--warmup") warmup = std::atoi(next());
    else if (a == "--threads") threads = std::atoi(next());
    else if (a == "--recompute") recompute = true;
    else if (a == "--profile") profile = true;
    else {
      std::fprintf(stderr, "usage: %s [--shape tiny|small] [--steps N] [--warmup N] [--threads N] [--recompute]\n", argv[0]);
      return 2;
    }
  }
  const Shape* s = nullptr;
  for (const Shape& x : kShapes)
    if (shape_name == x.name) s = &x;
  if (!s) {
    std::fprintf(stderr, "unknown shape %s\n", shape_name.c_str());
    return 2;
  }
  omp_set_num_threads(threads);
  std::printf("cpu: %s\n%s\nthreads: %d\n", kcpu::cpu_features_string().c_str(),
              kcpu::blas_info_string().c_str(), threads);

  nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", s->V},
                        {"hidden_size", s->C}, {"intermediate_size", s->F},
                        {"num_hidden_layers", s->L}, {"num_attention_heads", s->Hq},
                        {"num_key_value_heads", s->Hkv}, {"head_dim", s->D},
                        {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5},
                        {"rope_theta", 10000.0}, {"tie_word_embeddings", false},
                        {"torch_dtype", "float32"}};
  engine::CountingAllocator alloc;
  engine::Ops* cpu = &test::cpu_ops();  // kernels_cpu through the registry, as a backend runs it
  std::unique_ptr<engine::Ops> prof = engine::make_profiling_ops(*cpu);
  engine::EngineOptions eo;
  eo.recompute = recompute;
  eo.allocator = &alloc;
  eo.ops = profile ? prof.get() : cpu;
  eo.optimizer.weight_decay = 0.01;
  eo.optimizer.max_grad_norm = 1.0;
  engine::Engine e(model::describe(cfg), eo);
  uint32_t x = 12345;
  for (size_t i = 0; i < e.num_params(); ++i) {
    const bool vec = e.desc().params[i].shape.size() == 1;
    for (float& v : e.param(i)) {
      x = x * 1664525u + 1013904223u;
      const float u = float(x >> 8) * (1.0f / 16777216.0f) - 0.5f;
      v = vec ? 1.0f : 0.04f * u;
    }
  }

  const int64_t N = s->B * s->T;
  std::vector<int32_t> ids(static_cast<size_t>(N)), cu;
  for (int64_t i = 0; i < N; ++i) ids[size_t(i)] = int32_t((i * 7919 + 13) % s->V);
  for (int64_t b = 0; b <= s->B; ++b) cu.push_back(int32_t(b * s->T));
  engine::MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;

  int64_t matmul_params = 0;
  for (const auto& p : e.desc().params)
    if (p.shape.size() == 2 && p.role != sdk::ParamRole::embed) matmul_params += p.shape[0] * p.shape[1];
  const double attn_flops = 6.0 * double(s->L) * double(s->T) * double(s->Hq * s->D);
  const double train_flops_per_token = 6.0 * double(matmul_params) + attn_flops;
  const double fwd_flops_per_token = 2.0 * double(matmul_params) + attn_flops / 3.0;

  engine::StepOptions so;
  so.lr = 1e-4;
  so.global_tokens = s->B * (s->T - 1);
  so.outputs.logprob = true;
  auto loss = [](const engine::LossContext& c, const engine::OutputViews& o,
                 engine::OutputGrads& g) {
    engine::LossResult r;
    for (size_t t = 0; t < o.logprob.size(); ++t) {
      r.loss -= o.logprob[t] / double(c.global_tokens);
      g.logprob[t] = float(-1.0 / double(c.global_tokens));
    }
    return r;
  };

  // Each step timed alone; the median is what is reported (robust to another process taking a
  // core for a moment on a shared machine), the mean is printed beside it.
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s / double(v.size());
  };
  const double ceiling_before = sgemm_ceiling(2048);
  for (int i = 0; i < warmup; ++i) e.train_step({&mb, 1}, so, loss);
  engine::profiling_reset(*prof);
  double last_loss = 0;
  std::vector<double> train_times, fwd_times;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    last_loss = e.train_step({&mb, 1}, so, loss).loss;
    train_times.push_back(seconds_since(t0));
  }
  const double train_s = median(train_times);
  if (profile)
    std::printf("train step ops (%d steps, %.3f s wall):\n%s", steps, mean(train_times) * steps,
                engine::profiling_report(*prof).c_str());

  engine::OutputRequest fr;
  fr.logprob = true;
  e.forward(mb, fr);
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    e.forward(mb, fr);
    fwd_times.push_back(seconds_since(t0));
  }
  const double fwd_s = median(fwd_times);
  if (profile) std::printf("forward ops (train + forward):\n%s", engine::profiling_report(*prof).c_str());

  // The ceiling is measured before and after the runs; the larger is the machine's (a shared
  // machine may have been busy during one of them).
  const double ceiling = std::max(ceiling_before, sgemm_ceiling(2048));
  const double train_tps = double(N) / train_s, fwd_tps = double(N) / fwd_s;
  const double train_gflops = train_tps * train_flops_per_token / 1e9;
  const double fwd_gflops = fwd_tps * fwd_flops_per_token / 1e9;
  std::printf("shape %s: %.1f M matmul params, %ld tokens/step, loss %.4f\n", s->name,
              matmul_params / 1e6, long(N), last_loss);
  std::printf("train step: median %.3f s (mean %.3f), %.0f tok/s, %.1f GFLOP/s (%.0f%% of sgemm "
              "ceiling %.1f)\n",
              train_s, mean(train_times), train_tps, train_gflops, 100 * train_gflops / ceiling,
              ceiling);
  std::printf("forward logprobs: median %.3f s (mean %.3f), %.0f tok/s, %.1f GFLOP/s\n", fwd_s,
              mean(fwd_times), fwd_tps, fwd_gflops);
  std::printf("RESULT impl=rlhost shape=%s train_tok_s=%.1f fwd_tok_s=%.1f train_gflops=%.1f "
              "sgemm_gflops=%.1f\n",
              s->name, train_tps, fwd_tps, train_gflops, ceiling);
  return 0;
}
