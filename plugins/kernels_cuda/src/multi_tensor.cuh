// Multi-tensor launches: one grid over a list of tensors, each cut into fixed chunks; the list
// travels as a kernel parameter (no host-to-device copy). Chunks are the same for any launch
// of the same list, so per-chunk partial results are deterministic.
#pragma once

#include <algorithm>
#include <vector>

#include "common.cuh"

namespace rlh::kcuda {

constexpr int kMtMaxTensors = 48;
constexpr int64_t kMtChunk = 65536;  // elements per block

struct MtList {
  int count;
  int64_t block_start[kMtMaxTensors + 1];  // first block of each tensor; [count] = total
  int64_t n[kMtMaxTensors];
  void* p[5][kMtMaxTensors];               // up to five parallel lists (p, g, m, v, p in bf16)
  unsigned char bf16[5][kMtMaxTensors];
  int64_t partial_base;                    // index of this launch's first block in partials
};

// Splits `lists` (parallel lists of equal element counts) into launches of at most
// kMtMaxTensors tensors; calls launch(MtList&, blocks) for each.
template <class Launch>
void mt_for_each(const TensorList* lists, int nlists, Launch&& launch) {
  if (nlists < 1 || nlists > 5) throw std::invalid_argument("mt_for_each: 1 to 5 lists");
  const size_t count = lists[0].count;
  size_t t = 0;
  int64_t partial = 0;
  while (t < count) {
    MtList l{};
    l.partial_base = partial;
    int64_t blocks = 0;
    int c = 0;
    for (; c < kMtMaxTensors && t < count; ++c, ++t) {
      l.block_start[c] = blocks;
      l.n[c] = lists[0].n[t];
      for (int k = 0; k < nlists; ++k) {
        if (lists[k].n[t] != l.n[c]) throw std::invalid_argument("tensor lists differ in sizes");
        l.p[k][c] = lists[k].p[t];
        l.bf16[k][c] = lists[k].bf16 ? lists[k].bf16[t] : 0;
      }
      blocks += (l.n[c] + kMtChunk - 1) / kMtChunk;
    }
    l.count = c;
    l.block_start[c] = blocks;
    if (blocks > 0) launch(l, blocks);
    partial += blocks;
  }
}

inline int64_t mt_total_blocks(const TensorList& x) {
  int64_t b = 0;
  for (size_t i = 0; i < x.count; ++i) b += (x.n[i] + kMtChunk - 1) / kMtChunk;
  return b;
}

// The tensor of block `b` (binary search over block_start).
__device__ __forceinline__ int mt_tensor_of(const MtList& l, int64_t b) {
  int lo = 0, hi = l.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (l.block_start[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace rlh::kcuda
