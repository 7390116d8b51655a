// examples/vendor_fp8 on a GPU (label `gpu`; every test skips, naming the probe's reason, where
// the plugin cannot run). The plugin is the one the out-of-tree ctest built against the installed
// SDK (RLH_VENDOR_FP8_PLUGIN overrides the path); operands are staged through its own memory
// services, so this test links no CUDA. References are computed here in double from the very
// FP8 / bf16 numbers the plugin gets (rlh_kernel_check's formats), so what is left is the
// plugin's own error:
//   - gemm: tensorwise e4m3 x e4m3 (f32 and bf16 C, alpha, beta, padded rows, odd M/N), hybrid
//     e5m2 x e4m3 (gradients) and e4m3 x e5m2, blockwise 1x128 x 128x128 and 1x128 x 1x128;
//   - amax (f32, bf16, strided rows, NaN, zeros); quantize_fp8 per tensor (current, with
//     transpose), per 1x128 tile and per 128x128 block (uneven edges, padding scales), delayed
//     scaling (history max and most recent, the ring, state_save / state_load and bad states);
//   - an FP8 linear layer forward and backward (x W^T, dY W, dY^T X through quantize + gemm)
//     against the same layer in float64 from bf16 inputs, within FP8 tolerance;
//   - what it refuses (so the registry falls through): layouts, dtypes, sizes.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "numeric.hpp"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

namespace kc = rlh::sdk::kcheck;
using rlh::sdk::kBF16;
using rlh::sdk::kE4M3;
using rlh::sdk::kE5M2;
using rlh::sdk::kF32;
using rlh::sdk::StatusPtr;
using rlh::sdk::operator==;

std::string plugin_path() {
  if (const char* p = std::getenv("RLH_VENDOR_FP8_PLUGIN"); p && *p) return p;
  return RLH_VENDOR_FP8_PLUGIN_PATH;
}

struct Plugin {
  void* lib = nullptr;
  const rlh_plugin_desc* desc = nullptr;
  const rlh_kernels_api* api = nullptr;
  std::string error;
};

const Plugin& plugin() {
  static const Plugin p = [] {
    Plugin l;
    l.lib = dlopen(plugin_path().c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!l.lib) {
      l.error = std::string("cannot load ") + plugin_path() + ": " + dlerror();
      return l;
    }
    auto entry = reinterpret_cast<rlh_plugin_entry_fn>(dlsym(l.lib, RLH_PLUGIN_ENTRY_SYMBOL));
    l.desc = entry ? entry(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR) : nullptr;
    for (size_t i = 0; l.desc && i < l.desc->num_components; ++i)
      if (l.desc->components[i]->kind == RLH_KIND_KERNELS)
        l.api = static_cast<const rlh_kernels_api*>(l.desc->components[i]->api);
    if (!l.api) l.error = plugin_path() + " has no KERNELS component";
    return l;
  }();
  return p;
}

std::string msg(const rlh_status* s) { return s ? rlh::sdk::status_message(s) : std::string("ok"); }

// ---- On any machine: what the plugin says about itself, and why it cannot run here.

TEST(VendorFp8Plugin, DescribesItselfListsItsOpsAndClaimsFp8Settings) {
  const Plugin& p = plugin();
  ASSERT_NE(p.api, nullptr) << p.error;
  EXPECT_STREQ(p.desc->name, "vendor_fp8");
  ASSERT_GE(p.api->struct_size, RLH_STRUCT_SIZE(rlh_kernels_api, workspace_size));
  const rlh_component_desc* c = p.desc->components[0];
  ASSERT_TRUE(RLH_HAS_FIELD(c, rlh_component_desc, config_keys));
  ASSERT_NE(c->config_keys, nullptr);
  EXPECT_STREQ(c->config_keys[0], "policy.megatron_cfg.fp8_cfg.*");  // how the host knows FP8 is provided
  EXPECT_STREQ(c->config_keys[1], "policy.generation.vllm_cfg.precision");  // and FP8 rollouts
  EXPECT_EQ(c->config_keys[2], nullptr);
  std::string listing, info;
  ASSERT_EQ(StatusPtr(p.api->list_ops(nullptr, rlh::sdk::write_to_string, &listing)), nullptr);
  for (const char* op : {"{\"name\":\"gemm\",\"dtypes\":[\"e4m3\"]", "{\"name\":\"amax\"", "{\"name\":\"quantize_fp8\""})
    EXPECT_NE(listing.find(op), std::string::npos) << listing;
  ASSERT_EQ(StatusPtr(p.api->provider_info(nullptr, rlh::sdk::write_to_string, &info)), nullptr);
  EXPECT_EQ(info, "{\"reference\":false,\"memory\":\"device\"}");
  // Host memory is never its device; where the probe says it cannot run, create() says why in
  // one line (no device, no cuBLASLt, or built without CUDA).
  rlh_kernels* k = nullptr;
  StatusPtr cpu(p.api->create(nullptr, rlh::sdk::kCPU, "{}", 2, &k));
  ASSERT_NE(cpu, nullptr);
  EXPECT_TRUE(cpu->code == RLH_E_UNIMPLEMENTED || cpu->code == RLH_E_UNAVAILABLE) << msg(cpu.get());
  int32_t score = -1;
  std::string reason;
  ASSERT_EQ(StatusPtr(p.desc->probe(nullptr, &score, rlh::sdk::write_to_string, &reason)), nullptr);
  std::printf("probe: score %d, %s\n", score, reason.c_str());
  EXPECT_TRUE(!reason.empty() && reason.find('\n') == std::string::npos) << reason;
  if (score != 0) {
    EXPECT_EQ(score, 15);  // above kernels_cuda's 10: asked first, FP8 only
    return;
  }
  StatusPtr gpu(p.api->create(nullptr, rlh::sdk::cuda_device(0), "{}", 2, &k));
  ASSERT_NE(gpu, nullptr) << "create(cuda:0) succeeded where the probe said: " << reason;
  const std::string m = msg(gpu.get());
  std::printf("create(cuda:0): %s\n", m.c_str());
  EXPECT_TRUE(gpu->code == RLH_E_UNAVAILABLE || gpu->code == RLH_E_UNIMPLEMENTED) << m;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  EXPECT_EQ(m.rfind("vendor_fp8", 0), 0u) << m;
}

// ---- Device buffers through the plugin's memory services.

class Buf {
 public:
  Buf(const rlh_kernels_api* api, rlh_kernels* k, size_t bytes) : api_(api), k_(k), bytes_(bytes) {
    StatusPtr s(api->memory_alloc(k, std::max<size_t>(bytes, 1), &p_));
    if (s) throw std::runtime_error(msg(s.get()));
  }
  ~Buf() { api_->memory_free(k_, p_); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  void* get() const { return p_; }
  void put(const void* src, size_t n) {
    rlh::sdk::check(api_->memory_copy(k_, p_, src, n, RLH_COPY_HOST_TO_DEVICE, nullptr), "upload");
    rlh::sdk::check(api_->synchronize(k_, nullptr), "synchronize");
  }
  std::vector<uint8_t> get_bytes() const {
    std::vector<uint8_t> v(bytes_);
    rlh::sdk::check(api_->memory_copy(k_, v.data(), p_, bytes_, RLH_COPY_DEVICE_TO_HOST, nullptr), "download");
    rlh::sdk::check(api_->synchronize(k_, nullptr), "synchronize");
    return v;
  }

 private:
  const rlh_kernels_api* api_;
  rlh_kernels* k_;
  size_t bytes_;
  void* p_ = nullptr;
};

// A host matrix of doubles with the dtype and scale its device copy holds (values are already
// rounded to that dtype: the device and the reference see the same numbers).
struct Mat {
  int64_t rows = 0, cols = 0, ld = 0;
  rlh_dtype dtype = kF32;
  double scale = 1.0;  // fp8: dequantisation scale
  std::vector<double> v;  // rows * ld
  double at(int64_t r, int64_t c) const { return v[size_t(r * ld + c)]; }
};

std::vector<double> normal(std::mt19937_64& rng, size_t n, double sd) {
  std::normal_distribution<double> d(0.0, sd);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng);
  return v;
}

// A [rows, cols] matrix (row stride ld >= cols) of random values rounded to dtype; fp8 with the
// tensorwise current scale amax / max_finite (not a power of two: the plugin's recipe).
Mat random_mat(std::mt19937_64& rng, int64_t rows, int64_t cols, rlh_dtype d, double sd = 1.0, int64_t ld = 0) {
  Mat m;
  m.rows = rows;
  m.cols = cols;
  m.ld = ld ? ld : cols;
  m.dtype = d;
  m.v = normal(rng, size_t(rows * m.ld), sd);
  if (kc::is_fp8(d)) {
    double amax = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(m.at(r, c)));
    m.scale = amax / kc::fp8_format(d).max_finite();
  }
  for (double& x : m.v) x = kc::round_to(d, x, m.scale);
  return m;
}

std::vector<uint8_t> bytes_of(const Mat& m) {
  std::vector<uint8_t> b(m.v.size() * rlh::sdk::dtype_bytes(m.dtype));
  kc::encode_values(m.dtype, m.v.data(), m.v.size(), b.data(), m.scale);
  return b;
}

// max |got - ref| / max |ref| over a [rows, cols] region.
double rel_err(const std::vector<double>& got, const std::vector<double>& ref) {
  double e = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(ref[i])) return INFINITY;
    e = std::max(e, std::fabs(got[i] - ref[i]));
    r = std::max(r, std::fabs(ref[i]));
  }
  return e / std::max(r, 1e-30);
}

class VendorFp8 : public ::testing::Test {
 public:  // the helpers below are used by free functions of this file too
  void SetUp() override {
    const Plugin& p = plugin();
    ASSERT_NE(p.api, nullptr) << p.error;
    api_ = p.api;
    int32_t score = 0;
    std::string reason;
    StatusPtr s(p.desc->probe(nullptr, &score, rlh::sdk::write_to_string, &reason));
    ASSERT_EQ(s, nullptr) << msg(s.get());
    if (score == 0) GTEST_SKIP() << "vendor_fp8 cannot run here: " << reason;
    StatusPtr c(api_->create(nullptr, rlh::sdk::cuda_device(0), "{}", 2, &k_));
    ASSERT_EQ(c, nullptr) << "the probe said it can run (" << reason << "), create(cuda:0): " << msg(c.get());
  }
  void TearDown() override {
    bufs_.clear();
    if (k_) api_->destroy(k_);
  }

