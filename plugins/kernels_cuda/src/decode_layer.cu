// decode_layer_fwd: a dense decoder layer (RMSNorm, q|k|v, RoPE, the KV-cache write, paged
// attention, o, residual, RMSNorm, gate|up + SwiGLU, down, residual) for ONE token, in one
// persistent launch (docs/ops.md decode_layer_fwd; docs/kernels_cuda.md "The fused decoding
// layer").
//
// Why: at batch 1 a decoding step reads every weight once and does almost no arithmetic, so its
// speed is the memory's, if the memory is kept busy. Op by op, a layer is ~9 launches whose
// products stream at ~2 TB/s on an H100 and whose small kernels (norms, RoPE, the cache write,
// attention and its combine) leave the memory idle for ~30 us a layer (ncu, 2026-12-06). Here one
// block per SM runs the whole layer:
//   - a producer warp streams the block's share of the layer's four weights (q|k|v, o, gate|up,
//     down, in that order) into a ring of shared-memory slots with bulk copies (TMA, 1-D), from
//     the launch on: weights are never written by the work before (the contract of pdl_wait), so
//     they stream while the previous layer finishes, while the norms run and while the block
//     waits at a barrier;
//   - eight consumer warps compute each phase from the slots, with a grid-wide barrier where a
//     phase needs the whole output of the one before (after q|k|v, after attention, after o,
//     after gate|up): four a layer;
//   - a prefetch warp brings the cached keys and values the block's attention will read into L2
//     while q|k|v streams (prefetch_cache).
// A block claims each next tile of a product from a counter as a ring slot frees, so the blocks
// the memory serves faster stream more (or, RLH_KCUDA_DL_CLAIM=0, tiles are dealt round-robin).
//
// Numerics follow the ops it fuses, each intermediate rounded to bf16 where theirs is (the
// product sums, RoPE's output, attention's output, the residual adds, the GLU), with float32
// sums; only the order of the sums differs (so results are close, not bitwise, and the op is not
// batch-invariant: a generator's deterministic mode never takes it).
//
// All blocks must be resident at once (they meet at grid barriers): the launch uses one block
// per SM, which the shared memory asks for, and PDL's rule that a grid's dependents are
// scheduled only once all its blocks have triggered keeps the next launch from taking an SM a
// block of this one still waits for.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.cuh"
#include "bulk_ring.cuh"
#include "glu_act.cuh"

namespace rlh::kcuda {

namespace {

constexpr int kConsumerWarps = 8;
constexpr int kConsumers = kConsumerWarps * 32;
constexpr int kThreads = kConsumers + 64;  // + the producer warp and the cache-prefetch warp
constexpr int kSlotBytes = 32768;
constexpr int kSlots = 5;
constexpr int kWorkBytes = 32768;  // the phase's input vector (bf16), or attention's staged values
constexpr int kResBytes = 16384;   // the residual stream (x, then h: bf16 [C], C <= 8192)
constexpr int kMaxGroup = 8;        // query heads per kv head
// Positions an attention chunk, at most: their values (bf16 [CH][D]) fill at most the work area
// and their scores ([kMaxGroup][CH] floats) the score area. A launch may use smaller chunks, down
// to kMinChunk (chunk_for); the partials' workspace is laid out for the smallest.
__host__ __device__ constexpr int max_chunk(int64_t D) { return D >= 128 ? 128 : 256; }
constexpr int kMinChunk = 64;

// Shared memory: the ring, the work area, the residual, attention's queries and scores, the
// reduction scratch and the ring's barriers.
constexpr size_t kSmemRing = size_t(kSlots) * kSlotBytes;
constexpr size_t kSmemQ = kMaxGroup * 128 * sizeof(float);
constexpr size_t kSmemScores = 2048 * sizeof(float);
constexpr size_t kSmemRed = 64 * sizeof(float);
constexpr size_t kSmemBytes =
    kSmemRing + kWorkBytes + kResBytes + kSmemQ + kSmemScores + kSmemRed + 2 * kSlots * 8 + kSlots * 4;

// The consumers' own barrier (the producer warp never joins it).
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

// Data other blocks wrote during this launch: read through L2 (L1 is not coherent).
__device__ __forceinline__ uint4 ld_cg16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ float ld_cg_bf16(const bf16* p) {
  const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return __bfloat162float(__ushort_as_bfloat16(u));
}
__device__ __forceinline__ float rbf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Grid barrier: counter and generation (args.sync[0], args.sync[32]); the last block to arrive
// resets the counter and moves the generation, so the barrier leaves itself ready for the next
// one and the next launch. Writes before it are visible after it (fences on both sides).
// The generation moves by four a launch, so at a launch's start it tells the launch's index
// (launch_index). `clear_claims` (the first barrier, dealing tiles by claims): the last block
// also zeroes the claim counters of the other parity, which the next launch uses (claims_of).
__device__ __forceinline__ unsigned* claims_of(unsigned* sync, unsigned long long launch) {
  return sync + 16 + unsigned(launch & 1) * 4;
}
__device__ __forceinline__ unsigned long long* arrivals(unsigned* sync) {
  return reinterpret_cast<unsigned long long*>(sync + 48);
}
__device__ __forceinline__ void grid_sync(unsigned* sync, unsigned G, bool clear_claims = false) {
  consumers_sync();
  if (threadIdx.x == 0) {
    unsigned* count = sync;
    unsigned* gen = sync + 32;
    unsigned g0;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g0) : "l"(gen) : "memory");
    __threadfence();
    if (atomicAdd(count, 1u) == G - 1) {
      atomicExch(count, 0u);
      if (clear_claims)
        for (int ph = 0; ph < 4; ++ph) atomicExch(claims_of(sync, (g0 >> 2) + 1) + ph, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    } else {
      spin_until([&] {
        unsigned g;
        asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");
        return g != g0;
      });
    }
    __threadfence();
  }
  consumers_sync();
}

// The counted barrier (RLH_KCUDA_DL_BARRIER=count): a 64-bit arrival count (args.sync[48..49])
// that only grows, G a barrier and 4 G a launch; a block waits for it to reach its barrier's
// target, base + k G, where base is the launch's first arrival (launch_index). The last block
// has nothing more to do than arrive, where grid_sync's also resets the counter and moves the
// generation before anyone may leave (two more serialised atomics and a fence a barrier).
__device__ __forceinline__ void count_sync(unsigned* sync, unsigned long long target, bool clear_claims,
                                           unsigned long long launch) {
  consumers_sync();
  if (threadIdx.x == 0) {
    unsigned long long* n = arrivals(sync);
    __threadfence();
    const unsigned long long old = atomicAdd(n, 1ull);
    if (clear_claims && old == target - 1)
      for (int ph = 0; ph < 4; ++ph) atomicExch(claims_of(sync, launch + 1) + ph, 0u);
    spin_until([&] {
      unsigned long long c;
      asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(c) : "l"(n) : "memory");
      return c >= target;
    });
    __threadfence();
  }
  consumers_sync();
}

