// Ops over the C ABI's kernel registry: every op is resolved once (float32, host memory, no
// shapes) in the registry's preference order, then each call builds DLPack-layout descriptors
// for the engine's pointers and runs the resolved handle. Operands and attributes follow
// docs/ops.md; optional operands are passed as descriptors with a null data pointer.
// Kernel workspace is the provider's business here (kernels_cpu takes it from the host's
// allocation service, which counts it).
#include <array>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/engine/ops.hpp"
#include "rlhost/sdk/kernels.hpp"

namespace rlh::engine {
namespace {

using sdk::attr_bool;
using sdk::attr_double;
using sdk::attr_int;

// Descriptors for one call: shape/stride storage lives in the builder.
class Args {
 public:
  rlh_tensor vec(const void* p, int64_t n, rlh_dtype dt = sdk::kF32) {
    return make(p, dt, {n}, {1});
  }
  rlh_tensor mat(const void* p, int64_t rows, int64_t cols, int64_t ld) {
    return make(p, sdk::kF32, {rows, cols}, {ld, 1});
  }
  rlh_tensor heads(const void* p, int64_t N, int64_t H, int64_t D, int64_t ld) {
    return make(p, sdk::kF32, {N, H, D}, {ld, D, 1});
  }
  rlh_tensor ints(const int32_t* p, int64_t n) { return vec(p, n, sdk::kI32); }
  rlh_tensor imat(const int32_t* p, int64_t rows, int64_t cols) {
    return make(p, sdk::kI32, {rows, cols}, {cols, 1});
  }
  rlh_tensor mat64(const double* p, int64_t rows, int64_t cols, int64_t ld) {
    return make(p, sdk::kF64, {rows, cols}, {ld, 1});
  }
  rlh_tensor vec64(const double* p, int64_t n) { return make(p, sdk::kF64, {n}, {1}); }
  // [B, H, rows, cols] with the given strides (the paged KV cache)
  rlh_tensor cache(const float* p, int64_t B, int64_t H, int64_t rows, int64_t cols,
                   std::array<int64_t, 4> strides) {
    return make(p, sdk::kF32, {B, H, rows, cols}, {strides[0], strides[1], strides[2], strides[3]});
  }
  // The same over FP8 e4m3 codes
  rlh_tensor cache8(const uint8_t* p, int64_t B, int64_t H, int64_t rows, int64_t cols,
                    std::array<int64_t, 4> strides) {
    return make(p, sdk::kE4M3, {B, H, rows, cols}, {strides[0], strides[1], strides[2], strides[3]});
  }
  // [G, rows, cols], groups `stride` apart, rows `ld` apart
  rlh_tensor groups(const float* p, int64_t G, int64_t rows, int64_t cols, int64_t ld,
                    int64_t stride) {
    return make(p, sdk::kF32, {G, rows, cols}, {stride, ld, 1});
  }

