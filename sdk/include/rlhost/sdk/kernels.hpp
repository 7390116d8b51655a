// rlhost C++ SDK: tensors views and the kernel registry, for code that runs ops (engines,
// generators, the conformance test) and code that implements them (providers).
//
// A KernelRegistry holds provider instances in preference order (the CPU reference last) and
// per-op pins. resolve() asks each in turn for an op; the first that does not answer
// RLH_E_UNIMPLEMENTED wins. Resolution happens once; Op::run is one indirect call.
#pragma once

#include <algorithm>
#include <array>
#include <string_view>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/sdk/status.hpp"

namespace rlh::sdk {

// ------------------------------------------------------------------------------------------
// dtypes

constexpr rlh_dtype kF32{RLH_DTYPE_FLOAT, 32, 1};
constexpr rlh_dtype kF64{RLH_DTYPE_FLOAT, 64, 1};
constexpr rlh_dtype kF16{RLH_DTYPE_FLOAT, 16, 1};
constexpr rlh_dtype kBF16{RLH_DTYPE_BFLOAT, 16, 1};
constexpr rlh_dtype kI32{RLH_DTYPE_INT, 32, 1};
constexpr rlh_dtype kI64{RLH_DTYPE_INT, 64, 1};
constexpr rlh_dtype kU8{RLH_DTYPE_UINT, 8, 1};
constexpr rlh_dtype kE4M3{RLH_DTYPE_FLOAT8_E4M3FN, 8, 1};
constexpr rlh_dtype kE5M2{RLH_DTYPE_FLOAT8_E5M2, 8, 1};

constexpr bool operator==(rlh_dtype a, rlh_dtype b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}
constexpr size_t dtype_bytes(rlh_dtype d) { return (size_t(d.bits) * d.lanes + 7) / 8; }

// Short name ("f32", "bf16", "e4m3") for messages and op listings.
inline const char* dtype_name(rlh_dtype d) {
  switch (d.code) {
    case RLH_DTYPE_FLOAT: return d.bits == 32 ? "f32" : d.bits == 64 ? "f64" : d.bits == 16 ? "f16" : "f?";
    case RLH_DTYPE_BFLOAT: return "bf16";
    case RLH_DTYPE_INT: return d.bits == 32 ? "i32" : d.bits == 64 ? "i64" : d.bits == 8 ? "i8" : "i?";
    case RLH_DTYPE_UINT: return d.bits == 8 ? "u8" : "u?";
    case RLH_DTYPE_BOOL: return "bool";
    case RLH_DTYPE_FLOAT8_E4M3FN: return "e4m3";
    case RLH_DTYPE_FLOAT8_E5M2: return "e5m2";
    default: return "other";
  }
}

constexpr rlh_device kCPU{RLH_DEVICE_CPU, 0};
inline rlh_device cuda_device(int id) { return rlh_device{RLH_DEVICE_CUDA, id}; }

// ------------------------------------------------------------------------------------------
// A contiguous tensor view that owns its shape/stride arrays (rlh_tensor points into them), so
// it can be built on the fly: Tensor(ptr, {T, D}). Copying re-points the arrays.

class Tensor {
 public:
  static constexpr int kMaxDims = 6;

  Tensor() { t_ = rlh_tensor{}; t_.device = kCPU; t_.dtype = kF32; fix(); }
  Tensor(void* data, std::initializer_list<int64_t> shape, rlh_dtype dtype = kF32,
         rlh_device device = kCPU)
      : Tensor(data, std::span<const int64_t>(shape.begin(), shape.size()), dtype, device) {}
  Tensor(void* data, std::span<const int64_t> shape, rlh_dtype dtype = kF32,
         rlh_device device = kCPU) {
    if (shape.size() > kMaxDims) throw Error(RLH_E_INVALID_ARGUMENT, "tensor has too many dims");
    t_ = rlh_tensor{};
    t_.data = data;
    t_.device = device;
    t_.dtype = dtype;
    t_.ndim = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) shape_[i] = shape[i];
    int64_t s = 1;
    for (int i = t_.ndim - 1; i >= 0; --i) { strides_[i] = s; s *= shape_[i]; }
    fix();
  }
  Tensor(const Tensor& o) : t_(o.t_), shape_(o.shape_), strides_(o.strides_) { fix(); }
  Tensor& operator=(const Tensor& o) {
    t_ = o.t_; shape_ = o.shape_; strides_ = o.strides_; fix(); return *this;
  }

