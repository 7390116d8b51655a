// rmsnorm: y = x / sqrt(mean(x^2) + eps) * (w + w_offset), and its backward.
//
// Backward, with r = rstd and w' = w + w_offset for one row:
//   dx_i = r * w'_i * dy_i - x_i * r^3 / C * sum_j dy_j * w'_j * x_j
//   dw_i += dy_i * x_i * r            (summed over rows)
// dw is computed column-parallel first (each dw element sums its rows in order: deterministic
// for any thread count, no per-thread partial buffers), then dx row-parallel, so dx may be dy.
#include <omp.h>

#include <algorithm>
#include <cmath>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {

template <class T>
void rmsnorm_fwd(T* y, int64_t ldy, T* rstd, const T* x, int64_t ldx, const T* w, int64_t N,
                 int64_t C, T eps, T w_offset) {
#pragma omp parallel for schedule(static) if (N * C > 32768)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * ldx;
    T* yr = y + n * ldy;
    T ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
    const T r = T(1) / std::sqrt(ss / T(C) + eps);
    if (rstd) rstd[n] = r;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * r * (w[c] + w_offset);
  }
}

template <class T>
void rmsnorm_bwd(T* dx, int64_t lddx, T* dw, const T* dy, int64_t lddy, const T* x, int64_t ldx,
                 const T* w, const T* rstd, int64_t N, int64_t C, T w_offset, bool accumulate) {
  // dw first: dx may overwrite dy (in place).
  if (dw) {
    const int64_t band = 64, bands = (C + band - 1) / band;
#pragma omp parallel for schedule(static) if (N * C > 32768)
    for (int64_t b = 0; b < bands; ++b) {
      const int64_t c0 = b * band, c1 = std::min(C, c0 + band);
      T acc[64] = {};
      for (int64_t n = 0; n < N; ++n) {
        const T* xr = x + n * ldx;
        const T* dyr = dy + n * lddy;
        const T r = rstd[n];
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) acc[c - c0] += dyr[c] * xr[c] * r;
      }
      for (int64_t c = c0; c < c1; ++c) dw[c] += acc[c - c0];
    }
  }
#pragma omp parallel for schedule(static) if (N * C > 32768)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * ldx;
    const T* dyr = dy + n * lddy;
    T* dxr = dx + n * lddx;
    const T r = rstd[n];
    T dot = 0;  // sum_j dy_j * w'_j * x_j
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < C; ++c) dot += dyr[c] * (w[c] + w_offset) * xr[c];
    const T k = dot * r * r * r / T(C);
    if (accumulate) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dxr[c] += r * (w[c] + w_offset) * dyr[c] - xr[c] * k;
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dxr[c] = r * (w[c] + w_offset) * dyr[c] - xr[c] * k;
    }
  }
}

template void rmsnorm_fwd<float>(float*, int64_t, float*, const float*, int64_t, const float*,
                                 int64_t, int64_t, float, float);
template void rmsnorm_fwd<double>(double*, int64_t, double*, const double*, int64_t,
                                  const double*, int64_t, int64_t, double, double);
template void rmsnorm_bwd<float>(float*, int64_t, float*, const float*, int64_t, const float*,
                                 int64_t, const float*, const float*, int64_t, int64_t, float, bool);
template void rmsnorm_bwd<double>(double*, int64_t, double*, const double*, int64_t,
                                  const double*, int64_t, const double*, const double*, int64_t,
                                  int64_t, double, bool);
}  // namespace rlh::kcpu
