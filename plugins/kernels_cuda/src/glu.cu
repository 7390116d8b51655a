// Gated linear units: h = act(gate) * up and their backward, fp32 arithmetic; 8 elements per
// thread with 16-byte accesses when rows and pointers are aligned. act: silu (swiglu), gelu in
// its tanh form or exact (geglu, Gemma); the formulas are kernels_cpu's (swiglu.cpp, geglu.cpp).
#include "glu_act.cuh"

namespace rlh::kcuda {
namespace {

template <class T>
struct Vec8;  // 8 elements as one or two 16-byte words
template <>
struct Vec8<bf16> {
  uint4 u;
  __device__ void load(const bf16* p) { u = *reinterpret_cast<const uint4*>(p); }
  __device__ void store(bf16* p) const { *reinterpret_cast<uint4*>(p) = u; }
  __device__ float get(int k) const { return __bfloat162float(reinterpret_cast<const bf16*>(&u)[k]); }
  __device__ void set(int k, float v) { reinterpret_cast<bf16*>(&u)[k] = __float2bfloat16_rn(v); }
};
template <>
struct Vec8<float> {
  float4 a, b;
  __device__ void load(const float* p) {
    a = reinterpret_cast<const float4*>(p)[0];
    b = reinterpret_cast<const float4*>(p)[1];
  }
  __device__ void store(float* p) const {
    reinterpret_cast<float4*>(p)[0] = a;
    reinterpret_cast<float4*>(p)[1] = b;
  }
  __device__ float get(int k) const { return k < 4 ? (&a.x)[k] : (&b.x)[k - 4]; }
  __device__ void set(int k, float v) { (k < 4 ? (&a.x)[k] : (&b.x)[k - 4]) = v; }
};

template <class T, int VEC, int ACT>
__global__ void glu_fwd_kernel(T* h, int64_t ldh, const T* gate, int64_t ldg, const T* up,
                                  int64_t ldu, int64_t N, int64_t F) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t per_row = F / VEC, total = N * per_row;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = idx / per_row, f = (idx - n * per_row) * VEC;
    if constexpr (VEC == 8) {
      Vec8<T> g, u, o;
      g.load(gate + n * ldg + f);
      u.load(up + n * ldu + f);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        o.set(k, act_value<ACT>(g.get(k)) * u.get(k));
      }
      o.store(h + n * ldh + f);
    } else {
      h[n * ldh + f] = from_f<T>(act_value<ACT>(to_f(gate[n * ldg + f])) * to_f(up[n * ldu + f]));
    }
  }
}

template <class T, int VEC, int ACT>
__global__ void glu_bwd_kernel(T* dgate, int64_t lddg, T* dup, int64_t lddu, const T* dh,
                                  int64_t lddh, const T* gate, int64_t ldg, const T* up,
                                  int64_t ldu, int64_t N, int64_t F) {
  const int64_t per_row = F / VEC, total = N * per_row;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = idx / per_row, f = (idx - n * per_row) * VEC;
    if constexpr (VEC == 8) {
      Vec8<T> g, u, d, og, ou;
      g.load(gate + n * ldg + f);
      u.load(up + n * ldu + f);
      d.load(dh + n * lddh + f);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float a, da;
        act_and_grad<ACT>(g.get(k), &a, &da);
        const float uv = u.get(k), dv = d.get(k);
        og.set(k, dv * uv * da);
        ou.set(k, dv * a);
      }
      og.store(dgate + n * lddg + f);
      ou.store(dup + n * lddu + f);
    } else {
      float a, da;
      act_and_grad<ACT>(to_f(gate[n * ldg + f]), &a, &da);
      const float uv = to_f(up[n * ldu + f]), dv = to_f(dh[n * lddh + f]);
      dgate[n * lddg + f] = from_f<T>(dv * uv * da);
      dup[n * lddu + f] = from_f<T>(dv * a);
    }
  }
}

bool al16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
unsigned grid_of(int64_t work) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((work + 255) / 256, 132 * 32)));
}

template <class T, int ACT>
void fwd_t(T* h, int64_t ldh, const T* g, int64_t ldg, const T* u, int64_t ldu, int64_t N,
           int64_t F, cudaStream_t s) {
  const bool vec = F % 8 == 0 && ldh % 8 == 0 && ldg % 8 == 0 && ldu % 8 == 0 && al16(h) &&
                   al16(g) && al16(u);
  if (vec)
    launch_pdl(glu_fwd_kernel<T, 8, ACT>, grid_of(N * F / 8), 256, 0, s, h, ldh, g, ldg, u, ldu, N, F);
  else
    launch_pdl(glu_fwd_kernel<T, 1, ACT>, grid_of(N * F), 256, 0, s, h, ldh, g, ldg, u, ldu, N, F);
}