  const rlh_tensor& raw() const { return t_; }
  operator const rlh_tensor&() const { return t_; }
  int64_t numel() const { int64_t n = 1; for (int i = 0; i < t_.ndim; ++i) n *= shape_[i]; return n; }
  int64_t dim(int i) const { return shape_[i]; }
  int ndim() const { return t_.ndim; }
  template <typename T> T* data() const {
    return reinterpret_cast<T*>(static_cast<char*>(t_.data) + t_.byte_offset);
  }

 private:
  void fix() { t_.shape = shape_.data(); t_.strides = strides_.data(); }
  rlh_tensor t_;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

// Typed pointer to the first element of a borrowed tensor (no dtype check: callers resolved
// the op for these dtypes).
template <typename T>
inline T* tensor_data(const rlh_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}
inline int64_t tensor_numel(const rlh_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// Operand checks for providers: each throws Error(INVALID_ARGUMENT) naming `what` when the
// operand does not have the layout docs/ops.md promises.

// A contiguous view of n elements.
inline void need_vec(const rlh_tensor& t, int64_t n, const char* what) {
  if (tensor_numel(t) != n)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": expected " + std::to_string(n) + " elements");
  for (int i = 0; i < t.ndim; ++i) {
    int64_t inner = 1;
    for (int j = i + 1; j < t.ndim; ++j) inner *= t.shape[j];
    if (t.shape[i] > 1 && t.strides[i] != inner)
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": must be contiguous");
  }
}

// [rows, cols] with unit column stride; returns the row stride.
inline int64_t need_rows(const rlh_tensor& t, int64_t rows, int64_t cols, const char* what) {
  if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": expected shape [" + std::to_string(rows) + ", " +
                                            std::to_string(cols) + "]");
  if (cols > 1 && t.strides[1] != 1)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": last dimension must be contiguous");
  if (rows > 1 && t.strides[0] < cols) throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": rows overlap");
  return rows > 1 ? t.strides[0] : cols;
}

// [N, H, D] with strides (ld, D, 1): heads contiguous within a token; returns ld.
inline int64_t need_heads(const rlh_tensor& t, int64_t N, int64_t H, int64_t D, const char* what) {
  if (t.ndim != 3 || t.shape[0] != N || t.shape[1] != H || t.shape[2] != D)
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": expected shape [" + std::to_string(N) + ", " +
                                            std::to_string(H) + ", " + std::to_string(D) + "]");
  if ((D > 1 && t.strides[2] != 1) || (H > 1 && t.strides[1] != D))
    throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": heads must be contiguous within a token");
  if (N > 1 && t.strides[0] < H * D) throw Error(RLH_E_INVALID_ARGUMENT, std::string(what) + ": tokens overlap");
  return N > 1 ? t.strides[0] : H * D;
}

// The sizes of a fused product (docs/ops.md gemm_glu_fwd, rmsnorm_gemm_fwd, gemm_add_fwd): x [M, K],
// W [rows, K] and the output [M, N], with rows = 2N for a GLU (activation >= 0: 0 silu, 1 gelu
// tanh, 2 gelu erf) and N otherwise, checked against each other and the activation against
// [act_min, 2]; `op` names them in the error. Every provider checks them so.
struct ProductSizes {
  int64_t M = 0, K = 0, N = 0, rows = 0;
};
inline ProductSizes fused_product_sizes(const char* op, const rlh_tensor& x, const rlh_tensor& W,
                                        const rlh_tensor& out, int64_t act, int64_t act_min) {
  auto bad = [op](const std::string& what) { throw Error(RLH_E_INVALID_ARGUMENT, std::string(op) + ": " + what); };
  if (x.ndim != 2 || W.ndim != 2 || out.ndim != 2) bad("x, W and the output must be 2-D");
  if (act < act_min || act > 2)
    bad("activation must be " + std::string(act_min < 0 ? "-1 (none), " : "") + "0 (silu), 1 (gelu, tanh) or 2 (gelu, erf)");
  ProductSizes z;
  z.M = x.shape[0];
  z.K = x.shape[1];
  z.N = out.shape[1];
  z.rows = act >= 0 ? 2 * z.N : z.N;
  if (W.shape[0] != z.rows || W.shape[1] != z.K || out.shape[0] != z.M)
    bad(act >= 0 ? "W must be gate | up [2N, K] for x [M, K] and the output [M, N]"
                 : "W must be [N, K] for x [M, K] and the output [M, N]");
  return z;
}

