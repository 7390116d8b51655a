// bench_generator_cuda: generation tokens/s of the generator on a CUDA device (cuda_executor.hpp:
// bf16, paged KV cache, continuous batching, CUDA graphs) at the shapes, with the
// bandwidth roofline of the same work; run.sh runs it beside Hugging Face generate
// (bench_hf_generate.py) on the same GPU. Prints one "RESULT key=value ..." line per case.
//
//   bench_generator_cuda [--shape llama1b|llama3b|llama8b|small] [--case all|b1|b16|b64|b256|grpo[,...]] [--prompt 128] [--new 256]
//                        [--repeats 3] [--deterministic] [--no-graphs] [--sample] [--fp8] [--kv-fp8] [--parity]
//   --parity: the train-generation mismatch at this shape: the CUDA engine (bf16, the same weights;
//          in its deterministic mode with --deterministic) scores the last timed call's sequences
//          and each sampled token's logprob is compared with the generator's: how many differ
//          at all, mean and max |dlogprob|, token_mult_prob_error (one PARITY line per case)
//   --trainer PARTS: the trainer's deterministic parts for --parity, whatever the generator's mode:
//          none, all, or a +-list of gemm, attention, head (CudaEngineOptions::invariant_parts)
//   --fp8: FP8 rollouts (vllm_cfg.precision: fp8; blockwise, every layer's dense linears) through
//          an FP8 provider on the plugin path (RLH_TEST_PLUGIN_DIR with examples/vendor_fp8)
//   --kv-fp8: the KV cache in FP8 e4m3 (vllm_cfg.kv_cache_dtype fp8; kernels_cuda), half the
//          cache's bytes a step (the roofline counts one byte a cached value)
//
// llama1b: Llama-3.2-1B's shape (vocab 128256, d 2048, 16 layers, 32/8 heads of 64, ffn 8192,
// tied), random weights; llama3b: Llama-3.2-3B's (d 3072, 28 layers, 24/8 heads of 128, ffn 8192,
// tied); llama8b: Llama-3.1-8B's (d 4096, 32 layers, 32/8 heads of 128, ffn 14336, untied), where
// the products are a larger share of a step than at 1B (FP8 rollouts' ratio depends on it). Cases: batch 1, 64 and 256 prompts of `prompt` random tokens, each
// `new` new tokens (greedy, no stop: every sample runs to its length); grpo: 64 prompts x 8
// samples sharing their prompt (GRPO's rollout: temperature 1, so the samples differ).
// tok/s counts new tokens over the wall time of generate() (prefill included, as HF generate's);
// the median of `repeats` calls after one warm-up call (which captures the CUDA graphs).
// The roofline: a decoding step reads every weight once (bf16; the tied head is the embedding)
// and the keys and values of every position of every running sequence; at the device's peak
// memory bandwidth (from its memory clock and bus width: an H100 SXM's 3.35 TB/s, an H200's
// 4.8; 4.8 TB/s where the device does not say) that bounds the step time from below, and 2
// FLOPs per weight per token at 989 TFLOP/s from the compute side; tokens/s roofline = batch /
// max of the two, at the average position.
#include <cuda_runtime_api.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels_cuda_abi.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "rlhost/generator/cuda_executor.hpp"
#include "rlhost/generator/generator.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  const char* name;
  int64_t V, C, L, Hq, Hkv, D, F;
  bool tied;
};
const Shape kShapes[] = {{"llama1b", 128256, 2048, 16, 32, 8, 64, 8192, true},
                         {"llama3b", 128256, 3072, 28, 24, 8, 128, 8192, true},
                         {"llama8b", 128256, 4096, 32, 32, 8, 128, 14336, false},
                         {"small", 32000, 1024, 4, 16, 4, 64, 4096, true}};