// The launch's index among this op's launches, read by a block before its first arrival. Every
// block of the launch before has arrived at its last barrier by then (one block an SM: this one
// started on an SM one of them left), and at most G - 1 of this launch's have arrived at the
// first: so the generation is 4 x the index, and the arrival count lies in [4 G i, 4 G i + G).
__device__ __forceinline__ unsigned long long launch_index(unsigned* sync, unsigned G, bool counted) {
  if (counted) {
    unsigned long long c;
    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(c) : "l"(arrivals(sync)) : "memory");
    return c / (4ull * G);
  }
  unsigned g;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(g) : "l"(sync + 32) : "memory");
  return g >> 2;
}

// One product's tiling: rows N of K columns, `rows` rows a tile (gate|up: pairs, gate row i and
// up row F + i), `wpr` warps a row.
struct Tiling {
  int64_t N, K;
  int rows, wpr;
  bool pairs;
  __host__ __device__ int64_t tiles() const { return (N + rows - 1) / rows; }
};
inline Tiling tiling(int64_t N, int64_t K, bool pairs) {
  const int64_t chunks = K / 8;
  int wpr = 1;
  while (wpr < kConsumerWarps && int64_t(wpr) * 256 < chunks) wpr *= 2;
  const int rows_all = kConsumerWarps / wpr;  // rows of B a tile
  return Tiling{N, K, pairs ? rows_all / 2 : rows_all, wpr, pairs};
}

// The block's tiles of a product: global tile index u = first + t over the layer's products in
// turn, block u % G; returns the first t of block b and counts the product's tiles into `first`.
__device__ __forceinline__ int64_t first_tile(int64_t& first, int64_t tiles, unsigned b, unsigned G) {
  const int64_t t0 = (int64_t(b) + G - first % G) % G;
  first += tiles;
  return t0;
}

}  // namespace

// RLH_KCUDA_DL_TRACE=1 (a profiling aid): each block stamps the global timer at the phase
// boundaries below, and the host prints, every 64th launch made outside a graph capture, each
// stamp's earliest and latest block against the first block's entry. It shows what ncu's kernel
// time cannot: which phase, or which wait at a grid barrier, the layer's time goes to.
constexpr int kStamps = 13;
const char* const kStampNames[kStamps] = {"entry", "pdl_wait", "norm1", "qkv", "sync1", "attention", "sync2",
                                          "o", "sync3", "norm2", "gate_up", "sync4", "down"};

struct DecodeLayerDev {
  DecodeLayerArgs a;
  Tiling t[4];  // q|k|v, o, gate|up, down
  int64_t nch;  // attention chunks of the row (positions 0 .. pos)
  unsigned G;
  bool claim;  // tiles claimed from counters, not dealt (produce())
  int min_chunk;  // attention's smallest chunk (chunk_for)
  bool counted;   // count_sync's barriers, not grid_sync's
  unsigned long long* trace;  // [G][kStamps] or null
};

