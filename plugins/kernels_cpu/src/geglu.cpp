// geglu: h = gelu(gate) * up and its backward (Gemma's MLP; HF hidden_act gelu_pytorch_tanh /
// gelu_new for the tanh form, gelu for the exact one).
//   tanh form: gelu(g) = g/2 (1 + tanh(k (g + c g^3))),  k = sqrt(2/pi), c = 0.044715
//              gelu'(g) = (1 + t)/2 + g/2 (1 - t^2) k (1 + 3 c g^2),  t = tanh(k (g + c g^3))
//   erf form:  gelu(g) = g/2 (1 + erf(g / sqrt 2)),  gelu'(g) = (1 + erf(g/sqrt 2))/2 + g phi(g)
//   dgate = dh * up * gelu'(gate),  dup = dh * gelu(gate)
// Row-parallel and in a fixed order per element, like swiglu.cpp (no SIMD variants: std::tanh
// and std::erf keep the results those of the C library on every machine).
#include <omp.h>

#include <cmath>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {
namespace {

template <class T>
inline void gelu_and_grad(T g, bool tanh_form, T* value, T* grad) {
  if (tanh_form) {
    const T k = T(0.7978845608028654), c = T(0.044715);
    const T t = std::tanh(k * (g + c * g * g * g));
    *value = T(0.5) * g * (T(1) + t);
    if (grad) *grad = T(0.5) * (T(1) + t) + T(0.5) * g * (T(1) - t * t) * k * (T(1) + T(3) * c * g * g);
  } else {
    const T e = std::erf(g * T(0.7071067811865476));
    *value = T(0.5) * g * (T(1) + e);
    if (grad) *grad = T(0.5) * (T(1) + e) + g * std::exp(T(-0.5) * g * g) * T(0.3989422804014327);
  }
}

}  // namespace

template <class T>
void geglu_fwd(T* h, int64_t ldh, const T* gate, int64_t ldg, const T* up, int64_t ldu, int64_t N,
               int64_t F, bool tanh_form) {
#pragma omp parallel for schedule(static) if (N * F > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const T* g = gate + n * ldg;
    const T* u = up + n * ldu;
    T* o = h + n * ldh;
    for (int64_t f = 0; f < F; ++f) {
      T v;
      gelu_and_grad<T>(g[f], tanh_form, &v, nullptr);
      o[f] = v * u[f];
    }
  }
}

template <class T>
void geglu_bwd(T* dgate, int64_t lddg, T* dup, int64_t lddu, const T* dh, int64_t lddh,
               const T* gate, int64_t ldg, const T* up, int64_t ldu, int64_t N, int64_t F,
               bool tanh_form) {
#pragma omp parallel for schedule(static) if (N * F > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const T* g = gate + n * ldg;
    const T* u = up + n * ldu;
    const T* d = dh + n * lddh;
    T* dg = dgate + n * lddg;
    T* du = dup + n * lddu;
    for (int64_t f = 0; f < F; ++f) {
      T v, gr;
      gelu_and_grad<T>(g[f], tanh_form, &v, &gr);
      const T df = d[f];
      dg[f] = df * u[f] * gr;
      du[f] = df * v;
    }
  }
}

template void geglu_fwd<float>(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                               int64_t, bool);
template void geglu_fwd<double>(double*, int64_t, const double*, int64_t, const double*, int64_t, int64_t,
                                int64_t, bool);
template void geglu_bwd<float>(float*, int64_t, float*, int64_t, const float*, int64_t, const float*, int64_t,
                               const float*, int64_t, int64_t, int64_t, bool);
template void geglu_bwd<double>(double*, int64_t, double*, int64_t, const double*, int64_t, const double*,
                                int64_t, const double*, int64_t, int64_t, int64_t, bool);

}  // namespace rlh::kcpu
