// kernels_cuda beyond the shared op cases (label gpu; skipped without a CUDA device):
//   - the tensor-core attention (head dims 64 and 128, GQA, packed sequences with empty and
//     one-token ones, sliding windows, q/k/v read out of one fused buffer) against kernels_cpu
//     on the same bf16-rounded inputs, and against the SIMT path;
//   - long sequences (T = 4096) against a float64 evaluation of sampled rows and keys;
//   - bitwise determinism of the backward ops on reruns;
//   - large bf16 / f32 GEMMs (sampled entries against float64), batched, mixed bf16 -> f32
//     accumulation, the bias epilogue;
//   - the logprob head at a 32000-word vocabulary with two targets per token;
//   - the vectorised (16-byte) paths of rmsnorm, swiglu, embedding and add that the small
//     conformance shapes do not reach; multi-tensor AdamW with bf16 gradients;
//   - MoE: the router at large E (DeepSeek-V3 groups, E = 16384) and in float64 against
//     kernels_cpu, replay and the error flags, the permutation at the Qwen3-MoE shape (exact
//     rows and offsets), grouped GEMMs at the Qwen3-MoE shapes with ragged and empty groups on
//     both paths against float64, and their bitwise repeatability.
// Errors are max|got - ref| / max|ref| over the compared elements.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "rlhost/kernels_cpu/kernels.hpp"
#include "rlhost/kernels_cuda/kernels.hpp"

namespace rlh::kcuda::testing {
namespace {

// Workspace from plain cudaMalloc, freed after a device synchronisation.
class TestWorkspace final : public Workspace {
 public:
  ~TestWorkspace() override {
    cudaDeviceSynchronize();
    for (void* p : ptrs_) cudaFree(p);
  }
  void* get(size_t bytes) override {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(bytes, 256)) != cudaSuccess) throw std::bad_alloc();
    ptrs_.push_back(p);
    return p;
  }

 private:
  std::vector<void*> ptrs_;
};

DeviceInfo device_info() {
  DeviceInfo d;
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  d.sm_count = p.multiProcessorCount;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.smem_optin = p.sharedMemPerBlockOptin;
  return d;
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f, bool bf16 = true) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N01(0, 1);
  std::vector<float> v(n);
  for (float& x : v) x = bf16 ? round_bf16(N01(rng) * scale) : N01(rng) * scale;
  return v;
}

DevBuf upload(const std::vector<float>& v, bool bf16) {
  DevBuf b(v.size(), bf16);
  b.upload(v);
  return b;
}

// ------------------------------------------------------------------------------------------
// Attention

struct AttnCase {
  std::vector<int32_t> cu;
  int64_t Hq, Hkv, D, W;
  bool fused;  // q, k, v inside one [N, (Hq + 2 Hkv) D] buffer
};

struct AttnDev {
  int64_t N, ld, ldq, ldk, ldv;
  std::vector<float> q, k, v, dout;  // host copies in the fused or separate layout
  DevBuf bq, bk, bv, bo, blse, bdo, bdq, bdk, bdv, bcu;
  AttnArgs args;
};

// Builds the operands of a case on the device (bf16, lse f32).
void make_attn(const AttnCase& c, uint32_t seed, AttnDev& a) {
  a.N = c.cu.back();
  const int64_t wq = c.Hq * c.D, wk = c.Hkv * c.D;
  if (c.fused) {
    a.ld = wq + 2 * wk;
    const std::vector<float> qkv = randn(size_t(a.N * a.ld), seed);
    a.q = a.k = a.v = qkv;
    a.bq = upload(qkv, true);
    a.ldq = a.ldk = a.ldv = a.ld;
  } else {
    a.q = randn(size_t(a.N * wq), seed);
    a.k = randn(size_t(a.N * wk), seed + 1);
    a.v = randn(size_t(a.N * wk), seed + 2);
    a.bq = upload(a.q, true);
    a.bk = upload(a.k, true);
    a.bv = upload(a.v, true);
    a.ldq = wq;
    a.ldk = a.ldv = wk;
  }
  a.dout = randn(size_t(a.N * wq), seed + 3);
  a.bo = DevBuf(size_t(a.N * wq), true);
  a.blse = DevBuf(size_t(a.N * c.Hq), false);
  a.bdo = upload(a.dout, true);
  a.bdq = DevBuf(size_t(a.N * wq), true);
  a.bdk = DevBuf(size_t(a.N * wk), true);
  a.bdv = DevBuf(size_t(a.N * wk), true);
  a.bcu = DevBuf(c.cu.size(), false);
  cudaMemcpy(a.bcu.get(), c.cu.data(), c.cu.size() * 4, cudaMemcpyHostToDevice);
  AttnArgs& g = a.args;
  // RLH_KCUDA_ATTN_VARIANT picks a tile configuration of the tensor-core kernels (0 = default),
  // so every configuration can be checked with the same cases.
  if (const char* e = std::getenv("RLH_KCUDA_ATTN_VARIANT")) g.variant = std::atoi(e);
  g.t = DType::bf16;
  g.N = a.N;
  g.S = int64_t(c.cu.size()) - 1;
  g.Hq = c.Hq;
  g.Hkv = c.Hkv;
  g.Dk = g.Dv = c.D;
  g.window = c.W;
  g.scale = float(1.0 / std::sqrt(double(c.D)));
  g.cu = static_cast<const int32_t*>(a.bcu.get());
  auto* base = static_cast<uint16_t*>(a.bq.get());
  if (c.fused) {
    g.q = base;
    g.k = base + wq;
    g.v = base + wq + wk;
  } else {
    g.q = a.bq.get();
    g.k = a.bk.get();
    g.v = a.bv.get();
  }
  g.ldq = a.ldq;
  g.ldk = a.ldk;
  g.ldv = a.ldv;
  g.o = a.bo.get();
  g.ldo = wq;
  g.lse = Flex{a.blse.get(), false};
  g.dout = a.bdo.get();
  g.lddo = wq;
  g.dq = a.bdq.get();
  g.lddq = wq;
  g.dk = a.bdk.get();
  g.lddk = wk;
  g.dv = a.bdv.get();
  g.lddv = wk;
}

// Host pointers of q/k/v inside the (fused or separate) host copies.
struct HostQKV {
  const float *q, *k, *v;
};
HostQKV host_qkv(const AttnCase& c, const AttnDev& a) {
  if (!c.fused) return {a.q.data(), a.k.data(), a.v.data()};
  const int64_t wq = c.Hq * c.D, wk = c.Hkv * c.D;
  return {a.q.data(), a.q.data() + wq, a.q.data() + wq + wk};
}

TEST(CudaAttention, TensorCorePathsMatchKernelsCpu) {
  RLH_REQUIRE_CUDA();
  const DeviceInfo dev = device_info();
  const std::vector<std::vector<int32_t>> packings = {{0, 1, 77, 77, 300, 555}, {0, 200}};
  int checked = 0;
  for (int64_t D : {64, 128})
    for (size_t pk = 0; pk < packings.size(); ++pk)
      for (int64_t W : {0, 50})
        for (bool fused : {true, false}) {
          const AttnCase c{packings[pk], pk == 0 ? 4 : 2, pk == 0 ? 2 : 2, D, W, fused};
          SCOPED_TRACE("D=" + std::to_string(D) + " packing=" + std::to_string(pk) + " W=" +
                       std::to_string(W) + (fused ? " fused" : " separate"));
          AttnDev a;
          make_attn(c, uint32_t(11 + D + pk * 7 + W), a);
          ASSERT_STRNE(attention_path(a.args), "simt");
          attention_fwd(a.args, dev, nullptr);
          {
            TestWorkspace ws;
            attention_bwd(a.args, dev, ws, nullptr);
          }
          CUDA_OK(cudaDeviceSynchronize());
          // Reference: kernels_cpu on the same (bf16-rounded) values, in float32.
          const HostQKV h = host_qkv(c, a);
          const int64_t N = a.N, S = int64_t(c.cu.size()) - 1, wq = c.Hq * D, wk = c.Hkv * D;
          std::vector<float> o(size_t(N * wq)), lse(size_t(N * c.Hq));
          kcpu::attention_fwd<float>(o.data(), wq, lse.data(), h.q, a.ldq, h.k, a.ldk, h.v, a.ldv,
                                     c.cu.data(), S, N, c.Hq, c.Hkv, D, D, a.args.scale, W,
                                     kcpu::scratch_default());
          std::vector<float> dq(size_t(N * a.ldq), 0.f), dk(size_t(N * a.ldk), 0.f),
              dv(size_t(N * a.ldv), 0.f);
          kcpu::attention_bwd<float>(dq.data(), a.ldq, dk.data(), a.ldk, dv.data(), a.ldv,
                                     a.dout.data(), wq, h.q, a.ldq, h.k, a.ldk, h.v, a.ldv,
                                     o.data(), wq, lse.data(), c.cu.data(), S, N, c.Hq, c.Hkv, D,
                                     D, a.args.scale, W, kcpu::scratch_default());
          auto pick = [&](const std::vector<float>& full, int64_t ld, int64_t width) {
            std::vector<float> r;
            for (int64_t n = 0; n < N; ++n)
              for (int64_t j = 0; j < width; ++j) r.push_back(full[size_t(n * ld + j)]);
            return r;
          };
          const double e_o = rel_error(a.bo.download(), o);
          const double e_lse = rel_error(a.blse.download(), lse);
          const double e_dq = rel_error(a.bdq.download(), pick(dq, a.ldq, wq));
          const double e_dk = rel_error(a.bdk.download(), pick(dk, a.ldk, wk));
          const double e_dv = rel_error(a.bdv.download(), pick(dv, a.ldv, wk));
          std::printf("attention v%d %-8s D=%3ld packing=%zu W=%2ld %-8s  o %.1e lse %.1e dq %.1e dk %.1e dv %.1e\n",
                      a.args.variant, attention_path(a.args), long(D), pk, long(W), fused ? "fused" : "separate",
                      e_o, e_lse, e_dq, e_dk, e_dv);
          EXPECT_LE(e_o, 1e-2);
          EXPECT_LE(e_lse, 1e-2);
          EXPECT_LE(e_dq, 1e-2);
          EXPECT_LE(e_dk, 1e-2);
          EXPECT_LE(e_dv, 1e-2);
          // The SIMT path on the same operands agrees.
          AttnArgs s = a.args;
          s.force_simt = true;
          DevBuf o2(size_t(N * wq), true), lse2(size_t(N * c.Hq), false);
          s.o = o2.get();
          s.lse = Flex{lse2.get(), false};
          attention_fwd(s, dev, nullptr);
          CUDA_OK(cudaDeviceSynchronize());
          EXPECT_LE(rel_error(o2.download(), o), 1e-2);
          ++checked;
        }
  EXPECT_EQ(checked, 16);
}

