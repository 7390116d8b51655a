// The kernels_cudnn plugin: attention_fwd and attention_bwd (docs/ops.md) on CUDA devices through
// cuDNN's fused flash-attention engines (sdpa.hpp), behind the C ABI's KERNELS component. What it
// offers, refuses and why: docs/kernels_cudnn.md.
//
// Operands: bf16 q, k, v, o (and gradients) as [N, H, D] slices with any row stride that is a
// multiple of 8 (q|k|v read straight out of the fused projection), f32 lse [Hq, N], int32
// cu_seqlens [S + 1], all in the instance's device memory. Work is queued on
// rlh_op_call.stream; nothing synchronises with the host. Scratch comes from
// rlh_op_call.workspace when the caller passes at least workspace_size() bytes, else from a
// stream-ordered pool of the instance (cudaMallocFromPoolAsync / cudaFreeAsync).
//
// libcudnn.so.9 is loaded when an instance is created (cudnn_lib.hpp): the plugin loads, lists
// its ops and probes on a machine without a GPU or cuDNN, and create() says why it cannot run.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cudnn_lib.hpp"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/plugin.hpp"
#include "sdpa.hpp"

struct rlh_kernels {
  const rlh_host_api* host = nullptr;
  rlh_device device{};
  cudnnHandle_t handle = nullptr;
  cudaMemPool_t pool = nullptr;
  std::unique_ptr<rlh::kcudnn::SdpaEngine> sdpa;
};

struct rlh_op {
  bool backward = false;
  rlh_kernels* inst = nullptr;
  double scale = NAN;   // resolution defaults (a call's attributes override them)
  int64_t window = 0;
  bool has_scale = false, has_window = false;
};

namespace rlh::kcudnn {
namespace {

using sdk::Error;

sdk::MakeStatusFn g_make_status = nullptr;

[[noreturn]] void bad(const std::string& what) { throw Error(RLH_E_INVALID_ARGUMENT, what); }

void cuda_ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(RLH_E_INTERNAL, std::string("kernels_cudnn ") + what + ": " + cudaGetErrorString(e));
}

// Runs f with the instance's device current, restoring the caller's after.
template <class F>
void on_device(const rlh_kernels* k, F&& f) {
  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != k->device.device_id) cuda_ck(cudaSetDevice(k->device.device_id), "set device");
  struct Restore {
    int prev, dev;
    ~Restore() {
      if (prev >= 0 && prev != dev) cudaSetDevice(prev);
    }
  } restore{prev, k->device.device_id};
  f();
}

bool same(rlh_dtype a, rlh_dtype b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }
template <class T = void>
T* ptr(const rlh_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}

// ---------------------------------------------------------------------------------------------
// Operands: attention_fwd q, k, v, cu_seqlens -> o, lse; attention_bwd dout, q, k, v, o, lse,
// cu_seqlens -> dq, dk, dv (docs/ops.md).

constexpr const char* kOpName[2] = {"attention_fwd", "attention_bwd"};

// Counts, devices and dtypes (what resolution and every run check): UNIMPLEMENTED naming why.
void check_operands(bool bwd, const rlh_kernels* inst, const rlh_tensor* ins, size_t nin, const rlh_tensor* outs,
                    size_t nout) {
  const char* name = kOpName[bwd];
  auto unimpl = [&](const std::string& why) {
    throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cudnn ") + name + ": " + why);
  };
  // Kinds: b = bf16, f = f32, i = int32.
  const char* in_kinds = bwd ? "bbbbbfi" : "bbbi";
  const char* out_kinds = bwd ? "bbb" : "bf";
  if (nin != std::strlen(in_kinds)) unimpl("expects " + std::to_string(std::strlen(in_kinds)) + " inputs");
  if (nout != std::strlen(out_kinds)) unimpl("expects " + std::to_string(std::strlen(out_kinds)) + " outputs");
  auto visit = [&](const rlh_tensor& t, char kind) {
    const int dev = t.device.device_type;
    if ((dev != RLH_DEVICE_CUDA && dev != RLH_DEVICE_CUDA_MANAGED) || t.device.device_id != inst->device.device_id)
      unimpl("operands must be in CUDA memory of cuda:" + std::to_string(inst->device.device_id));
    const rlh_dtype want = kind == 'b' ? sdk::kBF16 : kind == 'f' ? sdk::kF32 : sdk::kI32;
    if (!same(t.dtype, want))
      unimpl(std::string(kind == 'b'   ? "q, k, v, o and their gradients must be bfloat16"
                         : kind == 'f' ? "lse must be float32"
                                       : "cu_seqlens must be int32") +
             " (got " + sdk::dtype_name(t.dtype) + ")");
  };
  for (size_t i = 0; i < nin; ++i) visit(ins[i], in_kinds[i]);
  for (size_t i = 0; i < nout; ++i) visit(outs[i], out_kinds[i]);
}