namespace {

// The launch's attention chunk: the smallest from p.min_chunk up, doubling to max_chunk(D), that
// leaves no more (kv head, chunk) units than blocks, so the phase takes one unit's time and each
// unit is as short as the blocks allow. Every block computes the same from the same position.
template <int D>
__device__ __forceinline__ int chunk_for(const DecodeLayerDev& p, int64_t pos) {
  int ch = p.min_chunk;
  const int64_t n = pos < 0 ? 1 : pos + 1;
  while (ch < max_chunk(D) && p.a.Hkv * ((n + ch - 1) / ch) > int64_t(p.G)) ch *= 2;
  return ch;
}

// Tile u of product ph into a slot (its full barrier completes when the bytes have landed).
__device__ __forceinline__ void load_tile(const DecodeLayerDev& p, int ph, int64_t u, char* dst, uint64_t* full) {
  const DecodeLayerArgs& a = p.a;
  const bf16* W = ph == 0 ? a.w_qkv : ph == 1 ? a.w_o : ph == 2 ? a.w_gu : a.w_down;
  const Tiling& t = p.t[ph];
  const int64_t r0 = u * t.rows, n = min(int64_t(t.rows), t.N - r0);
  const unsigned bytes = unsigned(n * t.K * 2);
  mbar_expect_tx(full, t.pairs ? 2 * bytes : bytes);
  bulk_copy(dst, W + r0 * t.K, bytes, full);
  if (t.pairs) bulk_copy(dst + size_t(t.rows) * t.K * 2, W + (t.N + r0) * t.K, bytes, full);
}

// The producer: every tile of the block, in the consumers' order, into the ring. Dealt: tile u
// of a product is block u % G's, so every block streams the same bytes. Claimed (p.claim, the
// default): a block takes the next tile of the product from a counter as a slot frees, so a
// block the memory serves faster takes more, and ends the product with a slot whose tile_of
// is -1. The counters are the launch's parity's (claims_of()): the previous launch's blocks may
// still be claiming the other ones' last tiles, and this launch's first barrier clears those for
// the next (every block of the previous launch has exited by then: one block an SM).
__device__ void produce(const DecodeLayerDev& p, char* ring, uint64_t* full, uint64_t* empty, volatile int* tile_of) {
  unsigned i = 0;
  if (p.claim) {
    unsigned* ctr = claims_of(p.a.sync, launch_index(p.a.sync, p.G, p.counted));
    for (int ph = 0; ph < 4; ++ph) {
      for (;; ++i) {
        const unsigned slot = i % kSlots, round = i / kSlots;
        mbar_wait(&empty[slot], (round & 1) ^ 1);
        const unsigned u = atomicAdd(ctr + ph, 1u);
        if (u >= p.t[ph].tiles()) {
          tile_of[slot] = -1;
          mbar_arrive(&full[slot]);
          ++i;
          break;
        }
        tile_of[slot] = int(u);
        load_tile(p, ph, u, ring + size_t(slot) * kSlotBytes, &full[slot]);
      }
    }
    return;
  }
  int64_t first = 0;
  for (int ph = 0; ph < 4; ++ph) {
    const Tiling& t = p.t[ph];
    const int64_t T = t.tiles();
    for (int64_t u = first_tile(first, T, blockIdx.x, p.G); u < T; u += p.G, ++i) {
      const unsigned slot = i % kSlots, round = i / kSlots;
      mbar_wait(&empty[slot], (round & 1) ^ 1);
      load_tile(p, ph, u, ring + size_t(slot) * kSlotBytes, &full[slot]);
    }
  }
}

// Global x (bf16 [C], written by earlier work, read through L2) copied into res (shared) and
// normalised into xs (shared, bf16): RMSNorm's arithmetic (rstd_of, x * rstd * (w + woff)); the
// sum of squares in the block's order. res keeps the residual for the products' epilogues, which
// would otherwise each wait on an L2 load with the whole block held at the next tile's barrier.
// The norm's weights are loaded with x (parked in xs until the second pass), so the pass waits
// on one round trip to the memory, not two: while the ring streams, each costs microseconds.
__device__ void norm_into(bf16* xs, bf16* res, const bf16* x, const bf16* w, int64_t C, float eps, float woff,
                          float* red) {
  const int tid = threadIdx.x;
  float ss = 0.f;
  for (int64_t c = int64_t(tid) * 8; c < C; c += kConsumers * 8) {
    const uint4 u = ld_cg16(x + c);
    *reinterpret_cast<uint4*>(xs + c) = *reinterpret_cast<const uint4*>(w + c);
    *reinterpret_cast<uint4*>(res + c) = u;
    const bf16* v = reinterpret_cast<const bf16*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) ss = fmaf(__bfloat162float(v[k]), __bfloat162float(v[k]), ss);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((tid & 31) == 0) red[tid >> 5] = ss;
  consumers_sync();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < kConsumerWarps; ++i) tot += red[i];
  const float r = rsqrtf(tot / float(C) + eps);
  const float rs = r * (1.5f - 0.5f * (tot / float(C) + eps) * r * r);
  for (int64_t c = int64_t(tid) * 8; c < C; c += kConsumers * 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(res + c), uw = *reinterpret_cast<const uint4*>(xs + c);
    const bf16* v = reinterpret_cast<const bf16*>(&u);
    const bf16* wv = reinterpret_cast<const bf16*>(&uw);
    uint4 o;
    bf16* ov = reinterpret_cast<bf16*>(&o);
#pragma unroll
    for (int k = 0; k < 8; ++k) ov[k] = __float2bfloat16_rn(__bfloat162float(v[k]) * rs * (__bfloat162float(wv[k]) + woff));
    *reinterpret_cast<uint4*>(xs + c) = o;
  }
  consumers_sync();  // (red is reused; xs is read by every warp)
}