// Long sequences: sampled rows (forward, dq) and keys (dk, dv) against float64 sums over the
// whole row / column. The key check uses the kernel's lse and O (validated by the row check).
TEST(CudaAttention, LongSequencesAgainstFloat64Samples) {
  RLH_REQUIRE_CUDA();
  const DeviceInfo dev = device_info();
  for (int64_t D : {64, 128})
    for (int64_t W : {0, 1024}) {
      const AttnCase c{{0, 1500, 5596}, 8, 2, D, W, false};  // a 1500 and a 4096 sequence
      SCOPED_TRACE("D=" + std::to_string(D) + " W=" + std::to_string(W));
      AttnDev a;
      make_attn(c, uint32_t(900 + D + W), a);
      attention_fwd(a.args, dev, nullptr);
      {
        TestWorkspace ws;
        attention_bwd(a.args, dev, ws, nullptr);
      }
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> o = a.bo.download(), lse = a.blse.download(),
                               dq = a.bdq.download(), dk = a.bdk.download(),
                               dv = a.bdv.download();
      const int64_t N = a.N, wq = c.Hq * D, wk = c.Hkv * D, grp = c.Hq / c.Hkv;
      const double scale = a.args.scale;
      auto seq_lo = [&](int64_t i) {
        int64_t st = 0;
        for (size_t s = 0; s + 1 < c.cu.size(); ++s)
          if (c.cu[s] <= i) st = c.cu[s];
        return W > 0 ? std::max(st, i - W + 1) : st;
      };
      auto seq_hi = [&](int64_t j) {
        int64_t end = N - 1;
        for (size_t s = 1; s < c.cu.size(); ++s)
          if (c.cu[s] > j) { end = c.cu[s] - 1; break; }
        return W > 0 ? std::min(end, j + W - 1) : end;
      };
      auto dot = [&](const float* x, const float* y) {
        double r = 0;
        for (int64_t d = 0; d < D; ++d) r += double(x[d]) * double(y[d]);
        return r;
      };
      std::mt19937 rng(7);
      std::vector<double> eo, ro, else_, rlse, edq, rdq, edk, rdk, edv, rdv;
      // Rows.
      for (int smp = 0; smp < 48; ++smp) {
        const int64_t i = smp < 4 ? std::vector<int64_t>{0, 1499, 1500, N - 1}[size_t(smp)]
                                  : int64_t(rng() % uint32_t(N));
        const int64_t h = int64_t(rng() % uint32_t(c.Hq)), g = h / grp;
        const float* qi = &a.q[size_t(i * wq + h * D)];
        const float* doi = &a.dout[size_t(i * wq + h * D)];
        const int64_t lo = seq_lo(i);
        std::vector<double> s(size_t(i - lo + 1));
        double mx = -INFINITY;
        for (int64_t j = lo; j <= i; ++j) {
          s[size_t(j - lo)] = scale * dot(qi, &a.k[size_t(j * wk + g * D)]);
          mx = std::max(mx, s[size_t(j - lo)]);
        }
        double sum = 0;
        for (double& x : s) sum += std::exp(x - mx);
        const double l = mx + std::log(sum);
        std::vector<double> orow(size_t(D), 0.0);
        for (int64_t j = lo; j <= i; ++j) {
          const double p = std::exp(s[size_t(j - lo)] - l);
          for (int64_t d = 0; d < D; ++d) orow[size_t(d)] += p * a.v[size_t(j * wk + g * D + d)];
        }
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) delta += orow[size_t(d)] * doi[d];
        std::vector<double> dqrow(size_t(D), 0.0);
        for (int64_t j = lo; j <= i; ++j) {
          const double p = std::exp(s[size_t(j - lo)] - l);
          const double dp = dot(doi, &a.v[size_t(j * wk + g * D)]);
          for (int64_t d = 0; d < D; ++d)
            dqrow[size_t(d)] += scale * p * (dp - delta) * a.k[size_t(j * wk + g * D + d)];
        }
        for (int64_t d = 0; d < D; ++d) {
          eo.push_back(o[size_t(i * wq + h * D + d)]);
          ro.push_back(orow[size_t(d)]);
          edq.push_back(dq[size_t(i * wq + h * D + d)]);
          rdq.push_back(dqrow[size_t(d)]);
        }
        else_.push_back(lse[size_t(h * N + i)]);
        rlse.push_back(l);
      }
      // Keys (kv head 0 and 1 alternately), over every query of the group that sees them.
      for (int smp = 0; smp < 24; ++smp) {
        const int64_t j = smp < 2 ? std::vector<int64_t>{0, 1500}[size_t(smp)] : int64_t(rng() % uint32_t(N));
        const int64_t g = smp % c.Hkv;
        std::vector<double> dkrow(size_t(D), 0.0), dvrow(size_t(D), 0.0);
        for (int64_t hh = 0; hh < grp; ++hh) {
          const int64_t h = g * grp + hh;
          for (int64_t i = j; i <= seq_hi(j); ++i) {
            const float* qi = &a.q[size_t(i * wq + h * D)];
            const float* doi = &a.dout[size_t(i * wq + h * D)];
            const double p = std::exp(scale * dot(qi, &a.k[size_t(j * wk + g * D)]) - lse[size_t(h * N + i)]);
            const double dp = dot(doi, &a.v[size_t(j * wk + g * D)]);
            double delta = 0;
            for (int64_t d = 0; d < D; ++d) delta += double(o[size_t(i * wq + h * D + d)]) * doi[d];
            for (int64_t d = 0; d < D; ++d) {
              dvrow[size_t(d)] += p * doi[d];
              dkrow[size_t(d)] += scale * p * (dp - delta) * qi[d];
            }
          }
        }
        for (int64_t d = 0; d < D; ++d) {
          edk.push_back(dk[size_t(j * wk + g * D + d)]);
          rdk.push_back(dkrow[size_t(d)]);
          edv.push_back(dv[size_t(j * wk + g * D + d)]);
          rdv.push_back(dvrow[size_t(d)]);
        }
      }
      auto err = [](const std::vector<double>& got, const std::vector<double>& ref) {
        double m = 0, e = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          m = std::max(m, std::fabs(ref[i]));
          e = std::max(e, std::fabs(got[i] - ref[i]));
        }
        return e / m;
      };
      const double e1 = err(eo, ro), e2 = err(else_, rlse), e3 = err(edq, rdq), e4 = err(edk, rdk),
                   e5 = err(edv, rdv);
      std::printf("attention v%d T=4096+1500 D=%3ld W=%4ld vs float64 samples: o %.1e lse %.1e dq %.1e dk %.1e dv %.1e\n",
                  a.args.variant, long(D), long(W), e1, e2, e3, e4, e5);
      EXPECT_LE(e1, 1e-2);
      EXPECT_LE(e2, 1e-2);
      EXPECT_LE(e3, 1e-2);
      EXPECT_LE(e4, 1e-2);
      EXPECT_LE(e5, 1e-2);
    }
}

TEST(CudaDeterminism, BackwardOpsAreBitwiseRepeatable) {
  RLH_REQUIRE_CUDA();
  const DeviceInfo dev = device_info();
  {  // attention backward, both paths
    for (bool simt : {false, true}) {
      const AttnCase c{{0, 333, 1024}, 8, 2, 64, 0, false};
      AttnDev a;
      make_attn(c, 4242, a);
      a.args.force_simt = simt;
      attention_fwd(a.args, dev, nullptr);
      std::vector<uint8_t> first[3];
      for (int rep = 0; rep < 2; ++rep) {
        {
          TestWorkspace ws;
          attention_bwd(a.args, dev, ws, nullptr);
        }
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<uint8_t> now[3] = {a.bdq.bytes(), a.bdk.bytes(), a.bdv.bytes()};
        for (int t = 0; t < 3; ++t) {
          if (rep == 0) first[t] = now[t];
          else EXPECT_EQ(first[t], now[t]) << "attention_bwd output " << t << (simt ? " simt" : " mma");
        }
      }
    }
  }
  GemmEngine* g = gemm_engine_create(dev);
  {  // logprob head backward
    const int64_t N = 300, C = 128, V = 5000;
    DevBuf h = upload(randn(size_t(N * C), 1), true), W = upload(randn(size_t(V * C), 2, 0.1f), true);
    std::vector<int32_t> tg(N);
    for (int64_t n = 0; n < N; ++n) tg[size_t(n)] = int32_t((n * 7919) % V);
    DevBuf t(N, false), lse(N, false), lp(N, false), dlp = upload(randn(N, 3, 1.f, false), false);
    cudaMemcpy(t.get(), tg.data(), N * 4, cudaMemcpyHostToDevice);
    LogprobArgs la;
    la.t = DType::bf16;
    la.N = N;
    la.C = C;
    la.V = V;
    la.h = h.get();
    la.W = W.get();
    la.target = static_cast<const int32_t*>(t.get());
    la.chunk_bytes = 300 * 1024;
    la.logprob = Flex{lp.get(), false};
    la.lse = Flex{lse.get(), false};
    la.dlogprob = Flex{dlp.get(), false};
    {
      TestWorkspace ws;
      linear_logprob_fwd(g, la, ws, nullptr);
    }
    std::vector<uint8_t> f_dh, f_dw;
    for (int rep = 0; rep < 2; ++rep) {
      DevBuf dh(size_t(N * C), true), dW(size_t(V * C), false);
      cudaMemset(dW.get(), 0, size_t(V * C) * 4);
      la.dh = dh.get();
      la.dW = Flex{dW.get(), false};
      {
        TestWorkspace ws;
        linear_logprob_bwd(g, la, ws, nullptr);
      }
      CUDA_OK(cudaDeviceSynchronize());
      if (rep == 0) {
        f_dh = dh.bytes();
        f_dw = dW.bytes();
      } else {
        EXPECT_EQ(f_dh, dh.bytes());
        EXPECT_EQ(f_dw, dW.bytes());
      }
    }
  }
  {  // embedding backward with many repeats
    const int64_t N = 4096, C = 256, V = 50;
    std::vector<int32_t> ids(N);
    for (int64_t n = 0; n < N; ++n) ids[size_t(n)] = int32_t((n * n) % V);
    DevBuf bids(N, false), dout = upload(randn(size_t(N * C), 9), true);
    cudaMemcpy(bids.get(), ids.data(), N * 4, cudaMemcpyHostToDevice);
    std::vector<uint8_t> first;
    for (int rep = 0; rep < 2; ++rep) {
      DevBuf dt(size_t(V * C), false);
      cudaMemset(dt.get(), 0, size_t(V * C) * 4);
      {
        TestWorkspace ws;
        embedding_bwd(DType::bf16, Flex{dt.get(), false}, static_cast<const int32_t*>(bids.get()),
                      dout.get(), N, C, V, nullptr, ws, nullptr);
      }
      CUDA_OK(cudaDeviceSynchronize());
      if (rep == 0) first = dt.bytes(); else EXPECT_EQ(first, dt.bytes());
    }
  }
  gemm_engine_destroy(g);
}

