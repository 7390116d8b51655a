// DeviceOps (device_ops.hpp): the CUDA engine's calls as ABI ops on its device and stream.
#include "rlhost/engine_cuda/device_ops.hpp"

#include <initializer_list>
#include <stdexcept>

namespace rlh::engine::cuda {

using sdk::attr_bool;
using sdk::attr_double;
using sdk::attr_int;

namespace {
constexpr rlh_dtype kBF16 = sdk::kBF16;
constexpr rlh_dtype kF32 = sdk::kF32;
constexpr rlh_dtype kF64 = sdk::kF64;
constexpr rlh_dtype kI32 = sdk::kI32;
}  // namespace

// Descriptors for one call; their shapes and strides stay valid while it lives.
class DeviceOps::Args {
 public:
  explicit Args(rlh_device dev) : dev_(dev) {}
  // [rows, cols], rows ld apart
  rlh_tensor mat(const void* p, rlh_dtype dt, int64_t rows, int64_t cols, int64_t ld) {
    return make(p, dt, {rows, cols}, {ld, 1});
  }
  rlh_tensor vec(const void* p, rlh_dtype dt, int64_t n) { return make(p, dt, {n}, {1}); }
  // [N, H, D] with heads contiguous within a token
  rlh_tensor heads(const void* p, int64_t N, int64_t H, int64_t D, int64_t ld) {
    return make(p, kBF16, {N, H, D}, {ld, D, 1});
  }
  // [G, rows, cols], groups `stride` apart
  rlh_tensor groups(const void* p, rlh_dtype dt, int64_t G, int64_t rows, int64_t cols, int64_t ld, int64_t stride) {
    return make(p, dt, {G, rows, cols}, {stride, ld, 1});
  }
  rlh_tensor absent(rlh_dtype dt) { return make(nullptr, dt, {0}, {1}); }
  // [B, H, bs, D] paged cache blocks `stride` apart, rows of D contiguous
  rlh_tensor cache(const void* p, int64_t B, int64_t H, int64_t bs, int64_t D, int64_t stride, bool fp8 = false) {
    return make(p, fp8 ? sdk::kE4M3 : kBF16, {B, H, bs, D}, {stride, bs * D, D, 1});
  }

 private:
  rlh_tensor make(const void* p, rlh_dtype dt, std::initializer_list<int64_t> shape,
                  std::initializer_list<int64_t> strides) {
    if (used_ == kMax) throw std::logic_error("cuda engine: too many operands in one call");
    Slot& s = slots_[used_++];
    std::copy(shape.begin(), shape.end(), s.shape.begin());
    std::copy(strides.begin(), strides.end(), s.strides.begin());
    rlh_tensor t{};
    t.data = const_cast<void*>(p);
    t.device = dev_;
    t.ndim = int32_t(shape.size());
    t.dtype = dt;
    t.shape = s.shape.data();
    t.strides = s.strides.data();
    return t;
  }
  static constexpr size_t kMax = 16;
  struct Slot {
    std::array<int64_t, 4> shape{}, strides{};
  };
  rlh_device dev_;
  std::array<Slot, kMax> slots_;
  size_t used_ = 0;
};

const sdk::Op& DeviceOps::op(const char* key, const char* name, const std::vector<rlh_tensor>& in,
                             const std::vector<rlh_tensor>& out, std::span<const rlh_named_value> attrs,
                             bool shapes) {
  auto it = ops_.find(key);
  if (it != ops_.end()) return it->second;
  sdk::Op o = reg_.resolve(name, dev_, in, out, attrs, shapes);
  return ops_.emplace(key, std::move(o)).first->second;
}

void DeviceOps::run(const sdk::Op& o, const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
                    std::span<const rlh_named_value> attrs) {
  o.run(in, out, attrs, stream_, ws_, ws_bytes_);
}

// Resolves (once per key) and runs an op. The operand lists bind by reference: a temporary
// lives to the end of the call, a named list is not copied.
#define RLH_RUN(KEY, NAME, IN, OUT, ATTRS)                 \
  do {                                                     \
    static const char kKey[] = KEY;                        \
    const std::vector<rlh_tensor>& in_ = IN;              \
    const std::vector<rlh_tensor>& out_ = OUT;            \
    const auto& at_ = ATTRS;                               \
    run(op(kKey, NAME, in_, out_, at_), in_, out_, at_);   \
  } while (0)

namespace {
const std::array<rlh_named_value, 0> kNone{};
}

void DeviceOps::gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                     int64_t ldb, double beta, void* C, int64_t ldc, bool c_f32) {
  Args a(dev_);
  const std::array<rlh_named_value, 4> at = {attr_bool("transpose_a", ta), attr_bool("transpose_b", tb),
                                             attr_double("alpha", 1.0), attr_double("beta", beta)};
  const rlh_tensor ta_ = ta ? a.mat(A, kBF16, K, M, lda) : a.mat(A, kBF16, M, K, lda);
  const rlh_tensor tb_ = tb ? a.mat(B, kBF16, N, K, ldb) : a.mat(B, kBF16, K, N, ldb);
  const rlh_tensor tc = a.mat(C, c_f32 ? kF32 : kBF16, M, N, ldc);
  if (batch_invariant_) {
    // A requirement at resolution: the registry takes only a handle that promises it.
    const std::array<rlh_named_value, 5> bi = {at[0], at[1], at[2], at[3], attr_bool("batch_invariant", true)};
    if (c_f32)
      RLH_RUN("gemm/f32/invariant", "gemm", (std::vector<rlh_tensor>{ta_, tb_}), (std::vector<rlh_tensor>{tc}), bi);
    else
      RLH_RUN("gemm/bf16/invariant", "gemm", (std::vector<rlh_tensor>{ta_, tb_}), (std::vector<rlh_tensor>{tc}), bi);
    return;
  }
  if (c_f32)
    RLH_RUN("gemm/f32", "gemm", (std::vector<rlh_tensor>{ta_, tb_}), (std::vector<rlh_tensor>{tc}), at);
  else
    RLH_RUN("gemm/bf16", "gemm", (std::vector<rlh_tensor>{ta_, tb_}), (std::vector<rlh_tensor>{tc}), at);
}

namespace {
// One resolution key per combination of the attributes and dtypes an FP8 op is resolved with
// (the ops_ map is keyed by address: each element below is its own key).
char g_quant_keys[2 * 3 * 2];
char g_quant_given_keys[2 * 2];
char g_quant_both_keys[2];
char g_gemm_keys[2 * 3 * 2];
char g_gemm_w8_keys[3];  // scaling 0, 1, and 1 with quantize_a
rlh_dtype fp8_dtype(DeviceOps::Fp8 f) { return f == DeviceOps::Fp8::e4m3 ? sdk::kE4M3 : sdk::kE5M2; }
}  // namespace

