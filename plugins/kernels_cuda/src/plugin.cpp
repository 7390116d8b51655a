// The kernels_cuda plugin: the CUDA ops of rlh_kernels_cuda_core behind the C ABI's KERNELS
// component (abi/include/rlhost/kernels.h). Operands, attributes and semantics are those of
// docs/ops.md; docs/kernels_cuda.md says what this provider adds and at what precision.
//
// Operands live in CUDA device memory of the instance's device (RLH_DEVICE_CUDA, or managed).
// dtypes: each op runs in f32 or bf16 (its "float" operands), with these extensions of the
// contract for bf16 ops: statistics (rmsnorm rstd, attention lse, the logprob outputs and their
// gradients) and parameter gradients (dw, db, dtable, dW, gemm's C) may be f32 instead of bf16
// (f32 is what the engine should pass); adamw takes a bf16 or f32 gradient; adamw, sumsq and
// scale take lists of tensors (multi-tensor: 4k outputs for adamw, k inputs for sumsq, k
// outputs for scale) and run each list in one launch.
// Work is queued on rlh_op_call.stream (a cudaStream_t; NULL = the legacy default stream);
// nothing synchronises. Scratch comes from rlh_op_call.workspace when it is large enough, else
// from a stream-ordered pool of this instance (cudaMallocFromPoolAsync / cudaFreeAsync).
// RLH_KCUDA_CHECK=1 synchronises after every op and reports launch errors and out-of-range ids
// or targets (which otherwise yield zero rows and no gradient).
// The ops' entry points are in ops_layers.cpp, ops_decode.cpp and ops_moe.cpp (op_call.hpp);
// this file holds the op table, the operand checks at resolution and the KERNELS table.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "op_call.hpp"
#include "rlhost/sdk/plugin.hpp"

