// The fused linear + logprob head without [N, V] logits: row blocks of up to 4096 tokens times
// vocabulary chunks, each chunk's logits an fp32 tile from one cuBLASLt GEMM (bf16 operands,
// fp32 accumulation and output; fp32 GEMM for the f32 op), reduced by an online log-sum-exp
// across chunks (forward) or turned into the chunk's logits gradient and fed to two more GEMMs
// (backward: dh accumulated in an fp32 buffer across chunks, dW += dlogits^T h chunk by
// chunk). The tile is at most chunk_bytes (0 = 32 MiB). With a logits cache (an engine's
// training step) the forward's tiles stay in it for the backward. Filtering (top_k/top_p) is
// not offered here (the plugin answers UNIMPLEMENTED for it). Soft-capping (Gemma-2) is applied
// by the tile kernels to the uncapped GEMM tile (which the cache holds), so the backward's
// 1 / cosh^2 is taken of the uncapped logit.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "rlhost/kernels_cuda/kernels.hpp"

namespace rlh::kcuda {
namespace {

struct Tiling {
  int64_t rows, cols;
};

Tiling tiling(const LogprobArgs& a) {
  const int64_t bytes = a.chunk_bytes > 0 ? a.chunk_bytes : (int64_t(32) << 20);
  int64_t rows = std::min<int64_t>(a.N, 4096);
  rows = std::max<int64_t>(1, std::min<int64_t>(rows, bytes / 4));
  int64_t cols = std::max<int64_t>(1, bytes / (4 * rows));
  if (cols >= 128) cols = cols / 64 * 64;  // GEMM-friendly widths
  cols = std::min(cols, a.V);
  return {rows, cols};
}

void check(const LogprobArgs& a) {
  if (a.temperature <= 0) throw std::invalid_argument("linear_logprob: temperature must be > 0");
  if (!(a.softcap >= 0) || !std::isfinite(a.softcap))
    throw std::invalid_argument("linear_logprob: softcap must be a finite number >= 0");
  if (a.logits_cache && a.ld_cache < a.V)
    throw std::invalid_argument("linear_logprob: ld_cache is smaller than the vocabulary");
}

}  // namespace

void linear_logprob_fwd(GemmEngine* g, const LogprobArgs& a, Workspace& ws, cudaStream_t s) {
  check(a);
  if (a.N == 0) return;
  if (a.V == 0) throw std::invalid_argument("linear_logprob: empty vocabulary");
  const Tiling t = tiling(a);
  const size_t es = dtype_size(a.t);
  auto* tile = a.logits_cache ? nullptr : static_cast<float*>(ws.get(size_t(t.rows * t.cols) * 4));
  auto* st = static_cast<float*>(ws.get(size_t(a.N) * (3 + a.K) * 4));
  float *m = st, *sum = st + a.N, *tz = st + 2 * a.N, *zt = st + 3 * a.N;
  const float inv_temp = float(1.0 / a.temperature);
  for (int64_t r0 = 0; r0 < a.N; r0 += t.rows) {
    const int64_t rows = std::min(t.rows, a.N - r0);
    for (int64_t v0 = 0; v0 < a.V; v0 += t.cols) {
      const int64_t cols = std::min(t.cols, a.V - v0);
      float* logits = a.logits_cache ? a.logits_cache + r0 * a.ld_cache + v0 : tile;
      const int64_t ld = a.logits_cache ? a.ld_cache : cols;
      GemmArgs gm;
      gm.ta = false;
      gm.tb = true;
      gm.M = rows;
      gm.N = cols;
      gm.K = a.C;
      gm.A = static_cast<const char*>(a.h) + size_t(r0 * a.C) * es;
      gm.lda = a.C;
      gm.B = static_cast<const char*>(a.W) + size_t(v0 * a.C) * es;
      gm.ldb = a.C;
      gm.C = logits;
      gm.ldc = ld;
      gm.ab = a.t;
      gm.c_dt = DType::f32;
      gemm(g, gm, ws, s);
      logprob_tile_stats(logits, rows, cols, ld, v0, a.target + r0 * a.K, a.K, inv_temp, a.softcap, m + r0,
                         sum + r0, tz + r0, zt + r0 * a.K, v0 == 0, a.err, a.V, s);
    }
  }
  logprob_finish(m, sum, tz, zt, a.target, a.N, a.K, a.logprob, a.lse, a.entropy, s);
}

void linear_logprob_bwd(GemmEngine* g, const LogprobArgs& a, Workspace& ws, cudaStream_t s) {
  check(a);
  if (a.N == 0) return;
  if (a.dentropy.p && !a.entropy.p)
    throw std::invalid_argument("linear_logprob_bwd: entropy must be given with dentropy");
  const Tiling t = tiling(a);
  const size_t es = dtype_size(a.t);
  auto* tile = a.logits_cache ? nullptr : static_cast<float*>(ws.get(size_t(t.rows * t.cols) * 4));
  void* dlogits = ws.get(size_t(t.rows * t.cols) * es);
  auto* dh_acc = static_cast<float*>(ws.get(size_t(t.rows * a.C) * 4));
  const float inv_temp = float(1.0 / a.temperature);
  const auto lse_at = [](Flex f, int64_t r0) {  // row r0 of a per-row operand
    Flex o = f;
    if (o.p) o.p = static_cast<char*>(o.p) + size_t(r0) * (o.bf16 ? 2 : 4);
    return o;
  };
  for (int64_t r0 = 0; r0 < a.N; r0 += t.rows) {
    const int64_t rows = std::min(t.rows, a.N - r0);
    const void* hb = static_cast<const char*>(a.h) + size_t(r0 * a.C) * es;
    for (int64_t v0 = 0; v0 < a.V; v0 += t.cols) {
      const int64_t cols = std::min(t.cols, a.V - v0);
      const void* Wb = static_cast<const char*>(a.W) + size_t(v0 * a.C) * es;
      float* logits = a.logits_cache ? a.logits_cache + r0 * a.ld_cache + v0 : tile;
      const int64_t ld = a.logits_cache ? a.ld_cache : cols;
      if (!a.logits_cache) {  // the forward's tile again
        GemmArgs gm;
        gm.tb = true;
        gm.M = rows;
        gm.N = cols;
        gm.K = a.C;
        gm.A = hb;
        gm.lda = a.C;
        gm.B = Wb;
        gm.ldb = a.C;
        gm.C = logits;
        gm.ldc = cols;
        gm.ab = a.t;
        gm.c_dt = DType::f32;
        gemm(g, gm, ws, s);
      }
      logprob_tile_grad(a.t, logits, rows, cols, ld, v0, a.target + r0 * a.K, a.K, inv_temp, a.softcap,
                        lse_at(a.lse, r0), lse_at(a.dlogprob, r0 * a.K), lse_at(a.entropy, r0),
                        lse_at(a.dentropy, r0), dlogits, cols, s);
      GemmArgs gh;  // dh_acc (+)= dlogits W_chunk
      gh.M = rows;
      gh.N = a.C;
      gh.K = cols;
      gh.A = dlogits;
      gh.lda = cols;
      gh.B = Wb;
      gh.ldb = a.C;
      gh.C = dh_acc;
      gh.ldc = a.C;
      gh.beta = v0 == 0 ? 0.0 : 1.0;
      gh.ab = a.t;
      gh.c_dt = DType::f32;
      gemm(g, gh, ws, s);
      if (a.dW.p) {
        GemmArgs gw;  // dW_chunk += dlogits^T h_block
        gw.ta = true;
        gw.M = cols;
        gw.N = a.C;
        gw.K = rows;
        gw.A = dlogits;
        gw.lda = cols;
        gw.B = hb;
        gw.ldb = a.C;
        gw.C = static_cast<char*>(a.dW.p) + size_t(v0 * a.C) * (a.dW.bf16 ? 2 : 4);
        gw.ldc = a.C;
        gw.beta = 1.0;
        gw.ab = a.t;
        gw.c_dt = a.dW.bf16 ? DType::bf16 : DType::f32;
        gemm(g, gw, ws, s);
      }
    }
    store_rows(a.t, static_cast<char*>(a.dh) + size_t(r0 * a.C) * es, dh_acc, rows * a.C,
               a.accumulate, s);
  }
}

}  // namespace rlh::kcuda
