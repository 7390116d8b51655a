// bench_cuda_engine: training-step and forward-logprob throughput of the engine's GPU path
// (rlh_engine_cuda: bf16 compute, fp32 master weights, AdamW) at the shapes, for
// comparison with PyTorch on the same GPU (bench_torch.py; run.sh runs both). Prints one
// "RESULT key=value ..." line per measurement for run.sh to parse.
//
//   bench_cuda_engine [--shape llama1b|small|qwen3moe|moesmall] [--steps N] [--warmup N] [--only train|forward]
//                     [--recompute none|selective|full] [--head-chunk-mib M] [--fp8 none|tensorwise|blockwise|delayed]
//                     [--curve N] [--micro N] [--loss host|device]
//
// llama1b: Llama-3.2-1B's shape (vocab 128256, d 2048, 16 layers, 32/8 heads of 64, ffn 8192,
// tied), training B4 x T2048, forward logprobs B8 x T2048. small: a quick check of the same code.
// qwen3moe: a Qwen3-MoE shape (vocab 32000, d 1024, 12 layers, 16/4 heads of 64 with q/k norms,
// 64 experts top-8 of width 512 in every layer, untied), same batches; moesmall: its quick check.
// llama3b: Llama-3.2-3B's shape (vocab 128256, d 3072, 28 layers, 24/8 heads of 128, ffn 8192,
// tied), training B2 x T2048 (the FP8 issue's end-to-end shape).
// --fp8: the training step's dense linears in FP8 (CudaEngineOptions::fp8: the registry's FP8
// provider, e.g. examples/vendor_fp8 on the plugin path; first and last layers in bf16). Rows are
// named train_fp8_<recipe>, beside the bf16 train row of the same run when run.sh asks for both.
// --micro N: a training step of N micro-batches (the batch N times, gradients accumulated, one
// AdamW update), as RL trainers run it (NeMo-RL's GRPO: 512 sequences a step in micro-batches of
// a few): the per-step costs (AdamW, the FP8 weight copies) are then shared by N micro-batches.
// tok/s counts all N; rows are named train[_fp8_<recipe>]_mb<N>.
// --loss device: the training step's loss on the device (train_step's DeviceLoss: the registry's
// nll_loss op, one host wait a step, as the GRPO loop runs it and as torch.compile's peer has its
// loss inside the graph) instead of the host callback (a host wait a micro-batch more); rows are
// named ..._devloss.
// --curve N: instead of timing, N training steps on a fixed learnable stream (each sequence an
// arithmetic progression of token ids, new batches every step) printing the mean loss of the
// last 10 steps: FP8 against bf16 on the same data (`RESULT name=curve_<fp8> ...`).
// MoE FLOPs count the active parameters: the router, and K of the E experts per token.
// FLOPs per token: 6 * matmul params (the tied head counted once) + causal attention
// 6 * L * T * H * D (forward 2 * T/2 * H * D * 2, backward twice that); MFU against the H200's
// dense bf16 989 TFLOP/s.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "device_nll_loss.hpp"
#include "kernels_cuda_abi.hpp"
#include "nll_loss.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using Clock = std::chrono::steady_clock;

