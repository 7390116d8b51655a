// The generate loop: validate the request, queue one sequence per (prompt, sample), then step —
// schedule, run the model over the step's rows, draw a token for every sequence whose pending
// tokens are all in the cache, end the samples that stop — until every sample has ended.
#include "rlhost/generator/generator.hpp"

#include <algorithm>
#include <exception>
#include <limits>
#include <string>

#include "rlhost/generator/scheduler.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::gen {

using sdk::Error;

Generator::Generator(sdk::TransformerDesc desc, Options options) : opt_(options) {
  if (opt_.block_size < 1) throw Error(RLH_E_INVALID_ARGUMENT, "generator: block_size must be >= 1");
  if (opt_.max_num_seqs < 1) throw Error(RLH_E_INVALID_ARGUMENT, "generator: max_num_seqs must be >= 1");
  if (opt_.max_num_batched_tokens < 1)
    throw Error(RLH_E_INVALID_ARGUMENT, "generator: max_num_batched_tokens must be >= 1");
  if (opt_.kv_cache_bytes < 1) throw Error(RLH_E_INVALID_ARGUMENT, "generator: kv_cache_bytes must be > 0");
  if (opt_.max_model_len < 0) throw Error(RLH_E_INVALID_ARGUMENT, "generator: max_model_len must be >= 0");
  // Positions past max_position_embeddings are outside the model's range.
  if (desc.max_position_embeddings > 0 && opt_.max_model_len > desc.max_position_embeddings)
    throw Error(RLH_E_INVALID_ARGUMENT, "generator: max_model_len " + std::to_string(opt_.max_model_len) +
                                            " is more than the model's max_position_embeddings (" +
                                            std::to_string(desc.max_position_embeddings) + ")");
  if (opt_.ops == nullptr && !opt_.executor)
    throw Error(RLH_E_INVALID_ARGUMENT, "generator: no kernels given (Options::ops)");
  if (opt_.tp && opt_.tp->size() > 1 && opt_.executor)
    throw Error(RLH_E_UNIMPLEMENTED, "generator: policy.generation.vllm_cfg.tensor_parallel_size = " +
                                         std::to_string(opt_.tp->size()) + " runs on the host executor only (the CPU)");
  if (opt_.kv_cache_fp8 && opt_.executor)
    throw Error(RLH_E_UNIMPLEMENTED, "generator: the FP8 KV cache (kv_cache_fp8) is the host executor's; an executor "
                                     "of its own decides its cache");
  model_ = std::make_unique<DecodeModel>(std::move(desc), opt_.tp);
  model_->set_router_fp64(opt_.moe_router_fp64);
  exec_ = opt_.executor ? opt_.executor(*model_) : make_host_executor(*model_, opt_.ops, opt_.kv_cache_fp8);
}

Generator::~Generator() = default;

int64_t Generator::max_length() const {
  if (opt_.max_model_len > 0) return opt_.max_model_len;
  const int64_t m = model_->desc().max_position_embeddings;
  return m > 0 ? m : std::numeric_limits<int32_t>::max();
}