 private:
  rlh_tensor make(const void* p, rlh_dtype dt, std::initializer_list<int64_t> shape,
                  std::initializer_list<int64_t> strides) {
    if (used_ == kMax) throw std::logic_error("registry ops: too many operands");
    Slot& s = slots_[used_++];
    std::copy(shape.begin(), shape.end(), s.shape.begin());
    std::copy(strides.begin(), strides.end(), s.strides.begin());
    rlh_tensor t{};
    t.data = const_cast<void*>(p);
    t.device = sdk::kCPU;
    t.ndim = int32_t(shape.size());
    t.dtype = dt;
    t.shape = s.shape.data();
    t.strides = s.strides.data();
    return t;
  }
  static constexpr size_t kMax = 12;
  struct Slot {
    std::array<int64_t, 4> shape{}, strides{};
  };
  std::array<Slot, kMax> slots_;
  size_t used_ = 0;
};

// Placeholder descriptors for resolution: dtype and rank per operand ('f' float32 2-D,
// 'i' int32 1-D, 'j' int32 2-D, 'v' float32 1-D, 'h' float32 3-D, 'c' float32 4-D, 'q' e4m3 4-D,
// 'd' float64 2-D, 'w' float64 1-D).
std::vector<rlh_tensor> placeholders(const char* kinds, std::vector<std::array<int64_t, 4>>& dims) {
  std::vector<rlh_tensor> v;
  for (const char* k = kinds; *k; ++k) {
    dims.push_back({1, 1, 1, 1});
    rlh_tensor t{};
    t.device = sdk::kCPU;
    t.dtype = (*k == 'i' || *k == 'j') ? sdk::kI32 : (*k == 'd' || *k == 'w') ? sdk::kF64 : *k == 'q' ? sdk::kE4M3 : sdk::kF32;
    t.ndim = (*k == 'c' || *k == 'q') ? 4 : *k == 'h' ? 3 : ((*k == 'f' || *k == 'j' || *k == 'd') ? 2 : 1);
    t.shape = dims.back().data();
    t.strides = dims.back().data();
    v.push_back(t);
  }
  return v;
}

class RegistryOps final : public Ops {
 public:
  RegistryOps(const sdk::KernelRegistry& reg, const std::string& only, Allocator* alloc)
      : reg_(reg), only_(only), alloc_(alloc) {
    auto get = [&](const char* name, const char* in, const char* out) {
      return resolve(name, in, out);
    };
    gemm_ = get("gemm", "ff", "f");
    emb_f_ = get("embedding_fwd", "if", "f");
    emb_b_ = get("embedding_bwd", "if", "f");
    rms_f_ = get("rmsnorm_fwd", "fv", "fv");
    rms_b_ = get("rmsnorm_bwd", "ffvv", "fv");
    rope_f_ = get("rope_fwd", "hiv", "h");
    rope_b_ = get("rope_bwd", "hiv", "h");
    att_f_ = get("attention_fwd", "hhhi", "hv");
    att_b_ = get("attention_bwd", "hhhhhvi", "hhh");
    swi_f_ = get("swiglu_fwd", "ff", "f");
    swi_b_ = get("swiglu_bwd", "fff", "ff");
    bias_f_ = get("bias_add_fwd", "v", "f");
    bias_b_ = get("bias_bwd", "f", "v");
    add_ = get("add_fwd", "vv", "v");
    lp_f_ = get("linear_logprob_fwd", "ffj", "fvv");
    lp_b_ = get("linear_logprob_bwd", "ffjvfvv", "ff");
    adamw_ = get("adamw", "", "vvvv");
    sumsq_ = get("sumsq", "v", "v");
    provider_ = gemm_.provider();
  }
  std::string name() const override { return "registry(" + provider_ + ")"; }

  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
            int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    Args a;
    const rlh_tensor in[] = {ta ? a.mat(A, K, M, lda) : a.mat(A, M, K, lda),
                             tb ? a.mat(B, N, K, ldb) : a.mat(B, K, N, ldb)};
    const rlh_tensor out[] = {a.mat(C, M, N, ldc)};
    const rlh_named_value at[] = {attr_bool("transpose_a", ta), attr_bool("transpose_b", tb),
                                  attr_double("alpha", alpha), attr_double("beta", beta)};
    gemm_.run(in, out, at);
  }
  void embedding_fwd(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                     int64_t V) override {
    Args a;
    const rlh_tensor in[] = {a.ints(ids, N), a.mat(table, V, C, C)};
    const rlh_tensor o[] = {a.mat(out, N, C, C)};
    emb_f_.run(in, o);
  }
  void embedding_bwd(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C,
                     int64_t V) override {
    Args a;
    const rlh_tensor in[] = {a.ints(ids, N), a.mat(dout, N, C, C)};
    const rlh_tensor o[] = {a.mat(dtable, V, C, C)};
    emb_b_.run(in, o);
  }
  void rmsnorm_fwd(float* y, int64_t ldy, float* rstd, const float* x, int64_t ldx, const float* w,
                   int64_t N, int64_t C, float eps, float off) override {
    Args a;
    const rlh_tensor in[] = {a.mat(x, N, C, ldx), a.vec(w, C)};
    const rlh_tensor o[] = {a.mat(y, N, C, ldy), a.vec(rstd, N)};
    const rlh_named_value at[] = {attr_double("eps", eps), attr_double("weight_offset", off)};
    rms_f_.run(in, o, at);
  }
  void rmsnorm_bwd(float* dx, int64_t lddx, float* dw, const float* dy, int64_t lddy,
                   const float* x, int64_t ldx, const float* w, const float* rstd, int64_t N,
                   int64_t C, float off, bool acc) override {
    Args a;
    const rlh_tensor in[] = {a.mat(dy, N, C, lddy), a.mat(x, N, C, ldx), a.vec(w, C),
                             a.vec(rstd, N)};
    const rlh_tensor o[] = {a.mat(dx, N, C, lddx), a.vec(dw, C)};
    const rlh_named_value at[] = {attr_double("weight_offset", off), attr_bool("accumulate", acc)};
    rms_b_.run(in, o, at);
  }
  void rope_fwd(float* y, int64_t ldy, const float* x, int64_t ldx, const int32_t* pos,
                const float* f, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
                bool il) override {
    rope(rope_f_, y, ldy, x, ldx, pos, f, N, H, D, R, scale, il);
  }
  void rope_bwd(float* dx, int64_t lddx, const float* dy, int64_t lddy, const int32_t* pos,
                const float* f, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
                bool il) override {
    rope(rope_b_, dx, lddx, dy, lddy, pos, f, N, H, D, R, scale, il);
  }
  void attention_fwd(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq,
                     const float* k, int64_t ldk, const float* v, int64_t ldv, const int32_t* cu,
                     int64_t S, int64_t N, int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv,
                     float scale, int64_t window, float softcap) override {
    Args a;
    const rlh_tensor in[] = {a.heads(q, N, Hq, Dk, ldq), a.heads(k, N, Hkv, Dk, ldk),
                             a.heads(v, N, Hkv, Dv, ldv), a.ints(cu, S + 1)};
    const rlh_tensor out[] = {a.heads(o, N, Hq, Dv, ldo), a.vec(lse, Hq * N)};
    const rlh_named_value at[] = {attr_double("scale", scale), attr_int("window", window),
                                  attr_double("softcap", softcap)};
    if (softcap > 0)
      run_ws(lazy(att_cap_f_, "attention_fwd", "hhhi", "hv", cap_attr(softcap)), in, out, at);
    else
      run_ws(att_f_, in, out, std::span(at, 2));
  }
  void attention_bwd(float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv, int64_t lddv,
                     const float* dout, int64_t lddo, const float* q, int64_t ldq, const float* k,
                     int64_t ldk, const float* v, int64_t ldv, const float* o, int64_t ldo,
                     const float* lse, const int32_t* cu, int64_t S, int64_t N, int64_t Hq,
                     int64_t Hkv, int64_t Dk, int64_t Dv, float scale, int64_t window,
                     float softcap) override {
    Args a;
    const rlh_tensor in[] = {a.heads(dout, N, Hq, Dv, lddo), a.heads(q, N, Hq, Dk, ldq),
                             a.heads(k, N, Hkv, Dk, ldk),     a.heads(v, N, Hkv, Dv, ldv),
                             a.heads(o, N, Hq, Dv, ldo),      a.vec(lse, Hq * N),
                             a.ints(cu, S + 1)};
    const rlh_tensor out[] = {a.heads(dq, N, Hq, Dk, lddq), a.heads(dk, N, Hkv, Dk, lddk),
                              a.heads(dv, N, Hkv, Dv, lddv)};
    const rlh_named_value at[] = {attr_double("scale", scale), attr_int("window", window),
                                  attr_double("softcap", softcap)};
    if (softcap > 0)
      run_ws(lazy(att_cap_b_, "attention_bwd", "hhhhhvi", "hhh", cap_attr(softcap)), in, out, at);
    else
      run_ws(att_b_, in, out, std::span(at, 2));
  }
  void swiglu_fwd(float* h, int64_t ldh, const float* g, int64_t ldg, const float* u, int64_t ldu,
                  int64_t N, int64_t F) override {
    Args a;
    const rlh_tensor in[] = {a.mat(g, N, F, ldg), a.mat(u, N, F, ldu)};
    const rlh_tensor o[] = {a.mat(h, N, F, ldh)};
    swi_f_.run(in, o);
  }
  void swiglu_bwd(float* dg, int64_t lddg, float* du, int64_t lddu, const float* dh, int64_t lddh,
                  const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t N,
                  int64_t F) override {
    Args a;
    const rlh_tensor in[] = {a.mat(dh, N, F, lddh), a.mat(g, N, F, ldg), a.mat(u, N, F, ldu)};
    const rlh_tensor o[] = {a.mat(dg, N, F, lddg), a.mat(du, N, F, lddu)};
    swi_b_.run(in, o);
  }
  void geglu_fwd(float* h, int64_t ldh, const float* g, int64_t ldg, const float* u, int64_t ldu,
                 int64_t N, int64_t F, bool tanh) override {
    Args a;
    const rlh_tensor in[] = {a.mat(g, N, F, ldg), a.mat(u, N, F, ldu)};
    const rlh_tensor o[] = {a.mat(h, N, F, ldh)};
    const rlh_named_value at[] = {attr_bool("approximate_tanh", tanh)};
    lazy(geglu_f_, "geglu_fwd", "ff", "f").run(in, o, at);
  }
  void geglu_bwd(float* dg, int64_t lddg, float* du, int64_t lddu, const float* dh, int64_t lddh,
                 const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t N, int64_t F,
                 bool tanh) override {
    Args a;
    const rlh_tensor in[] = {a.mat(dh, N, F, lddh), a.mat(g, N, F, ldg), a.mat(u, N, F, ldu)};
    const rlh_tensor o[] = {a.mat(dg, N, F, lddg), a.mat(du, N, F, lddu)};
    const rlh_named_value at[] = {attr_bool("approximate_tanh", tanh)};
    lazy(geglu_b_, "geglu_bwd", "fff", "ff").run(in, o, at);
  }
  void scale(float* x, int64_t n, double s) override {
    Args a;
    const rlh_tensor o[] = {a.vec(x, n)};
    const rlh_named_value at[] = {attr_double("scale", s)};
    lazy(scale_, "scale", "", "v").run({}, o, at);
  }
  void gemm_rows(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t ldw, int64_t M,
                 int64_t N, int64_t K) override {
    Args a;
    const rlh_tensor in[] = {a.mat(x, M, K, ldx), a.mat(W, N, K, ldw)};
    const rlh_tensor o[] = {a.mat(y, M, N, ldy)};
    const auto at = rows_attrs();
    lazy(rows_, "gemm", "ff", "f", at).run(in, o, at);
  }
  void gemm_rows_f64(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W, int64_t ldw,
                     int64_t M, int64_t N, int64_t K) override {
    Args a;
    const rlh_tensor in[] = {a.mat64(x, M, K, ldx), a.mat64(W, N, K, ldw)};
    const rlh_tensor o[] = {a.mat64(y, M, N, ldy)};
    const auto at = rows_attrs();
    lazy(rows64_, "gemm", "dd", "d", at).run(in, o, at);
  }
  void kv_cache_write(const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t R, const int32_t* slots,
                      const PagedCache& c) override {
    Args a;
    const int64_t bs = c.block_size;
    if (c.k8) {
      const rlh_tensor in[] = {a.heads(k, R, c.Hkv, c.Dk, ldk), a.heads(v, R, c.Hkv, c.Dv, ldv), a.ints(slots, R),
                               a.vec(&c.k_scale, 1), a.vec(&c.v_scale, 1)};
      const rlh_tensor o[] = {a.cache8(c.k8, c.num_blocks, c.Hkv, bs, c.Dk, {c.block_stride, c.Dk * bs, 1, bs}),
                              a.cache8(c.v8, c.num_blocks, c.Hkv, bs, c.Dv, {c.block_stride, bs * c.Dv, c.Dv, 1})};
      lazy(kvw8_, "kv_cache_write", "hhivv", "qq").run(in, o);
      return;
    }
    const rlh_tensor in[] = {a.heads(k, R, c.Hkv, c.Dk, ldk), a.heads(v, R, c.Hkv, c.Dv, ldv), a.ints(slots, R)};
    const rlh_tensor o[] = {a.cache(c.k, c.num_blocks, c.Hkv, bs, c.Dk, {c.block_stride, c.Dk * bs, 1, bs}),
                            a.cache(c.v, c.num_blocks, c.Hkv, bs, c.Dv, {c.block_stride, bs * c.Dv, c.Dv, 1})};
    lazy(kvw_, "kv_cache_write", "hhi", "cc").run(in, o);
  }
  void paged_attention(float* out, int64_t ldo, const float* q, int64_t ldq, int64_t R, int64_t Hq,
                       const PagedCache& c, const int32_t* blocks, int64_t table_width, const int32_t* pos,
                       float scale, int64_t window, float softcap) override {
    Args a;
    const int64_t bs = c.block_size;
    const rlh_tensor o[] = {a.heads(out, R, Hq, c.Dv, ldo)};
    const rlh_named_value at[] = {attr_double("scale", scale), attr_int("window", window),
                                  attr_double("softcap", softcap)};
    if (c.k8) {
      const rlh_tensor in[] = {a.heads(q, R, Hq, c.Dk, ldq),
                               a.cache8(c.k8, c.num_blocks, c.Hkv, bs, c.Dk, {c.block_stride, c.Dk * bs, 1, bs}),
                               a.cache8(c.v8, c.num_blocks, c.Hkv, bs, c.Dv, {c.block_stride, bs * c.Dv, c.Dv, 1}),
                               a.imat(blocks, R, table_width), a.ints(pos, R), a.vec(&c.k_scale, 1),
                               a.vec(&c.v_scale, 1)};
      if (softcap > 0)
        lazy(paged8_cap_, "paged_attention", "hqqjivv", "h", cap_attr(softcap)).run(in, o, at);
      else
        lazy(paged8_, "paged_attention", "hqqjivv", "h").run(in, o, std::span(at, 2));
      return;
    }
    const rlh_tensor in[] = {a.heads(q, R, Hq, c.Dk, ldq),
                             a.cache(c.k, c.num_blocks, c.Hkv, bs, c.Dk, {c.block_stride, c.Dk * bs, 1, bs}),
                             a.cache(c.v, c.num_blocks, c.Hkv, bs, c.Dv, {c.block_stride, bs * c.Dv, c.Dv, 1}),
                             a.imat(blocks, R, table_width), a.ints(pos, R)};
    if (softcap > 0)
      lazy(paged_cap_, "paged_attention", "hccji", "h", cap_attr(softcap)).run(in, o, at);
    else
      lazy(paged_, "paged_attention", "hccji", "h").run(in, o, std::span(at, 2));
  }
  void sample(int32_t* tokens, float* logprobs, const float* logits, int64_t ld, int64_t S, int64_t V,
              const double* u, const SampleAttrs& s) override {
    Args a;
    const rlh_tensor in[] = {a.mat(logits, S, V, ld), a.vec64(u, S)};
    const rlh_tensor o[] = {a.ints(tokens, S), a.vec(logprobs, S)};
    const rlh_named_value at[] = {attr_double("temperature", s.temperature), attr_int("top_k", s.top_k),
                                  attr_double("top_p", s.top_p), attr_double("min_p", s.min_p),
                                  attr_double("softcap", s.softcap)};
    if (s.softcap > 0)
      lazy(sample_cap_, "sample", "fw", "iv", cap_attr(s.softcap)).run(in, o, at);
    else
      lazy(sample_, "sample", "fw", "iv").run(in, o, std::span(at, 4));
  }
  void bias_add_fwd(float* y, int64_t ldy, const float* b, int64_t N, int64_t M) override {
    Args a;
    const rlh_tensor in[] = {a.vec(b, M)};
    const rlh_tensor o[] = {a.mat(y, N, M, ldy)};
    bias_f_.run(in, o);
  }
  void bias_bwd(float* db, const float* dy, int64_t lddy, int64_t N, int64_t M) override {
    Args a;
    const rlh_tensor in[] = {a.mat(dy, N, M, lddy)};
    const rlh_tensor o[] = {a.vec(db, M)};
    bias_b_.run(in, o);
  }
  void add_fwd(float* y, const float* x, const float* b, int64_t n) override {
    Args a;
    const rlh_tensor in[] = {a.vec(x, n), a.vec(b, n)};
    const rlh_tensor o[] = {a.vec(y, n)};
    add_.run(in, o);
  }
  void linear_logprob_fwd(float* lp, float* lse, float* ent, const float* h, const float* W,
                          const int32_t* t, int64_t N, int64_t C, int64_t V, int64_t K,
                          const LogprobAttrs& la) override {
    Args a;
    const rlh_tensor in[] = {a.mat(h, N, C, C), a.mat(W, V, C, C), a.imat(t, N, K)};
    const rlh_tensor o[] = {a.mat(lp, N, K, K), a.vec(lse, N), a.vec(ent, N)};  // ent may be null
    const auto at = logprob_attrs(la, false);
    if (la.softcap > 0)
      run_ws(lazy(lp_cap_f_, "linear_logprob_fwd", "ffj", "fvv", cap_attr(la.softcap)), in, o, at);
    else
      run_ws(lp_f_, in, o, std::span(at.data(), at.size() - 1));
  }
  void linear_logprob_bwd(float* dh, float* dW, const float* dlp, const float* dent,
                          const float* h, const float* W, const int32_t* t, const float* lse,
                          const float* ent, int64_t N, int64_t C, int64_t V, int64_t K,
                          const LogprobAttrs& la, bool acc) override {
    Args a;
    const rlh_tensor in[] = {a.mat(h, N, C, C),   a.mat(W, V, C, C), a.imat(t, N, K),
                             a.vec(lse, N),       a.mat(dlp, N, K, K), a.vec(ent, N),
                             a.vec(dent, N)};
    const rlh_tensor o[] = {a.mat(dh, N, C, C), a.mat(dW, V, C, C)};
    const auto at = logprob_attrs(la, acc);
    if (la.softcap > 0)
      run_ws(lazy(lp_cap_b_, "linear_logprob_bwd", "ffjvfvv", "ff", cap_attr(la.softcap)), in, o, at);
    else
      run_ws(lp_b_, in, o, std::span(at.data(), at.size() - 1));
  }
  void adamw(float* p, float* g, float* m, float* v, int64_t n, const AdamW& x) override {
    Args a;
    const rlh_tensor o[] = {a.vec(p, n), a.vec(g, n), a.vec(m, n), a.vec(v, n)};
    const rlh_named_value at[] = {attr_double("lr", x.lr),
                                  attr_double("beta1", x.beta1),
                                  attr_double("beta2", x.beta2),
                                  attr_double("eps", x.eps),
                                  attr_double("weight_decay", x.weight_decay),
                                  attr_int("step", x.step),
                                  attr_double("grad_scale", x.grad_scale),
                                  attr_bool("zero_grad", x.zero_grad)};
    adamw_.run({}, o, at);
  }
  double sumsq(const float* x, int64_t n) override {
    Args a;
    float out = 0;
    const rlh_tensor in[] = {a.vec(x, n)};
    const rlh_tensor o[] = {a.vec(&out, 1)};
    sumsq_.run(in, o);
    return double(out);
  }