// The call's operands as an AttnCall (shape and layout checks: INVALID_ARGUMENT naming the operand).
AttnCall read_call(bool bwd, const rlh_tensor* ins, const rlh_tensor* outs, double scale, int64_t window) {
  const rlh_tensor& q = ins[bwd ? 1 : 0];
  const rlh_tensor& k = ins[bwd ? 2 : 1];
  const rlh_tensor& v = ins[bwd ? 3 : 2];
  const rlh_tensor& cu = ins[bwd ? 6 : 3];
  if (q.ndim != 3 || k.ndim != 3 || v.ndim != 3) bad("attention: q, k, v must be [N, H, D]");
  AttnCall c;
  c.N = q.shape[0];
  c.Hq = q.shape[1];
  c.Hkv = k.shape[1];
  c.D = q.shape[2];
  const int64_t Dv = v.shape[2];
  c.S = sdk::tensor_numel(cu) - 1;
  if (c.S < 0) bad("attention cu_seqlens: must have S + 1 >= 1 elements");
  sdk::need_vec(cu, c.S + 1, "attention cu_seqlens");
  c.cu = ptr<int32_t>(cu);
  c.ldq = sdk::need_heads(q, c.N, c.Hq, c.D, "attention q");
  c.ldk = sdk::need_heads(k, c.N, c.Hkv, c.D, "attention k");
  c.ldv = sdk::need_heads(v, c.N, c.Hkv, Dv, "attention v");
  c.q = ptr(q);
  c.k = ptr(k);
  c.v = ptr(v);
  c.scale = float(std::isnan(scale) ? 1.0 / std::sqrt(double(c.D)) : scale);
  c.window = window;
  if (!bwd) {
    c.ldo = sdk::need_heads(outs[0], c.N, c.Hq, Dv, "attention_fwd o");
    c.o = ptr(outs[0]);
    sdk::need_vec(outs[1], c.Hq * c.N, "attention_fwd lse");
    c.lse = ptr<float>(outs[1]);
  } else {
    c.lddo = sdk::need_heads(ins[0], c.N, c.Hq, Dv, "attention_bwd dout");
    c.dout = ptr(ins[0]);
    c.ldo = sdk::need_heads(ins[4], c.N, c.Hq, Dv, "attention_bwd o");
    c.o = ptr(ins[4]);
    sdk::need_vec(ins[5], c.Hq * c.N, "attention_bwd lse");
    c.lse = ptr<float>(ins[5]);
    c.lddq = sdk::need_heads(outs[0], c.N, c.Hq, c.D, "attention_bwd dq");
    c.lddk = sdk::need_heads(outs[1], c.N, c.Hkv, c.D, "attention_bwd dk");
    c.lddv = sdk::need_heads(outs[2], c.N, c.Hkv, Dv, "attention_bwd dv");
    c.dq = ptr(outs[0]);
    c.dk = ptr(outs[1]);
    c.dv = ptr(outs[2]);
  }
  return c;
}

// What cuDNN cannot take for these operands: "" when it can.
std::string unsupported(const AttnCall& c, int64_t Dv, bool bwd) {
  const int64_t fwd_lds[] = {c.ldq, c.ldk, c.ldv, c.ldo};
  const int64_t bwd_lds[] = {c.ldq, c.ldk, c.ldv, c.ldo, c.lddo, c.lddq, c.lddk, c.lddv};
  return SdpaEngine::unsupported(c.Hq, c.Hkv, c.D, Dv, bwd ? bwd_lds : fwd_lds, bwd ? 8 : 4);
}

// A call's attribute, else the resolution's, else the contract's default.
double pick(const rlh_op_call* call, const char* name, bool op_has, double op_value, double fallback) {
  if (const rlh_named_value* a = sdk::find_attr(call->attrs, call->num_attrs, name))
    return a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value);
  return op_has ? op_value : fallback;
}