namespace {

void check_request(const Request& r, int64_t V) {
  const auto& off = r.prompt_offsets;
  if (off.empty() || off[0] != 0)
    throw Error(RLH_E_INVALID_ARGUMENT, "generate: prompt_offsets must start at 0 and hold num_prompts + 1 entries");
  if (off.back() != int64_t(r.prompt_ids.size()))
    throw Error(RLH_E_INVALID_ARGUMENT, "generate: prompt_offsets end at " + std::to_string(off.back()) + " but " +
                                            std::to_string(r.prompt_ids.size()) + " prompt ids were given");
  for (size_t p = 0; p + 1 < off.size(); ++p)
    if (off[p + 1] <= off[p])
      throw Error(RLH_E_INVALID_ARGUMENT, "generate: prompt " + std::to_string(p) + " is empty (offsets must increase)");
  for (size_t i = 0; i < r.prompt_ids.size(); ++i)
    if (r.prompt_ids[i] < 0 || r.prompt_ids[i] >= V)
      throw Error(RLH_E_INVALID_ARGUMENT, "generate: prompt token " + std::to_string(r.prompt_ids[i]) +
                                              " is outside the vocabulary of " + std::to_string(V));
  if (r.samples_per_prompt < 1) throw Error(RLH_E_INVALID_ARGUMENT, "generate: samples_per_prompt must be >= 1");
  if (r.max_new_tokens < 1) throw Error(RLH_E_INVALID_ARGUMENT, "generate: max_new_tokens must be >= 1");
  if (r.first_prompt_index < 0) throw Error(RLH_E_INVALID_ARGUMENT, "generate: first_prompt_index must be >= 0");
  for (int32_t t : r.stop_token_ids)
    if (t < 0) throw Error(RLH_E_INVALID_ARGUMENT, "generate: stop token id " + std::to_string(t) + " is negative");
  try {
    validate(r.sampling);
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("generate: ") + e.what());
  }
  if (!r.stop_strings.empty() && !r.detokenizer)
    throw Error(RLH_E_FAILED_PRECONDITION, "generate: stop strings need a tokenizer to decode the output");
}

}  // namespace