// decode_layer_fwd's sizes (docs/ops.md) from its operands: x [R, C], W_qkv [(Hq + 2 Hkv) D, C],
// W_o [C, Hq D], W_gu [2F, C], W_down [C, F] (inputs 0, 2, 3, 5, 6) and the caches
// [B, Hkv, bs, D] (outputs 1, 2), checked against each other; every provider derives them so.
struct DecodeLayerSizes {
  int64_t R = 0, C = 0, F = 0, Hq = 0, Hkv = 0, D = 0, bs = 0, num_blocks = 0;
};
inline DecodeLayerSizes decode_layer_sizes(const rlh_tensor* in, const rlh_tensor* out) {
  auto bad = [](const char* what) { throw Error(RLH_E_INVALID_ARGUMENT, std::string("decode_layer_fwd: ") + what); };
  const rlh_tensor &x = in[0], &wqkv = in[2], &wo = in[3], &wgu = in[5], &wd = in[6], &kc = out[1], &vc = out[2];
  if (x.ndim != 2 || wqkv.ndim != 2 || wo.ndim != 2 || wgu.ndim != 2 || wd.ndim != 2 || kc.ndim != 4 || vc.ndim != 4)
    bad("x, the weights and y must be 2-D, the caches [B, Hkv, bs, D]");
  DecodeLayerSizes z;
  z.R = x.shape[0];
  z.C = x.shape[1];
  z.num_blocks = kc.shape[0];
  z.Hkv = kc.shape[1];
  z.bs = kc.shape[2];
  z.D = kc.shape[3];
  z.F = wd.shape[1];
  if (z.D <= 0 || z.D % 2 || wo.shape[1] % z.D) bad("W_o's columns are not whole heads of the caches' even D");
  z.Hq = wo.shape[1] / z.D;
  if (z.Hkv <= 0 || z.Hq % z.Hkv) bad("kv heads must divide query heads");
  if (wqkv.shape[0] != (z.Hq + 2 * z.Hkv) * z.D || wqkv.shape[1] != z.C) bad("W_qkv must be [(Hq + 2 Hkv) D, C]");
  if (wo.shape[0] != z.C) bad("W_o must be [C, Hq D]");
  if (wgu.shape[0] != 2 * z.F || wgu.shape[1] != z.C) bad("W_gu must be [2F, C]");
  if (wd.shape[0] != z.C) bad("W_down must be [C, F]");
  for (int i = 0; i < 4; ++i)
    if (vc.shape[i] != kc.shape[i]) bad("the caches' shapes disagree");
  return z;
}

// ------------------------------------------------------------------------------------------
// Attributes

inline rlh_named_value attr_int(const char* name, int64_t v) {
  rlh_named_value a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_named_value, size);
  a.name = name; a.type = RLH_VALUE_INT64; a.int64_value = v;
  return a;
}
inline rlh_named_value attr_bool(const char* name, bool v) {
  rlh_named_value a = attr_int(name, v ? 1 : 0);
  a.type = RLH_VALUE_BOOL;
  return a;
}
inline rlh_named_value attr_double(const char* name, double v) {
  rlh_named_value a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_named_value, size);
  a.name = name; a.type = RLH_VALUE_DOUBLE; a.double_value = v;
  return a;
}
inline rlh_named_value attr_string(const char* name, std::string_view v) {
  rlh_named_value a{};
  a.struct_size = RLH_STRUCT_SIZE(rlh_named_value, size);
  a.name = name; a.type = RLH_VALUE_STRING; a.string_value = v.data(); a.size = v.size();
  return a;
}