template <class T, int ACT>
void bwd_t(T* dg, int64_t lddg, T* du, int64_t lddu, const T* dh, int64_t lddh, const T* g,
           int64_t ldg, const T* u, int64_t ldu, int64_t N, int64_t F, cudaStream_t s) {
  const bool vec = F % 8 == 0 && lddg % 8 == 0 && lddu % 8 == 0 && lddh % 8 == 0 &&
                   ldg % 8 == 0 && ldu % 8 == 0 && al16(dg) && al16(du) && al16(dh) && al16(g) &&
                   al16(u);
  if (vec)
    glu_bwd_kernel<T, 8, ACT><<<grid_of(N * F / 8), 256, 0, s>>>(dg, lddg, du, lddu, dh, lddh, g,
                                                                  ldg, u, ldu, N, F);
  else
    glu_bwd_kernel<T, 1, ACT><<<grid_of(N * F), 256, 0, s>>>(dg, lddg, du, lddu, dh, lddh, g, ldg,
                                                              u, ldu, N, F);
}

template <int ACT>
void glu_fwd(DType t, void* h, int64_t ldh, const void* gate, int64_t ldg, const void* up, int64_t ldu,
             int64_t N, int64_t F, cudaStream_t s, const char* what) {
  if (N * F == 0) return;
  if (t == DType::f32)
    fwd_t<float, ACT>(static_cast<float*>(h), ldh, static_cast<const float*>(gate), ldg,
                      static_cast<const float*>(up), ldu, N, F, s);
  else
    fwd_t<bf16, ACT>(static_cast<bf16*>(h), ldh, static_cast<const bf16*>(gate), ldg,
                     static_cast<const bf16*>(up), ldu, N, F, s);
  check_launch(what);
}

template <int ACT>
void glu_bwd(DType t, void* dgate, int64_t lddg, void* dup, int64_t lddu, const void* dh, int64_t lddh,
             const void* gate, int64_t ldg, const void* up, int64_t ldu, int64_t N, int64_t F, cudaStream_t s,
             const char* what) {
  if (N * F == 0) return;
  if (t == DType::f32)
    bwd_t<float, ACT>(static_cast<float*>(dgate), lddg, static_cast<float*>(dup), lddu,
                      static_cast<const float*>(dh), lddh, static_cast<const float*>(gate), ldg,
                      static_cast<const float*>(up), ldu, N, F, s);
  else
    bwd_t<bf16, ACT>(static_cast<bf16*>(dgate), lddg, static_cast<bf16*>(dup), lddu,
                     static_cast<const bf16*>(dh), lddh, static_cast<const bf16*>(gate), ldg,
                     static_cast<const bf16*>(up), ldu, N, F, s);
  check_launch(what);
}

}  // namespace

void swiglu_fwd(DType t, void* h, int64_t ldh, const void* gate, int64_t ldg, const void* up,
                int64_t ldu, int64_t N, int64_t F, cudaStream_t s) {
  glu_fwd<0>(t, h, ldh, gate, ldg, up, ldu, N, F, s, "swiglu_fwd");
}

void swiglu_bwd(DType t, void* dgate, int64_t lddg, void* dup, int64_t lddu, const void* dh,
                int64_t lddh, const void* gate, int64_t ldg, const void* up, int64_t ldu,
                int64_t N, int64_t F, cudaStream_t s) {
  glu_bwd<0>(t, dgate, lddg, dup, lddu, dh, lddh, gate, ldg, up, ldu, N, F, s, "swiglu_bwd");
}

void geglu_fwd(DType t, void* h, int64_t ldh, const void* gate, int64_t ldg, const void* up,
               int64_t ldu, int64_t N, int64_t F, bool tanh_form, cudaStream_t s) {
  if (tanh_form) glu_fwd<1>(t, h, ldh, gate, ldg, up, ldu, N, F, s, "geglu_fwd");
  else glu_fwd<2>(t, h, ldh, gate, ldg, up, ldu, N, F, s, "geglu_fwd");
}

void geglu_bwd(DType t, void* dgate, int64_t lddg, void* dup, int64_t lddu, const void* dh,
               int64_t lddh, const void* gate, int64_t ldg, const void* up, int64_t ldu,
               int64_t N, int64_t F, bool tanh_form, cudaStream_t s) {
  if (tanh_form) glu_bwd<1>(t, dgate, lddg, dup, lddu, dh, lddh, gate, ldg, up, ldu, N, F, s, "geglu_bwd");
  else glu_bwd<2>(t, dgate, lddg, dup, lddu, dh, lddh, gate, ldg, up, ldu, N, F, s, "geglu_bwd");
}

}  // namespace rlh::kcuda
