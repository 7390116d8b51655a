// Fp8Linears (fp8_linear.hpp): the CUDA engine's linears as FP8 products through the registry.
#include "rlhost/engine_cuda/fp8_linear.hpp"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace rlh::engine::cuda {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t kProbeSite = -2;  // the constructor's probe (delayed scaling), dropped after it
}  // namespace

Fp8Linears::Fp8Linears(DeviceOps& ops, Counters& counters, const Fp8Options& o, int64_t layers, bool forward_only,
                       const char* key)
    : ops_(ops), counters_(counters), opt_(o), layers_(layers) {
  // Generation's products repeat their few shapes every step, so the provider may time its
  // candidates once per shape (RLH_FP8_AUTOTUNE=0: its first guess, the A/B). Training keeps the
  // heuristic's pick: a run's products do not depend on timings.
  const char* at = std::getenv("RLH_FP8_AUTOTUNE");
  autotune_ = forward_only && !(at && std::string(at) == "0");
  if (opt_.blockwise && opt_.hybrid)
    throw std::invalid_argument("fp8_cfg: fp8 = hybrid with fp8_recipe = blockwise: block-scaled products take "
                                "e4m3 operands only (cuBLASLt on Hopper); use fp8 = e4m3");
  if (opt_.delayed && opt_.blockwise)
    throw std::invalid_argument("fp8_cfg: fp8_recipe = delayed scales per tensor; it is not blockwise");
  if (opt_.delayed && (opt_.amax_history_len < 1 || opt_.margin < 0))
    throw std::invalid_argument("fp8_cfg: fp8_amax_history_len must be >= 1 and fp8_margin >= 0 (got " +
                                std::to_string(opt_.amax_history_len) + ", " + std::to_string(opt_.margin) + ")");
  // One 128 x 128 x 128 case of each product, on zeros: resolution happens here, so a missing
  // or refusing FP8 provider is an error at construction naming the product.
  const int64_t n = 128;
  DeviceBuffer x(counters_, size_t(n * n) * sizeof(bf16)), y(counters_, size_t(n * n) * sizeof(float));
  check(cudaMemset(x.get(), 0, x.size()), "fp8 probe");
  check(cudaMemset(y.get(), 0, y.size()), "fp8 probe");
  const bf16* xb = x.get<bf16>();
  const char* what = "the forward product X W^T";
  try {
    if (opt_.delayed) {
      what = "delayed scaling's quantize_fp8 (recipe = 1)";
      add_sites({kProbeSite}, {kProbeSite});
      what = "the forward product X W^T";
    }
    if (!input(xb, n, n, n, kProbeSite) || !fits_group(n, n)) throw std::logic_error("a 128-aligned case does not fit");
    forward(xb, n, y.get<bf16>(), n);
    if (forward_only) {
      check(cudaDeviceSynchronize(), "fp8 probe");
      // The weight-only form (set_weight_only_rows) and, blockwise, the form with A quantised in
      // the product (set_quantize_in_product_rows): optional, asked once, here, outside any
      // captured graph.
      const auto offered = [&](bool quantize_a) {
        try {
          const Quantised& w = weight(xb, n, n, false);
          const bool ran = ops_.gemm_fp8_weight_only(16, n, n, xb, n, w.q.get(), w.sc(), w.nscale,
                                                     opt_.blockwise ? 1 : 0, y.get<bf16>(), n, quantize_a);
          check(cudaDeviceSynchronize(), "fp8 probe (weight-only)");
          return ran;
        } catch (const std::exception&) {
          cudaGetLastError();
          return false;
        }
      };
      w8_offered_ = offered(false);
      qa_offered_ = opt_.blockwise && offered(true);
      stats_ = {};
      w_.clear();
      in_sites_.clear();
      grad_sites_.clear();
      return;
    }
    what = "the input-gradient product dY W";
    backward_dx(xb, n, n, n, n, xb, 0, y.get<bf16>(), n, kProbeSite);
    what = "the weight-gradient product dY^T X";
    input_t(xb, n, n, n, kProbeSite);
    backward_dw(xb, n, n, n, n, y.get<float>(), kProbeSite);
    check(cudaDeviceSynchronize(), "fp8 probe");
    if (opt_.delayed) {  // an optional form: a site's handle writing x and x^T with its one history
      DeviceBuffer q(counters_, size_t(n * n)), qt(counters_, size_t(n * n)), sc(counters_, sizeof(float));
      try {
        ops_.quantize_fp8_both(site(in_sites_, kProbeSite, "input").q, xb, n, n, n, DeviceOps::Fp8::e4m3, q.get(),
                               qt.get(), sc.get<float>(), delayed_scaling());
        check(cudaDeviceSynchronize(), "fp8 probe");
        delayed_both_ = true;
      } catch (const std::exception&) {  // each copy then keeps its own history, as before
        cudaGetLastError();
        delayed_both_ = false;
      }
    }
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(key) + ": no kernel provider on this device runs " + what + " in FP8 (" +
                             (opt_.blockwise ? "blockwise" : opt_.delayed ? "tensorwise, delayed scaling" : "tensorwise") +
                             (opt_.hybrid ? ", hybrid" : ", e4m3") + "; load one, e.g. --plugin libvendor_fp8.so): " +
                             e.what());
  }
  stats_ = {};
  w_.clear();
  wt_.clear();
  kept_t_.clear();
  in_sites_.clear();
  grad_sites_.clear();
}

