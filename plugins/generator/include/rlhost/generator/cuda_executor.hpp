// The generator on a CUDA device: the same DecodeModel, scheduler and layer-program interpreter
// (program_runner.hpp) as on the host, with the step's values in device memory and every op the
// device's kernel registry's (kernels_cuda, or a vendor's provider) through the CUDA engine's
// DeviceOps. Built where the CUDA toolchain is (rlh_generator_cuda); this header needs no CUDA.
//
// What lives on the device (cuda_executor.cpp says why each):
//   weights     bf16, one arena laid out as the host's (q|k|v and gate|up adjacent: one product
//               each), refreshed from the host weights whenever a new set is in force; the
//               router's and the selection biases also in f32
//   activations bf16, planned once for max_num_batched_tokens rows
//   KV cache    bf16 paged blocks, keys row-major, sized by gpu_memory_utilization (or
//               kv_cache_bytes), allocated at the first generate() and kept (with
//               kv_cache_sleep: its memory given back between calls, its addresses kept)
//   logits      fp32 [sampling rows, V]; the draw is the registry's `sample` op on the device
// A decoding step (every row one token that samples) runs as a CUDA graph captured for its
// padded batch bucket; other steps (prefill chunks) run op by op.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "rlhost/engine/engine.hpp"
#include "rlhost/generator/model.hpp"

namespace rlh::sdk {
class KernelRegistry;
}

namespace rlh::gen {

struct CudaExecutorOptions {
  const sdk::KernelRegistry* kernels = nullptr;  // a registry for cuda:device (required; not owned)
  int device = 0;
  // KV cache: kv_cache_bytes > 0 is the budget; otherwise the pool takes what is left of
  // gpu_memory_utilization x the device's memory after everything this process (and, colocated,
  // the trainer) holds when the first generate() starts (vLLM's rule).
  double gpu_memory_utilization = 0.9;
  int64_t kv_cache_bytes = 0;
  // Sleep mode for the KV cache (native_cfg.kv_cache_sleep): after each generate() the pool's
  // physical memory goes back to the device (a colocated trainer's steps can use it) and the
  // next generate() maps it again at the same addresses (the captured graphs stay valid).
  bool kv_cache_sleep = false;
  // FP8 rollouts (policy.generation.vllm_cfg.precision: fp8): the dense linears of the layers
  // not kept in bf16 (bf16_first_layers / bf16_last_layers: vllm_cfg.num_first_layers_in_bf16,
  // num_last_layers_in_bf16) as blockwise FP8 products through the registry (a vendor's FP8
  // provider, examples/vendor_fp8), their weights quantised once per weight set.
  engine::Fp8Options fp8;
  // The KV cache in FP8 e4m3 with scale 1 (vllm_cfg.kv_cache_dtype fp8; docs/generator.md):
  // half the bf16 cache's bytes, read by kernels_cuda's tensor-core paged attention (head dims
  // 64 and 128), written by its cache write. Layers take the ops the fused decoding layer fuses.
  bool kv_cache_fp8 = false;
  // Scratch is planned for these (the generator's Options).
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  // Decoding steps as CUDA graphs over padded batch buckets (powers of two up to max_num_seqs).
  bool cuda_graphs = true;
  // Deterministic mode: the products resolved with batch_invariant = 1, so a sequence's tokens do
  // not depend on the others in its step (preemption and batching change nothing, as on the host).
  bool batch_invariant = false;
  // Logs one line (the graphs captured, a fallback to op-by-op steps).
  std::function<void(const std::string&)> log;
};

// True when the generator can run on cuda:device (a CUDA build, the device visible, Hopper);
// otherwise false with the reason in *why.
bool cuda_generator_available(std::string* why, int device = 0);
// The CUDA devices this process sees (0 without a driver or device).
int cuda_device_count();

// The executor factory for Options::executor. Throws sdk::Error when the model needs what the
// device path does not execute (RoPE whose frequencies depend on the sequence length, the MoE
// router in float64) or the device is unusable.
std::function<std::unique_ptr<StepExecutor>(DecodeModel&)> cuda_executor(CudaExecutorOptions options);

// What one CUDA executor has done so far, for tests and the benchmark.
struct CudaExecutorStats {
  int64_t graphs_captured = 0;   // buckets captured so far
  int64_t graph_steps = 0;       // steps run by launching a graph
  int64_t eager_steps = 0;       // steps run op by op
  int64_t kv_bytes = 0;          // the pool
  int64_t kv_sleeps = 0;         // kv_cache_sleep: times the pool's memory was given back
  double kv_wake_seconds = 0;    // and the time spent taking it again (map and clear)
  int64_t fp8_products = 0;      // FP8 rollouts: the products per step that run in FP8
  int64_t fp8_weight_only_rows = 0;  // and the most rows a step runs them weight-only (0: never)
  // and the most rows a step's products quantise an input no producer wrote themselves (0: never)
  int64_t fp8_in_product_rows = 0;
  int64_t fp8_produced = 0;      // and the most of a step's inputs whose codes their producer wrote,
  int64_t fp8_produced_by[3] = {0, 0, 0};  // by producer: RMSNorm, add + RMSNorm, SwiGLU
  int64_t fused_layers = 0;      // layers a one-row step runs as one decode_layer_fwd each (0: none did)
  int64_t weight_bytes = 0;      // the bf16 arena
  int64_t weight_uploads = 0;    // weight sets made current on the device
  int64_t device_pieces = 0;     // refit pieces that came in device memory (no host copy)
  // Host wall time inside step() (inputs, launches, the wait, the results) and, of it, the wait
  // for the device at the step's end: wall time outside step() is the generator's own host work
  // (scheduling, draws, stop checks), during which the device idles.
  double step_seconds = 0, wait_seconds = 0;
  // With RLH_GEN_STEP_EVENTS=1 (a diagnostic: four events a step), the device's own time for the
  // steps' phases, from events recorded on the stream: the inputs' uploads (from an event
  // recorded on the idle stream before the host packs them, so the packing is in it), the layers
  // and head (the graph or the ops, with the launch's latency), the draw and the results'
  // download. The wall time not in their sum is time the device had nothing queued: the host's
  // work between steps and the wake-up after the wait.
  int64_t timed_steps = 0;
  double dev_upload_seconds = 0, dev_forward_seconds = 0, dev_draw_seconds = 0;
  std::string graph_error;       // why graphs were turned off, if they were
};
// The stats of an executor made by cuda_executor() (zeros for any other).
CudaExecutorStats cuda_executor_stats(const StepExecutor& e);

}  // namespace rlh::gen
