// kernels_cpu's plugin internals shared by its op files (plugin.cpp, ops_decode.cpp): the
// instance and op handles behind the C ABI, one call's operands and attributes, the operand
// checks, the op table's entry, and the op functions a file other than plugin.cpp defines.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/kernels_cpu/kernels.hpp"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "worker_pool.hpp"

namespace rlh::kcpu {

using sdk::Error;

// ---------------------------------------------------------------------------------------------
// Instances, ops, attributes

struct Attr {
  std::string name;
  int32_t type = RLH_VALUE_INT64;
  int64_t i = 0;
  double d = 0;
};

struct OpSpec;

}  // namespace rlh::kcpu

// Scratch blocks a call needed beyond the caller's workspace, kept for the next call of the same
// size (every training step asks for the same sizes: a 32 MiB head tile is not mapped and
// page-faulted again on every call). Drawn from the host's allocator, which counts them as live
// while the instance keeps them.
struct ScratchBlocks {
  std::mutex mu;
  std::vector<std::pair<size_t, void*>> free;  // (bytes, block)
};

struct rlh_kernels {
  const rlh_host_api* host = nullptr;
  rlh_device device{};
  ScratchBlocks scratch;
  // Threads of the decode-sized ops (batch-invariant gemm, paged attention, sampling): the
  // instance's own pool when created with {"num_threads": N}, else the process-wide one.
  std::unique_ptr<rlh::kcpu::WorkerPool> own_pool;
  rlh::kcpu::WorkerPool& pool() { return own_pool ? *own_pool : rlh::kcpu::WorkerPool::current(); }
  ~rlh_kernels() {
    for (auto& [bytes, p] : scratch.free) {
      if (host && host->free_memory) host->free_memory(host->ctx, device, p);
      else std::free(p);
    }
  }
};

struct rlh_op {
  const rlh::kcpu::OpSpec* spec = nullptr;
  bool f64 = false;
  std::vector<rlh::kcpu::Attr> attrs;  // the desc's, copied (its strings are borrowed)
  rlh_kernels* inst = nullptr;
};

namespace rlh::kcpu {

// One call's operands and attributes (call attributes refine the desc's).
struct Call {
  const rlh_op* op;
  const rlh_op_call* call;
  Scratch scratch;

  const rlh_tensor& in(size_t i) const { return call->inputs[i]; }
  const rlh_tensor& out(size_t i) const { return call->outputs[i]; }
  bool has_in(size_t i) const { return i < call->num_inputs && call->inputs[i].data; }
  bool has_out(size_t i) const { return i < call->num_outputs && call->outputs[i].data; }

  const rlh_named_value* call_attr(const char* name) const {
    return sdk::find_attr(call->attrs, call->num_attrs, name);
  }
  double num(const char* name, double fallback) const {
    if (const rlh_named_value* a = call_attr(name))
      return a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value);
    for (auto it = op->attrs.rbegin(); it != op->attrs.rend(); ++it)
      if (it->name == name) return it->type == RLH_VALUE_DOUBLE ? it->d : double(it->i);
    return fallback;
  }
  int64_t integer(const char* name, int64_t fallback) const {
    return int64_t(num(name, double(fallback)));
  }
  bool flag(const char* name) const { return num(name, 0) != 0; }
};

// ---------------------------------------------------------------------------------------------
// Tensor checks

[[noreturn]] inline void bad(const std::string& what) { throw Error(RLH_E_INVALID_ARGUMENT, what); }

template <class T>
T* data(const rlh_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}

// Operand checks shared with every provider (rlhost/sdk/kernels.hpp).
using sdk::need_heads;
using sdk::need_rows;
using sdk::need_vec;
inline int64_t numel(const rlh_tensor& t) { return sdk::tensor_numel(t); }

// Soft-capping (Gemma-2): the "softcap" attribute, 0 = none; a negative or non-finite one is an
// error.
inline double softcap_of(const Call& c) {
  const double cap = c.num("softcap", 0);
  if (!(cap >= 0) || !std::isfinite(cap)) bad("softcap must be a finite number >= 0, got " + std::to_string(cap));
  return cap;
}

struct OpSpec {
  const char* name;
  const char* inputs;   // one Kind letter per input (plugin.cpp: f, i, k, d, b, q)
  size_t min_inputs;    // inputs beyond min_inputs are optional (trailing)
  const char* outputs;
  size_t min_outputs;
  const char* backward;  // "" when the backward is other ops
  bool f64;
  void (*run32)(const Call&);
  void (*run64)(const Call&);
};

// Ops defined outside plugin.cpp (T = float or double; instantiated where defined).
template <class T> void run_rope(const Call& c, bool backward);  // plugin.cpp
template <class T> void run_kv_cache_write(const Call& c);        // ops_decode.cpp
template <class T> void run_rope_kv_cache_write(const Call& c);
template <class T> void run_paged_attention(const Call& c);
template <class T> void run_decode_layer_fwd(const Call& c);
template <class T> void run_sample(const Call& c);

}  // namespace rlh::kcpu
