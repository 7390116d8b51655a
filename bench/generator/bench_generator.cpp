// bench_generator: decode throughput of the native generator on the CPU (tokens/s), for
// comparison with PyTorch's KV-cached greedy decoding of the same shapes (bench_torch_decode.py;
// run.sh runs both). Greedy, no stop: every sample makes exactly --new tokens after a --prompt
// token prompt, and the figure is batch * new / time of the whole generate() call (prefill
// included, as in the peer), median over --repeats calls. Also the process CPU time of the
// calls: on a machine shared with other work, tokens per CPU-second (times the thread count) is
// the figure the load does not distort, as long as idle threads sleep (OMP_WAIT_POLICY=passive).
//
//   bench_generator --shape tiny|small [--batch B] [--new N] [--prompt P] [--repeats R]
//                   [--threads T] [--temperature T]
// Shapes (Llama-style, untied, random weights):
//   tiny:  vocab 4096,  d 256, 4 layers,  8/4 heads of 32, ffn 768
//   small: vocab 32000, d 768, 12 layers, 12/4 heads of 64, ffn 2048
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "rlhost/generator/generator.hpp"
#include "rlhost/kernels_cpu/cpu_features.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  const char* name;
  int64_t V, C, L, Hq, Hkv, D, F;
};
const Shape kShapes[] = {{"tiny", 4096, 256, 4, 8, 4, 32, 768}, {"small", 32000, 768, 12, 12, 4, 64, 2048}};

const char* arg(int argc, char** argv, const char* name, const char* def) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string shape_name = arg(argc, argv, "--shape", "tiny");
  const int64_t B = std::atoll(arg(argc, argv, "--batch", "1"));
  const int64_t N = std::atoll(arg(argc, argv, "--new", "64"));
  const int64_t P = std::atoll(arg(argc, argv, "--prompt", "16"));
  const int repeats = std::atoi(arg(argc, argv, "--repeats", "3"));
  const int threads = std::atoi(arg(argc, argv, "--threads", "2"));
  const double temperature = std::atof(arg(argc, argv, "--temperature", "0"));
  const Shape* s = nullptr;
  for (const Shape& k : kShapes)
    if (shape_name == k.name) s = &k;
  if (!s || B < 1 || N < 1 || P < 1 || repeats < 1) {
    std::fprintf(stderr, "usage: bench_generator --shape tiny|small [--batch B] [--new N] [--prompt P] [--repeats R]\n");
    return 2;
  }
  omp_set_num_threads(threads);
  const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"},
                              {"vocab_size", s->V},       {"hidden_size", s->C},
                              {"num_hidden_layers", s->L}, {"num_attention_heads", s->Hq},
                              {"num_key_value_heads", s->Hkv}, {"head_dim", s->D},
                              {"intermediate_size", s->F}, {"max_position_embeddings", 4096},
                              {"rms_norm_eps", 1e-5},      {"tie_word_embeddings", false}};
  const sdk::TransformerDesc desc = model::describe(cfg);
  std::vector<std::vector<float>> w;
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 0.02f);
  for (const sdk::ParamDesc& p : desc.params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    std::vector<float> t(static_cast<size_t>(n));
    const bool norm = p.role == sdk::ParamRole::attn_norm || p.role == sdk::ParamRole::mlp_norm ||
                      p.role == sdk::ParamRole::final_norm;
    for (float& x : t) x = norm ? 1.f : nd(rng);
    w.push_back(std::move(t));
  }
  gen::Options o;
  o.max_num_seqs = std::max<int64_t>(B, 1);
  gen::Generator g(desc, o);
  g.weights().load(w, 0);
  w.clear();

  std::vector<int32_t> ids;
  std::vector<int64_t> off = {0};
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < P; ++t) ids.push_back(int32_t((b * P + t) * 7919 % s->V));
    off.push_back(int64_t(ids.size()));
  }
  gen::Request r;
  r.prompt_ids = ids;
  r.prompt_offsets = off;
  r.sampling.temperature = temperature;
  r.max_new_tokens = N;
  int64_t produced = 0;
  auto cpu_now = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  std::vector<double> cpu;
  auto once = [&] {
    produced = 0;
    const double c0 = cpu_now();
    const auto t0 = Clock::now();
    const gen::Stats st = g.generate(r, [&](const gen::Sample& smp) { produced += int64_t(smp.ids.size()); });
    (void)st;
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    cpu.push_back(cpu_now() - c0);
    return wall;
  };
  r.max_new_tokens = 4;
  once();  // warm-up: pages, thread pool
  cpu.clear();
  r.max_new_tokens = N;
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) times.push_back(once());
  std::sort(times.begin(), times.end());
  std::sort(cpu.begin(), cpu.end());
  const double t = times[times.size() / 2], c = cpu[cpu.size() / 2];
  if (produced != B * N) {
    std::fprintf(stderr, "expected %lld tokens, got %lld\n", (long long)(B * N), (long long)produced);
    return 1;
  }
  const double tok_s = double(B * N) / t, cpu_tok_s = double(B * N) / c * threads;
  std::printf("rlhost native generator, %d threads, %s: shape %s batch %lld: %lld new tokens after a %lld-token prompt "
              "in %.3f s (median of %d; min %.3f), %.1f tok/s; %.3f CPU-s, %.1f tok per CPU-s x %d threads\n",
              threads, kcpu::cpu_features_string().c_str(), s->name, (long long)B, (long long)N, (long long)P, t,
              repeats, times.front(), tok_s, c, cpu_tok_s, threads);
  std::printf("RESULT impl=rlhost shape=%s batch=%lld tok_s=%.2f cpu_tok_s=%.2f\n", s->name, (long long)B, tok_s,
              cpu_tok_s);
  return 0;
}