namespace rlh::kcuda {
namespace {

sdk::MakeStatusFn g_make_status = nullptr;

}  // namespace

// ---------------------------------------------------------------------------------------------
// The op table. Operand kinds: f = the op's dtype (f32 or bf16), i = int32, k = float32,
// d = float64, s = statistic / parameter gradient (f32, or bf16 in a bf16 op), g = f32 or bf16
// in any op, q = a KV cache: the op's dtype, or FP8 e4m3 in a bf16 op (its scale one of the two
// float32 inputs last in the list: kv_cache_write, paged_attention).

struct OpSpec {
  const char* name;
  const char* inputs;
  size_t min_inputs;
  const char* outputs;
  size_t min_outputs;
  const char* backward;
  bool bf16;        // offered in bf16
  bool variadic_in;  // inputs repeat the last kind (sumsq)
  bool variadic_out; // outputs repeat the kind pattern (adamw: 4, scale: 1)
  void (*run)(const Call&);
  bool batch_invariant;
};

namespace {


const OpSpec kOps[] = {
    {"gemm", "ffs", 2, "s", 1, "gemm", true, false, false, run_gemm, false},
    {"embedding_fwd", "if", 2, "f", 1, "embedding_bwd", true, false, false, run_embedding_fwd, true},
    {"embedding_bwd", "if", 2, "s", 1, "", true, false, false, run_embedding_bwd, false},
    {"rmsnorm_fwd", "ff", 2, "fs", 1, "rmsnorm_bwd", true, false, false, run_rmsnorm_fwd, true},
    {"rmsnorm_bwd", "fffs", 4, "fs", 1, "", true, false, false, run_rmsnorm_bwd, false},
    {"gemm_glu_fwd", "ff", 2, "f", 1, "", true, false, false, run_gemm_glu_fwd, false},
    {"rmsnorm_gemm_fwd", "fff", 3, "f", 1, "", true, false, false, run_rmsnorm_gemm_fwd, false},
    {"gemm_add_fwd", "fff", 3, "f", 1, "", true, false, false, run_gemm_add_fwd, false},
    {"add_rmsnorm_fwd", "fff", 3, "ff", 2, "", true, false, false, run_add_rmsnorm_fwd, true},
    {"rope_fwd", "fik", 3, "f", 1, "rope_bwd", true, false, false, run_rope_fwd, true},
    {"rope_bwd", "fik", 3, "f", 1, "", true, false, false, run_rope_bwd, true},
    {"attention_fwd", "fffi", 4, "fs", 2, "attention_bwd", true, false, false, run_attention_fwd, false},
    {"attention_bwd", "fffffsi", 7, "fff", 3, "", true, false, false, run_attention_bwd, false},
    {"swiglu_fwd", "ff", 2, "f", 1, "swiglu_bwd", true, false, false, run_swiglu_fwd, true},
    {"swiglu_bwd", "fff", 3, "ff", 2, "", true, false, false, run_swiglu_bwd, true},
    {"geglu_fwd", "ff", 2, "f", 1, "geglu_bwd", true, false, false, run_geglu_fwd, true},
    {"geglu_bwd", "fff", 3, "ff", 2, "", true, false, false, run_geglu_bwd, true},
    {"bias_add_fwd", "f", 1, "f", 1, "bias_bwd", true, false, false, run_bias_add_fwd, true},
    {"bias_bwd", "f", 1, "s", 1, "", true, false, false, run_bias_bwd, false},
    {"add_fwd", "ff", 2, "f", 1, "", true, false, false, run_add_fwd, true},
    {"linear_logprob_fwd", "ffi", 3, "sssk", 2, "linear_logprob_bwd", true, false, false,
     run_linear_logprob_fwd, false},
    {"linear_logprob_bwd", "ffissssk", 4, "fs", 2, "", true, false, false, run_linear_logprob_bwd, false},
    {"adamw", "", 0, "kgkk", 4, "", false, false, true, run_adamw, true},
    {"adamw_bf16", "", 0, "kgkkg", 5, "", false, false, true, run_adamw_bf16, true},
    {"sumsq", "g", 1, "k", 1, "", false, true, false, run_sumsq, false},
    {"scale", "", 0, "g", 1, "", false, false, true, run_scale, true},
    {"kv_cache_write", "ffikk", 3, "qq", 2, "", true, false, false, run_kv_cache_write, true},
    {"rope_kv_cache_write", "ffikikk", 5, "fqq", 3, "", true, false, false, run_rope_kv_cache_write, true},
    {"paged_attention", "fqqiikk", 5, "f", 1, "", true, false, false, run_paged_attention, false},
    {"decode_layer_fwd", "fffffffiiik", 11, "fff", 3, "", true, false, false, run_decode_layer_fwd, false},
    {"sample", "kdi", 2, "ik", 2, "", false, false, false, run_sample, true},
    {"moe_router_fwd", "fs", 1, "siss", 3, "moe_router_bwd", true, false, false, run_moe_router_fwd, true},
    {"moe_router_bwd", "ssiss", 3, "f", 1, "", true, false, false, run_moe_router_bwd, true},
    {"moe_permute_fwd", "fi", 2, "fii", 3, "moe_permute_bwd", true, false, false, run_moe_permute_fwd, true},
    {"moe_permute_bwd", "fi", 2, "f", 1, "", true, false, false, run_moe_permute_bwd, true},
    {"moe_unpermute_fwd", "fis", 3, "f", 1, "moe_unpermute_bwd", true, false, false, run_moe_unpermute_fwd, true},
    {"moe_unpermute_bwd", "ffis", 4, "fs", 1, "", true, false, false, run_moe_unpermute_bwd, true},
    {"grouped_gemm", "ffi", 3, "s", 1, "grouped_gemm", true, false, false, run_grouped_gemm, false},
    {"clipped_pg_loss", "kkkkkikkk", 6, "kkk", 2, "", false, false, false, run_clipped_pg_loss, false},
    {"nll_loss", "kkki", 4, "kkk", 2, "", false, false, false, run_nll_loss, false},
};

const OpSpec* find_op(const char* name) {
  for (const OpSpec& s : kOps)
    if (name && std::strcmp(s.name, name) == 0) return &s;
  return nullptr;
}

bool same(rlh_dtype a, rlh_dtype b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

// Checks counts, devices and dtypes; returns the op's dtype or throws UNIMPLEMENTED.
DType check_operands(const OpSpec& s, const rlh_kernels* inst, const rlh_tensor* ins, size_t nin,
                     const rlh_tensor* outs, size_t nout) {
  auto unimpl = [&](const std::string& why) {
    throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda ") + s.name + ": " + why);
  };
  const size_t max_in = std::strlen(s.inputs), max_out = std::strlen(s.outputs);
  if (nin < s.min_inputs || (!s.variadic_in && nin > max_in)) unimpl("wrong number of inputs");
  if (nout < s.min_outputs || (!s.variadic_out && nout > max_out)) unimpl("wrong number of outputs");
  if (s.variadic_out && max_out > 0 && nout % max_out != 0) unimpl("outputs must repeat in groups");
  int fdt = -1;  // 0 f32, 1 bf16, 2 f64 (the MoE router only: the engine's router_fp64)
  const bool f64_ok = std::strncmp(s.name, "moe_router", 10) == 0;
  std::vector<std::pair<const rlh_tensor*, char>> flexes;
  size_t fp8_caches = 0;
  bool cache = false;  // the operand visited is a 'q' (a KV cache)
  auto visit = [&](const rlh_tensor& t, char kind) {
    if (kind == 'q') kind = 'f';  // a cache: the op's dtype, unless e4m3 (below)
    if (t.data == nullptr && kind != 'f') return;  // absent optional operand
    const int dev = t.device.device_type;
    if ((dev != RLH_DEVICE_CUDA && dev != RLH_DEVICE_CUDA_MANAGED) ||
        t.device.device_id != inst->device.device_id)
      unimpl("operands must be in CUDA memory of cuda:" + std::to_string(inst->device.device_id));
    if (kind == 'f' && cache && same(t.dtype, sdk::kE4M3)) {
      ++fp8_caches;
      return;
    }
    const bool f32 = same(t.dtype, sdk::kF32), bf = same(t.dtype, sdk::kBF16);
    const bool f64 = f64_ok && same(t.dtype, sdk::kF64);
    switch (kind) {
      case 'i':
        if (!same(t.dtype, sdk::kI32)) unimpl("index operands must be int32");
        break;
      case 'k':
        if (!f32) unimpl("this operand must be float32");
        break;
      case 'd':
        if (!same(t.dtype, sdk::kF64)) unimpl("this operand must be float64");
        break;
      case 'g':
        if (!f32 && !bf) unimpl("operands must be float32 or bfloat16");
        break;
      case 's':
        if (!f32 && !bf && !f64) unimpl("operands must be float32 or bfloat16");
        flexes.push_back({&t, kind});
        break;
      default: {
        const int d = f32 ? 0 : bf ? 1 : f64 ? 2 : -1;
        if (d < 0) unimpl(std::string("dtype ") + sdk::dtype_name(t.dtype) + " not offered");
        if (fdt >= 0 && d != fdt) unimpl("float operands must share one dtype");
        fdt = d;
      }
    }
  };
  for (size_t i = 0; i < nin; ++i) {
    const char kind = s.variadic_in ? s.inputs[std::min(i, max_in - 1)] : s.inputs[i];
    cache = kind == 'q';
    visit(ins[i], kind);
  }
  for (size_t i = 0; i < nout; ++i) {
    const char kind = s.variadic_out ? s.outputs[i % max_out] : s.outputs[i];
    cache = kind == 'q';
    visit(outs[i], kind);
  }
  if (fdt == 1 && !s.bf16) unimpl("bfloat16 is not offered for this op");
  // FP8 caches: both, in a bf16 op, each with its float32 scale (the two inputs last).
  if (std::strchr(s.inputs, 'q') || std::strchr(s.outputs, 'q')) {
    const size_t base = max_in - 2, scales = nin > base ? nin - base : 0;
    if (fp8_caches != 0 && fp8_caches != 2) unimpl("both caches bf16 or both e4m3");
    if (fp8_caches == 2 && fdt != 1) unimpl("e4m3 caches in a bf16 op only");
    if (fp8_caches == 2 && scales != 2) unimpl("e4m3 caches need their two float32 scales (k_scale, v_scale) after the inputs");
    if (fp8_caches == 0 && scales != 0) unimpl("scales are for e4m3 caches");
  }
  // In an f32 op every statistic is f32 too; an f64 op (router) is f64 throughout.
  if (fdt != 1)
    for (auto& [t, k] : flexes)
      if (!same(t->dtype, fdt == 2 ? sdk::kF64 : sdk::kF32))
        unimpl(fdt == 2 ? "a float64 op takes float64 operands only"
                        : "a float32 op takes float32 statistics and gradients");
  if (fdt == 1)
    for (auto& [t, k] : flexes)
      if (same(t->dtype, sdk::kF64)) unimpl("float64 operands only in a float64 op");
  return fdt == 1 ? DType::bf16 : fdt == 2 ? DType::f64 : DType::f32;
}

// ---------------------------------------------------------------------------------------------
// The KERNELS table

void log(const rlh_host_api* host, int32_t level, const std::string& msg) {
  if (host && host->log) host->log(host->ctx, level, msg.data(), msg.size());
}

rlh_status* k_create(const rlh_host_api* host, rlh_device device, const char*, size_t,
                     rlh_kernels** out) {
  const sdk::MakeStatusFn make = host ? host->make_status : nullptr;
  return sdk::guard(make, [&] {
    if (device.device_type != RLH_DEVICE_CUDA)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda runs on CUDA devices only");
    if (!g_make_status) g_make_status = make;
    int count = 0;
    const cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0)
      throw Error(RLH_E_UNAVAILABLE, std::string("kernels_cuda: no CUDA device: ") +
                                         (ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices"));
    if (device.device_id < 0 || device.device_id >= count)
      throw Error(RLH_E_INVALID_ARGUMENT, "kernels_cuda: no device cuda:" + std::to_string(device.device_id));
    cudaDeviceProp prop{};
    cuda_ck(cudaGetDeviceProperties(&prop, device.device_id), "device properties");
    if (prop.major != 9 || prop.minor != 0)
      throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda is built for sm_90a (Hopper); cuda:") +
                                           std::to_string(device.device_id) + " (" + prop.name +
                                           ") is sm_" + std::to_string(prop.major * 10 + prop.minor));
    int prev = 0;
    cudaGetDevice(&prev);
    cuda_ck(cudaSetDevice(device.device_id), "set device");
    auto k = std::make_unique<rlh_kernels>();
    k->host = host;
    k->device = device;
    k->info.device = device.device_id;
    k->info.sm_count = prop.multiProcessorCount;
    k->info.cc_major = prop.major;
    k->info.cc_minor = prop.minor;
    k->info.smem_optin = prop.sharedMemPerBlockOptin;
    k->check = std::getenv("RLH_KCUDA_CHECK") && std::strcmp(std::getenv("RLH_KCUDA_CHECK"), "0") != 0;
    cudaMemPoolProps pp{};
    pp.allocType = cudaMemAllocationTypePinned;
    pp.location.type = cudaMemLocationTypeDevice;
    pp.location.id = device.device_id;
    cuda_ck(cudaMemPoolCreate(&k->pool, &pp), "memory pool");
    uint64_t keep = UINT64_MAX;  // keep freed workspace cached in the pool
    cudaMemPoolSetAttribute(k->pool, cudaMemPoolAttrReleaseThreshold, &keep);
    cuda_ck(cudaMalloc(reinterpret_cast<void**>(&k->err), sizeof(int)), "error flag");
    cuda_ck(cudaMemset(k->err, 0, sizeof(int)), "error flag");
    try {
      k->gemm = gemm_engine_create(k->info);
    } catch (const std::exception& e) {
      cudaFree(k->err);
      cudaMemPoolDestroy(k->pool);
      throw Error(RLH_E_UNAVAILABLE, std::string("kernels_cuda: ") + e.what());
    }
    cudaSetDevice(prev);
    log(host, RLH_LOG_INFO,
        std::string("kernels_cuda: cuda:") + std::to_string(device.device_id) + " " + prop.name +
            " (sm_90, " + std::to_string(prop.multiProcessorCount) + " SMs); " +
            gemm_engine_info(k->gemm));
    *out = k.release();
  });
}

void k_destroy(rlh_kernels* k) {
  if (!k) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(k->device.device_id);
  gemm_engine_destroy(k->gemm);
  cudaFree(k->err);
  cudaMemPoolDestroy(k->pool);
  cudaSetDevice(prev);
  delete k;
}

// The fused products (a decoding step's gate|up with its GLU, a norm with the product after it, a
// product with the residual add after it) are written for bf16 alone: they list no f32, so a
// conformance runner does not expect f32 cases of them to pass.
bool offers_f32(const OpSpec& s) {
  for (const char* n : {"gemm_glu_fwd", "rmsnorm_gemm_fwd", "gemm_add_fwd", "decode_layer_fwd"})
    if (std::strcmp(s.name, n) == 0) return false;
  return true;
}

rlh_status* k_list_ops(rlh_kernels*, rlh_write_fn write, void* user) {
  return sdk::guard(g_make_status, [&] {
    std::string j = "[";
    for (const OpSpec& s : kOps) {
      if (j.size() > 1) j += ",";
      const std::string f32 = offers_f32(s) ? "\"f32\"" : "";
      j += std::string("{\"name\":\"") + s.name + "\",\"dtypes\":[" + f32 +
           (s.bf16 ? std::string(f32.empty() ? "" : ",") + "\"bf16\"" : "") +
           // paged attention over FP8 caches (the conformance runner's bf16 x e4m3 variant)
           (std::strcmp(s.name, "paged_attention") == 0 ? ",\"bf16xe4m3\"" : "") +
           (std::strncmp(s.name, "moe_router", 10) == 0 ? ",\"f64\"" : "") +
           "],\"backward\":\"" + s.backward + "\"}";
    }
    j += "]";
    write(user, j.data(), j.size());
  });
}

bool withheld(const char* name) {
  static const std::string list = [] {
    const char* e = std::getenv("RLH_KCUDA_WITHHOLD");
    return "," + std::string(e ? e : "") + ",";
  }();
  return list.find("," + std::string(name) + ",") != std::string::npos;
}

// Runs f with the instance's device current, restoring the caller's after.
template <class F>
void on_device(const rlh_kernels* k, F&& f) {
  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != k->device.device_id) cuda_ck(cudaSetDevice(k->device.device_id), "set device");
  struct Restore {
    int prev, dev;
    ~Restore() { if (prev >= 0 && prev != dev) cudaSetDevice(prev); }
  } restore{prev, k->device.device_id};
  f();
}

rlh_status* k_get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out) {
  return sdk::guard(g_make_status, [&] {
    const OpSpec* s = find_op(d->name);
    if (!s) throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda has no op '") + (d->name ? d->name : "") + "'");
    // RLH_KCUDA_WITHHOLD="op,op": this provider answers none of them, so a registry falls through
    // to the next provider and an optional fused op's callers run the ops it fuses (the A/B of
    // the decoding benchmark; docs/kernels_cuda.md).
    if (withheld(s->name))
      throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda: ") + s->name + " withheld (RLH_KCUDA_WITHHOLD)");
    if (d->device.device_type != RLH_DEVICE_CUDA || d->device.device_id != k->device.device_id)
      throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda: op asked for another device");
    const DType dt = check_operands(*s, k, d->inputs, d->num_inputs, d->outputs, d->num_outputs);
    if (!offers_f32(*s) && dt != DType::bf16)
      throw Error(RLH_E_UNIMPLEMENTED, std::string("kernels_cuda ") + s->name + ": bf16 only");
    auto op = std::make_unique<rlh_op>();
    op->spec = s;
    op->dt = dt;
    op->inst = k;
    for (size_t i = 0; i < d->num_attrs; ++i) {
      const rlh_named_value& a = d->attrs[i];
      if (!a.name) continue;
      op->attrs.push_back(Attr{a.name, a.type, a.int64_value, a.double_value});
    }
    // Soft-capping (Gemma-2's "softcap") is offered by attention (on the CUDA-core kernels: the
    // tensor-core ones do not cap), paged_attention, linear_logprob and sample; a value that is
    // not a finite number >= 0 is refused here, before a step.
    for (const Attr& a : op->attrs)
      if (a.name == "softcap") {
        const double c = a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i);
        if (!(c >= 0) || !std::isfinite(c))
          throw Error(RLH_E_INVALID_ARGUMENT, std::string("kernels_cuda ") + s->name + ": softcap must be a finite number >= 0");
      }
    // Answers known at resolution: gemm's batch invariance for C = A B^T only (a registry then
    // falls through for the rest), filtered logprobs, attention head dims.
    if (std::strcmp(s->name, "gemm") == 0) {
      auto attr = [&](const char* n, double dflt) {
        for (const Attr& x : op->attrs)
          if (x.name == n) return x.type == RLH_VALUE_DOUBLE ? x.d : double(x.i);
        return dflt;
      };
      if (attr("batch_invariant", 0) != 0 &&
          (attr("transpose_a", 0) != 0 || attr("transpose_b", 1) == 0 ||
           (d->shapes_valid && d->num_inputs > 0 && d->inputs[0].ndim != 2)))
        throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda gemm: batch_invariant is offered for 2-D C = A B^T only");
    }
    if (std::strncmp(s->name, "linear_logprob", 14) == 0) {
      for (const Attr& a : op->attrs) {
        const double v = a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i);
        if ((a.name == "top_k" && v > 0) || (a.name == "top_p" && v < 1))
          throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda linear_logprob: top_k/top_p filtering is not offered");
      }
    }
    if (std::strcmp(s->name, "clipped_pg_loss") == 0) {
      // The config is checked now (a bad one is INVALID_ARGUMENT naming the loss_fn key) and an
      // option losses.cu lacks is an answer, so the caller keeps its host loss.
      std::vector<rlh_named_value> attrs(d->attrs, d->attrs + d->num_attrs);
      const losses::ClippedPGConfig cfg = losses::clipped_pg_config_from_attrs(
          [&](const char* k, double dflt) {
            const rlh_named_value* a = sdk::find_attr(attrs.data(), attrs.size(), k);
            return a == nullptr ? dflt : a->type == RLH_VALUE_DOUBLE ? a->double_value : double(a->int64_value);
          },
          nullptr);
      const std::string why = loss_op_refusal(cfg);
      if (!why.empty()) throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda clipped_pg_loss: " + why);
    }
    if (d->shapes_valid && std::strncmp(s->name, "attention", 9) == 0) {
      const rlh_tensor& q = d->inputs[std::strcmp(s->name, "attention_bwd") == 0 ? 1 : 0];
      const rlh_tensor& v = d->inputs[std::strcmp(s->name, "attention_bwd") == 0 ? 3 : 2];
      if (q.ndim == 3 && v.ndim == 3 && (q.shape[2] > 256 || v.shape[2] > 256))
        throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda attention: head dims above 256");
    }
    if (std::strcmp(s->name, "paged_attention") == 0 && d->num_inputs > 1 && same(d->inputs[1].dtype, sdk::kE4M3)) {
      // FP8 caches: the tensor-core kernel alone reads them (paged_attention_mma.cu).
      for (const Attr& a : op->attrs)
        if (a.name == "softcap" && (a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i)) != 0)
          throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda paged_attention: FP8 caches without soft-capping only");
      if (d->shapes_valid) {
        const rlh_tensor &q = d->inputs[0], &kc = d->inputs[1], &vc = d->inputs[2];
        const bool row_major = kc.ndim == 4 && vc.ndim == 4 && (!kc.strides || kc.strides[3] == 1) &&
                               (!vc.strides || vc.strides[3] == 1);
        bool chunks = true;  // 16-byte rows, blocks and heads (the codes come in by 16-byte copies)
        for (int i = 0; i < 3 && row_major; ++i)
          chunks = chunks && (!kc.strides || kc.strides[i] % 16 == 0) && (!vc.strides || vc.strides[i] % 16 == 0);
        if (q.ndim != 3 || !row_major || !chunks || q.shape[2] != vc.shape[3] || (q.shape[2] != 64 && q.shape[2] != 128))
          throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda paged_attention: FP8 caches at head dims 64 and 128 (Dk = Dv), "
                                           "rows of D contiguous, strides multiples of 16");
      }
    }
    if (std::strcmp(s->name, "decode_layer_fwd") == 0) {
      // One token's dense layer in one persistent launch (decode_layer.cu): silu, no window, no
      // soft-cap; sizes it cannot run are an answer (the caller runs the ops it fuses).
      for (const Attr& a : op->attrs) {
        const double v = a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i);
        if ((a.name == "activation" || a.name == "window" || a.name == "softcap") && v != 0)
          throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda decode_layer_fwd: " + a.name + " is not offered");
      }
      if (k->info.cc_major < 9)
        throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda decode_layer_fwd: compute capability 9 or more");
      if (d->shapes_valid) {
        std::string why = decode_layer_shape_refusal(d->inputs, d->num_inputs, d->outputs, d->num_outputs);
        if (why.empty()) on_device(k, [&] { why = decode_layer_device_refusal(d->outputs[1].shape[3]); });
        if (!why.empty()) throw Error(RLH_E_UNIMPLEMENTED, "kernels_cuda decode_layer_fwd: " + why);
      }
      on_device(k, [&] {
        void* mem = nullptr;
        cuda_ck(cudaMalloc(&mem, 256), "decode_layer_fwd barrier");
        op->sync = static_cast<unsigned*>(mem);
        cuda_ck(cudaMemset(op->sync, 0, 256), "decode_layer_fwd barrier");
        // (the memset is on the legacy stream; a caller's non-blocking stream would not wait
        // for it before the first launch)
        cuda_ck(cudaStreamSynchronize(nullptr), "decode_layer_fwd barrier");
      });
    }
    *out = op.release();
  });
}