  // A device copy of host bytes, owned by the test.
  void* upload(const std::vector<uint8_t>& b) {
    bufs_.push_back(std::make_unique<Buf>(api_, k_, b.size()));
    bufs_.back()->put(b.data(), b.size());
    return bufs_.back()->get();
  }
  Buf& alloc(size_t bytes, uint8_t fill = 0xFF) {  // poisoned (0xFF: NaN in every float format)
    bufs_.push_back(std::make_unique<Buf>(api_, k_, bytes));
    std::vector<uint8_t> p(bytes, fill);
    bufs_.back()->put(p.data(), bytes);
    return *bufs_.back();
  }
  void* upload(const Mat& m) { return upload(bytes_of(m)); }
  void* upload_f32(const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return upload(b);
  }

  // A device tensor descriptor; the shape/stride arrays live in the fixture.
  rlh_tensor t(void* data, std::vector<int64_t> shape, rlh_dtype d, std::vector<int64_t> strides = {}) {
    shapes_.push_back(std::make_unique<std::vector<int64_t>>(std::move(shape)));
    if (strides.empty()) {
      strides.assign(shapes_.back()->size(), 1);
      for (int i = int(strides.size()) - 2; i >= 0; --i) strides[size_t(i)] = strides[size_t(i) + 1] * (*shapes_.back())[size_t(i) + 1];
    }
    shapes_.push_back(std::make_unique<std::vector<int64_t>>(std::move(strides)));
    rlh_tensor x{};
    x.data = data;
    x.device = rlh::sdk::cuda_device(0);
    x.ndim = int32_t(shapes_[shapes_.size() - 2]->size());
    x.dtype = d;
    x.shape = shapes_[shapes_.size() - 2]->data();
    x.strides = shapes_.back()->data();
    return x;
  }
  rlh_tensor mat_t(void* data, const Mat& m) { return t(data, {m.rows, m.cols}, m.dtype, {m.ld, 1}); }

  // Resolves (with shapes) and returns the status; the op in *op.
  StatusPtr resolve(const char* name, const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
                    const std::vector<rlh_named_value>& attrs, rlh_op** op) {
    rlh_op_desc d{};
    d.struct_size = sizeof d;
    d.name = name;
    d.device = rlh::sdk::cuda_device(0);
    d.inputs = in.data();
    d.num_inputs = in.size();
    d.outputs = out.data();
    d.num_outputs = out.size();
    d.shapes_valid = 1;
    d.attrs = attrs.data();
    d.num_attrs = attrs.size();
    *op = nullptr;
    return StatusPtr(api_->get_op(k_, &d, op));
  }
  StatusPtr run(rlh_op* op, const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
                const std::vector<rlh_named_value>& attrs = {}) {
    rlh_op_call c{};
    c.struct_size = sizeof c;
    c.inputs = in.data();
    c.num_inputs = in.size();
    c.outputs = out.data();
    c.num_outputs = out.size();
    c.attrs = attrs.data();
    c.num_attrs = attrs.size();
    StatusPtr s(api_->run(op, &c));
    if (!s) s.reset(api_->synchronize(k_, nullptr));
    return s;
  }
  // Resolve, run once, release; the run's status (resolution failures are reported as such).
  void run_once(const char* name, const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
                const std::vector<rlh_named_value>& attrs) {
    rlh_op* op = nullptr;
    StatusPtr r = resolve(name, in, out, attrs, &op);
    ASSERT_EQ(r, nullptr) << name << " resolve: " << msg(r.get());
    StatusPtr s = run(op, in, out);
    api_->release_op(op);
    ASSERT_EQ(s, nullptr) << name << " run: " << msg(s.get());
  }
  rlh_code resolve_code(const char* name, const std::vector<rlh_tensor>& in, const std::vector<rlh_tensor>& out,
                        const std::vector<rlh_named_value>& attrs, std::string* text = nullptr) {
    rlh_op* op = nullptr;
    StatusPtr r = resolve(name, in, out, attrs, &op);
    api_->release_op(op);
    if (text) *text = msg(r.get());
    return r ? r->code : RLH_OK;
  }

  std::vector<double> read(const Buf& b, rlh_dtype d, size_t n, double scale = 1.0) {
    const std::vector<uint8_t> raw = b.get_bytes();
    std::vector<double> v(n);
    kc::decode_values(d, raw.data(), n, v.data(), scale);
    return v;
  }
  std::vector<float> read_f32(const Buf& b, size_t n) {
    const std::vector<uint8_t> raw = b.get_bytes();
    std::vector<float> v(n);
    std::memcpy(v.data(), raw.data(), n * 4);
    return v;
  }

  const rlh_kernels_api* api_ = nullptr;
  rlh_kernels* k_ = nullptr;
  std::vector<std::unique_ptr<Buf>> bufs_;
  std::vector<std::unique_ptr<std::vector<int64_t>>> shapes_;
};

// C = alpha * A B^T + beta * C0 in double, over the stored (rounded) values.
std::vector<double> ref_gemm(const Mat& a, const Mat& b, double alpha, double beta, const std::vector<double>& c0) {
  std::vector<double> c(size_t(a.rows * b.rows));
  for (int64_t i = 0; i < a.rows; ++i)
    for (int64_t j = 0; j < b.rows; ++j) {
      double s = 0;
      for (int64_t k = 0; k < a.cols; ++k) s += a.at(i, k) * b.at(j, k);
      c[size_t(i * b.rows + j)] = alpha * s + (beta != 0 ? beta * c0[size_t(i * b.rows + j)] : 0.0);
    }
  return c;
}

// ---------------------------------------------------------------------------------------------
// gemm, tensorwise

void gemm_case(VendorFp8& f, std::mt19937_64& rng, int64_t M, int64_t N, int64_t K, rlh_dtype da, rlh_dtype db,
               rlh_dtype dc, double alpha, double beta, int64_t pad, double tol, bool fast_accum = false) {
  SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K) + " " +
               rlh::sdk::dtype_name(da) + " x " + rlh::sdk::dtype_name(db) + " -> " + rlh::sdk::dtype_name(dc) +
               " alpha " + std::to_string(alpha) + " beta " + std::to_string(beta) + " pad " + std::to_string(pad) +
               (fast_accum ? " fast_accum" : ""));
  const Mat a = random_mat(rng, M, K, da, 1.0, K + pad), b = random_mat(rng, N, K, db, 0.05, K + pad);
  std::vector<double> c0 = normal(rng, size_t(M * N), 1.0);
  for (double& x : c0) x = kc::round_to(dc, x);
  std::vector<uint8_t> cb(c0.size() * rlh::sdk::dtype_bytes(dc));
  kc::encode_values(dc, c0.data(), c0.size(), cb.data());
  Buf& c = f.alloc(cb.size());
  c.put(cb.data(), cb.size());
  const std::vector<rlh_tensor> in = {f.mat_t(f.upload(a), a), f.mat_t(f.upload(b), b),
                                      f.t(f.upload_f32({float(a.scale)}), {1}, kF32),
                                      f.t(f.upload_f32({float(b.scale)}), {1}, kF32)};
  const std::vector<rlh_tensor> out = {f.t(c.get(), {M, N}, dc)};
  f.run_once("gemm", in, out,
             {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_double("alpha", alpha),
              rlh::sdk::attr_double("beta", beta), rlh::sdk::attr_int("fast_accum", fast_accum ? 1 : 0)});
  // The scales the device got are float32: the reference uses the same.
  Mat ar = a, br = b;
  for (double& x : ar.v) x = x / a.scale * double(float(a.scale));
  for (double& x : br.v) x = x / b.scale * double(float(b.scale));
  const std::vector<double> ref = ref_gemm(ar, br, alpha, beta, c0);
  const double e = rel_err(f.read(c, dc, ref.size()), ref);
  EXPECT_LE(e, tol);
}

TEST_F(VendorFp8, GemmTensorwiseE4m3MatchesFloat64) {
  std::mt19937_64 rng(1);
  // Inputs are exact FP8 numbers: the error left is accumulation (float32) and C's rounding.
  for (rlh_dtype dc : {kF32, kBF16}) {
    // Hopper's FP8 tensor cores accumulate in reduced precision between promotions to float32.
    const double tol = dc == kF32 ? 2e-3 : 8e-3;
    gemm_case(*this, rng, 64, 128, 256, kE4M3, kE4M3, dc, 1.0, 0.0, 0, tol);
    gemm_case(*this, rng, 256, 512, 1024, kE4M3, kE4M3, dc, 0.5, 0.0, 0, tol);
    gemm_case(*this, rng, 37, 72, 64, kE4M3, kE4M3, dc, 1.0, 0.5, 32, tol);  // odd M, padded rows, beta
    gemm_case(*this, rng, 1, 16, 4096, kE4M3, kE4M3, dc, 1.0, 0.0, 0, tol);
    // fast accumulation (the CUDA engine's forward products): partial sums kept in the tensor
    // cores' reduced precision (DeepSeek-V3 reports up to ~2% relative at K 4096 on Hopper)
    gemm_case(*this, rng, 256, 512, 4096, kE4M3, kE4M3, dc, 1.0, 0.0, 0, 2.5e-2, true);
    gemm_case(*this, rng, 37, 72, 64, kE4M3, kE4M3, dc, 1.0, 0.5, 32, tol, true);
  }
}

// NeMo-RL's fp8: hybrid: gradients in e5m2 against e4m3 weights (and the reverse order).
TEST_F(VendorFp8, GemmHybridE5m2WithE4m3) {
  std::mt19937_64 rng(2);
  gemm_case(*this, rng, 128, 64, 256, kE5M2, kE4M3, kF32, 1.0, 0.0, 0, 2e-3);
  gemm_case(*this, rng, 96, 256, 128, kE4M3, kE5M2, kBF16, 1.0, 1.0, 16, 8e-3);
}

