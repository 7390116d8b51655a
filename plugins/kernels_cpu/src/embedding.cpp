// embedding: rows of a table gathered by token id, and the scatter-add of their gradient.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {
namespace {
void check_ids(const int32_t* ids, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    if (ids[n] < 0 || ids[n] >= V)
      throw std::invalid_argument("embedding: id " + std::to_string(ids[n]) + " at " +
                                  std::to_string(n) + " outside [0, " + std::to_string(V) + ")");
}
}  // namespace

template <class T>
void embedding_fwd(T* out, const int32_t* ids, const T* table, int64_t N, int64_t C, int64_t V) {
  check_ids(ids, N, V);
#pragma omp parallel for schedule(static) if (N * C > 32768)
  for (int64_t n = 0; n < N; ++n) std::memcpy(out + n * C, table + ids[n] * C, C * sizeof(T));
}

// Threads own column bands, so repeated ids never race and every dtable element sums its rows
// in token order (deterministic for any thread count).
template <class T>
void embedding_bwd(T* dtable, const int32_t* ids, const T* dout, int64_t N, int64_t C, int64_t V) {
  check_ids(ids, N, V);
  const int64_t band = 64;
  const int64_t bands = (C + band - 1) / band;
#pragma omp parallel for schedule(static) if (N * C > 32768)
  for (int64_t b = 0; b < bands; ++b) {
    const int64_t c0 = b * band, c1 = std::min(C, c0 + band);
    for (int64_t n = 0; n < N; ++n) {
      T* dst = dtable + ids[n] * C;
      const T* src = dout + n * C;
      for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
    }
  }
}

template void embedding_fwd<float>(float*, const int32_t*, const float*, int64_t, int64_t, int64_t);
template void embedding_fwd<double>(double*, const int32_t*, const double*, int64_t, int64_t,
                                    int64_t);
template void embedding_bwd<float>(float*, const int32_t*, const float*, int64_t, int64_t, int64_t);
template void embedding_bwd<double>(double*, const int32_t*, const double*, int64_t, int64_t,
                                    int64_t);
}  // namespace rlh::kcpu
