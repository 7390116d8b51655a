// rope: rotary position embedding over the first R dims of each head, and its transpose.
//
// cos/sin are formed the way Hugging Face forms them, so the reference's rounding is matched:
// angle = float32(inv_freq) * float32(position) rounded to float32 (HF computes the freqs in
// float32 even for a float64 model), then cos/sin of that angle times the attention scaling.
// They are computed once per token and reused by every head.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "rlhost/kernels_cpu/kernels.hpp"

namespace rlh::kcpu {
namespace {

template <class T>
void rope_apply(T* y, int64_t ldy, const T* x, int64_t ldx, const int32_t* pos,
                const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
                bool interleaved, bool inverse) {
  if (R < 0 || R > D || R % 2) throw std::invalid_argument("rope: rotary dims must be even, <= D");
  const int64_t half = R / 2;
#pragma omp parallel if (N * H * D > 32768)
  {
    std::vector<T> cs(2 * half);  // cos, sin of this token
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = inv_freq[i] * float(pos[n]);
        cs[i] = T(std::cos(double(angle)) * scale);
        cs[half + i] = T(std::sin(double(angle)) * scale) * (inverse ? T(-1) : T(1));
      }
      const T* c = cs.data();
      const T* s = cs.data() + half;
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = x + n * ldx + h * D;
        T* yr = y + n * ldy + h * D;
        if (interleaved) {
          for (int64_t i = 0; i < half; ++i) {
            const T a = xr[2 * i], b = xr[2 * i + 1];
            yr[2 * i] = a * c[i] - b * s[i];
            yr[2 * i + 1] = b * c[i] + a * s[i];
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const T a = xr[i], b = xr[i + half];
            yr[i] = a * c[i] - b * s[i];
            yr[i + half] = b * c[i] + a * s[i];
          }
        }
        if (yr != xr && R < D) std::memcpy(yr + R, xr + R, (D - R) * sizeof(T));
      }
    }
  }
}

}  // namespace

template <class T>
void rope_fwd(T* y, int64_t ldy, const T* x, int64_t ldx, const int32_t* pos,
              const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
              bool interleaved) {
  rope_apply(y, ldy, x, ldx, pos, inv_freq, N, H, D, R, scale, interleaved, false);
}

// The rotation matrix is [[c, -s], [s, c]] * scale; its transpose is the same with -s.
template <class T>
void rope_bwd(T* dx, int64_t lddx, const T* dy, int64_t lddy, const int32_t* pos,
              const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
              bool interleaved) {
  rope_apply(dx, lddx, dy, lddy, pos, inv_freq, N, H, D, R, scale, interleaved, true);
}

template void rope_fwd<float>(float*, int64_t, const float*, int64_t, const int32_t*, const float*,
                              int64_t, int64_t, int64_t, int64_t, double, bool);
template void rope_fwd<double>(double*, int64_t, const double*, int64_t, const int32_t*,
                               const float*, int64_t, int64_t, int64_t, int64_t, double, bool);
template void rope_bwd<float>(float*, int64_t, const float*, int64_t, const int32_t*, const float*,
                              int64_t, int64_t, int64_t, int64_t, double, bool);
template void rope_bwd<double>(double*, int64_t, const double*, int64_t, const int32_t*,
                               const float*, int64_t, int64_t, int64_t, int64_t, double, bool);
}  // namespace rlh::kcpu
