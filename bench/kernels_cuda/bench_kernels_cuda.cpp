// bench_kernels_cuda: achieved TFLOP/s and GB/s of kernels_cuda's ops at the Llama-3.2-1B
// training shapes (d 2048, ffn 8192, vocab 128256, 32/8 heads of 64, T = 8192 tokens = 4
// packed sequences of 2048), one line per measurement:
//   RESULT impl=rlhost name=<op> shape=<...> value=<x> unit=<TFLOP/s|GB/s> ms=<median>
// bench_torch.py prints the same names for PyTorch; run.sh sets them side by side.
// Timing: CUDA events around each launch, 3 warm-ups, the median of the repeats; inputs are
// random (never zeros); memory-bound ops rotate through enough buffer sets that the data of
// consecutive launches does not sit in the 50 MB L2. Bytes counted: each operand read once and
// each output written once. FLOPs: 2 per multiply-add; attention counts the causal half
// (fwd 4 T^2/2 D per head, bwd 2.5x fwd, the usual convention).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "rlhost/kernels_cuda/kernels.hpp"
#include <cstdlib>

using namespace rlh::kcuda;

namespace {

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

class BenchWorkspace final : public Workspace {
 public:
  ~BenchWorkspace() override {
    for (auto& [p, n] : ptrs_) cudaFree(p);
  }
  // Reused across launches (the benchmark runs one op at a time on one stream).
  void* get(size_t bytes) override {
    if (next_ < ptrs_.size() && ptrs_[next_].second >= bytes) return ptrs_[next_++].first;
    void* p = nullptr;
    CK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
    if (next_ < ptrs_.size()) {
      cudaFree(ptrs_[next_].first);
      ptrs_[next_] = {p, bytes};
    } else {
      ptrs_.push_back({p, bytes});
    }
    ++next_;
    return p;
  }
  void reset() { next_ = 0; }

 private:
  std::vector<std::pair<void*, size_t>> ptrs_;
  size_t next_ = 0;
};

// Random device data (bf16 or f32) filled on the host in blocks.
void* dev_random(size_t n, bool bf16, float scale, uint32_t seed) {
  void* p = nullptr;
  CK(cudaMalloc(&p, n * (bf16 ? 2 : 4)));
  std::mt19937 rng(seed);
  std::normal_distribution<float> N01(0, 1);
  const size_t block = 1 << 22;
  std::vector<float> f(std::min(n, block));
  std::vector<__nv_bfloat16> b(bf16 ? f.size() : 0);
  for (size_t i = 0; i < f.size(); ++i) f[i] = N01(rng) * scale;
  for (size_t i = 0; i < b.size(); ++i) b[i] = __float2bfloat16(f[i]);
  // Tile the random block (cheap on the host; values stay non-trivial).
  for (size_t off = 0; off < n; off += block) {
    const size_t m = std::min(block, n - off);
    if (bf16)
      CK(cudaMemcpy(static_cast<char*>(p) + off * 2, b.data(), m * 2, cudaMemcpyHostToDevice));
    else
      CK(cudaMemcpy(static_cast<char*>(p) + off * 4, f.data(), m * 4, cudaMemcpyHostToDevice));
  }
  return p;
}

cudaStream_t g_stream;
int g_reps = 20;

// Median milliseconds of f(rep) over the repeats.
double time_ms(const std::function<void(int)>& f, int reps = -1) {
  if (reps < 0) reps = g_reps;
  for (int i = 0; i < 3; ++i) f(i);
  CK(cudaStreamSynchronize(g_stream));
  std::vector<cudaEvent_t> ev(size_t(reps) + 1);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  CK(cudaEventRecord(ev[0], g_stream));
  for (int i = 0; i < reps; ++i) {
    f(i);
    CK(cudaEventRecord(ev[size_t(i) + 1], g_stream));
  }
  CK(cudaStreamSynchronize(g_stream));
  CK(cudaGetLastError());
  std::vector<float> t(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) CK(cudaEventElapsedTime(&t[size_t(i)], ev[size_t(i)], ev[size_t(i) + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void result(const char* name, const std::string& shape, double ms, double flops, double bytes) {
  if (flops > 0)
    std::printf("RESULT impl=rlhost name=%s shape=%s value=%.1f unit=TFLOP/s ms=%.4f\n", name,
                shape.c_str(), flops / ms / 1e9, ms);
  else
    std::printf("RESULT impl=rlhost name=%s shape=%s value=%.0f unit=GB/s ms=%.4f\n", name,
                shape.c_str(), bytes / ms / 1e6, ms);
  std::fflush(stdout);
}

// Buffer sets to rotate through so consecutive launches miss L2 (>= 4 sets or 400 MB).
int sets_for(double bytes_per_call) {
  return int(std::clamp(std::ceil(400e6 / std::max(bytes_per_call, 1.0)), 1.0, 8.0));
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) g_reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
  }
  auto want = [&](const char* group) { return only.empty() || only.find(group) != std::string::npos; };
  CK(cudaSetDevice(0));
  CK(cudaStreamCreate(&g_stream));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  DeviceInfo dev;
  dev.sm_count = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs, %.0f GB\n", prop.name, prop.multiProcessorCount,
              double(prop.totalGlobalMem) / 1e9);
  GemmEngine* eng = gemm_engine_create(dev);
  std::printf("%s\n", gemm_engine_info(eng));
  BenchWorkspace ws;
  const int64_t T = 8192, d = 2048, F = 8192, V = 128256, Hq = 32, Hkv = 8, Dh = 64, L = 2048;

  // ---- copy ceiling
  if (want("copy")) {
    const size_t n = size_t(1) << 30;  // 1 GiB
    void* a = dev_random(n / 4, false, 1, 1);
    void* b = nullptr;
    CK(cudaMalloc(&b, n));
    const double ms = time_ms([&](int) { CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, g_stream)); });
    result("copy", "1GiB", ms, 0, 2.0 * double(n));
    cudaFree(a);
    cudaFree(b);
  }

