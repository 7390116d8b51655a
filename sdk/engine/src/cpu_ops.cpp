// Ops on kernels_cpu, called directly (the reference provider). Kernel workspace comes from the
// engine's Allocator, so the engine's memory count includes it.
#include <utility>
#include <vector>

#include "rlhost/engine/ops.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::engine {
namespace {

namespace k = rlh::kcpu;

// Kernel workspace: blocks from the engine's Allocator, kept after use and handed out again for
// the same size (every step asks for the same sizes), so a 32 MiB head tile is not mapped and
// page-faulted afresh on every call. Cached blocks stay counted as live by the Allocator.
class ScratchCache {
 public:
  explicit ScratchCache(Allocator& a) : alloc_(a) {}
  ~ScratchCache() {
    for (auto& [bytes, p] : free_) alloc_.deallocate(p, bytes);
  }
  void* get(size_t bytes) {
    for (size_t i = 0; i < free_.size(); ++i)
      if (free_[i].first == bytes) {
        void* p = free_[i].second;
        free_.erase(free_.begin() + long(i));
        return p;
      }
    return alloc_.allocate(bytes);
  }
  void put(void* p, size_t bytes) { free_.emplace_back(bytes, p); }

 private:
  Allocator& alloc_;
  std::vector<std::pair<size_t, void*>> free_;
};

class CpuOps final : public Ops {
 public:
  explicit CpuOps(Allocator& a) : cache_(a) {
    scratch_.ctx = &cache_;
    scratch_.alloc = [](void* ctx, size_t bytes) -> void* {
      return static_cast<ScratchCache*>(ctx)->get(bytes);
    };
    scratch_.free = [](void* ctx, void* p, size_t bytes) {
      static_cast<ScratchCache*>(ctx)->put(p, bytes);
    };
  }
  std::string name() const override { return "kernels_cpu"; }

  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
            int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    k::gemm<float>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void embedding_fwd(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                     int64_t V) override {
    k::embedding_fwd<float>(out, ids, table, N, C, V);
  }
  void embedding_bwd(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C,
                     int64_t V) override {
    k::embedding_bwd<float>(dtable, ids, dout, N, C, V);
  }
  void rmsnorm_fwd(float* y, int64_t ldy, float* rstd, const float* x, int64_t ldx, const float* w,
                   int64_t N, int64_t C, float eps, float w_offset) override {
    k::rmsnorm_fwd<float>(y, ldy, rstd, x, ldx, w, N, C, eps, w_offset);
  }
  void rmsnorm_bwd(float* dx, int64_t lddx, float* dw, const float* dy, int64_t lddy,
                   const float* x, int64_t ldx, const float* w, const float* rstd, int64_t N,
                   int64_t C, float w_offset, bool accumulate) override {
    k::rmsnorm_bwd<float>(dx, lddx, dw, dy, lddy, x, ldx, w, rstd, N, C, w_offset, accumulate);
  }
  void rope_fwd(float* y, int64_t ldy, const float* x, int64_t ldx, const int32_t* pos,
                const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
                bool interleaved) override {
    k::rope_fwd<float>(y, ldy, x, ldx, pos, inv_freq, N, H, D, R, scale, interleaved);
  }
  void rope_bwd(float* dx, int64_t lddx, const float* dy, int64_t lddy, const int32_t* pos,
                const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
                bool interleaved) override {
    k::rope_bwd<float>(dx, lddx, dy, lddy, pos, inv_freq, N, H, D, R, scale, interleaved);
  }
  void attention_fwd(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq,
                     const float* kk, int64_t ldk, const float* v, int64_t ldv, const int32_t* cu,
                     int64_t S, int64_t N, int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv,
                     float scale, int64_t window) override {
    k::attention_fwd<float>(o, ldo, lse, q, ldq, kk, ldk, v, ldv, cu, S, N, Hq, Hkv, Dk, Dv, scale,
                            window, scratch_);
  }
  void attention_bwd(float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv, int64_t lddv,
                     const float* dout, int64_t lddo, const float* q, int64_t ldq,
                     const float* kk, int64_t ldk, const float* v, int64_t ldv, const float* o,
                     int64_t ldo, const float* lse, const int32_t* cu, int64_t S, int64_t N,
                     int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv, float scale,
                     int64_t window) override {
    k::attention_bwd<float>(dq, lddq, dk, lddk, dv, lddv, dout, lddo, q, ldq, kk, ldk, v, ldv, o,
                            ldo, lse, cu, S, N, Hq, Hkv, Dk, Dv, scale, window, scratch_);
  }
  void swiglu_fwd(float* h, int64_t ldh, const float* gate, int64_t ldg, const float* up,
                  int64_t ldu, int64_t N, int64_t F) override {
    k::swiglu_fwd<float>(h, ldh, gate, ldg, up, ldu, N, F);
  }
  void swiglu_bwd(float* dgate, int64_t lddg, float* dup, int64_t lddu, const float* dh,
                  int64_t lddh, const float* gate, int64_t ldg, const float* up, int64_t ldu,
                  int64_t N, int64_t F) override {
    k::swiglu_bwd<float>(dgate, lddg, dup, lddu, dh, lddh, gate, ldg, up, ldu, N, F);
  }
  void bias_add_fwd(float* y, int64_t ldy, const float* b, int64_t N, int64_t M) override {
    k::bias_add_fwd<float>(y, ldy, b, N, M);
  }
  void bias_bwd(float* db, const float* dy, int64_t lddy, int64_t N, int64_t M) override {
    k::bias_bwd<float>(db, dy, lddy, N, M);
  }
  void add_fwd(float* y, const float* a, const float* b, int64_t n) override {
    k::add_fwd<float>(y, a, b, n);
  }
  void linear_logprob_fwd(float* logprob, float* lse, float* entropy, const float* h,
                          const float* W, const int32_t* target, int64_t N, int64_t C, int64_t V,
                          int64_t K, const LogprobAttrs& a) override {
    k::linear_logprob_fwd<float>(logprob, lse, entropy, h, W, target, N, C, V, K, opts(a),
                                 scratch_);
  }
  void linear_logprob_bwd(float* dh, float* dW, const float* dlogprob, const float* dentropy,
                          const float* h, const float* W, const int32_t* target, const float* lse,
                          const float* entropy, int64_t N, int64_t C, int64_t V, int64_t K,
                          const LogprobAttrs& a, bool accumulate) override {
    k::linear_logprob_bwd<float>(dh, dW, dlogprob, dentropy, h, W, target, lse, entropy, N, C, V,
                                 K, opts(a), accumulate, scratch_);
  }
  void adamw(float* p, float* g, float* m, float* v, int64_t n, const AdamW& o) override {
    k::AdamWOpts a;
    a.lr = o.lr;
    a.beta1 = o.beta1;
    a.beta2 = o.beta2;
    a.eps = o.eps;
    a.weight_decay = o.weight_decay;
    a.step = o.step;
    a.grad_scale = o.grad_scale;
    a.zero_grad = o.zero_grad;
    k::adamw(p, g, m, v, n, a);
  }
  double sumsq(const float* x, int64_t n) override { return k::sumsq(x, n); }