void Fp8Linears::add_sites(const std::vector<int64_t>& inputs, const std::vector<int64_t>& groups) {
  if (!opt_.delayed) return;
  const DeviceOps::DelayedScaling d = delayed_scaling();
  for (const int64_t id : inputs) {
    if (in_sites_.count(id)) throw std::logic_error("fp8 delayed scaling: input site " + std::to_string(id) + " twice");
    Site& s = in_sites_[id];
    s.q = ops_.resolve_quantize_fp8_delayed(false, DeviceOps::Fp8::e4m3, d);
    s.qt = ops_.resolve_quantize_fp8_delayed(true, DeviceOps::Fp8::e4m3, d);
  }
  for (const int64_t id : groups) {
    if (grad_sites_.count(id)) throw std::logic_error("fp8 delayed scaling: gradient site " + std::to_string(id) + " twice");
    Site& s = grad_sites_[id];
    s.q = ops_.resolve_quantize_fp8_delayed(false, grad_format(), d);
    s.qt = ops_.resolve_quantize_fp8_delayed(true, grad_format(), d);
  }
}

Fp8Linears::Site& Fp8Linears::site(std::map<int64_t, Site>& sites, int64_t id, const char* what) {
  auto it = sites.find(id);
  if (it == sites.end())
    throw std::logic_error(std::string("fp8 delayed scaling: no ") + what + " site " + std::to_string(id) +
                           " was resolved at setup (add_sites)");
  return it->second;
}

void Fp8Linears::quantise_delayed(Quantised& out, const sdk::Op& op, const bf16* x, int64_t R, int64_t C, int64_t ldx,
                                  bool transpose, DeviceOps::Fp8 f) {
  const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
  if (out.q.size() < size_t(rows * inner)) out.q = DeviceBuffer(counters_, size_t(rows * inner));
  if (out.scale.size() < sizeof(float)) out.scale = DeviceBuffer(counters_, sizeof(float));
  out.rows = rows;
  out.inner = inner;
  out.nscale = 1;
  out.given = nullptr;
  ops_.quantize_fp8(op, x, R, C, ldx, transpose, f, out.q.get(), out.scale.get<float>(), delayed_scaling());
}

namespace {
constexpr char kStateMagic[8] = {'R', 'L', 'H', 'F', 'P', '8', 'D', '1'};

void put(std::string& out, int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); }

// Reads the state's fields in order, refusing a short or overlong one by name.
struct StateReader {
  const std::string& in;
  size_t at = 0;
  int64_t i64() {
    int64_t v = 0;
    need(sizeof v);
    std::memcpy(&v, in.data() + at, sizeof v);
    at += sizeof v;
    return v;
  }
  std::string bytes(int64_t n) {
    if (n < 0) throw std::invalid_argument("fp8 state: a negative length");
    need(size_t(n));
    std::string s = in.substr(at, size_t(n));
    at += size_t(n);
    return s;
  }
  void need(size_t n) const {
    if (in.size() - at < n)
      throw std::invalid_argument("fp8 state: cut short (" + std::to_string(in.size()) + " bytes)");
  }
};
}  // namespace

std::string Fp8Linears::state() const {
  if (!opt_.delayed) return {};
  std::string out(kStateMagic, sizeof kStateMagic);
  put(out, opt_.amax_history_len);
  put(out, opt_.amax_max ? 1 : 0);
  put(out, opt_.margin);
  put(out, int64_t(in_sites_.size()));
  put(out, int64_t(grad_sites_.size()));
  for (const auto* sites : {&in_sites_, &grad_sites_})
    for (const auto& [id, s] : *sites) put(out, id);
  for (const auto* sites : {&in_sites_, &grad_sites_})
    for (const auto& [id, s] : *sites)
      for (const sdk::Op* op : {&s.q, &s.qt}) {
        const std::string b = DeviceOps::op_state(*op);
        put(out, int64_t(b.size()));
        out += b;
      }
  return out;
}