// ------------------------------------------------------------------------------------------
// GEMM

struct GemmCheck {
  bool ta, tb;
  int64_t M, N, K, batch;
  bool bf16, c_f32, bias;
  double beta;
};

TEST(CudaGemm, LargeAndMixedShapesAgainstFloat64Samples) {
  RLH_REQUIRE_CUDA();
  GemmEngine* eng = gemm_engine_create(device_info());
  std::printf("%s\n", gemm_engine_info(eng));
  const std::vector<GemmCheck> checks = {
      {false, true, 4096, 3072, 2048, 1, true, false, false, 0.0},   // qkv projection
      {false, false, 4096, 2048, 8192, 1, true, false, false, 0.0},  // dX = dY W
      {true, false, 2048, 8192, 4096, 1, true, true, false, 1.0},    // dW += dY^T X into f32
      {false, true, 1000, 1000, 1000, 1, true, false, true, 0.0},    // odd sizes, bias epilogue
      {false, true, 64, 80, 96, 5, true, false, false, 0.5},         // batched
      {false, false, 512, 512, 512, 1, false, false, false, 0.0},    // true fp32
      {true, true, 300, 200, 100, 1, false, false, true, 1.0},       // fp32, transposes, bias
      // few rows (gemv.cu): 4 warps a column and a bias; 2 warps with parts of 129 and 128
      // chunks, f32 C, a last block half empty; 8 warps a column
      {false, true, 1, 2048, 8192, 1, true, false, true, 0.0},
      {false, true, 3, 1000, 2056, 1, true, true, false, 0.0},
      {false, true, 4, 300, 16448, 1, true, false, false, 0.0},
  };
  for (const GemmCheck& k : checks) {
    SCOPED_TRACE("ta=" + std::to_string(k.ta) + " tb=" + std::to_string(k.tb) + " M=" +
                 std::to_string(k.M) + " N=" + std::to_string(k.N) + " K=" + std::to_string(k.K));
    const int64_t sa = k.M * k.K, sb = k.K * k.N, sc = k.M * k.N;
    const std::vector<float> A = randn(size_t(sa * k.batch), 31, 1.f, k.bf16),
                             B = randn(size_t(sb * k.batch), 32, 1.f, k.bf16);
    const bool c_bf16 = k.bf16 && !k.c_f32;
    std::vector<float> C0 = randn(size_t(sc * k.batch), 33, 1.f, c_bf16);
    const std::vector<float> bias = randn(size_t(k.N), 34, 1.f, c_bf16);
    DevBuf dA = upload(A, k.bf16), dB = upload(B, k.bf16), dC = upload(C0, c_bf16),
           dbias = upload(bias, c_bf16);
    GemmArgs g;
    g.ta = k.ta;
    g.tb = k.tb;
    g.M = k.M;
    g.N = k.N;
    g.K = k.K;
    g.beta = k.beta;
    g.A = dA.get();
    g.lda = k.ta ? k.M : k.K;
    g.stride_a = sa;
    g.B = dB.get();
    g.ldb = k.tb ? k.K : k.N;
    g.stride_b = sb;
    g.C = dC.get();
    g.ldc = k.N;
    g.stride_c = sc;
    g.batch = k.batch;
    g.ab = k.bf16 ? DType::bf16 : DType::f32;
    g.c_dt = c_bf16 ? DType::bf16 : DType::f32;
    if (k.bias) {
      g.bias = dbias.get();
      g.bias_dt = g.c_dt;
    }
    {
      TestWorkspace ws;
      gemm(eng, g, ws, nullptr);
    }
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> C = dC.download();
    std::mt19937 rng(5);
    std::vector<float> got, ref;
    for (int s = 0; s < 400; ++s) {
      const int64_t b = int64_t(rng() % uint32_t(k.batch)), i = int64_t(rng() % uint32_t(k.M)),
                    j = int64_t(rng() % uint32_t(k.N));
      double acc = 0;
      for (int64_t p = 0; p < k.K; ++p)
        acc += double(k.ta ? A[size_t(b * sa + p * k.M + i)] : A[size_t(b * sa + i * k.K + p)]) *
               double(k.tb ? B[size_t(b * sb + j * k.K + p)] : B[size_t(b * sb + p * k.N + j)]);
      acc += k.beta * C0[size_t(b * sc + i * k.N + j)] + (k.bias ? bias[size_t(j)] : 0.0);
      got.push_back(C[size_t(b * sc + i * k.N + j)]);
      ref.push_back(float(acc));
    }
    const double e = rel_error(got, ref);
    std::printf("gemm %s%s ta=%d tb=%d %ldx%ldx%ld batch=%ld beta=%.1f%s: %.1e\n",
                k.bf16 ? "bf16" : "f32", k.c_f32 ? "->f32" : "", int(k.ta), int(k.tb), long(k.M),
                long(k.N), long(k.K), long(k.batch), k.beta, k.bias ? " +bias" : "", e);
    EXPECT_LE(e, k.bf16 ? 1e-2 : 1e-5);
  }
  gemm_engine_destroy(eng);
}

// C = A B^T + Cin with Cin apart from C (the training forward's residual epilogue, gemm_add_fwd's
// round_product = 0): cuBLASLt with its candidates timed (the product is large enough), the SIMT
// fallback (Cin copied into C first), and Cin = C (in place). Cin is untouched, and every sampled
// element is within what one rounding of the product and one of the sum allow (the two ops'
// bound; fp32 sums of K terms as slack). How many are within half a bf16 step (one rounding) is
// printed: cuBLASLt's kernels differ there (H100, 2026-12-07: the 4096-row product and the
// fallback rounded once, the 300-row in-place product as the two ops).
TEST(CudaGemm, SeparateCInputIsTheEpilogueAdd) {
  RLH_REQUIRE_CUDA();
  GemmEngine* eng = gemm_engine_create(device_info());
  struct Case {
    int64_t M, N, K;
    bool fallback, in_place;
  };
  for (const Case& k : {Case{4096, 2048, 2048, false, false}, Case{96, 80, 64, true, false},
                        Case{300, 256, 512, false, true}}) {
    SCOPED_TRACE("M=" + std::to_string(k.M) + " N=" + std::to_string(k.N) + " K=" + std::to_string(k.K) +
                 (k.fallback ? " fallback" : "") + (k.in_place ? " in place" : ""));
    const std::vector<float> A = randn(size_t(k.M * k.K), 41), B = randn(size_t(k.N * k.K), 42, 0.05f),
                             R = randn(size_t(k.M * k.N), 43);
    DevBuf dA = upload(A, true), dB = upload(B, true), dR = upload(R, true),
           dC = upload(std::vector<float>(size_t(k.M * k.N), std::nanf("")), true);
    GemmArgs g;
    g.tb = true;
    g.M = k.M;
    g.N = k.N;
    g.K = k.K;
    g.beta = 1;
    g.A = dA.get();
    g.lda = k.K;
    g.B = dB.get();
    g.ldb = k.K;
    g.C = k.in_place ? dR.get() : dC.get();
    g.ldc = k.N;
    g.Cin = dR.get();
    g.ab = g.c_dt = DType::bf16;
    if (k.fallback) setenv("RLH_KCUDA_GEMM_FALLBACK", "1", 1);
    {
      TestWorkspace ws;
      gemm(eng, g, ws, nullptr);
    }
    if (k.fallback) unsetenv("RLH_KCUDA_GEMM_FALLBACK");
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> C = (k.in_place ? dR : dC).download();
    if (!k.in_place) EXPECT_EQ(dR.download(), R);
    std::mt19937 rng(7);
    int beyond = 0, twice_beyond = 0, out_of_bound = 0;
    for (int s = 0; s < 2000; ++s) {
      const int64_t i = int64_t(rng() % uint32_t(k.M)), j = int64_t(rng() % uint32_t(k.N));
      double p = 0, mag = 0;
      for (int64_t q = 0; q < k.K; ++q) {
        const double t = double(A[size_t(i * k.K + q)]) * double(B[size_t(j * k.K + q)]);
        p += t;
        mag += std::fabs(t);
      }
      const double exact = p + double(R[size_t(i * k.N + j)]);
      const auto half_step = [](double x) { return x == 0 ? 0.0 : std::ldexp(1.0, std::ilogb(x) - 8); };
      const double slack = 3e-5 * (mag + std::fabs(R[size_t(i * k.N + j)]));  // fp32 sums of K terms
      const double err = std::fabs(double(C[size_t(i * k.N + j)]) - exact);
      if (err > half_step(exact) + slack) ++beyond;
      if (err > 2 * half_step(exact) + half_step(p) + slack) ++out_of_bound;  // (the sum may cross a power of 2)
      // The two-step form's value: the product rounded to bf16, then the add rounded.
      const double two = double(round_bf16(float(double(round_bf16(float(p))) + double(R[size_t(i * k.N + j)]))));
      if (std::fabs(two - exact) > half_step(exact) + slack) ++twice_beyond;
    }
    std::printf("gemm + separate C %ldx%ldx%ld%s%s: %d of 2000 beyond half a bf16 step (the two-step form: %d), "
                "%d beyond the two roundings' bound\n",
                long(k.M), long(k.N), long(k.K), k.fallback ? " fallback" : "", k.in_place ? " in place" : "",
                beyond, twice_beyond, out_of_bound);
    EXPECT_EQ(out_of_bound, 0);
  }
  gemm_engine_destroy(eng);
}