// Scratch: the caller's when large enough and aligned, else the instance's stream-ordered pool.
class Scratch {
 public:
  Scratch(rlh_kernels* k, const rlh_op_call* call, size_t bytes, cudaStream_t s) : s_(s) {
    if (bytes == 0) return;
    if (call->workspace && call->workspace_bytes >= bytes && reinterpret_cast<uintptr_t>(call->workspace) % 256 == 0) {
      p_ = call->workspace;
      return;
    }
    const cudaError_t e = cudaMallocFromPoolAsync(&p_, bytes, k->pool, s);
    if (e != cudaSuccess)
      throw Error(RLH_E_RESOURCE_EXHAUSTED,
                  "kernels_cudnn workspace of " + std::to_string(bytes) + " bytes: " + cudaGetErrorString(e));
    owned_ = true;
  }
  ~Scratch() {
    if (owned_) cudaFreeAsync(p_, s_);
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  bool owned_ = false;
  cudaStream_t s_;
};

// ---------------------------------------------------------------------------------------------
// The KERNELS table

void log(const rlh_host_api* host, int32_t level, const std::string& msg) {
  if (host && host->log) host->log(host->ctx, level, msg.data(), msg.size());
}

// Cheap facts about the machine's devices: "" when one of compute capability 8.0+ exists, else
// why not; `found` lists them.
std::string device_reason(std::string* found) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    return std::string("no CUDA device: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  int usable = 0;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    *found += std::string(found->empty() ? "" : ", ") + "cuda:" + std::to_string(i) + " " + p.name + " sm_" +
              std::to_string(p.major * 10 + p.minor);
    usable += p.major >= 8;
  }
  if (usable == 0) return "cuDNN's fused attention needs compute capability 8.0+; found " + *found;
  return {};
}

rlh_status* k_create(const rlh_host_api* host, rlh_device device, const char*, size_t, rlh_kernels** out) {
  const sdk::MakeStatusFn make = host ? host->make_status : nullptr;
  return sdk::guard(make, [&] {
    if (device.device_type != RLH_DEVICE_CUDA)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cudnn runs on CUDA devices only");
    if (!g_make_status) g_make_status = make;
    int count = 0;
    const cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0)
      throw Error(RLH_E_UNAVAILABLE, std::string("kernels_cudnn: no CUDA device: ") +
                                         (ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices"));
    if (device.device_id < 0 || device.device_id >= count)
      throw Error(RLH_E_INVALID_ARGUMENT, "kernels_cudnn: no device cuda:" + std::to_string(device.device_id));
    const CudnnLib* lib = nullptr;
    try {
      lib = &cudnn_lib();
    } catch (const std::exception& e) {
      throw Error(RLH_E_UNAVAILABLE, std::string("kernels_cudnn: ") + e.what());
    }
    cudaDeviceProp prop{};
    cuda_ck(cudaGetDeviceProperties(&prop, device.device_id), "device properties");
    if (prop.major < 8)
      throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cudnn: cuDNN's fused attention needs compute capability "
                                                   "8.0+; cuda:") +
                                           std::to_string(device.device_id) + " (" + prop.name + ") is sm_" +
                                           std::to_string(prop.major * 10 + prop.minor));
    auto k = std::make_unique<rlh_kernels>();
    k->host = host;
    k->device = device;
    on_device(k.get(), [&] {
      const cudnnStatus_t s = lib->Create(&k->handle);
      if (s != CUDNN_STATUS_SUCCESS)
        throw Error(RLH_E_UNAVAILABLE, "kernels_cudnn: cudnnCreate on cuda:" + std::to_string(device.device_id) +
                                           " failed: " + lib->error(s));
      cudaMemPoolProps pp{};
      pp.allocType = cudaMemAllocationTypePinned;
      pp.location.type = cudaMemLocationTypeDevice;
      pp.location.id = device.device_id;
      if (cudaMemPoolCreate(&k->pool, &pp) != cudaSuccess) {
        lib->Destroy(k->handle);
        throw Error(RLH_E_UNAVAILABLE, "kernels_cudnn: cannot create a memory pool on cuda:" +
                                           std::to_string(device.device_id));
      }
      uint64_t keep = UINT64_MAX;  // freed scratch stays in the pool: no allocation per step
      cudaMemPoolSetAttribute(k->pool, cudaMemPoolAttrReleaseThreshold, &keep);
    });
    k->sdpa = std::make_unique<SdpaEngine>(*lib, k->handle);
    log(host, RLH_LOG_INFO,
        "kernels_cudnn: cuda:" + std::to_string(device.device_id) + " " + prop.name + " (sm_" +
            std::to_string(prop.major * 10 + prop.minor) + "), cuDNN " + lib->version_string() + " from " + lib->path);
    *out = k.release();
  });
}