struct Case {
  const char* name;
  int64_t prompts, samples;
};
const Case kCases[] = {{"b1", 1, 1}, {"b16", 16, 1}, {"b64", 64, 1}, {"b256", 256, 1}, {"grpo", 64, 8}};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Random weights, uniform with a normal's spread (std 0.02; norms 1): the speed does not depend on
// the distribution, and this fills 1.2B floats in a second on the device machine's cores.
std::vector<std::vector<float>> random_weights(const sdk::TransformerDesc& d) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < d.params.size(); ++i) {
    const sdk::ParamDesc& p = d.params[i];
    int64_t n = 1;
    for (int64_t x : p.shape) n *= x;
    std::vector<float> t(static_cast<size_t>(n));
    const bool norm = p.role == sdk::ParamRole::attn_norm || p.role == sdk::ParamRole::mlp_norm ||
                      p.role == sdk::ParamRole::final_norm;
    const float a = 0.02f * std::sqrt(3.f);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j)
      t[size_t(j)] = norm ? 1.f : a * (float(splitmix(uint64_t(j) * 1315423911ull + i) >> 40) / float(1 << 24) * 2.f - 1.f);
    out.push_back(std::move(t));
  }
  return out;
}

// The device's peak memory bandwidth (bytes per second): double data rate over the bus; 4.8e12
// (an H200's) where the attributes are not given. Until 2026-12-06 the roofline always used
// 4.8e12, so on an H100 its percentages read 30% low.
double peak_bandwidth(int dev) {
  int khz = 0, bits = 0;
  if (cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess || khz <= 0 || bits <= 0)
    return 4.8e12;
  return 2.0 * double(khz) * 1e3 * double(bits) / 8.0;
}

// Device-to-device copy rate (bytes read + written per second): what the weight reads can reach.
double copy_bandwidth() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return 0;
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaDeviceSynchronize();
  const auto t0 = Clock::now();
  for (int i = 0; i < 10; ++i) cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaDeviceSynchronize();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) * 10 / s;
}

// The generator's samples of one call: prompt + new tokens per sequence, with its logprobs.
struct Seq {
  int64_t prompt = 0;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
};

