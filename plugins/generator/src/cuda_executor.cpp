// The generator's CUDA executor (cuda_executor.hpp): the layer program (program_runner.hpp) in
// bf16 on one device, every op the device registry's through DeviceOps, decoding steps replayed
// as CUDA graphs.
//
// Memory is planned once, at construction, for max_num_batched_tokens rows (prefill chunks) and
// max_num_seqs sampling rows, so no step allocates: the residual stream and one layer's values
// (bf16), MLA and MoE scratch, the head's f32 logits, the step's inputs (ids, positions, cache
// slots, block tables, sampling rows, uniforms) and one op workspace. The block tables' width
// follows the longest sequence of a generate() call (begin_generate). The KV pool is allocated
// at the first generate() and kept (its addresses are in the captured graphs); with
// kv_cache_sleep its memory is given back between calls and its addresses kept (kv_pool_cuda.hpp).
//
// Why the pieces are as they are:
// - Weights are a bf16 copy of the host's Weights in the same arena layout, so the program's
//   adjacency rule (q|k|v, gate|up as one product) holds on the device unchanged. A new set in
//   force (a load, a completed refit) is converted and copied before the next step, in place:
//   the graphs keep their pointers.
// - One host wait per step: the sampled tokens and logprobs come back (the scheduler needs them
//   to plan the next step), as in vLLM. Inputs go up with a few asynchronous copies from
//   page-locked staging.
// - Decoding steps (every row one token that samples) are the steady state and are a few hundred
//   small launches each at small batch: they run as a graph per padded batch bucket (powers of
//   two up to max_num_seqs) and block-table width class (powers of two). A bucket's first step
//   runs op by op (resolving ops and GEMM plans), then the graph is captured; padding rows read
//   block 0 at position 0 and write nowhere (slot -1), and their tokens are not drawn. Prefill
//   steps (chunked prompts, recomputation) run op by op.
// - The head's logits are f32 from bf16 operands (cuBLASLt writes C in f32); the draw is the
//   registry's `sample` op with the CPU generator's uniforms (rng.hpp), so the same seeded
//   counter draws pick the tokens.
#include "rlhost/generator/cuda_executor.hpp"

#include "kv_pool_cuda.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "rlhost/engine_cuda/convert.hpp"
#include "rlhost/engine_cuda/cuda_engine.hpp"
#include "rlhost/engine_cuda/device_ops.hpp"
#include "rlhost/engine_cuda/fp8_linear.hpp"
#include "rlhost/generator/program_runner.hpp"
#include "rlhost/sdk/kernel_registry.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::gen {

namespace {

using engine::cuda::DeviceOps;
using sdk::Error;

struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2, "bf16 element");

void ck(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a sticky launch error where possible
    throw Error(RLH_E_INTERNAL, "generator (cuda): " + what + ": " + cudaGetErrorString(e));
  }
}

std::string mib(int64_t bytes) { return std::to_string((bytes + (1 << 19)) >> 20) + " MiB"; }