  // ---- GEMMs (bf16, fp32 accumulation)
  if (want("gemm")) {
    struct G {
      const char* name;
      bool ta, tb;
      int64_t M, N, K;
      bool c_f32;
      double beta;
    };
    const G gs[] = {
        {"gemm_qkv_fwd", false, true, T, 3072, d, false, 0},        // X Wqkv^T
        {"gemm_o_fwd", false, true, T, d, d, false, 0},             // attn Wo^T
        {"gemm_gateup_fwd", false, true, T, 2 * F, d, false, 0},    // X [Wg;Wu]^T
        {"gemm_down_fwd", false, true, T, d, F, false, 0},          // h Wd^T
        {"gemm_lmhead_fwd", false, true, T, V, d, false, 0},        // H E^T
        {"gemm_down_dx", false, false, T, F, d, false, 0},          // dY Wd
        {"gemm_gateup_dw", true, false, 2 * F, d, T, true, 1.0},    // dW += dY^T X (f32 grads)
        {"gemm_qkv_dw", true, false, 3072, d, T, true, 1.0},
    };
    for (const G& g : gs) {
      const int64_t ar = g.ta ? g.K : g.M, ac = g.ta ? g.M : g.K;
      const int64_t br = g.tb ? g.N : g.K, bc = g.tb ? g.K : g.N;
      void* A = dev_random(size_t(ar * ac), true, 1, 2);
      void* B = dev_random(size_t(br * bc), true, 0.02f, 3);
      void* C = dev_random(size_t(g.M * g.N), !g.c_f32, 0.01f, 4);
      GemmArgs a;
      a.ta = g.ta;
      a.tb = g.tb;
      a.M = g.M;
      a.N = g.N;
      a.K = g.K;
      a.beta = g.beta;
      a.A = A;
      a.lda = ac;
      a.B = B;
      a.ldb = bc;
      a.C = C;
      a.ldc = g.N;
      a.ab = DType::bf16;
      a.c_dt = g.c_f32 ? DType::f32 : DType::bf16;
      const double ms = time_ms([&](int) { ws.reset(); gemm(eng, a, ws, g_stream); });
      result(g.name, std::to_string(g.M) + "x" + std::to_string(g.N) + "x" + std::to_string(g.K),
             ms, 2.0 * double(g.M) * double(g.N) * double(g.K), 0);
      cudaFree(A);
      cudaFree(B);
      cudaFree(C);
    }
  }

