// cuDNN attention graphs, plans and runs (sdpa.hpp).
//
// The graphs are the ones cudnn-frontend's CompositeSDPANode / CompositeSDPABackwardNode build
// for bf16 packed sequences with a padding mask, a top-left causal mask and an optional left
// bound (its "sliding window"), with packed statistics and max_total_seq_len-sized backward
// scratch (what Transformer Engine asks for on cuDNN >= 9.6): cuDNN recognises this pattern and
// runs it on its fused flash-attention engines. Written here against the backend API; the
// frontend headers are not used.
#include "sdpa.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "ragged.hpp"

namespace rlh::kcudnn {

struct SdpaPlan {
  Graph g;
  int64_t q = 0, k = 0, v = 0, o = 0, stats = 0, seq_q = 0, seq_kv = 0, scale = 0, one = 0, window = 0;
  std::vector<int64_t> neg_inf;                       // -inf scalars of the masks
  std::vector<std::pair<int64_t, int64_t>> offsets;   // ragged offset tensors: (uid, multiplier)
  // backward
  int64_t d_o = 0, dq = 0, dk = 0, dv = 0, softmax_sum = 0, dq_accum = 0, dk_full = 0, dv_full = 0;
  size_t softmax_sum_bytes = 0, dq_accum_bytes = 0, dk_full_bytes = 0, dv_full_bytes = 0;
  bool tuned = false;  // its candidate configs timed (or only one)
};

namespace {

constexpr cudnnDataType_t kBF16 = CUDNN_DATA_BFLOAT16;
constexpr cudnnDataType_t kF32 = CUDNN_DATA_FLOAT;
constexpr cudnnDataType_t kI32 = CUDNN_DATA_INT32;
constexpr cudnnDataType_t kBool = CUDNN_DATA_BOOLEAN;

int64_t next_pow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// The plan's token bucket: N rounded up to a quarter of its octave (at most 25% above N, four
// plans per doubling of the packed token count), at least 64.
int64_t token_bucket(int64_t N) {
  if (N <= 64) return 64;
  const int64_t p = next_pow2(N), step = std::max<int64_t>(p / 4, 16);
  return (N + step - 1) / step * step;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The backward reads each input and writes its gradient through one ragged offset tensor per
// pair (q/dq, k/dk, v/dv, o/dout), as Transformer Engine binds them; a pair whose row strides
// differ goes through contiguous copies. So do GQA keys and values whose rows are wider than
// Hkv * D: cuDNN sums the per-query-head gradients in a buffer laid out like dK with rows G
// times as wide, which for the engine's fused q|k|v gradient (row (Hq + 2 Hkv) D) would be
// G times that row.
enum Pair { kPairQ = 0, kPairK = 1, kPairV = 2, kPairO = 3 };
struct PairLd {
  int64_t ld, ldd, packed;  // the caller's strides, and the contiguous one
};
PairLd pair_ld(const AttnCall& c, int pair) {
  switch (pair) {
    case kPairQ: return {c.ldq, c.lddq, c.Hq * c.D};
    case kPairK: return {c.ldk, c.lddk, c.Hkv * c.D};
    case kPairV: return {c.ldv, c.lddv, c.Hkv * c.D};
    default: return {c.ldo, c.lddo, c.Hq * c.D};
  }
}
bool contiguous_copy(const AttnCall& c, int pair) {
  const PairLd p = pair_ld(c, pair);
  if (p.ld != p.ldd) return true;
  return (pair == kPairK || pair == kPairV) && c.Hq != c.Hkv && p.ld != p.packed;
}

struct Builder {
  Graph& g;
  SdpaPlan& p;
  const PlanKey& k;

  TensorRef ragged(int64_t multiplier) {
    const TensorRef r = g.tensor(CUDNN_DATA_INT64, {k.B + 1, 1, 1, 1}, {1, 1, 1, 1}, false);
    p.offsets.emplace_back(r.uid, multiplier);
    return r;
  }
  // [B, H, T, D] rows ld apart, packed by `r`.
  TensorRef heads(cudnnDataType_t dt, int64_t H, int64_t ld, const TensorRef& r) {
    return g.tensor(dt, {k.B, H, k.T, k.D}, {k.T * ld, k.D, ld, 1}, false, &r);
  }
  // [B, H, D, T]: the transposed view of [N, H, D] rows ld apart.
  TensorRef heads_t(int64_t H, int64_t ld, const TensorRef& r) {
    return g.tensor(kBF16, {k.B, H, k.D, k.T}, {k.T * ld, k.D, 1, ld}, false, &r);
  }
  TensorRef neg_inf() {
    const TensorRef s = g.scalar();
    p.neg_inf.push_back(s.uid);
    return s;
  }
  // Rows at or past the sequence's length, and keys past it, score -inf (the padding mask).
  TensorRef padding(const TensorRef& s, const TensorRef& seq_q, const TensorRef& seq_kv) {
    const TensorRef row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, kI32, kI32, 2);
    const TensorRef col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, kI32, kI32, 3);
    const TensorRef rm = g.pointwise(CUDNN_POINTWISE_CMP_LT, row, &seq_q, nullptr, kBool, kBool);
    const TensorRef cm = g.pointwise(CUDNN_POINTWISE_CMP_LT, col, &seq_kv, nullptr, kBool, kBool);
    const TensorRef m = g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, rm, &cm, nullptr, kBool, kBool);
    const TensorRef ninf = neg_inf();
    return g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &ninf, &m, kF32);
  }
  // Causal (top-left: key j <= query i in each sequence), then the window's left bound
  // (j + W > i: the W keys up to and including i, HF's sliding window).
  TensorRef band(TensorRef s) {
    {
      const TensorRef row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, kI32, kF32, 2);
      const TensorRef col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, kI32, kF32, 3);
      const TensorRef keep = g.pointwise(CUDNN_POINTWISE_CMP_GE, row, &col, nullptr, kBool, kBool);
      const TensorRef ninf = neg_inf();
      s = g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &ninf, &keep, kF32);
    }
    if (k.window > 0) {
      const TensorRef row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, kI32, kF32, 2);
      const TensorRef col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, kI32, kF32, 3);
      const TensorRef w = g.scalar();
      p.window = w.uid;
      const TensorRef cw = g.pointwise(CUDNN_POINTWISE_ADD, col, &w, nullptr, kF32, kF32);
      const TensorRef keep = g.pointwise(CUDNN_POINTWISE_CMP_GT, cw, &row, nullptr, kBool, kBool);
      const TensorRef ninf = neg_inf();
      s = g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, &ninf, &keep, kF32);
    }
    return s;
  }
  Dims score_dims() const { return {k.B, k.Hq, k.T, k.T}; }
  Dims score_strides() const { return {k.Hq * k.T * k.T, k.T * k.T, k.T, 1}; }
  Dims score_t_strides() const { return {k.Hq * k.T * k.T, k.T * k.T, 1, k.T}; }
  Dims row_dims() const { return {k.B, k.Hq, k.T, 1}; }
  Dims row_strides() const { return {k.Hq * k.T, k.T, 1, 1}; }
  Dims packed_row_strides() const { return {k.Hq * k.T, 1, k.Hq, 1}; }  // [N, H] packed statistics
};