  // MoE: resolved on first use, so a provider without MoE ops still runs dense models.
  void moe_router_fwd(float* w, int32_t* ex, float* p, float* lse, const float* z, int64_t ldl,
                      const float* bias, int64_t N, int64_t E, int64_t K,
                      const RouterAttrs& ra) override {
    Args a;
    std::vector<rlh_tensor> in = {a.mat(z, N, E, ldl)};
    if (bias) in.push_back(a.vec(bias, E));
    const rlh_tensor o[] = {a.mat(w, N, K, K), a.imat(ex, N, K), a.mat(p, N, E, E), a.vec(lse, N)};
    const auto at = router_attrs(ra);
    lazy(router_f_, "moe_router_fwd", "f", "fjfv").run(in, o, at);
  }
  void moe_router_fwd_f64(double* w, int32_t* ex, double* p, double* lse, const double* z,
                          int64_t ldl, const double* bias, int64_t N, int64_t E, int64_t K,
                          const RouterAttrs& ra) override {
    Args a;
    std::vector<rlh_tensor> in = {a.mat64(z, N, E, ldl)};
    if (bias) in.push_back(a.vec64(bias, E));
    const rlh_tensor o[] = {a.mat64(w, N, K, K), a.imat(ex, N, K), a.mat64(p, N, E, E),
                            a.vec64(lse, N)};
    const auto at = router_attrs(ra);
    lazy(router_f64_, "moe_router_fwd", "d", "djdw").run(in, o, at);
  }
  void moe_router_bwd(float* dz, const float* dw, const float* p, const int32_t* ex,
                      const float* dp, const float* dlse, int64_t N, int64_t E, int64_t K,
                      const RouterAttrs& ra) override {
    Args a;
    const rlh_tensor in[] = {a.mat(dw, N, K, K), a.mat(p, N, E, E), a.imat(ex, N, K),
                             a.mat(dp, N, E, E), a.vec(dlse, N)};  // null data = absent
    const rlh_tensor o[] = {a.mat(dz, N, E, E)};
    const auto at = router_attrs(ra);
    lazy(router_b_, "moe_router_bwd", "ffj", "f").run(in, o, at);
  }
  void moe_router_bwd_f64(double* dz, const double* dw, const double* p, const int32_t* ex,
                          const double* dp, const double* dlse, int64_t N, int64_t E, int64_t K,
                          const RouterAttrs& ra) override {
    Args a;
    const rlh_tensor in[] = {a.mat64(dw, N, K, K), a.mat64(p, N, E, E), a.imat(ex, N, K),
                             a.mat64(dp, N, E, E), a.vec64(dlse, N)};
    const rlh_tensor o[] = {a.mat64(dz, N, E, E)};
    const auto at = router_attrs(ra);
    lazy(router_b64_, "moe_router_bwd", "ddj", "d").run(in, o, at);
  }
  void gemm_f64(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                int64_t lda, const double* B, int64_t ldb, double beta, double* C,
                int64_t ldc) override {
    Args a;
    const rlh_tensor in[] = {ta ? a.mat64(A, K, M, lda) : a.mat64(A, M, K, lda),
                             tb ? a.mat64(B, N, K, ldb) : a.mat64(B, K, N, ldb)};
    const rlh_tensor out[] = {a.mat64(C, M, N, ldc)};
    const rlh_named_value at[] = {attr_bool("transpose_a", ta), attr_bool("transpose_b", tb),
                                  attr_double("alpha", alpha), attr_double("beta", beta)};
    lazy(gemm64_, "gemm", "dd", "d").run(in, out, at);
  }
  void moe_permute_fwd(float* xp, int32_t* row, int32_t* off, const float* x, int64_t ldx,
                       const int32_t* ex, int64_t N, int64_t K, int64_t C, int64_t E) override {
    Args a;
    const rlh_tensor in[] = {a.mat(x, N, C, ldx), a.imat(ex, N, K)};
    const rlh_tensor o[] = {a.mat(xp, N * K, C, C), a.imat(row, N, K), a.ints(off, E + 1)};
    lazy(perm_f_, "moe_permute_fwd", "fj", "fji").run(in, o);
  }
  void moe_permute_bwd(float* dx, int64_t lddx, const float* dxp, const int32_t* row, int64_t N,
                       int64_t K, int64_t C, bool acc) override {
    Args a;
    const rlh_tensor in[] = {a.mat(dxp, N * K, C, C), a.imat(row, N, K)};
    const rlh_tensor o[] = {a.mat(dx, N, C, lddx)};
    const rlh_named_value at[] = {attr_bool("accumulate", acc)};
    lazy(perm_b_, "moe_permute_bwd", "fj", "f").run(in, o, at);
  }
  void moe_unpermute_fwd(float* y, int64_t ldy, const float* yp, const int32_t* row,
                         const float* w, int64_t N, int64_t K, int64_t C, bool acc) override {
    Args a;
    const rlh_tensor in[] = {a.mat(yp, N * K, C, C), a.imat(row, N, K), a.mat(w, N, K, K)};
    const rlh_tensor o[] = {a.mat(y, N, C, ldy)};
    const rlh_named_value at[] = {attr_bool("accumulate", acc)};
    lazy(unperm_f_, "moe_unpermute_fwd", "fjf", "f").run(in, o, at);
  }
  void moe_unpermute_bwd(float* dyp, float* dw, const float* dy, int64_t lddy, const float* yp,
                         const int32_t* row, const float* w, int64_t N, int64_t K,
                         int64_t C) override {
    Args a;
    const rlh_tensor in[] = {a.mat(dy, N, C, lddy), a.mat(yp, N * K, C, C), a.imat(row, N, K),
                             a.mat(w, N, K, K)};
    const rlh_tensor o[] = {a.mat(dyp, N * K, C, C), a.mat(dw, N, K, K)};  // dw may be null
    lazy(unperm_b_, "moe_unpermute_bwd", "ffjf", "ff").run(in, o);
  }
  void grouped_gemm(bool ta, bool tb, int64_t G, const int32_t* off, int64_t M, int64_t N,
                    int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                    int64_t ldb, int64_t stride_b, float beta, float* C, int64_t ldc,
                    int64_t stride_c) override {
    // The row count is the last offset (the caller's pointer is host memory: Ops is host-side).
    const int64_t T = off[G];
    Args a;
    const rlh_tensor in[] = {
        ta ? a.mat(A, T, M, lda) : a.mat(A, T, K, lda),
        ta ? a.mat(B, T, N, ldb)
           : (tb ? a.groups(B, G, N, K, ldb, stride_b) : a.groups(B, G, K, N, ldb, stride_b)),
        a.ints(off, G + 1)};
    const rlh_tensor o[] = {ta ? a.groups(C, G, M, N, ldc, stride_c) : a.mat(C, T, N, ldc)};
    const rlh_named_value at[] = {attr_bool("transpose_a", ta), attr_bool("transpose_b", tb),
                                  attr_double("alpha", alpha), attr_double("beta", beta)};
    lazy(ggemm_, "grouped_gemm", "fhi", "f").run(in, o, at);
  }

