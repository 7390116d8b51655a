// What kernels_cuda's op entry points share (plugin.cpp, ops_layers.cpp, ops_decode.cpp,
// ops_moe.cpp): an instance and a resolved op as the C ABI sees them, one call's operands and
// attributes, its workspace, and the entry points the op table names.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "losses.hpp"
#include "rlhost/kernels.h"
#include "rlhost/kernels_cuda/kernels.hpp"
#include "rlhost/losses/loss_ops.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::kcuda {

using sdk::Error;

struct Attr {
  std::string name;
  int32_t type = RLH_VALUE_INT64;
  int64_t i = 0;
  double d = 0;
};

struct OpSpec;  // plugin.cpp's op table

}  // namespace rlh::kcuda

struct rlh_kernels {
  const rlh_host_api* host = nullptr;
  rlh_device device{};
  rlh::kcuda::DeviceInfo info;
  rlh::kcuda::GemmEngine* gemm = nullptr;
  cudaMemPool_t pool = nullptr;
  int* err = nullptr;  // device flag: an id or target out of range
  bool check = false;
};

struct rlh_op {
  const rlh::kcuda::OpSpec* spec = nullptr;
  rlh::kcuda::DType dt = rlh::kcuda::DType::f32;
  std::vector<rlh::kcuda::Attr> attrs;
  rlh_kernels* inst = nullptr;
  // decode_layer_fwd's grid barrier: 256 bytes of device memory, zeroed at resolution, the op's
  // own (so calls of one op handle are stream-ordered); they carry state from launch to launch
  // (the barrier's generation or arrival count, the claim counters' parity sets: kernels.hpp)
  unsigned* sync = nullptr;
  ~rlh_op() {
    if (sync) cudaFree(sync);
  }
};

namespace rlh::kcuda {

[[noreturn]] inline void bad(const std::string& what) { throw Error(RLH_E_INVALID_ARGUMENT, what); }

inline void cuda_ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(RLH_E_INTERNAL, std::string("kernels_cuda ") + what + ": " + cudaGetErrorString(e));
}

// ---------------------------------------------------------------------------------------------
// Workspace: the caller's arena first, then the instance's stream-ordered pool.

class CallWorkspace final : public Workspace {
 public:
  CallWorkspace(rlh_kernels* inst, void* base, size_t size, cudaStream_t s)
      : inst_(inst), base_(static_cast<char*>(base)), size_(base ? size : 0), s_(s) {}
  ~CallWorkspace() override {
    for (void* p : owned_) cudaFreeAsync(p, s_);
  }
  void* get(size_t bytes) override {
    const size_t need = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    const size_t start = (used_ + 255) / 256 * 256;
    if (base_ && reinterpret_cast<uintptr_t>(base_) % 256 == 0 && start + need <= size_) {
      used_ = start + need;
      return base_ + start;
    }
    void* p = nullptr;
    const cudaError_t e = cudaMallocFromPoolAsync(&p, need, inst_->pool, s_);
    if (e != cudaSuccess)
      throw Error(RLH_E_RESOURCE_EXHAUSTED, "kernels_cuda workspace of " + std::to_string(bytes) +
                                                " bytes: " + cudaGetErrorString(e));
    owned_.push_back(p);
    return p;
  }

 private:
  rlh_kernels* inst_;
  char* base_;
  size_t size_, used_ = 0;
  cudaStream_t s_;
  std::vector<void*> owned_;
};

// ---------------------------------------------------------------------------------------------
// One call's operands and attributes.

struct Call {
  const rlh_op* op;
  const rlh_op_call* call;
  CallWorkspace* ws;
  cudaStream_t stream;

  const rlh_tensor& in(size_t i) const { return call->inputs[i]; }
  const rlh_tensor& out(size_t i) const { return call->outputs[i]; }
  bool has_in(size_t i) const { return i < call->num_inputs && call->inputs[i].data; }
  bool has_out(size_t i) const { return i < call->num_outputs && call->outputs[i].data; }
  size_t nin() const { return call->num_inputs; }
  size_t nout() const { return call->num_outputs; }

