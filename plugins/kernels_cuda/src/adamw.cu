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
};

__global__ void adamw_kernel(MtList l, AdamConst k) {
  const int64_t b = blockIdx.x;
  const int t = mt_tensor_of(l, b);
  const int64_t i0 = (b - l.block_start[t]) * kMtChunk;
  const int64_t i1 = min(l.n[t], i0 + kMtChunk);
  float* p = static_cast<float*>(l.p[0][t]);
  float* m = static_cast<float*>(l.p[2][t]);
  float* v = static_cast<float*>(l.p[3][t]);
  const bool gbf = l.bf16[1][t];
  void* g = l.p[1][t];
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const float graw = gbf ? __bfloat162float(static_cast<bf16*>(g)[i]) : static_cast<float*>(g)[i];
    const float gi = graw * k.gs;
    const float mi = k.b1 * m[i] + (1.f - k.b1) * gi;
    const float vi = k.b2 * v[i] + (1.f - k.b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * k.decay - k.step_size * mi / (sqrtf(vi) * k.inv_sqrt_bc2 + k.eps);
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
  const TensorList lists[4] = {p, g, m, v};
  mt_for_each(lists, 4, [&](const MtList& l, int64_t blocks) {
    adamw_kernel<<<unsigned(blocks), 512, 0, s>>>(l, k);
  });
  check_launch("adamw");
}

}  // namespace rlh::kcuda