void Fp8Linears::load_state(const std::string& bytes) {
  if (!opt_.delayed) throw std::logic_error("fp8 state: this engine does not run delayed scaling");
  if (bytes.size() < sizeof kStateMagic || std::memcmp(bytes.data(), kStateMagic, sizeof kStateMagic) != 0)
    throw std::invalid_argument("fp8 state: not the CUDA engine's FP8 delayed-scaling state (" +
                                std::to_string(bytes.size()) + " bytes)");
  StateReader r{bytes, sizeof kStateMagic};
  const int64_t len = r.i64();
  r.i64();  // the algorithm and margin the histories were kept under: either way amaxes
  r.i64();
  if (len != opt_.amax_history_len)
    throw std::invalid_argument("fp8 state: saved with fp8_amax_history_len = " + std::to_string(len) +
                                ", this run has " + std::to_string(opt_.amax_history_len) +
                                " (the histories cannot be carried over)");
  const int64_t n_in = r.i64(), n_grad = r.i64();
  bool same = n_in == int64_t(in_sites_.size()) && n_grad == int64_t(grad_sites_.size());
  for (const auto* sites : {&in_sites_, &grad_sites_})
    for (const auto& [id, s] : *sites)
      if (same) same = r.i64() == id;
  if (!same)
    throw std::invalid_argument("fp8 state: saved for " + std::to_string(n_in) + " input and " +
                                std::to_string(n_grad) + " gradient sites, this engine has " +
                                std::to_string(in_sites_.size()) + " and " + std::to_string(grad_sites_.size()) +
                                " or others (another model, or other layers kept in bf16)");
  std::vector<std::string> states;
  for (size_t i = 0; i < 2 * (in_sites_.size() + grad_sites_.size()); ++i) states.push_back(r.bytes(r.i64()));
  if (r.at != bytes.size())
    throw std::invalid_argument("fp8 state: " + std::to_string(bytes.size() - r.at) + " bytes past its end");
  size_t k = 0;
  for (auto* sites : {&in_sites_, &grad_sites_})
    for (auto& [id, s] : *sites)
      for (const sdk::Op* op : {&s.q, &s.qt}) DeviceOps::load_op_state(*op, states[k++]);
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
  out.given = nullptr;
}

bool Fp8Linears::quantise_given(Quantised& out, const bf16* x, int64_t R, int64_t C, int64_t ldx, bool transpose,
                                DeviceOps::Fp8 f, const float* scale) {
  const int64_t rows = transpose ? C : R, inner = transpose ? R : C;
  if (out.q.size() < size_t(rows * inner)) out.q = DeviceBuffer(counters_, size_t(rows * inner));
  if (!ops_.quantize_fp8_given(x, R, C, ldx, transpose, f, out.q.get(), scale)) return false;
  out.rows = rows;
  out.inner = inner;
  out.nscale = 1;
  out.given = scale;
  return true;
}

bool Fp8Linears::quantise_both(Quantised& out, Quantised& out_t, const bf16* x, int64_t R, int64_t C, int64_t ldx,
                               DeviceOps::Fp8 f, bool scale_in_t, const sdk::Op* op) {
  if (op && !delayed_both_) return false;
  Quantised& owner = scale_in_t ? out_t : out;
  Quantised& other = scale_in_t ? out : out_t;
  if (out.q.size() < size_t(R * C)) out.q = DeviceBuffer(counters_, size_t(R * C));
  if (out_t.q.size() < size_t(R * C)) out_t.q = DeviceBuffer(counters_, size_t(R * C));
  if (owner.scale.size() < sizeof(float)) owner.scale = DeviceBuffer(counters_, sizeof(float));
  float* sc = owner.scale.get<float>();
  if (op)
    ops_.quantize_fp8_both(*op, x, R, C, ldx, f, out.q.get(), out_t.q.get(), sc, delayed_scaling());
  else if (!ops_.quantize_fp8_both(x, R, C, ldx, f, out.q.get(), out_t.q.get(), sc))
    return false;
  out.rows = R;
  out.inner = C;
  out_t.rows = C;
  out_t.inner = R;
  out.nscale = out_t.nscale = 1;
  owner.given = nullptr;
  other.given = sc;
  return true;
}