Stats Generator::generate(const Request& rq, const SampleFn& on_sample, const std::function<bool()>& cancelled) {
  const int64_t V = model_->vocab();
  check_request(rq, V);
  StopStrings stops;
  try {
    stops = StopStrings(rq.stop_strings);
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("generate: ") + e.what());
  }
  model_->require_complete();
  model_->sync_weights();  // tensor parallelism: this rank's pieces of a new set

  const KvLayout layout = model_->kv_layout(opt_.block_size, exec_->keys_transposed(), exec_->elem_bytes());
  PoolAllocator alloc = exec_->kv_allocator();
  KvCache kv(layout, exec_->kv_budget(layout, opt_.kv_cache_bytes), alloc.allocate ? alloc : kv_alloc_);
  const int64_t cache_tokens = kv.num_blocks() * opt_.block_size;
  const int64_t max_len = std::min(max_length(), cache_tokens);
  const int64_t P = int64_t(rq.prompt_offsets.size()) - 1;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t n = rq.prompt_offsets[size_t(p) + 1] - rq.prompt_offsets[size_t(p)];
    if (n >= max_len)
      throw Error(RLH_E_INVALID_ARGUMENT,
                  "generate: prompt " + std::to_string(p) + " has " + std::to_string(n) +
                      " tokens, leaving no room for a new token within " + std::to_string(max_len) +
                      (max_len == cache_tokens && cache_tokens < max_length() ? " (the KV cache budget)"
                                                                              : " (max_model_len)"));
  }

  exec_->begin_generate(max_len, opt_.block_size);
  struct End {
    StepExecutor& e;
    ~End() { e.end_generate(); }
  } end_generate{*exec_};
  Scheduler sched(SchedulerOptions{opt_.max_num_seqs, opt_.max_num_batched_tokens}, kv);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t s = 0; s < rq.samples_per_prompt; ++s) {
      auto seq = std::make_unique<Sequence>();
      seq->prompt_index = p;
      seq->sample_index = s;
      seq->key = DrawKey{rq.seed, rq.step, rq.first_prompt_index + p, s};
      seq->tokens.assign(rq.prompt_ids.begin() + rq.prompt_offsets[size_t(p)],
                         rq.prompt_ids.begin() + rq.prompt_offsets[size_t(p) + 1]);
      seq->prompt_len = seq->length();
      seq->tokens.reserve(size_t(std::min(max_len, seq->prompt_len + rq.max_new_tokens)));
      sched.add(std::move(seq));
    }

  const int64_t version = model_->weights().version();
  Stats st;
  std::vector<int32_t> ids;
  std::vector<CacheRow> rows;
  std::vector<int64_t> sample_rows;
  std::vector<Sequence*> samplers;
  while (!sched.done()) {
    if (cancelled && cancelled()) throw Error(RLH_E_CANCELLED, "generate: cancelled");
    const std::vector<StepChunk> plan = sched.schedule();
    ids.clear();
    rows.clear();
    sample_rows.clear();
    samplers.clear();
    for (const StepChunk& c : plan) {
      for (int64_t t = c.begin; t < c.begin + c.count; ++t) {
        ids.push_back(c.seq->tokens[size_t(t)]);
        rows.push_back(CacheRow{c.seq->blocks.data(), int32_t(t)});
      }
      if (c.samples) {
        sample_rows.push_back(int64_t(rows.size()) - 1);
        samplers.push_back(c.seq);
      }
    }
    const int64_t S = int64_t(samplers.size());
    // Draws: one uniform per sampling row from its key (rng.hpp), then the registry's sampler;
    // a row's token depends only on its logits and its key.
    uniforms_.assign(size_t(S), 0.0);
    tokens_.assign(size_t(S), -1);
    token_logprobs_.assign(size_t(S), 0.f);
    if (!rq.sampling.greedy())
      for (int64_t i = 0; i < S; ++i) {
        const Sequence& q = *samplers[size_t(i)];
        uniforms_[size_t(i)] = uniform01(q.key, q.generated());
      }
    StepDraws draws;
    draws.u = uniforms_;
    draws.attrs.temperature = rq.sampling.temperature;
    draws.attrs.top_k = rq.sampling.top_k > 0 ? rq.sampling.top_k : 0;
    draws.attrs.top_p = rq.sampling.top_p;
    draws.attrs.min_p = rq.sampling.min_p;
    draws.attrs.softcap = model_->program().logit_softcap;  // Gemma-2: the logits are capped first
    draws.tokens = tokens_;
    draws.logprobs = token_logprobs_;
    step_rows_.build(ids, rows, sample_rows, opt_.block_size);
    exec_->step(step_rows_, kv, draws);
    sched.computed(plan);
    ++st.steps;
    st.sampled_tokens += S;
    st.prefill_tokens += int64_t(rows.size()) - S;

    for (int64_t i = 0; i < S; ++i) {
      Sequence* q = samplers[size_t(i)];
      const int32_t tok = tokens_[size_t(i)];
      if (tok < 0 || tok >= V) throw Error(RLH_E_INTERNAL, "generate: the sampler returned token " + std::to_string(tok));
      q->tokens.push_back(tok);
      q->logprobs.push_back(token_logprobs_[size_t(i)]);
      const std::span<const int32_t> gen(q->tokens.data() + q->prompt_len, size_t(q->generated()));
      bool stop = std::find(rq.stop_token_ids.begin(), rq.stop_token_ids.end(), tok) != rq.stop_token_ids.end();
      if (!stop && !stops.empty()) stop = stops.matches(gen, *rq.detokenizer);
      const bool limit = q->generated() >= rq.max_new_tokens || q->length() >= max_len;
      if (!stop && !limit) continue;
      std::unique_ptr<Sequence> done = sched.finish(q);
      Sample out;
      out.prompt_index = done->prompt_index;
      out.sample_index = done->sample_index;
      out.ids = std::span<const int32_t>(done->tokens.data() + done->prompt_len, size_t(done->generated()));
      out.logprobs = done->logprobs;
      out.truncated = !stop;
      out.weight_version = version;
      on_sample(out);
    }
  }
  st.preemptions = sched.preemptions();
  st.shared_prompt_tokens = sched.shared_tokens();
  st.kv_blocks = kv.num_blocks();
  st.kv_blocks_peak = kv.peak_used();
  st.max_running = sched.max_running();
  return st;
}

}  // namespace rlh::gen