void build_forward(SdpaPlan& p, const PlanKey& k) {
  Graph& g = p.g;
  Builder b{g, p, k};
  const TensorRef rq = b.ragged(k.ldq), rk = b.ragged(k.ldk), rv = b.ragged(k.ldv), ro = b.ragged(k.ldo),
                  rs = b.ragged(k.Hq);
  const TensorRef Q = b.heads(kBF16, k.Hq, k.ldq, rq);
  const TensorRef KT = b.heads_t(k.Hkv, k.ldk, rk);
  const TensorRef V = b.heads(kBF16, k.Hkv, k.ldv, rv);
  const TensorRef O = b.heads(kBF16, k.Hq, k.ldo, ro);
  const TensorRef stats = g.tensor(kF32, b.row_dims(), b.packed_row_strides(), false, &rs);
  const TensorRef seq_q = g.tensor(kI32, {k.B, 1, 1, 1}, {1, 1, 1, 1}, false);
  const TensorRef seq_kv = g.tensor(kI32, {k.B, 1, 1, 1}, {1, 1, 1, 1}, false);
  const TensorRef scale = g.scalar();
  p.q = Q.uid, p.k = KT.uid, p.v = V.uid, p.o = O.uid, p.stats = stats.uid;
  p.seq_q = seq_q.uid, p.seq_kv = seq_kv.uid, p.scale = scale.uid;

  TensorRef s = g.tensor(kF32, b.score_dims(), b.score_strides(), true);
  g.matmul(Q, KT, s, &seq_q, &seq_kv, nullptr);
  s = g.pointwise(CUDNN_POINTWISE_MUL, s, &scale, nullptr, kF32);
  s = b.padding(s, seq_q, seq_kv);
  s = b.band(s);
  // softmax with its statistics: max, exp(s - max), sum, stats = max + log(sum), p = e / sum
  const TensorRef mx = g.tensor(kF32, b.row_dims(), b.row_strides(), true);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, mx);
  const TensorRef z = g.pointwise(CUDNN_POINTWISE_SUB, s, &mx, nullptr, kF32);
  const TensorRef e = g.pointwise(CUDNN_POINTWISE_EXP, z, nullptr, nullptr, kF32);
  const TensorRef sum = g.tensor(kF32, b.row_dims(), b.row_strides(), true);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  const TensorRef lg = g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, kF32);
  g.pointwise_into(CUDNN_POINTWISE_ADD, mx, &lg, nullptr, stats);
  // The probabilities are the second product's bf16 operand.
  const TensorRef prob = g.tensor(kBF16, b.score_dims(), b.score_strides(), true);
  g.pointwise_into(CUDNN_POINTWISE_DIV, e, &sum, nullptr, prob);
  g.matmul(prob, V, O, &seq_q, nullptr, &seq_kv);
}