// float -> bf16, round to nearest even; NaN stays NaN.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// One device allocation, freed on destruction; an allocation that does not fit is a one-line
// error naming what it was for.
class DevBuf {
 public:
  DevBuf() = default;
  DevBuf(size_t bytes, const std::string& what) { alloc(bytes, what); }
  ~DevBuf() { reset(); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void alloc(size_t bytes, const std::string& what) {
    reset();
    if (bytes == 0) return;
    const cudaError_t e = cudaMalloc(&p_, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      p_ = nullptr;
      throw Error(RLH_E_RESOURCE_EXHAUSTED, "generator (cuda): cannot allocate " + mib(int64_t(bytes)) + " for " +
                                                what + ": " + cudaGetErrorString(e));
    }
    n_ = bytes;
  }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  template <class T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

class PinnedBuf {
 public:
  PinnedBuf() = default;
  ~PinnedBuf() { reset(); }
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
  void alloc(size_t bytes) {
    reset();
    if (bytes) ck(cudaMallocHost(&p_, bytes), "page-locked staging of " + mib(int64_t(bytes)));
    n_ = bytes;
  }
  void reset() {
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    n_ = 0;
  }
  template <class T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Carves one allocation into aligned pieces: a first pass counts, a second hands out pointers.
class Carver {
 public:
  explicit Carver(char* base = nullptr) : base_(base) {}
  template <class T>
  T* take(int64_t n) {
    at_ = (at_ + 255) / 256 * 256;  // every piece 256-byte aligned (vector loads, cuBLASLt)
    T* p = base_ ? reinterpret_cast<T*>(base_ + at_) : nullptr;
    at_ += size_t(std::max<int64_t>(n, 0)) * sizeof(T);
    return p;
  }
  size_t size() const { return (at_ + 255) / 256 * 256; }

 private:
  char* base_;
  size_t at_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Device buffers of a step, as the backend reads them.

struct StepBuffers {
  // activations
  Bf16* xs[2] = {nullptr, nullptr};
  Bf16* values = nullptr;
  Bf16* mla = nullptr;
  Bf16* hs = nullptr;
  Bf16* xn = nullptr;
  Bf16* normed[2] = {nullptr, nullptr};  // a layer's first norm, written by the last layer's add
  float* logits = nullptr;
  // MoE scratch
  float *z = nullptr, *probs = nullptr, *wts = nullptr, *sgl = nullptr, *sgw = nullptr, *sgp = nullptr;
  int32_t *experts = nullptr, *row = nullptr, *offsets = nullptr, *srow = nullptr, *szero = nullptr;
  Bf16 *xp = nullptr, *gu = nullptr, *act = nullptr, *yp = nullptr, *sgu = nullptr, *sa = nullptr, *sy = nullptr;
  // inputs (layout_inputs: fixed addresses, or packed a step with a graph reading its bucket's)
  int32_t *ids = nullptr, *pos = nullptr, *slots = nullptr, *sample_rows = nullptr, *table = nullptr;
  double* u = nullptr;
  int32_t* tokens = nullptr;  // a step's S tokens, then their S logprobs (float)
};

// ProgramRunner's backend on the device (its interface: program_runner.hpp).
class CudaBackend {
 public:
  using T = Bf16;
  CudaBackend(const DecodeModel& m, DeviceOps& ops, cudaStream_t s) : m_(m), ops_(ops), s_(s) {}

  // Where things are; set by the executor.
  StepBuffers* buf = nullptr;
  const Bf16* weights = nullptr;
  std::vector<const float*> w_f32;       // per parameter: its f32 copy (router and selection biases) or null
  std::vector<const float*> inv_freq;    // per RoPE table, on the device
  void* kv_pool = nullptr;
  const KvLayout* kv = nullptr;
  int64_t kv_blocks = 0;
  const float* kv_scales = nullptr;  // FP8 caches: k_scale, v_scale (device); null: bf16 caches
  // The step: the block tables' row width, whether the sampling rows are all rows in order
  // (decoding), and how many rows sample.
  int64_t width = 1;
  bool rows_sample_in_order = false;
  int64_t samples = 0;

  const Bf16* w(int64_t p) const { return p < 0 ? nullptr : weights + m_.weights().arena_offset(size_t(p)); }
  Bf16* residual(int i) { return buf->xs[i]; }
  Bf16* values() { return buf->values; }
  Bf16* mla_scratch() { return buf->mla; }
  Bf16* head_scratch() { return buf->xn; }
  void embed(Bf16* x, int64_t R) {
    ops_.embedding_fwd(x, buf->ids, w(m_.program().embed), R, m_.hidden(), m_.vocab());
  }
  // The embedding's scale (Gemma's sqrt(hidden)) as bf16 holds it: HF's bf16 model multiplies
  // by torch.tensor(sqrt(hidden), dtype=bfloat16), and so does the CUDA engine.
  void scale(Bf16* x, int64_t n, double s) {
    const uint32_t bits = uint32_t(to_bf16(float(s))) << 16;
    float r;
    std::memcpy(&r, &bits, 4);
    ops_.scale(x, n, double(r));
  }
  void norm(Bf16* y, int64_t ldy, const Bf16* x, int64_t ldx, const Bf16* wt, int64_t R, int64_t C, float eps,
            float offset) {
    DeviceOps::Fp8Producer p{DeviceOps::Producer::rmsnorm, x, ldx, nullptr, nullptr, wt, eps, offset, y, ldy};
    if (produce_fp8(std::exchange(feeds_, nullptr), p, y, ldy, R, C)) return;
    ops_.rmsnorm_fwd(y, ldy, nullptr, x, ldx, wt, R, C, eps, offset);
  }
  // FP8 rollouts: the products whose weights have an FP8 copy (fp8_weights, made per weight set)
  // run through the registry's FP8 GEMM, the activations quantised per step; the rest in bf16.
  engine::cuda::Fp8Linears* fp8 = nullptr;
  const std::unordered_set<const Bf16*>* fp8_weights = nullptr;
  void linear(Bf16* y, int64_t ldy, const Bf16* x, int64_t ldx, const Bf16* W, int64_t R, int64_t N, int64_t K) {
    feeds_ = nullptr;
    if (fp8 && fp8_weights->count(W) && fp8->fits_group(N, ldy) &&
        fp8->input(reinterpret_cast<const uint16_t*>(x), ldx, R, K)) {
      fp8->forward(reinterpret_cast<const uint16_t*>(W), N, reinterpret_cast<uint16_t*>(y), ldy);
      return;
    }
    if (fp8) fp8->drop_produced();  // (x's codes, if a producer wrote them, are for this product only)
    ops_.gemm(false, true, R, N, K, x, ldx, W, K, 0.0, y, ldy, false);
  }
  // The runner's word that the next producer (norm, add_norm, glu) makes the input of the
  // product of W, which runs right after it. In FP8 rollouts, where that product is FP8 and its
  // input would be quantised (past the weight-only rows), the producer writes the codes and
  // scales too, through the provider's quantize_fp8 fused with it (vendor_fp8's `producer`), and
  // the product takes them: no quantisation pass (at 64-256 rows ~5 us each, three of a layer's
  // four). Where no provider offers the form, the op and the pass run as before.
  const Bf16* feeds_ = nullptr;
  void feeds_product(const Bf16* W) { feeds_ = W; }
  bool produce_fp8(const Bf16* W, DeviceOps::Fp8Producer& p, const Bf16* y, int64_t ldy, int64_t R, int64_t C) {
    if (!W || !fp8 || !fp8_weights->count(W) || no_fp8_producer) return false;
    void* q = nullptr;
    float* scale = nullptr;
    if (!fp8->input_buffers(R, C, &q, &scale)) return false;
    if (!ops_.quantize_fp8_producer(p, R, C, DeviceOps::Fp8::e4m3, q, scale)) {
      const int k = int(p.kind) - 1;
      if (!producer_logged[k] && log) {  // once a form: why the provider's answer is the op and a pass
        producer_logged[k] = true;
        log("generator (cuda): FP8 rollouts quantise the " + std::string(kProducerNames[k]) +
            " output in a pass of its own: " + ops_.producer_refusal(p.kind, DeviceOps::Fp8::e4m3));
      }
      return false;
    }
    fp8->input_produced(reinterpret_cast<const uint16_t*>(y), ldy, R, C);
    ++fp8_produced[int(p.kind) - 1];
    return true;
  }
  static constexpr const char* kProducerNames[3] = {"RMSNorm", "residual add + RMSNorm", "SwiGLU"};
  bool no_fp8_producer = false;  // RLH_GEN_FP8_PRODUCER=0: the A/B
  int64_t fp8_produced[3] = {0, 0, 0};  // by producer, those that wrote their product's codes (the stats)
  bool producer_logged[3] = {false, false, false};
  std::function<void(const std::string&)> log;
  void bias_add(Bf16* y, int64_t ldy, const Bf16* b, int64_t R, int64_t N) { ops_.bias_add(false, y, ldy, b, R, N); }
  void rope(int t, Bf16* y, int64_t ldy, const Bf16* x, int64_t ldx, int64_t H, int64_t D, int64_t R) {
    const RopeTable& rp = m_.ropes()[size_t(t)];
    ops_.rope(y, ldy, x, ldx, buf->pos, inv_freq[size_t(t)], R, H, D, rp.R, rp.scale, rp.interleaved, false);
  }
  DeviceOps::PagedCache cache(int64_t l) const {
    const LayerShape& s = m_.shapes()[size_t(l)];
    DeviceOps::PagedCache c;
    char* base = static_cast<char*>(kv_pool) + kv->offset[size_t(l)] * kv->elem_bytes;
    c.k = base;
    c.v = base + s.Hkv * kv->block_size * s.Dk * kv->elem_bytes;
    if (kv_scales) {
      c.k_scale = kv_scales;
      c.v_scale = kv_scales + 1;
    }
    c.num_blocks = kv_blocks;
    c.block_stride = kv->block_elems;
    c.block_size = kv->block_size;
    c.Hkv = s.Hkv;
    c.Dk = s.Dk;
    c.Dv = s.Dv;
    return c;
  }
  void attend(int64_t l, const Bf16* q, int64_t ldq, const Bf16* k, int64_t ldk, const Bf16* v, int64_t ldv, Bf16* o,
              int64_t ldo, int64_t R) {
    const LayerShape& s = m_.shapes()[size_t(l)];
    const DeviceOps::PagedCache c = cache(l);
    // every row's key first: rows of one sequence see each other
    ops_.kv_cache_write(k, ldk, v, ldv, R, buf->slots, c);
    ops_.paged_attention(o, ldo, q, ldq, R, s.Hq, c, buf->table, width, buf->pos, s.scale, s.window, s.softcap);
  }
  // RoPE of q and k, the cache write and attention, with the RoPE and the write as one op where a
  // provider offers it (docs/ops.md rope_kv_cache_write: a launch fewer a layer, bitwise the two).
  bool rope_attend(int t, int64_t l, Bf16* qk, int64_t ldqk, int64_t Hq, int64_t Hk, int64_t D, const Bf16* v,
                   int64_t ldv, Bf16* o, int64_t ldo, int64_t R) {
    const LayerShape& s = m_.shapes()[size_t(l)];
    if (Hk != s.Hkv || D != s.Dk || Hq != s.Hq) return false;
    const RopeTable& rp = m_.ropes()[size_t(t)];
    const DeviceOps::PagedCache c = cache(l);
    if (!ops_.rope_kv_cache_write(qk, ldqk, qk, ldqk, Hq, v, ldv, R, buf->pos, inv_freq[size_t(t)], rp.R, rp.scale,
                                  rp.interleaved, buf->slots, c))
      return false;
    ops_.paged_attention(o, ldo, qk, ldqk, R, s.Hq, c, buf->table, width, buf->pos, s.scale, s.window, s.softcap);
    return true;
  }
  // A whole dense layer for one token in one op (decode_layer_fwd: at batch 1 the step's
  // weights then stream in one persistent launch a layer instead of ~9 kernels). Not in FP8
  // rollouts (their products are the FP8 ones) nor over FP8 caches (its caches are bf16); only
  // with RLH_GEN_FUSED_LAYER=1 for now.
  bool fused_layer_on = false;
  int64_t fused_layers = 0;  // layers run so (the executor's stats)
  bool dense_layer(int64_t l, const DenseLayerPlan& p, const Bf16* x, Bf16* y, int64_t R) {
    if (R != 1 || fp8 != nullptr || kv_scales != nullptr || !fused_layer_on) return false;
    const RopeTable& rp = m_.ropes()[size_t(p.table)];
    DeviceOps::DecodeLayer d;
    d.x = x;
    d.y = y;
    d.norm1 = w(p.norm1);
    d.wqkv = w(p.q);
    d.wo = w(p.o);
    d.norm2 = w(p.norm2);
    d.wgu = w(p.gate);
    d.wdown = w(p.down);
    d.C = m_.hidden();
    d.F = p.F;
    d.Hq = p.Hq;
    d.eps = p.eps1;
    d.eps2 = p.eps2;
    d.offset = p.offset;
    d.rope_scale = rp.scale;
    d.scale = p.scale;
    d.cache = cache(l);
    d.table = buf->table;
    d.width = width;
    d.pos = buf->pos;
    d.slots = buf->slots;
    d.inv_freq = inv_freq[size_t(p.table)];
    if (!ops_.decode_layer(d)) return false;
    ++fused_layers;
    return true;
  }
  void glu(const std::string& act, Bf16* h, int64_t ldh, const Bf16* gu, int64_t ldgu, int64_t R, int64_t F) {
    const Bf16* W = std::exchange(feeds_, nullptr);
    DeviceOps::Fp8Producer p{DeviceOps::Producer::swiglu, gu, ldgu, nullptr, nullptr, nullptr, 0.f, 0.f, h, ldh};
    if (act == "silu" && produce_fp8(W, p, h, ldh, R, F)) return;
    ops_.glu_fwd(act, h, ldh, gu, ldgu, R, F);
  }
  void add(Bf16* y, const Bf16* a, const Bf16* b, int64_t n) { ops_.add(y, a, b, n); }
  bool add_norm(Bf16* y, Bf16* yn, const Bf16* a, const Bf16* b, const Bf16* wt, int64_t R, int64_t C, float eps,
                float offset) {
    DeviceOps::Fp8Producer p{DeviceOps::Producer::add_rmsnorm, a, C, b, y, wt, eps, offset, yn, C};
    if (produce_fp8(std::exchange(feeds_, nullptr), p, yn, C, R, C)) return true;
    return ops_.add_rmsnorm(y, yn, a, b, wt, R, C, eps, offset);
  }
  Bf16* norm_scratch(int i) { return buf->normed[i]; }
  // gate|up and its GLU in one op (not where the weight has an FP8 copy: that product is FP8's).
  bool linear_glu(const std::string& act, Bf16* h, int64_t ldh, const Bf16* x, int64_t ldx, const Bf16* W, int64_t R,
                  int64_t F, int64_t K) {
    if (fp8 && fp8_weights->count(W)) return false;
    return ops_.gemm_glu(act, h, ldh, x, ldx, W, R, F, K);
  }
  // A norm with the product that reads it (and its GLU), and a product with the residual add
  // after it, as one op each (docs/ops.md rmsnorm_gemm_fwd, gemm_add_fwd): at up to kFusedRows
  // rows, where the product is kernels_cuda's few-row one and the norm's and the add's launches
  // are saved (a layer at batch 1 in 7 launches, not 9). Past them the library's GEMMs take the
  // products and the separate ops, with add_norm at the layer boundary, cost the same. Not where
  // the weight has an FP8 copy (that product is FP8's).
  static constexpr int64_t kFusedRows = 4;
  bool norm_linear(const std::string& act, Bf16* h, int64_t ldh, const Bf16* x, const Bf16* wn, const Bf16* W,
                   int64_t R, int64_t N, int64_t K, float eps, float offset) {
    if (R > kFusedRows || (fp8 && fp8_weights->count(W))) return false;
    return ops_.rmsnorm_gemm(act, h, ldh, x, wn, W, R, N, K, eps, offset);
  }
  bool linear_add(Bf16* y, const Bf16* r, const Bf16* x, int64_t ldx, const Bf16* W, int64_t R, int64_t N, int64_t K) {
    if (R > kFusedRows || (fp8 && fp8_weights->count(W))) return false;
    return ops_.gemm_add(y, r, x, ldx, W, R, N, K);
  }
  void copy2d(Bf16* dst, int64_t ldd, const Bf16* src, int64_t lds, int64_t rows, int64_t cols) {
    if (rows == 0 || cols == 0) return;
    ck(cudaMemcpy2DAsync(dst, size_t(ldd) * 2, src, size_t(lds) * 2, size_t(cols) * 2, size_t(rows),
                         cudaMemcpyDeviceToDevice, s_),
       "strided copy");
  }
  void moe(int64_t l, int64_t R, const Bf16* xn, Bf16* y);
  const Bf16* gather_rows(const Bf16* x, int64_t R) {
    if (rows_sample_in_order) return x;
    // The sampling rows of x: an embedding lookup with x as the table.
    ops_.embedding_fwd(buf->hs, buf->sample_rows, x, samples, m_.hidden(), R);
    return buf->hs;
  }
  void logits(const Bf16* xn, const Bf16* W, int64_t S) {
    const int64_t C = m_.hidden(), V = m_.vocab();
    ops_.gemm(false, true, S, V, C, xn, C, W, C, 0.0, buf->logits, V, true);  // f32 [S,V]
  }

 private:
  const DecodeModel& m_;
  DeviceOps& ops_;
  cudaStream_t s_;
};

// The MoE step: the CUDA engine's forward (sdk/engine_cuda/src/moe_layer.cpp) for the step's
// rows: router GEMM to f32 logits, moe_router_fwd, moe_permute_fwd, grouped GEMMs over the
// expert-sorted rows (gate and up into one gate|up buffer, then down), moe_unpermute_fwd; a
// shared expert as a dense GLU MLP, gated by sigmoid(xn ws^T) as a one-expert route added with
// accumulate (Qwen2-MoE) or added whole.
void CudaBackend::moe(int64_t l, int64_t R, const Bf16* xn, Bf16* y) {
  const LayerShape& s = m_.shapes()[size_t(l)];
  const int64_t C = m_.hidden(), E = s.E, K = s.Kx, Fe = s.Fe, Fs = s.Fs, RK = R * K;
  StepBuffers& b = *buf;
  ops_.gemm(false, true, R, E, C, xn, C, w(s.p_router), C, 0.0, b.z, E, true);  // z [R,E] f32
  if (s.p_router_b >= 0) ops_.bias_add(true, b.z, E, w_f32[size_t(s.p_router_b)], R, E);
  DeviceOps::Router r;
  r.N = R;
  r.E = E;
  r.K = K;
  r.scoring = s.router.scoring;
  r.norm_topk_prob = s.router.norm_topk_prob;
  r.scaling_factor = s.router.scaling_factor;
  r.n_group = s.router.n_group;
  r.topk_group = s.router.topk_group;
  ops_.router_fwd(r, b.z, E, s.p_score_bias >= 0 ? w_f32[size_t(s.p_score_bias)] : nullptr, b.wts, b.experts, b.probs,
                  nullptr);
  ops_.permute_fwd(b.xp, b.row, b.offsets, xn, C, b.experts, R, K, C, E);                      // xp [RK,C]
  // gate, then up, of every expert into gu [RK, 2Fe] (expert e's weights [Fe, C] slabs of [E, Fe, C])
  ops_.grouped_gemm(false, true, E, RK, b.offsets, 0, Fe, C, b.xp, C, w(s.p_gate), C, Fe * C, 0.0, b.gu, 2 * Fe, 0,
                    false);
  ops_.grouped_gemm(false, true, E, RK, b.offsets, 0, Fe, C, b.xp, C, w(s.p_up), C, Fe * C, 0.0, b.gu + Fe, 2 * Fe, 0,
                    false);
  ops_.glu_fwd(s.act, b.act, Fe, b.gu, 2 * Fe, RK, Fe);                                         // [RK,Fe]
  ops_.grouped_gemm(false, true, E, RK, b.offsets, 0, C, Fe, b.act, Fe, w(s.p_down), Fe, C * Fe, 0.0, b.yp, C, 0,
                    false);                                                                      // yp [RK,C]
  ops_.unpermute_fwd(y, C, b.yp, b.row, b.wts, R, K, C, false);                                 // y [R,C]
  if (Fs > 0) {
    const Bf16* gp = w(s.p_ws_gate_proj);
    const Bf16* up = w(s.p_ws_up);
    if (up == gp + Fs * C) {
      ops_.gemm(false, true, R, 2 * Fs, C, xn, C, gp, C, 0.0, b.sgu, 2 * Fs, false);            // [R,2Fs]
    } else {
      ops_.gemm(false, true, R, Fs, C, xn, C, gp, C, 0.0, b.sgu, 2 * Fs, false);
      ops_.gemm(false, true, R, Fs, C, xn, C, up, C, 0.0, b.sgu + Fs, 2 * Fs, false);
    }
    ops_.glu_fwd(s.act, b.sa, Fs, b.sgu, 2 * Fs, R, Fs);                                         // [R,Fs]
    ops_.gemm(false, true, R, C, Fs, b.sa, Fs, w(s.p_ws_down), Fs, 0.0, b.sy, C, false);         // sy [R,C]
    if (s.p_ws_gate >= 0) {
      ops_.gemm(false, true, R, 1, C, xn, C, w(s.p_ws_gate), C, 0.0, b.sgl, 1, true);             // [R,1] f32
      DeviceOps::Router g;
      g.N = R;
      g.E = 1;
      g.K = 1;
      g.scoring = 1;  // sigmoid, one expert, one choice: weight = sigmoid(logit)
      ops_.router_fwd(g, b.sgl, 1, nullptr, b.sgw, b.szero, b.sgp, nullptr);
      ops_.unpermute_fwd(y, C, b.sy, b.srow, b.sgw, R, 1, C, true);                              // y += g sy
    } else {
      ops_.add(y, y, b.sy, R * C);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The executor

struct GraphKey {
  int64_t rows, width;
  bool operator<(const GraphKey& o) const { return rows != o.rows ? rows < o.rows : width < o.width; }
};

class CudaExecutor final : public StepExecutor, public DeviceWeightSink {
 public:
  CudaExecutor(DecodeModel& m, CudaExecutorOptions o) : m_(m), opt_(std::move(o)) {
    std::string why;
    if (!cuda_generator_available(&why, opt_.device)) throw Error(RLH_E_UNAVAILABLE, "generator (cuda): " + why);
    if (!opt_.kernels) throw Error(RLH_E_INVALID_ARGUMENT, "generator (cuda): no kernel registry for the device");
    if (!(opt_.gpu_memory_utilization > 0 && opt_.gpu_memory_utilization <= 1))
      throw Error(RLH_E_INVALID_ARGUMENT, "generator (cuda): gpu_memory_utilization must be in (0, 1], not " +
                                              std::to_string(opt_.gpu_memory_utilization));
    for (const RopeTable& t : m_.ropes())
      if (t.dynamic_from > 0)
        throw Error(RLH_E_UNIMPLEMENTED,
                    "generator (cuda): RoPE whose frequencies depend on the sequence length (dynamic NTK, longrope) "
                    "is not executed on the GPU; use the CPU generator");
    bool moe = false;
    for (const LayerShape& s : m_.shapes()) moe = moe || s.moe;
    if (moe && m_.router_fp64())
      throw Error(RLH_E_UNIMPLEMENTED,
                  "generator (cuda): moe_router_dtype fp64 is not executed on the GPU yet; use fp32 or the CPU generator");
    ck(cudaSetDevice(opt_.device), "set device " + std::to_string(opt_.device));
    ck(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    ops_ = std::make_unique<DeviceOps>(*opt_.kernels, opt_.device, stream_);
    ops_->set_batch_invariant_gemm(opt_.batch_invariant);
    b_ = std::make_unique<CudaBackend>(m_, *ops_, stream_);
    if (opt_.kv_cache_fp8) {  // scale 1 for keys and values (vLLM's without calibrated scales)
      for (const LayerShape& s : m_.shapes())
        if (s.Dk != s.Dv || (s.Dk != 64 && s.Dk != 128) || s.softcap != 0)
          throw Error(RLH_E_UNIMPLEMENTED, "generator (cuda): the FP8 KV cache needs head dims 64 or 128 (keys as wide "
                                           "as values) and no attention soft-capping; use kv_cache_dtype auto");
      kv_scales_.alloc(2 * sizeof(float), "the FP8 KV cache's scales");
      const float one[2] = {1.f, 1.f};
      ck(cudaMemcpy(kv_scales_.get(), one, sizeof(one), cudaMemcpyHostToDevice), "the FP8 KV cache's scales");
      b_->kv_scales = kv_scales_.get<float>();
    }
    const char* pk = std::getenv("RLH_GEN_PACKED_STEP");
    packed_step_ = pk && std::string(pk) == "1";
    const char* ev = std::getenv("RLH_GEN_STEP_EVENTS");
    if (ev && std::string(ev) == "1") timer_.create();
    // Opt-in until it has run on a GPU beside the op-by-op steps (docs/generator.md).
    const char* fused = std::getenv("RLH_GEN_FUSED_LAYER");
    b_->fused_layer_on = fused && std::string(fused) == "1";
    plan();
    if (opt_.fp8.enabled) plan_fp8();
    m_.weights().set_device_sink(this);  // a colocated trainer's device views refit in place
  }

  ~CudaExecutor() override {
    if (m_.weights().device_sink() == this) m_.weights().set_device_sink(nullptr);
    cudaSetDevice(opt_.device);
    if (stream_) cudaStreamSynchronize(stream_);
    drop_graphs();
    timer_.destroy();
    if (stream_) cudaStreamDestroy(stream_);
  }

  std::string name() const override {
    return "cuda:" + std::to_string(opt_.device) + " bf16" + (opt_.batch_invariant ? ", batch-invariant" : "") +
           (graphs_on_ ? ", CUDA graphs" : "") + (opt_.kv_cache_fp8 ? ", FP8 KV cache" : "");
  }
  bool keys_transposed() const override { return false; }
  int64_t elem_bytes() const override { return opt_.kv_cache_fp8 ? 1 : 2; }

  int64_t kv_budget(const KvLayout& layout, int64_t) override {
    if (pool_.get()) return int64_t(pool_.size());
    ck(cudaSetDevice(opt_.device), "set device");
    upload_weights();  // the weights count as in use before the pool takes the rest
    int64_t bytes = opt_.kv_cache_bytes;
    std::string rule = "kv_cache_bytes";
    if (bytes <= 0) {
      size_t free_b = 0, total_b = 0;
      ck(cudaMemGetInfo(&free_b, &total_b), "memory info");
      const double want = opt_.gpu_memory_utilization * double(total_b);
      const int64_t used = int64_t(total_b - free_b);
      // A margin for what comes later: CUDA graphs, the providers' stream-ordered pools.
      constexpr int64_t kMargin = int64_t(256) << 20;
      bytes = int64_t(want) - used - kMargin;
      rule = "gpu_memory_utilization " + std::to_string(opt_.gpu_memory_utilization).substr(0, 4) + " of " +
             mib(int64_t(total_b)) + " leaves " + (bytes > 0 ? mib(bytes) : "nothing") + " after the " + mib(used) +
             " in use and a margin of " + mib(kMargin);
    }
    if (bytes < layout.block_bytes())
      throw Error(RLH_E_RESOURCE_EXHAUSTED, "generator (cuda): the KV cache does not fit: " + rule +
                                                ", less than one block of " + std::to_string(layout.block_bytes()) +
                                                " bytes (the memory in use counts every process on the device: where "
                                                "ranks share a GPU, give each a kv_cache_bytes)");
    const int64_t blocks = std::min<int64_t>(bytes / layout.block_bytes(), INT32_MAX);
    pool_.alloc(opt_.device, size_t(blocks * layout.block_bytes()), opt_.kv_cache_sleep, "the KV cache (" + rule + ")");
    // Padding rows of a captured step read block 0: zeros, not stale garbage that could be NaN.
    ck(cudaMemsetAsync(pool_.get(), 0, pool_.size(), stream_), "clearing the KV cache");
    ck(cudaStreamSynchronize(stream_), "clearing the KV cache");
    stats_.kv_bytes = int64_t(pool_.size());
    drop_graphs();  // they would read another pool
    return int64_t(pool_.size());
  }

  PoolAllocator kv_allocator() override {
    PoolAllocator a;
    a.allocate = [this](size_t bytes) -> void* {
      if (!pool_.get() || bytes > pool_.size())
        throw Error(RLH_E_INTERNAL, "generator (cuda): the KV cache was not sized before use");
      return pool_.get();
    };
    a.deallocate = [](void*, size_t) {};  // kept for the next call (the graphs hold its address)
    return a;
  }

  void begin_generate(int64_t max_len, int64_t block_size) override {
    ck(cudaSetDevice(opt_.device), "set device");
    if (pool_.asleep()) {  // kv_cache_sleep: memory again at the same addresses, cleared
      const auto t0 = std::chrono::steady_clock::now();
      pool_.wake("the KV cache (waking it)");
      ck(cudaMemsetAsync(pool_.get(), 0, pool_.size(), stream_), "clearing the KV cache");
      ck(cudaStreamSynchronize(stream_), "clearing the KV cache");
      stats_.kv_wake_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const int64_t need = pow2_at_least((max_len + block_size - 1) / block_size);
    if (need > table_cap_) plan_inputs(need);
  }

  // kv_cache_sleep: the pool's memory back to the device until the next call. Runs from a
  // destructor (the generate() call's end, also on an error): it never throws, and a pool whose
  // stream cannot be drained stays mapped.
  void end_generate() override {
    if (!pool_.sleepable() || pool_.asleep()) return;
    if (cudaSetDevice(opt_.device) != cudaSuccess || cudaStreamSynchronize(stream_) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    pool_.sleep();
    ++stats_.kv_sleeps;
  }

  void step(const StepRows& rows, KvCache& kv, const StepDraws& d) override {
    const int64_t R = rows.R(), S = rows.S();
    if (R == 0) return;
    const auto t_step = std::chrono::steady_clock::now();
    ck(cudaSetDevice(opt_.device), "set device");
    if (R > rmax_ || S > smax_)
      throw Error(RLH_E_INTERNAL, "generator (cuda): a step of " + std::to_string(R) + " rows / " + std::to_string(S) +
                                      " samples beyond the plan");
    if (rows.width > table_cap_) plan_inputs(pow2_at_least(rows.width));
    if (kv.pool() != pool_.get() || kv.layout().elem_bytes != elem_bytes() || kv.layout().keys_transposed)
      throw Error(RLH_E_INTERNAL, "generator (cuda): the KV cache is not this executor's");
    upload_weights();
    b_->kv_pool = pool_.get();
    b_->kv = &kv.layout();
    b_->kv_blocks = kv.num_blocks();

    bool decode = S == R;
    for (int64_t i = 0; decode && i < S; ++i) decode = rows.sample_rows[size_t(i)] == i;
    const bool graph = decode && graphs_on_;
    // FP8 rollouts pad small decoding batches to 16 rows, the fewest blockwise FP8 products take
    // on cuBLASLt (Fp8Linears::input), unless the weight-only products take them (up to 8 rows
    // where a provider offers the form: plan_fp8): either way a step reads the FP8 weights.
    // (Block-scaled products of 1-15 rows unpadded, on vendor_fp8's few-row kernel, were measured
    // at batch 1 on an H100, 2026-12-07: 940 tok/s against 959 weight-only, and a larger
    // mismatch; removed: bench/results/h100-2026-12-07-s28-fp8prod-b1-few1.log.)
    const int64_t pad = fp8_ && pow2_at_least(R) > fp8_->weight_only_rows() ? 16 : 1;
    const int64_t Rb = graph ? std::min<int64_t>(std::max<int64_t>(pow2_at_least(R), pad), gmax_) : R;
    const int64_t W = graph ? std::min<int64_t>(pow2_at_least(rows.width), table_cap_) : rows.width;
    if (timer_.on) timer_.mark(0, stream_);
    b_->samples = graph ? Rb : S;
    upload_inputs(rows, d, Rb, W, b_->samples);
    if (timer_.on) timer_.mark(1, stream_);
    b_->width = W;
    b_->rows_sample_in_order = decode;

    if (graph) {
      auto it = graphs_.find(GraphKey{Rb, W});
      if (it != graphs_.end()) {
        ck(cudaGraphLaunch(it->second, stream_), "launching a decode graph");
        ++stats_.graph_steps;
      } else {
        forward(Rb, Rb);  // op by op: resolves the ops and plans (and computes this step)
        ++stats_.eager_steps;
        capture(GraphKey{Rb, W});
      }
    } else {
      forward(R, S);
      ++stats_.eager_steps;
    }
    if (timer_.on) timer_.mark(2, stream_);
    if (S > 0) {
      DeviceOps::Sample sa;
      sa.temperature = d.attrs.temperature;
      sa.top_k = d.attrs.top_k;
      sa.top_p = d.attrs.top_p;
      sa.min_p = d.attrs.min_p;
      sa.softcap = d.attrs.softcap;  // Gemma-2's final cap (the program's)
      // The tokens and right after them their logprobs, so one copy brings both down.
      auto* logprobs = reinterpret_cast<float*>(buf_.tokens + S);
      ops_->sample(buf_.tokens, logprobs, buf_.logits, m_.vocab(), S, m_.vocab(), buf_.u, sa);
      if (packed_step_) {
        ck(cudaMemcpyAsync(out_.get(), buf_.tokens, size_t(S) * 8, cudaMemcpyDeviceToHost, stream_), "the draws");
      } else {
        ck(cudaMemcpyAsync(out_.get(), buf_.tokens, size_t(S) * 4, cudaMemcpyDeviceToHost, stream_), "tokens");
        ck(cudaMemcpyAsync(out_.get<int32_t>() + S, logprobs, size_t(S) * 4, cudaMemcpyDeviceToHost, stream_),
           "logprobs");
      }
    }
    if (timer_.on) timer_.mark(3, stream_);
    const auto t_wait = std::chrono::steady_clock::now();
    ck(cudaStreamSynchronize(stream_), "a decoding step");
    if (timer_.on) timer_.add(stats_);
    if (S > 0) {
      std::memcpy(d.tokens.data(), out_.get<int32_t>(), size_t(S) * 4);
      std::memcpy(d.logprobs.data(), out_.get<int32_t>() + S, size_t(S) * 4);
    }
    const auto t_end = std::chrono::steady_clock::now();
    stats_.wait_seconds += std::chrono::duration<double>(t_end - t_wait).count();
    stats_.step_seconds += std::chrono::duration<double>(t_end - t_step).count();
  }

  const CudaExecutorStats& stats() const { return stats_; }

 private:
  // Device memory for the rows of a step (everything but the inputs, the weights and the pool).
  void plan() {
    const int64_t C = m_.hidden(), V = m_.vocab();
    smax_ = std::max<int64_t>(1, opt_.max_num_seqs);
    rmax_ = std::max<int64_t>(opt_.max_num_batched_tokens, smax_);
    gmax_ = smax_;  // decode steps have one row per running sequence
    int64_t moe_rk = 0, E = 0, Fe = 0, Fs = 0;
    for (const LayerShape& s : m_.shapes())
      if (s.moe) {
        moe_rk = std::max(moe_rk, rmax_ * s.Kx);
        E = std::max(E, s.E);
        Fe = std::max(Fe, s.Fe);
        Fs = std::max(Fs, s.Fs);
      }
    auto carve = [&](Carver& c) {
      StepBuffers b;
      b.xs[0] = c.take<Bf16>(rmax_ * C);
      b.xs[1] = c.take<Bf16>(rmax_ * C);
      b.values = c.take<Bf16>(m_.values_elems(rmax_));
      b.mla = c.take<Bf16>(m_.mla_scratch_elems(rmax_));
      b.hs = c.take<Bf16>(smax_ * C);
      b.xn = c.take<Bf16>(smax_ * C);
      b.normed[0] = c.take<Bf16>(rmax_ * C);
      b.normed[1] = c.take<Bf16>(rmax_ * C);
      b.logits = c.take<float>(smax_ * V);
      if (moe_rk > 0) {
        b.z = c.take<float>(rmax_ * E);
        b.probs = c.take<float>(rmax_ * E);
        b.wts = c.take<float>(moe_rk);
        b.experts = c.take<int32_t>(moe_rk);
        b.row = c.take<int32_t>(moe_rk);
        b.offsets = c.take<int32_t>(E + 1);
        b.xp = c.take<Bf16>(moe_rk * C);
        b.gu = c.take<Bf16>(moe_rk * 2 * Fe);
        b.act = c.take<Bf16>(moe_rk * Fe);
        b.yp = c.take<Bf16>(moe_rk * C);
        if (Fs > 0) {
          b.sgu = c.take<Bf16>(rmax_ * 2 * Fs);
          b.sa = c.take<Bf16>(rmax_ * Fs);
          b.sy = c.take<Bf16>(rmax_ * C);
          b.sgl = c.take<float>(rmax_);
          b.sgw = c.take<float>(rmax_);
          b.sgp = c.take<float>(rmax_);
          b.srow = c.take<int32_t>(rmax_);
          b.szero = c.take<int32_t>(rmax_);
        }
      }
      b.tokens = c.take<int32_t>(2 * smax_);  // a step's tokens, then their logprobs
      return b;
    };
    Carver count;
    carve(count);
    scratch_.alloc(count.size(), "the generator's activations (" + std::to_string(rmax_) + " rows)");
    Carver real(scratch_.get<char>());
    buf_ = carve(real);
    if (buf_.srow) {  // the shared expert's gate: row r is route r of one expert
      std::vector<int32_t> iota(static_cast<size_t>(rmax_));
      for (int64_t r = 0; r < rmax_; ++r) iota[size_t(r)] = int32_t(r);
      ck(cudaMemcpy(buf_.srow, iota.data(), iota.size() * 4, cudaMemcpyHostToDevice), "upload");
      ck(cudaMemset(buf_.szero, 0, size_t(rmax_) * 4), "clear");
    }
    // The ops' scratch: cuBLASLt asks for up to 32 MiB; the MoE sort for a little.
    workspace_.alloc(size_t(64) << 20, "the kernels' workspace");
    ops_->set_workspace(workspace_.get(), workspace_.size());
    out_.alloc(size_t(smax_) * 8);
    // RoPE tables (f32 on the device)
    std::vector<size_t> at;
    size_t n = 0;
    for (const RopeTable& t : m_.ropes()) {
      at.push_back(n);
      n += (t.inv_freq.size() + 63) / 64 * 64;
    }
    rope_.alloc(std::max<size_t>(n, 1) * 4, "RoPE tables");
    b_->inv_freq.clear();
    for (size_t t = 0; t < m_.ropes().size(); ++t) {
      const std::vector<float>& f = m_.ropes()[t].inv_freq;
      float* p = rope_.get<float>() + at[t];
      if (!f.empty()) ck(cudaMemcpy(p, f.data(), f.size() * 4, cudaMemcpyHostToDevice), "upload RoPE");
      b_->inv_freq.push_back(p);
    }
    b_->buf = &buf_;
    graphs_on_ = opt_.cuda_graphs;
    plan_inputs(1);
  }

  // The step's inputs, device and staging, for block tables `width` wide.
  void plan_inputs(int64_t width) {
    drop_graphs();  // they read the old buffers
    table_cap_ = width;
    const size_t bytes = layout_inputs(nullptr, rmax_, table_cap_, smax_);  // the largest step's
    in_.alloc(bytes, "the step's inputs");
    stage_.alloc(bytes);
    layout_inputs(in_.get<char>(), rmax_, table_cap_, smax_);  // fixed, unless packed a step
  }

  // The step inputs' layout in in_ (and in its host mirror stage_) for Rb rows, tables W wide
  // and Sh sampling rows: buf_'s input pointers into `base` (none when null); returns the bytes.
  // By default the layout is the largest step's, fixed at plan_inputs, and a step makes six
  // uploads. With RLH_GEN_PACKED_STEP=1 each step lays its inputs out packed for its own rows and
  // width, so one copy takes them all up (a batch-1 step's are about 1.5 KiB, where each of six
  // copies costs the device a transfer's latency); a graph then reads its (rows, width) bucket's
  // layout, which every step of that bucket recomputes alike. Opt-in until it has run on a GPU
  // (built 2026-12-07, thirty-first session, when no machine could be started).
  size_t layout_inputs(char* base, int64_t Rb, int64_t W, int64_t Sh) {
    Carver c(base);
    int32_t* ids = c.take<int32_t>(Rb);
    int32_t* pos = c.take<int32_t>(Rb);
    int32_t* slots = c.take<int32_t>(Rb);
    int32_t* sample_rows = c.take<int32_t>(Sh);
    double* u = c.take<double>(Sh);
    int32_t* table = c.take<int32_t>(Rb * W);
    if (base) {
      buf_.ids = ids, buf_.pos = pos, buf_.slots = slots, buf_.sample_rows = sample_rows, buf_.u = u;
      buf_.table = table;
    }
    return c.size();
  }

  template <class T>
  T* staged(T* dev) {
    return reinterpret_cast<T*>(stage_.get<char>() + (reinterpret_cast<char*>(dev) - in_.get<char>()));
  }

  // Packs the step's inputs (padded to Rb rows, tables W wide, Sh rows for the head, of which
  // the first S draw) and copies them up.
  void upload_inputs(const StepRows& rows, const StepDraws& d, int64_t Rb, int64_t W, int64_t Sh) {
    const int64_t R = rows.R(), S = rows.S();
    const size_t bytes = packed_step_ ? layout_inputs(in_.get<char>(), Rb, W, Sh) : 0;
    int32_t* ids = staged(buf_.ids);
    int32_t* pos = staged(buf_.pos);
    int32_t* slots = staged(buf_.slots);
    int32_t* table = staged(buf_.table);
    std::copy(rows.ids.begin(), rows.ids.end(), ids);
    std::copy(rows.pos.begin(), rows.pos.end(), pos);
    std::copy(rows.slots.begin(), rows.slots.end(), slots);
    for (int64_t r = 0; r < R; ++r) {
      const int32_t* src = rows.table.data() + r * rows.width;
      std::copy(src, src + rows.width, table + r * W);
      std::fill(table + r * W + rows.width, table + (r + 1) * W, -1);
    }
    for (int64_t r = R; r < Rb; ++r) {  // padding: token 0 at position 0 of block 0, written nowhere
      ids[r] = 0;
      pos[r] = 0;
      slots[r] = -1;
      table[r * W] = 0;
      std::fill(table + r * W + 1, table + (r + 1) * W, -1);
    }
    int32_t* sr = staged(buf_.sample_rows);
    for (int64_t i = 0; i < S; ++i) sr[i] = int32_t(rows.sample_rows[size_t(i)]);
    for (int64_t i = S; i < Sh; ++i) sr[i] = int32_t(i);  // a graph's padding rows: their own (unused) logits
    std::copy(d.u.begin(), d.u.end(), staged(buf_.u));
    auto up = [&](void* dev, size_t n) {
      if (n)
        ck(cudaMemcpyAsync(dev, staged(static_cast<char*>(dev)), n, cudaMemcpyHostToDevice, stream_),
           "uploading a step");
    };
    if (packed_step_) {
      up(in_.get(), bytes);
      return;
    }
    up(buf_.ids, size_t(Rb) * 4);
    up(buf_.pos, size_t(Rb) * 4);
    up(buf_.slots, size_t(Rb) * 4);
    up(buf_.table, size_t(Rb * W) * 4);
    up(buf_.sample_rows, size_t(Sh) * 4);
    up(buf_.u, size_t(S) * 8);
  }

  void forward(int64_t R, int64_t S) {
    ProgramRunner<CudaBackend> run(m_, *b_);
    b_->fused_layers = 0;
    for (int64_t& n : b_->fp8_produced) n = 0;
    const Bf16* x = run.layers(R);
    run.head(x, R, S);
    if (b_->fused_layers > 0) stats_.fused_layers = b_->fused_layers;
    for (int k = 0; k < 3; ++k) stats_.fp8_produced_by[k] = std::max(stats_.fp8_produced_by[k], b_->fp8_produced[k]);
    stats_.fp8_produced = stats_.fp8_produced_by[0] + stats_.fp8_produced_by[1] + stats_.fp8_produced_by[2];
  }

  // Captures the step just run (R rows, tables W wide) as a graph. A failure turns graphs off
  // for this executor, with one log line; steps go on op by op.
  void capture(GraphKey key) {
    cudaGraph_t g = nullptr;
    std::string err;
    ck(cudaStreamSynchronize(stream_), "before a graph capture");  // the op-by-op step just queued
    ck(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "beginning a graph capture");
    try {
      forward(key.rows, key.rows);
    } catch (const std::exception& e) {
      err = e.what();
    }
    const cudaError_t e = cudaStreamEndCapture(stream_, &g);
    if (err.empty() && e != cudaSuccess) err = std::string("capture: ") + cudaGetErrorString(e);
    cudaGraphExec_t exec = nullptr;
    if (err.empty()) {
      const cudaError_t ie = cudaGraphInstantiate(&exec, g, 0);
      if (ie != cudaSuccess) err = std::string("instantiate: ") + cudaGetErrorString(ie);
    }
    if (g) cudaGraphDestroy(g);
    if (!err.empty()) {
      cudaGetLastError();
      graphs_on_ = false;
      stats_.graph_error = err;
      if (opt_.log) opt_.log("generator (cuda): decoding steps run op by op, capturing a CUDA graph failed: " + err);
      return;
    }
    graphs_.emplace(key, exec);
    ++stats_.graphs_captured;
  }

  void drop_graphs() {
    for (auto& [k, g] : graphs_) cudaGraphExecDestroy(g);
    graphs_.clear();
  }

  // The device arena (bf16, the host Weights' layout) and the f32 copies of the biases the
  // router adds in f32, allocated once: captured graphs keep their addresses.
  void ensure_weight_arena() {
    if (warena_.get()) return;
    const Weights& w = m_.weights();
    const sdk::TransformerDesc& desc = m_.desc();
    warena_.alloc(size_t(w.arena_elems()) * 2, "the bf16 weights");
    stats_.weight_bytes = int64_t(warena_.size());
    b_->weights = warena_.get<Bf16>();
    size_t n = 0;
    f32_at_.assign(desc.params.size(), -1);
    for (size_t i = 0; i < desc.params.size(); ++i)
      if (desc.params[i].role == sdk::ParamRole::router_bias ||
          desc.params[i].role == sdk::ParamRole::expert_score_bias) {
        int64_t numel = 1;
        for (int64_t d : desc.params[i].shape) numel *= d;
        f32_at_[i] = int64_t(n);
        n += size_t(numel + 63) / 64 * 64;
      }
    wf32_.alloc(std::max<size_t>(n, 1) * 4, "the router biases");
    b_->w_f32.assign(desc.params.size(), nullptr);
    for (size_t i = 0; i < desc.params.size(); ++i)
      if (f32_at_[i] >= 0) b_->w_f32[i] = wf32_.get<float>() + f32_at_[i];
  }

  // DeviceWeightSink: a refit piece in this device's memory, converted into the arena on the
  // stream (runs with the same source and destination steps go as one 2-D copy).
  rlh_device device() const override { return rlh_device{RLH_DEVICE_CUDA, opt_.device}; }

  void put(size_t i, const rlh_dtype& dtype, const void* data, std::span<const WeightRun> runs) override {
    const bool f32 = dtype.code == RLH_DTYPE_FLOAT && dtype.bits == 32 && dtype.lanes == 1;
    const bool b16 = dtype.code == RLH_DTYPE_BFLOAT && dtype.bits == 16 && dtype.lanes == 1;
    if (!f32 && !b16)
      throw Error(RLH_E_INVALID_ARGUMENT, "update_weights: parameter " + m_.desc().params[i].name +
                                              ": device tensors must be float32 or bfloat16");
    ck(cudaSetDevice(opt_.device), "set device");
    ensure_weight_arena();
    Bf16* dst = warena_.get<Bf16>() + m_.weights().arena_offset(i);
    for (size_t a = 0; a < runs.size();) {
      size_t b = a + 1;  // [a, b): runs of one 2-D block
      const int64_t dd = b < runs.size() ? runs[b].dst - runs[a].dst : 0, ds = b < runs.size() ? runs[b].src - runs[a].src : 0;
      while (b < runs.size() && runs[b].count == runs[a].count && runs[b].dst - runs[b - 1].dst == dd &&
             runs[b].src - runs[b - 1].src == ds)
        ++b;
      const int64_t rows = int64_t(b - a), cols = runs[a].count, dst_ld = rows > 1 ? dd : cols, src_ld = rows > 1 ? ds : cols;
      if (f32) {
        engine::cuda::convert_f32_to_bf16_2d(static_cast<const float*>(data) + runs[a].src, src_ld, dst + runs[a].dst,
                                             dst_ld, rows, cols, stream_);
      } else {
        ck(cudaMemcpy2DAsync(dst + runs[a].dst, size_t(dst_ld) * 2, static_cast<const Bf16*>(data) + runs[a].src,
                             size_t(src_ld) * 2, size_t(cols) * 2, size_t(rows), cudaMemcpyDeviceToDevice, stream_),
           "refit from device memory");
      }
      a = b;
    }
    if (f32_at_[i] >= 0)  // the router's f32 copy too
      for (const WeightRun& r : runs) {
        float* to = const_cast<float*>(b_->w_f32[i]) + r.dst;
        if (f32)
          ck(cudaMemcpyAsync(to, static_cast<const float*>(data) + r.src, size_t(r.count) * 4, cudaMemcpyDeviceToDevice,
                             stream_),
             "refit from device memory");
        else
          engine::cuda::convert_bf16_to_f32(static_cast<const Bf16*>(data) + r.src, to, r.count, stream_);
      }
    ++stats_.device_pieces;
  }

  void flush() override {
    ck(cudaSetDevice(opt_.device), "set device");
    ck(cudaStreamSynchronize(stream_), "refit from device memory");
  }

  // The host weights in force, as bf16 in the device arena (the router's and selection biases
  // also as f32), whenever a new set is in force. Parameters that came in device memory are
  // there already.
  void upload_weights() {
    const Weights& w = m_.weights();
    w.require_complete();
    if (uploaded_serial_ == w.serial()) return;
    const sdk::TransformerDesc& desc = m_.desc();
    ensure_weight_arena();
    if (!wstage_.get()) wstage_.alloc(size_t(16) << 20);
    const size_t chunk = wstage_.size() / 2;  // bf16 elements per copy
    uint16_t* stage = wstage_.get<uint16_t>();
    // Converts n floats at src into bf16 at dst (elements of the arena), a chunk at a time.
    auto upload = [&](const float* src, int64_t n, Bf16* dst) {
      for (int64_t at = 0; at < n; at += int64_t(chunk)) {
        const int64_t k = std::min<int64_t>(int64_t(chunk), n - at);
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < k; ++j) stage[j] = to_bf16(src[at + j]);
        ck(cudaMemcpyAsync(dst + at, stage, size_t(k) * 2, cudaMemcpyHostToDevice, stream_), "uploading weights");
        ck(cudaStreamSynchronize(stream_), "uploading weights");
      }
    };
    for (size_t i = 0; i < desc.params.size(); ++i) {
      if (w.on_device(i)) continue;
      const sdk::ParamDesc& p = desc.params[i];
      int64_t numel = 1;
      for (int64_t d : p.shape) numel *= d;
      Bf16* dst = warena_.get<Bf16>() + w.arena_offset(i);
      if (const float* whole = w.param(i)) {
        upload(whole, numel, dst);
        if (f32_at_[i] >= 0)
          ck(cudaMemcpy(const_cast<float*>(b_->w_f32[i]), whole, size_t(numel) * 4, cudaMemcpyHostToDevice), "uploading a bias");
        continue;
      }
      // stacked pieces (experts) lying apart: slab by slab
      int64_t slab = 1;
      for (int64_t d : p.hf_shapes[0]) slab *= d;
      for (size_t k = 0; k < p.hf_names.size(); ++k) {
        const float* piece = w.piece(i, k);
        if (!piece) throw Error(RLH_E_INTERNAL, "generator (cuda): weight " + p.name + " has a missing piece");
        upload(piece, slab, dst + int64_t(k) * slab);
      }
    }
    uploaded_serial_ = w.serial();
    ++stats_.weight_uploads;
    prepare_fp8_weights();
  }

  // FP8 rollouts (CudaExecutorOptions::fp8): the products that run in FP8 are the linear steps'
  // (weights adjacent in the arena as one product, as program_runner runs them) of the layers
  // not kept in bf16, whose shapes the blockwise recipe takes (128-multiples). The head, the
  // router, the experts' grouped products and MLA's own projections stay in bf16 (NeMo-RL's
  // vLLM FP8 keeps the head in bf16 too).
  void plan_fp8() {
    if (!opt_.fp8.blockwise)
      throw Error(RLH_E_INVALID_ARGUMENT, "generator (cuda): FP8 rollouts take the blockwise recipe");
    if (opt_.batch_invariant)
      throw Error(RLH_E_UNIMPLEMENTED, "generator (cuda): batch_invariant with FP8 rollouts is not implemented "
                                       "(the FP8 products pick their kernels by shape)");
    const sdk::ModelProgram& prog = m_.program();
    const sdk::TransformerDesc& desc = m_.desc();
    const Weights& w = m_.weights();
    try {
      fp8_ = std::make_unique<engine::cuda::Fp8Linears>(*ops_, fp8_counters_, opt_.fp8, m_.num_layers(), true,
                                                        "policy.generation.vllm_cfg.precision = fp8");
    } catch (const std::exception& e) {
      throw Error(RLH_E_FAILED_PRECONDITION, std::string("generator (cuda): ") + e.what());
    }
    int64_t max_k = 0;
    for (int64_t l = 0; l < m_.num_layers(); ++l) {
      if (!fp8_->layer_in_fp8(l)) continue;
      for (const sdk::LayerStep& st : prog.layers[size_t(l)].steps) {
        if (st.op != sdk::StepOp::linear) continue;
        const int64_t K = st.in.width;
        const auto at = [&](int64_t p) { return w.arena_offset(size_t(p)); };
        for_each_linear_product(desc, st, at, [&](size_t i, int64_t n) {
          if (n % 128 != 0 || K % 128 != 0) return;
          fp8_products_.push_back({at(st.weights[i]), n, K});
          max_k = std::max(max_k, K);
        });
      }
    }
    fp8_->reserve_input(rmax_, max_k);  // captured graphs keep the activations' FP8 buffers
    // Decoding steps of up to 8 rows run weight-only products (bf16 activations x the FP8
    // weights: no quantisation pass a product) where a provider offers them: the Llama-3.2-1B
    // shape at batch 1 decoded 900 tok/s against 798 with the activations quantised (and padded
    // to 16 rows) and 803 in bf16 (H100, 2026-12-06). Past 8 rows vendor_fp8's weight-only
    // kernel loses to the quantised product on cuBLASLt (9,976 against 10,435 tok/s at batch
    // 16; at 64 rows its gate|up took 58 us against 14.5: the activations' loads bound it).
    // RLH_GEN_FP8_WEIGHT_ONLY=N sets the bound (0: quantise every step's activations, the A/B).
    const char* wo = std::getenv("RLH_GEN_FP8_WEIGHT_ONLY");
    stats_.fp8_weight_only_rows = fp8_->set_weight_only_rows(wo && *wo ? std::max<int64_t>(0, std::atoll(wo)) : 8);
    // Past those rows and up to 64, an input that no producer quantised (o's: attention's
    // output) goes to the product as bf16 and the provider quantises its tiles inside it
    // (vendor_fp8's few-row kernel with quantize_a): the same codes, no quantisation pass.
    // RLH_GEN_FP8_IN_PRODUCT=N sets the bound (0: the pass, the A/B).
    const char* qa = std::getenv("RLH_GEN_FP8_IN_PRODUCT");
    stats_.fp8_in_product_rows =
        fp8_->set_quantize_in_product_rows(qa && *qa ? std::max<int64_t>(0, std::atoll(qa)) : 64);
    b_->fp8 = fp8_.get();
    b_->fp8_weights = &fp8_ptrs_;
    // The norms and SwiGLU write their product's FP8 input themselves where a provider offers
    // quantize_fp8's producer form (CudaBackend::produce_fp8); RLH_GEN_FP8_PRODUCER=0 keeps the
    // separate quantisation passes (the A/B).
    const char* pr = std::getenv("RLH_GEN_FP8_PRODUCER");
    b_->no_fp8_producer = pr && std::string(pr) == "0";
    b_->log = opt_.log;
  }

  // A new weight set is in force: the FP8 copies remade now, before any step (a replayed graph
  // would not remake them).
  void prepare_fp8_weights() {
    if (!fp8_) return;
    fp8_->new_call();
    fp8_ptrs_.clear();
    for (const Fp8Product& p : fp8_products_) {
      const Bf16* W = warena_.get<Bf16>() + p.off;
      fp8_->prepare_weight(reinterpret_cast<const uint16_t*>(W), p.rows, p.K);
      fp8_ptrs_.insert(W);
    }
    stats_.fp8_products = int64_t(fp8_products_.size());
  }

  DecodeModel& m_;
  CudaExecutorOptions opt_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceOps> ops_;
  std::unique_ptr<CudaBackend> b_;
  int64_t rmax_ = 0, smax_ = 0, gmax_ = 0, table_cap_ = 0;
  DevBuf scratch_, workspace_, rope_, in_, warena_, wf32_;
  KvPoolCuda pool_;  // the KV cache (kv_pool_cuda.hpp: it can sleep between calls)
  DevBuf kv_scales_;  // FP8 KV cache: k_scale, v_scale
  // FP8 rollouts (plan_fp8): the products in FP8 by arena offset, rows and K; their weights'
  // device addresses; the FP8 copies' buffers.
  struct Fp8Product {
    int64_t off, rows, K;
  };
  std::vector<Fp8Product> fp8_products_;
  std::unordered_set<const Bf16*> fp8_ptrs_;
  engine::cuda::Counters fp8_counters_;
  std::unique_ptr<engine::cuda::Fp8Linears> fp8_;
  PinnedBuf stage_, out_, wstage_;
  StepBuffers buf_;
  std::vector<int64_t> f32_at_;
  int64_t uploaded_serial_ = -1;
  bool graphs_on_ = true;
  bool packed_step_ = false;  // RLH_GEN_PACKED_STEP=1: one upload and one download a step (layout_inputs)
  std::map<GraphKey, cudaGraphExec_t> graphs_;
  CudaExecutorStats stats_;
  // RLH_GEN_STEP_EVENTS=1: events at a step's phase boundaries (stats: dev_*_seconds).
  struct StepTimer {
    bool on = false;
    cudaEvent_t ev[4] = {};
    void create() {
      for (cudaEvent_t& e : ev) ck(cudaEventCreate(&e), "a step timing event");
      on = true;
    }
    void destroy() {
      for (cudaEvent_t& e : ev)
        if (e) cudaEventDestroy(e);
      on = false;
    }
    void mark(int i, cudaStream_t s) { ck(cudaEventRecord(ev[i], s), "recording a step timing event"); }
    void add(CudaExecutorStats& st) const {  // after the stream's wait: every event has completed
      float ms[3] = {};
      for (int i = 0; i < 3; ++i) ck(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]), "a step timing event");
      st.dev_upload_seconds += 1e-3 * ms[0];
      st.dev_forward_seconds += 1e-3 * ms[1];
      st.dev_draw_seconds += 1e-3 * ms[2];
      ++st.timed_steps;
    }
  } timer_;
};

}  // namespace

bool cuda_generator_available(std::string* why, int device) {
  // The same devices as the CUDA engine's (both built for sm_90a); named for the generator.
  std::string w;
  if (engine::cuda_engine_available(&w, device)) return true;
  cudaGetLastError();  // a failed probe leaves no sticky error for later calls
  if (why) *why = "generator (cuda): " + w;
  return false;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::function<std::unique_ptr<StepExecutor>(DecodeModel&)> cuda_executor(CudaExecutorOptions options) {
  return [options](DecodeModel& m) -> std::unique_ptr<StepExecutor> { return std::make_unique<CudaExecutor>(m, options); };
}

CudaExecutorStats cuda_executor_stats(const StepExecutor& e) {
  if (const auto* c = dynamic_cast<const CudaExecutor*>(&e)) return c->stats();
  return {};
}

}  // namespace rlh::gen
