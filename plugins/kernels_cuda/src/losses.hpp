// kernels_cuda's loss launchers (losses.cu), apart from kernels.hpp so that adding them leaves
// the other kernels' translation units alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace rlh::kcuda {

// Losses (losses.cu): clipped_pg_loss and nll_loss of docs/ops.md, fp32 operands (device
// pointers, token-aligned, cu_seqlens int32 [S+1] with cu_seqlens[S] == N), fp64 math, one
// block with fixed-order reductions. loss is [1]; metrics (nullable) receives
// rlhost/losses/loss_ops.hpp's metrics in order.
struct ClippedPgArgs {
  const float *lp = nullptr, *adv = nullptr, *gen = nullptr, *tm = nullptr, *sm = nullptr;
  const int32_t* cu = nullptr;
  const float* prev = nullptr;  // null with force_on_policy_ratio (mode 2)
  const float* ref = nullptr;   // null when beta == 0
  int64_t N = 0, S = 0;
  double g_tok = 0, g_seq = 0;
  bool token_level = true;
  int mode = 0;  // 0 PPO ratio, 2 force_on_policy_ratio, 3 disable_ppo_ratio
  double ratio_clip_min = 0.2, ratio_clip_max = 0.2, clip_c = 0;  // clip_c 0 = no dual clip
  double beta = 0;                                                 // the KL term's coefficient
  int kl_type = 3;                                                 // 1 k1, 2 k2, 3 k3
  double kl_in = 0, kl_out = 0;                                    // clamps, 0 = off
  bool on_policy_kl = false;
  bool use_is = false;
  int tis_type = 0;  // 0 none, 1 tis, 2 icepop, 3 seq-mask-tis
  double tis_hi = 0, tis_lo = 0;
  bool cispo = false;
  double constant_normalizer = 0;  // 0 = off
};
void clipped_pg_loss(const ClippedPgArgs& a, float* loss, float* dlp, float* metrics, cudaStream_t s);
void nll_loss(const float* lp, const float* tm, const float* sm, const int32_t* cu, int64_t N, int64_t S,
              double global_valid_toks, float* loss, float* dlp, float* metrics, cudaStream_t s);

}  // namespace rlh::kcuda