void build_backward(SdpaPlan& p, const PlanKey& k, size_t cudnn_version) {
  Graph& g = p.g;
  Builder b{g, p, k};
  const int64_t G = k.Hq / k.Hkv;
  // One offsets tensor per input/gradient pair (their row strides are equal: contiguous_copy).
  const TensorRef rq = b.ragged(k.ldq), rk = b.ragged(k.ldk), rv = b.ragged(k.ldv), ro = b.ragged(k.ldo),
                  rs = b.ragged(k.Hq);
  const TensorRef &rdo = ro, &rdq = rq, &rdk = rk, &rdv = rv;
  const TensorRef Q = b.heads(kBF16, k.Hq, k.ldq, rq);
  const TensorRef KT = b.heads_t(k.Hkv, k.ldk, rk);
  const TensorRef VT = b.heads_t(k.Hkv, k.ldv, rv);
  const TensorRef O = b.heads(kBF16, k.Hq, k.ldo, ro);
  const TensorRef dO = b.heads(kBF16, k.Hq, k.lddo, rdo);
  const TensorRef stats = g.tensor(kF32, b.row_dims(), b.packed_row_strides(), false, &rs);
  const TensorRef dQ = b.heads(kBF16, k.Hq, k.lddq, rdq);
  const TensorRef dK = b.heads(kBF16, k.Hkv, k.lddk, rdk);
  const TensorRef dV = b.heads(kBF16, k.Hkv, k.lddv, rdv);
  const TensorRef seq_q = g.tensor(kI32, {k.B, 1, 1, 1}, {1, 1, 1, 1}, false);
  const TensorRef seq_kv = g.tensor(kI32, {k.B, 1, 1, 1}, {1, 1, 1, 1}, false);
  const TensorRef scale = g.scalar();
  const TensorRef one = g.scalar();
  p.q = Q.uid, p.k = KT.uid, p.v = VT.uid, p.o = O.uid, p.d_o = dO.uid, p.stats = stats.uid;
  p.dq = dQ.uid, p.dk = dK.uid, p.dv = dV.uid;
  p.seq_q = seq_q.uid, p.seq_kv = seq_kv.uid, p.scale = scale.uid, p.one = one.uid;

  // Delta = rowsum(dO * O), kept (non-virtual, packed like the statistics) for the dS chain.
  const TensorRef doo = g.tensor(kF32, {k.B, k.Hq, k.T, k.D}, {k.Hq * k.T * k.D, k.T * k.D, k.Hq * k.D, 1}, true);
  g.pointwise_into(CUDNN_POINTWISE_MUL, dO, &O, nullptr, doo);
  const TensorRef rsum = g.tensor(kF32, b.row_dims(), b.row_strides(), true);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, doo, rsum);
  const TensorRef delta = g.tensor(kF32, b.row_dims(), b.packed_row_strides(), false, &rs);
  g.pointwise_into(CUDNN_POINTWISE_MUL, rsum, &one, nullptr, delta);
  p.softmax_sum = delta.uid;
  p.softmax_sum_bytes = size_t(k.T * k.Hq) * sizeof(float);

  // P = exp(scale * Q K^T (masked) - stats)
  TensorRef s = g.tensor(kF32, b.score_dims(), b.score_strides(), true);
  g.matmul(Q, KT, s, &seq_q, &seq_kv, nullptr);
  s = g.pointwise(CUDNN_POINTWISE_MUL, s, &scale, nullptr, kF32);
  s = b.padding(s, seq_q, seq_kv);
  s = g.pointwise(CUDNN_POINTWISE_SUB, s, &stats, nullptr, kF32);
  // cuDNN 9.0 - 9.9 wants the padding value put back after the statistics are subtracted.
  if (cudnn_version < 91000) s = b.padding(s, seq_q, seq_kv);
  s = b.band(s);
  const TensorRef prob = g.pointwise(CUDNN_POINTWISE_EXP, s, nullptr, nullptr, kF32);

  // dV = P^T dO (GQA: per query head into a packed buffer G times as wide, then summed)
  const TensorRef pt = g.reshape(prob, {k.B, k.Hq, k.T, k.T}, b.score_t_strides(), kBF16);
  auto grad_kv = [&](const TensorRef& lhs, const TensorRef& rhs, const TensorRef& out, int64_t ld,
                     const TensorRef& r, int64_t* full_uid, size_t* full_bytes) {
    if (G == 1) {
      g.matmul(lhs, rhs, out, &seq_kv, nullptr, &seq_q);
      return;
    }
    const TensorRef full = g.tensor(kBF16, {k.B, k.Hq, k.T, k.D}, {k.T * ld * G, k.D, ld * G, 1}, false, &r);
    g.matmul(lhs, rhs, full, &seq_kv, nullptr, &seq_q);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
    *full_uid = full.uid;
    *full_bytes = size_t(k.T * ld * G) * sizeof(float);  // the frontend's size (float, not bf16)
  };
  grad_kv(pt, dO, dV, k.lddv, rdv, &p.dv_full, &p.dv_full_bytes);

  // dS = scale * P * (dO V^T - Delta)
  TensorRef dp = g.tensor(kF32, b.score_dims(), b.score_strides(), true);
  g.matmul(dO, VT, dp, &seq_q, &seq_kv, nullptr);
  dp = g.pointwise(CUDNN_POINTWISE_SUB, dp, &delta, nullptr, kF32);
  dp = g.pointwise(CUDNN_POINTWISE_MUL, dp, &prob, nullptr, kF32);
  const TensorRef ds = g.pointwise(CUDNN_POINTWISE_MUL, dp, &scale, nullptr, kF32);

  // dK = dS^T Q
  const TensorRef dst = g.reshape(ds, {k.B, k.Hq, k.T, k.T}, b.score_t_strides(), kBF16);
  grad_kv(dst, Q, dK, k.lddk, rdk, &p.dk_full, &p.dk_full_bytes);

  // dQ = dS K, accumulated in float (packed like dQ) and converted
  const TensorRef kr = g.reshape(KT, {k.B, k.Hkv, k.T, k.D}, {k.T * k.ldk, k.D, k.ldk, 1}, kBF16, &rk);
  const TensorRef acc = g.tensor(kF32, {k.B, k.Hq, k.T, k.D}, {k.T * k.lddq, k.D, k.lddq, 1}, false, &rdq);
  g.matmul(ds, kr, acc, &seq_q, nullptr, &seq_kv);
  g.pointwise_into(CUDNN_POINTWISE_IDENTITY, acc, nullptr, nullptr, dQ);
  p.dq_accum = acc.uid;
  p.dq_accum_bytes = size_t(k.T * k.lddq) * sizeof(float);
}

}  // namespace