 private:
  // Runs an op that takes scratch with a workspace the provider sized (workspace_size), drawn
  // from the engine's Allocator when one is given: one block, grown to the largest need and
  // kept, so a steady state allocates nothing and the engine's memory count includes it.
  template <size_t NI, size_t NO, size_t NA>
  void run_ws(const sdk::Op& op, const rlh_tensor (&in)[NI], const rlh_tensor (&out)[NO],
              const std::array<rlh_named_value, NA>& at) {
    run_ws(op, std::span<const rlh_tensor>(in), std::span<const rlh_tensor>(out), std::span<const rlh_named_value>(at));
  }
  template <size_t NI, size_t NO, size_t NA>
  void run_ws(const sdk::Op& op, const rlh_tensor (&in)[NI], const rlh_tensor (&out)[NO],
              const rlh_named_value (&at)[NA]) {
    run_ws(op, std::span<const rlh_tensor>(in), std::span<const rlh_tensor>(out), std::span<const rlh_named_value>(at));
  }
  void run_ws(const sdk::Op& op, std::span<const rlh_tensor> in, std::span<const rlh_tensor> out,
              std::span<const rlh_named_value> at) {
    rlh_op_call call{};
    call.struct_size = RLH_STRUCT_SIZE(rlh_op_call, workspace_bytes);
    call.inputs = in.data();
    call.num_inputs = in.size();
    call.outputs = out.data();
    call.num_outputs = out.size();
    call.attrs = at.data();
    call.num_attrs = at.size();
    if (alloc_ != nullptr) {
      const size_t need = op.workspace_size(call);
      if (need > ws_.size()) {
        ws_.reset();
        ws_ = Buffer<char>(*alloc_, need);
      }
      call.workspace = need ? ws_.data() : nullptr;
      call.workspace_bytes = need ? ws_.size() : 0;
    }
    op.run(call);
  }

