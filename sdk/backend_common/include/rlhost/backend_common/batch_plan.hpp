// From an ABI batch (rlh_batch: packed token ids, sequence offsets, named fields) to engine
// micro-batches, with every field sliced along: per-token fields (leading dimension num_tokens)
// take the micro-batch's tokens, per-sequence fields (leading dimension num_seqs) its sequences,
// in micro-batch order. Whole sequences always stay in one micro-batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rlhost/backend.h"
#include "rlhost/engine/engine.hpp"

namespace rlh::backend {

// Checks a batch (struct size, offsets, ids in [0, vocab), field shapes and devices); throws
// rlh::sdk::Error naming what is wrong.
// max_positions > 0: no sequence may be longer (the model's max_position_embeddings).
// `may_be_empty`: a batch of no sequences and no tokens is valid (a data-parallel rank's shard).
void validate_batch(const rlh_batch* batch, int64_t vocab_size, int64_t max_positions = 0, bool may_be_empty = false);

// Which sequences (batch indices, in micro-batch order) form each micro-batch.
struct MicroBatchPlan {
  std::vector<int64_t> seqs;
  int64_t num_tokens = 0;
};

struct PlanOptions {
  int64_t max_seqs = 0;    // > 0: consecutive groups of this many sequences
  int64_t max_tokens = 0;  // else: a token budget (a longer sequence gets its own micro-batch)
  bool first_fit_decreasing = false;  // token budget: FFD bins instead of batch order
};

// Groups the batch's sequences. RLH_BATCH_KEEP_PAIRS keeps sequences 2i and 2i+1 together
// (a group of max_seqs then holds max(2, max_seqs rounded down to even) sequences). Micro-batches
// without tokens are dropped (their sequences are empty: nothing to compute).
std::vector<MicroBatchPlan> plan_microbatches(const rlh_batch& batch, const PlanOptions& options);

// One micro-batch, materialised: its token ids, local offsets (int32 for the engine, int64 for
// the loss callback's rlh_batch) and copies of the sliced fields (contiguous, row-major).
class MicroBatchData {
 public:
  MicroBatchData(const rlh_batch& batch, MicroBatchPlan plan);
  MicroBatchData(MicroBatchData&&) noexcept = default;
  MicroBatchData(const MicroBatchData&) = delete;

  const MicroBatchPlan& plan() const { return plan_; }
  // Views for the engine (valid while this object lives).
  engine::MicroBatch engine_view() const;
  // The micro-batch as an rlh_batch (for rlh_microbatch.batch); pointers into this object.
  const rlh_batch& abi_batch();
  // Token range [begin, begin+len) in the batch for local sequence j.
  int64_t batch_begin(size_t j) const { return batch_begin_[j]; }
  int64_t local_begin(size_t j) const { return offsets64_[j]; }
  int64_t length(size_t j) const { return offsets64_[j + 1] - offsets64_[j]; }

 private:
  struct Field {
    std::string name;
    std::vector<unsigned char> bytes;
    std::vector<int64_t> shape, strides;
    rlh_dtype dtype{};
  };
  MicroBatchPlan plan_;
  std::vector<int32_t> ids_, cu32_;
  std::vector<int64_t> offsets64_, batch_begin_;
  std::vector<Field> fields_;
  std::vector<rlh_named_tensor> named_;  // rebuilt by abi_batch()/engine_view()
  uint64_t constraints_ = 0;
  rlh_batch abi_{};
};

}  // namespace rlh::backend