// One tile of a product: each warp sums its part of its row against xs and releases the slot
// (its reads of it are done), the parts are added in order, and `epi(row, sum, up_sum)` runs for
// each row of the tile (gate|up tiles: `rows` gate rows then their up rows; up_sum is the
// pair's, else 0) on the thread that added them. One block barrier a tile: the caller alternates
// `red` between two halves tile by tile, so a tile's parts never overwrite the ones the tile
// before is still adding (the barrier between them orders those).
template <class Epi>
__device__ __forceinline__ void tile_sums(const Tiling& t, const char* slot, const bf16* xs, int64_t r0, float* red,
                                          uint64_t* empty, Epi epi) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows_all = kConsumerWarps / t.wpr;
  const int rr = warp / t.wpr, part = warp % t.wpr;
  const int64_t chunks = t.K / 8, per = (chunks + t.wpr - 1) / t.wpr;
  const int64_t c_begin = part * per, c_end = min(c_begin + per, chunks);
  // row rr of the slot: gate|up tiles hold `rows` gate rows, then their `rows` up rows
  const int64_t n = min(int64_t(t.rows), t.N - r0);
  const bool live = t.pairs ? (rr % t.rows) < n : rr < n;
  float acc = 0.f;
  if (live) {
    const uint4* wr = reinterpret_cast<const uint4*>(slot + size_t(rr) * t.K * 2);
    const uint4* xv = reinterpret_cast<const uint4*>(xs);
    for (int64_t c = c_begin + lane; c < c_end; c += 32) fma8(acc, xv[c], wr[c]);
  }
  __syncwarp();  // every lane's loads of the slot have returned (its sum needed them)
  if (lane == 0) mbar_arrive(empty);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) red[warp] = acc;
  consumers_sync();
  if (threadIdx.x < (t.pairs ? t.rows : rows_all) && threadIdx.x < n) {
    const int row = threadIdx.x;
    float s = 0.f, us = 0.f;
    for (int q = 0; q < t.wpr; ++q) s += red[row * t.wpr + q];  // parts in order
    if (t.pairs)
      for (int q = 0; q < t.wpr; ++q) us += red[(t.rows + row) * t.wpr + q];
    epi(row, s, us);
  }
}