const Fp8Linears::Quantised& Fp8Linears::weight(const bf16* W, int64_t rows, int64_t K, bool transposed) {
  Quantised& q = (transposed ? wt_ : w_)[W];
  if (q.epoch != epoch_ || q.rows != (transposed ? K : rows)) {
    // Weights keep current per-tensor scaling under the delayed recipe too, so W^T can always
    // take W's scale: made beside W in a training call, else from W's scale.
    const bool per_tensor = !opt_.blockwise;
    const auto w = w_.find(W);
    if (!transposed && train_ && per_tensor && quantise_both(q, wt_[W], W, rows, K, K, DeviceOps::Fp8::e4m3)) {
      wt_[W].epoch = epoch_;
    } else if (!(transposed && per_tensor && w != w_.end() && w->second.epoch == epoch_ && w->second.rows == rows &&
                 quantise_given(q, W, rows, K, K, true, DeviceOps::Fp8::e4m3, w->second.sc()))) {
      quantise(q, W, rows, K, K, transposed, DeviceOps::Fp8::e4m3, weight_grouping());
    }
    q.epoch = epoch_;
  }
  return q;
}

void Fp8Linears::reserve_input(int64_t N, int64_t K) {
  const int64_t ns = scale_count(act_grouping(), N, K);
  if (x_.q.size() < size_t(N * K)) x_.q = DeviceBuffer(counters_, size_t(N * K));
  if (x_.scale.size() < size_t(ns) * sizeof(float)) x_.scale = DeviceBuffer(counters_, size_t(ns) * sizeof(float));
}

void Fp8Linears::quantise_operand(Quantised& out, std::map<int64_t, Site>& sites, int64_t id, const char* what,
                                  const bf16* x, int64_t R, int64_t C, int64_t ldx, bool transpose, DeviceOps::Fp8 f) {
  if (!opt_.delayed) return quantise(out, x, R, C, ldx, transpose, f, act_grouping());
  const Site& s = site(sites, id, what);
  quantise_delayed(out, transpose ? s.qt : s.q, x, R, C, ldx, transpose, f);
}

bool Fp8Linears::input_buffers(int64_t N, int64_t K, void** q, float** scale) {
  if (train_ || !opt_.blockwise || opt_.delayed || N <= w8_rows_ || !tokens_fit(N) || !aligned(K)) return false;
  reserve_input(N, K);
  *q = x_.q.get();
  *scale = x_.scale.get<float>();
  return true;
}

bool Fp8Linears::input(const bf16* x, int64_t ldx, int64_t N, int64_t K, int64_t site_id) {
  xw_ = nullptr;
  xqa_ = false;
  if (const Src p = std::exchange(produced_, Src{}); p == Src{x, N, K, ldx}) {  // the producer quantised x
    x_.rows = N;
    x_.inner = K;
    x_.nscale = scale_count(act_grouping(), N, K);
    x_.given = nullptr;
    xN_ = N;
    xK_ = K;
    return true;
  }
  if (!train_ && N > 0 && N <= w8_rows_ && aligned(K) && ldx % 8 == 0) {  // weight-only: nothing to quantise
    xw_ = x;
    xw_ld_ = ldx;
    xN_ = N;
    xK_ = K;
    return true;
  }
  if (!train_ && opt_.blockwise && N > 0 && N <= qa_rows_ && aligned(K) && ldx % 8 == 0) {  // quantised in the product
    xw_ = x;
    xw_ld_ = ldx;
    xqa_ = true;
    xN_ = N;
    xK_ = K;
    return true;
  }
  if (!tokens_fit(N) || !aligned(K)) return false;
  // A training call's forward makes X^T beside X (per tensor; input_t's conditions) and keeps it
  // for the step's dW: one pass over X instead of two, and one amax.
  if (train_ && !opt_.blockwise && aligned(N)) {
    KeptT& k = kept_t_[site_id];
    const sdk::Op* op = opt_.delayed ? &site(in_sites_, site_id, "input").q : nullptr;
    if (quantise_both(x_, k.q, x, N, K, ldx, DeviceOps::Fp8::e4m3, /*scale_in_t=*/true, op)) {
      k.src = {x, N, K, ldx};
      k.epoch = epoch_;
      xN_ = N;
      xK_ = K;
      return true;
    }
    k.epoch = -1;
  }
  quantise_operand(x_, in_sites_, site_id, "input", x, N, K, ldx, false, DeviceOps::Fp8::e4m3);
  xN_ = N;
  xK_ = K;
  return true;
}

bool Fp8Linears::fits_group(int64_t rows, int64_t ldy) const { return aligned(rows) && ldy % 8 == 0; }

