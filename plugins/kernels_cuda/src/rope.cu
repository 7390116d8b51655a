// rope: rotate the first R dims of every head; one thread per (token, pair), looping over the
// heads, so each angle's sin/cos is computed once per token. The angle is formed as HF forms it
// (float32 product of float32 inv_freq and float32 position); sin/cos are the precise
// (non-intrinsic) float32 functions.
#include "common.cuh"

namespace rlh::kcuda {
namespace {

template <class T>
__global__ void rope_kernel(T* y, int64_t ldy, const T* x, int64_t ldx, const int32_t* pos,
                            const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R,
                            float scale, bool interleaved, float sign) {
  const int64_t half = R / 2;
  const int64_t per_token = half + (D - R);  // pairs, then copied dims
  const int64_t total = N * per_token;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = idx / per_token, i = idx - n * per_token;
    if (i < half) {
      const float angle = __fmul_rn(inv_freq[i], float(pos[n]));
      float sn, cs;
      sincosf(angle, &sn, &cs);
      const float c = cs * scale, s = sn * scale * sign;
      const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = x + n * ldx + h * D;
        T* yr = y + n * ldy + h * D;
        const float xa = to_f(xr[a]), xb = to_f(xr[b]);
        yr[a] = from_f<T>(xa * c - xb * s);
        yr[b] = from_f<T>(xb * c + xa * s);
      }
    } else if (x != y || ldx != ldy) {
      const int64_t d = R + (i - half);
      for (int64_t h = 0; h < H; ++h) y[n * ldy + h * D + d] = x[n * ldx + h * D + d];
    }
  }
}

}  // namespace

void rope(DType t, void* y, int64_t ldy, const void* x, int64_t ldx, const int32_t* pos,
          const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
          bool interleaved, bool inverse, cudaStream_t s) {
  if (R < 0 || R > D || R % 2) throw std::invalid_argument("rope: rotary dims must be even, <= D");
  const int64_t total = N * (R / 2 + (D - R));
  if (total == 0) return;
  const unsigned grid = unsigned(std::min<int64_t>((total + 255) / 256, 132 * 32));
  const float sign = inverse ? -1.f : 1.f;
  if (t == DType::f32)
    rope_kernel<<<grid, 256, 0, s>>>(static_cast<float*>(y), ldy, static_cast<const float*>(x), ldx,
                                     pos, inv_freq, N, H, D, R, float(scale), interleaved, sign);
  else
    rope_kernel<<<grid, 256, 0, s>>>(static_cast<bf16*>(y), ldy, static_cast<const bf16*>(x), ldx,
                                     pos, inv_freq, N, H, D, R, float(scale), interleaved, sign);
  check_launch("rope");
}

}  // namespace rlh::kcuda