size_t build_graph_operations(const PlanKey& k, size_t cudnn_version) {
  SdpaPlan p;
  if (k.backward)
    build_backward(p, k, cudnn_version);
  else
    build_forward(p, k);
  return p.g.num_operations();
}

struct SdpaEngine::Layout {
  size_t offsets = 0, seqlens = 0, stats = 0, softmax_sum = 0, dq_accum = 0, dk_full = 0, dv_full = 0;
  size_t in_s[4] = {0, 0, 0, 0}, grad_s[4] = {0, 0, 0, 0};  // contiguous copies of a pair
  size_t plan = 0, total = 0;
  Multipliers mult;
  std::vector<int> index;  // plan offset tensor i -> its multiplier's row
};

SdpaEngine::SdpaEngine(const CudnnLib& lib, cudnnHandle_t handle) : lib_(lib), handle_(handle) {}
SdpaEngine::~SdpaEngine() = default;

std::string SdpaEngine::unsupported(int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv, const int64_t* lds, int n) {
  if (Dk != Dv) return "head dims differ (Dk " + std::to_string(Dk) + ", Dv " + std::to_string(Dv) + ")";
  if (Dk % 16 != 0 || Dk < 16 || Dk > 256)
    return "head dim " + std::to_string(Dk) + " (cuDNN's packed attention: a multiple of 16 up to 256)";
  if (Hq < 1 || Hkv < 1 || Hq % Hkv != 0)
    return "query heads " + std::to_string(Hq) + " not a multiple of key/value heads " + std::to_string(Hkv);
  for (int i = 0; i < n; ++i)
    if (lds[i] % 8 != 0) return "row stride " + std::to_string(lds[i]) + " not a multiple of 8 (16-byte rows)";
  return {};
}