// The engine's logprobs of the sequences (packed micro-batches of about 16K tokens) against the
// generator's, token by token.
void parity(engine::CudaEngine& eng, const std::vector<Seq>& seqs, const std::vector<int32_t>& prompt_ids,
            const std::vector<int64_t>& off, double temperature, const char* name) {
  int64_t tokens = 0, differ = 0;
  double sum = 0, mx = 0, mult = 0;
  for (size_t a = 0; a < seqs.size();) {
    engine::MicroBatch mb;
    std::vector<int32_t> ids, cu = {0};
    std::vector<std::pair<size_t, int64_t>> starts;  // sequence, where its new tokens start
    size_t b = a;
    for (; b < seqs.size() && (b == a || ids.size() + 1024 <= 16384); ++b) {
      const Seq& q = seqs[b];
      ids.insert(ids.end(), prompt_ids.begin() + off[size_t(q.prompt)], prompt_ids.begin() + off[size_t(q.prompt) + 1]);
      starts.push_back({b, int64_t(ids.size())});
      ids.insert(ids.end(), q.ids.begin(), q.ids.end());
      cu.push_back(int32_t(ids.size()));
    }
    mb.input_ids = ids;
    mb.cu_seqlens = cu;
    engine::OutputRequest req;
    req.logprob = true;
    req.temperature = temperature > 0 ? temperature : 1.0;
    const std::vector<float> lp = eng.forward(mb, req).logprob;
    for (const auto& [i, start] : starts)
      for (size_t t = 0; t < seqs[i].ids.size(); ++t) {
        const float want = seqs[i].logprobs[t], got = lp[size_t(start) + t];
        const double d = std::fabs(double(got) - double(want));
        differ += got != want;
        sum += d;
        mult += std::exp(d);
        mx = std::max(mx, d);
        ++tokens;
      }
    a = b;
  }
  const double n = double(std::max<int64_t>(tokens, 1));
  std::printf("PARITY name=%s tokens=%lld differ=%lld mean_abs_dlogprob=%.3g max_abs_dlogprob=%.3g "
              "token_mult_prob_error=%.6f\n",
              name, (long long)tokens, (long long)differ, sum / n, mx, mult / n);
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_name = "llama1b", which = "all";
  int64_t prompt = 128, new_tokens = 256;
  int repeats = 3;
  bool deterministic = false, graphs = true, sample = false, fp8 = false, check_parity = false, kv_fp8 = false;
  std::string trainer_parts;  // empty: as the generator's mode
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
    else if (a == "--case") which = next();
    else if (a == "--prompt") prompt = std::atoll(next());
    else if (a == "--new") new_tokens = std::atoll(next());
    else if (a == "--repeats") repeats = std::atoi(next());
    else if (a == "--deterministic") deterministic = true;
    else if (a == "--no-graphs") graphs = false;
    else if (a == "--sample") sample = true;
    else if (a == "--fp8") fp8 = true;
    else if (a == "--kv-fp8") kv_fp8 = true;
    else if (a == "--parity") check_parity = true;
    else if (a == "--trainer") trainer_parts = next();
    else {
      std::fprintf(stderr,
                   "usage: %s [--shape llama1b|llama3b|llama8b|small] [--case all|b1|b16|b64|b256|grpo] [--prompt N] [--new N] "
                   "[--repeats N] [--deterministic] [--no-graphs] [--sample] [--fp8] [--kv-fp8] [--parity] [--trainer none|all|gemm+attention+head]\n",
                   argv[0]);
      return 2;
    }
  }
  const Shape* s = nullptr;
  for (const Shape& x : kShapes)
    if (shape_name == x.name) s = &x;
  if (!s || prompt < 1 || new_tokens < 1 || repeats < 1) {
    std::fprintf(stderr, "bench_generator_cuda: unknown shape '%s' or bad sizes\n", shape_name.c_str());
    return 2;
  }
  std::string why;
  if (!gen::cuda_generator_available(&why)) {
    std::fprintf(stderr, "bench_generator_cuda: %s\n", why.c_str());
    return 1;
  }
  if (!test::cuda_registry()) {
    std::fprintf(stderr, "bench_generator_cuda: no kernel provider runs on cuda:0 (RLH_TEST_PLUGIN_DIR?)\n");
    return 1;
  }
  const nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", s->V},
                              {"hidden_size", s->C}, {"intermediate_size", s->F},
                              {"num_hidden_layers", s->L}, {"num_attention_heads", s->Hq},
                              {"num_key_value_heads", s->Hkv}, {"head_dim", s->D},
                              {"max_position_embeddings", 131072}, {"rms_norm_eps", 1e-5},
                              {"rope_theta", 500000.0}, {"tie_word_embeddings", s->tied},
                              {"torch_dtype", "bfloat16"}};
  const sdk::TransformerDesc desc = model::describe(cfg);
  int64_t weights = 0, embed = s->V * s->C;
  for (const sdk::ParamDesc& p : desc.params) {
    int64_t n = 1;
    for (int64_t x : p.shape) n *= x;
    weights += n;
  }
  const auto t_w = Clock::now();
  const std::vector<std::vector<float>> w = random_weights(desc);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double bw_copy = copy_bandwidth(), bw_peak = peak_bandwidth(0);
  std::printf("device: %s, %lld weights (%.2f GB bf16), random weights in %.1f s; device copy rate %.0f GB/s, "
              "peak %.0f GB/s (the roofline's)\n",
              prop.name, (long long)weights, 2e-9 * double(weights),
              std::chrono::duration<double>(Clock::now() - t_w).count(), bw_copy * 1e-9, bw_peak * 1e-9);

  // The trainer for --parity, made before the generators so their KV caches leave it room.
  std::unique_ptr<engine::CudaEngine> trainer;
  if (check_parity) {
    engine::CudaEngineOptions eo = test::cuda_options();
    eo.trainable = false;
    eo.batch_invariant = deterministic;
    if (!trainer_parts.empty()) {
      const auto has = [&](const char* p) { return trainer_parts == "all" || trainer_parts.find(p) != std::string::npos; };
      eo.invariant_parts = {has("gemm"), has("attention"), has("head")};
      eo.batch_invariant = trainer_parts != "none";
    }
    std::printf("trainer for --parity: %s\n", !eo.batch_invariant ? "default kernels"
                                                 : (std::string("deterministic:") + (eo.invariant_parts.gemm ? " gemm" : "") +
                                                    (eo.invariant_parts.attention ? " attention" : "") +
                                                    (eo.invariant_parts.head ? " head" : "")).c_str());
    trainer = std::make_unique<engine::CudaEngine>(desc, eo);
    trainer->load_parameters(w);
    // One call at the largest micro-batch parity() packs, so the trainer's memory is planned
    // before the generators' KV caches take what is left.
    std::vector<int32_t> ids, cu;
    for (int64_t i = 0; i < 16; ++i) {
      for (int64_t t = 0; t < 1024; ++t) ids.push_back(int32_t((i * 1024 + t) % s->V));
      cu.push_back(int32_t(i * 1024));
    }
    cu.push_back(16 * 1024);
    engine::MicroBatch mb;
    mb.input_ids = ids;
    mb.cu_seqlens = cu;
    engine::OutputRequest req;
    req.logprob = true;
    trainer->forward(mb, req);
  }

  for (const Case& c : kCases) {
    if (which != "all" && ("," + which + ",").find("," + std::string(c.name) + ",") == std::string::npos) continue;
    const int64_t seqs = c.prompts * c.samples;
    gen::Options o;
    o.max_num_seqs = seqs;
    o.max_num_batched_tokens = std::max<int64_t>(std::min<int64_t>(c.prompts * prompt, 8192), prompt);
    o.block_size = 16;
    gen::CudaExecutorOptions co;
    co.kernels = test::cuda_registry();
    co.gpu_memory_utilization = 0.9;
    co.max_num_seqs = o.max_num_seqs;
    co.max_num_batched_tokens = o.max_num_batched_tokens;
    co.cuda_graphs = graphs;
    co.batch_invariant = deterministic;
    co.fp8.enabled = fp8;
    co.fp8.blockwise = true;
    co.fp8.bf16_first_layers = co.fp8.bf16_last_layers = 0;
    co.kv_cache_fp8 = kv_fp8;
    o.executor = gen::cuda_executor(co);
    gen::Generator g(desc, o);
    g.weights().load(w, 0);

    std::vector<int32_t> ids;
    std::vector<int64_t> off = {0};
    for (int64_t p = 0; p < c.prompts; ++p) {
      for (int64_t t = 0; t < prompt; ++t) ids.push_back(int32_t(splitmix(uint64_t(p * 7919 + t)) % uint64_t(s->V)));
      off.push_back(int64_t(ids.size()));
    }
    gen::Request r;
    r.prompt_ids = ids;
    r.prompt_offsets = off;
    r.samples_per_prompt = c.samples;
    r.max_new_tokens = new_tokens;
    // GRPO samples (temperature 1); the batch cases greedy unless --sample
    r.sampling.temperature = (c.samples > 1 || sample) ? 1.0 : 0.0;
    r.seed = 1;
    std::vector<double> secs;
    int64_t tokens = 0;
    gen::Stats st;
    double in_step = 0, waiting = 0, timed = 0;  // the timed calls' executor and wait seconds, their wall
    double dev[3] = {0, 0, 0};  // RLH_GEN_STEP_EVENTS=1: the device's upload, forward and draw seconds
    int64_t dev_steps = 0;
    std::vector<Seq> last;  // the last call's sequences (--parity)
    for (int rep = 0; rep <= repeats; ++rep) {
      tokens = 0;
      r.step = rep;
      last.clear();
      const gen::CudaExecutorStats before = gen::cuda_executor_stats(g.executor());
      const auto t0 = Clock::now();
      st = g.generate(r, [&](const gen::Sample& x) {
        tokens += int64_t(x.ids.size());
        if (check_parity)
          last.push_back(Seq{x.prompt_index, std::vector<int32_t>(x.ids.begin(), x.ids.end()),
                             std::vector<float>(x.logprobs.begin(), x.logprobs.end())});
      });
      const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
      if (rep > 0) {  // the first call captures the graphs
        secs.push_back(sec);
        const gen::CudaExecutorStats after = gen::cuda_executor_stats(g.executor());
        in_step += after.step_seconds - before.step_seconds;
        waiting += after.wait_seconds - before.wait_seconds;
        timed += sec;
        dev[0] += after.dev_upload_seconds - before.dev_upload_seconds;
        dev[1] += after.dev_forward_seconds - before.dev_forward_seconds;
        dev[2] += after.dev_draw_seconds - before.dev_draw_seconds;
        dev_steps += after.timed_steps - before.timed_steps;
      }
    }
    const double t = median(secs), tok_s = double(tokens) / t;
    // Roofline at the average position of the decoding steps.
    const double pos = double(prompt) + 0.5 * double(new_tokens);
    const double kv_token = double(s->L) * 2.0 * double(s->Hkv * s->D) * (kv_fp8 ? 1.0 : 2.0);  // bytes per cached token
    // every weight but an untied embedding table (of which a step reads only its rows)
    const double read = double(s->tied ? weights : weights - embed);
    const double step_bytes = 2.0 * read + double(seqs) * pos * kv_token;
    const double t_bw = step_bytes / bw_peak;
    const double t_flops = 2.0 * read * double(seqs) / 989e12;
    const double roof = double(seqs) / std::max(t_bw, t_flops);
    const gen::CudaExecutorStats xs = gen::cuda_executor_stats(g.executor());
    std::printf("%-5s %4lld prompts x %lld samples, prompt %lld + %lld new: %8.0f tok/s (%.3f s, %lld tokens, %lld steps, "
                "%lld prefill rows, %lld prompt tokens shared); roofline %.0f tok/s (%s-bound), %.0f%% of it; KV %.1f GiB; "
                "graph steps %lld, op-by-op %lld%s%s\n",
                c.name, (long long)c.prompts, (long long)c.samples, (long long)prompt, (long long)new_tokens, tok_s, t,
                (long long)tokens, (long long)st.steps, (long long)st.prefill_tokens, (long long)st.shared_prompt_tokens,
                roof, t_bw >= t_flops ? "bandwidth" : "compute", 100.0 * tok_s / roof,
                double(xs.kv_bytes) / double(1 << 30), (long long)xs.graph_steps, (long long)xs.eager_steps,
                xs.graph_error.empty() ? "" : "; graphs off: ", xs.graph_error.c_str());
    // Where the wall time goes (the timed calls): the generator's host work between steps (the
    // device idles), the executor's host work within a step (inputs, launches), the wait for the
    // device at a step's end.
    if (timed > 0)
      std::printf("      host between steps %.0f%%, executor launching %.0f%%, waiting for the device %.0f%% of the wall time\n",
                  100.0 * (timed - in_step) / timed, 100.0 * (in_step - waiting) / timed, 100.0 * waiting / timed);
    // The device's side of the same steps (events on the stream): what is left of the wall time
    // is time the device had nothing queued.
    if (timed > 0 && dev_steps > 0) {
      const double n = double(dev_steps), busy = dev[0] + dev[1] + dev[2];
      std::printf("      device per step: uploads %.1f us, layers and head %.1f us, draw and results %.1f us; "
                  "wall per step %.1f us, idle %.0f%% of the wall time\n",
                  1e6 * dev[0] / n, 1e6 * dev[1] / n, 1e6 * dev[2] / n, 1e6 * timed / n, 100.0 * (timed - busy) / timed);
    }
    std::printf("RESULT name=%s shape=%s prompts=%lld samples=%lld prompt=%lld new=%lld tok_s=%.1f sec=%.4f "
                "roofline_tok_s=%.0f deterministic=%d graphs=%d fp8=%d fp8_products=%lld fp8_produced=%lld(%lld/%lld/%lld) fused_layers=%lld kv_fp8=%d\n",
                c.name, s->name, (long long)c.prompts, (long long)c.samples, (long long)prompt, (long long)new_tokens,
                tok_s, t, roof, deterministic ? 1 : 0, graphs ? 1 : 0, fp8 ? 1 : 0, (long long)xs.fp8_products, (long long)xs.fp8_produced, (long long)xs.fp8_produced_by[0],
                (long long)xs.fp8_produced_by[1], (long long)xs.fp8_produced_by[2],
                (long long)xs.fused_layers, kv_fp8 ? 1 : 0);
    if (trainer) parity(*trainer, last, ids, off, r.sampling.temperature, c.name);
    std::fflush(stdout);
  }
  return 0;
}
