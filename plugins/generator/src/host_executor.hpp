// The host executor: the layer program (program_runner.hpp) in float32 on the CPU's kernel
// registry (the engine's Ops), over the host KV cache (keys transposed within a block). Every
// linear step is the batch-invariant gemm; attention writes the step's keys and values with
// kv_cache_write and reads them with paged_attention; MoE runs each expert's rows through the
// same product (moe_decode.cpp); the draw is the `sample` op.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "rlhost/generator/model.hpp"

namespace rlh::gen {

// std::vector's storage on 64-byte boundaries (a cache line, one AVX-512 register).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
using AlignedFloats = std::vector<float, Aligned64<float>>;

// Weight pointers of the MoE step of one layer (the set in force).
struct MoeWeights {
  const float *router = nullptr, *router_b = nullptr, *score_bias = nullptr;
  // Expert e's gate / up [Fe, C] and down [C, Fe]: views may lie anywhere (refit by HF name
  // with one tensor per expert), so one pointer each.
  std::vector<const float*> e_gate, e_up, e_down;
  const float *ws_gate_proj = nullptr, *ws_up = nullptr, *ws_down = nullptr, *ws_gate = nullptr;
  // The float64 router (router_fp64): the router weight widened, refreshed with the set
  std::vector<double> router64;
};

// ProgramRunner's backend on the host (its interface: program_runner.hpp).
class HostBackend {
 public:
  using T = float;
  HostBackend(DecodeModel& m, engine::Ops* ops);

  // Before a step: the weights' pointers (rebound when the set changed), scratch for its rows,
  // the rows' own RoPE tables.
  void prepare(const StepRows& rows, KvCache& kv);
  const float* logits() const { return logits_.data(); }

  const float* w(int64_t param) const { return param < 0 ? nullptr : m_.weights().param(size_t(param)); }
  float* residual(int i) { return xs_[i].data(); }
  float* values() { return values_.data(); }
  float* mla_scratch() { return mla_f_.data(); }
  float* head_scratch() { return xn_.data(); }
  void embed(float* x, int64_t R);
  // Tensor parallelism: the group's sum of a row-parallel step's partial output, in place.
  void tp_reduce(float* y, int64_t n);
  void scale(float* x, int64_t n, double s) { ops_->scale(x, n, s); }
  void norm(float* y, int64_t ldy, const float* x, int64_t ldx, const float* w, int64_t R, int64_t C, float eps,
            float offset) {
    ops_->rmsnorm_fwd(y, ldy, nullptr, x, ldx, w, R, C, eps, offset);
  }
  void linear(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t R, int64_t N, int64_t K) {
    ops_->gemm_rows(y, ldy, x, ldx, W, K, R, N, K);
  }
  void bias_add(float* y, int64_t ldy, const float* b, int64_t R, int64_t N) { ops_->bias_add_fwd(y, ldy, b, R, N); }
  void rope(int t, float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D, int64_t R);
  void attend(int64_t l, const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v, int64_t ldv,
              float* o, int64_t ldo, int64_t R);
  void glu(const std::string& act, float* h, int64_t ldh, const float* gu, int64_t ldgu, int64_t R, int64_t F);
  void add(float* y, const float* a, const float* b, int64_t n) { ops_->add_fwd(y, a, b, n); }
  // The residual add and the norm after it (program_runner.hpp): here the two ops, so the
  // runner's fused path (a layer's first norm in norm_scratch) runs and is tested on the CPU too.
  bool add_norm(float* y, float* yn, const float* a, const float* b, const float* w, int64_t R, int64_t C, float eps,
                float offset) {
    ops_->add_fwd(y, a, b, R * C);
    ops_->rmsnorm_fwd(yn, C, nullptr, y, C, w, R, C, eps, offset);
    return true;
  }
  float* norm_scratch(int i) { return normed_[i].data(); }
  // gate|up then its GLU (program_runner.hpp): the two ops through the values' scratch row, so
  // the runner's fused path runs on the CPU too.
  bool linear_glu(const std::string& act, float* h, int64_t ldh, const float* x, int64_t ldx, const float* W, int64_t R,
                  int64_t F, int64_t K) {
    float* gu = glu_scratch(R * 2 * F);
    linear(gu, 2 * F, x, ldx, W, R, 2 * F, K);
    glu(act, h, ldh, gu, 2 * F, R, F);
    return true;
  }
  // A norm with the product after it (and its GLU), a product with the residual add after it
  // (program_runner.hpp): here the ops in turn, at up to 4 rows as the CUDA executor takes them,
  // so the runner's fused paths run and are tested on the CPU too (add_norm's at more rows).
  bool norm_linear(const std::string& act, float* h, int64_t ldh, const float* x, const float* w, const float* W,
                   int64_t R, int64_t N, int64_t K, float eps, float offset) {
    if (R > 4) return false;
    float* xn = glu_scratch(R * K + (act.empty() ? 0 : R * 2 * N));
    norm(xn, K, x, K, w, R, K, eps, offset);
    if (act.empty()) {
      linear(h, ldh, xn, K, W, R, N, K);
    } else {
      float* gu = xn + R * K;
      linear(gu, 2 * N, xn, K, W, R, 2 * N, K);
      glu(act, h, ldh, gu, 2 * N, R, N);
    }
    return true;
  }
  bool linear_add(float* y, const float* r, const float* x, int64_t ldx, const float* W, int64_t R, int64_t N,
                  int64_t K) {
    if (R > 4) return false;
    float* p = glu_scratch(R * N);
    linear(p, N, x, ldx, W, R, N, K);
    add(y, r, p, R * N);
    return true;
  }
  // RoPE of q and k, then attention (program_runner.hpp): here the two steps, at up to 4 rows as
  // the fused ones above, so the runner's path runs on the CPU too.
  bool rope_attend(int t, int64_t l, float* qk, int64_t ldqk, int64_t Hq, int64_t Hk, int64_t D, const float* v,
                   int64_t ldv, float* o, int64_t ldo, int64_t R) {
    if (R > 4) return false;
    rope(t, qk, ldqk, qk, ldqk, Hq + Hk, D, R);
    attend(l, qk, ldqk, qk + Hq * D, ldqk, v, ldv, o, ldo, R);
    return true;
  }
  void copy2d(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols);
  void moe(int64_t l, int64_t R, const float* xn, float* y);  // moe_decode.cpp
  const float* gather_rows(const float* x, int64_t R);
  void logits(const float* xn, const float* W, int64_t S);