// ------------------------------------------------------------------------------------------
// The logprob head at a realistic vocabulary, two targets per token.

TEST(CudaLogprob, VocabularyOf32000AgainstKernelsCpu) {
  RLH_REQUIRE_CUDA();
  GemmEngine* eng = gemm_engine_create(device_info());
  const int64_t N = 64, C = 256, V = 32000, K = 2;
  const std::vector<float> h = randn(size_t(N * C), 61), W = randn(size_t(V * C), 62, 0.2f);
  std::vector<int32_t> tg(size_t(N * K));
  for (int64_t n = 0; n < N; ++n) {
    tg[size_t(n * K)] = n == 3 ? -1 : int32_t((n * 4099) % V);
    tg[size_t(n * K + 1)] = int32_t((n * 31 + 17) % V);
  }
  const std::vector<float> dlp = randn(size_t(N * K), 63, 1.f, false), dent = randn(size_t(N), 64, 1.f, false);
  DevBuf dh_ = upload(h, true), dW_ = upload(W, true), dt(size_t(N * K), false);
  cudaMemcpy(dt.get(), tg.data(), tg.size() * 4, cudaMemcpyHostToDevice);
  DevBuf lp(size_t(N * K), false), lse(N, false), ent(N, false), ddlp = upload(dlp, false),
      ddent = upload(dent, false), gh(size_t(N * C), true), gW(size_t(V * C), false);
  cudaMemset(gW.get(), 0, size_t(V * C) * 4);
  const double temp = 0.8;
  for (int64_t chunk : {int64_t(0), int64_t(1) << 20}) {
    LogprobArgs a;
    a.t = DType::bf16;
    a.N = N;
    a.C = C;
    a.V = V;
    a.K = K;
    a.h = dh_.get();
    a.W = dW_.get();
    a.target = static_cast<const int32_t*>(dt.get());
    a.temperature = temp;
    a.chunk_bytes = chunk;
    a.logprob = Flex{lp.get(), false};
    a.lse = Flex{lse.get(), false};
    a.entropy = Flex{ent.get(), false};
    a.dlogprob = Flex{ddlp.get(), false};
    a.dentropy = Flex{ddent.get(), false};
    a.dh = gh.get();
    a.dW = Flex{gW.get(), false};
    cudaMemset(gW.get(), 0, size_t(V * C) * 4);
    {
      TestWorkspace ws;
      linear_logprob_fwd(eng, a, ws, nullptr);
      linear_logprob_bwd(eng, a, ws, nullptr);
    }
    CUDA_OK(cudaDeviceSynchronize());
    kcpu::LogprobOpts o;
    o.temperature = temp;
    std::vector<float> rlp(size_t(N * K)), rlse(N), rent(N), rdh(size_t(N * C)), rdW(size_t(V * C), 0.f);
    kcpu::linear_logprob_fwd<float>(rlp.data(), rlse.data(), rent.data(), h.data(), W.data(),
                                    tg.data(), N, C, V, K, o, kcpu::scratch_default());
    kcpu::linear_logprob_bwd<float>(rdh.data(), rdW.data(), dlp.data(), dent.data(), h.data(),
                                    W.data(), tg.data(), rlse.data(), rent.data(), N, C, V, K, o,
                                    false, kcpu::scratch_default());
    const double e[5] = {rel_error(lp.download(), rlp), rel_error(lse.download(), rlse),
                         rel_error(ent.download(), rent), rel_error(gh.download(), rdh),
                         rel_error(gW.download(), rdW)};
    std::printf("linear_logprob bf16 N=%ld C=%ld V=%ld K=%ld chunk=%ld: logprob %.1e lse %.1e entropy %.1e dh %.1e dW %.1e\n",
                long(N), long(C), long(V), long(K), long(chunk), e[0], e[1], e[2], e[3], e[4]);
    for (double x : e) EXPECT_LE(x, 1e-2);
  }
  gemm_engine_destroy(eng);
}

// ------------------------------------------------------------------------------------------
// add_rmsnorm_fwd is add_fwd then rmsnorm_fwd, bit for bit: a decoding step's residual add and
// next norm as one launch must not move the generator's numbers. Vector rows (C = 2048, 2056),
// rows that do not vectorise (37), f32 and bf16, y in place of a, Gemma's weight offset.

