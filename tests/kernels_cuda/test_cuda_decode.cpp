// kernels_cuda's decode ops (decode.cu) against kernels_cpu's (the reference): kv_cache_write
// fills the same strided cache bit for bit; paged_attention over scattered blocks, with and
// without a window, GQA and MLA's Dk != Dv, contexts of one and of several 256-key partitions
// (the split kernel and its combine), in kernels_cpu's layout (f32 1e-5, bf16 1e-2) and in the
// GPU generator's contiguous layout (bf16, the vector loads), and one row alone against the same
// row in the batch with a wider table, bitwise (batch invariance); sample under every
// filter on rows with ties, flat and peaked distributions: the same tokens as kernels_cpu (the
// kept sets are searched differently, so a draw that lands within rounding of a cut may differ:
// at most 1 in 200), logprobs within 1e-4, non-finite logits give no token; rope_kv_cache_write
// bitwise rope then kv_cache_write. Label gpu.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_test_util.hpp"
#include "decode_ops.hpp"
#include "fp8_e4m3.hpp"
#include "rlhost/kernels_cuda/kernels.hpp"
#include "worker_pool.hpp"

namespace {

namespace kc = rlh::kcuda;
namespace kp = rlh::kcpu;

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&p), count * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~Dev() { cudaFree(p); }
  void put(const std::vector<T>& h) { cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<__nv_bfloat16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16_rn(x[i]);
  return y;
}
std::vector<float> from_bf16(const std::vector<__nv_bfloat16>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = __bfloat162float(x[i]);
  return y;
}

struct Geometry {
  int64_t Hq, Hkv, Dk, Dv, bs;
};

class CudaPaged : public ::testing::TestWithParam<Geometry> {};