TEST_F(VendorFp8, GemmRefusesWhatItDoesNotAnswer) {
  std::mt19937_64 rng(3);
  const Mat a = random_mat(rng, 32, 64, kE4M3), b = random_mat(rng, 48, 64, kE4M3);
  void* pa = upload(a);
  void* pb = upload(b);
  void* s1 = upload_f32({1.0f});
  Buf& c = alloc(32 * 48 * 4);
  const rlh_tensor A = mat_t(pa, a), B = mat_t(pb, b), S = t(s1, {1}, kF32), C = t(c.get(), {32, 48}, kF32);
  const auto tb = rlh::sdk::attr_int("transpose_b", 1);
  std::string why;
  EXPECT_EQ(resolve_code("gemm", {A, B, S, S}, {C}, {tb}, &why), RLH_OK) << why;
  // Layouts cuBLASLt's FP8 GEMM does not take: the registry falls through to kernels_cuda.
  EXPECT_EQ(resolve_code("gemm", {A, B, S, S}, {C}, {}, &why), RLH_E_UNIMPLEMENTED) << why;
  EXPECT_NE(why.find("transpose_b = 1"), std::string::npos) << why;
  EXPECT_EQ(resolve_code("gemm", {A, B, S, S}, {C}, {tb, rlh::sdk::attr_int("transpose_a", 1)}), RLH_E_UNIMPLEMENTED);
  EXPECT_EQ(resolve_code("gemm", {A, B, S, S}, {C}, {tb, rlh::sdk::attr_int("batch_invariant", 1)}), RLH_E_UNIMPLEMENTED);
  // K not a multiple of 16.
  const rlh_tensor A24 = t(pa, {32, 24}, kE4M3, {64, 1}), B24 = t(pb, {48, 24}, kE4M3, {64, 1});
  EXPECT_EQ(resolve_code("gemm", {A24, B24, S, S}, {C}, {tb}, &why), RLH_E_UNIMPLEMENTED) << why;
  // Not FP8, or e5m2 x e5m2 (no such cuBLASLt product), or an fp8 C.
  EXPECT_EQ(resolve_code("gemm", {t(pa, {32, 32}, kBF16), t(pb, {48, 32}, kBF16)}, {C}, {tb}), RLH_E_UNIMPLEMENTED);
  EXPECT_EQ(resolve_code("gemm", {t(pa, {32, 64}, kE5M2), t(pb, {48, 64}, kE5M2), S, S}, {C}, {tb}, &why),
            RLH_E_UNIMPLEMENTED) << why;
  EXPECT_EQ(resolve_code("gemm", {A, B, S, S}, {t(c.get(), {32, 48}, kE4M3)}, {tb}), RLH_E_UNIMPLEMENTED);
  // Scales missing, or the wrong count for the scaling asked: a caller's error.
  EXPECT_EQ(resolve_code("gemm", {A, B}, {C}, {tb}), RLH_E_UNIMPLEMENTED);
  EXPECT_EQ(resolve_code("gemm", {A, B, S, S}, {C}, {tb, rlh::sdk::attr_int("scaling", 1)}, &why),
            RLH_E_INVALID_ARGUMENT) << why;
  EXPECT_EQ(resolve_code("gemm", {A, B, S, S}, {C}, {tb, rlh::sdk::attr_int("scaling", 7)}), RLH_E_INVALID_ARGUMENT);
  // Another op, or host memory.
  EXPECT_EQ(resolve_code("rmsnorm_fwd", {A}, {C}, {}), RLH_E_UNIMPLEMENTED);
  rlh_tensor host_a = A;
  host_a.device = rlh::sdk::kCPU;
  EXPECT_EQ(resolve_code("gemm", {host_a, B, S, S}, {C}, {tb}), RLH_E_UNIMPLEMENTED);
  // op_info: not batch-invariant, not stateful, a workspace.
  rlh_op* op = nullptr;
  ASSERT_EQ(resolve("gemm", {A, B, S, S}, {C}, {tb}, &op), nullptr);
  rlh_op_info info{};
  info.struct_size = sizeof info;
  ASSERT_EQ(StatusPtr(api_->op_info(op, &info)), nullptr);
  EXPECT_EQ(info.batch_invariant, 0);
  EXPECT_EQ(info.stateful, 0);
  EXPECT_GT(info.workspace_bytes, 0u);
  api_->release_op(op);
}

// ---------------------------------------------------------------------------------------------
// amax

TEST_F(VendorFp8, AmaxMatchesTheHost) {
  std::mt19937_64 rng(4);
  for (rlh_dtype d : {kF32, kBF16})
    // (contiguous bf16 rows with a multiple of 8 elements take the flat kernel, the rest the row walk)
    for (auto [rows, cols, ld] : std::vector<std::array<int64_t, 3>>{
             {1, 1000003, 1000003}, {300, 257, 300}, {1, 1, 1}, {96, 4096, 4096}, {1, 8 * 70001, 8 * 70001}}) {
      SCOPED_TRACE(std::string(rlh::sdk::dtype_name(d)) + " " + std::to_string(rows) + "x" + std::to_string(cols));
      Mat x = random_mat(rng, rows, cols, d, 3.0, ld);
      // Padding between rows holds larger values: amax must not read them.
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = cols; c < ld; ++c) x.v[size_t(r * ld + c)] = kc::round_to(d, 1e6);
      double want = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) want = std::max(want, std::fabs(x.at(r, c)));
      Buf& out = alloc(4);
      const rlh_tensor X = rows == 1 ? t(upload(x), {cols}, d) : mat_t(upload(x), x);
      run_once("amax", {X}, {t(out.get(), {1}, kF32)}, {});
      EXPECT_EQ(read_f32(out, 1)[0], float(want));
    }
  // A NaN anywhere is a NaN amax (a scale from it would hide the overflow); zeros are 0.
  for (rlh_dtype d : {kF32, kBF16})
  for (double special : {double(NAN), 0.0}) {
    Mat x = random_mat(rng, 1, 4096, d);
    if (std::isnan(special)) x.v[1234] = NAN;
    else std::fill(x.v.begin(), x.v.end(), 0.0);
    Buf& out = alloc(4);
    run_once("amax", {t(upload(x), {4096}, d)}, {t(out.get(), {1}, kF32)}, {});
    const float got = read_f32(out, 1)[0];
    if (std::isnan(special)) {
      EXPECT_TRUE(std::isnan(got)) << got;
    } else {
      EXPECT_EQ(got, 0.0f);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// quantize_fp8

// The host's quantisation of one group: scale = amax / max (1 when amax is 0), q = x / scale
// rounded to the format (saturating). Returns the scale.
float host_scale(double amax, rlh_dtype q) {
  const float a = float(amax);
  return a > 0 && std::isfinite(a) ? a / float(kc::fp8_format(q).max_finite()) : 1.0f;
}

// Compares the device's q bytes with the host's encoding of x / scale: the codes may differ by
// one step only where float32 division rounds x / scale across a rounding boundary.
void expect_codes(const std::vector<uint8_t>& got, const std::vector<double>& x, const std::vector<float>& scale_of,
                  rlh_dtype q, const std::string& what) {
  const kc::Fp8Format& f = kc::fp8_format(q);
  size_t off = 0, worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint8_t want = f.encode(double(float(x[i]) / scale_of[i]));
    if (got[i] != want && ((got[i] | want) & 0x7F) != 0) {  // (+0 and -0 both code zero)
      ++off;
      if (std::abs(int(got[i] & 0x7F) - int(want & 0x7F)) > 1 || (got[i] & 0x80) != (want & 0x80)) ++worst;
    }
  }
  EXPECT_EQ(worst, 0u) << what << ": codes more than one step from the host's";
  EXPECT_LE(off, x.size() / 1000 + 1) << what << ": " << off << " of " << x.size() << " codes differ by a step";
}

TEST_F(VendorFp8, QuantizePerTensorCurrentScaling) {
  std::mt19937_64 rng(5);
  for (rlh_dtype xd : {kF32, kBF16})
    for (rlh_dtype qd : {kE4M3, kE5M2})
      for (int transpose : {0, 1}) {
        const int64_t R = 200, C = 136, ld = 160;
        SCOPED_TRACE(std::string(rlh::sdk::dtype_name(xd)) + " -> " + rlh::sdk::dtype_name(qd) + " transpose " +
                     std::to_string(transpose));
        const Mat x = random_mat(rng, R, C, xd, 2.0, ld);
        const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
        Buf& q = alloc(size_t(rows * inner));
        Buf& s = alloc(4);
        Buf& am = alloc(4);
        run_once("quantize_fp8", {mat_t(upload(x), x)},
                 {t(q.get(), {rows, inner}, qd), t(s.get(), {1}, kF32), t(am.get(), {1}, kF32)},
                 {rlh::sdk::attr_int("transpose", transpose)});
        double amax = 0;
        std::vector<double> xs;  // in q's order
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < inner; ++j) {
            const double v = transpose ? x.at(j, i) : x.at(i, j);
            xs.push_back(v);
            amax = std::max(amax, std::fabs(v));
          }
        const float scale = read_f32(s, 1)[0];
        EXPECT_EQ(read_f32(am, 1)[0], float(amax));
        EXPECT_NEAR(scale, host_scale(amax, qd), 1e-6 * scale);
        expect_codes(q.get_bytes(), xs, std::vector<float>(xs.size(), scale), qd, "tensorwise");
        // Dequantised, within the format's resolution of x.
        const std::vector<double> back = read(q, qd, xs.size(), scale);
        EXPECT_LE(rel_err(back, xs), qd == kE4M3 ? 7e-2 : 1.3e-1);
      }
}

