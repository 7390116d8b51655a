// Fp8Linears (fp8_linear.hpp): the CUDA engine's linears as FP8 products through the registry.
#include "rlhost/engine_cuda/fp8_linear.hpp"

#include <stdexcept>
#include <string>

namespace rlh::engine::cuda {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

Fp8Linears::Fp8Linears(DeviceOps& ops, Counters& counters, const Fp8Options& o, int64_t layers, bool forward_only,
                       const char* key)
    : ops_(ops), counters_(counters), opt_(o), layers_(layers) {
  if (opt_.blockwise && opt_.hybrid)
    throw std::invalid_argument("fp8_cfg: fp8 = hybrid with fp8_recipe = blockwise: block-scaled products take "
                                "e4m3 operands only (cuBLASLt on Hopper); use fp8 = e4m3");
  // One 128 x 128 x 128 case of each product, on zeros: resolution happens here, so a missing
  // or refusing FP8 provider is an error at construction naming the product.
  const int64_t n = 128;
  DeviceBuffer x(counters_, size_t(n * n) * sizeof(bf16)), y(counters_, size_t(n * n) * sizeof(float));
  check(cudaMemset(x.get(), 0, x.size()), "fp8 probe");
  check(cudaMemset(y.get(), 0, y.size()), "fp8 probe");
  const bf16* xb = x.get<bf16>();
  const char* what = "the forward product X W^T";
  try {
    if (!input(xb, n, n, n) || !fits_group(n, n)) throw std::logic_error("a 128-aligned case does not fit");
    forward(xb, n, y.get<bf16>(), n);
    if (forward_only) {
      check(cudaDeviceSynchronize(), "fp8 probe");
      stats_ = {};
      w_.clear();
      return;
    }
    what = "the input-gradient product dY W";
    backward_dx(xb, n, n, n, n, xb, 0, y.get<bf16>(), n);
    what = "the weight-gradient product dY^T X";
    input_t(xb, n, n, n);
    backward_dw(xb, n, n, n, n, y.get<float>());
    check(cudaDeviceSynchronize(), "fp8 probe");
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(key) + ": no kernel provider on this device runs " + what + " in FP8 (" + (opt_.blockwise ? "blockwise" : "tensorwise") +
                             (opt_.hybrid ? ", hybrid" : ", e4m3") + "; load one, e.g. --plugin libvendor_fp8.so): " +
                             e.what());
  }
  stats_ = {};
  w_.clear();
  wt_.clear();
}

int64_t Fp8Linears::scale_count(int grouping, int64_t rows, int64_t inner) const {
  if (grouping == 0) return 1;
  if (grouping == 1) return ceil_div(inner, 128) * rows;
  return ceil_div(rows, 128) * (ceil_div(ceil_div(inner, 128), 4) * 4);
}

void Fp8Linears::quantise(Quantised& out, const bf16* x, int64_t R, int64_t C, int64_t ldx, bool transpose,
                          DeviceOps::Fp8 f, int grouping) {
  const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
  const int64_t ns = scale_count(grouping, rows, inner);
  if (out.q.size() < size_t(rows * inner)) out.q = DeviceBuffer(counters_, size_t(rows * inner));
  if (out.scale.size() < size_t(ns) * sizeof(float)) out.scale = DeviceBuffer(counters_, size_t(ns) * sizeof(float));
  out.rows = rows;
  out.inner = inner;
  out.nscale = ns;
  ops_.quantize_fp8(x, R, C, ldx, transpose, f, grouping, out.q.get(), out.scale.get<float>(), ns);
}

const Fp8Linears::Quantised& Fp8Linears::weight(const bf16* W, int64_t rows, int64_t K, bool transposed) {
  Quantised& q = (transposed ? wt_ : w_)[W];
  if (q.epoch != epoch_ || q.rows != (transposed ? K : rows)) {
    quantise(q, W, rows, K, K, transposed, DeviceOps::Fp8::e4m3, weight_grouping());
    q.epoch = epoch_;
  }
  return q;
}