  // ---- attention (4 packed sequences of 2048, 32/8 heads of 64; and heads of 128)
  if (want("attn")) {
    for (int64_t D : {int64_t(64), int64_t(128)}) {
      const int64_t hq = D == 64 ? Hq : 16, hkv = D == 64 ? Hkv : 4;
      const int64_t S = T / L;
      std::vector<int32_t> cu;
      for (int64_t s = 0; s <= S; ++s) cu.push_back(int32_t(s * L));
      int32_t* dcu = nullptr;
      CK(cudaMalloc(reinterpret_cast<void**>(&dcu), cu.size() * 4));
      CK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
      void* q = dev_random(size_t(T * hq * D), true, 1, 5);
      void* k = dev_random(size_t(T * hkv * D), true, 1, 6);
      void* v = dev_random(size_t(T * hkv * D), true, 1, 7);
      void* o = dev_random(size_t(T * hq * D), true, 1, 8);
      void* dO = dev_random(size_t(T * hq * D), true, 1, 9);
      void* dq = dev_random(size_t(T * hq * D), true, 1, 10);
      void* dk = dev_random(size_t(T * hkv * D), true, 1, 11);
      void* dv = dev_random(size_t(T * hkv * D), true, 1, 12);
      void* lse = dev_random(size_t(T * hq), false, 1, 13);
      AttnArgs a;
      a.t = DType::bf16;
      a.N = T;
      a.S = S;
      a.Hq = hq;
      a.Hkv = hkv;
      a.Dk = a.Dv = D;
      a.scale = float(1 / std::sqrt(double(D)));
      a.cu = dcu;
      a.q = q;
      a.k = k;
      a.v = v;
      a.o = o;
      a.dout = dO;
      a.dq = dq;
      a.dk = dk;
      a.dv = dv;
      a.ldq = a.ldo = a.lddo = a.lddq = hq * D;
      a.ldk = a.ldv = a.lddk = a.lddv = hkv * D;
      a.lse = Flex{lse, false};
      const double fwd_flops = 4.0 * double(S) * double(hq) * double(D) * double(L) * double(L + 1) / 2;
      const std::string shape = "S4xT2048xHq" + std::to_string(hq) + "xHkv" + std::to_string(hkv) +
                                "xD" + std::to_string(D);
      std::printf("attention path: %s\n", attention_path(a));
      double ms = time_ms([&](int) { attention_fwd(a, dev, g_stream); });
      result(D == 64 ? "attn_fwd" : "attn_fwd_d128", shape, ms, fwd_flops, 0);
      ms = time_ms([&](int) { ws.reset(); attention_bwd(a, dev, ws, g_stream); });
      result(D == 64 ? "attn_bwd" : "attn_bwd_d128", shape, ms, 2.5 * fwd_flops, 0);
      // Every tile configuration of the tensor-core kernels (attention_fwd.cu / _bwd.cu).
      if (std::getenv("RLH_BENCH_ATTN_VARIANTS")) {
        for (int var = 1; var <= (D == 64 ? 6 : 3); ++var) {
          a.variant = var;
          const double f = time_ms([&](int) { attention_fwd(a, dev, g_stream); });
          double b = 0;
          if (var <= 3) b = time_ms([&](int) { ws.reset(); attention_bwd(a, dev, ws, g_stream); });
          std::printf("VARIANT D=%ld v=%d fwd %.1f TFLOP/s (%.3f ms)  bwd %.1f TFLOP/s (%.3f ms)\n",
                      long(D), var, fwd_flops / f / 1e9, f, b > 0 ? 2.5 * fwd_flops / b / 1e9 : 0.0, b);
        }
        a.variant = 0;
      }
      for (void* p : {q, k, v, o, dO, dq, dk, dv, lse}) cudaFree(p);
      cudaFree(dcu);
    }
  }