// The scale given as a second input (the CUDA engine's W^T after W, dY^T after dY): the codes
// are the full form's, byte for byte, in both orientations; other groupings and output lists
// are refused.
TEST_F(VendorFp8, QuantizeWithAGivenScaleWritesTheFullFormsCodes) {
  std::mt19937_64 rng(15);
  for (rlh_dtype xd : {kF32, kBF16})
    for (int transpose : {0, 1}) {
      const int64_t R = 300, C = 264, ld = 272;  // a partial 128-row tile, padding between rows
      SCOPED_TRACE(std::string(rlh::sdk::dtype_name(xd)) + " transpose " + std::to_string(transpose));
      const Mat x = random_mat(rng, R, C, xd, 3.0, ld);
      const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
      const rlh_tensor X = mat_t(upload(x), x);
      Buf& full = alloc(size_t(rows * inner));
      Buf& given = alloc(size_t(rows * inner));
      Buf& s = alloc(4);
      // the scale from x itself (the untransposed form), then each orientation with it
      Buf& q0 = alloc(size_t(R * C));
      run_once("quantize_fp8", {X}, {t(q0.get(), {R, C}, kE4M3), t(s.get(), {1}, kF32)}, {});
      run_once("quantize_fp8", {X}, {t(full.get(), {rows, inner}, kE4M3), t(alloc(4).get(), {1}, kF32)},
               {rlh::sdk::attr_int("transpose", transpose)});
      run_once("quantize_fp8", {X, t(s.get(), {1}, kF32)}, {t(given.get(), {rows, inner}, kE4M3)},
               {rlh::sdk::attr_int("transpose", transpose)});
      EXPECT_EQ(given.get_bytes(), full.get_bytes());
      if (transpose == 0) continue;
      // transpose = 2: x and x^T in one pass, the codes of the two forms above, one scale
      Buf& b = alloc(size_t(R * C));
      Buf& bt = alloc(size_t(R * C));
      Buf& bs = alloc(4);
      Buf& ba = alloc(4);
      for (bool amax : {false, true}) {
        run_once("quantize_fp8", {X},
                 {t(b.get(), {R, C}, kE4M3), t(bs.get(), {1}, kF32), t(amax ? ba.get() : nullptr, {1}, kF32),
                  t(bt.get(), {C, R}, kE4M3)},
                 {rlh::sdk::attr_int("transpose", 2)});
        EXPECT_EQ(b.get_bytes(), q0.get_bytes());
        EXPECT_EQ(bt.get_bytes(), full.get_bytes());
        EXPECT_EQ(read_f32(bs, 1)[0], read_f32(s, 1)[0]);
      }
    }
  Buf& q = alloc(256);
  Buf& s = alloc(8);
  Buf& xb = alloc(1024);
  std::string why;
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {2, 128}, kF32), t(s.get(), {1}, kF32)},
                         {t(q.get(), {2, 128}, kE4M3)}, {rlh::sdk::attr_int("grouping", 1)}, &why),
            RLH_E_UNIMPLEMENTED) << why;
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {2, 128}, kF32), t(s.get(), {1}, kF32)},
                         {t(q.get(), {2, 128}, kE4M3), t(s.get(), {1}, kF32)}, {}),
            RLH_E_UNIMPLEMENTED);
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {2, 128}, kF32), t(s.get(), {1}, kF32)},
                         {t(q.get(), {2, 128}, kE4M3)}, {rlh::sdk::attr_int("recipe", 1)}),
            RLH_E_UNIMPLEMENTED);
  // both copies: per tensor only, q^T's shape checked
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {2, 128}, kF32)},
                         {t(q.get(), {2, 128}, kE4M3), t(s.get(), {2}, kF32), t(nullptr, {1}, kF32),
                          t(q.get(), {128, 2}, kE4M3)},
                         {rlh::sdk::attr_int("transpose", 2), rlh::sdk::attr_int("grouping", 1)}),
            RLH_E_UNIMPLEMENTED);
  Buf& q2 = alloc(256);
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {2, 128}, kF32)},
                         {t(q.get(), {2, 128}, kE4M3), t(s.get(), {1}, kF32), t(nullptr, {1}, kF32),
                          t(q2.get(), {2, 128}, kE4M3)},
                         {rlh::sdk::attr_int("transpose", 2)}),
            RLH_E_INVALID_ARGUMENT);
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {256}, kF32)}, {t(q.get(), {256}, kE4M3), t(s.get(), {1}, kF32)},
                         {rlh::sdk::attr_int("transpose", 3)}),
            RLH_E_INVALID_ARGUMENT);
}

// A delayed-scaling handle asked for both copies by its call (transpose = 2; the CUDA engine's X
// and X^T, dY and dY^T with one history per site): the history's scale for both, the codes of
// the one-copy calls of handles holding the same history.
TEST_F(VendorFp8, QuantizeDelayedBothCopiesShareTheHistory) {
  std::mt19937_64 rng(17);
  const int64_t R = 256, C = 192;
  const auto attrs = [](int transpose) {
    return std::vector<rlh_named_value>{rlh::sdk::attr_int("recipe", 1), rlh::sdk::attr_int("amax_history_len", 4),
                                        rlh::sdk::attr_int("transpose", transpose)};
  };
  Buf& xb = alloc(size_t(R * C) * 2);
  Buf& q = alloc(size_t(R * C));
  Buf& qt = alloc(size_t(R * C));
  Buf& s = alloc(4);
  Buf& q1 = alloc(size_t(R * C));
  Buf& s1 = alloc(4);
  Buf& qt1 = alloc(size_t(R * C));
  Buf& st1 = alloc(4);
  const rlh_tensor X = t(xb.get(), {R, C}, kBF16);
  const std::vector<rlh_tensor> both = {t(q.get(), {R, C}, kE4M3), t(s.get(), {1}, kF32), t(nullptr, {1}, kF32),
                                        t(qt.get(), {C, R}, kE4M3)};
  const std::vector<rlh_tensor> rows = {t(q1.get(), {R, C}, kE4M3), t(s1.get(), {1}, kF32)};
  const std::vector<rlh_tensor> cols = {t(qt1.get(), {C, R}, kE4M3), t(st1.get(), {1}, kF32)};
  rlh_op *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_EQ(resolve("quantize_fp8", {X}, rows, attrs(0), &a), nullptr);  // asked for both by its calls
  ASSERT_EQ(resolve("quantize_fp8", {X}, rows, attrs(0), &b), nullptr);
  ASSERT_EQ(resolve("quantize_fp8", {X}, cols, attrs(1), &c), nullptr);
  for (int step = 0; step < 3; ++step) {  // the first call scales by its own amax, the rest by the history
    SCOPED_TRACE("step " + std::to_string(step));
    const Mat x = random_mat(rng, R, C, kBF16, std::exp2(double(2 * step - 2)));
    xb.put(bytes_of(x).data(), size_t(R * C) * 2);
    ASSERT_EQ(run(a, {X}, both, {rlh::sdk::attr_int("transpose", 2)}), nullptr);
    ASSERT_EQ(run(b, {X}, rows), nullptr);
    ASSERT_EQ(run(c, {X}, cols), nullptr);
    EXPECT_EQ(read_f32(s, 1)[0], read_f32(s1, 1)[0]);
    EXPECT_EQ(read_f32(s, 1)[0], read_f32(st1, 1)[0]);
    EXPECT_EQ(q.get_bytes(), q1.get_bytes());
    EXPECT_EQ(qt.get_bytes(), qt1.get_bytes());
  }
  for (rlh_op* o : {a, b, c}) api_->release_op(o);
}

// 1x128 tiles (activations) and 128x128 blocks (weights), on sizes that are not multiples of
// 128, against the host's grouping and cuBLASLt's scale layouts (fp8_kernels.hpp).
TEST_F(VendorFp8, QuantizeBlockwise) {
  std::mt19937_64 rng(6);
  // bf16 rows of a multiple of 8 take the kernels' 16-byte paths; 203 columns and f32 the rest
  for (auto [d, C] : std::vector<std::pair<rlh_dtype, int64_t>>{{kBF16, 200}, {kBF16, 203}, {kF32, 203}})
  for (int grouping : {1, 2})
    for (int transpose : {0, 1}) {
      const int64_t R = 300;
      SCOPED_TRACE(std::string(rlh::sdk::dtype_name(d)) + " 300x" + std::to_string(C) + " grouping " +
                   std::to_string(grouping) + " transpose " + std::to_string(transpose));
      Mat x = random_mat(rng, R, C, d, 1.0);
      // Groups of very different magnitudes: one scale for all would lose the small ones.
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) x.v[size_t(r * C + c)] = kc::round_bf16(x.at(r, c) * std::exp2(double((r + c) % 9)));
      const int64_t rows = transpose ? C : R, inner = transpose ? R : C, nkb = (inner + 127) / 128,
                    kb4 = (nkb + 3) / 4 * 4, nrb = (rows + 127) / 128;
      const int64_t ns = grouping == 1 ? nkb * rows : nrb * kb4;
      Buf& q = alloc(size_t(rows * inner));
      Buf& s = alloc(size_t(ns) * 4);
      run_once("quantize_fp8", {mat_t(upload(x), x)}, {t(q.get(), {rows, inner}, kE4M3), t(s.get(), {ns}, kF32)},
               {rlh::sdk::attr_int("grouping", grouping), rlh::sdk::attr_int("transpose", transpose)});
      const std::vector<float> scales = read_f32(s, size_t(ns));
      std::vector<double> xs;
      std::vector<float> sc_of;
      std::vector<double> group_amax(size_t(ns), 0.0);
      auto index = [&](int64_t i, int64_t j) { return grouping == 1 ? (j / 128) * rows + i : (i / 128) * kb4 + j / 128; };
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < inner; ++j) {
          const double v = transpose ? x.at(j, i) : x.at(i, j);
          double& g = group_amax[size_t(index(i, j))];
          g = std::max(g, std::fabs(v));
        }
      for (int64_t g = 0; g < ns; ++g) {
        const bool padding = grouping == 2 && g % kb4 >= nkb;
        const float want = padding ? 1.0f : host_scale(group_amax[size_t(g)], kE4M3);
        ASSERT_NEAR(scales[size_t(g)], want, 1e-6 * want) << "scale " << g << (padding ? " (padding)" : "");
      }
      std::vector<double> back;
      const std::vector<uint8_t> qb = q.get_bytes();
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < inner; ++j) {
          xs.push_back(transpose ? x.at(j, i) : x.at(i, j));
          sc_of.push_back(scales[size_t(index(i, j))]);
          back.push_back(kc::fp8_format(kE4M3).decode(qb[size_t(i * inner + j)]) * sc_of.back());
        }
      expect_codes(qb, xs, sc_of, kE4M3, "blockwise");
      // Each element within e4m3's resolution of its own group's amax.
      for (size_t e = 0; e < xs.size(); ++e)
        ASSERT_LE(std::fabs(back[e] - xs[e]), 0.0625 * std::fabs(xs[e]) + std::ldexp(double(sc_of[e]), -9)) << "element " << e;
    }
}