rlh_status* k_op_info(rlh_op* op, rlh_op_info* out) {
  return sdk::guard(g_make_status, [&] {
    rlh_op_info info{};
    // No atomics in any result (every output element has one writer, reductions run in a fixed
    // order), so reruns are bitwise equal. Row-wise ops are batch-invariant; GEMMs (cuBLASLt
    // picks kernels by shape), attention (tiles follow token positions), reductions and the
    // logprob head (its GEMM) are not.
    // gemm asked for batch invariance runs grouped_gemm.cu's fixed-order tiles (run_gemm_rows);
    // paged_attention asked for it keeps every row in one partition (paged_attention_mma.cu).
    bool rows = false;
    if (std::strcmp(op->spec->name, "gemm") == 0 || std::strcmp(op->spec->name, "paged_attention") == 0)
      for (const Attr& a : op->attrs)
        rows = rows || (a.name == "batch_invariant" && (a.type == RLH_VALUE_DOUBLE ? a.d : double(a.i)) != 0);
    info.batch_invariant = op->spec->batch_invariant || rows ? 1 : 0;
    info.deterministic = 1;
    info.stateful = 0;
    info.workspace_bytes = 0;
    const size_t n = std::min(out->struct_size, sizeof(rlh_op_info));
    if (n > sizeof(size_t))
      std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t),
                  reinterpret_cast<const char*>(&info) + sizeof(size_t), n - sizeof(size_t));
  });
}