// Attention of the row's position over its chunk `c` of positions for kv head g (all its query
// heads): unnormalised partial (max, sum, o[D]) per query head into a.part. The chunk holding
// the row's own position also writes the new key and value into the cache.
template <int D>
__device__ void attend_chunk(const DecodeLayerDev& p, int64_t g, int64_t c, int CH, char* work, float* qs, float* sc) {
  const DecodeLayerArgs& a = p.a;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t HPG = a.Hq / a.Hkv, pos = a.pos[0];
  // (a position past the table, or a block id outside the cache, sets the error flag and is
  // read from block 0 instead: no read outside the operands)
  const int64_t p0 = c * CH, n = min(min(int64_t(CH), pos + 1 - p0), a.max_positions - p0);
  const int64_t qk = (a.Hq + a.Hkv) * D;  // v's columns in qkv
  bf16* vs = reinterpret_cast<bf16*>(work);  // [CH][D] values
  __shared__ float kn[128];                  // the new key, rotated and rounded
  // RoPE of the group's queries and of the new key at the row's position (rope_fwd's rotation:
  // pairs (i, i + D/2), angle float32(inv_freq[i]) * float32(pos), cos and sin times scale).
  for (int64_t e = tid; e < (HPG + 1) * (D / 2); e += kConsumers) {
    const int64_t j = e / (D / 2), i = e % (D / 2);
    const bf16* src = j < HPG ? a.qkv + (g * HPG + j) * D : a.qkv + a.Hq * D + g * D;
    const float xa = ld_cg_bf16(src + i), xb = ld_cg_bf16(src + i + D / 2);
    float sn, cs;
    sincosf(__fmul_rn(a.inv_freq[i], float(pos)), &sn, &cs);
    cs *= a.rope_scale;
    sn *= a.rope_scale;
    const float ya = rbf(xa * cs - xb * sn), yb = rbf(xb * cs + xa * sn);
    if (j < HPG) {
      qs[j * D + i] = ya;
      qs[j * D + i + D / 2] = yb;
    } else {
      kn[i] = ya;
      kn[i + D / 2] = yb;
    }
  }
  consumers_sync();
  const bool own = pos >= p0 && pos < p0 + CH;  // this chunk holds the new position
  if (own && tid < D) {  // the cache write (kv_cache_write's: slot = block * bs + offset)
    const int64_t slot = a.slots[0];
    if (slot >= 0 && slot < a.num_blocks * a.bs) {
      const int64_t b = slot / a.bs, o = slot % a.bs;
      a.k_cache[b * a.kc[0] + g * a.kc[1] + o * a.kc[2] + tid * a.kc[3]] = __float2bfloat16_rn(kn[tid]);
      a.v_cache[b * a.vc[0] + g * a.vc[1] + o * a.vc[2] + tid * a.vc[3]] = __float2bfloat16_rn(ld_cg_bf16(a.qkv + qk + g * D + tid));
    } else if (slot >= a.num_blocks * a.bs && a.err) {
      atomicExch(a.err, 1);
    }
  }
  // Scores: a thread a position (its key row read whole); values staged for the sums below.
  for (int64_t t = tid; t < n; t += kConsumers) {
    const int64_t q = p0 + t;
    float kv[D];
    if (q == pos) {
#pragma unroll
      for (int d = 0; d < D; ++d) kv[d] = kn[d];
      for (int d = 0; d < D; d += 8)
        *reinterpret_cast<uint4*>(vs + t * D + d) = ld_cg16(a.qkv + qk + g * D + d);
    } else {
      int64_t blk = a.blocks[q / a.bs];
      const int64_t o = q % a.bs;
      if (blk < 0 || blk >= a.num_blocks) {
        if (a.err) atomicExch(a.err, 1);
        blk = 0;
      }
      const bf16* kr = a.k_cache + blk * a.kc[0] + g * a.kc[1] + o * a.kc[2];
      const bf16* vr = a.v_cache + blk * a.vc[0] + g * a.vc[1] + o * a.vc[2];
      if (a.kc[3] == 1 && a.vc[3] == 1) {
#pragma unroll
        for (int d = 0; d < D; d += 8) {
          const uint4 u = __ldcg(reinterpret_cast<const uint4*>(kr + d));
          const bf16* v8 = reinterpret_cast<const bf16*>(&u);
#pragma unroll
          for (int k = 0; k < 8; ++k) kv[d + k] = __bfloat162float(v8[k]);
          *reinterpret_cast<uint4*>(vs + t * D + d) = __ldcg(reinterpret_cast<const uint4*>(vr + d));
        }
      } else {
#pragma unroll
        for (int d = 0; d < D; ++d) {
          kv[d] = __bfloat162float(kr[d * a.kc[3]]);
          vs[t * D + d] = vr[d * a.vc[3]];
        }
      }
    }
    for (int64_t j = 0; j < HPG; ++j) {
      float s = 0.f;
#pragma unroll
      for (int d = 0; d < D; ++d) s = fmaf(qs[j * D + d], kv[d], s);
      sc[j * CH + t] = s * a.scale;
    }
  }
  consumers_sync();
  // Softmax statistics: warp j for query head j.
  float* part = a.part + ((g * p.nch + c) * HPG) * (D + 2);
  if (warp < HPG) {
    float m = -INFINITY;
    for (int64_t t = lane; t < n; t += 32) m = fmaxf(m, sc[warp * CH + t]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.f;
    for (int64_t t = lane; t < n; t += 32) {
      const float e = __expf(sc[warp * CH + t] - m);
      sc[warp * CH + t] = e;
      l += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) {
      part[warp * (D + 2)] = m;
      part[warp * (D + 2) + 1] = l;
    }
  }
  consumers_sync();
  for (int64_t e = tid; e < HPG * D; e += kConsumers) {
    const int64_t j = e / D, d = e % D;
    float o = 0.f;
    for (int64_t t = 0; t < n; ++t) o = fmaf(sc[j * CH + t], __bfloat162float(vs[t * D + d]), o);
    part[j * (D + 2) + 2 + d] = o;
  }
  consumers_sync();  // (the work area and sc are reused)
}

// The prefetch warp: the cached keys and values of the attention units this block will run,
// into L2, from the launch on. They were written by earlier steps, so they can be fetched while
// the layer's q|k|v streams; read at the attention phase instead, each of its dependent loads
// (the block table, then the rows) would wait microseconds behind the weights' stream. The
// position and the table are read before pdl_wait only to compute addresses (a stale value
// costs a useless prefetch, never a result); every address stays inside the cache.
template <int D>
__device__ void prefetch_cache(const DecodeLayerDev& p) {
  const DecodeLayerArgs& a = p.a;
  constexpr int PER = max_chunk(D) / 32;
  const int lane = threadIdx.x & 31;
  // (through L2 only: a line of them left in this SM's L1 from before pdl_wait could be read by
  // the consumers after it, when the kernel before wrote them)
  const int64_t pos = __ldcg(a.pos);
  if (pos < 0 || pos >= a.max_positions || a.kc[3] != 1 || a.vc[3] != 1) return;
  const int CH = chunk_for<D>(p, pos);
  const int64_t nc = min(p.nch, pos / CH + 1);
  for (int64_t u = blockIdx.x; u < a.Hkv * nc; u += p.G) {
    const int64_t g = u / nc, p0 = (u % nc) * CH;
    int64_t blk[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {  // the table's entries first, all in flight at once
      const int64_t q = p0 + lane + 32 * k;
      blk[k] = 32 * k < CH && q < pos ? __ldcg(a.blocks + q / a.bs) : -1;
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      if (blk[k] < 0 || blk[k] >= a.num_blocks) continue;
      const int64_t o = (p0 + lane + 32 * k) % a.bs;
      const bf16* kr = a.k_cache + blk[k] * a.kc[0] + g * a.kc[1] + o * a.kc[2];
      const bf16* vr = a.v_cache + blk[k] * a.vc[0] + g * a.vc[1] + o * a.vc[2];
#pragma unroll
      for (int d = 0; d < D; d += 64) {  // a 128-byte line at a time
        prefetch_l2(kr + d);
        prefetch_l2(vr + d);
      }
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) decode_layer_kernel(const __grid_constant__ DecodeLayerDev p) {
  extern __shared__ __align__(128) char smem[];
  char* ring = smem;
  char* work = smem + kSmemRing;
  bf16* res = reinterpret_cast<bf16*>(work + kWorkBytes);
  float* qs = reinterpret_cast<float*>(work + kWorkBytes + kResBytes);
  float* sc = qs + kMaxGroup * 128;
  float* red = sc + 2048;
  uint64_t* full = reinterpret_cast<uint64_t*>(red + 64);
  uint64_t* empty = full + kSlots;
  volatile int* tile_of = reinterpret_cast<volatile int*>(empty + kSlots);  // claimed tiles (produce())
  const DecodeLayerArgs& a = p.a;
  unsigned stamp_i = 0;
  const auto stamp = [&] {
    if (p.trace && threadIdx.x == 0) p.trace[blockIdx.x * kStamps + stamp_i] = now_ns();
    ++stamp_i;
  };
  stamp();
  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers + 32) {  // the prefetch warp
    prefetch_cache<D>(p);
    pdl_trigger();
    return;
  }
  if (threadIdx.x >= kConsumers) {  // the producer warp: weights only, so before pdl_wait
    if (threadIdx.x == kConsumers) produce(p, ring, full, empty, tile_of);
    pdl_trigger();
    return;
  }
  pdl_wait();
  pdl_trigger();
  stamp();
  // The four barriers of the layer (k = 1..4); the first clears the next launch's claim counters.
  unsigned long long base = 0, launch = 0;  // (count_sync's; thread 0's)
  if (p.counted && threadIdx.x == 0) {
    launch = launch_index(a.sync, p.G, true);
    base = launch * 4ull * p.G;
  }
  const auto barrier = [&](int k) {
    if (p.counted) count_sync(a.sync, base + unsigned(k) * p.G, k == 1 && p.claim, launch);
    else grid_sync(a.sync, p.G, k == 1 && p.claim);
  };
  bf16* xs = reinterpret_cast<bf16*>(work);
  unsigned it = 0;  // ring position
  int64_t first = 0;
  // Product `ph`: the block's tiles of it, in the producer's order, each from its ring slot;
  // epi(r0 + row, sum, up_sum) per row (each warp releases the slot once it has summed).
  auto product = [&](int ph, auto epi) {
    const Tiling& t = p.t[ph];
    const auto tile = [&](int64_t u, unsigned slot) {
      const int64_t r0 = u * t.rows;
      tile_sums(t, ring + size_t(slot) * kSlotBytes, xs, r0, red + (it & 1) * 16, &empty[slot],
                [&](int row, float s, float us) { epi(r0 + row, s, us); });
    };
    if (p.claim) {
      for (;; ++it) {
        const unsigned slot = it % kSlots;
        mbar_wait(&full[slot], (it / kSlots) & 1);
        const int u = tile_of[slot];  // (read before this warp releases the slot)
        if (u < 0) {  // the product's end: the slot goes back empty
          __syncwarp();
          if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[slot]);
          ++it;
          break;
        }
        tile(u, slot);
      }
      return;
    }
    for (int64_t u = first_tile(first, t.tiles(), blockIdx.x, p.G); u < t.tiles(); u += p.G, ++it) {
      const unsigned slot = it % kSlots;
      mbar_wait(&full[slot], (it / kSlots) & 1);
      tile(u, slot);
    }
  };
  const int64_t C = a.C, F = a.F, HD = a.Hq * D;
  // 1. q|k|v = rmsnorm(x) W_qkv^T, rounded
  norm_into(xs, res, a.x, a.w_norm1, C, a.eps1, a.woff1, red);
  stamp();
  product(0, [&](int64_t j, float s, float) { a.qkv[j] = __float2bfloat16_rn(s); });
  stamp();
  barrier(1);
  stamp();
  // 2. attention partials, (kv head, chunk) units dealt over the blocks
  // Only the chunks up to the row's position hold keys (the partials' layout keeps p.nch, the
  // table's capacity, as its stride).
  const int CH = chunk_for<D>(p, a.pos[0]);
  const int64_t nc = a.pos[0] < 0 ? 0 : min(p.nch, int64_t(a.pos[0]) / CH + 1);  // (0 for a negative position)
  if ((a.pos[0] < 0 || a.pos[0] >= a.max_positions) && blockIdx.x == 0 && threadIdx.x == 0 && a.err)
    atomicExch(a.err, 1);  // (the output is then not defined; no read leaves the operands)
  for (int64_t u = blockIdx.x; u < a.Hkv * nc; u += p.G) attend_chunk<D>(p, u / nc, u % nc, CH, work, qs, sc);
  stamp();
  barrier(2);
  stamp();
  // 3. attention combined (every block, for its o rows), h = x + o W_o^T into y. The chunks'
  // maxima and sums are staged in sc first, all loads in flight at once, then each output sums
  // its chunks from there (four outputs a thread at a time): the same arithmetic in the same
  // order as one thread an output reading each partial in turn, without its chain of dependent
  // L2 loads (~7 us a layer while the ring streams). Rows of many chunks take that chain still.
  {
    const int64_t HPG = a.Hq / a.Hkv, step = HPG * (D + 2), Hq = a.Hq;
    const auto head = [&](int64_t h) { return a.part + ((h / HPG) * p.nch * HPG + h % HPG) * (D + 2); };
    if (Hq * (2 * nc + 1) <= 2048) {
      float *ms = sc, *ls = sc + Hq * nc, *Ls = sc + 2 * Hq * nc;  // [Hq][nc] maxima, sums; [Hq] totals
      for (int64_t i = threadIdx.x; i < Hq * nc; i += kConsumers) {
        const float* pc = head(i / nc) + (i % nc) * step;
        ms[i] = __ldcg(pc);
        ls[i] = __ldcg(pc + 1);
      }
      consumers_sync();
      for (int64_t h = threadIdx.x; h < Hq; h += kConsumers) {
        float M = -INFINITY;
        for (int64_t c = 0; c < nc; ++c) M = fmaxf(M, ms[h * nc + c]);
        float L = 0.f;
        for (int64_t c = 0; c < nc; ++c) {
          const float w = __expf(ms[h * nc + c] - M);
          L = fmaf(ls[h * nc + c], w, L);
          ms[h * nc + c] = w;  // the chunk's weight from here on
        }
        Ls[h] = L;
      }
      consumers_sync();
      for (int64_t e0 = threadIdx.x; e0 < HD; e0 += 4 * kConsumers) {
        float O[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t c = 0; c < nc; ++c) {
          float v[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int64_t e = e0 + k * kConsumers;
            v[k] = e < HD ? __ldcg(head(e / D) + c * step + 2 + e % D) : 0.f;
          }
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int64_t e = e0 + k * kConsumers;
            if (e < HD) O[k] = fmaf(v[k], ms[(e / D) * nc + c], O[k]);
          }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int64_t e = e0 + k * kConsumers;
          if (e < HD) xs[e] = __float2bfloat16_rn(O[k] / Ls[e / D]);
        }
      }
    } else {
      for (int64_t e = threadIdx.x; e < HD; e += kConsumers) {
        const int64_t d = e % D;
        const float* pc = head(e / D);
        float M = -INFINITY;
        for (int64_t c = 0; c < nc; ++c) M = fmaxf(M, __ldcg(pc + c * step));
        float L = 0.f, O = 0.f;
        for (int64_t c = 0; c < nc; ++c) {
          const float w = __expf(__ldcg(pc + c * step) - M);
          L = fmaf(__ldcg(pc + c * step + 1), w, L);
          O = fmaf(__ldcg(pc + c * step + 2 + d), w, O);
        }
        xs[e] = __float2bfloat16_rn(O / L);
      }
    }
    consumers_sync();
    product(1, [&](int64_t j, float s, float) { a.y[j] = __float2bfloat16_rn(__bfloat162float(res[j]) + rbf(s)); });
  }
  stamp();
  barrier(3);
  stamp();
  // 4. act = silu(g) * u of rmsnorm(h) W_gu^T, rounded as gemm_glu_fwd's (res: h from here on)
  norm_into(xs, res, a.y, a.w_norm2, C, a.eps2, a.woff2, red);
  stamp();
  product(2, [&](int64_t i, float gs, float us) { a.act[i] = __float2bfloat16_rn(act_value<0>(rbf(gs)) * rbf(us)); });
  stamp();
  barrier(4);
  stamp();
  // 5. y = h + act W_down^T
  for (int64_t c = int64_t(threadIdx.x) * 8; c < F; c += kConsumers * 8)
    *reinterpret_cast<uint4*>(xs + c) = ld_cg16(a.act + c);
  consumers_sync();
  product(3, [&](int64_t j, float s, float) { a.y[j] = __float2bfloat16_rn(__bfloat162float(res[j]) + rbf(s)); });
  stamp();
}

}  // namespace