PlanKey SdpaEngine::key_of(const AttnCall& c, bool backward) const {
  PlanKey k;
  k.backward = backward;
  k.B = next_pow2(std::max<int64_t>(c.S, 1));
  k.T = token_bucket(c.N);
  k.Hq = c.Hq, k.Hkv = c.Hkv, k.D = c.D, k.window = c.window > 0 ? c.window : 0;
  k.ldq = c.ldq, k.ldk = c.ldk, k.ldv = c.ldv, k.ldo = c.ldo;
  if (backward) {
    int64_t* ld[4] = {&k.ldq, &k.ldk, &k.ldv, &k.ldo};
    for (int pair = 0; pair < 4; ++pair)
      if (contiguous_copy(c, pair)) *ld[pair] = pair_ld(c, pair).packed;
    k.lddq = k.ldq, k.lddk = k.ldk, k.lddv = k.ldv, k.lddo = k.ldo;
  }
  return k;
}

SdpaPlan& SdpaEngine::plan_for(const PlanKey& k) {
  auto it = plans_.find(k);
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<SdpaPlan>();
  if (k.backward)
    build_backward(*p, k, lib_.version);
  else
    build_forward(*p, k);
  p->g.build_plan(lib_, handle_, tune_mode() ? kTuneCandidates : 1);
  p->tuned = p->g.candidates() < 2;
  return *plans_.emplace(k, std::move(p)).first->second;
}