 private:
  void bind_weights();
  void reserve(int64_t rows, int64_t samples);

  DecodeModel& m_;
  engine::Ops* ops_;
  int64_t C_, V_;
  int64_t bound_serial_ = -1;  // Weights::serial() the MoE pointers were read at
  bool bound_fp64_ = false;
  std::vector<MoeWeights> lw_;
  const StepRows* rows_ = nullptr;  // the step running
  KvCache* kv_ = nullptr;

  // Per RoPE table with a dynamic threshold: the rows' own tables past it.
  struct RowRope {
    std::vector<float> freq;    // [rows, R/2]
    std::vector<uint8_t> own;   // [rows]
  };
  std::vector<RowRope> row_rope_;

  // Scratch for up to cap_rows_ rows (grown on demand; no state survives a step).
  int64_t cap_rows_ = 0, cap_samples_ = 0;
  AlignedFloats xs_[2];        // the residual stream, layer by layer in turn [R, C]
  AlignedFloats normed_[2];    // a layer's first norm, written by the last layer's add [R, C]
  AlignedFloats glu_;          // linear_glu's gate|up product [R, 2F]
  float* glu_scratch(int64_t n) {
    if (int64_t(glu_.size()) < n) glu_.resize(size_t(n));
    return glu_.data();
  }
  AlignedFloats values_;       // a layer's other values (the worst layer's worth)
  AlignedFloats hs_, xn_;      // the sampled rows' hidden states and their final norm [S, C]
  AlignedFloats logits_;       // [S, V]
  AlignedFloats tile_, gathered_;  // tensor parallelism: this rank's [S, B] logits, every rank's
  AlignedFloats mla_f_;        // MLA scratch
  AlignedFloats moe_f_;        // MoE scratch
  std::vector<double> moe_d_;  // float64 router scratch
  std::vector<int32_t> moe_i_;
};

}  // namespace rlh::gen
