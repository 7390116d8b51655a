// Attention on cuDNN's fused flash-attention engines, through the backend graph API: the
// forward and backward graphs the cuDNN frontend's composite SDPA nodes lower to (bmm, scale,
// padding mask from per-sequence lengths, causal top-left mask, sliding-window left bound,
// softmax with its statistics, bmm; and the backward chain), over packed (THD) operands with
// ragged offsets, one plan per shape signature.
//
// Layout choices (docs/kernels_cudnn.md): q, k, v, o and their gradients are [N, H, D] slices
// with any row stride (a multiple of 8); the batch is the contract's sequences, padded with
// empty ones up to a power of two, and the "max sequence length" of the plan is the token count
// N rounded up to a quarter octave, so a plan serves every packing of about that many tokens.
// cuDNN's statistics are packed [N, H] and converted to and from the contract's lse [H, N].
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "backend_graph.hpp"

namespace rlh::kcudnn {

// One attention call's operands (device pointers, row strides in elements).
struct AttnCall {
  int64_t N = 0, S = 0, Hq = 0, Hkv = 0, D = 0, window = 0;
  float scale = 1;
  const int32_t* cu = nullptr;
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t ldq = 0, ldk = 0, ldv = 0;
  void* o = nullptr;  // forward output, backward input
  int64_t ldo = 0;
  float* lse = nullptr;  // [Hq, N]: forward output, backward input
  // backward
  const void* dout = nullptr;
  int64_t lddo = 0;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  int64_t lddq = 0, lddk = 0, lddv = 0;
};

// What a plan is built for.
struct PlanKey {
  bool backward = false;
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0, window = 0;
  int64_t ldq = 0, ldk = 0, ldv = 0, ldo = 0, lddo = 0, lddq = 0, lddk = 0, lddv = 0;
  auto tie() const {
    return std::tie(backward, B, T, Hq, Hkv, D, window, ldq, ldk, ldv, ldo, lddo, lddq, lddk, lddv);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct SdpaPlan;  // sdpa.cpp

// Builds (and finalizes) the operations of one key's graph without a device or a handle; the
// number of operations. What a machine without a GPU can check of the graphs (tests).
size_t build_graph_operations(const PlanKey& k, size_t cudnn_version);

// The plans of one provider instance (one device, one cuDNN handle). Thread-safe.
class SdpaEngine {
 public:
  SdpaEngine(const CudnnLib& lib, cudnnHandle_t handle);
  ~SdpaEngine();

  // Operands cuDNN cannot take (head dims, strides, GQA ratio): the reason, or "".
  static std::string unsupported(int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv, const int64_t* lds, int n);

  // Builds (or finds) the plan a call with these sizes needs; throws CudnnError when cuDNN
  // cannot build it. Used at resolution to refuse what this cuDNN cannot run.
  void prepare(const AttnCall& c, bool backward);
  // Scratch bytes a call needs (plan workspace + ragged offsets + statistics + backward
  // accumulators), building the plan if needed.
  size_t workspace_bytes(const AttnCall& c, bool backward);
  // Runs the call on `stream` with `workspace` (at least workspace_bytes, 256-byte aligned).
  void forward(const AttnCall& c, void* workspace, cudaStream_t stream);
  void backward(const AttnCall& c, void* workspace, cudaStream_t stream);
  // The chosen engines report no NONDETERMINISTIC note (forward plans built so far).
  bool forward_deterministic() const;

 private:
  struct Layout;
  // Candidate configs timed at a plan's first call (sdpa.cpp's tune); a pick must beat the first
  // by kTuneMargin.
  static constexpr int kTuneCandidates = 6;
  static constexpr float kTuneMargin = 1.03f;
  static int tune_mode();
  void tune(SdpaPlan& p, const PlanKey& k, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs,
            void* workspace, cudaStream_t stream);
  PlanKey key_of(const AttnCall& c, bool backward) const;
  SdpaPlan& plan_for(const PlanKey& k);
  Layout layout(const AttnCall& c, const PlanKey& k, const SdpaPlan& p) const;

  const CudnnLib& lib_;
  cudnnHandle_t handle_;
  mutable std::mutex mu_;  // the plan cache and the handle's stream
  std::map<PlanKey, std::unique_ptr<SdpaPlan>> plans_;
};

}  // namespace rlh::kcudnn