void DeviceOps::quantize_fp8(const void* x, int64_t R, int64_t C, int64_t ldx, bool transpose, Fp8 f, int grouping,
                             void* q, float* scale, int64_t nscale) {
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_int("grouping", grouping), attr_int("transpose", transpose ? 1 : 0)};
  const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
  const std::vector<rlh_tensor> in = {a.mat(x, kBF16, R, C, ldx)};
  const std::vector<rlh_tensor> out = {a.mat(q, fp8_dtype(f), rows, inner, inner), a.vec(scale, kF32, nscale)};
  const char* key = &g_quant_keys[(int(f) * 3 + grouping) * 2 + (transpose ? 1 : 0)];
  run(op(key, "quantize_fp8", in, out, at), in, out, at);
}

bool DeviceOps::quantize_fp8_given(const void* x, int64_t R, int64_t C, int64_t ldx, bool transpose, Fp8 f, void* q,
                                   const float* scale) {
  const char* key = &g_quant_given_keys[int(f) * 2 + (transpose ? 1 : 0)];
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_int("grouping", 0), attr_int("transpose", transpose ? 1 : 0)};
  const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
  const std::vector<rlh_tensor> in = {a.mat(x, kBF16, R, C, ldx), a.vec(scale, kF32, 1)};
  const std::vector<rlh_tensor> out = {a.mat(q, fp8_dtype(f), rows, inner, inner)};
  return run_optional(key, "quantize_fp8", in, out, at);
}

// quantize_fp8's outputs with transpose = 2: q [R, C], its one scale, no amax, q^T [C, R].
std::vector<rlh_tensor> DeviceOps::both_outputs(Args& a, int64_t R, int64_t C, Fp8 f, void* q, void* qt, float* scale) {
  return {a.mat(q, fp8_dtype(f), R, C, C), a.vec(scale, kF32, 1), a.vec(nullptr, kF32, 1),
          a.mat(qt, fp8_dtype(f), C, R, R)};
}

bool DeviceOps::quantize_fp8_both(const void* x, int64_t R, int64_t C, int64_t ldx, Fp8 f, void* q, void* qt,
                                  float* scale) {
  const char* key = &g_quant_both_keys[int(f)];
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_int("grouping", 0), attr_int("transpose", 2)};
  const std::vector<rlh_tensor> in = {a.mat(x, kBF16, R, C, ldx)};
  return run_optional(key, "quantize_fp8", in, both_outputs(a, R, C, f, q, qt, scale), at);
}

namespace {
char g_quant_producer_keys[2 * 3];
}  // namespace

bool DeviceOps::quantize_fp8_producer(const Fp8Producer& p, int64_t R, int64_t C, Fp8 f, void* q, float* scale) {
  const int kind = int(p.kind);
  if (kind < 1 || kind > 3) throw std::invalid_argument("quantize_fp8_producer: an unknown producer");
  const char* key = &g_quant_producer_keys[int(f) * 3 + kind - 1];
  Args a(dev_);
  // (eps and weight_offset are the norms' only: SwiGLU's handle keeps the defaults)
  std::vector<rlh_named_value> at = {attr_int("grouping", 1), attr_int("producer", kind), attr_int("transpose", 0)};
  if (p.kind != Producer::swiglu) {
    at.push_back(attr_double("eps", double(p.eps)));
    at.push_back(attr_double("weight_offset", double(p.offset)));
  }
  std::vector<rlh_tensor> in, out;
  const int64_t ns = (C + 127) / 128 * R;
  switch (p.kind) {
    case Producer::rmsnorm: in = {a.mat(p.x, kBF16, R, C, p.ldx), a.vec(p.w, kBF16, C)}; break;
    case Producer::add_rmsnorm: in = {a.mat(p.x, kBF16, R, C, C), a.mat(p.b, kBF16, R, C, C), a.vec(p.w, kBF16, C)}; break;
    case Producer::swiglu: in = {a.mat(p.x, kBF16, R, 2 * C, p.ldx)}; break;
  }
  out = {a.mat(q, fp8_dtype(f), R, C, C), a.vec(scale, kF32, ns)};
  if (p.kind == Producer::add_rmsnorm) out.push_back(a.mat(p.sum, kBF16, R, C, C));
  out.push_back(p.y ? a.mat(p.y, kBF16, R, C, p.ldy) : a.mat(nullptr, kBF16, R, C, C));
  return run_optional(key, "quantize_fp8", in, out, at);
}

std::string DeviceOps::producer_refusal(Producer kind, Fp8 f) const {
  const auto it = refused_.find(&g_quant_producer_keys[int(f) * 3 + int(kind) - 1]);
  return it == refused_.end() ? std::string() : it->second;
}

bool DeviceOps::run_optional(const char* key, const char* name, const std::vector<rlh_tensor>& in,
                             const std::vector<rlh_tensor>& out, std::span<const rlh_named_value> attrs) {
  if (refused_.count(key)) return false;
  if (!ops_.count(key)) {
    try {
      op(key, name, in, out, attrs);
    } catch (const std::exception& e) {  // an optional form: the caller takes the general one instead
      refused_[key] = e.what();
      return false;
    }
  }
  run(op(key, name, in, out, attrs), in, out, attrs);
  return true;
}

namespace {
// transpose: 0 x, 1 x^T, 2 both (a call may ask its handle for both: vendor_fp8's README)
std::array<rlh_named_value, 6> delayed_attrs(int transpose, const DeviceOps::DelayedScaling& d) {
  return {attr_int("grouping", 0),
          attr_int("transpose", transpose),
          attr_int("recipe", 1),
          attr_int("amax_history_len", d.history_len),
          attr_int("amax_compute_algo", d.max ? 0 : 1),  // quantize_fp8 (vendor_fp8 README): 0 max, 1 most_recent
          attr_double("margin", double(d.margin))};
}
}  // namespace

sdk::Op DeviceOps::resolve_quantize_fp8_delayed(bool transpose, Fp8 f, const DelayedScaling& d) {
  Args a(dev_);
  const auto at = delayed_attrs(transpose ? 1 : 0, d);
  const std::vector<rlh_tensor> in = {a.mat(nullptr, kBF16, 0, 0, 0)};
  const std::vector<rlh_tensor> out = {a.mat(nullptr, fp8_dtype(f), 0, 0, 0), a.vec(nullptr, kF32, 1)};
  sdk::Op o = reg_.resolve("quantize_fp8", dev_, in, out, at, false);
  if (!o.info().stateful)
    throw std::runtime_error("kernel provider '" + o.provider() + "' answered quantize_fp8 with recipe = 1 (delayed "
                             "scaling) by a handle without state: it does not keep an amax history");
  if (!RLH_HAS_FIELD(o.api(), rlh_kernels_api, state_load) || o.api()->state_save == nullptr ||
      o.api()->state_load == nullptr)
    throw std::runtime_error("kernel provider '" + o.provider() + "' keeps quantize_fp8's amax history but offers no "
                             "state_save / state_load: it could not be checkpointed");
  return o;
}

