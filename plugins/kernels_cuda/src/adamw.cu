// adamw over tensor lists (torch.optim.AdamW, decoupled decay), one launch per 48 tensors:
// p, m, v float32 (master weights and moments), g float32 or bf16; fp32 arithmetic in the order
// of kernels_cpu's adamw.
#include <cmath>

#include "multi_tensor.cuh"

namespace rlh::kcuda {
namespace {

struct AdamConst {
  float b1, b2, eps, decay, gs, step_size, inv_sqrt_bc2;
  bool zero;
  bool copy;  // list 4: p in bf16
};

__device__ __forceinline__ void adam_one(float& p, float& m, float& v, float g, const AdamConst& k) {
  const float gi = g * k.gs;
  m = k.b1 * m + (1.f - k.b1) * gi;
  v = k.b2 * v + (1.f - k.b2) * gi * gi;
  p = p * k.decay - k.step_size * m / (sqrtf(v) * k.inv_sqrt_bc2 + k.eps);
}

__global__ void __launch_bounds__(512) adamw_kernel(MtList l, AdamConst k) {
  const int64_t b = blockIdx.x;
  const int t = mt_tensor_of(l, b);
  const int64_t i0 = (b - l.block_start[t]) * kMtChunk;
  const int64_t i1 = min(l.n[t], i0 + kMtChunk);
  float* p = static_cast<float*>(l.p[0][t]);
  float* m = static_cast<float*>(l.p[2][t]);
  float* v = static_cast<float*>(l.p[3][t]);
  const bool gbf = l.bf16[1][t];
  void* g = l.p[1][t];
  bf16* p16 = k.copy ? static_cast<bf16*>(l.p[4][t]) : nullptr;
  // 16-byte accesses when the tensors allow (chunks start at multiples of 4 elements).
  const bool vec = !gbf && ((reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(m) |
                             reinterpret_cast<uintptr_t>(v) | reinterpret_cast<uintptr_t>(g)) % 16 == 0) &&
                   reinterpret_cast<uintptr_t>(p16) % 8 == 0;
  int64_t i = i0;
  if (vec) {
    const int64_t n4 = (i1 - i0) / 4;
    float4* p4 = reinterpret_cast<float4*>(p + i0);
    float4* m4 = reinterpret_cast<float4*>(m + i0);
    float4* v4 = reinterpret_cast<float4*>(v + i0);
    float4* g4 = reinterpret_cast<float4*>(static_cast<float*>(g) + i0);
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
      float4 pp = p4[j], mm = m4[j], vv = v4[j];
      const float4 gg = g4[j];
      adam_one(pp.x, mm.x, vv.x, gg.x, k);
      adam_one(pp.y, mm.y, vv.y, gg.y, k);
      adam_one(pp.z, mm.z, vv.z, gg.z, k);
      adam_one(pp.w, mm.w, vv.w, gg.w, k);
      p4[j] = pp;
      m4[j] = mm;
      v4[j] = vv;
      if (k.zero) g4[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (p16) {
        __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(p16 + i0) + 2 * j;
        q[0] = __floats2bfloat162_rn(pp.x, pp.y);
        q[1] = __floats2bfloat162_rn(pp.z, pp.w);
      }
    }
    i = i0 + n4 * 4;
  }
  for (i += threadIdx.x; i < i1; i += blockDim.x) {
    const float graw = gbf ? __bfloat162float(static_cast<bf16*>(g)[i]) : static_cast<float*>(g)[i];
    adam_one(p[i], m[i], v[i], graw, k);
    if (p16) p16[i] = __float2bfloat16_rn(p[i]);
    if (k.zero) {
      if (gbf)
        static_cast<bf16*>(g)[i] = __float2bfloat16_rn(0.f);
      else
        static_cast<float*>(g)[i] = 0.f;
    }
  }
}

}  // namespace

void adamw(const TensorList& p, const TensorList& g, const TensorList& m, const TensorList& v,
           const AdamWArgs& o, Workspace&, cudaStream_t s) {
  if (o.step < 1) throw std::invalid_argument("adamw: step counts from 1");
  AdamConst k;
  k.b1 = float(o.beta1);
  k.b2 = float(o.beta2);
  k.eps = float(o.eps);
  k.decay = float(1.0 - o.lr * o.weight_decay);
  k.gs = float(o.grad_scale);
  const double bc1 = 1.0 - std::pow(o.beta1, double(o.step));
  const double bc2 = 1.0 - std::pow(o.beta2, double(o.step));
  k.step_size = float(o.lr / bc1);
  k.inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  k.zero = o.zero_grad;
  k.copy = o.p_bf16 != nullptr;
  const TensorList lists[5] = {p, g, m, v, k.copy ? *o.p_bf16 : p};
  mt_for_each(lists, k.copy ? 5 : 4, [&](const MtList& l, int64_t blocks) {
    adamw_kernel<<<unsigned(blocks), 512, 0, s>>>(l, k);
  });
  check_launch("adamw");
}

}  // namespace rlh::kcuda
