// bench_generator: decode throughput of the native generator on the CPU (tokens/s), for
// comparison with PyTorch's KV-cached greedy decoding of the same shapes (bench_torch_decode.py;
// run.sh runs both). Greedy, no stop: every sample makes exactly --new tokens after a --prompt
// token prompt, and the figure is batch * new / time of the whole generate() call (prefill
// included, as in the peer), median over --repeats calls. Also the process CPU time of the
// calls: on a machine shared with other work, tokens per CPU-second (times the thread count) is
// the figure the load does not distort, as long as idle threads sleep.
//
// Also the bandwidth roofline of a decoding step: every step reads all the weights, so tokens/s
// at batch B is at most B * (read bandwidth) / (weight bytes). The read bandwidth is measured
// here over a buffer the size of the weights (L3-resident for tiny, DRAM for small) with the same
// threads, and the step rate is printed as a fraction of it.
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

#include "kernels_cpu_abi.hpp"
#include "rlhost/generator/generator.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  const char* name;
  int64_t V, C, L, Hq, Hkv, D, F;
};
const Shape kShapes[] = {{"tiny", 4096, 256, 4, 8, 4, 32, 768}, {"small", 32000, 768, 12, 12, 4, 64, 2048}};

// Sum of n floats (n a multiple of 64) with four independent vector accumulators: a read stream
// as wide as the CPU allows, so the probe below measures memory, not the adder.
typedef float v16 __attribute__((vector_size(64)));
template <int>
inline __attribute__((always_inline)) float sum_body(const float* p, int64_t n) {
  v16 a = {}, b = {}, c = {}, d = {};
  for (int64_t i = 0; i < n; i += 64) {
    for (int l = 0; l < 4; ++l) __builtin_prefetch(p + i + 1024 + 16 * l);  // 4 KiB ahead
    v16 x, y, z, u;
    std::memcpy(&x, p + i, 64);
    std::memcpy(&y, p + i + 16, 64);
    std::memcpy(&z, p + i + 32, 64);
    std::memcpy(&u, p + i + 48, 64);
    a += x, b += y, c += z, d += u;
  }
  const v16 t = (a + b) + (c + d);
  float r = 0;
  for (int j = 0; j < 16; ++j) r += t[j];
  return r;
}
__attribute__((target("avx512f"))) float sum_avx512(const float* p, int64_t n) { return sum_body<0>(p, n); }
__attribute__((target("avx2"))) float sum_avx2(const float* p, int64_t n) { return sum_body<1>(p, n); }
float sum_generic(const float* p, int64_t n) { return sum_body<2>(p, n); }

// Bytes per second of reading `bytes` of floats, best of 5, split over `threads` like the decode.
double read_bandwidth(int64_t bytes, int threads) {
  float (*sum)(const float*, int64_t) = __builtin_cpu_supports("avx512f") ? sum_avx512
                                        : __builtin_cpu_supports("avx2") ? sum_avx2 : sum_generic;
  std::vector<float> buf(static_cast<size_t>(bytes / 4), 1.f);
  const int64_t chunks = int64_t(threads) * 16, per = int64_t(buf.size()) / chunks / 64 * 64;
  std::vector<float> sums(static_cast<size_t>(chunks));
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = Clock::now();
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t c = 0; c < chunks; ++c) sums[size_t(c)] = sum(buf.data() + c * per, per);
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, double(chunks * per) * 4 / secs);
  }
  if (sums[0] < 0) std::printf("?");  // keeps the reads
  return best;
}

const char* simd_name() {
  return __builtin_cpu_supports("avx512f") ? "avx512" : __builtin_cpu_supports("avx2") ? "avx2" : "generic";
}

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
  bool kv_fp8 = false;  // --kv-fp8: the KV cache in FP8 e4m3 (vllm_cfg.kv_cache_dtype fp8)
  for (int i = 1; i < argc; ++i) kv_fp8 = kv_fp8 || std::strcmp(argv[i], "--kv-fp8") == 0;
  const Shape* s = nullptr;
  for (const Shape& k : kShapes)
    if (shape_name == k.name) s = &k;
  if (!s || B < 1 || N < 1 || P < 1 || repeats < 1) {
    std::fprintf(stderr, "usage: bench_generator --shape tiny|small [--batch B] [--new N] [--prompt P] [--repeats R] [--kv-fp8]\n");
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
  // Bytes a step reads: every parameter but the embedding table, of which it gathers a few rows.
  int64_t weight_bytes = 0;
  for (size_t i = 0; i < w.size(); ++i)
    if (desc.params[i].role != sdk::ParamRole::embed) weight_bytes += int64_t(w[i].size() * sizeof(float));
  gen::Options o;
  // kernels_cpu through the registry, as the plugin runs it, with `threads` decode threads
  const std::string kcfg = "{\"num_threads\": " + std::to_string(threads) + "}";
  test::KernelsCpuThroughAbi kernels({}, kcfg.c_str());
  o.ops = &kernels.ops();
  o.max_num_seqs = std::max<int64_t>(B, 1);
  o.kv_cache_fp8 = kv_fp8;
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
              threads, simd_name(), s->name, (long long)B, (long long)N, (long long)P, t,
              repeats, times.front(), tok_s, c, cpu_tok_s, threads);
  const double bw = read_bandwidth(weight_bytes, threads), steps_s = tok_s / double(B);
  std::printf("roofline: %.1f MB of weights (all but the embedding) read per step; a plain vector read of that much "
              "runs at %.1f GB/s here, so about %.1f steps/s at most; this run makes %.1f steps/s (%.0f%% of it, "
              "%.1f GB/s of weights)\n",
              double(weight_bytes) / 1e6, bw / 1e9, bw / double(weight_bytes), steps_s,
              100.0 * steps_s * double(weight_bytes) / bw, steps_s * double(weight_bytes) / 1e9);
  std::printf("RESULT impl=rlhost shape=%s batch=%lld tok_s=%.2f cpu_tok_s=%.2f roofline_pct=%.1f kv_fp8=%d\n", s->name,
              (long long)B, tok_s, cpu_tok_s, 100.0 * steps_s * double(weight_bytes) / bw, kv_fp8 ? 1 : 0);
  return 0;
}
