// swiglu: h = silu(gate) * up and its backward.
//   sig = 1 / (1 + exp(-g)),  h = g * sig * u
//   dgate = dh * u * sig * (1 + g * (1 - sig)),  dup = dh * g * sig
#include <omp.h>

#include "rlhost/kernels_cpu/kernels.hpp"
#include "simd.hpp"  // exp_t, dispatch

namespace rlh::kcpu {
namespace {

template <class T>
RLH_KCPU_INLINE void swiglu_fwd_rows(T* h, int64_t ldh, const T* gate, int64_t ldg, const T* up,
                                     int64_t ldu, int64_t n0, int64_t n1, int64_t F) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* g = gate + n * ldg;
    const T* u = up + n * ldu;
    T* o = h + n * ldh;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) o[f] = g[f] / (T(1) + exp_t(-g[f])) * u[f];
  }
}

template <class T>
RLH_KCPU_INLINE void swiglu_bwd_rows(T* dgate, int64_t lddg, T* dup, int64_t lddu, const T* dh,
                                     int64_t lddh, const T* gate, int64_t ldg, const T* up,
                                     int64_t ldu, int64_t n0, int64_t n1, int64_t F) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* g = gate + n * ldg;
    const T* u = up + n * ldu;
    const T* d = dh + n * lddh;
    T* dg = dgate + n * lddg;
    T* du = dup + n * lddu;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const T sig = T(1) / (T(1) + exp_t(-g[f]));
      const T gf = g[f], uf = u[f], df = d[f];
      dg[f] = df * uf * sig * (T(1) + gf * (T(1) - sig));
      du[f] = df * gf * sig;
    }
  }
}

RLH_KCPU_MULTIVERSION(swiglu_fwd_f, swiglu_fwd_rows,
                      (float* h, int64_t ldh, const float* g, int64_t ldg, const float* u,
                       int64_t ldu, int64_t n0, int64_t n1, int64_t F),
                      (h, ldh, g, ldg, u, ldu, n0, n1, F))
RLH_KCPU_MULTIVERSION(swiglu_bwd_f, swiglu_bwd_rows,
                      (float* dg, int64_t lddg, float* du, int64_t lddu, const float* dh,
                       int64_t lddh, const float* g, int64_t ldg, const float* u, int64_t ldu,
                       int64_t n0, int64_t n1, int64_t F),
                      (dg, lddg, du, lddu, dh, lddh, g, ldg, u, ldu, n0, n1, F))

// Rows [n0, n1) of thread t out of nt.
inline void thread_rows(int64_t N, int64_t* n0, int64_t* n1) {
  const int t = omp_get_thread_num(), nt = omp_get_num_threads();
  *n0 = N * t / nt;
  *n1 = N * (t + 1) / nt;
}

}  // namespace

template <class T>
void swiglu_fwd(T* h, int64_t ldh, const T* gate, int64_t ldg, const T* up, int64_t ldu,
                int64_t N, int64_t F) {
#pragma omp parallel if (N * F > 16384)
  {
    int64_t n0, n1;
    thread_rows(N, &n0, &n1);
    if constexpr (std::is_same_v<T, float>) {
      swiglu_fwd_f_select()(h, ldh, gate, ldg, up, ldu, n0, n1, F);
    } else {
      swiglu_fwd_rows<T>(h, ldh, gate, ldg, up, ldu, n0, n1, F);
    }
  }
}

template <class T>
void swiglu_bwd(T* dgate, int64_t lddg, T* dup, int64_t lddu, const T* dh, int64_t lddh,
                const T* gate, int64_t ldg, const T* up, int64_t ldu, int64_t N, int64_t F) {
#pragma omp parallel if (N * F > 16384)
  {
    int64_t n0, n1;
    thread_rows(N, &n0, &n1);
    if constexpr (std::is_same_v<T, float>) {
      swiglu_bwd_f_select()(dgate, lddg, dup, lddu, dh, lddh, gate, ldg, up, ldu, n0, n1, F);
    } else {
      swiglu_bwd_rows<T>(dgate, lddg, dup, lddu, dh, lddh, gate, ldg, up, ldu, n0, n1, F);
    }
  }
}

template void swiglu_fwd<float>(float*, int64_t, const float*, int64_t, const float*, int64_t,
                                int64_t, int64_t);
template void swiglu_fwd<double>(double*, int64_t, const double*, int64_t, const double*, int64_t,
                                 int64_t, int64_t);
template void swiglu_bwd<float>(float*, int64_t, float*, int64_t, const float*, int64_t,
                                const float*, int64_t, const float*, int64_t, int64_t, int64_t);
template void swiglu_bwd<double>(double*, int64_t, double*, int64_t, const double*, int64_t,
                                 const double*, int64_t, const double*, int64_t, int64_t, int64_t);
}  // namespace rlh::kcpu
