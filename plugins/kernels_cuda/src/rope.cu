// rope: rotate the first R dims of every head; one thread per (token, pair), looping over the
// heads, so each angle's sin/cos is computed once per token (rope_kernel); aligned half-split
// rows take a 16-byte path (rope_vec_kernel). The angle is formed as HF forms it
// (float32 product of float32 inv_freq and float32 position); sin/cos are the precise
// (non-intrinsic) float32 functions.
#include "rope_math.cuh"

namespace rlh::kcuda {
namespace {

template <class T>
__global__ void rope_kernel(T* y, int64_t ldy, const T* x, int64_t ldx, const int32_t* pos,
                            const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R,
                            float scale, bool interleaved, float sign) {
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  const int64_t half = R / 2;
  const int64_t per_token = half + (D - R);  // pairs, then copied dims
  const int64_t total = N * per_token;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = idx / per_token, i = idx - n * per_token;
    if (i < half) {
      float c, s;
      rope_cos_sin(inv_freq, i, pos[n], scale, sign, c, s);
      const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
      for (int64_t h = 0; h < H; ++h) {
        const T* xr = x + n * ldx + h * D;
        T* yr = y + n * ldy + h * D;
        float ya, yb;
        rope_rotate(to_f(xr[a]), to_f(xr[b]), c, s, ya, yb);
        yr[a] = from_f<T>(ya);
        yr[b] = from_f<T>(yb);
      }
    } else if (x != y || ldx != ldy) {
      const int64_t d = R + (i - half);
      for (int64_t h = 0; h < H; ++h) y[n * ldy + h * D + d] = x[n * ldx + h * D + d];
    }
  }
}

// Vectorised half-split path: a block holds kTok tokens; their cos/sin (R/2 each) go to shared
// memory once, then each thread rotates VEC pairs of one head with 16-byte loads and stores.
constexpr int kTok = 4;

template <class T>
__global__ void __launch_bounds__(256)
rope_vec_kernel(T* y, int64_t ldy, const T* x, int64_t ldx, const int32_t* pos,
                const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, float scale,
                float sign) {
  // The angles come from the positions and the frequencies, which no kernel of a step writes
  // (the callers upload positions; docs/kernels_cuda.md "pdl_wait"): they are formed before
  // pdl_wait, while the product before finishes, and only x is read after it.
  constexpr int VEC = 16 / sizeof(T);
  extern __shared__ float cs_sh[];  // [kTok][R/2] cos, then [kTok][R/2] sin
  const int64_t half = R / 2;
  float* cs = cs_sh;
  float* sn = cs_sh + kTok * half;
  const int64_t n0 = int64_t(blockIdx.x) * kTok;
  for (int64_t i = threadIdx.x; i < kTok * half; i += blockDim.x) {
    const int64_t n = n0 + i / half;
    float c = 0.f, sv = 0.f;
    if (n < N) rope_cos_sin(inv_freq, i % half, pos[n], scale, sign, c, sv);
    cs[i] = c;
    sn[i] = sv;
  }
  pdl_wait();  // launched by launch_pdl (common.cuh)
  pdl_trigger();
  __syncthreads();
  const int64_t pair_chunks = half / VEC, copy_chunks = (x != y || ldx != ldy) ? (D - R) / VEC : 0;
  const int64_t per_token = H * (pair_chunks + copy_chunks);
  for (int64_t it = threadIdx.x; it < kTok * per_token; it += blockDim.x) {
    const int64_t tk = it / per_token, r = it - tk * per_token, n = n0 + tk;
    if (n >= N) break;
    const int64_t h = r / (pair_chunks + copy_chunks), c = r - h * (pair_chunks + copy_chunks);
    const T* xr = x + n * ldx + h * D;
    T* yr = y + n * ldy + h * D;
    if (c < pair_chunks) {
      const int64_t a = c * VEC, b = a + half;
      uint4 ua = *reinterpret_cast<const uint4*>(xr + a), ub = *reinterpret_cast<const uint4*>(xr + b);
      T* va = reinterpret_cast<T*>(&ua);
      T* vb = reinterpret_cast<T*>(&ub);
      const float* cr = cs + tk * half + a;
      const float* sr = sn + tk * half + a;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float ya, yb;
        rope_rotate(to_f(va[e]), to_f(vb[e]), cr[e], sr[e], ya, yb);
        va[e] = from_f<T>(ya);
        vb[e] = from_f<T>(yb);
      }
      *reinterpret_cast<uint4*>(yr + a) = ua;
      *reinterpret_cast<uint4*>(yr + b) = ub;
    } else {
      const int64_t d = R + (c - pair_chunks) * VEC;
      *reinterpret_cast<uint4*>(yr + d) = *reinterpret_cast<const uint4*>(xr + d);
    }
  }
}

template <class T>
bool rope_vec_ok(const void* y, int64_t ldy, const void* x, int64_t ldx, int64_t D, int64_t R,
                 bool interleaved) {
  constexpr int VEC = 16 / sizeof(T);
  return !interleaved && R >= 2 * VEC && (R / 2) % VEC == 0 && D % VEC == 0 && ldx % VEC == 0 &&
         ldy % VEC == 0 && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(y)) % 16 == 0) &&
         R / 2 <= 1024;
}

template <class T>
void rope_t(T* y, int64_t ldy, const T* x, int64_t ldx, const int32_t* pos, const float* inv_freq,
            int64_t N, int64_t H, int64_t D, int64_t R, float scale, bool interleaved, float sign,
            cudaStream_t s) {
  if (rope_vec_ok<T>(y, ldy, x, ldx, D, R, interleaved)) {
    const size_t smem = size_t(2 * kTok * (R / 2)) * sizeof(float);
    launch_pdl(rope_vec_kernel<T>, ceil_div(N, kTok), 256, smem, s, y, ldy, x, ldx, pos, inv_freq, N, H, D,
                                                            R, scale, sign);
    return;
  }
  const int64_t total = N * (R / 2 + (D - R));
  const unsigned grid = unsigned(std::min<int64_t>((total + 255) / 256, 132 * 32));
  launch_pdl(rope_kernel<T>, grid, 256, 0, s, y, ldy, x, ldx, pos, inv_freq, N, H, D, R, scale, interleaved, sign);
}

}  // namespace

void rope(DType t, void* y, int64_t ldy, const void* x, int64_t ldx, const int32_t* pos,
          const float* inv_freq, int64_t N, int64_t H, int64_t D, int64_t R, double scale,
          bool interleaved, bool inverse, cudaStream_t s) {
  if (R < 0 || R > D || R % 2) throw std::invalid_argument("rope: rotary dims must be even, <= D");
  if (N * H * D == 0) return;
  const float sign = inverse ? -1.f : 1.f;
  if (t == DType::f32)
    rope_t(static_cast<float*>(y), ldy, static_cast<const float*>(x), ldx, pos, inv_freq, N, H, D,
           R, float(scale), interleaved, sign, s);
  else
    rope_t(static_cast<bf16*>(y), ldy, static_cast<const bf16*>(x), ldx, pos, inv_freq, N, H, D, R,
           float(scale), interleaved, sign, s);
  check_launch("rope");
}

}  // namespace rlh::kcuda