namespace {

struct Shape {
  const char* name;
  int64_t V, C, L, Hq, Hkv, D, F;
  bool tied;
  int64_t train_B, fwd_B, T;
  int64_t E = 0, K = 0, Fe = 0;  // MoE (Qwen3-MoE): experts, top-k, expert width; 0 = dense
};
const Shape kShapes[] = {{"llama1b", 128256, 2048, 16, 32, 8, 64, 8192, true, 4, 8, 2048},
                         {"llama3b", 128256, 3072, 28, 24, 8, 128, 8192, true, 2, 4, 2048},
                         {"small", 32000, 1024, 4, 16, 4, 64, 4096, true, 2, 4, 1024},
                         {"qwen3moe", 32000, 1024, 12, 16, 4, 64, 3072, false, 4, 8, 2048, 64, 8, 512},
                         {"moesmall", 32000, 512, 2, 8, 4, 64, 1536, false, 2, 4, 1024, 16, 4, 256}};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  std::string shape_name = "llama1b", only, recompute = "none", fp8 = "none", loss_at = "host";
  int steps = 10, warmup = 2, curve = 0, micro = 1;
  int64_t head_chunk_mib = 0;  // the logprob head's logits tile (0 = the kernel's default)
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
    else if (a == "--only") only = next();
    else if (a == "--recompute") recompute = next();
    else if (a == "--head-chunk-mib") head_chunk_mib = std::atoll(next());
    else if (a == "--fp8") fp8 = next();
    else if (a == "--curve") curve = std::atoi(next());
    else if (a == "--micro") micro = std::atoi(next());
    else if (a == "--loss") loss_at = next();
    else {
      std::fprintf(stderr,
                   "usage: %s [--shape llama1b|small|qwen3moe|moesmall] [--steps N] [--warmup N] [--only train|forward] "
                   "[--recompute none|selective|full] [--head-chunk-mib M] [--fp8 none|tensorwise|blockwise|delayed] [--curve N] [--micro N] "
                   "[--loss host|device]\n",
                   argv[0]);
      return 2;
    }
  }
  const Shape* s = nullptr;
  for (const Shape& x : kShapes)
    if (shape_name == x.name) s = &x;
  if (loss_at != "host" && loss_at != "device") {
    std::fprintf(stderr, "bench_cuda_engine: --loss expects host or device, got '%s'\n", loss_at.c_str());
    return 2;
  }
  if (!s || steps < 1 || warmup < 0 || micro < 1) {
    std::fprintf(stderr, "bench_cuda_engine: unknown shape '%s' or bad step counts\n", shape_name.c_str());
    return 2;
  }
  if (fp8 != "none" && fp8 != "tensorwise" && fp8 != "blockwise" && fp8 != "delayed") {
    std::fprintf(stderr, "bench_cuda_engine: --fp8 expects none, tensorwise, blockwise or delayed, got '%s'\n",
                 fp8.c_str());
    return 2;
  }
  engine::Fp8Options fp8o;
  fp8o.enabled = fp8 != "none";
  fp8o.blockwise = fp8 == "blockwise";
  fp8o.delayed = fp8 == "delayed";  // Megatron's defaults: history 1, most_recent, margin 0
  engine::Recompute rc = engine::Recompute::none;
  if (recompute == "selective") rc = engine::Recompute::selective;
  else if (recompute == "full") rc = engine::Recompute::full;
  else if (recompute != "none") {
    std::fprintf(stderr, "bench_cuda_engine: --recompute expects none, selective or full, got '%s'\n",
                 recompute.c_str());
    return 2;
  }
  std::string why;
  if (!engine::cuda_engine_available(&why)) {
    std::fprintf(stderr, "bench_cuda_engine: %s\n", why.c_str());
    return 1;
  }
  nlohmann::json cfg = {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", s->V},
                        {"hidden_size", s->C}, {"intermediate_size", s->F},
                        {"num_hidden_layers", s->L}, {"num_attention_heads", s->Hq},
                        {"num_key_value_heads", s->Hkv}, {"head_dim", s->D},
                        {"max_position_embeddings", 131072}, {"rms_norm_eps", 1e-5},
                        {"rope_theta", 500000.0}, {"tie_word_embeddings", s->tied},
                        {"torch_dtype", "bfloat16"}};
  if (s->E > 0) {  // Qwen3-MoE: every layer routed (decoder_sparse_step 1), q/k norms
    cfg["architectures"] = {"Qwen3MoeForCausalLM"};
    cfg["model_type"] = "qwen3_moe";
    cfg["num_experts"] = s->E;
    cfg["num_experts_per_tok"] = s->K;
    cfg["moe_intermediate_size"] = s->Fe;
    cfg["norm_topk_prob"] = true;
    cfg["decoder_sparse_step"] = 1;
    cfg["mlp_only_layers"] = nlohmann::json::array();
    cfg["rms_norm_eps"] = 1e-6;
    cfg["rope_theta"] = 1000000.0;
  }
  const sdk::TransformerDesc desc = model::describe(cfg);
  // Random weights (a fixed LCG; norms at 1), small enough that the logits stay moderate.
  std::vector<std::vector<float>> w;
  uint32_t x = 12345;
  int64_t matmul_params = 0;
  for (const auto& p : desc.params) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    // the embedding is a matmul only as the tied head; a token passes through K of the E
    // experts, so routed experts count K / E of their parameters (the active parameters)
    const bool expert = p.role == sdk::ParamRole::expert_gate || p.role == sdk::ParamRole::expert_up ||
                        p.role == sdk::ParamRole::expert_down;
    if (expert) matmul_params += n / s->E * s->K;
    else if (p.shape.size() == 2 && (p.role != sdk::ParamRole::embed || s->tied)) matmul_params += n;
    std::vector<float> t(static_cast<size_t>(n));
    const bool vec = p.shape.size() == 1;
    for (float& v : t) {
      x = x * 1664525u + 1013904223u;
      v = vec ? 1.0f : 0.04f * (float(x >> 8) * (1.0f / 16777216.0f) - 0.5f);
    }
    w.push_back(std::move(t));
  }
  const double attn = 6.0 * double(s->L) * double(s->T) * double(s->Hq * s->D);
  const double train_flops = 6.0 * double(matmul_params) + attn;
  const double fwd_flops = 2.0 * double(matmul_params) + attn / 3.0;
  const double peak = 989e12;
  // The kernels: every provider on the plugin path that runs on cuda:0, as a backend builds them.
  if (test::cuda_registry() == nullptr) {
    std::fprintf(stderr, "bench_cuda_engine: no kernel provider runs on cuda:0 (is kernels_cuda in %s?)\n",
                 RLH_PLUGIN_DIR);
    return 1;
  }

  auto batch = [&](int64_t B, std::vector<int32_t>& ids, std::vector<int32_t>& cu) {
    ids.resize(size_t(B * s->T));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((int64_t(i) * 7919 + 13) % s->V);
    cu.clear();
    for (int64_t b = 0; b <= B; ++b) cu.push_back(int32_t(b * s->T));
    engine::MicroBatch mb;
    mb.input_ids = ids;
    mb.cu_seqlens = cu;
    return mb;
  };

  const auto loss = test::nll_loss;
  if (curve > 0) {
    // A learnable stream: sequence b of step i counts from a start by a stride (mod V), both
    // drawn from (i, b), so the model learns the rule, not a batch.
    engine::CudaEngineOptions o = test::cuda_options();
    o.optimizer.weight_decay = 0.0;
    o.optimizer.max_grad_norm = 1.0;
    o.fp8 = fp8o;
    engine::CudaEngine e(desc, o);
    e.load_parameters(w);
    std::vector<int32_t> ids(size_t(s->train_B * s->T)), cu;
    for (int64_t b = 0; b <= s->train_B; ++b) cu.push_back(int32_t(b * s->T));
    std::vector<double> last;
    const int64_t vocab = std::min<int64_t>(s->V, 4096);
    for (int i = 0; i < curve; ++i) {
      for (int64_t b = 0; b < s->train_B; ++b) {
        uint64_t h = uint64_t(i) * 1000003u + uint64_t(b) * 7919u + 17u;
        h ^= h >> 13;
        h *= 0x9E3779B97F4A7C15ull;
        const int64_t start = int64_t(h % uint64_t(vocab)), stride = 1 + int64_t((h >> 20) % 7);
        for (int64_t t = 0; t < s->T; ++t) ids[size_t(b * s->T + t)] = int32_t((start + stride * t) % vocab);
      }
      engine::MicroBatch mb;
      mb.input_ids = ids;
      mb.cu_seqlens = cu;
      engine::StepOptions so;
      so.lr = 3e-4;
      so.global_tokens = s->train_B * (s->T - 1);
      const double l = e.train_step({&mb, 1}, so, loss).loss;
      if (i == 0 || (i + 1) % 25 == 0) std::printf("curve %s step %d loss %.5f\n", fp8.c_str(), i + 1, l);
      if (i >= curve - 10) last.push_back(l);
    }
    double mean = 0;
    for (double l : last) mean += l / double(last.size());
    const auto st = e.stats();
    std::printf("RESULT name=curve_%s shape=%s_B%ldxT%ld value=%.6f unit=loss steps=%d fp8_gemms=%ld bf16_in_fp8_layers=%ld\n",
                fp8.c_str(), s->name, long(s->train_B), long(s->T), mean, curve, long(st.fp8_gemms),
                long(st.fp8_layer_bf16_gemms));
    return 0;
  }

  if (only.empty() || only == "train") {
    engine::CudaEngineOptions o = test::cuda_options();
    o.optimizer.weight_decay = 0.01;
    o.optimizer.max_grad_norm = 1.0;
    o.recompute = rc;
    o.logprob_chunk_bytes = head_chunk_mib << 20;
    o.fp8 = fp8o;
    engine::CudaEngine e(desc, o);
    std::printf("device: %s, shape %s: %.1f M (active) matmul params\n", e.device_name().c_str(), s->name,
                matmul_params / 1e6);
    e.load_parameters(w);
    std::vector<int32_t> ids, cu;
    const engine::MicroBatch mb = batch(s->train_B, ids, cu);
    const std::vector<engine::MicroBatch> mbs(size_t(micro), mb);
    engine::StepOptions so;
    so.lr = 1e-5;
    so.global_tokens = micro * s->train_B * (s->T - 1);
    std::unique_ptr<test::DeviceNll> dev_loss;
    if (loss_at == "device") dev_loss = std::make_unique<test::DeviceNll>(mbs, so.global_tokens);
    auto step = [&]() {
      if (!dev_loss) return e.train_step(mbs, so, loss).loss;
      e.train_step(mbs, so, dev_loss->loss());
      return dev_loss->last_loss();
    };
    for (int i = 0; i < warmup; ++i) step();
    const auto before = e.stats();
    std::vector<double> times;
    double last = 0;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = Clock::now();
      last = step();  // returns after the update is queued
      times.push_back(seconds_since(t0));
    }
    const auto after = e.stats();
    // The step returns once AdamW is queued; the next step's first wait covers it, so the
    // median of the per-step times is the steady-state rate (the last step's tail is small).
    const double t = median(times), tps = double(micro * mb.num_tokens()) / t;
    if (micro > 1) std::printf("(%d micro-batches a step)\n", micro);
    std::printf("train (recompute %s): median %.1f ms/step, %.0f tok/s, %.0f TFLOP/s (MFU %.1f%%), "
                "loss %.4f, %.2f device allocs/step, %.2f host waits/step, %.1f GiB held\n",
                recompute.c_str(), t * 1e3, tps, tps * train_flops / 1e12, 100 * tps * train_flops / peak, last,
                double(after.device_allocations - before.device_allocations) / steps,
                double(after.host_syncs - before.host_syncs) / steps,
                double(after.device_bytes) / double(1ull << 30));
    if (fp8o.enabled)
      std::printf("fp8 (%s): %ld products in FP8, %ld in bf16 in the FP8 layers (shapes FP8 cannot take)\n",
                  fp8.c_str(), long(after.fp8_gemms), long(after.fp8_layer_bf16_gemms));
    // Recompute rows are named apart: PyTorch's peer runs without checkpointing.
    const std::string row = (fp8o.enabled ? "train_fp8_" + fp8
                             : rc == engine::Recompute::none ? std::string("train")
                                                             : "train_recompute_" + recompute) +
                            (micro > 1 ? "_mb" + std::to_string(micro) : "") + (dev_loss ? "_devloss" : "");
    std::printf("RESULT name=%s shape=%s_B%ldxT%ld value=%.0f unit=tok/s ms=%.3f mfu=%.4f allocs=%.2f "
                "syncs=%.2f gib=%.2f\n",
                row.c_str(), s->name,
                long(s->train_B), long(s->T), tps, t * 1e3, tps * train_flops / peak,
                double(after.device_allocations - before.device_allocations) / steps,
                double(after.host_syncs - before.host_syncs) / steps,
                double(after.device_bytes) / double(1ull << 30));
  }
  if (only.empty() || only == "forward") {
    engine::CudaEngineOptions o = test::cuda_options();
    o.logprob_chunk_bytes = head_chunk_mib << 20;
    engine::CudaEngine e(desc, o);
    e.load_parameters(w);
    std::vector<int32_t> ids, cu;
    const engine::MicroBatch mb = batch(s->fwd_B, ids, cu);
    engine::OutputRequest req;
    for (int i = 0; i < warmup; ++i) e.forward(mb, req);
    std::vector<double> times;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = Clock::now();
      e.forward(mb, req);  // returns with the logprobs on the host
      times.push_back(seconds_since(t0));
    }
    const double t = median(times), tps = double(mb.num_tokens()) / t;
    std::printf("forward logprobs: median %.1f ms, %.0f tok/s, %.0f TFLOP/s (MFU %.1f%%)\n", t * 1e3,
                tps, tps * fwd_flops / 1e12, 100 * tps * fwd_flops / peak);
    std::printf("RESULT name=forward shape=%s_B%ldxT%ld value=%.0f unit=tok/s ms=%.3f mfu=%.4f\n",
                s->name, long(s->fwd_B), long(s->T), tps, t * 1e3, tps * fwd_flops / peak);
  }
  std::printf("kernels: %s\n", test::cuda_registry()->choices_summary().c_str());
  return 0;
}