void k_destroy(rlh_kernels* k) {
  if (!k) return;
  try {
    on_device(k, [&] {
      k->sdpa.reset();
      if (k->handle) cudnn_lib().Destroy(k->handle);
      if (k->pool) cudaMemPoolDestroy(k->pool);
    });
  } catch (...) {
  }
  delete k;
}

rlh_status* k_list_ops(rlh_kernels*, rlh_write_fn write, void* user) {
  return sdk::guard(g_make_status, [&] {
    static const char kOps[] =
        "[{\"name\":\"attention_fwd\",\"dtypes\":[\"bf16\"],\"backward\":\"attention_bwd\"},"
        "{\"name\":\"attention_bwd\",\"dtypes\":[\"bf16\"],\"backward\":\"\"}]";
    write(user, kOps, sizeof(kOps) - 1);
  });
}

rlh_status* k_get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out) {
  return sdk::guard(g_make_status, [&] {
    const std::string name = d->name ? d->name : "";
    if (name != "attention_fwd" && name != "attention_bwd")
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cudnn has no op '" + name + "' (it offers attention_fwd, attention_bwd)");
    const bool bwd = name == "attention_bwd";
    if (d->device.device_type != RLH_DEVICE_CUDA || d->device.device_id != k->device.device_id)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cudnn: op asked for another device");
    check_operands(bwd, k, d->inputs, d->num_inputs, d->outputs, d->num_outputs);
    auto op = std::make_unique<rlh_op>();
    op->backward = bwd;
    op->inst = k;
    if (const rlh_named_value* a = sdk::find_attr(d->attrs, d->num_attrs, "scale")) {
      op->has_scale = true;
      op->scale = a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value);
    }
    if (const rlh_named_value* a = sdk::find_attr(d->attrs, d->num_attrs, "window")) {
      op->has_window = true;
      op->window = a->type == RLH_VALUE_DOUBLE ? int64_t(a->double_value) : a->int64_value;
    }
    // Soft-capped scores (Gemma-2) are not built into the graph: refused, so a registry falls through.
    if (const rlh_named_value* a = sdk::find_attr(d->attrs, d->num_attrs, "softcap");
        a && (a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value)) != 0)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cudnn " + name + ": softcap (soft-capping) is not offered");
    // Bitwise reproducible gradients asked for: cuDNN's backward accumulates dQ with atomics.
    if (bwd && sdk::attr_int_or(d->attrs, d->num_attrs, "deterministic", 0) != 0)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cudnn attention_bwd: not deterministic (dQ is accumulated with "
                                       "atomics), and deterministic = 1 was asked for");
    // The descriptors' shapes (the engine's first call; every call when shapes_valid): refuse
    // what cuDNN cannot take, and build that call's plan now, so that a cuDNN that cannot run
    // this graph is an answer (the registry falls through to the next provider), not a failure
    // in the middle of a step.
    const rlh_tensor& q = d->inputs[bwd ? 1 : 0];
    const rlh_tensor& v = d->inputs[bwd ? 3 : 2];
    if (q.ndim == 3 && v.ndim == 3 && q.shape && v.shape && q.strides && q.shape[0] > 0) {
      AttnCall c;
      try {
        c = read_call(bwd, d->inputs, d->outputs, op->scale, op->window);
      } catch (const Error& e) {
        throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cudnn ") + name + ": " + e.what());
      }
      const std::string why = unsupported(c, v.shape[2], bwd);
      if (!why.empty()) throw Error(RLH_E_UNIMPLEMENTED, "kernels_cudnn " + name + ": " + why);
      try {
        on_device(k, [&] { k->sdpa->prepare(c, bwd); });
      } catch (const CudnnError& e) {
        throw Error(RLH_E_UNIMPLEMENTED, "kernels_cudnn " + name + ": cuDNN " + cudnn_lib().version_string() +
                                             " cannot run it (N " + std::to_string(c.N) + ", Hq " +
                                             std::to_string(c.Hq) + ", Hkv " + std::to_string(c.Hkv) + ", D " +
                                             std::to_string(c.D) + ", window " + std::to_string(c.window) +
                                             "): " + e.what());
      }
    }
    *out = op.release();
  });
}