  double num(const char* name, double fallback) const {
    if (const rlh_named_value* a = sdk::find_attr(call->attrs, call->num_attrs, name))
      return a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value);
    for (auto it = op->attrs.rbegin(); it != op->attrs.rend(); ++it)
      if (it->name == name) return it->type == RLH_VALUE_DOUBLE ? it->d : double(it->i);
    return fallback;
  }
  int64_t integer(const char* name, int64_t fallback) const { return int64_t(num(name, double(fallback))); }
  bool flag(const char* name) const { return num(name, 0) != 0; }
  DType dt() const { return op->dt; }
  int* err() const { return op->inst->err; }
};

template <class T = void>
inline T* ptr(const rlh_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}
inline bool is_bf16(const rlh_tensor& t) { return t.dtype.code == RLH_DTYPE_BFLOAT; }
inline Flex flex(const rlh_tensor& t) { return Flex{ptr(t), is_bf16(t)}; }
inline Flex flex_opt_in(const Call& c, size_t i) { return c.has_in(i) ? flex(c.in(i)) : Flex{}; }

// Operand checks shared with every provider (rlhost/sdk/kernels.hpp).
using sdk::need_heads;
using sdk::need_rows;
using sdk::need_vec;
inline int64_t numel(const rlh_tensor& t) { return sdk::tensor_numel(t); }


// ---------------------------------------------------------------------------------------------
// The op table's entry points, by file.

// ops_layers.cpp
void run_gemm(const Call& c);
void run_gemm_glu_fwd(const Call& c);
void run_rmsnorm_gemm_fwd(const Call& c);
void run_gemm_add_fwd(const Call& c);
void run_embedding_fwd(const Call& c);
void run_embedding_bwd(const Call& c);
void run_rmsnorm_fwd(const Call& c);
void run_add_rmsnorm_fwd(const Call& c);
void run_rmsnorm_bwd(const Call& c);
void run_rope_fwd(const Call& c);
void run_rope_bwd(const Call& c);
void run_attention_fwd(const Call& c);
void run_attention_bwd(const Call& c);
void run_swiglu_fwd(const Call& c);
void run_geglu_fwd(const Call& c);
void run_geglu_bwd(const Call& c);
void run_swiglu_bwd(const Call& c);
void run_bias_add_fwd(const Call& c);
void run_bias_bwd(const Call& c);
void run_add_fwd(const Call& c);
void run_linear_logprob_fwd(const Call& c);
void run_linear_logprob_bwd(const Call& c);
void run_adamw(const Call& c);
void run_adamw_bf16(const Call& c);
losses::ClippedPGConfig loss_config(const Call& c, losses::LossCounts* n);
void run_clipped_pg_loss(const Call& c);
void run_nll_loss(const Call& c);
std::string loss_op_refusal(const losses::ClippedPGConfig& cfg);
void run_sumsq(const Call& c);
void run_scale(const Call& c);
// ops_decode.cpp
void run_kv_cache_write(const Call& c);
void run_rope_kv_cache_write(const Call& c);
void run_paged_attention(const Call& c);
void run_decode_layer_fwd(const Call& c);
// decode_layer_fwd's sizes at resolution: empty when kernels_cuda runs them, else what it lacks.
std::string decode_layer_shape_refusal(const rlh_tensor* in, size_t nin, const rlh_tensor* out, size_t nout);
void run_sample(const Call& c);
// ops_moe.cpp
void run_moe_router_fwd(const Call& c);
void run_moe_router_bwd(const Call& c);
void run_moe_permute_fwd(const Call& c);
void run_moe_permute_bwd(const Call& c);
void run_moe_unpermute_fwd(const Call& c);
void run_moe_unpermute_bwd(const Call& c);
void run_grouped_gemm(const Call& c);

}  // namespace rlh::kcuda
