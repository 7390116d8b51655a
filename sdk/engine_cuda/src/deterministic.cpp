// The deterministic mode's forward-only calls (CudaEngineOptions::batch_invariant): the trainer's
// logprobs bitwise the GPU generator's in its own deterministic mode (docs/engine_cuda.md,
// "Deterministic mode").
//
// Why this shape: the generator computes a token's logprob from its KV cache, one row at a
// time, with kernels whose result for a row depends on that row alone (the batch-invariant gemm,
// paged_attention with batch_invariant = 1, the row-wise ops, the `sample` op). The trainer
// scores whole packed sequences. Both run the same layer program, so they agree bitwise when
// every step computes a row the same way:
// - the products: `forward` swaps in the DeviceOps that resolve gemm with batch_invariant = 1
//   (each row of C a fixed-order sum over K, whatever M: the trainer's N rows and the
//   generator's step rows give the same bits); the fused gemm_glu declines there, as it does in
//   the generator;
// - attention: the generator's paged_attention over this call's keys and values, written with
//   kv_cache_write into a cache of the generator's layout ([block][kv head][slot][D], blocks of
//   kBlock positions, each sequence's blocks in a row), every token a query at its position
//   within its sequence; the kernel's tiles and partitions are cut at absolute positions, so a
//   query sees its keys in the order the generator's decode step did;
// - the head: the logits by the batch-invariant gemm into an f32 tile, then the `sample` op
//   scoring the given next tokens (no draw) with the request's temperature and the model's
//   soft-cap: the generator's log-sum-exp, partition for partition.
// The other ops (embedding, norms, RoPE, GLU, adds, the MoE router and grouped GEMMs, MLA's
// products) are already per row and the same calls in both. The cost: attention reads each
// query's whole prefix from the cache (the decode kernel's access pattern), and the products run
// at the invariant gemm's speed; training steps keep the fast kernels.
#include <algorithm>
#include <stdexcept>

#include "cuda_engine_impl.hpp"

namespace rlh::engine {

using cuda::check;

namespace {
constexpr int64_t kBlock = 16;                          // the generator's default block size
constexpr int64_t kHeadTileBytes = int64_t(256) << 20;  // the head's f32 logits tile at most
}  // namespace

// Slots and block tables of this call: sequence s's tokens in blocks base_s .. base_s + nb_s - 1
// (base_s the blocks of the sequences before it), token t at slot base_s kBlock + t, and every
// token's table row that sequence's blocks (det_width wide, the longest sequence's count).
// paged_attention takes a table row per query, so the tables hold N x det_width int32: 16 MiB
// for 16K tokens of 4K-token sequences, but 1 GiB for a 64K-token sequence; bounding them
// (queries in chunks of rows) is left for when such batches need this mode.
void CudaEngine::Impl::det_prepare(const MicroBatch& mb) {
  const int64_t N = mb.num_tokens(), S = mb.num_sequences();
  int64_t width = 1, blocks = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nb = (int64_t(mb.cu_seqlens[size_t(s) + 1]) - mb.cu_seqlens[size_t(s)] + kBlock - 1) / kBlock;
    width = std::max(width, nb);
    blocks += nb;
  }
  det_host.assign(size_t(N * (1 + width)), 0);
  int32_t* slots = det_host.data();
  int32_t* table = slots + N;
  int64_t base = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t b = mb.cu_seqlens[size_t(s)], e = mb.cu_seqlens[size_t(s) + 1], nb = (e - b + kBlock - 1) / kBlock;
    for (int64_t t = b; t < e; ++t) {
      slots[t] = int32_t(base * kBlock + (t - b));
      for (int64_t j = 0; j < nb; ++j) table[t * width + j] = int32_t(base + j);
    }
    base += nb;
  }
  const size_t bytes = det_host.size() * sizeof(int32_t);
  if (det_index.size() < bytes) det_index = cuda::DeviceBuffer(counters, bytes);
  // pageable source: the copy is staged before the call returns, so det_host may change after
  check(cudaMemcpyAsync(det_index.get(), det_host.data(), bytes, cudaMemcpyHostToDevice, stream), "upload");
  det_width = width;
  det_blocks = blocks;
}

void CudaEngine::Impl::det_attention(const cuda::DeviceOps::Attention& at) {
  const int64_t N = at.N;
  cuda::DeviceOps::PagedCache c;
  c.num_blocks = det_blocks;
  c.block_size = kBlock;
  c.Hkv = at.Hkv;
  c.Dk = at.Dk;
  c.Dv = at.Dv;
  c.block_stride = at.Hkv * kBlock * (at.Dk + at.Dv);  // keys then values, as the generator's pool
  const size_t bytes = size_t(det_blocks * c.block_stride) * sizeof(bf16);
  if (det_kv.size() < bytes) det_kv = cuda::DeviceBuffer(counters, bytes);  // grows to the largest call
  bf16* base = det_kv.get<bf16>();
  c.k = base;
  c.v = base + at.Hkv * kBlock * at.Dk;
  const int32_t* slots = det_index.get<int32_t>();
  const int32_t* table = slots + N;
  det_ops->kv_cache_write(at.k, at.ldk, at.v, at.ldv, N, slots, c);
  det_ops->paged_attention(at.o, at.ldo, at.q, at.ldq, N, at.Hq, c, table, det_width, pos, at.scale, at.window,
                           at.softcap);
}

void CudaEngine::Impl::det_head(const OutputRequest& req, int64_t N) {
  // The entropy (when asked) from the registry's fused op, whose logprobs the next lines replace.
  if (req.entropy) ops->logprob_fwd(head_args(req, N, false));
  if (!req.logprob) return;
  const int64_t rows = std::clamp<int64_t>(kHeadTileBytes / (V * 4), 1, N);
  // rows f64 zero uniforms | [rows, V] f32 logits | rows int32 tokens, each part 256-byte aligned
  const auto up = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t at_logits = up(size_t(rows) * 8), at_tok = at_logits + up(size_t(rows * V) * 4);
  const size_t bytes = at_tok + size_t(rows) * 4;
  if (det_head_buf.size() < bytes) det_head_buf = cuda::DeviceBuffer(counters, bytes);
  char* base = det_head_buf.get<char>();
  double* u = reinterpret_cast<double*>(base);
  // zero every call: a call with more rows lays its uniforms over an earlier call's logits (the
  // op reads no uniforms when it scores given ids, but its operand is still a valid one)
  check(cudaMemsetAsync(u, 0, size_t(rows) * 8, stream), "clear");
  float* logits = reinterpret_cast<float*>(base + at_logits);
  int32_t* tok = reinterpret_cast<int32_t*>(base + at_tok);
  cuda::DeviceOps::Sample s;
  s.temperature = req.temperature;
  s.softcap = prog.logit_softcap;
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t n = std::min(rows, N - n0);
    det_ops->gemm(false, true, n, V, C, xn + n0 * C, C, wp(prog.head), C, 0, logits, V, true);
    det_ops->sample(tok, lp + n0, logits, V, n, V, u, s, target + n0);
  }
}

}  // namespace rlh::engine
