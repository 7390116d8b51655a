// An Ops decorator that times every call by op name (wall clock), for benchmarks and tuning.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "rlhost/engine/ops.hpp"

namespace rlh::engine {
namespace {

class ProfilingOps final : public Ops {
 public:
  explicit ProfilingOps(Ops& inner) : in_(inner) {}
  std::string name() const override { return "profile(" + in_.name() + ")"; }

  std::string report() const {
    double total = 0;
    for (const auto& [k, v] : t_) total += v.seconds;
    std::string out;
    char line[160];
    for (const auto& [k, v] : t_) {
      std::snprintf(line, sizeof line, "  %-20s %8.3f s %5.1f%% %8ld calls\n", k.c_str(), v.seconds,
                    total > 0 ? 100 * v.seconds / total : 0.0, long(v.calls));
      out += line;
    }
    std::snprintf(line, sizeof line, "  %-20s %8.3f s\n", "total", total);
    return out + line;
  }
  void reset() { t_.clear(); }

#define RLH_TIMED(NAME, CALL)                                                        \
  {                                                                                  \
    const auto t0 = std::chrono::steady_clock::now();                                \
    CALL;                                                                            \
    auto& e = t_[NAME];                                                              \
    e.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); \
    ++e.calls;                                                                       \
  }

  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
            int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) override {
    RLH_TIMED("gemm", in_.gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))
  }
  void embedding_fwd(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                     int64_t V) override {
    RLH_TIMED("embedding_fwd", in_.embedding_fwd(out, ids, table, N, C, V))
  }
  void embedding_bwd(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C,
                     int64_t V) override {
    RLH_TIMED("embedding_bwd", in_.embedding_bwd(dtable, ids, dout, N, C, V))
  }
  void rmsnorm_fwd(float* y, int64_t ldy, float* rstd, const float* x, int64_t ldx, const float* w,
                   int64_t N, int64_t C, float eps, float off) override {
    RLH_TIMED("rmsnorm_fwd", in_.rmsnorm_fwd(y, ldy, rstd, x, ldx, w, N, C, eps, off))
  }
  void rmsnorm_bwd(float* dx, int64_t lddx, float* dw, const float* dy, int64_t lddy,
                   const float* x, int64_t ldx, const float* w, const float* rstd, int64_t N,
                   int64_t C, float off, bool acc) override {
    RLH_TIMED("rmsnorm_bwd",
              in_.rmsnorm_bwd(dx, lddx, dw, dy, lddy, x, ldx, w, rstd, N, C, off, acc))
  }
  void rope_fwd(float* y, int64_t ldy, const float* x, int64_t ldx, const int32_t* pos,
                const float* f, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
                bool il) override {
    RLH_TIMED("rope_fwd", in_.rope_fwd(y, ldy, x, ldx, pos, f, N, H, D, R, scale, il))
  }
  void rope_bwd(float* dx, int64_t lddx, const float* dy, int64_t lddy, const int32_t* pos,
                const float* f, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
                bool il) override {
    RLH_TIMED("rope_bwd", in_.rope_bwd(dx, lddx, dy, lddy, pos, f, N, H, D, R, scale, il))
  }
  void attention_fwd(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq,
                     const float* k, int64_t ldk, const float* v, int64_t ldv, const int32_t* cu,
                     int64_t S, int64_t N, int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv,
                     float scale, int64_t window, float softcap) override {
    RLH_TIMED("attention_fwd", in_.attention_fwd(o, ldo, lse, q, ldq, k, ldk, v, ldv, cu, S, N, Hq,
                                                 Hkv, Dk, Dv, scale, window, softcap))
  }
  void attention_bwd(float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv, int64_t lddv,
                     const float* dout, int64_t lddo, const float* q, int64_t ldq, const float* k,
                     int64_t ldk, const float* v, int64_t ldv, const float* o, int64_t ldo,
                     const float* lse, const int32_t* cu, int64_t S, int64_t N, int64_t Hq,
                     int64_t Hkv, int64_t Dk, int64_t Dv, float scale, int64_t window,
                     float softcap) override {
    RLH_TIMED("attention_bwd",
              in_.attention_bwd(dq, lddq, dk, lddk, dv, lddv, dout, lddo, q, ldq, k, ldk, v, ldv,
                                o, ldo, lse, cu, S, N, Hq, Hkv, Dk, Dv, scale, window, softcap))
  }
  void swiglu_fwd(float* h, int64_t ldh, const float* g, int64_t ldg, const float* u, int64_t ldu,
                  int64_t N, int64_t F) override {
    RLH_TIMED("swiglu_fwd", in_.swiglu_fwd(h, ldh, g, ldg, u, ldu, N, F))
  }
  void swiglu_bwd(float* dg, int64_t lddg, float* du, int64_t lddu, const float* dh, int64_t lddh,
                  const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t N,
                  int64_t F) override {
    RLH_TIMED("swiglu_bwd", in_.swiglu_bwd(dg, lddg, du, lddu, dh, lddh, g, ldg, u, ldu, N, F))
  }
  void geglu_fwd(float* h, int64_t ldh, const float* g, int64_t ldg, const float* u, int64_t ldu,
                 int64_t N, int64_t F, bool t) override {
    RLH_TIMED("geglu_fwd", in_.geglu_fwd(h, ldh, g, ldg, u, ldu, N, F, t))
  }
  void geglu_bwd(float* dg, int64_t lddg, float* du, int64_t lddu, const float* dh, int64_t lddh,
                 const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t N, int64_t F,
                 bool t) override {
    RLH_TIMED("geglu_bwd", in_.geglu_bwd(dg, lddg, du, lddu, dh, lddh, g, ldg, u, ldu, N, F, t))
  }
  void scale(float* x, int64_t n, double s) override { RLH_TIMED("scale", in_.scale(x, n, s)) }
  void gemm_rows(float* y, int64_t ldy, const float* x, int64_t ldx, const float* W, int64_t ldw, int64_t M,
                 int64_t N, int64_t K) override {
    RLH_TIMED("gemm_rows", in_.gemm_rows(y, ldy, x, ldx, W, ldw, M, N, K))
  }
  void gemm_rows_f64(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W, int64_t ldw,
                     int64_t M, int64_t N, int64_t K) override {
    RLH_TIMED("gemm_rows_f64", in_.gemm_rows_f64(y, ldy, x, ldx, W, ldw, M, N, K))
  }
  void kv_cache_write(const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t R, const int32_t* slots,
                      const PagedCache& c) override {
    RLH_TIMED("kv_cache_write", in_.kv_cache_write(k, ldk, v, ldv, R, slots, c))
  }
  void paged_attention(float* o, int64_t ldo, const float* q, int64_t ldq, int64_t R, int64_t Hq,
                       const PagedCache& c, const int32_t* blocks, int64_t tw, const int32_t* pos, float scale,
                       int64_t window, float softcap) override {
    RLH_TIMED("paged_attention",
              in_.paged_attention(o, ldo, q, ldq, R, Hq, c, blocks, tw, pos, scale, window, softcap))
  }
  void sample(int32_t* tokens, float* logprobs, const float* logits, int64_t ld, int64_t S, int64_t V,
              const double* u, const SampleAttrs& a) override {
    RLH_TIMED("sample", in_.sample(tokens, logprobs, logits, ld, S, V, u, a))
  }
  void bias_add_fwd(float* y, int64_t ldy, const float* b, int64_t N, int64_t M) override {
    RLH_TIMED("bias_add_fwd", in_.bias_add_fwd(y, ldy, b, N, M))
  }
  void bias_bwd(float* db, const float* dy, int64_t lddy, int64_t N, int64_t M) override {
    RLH_TIMED("bias_bwd", in_.bias_bwd(db, dy, lddy, N, M))
  }
  void add_fwd(float* y, const float* a, const float* b, int64_t n) override {
    RLH_TIMED("add_fwd", in_.add_fwd(y, a, b, n))
  }
  void linear_logprob_fwd(float* lp, float* lse, float* ent, const float* h, const float* W,
                          const int32_t* t, int64_t N, int64_t C, int64_t V, int64_t K,
                          const LogprobAttrs& a) override {
    RLH_TIMED("linear_logprob_fwd", in_.linear_logprob_fwd(lp, lse, ent, h, W, t, N, C, V, K, a))
  }
  void linear_logprob_bwd(float* dh, float* dW, const float* dlp, const float* dent,
                          const float* h, const float* W, const int32_t* t, const float* lse,
                          const float* ent, int64_t N, int64_t C, int64_t V, int64_t K,
                          const LogprobAttrs& a, bool acc) override {
    RLH_TIMED("linear_logprob_bwd",
              in_.linear_logprob_bwd(dh, dW, dlp, dent, h, W, t, lse, ent, N, C, V, K, a, acc))
  }
  void adamw(float* p, float* g, float* m, float* v, int64_t n, const AdamW& o) override {
    RLH_TIMED("adamw", in_.adamw(p, g, m, v, n, o))
  }
  double sumsq(const float* x, int64_t n) override {
    double r = 0;
    RLH_TIMED("sumsq", r = in_.sumsq(x, n))
    return r;
  }
  void moe_router_fwd(float* w, int32_t* ex, float* p, float* lse, const float* z, int64_t ldl,
                      const float* bias, int64_t N, int64_t E, int64_t K,
                      const RouterAttrs& a) override {
    RLH_TIMED("moe_router_fwd", in_.moe_router_fwd(w, ex, p, lse, z, ldl, bias, N, E, K, a))
  }
  void moe_router_fwd_f64(double* w, int32_t* ex, double* p, double* lse, const double* z,
                          int64_t ldl, const double* bias, int64_t N, int64_t E, int64_t K,
                          const RouterAttrs& a) override {
    RLH_TIMED("moe_router_fwd_f64",
              in_.moe_router_fwd_f64(w, ex, p, lse, z, ldl, bias, N, E, K, a))
  }
  void moe_router_bwd(float* dz, const float* dw, const float* p, const int32_t* ex,
                      const float* dp, const float* dlse, int64_t N, int64_t E, int64_t K,
                      const RouterAttrs& a) override {
    RLH_TIMED("moe_router_bwd", in_.moe_router_bwd(dz, dw, p, ex, dp, dlse, N, E, K, a))
  }
  void moe_router_bwd_f64(double* dz, const double* dw, const double* p, const int32_t* ex,
                          const double* dp, const double* dlse, int64_t N, int64_t E, int64_t K,
                          const RouterAttrs& a) override {
    RLH_TIMED("moe_router_bwd_f64", in_.moe_router_bwd_f64(dz, dw, p, ex, dp, dlse, N, E, K, a))
  }
  void gemm_f64(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A,
                int64_t lda, const double* B, int64_t ldb, double beta, double* C,
                int64_t ldc) override {
    RLH_TIMED("gemm_f64", in_.gemm_f64(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc))
  }
  void moe_permute_fwd(float* xp, int32_t* row, int32_t* off, const float* x, int64_t ldx,
                       const int32_t* ex, int64_t N, int64_t K, int64_t C, int64_t E) override {
    RLH_TIMED("moe_permute_fwd", in_.moe_permute_fwd(xp, row, off, x, ldx, ex, N, K, C, E))
  }
  void moe_permute_bwd(float* dx, int64_t lddx, const float* dxp, const int32_t* row, int64_t N,
                       int64_t K, int64_t C, bool acc) override {
    RLH_TIMED("moe_permute_bwd", in_.moe_permute_bwd(dx, lddx, dxp, row, N, K, C, acc))
  }
  void moe_unpermute_fwd(float* y, int64_t ldy, const float* yp, const int32_t* row,
                         const float* w, int64_t N, int64_t K, int64_t C, bool acc) override {
    RLH_TIMED("moe_unpermute_fwd", in_.moe_unpermute_fwd(y, ldy, yp, row, w, N, K, C, acc))
  }
  void moe_unpermute_bwd(float* dyp, float* dw, const float* dy, int64_t lddy, const float* yp,
                         const int32_t* row, const float* w, int64_t N, int64_t K,
                         int64_t C) override {
    RLH_TIMED("moe_unpermute_bwd", in_.moe_unpermute_bwd(dyp, dw, dy, lddy, yp, row, w, N, K, C))
  }
  void grouped_gemm(bool ta, bool tb, int64_t G, const int32_t* off, int64_t M, int64_t N,
                    int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                    int64_t ldb, int64_t stride_b, float beta, float* C, int64_t ldc,
                    int64_t stride_c) override {
    RLH_TIMED("grouped_gemm", in_.grouped_gemm(ta, tb, G, off, M, N, K, alpha, A, lda, B, ldb,
                                               stride_b, beta, C, ldc, stride_c))
  }
#undef RLH_TIMED

 private:
  struct Entry {
    double seconds = 0;
    int64_t calls = 0;
  };
  Ops& in_;
  std::map<std::string, Entry> t_;
};

}  // namespace

std::unique_ptr<Ops> make_profiling_ops(Ops& inner) { return std::make_unique<ProfilingOps>(inner); }
std::string profiling_report(const Ops& ops) {
  const auto* p = dynamic_cast<const ProfilingOps*>(&ops);
  return p ? p->report() : std::string();
}
void profiling_reset(Ops& ops) {
  if (auto* p = dynamic_cast<ProfilingOps*>(&ops)) p->reset();
}

}  // namespace rlh::engine