rlh_status* k_run(rlh_op* op, const rlh_op_call* call) {
  return sdk::guard(g_make_status, [&] {
    const OpSpec& s = *op->spec;
    rlh_kernels* k = op->inst;
    if (check_operands(s, k, call->inputs, call->num_inputs, call->outputs, call->num_outputs) != op->dt)
      throw Error(RLH_E_INVALID_ARGUMENT, std::string(s.name) + ": dtype differs from the resolved op");
    on_device(k, [&] {
      const auto stream = static_cast<cudaStream_t>(call->stream);
      {
        CallWorkspace ws(k, call->workspace, call->workspace_bytes, stream);
        Call c{op, call, &ws, stream};
        s.run(c);
      }
      if (k->check) {
        cuda_ck(cudaStreamSynchronize(stream), s.name);
        cuda_ck(cudaGetLastError(), s.name);
        int flag = 0;
        cuda_ck(cudaMemcpy(&flag, k->err, sizeof(int), cudaMemcpyDeviceToHost), "error flag");
        if (flag) {
          cudaMemset(k->err, 0, sizeof(int));
          bad(std::string(s.name) + ": an id or target is outside [0, V)");
        }
      }
    });
  });
}

void k_release_op(rlh_op* op) { delete op; }

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
    if (out == nullptr) throw Error(RLH_E_INVALID_ARGUMENT, "memory_alloc: out is NULL");
    on_device(k, [&] {
      const cudaError_t e = cudaMalloc(out, std::max<size_t>(bytes, 1));
      if (e != cudaSuccess)
        throw Error(RLH_E_RESOURCE_EXHAUSTED, "kernels_cuda: cudaMalloc of " + std::to_string(bytes) +
                                                  " bytes: " + cudaGetErrorString(e));
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

rlh_status* k_memory_copy(rlh_kernels* k, void* dst, const void* src, size_t bytes, int32_t dir,
                          void* stream) {
  return sdk::guard(g_make_status, [&] {
    cudaMemcpyKind kind;
    switch (dir) {
      case RLH_COPY_HOST_TO_DEVICE: kind = cudaMemcpyHostToDevice; break;
      case RLH_COPY_DEVICE_TO_HOST: kind = cudaMemcpyDeviceToHost; break;
      case RLH_COPY_DEVICE_TO_DEVICE: kind = cudaMemcpyDeviceToDevice; break;
      default: throw Error(RLH_E_INVALID_ARGUMENT, "memory_copy: unknown direction " + std::to_string(dir));
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
  a.workspace_size = nullptr;  // scratch comes from the call's workspace or the instance's pool
  return a;
}();

// Can it run here? Cheap: counts devices (which loads libcuda.so.1 through the static runtime,
// if present) and reads their compute capability; keeps nothing.
rlh_status* probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user) {
  return sdk::guard(host ? host->make_status : nullptr, [&] {
    auto say = [&](const std::string& m) { if (write) write(user, m.data(), m.size()); };
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      *score = 0;
      say(std::string("no CUDA device: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
      return;
    }
    std::string found;
    int hopper = 0;
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp p{};
      if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
      found += std::string(found.empty() ? "" : ", ") + "cuda:" + std::to_string(i) + " " + p.name +
               " sm_" + std::to_string(p.major * 10 + p.minor);
      hopper += p.major == 9 && p.minor == 0;
    }
    if (hopper == 0) {
      *score = 0;
      say("kernels_cuda is built for sm_90a (Hopper) only; found " + found);
      return;
    }
    *score = 10;
    say(found);
  });
}

const rlh_component_desc kComponent =
    sdk::component_desc(RLH_KIND_KERNELS, "kernels_cuda", "0.1.0", RLH_KERNELS_API_VERSION_MAJOR,
                        RLH_KERNELS_API_VERSION_MINOR, &kApi,
                        "CUDA kernels for Hopper (sm_90a): cuBLASLt GEMMs, flash attention on "
                        "tensor cores, fused norms/rope/swiglu/logprob head, multi-tensor AdamW");
const rlh_component_desc* const kComponents[] = {&kComponent};

rlh_plugin_desc make_desc() {
  rlh_plugin_desc d = sdk::plugin_desc("kernels_cuda", "0.1.0", "rlhost", kComponents,
                                       "CUDA kernel provider (bf16/f32, sm_90a)");
  d.probe = probe;
  return d;
}

}  // namespace
}  // namespace rlh::kcuda

RLH_DEFINE_PLUGIN(rlh::kcuda::make_desc());
