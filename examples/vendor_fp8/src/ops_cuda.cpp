// vendor_fp8's ops on a CUDA device (plugin.cpp lists them; README.md is their contract): the
// operand checks that decide what this provider answers (anything else is UNIMPLEMENTED, so the
// registry falls through to the next provider), the runs, the delayed-scaling state, and the
// memory services a caller that knows nothing of CUDA (the conformance runner) stages through.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fp8_gemm.hpp"
#include "fp8_kernels.hpp"
#include "ops.hpp"
#include "rlhost/sdk/kernels.hpp"

struct rlh_kernels {
  const rlh_host_api* host = nullptr;
  rlh_device device{};
  int cc = 0;  // compute capability, major * 10 + minor
  std::unique_ptr<vfp8::Gemm> gemm;
};

namespace vendor_fp8 {
namespace {

using rlh::sdk::Error;
using rlh::sdk::operator==;
using vfp8::Fmt;
using vfp8::Grouping;
using vfp8::Scaling;

rlh::sdk::MakeStatusFn g_make = nullptr;

[[noreturn]] void unimpl(const std::string& why) { throw Error(RLH_E_UNIMPLEMENTED, "vendor_fp8 " + why); }
[[noreturn]] void bad(const std::string& why) { throw Error(RLH_E_INVALID_ARGUMENT, "vendor_fp8 " + why); }

void cuda_ck(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw Error(RLH_E_INTERNAL, "vendor_fp8 " + what + ": " + cudaGetErrorString(e));
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

enum class Kind { gemm, amax, quantize };

constexpr int32_t kMaxHistory = 65536;
constexpr char kStateMagic[8] = {'V', 'F', 'P', '8', 'D', 'S', '1', 0};

}  // namespace
}  // namespace vendor_fp8

struct rlh_op {
  vendor_fp8::Kind kind = vendor_fp8::Kind::gemm;
  rlh_kernels* inst = nullptr;
  // Resolution's attributes (a call's override them, except those fixing the op's state).
  double alpha = 1, beta = 0, margin = 0;
  int64_t scaling = 0, grouping = 0, transpose = 0;
  int64_t transpose_a = 0, transpose_b = 0, batch_invariant = 0;  // gemm (docs/ops.md's defaults)
  bool weight_only = false;  // gemm's form A bf16, B e4m3, scale_b (resolved with three inputs)
  // gemm's few-row kernel (fp8_few_rows.cu) for block-scaled products: 0 never (cuBLASLt), 1 up
  // to vfp8::few_rows_bound() rows, 2 at any rows the kernel takes.
  int64_t few_rows = 1;
  // The weight-only form with A's 1x128 tiles quantised to e4m3 in the product (the few-row
  // kernel's QA form: README.md, `quantize_a`): W8A8 numerics, no quantisation pass.
  bool quantize_a = false;
  // quantize_fp8 fused into the op that produces x (README.md: `producer`): 0 none, 1 rmsnorm,
  // 2 add_rmsnorm, 3 swiglu; eps and weight_offset are the norms'.
  int64_t producer = 0;
  double eps = 1e-6, weight_offset = 0;
  // quantize_fp8 with delayed scaling: the amax history ring on the device.
  bool delayed = false, most_recent = false;
  int32_t history_len = 0;
  float* hist = nullptr;
  int32_t* pos_count = nullptr;  // {next slot, entries filled}
  // The host's count of the entries filled (runs since creation, or the loaded state's): past 0,
  // a run takes the one-pass path. A run replayed in a CUDA graph does not count, which only
  // keeps the (equally exact) two-pass path longer.
  int32_t filled_host = 0;
};

namespace vendor_fp8 {
namespace {

bool is_fp8(rlh_dtype d) { return d == rlh::sdk::kE4M3 || d == rlh::sdk::kE5M2; }
Fmt fmt_of(rlh_dtype d) { return d == rlh::sdk::kE4M3 ? Fmt::e4m3 : Fmt::e5m2; }
template <class T = void>
T* ptr(const rlh_tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}
bool present(const rlh_tensor& t) { return t.data != nullptr; }

// A call's attribute, else the default given (the resolution's value).
int64_t pick_i(const rlh_op_call* c, const char* n, int64_t d) {
  return c ? rlh::sdk::attr_int_or(c->attrs, c->num_attrs, n, d) : d;
}
double pick_d(const rlh_op_call* c, const char* n, double d) {
  return c ? rlh::sdk::attr_double_or(c->attrs, c->num_attrs, n, d) : d;
}

void need_device(const rlh_kernels* k, const rlh_tensor& t, const char* op) {
  const int dev = t.device.device_type;
  if ((dev != RLH_DEVICE_CUDA && dev != RLH_DEVICE_CUDA_MANAGED) || t.device.device_id != k->device.device_id)
    unimpl(std::string(op) + ": operands must be in CUDA memory of cuda:" + std::to_string(k->device.device_id));
}

// A matrix operand [rows, cols] with unit column stride (1-D: one row): its row stride.
int64_t matrix_ld(const rlh_tensor& t, int64_t* rows, int64_t* cols, const std::string& what) {
  if (t.ndim == 1) {
    *rows = 1;
    *cols = t.shape[0];
    if (t.strides && t.strides[0] != 1) unimpl(what + ": a strided vector");
    return *cols;
  }
  if (t.ndim != 2) unimpl(what + ": expects a matrix (got " + std::to_string(t.ndim) + " dims)");
  *rows = t.shape[0];
  *cols = t.shape[1];
  if (t.strides && t.strides[1] != 1) unimpl(what + ": the last dimension must have stride 1");
  const int64_t ld = t.strides ? t.strides[0] : *cols;
  if (ld < *cols && *rows > 1) bad(what + ": row stride " + std::to_string(ld) + " < " + std::to_string(*cols));
  return ld;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A 2-D product's shapes from A [M, K], B [N, K] (transpose_b) and C [M, N], and their row
// strides; `form` names the gemm form in the errors.
struct ProductShape {
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
};
ProductShape product_shape(const rlh_tensor* in, const rlh_tensor* out, const std::string& form) {
  ProductShape p;
  int64_t K2, Mc, Nc;
  p.lda = matrix_ld(in[0], &p.M, &p.K, "gemm A");
  p.ldb = matrix_ld(in[1], &p.N, &K2, "gemm B");
  p.ldc = matrix_ld(out[0], &Mc, &Nc, "gemm C");
  if (in[0].ndim != 2 || in[1].ndim != 2 || out[0].ndim != 2) unimpl(form + ": answers 2-D products only");
  if (K2 != p.K || Mc != p.M || Nc != p.N)
    bad("gemm: shapes A [" + std::to_string(p.M) + ", " + std::to_string(p.K) + "], B [" + std::to_string(p.N) + ", " +
        std::to_string(K2) + "] (transpose_b), C [" + std::to_string(Mc) + ", " + std::to_string(Nc) + "] disagree");
  if (p.M == 0 || p.N == 0 || p.K == 0) unimpl(form + ": empty product");
  return p;
}

// ---- gemm: A, B, scale_a, scale_b -> C (docs/ops.md's fp8 variant; README.md).

vfp8::GemmArgs gemm_args(const rlh_kernels* k, const rlh_tensor* in, size_t nin, const rlh_tensor* out, size_t nout,
                         const rlh_op& op, const rlh_op_call* call, bool shapes) {
  if (nin != 4 || nout != 1)
    unimpl("gemm: expects A, B, scale_a, scale_b -> C (got " + std::to_string(nin) + " inputs, " +
           std::to_string(nout) + " outputs)");
  for (size_t i = 0; i < nin; ++i) need_device(k, in[i], "gemm");
  need_device(k, out[0], "gemm");
  const rlh_dtype da = in[0].dtype, db = in[1].dtype;
  if (!is_fp8(da) || !is_fp8(db))
    unimpl(std::string("gemm: answers FP8 operands only (got ") + rlh::sdk::dtype_name(da) + " x " +
           rlh::sdk::dtype_name(db) + ")");
  if (da == rlh::sdk::kE5M2 && db == rlh::sdk::kE5M2) unimpl("gemm: cuBLASLt has no e5m2 x e5m2 product");
  if (!(in[2].dtype == rlh::sdk::kF32) || !(in[3].dtype == rlh::sdk::kF32)) unimpl("gemm: scales must be float32");
  const rlh_dtype dc = out[0].dtype;
  if (!(dc == rlh::sdk::kF32) && !(dc == rlh::sdk::kBF16))
    unimpl(std::string("gemm: C must be float32 or bf16 (got ") + rlh::sdk::dtype_name(dc) + ")");
  if (pick_i(call, "transpose_a", op.transpose_a) != 0 || pick_i(call, "transpose_b", op.transpose_b) != 1)
    unimpl("gemm: answers transpose_a = 0, transpose_b = 1 only (both operands K-major, cuBLASLt's FP8 layout)");
  if (pick_i(call, "batch_invariant", op.batch_invariant) != 0) unimpl("gemm: not batch-invariant");
  vfp8::GemmArgs g;
  g.scaling = Scaling(op.scaling);
  g.fa = fmt_of(da);
  g.fb = fmt_of(db);
  g.c_bf16 = dc == rlh::sdk::kBF16;
  g.alpha = float(pick_d(call, "alpha", op.alpha));
  g.beta = float(pick_d(call, "beta", op.beta));
  // (block-scaled products keep the promotion: their scales are applied at it; a scale per row or
  // per tensor is applied once, in the epilogue)
  g.fast_accum = (g.scaling == Scaling::tensor || g.scaling == Scaling::rows) && pick_i(call, "fast_accum", 0) != 0;
  g.autotune = pick_i(call, "autotune", 0) != 0;
  if (g.scaling != Scaling::tensor) {
    if (da != rlh::sdk::kE4M3 || db != rlh::sdk::kE4M3) unimpl("gemm: block and row scaling take e4m3 operands only");
    if (k->cc / 10 != 9) unimpl("gemm: cuBLASLt's 1x128 / 128x128 block and row scaling run on Hopper (sm_90) only");
  }
  if (!shapes) return g;
  const ProductShape ps = product_shape(in, out, "gemm");
  const int64_t M = ps.M, N = ps.N, K = ps.K;
  g.lda = ps.lda;
  g.ldb = ps.ldb;
  g.ldc = ps.ldc;
  if (K % 16 != 0 || g.lda % 16 != 0 || g.ldb % 16 != 0 || (g.ldc * (g.c_bf16 ? 2 : 4)) % 16 != 0)
    unimpl("gemm: FP8 products need K and the leading dimensions at multiples of 16 bytes (K " + std::to_string(K) +
           ", lda " + std::to_string(g.lda) + ", ldb " + std::to_string(g.ldb) + ", ldc " + std::to_string(g.ldc) + ")");
  g.M = M;
  g.N = N;
  g.K = K;
  const Grouping ga = g.scaling == Scaling::tensor ? Grouping::tensor
                      : g.scaling == Scaling::rows ? Grouping::row
                                                   : Grouping::tile1x128;
  const Grouping gb = g.scaling == Scaling::tensor       ? Grouping::tensor
                      : g.scaling == Scaling::tiles_blocks ? Grouping::block128
                      : g.scaling == Scaling::rows         ? Grouping::row
                                                           : Grouping::tile1x128;
  const int64_t na = vfp8::scale_count(ga, M, K), nb = vfp8::scale_count(gb, N, K);
  if (rlh::sdk::tensor_numel(in[2]) != na || rlh::sdk::tensor_numel(in[3]) != nb)
    bad("gemm: scaling " + std::to_string(op.scaling) + " takes " + std::to_string(na) + " scales for A and " +
        std::to_string(nb) + " for B (got " + std::to_string(rlh::sdk::tensor_numel(in[2])) + ", " +
        std::to_string(rlh::sdk::tensor_numel(in[3])) + ")");
  g.a = ptr(in[0]);
  g.b = ptr(in[1]);
  g.sa = ptr<const float>(in[2]);
  g.sb = ptr<const float>(in[3]);
  g.c = ptr(out[0]);
  return g;
}

// Whether a block-scaled product runs on the few-row kernel (fp8_few_rows.cu) rather than
// cuBLASLt: `few_rows` 1 up to vfp8::few_rows_bound() rows, 2 at any rows, where it takes the shape.
bool takes_few_rows(const vfp8::GemmArgs& g, int64_t few_rows) {
  if (few_rows < 0 || few_rows > 2) bad("gemm: few_rows must be 0, 1 or 2, got " + std::to_string(few_rows));
  if (few_rows == 0 || (few_rows == 1 && g.M > vfp8::few_rows_bound())) return false;
  return vfp8::few_rows_unsupported(g).empty();
}

// The weight-only form's product with A quantised in it (`quantize_a`): the few-row kernel's
// arguments, A's scales 2^margin over amax / 448.
vfp8::GemmArgs quantized_in_product(const vfp8::WeightOnlyArgs& w, double margin_mult) {
  vfp8::GemmArgs g;
  g.M = w.M;
  g.N = w.N;
  g.K = w.K;
  g.a = w.a;
  g.lda = w.lda;
  g.b = w.b;
  g.ldb = w.ldb;
  g.sb = w.sb;
  g.scaling = Scaling::tiles_blocks;
  g.c = w.c;
  g.ldc = w.ldc;
  g.c_bf16 = w.c_bf16;
  g.alpha = w.alpha;
  g.beta = w.beta;
  g.a_bf16 = true;
  g.a_margin_mult = float(margin_mult);
  return g;
}

// ---- gemm, weight-only: A bf16, B e4m3, scale_b -> C (README.md): B's codes dequantised in the
// product's registers, A read as it is (fp8_weight_only.cu); or with `quantize_a`, A's tiles
// quantised in the product (fp8_few_rows.cu).
vfp8::WeightOnlyArgs weight_only_args(const rlh_kernels* k, const rlh_tensor* in, size_t nin, const rlh_tensor* out,
                                      size_t nout, const rlh_op& op, const rlh_op_call* call, bool shapes) {
  if (nin != 3 || nout != 1)
    unimpl("gemm (weight-only): expects A, B, scale_b -> C (got " + std::to_string(nin) + " inputs, " +
           std::to_string(nout) + " outputs)");
  for (size_t i = 0; i < nin; ++i) need_device(k, in[i], "gemm");
  need_device(k, out[0], "gemm");
  if (!(in[0].dtype == rlh::sdk::kBF16) || !(in[1].dtype == rlh::sdk::kE4M3))
    unimpl(std::string("gemm (weight-only): answers A bf16 x B e4m3 (got ") + rlh::sdk::dtype_name(in[0].dtype) +
           " x " + rlh::sdk::dtype_name(in[1].dtype) + ")");
  if (!(in[2].dtype == rlh::sdk::kF32)) unimpl("gemm (weight-only): B's scales must be float32");
  const rlh_dtype dc = out[0].dtype;
  if (!(dc == rlh::sdk::kF32) && !(dc == rlh::sdk::kBF16))
    unimpl(std::string("gemm (weight-only): C must be float32 or bf16 (got ") + rlh::sdk::dtype_name(dc) + ")");
  if (pick_i(call, "transpose_a", op.transpose_a) != 0 || pick_i(call, "transpose_b", op.transpose_b) != 1)
    unimpl("gemm (weight-only): answers transpose_a = 0, transpose_b = 1 only (B is a weight [N, K])");
  if (pick_i(call, "batch_invariant", op.batch_invariant) != 0) unimpl("gemm (weight-only): not batch-invariant");
  if (op.scaling != 0 && op.scaling != 1)
    unimpl("gemm (weight-only): takes scaling 0 (one scale for B) or 1 (B's 128x128 blocks)");
  if (op.quantize_a && op.scaling != 1) unimpl("gemm (weight-only, quantize_a = 1): takes scaling 1 only");
  if (k->cc / 10 != 9) unimpl("gemm (weight-only): runs on Hopper (sm_90) only (it reduces across thread-block clusters)");
  vfp8::WeightOnlyArgs w;
  w.block_scales = op.scaling == 1;
  w.c_bf16 = dc == rlh::sdk::kBF16;
  w.alpha = float(pick_d(call, "alpha", op.alpha));
  w.beta = float(pick_d(call, "beta", op.beta));
  if (!shapes) return w;
  const ProductShape ps = product_shape(in, out, "gemm (weight-only)");
  const int64_t N = ps.N, K = ps.K;
  w.M = ps.M;
  w.N = N;
  w.K = K;
  w.lda = ps.lda;
  w.ldb = ps.ldb;
  w.ldc = ps.ldc;
  if (const std::string why = op.quantize_a ? vfp8::few_rows_unsupported(quantized_in_product(w, 1))
                                            : vfp8::weight_only_unsupported(w);
      !why.empty())
    unimpl(std::string("gemm (weight-only") + (op.quantize_a ? ", quantize_a = 1" : "") + "): " + why);
  const int64_t nb = vfp8::scale_count(w.block_scales ? Grouping::block128 : Grouping::tensor, N, K);
  if (rlh::sdk::tensor_numel(in[2]) != nb)
    bad("gemm (weight-only): scaling " + std::to_string(op.scaling) + " takes " + std::to_string(nb) +
        " scales for B (got " + std::to_string(rlh::sdk::tensor_numel(in[2])) + ")");
  w.a = ptr(in[0]);
  w.b = ptr(in[1]);
  w.sb = ptr<const float>(in[2]);
  w.c = ptr(out[0]);
  return w;
}

// ---- amax: x -> out f32 [1].

vfp8::Source amax_source(const rlh_kernels* k, const rlh_tensor* in, size_t nin, const rlh_tensor* out, size_t nout,
                         bool shapes) {
  if (nin != 1 || nout != 1) unimpl("amax: expects x -> out");
  need_device(k, in[0], "amax");
  need_device(k, out[0], "amax");
  const rlh_dtype dx = in[0].dtype;
  if (!(dx == rlh::sdk::kF32) && !(dx == rlh::sdk::kBF16))
    unimpl(std::string("amax: x must be float32 or bf16 (got ") + rlh::sdk::dtype_name(dx) + ")");
  if (!(out[0].dtype == rlh::sdk::kF32))
    unimpl(std::string("amax: out must be float32 (got ") + rlh::sdk::dtype_name(out[0].dtype) + ")");
  vfp8::Source s;
  s.type = dx == rlh::sdk::kF32 ? vfp8::In::f32 : vfp8::In::bf16;
  if (!shapes) return s;
  s.ldx = matrix_ld(in[0], &s.R, &s.C, "amax x");
  if (rlh::sdk::tensor_numel(out[0]) != 1) bad("amax: out must hold one element");
  s.x = ptr(in[0]);
  return s;
}

// ---- quantize_fp8: x -> q, scale, amax (optional); or x, scale -> q (the scale given).

struct QuantCall {
  vfp8::Source src;
  Fmt fmt = Fmt::e4m3;
  void* q = nullptr;
  int64_t ldq = 0;
  float* scale = nullptr;
  float* amax = nullptr;
  const float* given = nullptr;  // the scale to quantise with (a second input), else null
  void* qt = nullptr;            // transpose = 2: x^T as well
  int64_t ldqt = 0;
};

// `transpose` is the call's (a call may override the handle's: a delayed-scaling site's handle
// writes x, or x and x^T, with one history).
QuantCall quant_call(const rlh_kernels* k, const rlh_tensor* in, size_t nin, const rlh_tensor* out, size_t nout,
                     const rlh_op& op, int64_t transpose, bool shapes) {
  if (transpose < 0 || transpose > 2) bad("quantize_fp8: transpose must be 0 (x), 1 (x^T) or 2 (both)");
  const bool given = nin == 2, both = transpose == 2;
  if (both ? (nin != 1 || nout != 4) : given ? nout != 1 : (nin != 1 || (nout != 2 && nout != 3)))
    unimpl("quantize_fp8: expects x -> q, scale[, amax], or x, scale -> q, or with transpose = 2 x -> q, scale, "
           "amax (may be absent), q^T");
  if (both && op.grouping != 0) unimpl("quantize_fp8: transpose = 2 (both copies) is per tensor only");
  if (op.grouping == 3 && transpose != 0) unimpl("quantize_fp8: grouping 3 (a scale per row) quantises x itself (transpose = 0)");
  need_device(k, in[0], "quantize_fp8");
  if (given) need_device(k, in[1], "quantize_fp8");
  for (size_t i = 0; i < nout; ++i)
    if (i < 2 || i == 3 || present(out[i]) || !shapes) need_device(k, out[i], "quantize_fp8");
  const rlh_dtype dx = in[0].dtype;
  if (!(dx == rlh::sdk::kF32) && !(dx == rlh::sdk::kBF16))
    unimpl(std::string("quantize_fp8: x must be float32 or bf16 (got ") + rlh::sdk::dtype_name(dx) + ")");
  if (!is_fp8(out[0].dtype) || (both && !(out[3].dtype == out[0].dtype)))
    unimpl(std::string("quantize_fp8: q (and q^T) must be e4m3 or e5m2, one format (got ") +
           rlh::sdk::dtype_name(out[0].dtype) + ")");
  if ((given ? !(in[1].dtype == rlh::sdk::kF32) : !(out[1].dtype == rlh::sdk::kF32)) ||
      (nout >= 3 && !(out[2].dtype == rlh::sdk::kF32)))
    unimpl("quantize_fp8: scale and amax must be float32");
  if (op.delayed && op.grouping != 0) unimpl("quantize_fp8: delayed scaling (recipe = 1) is per tensor only");
  if (given && (op.delayed || op.grouping != 0))
    unimpl("quantize_fp8: a given scale is one per tensor, with current scaling (grouping 0, recipe 0)");
  QuantCall c;
  c.fmt = fmt_of(out[0].dtype);
  c.src.type = dx == rlh::sdk::kF32 ? vfp8::In::f32 : vfp8::In::bf16;
  c.src.transpose = transpose == 1;
  if (!shapes) return c;
  c.src.ldx = matrix_ld(in[0], &c.src.R, &c.src.C, "quantize_fp8 x");
  int64_t qr, qc;
  c.ldq = matrix_ld(out[0], &qr, &qc, "quantize_fp8 q");
  if (qr != c.src.rows() || qc != c.src.inner())
    bad("quantize_fp8: q must be [" + std::to_string(c.src.rows()) + ", " + std::to_string(c.src.inner()) + "]" +
        (c.src.transpose ? " (x transposed)" : "") + ", got [" + std::to_string(qr) + ", " + std::to_string(qc) + "]");
  c.src.x = ptr(in[0]);
  c.q = ptr(out[0]);
  if (given) {
    if (rlh::sdk::tensor_numel(in[1]) != 1) bad("quantize_fp8: a given scale holds one element");
    c.given = ptr<float>(in[1]);
    return c;
  }
  const int64_t ns = vfp8::scale_count(Grouping(op.grouping), c.src.rows(), c.src.inner());
  if (rlh::sdk::tensor_numel(out[1]) != ns)
    bad("quantize_fp8: grouping " + std::to_string(op.grouping) + " writes " + std::to_string(ns) + " scales, scale holds " +
        std::to_string(rlh::sdk::tensor_numel(out[1])));
  if (nout >= 3 && present(out[2])) {
    if (op.grouping != 0) bad("quantize_fp8: the amax output is per tensor; ask for it with grouping 0 only");
    if (rlh::sdk::tensor_numel(out[2]) != 1) bad("quantize_fp8: amax must hold one element");
    c.amax = ptr<float>(out[2]);
  }
  if (both) {
    int64_t tr, tc;
    c.ldqt = matrix_ld(out[3], &tr, &tc, "quantize_fp8 q^T");
    if (tr != c.src.C || tc != c.src.R)
      bad("quantize_fp8: q^T must be [" + std::to_string(c.src.C) + ", " + std::to_string(c.src.R) + "], got [" +
          std::to_string(tr) + ", " + std::to_string(tc) + "]");
    c.qt = ptr(out[3]);
  }
  c.scale = ptr<float>(out[1]);
  return c;
}

// ---- quantize_fp8 with a producer (README.md): the norm, add + norm or SwiGLU that makes x,
// then x's 1x128 tile quantisation, in one kernel (fp8_producers.cu).
//   producer 1: x [R, C], w [C]        -> q [R, C], scale, y [R, C] (may be absent)
//   producer 2: a, b [R, C], w [C]     -> q, scale, sum [R, C] (may be a or b), y (may be absent)
//   producer 3: gate|up [R, 2C]        -> q [R, C], scale, y [R, C] (may be absent)
vfp8::ProducerArgs producer_call(const rlh_kernels* k, const rlh_tensor* in, size_t nin, const rlh_tensor* out,
                                 size_t nout, const rlh_op& op, bool shapes) {
  static const char* kForms[] = {"", "x, w -> q, scale, y", "a, b, w -> q, scale, sum, y", "gate|up -> q, scale, y"};
  const int64_t pk = op.producer;
  const size_t want_in = pk == 1 ? 2 : pk == 2 ? 3 : 1, want_out = pk == 2 ? 4 : 3;
  if (nin != want_in || nout != want_out)
    unimpl(std::string("quantize_fp8 (producer ") + std::to_string(pk) + "): expects " + kForms[pk] +
           " (y may be absent)");
  if (op.grouping != 1 || op.delayed || op.transpose != 0)
    unimpl("quantize_fp8 (producer): 1x128 tiles (grouping 1) of x itself with current scaling only");
  for (size_t i = 0; i < nin; ++i) {
    need_device(k, in[i], "quantize_fp8");
    if (!(in[i].dtype == rlh::sdk::kBF16)) unimpl("quantize_fp8 (producer): inputs must be bf16");
  }
  for (size_t i = 0; i < nout; ++i) {
    const bool y = i + 1 == nout;
    if (y && !present(out[i]) && shapes) continue;
    need_device(k, out[i], "quantize_fp8");
    if (i >= 2 && !(out[i].dtype == rlh::sdk::kBF16)) unimpl("quantize_fp8 (producer): sum and y must be bf16");
  }
  if (!is_fp8(out[0].dtype)) unimpl("quantize_fp8 (producer): q must be e4m3 or e5m2");
  if (!(out[1].dtype == rlh::sdk::kF32)) unimpl("quantize_fp8 (producer): scale must be float32");
  vfp8::ProducerArgs p;
  p.kind = vfp8::Producer(pk);
  p.fmt = fmt_of(out[0].dtype);
  p.eps = float(op.eps);
  p.offset = float(op.weight_offset);
  p.margin = op.margin;
  if (!shapes) return p;
  int64_t R, C, r2, c2;
  p.ldx = matrix_ld(in[0], &R, &C, "quantize_fp8 x");
  if (pk == 3) {
    if (C % 2 != 0) bad("quantize_fp8 (producer 3): gate|up must have an even width, got " + std::to_string(C));
    C /= 2;
  }
  p.R = R;
  p.C = C;
  auto same = [&](const rlh_tensor& t, const char* what) {
    const int64_t ld = matrix_ld(t, &r2, &c2, std::string("quantize_fp8 ") + what);
    if (r2 != R || c2 != C)
      bad(std::string("quantize_fp8 (producer): ") + what + " must be [" + std::to_string(R) + ", " +
          std::to_string(C) + "], got [" + std::to_string(r2) + ", " + std::to_string(c2) + "]");
    return ld;
  };
  p.x = ptr(in[0]);
  if (pk == 2) {
    p.ldb = same(in[1], "b");
    p.b = ptr(in[1]);
    p.ld_sum = same(out[2], "sum");
    p.sum = ptr(out[2]);
  }
  if (pk != 3) {
    const rlh_tensor& w = in[nin - 1];
    if (rlh::sdk::tensor_numel(w) != C)
      bad("quantize_fp8 (producer): w must hold " + std::to_string(C) + " elements, got " +
          std::to_string(rlh::sdk::tensor_numel(w)));
    p.w = ptr(w);
  }
  p.ldq = same(out[0], "q");
  p.q = ptr(out[0]);
  const int64_t ns = vfp8::scale_count(Grouping::tile1x128, R, C);
  if (rlh::sdk::tensor_numel(out[1]) != ns)
    bad("quantize_fp8 (producer): 1x128 tiles of [" + std::to_string(R) + ", " + std::to_string(C) + "] take " +
        std::to_string(ns) + " scales, scale holds " + std::to_string(rlh::sdk::tensor_numel(out[1])));
  p.scale = ptr<float>(out[1]);
  if (present(out[nout - 1])) {
    p.ldy = same(out[nout - 1], "y");
    p.y = ptr(out[nout - 1]);
  }
  if (const std::string why = vfp8::producer_unsupported(p); !why.empty()) unimpl("quantize_fp8 (producer): " + why);
  return p;
}

// Scratch: the caller's workspace when large enough and aligned, else stream-ordered memory.
class Scratch {
 public:
  Scratch(const rlh_op_call* call, size_t bytes, cudaStream_t s) : s_(s) {
    if (call->workspace && call->workspace_bytes >= bytes && reinterpret_cast<uintptr_t>(call->workspace) % 256 == 0) {
      p_ = call->workspace;
      return;
    }
    const cudaError_t e = cudaMallocAsync(&p_, bytes, s);
    if (e != cudaSuccess)
      throw Error(RLH_E_RESOURCE_EXHAUSTED, "vendor_fp8 workspace of " + std::to_string(bytes) + " bytes: " +
                                                cudaGetErrorString(e));
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

constexpr size_t kSmallScratch = 256;  // amax bits and the current amax

size_t workspace_of(const rlh_op& op) {
  if (op.weight_only || op.producer != 0) return 0;
  return op.kind == Kind::gemm ? vfp8::kGemmWorkspace : kSmallScratch;
}

// Checks of a desc or a call, by kind (throws UNIMPLEMENTED / INVALID_ARGUMENT naming why).
void check(const rlh_op& op, const rlh_tensor* in, size_t nin, const rlh_tensor* out, size_t nout,
           const rlh_op_call* call, bool shapes) {
  switch (op.kind) {
    case Kind::gemm:
      if (op.weight_only)
        weight_only_args(op.inst, in, nin, out, nout, op, call, shapes);
      else
        gemm_args(op.inst, in, nin, out, nout, op, call, shapes);
      return;
    case Kind::amax: amax_source(op.inst, in, nin, out, nout, shapes); return;
    case Kind::quantize:
      if (op.producer != 0)
        producer_call(op.inst, in, nin, out, nout, op, shapes);
      else
        quant_call(op.inst, in, nin, out, nout, op, pick_i(call, "transpose", op.transpose), shapes);
      return;
  }
}

std::string device_facts(int* best_cc) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    return std::string("no CUDA device: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  std::string found;
  *best_cc = 0;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    found += std::string(found.empty() ? "" : ", ") + "cuda:" + std::to_string(i) + " " + p.name + " sm_" +
             std::to_string(p.major * 10 + p.minor);
    *best_cc = std::max(*best_cc, p.major * 10 + p.minor);
  }
  return found;
}

}  // namespace

rlh::sdk::MakeStatusFn make_status() { return g_make; }

// Score 15: above kernels_cuda (10), so the registry asks this provider first; it answers FP8
// operands (and amax) only, so every other op and dtype falls through.
rlh_status* probe(const rlh_host_api* host, int32_t* score, rlh_write_fn write, void* user) {
  if (host && !g_make) g_make = host->make_status;
  return rlh::sdk::guard(g_make, [&] {
    auto say = [&](const std::string& m) {
      if (write) write(user, m.data(), m.size());
    };
    *score = 0;
    int cc = 0;
    const std::string found = device_facts(&cc);
    if (cc == 0) return say(found);
    if (cc < 89) return say("FP8 tensor cores need compute capability 8.9+ (Ada, Hopper); found " + found);
    if (const std::string e = vfp8::cublaslt_error(); !e.empty()) return say(e);
    *score = 15;
    say(found + "; cuBLASLt " + vfp8::cublaslt_path());
  });
}

rlh_status* k_create(const rlh_host_api* host, rlh_device device, const char*, size_t, rlh_kernels** out) {
  if (host && !g_make) g_make = host->make_status;
  return rlh::sdk::guard(g_make, [&] {
    if (device.device_type != RLH_DEVICE_CUDA) unimpl("runs on CUDA devices only");
    int count = 0;
    const cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0)
      throw Error(RLH_E_UNAVAILABLE, std::string("vendor_fp8: no CUDA device: ") +
                                         (ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices"));
    if (device.device_id < 0 || device.device_id >= count)
      throw Error(RLH_E_INVALID_ARGUMENT, "vendor_fp8: no device cuda:" + std::to_string(device.device_id));
    cudaDeviceProp prop{};
    cuda_ck(cudaGetDeviceProperties(&prop, device.device_id), "device properties");
    const int cc = prop.major * 10 + prop.minor;
    if (cc < 89)
      unimpl("needs FP8 tensor cores (compute capability 8.9+); cuda:" + std::to_string(device.device_id) + " (" +
             prop.name + ") is sm_" + std::to_string(cc));
    if (const std::string e = vfp8::cublaslt_error(); !e.empty()) throw Error(RLH_E_UNAVAILABLE, "vendor_fp8: " + e);
    auto k = std::make_unique<rlh_kernels>();
    k->host = host;
    k->device = device;
    k->cc = cc;
    on_device(k.get(), [&] {
      try {
        k->gemm = std::make_unique<vfp8::Gemm>();
      } catch (const std::exception& e) {
        throw Error(RLH_E_UNAVAILABLE, std::string("vendor_fp8: ") + e.what());
      }
    });
    if (host && host->log) {
      const std::string m = "vendor_fp8: cuda:" + std::to_string(device.device_id) + " " + prop.name + " (sm_" +
                            std::to_string(cc) + "), cuBLASLt from " + vfp8::cublaslt_path();
      host->log(host->ctx, RLH_LOG_INFO, m.data(), m.size());
    }
    *out = k.release();
  });
}

void k_destroy(rlh_kernels* k) {
  if (!k) return;
  try {
    on_device(k, [&] { k->gemm.reset(); });
  } catch (...) {
  }
  delete k;
}

rlh_status* k_get_op(rlh_kernels* k, const rlh_op_desc* d, rlh_op** out) {
  return rlh::sdk::guard(g_make, [&] {
    const std::string name = d->name ? d->name : "";
    // Released through k_release_op on every exit but success (it frees a delayed op's history).
    std::unique_ptr<rlh_op, void (*)(rlh_op*)> op(new rlh_op, k_release_op);
    op->inst = k;
    if (name == "gemm") op->kind = Kind::gemm;
    else if (name == "amax") op->kind = Kind::amax;
    else if (name == "quantize_fp8") op->kind = Kind::quantize;
    else unimpl("has no op '" + name + "' (it offers gemm in FP8, amax, quantize_fp8)");
    if (d->device.device_type != RLH_DEVICE_CUDA || d->device.device_id != k->device.device_id)
      unimpl(name + ": asked for another device");
    const rlh_named_value* a = d->attrs;
    const size_t na = d->num_attrs;
    op->alpha = rlh::sdk::attr_double_or(a, na, "alpha", 1.0);
    op->beta = rlh::sdk::attr_double_or(a, na, "beta", 0.0);
    op->scaling = rlh::sdk::attr_int_or(a, na, "scaling", 0);
    op->transpose_a = rlh::sdk::attr_int_or(a, na, "transpose_a", 0);
    op->transpose_b = rlh::sdk::attr_int_or(a, na, "transpose_b", 0);
    op->batch_invariant = rlh::sdk::attr_int_or(a, na, "batch_invariant", 0);
    op->grouping = rlh::sdk::attr_int_or(a, na, "grouping", 0);
    op->transpose = rlh::sdk::attr_int_or(a, na, "transpose", 0);
    op->margin = rlh::sdk::attr_double_or(a, na, "margin", 0.0);
    op->producer = op->kind == Kind::quantize ? rlh::sdk::attr_int_or(a, na, "producer", 0) : 0;
    op->eps = rlh::sdk::attr_double_or(a, na, "eps", 1e-6);
    op->weight_offset = rlh::sdk::attr_double_or(a, na, "weight_offset", 0.0);
    if (op->producer < 0 || op->producer > 3)
      bad("quantize_fp8: producer must be 0 (none), 1 (rmsnorm), 2 (add_rmsnorm) or 3 (swiglu), got " +
          std::to_string(op->producer));
    const bool norm = op->producer == 1 || op->producer == 2;  // (eps and weight_offset are the norms')
    if (norm && (!(op->eps > 0) || !std::isfinite(op->eps) || !std::isfinite(op->weight_offset)))
      bad("quantize_fp8: eps must be positive and finite, weight_offset finite");
    op->few_rows = rlh::sdk::attr_int_or(a, na, "few_rows", 1);
    const int64_t qa = rlh::sdk::attr_int_or(a, na, "quantize_a", 0);
    if (qa != 0 && qa != 1) bad("gemm: quantize_a must be 0 or 1, got " + std::to_string(qa));
    op->quantize_a = qa == 1;
    if (op->few_rows < 0 || op->few_rows > 2)
      bad("gemm: few_rows must be 0 (never), 1 (up to the bound's rows) or 2 (at any rows), got " +
          std::to_string(op->few_rows));
    if (op->scaling < 0 || op->scaling > 3)
      bad("gemm: scaling must be 0 (tensor), 1 (1x128 x 128x128), 2 (1x128 x 1x128) or 3 (per row x per row)");
    if (op->grouping < 0 || op->grouping > 3)
      bad("quantize_fp8: grouping must be 0 (tensor), 1 (1x128), 2 (128x128) or 3 (per row)");
    if (!std::isfinite(op->margin)) bad("quantize_fp8: margin must be finite");
    const int64_t recipe = rlh::sdk::attr_int_or(a, na, "recipe", 0);
    if (recipe != 0 && recipe != 1) bad("quantize_fp8: recipe must be 0 (current scaling) or 1 (delayed)");
    op->delayed = op->kind == Kind::quantize && recipe == 1;
    // Three inputs with a bf16 A: the weight-only form (README.md).
    op->weight_only = op->kind == Kind::gemm && d->num_inputs == 3 && d->inputs[0].dtype == rlh::sdk::kBF16;
    // The attributes a gemm call may change stay the call's; the scaling mode is the handle's.
    rlh_op_call resolution{};
    resolution.attrs = a;
    resolution.num_attrs = na;
    check(*op, d->inputs, d->num_inputs, d->outputs, d->num_outputs, &resolution, d->shapes_valid != 0);
    // With the shapes of the calls to come, ask cuBLASLt now: a product it has no algorithm for
    // is a refusal (the registry falls through), not a failure in the middle of a step.
    if (op->quantize_a && !op->weight_only)
      unimpl("gemm: quantize_a = 1 is the weight-only form's (A bf16, B e4m3, scale_b)");
    if (op->kind == Kind::gemm && op->scaling == 1 && ((!op->weight_only && op->few_rows != 0) || op->quantize_a))
      on_device(k, [] { vfp8::few_rows_prepare(); });
    if (op->kind == Kind::gemm && !op->weight_only && d->shapes_valid) {
      vfp8::GemmArgs g =
          gemm_args(k, d->inputs, d->num_inputs, d->outputs, d->num_outputs, *op, &resolution, true);
      if (!takes_few_rows(g, op->few_rows)) {
        std::string why;
        on_device(k, [&] { why = k->gemm->unsupported(g); });
        if (!why.empty()) unimpl("gemm: " + why);
      }
    }
    if (op->delayed) {
      const int64_t len = rlh::sdk::attr_int_or(a, na, "amax_history_len", 1024);
      if (len < 1 || len > kMaxHistory)
        bad("quantize_fp8: amax_history_len must be in [1, " + std::to_string(kMaxHistory) + "], got " + std::to_string(len));
      const int64_t algo = rlh::sdk::attr_int_or(a, na, "amax_compute_algo", 0);
      if (algo != 0 && algo != 1) bad("quantize_fp8: amax_compute_algo must be 0 (max) or 1 (most_recent)");
      op->history_len = int32_t(len);
      op->most_recent = algo == 1;
      on_device(k, [&] {
        cuda_ck(cudaMalloc(reinterpret_cast<void**>(&op->hist), size_t(len) * sizeof(float)), "amax history");
        cuda_ck(cudaMalloc(reinterpret_cast<void**>(&op->pos_count), 2 * sizeof(int32_t)), "amax history");
        cuda_ck(cudaMemset(op->hist, 0, size_t(len) * sizeof(float)), "amax history");
        cuda_ck(cudaMemset(op->pos_count, 0, 2 * sizeof(int32_t)), "amax history");
      });
    }
    *out = op.release();
  });
}

rlh_status* k_op_info(rlh_op* op, rlh_op_info* out) {
  return rlh::sdk::guard(g_make, [&] {
    rlh_op_info info{};
    info.batch_invariant = 0;  // scales (and cuBLASLt's tiles) span rows
    // amax and quantisation: an order-free max, then elementwise; the GEMM's algorithm may split K.
    // (the weight-only form adds its split K in a fixed order)
    info.deterministic = op->kind == Kind::gemm && !op->weight_only ? 0 : 1;
    info.stateful = op->delayed ? 1 : 0;
    info.workspace_bytes = workspace_of(*op);
    const size_t n = std::min(out->struct_size, sizeof(rlh_op_info));
    if (n > sizeof(size_t))
      std::memcpy(reinterpret_cast<char*>(out) + sizeof(size_t), reinterpret_cast<const char*>(&info) + sizeof(size_t),
                  n - sizeof(size_t));
  });
}

rlh_status* k_run(rlh_op* op, const rlh_op_call* call) {
  return rlh::sdk::guard(g_make, [&] {
    rlh_kernels* k = op->inst;
    const auto st = static_cast<cudaStream_t>(call->stream);
    on_device(k, [&] {
      if (op->weight_only) {  // no scratch: split K is reduced within a cluster
        const vfp8::WeightOnlyArgs w =
            weight_only_args(k, call->inputs, call->num_inputs, call->outputs, call->num_outputs, *op, call, true);
        if (!aligned16(w.a) || !aligned16(w.b)) bad("gemm (weight-only): A and B must be 16-byte aligned");
        try {
          if (op->quantize_a) {
            const double margin = pick_d(call, "margin", op->margin);
            if (!std::isfinite(margin)) bad("gemm (quantize_a): margin must be finite");
            vfp8::gemm_few_rows(quantized_in_product(w, std::exp2(margin)), st);
            return;
          }
          vfp8::gemm_weight_only(w, st);
        } catch (const std::runtime_error& e) {
          throw Error(RLH_E_INTERNAL, "vendor_fp8 gemm (weight-only; M " + std::to_string(w.M) + ", N " +
                                          std::to_string(w.N) + ", K " + std::to_string(w.K) + "): " + e.what());
        }
        return;
      }
      if (op->producer != 0) {  // no scratch
        vfp8::ProducerArgs p =
            producer_call(k, call->inputs, call->num_inputs, call->outputs, call->num_outputs, *op, true);
        p.eps = float(pick_d(call, "eps", op->eps));  // a call's norm attributes override the handle's
        p.offset = float(pick_d(call, "weight_offset", op->weight_offset));
        if (p.kind != vfp8::Producer::swiglu && (!(p.eps > 0) || !std::isfinite(p.eps) || !std::isfinite(p.offset)))
          bad("quantize_fp8: eps must be positive and finite, weight_offset finite");
        try {
          vfp8::quantize_producer(p, st);
        } catch (const std::invalid_argument& e) {
          bad(std::string("quantize_fp8 (producer): ") + e.what());
        }
        cuda_ck(cudaGetLastError(), "launch");
        return;
      }
      Scratch ws(call, workspace_of(*op), st);
      auto* bits = static_cast<uint32_t*>(ws.get());
      switch (op->kind) {
        case Kind::gemm: {
          const vfp8::GemmArgs g =
              gemm_args(k, call->inputs, call->num_inputs, call->outputs, call->num_outputs, *op, call, true);
          if (!aligned16(g.a) || !aligned16(g.b) || !aligned16(g.c)) bad("gemm: A, B and C must be 16-byte aligned");
          try {
            if (takes_few_rows(g, pick_i(call, "few_rows", op->few_rows)))
              vfp8::gemm_few_rows(g, st);
            else
              k->gemm->run(g, ws.get(), st);
          } catch (const std::runtime_error& e) {
            throw Error(RLH_E_INTERNAL, "vendor_fp8 gemm (M " + std::to_string(g.M) + ", N " + std::to_string(g.N) +
                                            ", K " + std::to_string(g.K) + "): " + e.what());
          }
          break;
        }
        case Kind::amax: {
          const vfp8::Source s = amax_source(k, call->inputs, call->num_inputs, call->outputs, call->num_outputs, true);
          vfp8::amax(s, ptr<float>(call->outputs[0]), bits, st);
          break;
        }
        case Kind::quantize: {
          const QuantCall c = quant_call(k, call->inputs, call->num_inputs, call->outputs, call->num_outputs, *op,
                                         pick_i(call, "transpose", op->transpose), true);
          const double margin = pick_d(call, "margin", op->margin);
          if (!std::isfinite(margin)) bad("quantize_fp8: margin must be finite");
          if (c.given) {
            vfp8::quantize_with_scale(c.src, c.fmt, c.given, c.q, c.ldq, st);
          } else if (op->delayed) {
            vfp8::quantize_delayed(c.src, c.fmt, margin, op->most_recent, op->hist, op->history_len, op->pos_count,
                                   op->filled_host > 0, c.q, c.ldq, c.scale, c.amax, reinterpret_cast<float*>(bits + 1),
                                   bits, st, c.qt, c.ldqt);
            op->filled_host = std::min(op->filled_host + 1, op->history_len);
          } else {
            vfp8::quantize_current(c.src, c.fmt, Grouping(op->grouping), margin, c.q, c.ldq, c.scale, c.amax, bits, st,
                                   c.qt, c.ldqt);
          }
          break;
        }
      }
      cuda_ck(cudaGetLastError(), "launch");
    });
  });
}

void k_release_op(rlh_op* op) {
  if (!op) return;
  try {
    on_device(op->inst, [&] {
      if (op->hist) cudaFree(op->hist);
      if (op->pos_count) cudaFree(op->pos_count);
    });
  } catch (...) {
  }
  delete op;
}

// State of a delayed-scaling quantize_fp8 (other ops have none: zero bytes): magic, then int32
// history length, next slot, entries filled, reserved, then the history as float32. The device
// is synchronised first, so the bytes are those after every queued call.
rlh_status* k_state_save(rlh_op* op, rlh_write_fn write, void* user) {
  return rlh::sdk::guard(g_make, [&] {
    if (!op->delayed) return;
    std::vector<float> hist(size_t(op->history_len));
    int32_t pc[2] = {0, 0};
    on_device(op->inst, [&] {
      cuda_ck(cudaDeviceSynchronize(), "state_save");
      cuda_ck(cudaMemcpy(hist.data(), op->hist, hist.size() * sizeof(float), cudaMemcpyDeviceToHost), "state_save");
      cuda_ck(cudaMemcpy(pc, op->pos_count, sizeof pc, cudaMemcpyDeviceToHost), "state_save");
    });
    const int32_t head[4] = {op->history_len, pc[0], pc[1], 0};
    write(user, kStateMagic, sizeof kStateMagic);
    write(user, head, sizeof head);
    write(user, hist.data(), hist.size() * sizeof(float));
  });
}

rlh_status* k_state_load(rlh_op* op, const void* data, size_t len) {
  return rlh::sdk::guard(g_make, [&] {
    if (!op->delayed) {
      if (len != 0) bad("state_load: this op has no state (" + std::to_string(len) + " bytes given)");
      return;
    }
    const size_t want = sizeof kStateMagic + 4 * sizeof(int32_t) + size_t(op->history_len) * sizeof(float);
    if (data == nullptr || len < sizeof kStateMagic + 4 * sizeof(int32_t) ||
        std::memcmp(data, kStateMagic, sizeof kStateMagic) != 0)
      bad("state_load: not a vendor_fp8 amax history (" + std::to_string(len) + " bytes)");
    int32_t head[4];
    std::memcpy(head, static_cast<const char*>(data) + sizeof kStateMagic, sizeof head);
    if (head[0] != op->history_len)
      bad("state_load: the saved amax history has " + std::to_string(head[0]) + " entries, this op " +
          std::to_string(op->history_len) + " (amax_history_len)");
    if (len != want) bad("state_load: " + std::to_string(len) + " bytes, expected " + std::to_string(want));
    const int32_t pos = head[1], count = head[2];
    if (count < 0 || count > op->history_len || pos < 0 || pos >= op->history_len ||
        (count < op->history_len && pos != count))
      bad("state_load: inconsistent amax history (next slot " + std::to_string(pos) + ", filled " + std::to_string(count) +
          " of " + std::to_string(op->history_len) + ")");
    std::vector<float> hist(size_t(op->history_len));
    std::memcpy(hist.data(), static_cast<const char*>(data) + sizeof kStateMagic + sizeof head, hist.size() * sizeof(float));
    for (size_t i = 0; i < hist.size(); ++i)
      if (!(hist[i] >= 0) || std::isinf(hist[i]))
        bad("state_load: amax history entry " + std::to_string(i) + " is not a finite non-negative number");
    const int32_t pc[2] = {pos, count};
    on_device(op->inst, [&] {
      cuda_ck(cudaDeviceSynchronize(), "state_load");
      cuda_ck(cudaMemcpy(op->hist, hist.data(), hist.size() * sizeof(float), cudaMemcpyHostToDevice), "state_load");
      cuda_ck(cudaMemcpy(op->pos_count, pc, sizeof pc, cudaMemcpyHostToDevice), "state_load");
    });
    op->filled_host = count;
  });
}

rlh_status* k_workspace_size(rlh_op* op, const rlh_op_call* call, size_t* bytes) {
  return rlh::sdk::guard(g_make, [&] {
    if (bytes == nullptr) bad("workspace_size: bytes is NULL");
    check(*op, call->inputs, call->num_inputs, call->outputs, call->num_outputs, call, true);
    *bytes = workspace_of(*op);
  });
}

rlh_status* k_memory_alloc(rlh_kernels* k, size_t bytes, void** out) {
  return rlh::sdk::guard(g_make, [&] {
    if (out == nullptr) bad("memory_alloc: out is NULL");
    on_device(k, [&] {
      const cudaError_t e = cudaMalloc(out, std::max<size_t>(bytes, 1));
      if (e != cudaSuccess)
        throw Error(RLH_E_RESOURCE_EXHAUSTED,
                    "vendor_fp8: cudaMalloc of " + std::to_string(bytes) + " bytes: " + cudaGetErrorString(e));
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
  return rlh::sdk::guard(g_make, [&] {
    cudaMemcpyKind kind;
    switch (dir) {
      case RLH_COPY_HOST_TO_DEVICE: kind = cudaMemcpyHostToDevice; break;
      case RLH_COPY_DEVICE_TO_HOST: kind = cudaMemcpyDeviceToHost; break;
      case RLH_COPY_DEVICE_TO_DEVICE: kind = cudaMemcpyDeviceToDevice; break;
      default: bad("memory_copy: unknown direction " + std::to_string(dir));
    }
    if (bytes == 0) return;
    on_device(k, [&] { cuda_ck(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream)), "memory_copy"); });
  });
}

rlh_status* k_synchronize(rlh_kernels* k, void* stream) {
  return rlh::sdk::guard(g_make, [&] {
    on_device(k, [&] {
      cuda_ck(stream ? cudaStreamSynchronize(static_cast<cudaStream_t>(stream)) : cudaDeviceSynchronize(), "synchronize");
    });
  });
}

}  // namespace vendor_fp8