void DeviceOps::quantize_fp8(const sdk::Op& op, const void* x, int64_t R, int64_t C, int64_t ldx, bool transpose,
                             Fp8 f, void* q, float* scale, const DelayedScaling& d) {
  Args a(dev_);
  const auto at = delayed_attrs(transpose ? 1 : 0, d);
  const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
  const std::vector<rlh_tensor> in = {a.mat(x, kBF16, R, C, ldx)};
  const std::vector<rlh_tensor> out = {a.mat(q, fp8_dtype(f), rows, inner, inner), a.vec(scale, kF32, 1)};
  run(op, in, out, at);
}

void DeviceOps::quantize_fp8_both(const sdk::Op& op, const void* x, int64_t R, int64_t C, int64_t ldx, Fp8 f, void* q,
                                  void* qt, float* scale, const DelayedScaling& d) {
  Args a(dev_);
  const auto at = delayed_attrs(2, d);
  const std::vector<rlh_tensor> in = {a.mat(x, kBF16, R, C, ldx)};
  run(op, in, both_outputs(a, R, C, f, q, qt, scale), at);
}

std::string DeviceOps::op_state(const sdk::Op& op) {
  std::string bytes;
  if (rlh_status* s = op.api()->state_save(op.raw(), sdk::write_to_string, &bytes)) {
    sdk::StatusPtr owned(s);
    throw sdk::Error(s->code, "kernel provider '" + op.provider() + "' failed saving the state of op '" + op.name() +
                                  "': " + sdk::status_message(s));
  }
  return bytes;
}

void DeviceOps::load_op_state(const sdk::Op& op, const std::string& bytes) {
  if (rlh_status* s = op.api()->state_load(op.raw(), bytes.data(), bytes.size())) {
    sdk::StatusPtr owned(s);
    throw sdk::Error(s->code, "kernel provider '" + op.provider() + "' refused the saved state of op '" + op.name() +
                                  "': " + sdk::status_message(s));
  }
}

void DeviceOps::gemm_fp8(int64_t M, int64_t N, int64_t K, const void* A, Fp8 fa, const float* sa, int64_t na,
                         const void* B, Fp8 fb, const float* sb, int64_t nb, int scaling, double beta, void* C,
                         int64_t ldc, bool c_f32, bool fast_accum, bool autotune) {
  Args a(dev_);
  const std::array<rlh_named_value, 6> at = {attr_int("transpose_b", 1), attr_int("scaling", scaling),
                                             attr_double("alpha", 1.0), attr_double("beta", beta),
                                             attr_int("fast_accum", fast_accum ? 1 : 0),
                                             attr_int("autotune", autotune ? 1 : 0)};
  const std::vector<rlh_tensor> in = {a.mat(A, fp8_dtype(fa), M, K, K), a.mat(B, fp8_dtype(fb), N, K, K),
                                      a.vec(sa, kF32, na), a.vec(sb, kF32, nb)};
  const std::vector<rlh_tensor> out = {a.mat(C, c_f32 ? kF32 : kBF16, M, N, ldc)};
  // B is e4m3 in every product the engine runs (weights and activations); A carries the
  // gradient's format, so the key needs only A's.
  if (fb != Fp8::e4m3) throw std::logic_error("cuda engine: gemm_fp8 takes an e4m3 B");
  const char* key = &g_gemm_keys[(int(fa) * 3 + scaling) * 2 + (c_f32 ? 1 : 0)];
  run(op(key, "gemm", in, out, at), in, out, at);
}

bool DeviceOps::gemm_fp8_weight_only(int64_t M, int64_t N, int64_t K, const void* A, int64_t lda, const void* B,
                                     const float* sb, int64_t nb, int scaling, void* C, int64_t ldc,
                                     bool quantize_a) {
  if (quantize_a && scaling != 1) throw std::logic_error("gemm_fp8_weight_only: quantize_a takes scaling 1");
  const char* key = &g_gemm_w8_keys[quantize_a ? 2 : scaling ? 1 : 0];
  Args a(dev_);
  const std::array<rlh_named_value, 5> at = {attr_int("transpose_b", 1), attr_int("scaling", scaling),
                                             attr_double("alpha", 1.0), attr_double("beta", 0.0),
                                             attr_int("quantize_a", quantize_a ? 1 : 0)};
  const std::vector<rlh_tensor> in = {a.mat(A, kBF16, M, K, lda), a.mat(B, sdk::kE4M3, N, K, K), a.vec(sb, kF32, nb)};
  const std::vector<rlh_tensor> out = {a.mat(C, kBF16, M, N, ldc)};
  return run_optional(key, "gemm", in, out, at);
}

void DeviceOps::grouped_gemm(bool ta, bool tb, int64_t G, int64_t T, const int32_t* offsets, int64_t M, int64_t N,
                             int64_t K, const void* A, int64_t lda, const void* B, int64_t ldb, int64_t stride_b,
                             double beta, void* C, int64_t ldc, int64_t stride_c, bool c_f32) {
  Args a(dev_);
  const std::array<rlh_named_value, 4> at = {attr_bool("transpose_a", ta), attr_bool("transpose_b", tb),
                                             attr_double("alpha", 1.0), attr_double("beta", beta)};
  const rlh_dtype cd = c_f32 ? kF32 : kBF16;
  std::vector<rlh_tensor> in, out;
  if (!ta) {
    in = {a.mat(A, kBF16, T, K, lda),
          tb ? a.groups(B, kBF16, G, N, K, ldb, stride_b) : a.groups(B, kBF16, G, K, N, ldb, stride_b),
          a.vec(offsets, kI32, G + 1)};
    out = {a.mat(C, cd, T, N, ldc)};
  } else {
    in = {a.mat(A, kBF16, T, M, lda), a.mat(B, kBF16, T, N, ldb), a.vec(offsets, kI32, G + 1)};
    out = {a.groups(C, cd, G, M, N, ldc, stride_c)};
  }
  if (c_f32)
    RLH_RUN("grouped_gemm/f32", "grouped_gemm", in, out, at);
  else
    RLH_RUN("grouped_gemm/bf16", "grouped_gemm", in, out, at);
}

void DeviceOps::embedding_fwd(void* out, const int32_t* ids, const void* table, int64_t N, int64_t C, int64_t V) {
  Args a(dev_);
  RLH_RUN("embedding_fwd", "embedding_fwd",
          (std::vector<rlh_tensor>{a.vec(ids, kI32, N), a.mat(table, kBF16, V, C, C)}),
          (std::vector<rlh_tensor>{a.mat(out, kBF16, N, C, C)}), kNone);
}

