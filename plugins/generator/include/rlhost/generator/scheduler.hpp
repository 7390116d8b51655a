// Continuous batching over the paged KV cache (vLLM V1's scheduler, reduced to what a CPU
// generator needs).
//
// Every step has a token budget (max_num_batched_tokens). Running sequences are served first,
// oldest admission first: each gets its pending tokens — one for a decoding sequence (the token
// it sampled last step), up to the rest of the budget for one still prefilling, so a long prompt
// is prefilled in chunks across steps while the others keep decoding. Then waiting sequences are
// admitted, first come first served, while the budget, max_num_seqs and the free blocks allow; a
// finished sequence frees its slot and blocks for the next prompt at once.
//
// Prefix sharing (vLLM's parallel sampling): the samples of one prompt share the cache blocks that
// hold only prompt tokens. A sample admitted while a sibling has already computed those blocks
// takes references to them and prefills only the rest of the prompt (less than a block plus the
// last token); a sample whose sibling is still prefilling them waits for that step instead of
// recomputing them. The shared keys and values are exactly what the sample would have computed
// (rows are batch-invariant), so sharing changes no result, only the work and memory.
//
// When a running sequence needs a block and none is free, the most recently admitted running
// sequence is preempted: its blocks are freed and it goes back to the front of the queue with its
// tokens so far, to be prefilled again (vLLM's recompute preemption). Nothing is lost: the
// model's rows are batch-invariant (linear.hpp) and the random draws are keyed by token index
// (rng.hpp), so the recomputed cache and the tokens that follow are exactly those of an
// uninterrupted run.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "rlhost/generator/kv_cache.hpp"
#include "rlhost/generator/rng.hpp"

namespace rlh::gen {

struct Sequence {
  int64_t prompt_index = 0;  // local index in the generate call
  int64_t sample_index = 0;
  DrawKey key;               // RNG key (global prompt index)
  std::vector<int32_t> tokens;  // prompt, then generated tokens
  int64_t prompt_len = 0;
  int64_t num_computed = 0;     // leading tokens whose keys/values are in the cache
  std::vector<int32_t> blocks;  // block table
  std::vector<float> logprobs;  // one per generated token
  int64_t admitted = -1;        // admission counter (preemption picks the largest)
  int64_t preemptions = 0;

  int64_t length() const { return int64_t(tokens.size()); }
  int64_t generated() const { return length() - prompt_len; }
};

struct SchedulerOptions {
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
};

// What one step runs: tokens [begin, begin + count) of each chunk's sequence. `samples`: the
// chunk reaches the sequence's last token, so its last row's logits draw the next token.
struct StepChunk {
  Sequence* seq = nullptr;
  int64_t begin = 0, count = 0;
  bool samples = false;
};

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, KvCache& kv);
  ~Scheduler();

  // Queues a sequence (FIFO). The scheduler owns it until finish().
  void add(std::unique_ptr<Sequence> seq);
  bool done() const { return waiting_.empty() && running_.empty(); }

  // Plans the next step and allocates the blocks it writes; may preempt. Throws sdk::Error
  // (RLH_E_RESOURCE_EXHAUSTED) when nothing can run, i.e. one sequence alone outgrows the cache.
  std::vector<StepChunk> schedule();

  // Marks the chunks of a step as computed (their keys/values are in the cache now).
  void computed(const std::vector<StepChunk>& chunks);

  // Removes a finished sequence and frees its blocks; returns ownership to the caller.
  std::unique_ptr<Sequence> finish(Sequence* seq);

  int64_t preemptions() const { return preemptions_; }
  int64_t shared_tokens() const { return shared_tokens_; }  // prompt tokens not recomputed
  int64_t running() const { return int64_t(running_.size()); }
  int64_t max_running() const { return max_running_; }

 private:
  bool grow(Sequence& s, int64_t tokens);  // blocks for `tokens` leading tokens; false if none
  void preempt(size_t running_index);
  // Prompt tokens of `s` that live in blocks holding nothing else (whole blocks, and never the
  // last prompt token, whose logits the sample needs).
  int64_t shareable(const Sequence& s) const;
  // For a sequence about to be admitted: true when it should wait for a sibling's prefill;
  // otherwise takes the sibling's shareable blocks if one has them computed.
  bool wait_or_share(Sequence& s);

  SchedulerOptions opt_;
  KvCache& kv_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order
  int64_t admissions_ = 0, preemptions_ = 0, max_running_ = 0, shared_tokens_ = 0;
};

}  // namespace rlh::gen