// A scale per row (grouping 3: per token for activations, per output channel for weights,
// cuBLASLt's outer vectors), on rows of very different magnitudes: each row's scale is its own
// amax's, and every code is x / scale rounded to e4m3. Only x itself is taken (transpose = 1 is
// refused by name).
TEST_F(VendorFp8, QuantizeRowwise) {
  std::mt19937_64 rng(16);
  for (auto [d, C] : std::vector<std::pair<rlh_dtype, int64_t>>{{kBF16, 2048}, {kBF16, 203}, {kF32, 203}}) {
    const int64_t R = 300;
    SCOPED_TRACE(std::string(rlh::sdk::dtype_name(d)) + " 300x" + std::to_string(C));
    Mat x = random_mat(rng, R, C, d, 1.0);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) x.v[size_t(r * C + c)] = kc::round_to(d, x.at(r, c) * std::exp2(double(r % 11) - 5));
    for (int64_t c = 0; c < C; ++c) x.v[size_t(7 * C + c)] = 0.0;  // an all-zero row: scale 1
    Buf& q = alloc(size_t(R * C));
    Buf& s = alloc(size_t(R) * 4);
    run_once("quantize_fp8", {mat_t(upload(x), x)}, {t(q.get(), {R, C}, kE4M3), t(s.get(), {R}, kF32)},
             {rlh::sdk::attr_int("grouping", 3)});
    const std::vector<float> scales = read_f32(s, size_t(R));
    std::vector<double> xs;
    std::vector<float> sc_of;
    for (int64_t r = 0; r < R; ++r) {
      double amax = 0;
      for (int64_t c = 0; c < C; ++c) amax = std::max(amax, std::fabs(x.at(r, c)));
      const float want = host_scale(amax, kE4M3);
      ASSERT_NEAR(scales[size_t(r)], want, 1e-6 * want) << "row " << r;
      for (int64_t c = 0; c < C; ++c) {
        xs.push_back(x.at(r, c));
        sc_of.push_back(scales[size_t(r)]);
      }
    }
    EXPECT_EQ(scales[7], 1.0f);
    expect_codes(q.get_bytes(), xs, sc_of, kE4M3, "rowwise");
  }
  const Mat x = random_mat(rng, 16, 64, kBF16, 1.0);
  Buf& q = alloc(16 * 64);
  Buf& s = alloc(64 * 4);
  std::string why;
  EXPECT_EQ(resolve_code("quantize_fp8", {mat_t(upload(x), x)}, {t(q.get(), {64, 16}, kE4M3), t(s.get(), {64}, kF32)},
                         {rlh::sdk::attr_int("grouping", 3), rlh::sdk::attr_int("transpose", 1)}, &why),
            RLH_E_UNIMPLEMENTED);
  EXPECT_NE(why.find("grouping 3"), std::string::npos) << why;
}

// quantize_fp8 fused into the op that produces x (`producer`: 1 rmsnorm, 2 add + rmsnorm, 3
// SwiGLU), as the generator's FP8 rollouts use it: the produced values y are the op's within a
// bf16 step (the norm's sum runs in another order than the host's), the add's sum is bitwise
// bf16(a + b), and the codes and tile scales are exactly the 1x128 quantisation of the y the
// kernel wrote (so nothing is lost against the op and quantize_fp8 run apart). Without y the
// codes are the same bytes. Rows of very different magnitudes; 200 columns leave a partial tile.
TEST_F(VendorFp8, QuantizeFusedIntoItsProducer) {
  std::mt19937_64 rng(21);
  for (int producer : {1, 2, 3})
    for (auto [R, C] : std::vector<std::pair<int64_t, int64_t>>{{64, 2048}, {3, 200}, {16, 8192}}) {
      SCOPED_TRACE("producer " + std::to_string(producer) + " " + std::to_string(R) + "x" + std::to_string(C));
      const int64_t xc = producer == 3 ? 2 * C : C, ldx = xc + 8;
      Mat x = random_mat(rng, R, xc, kBF16, 1.0, ldx), b = random_mat(rng, R, C, kBF16, 0.5);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < xc; ++c) x.v[size_t(r * ldx + c)] = kc::round_bf16(x.at(r, c) * std::exp2(double(r % 7) - 3));
      const Mat w = random_mat(rng, 1, C, kBF16, 0.3);
      const double eps = 1e-5, offset = producer == 1 ? 1.0 : 0.0;  // (a Gemma-style offset once)
      // The host's produced values, in double from the same bf16 inputs.
      std::vector<double> sum(size_t(R * C)), want(size_t(R * C));
      for (int64_t r = 0; r < R; ++r) {
        double ss = 0;
        for (int64_t c = 0; c < C; ++c) {
          const double v = producer == 2 ? kc::round_bf16(x.at(r, c) + b.at(r, c)) : x.at(r, c);
          sum[size_t(r * C + c)] = v;
          ss += v * v;
        }
        const double rstd = 1.0 / std::sqrt(ss / double(C) + eps);
        for (int64_t c = 0; c < C; ++c) {
          const double g = x.at(r, c), u = producer == 3 ? x.at(r, C + c) : 0.0;
          want[size_t(r * C + c)] = producer == 3 ? g / (1.0 + std::exp(-g)) * u
                                                  : sum[size_t(r * C + c)] * rstd * (w.at(0, c) + offset);
        }
      }
      const int64_t ns = (C + 127) / 128 * R;
      std::vector<uint8_t> codes[2];
      for (int with_y : {1, 0}) {
        Buf& q = alloc(size_t(R * C));
        Buf& s = alloc(size_t(ns) * 4);
        Buf& y = alloc(size_t(R * C) * 2);
        Buf& sm = alloc(size_t(R * C) * 2);
        void* xd = upload(x);
        std::vector<rlh_tensor> in = {mat_t(xd, x)};
        if (producer == 2) in.push_back(mat_t(upload(b), b));
        if (producer != 3) in.push_back(t(upload(w), {C}, kBF16));
        std::vector<rlh_tensor> out = {t(q.get(), {R, C}, kE4M3), t(s.get(), {ns}, kF32)};
        if (producer == 2) out.push_back(t(sm.get(), {R, C}, kBF16));
        out.push_back(t(with_y ? y.get() : nullptr, {R, C}, kBF16));
        run_once("quantize_fp8", in, out,
                 {rlh::sdk::attr_int("grouping", 1), rlh::sdk::attr_int("producer", producer),
                  rlh::sdk::attr_double("eps", eps), rlh::sdk::attr_double("weight_offset", offset)});
        codes[with_y] = q.get_bytes();
        if (!with_y) continue;
        if (producer == 2) {
          const std::vector<double> got = read(sm, kBF16, size_t(R * C));
          for (size_t e = 0; e < got.size(); ++e) ASSERT_EQ(got[e], sum[e]) << "sum element " << e;
        }
        const std::vector<double> yd = read(y, kBF16, size_t(R * C));
        for (size_t e = 0; e < yd.size(); ++e)
          ASSERT_LE(std::fabs(yd[e] - want[e]), std::ldexp(std::fabs(want[e]), -7) + 1e-30) << "y element " << e;
        // Scales and codes: the 1x128 quantisation of the y written.
        const std::vector<float> scales = read_f32(s, size_t(ns));
        std::vector<float> sc_of;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t kb = 0; kb * 128 < C; ++kb) {
            double amax = 0;
            for (int64_t c = kb * 128; c < std::min(C, kb * 128 + 128); ++c) amax = std::max(amax, std::fabs(yd[size_t(r * C + c)]));
            const float sc = host_scale(amax, kE4M3);
            ASSERT_NEAR(scales[size_t(kb * R + r)], sc, 1e-6 * sc) << "scale of row " << r << " tile " << kb;
          }
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < C; ++c) sc_of.push_back(scales[size_t((c / 128) * R + r)]);
        expect_codes(codes[1], yd, sc_of, kE4M3, "producer");
      }
      EXPECT_EQ(codes[0], codes[1]) << "the codes without y differ from those with it";
    }
  // What it does not take is refused at resolution, by name: other groupings, rows not a
  // multiple of 8 wide, a missing input.
  const Mat x = random_mat(rng, 4, 100, kBF16, 1.0), w = random_mat(rng, 1, 100, kBF16, 1.0);
  Buf& q = alloc(400);
  Buf& s = alloc(16);
  std::string why;
  EXPECT_EQ(resolve_code("quantize_fp8", {mat_t(upload(x), x), t(upload(w), {100}, kBF16)},
                         {t(q.get(), {4, 100}, kE4M3), t(s.get(), {4}, kF32), t(nullptr, {4, 100}, kBF16)},
                         {rlh::sdk::attr_int("grouping", 2), rlh::sdk::attr_int("producer", 1)}, &why),
            RLH_E_UNIMPLEMENTED);
  EXPECT_NE(why.find("grouping 1"), std::string::npos) << why;
  const Mat x2 = random_mat(rng, 4, 100, kBF16, 1.0);
  EXPECT_EQ(resolve_code("quantize_fp8", {mat_t(upload(x2), x2), t(upload(w), {100}, kBF16)},
                         {t(q.get(), {4, 100}, kE4M3), t(s.get(), {4}, kF32), t(nullptr, {4, 100}, kBF16)},
                         {rlh::sdk::attr_int("grouping", 1), rlh::sdk::attr_int("producer", 1)}, &why),
            RLH_E_UNIMPLEMENTED);
  EXPECT_NE(why.find("multiple of 8"), std::string::npos) << why;
  EXPECT_EQ(resolve_code("quantize_fp8", {mat_t(upload(x2), x2)},
                         {t(q.get(), {4, 100}, kE4M3), t(s.get(), {4}, kF32), t(nullptr, {4, 100}, kBF16)},
                         {rlh::sdk::attr_int("grouping", 1), rlh::sdk::attr_int("producer", 1)}, &why),
            RLH_E_UNIMPLEMENTED);
  EXPECT_NE(why.find("x, w -> q, scale, y"), std::string::npos) << why;
}