void DeviceOps::embedding_bwd(float* dtable, const int32_t* ids, const void* dout, int64_t N, int64_t C, int64_t V) {
  Args a(dev_);
  RLH_RUN("embedding_bwd", "embedding_bwd",
          (std::vector<rlh_tensor>{a.vec(ids, kI32, N), a.mat(dout, kBF16, N, C, C)}),
          (std::vector<rlh_tensor>{a.mat(dtable, kF32, V, C, C)}), kNone);
}

void DeviceOps::rmsnorm_fwd(void* y, int64_t ldy, float* rstd, const void* x, int64_t ldx, const void* w, int64_t N,
                            int64_t C, double eps, double offset) {
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_double("eps", eps), attr_double("weight_offset", offset)};
  RLH_RUN("rmsnorm_fwd", "rmsnorm_fwd", (std::vector<rlh_tensor>{a.mat(x, kBF16, N, C, ldx), a.vec(w, kBF16, C)}),
          (std::vector<rlh_tensor>{a.mat(y, kBF16, N, C, ldy), rstd ? a.vec(rstd, kF32, N) : a.absent(kF32)}), at);
}

void DeviceOps::rmsnorm_bwd(void* dx, int64_t lddx, float* dw, const void* dy, int64_t lddy, const void* x,
                            int64_t ldx, const void* w, const float* rstd, int64_t N, int64_t C, double offset,
                            bool accumulate) {
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_double("weight_offset", offset), attr_bool("accumulate", accumulate)};
  RLH_RUN("rmsnorm_bwd", "rmsnorm_bwd",
          (std::vector<rlh_tensor>{a.mat(dy, kBF16, N, C, lddy), a.mat(x, kBF16, N, C, ldx), a.vec(w, kBF16, C),
                                   a.vec(rstd, kF32, N)}),
          (std::vector<rlh_tensor>{a.mat(dx, kBF16, N, C, lddx), dw ? a.vec(dw, kF32, C) : a.absent(kF32)}), at);
}

void DeviceOps::rope(void* y, int64_t ldy, const void* x, int64_t ldx, const int32_t* pos, const float* inv_freq,
                     int64_t N, int64_t H, int64_t D, int64_t R, double scale, bool interleaved, bool inverse) {
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_double("scale", scale), attr_bool("interleaved", interleaved)};
  const std::vector<rlh_tensor> in = {a.heads(x, N, H, D, ldx), a.vec(pos, kI32, N), a.vec(inv_freq, kF32, R / 2)};
  const std::vector<rlh_tensor> out = {a.heads(y, N, H, D, ldy)};
  if (inverse)
    RLH_RUN("rope_bwd", "rope_bwd", in, out, at);
  else
    RLH_RUN("rope_fwd", "rope_fwd", in, out, at);
}

void DeviceOps::attention_fwd(const Attention& t) {
  Args a(dev_);
  const std::vector<rlh_tensor> in = {a.heads(t.q, t.N, t.Hq, t.Dk, t.ldq), a.heads(t.k, t.N, t.Hkv, t.Dk, t.ldk),
                                      a.heads(t.v, t.N, t.Hkv, t.Dv, t.ldv), a.vec(t.cu, kI32, t.S + 1)};
  const std::vector<rlh_tensor> out = {a.heads(t.o, t.N, t.Hq, t.Dv, t.ldo), a.vec(t.lse, kF32, t.Hq * t.N)};
  // Capped attention (Gemma-2) is an op of its own: resolved with the attribute, so a provider
  // that does not cap (cuDNN here) is passed over for it alone.
  if (t.softcap != 0) {
    const std::array<rlh_named_value, 3> at = {attr_double("scale", t.scale), attr_int("window", t.window),
                                               attr_double("softcap", t.softcap)};
    RLH_RUN("attention_fwd/capped", "attention_fwd", in, out, at);
  } else {
    const std::array<rlh_named_value, 2> at = {attr_double("scale", t.scale), attr_int("window", t.window)};
    RLH_RUN("attention_fwd", "attention_fwd", in, out, at);
  }
}

void DeviceOps::attention_bwd(const Attention& t, const void* dout, int64_t lddo, void* dq, int64_t lddq, void* dk,
                              int64_t lddk, void* dv, int64_t lddv) {
  Args a(dev_);
  const std::vector<rlh_tensor> in = {a.heads(dout, t.N, t.Hq, t.Dv, lddo), a.heads(t.q, t.N, t.Hq, t.Dk, t.ldq),
                                      a.heads(t.k, t.N, t.Hkv, t.Dk, t.ldk), a.heads(t.v, t.N, t.Hkv, t.Dv, t.ldv),
                                      a.heads(t.o, t.N, t.Hq, t.Dv, t.ldo), a.vec(t.lse, kF32, t.Hq * t.N),
                                      a.vec(t.cu, kI32, t.S + 1)};
  const std::vector<rlh_tensor> out = {a.heads(dq, t.N, t.Hq, t.Dk, lddq), a.heads(dk, t.N, t.Hkv, t.Dk, lddk),
                                       a.heads(dv, t.N, t.Hkv, t.Dv, lddv)};
  if (t.softcap != 0) {
    const std::array<rlh_named_value, 3> at = {attr_double("scale", t.scale), attr_int("window", t.window),
                                               attr_double("softcap", t.softcap)};
    RLH_RUN("attention_bwd/capped", "attention_bwd", in, out, at);
  } else {
    const std::array<rlh_named_value, 2> at = {attr_double("scale", t.scale), attr_int("window", t.window)};
    RLH_RUN("attention_bwd", "attention_bwd", in, out, at);
  }
}

void DeviceOps::glu_fwd(const std::string& act, void* h, int64_t ldh, const void* gu, int64_t ldgu, int64_t N,
                        int64_t F) {
  Args a(dev_);
  const std::vector<rlh_tensor> in = {a.mat(gu, kBF16, N, F, ldgu), a.mat(static_cast<const uint16_t*>(gu) + F, kBF16, N, F, ldgu)};
  const std::vector<rlh_tensor> out = {a.mat(h, kBF16, N, F, ldh)};
  if (act == "silu") {
    RLH_RUN("swiglu_fwd", "swiglu_fwd", in, out, kNone);
  } else {
    const std::array<rlh_named_value, 1> at = {attr_bool("approximate_tanh", act == "gelu_tanh")};
    RLH_RUN("geglu_fwd", "geglu_fwd", in, out, at);
  }
}