rlh_status* k_op_info(rlh_op* op, rlh_op_info* out) {
  return sdk::guard(g_make_status, [&] {
    rlh_op_info info{};
    // Rows share tiles (not batch-invariant). The forward is deterministic unless the engine
    // cuDNN chose says otherwise; the backward is not (dQ accumulated with float atomics; cuDNN's
    // deterministic backward on Hopper keeps an [S, S] dP per head, which packed sequences
    // cannot afford).
    info.batch_invariant = 0;
    info.deterministic = op->backward ? 0 : (op->inst->sdpa->forward_deterministic() ? 1 : 0);
    info.stateful = 0;
    info.workspace_bytes = 0;  // depends on N: workspace_size() answers per call
    const size_t n = std::min(out->struct_size, sizeof(rlh_op_info));
    if (n > sizeof(size_t))
      std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t), reinterpret_cast<const char*>(&info) + sizeof(size_t),
                  n - sizeof(size_t));
  });
}

AttnCall checked_call(rlh_op* op, const rlh_op_call* call) {
  check_operands(op->backward, op->inst, call->inputs, call->num_inputs, call->outputs, call->num_outputs);
  const double scale = pick(call, "scale", op->has_scale, op->scale, NAN);  // NaN: 1 / sqrt(D)
  const double window = pick(call, "window", op->has_window, double(op->window), 0);
  AttnCall c = read_call(op->backward, call->inputs, call->outputs, scale, int64_t(window));
  const int64_t Dv = call->inputs[op->backward ? 3 : 2].shape[2];
  const std::string why = unsupported(c, Dv, op->backward);
  if (!why.empty()) bad(std::string("kernels_cudnn ") + kOpName[op->backward] + ": " + why);
  if (c.window < 0) bad(std::string("kernels_cudnn ") + kOpName[op->backward] + ": window must be >= 0");
  for (const void* p : {c.q, c.k, c.v, static_cast<const void*>(c.o), c.dout, static_cast<const void*>(c.dq),
                        static_cast<const void*>(c.dk), static_cast<const void*>(c.dv)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
      bad(std::string("kernels_cudnn ") + kOpName[op->backward] + ": operands must be 16-byte aligned");
  return c;
}

rlh_status* k_run(rlh_op* op, const rlh_op_call* call) {
  return sdk::guard(g_make_status, [&] {
    rlh_kernels* k = op->inst;
    const AttnCall c = checked_call(op, call);
    const auto stream = static_cast<cudaStream_t>(call->stream);
    on_device(k, [&] {
      try {
        const size_t bytes = k->sdpa->workspace_bytes(c, op->backward);
        Scratch ws(k, call, bytes, stream);
        if (op->backward)
          k->sdpa->backward(c, ws.get(), stream);
        else
          k->sdpa->forward(c, ws.get(), stream);
      } catch (const CudnnError& e) {
        throw Error(RLH_E_INTERNAL, std::string("kernels_cudnn ") + kOpName[op->backward] + " (N " +
                                        std::to_string(c.N) + ", S " + std::to_string(c.S) + ", window " +
                                        std::to_string(c.window) + "): " + e.what());
      }
      cuda_ck(cudaGetLastError(), kOpName[op->backward]);
    });
  });
}

void k_release_op(rlh_op* op) { delete op; }

rlh_status* k_workspace_size(rlh_op* op, const rlh_op_call* call, size_t* bytes) {
  return sdk::guard(g_make_status, [&] {
    if (bytes == nullptr) bad("workspace_size: bytes is NULL");
    const AttnCall c = checked_call(op, call);
    on_device(op->inst, [&] {
      try {
        *bytes = op->inst->sdpa->workspace_bytes(c, op->backward);
      } catch (const CudnnError& e) {
        throw Error(RLH_E_INTERNAL, std::string("kernels_cudnn ") + kOpName[op->backward] + ": " + e.what());
      }
    });
  });
}

// Operands live in the instance's device memory: the memory services let a caller that knows
// nothing of CUDA (the conformance runner) stage them.
rlh_status* k_provider_info(rlh_kernels*, rlh_write_fn write, void* user) {
  return sdk::guard(g_make_status, [&] {
    static const char kInfo[] = "{\"reference\":false,\"memory\":\"device\"}";
    write(user, kInfo, sizeof(kInfo) - 1);
  });
}

rlh_status* k_memory_alloc(rlh_kernels* k, size_t bytes, void** out) {
  return sdk::guard(g_make_status, [&] {
    if (out == nullptr) bad("memory_alloc: out is NULL");
    on_device(k, [&] {
      const cudaError_t e = cudaMalloc(out, std::max<size_t>(bytes, 1));
      if (e != cudaSuccess)
        throw Error(RLH_E_RESOURCE_EXHAUSTED,
                    "kernels_cudnn: cudaMalloc of " + std::to_string(bytes) + " bytes: " + cudaGetErrorString(e));
    });
  });
}

void k_memory_free(rlh_kernels* k, void* p) {
  if (p == nullptr) return;
  try {
    on_device(k, [&] { cudaFree(p); });
  } catch (...) {
  }
}

rlh_status* k_memory_copy(rlh_kernels* k, void* dst, const void* src, size_t bytes, int32_t dir, void* stream) {
  return sdk::guard(g_make_status, [&] {
    cudaMemcpyKind kind;
    switch (dir) {
      case RLH_COPY_HOST_TO_DEVICE: kind = cudaMemcpyHostToDevice; break;
      case RLH_COPY_DEVICE_TO_HOST: kind = cudaMemcpyDeviceToHost; break;
      case RLH_COPY_DEVICE_TO_DEVICE: kind = cudaMemcpyDeviceToDevice; break;
      default: bad("memory_copy: unknown direction " + std::to_string(dir));
    }
    if (bytes == 0) return;
    on_device(k, [&] {
      cuda_ck(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream)), "memory_copy");
    });
  });
}

