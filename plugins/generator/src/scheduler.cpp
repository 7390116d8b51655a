// Continuous batching with chunked prefill and recompute preemption (policy in scheduler.hpp).
#include "rlhost/generator/scheduler.hpp"

#include <algorithm>
#include <string>

#include "rlhost/sdk/status.hpp"

namespace rlh::gen {

Scheduler::Scheduler(SchedulerOptions options, KvCache& kv) : opt_(options), kv_(kv) {
  if (opt_.max_num_seqs < 1) throw sdk::Error(RLH_E_INVALID_ARGUMENT, "generator: max_num_seqs must be >= 1");
  if (opt_.max_num_batched_tokens < 1)
    throw sdk::Error(RLH_E_INVALID_ARGUMENT, "generator: max_num_batched_tokens must be >= 1");
}

Scheduler::~Scheduler() {
  for (auto& s : running_)
    for (int32_t b : s->blocks) kv_.release(b);
}

void Scheduler::add(std::unique_ptr<Sequence> seq) { waiting_.push_back(std::move(seq)); }

bool Scheduler::grow(Sequence& s, int64_t tokens) {
  const int64_t bs = kv_.layout().block_size;
  const int64_t need = (tokens + bs - 1) / bs - int64_t(s.blocks.size());
  if (need <= 0) return true;
  if (need > kv_.num_free()) return false;
  for (int64_t i = 0; i < need; ++i) s.blocks.push_back(kv_.allocate());
  return true;
}

void Scheduler::preempt(size_t i) {
  std::unique_ptr<Sequence> s = std::move(running_[i]);
  running_.erase(running_.begin() + long(i));
  for (int32_t b : s->blocks) kv_.release(b);
  s->blocks.clear();
  s->num_computed = 0;
  ++s->preemptions;
  ++preemptions_;
  waiting_.push_front(std::move(s));  // first to come back
}

int64_t Scheduler::shareable(const Sequence& s) const {
  const int64_t bs = kv_.layout().block_size;
  return (s.prompt_len - 1) / bs * bs;
}

bool Scheduler::wait_or_share(Sequence& s) {
  const int64_t F = shareable(s);
  if (F == 0) return false;
  const Sequence* donor = nullptr;
  bool prefilling = false;
  for (const auto& r : running_) {
    if (r->prompt_index != s.prompt_index) continue;
    if (r->num_computed >= F && r->blocks.size() * size_t(kv_.layout().block_size) >= size_t(F)) {
      donor = r.get();
      break;
    }
    prefilling = true;
  }
  if (!donor) return prefilling;
  const int64_t nb = F / kv_.layout().block_size;
  // A waiting sequence holds no blocks and has computed nothing (preempt() and the admission
  // below keep it so).
  s.blocks.assign(donor->blocks.begin(), donor->blocks.begin() + nb);
  for (int32_t b : s.blocks) kv_.share(b);
  shared_tokens_ += F;
  s.num_computed = F;
  return false;
}

std::vector<StepChunk> Scheduler::schedule() {
  std::vector<StepChunk> plan;
  int64_t budget = opt_.max_num_batched_tokens;
  bool preempted = false;
  // Running sequences, oldest first. A victim is always the youngest, which this loop has not
  // reached yet (or is the sequence itself), so no planned chunk loses its blocks.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& s = *running_[i];
    const int64_t n = std::min(s.length() - s.num_computed, budget);
    bool self = false;
    while (!grow(s, s.num_computed + n)) {
      const size_t victim = running_.size() - 1;
      preempted = true;
      if (victim == i) {
        self = true;
        preempt(victim);
        break;
      }
      preempt(victim);
    }
    if (self) break;  // it was the youngest: everything older is planned
    plan.push_back(StepChunk{&s, s.num_computed, n, s.num_computed + n == s.length()});
    budget -= n;
    ++i;
  }
  // Admissions, while nothing had to be preempted this step (a preempted sequence waits at the
  // front; admitting others now would only evict them again).
  while (!preempted && budget > 0 && int64_t(running_.size()) < opt_.max_num_seqs && !waiting_.empty()) {
    Sequence& s = *waiting_.front();
    if (wait_or_share(s)) break;  // a sibling computes the shared prompt blocks this step
    const int64_t n = std::min(s.length() - s.num_computed, budget);
    if (!grow(s, s.num_computed + n)) {
      // Waiting sequences hold no blocks (so preemption can always free what it needs): give
      // back the shared ones; they are taken again on admission.
      for (int32_t b : s.blocks) kv_.release(b);
      s.blocks.clear();
      shared_tokens_ -= s.num_computed;
      s.num_computed = 0;
      break;
    }
    s.admitted = admissions_++;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    plan.push_back(StepChunk{&s, s.num_computed, n, s.num_computed + n == s.length()});
    budget -= n;
  }
  max_running_ = std::max(max_running_, int64_t(running_.size()));
  // Nothing planned while work remains: every running sequence was preempted (the oldest only
  // when it alone outgrows the cache) and the first waiting one does not fit.
  if (plan.empty() && !done()) {
    const int64_t len = waiting_.empty() ? 0 : waiting_.front()->length();
    throw sdk::Error(RLH_E_RESOURCE_EXHAUSTED,
                     "generator: the KV cache (" + std::to_string(kv_.num_blocks()) + " blocks of " +
                         std::to_string(kv_.layout().block_size) + " tokens) cannot hold a sequence of " +
                         std::to_string(len) + " tokens; raise kv_cache_bytes");
  }
  return plan;
}

void Scheduler::computed(const std::vector<StepChunk>& chunks) {
  for (const StepChunk& c : chunks) c.seq->num_computed = c.begin + c.count;
}

std::unique_ptr<Sequence> Scheduler::finish(Sequence* seq) {
  for (size_t i = 0; i < running_.size(); ++i)
    if (running_[i].get() == seq) {
      std::unique_ptr<Sequence> s = std::move(running_[i]);
      running_.erase(running_.begin() + long(i));
      for (int32_t b : s->blocks) kv_.release(b);
      s->blocks.clear();
      return s;
    }
  throw sdk::Error(RLH_E_INTERNAL, "generator: finishing a sequence that is not running");
}

}  // namespace rlh::gen