std::string decode_layer_refusal(const DecodeLayerArgs& a) {
  if (a.D != 16 && a.D != 32 && a.D != 64 && a.D != 128) return "head dims 16, 32, 64 and 128 only";
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0 || a.Hq / a.Hkv > kMaxGroup) return "up to 8 query heads a kv head";
  if (a.C % 8 || a.F % 8 || a.C > 8192 || a.F > 16384 || a.Hq * a.D > 16384)
    return "hidden size a multiple of 8 up to 8192, intermediate size a multiple of 8 up to 16384";
  return "";
}

int64_t decode_layer_workspace_bytes(const DecodeLayerArgs& a) {
  const int64_t nch = (a.max_positions + kMinChunk - 1) / kMinChunk;
  const int64_t qkv = (a.Hq + 2 * a.Hkv) * a.D * 2, act = a.F * 2;
  const int64_t part = a.Hkv * nch * (a.Hq / a.Hkv) * (a.D + 2) * 4;
  auto up = [](int64_t n) { return (n + 255) / 256 * 256; };
  return up(qkv) + up(act) + up(part);
}

void decode_layer_carve(DecodeLayerArgs& a, void* ws) {
  auto up = [](int64_t n) { return (n + 255) / 256 * 256; };
  char* p = static_cast<char*>(ws);
  a.qkv = reinterpret_cast<bf16*>(p);
  p += up((a.Hq + 2 * a.Hkv) * a.D * 2);
  a.act = reinterpret_cast<bf16*>(p);
  p += up(a.F * 2);
  a.part = reinterpret_cast<float*>(p);
}

