// The CUDA engine's own MoE kernels (cuda_engine_kernels.cu), apart from cuda_engine_impl.hpp
// because the .cu is compiled as C++17 and cannot include engine.hpp (C++20).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rlh::engine::cuda {

using bf16 = uint16_t;  // storage of __nv_bfloat16 (the .cpp files never do bf16 arithmetic)

// Kernels of the engine itself for the MoE layers (cuda_engine_kernels.cu).
// The fp64 router's GEMMs (MoeOptions::router_fp64), fp64 arithmetic on mixed operands:
// C[m, n] (=|+=) sum_k A(m, k) B(k, n) with A(m, k) = A[m sam + k sak], B(k, n) = B[k sbk + n sbn].
//   logits:  double z [N, E] = xn (bf16) Wr^T (fp32 master) + b (fp32, optional)
//   dx:      bf16 dxn [N, C] += float(dz (double) Wr (fp32))
//   dW:      fp32 gW [E, C] += float(dz^T (double) xn (bf16))
void f64_gemm_logits(const bf16* x, int64_t ldx, const float* W, const float* bias, double* z,
                     int64_t N, int64_t E, int64_t C, cudaStream_t s);
void f64_gemm_dx(const double* dz, const float* W, bf16* dx, int64_t N, int64_t E, int64_t C,
                 cudaStream_t s);
void f64_gemm_dw(const double* dz, const bf16* x, float* gW, int64_t N, int64_t E, int64_t C,
                 cudaStream_t s);
void f64_colsum_acc(const double* dz, float* gb, int64_t N, int64_t E, cudaStream_t s);
void f64_to_f32(const double* src, float* dst, int64_t n, cudaStream_t s);
// shift_to_outputs / shift_to_kernel (engine.hpp) of one [N] float column on the device, for a
// loss that runs there (cu: the micro-batch's int32 [S+1] offsets on the device).
void shift_to_outputs_device(const float* kernel, float* out, const int32_t* cu, int64_t S, int64_t N,
                             cudaStream_t s);
void shift_to_kernel_device(const float* out, float* kernel, const int32_t* cu, int64_t S, int64_t N,
                            cudaStream_t s);
void f32_to_f64(const float* src, double* dst, int64_t n, cudaStream_t s);
void iota_i32(int32_t* p, int64_t n, cudaStream_t s);

// The auxiliary losses of docs/engine.md (MoeOptions), on the device. mode 0 none, 1 aux_loss
// (the micro-batch as one segment, counts from offsets), 2 seq_aux_loss (per sequence of cu,
// counts from experts). Values (one block, fixed summation order) are added into stats[0]
// (load balancing) and stats[1] (z-loss); stats[2] = max(stats[2], the busiest expert's share).
// Gradients: dprobs [N, E] (when not null) and dlse [N] (when not null) are written.
struct MoeLossArgs {
  int64_t N = 0, S = 0, E = 0, K = 0;
  int mode = 0;
  double aux_coef = 0, z_coef = 0, tokens = 1, seqs = 1;  // global T and S
  const int32_t* experts = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* cu = nullptr;
};
template <class T>
void moe_loss_values(const MoeLossArgs& a, const T* probs, const T* lse, double* stats,
                     cudaStream_t s);
template <class T>
void moe_loss_grads(const MoeLossArgs& a, const T* lse, T* dprobs, T* dlse, cudaStream_t s);

}  // namespace rlh::engine::cuda