  sdk::Op resolve(const char* name, const char* in, const char* out,
                  std::span<const rlh_named_value> attrs = {}) const {
    std::vector<std::array<int64_t, 4>> dims;
    dims.reserve(32);  // the descriptors point into it
    const std::vector<rlh_tensor> i = placeholders(in, dims), o = placeholders(out, dims);
    return reg_.resolve(name, sdk::kCPU, i, o, attrs, false, only_);
  }
  const sdk::Op& lazy(std::optional<sdk::Op>& slot, const char* name, const char* in,
                      const char* out, std::span<const rlh_named_value> attrs = {}) {
    if (!slot) slot.emplace(resolve(name, in, out, attrs));
    return *slot;
  }
  // gemm asked for batch invariance at resolution (the registry checks the handle's op_info).
  static std::array<rlh_named_value, 3> rows_attrs() {
    return {attr_bool("batch_invariant", true), attr_bool("transpose_a", false), attr_bool("transpose_b", true)};
  }
  static std::array<rlh_named_value, 6> router_attrs(const RouterAttrs& r) {
    return {attr_int("scoring", r.scoring), attr_bool("norm_topk_prob", r.norm_topk_prob),
            attr_double("scaling_factor", r.scaling_factor), attr_bool("replay", r.replay),
            attr_int("n_group", r.n_group), attr_int("topk_group", r.topk_group)};
  }

