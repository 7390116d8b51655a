// bias and residual: y += b, db += column sums of dy, y = a + b.
#include <omp.h>

#include <algorithm>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {

template <class T>
void bias_add_fwd(T* y, int64_t ldy, const T* b, int64_t N, int64_t M) {
#pragma omp parallel for schedule(static) if (N * M > 32768)
  for (int64_t n = 0; n < N; ++n) {
    T* yr = y + n * ldy;
#pragma omp simd
    for (int64_t m = 0; m < M; ++m) yr[m] += b[m];
  }
}

// Column bands per thread: each db element sums its rows in order, for any thread count.
template <class T>
void bias_bwd(T* db, const T* dy, int64_t lddy, int64_t N, int64_t M) {
  const int64_t band = 64, bands = (M + band - 1) / band;
#pragma omp parallel for schedule(static) if (N * M > 32768)
  for (int64_t bi = 0; bi < bands; ++bi) {
    const int64_t m0 = bi * band, m1 = std::min(M, m0 + band);
    T acc[64] = {};
    for (int64_t n = 0; n < N; ++n) {
      const T* d = dy + n * lddy;
#pragma omp simd
      for (int64_t m = m0; m < m1; ++m) acc[m - m0] += d[m];
    }
    for (int64_t m = m0; m < m1; ++m) db[m] += acc[m - m0];
  }
}

template <class T>
void add_fwd(T* y, const T* a, const T* b, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

template void bias_add_fwd<float>(float*, int64_t, const float*, int64_t, int64_t);
template void bias_add_fwd<double>(double*, int64_t, const double*, int64_t, int64_t);
template void bias_bwd<float>(float*, const float*, int64_t, int64_t, int64_t);
template void bias_bwd<double>(double*, const double*, int64_t, int64_t, int64_t);
template void add_fwd<float>(float*, const float*, const float*, int64_t);
template void add_fwd<double>(double*, const double*, const double*, int64_t);
}  // namespace rlh::kcpu