rlh_status* k_synchronize(rlh_kernels* k, void* stream) {
  return sdk::guard(g_make_status, [&] {
    on_device(k, [&] {
      cuda_ck(stream ? cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) : cudaDeviceSynchronize(),
              "synchronize");
    });
  });
}

const rlh_kernels_api kApi = [] {
  rlh_kernels_api a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_kernels_api, workspace_size);
  a.create = k_create;
  a.destroy = k_destroy;
  a.list_ops = k_list_ops;
  a.get_op = k_get_op;
  a.op_info = k_op_info;
  a.run = k_run;
  a.release_op = k_release_op;
  a.state_save = nullptr;
  a.state_load = nullptr;
  a.provider_info = k_provider_info;
  a.memory_alloc = k_memory_alloc;
  a.memory_free = k_memory_free;
  a.memory_copy = k_memory_copy;
  a.synchronize = k_synchronize;
  a.workspace_size = k_workspace_size;
  return a;
}();

// Can it run here? Counts devices (loading libcuda.so.1 through the static runtime, if present),
// reads their compute capability and loads cuDNN (once per process). Score 20: above
// kernels_cuda's 10, so the registry asks this provider first for attention (the ops it does
// not offer, and the shapes it refuses, fall through).
rlh_status* probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user) {
  return sdk::guard(host ? host->make_status : nullptr, [&] {
    auto say = [&](const std::string& m) {
      if (write) write(user, m.data(), m.size());
    };
    std::string found;
    const std::string why = device_reason(&found);
    if (!why.empty()) {
      *score = 0;
      say(why);
      return;
    }
    try {
      const CudnnLib& lib = cudnn_lib();
      *score = 20;
      say(found + "; cuDNN " + lib.version_string() + " (" + lib.path + ")");
    } catch (const std::exception& e) {
      *score = 0;
      say(e.what());
    }
  });
}

const rlh_component_desc kComponent = sdk::component_desc(
    RLH_KIND_KERNELS, "kernels_cudnn", "0.1.0", RLH_KERNELS_API_VERSION_MAJOR, RLH_KERNELS_API_VERSION_MINOR, &kApi,
    "Attention (varlen, causal, sliding window, GQA; bf16) on cuDNN 9's fused flash-attention engines");
const rlh_component_desc* const kComponents[] = {&kComponent};

rlh_plugin_desc make_desc() {
  rlh_plugin_desc d = sdk::plugin_desc("kernels_cudnn", "0.1.0", "rlhost", kComponents,
                                       "cuDNN attention provider (bf16, compute capability 8.0+)");
  d.probe = probe;
  return d;
}

}  // namespace
}  // namespace rlh::kcudnn

RLH_DEFINE_PLUGIN(rlh::kcudnn::make_desc());
