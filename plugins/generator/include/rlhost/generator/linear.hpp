// The generator's matrix product: y = x W^T for the few-row products of decoding (and the
// prefill chunks between them), written so that every output row depends only on its own input
// row — bitwise, for any number of rows, any row grouping and any thread count.
//
// Why not kernels_cpu's gemm: its float path runs OpenBLAS, whose result for one row changes
// with the number of rows M (gemv for M = 1, small-matrix kernels, different edge tiles):
// measured on this machine, row 0 of an [M, 768] x [768, 1280] product differs between M = 1 and
// M = 2. A generator on top of it would sample a different token when another prompt joins the
// batch. Here each output element y[m, n] has its own 16-lane accumulator fed k = 0, 16, 32, ...
// in order and reduced by a fixed tree, whatever tile, chunk or thread computes it, so decoding
// is batch-invariant and a preempted sequence recomputes exactly the cache it lost.
//
// Speed: register tiles of 4 rows x 4 weight rows (16 accumulators, 8 loads per 16 FMAs: FMA
// bound, not load bound) with the weight rows of a tile reused across all input rows while in
// L1; one row (decoding at batch 1) uses 1 x 8 tiles and is bound by reading W. Work is split
// over the generator's threads (worker_pool.hpp) by blocks of weight rows.
#pragma once

#include <cstdint>

namespace rlh::gen {

// y[m * ldy + n] = sum_k x[m * ldx + k] * W[n * ldw + k]    (m < M, n < N, k < K)
// y is written (not accumulated). x, W, y must not overlap.
void linear(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t ldw,
            int64_t M, int64_t N, int64_t K);

}  // namespace rlh::gen