// Delayed scaling: the scale comes from earlier calls' amaxes (a ring of amax_history_len), the
// first call from its own; the history is the op's state and survives state_save / state_load.
TEST_F(VendorFp8, QuantizeDelayedScalingAndItsState) {
  std::mt19937_64 rng(7);
  const int64_t n = 4096;
  const std::vector<double> mult = {1, 4, 0.5, 16, 1, 1, 2, 0.25};
  for (int algo : {0, 1}) {
    SCOPED_TRACE(algo ? "most_recent" : "max");
    const std::vector<rlh_named_value> attrs = {rlh::sdk::attr_int("recipe", 1), rlh::sdk::attr_int("amax_history_len", 3),
                                                rlh::sdk::attr_int("amax_compute_algo", algo)};
    Buf& q = alloc(size_t(n));
    Buf& s = alloc(4);
    Buf& am = alloc(4);
    Buf& xb = alloc(size_t(n) * 4);
    const std::vector<rlh_tensor> out = {t(q.get(), {n}, kE4M3), t(s.get(), {1}, kF32), t(am.get(), {1}, kF32)};
    const std::vector<rlh_tensor> in = {t(xb.get(), {n}, kF32)};
    rlh_op* op = nullptr;
    ASSERT_EQ(resolve("quantize_fp8", in, out, attrs, &op), nullptr);
    rlh_op_info info{};
    info.struct_size = sizeof info;
    ASSERT_EQ(StatusPtr(api_->op_info(op, &info)), nullptr);
    EXPECT_EQ(info.stateful, 1);
    std::vector<double> hist;
    std::string saved;
    rlh_op* restored = nullptr;
    for (size_t step = 0; step < mult.size(); ++step) {
      Mat x = random_mat(rng, 1, n, kF32, mult[step]);
      xb.put(bytes_of(x).data(), size_t(n) * 4);
      double cur = 0;
      for (double v : x.v) cur = std::max(cur, std::fabs(v));
      double from = cur;
      if (!hist.empty()) from = algo ? hist.back() : *std::max_element(hist.begin(), hist.end());
      // Halfway, the state moves to a fresh handle, which carries on as the first would have.
      if (step == 4) {
        ASSERT_EQ(StatusPtr(api_->state_save(op, rlh::sdk::write_to_string, &saved)), nullptr);
        EXPECT_EQ(saved.size(), 8 + 16 + 3 * 4u);
        ASSERT_EQ(resolve("quantize_fp8", in, out, attrs, &restored), nullptr);
        ASSERT_EQ(StatusPtr(api_->state_load(restored, saved.data(), saved.size())), nullptr);
      }
      ASSERT_EQ(run(step >= 4 ? restored : op, in, out), nullptr) << "step " << step;
      const float scale = read_f32(s, 1)[0];
      EXPECT_NEAR(scale, host_scale(from, kE4M3), 1e-6 * scale) << "step " << step;
      EXPECT_EQ(read_f32(am, 1)[0], float(cur)) << "step " << step;
      // Values above the stale scale's range saturate at the format's largest finite value.
      const std::vector<double> back = read(q, kE4M3, size_t(n), scale);
      for (size_t i = 0; i < back.size(); ++i)
        ASSERT_LE(std::fabs(back[i]), 448.0 * scale * (1 + 1e-6)) << "step " << step;
      hist.push_back(cur);
      if (hist.size() > 3) hist.erase(hist.begin());
    }
    // Bad states are refused by name, and leave the op as it was.
    std::string bad = saved;
    bad[0] = 'X';
    StatusPtr e1(api_->state_load(op, bad.data(), bad.size()));
    ASSERT_NE(e1, nullptr);
    EXPECT_EQ(e1->code, RLH_E_INVALID_ARGUMENT);
    EXPECT_NE(msg(e1.get()).find("not a vendor_fp8 amax history"), std::string::npos) << msg(e1.get());
    StatusPtr e2(api_->state_load(op, saved.data(), saved.size() - 4));
    ASSERT_NE(e2, nullptr);
    EXPECT_EQ(e2->code, RLH_E_INVALID_ARGUMENT);
    bad = saved;
    const float negative = -1.0f;
    std::memcpy(bad.data() + 24, &negative, 4);
    StatusPtr e3(api_->state_load(op, bad.data(), bad.size()));
    ASSERT_NE(e3, nullptr);
    EXPECT_NE(msg(e3.get()).find("not a finite non-negative"), std::string::npos) << msg(e3.get());
    bad = saved;
    const int32_t pos = 7;
    std::memcpy(bad.data() + 12, &pos, 4);
    StatusPtr e4(api_->state_load(op, bad.data(), bad.size()));
    ASSERT_NE(e4, nullptr);
    EXPECT_NE(msg(e4.get()).find("inconsistent"), std::string::npos) << msg(e4.get());
    // A history of another length.
    rlh_op* other = nullptr;
    ASSERT_EQ(resolve("quantize_fp8", in, out,
                      {rlh::sdk::attr_int("recipe", 1), rlh::sdk::attr_int("amax_history_len", 5)}, &other),
              nullptr);
    StatusPtr e5(api_->state_load(other, saved.data(), saved.size()));
    ASSERT_NE(e5, nullptr);
    EXPECT_NE(msg(e5.get()).find("has 3 entries, this op 5"), std::string::npos) << msg(e5.get());
    api_->release_op(other);
    api_->release_op(restored);
    api_->release_op(op);
  }
  // Delayed scaling is per tensor; out-of-range attributes are errors.
  Buf& q = alloc(256);
  Buf& s = alloc(4);
  Buf& xb = alloc(1024);
  std::string why;
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {2, 128}, kF32)}, {t(q.get(), {2, 128}, kE4M3), t(s.get(), {2}, kF32)},
                         {rlh::sdk::attr_int("recipe", 1), rlh::sdk::attr_int("grouping", 1)}, &why),
            RLH_E_UNIMPLEMENTED) << why;
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {256}, kF32)}, {t(q.get(), {256}, kE4M3), t(s.get(), {1}, kF32)},
                         {rlh::sdk::attr_int("recipe", 1), rlh::sdk::attr_int("amax_history_len", 0)}),
            RLH_E_INVALID_ARGUMENT);
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {256}, kF32)}, {t(q.get(), {256}, kBF16), t(s.get(), {1}, kF32)}, {}),
            RLH_E_UNIMPLEMENTED);
  EXPECT_EQ(resolve_code("quantize_fp8", {t(xb.get(), {256}, kF32)}, {t(q.get(), {128}, kE4M3), t(s.get(), {1}, kF32)}, {}),
            RLH_E_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------------------------
// Blockwise products and an FP8 linear layer, quantised by the plugin itself.

// Device FP8 copy of x (bf16 values) by the plugin's quantize_fp8; returns q (as a Mat of the
// dequantised values the device holds) and the device pointers of q and its scales.
struct Quantized {
  Mat deq;
  void* q = nullptr;
  void* scale = nullptr;
  int64_t nscale = 0;
};

Quantized quantize_on_device(VendorFp8& f, const Mat& x, rlh_dtype qd, int grouping, int transpose) {
  const int64_t rows = transpose ? x.cols : x.rows, inner = transpose ? x.rows : x.cols;
  const int64_t nkb = (inner + 127) / 128, kb4 = (nkb + 3) / 4 * 4;
  Quantized out;
  out.nscale = grouping == 0 ? 1 : grouping == 1 ? nkb * rows : grouping == 3 ? rows : ((rows + 127) / 128) * kb4;
  Buf& q = f.alloc(size_t(rows * inner));
  Buf& s = f.alloc(size_t(out.nscale) * 4);
  f.run_once("quantize_fp8", {f.mat_t(f.upload(x), x)},
             {f.t(q.get(), {rows, inner}, qd), f.t(s.get(), {out.nscale}, kF32)},
             {rlh::sdk::attr_int("grouping", grouping), rlh::sdk::attr_int("transpose", transpose)});
  const std::vector<uint8_t> qb = q.get_bytes();
  const std::vector<float> sc = f.read_f32(s, size_t(out.nscale));
  out.deq.rows = rows;
  out.deq.cols = out.deq.ld = inner;
  out.deq.dtype = qd;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < inner; ++j) {
      const float scale = grouping == 0   ? sc[0]
                          : grouping == 1 ? sc[size_t((j / 128) * rows + i)]
                          : grouping == 3 ? sc[size_t(i)]
                                          : sc[size_t((i / 128) * kb4 + j / 128)];
      out.deq.v.push_back(kc::fp8_format(qd).decode(qb[size_t(i * inner + j)]) * double(scale));
    }
  out.q = q.get();
  out.scale = s.get();
  return out;
}

// C = A B^T through gemm with the given scaling, C in dtype dc; returns C's values. With
// `may_refuse`, a refusal at resolution (UNIMPLEMENTED: cuBLASLt has no algorithm, an answer the
// registry falls through on) returns an empty vector instead of failing.
std::vector<double> device_gemm(VendorFp8& f, const Quantized& a, const Quantized& b, rlh_dtype da, rlh_dtype db,
                                int scaling, rlh_dtype dc = kF32, bool may_refuse = false) {
  const int64_t M = a.deq.rows, N = b.deq.rows, K = a.deq.cols;
  Buf& c = f.alloc(size_t(M * N) * rlh::sdk::dtype_bytes(dc));
  const std::vector<rlh_tensor> in = {f.t(a.q, {M, K}, da), f.t(b.q, {N, K}, db), f.t(a.scale, {a.nscale}, kF32),
                                      f.t(b.scale, {b.nscale}, kF32)};
  const std::vector<rlh_tensor> out = {f.t(c.get(), {M, N}, dc)};
  const std::vector<rlh_named_value> attrs = {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", scaling)};
  if (may_refuse) {
    std::string why;
    if (f.resolve_code("gemm", in, out, attrs, &why) == RLH_E_UNIMPLEMENTED) {
      std::printf("refused (an answer, not a failure): %s\n", why.c_str());
      return {};
    }
  }
  f.run_once("gemm", in, out, attrs);
  return f.read(c, dc, size_t(M * N));
}

// Block-scaled products write bf16 (what DeepSeek-V3's recipe and PyTorch's _scaled_mm do); at
// sizes in multiples of 128 they must run, at others cuBLASLt may refuse (then the registry
// falls through), and a float32 C may be refused too.
TEST_F(VendorFp8, GemmBlockwiseMatchesTheDequantisedProduct) {
  std::mt19937_64 rng(8);
  // The few-row products of decoding (16 and 64 rows: what the generator's FP8 rollouts run) too.
  for (auto [M, N, K] : std::vector<std::array<int64_t, 3>>{
           {256, 384, 512}, {128, 128, 128}, {200, 136, 320}, {16, 256, 256}, {64, 384, 512}}) {
    const bool aligned = M % 128 == 0 && N % 128 == 0 && K % 128 == 0;
    SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K));
    Mat x = random_mat(rng, M, K, kBF16, 1.0), w = random_mat(rng, N, K, kBF16, 0.02);
    // Rows of very different size: what per-tile scales are for.
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < K; ++c) x.v[size_t(r * K + c)] = kc::round_bf16(x.at(r, c) * std::exp2(double(r % 7) - 3));
    const Quantized qx = quantize_on_device(*this, x, kE4M3, 1, 0), qw = quantize_on_device(*this, w, kE4M3, 2, 0);
    const std::vector<double> c = device_gemm(*this, qx, qw, kE4M3, kE4M3, 1, kBF16, !aligned);
    if (!c.empty()) {
      EXPECT_LE(rel_err(c, ref_gemm(qx.deq, qw.deq, 1, 0, {})), 8e-3) << "1x128 x 128x128";
      // Against the bf16 product: within FP8 resolution (the contract's e4m3 bound).
      EXPECT_LE(rel_err(c, ref_gemm(x, w, 1, 0, {})), 1e-1);
    }
    const Quantized qw1 = quantize_on_device(*this, w, kE4M3, 1, 0);
    const std::vector<double> c2 = device_gemm(*this, qx, qw1, kE4M3, kE4M3, 2, kBF16, !aligned);
    if (!c2.empty()) {
      EXPECT_LE(rel_err(c2, ref_gemm(qx.deq, qw1.deq, 1, 0, {})), 8e-3) << "1x128 x 1x128";
    }
    const std::vector<double> c3 = device_gemm(*this, qx, qw, kE4M3, kE4M3, 1, kF32, true);
    if (!c3.empty()) {
      EXPECT_LE(rel_err(c3, ref_gemm(qx.deq, qw.deq, 1, 0, {})), 2e-3) << "1x128 x 128x128, f32 C";
    }
  }
}