void DeviceOps::glu_bwd(const std::string& act, void* dgu, int64_t lddgu, const void* dh, int64_t lddh,
                        const void* gu, int64_t ldgu, int64_t N, int64_t F) {
  Args a(dev_);
  const std::vector<rlh_tensor> in = {a.mat(dh, kBF16, N, F, lddh), a.mat(gu, kBF16, N, F, ldgu),
                                      a.mat(static_cast<const uint16_t*>(gu) + F, kBF16, N, F, ldgu)};
  const std::vector<rlh_tensor> out = {a.mat(dgu, kBF16, N, F, lddgu),
                                       a.mat(static_cast<uint16_t*>(dgu) + F, kBF16, N, F, lddgu)};
  if (act == "silu") {
    RLH_RUN("swiglu_bwd", "swiglu_bwd", in, out, kNone);
  } else {
    const std::array<rlh_named_value, 1> at = {attr_bool("approximate_tanh", act == "gelu_tanh")};
    RLH_RUN("geglu_bwd", "geglu_bwd", in, out, at);
  }
}

void DeviceOps::bias_add(bool f32, void* y, int64_t ldy, const void* b, int64_t N, int64_t M) {
  Args a(dev_);
  const rlh_dtype dt = f32 ? kF32 : kBF16;
  const std::vector<rlh_tensor> in = {a.vec(b, dt, M)};
  const std::vector<rlh_tensor> out = {a.mat(y, dt, N, M, ldy)};
  if (f32)
    RLH_RUN("bias_add_fwd/f32", "bias_add_fwd", in, out, kNone);
  else
    RLH_RUN("bias_add_fwd/bf16", "bias_add_fwd", in, out, kNone);
}

void DeviceOps::bias_bwd(bool dy_f32, float* db, const void* dy, int64_t lddy, int64_t N, int64_t M) {
  Args a(dev_);
  const std::vector<rlh_tensor> in = {a.mat(dy, dy_f32 ? kF32 : kBF16, N, M, lddy)};
  const std::vector<rlh_tensor> out = {a.vec(db, kF32, M)};
  if (dy_f32)
    RLH_RUN("bias_bwd/f32", "bias_bwd", in, out, kNone);
  else
    RLH_RUN("bias_bwd/bf16", "bias_bwd", in, out, kNone);
}

void DeviceOps::add(void* y, const void* x, const void* b, int64_t n) {
  Args a(dev_);
  RLH_RUN("add_fwd", "add_fwd", (std::vector<rlh_tensor>{a.vec(x, kBF16, n), a.vec(b, kBF16, n)}),
          (std::vector<rlh_tensor>{a.vec(y, kBF16, n)}), kNone);
}

bool DeviceOps::run_optional(const char* key, const char* name, bool& none, const std::vector<rlh_tensor>& in,
                             const std::vector<rlh_tensor>& out, std::span<const rlh_named_value> attrs,
                             bool shapes) {
  if (none) return false;
  const sdk::Op* o = nullptr;
  try {
    o = &op(key, name, in, out, attrs, shapes);
  } catch (const sdk::Error& e) {
    if (e.code() != RLH_E_UNIMPLEMENTED) throw;
    none = true;  // no provider offers it: the caller runs the ops it fuses
    return false;
  }
  run(*o, in, out, attrs);
  return true;
}

bool DeviceOps::add_rmsnorm(void* y, void* yn, const void* x, const void* b, const void* w, int64_t N, int64_t C,
                            double eps, double offset) {
  if (no_add_rmsnorm_) return false;  // (before building the call's descriptors)
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_double("eps", eps), attr_double("weight_offset", offset)};
  static const char kKey[] = "add_rmsnorm_fwd";
  return run_optional(kKey, "add_rmsnorm_fwd", no_add_rmsnorm_,
                      {a.mat(x, kBF16, N, C, C), a.mat(b, kBF16, N, C, C), a.vec(w, kBF16, C)},
                      {a.mat(y, kBF16, N, C, C), a.mat(yn, kBF16, N, C, C)}, at);
}

bool DeviceOps::gemm_glu(const std::string& act, void* h, int64_t ldh, const void* x, int64_t ldx, const void* W,
                         int64_t N, int64_t F, int64_t K) {
  // The deterministic mode's products are the batch-invariant gemm's; the fused op does not
  // promise that (its few-row path sums as gemv.cu does).
  if (batch_invariant_ || no_gemm_glu_) return false;
  Args a(dev_);
  const std::array<rlh_named_value, 1> at = {attr_int("activation", act == "silu" ? 0 : act == "gelu_tanh" ? 1 : 2)};
  static const char kKey[] = "gemm_glu_fwd";
  return run_optional(kKey, "gemm_glu_fwd", no_gemm_glu_, {a.mat(x, kBF16, N, K, ldx), a.mat(W, kBF16, 2 * F, K, K)},
                      {a.mat(h, kBF16, N, F, ldh)}, at);
}

bool DeviceOps::rmsnorm_gemm(const std::string& act, void* h, int64_t ldh, const void* x, const void* w, const void* W,
                             int64_t N, int64_t F, int64_t K, double eps, double offset) {
  if (batch_invariant_ || no_rmsnorm_gemm_) return false;  // (as gemm_glu)
  Args a(dev_);
  const int64_t ai = act.empty() ? -1 : act == "silu" ? 0 : act == "gelu_tanh" ? 1 : 2;
  const std::array<rlh_named_value, 3> at = {attr_double("eps", eps), attr_double("weight_offset", offset),
                                             attr_int("activation", ai)};
  static const char kKey[] = "rmsnorm_gemm_fwd", kKeyGlu[] = "rmsnorm_gemm_fwd/glu";
  return run_optional(ai < 0 ? kKey : kKeyGlu, "rmsnorm_gemm_fwd", no_rmsnorm_gemm_,
                      {a.mat(x, kBF16, N, K, K), a.vec(w, kBF16, K), a.mat(W, kBF16, ai < 0 ? F : 2 * F, K, K)},
                      {a.mat(h, kBF16, N, F, ldh)}, at);
}

bool DeviceOps::gemm_add(void* y, const void* r, const void* x, int64_t ldx, const void* W, int64_t N, int64_t M,
                         int64_t K, bool round_product) {
  if (batch_invariant_ || no_gemm_add_) return false;  // (as gemm_glu)
  Args a(dev_);
  static const char kKey[] = "gemm_add_fwd", kKeyOnce[] = "gemm_add_fwd/once";
  const std::array<rlh_named_value, 1> once = {attr_int("round_product", 0)};
  return run_optional(round_product ? kKey : kKeyOnce, "gemm_add_fwd", no_gemm_add_,
                      {a.mat(x, kBF16, N, K, ldx), a.mat(W, kBF16, M, K, K), a.mat(r, kBF16, N, M, M)},
                      {a.mat(y, kBF16, N, M, M)}, round_product ? kNone : std::span<const rlh_named_value>(once));
}