 private:
  static k::LogprobOpts opts(const LogprobAttrs& a) {
    k::LogprobOpts o;
    o.temperature = a.temperature;
    o.top_k = a.top_k;
    o.top_p = a.top_p;
    o.chunk_bytes = a.chunk_bytes;
    return o;
  }
  ScratchCache cache_;
  k::Scratch scratch_;
};

k::RouterOpts router_opts(const Ops::RouterAttrs& a) {
  k::RouterOpts o;
  o.scoring = a.scoring;
  o.norm_topk_prob = a.norm_topk_prob;
  o.scaling_factor = a.scaling_factor;
  o.replay = a.replay;
  o.n_group = a.n_group;
  o.topk_group = a.topk_group;
  return o;
}

}  // namespace

// The MoE defaults of Ops: kernels_cpu on host memory (CpuOps inherits them).
void Ops::moe_router_fwd(float* w, int32_t* ex, float* p, float* lse, const float* z, int64_t ldl,
                         const float* bias, int64_t N, int64_t E, int64_t K, const RouterAttrs& a) {
  k::moe_router_fwd<float>(w, ex, p, lse, z, ldl, bias, N, E, K, router_opts(a));
}
void Ops::moe_router_fwd_f64(double* w, int32_t* ex, double* p, double* lse, const double* z,
                             int64_t ldl, const double* bias, int64_t N, int64_t E, int64_t K,
                             const RouterAttrs& a) {
  k::moe_router_fwd<double>(w, ex, p, lse, z, ldl, bias, N, E, K, router_opts(a));
}
void Ops::moe_router_bwd(float* dz, const float* dw, const float* p, const int32_t* ex,
                         const float* dp, const float* dlse, int64_t N, int64_t E, int64_t K,
                         const RouterAttrs& a) {
  k::moe_router_bwd<float>(dz, E, dw, p, ex, dp, dlse, N, E, K, router_opts(a));
}
void Ops::moe_router_bwd_f64(double* dz, const double* dw, const double* p, const int32_t* ex,
                             const double* dp, const double* dlse, int64_t N, int64_t E,
                             int64_t K, const RouterAttrs& a) {
  k::moe_router_bwd<double>(dz, E, dw, p, ex, dp, dlse, N, E, K, router_opts(a));
}
void Ops::gemm_f64(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha,
                   const double* A, int64_t lda, const double* B, int64_t ldb, double beta,
                   double* C, int64_t ldc) {
  k::gemm<double>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void Ops::moe_permute_fwd(float* xp, int32_t* row, int32_t* offsets, const float* x, int64_t ldx,
                          const int32_t* experts, int64_t N, int64_t K, int64_t C, int64_t E) {
  k::moe_permute_fwd<float>(xp, C, row, offsets, x, ldx, experts, N, K, C, E);
}
void Ops::moe_permute_bwd(float* dx, int64_t lddx, const float* dxp, const int32_t* row,
                          int64_t N, int64_t K, int64_t C, bool accumulate) {
  k::moe_permute_bwd<float>(dx, lddx, dxp, C, row, N, K, C, accumulate);
}
void Ops::moe_unpermute_fwd(float* y, int64_t ldy, const float* yp, const int32_t* row,
                            const float* w, int64_t N, int64_t K, int64_t C, bool accumulate) {
  k::moe_unpermute_fwd<float>(y, ldy, yp, C, row, w, N, K, C, accumulate);
}
void Ops::moe_unpermute_bwd(float* dyp, float* dw, const float* dy, int64_t lddy, const float* yp,
                            const int32_t* row, const float* w, int64_t N, int64_t K, int64_t C) {
  k::moe_unpermute_bwd<float>(dyp, C, dw, dy, lddy, yp, C, row, w, N, K, C);
}
void Ops::grouped_gemm(bool ta, bool tb, int64_t G, const int32_t* offsets, int64_t M, int64_t N,
                       int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                       int64_t ldb, int64_t stride_b, float beta, float* C, int64_t ldc,
                       int64_t stride_c) {
  k::grouped_gemm<float>(ta, tb, G, offsets, M, N, K, alpha, A, lda, B, ldb, stride_b, beta, C,
                         ldc, stride_c);
}

std::unique_ptr<Ops> make_cpu_ops(Allocator& alloc) { return std::make_unique<CpuOps>(alloc); }

}  // namespace rlh::engine