namespace {

using LayerKernel = void (*)(DecodeLayerDev);
LayerKernel layer_kernel(int64_t D) {
  return D == 16 ? decode_layer_kernel<16> : D == 32 ? decode_layer_kernel<32> : D == 64 ? decode_layer_kernel<64>
                                                                                      : decode_layer_kernel<128>;
}

// The shared-memory limit raised once per device and head dim (not on every call: a generator
// captures these launches).
void raise_smem(int64_t D) {
  static bool raised[64][4] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  bool& done = raised[dev & 63][D == 16 ? 0 : D == 32 ? 1 : D == 64 ? 2 : 3];
  if (done) return;
  if (cudaFuncSetAttribute(layer_kernel(D), cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)) != cudaSuccess)
    throw std::runtime_error("decode_layer_fwd: cannot raise the shared-memory limit");
  done = true;
}

// RLH_KCUDA_DL_TRACE's buffer and report (see kStamps). One per process: a profiling aid.
struct Trace {
  bool on = false;
  unsigned long long* dev = nullptr;
  unsigned cap = 0;
  long launches = 0;
  unsigned long long* buffer(unsigned G) {
    if (G > cap) {
      if (dev) cudaFree(dev);
      dev = nullptr;
      if (cudaMalloc(&dev, size_t(G) * kStamps * 8) != cudaSuccess) throw std::runtime_error("decode_layer_fwd: trace buffer");
      cap = G;
    }
    return dev;
  }
  void report(cudaStream_t s, unsigned G) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) return;
    if (++launches % 64 != 0) return;
    std::vector<unsigned long long> h(size_t(G) * kStamps);
    if (cudaMemcpyAsync(h.data(), dev, h.size() * 8, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess)
      throw std::runtime_error("decode_layer_fwd: trace copy");
    unsigned long long t0 = ~0ull;
    for (unsigned b = 0; b < G; ++b) t0 = std::min(t0, h[size_t(b) * kStamps]);
    std::string line = "decode_layer_fwd trace (us after the first block's entry, earliest/latest block):";
    for (int k = 0; k < kStamps; ++k) {
      unsigned long long lo = ~0ull, hi = 0;
      for (unsigned b = 0; b < G; ++b) {
        lo = std::min(lo, h[size_t(b) * kStamps + k]);
        hi = std::max(hi, h[size_t(b) * kStamps + k]);
      }
      char buf[96];
      std::snprintf(buf, sizeof buf, " %s %.1f/%.1f", kStampNames[k], (lo - t0) / 1e3, (hi - t0) / 1e3);
      line += buf;
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }
};
Trace& trace() {
  static Trace t = [] {
    Trace x;
    const char* e = std::getenv("RLH_KCUDA_DL_TRACE");
    x.on = e && *e && std::strcmp(e, "0") != 0;
    return x;
  }();
  return t;
}

