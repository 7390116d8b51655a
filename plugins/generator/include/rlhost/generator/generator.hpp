// The native generator: batched autoregressive decoding on the CPU for the Llama family (dense,
// MoE, DeepSeek's MLA), sharing the trainer's description, kernels and (through refit views)
// weights.
//
//   gen::Generator g(desc, options);
//   g.weights().load(tensors, /*version=*/0);          // or update_weights(...) by HF name
//   gen::Request r;  r.prompt_ids = ...; r.prompt_offsets = ...; r.sampling.temperature = 0.8;
//   g.generate(r, [](const gen::Sample& s) { ... });   // once per finished sample, any order
//
// Pieces: the model step (model.hpp) over a paged KV cache (kv_cache.hpp) driven by continuous
// batching with chunked prefill and preemption (scheduler.hpp); sampling and processed logprobs
// as vLLM/NeMo-RL define them (sampling.hpp) with counter-based draws (rng.hpp); stop token ids,
// stop strings (stop_strings.hpp), max_new_tokens and the context limit end a sample.
//
// Guarantee: a sample is a function of (weights, prompt, sampling parameters, seed, step, global
// prompt index, sample index) only — not of the batch it ran in, the order of the prompts, how
// they were split into calls or ranks, the scheduler's limits or the cache budget (as long as the
// budget does not cut the context, see Options::kv_cache_bytes), bitwise.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rlhost/generator/model.hpp"
#include "rlhost/generator/sampling.hpp"
#include "rlhost/generator/stop_strings.hpp"

namespace rlh::gen {

struct Options {
  int64_t max_num_seqs = 64;              // sequences decoding at once (batch slots)
  int64_t max_num_batched_tokens = 512;   // tokens per step: decode rows + prefill chunks
  int64_t block_size = 16;                // tokens per KV block
  // KV cache budget. The pool lives for one generate() call and only the blocks in use are
  // resident. A sequence never grows beyond what the whole budget holds: it ends there,
  // truncated, like at max_model_len.
  int64_t kv_cache_bytes = int64_t(512) << 20;
  // The cache's keys and values in FP8 e4m3 with scale 1 (vLLM's kv_cache_dtype fp8 without
  // calibrated scales; NeMo-RL's policy.generation.vllm_cfg.kv_cache_dtype): a quarter of the
  // float32 cache's bytes, each key and value rounded to 3 mantissa bits. The host executor
  // (`ops`) only; an `executor` decides its own cache.
  bool kv_cache_fp8 = false;
  int64_t max_model_len = 0;              // prompt + new tokens; 0 = max_position_embeddings
  // MoE router in float64, as the trainer's MoeOptions::router_fp64 (NeMo-RL's
  // moe_router_dtype: fp64): set it as the trainer is set so both route alike.
  bool moe_router_fp64 = false;
  // The kernels of the host executor (not owned): engine::make_registry_ops over the CPU's
  // providers. Required unless `executor` is given.
  engine::Ops* ops = nullptr;
  // Another executor (a CUDA device's: make_cuda_executor), made for the generator's model.
  std::function<std::unique_ptr<StepExecutor>(DecodeModel&)> executor;
  // Tensor parallelism (not owned; nullptr or one rank: none): the group this generator is
  // spread over. Every rank of it makes the same calls; each holds its heads, widths and
  // vocabulary rows (DecodeModel), and all draw the same tokens. The host executor only.
  TpGroup* tp = nullptr;
};

struct Request {
  std::span<const int32_t> prompt_ids;      // all prompts concatenated
  std::span<const int64_t> prompt_offsets;  // [num_prompts + 1], from 0
  int64_t samples_per_prompt = 1;
  int64_t first_prompt_index = 0;           // global index of prompt 0: the RNG key across ranks
  SamplingParams sampling;
  int64_t max_new_tokens = 16;
  uint64_t seed = 0;
  int64_t step = 0;
  std::vector<int32_t> stop_token_ids;      // the stop token stays in the output (vLLM's rule)
  std::vector<std::string> stop_strings;    // needs `detokenizer`
  const Detokenizer* detokenizer = nullptr;
};

struct Sample {
  int64_t prompt_index = 0;  // local: index into the request's prompts
  int64_t sample_index = 0;
  std::span<const int32_t> ids;       // new tokens
  std::span<const float> logprobs;    // processed logprob of each new token
  bool truncated = false;             // ended at max_new_tokens / the context limit, no stop
  int64_t weight_version = 0;
};

struct Stats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;   // rows that did not sample (prompt chunks, recomputation)
  int64_t sampled_tokens = 0;   // rows that sampled a token
  int64_t preemptions = 0;
  int64_t shared_prompt_tokens = 0;  // prompt tokens a sample took from a sibling's cache blocks
  int64_t kv_blocks = 0, kv_blocks_peak = 0;
  int64_t max_running = 0;
};

class Generator {
 public:
  // Throws sdk::Error(RLH_E_UNIMPLEMENTED) for descriptions it does not execute (model.hpp).
  Generator(sdk::TransformerDesc desc, Options options = {});
  ~Generator();

  const sdk::TransformerDesc& desc() const { return model_->desc(); }
  const Options& options() const { return opt_; }
  // Where whole weights are loaded and refit (under tensor parallelism the whole set, sliced
  // into this rank's pieces when a generate call begins).
  Weights& weights() { return model_->input_weights(); }
  DecodeModel& model() { return *model_; }

  // The longest sequence (prompt + new tokens) this generator produces (the KV budget may cut
  // it further).
  int64_t max_length() const;
  // Where the host KV pool's memory comes from (default: the heap; a device executor has its own).
  void set_kv_allocator(PoolAllocator alloc) { kv_alloc_ = std::move(alloc); }
  StepExecutor& executor() { return *exec_; }

  using SampleFn = std::function<void(const Sample&)>;
  // Generates every (prompt, sample) pair and calls `on_sample` as each one finishes. Stops
  // with sdk::Error(RLH_E_CANCELLED) when `cancelled` returns true (polled once per step).
  // Exceptions from on_sample propagate. Externally synchronised.
  Stats generate(const Request& request, const SampleFn& on_sample,
                 const std::function<bool()>& cancelled = {});

 private:
  Options opt_;
  std::unique_ptr<DecodeModel> model_;
  std::unique_ptr<StepExecutor> exec_;
  PoolAllocator kv_alloc_ = PoolAllocator::aligned_heap();
  StepRows step_rows_;
  std::vector<double> uniforms_;  // per sampling row: its draw (rng.hpp)
  std::vector<int32_t> tokens_;
  std::vector<float> token_logprobs_;
};

}  // namespace rlh::gen