// Attribute lookup for providers: returns the last value named `name`, or `fallback`.
inline const rlh_named_value* find_attr(const rlh_named_value* attrs, size_t n, std::string_view name) {
  const rlh_named_value* found = nullptr;
  for (size_t i = 0; attrs != nullptr && i < n; ++i)
    if (attrs[i].name != nullptr && name == attrs[i].name) found = &attrs[i];
  return found;
}
inline int64_t attr_int_or(const rlh_named_value* attrs, size_t n, std::string_view name, int64_t fallback) {
  const rlh_named_value* a = find_attr(attrs, n, name);
  if (a == nullptr) return fallback;
  return a->type == RLH_VALUE_DOUBLE ? static_cast<int64_t>(a->double_value) : a->int64_value;
}
inline double attr_double_or(const rlh_named_value* attrs, size_t n, std::string_view name, double fallback) {
  const rlh_named_value* a = find_attr(attrs, n, name);
  if (a == nullptr) return fallback;
  return a->type == RLH_VALUE_DOUBLE ? a->double_value : static_cast<double>(a->int64_value);
}

// ------------------------------------------------------------------------------------------
// Registry

// A resolved op. Movable, releases the handle on destruction.
class Op {
 public:
  Op() = default;
  Op(const rlh_kernels_api* api, rlh_op* op, std::string provider, std::string name = {})
      : api_(api), op_(op), provider_(std::move(provider)), name_(std::move(name)) {}
  Op(Op&& o) noexcept
      : api_(o.api_), op_(std::exchange(o.op_, nullptr)), provider_(std::move(o.provider_)),
        name_(std::move(o.name_)) {}
  Op& operator=(Op&& o) noexcept {
    if (this != &o) {
      reset();
      api_ = o.api_;
      op_ = std::exchange(o.op_, nullptr);
      provider_ = std::move(o.provider_);
      name_ = std::move(o.name_);
    }
    return *this;
  }
  ~Op() { reset(); }
  explicit operator bool() const { return op_ != nullptr; }
  const std::string& provider() const { return provider_; }
  const std::string& name() const { return name_; }
  rlh_op* raw() const { return op_; }
  const rlh_kernels_api* api() const { return api_; }

  void run(std::span<const rlh_tensor> inputs, std::span<const rlh_tensor> outputs,
           std::span<const rlh_named_value> attrs = {}, void* stream = nullptr,
           void* workspace = nullptr, size_t workspace_bytes = 0) const {
    rlh_op_call call{};
    call.struct_size = RLH_STRUCT_SIZE(rlh_op_call, workspace_bytes);
    call.inputs = inputs.data(); call.num_inputs = inputs.size();
    call.outputs = outputs.data(); call.num_outputs = outputs.size();
    call.attrs = attrs.data(); call.num_attrs = attrs.size();
    call.stream = stream; call.workspace = workspace; call.workspace_bytes = workspace_bytes;
    run(call);
  }
  // Runs a prepared call; a failure names the provider and the op.
  void run(const rlh_op_call& call) const {
    if (rlh_status* s = api_->run(op_, &call)) failed(s, "running");
  }
  // Scratch bytes this call needs (0 when the provider does not say: it finds its own).
  size_t workspace_size(const rlh_op_call& call) const {
    if (!RLH_HAS_FIELD(api_, rlh_kernels_api, workspace_size) || api_->workspace_size == nullptr) return 0;
    size_t bytes = 0;
    if (rlh_status* s = api_->workspace_size(op_, &call, &bytes)) failed(s, "sizing the workspace of");
    return bytes;
  }
  // Convenience for Tensor lists.
  void run(std::initializer_list<Tensor> inputs, std::initializer_list<Tensor> outputs,
           std::initializer_list<rlh_named_value> attrs = {}, void* stream = nullptr) const {
    std::vector<rlh_tensor> in, out;
    for (const Tensor& t : inputs) in.push_back(t.raw());
    for (const Tensor& t : outputs) out.push_back(t.raw());
    run(in, out, std::span<const rlh_named_value>(attrs.begin(), attrs.size()), stream);
  }