void DeviceOps::scale(void* x, int64_t n, double s) {
  Args a(dev_);
  const std::array<rlh_named_value, 1> at = {attr_double("scale", s)};
  RLH_RUN("scale", "scale", (std::vector<rlh_tensor>{}), (std::vector<rlh_tensor>{a.vec(x, kBF16, n)}), at);
}

void DeviceOps::logprob_fwd(const Logprob& t) {
  Args a(dev_);
  const std::array<rlh_named_value, 3> at = {attr_double("temperature", t.temperature),
                                             attr_int("chunk_bytes", t.chunk_bytes), attr_double("softcap", t.softcap)};
  std::vector<rlh_tensor> out = {a.vec(t.logprob, kF32, t.N), a.vec(t.lse, kF32, t.N),
                                 t.entropy ? a.vec(t.entropy, kF32, t.N) : a.absent(kF32)};
  if (t.cache) out.push_back(a.mat(t.cache, kF32, t.N, t.V, t.ld_cache));
  const std::vector<rlh_tensor> in = {a.mat(t.h, kBF16, t.N, t.C, t.C), a.mat(t.W, kBF16, t.V, t.C, t.C),
                                      a.vec(t.target, kI32, t.N)};
  // The attribute list without softcap where it is 0: an uncapped head resolves as before.
  const std::span<const rlh_named_value> ats(at.data(), t.softcap != 0 ? 3 : 2);
  if (t.cache && t.softcap != 0)
    RLH_RUN("linear_logprob_fwd/cache/capped", "linear_logprob_fwd", in, out, ats);
  else if (t.cache)
    RLH_RUN("linear_logprob_fwd/cache", "linear_logprob_fwd", in, out, ats);
  else if (t.softcap != 0)
    RLH_RUN("linear_logprob_fwd/capped", "linear_logprob_fwd", in, out, ats);
  else
    RLH_RUN("linear_logprob_fwd", "linear_logprob_fwd", in, out, ats);
}

void DeviceOps::logprob_bwd(const Logprob& t, const float* dlogprob, const float* dentropy, void* dh, float* dW,
                            bool accumulate) {
  Args a(dev_);
  const std::array<rlh_named_value, 4> at = {attr_double("temperature", t.temperature),
                                             attr_int("chunk_bytes", t.chunk_bytes), attr_bool("accumulate", accumulate),
                                             attr_double("softcap", t.softcap)};
  std::vector<rlh_tensor> in = {a.mat(t.h, kBF16, t.N, t.C, t.C),
                                a.mat(t.W, kBF16, t.V, t.C, t.C),
                                a.vec(t.target, kI32, t.N),
                                a.vec(t.lse, kF32, t.N),
                                a.vec(dlogprob, kF32, t.N),
                                dentropy ? a.vec(t.entropy, kF32, t.N) : a.absent(kF32),
                                dentropy ? a.vec(dentropy, kF32, t.N) : a.absent(kF32)};
  if (t.cache) in.push_back(a.mat(t.cache, kF32, t.N, t.V, t.ld_cache));
  const std::vector<rlh_tensor> out = {a.mat(dh, kBF16, t.N, t.C, t.C), a.mat(dW, kF32, t.V, t.C, t.C)};
  const std::span<const rlh_named_value> ats(at.data(), t.softcap != 0 ? 4 : 3);
  if (t.cache && t.softcap != 0)
    RLH_RUN("linear_logprob_bwd/cache/capped", "linear_logprob_bwd", in, out, ats);
  else if (t.cache)
    RLH_RUN("linear_logprob_bwd/cache", "linear_logprob_bwd", in, out, ats);
  else if (t.softcap != 0)
    RLH_RUN("linear_logprob_bwd/capped", "linear_logprob_bwd", in, out, ats);
  else
    RLH_RUN("linear_logprob_bwd", "linear_logprob_bwd", in, out, ats);
}

void DeviceOps::sumsq(const DeviceList& x, float* result) {
  Args a(dev_);
  std::vector<rlh_tensor> in;
  in.reserve(x.n.size());
  // (Args holds few slots: list descriptors get storage of their own)
  std::vector<std::array<int64_t, 2>> dims(x.n.size());
  for (size_t i = 0; i < x.n.size(); ++i) {
    dims[i] = {x.n[i], 1};
    rlh_tensor t{};
    t.data = x.p[i];
    t.device = dev_;
    t.ndim = 1;
    t.dtype = kF32;
    t.shape = &dims[i][0];
    t.strides = &dims[i][1];
    in.push_back(t);
  }
  RLH_RUN("sumsq", "sumsq", in, (std::vector<rlh_tensor>{a.vec(result, kF32, 1)}), kNone);
}

void DeviceOps::adamw_bf16(const DeviceList& p, const DeviceList& g, const DeviceList& m, const DeviceList& v,
                           const DeviceList& p16, const AdamW& o) {
  const size_t n = p.n.size();
  std::vector<rlh_tensor> out;
  out.reserve(5 * n);
  std::vector<std::array<int64_t, 2>> dims(n);
  auto t = [&](void* ptr, rlh_dtype dt, size_t i) {
    rlh_tensor x{};
    x.data = ptr;
    x.device = dev_;
    x.ndim = 1;
    x.dtype = dt;
    x.shape = &dims[i][0];
    x.strides = &dims[i][1];
    return x;
  };
  for (size_t i = 0; i < n; ++i) {
    dims[i] = {p.n[i], 1};
    out.push_back(t(p.p[i], kF32, i));
    out.push_back(t(g.p[i], kF32, i));
    out.push_back(t(m.p[i], kF32, i));
    out.push_back(t(v.p[i], kF32, i));
    out.push_back(t(p16.p[i], kBF16, i));
  }
  const std::array<rlh_named_value, 8> at = {attr_double("lr", o.lr),
                                             attr_double("beta1", o.beta1),
                                             attr_double("beta2", o.beta2),
                                             attr_double("eps", o.eps),
                                             attr_double("weight_decay", o.weight_decay),
                                             attr_int("step", o.step),
                                             attr_double("grad_scale", o.grad_scale),
                                             attr_bool("zero_grad", o.zero_grad)};
  RLH_RUN("adamw_bf16", "adamw_bf16", (std::vector<rlh_tensor>{}), out, at);
}

namespace {
std::array<rlh_named_value, 6> router_attrs(const DeviceOps::Router& r) {
  return {attr_int("scoring", r.scoring), attr_bool("norm_topk_prob", r.norm_topk_prob),
          attr_double("scaling_factor", r.scaling_factor), attr_bool("replay", r.replay),
          attr_int("n_group", r.n_group), attr_int("topk_group", r.topk_group)};
}
}  // namespace

