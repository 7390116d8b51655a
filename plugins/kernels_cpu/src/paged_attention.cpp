// paged_attention (docs/ops.md): attention of new rows (decode rows and prefill chunks alike)
// over a paged KV cache. A row is one token of one sequence at position pos; it attends to that
// sequence's keys at positions lo .. pos (causal; lo = pos - window + 1 with a sliding window W,
// HF's rule: W keys including itself), all of which are in the cache when it runs. GQA: query
// head h reads kv head h / (Hq / Hkv).
//
// Cache layout (what kernels_cpu offers; the generator's KvCache allocates it so): per block,
// keys K [Hkv][Dk][bs] (transposed: the scores of a whole block are block-wide vector FMAs over
// d with q[d] broadcast, no horizontal sum per key) and values V [Hkv][bs][Dv] (row-major: the
// output accumulates whole value rows); blocks any distance apart. Dk != Dv for MLA layers.
//
// FP8 caches (e4m3 codes, value = scale x code; docs/ops.md): the same loops over the codes'
// values (a 256-entry table), with the key scale folded into the scores' scale and the value
// scale into the output's normalisation, as a GPU kernel folds them.
//
// One task = (row, kv head) with its G = Hq / Hkv query heads: scores of all its keys, then per
// query head the maximum, exp, sum, and the value rows weighted in position order. Each task is
// computed by one thread in a fixed order, so a row's output does not depend on which other rows
// share the call (batch-invariant, as the batch-invariant gemm). Scores live in a per-thread
// buffer of G x (keys) floats.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "decode_ops.hpp"
#include "fp8_e4m3.hpp"
#include "simd.hpp"
#include "worker_pool.hpp"

