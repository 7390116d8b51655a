// Tensor-core building blocks for the attention kernels (sm_80+ instructions, run on sm_90a):
// cp.async 16-byte copies into shared memory, ldmatrix, mma.sync m16n8k16 bf16 -> fp32, and the
// XOR swizzle of [rows][D] bf16 tiles (16-byte chunk c of row r lives at chunk c ^ (r & 7)),
// which makes ldmatrix and the cp.async stores bank-conflict free for D = 64 and 128.
#pragma once

#include "common.cuh"

namespace rlh::kcuda::mma {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; zero-filled when !pred (src is not read then).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// c += a (16x16, row) * b (16x8, col)
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x, the hardware approximation (the attention kernels' softmax: scale and log2 e folded into
// one multiply).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element offset of (row, col) in a swizzled [rows][D] tile; col a multiple of 8 for chunks.
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
  return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Copies rows [r0, r0 + ROWS) of a [*, D] bf16 matrix (row stride ld elements, head offset
// applied by the caller) into a swizzled tile; rows outside [0, rows_valid) are zero-filled.
template <int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* base, int64_t ld, int64_t r0,
                                          int64_t rows_end) {
  constexpr int CHUNKS = ROWS * D / 8;
#pragma unroll
  for (int i = threadIdx.x; i < CHUNKS; i += THREADS) {
    const int r = i / (D / 8), c = (i % (D / 8)) * 8;
    const int64_t gr = r0 + r;
    const bool ok = gr < rows_end && gr >= 0;
    cp_async16(tile + swz<D>(r, c), ok ? base + gr * ld + c : base, ok);
  }
}

// A fragment (16 rows x 16 cols at k0) of a swizzled row-major tile, rows r0..r0+15.
template <int D>
__device__ __forceinline__ void frag_a(uint32_t* a, const bf16* tile, int r0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(a, tile + swz<D>(r0 + (lane & 15), k0 + (lane >> 4) * 8));
}
// B fragments of two n-tiles (n0..n0+7, n0+8..n0+15) x k16 at k0 from a tile stored [n][k]
// (row-major over n: "col-major B"). b[0],b[1] -> n-tile n0; b[2],b[3] -> n-tile n0+8.
template <int D>
__device__ __forceinline__ void frag_b_nk(uint32_t* b, const bf16* tile, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(b, tile + swz<D>(n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 8));
}
// B fragments of two n-tiles (n0.., n0+8..) x k16 at k0 from a tile stored [k][n] (row-major
// over k), through ldmatrix.trans. b[0],b[1] -> n-tile n0; b[2],b[3] -> n-tile n0+8.
template <int D>
__device__ __forceinline__ void frag_b_kn(uint32_t* b, const bf16* tile, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4_t(b, tile + swz<D>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), n0 + (lane >> 4) * 8));
}

}  // namespace rlh::kcuda::mma