SdpaEngine::Layout SdpaEngine::layout(const AttnCall& c, const PlanKey& k, const SdpaPlan& p) const {
  Layout L;
  for (const auto& [uid, m] : p.offsets) {
    int at = -1;
    for (int j = 0; j < L.mult.n; ++j)
      if (L.mult.m[j] == m) at = j;
    if (at < 0) {
      at = L.mult.n++;
      L.mult.m[at] = m;
    }
    L.index.push_back(at);
  }
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(std::max<size_t>(bytes, 1));
    return at;
  };
  L.offsets = take(size_t(L.mult.n) * size_t(k.B + 1) * sizeof(int64_t));
  L.seqlens = take(size_t(k.B) * sizeof(int32_t));
  L.stats = take(size_t(k.T * k.Hq) * sizeof(float));
  if (k.backward) {
    L.softmax_sum = take(p.softmax_sum_bytes);
    L.dq_accum = take(p.dq_accum_bytes);
    if (p.dk_full) L.dk_full = take(p.dk_full_bytes);
    if (p.dv_full) L.dv_full = take(p.dv_full_bytes);
    for (int pair = 0; pair < 4; ++pair)
      if (contiguous_copy(c, pair)) {
        const size_t bytes = size_t(c.N * pair_ld(c, pair).packed) * 2;
        L.in_s[pair] = take(bytes);
        L.grad_s[pair] = take(bytes);  // for o: dout's copy
      }
  }
  L.plan = take(size_t(p.g.workspace_bytes()));
  L.total = off;
  return L;
}

void SdpaEngine::prepare(const AttnCall& c, bool backward) {
  std::lock_guard<std::mutex> lock(mu_);
  plan_for(key_of(c, backward));
}

size_t SdpaEngine::workspace_bytes(const AttnCall& c, bool backward) {
  if (c.N == 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  const PlanKey k = key_of(c, backward);
  return layout(c, k, plan_for(k)).total;
}

bool SdpaEngine::forward_deterministic() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [k, p] : plans_)
    if (!k.backward && p->g.nondeterministic()) return false;
  return true;
}

namespace {

// The masks' fill value: -inf, or the lowest float before cuDNN 9.10 (what the frontend passes).
float mask_value(size_t version) {
  return version < 91000 ? std::numeric_limits<float>::lowest() : -std::numeric_limits<float>::infinity();
}

struct Bindings {
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  void add(int64_t uid, const void* p) {
    if (uid == 0) return;
    uids.push_back(uid);
    ptrs.push_back(const_cast<void*>(p));
  }
};

}  // namespace

// A plan's first call outside stream capture times its candidate configs on the call's own
// operands and keeps the fastest where it beats heuristics' first pick by kTuneMargin (else the
// first). Each candidate writes only what the call writes (the outputs, the statistics, the
// workspace), all of which the chosen plan writes again right after. Why: cuBLASLt's first picks
// left 6-13% on the 1B step's large products (gemm_cublaslt.cpp); attention is ~11% of that
// step. The margin keeps noise from flipping picks between runs; RLH_KCUDNN_TUNE=0 keeps the
// first pick, 2 logs each timed plan.
int SdpaEngine::tune_mode() {
  static const int m = [] {
    const char* e = std::getenv("RLH_KCUDNN_TUNE");
    return e ? std::atoi(e) : 1;
  }();
  return m;
}