namespace rlh::kcpu {

namespace {

struct Task {
  const float* q;   // first query head of the group, heads Dk apart
  float* out;       // its output, heads Dv apart
  const int32_t* blocks;
  int64_t lo, hi;   // key positions [lo, hi]
};

typedef float v16 __attribute__((vector_size(64)));
RLH_KCPU_INLINE v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
RLH_KCPU_INLINE void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
const float* const kE4m3 = e4m3_values().data();
// 16 e4m3 codes as floats, in vector arithmetic rather than 16 table loads (the table made the
// FP8 cache's attention ~1.45x slower at batch 16). A normal code's 7 magnitude bits placed as a
// float32's exponent and top mantissa bits, with the exponent rebiased (+120), are its value; a
// subnormal one (exponent 0) is its mantissa times 2^-9, converted (a float32 subnormal in
// between would cost a microcode assist per element). Then the sign, and NaN for S.1111.111.
typedef uint32_t u16x __attribute__((vector_size(64)));
RLH_KCPU_INLINE v16 load16(const uint8_t* p) {
  u16x c;
  for (int i = 0; i < 16; ++i) c[i] = p[i];
  const u16x mag = c & 0x7Fu;
  const u16x normal = (mag << 20) + (120u << 23);  // (a vector cast below reinterprets the bits)
  const u16x sub = (u16x)(__builtin_convertvector(mag, v16) * 0x1p-9f);
  const u16x is_sub = (u16x)(mag < 8u), nan = (u16x)(mag == 0x7Fu);  // all ones where true
  const u16x bits = ((sub & is_sub) | (normal & ~is_sub)) | ((c & 0x80u) << 24);
  return (v16)((bits & ~nan) | (nan & 0x7FC00000u));
}
RLH_KCPU_INLINE float value(float x) { return x; }
RLH_KCPU_INLINE float value(uint8_t c) { return kE4m3[c]; }

// The caches as T: float, or e4m3 codes (uint8_t).
template <class T>
const T* keys_of(const PagedAttentionArgs& a) {
  if constexpr (std::is_same_v<T, float>) return a.k;
  else return a.k8;
}
template <class T>
const T* values_of(const PagedAttentionArgs& a) {
  if constexpr (std::is_same_v<T, float>) return a.v;
  else return a.v8;
}

// The default 16-token blocks: a block's scores for one query head in one register, summed over
// d in order, as the generic loop below sums them. (Kept in memory between the d steps, as the
// generic loop keeps them, attention was ~15 % of a tiny-model step at batch 16; with this and
// weighted_values the tiny model decodes ~20 % faster.)
template <class T>
RLH_KCPU_INLINE void block_scores16(float* sg, const float* q, const T* Kt, int64_t D) {
  v16 acc = {};
  for (int64_t d = 0; d < D; ++d) acc += q[d] * load16(Kt + d * 16);
  store16(sg, acc);
}

// o[0:16 NV] = sum over live positions c of w[c] * v[c], in position order, times inv: the
// generic loop's order, with the sums held in NV registers instead of in memory between keys
// and the block walked by pointer. Values of a block are rows of Dv = 16 NV floats.
template <int NV, class T>
RLH_KCPU_INLINE void weighted_values(float* o, const float* sg, int64_t first, int64_t c0, int64_t c1,
                                    const int32_t* blocks, const PagedAttentionArgs& a, int64_t h,
                                    int64_t bs, float inv) {
  v16 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = v16{};
  const int64_t Dv = 16 * NV;
  for (int64_t c = c0; c <= c1;) {
    const int64_t p = first + c, slot = p % bs, n = std::min(bs - slot, c1 - c + 1);
    const T* vr = values_of<T>(a) + blocks[p / bs] * a.v_block + (h * bs + slot) * Dv;
    for (int64_t i = 0; i < n; ++i, vr += Dv) {
      const float w = sg[c + i];
      for (int j = 0; j < NV; ++j) acc[j] += w * load16(vr + 16 * j);
    }
    c += n;
  }
  for (int j = 0; j < NV; ++j) store16(o + 16 * j, acc[j] * inv);
}

// Scores, softmax and output of one (row, kv head) task; s holds G * (hi - lo + 1 + bs) floats.
template <class T>
RLH_KCPU_INLINE void attend_body(const Task& t, const PagedAttentionArgs& a, int64_t h, int64_t G, float* s) {
  const int64_t D = a.Dk, Dv = a.Dv, bs = a.bs;
  constexpr bool fp8 = std::is_same_v<T, uint8_t>;
  const float scale = fp8 ? a.scale * a.k_scale : a.scale;
  const int64_t b0 = t.lo / bs, b1 = t.hi / bs;  // blocks touched
  const int64_t first = b0 * bs;                 // position of score column 0
  const int64_t width = (b1 - b0 + 1) * bs;      // score columns per query head
  // Scores of whole blocks: s[g][c] for positions first + c.
  for (int64_t b = b0; b <= b1; ++b) {
    const T* Kt = keys_of<T>(a) + t.blocks[b] * a.k_block + h * D * bs;  // [D][bs]
    for (int64_t g = 0; g < G; ++g) {
      const float* q = t.q + g * D;
      float* sg = s + g * width + (b - b0) * bs;
      if (bs == 16) {
        block_scores16(sg, q, Kt, D);
        continue;
      }
      for (int64_t c = 0; c < bs; ++c) sg[c] = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float qd = q[d];
        const T* kd = Kt + d * bs;
#pragma omp simd
        for (int64_t c = 0; c < bs; ++c) sg[c] += qd * value(kd[c]);
      }
    }
  }
  const int64_t c0 = t.lo - first, c1 = t.hi - first;  // live columns [c0, c1]
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * width;
    float mx = -INFINITY;
    if (a.softcap > 0)  // the training kernel's order: scale, then the cap (attention.cpp)
      for (int64_t c = c0; c <= c1; ++c) sg[c] = a.softcap * std::tanh(sg[c] * scale / a.softcap);
    else
      for (int64_t c = c0; c <= c1; ++c) sg[c] *= scale;
    for (int64_t c = c0; c <= c1; ++c) mx = std::max(mx, sg[c]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = c0; c <= c1; ++c) {
      sg[c] = exp_f(sg[c] - mx);
      sum += sg[c];
    }
    const float inv = fp8 ? a.v_scale / sum : 1.f / sum;
    float* o = t.out + g * Dv;
    switch (Dv % 16 ? 0 : Dv / 16) {  // widths of up to 128 in registers
      case 1: weighted_values<1, T>(o, sg, first, c0, c1, t.blocks, a, h, bs, inv); continue;
      case 2: weighted_values<2, T>(o, sg, first, c0, c1, t.blocks, a, h, bs, inv); continue;
      case 4: weighted_values<4, T>(o, sg, first, c0, c1, t.blocks, a, h, bs, inv); continue;
      case 8: weighted_values<8, T>(o, sg, first, c0, c1, t.blocks, a, h, bs, inv); continue;
      default: break;
    }
    for (int64_t d = 0; d < Dv; ++d) o[d] = 0.f;
    for (int64_t c = c0; c <= c1; ++c) {
      const int64_t p = first + c;
      const T* vr = values_of<T>(a) + t.blocks[p / bs] * a.v_block + (h * bs + p % bs) * Dv;
      const float w = sg[c];
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) o[d] += w * value(vr[d]);
    }
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
  }
}