// The few-row kernel of block-scaled products (README.md: `few_rows`; src/fp8_few_rows.cu):
// one token (a decoding step at batch 1), rows that fill no 8-token tile and one to four chunks
// of 64, K in one stage and split across a cluster in uneven shares (9 and 16 stages), bands
// whose block scales differ, rows of A of very different size, bf16 and f32 C, alpha and beta.
// Against the float64 product of the dequantised operands and, at the rows cuBLASLt takes,
// against cuBLASLt's product of the same codes (`few_rows = 0`): the two promote the same
// 128-term sums with the same scales.
TEST_F(VendorFp8, GemmFewRowsMatchesTheDequantisedProduct) {
  std::mt19937_64 rng(21);
  int ran = 0, against_cublaslt = 0;
  for (auto [M, N, K] : std::vector<std::array<int64_t, 3>>{
           {1, 384, 256}, {5, 128, 1152}, {9, 256, 128}, {16, 384, 1152}, {17, 128, 2048}, {40, 1024, 640},
           {64, 384, 512}, {100, 256, 384}, {200, 128, 256}}) {
    Mat x = random_mat(rng, M, K, kBF16, 1.0), w = random_mat(rng, N, K, kBF16, 0.02);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < K; ++c) x.v[size_t(r * K + c)] = kc::round_bf16(x.at(r, c) * std::exp2(double(r % 7) - 3));
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < K; ++c)
        w.v[size_t(r * K + c)] = kc::round_bf16(w.at(r, c) * std::exp2(double((r / 128 + c / 128) % 5) - 2));
    const Quantized qx = quantize_on_device(*this, x, kE4M3, 1, 0), qw = quantize_on_device(*this, w, kE4M3, 2, 0);
    for (rlh_dtype dc : {kBF16, kF32}) {
      const double alpha = dc == kF32 ? 0.5 : 1.0, beta = M % 2 ? 0.25 : 0.0;
      SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K) + " C " +
                   rlh::sdk::dtype_name(dc));
      std::vector<double> c0 = normal(rng, size_t(M * N), 1.0);
      for (double& v : c0) v = kc::round_to(dc, v);
      std::vector<uint8_t> cb(c0.size() * rlh::sdk::dtype_bytes(dc));
      kc::encode_values(dc, c0.data(), c0.size(), cb.data());
      const std::vector<rlh_tensor> in = {t(qx.q, {M, K}, kE4M3), t(qw.q, {N, K}, kE4M3), t(qx.scale, {qx.nscale}, kF32),
                                          t(qw.scale, {qw.nscale}, kF32)};
      auto product = [&](int few) {
        Buf& c = alloc(cb.size());
        c.put(cb.data(), cb.size());
        const std::vector<rlh_tensor> out = {t(c.get(), {M, N}, dc)};
        const std::vector<rlh_named_value> attrs = {
            rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", 1), rlh::sdk::attr_int("few_rows", few),
            rlh::sdk::attr_double("alpha", alpha), rlh::sdk::attr_double("beta", beta)};
        if (few == 0 && resolve_code("gemm", in, out, attrs) != RLH_OK) return std::vector<double>{};
        run_once("gemm", in, out, attrs);
        return read(c, dc, c0.size());
      };
      const std::vector<double> got = product(2), ref = ref_gemm(qx.deq, qw.deq, alpha, beta, c0);
      EXPECT_LE(rel_err(got, ref), dc == kBF16 ? 8e-3 : 1e-3);
      ++ran;
      if (const std::vector<double> lt = product(0); !lt.empty()) {
        EXPECT_LE(rel_err(got, lt), dc == kBF16 ? 8e-3 : 1e-3) << "against cuBLASLt";
        ++against_cublaslt;
      }
    }
  }
  EXPECT_EQ(ran, 18);
  EXPECT_GE(against_cublaslt, 4);  // (cuBLASLt takes the multiples of 16 rows at least)
  // A `few_rows` past 2 is the caller's error.
  const Quantized qx = quantize_on_device(*this, random_mat(rng, 16, 256, kBF16, 1.0), kE4M3, 1, 0);
  const Quantized qw = quantize_on_device(*this, random_mat(rng, 128, 256, kBF16, 0.02), kE4M3, 2, 0);
  Buf& c = alloc(16 * 128 * 2);
  EXPECT_EQ(resolve_code("gemm", {t(qx.q, {16, 256}, kE4M3), t(qw.q, {128, 256}, kE4M3), t(qx.scale, {qx.nscale}, kF32),
                                  t(qw.scale, {qw.nscale}, kF32)},
                         {t(c.get(), {16, 128}, kBF16)},
                         {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", 1),
                          rlh::sdk::attr_int("few_rows", 3)}),
            RLH_E_INVALID_ARGUMENT);
}

// The weight-only form with `quantize_a = 1` (README.md): A's 1x128 tiles quantised to e4m3
// inside the few-row product. It must give exactly what quantize_fp8 (grouping 1, the same
// margin) followed by the block-scaled product of its codes gives: the same codes and scales,
// summed in the same order. One token, rows that fill no tile of 8, one and several chunks of
// 64, K in one stage and split, rows of very different size, margin 0 and 1.
TEST_F(VendorFp8, GemmQuantizeAInTheProductIsThePassThenTheProduct) {
  std::mt19937_64 rng(22);
  int ran = 0;
  for (auto [M, N, K] :
       std::vector<std::array<int64_t, 3>>{{1, 256, 256}, {9, 256, 128}, {40, 384, 1152}, {64, 128, 512}, {130, 256, 384}})
    for (const double margin : {0.0, 1.0}) {
      SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K) + " margin " +
                   std::to_string(margin));
      Mat x = random_mat(rng, M, K, kBF16, 1.0);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < K; ++c) x.v[size_t(r * K + c)] = kc::round_bf16(x.at(r, c) * std::exp2(double(r % 9) - 4));
      const Mat w = random_mat(rng, N, K, kBF16, 0.02);
      const Quantized qw = quantize_on_device(*this, w, kE4M3, 2, 0);
      // The pass, then the codes' product.
      const int64_t ns = ((K + 127) / 128) * M;
      Buf& q = alloc(size_t(M * K));
      Buf& sc = alloc(size_t(ns) * 4);
      void* xd = upload(x);
      run_once("quantize_fp8", {mat_t(xd, x)}, {t(q.get(), {M, K}, kE4M3), t(sc.get(), {ns}, kF32)},
               {rlh::sdk::attr_int("grouping", 1), rlh::sdk::attr_double("margin", margin)});
      Buf& c1 = alloc(size_t(M * N) * 2);
      run_once("gemm",
               {t(q.get(), {M, K}, kE4M3), t(qw.q, {N, K}, kE4M3), t(sc.get(), {ns}, kF32), t(qw.scale, {qw.nscale}, kF32)},
               {t(c1.get(), {M, N}, kBF16)},
               {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", 1), rlh::sdk::attr_int("few_rows", 2)});
      // In the product.
      Buf& c2 = alloc(size_t(M * N) * 2);
      run_once("gemm", {mat_t(xd, x), t(qw.q, {N, K}, kE4M3), t(qw.scale, {qw.nscale}, kF32)}, {t(c2.get(), {M, N}, kBF16)},
               {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", 1), rlh::sdk::attr_int("quantize_a", 1),
                rlh::sdk::attr_double("margin", margin)});
      EXPECT_EQ(c1.get_bytes(), c2.get_bytes());
      EXPECT_LE(rel_err(read(c2, kBF16, size_t(M * N)), ref_gemm(x, w, 1, 0, {})), 1e-1) << "against bf16";
      ++ran;
    }
  EXPECT_EQ(ran, 10);
  // Refused: with one scale for B, and on the codes' form (A e4m3).
  const Mat x = random_mat(rng, 16, 128, kBF16, 1.0), w = random_mat(rng, 128, 128, kBF16, 0.02);
  const Quantized qw0 = quantize_on_device(*this, w, kE4M3, 0, 0);
  Buf& c = alloc(16 * 128 * 2);
  EXPECT_EQ(resolve_code("gemm", {mat_t(upload(x), x), t(qw0.q, {128, 128}, kE4M3), t(qw0.scale, {1}, kF32)},
                         {t(c.get(), {16, 128}, kBF16)},
                         {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("quantize_a", 1)}),
            RLH_E_UNIMPLEMENTED);
}