void SdpaEngine::tune(SdpaPlan& p, const PlanKey& k, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs,
                      void* workspace, cudaStream_t stream) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return;  // a later call outside capture times them
  }
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
    cudaGetLastError();
    if (e0) cudaEventDestroy(e0);
    p.g.choose(0);
    p.tuned = true;
    return;
  }
  constexpr int kRuns = 2;
  std::vector<float> ms(p.g.candidates(), -1.f);
  for (size_t i = 0; i < p.g.candidates(); ++i) {
    try {
      execute_plan(lib_, handle_, p.g.candidate(i), uids, ptrs, workspace);  // warm-up
      cudaEventRecord(e0, stream);
      for (int r = 0; r < kRuns; ++r) execute_plan(lib_, handle_, p.g.candidate(i), uids, ptrs, workspace);
      cudaEventRecord(e1, stream);
      float t = 0.f;
      if (cudaEventSynchronize(e1) == cudaSuccess && cudaEventElapsedTime(&t, e0, e1) == cudaSuccess) ms[i] = t;
    } catch (const CudnnError&) {
      // a candidate that fails to run is not taken (the first pick runs the call as before)
    }
    cudaGetLastError();
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  size_t pick = 0;
  for (size_t i = 1; i < ms.size(); ++i)
    if (ms[i] >= 0.f && (ms[pick] < 0.f || ms[i] < ms[pick])) pick = i;
  const bool take = pick != 0 && ms[0] >= 0.f && ms[pick] * kTuneMargin <= ms[0];
  if (tune_mode() >= 2) {
    std::fprintf(stderr, "kernels_cudnn sdpa tune %s B %lld T %lld Hq %lld Hkv %lld D %lld:", k.backward ? "bwd" : "fwd",
                 (long long)k.B, (long long)k.T, (long long)k.Hq, (long long)k.Hkv, (long long)k.D);
    for (size_t i = 0; i < ms.size(); ++i) std::fprintf(stderr, " %.1f", ms[i] * 1e3f / kRuns);
    std::fprintf(stderr, " us; %s\n", take ? ("candidate " + std::to_string(pick) + " taken").c_str()
                                           : "the first kept");
  }
  p.g.choose(take ? pick : 0);
  p.tuned = true;
}