void Fp8Linears::reserve_input(int64_t N, int64_t K) {
  const int64_t ns = scale_count(act_grouping(), N, K);
  if (x_.q.size() < size_t(N * K)) x_.q = DeviceBuffer(counters_, size_t(N * K));
  if (x_.scale.size() < size_t(ns) * sizeof(float)) x_.scale = DeviceBuffer(counters_, size_t(ns) * sizeof(float));
}

bool Fp8Linears::input(const bf16* x, int64_t ldx, int64_t N, int64_t K) {
  // Blockwise: cuBLASLt found no algorithm for 378 token rows on the H100 (2026-12-05, the
  // generator's prefill), where tensorwise takes any count (200 in test_cuda_engine_fp8); its
  // 1x128 scales run down the tokens, so their count must keep each column of scales aligned.
  if (N == 0 || !aligned(K) || (opt_.blockwise && N % 16 != 0)) return false;
  quantise(x_, x, N, K, ldx, false, DeviceOps::Fp8::e4m3, act_grouping());
  xN_ = N;
  xK_ = K;
  return true;
}

bool Fp8Linears::fits_group(int64_t rows, int64_t ldy) const { return aligned(rows) && ldy % 8 == 0; }

void Fp8Linears::forward(const bf16* W, int64_t rows, bf16* y, int64_t ldy) {
  const Quantised& w = weight(W, rows, xK_, false);
  ops_.gemm_fp8(xN_, rows, xK_, x_.q.get(), DeviceOps::Fp8::e4m3, x_.scale.get<float>(), x_.nscale, w.q.get(),
                DeviceOps::Fp8::e4m3, w.scale.get<float>(), w.nscale, opt_.blockwise ? 1 : 0, 0.0, y, ldy, false);
  ++stats_.fp8_gemms;
}

bool Fp8Linears::backward_dx(const bf16* dy, int64_t lddy, int64_t N, int64_t rows, int64_t K, const bf16* W,
                             double beta, bf16* dx, int64_t lddx) {
  if (N == 0 || !aligned(rows) || !aligned(K) || lddx % 8 != 0) return false;
  quantise(dy_, dy, N, rows, lddy, false, grad_format(), act_grouping());
  const Quantised& wt = weight(W, rows, K, true);
  ops_.gemm_fp8(N, K, rows, dy_.q.get(), grad_format(), dy_.scale.get<float>(), dy_.nscale, wt.q.get(),
                DeviceOps::Fp8::e4m3, wt.scale.get<float>(), wt.nscale, opt_.blockwise ? 1 : 0, beta, dx, lddx, false);
  ++stats_.fp8_gemms;
  return true;
}

bool Fp8Linears::input_t(const bf16* x, int64_t ldx, int64_t N, int64_t K) {
  xtN_ = xtK_ = 0;
  if (!aligned(N) || !aligned(K)) return false;
  quantise(xt_, x, N, K, ldx, true, DeviceOps::Fp8::e4m3, act_grouping());
  xtN_ = N;
  xtK_ = K;
  return true;
}

bool Fp8Linears::backward_dw(const bf16* dy, int64_t lddy, int64_t N, int64_t rows, int64_t K, float* dW) {
  if (xtN_ != N || xtK_ != K || !aligned(rows)) return false;
  quantise(dyt_, dy, N, rows, lddy, true, grad_format(), act_grouping());
  ops_.gemm_fp8(rows, K, N, dyt_.q.get(), grad_format(), dyt_.scale.get<float>(), dyt_.nscale, xt_.q.get(),
                DeviceOps::Fp8::e4m3, xt_.scale.get<float>(), xt_.nscale, opt_.blockwise ? 2 : 0, 1.0, dW, K, true);
  ++stats_.fp8_gemms;
  return true;
}

}  // namespace rlh::engine::cuda