  rlh_op_info info() const {
    rlh_op_info i{};
    i.struct_size = sizeof(rlh_op_info);
    if (rlh_status* s = api_->op_info(op_, &i)) failed(s, "reading the properties of");
    return i;
  }

 private:
  [[noreturn]] void failed(rlh_status* s, const char* what) const {
    StatusPtr owned(s);
    throw Error(s->code, "kernel provider '" + provider_ + "' failed " + what + " op '" + name_ + "': " +
                             status_message(s));
  }
  void reset() { if (op_ != nullptr && api_ != nullptr) api_->release_op(op_); op_ = nullptr; }
  const rlh_kernels_api* api_ = nullptr;
  rlh_op* op_ = nullptr;
  std::string provider_, name_;
};

// The providers an executor draws its ops from, in preference order: every provider that runs
// on the executor's device, best probe score first, the reference (docs/ops.md; kernels_cpu says
// so in provider_info) last. resolve() asks each in turn and the first that does not answer
// RLH_E_UNIMPLEMENTED wins, so a provider may answer only some ops, dtypes or shapes and the
// rest falls through. A pin (policy.kernels.<op>: <provider>) makes one provider the only one
// asked for that op. Every resolution is recorded, so the executor can log which provider runs
// each op. make_kernel_registry (kernel_registry.hpp) builds one from the host's providers.
class KernelRegistry {
 public:
  struct Provider {
    std::string name;
    const rlh_kernels_api* api = nullptr;
    rlh_kernels* instance = nullptr;
    bool owned = false;      // destroy the instance with the registry
    bool reference = false;  // provider_info says "reference": true
    bool device_memory = false;  // provider_info says "memory": "device"
    // Set by conformance verification (make_kernel_registry): the provider is asked only for
    // these ops (those it lists that did not fail).
    bool verified = false;
    std::vector<std::string> verified_ops;
  };
  // One resolution: the op, its float dtype ("bf16", ...) and the provider that answered.
  struct Choice {
    std::string op, dtype, provider;
  };

  KernelRegistry() = default;
  KernelRegistry(const KernelRegistry&) = delete;
  KernelRegistry& operator=(const KernelRegistry&) = delete;
  ~KernelRegistry() {
    for (auto it = providers_.rbegin(); it != providers_.rend(); ++it)
      if (it->owned && it->api != nullptr && it->instance != nullptr) it->api->destroy(it->instance);
  }

  // Adds a provider at the end of the preference order, creating (and later destroying) an
  // instance for `device`.
  void add(std::string name, const rlh_kernels_api* api, const rlh_host_api* host,
           rlh_device device, std::string_view config_json = "{}") {
    if (api == nullptr || api->struct_size < RLH_STRUCT_SIZE(rlh_kernels_api, release_op))
      throw Error(RLH_E_ABI_MISMATCH, "kernel provider '" + name + "' has a too-small table");
    rlh_kernels* inst = nullptr;
    check(api->create(host, device, config_json.data(), config_json.size(), &inst),
          "creating kernel provider '" + name + "'");
    add_provider(make(std::move(name), api, inst, true));
  }
  void add_instance(std::string name, const rlh_kernels_api* api, rlh_kernels* instance) {
    add_provider(make(std::move(name), api, instance, false));
  }
  void add_provider(Provider p) { providers_.push_back(std::move(p)); }
  static Provider make(std::string name, const rlh_kernels_api* api, rlh_kernels* instance, bool owned) {
    Provider p;
    p.name = std::move(name);
    p.api = api;
    p.instance = instance;
    p.owned = owned;
    return p;
  }
  // Limits `provider` to `ops` (conformance verification leaves failing ops out).
  void restrict_ops(std::string_view provider, std::vector<std::string> ops) {
    for (Provider& p : providers_)
      if (p.name == provider) {
        p.verified = true;
        p.verified_ops = std::move(ops);
      }
  }
  const std::vector<Provider>& providers() const { return providers_; }
  const Provider* find(std::string_view name) const {
    for (const Provider& p : providers_)
      if (p.name == name) return &p;
    return nullptr;
  }