void SdpaEngine::forward(const AttnCall& c, void* workspace, cudaStream_t stream) {
  if (c.N == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  const PlanKey k = key_of(c, false);
  SdpaPlan& p = plan_for(k);
  const Layout L = layout(c, k, p);
  char* ws = static_cast<char*>(workspace);
  auto* offsets = reinterpret_cast<int64_t*>(ws + L.offsets);
  auto* seqlens = reinterpret_cast<int32_t*>(ws + L.seqlens);
  auto* stats = reinterpret_cast<float*>(ws + L.stats);
  ragged_setup(c.cu, c.S, k.B, c.N, k.T, L.mult, offsets, seqlens, stream);

  const float neg = mask_value(lib_.version), scale = c.scale, window = float(k.window);
  Bindings b;
  b.add(p.q, c.q);
  b.add(p.k, c.k);
  b.add(p.v, c.v);
  b.add(p.o, c.o);
  b.add(p.stats, stats);
  b.add(p.seq_q, seqlens);
  b.add(p.seq_kv, seqlens);
  b.add(p.scale, &scale);
  b.add(p.window, &window);
  for (int64_t u : p.neg_inf) b.add(u, &neg);
  for (size_t i = 0; i < p.offsets.size(); ++i) b.add(p.offsets[i].first, offsets + L.index[i] * (k.B + 1));
  cudnn_check(lib_.SetStream(handle_, stream), "setting cuDNN's stream");
  if (!p.tuned) tune(p, k, b.uids, b.ptrs, ws + L.plan, stream);
  execute_plan(lib_, handle_, p.g.plan(), b.uids, b.ptrs, ws + L.plan);
  stats_to_lse(stats, c.lse, c.N, c.Hq, stream);
}

void SdpaEngine::backward(const AttnCall& c, void* workspace, cudaStream_t stream) {
  if (c.N == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  const PlanKey k = key_of(c, true);
  SdpaPlan& p = plan_for(k);
  const Layout L = layout(c, k, p);
  char* ws = static_cast<char*>(workspace);
  auto* offsets = reinterpret_cast<int64_t*>(ws + L.offsets);
  auto* seqlens = reinterpret_cast<int32_t*>(ws + L.seqlens);
  auto* stats = reinterpret_cast<float*>(ws + L.stats);
  ragged_setup(c.cu, c.S, k.B, c.N, k.T, L.mult, offsets, seqlens, stream);
  lse_to_stats(c.lse, stats, c.N, c.Hq, stream);

  // Pairs with unequal strides (or wide GQA key/value rows) through contiguous copies.
  const void* in[4] = {c.q, c.k, c.v, c.o};
  void* grad[4] = {c.dq, c.dk, c.dv, const_cast<void*>(c.dout)};
  auto copy_rows = [&](void* dst, int64_t ldd, const void* src, int64_t lds, int64_t width) {
    const cudaError_t e = cudaMemcpy2DAsync(dst, size_t(ldd) * 2, src, size_t(lds) * 2, size_t(width) * 2,
                                            size_t(c.N), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) throw CudnnError(CUDNN_STATUS_EXECUTION_FAILED, std::string("copying rows: ") + cudaGetErrorString(e));
  };
  bool copied[4] = {false, false, false, false};
  for (int pair = 0; pair < 4; ++pair) {
    if (!contiguous_copy(c, pair)) continue;
    copied[pair] = true;
    const PairLd ld = pair_ld(c, pair);
    copy_rows(ws + L.in_s[pair], ld.packed, in[pair], ld.ld, ld.packed);
    in[pair] = ws + L.in_s[pair];
    if (pair == kPairO) copy_rows(ws + L.grad_s[pair], ld.packed, grad[pair], ld.ldd, ld.packed);  // dout: an input
    grad[pair] = ws + L.grad_s[pair];
  }
  const float neg = mask_value(lib_.version), scale = c.scale, window = float(k.window), one = 1.0f;
  Bindings b;
  b.add(p.q, in[kPairQ]);
  b.add(p.k, in[kPairK]);
  b.add(p.v, in[kPairV]);
  b.add(p.o, in[kPairO]);
  b.add(p.d_o, grad[kPairO]);
  b.add(p.stats, stats);
  b.add(p.dq, grad[kPairQ]);
  b.add(p.dk, grad[kPairK]);
  b.add(p.dv, grad[kPairV]);
  b.add(p.softmax_sum, ws + L.softmax_sum);
  b.add(p.dq_accum, ws + L.dq_accum);
  b.add(p.dk_full, ws + L.dk_full);
  b.add(p.dv_full, ws + L.dv_full);
  b.add(p.seq_q, seqlens);
  b.add(p.seq_kv, seqlens);
  b.add(p.scale, &scale);
  b.add(p.one, &one);
  b.add(p.window, &window);
  for (int64_t u : p.neg_inf) b.add(u, &neg);
  for (size_t i = 0; i < p.offsets.size(); ++i) b.add(p.offsets[i].first, offsets + L.index[i] * (k.B + 1));
  cudnn_check(lib_.SetStream(handle_, stream), "setting cuDNN's stream");
  if (!p.tuned) tune(p, k, b.uids, b.ptrs, ws + L.plan, stream);
  execute_plan(lib_, handle_, p.g.plan(), b.uids, b.ptrs, ws + L.plan);
  // Gradients computed into contiguous copies go back to the caller's rows.
  void* out[3] = {c.dq, c.dk, c.dv};
  for (int pair = 0; pair < 3; ++pair)
    if (copied[pair]) {
      const PairLd ld = pair_ld(c, pair);
      copy_rows(out[pair], ld.ldd, grad[pair], ld.packed, ld.packed);
    }
}

}  // namespace rlh::kcudnn