// Row scaling (scaling 3): a float per row of A and per row of B, C[i, j] = sa[i] sb[j] (A B^T)[i, j]
// (torch._scaled_mm's rowwise recipe), on cuBLASLt's outer vectors, with and without fast
// accumulation, at decoding's few rows and at a training shape, bf16 C, against the product of
// the dequantised operands. Sizes that are not multiples of 16 rows may be refused (an answer).
TEST_F(VendorFp8, GemmRowwiseMatchesTheDequantisedProduct) {
  std::mt19937_64 rng(17);
  int ran = 0;
  for (auto [M, N, K] : std::vector<std::array<int64_t, 3>>{
           {1, 256, 512}, {16, 256, 256}, {64, 384, 512}, {256, 384, 512}, {200, 136, 320}}) {
    SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K));
    Mat x = random_mat(rng, M, K, kBF16, 1.0), w = random_mat(rng, N, K, kBF16, 0.02);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < K; ++c) x.v[size_t(r * K + c)] = kc::round_bf16(x.at(r, c) * std::exp2(double(r % 7) - 3));
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < K; ++c) w.v[size_t(r * K + c)] = kc::round_bf16(w.at(r, c) * std::exp2(double(r % 5) - 2));
    const Quantized qx = quantize_on_device(*this, x, kE4M3, 3, 0), qw = quantize_on_device(*this, w, kE4M3, 3, 0);
    const bool aligned = M % 16 == 0 && N % 16 == 0;
    for (int fast : {0, 1}) {
      Buf& c = alloc(size_t(M * N) * 2);
      const std::vector<rlh_tensor> in = {t(qx.q, {M, K}, kE4M3), t(qw.q, {N, K}, kE4M3), t(qx.scale, {M}, kF32),
                                          t(qw.scale, {N}, kF32)};
      const std::vector<rlh_tensor> out = {t(c.get(), {M, N}, kBF16)};
      const std::vector<rlh_named_value> attrs = {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", 3),
                                                  rlh::sdk::attr_int("fast_accum", fast)};
      std::string why;
      const rlh_code code = resolve_code("gemm", in, out, attrs, &why);
      if (code == RLH_E_UNIMPLEMENTED && !aligned) {
        std::printf("M %lld N %lld: refused (an answer, not a failure): %s\n", (long long)M, (long long)N, why.c_str());
        continue;
      }
      ASSERT_EQ(code, RLH_OK) << why;
      run_once("gemm", in, out, attrs);
      EXPECT_LE(rel_err(read(c, kBF16, size_t(M * N)), ref_gemm(qx.deq, qw.deq, 1, 0, {})), 8e-3) << "fast " << fast;
      EXPECT_LE(rel_err(read(c, kBF16, size_t(M * N)), ref_gemm(x, w, 1, 0, {})), 1e-1) << "against bf16";
      ++ran;
    }
  }
  EXPECT_GE(ran, 8);
  // The scale counts are the rows': one per tensor is the caller's error.
  const Quantized qx = quantize_on_device(*this, random_mat(rng, 16, 128, kBF16, 1.0), kE4M3, 3, 0);
  Buf& c = alloc(16 * 16 * 2);
  EXPECT_EQ(resolve_code("gemm", {t(qx.q, {16, 128}, kE4M3), t(qx.q, {16, 128}, kE4M3), t(qx.scale, {16}, kF32),
                                  t(qx.scale, {1}, kF32)},
                         {t(c.get(), {16, 16}, kBF16)}, {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", 3)}),
            RLH_E_INVALID_ARGUMENT);
}

// gemm's weight-only form (README.md): A bf16 x B e4m3 with B's scales, the product a decoding
// step runs. Rows 1 to 130 (one to three chunks of 64 tokens, rows that fill no group of 8),
// block scales and one scale, bf16 and f32 C, alpha and beta, a padded A, and K split across a
// cluster at every size. Against the float64 product of the bf16 A and the dequantised weight;
// the kernel rounds each dequantised weight to bf16, so the bound is bf16's.
TEST_F(VendorFp8, GemmWeightOnlyMatchesTheDequantisedProduct) {
  std::mt19937_64 rng(10);
  int ran = 0;
  for (auto [M, N, K] : std::vector<std::array<int64_t, 3>>{
           {1, 2048, 2048}, {3, 256, 128}, {16, 384, 512}, {29, 160, 192}, {64, 1024, 1024}, {130, 128, 256}}) {
    for (int scaling : {1, 0}) {
      if (scaling == 1 && (N % 128 != 0 || K % 128 != 0)) continue;
      for (rlh_dtype dc : {kBF16, kF32}) {
        const double alpha = dc == kF32 ? 0.5 : 1.0, beta = dc == kF32 ? 0.25 : 0.0;
        const int64_t pad = M % 2 ? 8 : 0;
        SCOPED_TRACE("M " + std::to_string(M) + " N " + std::to_string(N) + " K " + std::to_string(K) + " scaling " +
                     std::to_string(scaling) + " C " + rlh::sdk::dtype_name(dc));
        const Mat x = random_mat(rng, M, K, kBF16, 1.0, K + pad), w = random_mat(rng, N, K, kBF16, 0.02);
        const Quantized qw = quantize_on_device(*this, w, kE4M3, scaling == 1 ? 2 : 0, 0);
        std::vector<double> c0 = normal(rng, size_t(M * N), 1.0);
        for (double& v : c0) v = kc::round_to(dc, v);
        std::vector<uint8_t> cb(c0.size() * rlh::sdk::dtype_bytes(dc));
        kc::encode_values(dc, c0.data(), c0.size(), cb.data());
        Buf& c = alloc(cb.size());
        c.put(cb.data(), cb.size());
        const std::vector<rlh_tensor> in = {mat_t(upload(x), x), t(qw.q, {N, K}, kE4M3), t(qw.scale, {qw.nscale}, kF32)};
        const std::vector<rlh_tensor> out = {t(c.get(), {M, N}, dc)};
        run_once("gemm", in, out,
                 {rlh::sdk::attr_int("transpose_b", 1), rlh::sdk::attr_int("scaling", scaling),
                  rlh::sdk::attr_double("alpha", alpha), rlh::sdk::attr_double("beta", beta)});
        EXPECT_LE(rel_err(read(c, dc, c0.size()), ref_gemm(x, qw.deq, alpha, beta, c0)), 1e-2);
        ++ran;
      }
    }
  }
  EXPECT_EQ(ran, 22);
  // What the form does not take is refused at resolution (the caller quantises A instead).
  const Mat x = random_mat(rng, 4, 100, kBF16, 1.0), w = random_mat(rng, 64, 100, kBF16, 0.02);
  const Quantized qw = quantize_on_device(*this, w, kE4M3, 0, 0);
  Buf& c = alloc(size_t(4 * 64) * 2);
  std::string why;
  EXPECT_EQ(resolve_code("gemm", {mat_t(upload(x), x), t(qw.q, {64, 100}, kE4M3), t(qw.scale, {1}, kF32)},
                         {t(c.get(), {4, 64}, kBF16)}, {rlh::sdk::attr_int("transpose_b", 1)}, &why),
            RLH_E_UNIMPLEMENTED);
  EXPECT_NE(why.find("K must be a multiple of 64"), std::string::npos) << why;
}

// An FP8 linear layer, y = x W^T, forward and backward, the way an engine runs it through the
// registry: x and W quantised (e4m3), dY quantised (e5m2 for `hybrid`, e4m3 for `e4m3`), each
// backward product reading K-major copies (quantize_fp8 with transpose). Compared with the same
// layer in float64 on the bf16 values.
TEST_F(VendorFp8, Fp8LinearForwardAndBackwardAgreeWithBf16) {
  std::mt19937_64 rng(9);
  const int64_t T = 256, In = 512, Out = 384;  // tokens, input and output features
  const Mat x = random_mat(rng, T, In, kBF16, 1.0), w = random_mat(rng, Out, In, kBF16, 0.04),
            dy = random_mat(rng, T, Out, kBF16, 1e-3);
  for (const char* recipe : {"tensorwise", "blockwise"})
    for (rlh_dtype gd : {kE4M3, kE5M2}) {
      const bool block = std::string(recipe) == "blockwise";
      if (block && gd == kE5M2) continue;  // blockwise products take e4m3 only
      SCOPED_TRACE(std::string(recipe) + ", gradients " + rlh::sdk::dtype_name(gd));
      const int ga = block ? 1 : 0, gw = block ? 2 : 0;
      const double tol = gd == kE4M3 ? 1e-1 : 2e-1;
      // Forward: y = x W^T.
      const Quantized qx = quantize_on_device(*this, x, kE4M3, ga, 0), qw = quantize_on_device(*this, w, kE4M3, gw, 0);
      const rlh_dtype dc = block ? kBF16 : kF32;
      EXPECT_LE(rel_err(device_gemm(*this, qx, qw, kE4M3, kE4M3, block ? 1 : 0, dc), ref_gemm(x, w, 1, 0, {})), tol) << "y";
      // dX = dY W: A = dY [T, Out], B = W^T [In, Out] (W quantised transposed).
      const Quantized qdy = quantize_on_device(*this, dy, gd, ga, 0), qwt = quantize_on_device(*this, w, kE4M3, gw, 1);
      Mat wt;
      wt.rows = In;
      wt.cols = wt.ld = Out;
      for (int64_t i = 0; i < In; ++i)
        for (int64_t o = 0; o < Out; ++o) wt.v.push_back(w.at(o, i));
      EXPECT_LE(rel_err(device_gemm(*this, qdy, qwt, gd, kE4M3, block ? 1 : 0, dc), ref_gemm(dy, wt, 1, 0, {})), tol) << "dX";
      // dW = dY^T X: A = dY^T [Out, T], B = X^T [In, T] (both along tokens: 1x128 x 1x128).
      const Quantized qdyt = quantize_on_device(*this, dy, gd, ga, 1), qxt = quantize_on_device(*this, x, kE4M3, ga, 1);
      Mat dyt, xt;
      dyt.rows = Out;
      dyt.cols = dyt.ld = T;
      xt.rows = In;
      xt.cols = xt.ld = T;
      for (int64_t o = 0; o < Out; ++o)
        for (int64_t n = 0; n < T; ++n) dyt.v.push_back(dy.at(n, o));
      for (int64_t i = 0; i < In; ++i)
        for (int64_t n = 0; n < T; ++n) xt.v.push_back(x.at(n, i));
      EXPECT_LE(rel_err(device_gemm(*this, qdyt, qxt, gd, kE4M3, block ? 2 : 0, dc), ref_gemm(dyt, xt, 1, 0, {})), tol)
          << "dW";
    }
}

}  // namespace