  // Pins `provider` for the op named `op`, or for every op of a family: "attention" pins
  // attention_fwd and attention_bwd ("<family>_..."). The provider must be in the registry.
  void pin(const std::string& op, const std::string& provider) {
    if (find(provider) == nullptr) {
      std::string have;
      for (const Provider& p : providers_) have += (have.empty() ? "" : ", ") + p.name;
      throw Error(RLH_E_NOT_FOUND, "policy.kernels." + op + " pins kernel provider '" + provider +
                                       "', which is not loaded for this device (loaded: " +
                                       (have.empty() ? "none" : have) + ")");
    }
    // The provider must offer the op (or, for a family, an op of it) on this device: refused
    // here, at setup, rather than at the first call that needs it.
    const Provider& pr = *find(provider);
    if (pr.api->list_ops != nullptr) {
      std::string listing;
      if (rlh_status* s = pr.api->list_ops(pr.instance, write_to_string, &listing)) {
        StatusPtr owned(s);
        throw Error(s->code, "kernel provider '" + provider + "' failed to list its ops: " + status_message(s));
      }
      bool offered = false;
      std::string names;
      for (const std::string& n : listed_op_names(listing)) {
        offered = offered || n == op || (n.size() > op.size() && n.compare(0, op.size(), op) == 0 && n[op.size()] == '_');
        names += (names.empty() ? "" : ", ") + n;
      }
      if (!offered)
        throw Error(RLH_E_INVALID_ARGUMENT, "policy.kernels." + op + " pins kernel provider '" + provider +
                                                "', which offers no op '" + op + "' (it offers: " +
                                                (names.empty() ? "none" : names) + ")");
    }
    pins_.emplace_back(op, provider);
  }
  // The "name" values of a list_ops JSON array (a tolerant scan: no JSON library in this header).
  static std::vector<std::string> listed_op_names(const std::string& j) {
    std::vector<std::string> out;
    for (size_t at = j.find("\"name\""); at != std::string::npos; at = j.find("\"name\"", at + 6)) {
      size_t i = at + 6;
      while (i < j.size() && (j[i] == ' ' || j[i] == ':' || j[i] == '\t' || j[i] == '\n')) ++i;
      if (i >= j.size() || j[i] != '"') continue;
      const size_t e = j.find('"', i + 1);
      if (e == std::string::npos) break;
      out.push_back(j.substr(i + 1, e - i - 1));
    }
    return out;
  }
  // The provider pinned for `op`, or empty.
  std::string pinned(std::string_view op) const {
    std::string found;
    for (const auto& [key, prov] : pins_)
      if (op == key || (op.size() > key.size() && op.substr(0, key.size()) == key && op[key.size()] == '_'))
        found = prov;
    return found;
  }