void DeviceOps::router_fwd(const Router& r, const void* logits, int64_t ldl, const void* bias, void* weights,
                           int32_t* experts, void* probs, void* lse) {
  Args a(dev_);
  const rlh_dtype dt = r.f64 ? kF64 : kF32;
  std::vector<rlh_tensor> in = {a.mat(logits, dt, r.N, r.E, ldl)};
  if (bias) in.push_back(a.vec(bias, dt, r.E));
  const std::vector<rlh_tensor> out = {a.mat(weights, dt, r.N, r.K, r.K), a.mat(experts, kI32, r.N, r.K, r.K),
                                       a.mat(probs, dt, r.N, r.E, r.E), lse ? a.vec(lse, dt, r.N) : a.absent(dt)};
  const auto at = router_attrs(r);
  if (r.f64)
    RLH_RUN("moe_router_fwd/f64", "moe_router_fwd", in, out, at);
  else
    RLH_RUN("moe_router_fwd/f32", "moe_router_fwd", in, out, at);
}

void DeviceOps::router_bwd(const Router& r, void* dlogits, const void* dweights, const void* probs,
                           const int32_t* experts, const void* dprobs, const void* dlse) {
  Args a(dev_);
  const rlh_dtype dt = r.f64 ? kF64 : kF32;
  const std::vector<rlh_tensor> in = {a.mat(dweights, dt, r.N, r.K, r.K), a.mat(probs, dt, r.N, r.E, r.E),
                                      a.mat(experts, kI32, r.N, r.K, r.K),
                                      dprobs ? a.mat(dprobs, dt, r.N, r.E, r.E) : a.absent(dt),
                                      dlse ? a.vec(dlse, dt, r.N) : a.absent(dt)};
  const std::vector<rlh_tensor> out = {a.mat(dlogits, dt, r.N, r.E, r.E)};
  const auto at = router_attrs(r);
  if (r.f64)
    RLH_RUN("moe_router_bwd/f64", "moe_router_bwd", in, out, at);
  else
    RLH_RUN("moe_router_bwd/f32", "moe_router_bwd", in, out, at);
}

void DeviceOps::permute_fwd(void* xp, int32_t* row, int32_t* offsets, const void* x, int64_t ldx,
                            const int32_t* experts, int64_t N, int64_t K, int64_t C, int64_t E) {
  Args a(dev_);
  RLH_RUN("moe_permute_fwd", "moe_permute_fwd",
          (std::vector<rlh_tensor>{a.mat(x, kBF16, N, C, ldx), a.mat(experts, kI32, N, K, K)}),
          (std::vector<rlh_tensor>{a.mat(xp, kBF16, N * K, C, C), a.mat(row, kI32, N, K, K),
                                   a.vec(offsets, kI32, E + 1)}),
          kNone);
}

void DeviceOps::permute_bwd(void* dx, int64_t lddx, const void* dxp, const int32_t* row, int64_t N, int64_t K,
                            int64_t C, bool accumulate) {
  Args a(dev_);
  const std::array<rlh_named_value, 1> at = {attr_bool("accumulate", accumulate)};
  RLH_RUN("moe_permute_bwd", "moe_permute_bwd",
          (std::vector<rlh_tensor>{a.mat(dxp, kBF16, N * K, C, C), a.mat(row, kI32, N, K, K)}),
          (std::vector<rlh_tensor>{a.mat(dx, kBF16, N, C, lddx)}), at);
}

void DeviceOps::unpermute_fwd(void* y, int64_t ldy, const void* yp, const int32_t* row, const float* weights,
                              int64_t N, int64_t K, int64_t C, bool accumulate) {
  Args a(dev_);
  const std::array<rlh_named_value, 1> at = {attr_bool("accumulate", accumulate)};
  RLH_RUN("moe_unpermute_fwd", "moe_unpermute_fwd",
          (std::vector<rlh_tensor>{a.mat(yp, kBF16, N * K, C, C), a.mat(row, kI32, N, K, K),
                                   a.mat(weights, kF32, N, K, K)}),
          (std::vector<rlh_tensor>{a.mat(y, kBF16, N, C, ldy)}), at);
}

void DeviceOps::unpermute_bwd(void* dyp, float* dweights, const void* dy, int64_t lddy, const void* yp,
                              const int32_t* row, const float* weights, int64_t N, int64_t K, int64_t C) {
  Args a(dev_);
  RLH_RUN("moe_unpermute_bwd", "moe_unpermute_bwd",
          (std::vector<rlh_tensor>{a.mat(dy, kBF16, N, C, lddy), a.mat(yp, kBF16, N * K, C, C),
                                   a.mat(row, kI32, N, K, K), a.mat(weights, kF32, N, K, K)}),
          (std::vector<rlh_tensor>{a.mat(dyp, kBF16, N * K, C, C),
                                   dweights ? a.mat(dweights, kF32, N, K, K) : a.absent(kF32)}),
          kNone);
}

void DeviceOps::kv_cache_write(const void* k, int64_t ldk, const void* v, int64_t ldv, int64_t R, const int32_t* slots,
                               const PagedCache& c) {
  Args a(dev_);
  const bool fp8 = c.k_scale != nullptr;
  std::vector<rlh_tensor> in = {a.heads(k, R, c.Hkv, c.Dk, ldk), a.heads(v, R, c.Hkv, c.Dv, ldv), a.vec(slots, kI32, R)};
  const std::vector<rlh_tensor> out = {a.cache(c.k, c.num_blocks, c.Hkv, c.block_size, c.Dk, c.block_stride, fp8),
                                       a.cache(c.v, c.num_blocks, c.Hkv, c.block_size, c.Dv, c.block_stride, fp8)};
  if (fp8) {
    in.push_back(a.vec(c.k_scale, kF32, 1));
    in.push_back(a.vec(c.v_scale, kF32, 1));
    RLH_RUN("kv_cache_write/fp8", "kv_cache_write", in, out, kNone);
    return;
  }
  RLH_RUN("kv_cache_write", "kv_cache_write", in, out, kNone);
}