void Fp8Linears::forward(const bf16* W, int64_t rows, bf16* y, int64_t ldy) {
  const Quantised& w = weight(W, rows, xK_, false);
  if (xw_) {  // (only once the constructor's probe ran the form: it is resolved, so it runs)
    if (!ops_.gemm_fp8_weight_only(xN_, rows, xK_, xw_, xw_ld_, w.q.get(), w.sc(), w.nscale, opt_.blockwise ? 1 : 0,
                                   y, ldy, xqa_))
      throw std::logic_error("fp8: the weight-only product ran at setup and is refused now");
    ++stats_.fp8_gemms;
    ++(xqa_ ? stats_.quantized_in_product : stats_.weight_only);
    return;
  }
  ops_.gemm_fp8(xN_, rows, xK_, x_.q.get(), DeviceOps::Fp8::e4m3, x_.sc(), x_.nscale, w.q.get(),
                DeviceOps::Fp8::e4m3, w.sc(), w.nscale, opt_.blockwise ? 1 : 0, 0.0, y, ldy, false,
                /*fast_accum=*/true,  // TransformerEngine's forward; the gradients' products promote
                autotune_);
  ++stats_.fp8_gemms;
}

bool Fp8Linears::backward_dx(const bf16* dy, int64_t lddy, int64_t N, int64_t rows, int64_t K, const bf16* W,
                             double beta, bf16* dx, int64_t lddx, int64_t site_id) {
  dy_src_ = dyt_src_ = {};
  if (!tokens_fit(N) || !aligned(rows) || !aligned(K) || lddx % 8 != 0) return false;
  // When this group's dW runs in FP8 next (backward_dw's conditions), dY^T is made in the same
  // pass (per tensor; under delayed scaling with the dY site's history).
  const Src src{dy, N, rows, lddy};
  const sdk::Op* op = opt_.delayed ? &site(grad_sites_, site_id, "gradient").q : nullptr;
  if (!opt_.blockwise && xtN_ == N && xtK_ == K && aligned(rows) &&
      quantise_both(dy_, dyt_, dy, N, rows, lddy, grad_format(), false, op))
    dyt_src_ = src;
  else
    quantise_operand(dy_, grad_sites_, site_id, "gradient", dy, N, rows, lddy, false, grad_format());
  dy_src_ = src;
  const Quantised& wt = weight(W, rows, K, true);
  ops_.gemm_fp8(N, K, rows, dy_.q.get(), grad_format(), dy_.sc(), dy_.nscale, wt.q.get(),
                DeviceOps::Fp8::e4m3, wt.sc(), wt.nscale, opt_.blockwise ? 1 : 0, beta, dx, lddx, false);
  ++stats_.fp8_gemms;
  return true;
}

bool Fp8Linears::input_t(const bf16* x, int64_t ldx, int64_t N, int64_t K, int64_t site_id) {
  xtN_ = xtK_ = 0;
  xt_use_ = &xt_;
  if (!aligned(N) || !aligned(K)) return false;
  const auto kept = kept_t_.find(site_id);
  if (kept != kept_t_.end() && kept->second.epoch == epoch_ && kept->second.src == Src{x, N, K, ldx})
    xt_use_ = &kept->second.q;  // made in this step's forward from the same source
  else
    quantise_operand(xt_, in_sites_, site_id, "input", x, N, K, ldx, true, DeviceOps::Fp8::e4m3);
  xtN_ = N;
  xtK_ = K;
  return true;
}

bool Fp8Linears::backward_dw(const bf16* dy, int64_t lddy, int64_t N, int64_t rows, int64_t K, float* dW,
                             int64_t site_id) {
  if (xtN_ != N || xtK_ != K || !aligned(rows)) return false;
  const Src src{dy, N, rows, lddy};
  if (!(dyt_src_ == src) && !(reuse_scale() && dy_src_ == src &&
                              quantise_given(dyt_, dy, N, rows, lddy, true, grad_format(), dy_.sc())))
    quantise_operand(dyt_, grad_sites_, site_id, "gradient", dy, N, rows, lddy, true, grad_format());
  dyt_src_ = {};
  const Quantised& xt = *xt_use_;
  ops_.gemm_fp8(rows, K, N, dyt_.q.get(), grad_format(), dyt_.sc(), dyt_.nscale, xt.q.get(), DeviceOps::Fp8::e4m3,
                xt.sc(), xt.nscale, opt_.blockwise ? 2 : 0, 1.0, dW, K, true);
  ++stats_.fp8_gemms;
  return true;
}

}  // namespace rlh::engine::cuda