TEST(CudaElementwise, AddRmsnormIsAddThenRmsnormBitwise) {
  RLH_REQUIRE_CUDA();
  for (const bool bf16 : {true, false})
    for (const int64_t C : {int64_t(2048), int64_t(2056), int64_t(37)})
      for (const bool in_place : {false, true}) {
        SCOPED_TRACE(std::string(bf16 ? "bf16" : "f32") + " C=" + std::to_string(C) + (in_place ? " in place" : ""));
        const int64_t N = 5;
        const float off = C == 2056 ? 1.f : 0.f;
        const std::vector<float> a = randn(size_t(N * C), 81, 1.f, bf16), b = randn(size_t(N * C), 82, 1.f, bf16),
                                 w = randn(size_t(C), 83, 0.5f, bf16);
        const DType t = bf16 ? DType::bf16 : DType::f32;
        DevBuf da = upload(a, bf16), db = upload(b, bf16), dw = upload(w, bf16);
        DevBuf y1(size_t(N * C), bf16), n1(size_t(N * C), bf16), y2(size_t(N * C), bf16), n2(size_t(N * C), bf16);
        add_fwd(t, y1.get(), da.get(), db.get(), N * C, nullptr);
        rmsnorm_fwd(t, n1.get(), C, Flex{}, y1.get(), C, dw.get(), N, C, 1e-5f, off, nullptr);
        DevBuf da2 = upload(a, bf16);
        void* y = in_place ? da2.get() : y2.get();
        add_rmsnorm_fwd(t, y, n2.get(), da2.get(), db.get(), dw.get(), N, C, 1e-5f, off, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> want_y = y1.download(), want_n = n1.download();
        const std::vector<float> got_y = in_place ? da2.download() : y2.download(), got_n = n2.download();
        EXPECT_EQ(std::memcmp(got_y.data(), want_y.data(), want_y.size() * 4), 0) << "y";
        EXPECT_EQ(std::memcmp(got_n.data(), want_n.data(), want_n.size() * 4), 0) << "yn";
      }
}

// The forward norms of a few rows (a block a row: rmsnorm.cu's rmsnorm_row_block_kernel) give
// those rows' bits in a batch of 200 (a warp a row), with and without the residual add: rstd, y
// and yn. The deterministic mode needs a row's result not to depend on the batch.
TEST(CudaElementwise, NormsOfFewRowsAreTheBatchRowsBitwise) {
  RLH_REQUIRE_CUDA();
  for (const bool bf16 : {true, false})
    for (const int64_t C : {int64_t(2048), int64_t(2056), int64_t(1000), int64_t(8192)}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "f32") + " C=" + std::to_string(C));
      const int64_t N = 200;
      const DType t = bf16 ? DType::bf16 : DType::f32;
      const size_t es = bf16 ? 2 : 4;
      const std::vector<float> a = randn(size_t(N * C), 84, 1.f, bf16), b = randn(size_t(N * C), 85, 1.f, bf16),
                               w = randn(size_t(C), 86, 0.5f, bf16);
      DevBuf da = upload(a, bf16), db = upload(b, bf16), dw = upload(w, bf16);
      DevBuf y(size_t(N * C), bf16), r(size_t(N), false), s(size_t(N * C), bf16), n(size_t(N * C), bf16);
      rmsnorm_fwd(t, y.get(), C, Flex{r.get(), false}, da.get(), C, dw.get(), N, C, 1e-5f, 0.f, nullptr);
      add_rmsnorm_fwd(t, s.get(), n.get(), da.get(), db.get(), dw.get(), N, C, 1e-5f, 0.f, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> want_y = y.download(), want_r = r.download(), want_s = s.download(),
                               want_n = n.download();
      for (const auto& [r0, rows] : {std::pair<int64_t, int64_t>{0, 3}, std::pair<int64_t, int64_t>{199, 1}}) {
        SCOPED_TRACE("rows " + std::to_string(r0) + "+" + std::to_string(rows));
        auto at = [&](const DevBuf& d) { return static_cast<char*>(const_cast<void*>(d.get())) + r0 * C * es; };
        DevBuf y1(size_t(rows * C), bf16), r1(size_t(rows), false), s1(size_t(rows * C), bf16), n1(size_t(rows * C), bf16);
        rmsnorm_fwd(t, y1.get(), C, Flex{r1.get(), false}, at(da), C, dw.get(), rows, C, 1e-5f, 0.f, nullptr);
        add_rmsnorm_fwd(t, s1.get(), n1.get(), at(da), at(db), dw.get(), rows, C, 1e-5f, 0.f, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> gy = y1.download(), gr = r1.download(), gs = s1.download(), gn = n1.download();
        const size_t o = size_t(r0 * C), m = size_t(rows * C);
        EXPECT_EQ(std::memcmp(gy.data(), want_y.data() + o, m * 4), 0) << "y";
        EXPECT_EQ(std::memcmp(gr.data(), want_r.data() + r0, size_t(rows) * 4), 0) << "rstd";
        EXPECT_EQ(std::memcmp(gs.data(), want_s.data() + o, m * 4), 0) << "a + b";
        EXPECT_EQ(std::memcmp(gn.data(), want_n.data() + o, m * 4), 0) << "norm of a + b";
      }
    }
}

// gemv.cu's GLU epilogue (gemm_glu_fwd at up to 4 rows) is gemm then swiglu_fwd / geglu_fwd, bit
// for bit: 1-4 rows, one and several warps a column (K 2048, 8192), each activation.
TEST(CudaGemm, GluEpilogueIsGemmThenGluBitwise) {
  RLH_REQUIRE_CUDA();
  GemmEngine* eng = gemm_engine_create(device_info());
  for (const int64_t K : {int64_t(2048), int64_t(8192)})
    for (const int64_t M : {int64_t(1), int64_t(3), int64_t(4)})
      for (int act = 0; act < 3; ++act) {
        SCOPED_TRACE("K=" + std::to_string(K) + " M=" + std::to_string(M) + " act=" + std::to_string(act));
        const int64_t F = 200;
        const std::vector<float> x = randn(size_t(M * K), 91), W = randn(size_t(2 * F * K), 92, 0.05f);
        DevBuf dx = upload(x, true), dW = upload(W, true), gu(size_t(M * 2 * F), true), h1(size_t(M * F), true),
               h2(size_t(M * F), true);
        GemmArgs g;
        g.M = M;
        g.N = 2 * F;
        g.K = K;
        g.tb = true;
        g.A = dx.get();
        g.lda = K;
        g.B = dW.get();
        g.ldb = K;
        g.C = gu.get();
        g.ldc = 2 * F;
        g.ab = g.c_dt = DType::bf16;
        {
          TestWorkspace ws;
          gemm(eng, g, ws, nullptr);
        }
        const auto* gate = static_cast<const uint16_t*>(gu.get());
        if (act == 0)
          swiglu_fwd(DType::bf16, h1.get(), F, gate, 2 * F, gate + F, 2 * F, M, F, nullptr);
        else
          geglu_fwd(DType::bf16, h1.get(), F, gate, 2 * F, gate + F, 2 * F, M, F, act == 1, nullptr);
        GemmArgs f = g;
        f.N = F;
        f.C = h2.get();
        f.ldc = F;
        ASSERT_TRUE(gemv_glu_rows(f, act, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> want = h1.download(), got = h2.download();
        EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
      }
  gemm_engine_destroy(eng);
}

// gemv.cu's normalising prologue (rmsnorm_gemm_fwd at up to 4 rows) is rmsnorm_fwd then the
// few-row product (then its GLU), and its residual epilogue (gemm_add_fwd) the product then
// add_fwd, bit for bit: 1-4 rows, one and several warps a column, a weight offset, in place.
TEST(CudaGemm, NormPrologueAndResidualEpilogueAreTheOpsBitwise) {
  RLH_REQUIRE_CUDA();
  for (const int64_t K : {int64_t(2048), int64_t(4096)})
    for (const int64_t M : {int64_t(1), int64_t(2), int64_t(4)})
      for (const int act : {-1, 0}) {
        SCOPED_TRACE("K=" + std::to_string(K) + " M=" + std::to_string(M) + " act=" + std::to_string(act));
        const int64_t N = 200, rows = act >= 0 ? 2 * N : N;
        const float woff = act >= 0 ? 1.f : 0.f;
        const std::vector<float> x = randn(size_t(M * K), 93, 3.f), w = randn(size_t(K), 94, 0.5f),
                                 W = randn(size_t(rows * K), 95, 0.05f);
        DevBuf dx = upload(x, true), dw = upload(w, true), dW = upload(W, true), xn(size_t(M * K), true),
               h1(size_t(M * N), true), h2(size_t(M * N), true);
        rmsnorm_fwd(DType::bf16, xn.get(), K, Flex{}, dx.get(), K, dw.get(), M, K, 1e-5f, woff, nullptr);
        GemmArgs g;
        g.M = M;
        g.N = N;
        g.K = K;
        g.tb = true;
        g.A = xn.get();
        g.lda = K;
        g.B = dW.get();
        g.ldb = K;
        g.C = h1.get();
        g.ldc = N;
        g.ab = g.c_dt = DType::bf16;
        ASSERT_TRUE(act < 0 ? gemv_rows(g, nullptr) : gemv_glu_rows(g, act, nullptr));
        GemmArgs f = g;
        f.A = dx.get();
        f.C = h2.get();
        GemvExtra ex;
        ex.norm_w = static_cast<const uint16_t*>(dw.get());
        ex.eps = 1e-5f;
        ex.woff = woff;
        ASSERT_TRUE(gemv_norm_rows(f, act, ex, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> want = h1.download(), got = h2.download();
        EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << "norm prologue";
        if (act >= 0) continue;
        // y = r + x W^T: out of place, then in place (y is r)
        const std::vector<float> r = randn(size_t(M * N), 96);
        DevBuf dr = upload(r, true), y1(size_t(M * N), true), y2(size_t(M * N), true);
        add_fwd(DType::bf16, y1.get(), dr.get(), h1.get(), M * N, nullptr);
        GemmArgs e = g;
        e.C = y2.get();
        GemvExtra ea;
        ea.res = static_cast<const uint16_t*>(dr.get());
        ea.ldres = N;
        ASSERT_TRUE(gemv_add_rows(e, ea, nullptr));
        e.C = dr.get();  // in place
        ASSERT_TRUE(gemv_add_rows(e, ea, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> want_y = y1.download(), got_y = y2.download(), got_in = dr.download();
        EXPECT_EQ(std::memcmp(got_y.data(), want_y.data(), want_y.size() * 4), 0) << "residual epilogue";
        EXPECT_EQ(std::memcmp(got_in.data(), want_y.data(), want_y.size() * 4), 0) << "residual epilogue in place";
      }
}

// ------------------------------------------------------------------------------------------
// Vectorised paths and AdamW

TEST(CudaElementwise, VectorPathsAndMultiTensorAdamW) {
  RLH_REQUIRE_CUDA();
  // rmsnorm, bf16, f32 rstd and dw: C = 2048 and 3072 (the backward's row kernel at 8 and 12
  // chunks a lane), one block of rows and several with a partial last one, dx overwritten and
  // accumulated (dw accumulates onto what it holds).
  for (const auto& [N, C, acc] : {std::tuple<int64_t, int64_t, bool>{37, 2048, false}, {100, 2048, true},
                                  {70, 3072, true}, {5, 3072, false}}) {
    SCOPED_TRACE("rmsnorm N " + std::to_string(N) + " C " + std::to_string(C) + (acc ? " accumulate" : ""));
    const std::vector<float> x = randn(size_t(N * C), 71), w = randn(size_t(C), 72, 0.5f),
                             dy = randn(size_t(N * C), 73), dx0 = randn(size_t(N * C), 74),
                             dw0 = randn(size_t(C), 75);
    DevBuf bx = upload(x, true), bw = upload(w, true), by(size_t(N * C), true), br(N, false),
           bdy = upload(dy, true), bdx = upload(dx0, true), bdw = upload(dw0, false);
    rmsnorm_fwd(DType::bf16, by.get(), C, Flex{br.get(), false}, bx.get(), C, bw.get(), N, C, 1e-5f,
                1.f, nullptr);
    {
      TestWorkspace ws;
      rmsnorm_bwd(DType::bf16, bdx.get(), C, Flex{bdw.get(), false}, bdy.get(), C, bx.get(), C,
                  bw.get(), Flex{br.get(), false}, N, C, 1.f, acc, ws, nullptr);
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> y(size_t(N * C)), r(N), dx = dx0, dw = dw0;
    // The CPU reference works on the bf16 values the GPU saw.
    const std::vector<float> xq = bx.download(), wq = bw.download(), dyq = bdy.download();
    if (acc) dx = upload(dx0, true).download();
    kcpu::rmsnorm_fwd<float>(y.data(), C, r.data(), xq.data(), C, wq.data(), N, C, 1e-5f, 1.f);
    kcpu::rmsnorm_bwd<float>(dx.data(), C, dw.data(), dyq.data(), C, xq.data(), C, wq.data(), r.data(),
                             N, C, 1.f, acc);
    EXPECT_LE(rel_error(by.download(), y), 1e-2);
    EXPECT_LE(rel_error(br.download(), r), 1e-5);
    EXPECT_LE(rel_error(bdx.download(), dx), 1e-2);
    EXPECT_LE(rel_error(bdw.download(), dw), 1e-3);
  }
  {  // swiglu at F = 1024
    const int64_t N = 16, F = 1024;
    const std::vector<float> g = randn(size_t(N * F), 81, 2.f), u = randn(size_t(N * F), 82),
                             dh = randn(size_t(N * F), 83);
    DevBuf bg = upload(g, true), bu = upload(u, true), bh(size_t(N * F), true), bdh = upload(dh, true),
           bdg(size_t(N * F), true), bdu(size_t(N * F), true);
    swiglu_fwd(DType::bf16, bh.get(), F, bg.get(), F, bu.get(), F, N, F, nullptr);
    swiglu_bwd(DType::bf16, bdg.get(), F, bdu.get(), F, bdh.get(), F, bg.get(), F, bu.get(), F, N,
               F, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> h(size_t(N * F)), dg(size_t(N * F)), du(size_t(N * F));
    kcpu::swiglu_fwd<float>(h.data(), F, g.data(), F, u.data(), F, N, F);
    kcpu::swiglu_bwd<float>(dg.data(), F, du.data(), F, dh.data(), F, g.data(), F, u.data(), F, N, F);
    EXPECT_LE(rel_error(bh.download(), h), 1e-2);
    EXPECT_LE(rel_error(bdg.download(), dg), 1e-2);
    EXPECT_LE(rel_error(bdu.download(), du), 1e-2);
  }
  {  // rope at 32 heads of 64 (16-byte path), forward and backward, and in place
    const int64_t N = 300, H = 32, D = 64, R = 64;
    const std::vector<float> x = randn(size_t(N * H * D), 95);
    std::vector<int32_t> pos(N);
    for (int64_t n = 0; n < N; ++n) pos[size_t(n)] = int32_t((n * 17) % 4096);
    std::vector<float> inv(R / 2);
    for (int64_t i = 0; i < R / 2; ++i) inv[size_t(i)] = float(std::pow(500000.0, -2.0 * double(i) / double(R)));
    DevBuf bx = upload(x, true), by(size_t(N * H * D), true), bpos(N, false), binv(R / 2, false);
    cudaMemcpy(bpos.get(), pos.data(), N * 4, cudaMemcpyHostToDevice);
    binv.upload(inv);
    for (bool inverse : {false, true}) {
      rope(DType::bf16, by.get(), H * D, bx.get(), H * D, static_cast<const int32_t*>(bpos.get()),
           static_cast<const float*>(binv.get()), N, H, D, R, 1.0, false, inverse, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<float> y(size_t(N * H * D));
      if (inverse)
        kcpu::rope_bwd<float>(y.data(), H * D, x.data(), H * D, pos.data(), inv.data(), N, H, D, R, 1.0, false);
      else
        kcpu::rope_fwd<float>(y.data(), H * D, x.data(), H * D, pos.data(), inv.data(), N, H, D, R, 1.0, false);
      EXPECT_LE(rel_error(by.download(), y), 1e-2) << "rope inverse=" << inverse;
      if (!inverse) {  // in place
        DevBuf bz = upload(x, true);
        rope(DType::bf16, bz.get(), H * D, bz.get(), H * D, static_cast<const int32_t*>(bpos.get()),
             static_cast<const float*>(binv.get()), N, H, D, R, 1.0, false, false, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        EXPECT_EQ(bz.bytes(), by.bytes());
      }
    }
  }
  {  // embedding at C = 2048 and add
    const int64_t N = 100, C = 2048, V = 300;
    const std::vector<float> table = randn(size_t(V * C), 91);
    std::vector<int32_t> ids(N);
    for (int64_t n = 0; n < N; ++n) ids[size_t(n)] = int32_t((n * 37) % V);
    DevBuf bt = upload(table, true), bids(N, false), bout(size_t(N * C), true), bsum(size_t(N * C), true);
    cudaMemcpy(bids.get(), ids.data(), N * 4, cudaMemcpyHostToDevice);
    embedding_fwd(DType::bf16, bout.get(), static_cast<const int32_t*>(bids.get()), bt.get(), N, C,
                  V, nullptr, nullptr);
    add_fwd(DType::bf16, bsum.get(), bout.get(), bout.get(), N * C, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> out(size_t(N * C)), two(size_t(N * C));
    kcpu::embedding_fwd<float>(out.data(), ids.data(), table.data(), N, C, V);
    for (size_t i = 0; i < out.size(); ++i) two[i] = 2 * out[i];
    EXPECT_EQ(rel_error(bout.download(), out), 0.0);
    EXPECT_LE(rel_error(bsum.download(), two), 1e-2);
  }
  {  // adamw over three tensors, bf16 gradients, the bf16 copy of p refreshed in the same pass
    const std::vector<int64_t> sizes = {1000, 70001, 5};
    kcpu::AdamWOpts o;
    o.lr = 1e-3;
    o.beta1 = 0.9;
    o.beta2 = 0.95;
    o.weight_decay = 0.1;
    o.step = 7;
    o.grad_scale = 0.25;
    std::vector<std::vector<float>> P, G, M, Vv;
    std::vector<DevBuf> bp, bg, bm, bv, b16;
    std::vector<void*> pp, pg, pm, pv, p16;
    std::vector<int64_t> ns;
    for (size_t t = 0; t < sizes.size(); ++t) {
      P.push_back(randn(size_t(sizes[t]), 100 + uint32_t(t), 1.f, false));
      G.push_back(randn(size_t(sizes[t]), 200 + uint32_t(t)));
      M.push_back(randn(size_t(sizes[t]), 300 + uint32_t(t), 0.1f, false));
      Vv.push_back(randn(size_t(sizes[t]), 400 + uint32_t(t), 0.01f, false));
      for (float& x : Vv.back()) x = std::fabs(x);
      bp.push_back(upload(P[t], false));
      bg.push_back(upload(G[t], true));
      bm.push_back(upload(M[t], false));
      bv.push_back(upload(Vv[t], false));
      b16.push_back(upload(std::vector<float>(size_t(sizes[t]), 0.f), true));
      p16.push_back(b16.back().get());
      pp.push_back(bp.back().get());
      pg.push_back(bg.back().get());
      pm.push_back(bm.back().get());
      pv.push_back(bv.back().get());
      ns.push_back(sizes[t]);
    }
    bool bf_true[3] = {true, true, true};
    const TensorList lp{ns.data(), pp.data(), nullptr, ns.size()},
        lg{ns.data(), pg.data(), bf_true, ns.size()}, lm{ns.data(), pm.data(), nullptr, ns.size()},
        lv{ns.data(), pv.data(), nullptr, ns.size()}, l16{ns.data(), p16.data(), bf_true, ns.size()};
    AdamWArgs a;
    a.p_bf16 = &l16;
    a.lr = o.lr;
    a.beta1 = o.beta1;
    a.beta2 = o.beta2;
    a.weight_decay = o.weight_decay;
    a.step = o.step;
    a.grad_scale = o.grad_scale;
    a.zero_grad = true;
    {
      TestWorkspace ws;
      adamw(lp, lg, lm, lv, a, ws, nullptr);
    }
    CUDA_OK(cudaDeviceSynchronize());
    for (size_t t = 0; t < sizes.size(); ++t) {
      kcpu::adamw(P[t].data(), G[t].data(), M[t].data(), Vv[t].data(), sizes[t], o);
      EXPECT_LE(rel_error(bp[t].download(), P[t]), 1e-5) << "tensor " << t;
      EXPECT_LE(rel_error(bm[t].download(), M[t]), 1e-5) << "tensor " << t;
      EXPECT_LE(rel_error(bv[t].download(), Vv[t]), 1e-5) << "tensor " << t;
      for (float x : bg[t].download()) ASSERT_EQ(x, 0.f);
      const std::vector<float> p_gpu = bp[t].download(), copy = b16[t].download();
      for (size_t i = 0; i < copy.size(); ++i) ASSERT_EQ(copy[i], round_bf16(p_gpu[i])) << "tensor " << t << " at " << i;
    }
  }
}

// ------------------------------------------------------------------------------------------
// MoE: router at large E and in float64, permutation at the Qwen3-MoE shape, grouped GEMMs
// with ragged and empty groups (tensor cores and CUDA cores), error flags.

// A device array of any trivially copyable T.
template <class T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n * sizeof(T), 16)) != cudaSuccess) throw std::bad_alloc();
  }
  explicit Dev(const std::vector<T>& v) : Dev(v.size()) {
    cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { cudaFree(p_); }
  T* get() const { return static_cast<T*>(p_); }
  std::vector<T> get_host() const {
    std::vector<T> v(n_);
    cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

template <class T>
double rel_err(const std::vector<T>& got, const std::vector<T>& ref) {
  double mr = 0, me = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(double(got[i]))) return INFINITY;
    mr = std::max(mr, std::fabs(double(ref[i])));
    me = std::max(me, std::fabs(double(got[i]) - double(ref[i])));
  }
  return me / std::max(mr, 1e-300);
}

int read_flag(int* flag) {
  int v = 0;
  cudaMemcpy(&v, flag, sizeof(int), cudaMemcpyDeviceToHost);
  cudaMemset(flag, 0, sizeof(int));
  return v;
}

// Logits on a grid (distinct values 0.02 apart, shuffled per row): no near-ties, so a float32
// choice cannot differ from the CPU's by the last bit of an exp.
template <class T>
std::vector<T> grid_logits(int64_t N, int64_t E, int64_t ld, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<T> z(size_t(N * ld), T(0));
  std::vector<int> perm(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t e = 0; e < E; ++e) z[size_t(n * ld + e)] = T(0.02 * (perm[size_t(e)] - E / 2) / std::max<double>(1, E / 256.0));
  }
  return z;
}

template <class T>
void router_check(const char* label, DType t, int64_t N, int64_t E, int64_t K, int64_t pad,
                  kcpu::RouterOpts o, bool bias, bool grid, double tol) {
  SCOPED_TRACE(label);
  const int64_t ldl = E + pad;
  std::vector<T> z;
  if (grid) {
    z = grid_logits<T>(N, E, ldl, 7);
  } else {
    std::mt19937 rng(11);
    std::normal_distribution<double> N01(0, 1);
    z.resize(size_t(N * ldl));
    for (T& x : z) x = T(2 * N01(rng));
  }
  std::vector<T> b(static_cast<size_t>(E)), dw(size_t(N * K)), dp(size_t(N * E)), dl(static_cast<size_t>(N));
  std::mt19937 rng(12);
  std::normal_distribution<double> N01(0, 1);
  for (T& x : b) x = T(0.1 * N01(rng));
  for (T& x : dw) x = T(N01(rng));
  for (T& x : dp) x = T(N01(rng));
  for (T& x : dl) x = T(N01(rng));
  const bool softmax = o.scoring == 0;
  // Reference.
  std::vector<T> w(size_t(N * K)), p(size_t(N * E)), lse(static_cast<size_t>(N)), dz(size_t(N * ldl), T(0));
  std::vector<int32_t> ex(size_t(N * K));
  kcpu::moe_router_fwd<T>(w.data(), ex.data(), p.data(), lse.data(), z.data(), ldl,
                          bias ? b.data() : nullptr, N, E, K, o);
  kcpu::moe_router_bwd<T>(dz.data(), ldl, dw.data(), p.data(), ex.data(), dp.data(),
                          softmax ? dl.data() : nullptr, N, E, K, o);
  // Device.
  Dev<T> dzl(z), db(b), ddw(dw), ddp(dp), ddl(dl), gw(size_t(N * K)), gp(size_t(N * E)),
      glse(static_cast<size_t>(N)), gdz(std::vector<T>(size_t(N * ldl), T(0)));
  Dev<int32_t> gex(size_t(N * K)), flag(std::vector<int32_t>{0});
  RouterArgs a;
  a.t = t;
  a.N = N;
  a.E = E;
  a.K = K;
  a.scoring = o.scoring;
  a.norm_topk_prob = o.norm_topk_prob;
  a.scaling_factor = o.scaling_factor;
  a.n_group = o.n_group;
  a.topk_group = o.topk_group;
  a.logits = dzl.get();
  a.ldl = ldl;
  if (bias) a.bias = Flex{db.get(), false};
  a.weights = Flex{gw.get(), false};
  a.experts = gex.get();
  a.probs = Flex{gp.get(), false};
  a.lse = Flex{glse.get(), false};
  a.err = flag.get();
  moe_router_fwd(a, nullptr);
  a.dweights = Flex{ddw.get(), false};
  a.dprobs = Flex{ddp.get(), false};
  if (softmax) a.dlse = Flex{ddl.get(), false};
  a.dlogits = gdz.get();
  a.lddl = ldl;
  moe_router_bwd(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(read_flag(flag.get()), 0);
  EXPECT_EQ(gex.get_host(), ex);
  EXPECT_LE(rel_err(gw.get_host(), w), tol);
  EXPECT_LE(rel_err(gp.get_host(), p), tol);
  EXPECT_LE(rel_err(glse.get_host(), lse), tol);
  EXPECT_LE(rel_err(gdz.get_host(), dz), tol);
}

TEST(CudaMoe, RouterLargeExpertCountsAndFloat64AgainstKernelsCpu) {
  RLH_REQUIRE_CUDA();
  kcpu::RouterOpts ds;  // DeepSeek-V3: sigmoid, bias, 8 groups of 32, 4 kept, top-8, scaled
  ds.scoring = 1;
  ds.norm_topk_prob = true;
  ds.scaling_factor = 2.5;
  ds.n_group = 8;
  ds.topk_group = 4;
  router_check<double>("f64 DeepSeek-V3 E=256", DType::f64, 300, 256, 8, 3, ds, true, false, 1e-12);
  kcpu::RouterOpts qw;  // Qwen3-MoE: softmax, renormalised top-8 of 128
  qw.norm_topk_prob = true;
  router_check<double>("f64 Qwen3-MoE E=128", DType::f64, 300, 128, 8, 0, qw, false, false, 1e-12);
  router_check<float>("f32 Qwen3-MoE E=128", DType::f32, 1000, 128, 8, 5, qw, false, true, 1e-5);
  kcpu::RouterOpts big;  // large E: one warp per block with opted-in shared memory (64 KiB)
  big.scaling_factor = 1.5;
  router_check<float>("f32 E=16384", DType::f32, 40, 16384, 64, 0, big, false, true, 1e-5);
  router_check<double>("f64 E=8192", DType::f64, 40, 8192, 6, 1, qw, false, true, 1e-12);
}

TEST(CudaMoe, ReplayAndBadExpertsRaiseTheFlag) {
  RLH_REQUIRE_CUDA();
  const int64_t N = 4, E = 8, K = 2;
  Dev<float> z(std::vector<float>(size_t(N * E), 0.5f)), w(size_t(N * K)), p(size_t(N * E));
  Dev<int32_t> flag(std::vector<int32_t>{0});
  RouterArgs a;
  a.N = N;
  a.E = E;
  a.K = K;
  a.replay = true;
  a.logits = z.get();
  a.ldl = E;
  a.weights = Flex{w.get(), false};
  a.probs = Flex{p.get(), false};
  a.err = flag.get();
  {  // a valid replay: weights = p of the given experts (uniform 1/8)
    Dev<int32_t> ex(std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 0});
    a.experts = ex.get();
    moe_router_fwd(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(read_flag(flag.get()), 0);
    for (float x : w.get_host()) EXPECT_FLOAT_EQ(x, 0.125f);
  }
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{1, 1, 0, 1, 0, 1, 0, 1},  // repeat
                                          std::vector<int32_t>{0, 1, 0, 8, 0, 1, 0, 1}}) {  // range
    Dev<int32_t> ex(bad);
    a.experts = ex.get();
    moe_router_fwd(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(read_flag(flag.get()), 1);
  }
  {  // permute: an expert outside [0, E)
    Dev<int32_t> ex(std::vector<int32_t>{0, 1, 2, 9, 3, 4, 5, 6}), row(size_t(N * K)), off(size_t(E + 1));
    TestWorkspace ws;
    moe_permute_index(row.get(), off.get(), ex.get(), N, K, E, flag.get(), ws, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(read_flag(flag.get()), 1);
  }
  {  // unpermute: row not a permutation
    Dev<int32_t> row(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 6});
    Dev<float> yp(std::vector<float>(size_t(N * K * 4), 1.f)), wt(std::vector<float>(size_t(N * K), 1.f)),
        y(size_t(N * 4));
    TestWorkspace ws;
    moe_unpermute_fwd(DType::f32, y.get(), 4, yp.get(), 4, row.get(), Flex{wt.get(), false}, N, K, 4,
                      false, flag.get(), ws, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(read_flag(flag.get()), 1);
  }
}

// Qwen3-MoE's dispatch: 8192 tokens, top-8 of 64 experts (skewed: expert 5 and 40 get none),
// d 1024 in bf16 (16-byte path). Rows and offsets exactly kernels_cpu's; data movement exact
// (permute) or within bf16 rounding of fp32 sums; reruns bitwise equal.
TEST(CudaMoe, PermuteAtQwen3ShapeAgainstKernelsCpu) {
  RLH_REQUIRE_CUDA();
  const int64_t N = 8192, K = 8, E = 64, C = 1024;
  std::mt19937 rng(3);
  std::vector<int32_t> ex(size_t(N * K));
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> pool;
    for (int32_t e = 0; e < E; ++e)
      if (e != 5 && e != 40) pool.push_back(e);
    std::shuffle(pool.begin(), pool.begin() + 20, rng);  // skew: the low experts are popular
    for (int64_t k = 0; k < K; ++k) ex[size_t(n * K + k)] = pool[size_t(k)];
  }
  std::vector<int32_t> row(size_t(N * K)), off(size_t(E + 1));
  kcpu::moe_permute_index(row.data(), off.data(), ex.data(), N, K, E);
  const std::vector<float> x = randn(size_t(N * C), 21), yp = randn(size_t(N * K * C), 22),
                           dy = randn(size_t(N * C), 23), wts = randn(size_t(N * K), 24, 0.3f);
  DevBuf bx = upload(x, true), byp = upload(yp, true), bdy = upload(dy, true), bxp(size_t(N * K * C), true),
         bdx(size_t(N * C), true), by(size_t(N * C), true), bdyp(size_t(N * K * C), true),
         bw = upload(wts, false), bdw(size_t(N * K), false);
  Dev<int32_t> bex(ex), brow(size_t(N * K)), boff(size_t(E + 1)), flag(std::vector<int32_t>{0});
  std::vector<uint8_t> first;
  for (int rep = 0; rep < 2; ++rep) {
    TestWorkspace ws;
    moe_permute_fwd(DType::bf16, bxp.get(), C, brow.get(), boff.get(), bx.get(), C, bex.get(), N, K,
                    C, E, flag.get(), ws, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    if (rep == 0) first = bxp.bytes(); else EXPECT_EQ(first, bxp.bytes());
  }
  EXPECT_EQ(brow.get_host(), row);
  EXPECT_EQ(boff.get_host(), off);
  EXPECT_EQ(off[6] - off[5], 0);
  {
    const std::vector<float> xp = bxp.download();
    std::vector<float> ref(size_t(N * K * C));
    kcpu::moe_permute_fwd<float>(ref.data(), C, row.data(), off.data(), x.data(), C, ex.data(), N,
                                 K, C, E);
    EXPECT_EQ(xp, ref);
  }
  {
    TestWorkspace ws;
    moe_permute_bwd(DType::bf16, bdx.get(), C, byp.get(), C, brow.get(), N, K, C, false, flag.get(), ws, nullptr);
    moe_unpermute_fwd(DType::bf16, by.get(), C, byp.get(), C, brow.get(), Flex{bw.get(), false}, N, K,
                      C, false, flag.get(), ws, nullptr);
    moe_unpermute_bwd(DType::bf16, bdyp.get(), C, Flex{bdw.get(), false}, bdy.get(), C, byp.get(), C,
                      brow.get(), Flex{bw.get(), false}, N, K, C, flag.get(), ws, nullptr);
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(read_flag(flag.get()), 0);
  std::vector<float> dx(size_t(N * C)), y(size_t(N * C)), dyp(size_t(N * K * C)), dw(size_t(N * K));
  kcpu::moe_permute_bwd<float>(dx.data(), C, yp.data(), C, row.data(), N, K, C, false);
  kcpu::moe_unpermute_fwd<float>(y.data(), C, yp.data(), C, row.data(), wts.data(), N, K, C, false);
  kcpu::moe_unpermute_bwd<float>(dyp.data(), C, dw.data(), dy.data(), C, yp.data(), C, row.data(),
                                 wts.data(), N, K, C);
  EXPECT_LE(rel_error(bdx.download(), dx), 1e-2);
  EXPECT_LE(rel_error(by.download(), y), 1e-2);
  EXPECT_LE(rel_error(bdyp.download(), dyp), 1e-2);
  EXPECT_LE(rel_error(bdw.download(), dw), 1e-5);  // fp32 dots of the same bf16 values
}

// Group sizes of a skewed routing: empty groups (first, middle, last), one-row groups, groups
// that are not multiples of the tile, one large group.
std::vector<int32_t> ragged_offsets(int64_t G, int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<double> share(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) share[size_t(g)] = (g % 7 == 3 || g == 0 || g == G - 1) ? 0 : std::exp(std::normal_distribution<double>(0, 1)(rng));
  share[1] = 1e-9;  // one row below
  double tot = 0;
  for (double v : share) tot += v;
  std::vector<int32_t> off(size_t(G + 1), 0);
  int64_t used = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t r = share[size_t(g)] == 0 ? 0 : std::max<int64_t>(1, int64_t(share[size_t(g)] / tot * double(T)));
    if (g == G - 2) r = T - used;  // the rest (G-1 stays empty)
    r = std::min(r, T - used);
    used += r;
    off[size_t(g + 1)] = int32_t(used);
  }
  return off;
}

struct GGCheck {
  const char* what;
  bool ta, tb;
  int64_t G, T, M, N, K;
  bool bf16, c_f32, force_simt;
  double alpha, beta;
  int64_t samples;  // 0: compare every element
  double tol;
  const char* path;  // the implementation expected to run
};

void grouped_check(const GGCheck& k) {
  SCOPED_TRACE(k.what);
  const std::vector<int32_t> off = ragged_offsets(k.G, k.T, 5);
  const int64_t arows = k.T, acols = k.ta ? k.M : k.K;
  const int64_t brows = k.ta ? k.T : k.G * (k.tb ? k.N : k.K), bcols = k.ta ? k.N : (k.tb ? k.K : k.N);
  const int64_t crows = k.ta ? k.G * k.M : k.T;
  const std::vector<float> A = randn(size_t(arows * acols), 31, 1.f, k.bf16),
                           B = randn(size_t(brows * bcols), 32, 1.f, k.bf16),
                           C0 = randn(size_t(crows * k.N), 33, 1.f, k.bf16 && !k.c_f32);
  DevBuf bA = upload(A, k.bf16), bB = upload(B, k.bf16), bC = upload(C0, k.bf16 && !k.c_f32);
  Dev<int32_t> boff(off), flag(std::vector<int32_t>{0});
  GroupedGemmArgs g;
  g.ta = k.ta;
  g.tb = k.tb;
  g.G = k.G;
  g.T = k.T;
  g.M = k.M;
  g.N = k.N;
  g.K = k.K;
  g.alpha = k.alpha;
  g.beta = k.beta;
  g.offsets = boff.get();
  g.A = bA.get();
  g.lda = acols;
  g.B = bB.get();
  g.ldb = bcols;
  g.stride_b = k.ta ? 0 : k.K * k.N;  // [G,K,N] or [G,N,K]
  g.C = bC.get();
  g.ldc = k.N;
  g.stride_c = k.ta ? k.M * k.N : 0;
  g.ab = k.bf16 ? DType::bf16 : DType::f32;
  g.c_dt = k.bf16 && !k.c_f32 ? DType::bf16 : DType::f32;
  g.err = flag.get();
  g.force_simt = k.force_simt;
  EXPECT_STREQ(grouped_gemm_path(g), k.path);
  grouped_gemm(g, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(read_flag(flag.get()), 0);
  const std::vector<float> got = bC.download();
  // Reference in float64 on (sampled) elements of C.
  auto group_of = [&](int64_t r) {
    return int64_t(std::upper_bound(off.begin(), off.end(), int32_t(r)) - off.begin()) - 1;
  };
  std::vector<int64_t> idx;
  if (k.samples == 0) {
    for (int64_t i = 0; i < crows * k.N; ++i) idx.push_back(i);
  } else {
    std::mt19937 rng(9);
    std::uniform_int_distribution<int64_t> U(0, crows * k.N - 1);
    for (int64_t s = 0; s < k.samples; ++s) idx.push_back(U(rng));
    for (int64_t g2 = 0; g2 < k.G; ++g2)  // every group's first and last row (or C_g corner)
      for (int64_t e : {k.ta ? g2 * k.M * k.N : int64_t(off[size_t(g2)]) * k.N,
                        k.ta ? (g2 + 1) * k.M * k.N - 1 : int64_t(off[size_t(g2 + 1)]) * k.N - 1})
        if (e >= 0 && e < crows * k.N) idx.push_back(e);
  }
  std::vector<float> gv, rv;
  for (int64_t i : idx) {
    const int64_t r = i / k.N, j = i % k.N;
    double acc = 0;
    if (!k.ta) {
      const int64_t gg = group_of(r);
      for (int64_t q = 0; q < k.K; ++q)
        acc += double(A[size_t(r * k.K + q)]) *
               double(k.tb ? B[size_t((gg * k.N + j) * k.K + q)] : B[size_t((gg * k.K + q) * k.N + j)]);
    } else {
      const int64_t gg = r / k.M, m = r % k.M;
      for (int64_t t = off[size_t(gg)]; t < off[size_t(gg + 1)]; ++t)
        acc += double(A[size_t(t * k.M + m)]) * double(B[size_t(t * k.N + j)]);
    }
    gv.push_back(got[size_t(i)]);
    rv.push_back(float(k.alpha * acc + k.beta * double(C0[size_t(i)])));
  }
  const double err = rel_error(gv, rv);
  std::printf("%s: max|err|/max|ref| %.2e over %zu elements\n", k.what, err, idx.size());
  EXPECT_LE(err, k.tol);
  // Bitwise repeatable.
  const std::vector<uint8_t> b1 = bC.bytes();
  bC.upload(C0);
  grouped_gemm(g, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(b1, bC.bytes());
  if (k.T >= 65536) {  // speed at the Qwen3-MoE shapes (informative): median of 9 runs
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    std::vector<float> ms;
    for (int rep = 0; rep < 12; ++rep) {
      cudaEventRecord(e0);
      grouped_gemm(g, nullptr);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      if (rep >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double flops = 2.0 * double(k.T) * double(k.N) * double(k.ta ? k.M : k.K);
    std::printf("%s: %.3f ms, %.0f TFLOP/s\n", k.what, ms[ms.size() / 2], flops / (ms[ms.size() / 2] * 1e-3) / 1e12);
    if (!k.ta) {  // the same FLOPs as one dense cuBLASLt GEMM (expert 0's weight for all rows)
      GemmEngine* eng = gemm_engine_create(device_info());
      GemmArgs d;
      d.tb = k.tb;
      d.M = k.T;
      d.N = k.N;
      d.K = k.K;
      d.A = g.A;
      d.lda = g.lda;
      d.B = g.B;
      d.ldb = g.ldb;
      d.C = g.C;
      d.ldc = g.ldc;
      d.ab = g.ab;
      d.c_dt = g.c_dt;
      std::vector<float> dm;
      for (int rep = 0; rep < 12; ++rep) {
        TestWorkspace ws;
        cudaEventRecord(e0);
        gemm(eng, d, ws, nullptr);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float t = 0;
        cudaEventElapsedTime(&t, e0, e1);
        if (rep >= 3) dm.push_back(t);
      }
      std::sort(dm.begin(), dm.end());
      std::printf("%s: dense cuBLASLt of the same size %.3f ms, %.0f TFLOP/s\n", k.what,
                  dm[dm.size() / 2], flops / (dm[dm.size() / 2] * 1e-3) / 1e12);
      gemm_engine_destroy(eng);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
}

TEST(CudaMoe, GroupedGemmRaggedGroupsAgainstFloat64) {
  RLH_REQUIRE_CUDA();
  const std::vector<GGCheck> checks = {
      // Qwen3-MoE (d 1024, 64 experts, expert ffn 512, 8192 tokens x top-8 = 65536 rows)
      {"gate+up fwd x W^T", false, true, 64, 65536, 0, 1024, 1024, true, false, false, 1, 0, 3000, 1e-2, "mma"},
      {"down fwd", false, true, 64, 65536, 0, 1024, 512, true, false, false, 1, 0, 3000, 1e-2, "mma"},
      {"gate+up dX = dY W", false, false, 64, 65536, 0, 1024, 1024, true, false, false, 1, 0, 3000, 1e-2, "mma"},
      {"gate+up dW += dY^T X (f32)", true, false, 64, 65536, 1024, 1024, 0, true, true, false, 1, 1, 3000, 1e-4, "mma"},
      {"down dW (bf16 C)", true, false, 64, 65536, 1024, 512, 0, true, false, false, 1, 0, 3000, 1e-2, "mma"},
      // small and odd: every element, both paths, f32
      {"small tb mma", false, true, 9, 700, 0, 72, 40, true, false, false, 0.5, 0.25, 0, 1e-2, "mma"},
      {"small tb simt", false, true, 9, 700, 0, 72, 40, true, false, true, 0.5, 0.25, 0, 1e-2, "simt"},
      {"small ta mma f32 C", true, false, 9, 700, 48, 136, 0, true, true, false, 1, 0.5, 0, 1e-4, "mma"},
      {"odd bf16 (simt)", false, false, 7, 333, 0, 13, 21, true, false, false, 1, 0, 0, 1e-2, "simt"},
      {"f32 tb", false, true, 11, 900, 0, 70, 33, false, false, false, 1, 0.5, 0, 1e-5, "simt"},
      {"f32 ta", true, false, 11, 900, 37, 45, 0, false, false, false, 0.7, 1, 0, 1e-5, "simt"},
      {"f32 nn", false, false, 11, 900, 0, 45, 37, false, false, false, 1, 0, 0, 1e-5, "simt"},
  };
  for (const GGCheck& k : checks) grouped_check(k);
}

TEST(CudaMoe, GroupedGemmOffsetsThatDoNotPartitionRaiseTheFlag) {
  RLH_REQUIRE_CUDA();
  const int64_t T = 64, K = 16, N = 16;
  DevBuf A = upload(randn(size_t(T * K), 1), true), B = upload(randn(size_t(2 * K * N), 2), true),
         C(size_t(T * N), true);
  for (const std::vector<int32_t>& off : {std::vector<int32_t>{0, 40, 30}, std::vector<int32_t>{0, 10, 50},
                                          std::vector<int32_t>{4, 10, 64}}) {
    Dev<int32_t> boff(off), flag(std::vector<int32_t>{0});
    GroupedGemmArgs g;
    g.G = 2;
    g.T = T;
    g.N = N;
    g.K = K;
    g.offsets = boff.get();
    g.A = A.get();
    g.lda = K;
    g.B = B.get();
    g.ldb = N;
    g.stride_b = K * N;
    g.C = C.get();
    g.ldc = N;
    g.ab = g.c_dt = DType::bf16;
    g.err = flag.get();
    grouped_gemm(g, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(read_flag(flag.get()), 1);
  }
}

}  // namespace
}  // namespace rlh::kcuda::testing