  // Resolves `name` on `device` for the given operand descriptors, trying providers in order
  // (only the pinned one when the op is pinned, only `only` when given: conformance checks).
  // An attribute batch_invariant = 1 is a requirement: a provider's handle counts only when its
  // op_info says batch_invariant (a provider that ignores the attribute falls through).
  // A provider that fails to resolve with anything but RLH_E_UNIMPLEMENTED is an error naming it
  // and the op; no provider answering is RLH_E_UNIMPLEMENTED listing each one's reason.
  Op resolve(const char* name, rlh_device device, std::span<const rlh_tensor> inputs,
             std::span<const rlh_tensor> outputs, std::span<const rlh_named_value> attrs = {},
             bool shapes_valid = false, const std::string& only = {}) const {
    rlh_op_desc d{};
    d.struct_size = RLH_STRUCT_SIZE(rlh_op_desc, num_attrs);
    d.name = name; d.device = device;
    d.inputs = inputs.data(); d.num_inputs = inputs.size();
    d.outputs = outputs.data(); d.num_outputs = outputs.size();
    d.shapes_valid = shapes_valid ? 1 : 0;
    d.attrs = attrs.data(); d.num_attrs = attrs.size();
    const std::string pin = only.empty() ? pinned(name) : only;
    std::string reasons;
    for (const Provider& p : providers_) {
      if (!pin.empty() && p.name != pin) continue;
      if (p.verified && std::find(p.verified_ops.begin(), p.verified_ops.end(), name) == p.verified_ops.end()) {
        reasons += "; " + p.name + ": left out for this op (it failed conformance, or does not list it)";
        continue;
      }
      rlh_op* op = nullptr;
      rlh_status* s = p.api->get_op(p.instance, &d, &op);
      if (s == nullptr && needs_batch_invariance(attrs)) {
        rlh_op_info info{};
        info.struct_size = sizeof(rlh_op_info);
        rlh_status* is = p.api->op_info(op, &info);
        if (is != nullptr || !info.batch_invariant) {
          StatusPtr drop(is);  // (null when op_info answered)
          p.api->release_op(op);
          reasons += "; " + p.name + ": not batch-invariant";
          continue;
        }
      }
      if (s == nullptr) {
        std::lock_guard<std::mutex> lock(choices_mu_);
        choices_.push_back(Choice{name, float_dtype(inputs, outputs), p.name});
        return Op(p.api, op, p.name, name);
      }
      StatusPtr owned(s);
      if (s->code != RLH_E_UNIMPLEMENTED)
        throw Error(s->code, "kernel provider '" + p.name + "' failed to resolve op '" + name +
                                 "': " + status_message(s));
      reasons += "; " + p.name + ": " + status_message(s);
    }
    if (!pin.empty() && only.empty())
      throw Error(RLH_E_UNIMPLEMENTED, "op '" + std::string(name) + "' is pinned to kernel provider '" +
                                           pin + "' (policy.kernels), which does not offer it for these operands" +
                                           reasons);
    throw Error(RLH_E_UNIMPLEMENTED, "no kernel provider implements op '" + std::string(name) +
                                         "' for these operands" + reasons);
  }

  static bool needs_batch_invariance(std::span<const rlh_named_value> attrs) {
    const rlh_named_value* a = find_attr(attrs.data(), attrs.size(), "batch_invariant");
    return a != nullptr && (a->type == RLH_VALUE_DOUBLE ? a->double_value != 0 : a->int64_value != 0);
  }

  // Every resolution so far, in order (one entry per op and dtype).
  std::vector<Choice> choices() const {
    std::vector<Choice> out;
    std::lock_guard<std::mutex> lock(choices_mu_);
    for (const Choice& c : choices_) {
      bool seen = false;
      for (const Choice& o : out) seen = seen || (o.op == c.op && o.dtype == c.dtype && o.provider == c.provider);
      if (!seen) out.push_back(c);
    }
    return out;
  }
  // "gemm bf16: kernels_cuda, attention_fwd bf16: kernels_cudnn, ..." grouped by provider:
  // "kernels_cudnn: attention_fwd, attention_bwd (bf16); kernels_cuda: gemm, ... (bf16)".
  std::string choices_summary() const {
    std::vector<std::pair<std::string, std::string>> by;  // provider -> ops
    for (const Choice& c : choices()) {
      const std::string item = c.op + (c.dtype.empty() ? "" : " " + c.dtype);
      bool found = false;
      for (auto& [prov, ops] : by)
        if (prov == c.provider) { ops += ", " + item; found = true; }
      if (!found) by.emplace_back(c.provider, item);
    }
    std::string s;
    for (const auto& [prov, ops] : by) s += (s.empty() ? "" : "; ") + prov + ": " + ops;
    return s;
  }

 private:
  static std::string float_dtype(std::span<const rlh_tensor> a, std::span<const rlh_tensor> b) {
    for (auto span : {a, b})
      for (const rlh_tensor& t : span)
        if (t.dtype.code == RLH_DTYPE_FLOAT || t.dtype.code == RLH_DTYPE_BFLOAT ||
            t.dtype.code == RLH_DTYPE_FLOAT8_E4M3FN || t.dtype.code == RLH_DTYPE_FLOAT8_E5M2)
          return dtype_name(t.dtype);
    return {};
  }
  std::vector<Provider> providers_;
  std::vector<std::pair<std::string, std::string>> pins_;
  // Engines on several threads share one registry (a process of several ranks' engines, the
  // FSDP and TP engine tests): resolve is const and records here under the lock.
  mutable std::mutex choices_mu_;
  mutable std::vector<Choice> choices_;
};

}  // namespace rlh::sdk