// Exactly one block of the kernel fits an SM of the current device (asked once per device and
// head dim: a generator captures these launches).
bool one_block_an_sm(int64_t D) {
  static signed char known[64][4] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  cudaGetDevice(&dev);
  signed char& k = known[dev & 63][D == 16 ? 0 : D == 32 ? 1 : D == 64 ? 2 : 3];
  if (k == 0) {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, layer_kernel(D), kThreads, kSmemBytes) != cudaSuccess) {
      cudaGetLastError();  // (its own error only: then tiles are dealt)
      blocks = 0;
    }
    k = blocks == 1 ? 1 : 2;
  }
  return k == 1;
}
// Tiles claimed, not dealt (produce()), where exactly one block fits an SM, which the counters'
// reuse across launches relies on; RLH_KCUDA_DL_CLAIM=0 deals them. Claimed ran a layer in
// ~76 us against ~84 dealt (H100, 2026-12-06: the blocks the memory serves faster take more).
bool claim_tiles(int64_t D) {
  static const bool asked = [] {
    const char* e = std::getenv("RLH_KCUDA_DL_CLAIM");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  if (!asked) return false;
  return one_block_an_sm(D);
}
// RLH_KCUDA_DL_BARRIER=count: count_sync's barriers (with claimed tiles, whose one-block-an-SM
// check they rely on too); unset, grid_sync's, as measured.
bool counted_barrier() {
  static const bool asked = [] {
    const char* e = std::getenv("RLH_KCUDA_DL_BARRIER");
    return e && std::strcmp(e, "count") == 0;
  }();
  return asked;
}

// The counted barrier rides on the claimed tiles' counters (its flag lives beside them): with
// tiles dealt it is not used, said once so an A/B run is not mislabelled.
bool counted_barrier_for(bool claim) {
  if (counted_barrier() && !claim) {
    static const bool said = [] {
      std::fprintf(stderr, "decode_layer_fwd: RLH_KCUDA_DL_BARRIER=count needs claimed tiles "
                           "(RLH_KCUDA_DL_CLAIM=0 was set): the generation barrier runs\n");
      return true;
    }();
    (void)said;
  }
  return claim && counted_barrier();
}
}  // namespace

namespace {
// RLH_KCUDA_DL_MIN_CHUNK=64|128: attention's chunks may shrink to that many positions when the
// blocks outnumber the units (chunk_for); unset, every launch uses max_chunk(D), as measured.
int min_chunk(int64_t D) {
  static const int asked = [] {
    const char* e = std::getenv("RLH_KCUDA_DL_MIN_CHUNK");
    return e && *e ? std::atoi(e) : 0;
  }();
  int ch = kMinChunk;
  while (ch < max_chunk(D) && ch < asked) ch *= 2;
  return asked > 0 ? ch : max_chunk(D);  // (below 64: 64)
}
}  // namespace

std::string decode_layer_device_refusal(int64_t D) {
  try {
    raise_smem(D);
  } catch (const std::exception& e) {
    cudaGetLastError();
    return e.what();
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, layer_kernel(D), kThreads, kSmemBytes) != cudaSuccess ||
      blocks < 1) {
    cudaGetLastError();
    return "one block of the layer kernel does not fit an SM of this device";
  }
  return "";
}

void decode_layer(const DecodeLayerArgs& a, cudaStream_t s) {
  DecodeLayerDev p{};
  p.a = a;
  p.G = unsigned(a.sms);
  p.t[0] = tiling((a.Hq + 2 * a.Hkv) * a.D, a.C, false);
  p.t[1] = tiling(a.C, a.Hq * a.D, false);
  p.t[2] = tiling(a.F, a.C, true);
  p.t[3] = tiling(a.C, a.F, false);
  p.nch = (a.max_positions + kMinChunk - 1) / kMinChunk;  // the workspace's chunks (the smallest)
  p.min_chunk = min_chunk(a.D);
  raise_smem(a.D);
  p.claim = claim_tiles(a.D);
  p.counted = counted_barrier_for(p.claim);
  Trace& tr = trace();
  p.trace = tr.on ? tr.buffer(p.G) : nullptr;
  auto kernel = layer_kernel(a.D);
  launch_pdl(kernel, dim3(p.G), dim3(kThreads), kSmemBytes, s, p);
  check_launch("decode_layer_fwd");
  if (p.trace) tr.report(s, p.G);
}

}  // namespace rlh::kcuda