bool DeviceOps::rope_kv_cache_write(void* y, int64_t ldy, const void* x, int64_t ldx, int64_t Hq, const void* v,
                                    int64_t ldv, int64_t R, const int32_t* pos, const float* inv_freq, int64_t rot,
                                    double scale, bool interleaved, const int32_t* slots, const PagedCache& c) {
  if (no_rope_kv_) return false;  // (before building the call's descriptors)
  Args a(dev_);
  const std::array<rlh_named_value, 2> at = {attr_double("scale", scale), attr_bool("interleaved", interleaved)};
  const bool fp8 = c.k_scale != nullptr;
  std::vector<rlh_tensor> in = {a.heads(x, R, Hq + c.Hkv, c.Dk, ldx), a.heads(v, R, c.Hkv, c.Dv, ldv),
                                a.vec(pos, kI32, R), a.vec(inv_freq, kF32, rot / 2), a.vec(slots, kI32, R)};
  const std::vector<rlh_tensor> out = {a.heads(y, R, Hq + c.Hkv, c.Dk, ldy),
                                       a.cache(c.k, c.num_blocks, c.Hkv, c.block_size, c.Dk, c.block_stride, fp8),
                                       a.cache(c.v, c.num_blocks, c.Hkv, c.block_size, c.Dv, c.block_stride, fp8)};
  if (fp8) {
    in.push_back(a.vec(c.k_scale, kF32, 1));
    in.push_back(a.vec(c.v_scale, kF32, 1));
  }
  static const char kKey[] = "rope_kv_cache_write", kKeyFp8[] = "rope_kv_cache_write/fp8";
  return run_optional(fp8 ? kKeyFp8 : kKey, "rope_kv_cache_write", no_rope_kv_, in, out, at);
}

void DeviceOps::paged_attention(void* o, int64_t ldo, const void* q, int64_t ldq, int64_t R, int64_t Hq,
                                const PagedCache& c, const int32_t* table, int64_t width, const int32_t* pos,
                                double scale, int64_t window, double softcap) {
  Args a(dev_);
  const std::array<rlh_named_value, 3> at = {attr_double("scale", scale), attr_int("window", window),
                                             attr_double("softcap", softcap)};
  const bool fp8 = c.k_scale != nullptr;
  std::vector<rlh_tensor> in = {a.heads(q, R, Hq, c.Dk, ldq),
                                a.cache(c.k, c.num_blocks, c.Hkv, c.block_size, c.Dk, c.block_stride, fp8),
                                a.cache(c.v, c.num_blocks, c.Hkv, c.block_size, c.Dv, c.block_stride, fp8),
                                a.mat(table, kI32, R, width, width), a.vec(pos, kI32, R)};
  const std::vector<rlh_tensor> out = {a.heads(o, R, Hq, c.Dv, ldo)};
  if (fp8) {  // (kernels_cuda's tensor-core kernel reads them; it does not soft-cap)
    if (softcap != 0) throw std::invalid_argument("paged_attention: FP8 caches without soft-capping only");
    in.push_back(a.vec(c.k_scale, kF32, 1));
    in.push_back(a.vec(c.v_scale, kF32, 1));
  }
  // Attributes: scale, window, softcap where it caps, and batch_invariant as a requirement at
  // resolution where asked (as gemm's: kernels_cuda then keeps each row in one partition). One
  // resolved handle per form, keyed by its literal: [fp8][batch_invariant][capped].
  static const char* const kKeys[2][2][2] = {
      {{"paged_attention", "paged_attention/capped"}, {"paged_attention/invariant", "paged_attention/capped/invariant"}},
      {{"paged_attention/fp8", nullptr}, {"paged_attention/fp8/invariant", nullptr}}};
  const bool capped = softcap != 0;
  std::array<rlh_named_value, 4> attrs = {at[0], at[1]};
  size_t n = 2;
  if (capped) attrs[n++] = at[2];
  if (batch_invariant_) attrs[n++] = attr_bool("batch_invariant", true);
  const std::span<const rlh_named_value> used(attrs.data(), n);
  run(op(kKeys[fp8][batch_invariant_][capped], "paged_attention", in, out, used), in, out, used);
}

bool DeviceOps::decode_layer(const DecodeLayer& d) {
  // (decode_layer_fwd's caches are bf16: FP8 caches run the ops it fuses)
  if (batch_invariant_ || no_decode_layer_ || d.cache.k_scale != nullptr) return false;
  const PagedCache& c = d.cache;
  const int64_t C = d.C, F = d.F, D = c.Dk, Nqkv = (d.Hq + 2 * c.Hkv) * D;
  Args a(dev_);
  const std::array<rlh_named_value, 5> at = {attr_double("eps", d.eps), attr_double("eps2", d.eps2),
                                             attr_double("weight_offset", d.offset),
                                             attr_double("rope_scale", d.rope_scale), attr_double("scale", d.scale)};
  const std::vector<rlh_tensor> in = {
      a.mat(d.x, kBF16, 1, C, C),         a.vec(d.norm1, kBF16, C),       a.mat(d.wqkv, kBF16, Nqkv, C, C),
      a.mat(d.wo, kBF16, C, d.Hq * D, d.Hq * D), a.vec(d.norm2, kBF16, C), a.mat(d.wgu, kBF16, 2 * F, C, C),
      a.mat(d.wdown, kBF16, C, F, F),     a.vec(d.pos, kI32, 1),          a.vec(d.slots, kI32, 1),
      a.mat(d.table, kI32, 1, d.width, d.width), a.vec(d.inv_freq, kF32, D / 2)};
  const std::vector<rlh_tensor> out = {a.mat(d.y, kBF16, 1, C, C),
                                       a.cache(c.k, c.num_blocks, c.Hkv, c.block_size, D, c.block_stride),
                                       a.cache(c.v, c.num_blocks, c.Hkv, c.block_size, D, c.block_stride)};
  static const char kKey[] = "decode_layer_fwd";
  // with shapes: a provider answers for these sizes or not at all (the caller runs the ops then)
  return run_optional(kKey, "decode_layer_fwd", no_decode_layer_, in, out, at, true);
}

void DeviceOps::sample(int32_t* tokens, float* logprobs, const float* logits, int64_t ld, int64_t S, int64_t V,
                       const double* u, const Sample& s, const int32_t* given) {
  Args a(dev_);
  const std::array<rlh_named_value, 5> at = {attr_double("temperature", s.temperature), attr_int("top_k", s.top_k),
                                             attr_double("top_p", s.top_p), attr_double("min_p", s.min_p),
                                             attr_double("softcap", s.softcap)};
  std::vector<rlh_tensor> in = {a.mat(logits, kF32, S, V, ld), a.vec(u, kF64, S)};
  const std::vector<rlh_tensor> out = {a.vec(tokens, kI32, S), a.vec(logprobs, kF32, S)};
  const std::span<const rlh_named_value> uncapped(at.data(), 4);
  if (given) {
    in.push_back(a.vec(given, kI32, S));
    if (s.softcap != 0)
      RLH_RUN("sample/given/capped", "sample", in, out, at);
    else
      RLH_RUN("sample/given", "sample", in, out, uncapped);
  } else if (s.softcap != 0) {
    RLH_RUN("sample/capped", "sample", in, out, at);
  } else {
    RLH_RUN("sample", "sample", in, out, uncapped);
  }
}

#undef RLH_RUN

}  // namespace rlh::engine::cuda