using AttendFn = void (*)(const Task&, const PagedAttentionArgs&, int64_t, int64_t, float*);
template <class T>
RLH_KCPU_TARGET_AVX512 void attend_avx512(const Task& t, const PagedAttentionArgs& a, int64_t h, int64_t G,
                                          float* s) {
  attend_body<T>(t, a, h, G, s);
}
template <class T>
RLH_KCPU_TARGET_AVX2 void attend_avx2(const Task& t, const PagedAttentionArgs& a, int64_t h, int64_t G, float* s) {
  attend_body<T>(t, a, h, G, s);
}
template <class T>
void attend_generic(const Task& t, const PagedAttentionArgs& a, int64_t h, int64_t G, float* s) {
  attend_body<T>(t, a, h, G, s);
}

}  // namespace

void paged_attention(const PagedAttentionArgs& a, WorkerPool& pool) {
  static const AttendFn attend32 = dispatch(&attend_avx512<float>, &attend_avx2<float>, &attend_generic<float>);
  static const AttendFn attend8 = dispatch(&attend_avx512<uint8_t>, &attend_avx2<uint8_t>, &attend_generic<uint8_t>);
  const AttendFn attend = a.k8 ? attend8 : attend32;
  if (!a.k8 != !a.v8) throw std::invalid_argument("paged_attention: both caches float32 or both e4m3");
  const int64_t Hkv = a.Hkv, D = a.Dk, bs = a.bs, Dv = a.Dv, Hq = a.Hq, R = a.R, window = a.window;
  if (Hkv < 1 || Hq % Hkv) throw std::invalid_argument("paged_attention: Hq must be a multiple of Hkv");
  if (bs < 1) throw std::invalid_argument("paged_attention: block size must be >= 1");
  const int64_t G = Hq / Hkv, tasks = R * Hkv;
  int64_t longest = 0;
  for (int64_t r = 0; r < R; ++r) {
    if (a.pos[r] < 0 || a.pos[r] / bs >= a.table_width)
      throw std::invalid_argument("paged_attention: row " + std::to_string(r) + " at position " +
                                  std::to_string(a.pos[r]) + " is outside its block table");
    longest = std::max<int64_t>(longest, a.pos[r] + 1);
  }
  // Enough score columns for the widest row: its keys plus a partial block at each end.
  const size_t per_thread = size_t(G * (std::min(longest, window > 0 ? window : longest) + 2 * bs));
  // Work per task is ~ keys * G * (Dk + Dv): few tasks with short contexts run on one thread.
  int64_t work = 0;
  for (int64_t r = 0; r < R; ++r) work += std::min<int64_t>(a.pos[r] + 1, window > 0 ? window : a.pos[r] + 1);
  work *= Hq * (D + Dv) / 2;
  const int threads = !omp_in_parallel() && tasks > 1 && work > (1 << 16) ? pool.threads() : 1;
  // Scores, one slice per worker; kept by the calling thread from call to call.
  thread_local std::vector<float> scratch;
  if (scratch.size() < size_t(threads) * per_thread) scratch.resize(size_t(threads) * per_thread);
  float* const scores = scratch.data();  // by pointer: in a worker, `scratch` names its own
  auto task = [&](int64_t i, int worker) {
    const int64_t r = i / Hkv, h = i % Hkv;
    const int64_t pos = a.pos[r];
    Task t;
    t.q = a.q + r * a.ldq + h * G * D;
    t.out = a.out + r * a.ldo + h * G * Dv;
    t.blocks = a.blocks + r * a.ld_blocks;
    t.hi = pos;
    t.lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    attend(t, a, h, G, scores + size_t(worker) * per_thread);
  };
  if (threads > 1) {
    pool.parallel_for(tasks, task);
  } else {
    for (int64_t i = 0; i < tasks; ++i) task(i, 0);
  }
}

}  // namespace rlh::kcpu