  // ---- memory-bound ops (bf16 activations), rotating buffer sets
  if (want("mem")) {
    {  // rmsnorm fwd/bwd at [T, d]
      const size_t n = size_t(T * d);
      const int R = sets_for(4.0 * double(n));
      std::vector<void*> x, y, dy, dx;
      std::vector<void*> rstd;
      for (int r = 0; r < R; ++r) {
        x.push_back(dev_random(n, true, 1, 20 + r));
        y.push_back(dev_random(n, true, 1, 30 + r));
        dy.push_back(dev_random(n, true, 1, 40 + r));
        dx.push_back(dev_random(n, true, 1, 50 + r));
        rstd.push_back(dev_random(size_t(T), false, 1, 60 + r));
      }
      void* w = dev_random(size_t(d), true, 1, 70);
      void* dw = dev_random(size_t(d), false, 0, 71);
      double ms = time_ms([&](int i) {
        rmsnorm_fwd(DType::bf16, y[i % R], d, Flex{rstd[i % R], false}, x[i % R], d, w, T, d, 1e-5f, 0, g_stream);
      });
      result("rmsnorm_fwd", "8192x2048", ms, 0, 2.0 * 2 * double(n) + 4.0 * T);
      ms = time_ms([&](int i) {
        ws.reset();
        rmsnorm_bwd(DType::bf16, dx[i % R], d, Flex{dw, false}, dy[i % R], d, x[i % R], d, w,
                    Flex{rstd[i % R], false}, T, d, 0, false, ws, g_stream);
      });
      result("rmsnorm_bwd", "8192x2048", ms, 0, 3.0 * 2 * double(n) + 4.0 * T);
      for (int r = 0; r < R; ++r) for (void* p : {x[r], y[r], dy[r], dx[r], rstd[r]}) cudaFree(p);
      cudaFree(w);
      cudaFree(dw);
    }
    {  // rope on q [T, 32, 64]
      const size_t n = size_t(T * Hq * Dh);
      const int R = sets_for(4.0 * double(n));
      std::vector<void*> x, y;
      for (int r = 0; r < R; ++r) {
        x.push_back(dev_random(n, true, 1, 80 + r));
        y.push_back(dev_random(n, true, 1, 90 + r));
      }
      std::vector<int32_t> pos(T);
      for (int64_t i = 0; i < T; ++i) pos[size_t(i)] = int32_t(i % L);
      std::vector<float> inv(Dh / 2);
      for (int64_t i = 0; i < Dh / 2; ++i) inv[size_t(i)] = float(std::pow(500000.0, -2.0 * double(i) / double(Dh)));
      int32_t* dpos = nullptr;
      float* dinv = nullptr;
      CK(cudaMalloc(reinterpret_cast<void**>(&dpos), T * 4));
      CK(cudaMalloc(reinterpret_cast<void**>(&dinv), inv.size() * 4));
      CK(cudaMemcpy(dpos, pos.data(), T * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(dinv, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
      const double ms = time_ms([&](int i) {
        rope(DType::bf16, y[i % R], Hq * Dh, x[i % R], Hq * Dh, dpos, dinv, T, Hq, Dh, Dh, 1.0, false, false, g_stream);
      });
      result("rope_fwd", "8192x32x64", ms, 0, 2.0 * 2 * double(n));
      for (int r = 0; r < R; ++r) { cudaFree(x[r]); cudaFree(y[r]); }
      cudaFree(dpos);
      cudaFree(dinv);
    }
    {  // swiglu fwd/bwd at [T, F]
      const size_t n = size_t(T * F);
      const int R = sets_for(10.0 * double(n));
      std::vector<void*> g, u, h, dg, du;
      for (int r = 0; r < R; ++r) {
        g.push_back(dev_random(n, true, 2, 100 + r));
        u.push_back(dev_random(n, true, 1, 110 + r));
        h.push_back(dev_random(n, true, 1, 120 + r));
        dg.push_back(dev_random(n, true, 1, 130 + r));
        du.push_back(dev_random(n, true, 1, 140 + r));
      }
      double ms = time_ms([&](int i) {
        swiglu_fwd(DType::bf16, h[i % R], F, g[i % R], F, u[i % R], F, T, F, g_stream);
      });
      result("swiglu_fwd", "8192x8192", ms, 0, 3.0 * 2 * double(n));
      ms = time_ms([&](int i) {
        swiglu_bwd(DType::bf16, dg[i % R], F, du[i % R], F, h[i % R], F, g[i % R], F, u[i % R], F, T, F, g_stream);
      });
      result("swiglu_bwd", "8192x8192", ms, 0, 5.0 * 2 * double(n));
      for (int r = 0; r < R; ++r) for (void* p : {g[r], u[r], h[r], dg[r], du[r]}) cudaFree(p);
    }
    {  // embedding fwd, residual add
      const size_t n = size_t(T * d);
      void* table = dev_random(size_t(V * d), true, 1, 150);
      std::vector<int32_t> ids(T);
      std::mt19937 rng(3);
      for (auto& x : ids) x = int32_t(rng() % uint32_t(V));
      int32_t* dids = nullptr;
      CK(cudaMalloc(reinterpret_cast<void**>(&dids), T * 4));
      CK(cudaMemcpy(dids, ids.data(), T * 4, cudaMemcpyHostToDevice));
      const int R = sets_for(6.0 * double(n));
      std::vector<void*> out, a, b;
      for (int r = 0; r < R; ++r) {
        out.push_back(dev_random(n, true, 1, 160 + r));
        a.push_back(dev_random(n, true, 1, 170 + r));
        b.push_back(dev_random(n, true, 1, 180 + r));
      }
      double ms = time_ms([&](int i) {
        embedding_fwd(DType::bf16, out[i % R], dids, table, T, d, V, nullptr, g_stream);
      });
      result("embedding_fwd", "8192x2048", ms, 0, 2.0 * 2 * double(n));
      ms = time_ms([&](int i) { add_fwd(DType::bf16, out[i % R], a[i % R], b[i % R], int64_t(n), g_stream); });
      result("add_fwd", "8192x2048", ms, 0, 3.0 * 2 * double(n));
      for (int r = 0; r < R; ++r) for (void* p : {out[r], a[r], b[r]}) cudaFree(p);
      cudaFree(table);
      cudaFree(dids);
    }
    {  // adamw over 16 fp32 tensors of 16M parameters (f32 grads), one multi-tensor launch
      const int64_t parts = 16, each = int64_t(1) << 24, total = parts * each;
      std::vector<void*> P, G, M, Vv;
      std::vector<int64_t> ns(parts, each);
      for (int64_t t = 0; t < parts; ++t) {
        P.push_back(dev_random(size_t(each), false, 1, 200));
        G.push_back(dev_random(size_t(each), false, 1e-3f, 201));
        M.push_back(dev_random(size_t(each), false, 1e-3f, 202));
        Vv.push_back(dev_random(size_t(each), false, 1e-6f, 203));
      }
      TensorList lp{ns.data(), P.data(), nullptr, ns.size()}, lg{ns.data(), G.data(), nullptr, ns.size()},
          lm{ns.data(), M.data(), nullptr, ns.size()}, lv{ns.data(), Vv.data(), nullptr, ns.size()};
      AdamWArgs o;
      o.lr = 1e-5;
      o.weight_decay = 0.01;
      int step = 1;
      // |v| is what AdamW reads; random signs would give NaN: use v = 0 start (a real first step).
      for (void* p : Vv) CK(cudaMemset(p, 0, size_t(each) * 4));
      const double ms = time_ms([&](int) {
        o.step = step++;
        adamw(lp, lg, lm, lv, o, ws, g_stream);
      }, 10);
      result("adamw", "16x16M_f32", ms, 0, double(total) * (4 * 4 + 3 * 4));
      for (int64_t t = 0; t < parts; ++t) for (void* p : {P[size_t(t)], G[size_t(t)], M[size_t(t)], Vv[size_t(t)]}) cudaFree(p);
    }
  }

  // ---- fused linear + logprob head (bf16 operands, fp32 statistics), N = 8192, V = 128256
  if (want("logprob")) {
    void* h = dev_random(size_t(T * d), true, 1, 300);
    void* W = dev_random(size_t(V * d), true, 0.02f, 301);
    std::vector<int32_t> tg(T);
    std::mt19937 rng(4);
    for (auto& x : tg) x = int32_t(rng() % uint32_t(V));
    int32_t* dt = nullptr;
    CK(cudaMalloc(reinterpret_cast<void**>(&dt), T * 4));
    CK(cudaMemcpy(dt, tg.data(), T * 4, cudaMemcpyHostToDevice));
    void* lp = dev_random(size_t(T), false, 1, 302);
    void* lse = dev_random(size_t(T), false, 1, 303);
    void* ent = dev_random(size_t(T), false, 1, 304);
    void* dlp = dev_random(size_t(T), false, 1, 305);
    void* dh = dev_random(size_t(T * d), true, 1, 306);
    void* dW = dev_random(size_t(V * d), false, 0, 307);
    for (int64_t chunk : {int64_t(0), int64_t(16) << 20, int64_t(64) << 20}) {
      LogprobArgs a;
      a.t = DType::bf16;
      a.N = T;
      a.C = d;
      a.V = V;
      a.h = h;
      a.W = W;
      a.target = dt;
      a.chunk_bytes = chunk;
      a.logprob = Flex{lp, false};
      a.lse = Flex{lse, false};
      a.entropy = Flex{ent, false};
      a.dlogprob = Flex{dlp, false};
      a.dh = dh;
      a.dW = Flex{dW, false};
      const std::string shape = "8192x2048xV128256_chunk" + std::to_string(chunk >> 20) + "MiB";
      double ms = time_ms([&](int) { ws.reset(); linear_logprob_fwd(eng, a, ws, g_stream); }, 10);
      result("logprob_fwd", shape, ms, 2.0 * T * double(V) * d, 0);
      ms = time_ms([&](int) { ws.reset(); linear_logprob_bwd(eng, a, ws, g_stream); }, 5);
      result("logprob_bwd", shape, ms, 6.0 * T * double(V) * d, 0);
    }
    for (void* p : {h, W, lp, lse, ent, dlp, dh, dW}) cudaFree(p);
    cudaFree(dt);
  }
  gemm_engine_destroy(eng);
  return 0;
}