  void rope(const sdk::Op& op, float* y, int64_t ldy, const float* x, int64_t ldx,
            const int32_t* pos, const float* f, int64_t N, int64_t H, int64_t D, int64_t R,
            double scale, bool il) {
    Args a;
    const rlh_tensor in[] = {a.heads(x, N, H, D, ldx), a.ints(pos, N), a.vec(f, R / 2)};
    const rlh_tensor o[] = {a.heads(y, N, H, D, ldy)};
    const rlh_named_value at[] = {attr_double("scale", scale), attr_bool("interleaved", il)};
    op.run(in, o, at);
  }
  // The soft-cap last, so a call without one passes the others alone.
  static std::array<rlh_named_value, 6> logprob_attrs(const LogprobAttrs& la, bool acc) {
    return {attr_double("temperature", la.temperature), attr_int("top_k", la.top_k),
            attr_double("top_p", la.top_p),           attr_int("chunk_bytes", la.chunk_bytes),
            attr_bool("accumulate", acc),             attr_double("softcap", la.softcap)};
  }
  // Soft-capped ops are resolved with the attribute (Gemma-2), so a provider that does not cap
  // refuses them there and the next one answers; a model without caps never asks for them.
  static std::array<rlh_named_value, 1> cap_attr(double softcap) { return {attr_double("softcap", softcap)}; }

  const sdk::KernelRegistry& reg_;
  std::string only_;
  Allocator* alloc_;
  Buffer<char> ws_;
  sdk::Op gemm_, emb_f_, emb_b_, rms_f_, rms_b_, rope_f_, rope_b_, att_f_, att_b_, swi_f_, swi_b_,
      bias_f_, bias_b_, add_, lp_f_, lp_b_, adamw_, sumsq_;
  std::optional<sdk::Op> router_f_, router_f64_, router_b_, router_b64_, gemm64_, perm_f_, perm_b_,
      unperm_f_, unperm_b_, ggemm_, geglu_f_, geglu_b_, scale_, rows_, rows64_, paged_, sample_, kvw_,
      att_cap_f_, att_cap_b_, lp_cap_f_, lp_cap_b_, paged_cap_, sample_cap_, kvw8_, paged8_, paged8_cap_;
  std::string provider_;
};

}  // namespace

std::unique_ptr<Ops> make_registry_ops(const sdk::KernelRegistry& registry, Allocator* workspace,
                                       const std::string& only) {
  return std::make_unique<RegistryOps>(registry, only, workspace);
}

}  // namespace rlh::engine