TEST_P(CudaPaged, CacheWritesAndAttentionMatchKernelsCpu) {
  RLH_REQUIRE_CUDA();
  const Geometry g = GetParam();
  const int64_t T = 300, nb = (T + g.bs - 1) / g.bs, B = nb + 5;
  // kernels_cpu's layout: per block, K [Hkv][Dk][bs] then V [Hkv][bs][Dv]; blocks 64 floats apart
  // beyond that (a stride of their own).
  const int64_t kfl = g.Hkv * g.Dk * g.bs, vfl = g.Hkv * g.bs * g.Dv, block = kfl + vfl + 64;
  const int64_t ks[4] = {block, g.Dk * g.bs, 1, g.bs}, vs[4] = {block, g.bs * g.Dv, g.Dv, 1};
  std::mt19937 gen(3);
  std::normal_distribution<float> nd;
  std::vector<float> q(static_cast<size_t>(T * g.Hq * g.Dk)), k(static_cast<size_t>(T * g.Hkv * g.Dk)), v(static_cast<size_t>(T * g.Hkv * g.Dv));
  for (float& x : q) x = nd(gen);
  for (float& x : k) x = nd(gen);
  for (float& x : v) x = nd(gen);
  // the sequence's blocks, scattered over the cache, and two unused entries past its end
  std::vector<int32_t> table(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) table[size_t(i)] = int32_t(i);
  std::shuffle(table.begin(), table.end(), std::mt19937(11));
  table.resize(size_t(nb));
  table.push_back(-1);
  table.push_back(-1);
  std::vector<int32_t> slots, tables, pos;
  for (int64_t t = 0; t < T; ++t) {
    slots.push_back(int32_t(table[size_t(t / g.bs)] * g.bs + t % g.bs));
    tables.insert(tables.end(), table.begin(), table.end());
    pos.push_back(int32_t(t));
  }
  // The reference cache, filled on the host as kernels_cpu's kv_cache_write does.
  std::vector<float> cache(static_cast<size_t>(B * block), 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = slots[size_t(t)] / g.bs, off = slots[size_t(t)] % g.bs;
    for (int64_t h = 0; h < g.Hkv; ++h) {
      for (int64_t d = 0; d < g.Dk; ++d)
        cache[size_t(b * ks[0] + h * ks[1] + off * ks[2] + d * ks[3])] = k[size_t(t * g.Hkv * g.Dk + h * g.Dk + d)];
      for (int64_t d = 0; d < g.Dv; ++d)
        cache[size_t(kfl + b * vs[0] + h * vs[1] + off * vs[2] + d * vs[3])] = v[size_t(t * g.Hkv * g.Dv + h * g.Dv + d)];
    }
  }
  Dev<float> dk(k.size()), dv(v.size()), dcache(cache.size()), dq(q.size()), dout(static_cast<size_t>(T * g.Hq * g.Dv));
  Dev<int32_t> dslots(slots.size()), dtables(tables.size()), dpos(pos.size());
  dk.put(k);
  dv.put(v);
  dq.put(q);
  dslots.put(slots);
  dtables.put(tables);
  dpos.put(pos);
  CUDA_OK(cudaMemset(dcache.p, 0, cache.size() * sizeof(float)));
  kc::KvWriteArgs w;
  w.t = kc::DType::f32;
  w.R = T;
  w.Hkv = g.Hkv;
  w.Dk = g.Dk;
  w.Dv = g.Dv;
  w.bs = g.bs;
  w.num_blocks = B;
  w.k = dk.p;
  w.ldk = g.Hkv * g.Dk;
  w.v = dv.p;
  w.ldv = g.Hkv * g.Dv;
  w.slots = dslots.p;
  w.k_cache = dcache.p;
  w.v_cache = dcache.p + kfl;
  std::memcpy(w.kc_strides, ks, sizeof(ks));
  std::memcpy(w.vc_strides, vs, sizeof(vs));
  kc::kv_cache_write(w, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dcache.get(), cache) << "the GPU's cache writes differ from the layout's";

  // The GPU generator's layout: per block K [Hkv][bs][Dk] then V [Hkv][bs][Dv], head dims contiguous.
  const int64_t gkfl = g.Hkv * g.bs * g.Dk, gblock = gkfl + g.Hkv * g.bs * g.Dv;
  const int64_t gks[4] = {gblock, g.bs * g.Dk, g.Dk, 1}, gvs[4] = {gblock, g.bs * g.Dv, g.Dv, 1};
  std::vector<float> gcache(static_cast<size_t>(B * gblock), 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = slots[size_t(t)] / g.bs, off = slots[size_t(t)] % g.bs;
    for (int64_t h = 0; h < g.Hkv; ++h) {
      for (int64_t d = 0; d < g.Dk; ++d)
        gcache[size_t(b * gks[0] + h * gks[1] + off * gks[2] + d)] = k[size_t(t * g.Hkv * g.Dk + h * g.Dk + d)];
      for (int64_t d = 0; d < g.Dv; ++d)
        gcache[size_t(gkfl + b * gvs[0] + h * gvs[1] + off * gvs[2] + d)] = v[size_t(t * g.Hkv * g.Dv + h * g.Dv + d)];
    }
  }
  Dev<__nv_bfloat16> gbcache(gcache.size());
  gbcache.put(to_bf16(gcache));

  kp::WorkerPool pool(2);
  for (int64_t window : {int64_t(0), int64_t(10), int64_t(200)}) {
    const float scale = 0.25f;
    std::vector<float> want(static_cast<size_t>(T * g.Hq * g.Dv));
    kp::PagedAttentionArgs c;
    c.out = want.data();
    c.ldo = g.Hq * g.Dv;
    c.q = q.data();
    c.ldq = g.Hq * g.Dk;
    c.R = T;
    c.Hq = g.Hq;
    c.Hkv = g.Hkv;
    c.Dk = g.Dk;
    c.Dv = g.Dv;
    c.bs = g.bs;
    c.k = cache.data();
    c.k_block = block;
    c.v = cache.data() + kfl;
    c.v_block = block;
    c.blocks = tables.data();
    c.ld_blocks = int64_t(table.size());
    c.table_width = int64_t(table.size());
    c.pos = pos.data();
    c.scale = scale;
    c.window = window;
    kp::paged_attention(c, pool);
    kc::PagedAttnArgs a;
    a.t = kc::DType::f32;
    a.R = T;
    a.Hq = g.Hq;
    a.Hkv = g.Hkv;
    a.Dk = g.Dk;
    a.Dv = g.Dv;
    a.bs = g.bs;
    a.window = window;
    a.scale = scale;
    a.q = dq.p;
    a.ldq = g.Hq * g.Dk;
    a.o = dout.p;
    a.ldo = g.Hq * g.Dv;
    a.k_cache = dcache.p;
    a.v_cache = dcache.p + kfl;
    std::memcpy(a.kc_strides, ks, sizeof(ks));
    std::memcpy(a.vc_strides, vs, sizeof(vs));
    a.blocks = dtables.p;
    a.ld_blocks = int64_t(table.size());
    a.pos = dpos.p;
    const int64_t ws_bytes = kc::paged_attention_workspace_bytes(a);
    ASSERT_GT(ws_bytes, 0) << "contexts of 300 positions take several partitions";
    Dev<float> ws(size_t(ws_bytes) / sizeof(float));
    a.partials = ws.p;
    kc::paged_attention(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = dout.get();
    double worst = 0, mag = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, double(std::fabs(got[i] - want[i])));
      mag = std::max(mag, double(std::fabs(want[i])));
    }
    EXPECT_LT(worst / mag, 1e-5) << "f32, window " << window;
    // bf16: q and the cache rounded, f32 inside; against the f32 reference on the rounded inputs
    Dev<__nv_bfloat16> bq(q.size()), bcache(cache.size()), bout(got.size()), bout1(static_cast<size_t>(g.Hq * g.Dv));
    bq.put(to_bf16(q));
    bcache.put(to_bf16(cache));
    a.t = kc::DType::bf16;
    a.q = bq.p;
    a.o = bout.p;
    a.k_cache = bcache.p;
    a.v_cache = bcache.p + kfl;
    kc::paged_attention(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> gb = from_bf16(bout.get());
    std::vector<float> qr = from_bf16(to_bf16(q)), cr = from_bf16(to_bf16(cache));
    c.q = qr.data();
    c.k = cr.data();
    c.v = cr.data() + kfl;
    kp::paged_attention(c, pool);
    auto rel = [&](const std::vector<float>& x) {
      double w = 0;
      for (size_t i = 0; i < x.size(); ++i) w = std::max(w, double(std::fabs(x[i] - want[i])));
      return w / mag;
    };
    EXPECT_LT(rel(gb), 1e-2) << "bf16, window " << window;
    // bf16 in the generator's layout (16-byte key loads where the dims allow)
    a.k_cache = gbcache.p;
    a.v_cache = gbcache.p + gkfl;
    std::memcpy(a.kc_strides, gks, sizeof(gks));
    std::memcpy(a.vc_strides, gvs, sizeof(gvs));
    // the partitions combined in the block (the default where they fit) and through global memory
    for (const int block_combine : {1, 0}) {
      a.block_combine = block_combine;
      kc::paged_attention(a, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_LT(rel(from_bf16(bout.get())), 1e-2)
          << "bf16, generator layout, window " << window << ", block combine " << block_combine;
      a.block_combine = -1;
    }
    // Batch invariance, asked for (batch_invariant, the generator's deterministic mode; without
    // it the tensor-core kernel picks its partitions per launch): each checked row alone, with a
    // table 8 entries wider (more partitions), gives its row of the batch bit for bit.
    a.batch_invariant = true;
    kc::paged_attention(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<__nv_bfloat16> all = bout.get();
    EXPECT_LT(rel(from_bf16(all)), 1e-2) << "bf16, generator layout, batch-invariant, window " << window;
    for (int64_t r : {int64_t(0), int64_t(127), int64_t(200), int64_t(255), int64_t(256), int64_t(270), T - 1}) {
      std::vector<int32_t> wide(table.begin(), table.end());
      wide.resize(wide.size() + 8, -1);
      Dev<int32_t> dwide(wide.size()), dpos1(1);
      dwide.put(wide);
      dpos1.put({pos[size_t(r)]});
      kc::PagedAttnArgs one = a;
      one.R = 1;
      one.q = bq.p + r * g.Hq * g.Dk;
      one.o = bout1.p;
      one.blocks = dwide.p;
      one.ld_blocks = int64_t(wide.size());
      one.table_width = int64_t(wide.size());
      one.pos = dpos1.p;
      Dev<float> ws1(size_t(std::max<int64_t>(kc::paged_attention_workspace_bytes(one), 4)) / sizeof(float));
      one.partials = ws1.p;
      kc::paged_attention(one, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const std::vector<__nv_bfloat16> alone = bout1.get();
      EXPECT_EQ(0, std::memcmp(alone.data(), all.data() + r * g.Hq * g.Dv, alone.size() * sizeof(__nv_bfloat16)))
          << "row " << r << " alone differs from the batch, window " << window;
    }
    a.batch_invariant = false;
    // A batch-1 step (one row, a table just wide enough: 1-3 tiles of 64 keys): the partitions
    // combined in the block and through the combine kernel, each against the reference row.
    for (int64_t r : {int64_t(40), int64_t(127), int64_t(150)}) {
      Dev<int32_t> dpos1(1);
      dpos1.put({pos[size_t(r)]});
      kc::PagedAttnArgs one = a;
      one.R = 1;
      one.q = bq.p + r * g.Hq * g.Dk;
      one.o = bout1.p;
      one.table_width = r / g.bs + 1;
      one.pos = dpos1.p;
      Dev<float> ws1(size_t(std::max<int64_t>(kc::paged_attention_workspace_bytes(one), 4)) / sizeof(float));
      one.partials = ws1.p;
      for (const int block_combine : {1, 0}) {
        one.block_combine = block_combine;
        kc::paged_attention(one, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> got1 = from_bf16(bout1.get());
        double w1 = 0;
        for (size_t i = 0; i < got1.size(); ++i)
          w1 = std::max(w1, double(std::fabs(got1[i] - want[size_t(r * g.Hq * g.Dv) + i])));
        EXPECT_LT(w1 / mag, 1e-2) << "row " << r << " alone, block combine " << block_combine << ", window " << window;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(GqaAndMla, CudaPaged,
                         ::testing::Values(Geometry{4, 2, 16, 16, 16}, Geometry{8, 2, 64, 64, 16},
                                           Geometry{4, 4, 24, 12, 8}, Geometry{2, 1, 128, 128, 16},
                                           Geometry{2, 2, 192, 128, 16}));

// FP8 caches (kv_cache_dtype fp8): kernels_cuda's cache write stores each key's and value's code
// of x / scale as kernels_cpu does (fp8_e4m3.hpp: nearest even, saturated), bit for bit, in the
// GPU generator's layout; its tensor-core attention over them is the attention of their values
// (scale x code) within bf16's error, through partitions combined both ways, for queries of any
// magnitude, and batch-invariant when asked.
class CudaPagedFp8 : public ::testing::TestWithParam<int64_t> {};  // the head dim

TEST_P(CudaPagedFp8, CodesAsKernelsCpuAndAttentionOfTheirValues) {
  RLH_REQUIRE_CUDA();
  const int64_t D = GetParam(), Hq = 8, Hkv = 2, bs = 16, T = 300, nb = (T + bs - 1) / bs, B = nb + 5;
  std::mt19937 gen(7);
  std::normal_distribution<float> nd;
  // bf16 inputs (as a step's keys and values are); the host sees the same numbers in float
  std::vector<float> q(size_t(T * Hq * D)), k(size_t(T * Hkv * D)), v(size_t(T * Hkv * D));
  for (float& x : q) x = nd(gen);
  for (float& x : k) x = 3.f * nd(gen);
  for (float& x : v) x = nd(gen);
  k[3] = 900.f;    // saturates at k_scale 0.5 (past 448)
  k[4] = -0.003f;  // subnormal codes at both key scales (|x / k_scale| < 2^-6)
  // Queries past fp16's range and below its normal numbers (the FP8 form rounds Q to fp16 after a
  // power-of-two scale): row 150's first head x 1e5 (a one-hot softmax), row 40's second x 1e-6.
  for (int64_t d = 0; d < D; ++d) {
    q[size_t((150 * Hq + 0) * D + d)] *= 1e5f;
    q[size_t((40 * Hq + 1) * D + d)] *= 1e-6f;
  }
  q = from_bf16(to_bf16(q));
  k = from_bf16(to_bf16(k));
  v = from_bf16(to_bf16(v));
  std::vector<int32_t> table(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) table[size_t(i)] = int32_t(i);
  std::shuffle(table.begin(), table.end(), std::mt19937(13));
  table.resize(size_t(nb));
  std::vector<int32_t> slots, tables, pos;
  for (int64_t t = 0; t < T; ++t) {
    slots.push_back(int32_t(table[size_t(t / bs)] * bs + t % bs));
    tables.insert(tables.end(), table.begin(), table.end());
    pos.push_back(int32_t(t));
  }
  // The GPU generator's layout in bytes: per block K [Hkv][bs][D] then V [Hkv][bs][D].
  const int64_t kb = Hkv * bs * D, block = 2 * kb;
  const int64_t st[4] = {block, bs * D, D, 1};
  Dev<__nv_bfloat16> dk(k.size()), dv(v.size()), dq(q.size()), dout(size_t(T * Hq * D)), dout1(size_t(Hq * D));
  Dev<uint8_t> dcache(size_t(B * block));
  Dev<int32_t> dslots(slots.size()), dtables(tables.size()), dpos(pos.size());
  Dev<float> dscales(2);
  dk.put(to_bf16(k));
  dv.put(to_bf16(v));
  dq.put(to_bf16(q));
  dslots.put(slots);
  dtables.put(tables);
  dpos.put(pos);
  kp::WorkerPool pool(2);
  const std::array<float, 256>& val = kp::e4m3_values();
  for (const auto& [ks, vs] : {std::pair<float, float>{0.5f, 2.f}, {0.37f, 1.3f}}) {
    dscales.put({ks, vs});
    CUDA_OK(cudaMemset(dcache.p, 0, dcache.n));
    kc::KvWriteArgs w;
    w.t = kc::DType::bf16;
    w.R = T;
    w.Hkv = Hkv;
    w.Dk = w.Dv = D;
    w.bs = bs;
    w.num_blocks = B;
    w.k = dk.p;
    w.ldk = Hkv * D;
    w.v = dv.p;
    w.ldv = Hkv * D;
    w.slots = dslots.p;
    w.k_cache = dcache.p;
    w.v_cache = dcache.p + kb;
    std::memcpy(w.kc_strides, st, sizeof(st));
    std::memcpy(w.vc_strides, st, sizeof(st));
    w.k_scale = dscales.p;
    w.v_scale = dscales.p + 1;
    kc::kv_cache_write(w, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> codes = dcache.get();
    // The codes against kernels_cpu's, and the float32 cache of their values in kernels_cpu's
    // layout (K [Hkv][D][bs], V [Hkv][bs][D]) for the reference attention.
    std::vector<float> ref(size_t(B * block), 0.f);
    int64_t wrong = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t b = slots[size_t(t)] / bs, off = slots[size_t(t)] % bs;
      for (int64_t h = 0; h < Hkv; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const uint8_t ck = codes[size_t(b * block + h * bs * D + off * D + d)];
          const uint8_t cv = codes[size_t(b * block + kb + h * bs * D + off * D + d)];
          wrong += ck != kp::e4m3_encode(k[size_t((t * Hkv + h) * D + d)] / ks);
          wrong += cv != kp::e4m3_encode(v[size_t((t * Hkv + h) * D + d)] / vs);
          ref[size_t(b * block + (h * D + d) * bs + off)] = ks * val[ck];
          ref[size_t(b * block + kb + (h * bs + off) * D + d)] = vs * val[cv];
        }
    }
    EXPECT_EQ(wrong, 0) << "codes unlike kernels_cpu's, scales " << ks << ", " << vs;
    for (int64_t window : {int64_t(0), int64_t(100)}) {
      std::vector<float> want(size_t(T * Hq * D));
      kp::PagedAttentionArgs c;
      c.out = want.data();
      c.ldo = Hq * D;
      c.q = q.data();
      c.ldq = Hq * D;
      c.R = T;
      c.Hq = Hq;
      c.Hkv = Hkv;
      c.Dk = c.Dv = D;
      c.bs = bs;
      c.k = ref.data();
      c.k_block = block;
      c.v = ref.data() + kb;
      c.v_block = block;
      c.blocks = tables.data();
      c.ld_blocks = c.table_width = int64_t(table.size());
      c.pos = pos.data();
      c.scale = 0.125f;
      c.window = window;
      kp::paged_attention(c, pool);
      double mag = 0;
      for (float x : want) mag = std::max(mag, double(std::fabs(x)));
      kc::PagedAttnArgs a;
      a.t = kc::DType::bf16;
      a.R = T;
      a.Hq = Hq;
      a.Hkv = Hkv;
      a.Dk = a.Dv = D;
      a.bs = bs;
      a.window = window;
      a.scale = 0.125f;
      a.q = dq.p;
      a.ldq = Hq * D;
      a.o = dout.p;
      a.ldo = Hq * D;
      a.k_cache = dcache.p;
      a.v_cache = dcache.p + kb;
      std::memcpy(a.kc_strides, st, sizeof(st));
      std::memcpy(a.vc_strides, st, sizeof(st));
      a.blocks = dtables.p;
      a.ld_blocks = a.table_width = int64_t(table.size());
      a.pos = dpos.p;
      a.k_scale = dscales.p;
      a.v_scale = dscales.p + 1;
      ASSERT_TRUE(kc::paged_attention_mma_ok(a));
      Dev<float> ws(size_t(std::max<int64_t>(kc::paged_attention_workspace_bytes(a), 4)) / sizeof(float));
      a.partials = ws.p;
      auto rel = [&](const std::vector<float>& x, size_t at) {
        double e = 0;
        for (size_t i = 0; i < x.size(); ++i) e = std::max(e, double(std::fabs(x[i] - want[at + i])));
        return e / mag;
      };
      for (const bool invariant : {false, true}) {
        a.batch_invariant = invariant;
        kc::paged_attention(a, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<__nv_bfloat16> all = dout.get();
        EXPECT_LT(rel(from_bf16(all), 0), 1e-2) << "D " << D << " window " << window << " invariant " << invariant;
        // One row alone (a batch-1 step: few tiles, partitions combined in the block or through
        // the combine kernel); with batch invariance asked, bit for bit its row of the batch.
        for (int64_t r : {int64_t(40), int64_t(150), T - 1}) {
          Dev<int32_t> dpos1(1);
          dpos1.put({pos[size_t(r)]});
          kc::PagedAttnArgs one = a;
          one.R = 1;
          one.q = dq.p + r * Hq * D;
          one.o = dout1.p;
          one.pos = dpos1.p;
          Dev<float> ws1(size_t(std::max<int64_t>(kc::paged_attention_workspace_bytes(one), 4)) / sizeof(float));
          one.partials = ws1.p;
          for (const int block_combine : {1, 0}) {
            one.block_combine = block_combine;
            kc::paged_attention(one, nullptr);
            CUDA_OK(cudaDeviceSynchronize());
            const std::vector<__nv_bfloat16> alone = dout1.get();
            EXPECT_LT(rel(from_bf16(alone), size_t(r * Hq * D)), 1e-2) << "row " << r << " block combine " << block_combine;
            if (invariant) {
              EXPECT_EQ(0, std::memcmp(alone.data(), all.data() + r * Hq * D, alone.size() * sizeof(__nv_bfloat16)))
                  << "row " << r << " alone differs from the batch (batch_invariant)";
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaPagedFp8, ::testing::Values(int64_t(64), int64_t(128)));

// rope_kv_cache_write is rope then kv_cache_write of the rotated keys, bit for bit: the rotated
// q and k heads and both caches (bf16 and FP8), in place and out of place, with a padding row
// (slot -1) and Llama's and a 128-dim head's shapes (one launch), and partial rotary dims (the
// two ops).
TEST(CudaRopeKv, OneLaunchIsRopeThenTheCacheWriteBitwise) {
  RLH_REQUIRE_CUDA();
  struct Shape {
    int64_t Hq, Hkv, D, rot;
  };
  for (const Shape sh : {Shape{32, 8, 64, 64}, Shape{8, 2, 128, 128}, Shape{4, 2, 64, 32}})
    for (const bool fp8 : {false, true})
      for (const bool in_place : {true, false}) {
        SCOPED_TRACE("Hq " + std::to_string(sh.Hq) + " D " + std::to_string(sh.D) + " rot " + std::to_string(sh.rot) +
                     (fp8 ? " fp8" : " bf16") + (in_place ? " in place" : ""));
        const int64_t R = 6, H = sh.Hq + sh.Hkv, D = sh.D, ld = (H + sh.Hkv) * D, bs = 16, B = 8;
        const int64_t eb = fp8 ? 1 : 2, kb = sh.Hkv * bs * D, block = 2 * kb;  // elements of a block's K, then V
        std::mt19937 gen(11);
        std::normal_distribution<float> nd;
        std::vector<float> x(size_t(R * ld));
        for (float& e : x) e = 2.f * nd(gen);
        std::vector<float> inv(size_t(sh.rot / 2));
        for (size_t i = 0; i < inv.size(); ++i) inv[i] = float(std::pow(500000.0, -2.0 * double(i) / double(sh.rot)));
        const std::vector<int32_t> pos = {0, 17, 130, 4095, 9, 77}, slots = {5, 40, -1, 127, 64, 3};
        Dev<__nv_bfloat16> dx(x.size()), y1(x.size()), y2(x.size());
        Dev<uint8_t> c1(size_t(B * block * eb)), c2(size_t(B * block * eb));
        Dev<float> dinv(inv.size()), dscale(2);
        Dev<int32_t> dpos(pos.size()), dslots(slots.size());
        dx.put(to_bf16(x));
        dinv.put(inv);
        dscale.put({0.05f, 0.03f});
        dpos.put(pos);
        dslots.put(slots);
        CUDA_OK(cudaMemset(c1.p, 0, c1.n));
        CUDA_OK(cudaMemset(c2.p, 0, c2.n));
        CUDA_OK(cudaMemcpy(y1.p, dx.p, x.size() * 2, cudaMemcpyDeviceToDevice));
        CUDA_OK(cudaMemcpy(y2.p, dx.p, x.size() * 2, cudaMemcpyDeviceToDevice));
        // the values: the heads after q|k in each row
        const int64_t st[4] = {block, bs * D, D, 1};
        kc::KvWriteArgs w;
        w.t = kc::DType::bf16;
        w.R = R;
        w.Hkv = sh.Hkv;
        w.Dk = w.Dv = D;
        w.bs = bs;
        w.num_blocks = B;
        w.ldv = ld;
        w.slots = dslots.p;
        std::memcpy(w.kc_strides, st, sizeof(st));
        std::memcpy(w.vc_strides, st, sizeof(st));
        if (fp8) {
          w.k_scale = dscale.p;
          w.v_scale = dscale.p + 1;
        }
        // the two ops: rope in place in y1, then the write from y1
        kc::rope(kc::DType::bf16, y1.p, ld, y1.p, ld, dpos.p, dinv.p, R, H, D, sh.rot, 1.0, false, false, nullptr);
        kc::KvWriteArgs w1 = w;
        w1.k = y1.p + sh.Hq * D;
        w1.ldk = ld;
        w1.v = y1.p + H * D;
        w1.k_cache = c1.p;
        w1.v_cache = c1.p + kb * eb;
        kc::kv_cache_write(w1, nullptr);
        // the one op into y2 (in place, or from dx)
        kc::RopeKvArgs a;
        a.kv = w;
        a.kv.v = (in_place ? y2.p : dx.p) + H * D;
        a.kv.k_cache = c2.p;
        a.kv.v_cache = c2.p + kb * eb;
        a.y = y2.p;
        a.ldy = ld;
        a.x = in_place ? y2.p : dx.p;
        a.ldx = ld;
        a.Hq = sh.Hq;
        a.rot = sh.rot;
        a.pos = dpos.p;
        a.inv_freq = dinv.p;
        kc::rope_kv_cache_write(a, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<__nv_bfloat16> g1 = y1.get(), g2 = y2.get();
        EXPECT_EQ(0, std::memcmp(g1.data(), g2.data(), g1.size() * 2)) << "rotated heads";
        const std::vector<uint8_t> k1 = c1.get(), k2 = c2.get();
        EXPECT_EQ(0, std::memcmp(k1.data(), k2.data(), k1.size())) << "caches";
        int64_t written = 0;  // (the padding row wrote nothing; the others did)
        for (uint8_t b : k2) written += b != 0;
        EXPECT_GT(written, 0);
      }
}

std::vector<std::vector<float>> sample_rows(int64_t V) {
  std::mt19937 g(5);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> rows;
  for (int r = 0; r < 6; ++r) {
    std::vector<float> row(static_cast<size_t>(V));
    for (float& x : row) x = 2.f * nd(g);
    rows.push_back(row);
  }
  std::vector<float> ties(static_cast<size_t>(V));
  for (int64_t j = 0; j < V; ++j) ties[size_t(j)] = float(j % 7) * 0.5f;
  rows.push_back(ties);
  rows.push_back(std::vector<float>(static_cast<size_t>(V), 0.25f));
  std::vector<float> peak(static_cast<size_t>(V), -3.f);
  peak[17] = 9.f;
  peak[3] = 8.5f;
  rows.push_back(peak);
  return rows;
}

TEST(CudaSample, DrawsWhatKernelsCpuDrawsUnderEveryFilter) {
  RLH_REQUIRE_CUDA();
  kp::WorkerPool pool(2);
  int64_t compared = 0, differ = 0;
  for (int64_t V : {int64_t(300), int64_t(50000)}) {
    const auto rows = sample_rows(V);
    const int64_t R = int64_t(rows.size()), U = 16, S = R * U;
    std::vector<float> logits;
    std::vector<double> u;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < U; ++i) {
        logits.insert(logits.end(), rows[size_t(r)].begin(), rows[size_t(r)].end());
        u.push_back((double(i) + 0.5) / double(U));
      }
    Dev<float> dl(logits.size()), dlp(static_cast<size_t>(S));
    Dev<double> du(u.size());
    Dev<int32_t> dt(static_cast<size_t>(S));
    dl.put(logits);
    du.put(u);
    // With the workspace, calls without thresholds take the partitioned draw (4096-id
    // partitions: one at V 300, 13 with a short last one at 50000); without it, the one-block draw.
    for (int split = 0; split < 2; ++split)
    for (double T : {0.0, 1.0, 0.6})
      for (int64_t k : {int64_t(0), int64_t(1), int64_t(5), int64_t(40)})
        for (double p : {1.0, 0.9, 0.5})
          for (double mp : {0.0, 0.05}) {
            kp::SampleParams sp{T, k, p, mp};
            std::vector<int32_t> want_t(static_cast<size_t>(S));
            std::vector<float> want_lp(static_cast<size_t>(S));
            kp::sample(logits.data(), V, S, V, u.data(), sp, want_t.data(), want_lp.data(), pool);
            kc::SampleArgs a;
            a.S = S;
            a.V = V;
            a.ld = V;
            a.logits = dl.p;
            a.u = du.p;
            a.temperature = T;
            a.top_k = k;
            a.top_p = p;
            a.min_p = mp;
            a.tokens = dt.p;
            a.logprobs = dlp.p;
            const int64_t ws = split ? kc::sample_workspace_bytes(a) : 0;
            Dev<char> parts(static_cast<size_t>(std::max<int64_t>(ws, 1)));
            if (ws) a.parts = parts.p;
            kc::sample(a, nullptr);
            CUDA_OK(cudaDeviceSynchronize());
            const std::vector<int32_t> got_t = dt.get();
            const std::vector<float> got_lp = dlp.get();
            for (int64_t i = 0; i < S; ++i) {
              ++compared;
              if (got_t[size_t(i)] != want_t[size_t(i)]) {
                ++differ;
                continue;
              }
              ASSERT_NEAR(got_lp[size_t(i)], want_lp[size_t(i)], 1e-4)
                  << "V " << V << " row " << i / U << " T " << T << " k " << k << " p " << p << " min_p " << mp;
            }
          }
  }
  std::printf("sample: %lld draws compared, %lld differ\n", (long long)compared, (long long)differ);
  EXPECT_LE(differ * 200, compared);
  {
    // The partitioned draw of one row alone equals the same row's draw in a batch (its
    // partitions depend on V only), and NaN anywhere in a row gives no token.
    const int64_t V = 50000;
    const auto rows = sample_rows(V);
    std::vector<float> logits;
    for (const auto& r : rows) logits.insert(logits.end(), r.begin(), r.end());
    logits[size_t(2 * V + 40000)] = NAN;  // row 2, in its tenth partition
    const int64_t S = int64_t(rows.size());
    std::vector<double> u(static_cast<size_t>(S));
    for (int64_t i = 0; i < S; ++i) u[size_t(i)] = (double(i) + 0.3) / double(S);
    Dev<float> dl(logits.size()), dlp(static_cast<size_t>(S));
    Dev<double> du(u.size());
    Dev<int32_t> dt(static_cast<size_t>(S));
    dl.put(logits);
    du.put(u);
    kc::SampleArgs a;
    a.S = S;
    a.V = a.ld = V;
    a.logits = dl.p;
    a.u = du.p;
    a.tokens = dt.p;
    a.logprobs = dlp.p;
    Dev<char> parts(static_cast<size_t>(kc::sample_workspace_bytes(a)));
    ASSERT_GT(kc::sample_workspace_bytes(a), 0);
    a.parts = parts.p;
    kc::sample(a, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<int32_t> batch_t = dt.get();
    const std::vector<float> batch_lp = dlp.get();
    EXPECT_EQ(batch_t[2], -1);
    for (int64_t i = 0; i < S; ++i) {
      kc::SampleArgs one = a;
      one.S = 1;
      one.logits = dl.p + i * V;
      one.u = du.p + i;
      one.tokens = dt.p + i;
      one.logprobs = dlp.p + i;
      kc::sample(one, nullptr);
    }
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(dt.get(), batch_t);
    const std::vector<float> one_lp = dlp.get();
    for (int64_t i = 0; i < S; ++i)
      if (i != 2) {
        EXPECT_EQ(one_lp[size_t(i)], batch_lp[size_t(i)]) << "row " << i;
      }
  }
  // Non-finite logits: no token (the generator refuses a -1 with an error naming it).
  std::vector<float> bad = {0.f, NAN, 1.f};
  const std::vector<double> uu = {0.5};
  Dev<float> db(bad.size()), dlp(1);
  Dev<double> du(1);
  Dev<int32_t> dt(1);
  db.put(bad);
  du.put(uu);
  kc::SampleArgs a;
  a.S = 1;
  a.V = 3;
  a.ld = 3;
  a.logits = db.p;
  a.u = du.p;
  a.tokens = dt.p;
  a.logprobs = dlp.p;
  kc::sample(a, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dt.get()[0], -1);
}

}  // namespace
