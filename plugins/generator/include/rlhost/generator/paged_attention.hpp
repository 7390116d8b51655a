// Attention of new rows over the paged KV cache (decode rows and prefill chunks alike).
//
// A row is one token of one sequence at position `pos`; it attends to that sequence's keys at
// positions lo .. pos (causal; lo = pos - window + 1 with a sliding window W, HF's rule: W keys
// including itself), all of which are in the cache when it runs: a step first writes the keys
// and values of all its rows (kv_write), then attends. GQA: query head h reads kv head h / (Hq /
// Hkv). Each (row, kv head) pair is computed by one thread in a fixed order (scores block by
// block, softmax with its maximum, values summed in position order), so a row's output does not
// depend on which other rows share the call: the property linear.hpp gives the projections.
#pragma once

#include <cstdint>
#include <span>

#include "rlhost/generator/kv_cache.hpp"

namespace rlh::gen {

struct CacheRow {
  const int32_t* blocks = nullptr;  // the sequence's block table
  int32_t pos = 0;                  // the row's position in its sequence
};

// Stores the keys k [R, Hkv*Dk] (rows ldk apart) and values v [R, Hkv*Dv] (ldv) of `rows` in
// layer `layer` (Dk, Dv: the cache layout's head_dim and value_dim of the layer).
void kv_write(KvCache& kv, int64_t layer, std::span<const CacheRow> rows, const float* k,
              int64_t ldk, const float* v, int64_t ldv);

// out [R, Hq*Dv] (ldo) = softmax(scale * q k^T) v per row and head; q [R, Hq*Dk] (ldq).
void paged_attention(float* out, int64_t ldo, const float* q, int64_t ldq,
                     std::span<const CacheRow> rows, KvCache& kv, int64_t layer, int64_t Hq,
                     float scale, int64_t window);

}  // namespace rlh::gen
