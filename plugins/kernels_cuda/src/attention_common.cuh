// Packed-sequence masks shared by the attention kernels. Query i of sequence s (cu[s] <= i <
// cu[s+1]) sees keys j with lo(i) <= j <= i, lo(i) = max(cu[s], i - W + 1) (W = 0: no window).
// Tiles are cut over global token indices, so no host-side knowledge of the sequence lengths
// is needed (nothing is synchronised); a tile that straddles sequences is masked.
#pragma once

#include "common.cuh"

namespace rlh::kcuda {

// Index of the sequence holding token i: the last s with cu[s] <= i (empty sequences skipped).
__device__ __forceinline__ int64_t seq_of(const int32_t* cu, int64_t S, int64_t i) {
  int64_t lo = 0, hi = S - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}
__device__ __forceinline__ int64_t row_lo(const int32_t* cu, int64_t S, int64_t i, int64_t W) {
  const int64_t st = cu[seq_of(cu, S, i)];
  return W > 0 ? max(st, i - W + 1) : st;
}
// The last query (inclusive) that can see key j.
__device__ __forceinline__ int64_t key_hi(const int32_t* cu, int64_t S, int64_t j, int64_t W) {
  const int64_t end = int64_t(cu[seq_of(cu, S, j) + 1]) - 1;
  return W > 0 ? min(end, j + W - 1) : end;
}

}  // namespace rlh::kcuda
