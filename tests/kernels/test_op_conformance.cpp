// Op conformance through the SDK's runner (rlhost/sdk/kernel_check.hpp) on every kernel provider
// the host finds on the build's plugin path that runs on the CPU, kernels_cpu included: the
// reference is checked against itself where that means something, its float32 ops against its
// float64 ones. Every op a provider lists must have a case, every dtype it lists must run, and
// the runner must find the reference by its provider_info, not by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "rlhost/host.h"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernel_check.hpp"

namespace {

using namespace rlh;

class PluginPathHost {
 public:
  PluginPathHost() {
    sdk::check(rlhost_create(&h_), "rlhost_create");
    rlhost_set_log_level(h_, RLH_LOG_WARN);
    sdk::check(rlhost_add_plugin_dir(h_, RLH_PLUGIN_DIR));
  }
  ~PluginPathHost() { rlhost_destroy(h_); }
  sdk::Host host() const { return sdk::Host(rlhost_services(h_)); }

 private:
  rlhost_t* h_ = nullptr;
};

// The KERNELS components the host has (its plugin path is autoloaded when listed), score order.
std::vector<std::string> kernel_providers(const sdk::Host& host) {
  std::string listing;
  sdk::check(host.api()->list_components(host.api()->ctx, RLH_KIND_KERNELS, sdk::write_to_string, &listing));
  std::vector<std::string> names;
  for (const auto& c : nlohmann::json::parse(listing)) names.push_back(c["name"]);
  return names;
}

TEST(OpConformance, EveryCpuProviderEveryOpEveryDtype) {
  PluginPathHost h;
  const sdk::Host host = h.host();
  auto ref = sdk::ReferenceKernels::find(host);
  ASSERT_TRUE(ref) << "no reference kernel provider on " << RLH_PLUGIN_DIR;
  EXPECT_EQ(ref->name(), "kernels_cpu");
  int checked = 0;
  for (const std::string& name : kernel_providers(host)) {
    SCOPED_TRACE("provider " + name);
    const auto* api = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, name.c_str(), RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
    rlh_kernels* inst = nullptr;
    if (rlh_status* s = api->create(host.api(), sdk::kCPU, "{}", 2, &inst)) {
      const rlh_code code = s->code;
      std::printf("%s: not on the CPU (%s)\n", name.c_str(), sdk::status_message(s).c_str());
      rlh_status_destroy(s);
      EXPECT_TRUE(code == RLH_E_UNIMPLEMENTED || code == RLH_E_UNAVAILABLE) << code;
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const sdk::KernelCheckReport rep = sdk::check_kernels(*ref, name, api, inst, sdk::kCPU);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    api->destroy(inst);
    std::printf("%s(%.2f s)\n", rep.table().c_str(), secs);
    ++checked;
    EXPECT_FALSE(rep.failed());
    for (const std::string& f : rep.failures()) ADD_FAILURE() << f;
    for (const auto& row : rep.rows) {
      if (!row.listed) continue;
      for (size_t i = 0; i < row.cells.size(); ++i) {
        const auto& c = row.cells[i];
        const char* variant = sdk::kernel_variants()[i].name;
        EXPECT_NE(c.state, sdk::KernelCheckCell::no_case) << row.op << " has no conformance case";
        EXPECT_NE(c.state, sdk::KernelCheckCell::no_reference) << row.op << " " << variant << ": " << c.note;
        EXPECT_NE(c.state, sdk::KernelCheckCell::refused) << row.op << " " << variant << ": " << c.note;
      }
    }
    if (name == "kernels_cpu") {  // f32 and f64 of every op it lists ran
      for (const auto& row : rep.rows) {
        if (!row.listed) continue;
        EXPECT_EQ(row.cells[0].state, sdk::KernelCheckCell::pass) << row.op << " f32";
      }
      ASSERT_NE(rep.row("gemm"), nullptr);
      EXPECT_EQ(rep.row("gemm")->cells[3].state, sdk::KernelCheckCell::pass) << "gemm f64";
      EXPECT_GT(rep.row("gemm")->cells[0].worst, 0.0) << "f32 against the f64 reference cannot be exact";
    }
  }
  EXPECT_GT(checked, 0);
}

// The reference's adamw_bf16 (the runner compares other providers' with it, so it is checked
// here on its own): p, g, m, v as adamw leaves them, p16 the bf16 of p rounded to nearest even.
// lr = 0 keeps p, so p can sit exactly on bf16 ties.
TEST(OpConformance, ReferenceAdamwBf16RoundsTheWorkingCopyToNearestEven) {
  PluginPathHost h;
  const sdk::Host host = h.host();
  auto ref = sdk::ReferenceKernels::find(host);
  ASSERT_TRUE(ref);
  const float tie_down = 1.0f + 0x1p-8f;      // halfway between 1 and 1 + 2^-7: to 1 (even)
  const float tie_up = 1.0f + 3 * 0x1p-8f;    // halfway between 1 + 2^-7 and 1 + 2^-6: up (even)
  const float above = 1.0f + 0x1p-8f + 0x1p-20f;  // past the tie: up
  std::vector<float> p = {tie_down, tie_up, above, -tie_up, 3.0e38f, NAN}, g(6, 0.5f), m(6, 0.1f), v(6, 0.2f);
  std::vector<uint16_t> p16(6, 0);
  const int64_t n = 6;
  std::vector<rlh_tensor> outs;
  std::vector<sdk::Tensor> keep = {sdk::Tensor(p.data(), {n}), sdk::Tensor(g.data(), {n}), sdk::Tensor(m.data(), {n}),
                                   sdk::Tensor(v.data(), {n}), sdk::Tensor(p16.data(), {n}, sdk::kBF16)};
  for (const auto& t : keep) outs.push_back(t.raw());
  const std::vector<rlh_named_value> attrs = {sdk::attr_double("lr", 0.0), sdk::attr_int("step", 1)};
  sdk::KernelRegistry reg;
  reg.add_instance(ref->name(), ref->api(), ref->instance());
  sdk::Op op = reg.resolve("adamw_bf16", sdk::kCPU, {}, outs, attrs, true);
  op.run({}, outs, {});
  EXPECT_EQ(p[0], tie_down);  // lr = 0: p is kept
  EXPECT_EQ(p16[0], 0x3F80);  // 1.0
  EXPECT_EQ(p16[1], 0x3F82);  // 1 + 2^-6
  EXPECT_EQ(p16[2], 0x3F81);  // 1 + 2^-7
  EXPECT_EQ(p16[3], 0xBF82);
  EXPECT_EQ(p16[4], 0x7F62);  // 3.0e38 = 0x7F61B1E6 -> 0x7F62
  EXPECT_EQ(p16[5] & 0x7F80, 0x7F80);  // NaN stays NaN
  EXPECT_NE(p16[5] & 0x7F, 0);
  EXPECT_NE(m[0], 0.1f);  // the moments moved as adamw moves them
}

// The reference's paged_attention reads its own cache layout (keys transposed in a block) in
// place and copies any other first, e.g. the row-major keys of a device provider that the
// conformance runner hands it: every layout gives bitwise the same output.
TEST(OpConformance, ReferencePagedAttentionReadsAnyCacheLayout) {
  PluginPathHost h;
  const sdk::Host host = h.host();
  auto ref = sdk::ReferenceKernels::find(host);
  ASSERT_TRUE(ref);
  sdk::KernelRegistry reg;
  reg.add_instance(ref->name(), ref->api(), ref->instance());
  const int64_t B = 6, H = 2, bs = 4, D = 8, Hq = 4, R = 3, T = 4;
  std::vector<float> q(size_t(R * Hq * D)), k(size_t(B * H * bs * D)), v(size_t(B * H * bs * D));
  uint32_t x = 12345;
  auto rnd = [&] { x = x * 1664525u + 1013904223u; return float(int(x >> 9) % 2001 - 1000) / 1000.f; };
  for (auto* buf : {&q, &k, &v})
    for (float& f : *buf) f = rnd();
  std::vector<int32_t> table = {5, 0, -1, -1, 2, 4, -1, -1, 1, 3, 0, 5}, pos = {3, 6, 13};
  // The same values in three layouts: row-major [B][H][bs][D]; keys transposed in a block
  // [B][H][D][bs] (kernels_cpu's); values slot-major [B][bs][H][D].
  std::vector<float> kt(k.size()), vs(v.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t p = 0; p < bs; ++p)
        for (int64_t d = 0; d < D; ++d) {
          const size_t rm = size_t(((b * H + hh) * bs + p) * D + d);
          kt[size_t(((b * H + hh) * D + d) * bs + p)] = k[rm];
          vs[size_t(((b * bs + p) * H + hh) * D + d)] = v[rm];
        }
  struct Layout {
    int64_t shape[4], strides[4];
  };
  const Layout row_major{{B, H, bs, D}, {H * bs * D, bs * D, D, 1}};
  const Layout keys_t{{B, H, bs, D}, {H * D * bs, D * bs, 1, bs}};
  const Layout slot_major{{B, H, bs, D}, {bs * H * D, D, H * D, 1}};
  auto cache = [](float* p, const Layout& l) {
    rlh_tensor t{};
    t.data = p;
    t.device = sdk::kCPU;
    t.dtype = sdk::kF32;
    t.ndim = 4;
    t.shape = const_cast<int64_t*>(l.shape);
    t.strides = const_cast<int64_t*>(l.strides);
    return t;
  };
  const std::vector<rlh_named_value> attrs = {sdk::attr_double("scale", 0.35), sdk::attr_int("window", 0)};
  auto run = [&](float* kp, const Layout& kl, float* vp, const Layout& vl) {
    std::vector<float> o(size_t(R * Hq * D), -7.f);
    const sdk::Tensor tq(q.data(), {R, Hq, D}), tb(table.data(), {R, T}, sdk::kI32), tp(pos.data(), {R}, sdk::kI32),
        to(o.data(), {R, Hq, D});
    const std::vector<rlh_tensor> in = {tq.raw(), cache(kp, kl), cache(vp, vl), tb.raw(), tp.raw()};
    const std::vector<rlh_tensor> out = {to.raw()};
    sdk::Op op = reg.resolve("paged_attention", sdk::kCPU, in, out, attrs, true);
    op.run(in, out, attrs);
    return o;
  };
  const std::vector<float> native = run(kt.data(), keys_t, v.data(), row_major);
  EXPECT_EQ(run(k.data(), row_major, v.data(), row_major), native);
  EXPECT_EQ(run(kt.data(), keys_t, vs.data(), slot_major), native);
  EXPECT_EQ(run(k.data(), row_major, vs.data(), slot_major), native);
  EXPECT_NE(native[0], -7.f);
}

// ---------------------------------------------------------------------------------------------
// decode_layer_fwd is, by definition (docs/ops.md), the ops it fuses run in turn. The reference's
// decode_layer_fwd (float64 sums, decode_layer.cpp) against those kernels_cpu ops through the
// C ABI (float32 sums) on copies of the same operands and caches: y and both caches (row-major
// [B, Hkv, bs, D], pre-filled, so attention reads keys and values that were there before the
// step) agree to float32 rounding.

// max|got - ref| / max|ref|; +inf when a NaN appears.
double rel_err(const std::vector<float>& got, const std::vector<float>& ref) {
  double maxref = 0, maxerr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i]) || std::isnan(ref[i])) return INFINITY;
    maxref = std::max(maxref, std::fabs(double(ref[i])));
    maxerr = std::max(maxerr, std::fabs(double(got[i]) - double(ref[i])));
  }
  return maxerr / std::max(maxref, 1e-30);
}

// [N, H, D] heads of rows ld apart (e.g. the q or k heads inside a fused qkv row). Not copyable:
// the rlh_tensor points into it.
struct HeadsView {
  int64_t shape[3], strides[3];
  rlh_tensor t{};
  HeadsView(float* p, int64_t N, int64_t H, int64_t D, int64_t ld) : shape{N, H, D}, strides{ld, D, 1} {
    t.data = p;
    t.device = sdk::kCPU;
    t.dtype = sdk::kF32;
    t.ndim = 3;
    t.shape = shape;
    t.strides = strides;
  }
  HeadsView(const HeadsView&) = delete;
  HeadsView& operator=(const HeadsView&) = delete;
};

// Resolves `name` on the reference alone and runs it once.
void run_ref_op(const sdk::KernelRegistry& reg, const char* name, const std::vector<rlh_tensor>& in,
                const std::vector<rlh_tensor>& out, const std::vector<rlh_named_value>& attrs = {}) {
  sdk::Op op = reg.resolve(name, sdk::kCPU, in, out, attrs, true);
  op.run(in, out, attrs);
}

struct DecodeLayerShape {
  std::vector<int32_t> positions;  // one row each
  std::vector<int32_t> seq;        // the sequence of each row (rows of one sequence share blocks)
  int64_t C, F, Hq, Hkv, D, bs;
  // attributes: all given (non-default), or only eps (eps2 = eps and the other defaults)
  bool all_attrs;
};

// Operands of one decode_layer_fwd call, random f32; caches pre-filled with random values.
struct DecodeLayerOperands {
  int64_t R, C, F, Hq, Hkv, D, bs, B, T, Nqkv;
  std::vector<float> x, norm1, wqkv, wo, norm2, wgu, wdown, inv_freq, kc, vc;
  std::vector<int32_t> pos, slots, table;

  explicit DecodeLayerOperands(const DecodeLayerShape& s, uint32_t seed)
      : R(int64_t(s.positions.size())), C(s.C), F(s.F), Hq(s.Hq), Hkv(s.Hkv), D(s.D), bs(s.bs) {
    Nqkv = (Hq + 2 * Hkv) * D;
    // Each sequence's blocks: as many as its furthest row needs, scattered over the cache.
    const int32_t S = *std::max_element(s.seq.begin(), s.seq.end()) + 1;
    std::vector<int32_t> last(size_t(S), 0);
    for (int64_t r = 0; r < R; ++r) last[size_t(s.seq[size_t(r)])] = std::max(last[size_t(s.seq[size_t(r)])], s.positions[size_t(r)]);
    T = 0;
    int64_t used = 0;
    for (int32_t p : last) {
      T = std::max<int64_t>(T, p / bs + 1);
      used += p / bs + 1;
    }
    B = used + 3;  // spare blocks nobody reads
    std::vector<int32_t> ids(static_cast<size_t>(B));
    for (int64_t i = 0; i < B; ++i) ids[size_t(i)] = int32_t((B + 1 - i) % B);  // 1, 0, B-1, B-2, ...
    std::vector<int32_t> seq_table(size_t(S * T), -1);
    int64_t next = 0;
    for (int32_t q = 0; q < S; ++q)
      for (int64_t b = 0; b <= last[size_t(q)] / bs; ++b) seq_table[size_t(q * T + b)] = ids[size_t(next++)];
    for (int64_t r = 0; r < R; ++r) {
      const int32_t p = s.positions[size_t(r)], q = s.seq[size_t(r)];
      pos.push_back(p);
      table.insert(table.end(), seq_table.begin() + q * T, seq_table.begin() + (q + 1) * T);
      slots.push_back(int32_t(seq_table[size_t(q * T + p / bs)] * bs + p % bs));
    }
    std::mt19937 rng(seed);
    std::normal_distribution<float> N01;
    auto fill = [&](std::vector<float>& v, int64_t n, double sc, double offset = 0) {
      v.resize(size_t(n));
      for (float& f : v) f = float(offset + sc * N01(rng));
    };
    fill(x, R * C, 1);
    fill(norm1, C, 0.2, s.all_attrs ? 0 : 1);  // weight_offset 1 when all_attrs: w around 0, else 1
    fill(wqkv, Nqkv * C, 1 / std::sqrt(double(C)));
    fill(wo, C * Hq * D, 1 / std::sqrt(double(Hq * D)));
    fill(norm2, C, 0.2, s.all_attrs ? 0 : 1);
    fill(wgu, 2 * F * C, 1 / std::sqrt(double(C)));
    fill(wdown, C * F, 1 / std::sqrt(double(F)));
    fill(kc, B * Hkv * bs * D, 1);
    fill(vc, B * Hkv * bs * D, 1);
    inv_freq.resize(size_t(D / 2));
    for (int64_t i = 0; i < D / 2; ++i) inv_freq[size_t(i)] = float(std::pow(10000.0, -2.0 * double(i) / double(D)));
  }
};

std::vector<rlh_named_value> decode_layer_attrs(const DecodeLayerShape& s) {
  if (!s.all_attrs) return {sdk::attr_double("eps", 1e-4)};
  return {sdk::attr_double("eps", 1e-5),         sdk::attr_double("eps2", 1e-3),
          sdk::attr_double("weight_offset", 1.0), sdk::attr_double("rope_scale", 1.25),
          sdk::attr_double("scale", 0.3)};
}

// decode_layer_fwd on the given operands (its caches updated in place) -> y; throws on failure.
std::vector<float> run_decode_layer(const sdk::KernelRegistry& reg, DecodeLayerOperands& o,
                                    const std::vector<rlh_named_value>& attrs) {
  std::vector<float> y(size_t(o.R * o.C), -7.f);
  const int64_t R = o.R, C = o.C, F = o.F;
  const sdk::Tensor tx(o.x.data(), {R, C}), tn1(o.norm1.data(), {C}), twqkv(o.wqkv.data(), {o.Nqkv, C}),
      two(o.wo.data(), {C, o.Hq * o.D}), tn2(o.norm2.data(), {C}), twgu(o.wgu.data(), {2 * F, C}),
      twd(o.wdown.data(), {C, F}), tpos(o.pos.data(), {R}, sdk::kI32), tslots(o.slots.data(), {R}, sdk::kI32),
      ttable(o.table.data(), {R, o.T}, sdk::kI32), tfreq(o.inv_freq.data(), {o.D / 2}), ty(y.data(), {R, C}),
      tkc(o.kc.data(), {o.B, o.Hkv, o.bs, o.D}), tvc(o.vc.data(), {o.B, o.Hkv, o.bs, o.D});
  run_ref_op(reg, "decode_layer_fwd",
             {tx.raw(), tn1.raw(), twqkv.raw(), two.raw(), tn2.raw(), twgu.raw(), twd.raw(), tpos.raw(), tslots.raw(),
              ttable.raw(), tfreq.raw()},
             {ty.raw(), tkc.raw(), tvc.raw()}, attrs);
  return y;
}

// The same layer as the ops it fuses, one by one (caches updated in place) -> y and, for the
// checks that the comparison means something, h (the residual stream after attention).
std::vector<float> run_decode_layer_as_ops(const sdk::KernelRegistry& reg, const DecodeLayerShape& s,
                                           DecodeLayerOperands& o, std::vector<float>* h_out) {
  const int64_t R = o.R, C = o.C, F = o.F, Hq = o.Hq, Hkv = o.Hkv, D = o.D, Nqkv = o.Nqkv;
  const double eps = s.all_attrs ? 1e-5 : 1e-4, eps2 = s.all_attrs ? 1e-3 : eps;
  const double woff = s.all_attrs ? 1.0 : 0.0, rope_scale = s.all_attrs ? 1.25 : 1.0;
  const double scale = s.all_attrs ? 0.3 : 1.0 / std::sqrt(double(D));
  const rlh_named_value tb = sdk::attr_int("transpose_b", 1);
  auto n = [](int64_t k) { return size_t(k); };
  std::vector<float> xn(n(R * C)), qkv(n(R * Nqkv)), att(n(R * Hq * D)), a(n(R * C)), h(n(R * C)), xn2(n(R * C)),
      act(n(R * F)), d(n(R * C)), y(n(R * C));
  const sdk::Tensor tx(o.x.data(), {R, C}), tn1(o.norm1.data(), {C}), txn(xn.data(), {R, C}),
      twqkv(o.wqkv.data(), {Nqkv, C}), tqkv(qkv.data(), {R, Nqkv}), tpos(o.pos.data(), {R}, sdk::kI32),
      tfreq(o.inv_freq.data(), {D / 2}), tslots(o.slots.data(), {R}, sdk::kI32),
      tkc(o.kc.data(), {o.B, Hkv, o.bs, D}), tvc(o.vc.data(), {o.B, Hkv, o.bs, D}),
      ttable(o.table.data(), {R, o.T}, sdk::kI32), tatt3(att.data(), {R, Hq, D}), tatt(att.data(), {R, Hq * D}),
      two(o.wo.data(), {C, Hq * D}), ta(a.data(), {R, C}), tx1(o.x.data(), {R * C}), ta1(a.data(), {R * C}),
      th1(h.data(), {R * C}), th(h.data(), {R, C}), tn2(o.norm2.data(), {C}), txn2(xn2.data(), {R, C}),
      twgu(o.wgu.data(), {2 * F, C}), tact(act.data(), {R, F}), twd(o.wdown.data(), {C, F}), td(d.data(), {R, C}),
      td1(d.data(), {R * C}), ty1(y.data(), {R * C});
  // the q, k and v heads inside qkv's rows
  const HeadsView q(qkv.data(), R, Hq, D, Nqkv), k(qkv.data() + Hq * D, R, Hkv, D, Nqkv),
      v(qkv.data() + (Hq + Hkv) * D, R, Hkv, D, Nqkv);
  run_ref_op(reg, "rmsnorm_fwd", {tx.raw(), tn1.raw()}, {txn.raw()},
             {sdk::attr_double("eps", eps), sdk::attr_double("weight_offset", woff)});
  run_ref_op(reg, "gemm", {txn.raw(), twqkv.raw()}, {tqkv.raw()}, {tb});
  run_ref_op(reg, "rope_fwd", {q.t, tpos.raw(), tfreq.raw()}, {q.t}, {sdk::attr_double("scale", rope_scale)});
  run_ref_op(reg, "rope_fwd", {k.t, tpos.raw(), tfreq.raw()}, {k.t}, {sdk::attr_double("scale", rope_scale)});
  run_ref_op(reg, "kv_cache_write", {k.t, v.t, tslots.raw()}, {tkc.raw(), tvc.raw()});
  run_ref_op(reg, "paged_attention", {q.t, tkc.raw(), tvc.raw(), ttable.raw(), tpos.raw()}, {tatt3.raw()},
             {sdk::attr_double("scale", scale)});
  run_ref_op(reg, "gemm", {tatt.raw(), two.raw()}, {ta.raw()}, {tb});
  run_ref_op(reg, "add_fwd", {tx1.raw(), ta1.raw()}, {th1.raw()});
  run_ref_op(reg, "rmsnorm_fwd", {th.raw(), tn2.raw()}, {txn2.raw()},
             {sdk::attr_double("eps", eps2), sdk::attr_double("weight_offset", woff)});
  run_ref_op(reg, "gemm_glu_fwd", {txn2.raw(), twgu.raw()}, {tact.raw()}, {sdk::attr_int("activation", 0)});
  run_ref_op(reg, "gemm", {tact.raw(), twd.raw()}, {td.raw()}, {tb});
  run_ref_op(reg, "add_fwd", {th1.raw(), td1.raw()}, {ty1.raw()});
  if (h_out) *h_out = h;
  return y;
}

TEST(OpConformance, DecodeLayerFwdIsTheOpsItFuses) {
  PluginPathHost hst;
  const sdk::Host host = hst.host();
  auto ref = sdk::ReferenceKernels::find(host);
  ASSERT_TRUE(ref);
  sdk::KernelRegistry reg;
  reg.add_instance(ref->name(), ref->api(), ref->instance());
  const std::vector<DecodeLayerShape> shapes = {
      // one row, groups of 2 query heads a kv head, every attribute off its default
      {{9}, {0}, 64, 96, 4, 2, 16, 4, true},
      // three rows of three sequences, the first token among them, no grouping, default attributes
      {{0, 5, 13}, {0, 1, 2}, 64, 96, 4, 4, 16, 4, false},
      // two rows of one sequence (the second attends to the first's new key), MQA
      {{6, 7}, {0, 0}, 32, 48, 4, 1, 8, 4, true},
  };
  uint32_t seed = 11;
  for (const DecodeLayerShape& s : shapes) {
    SCOPED_TRACE("R=" + std::to_string(s.positions.size()) + " Hq=" + std::to_string(s.Hq) +
                 " Hkv=" + std::to_string(s.Hkv) + " D=" + std::to_string(s.D));
    const DecodeLayerOperands base(s, seed++);
    DecodeLayerOperands fused = base, ops = base;
    const std::vector<float> y = run_decode_layer(reg, fused, decode_layer_attrs(s));
    std::vector<float> h;
    const std::vector<float> y_ops = run_decode_layer_as_ops(reg, s, ops, &h);
    const double ey = rel_err(y, y_ops), ek = rel_err(fused.kc, ops.kc), ev = rel_err(fused.vc, ops.vc);
    std::printf("decode_layer_fwd R=%zu: y %.2e, k_cache %.2e, v_cache %.2e\n", s.positions.size(), ey, ek, ev);
    EXPECT_LE(ey, 1e-5) << "y";
    EXPECT_LE(ek, 1e-5) << "k_cache";
    EXPECT_LE(ev, 1e-5) << "v_cache";
    // The comparison means something: both residual branches move y well past the tolerance
    // (a dropped add or a skipped MLP fails), the step wrote its rows' slots and nothing else.
    EXPECT_GT(rel_err(y_ops, h), 0.05) << "the MLP branch barely moves y";
    EXPECT_GT(rel_err(h, base.x), 0.05) << "the attention branch barely moves h";
    EXPECT_GT(rel_err(y_ops, base.x), 0.05);
    std::vector<bool> written(base.kc.size(), false);
    for (int32_t slot : base.slots)
      for (int64_t g = 0; g < base.Hkv; ++g)
        for (int64_t dd = 0; dd < base.D; ++dd)
          written[size_t(((slot / base.bs * base.Hkv + g) * base.bs + slot % base.bs) * base.D + dd)] = true;
    size_t changed_k = 0, changed_v = 0, stray = 0;
    for (size_t i = 0; i < written.size(); ++i) {
      const bool ck = fused.kc[i] != base.kc[i], cv = fused.vc[i] != base.vc[i];
      changed_k += ck;
      changed_v += cv;
      stray += !written[i] && (ck || cv);
    }
    EXPECT_EQ(changed_k, s.positions.size() * size_t(base.Hkv * base.D));
    EXPECT_EQ(changed_v, s.positions.size() * size_t(base.Hkv * base.D));
    EXPECT_EQ(stray, 0u);
  }

  // A slot outside the cache is an error status naming the op, not a crash.
  const DecodeLayerShape& s = shapes[0];
  DecodeLayerOperands o(s, 99);
  o.slots[0] = int32_t(o.B * o.bs);
  std::vector<float> y(size_t(o.R * o.C));
  const int64_t R = o.R, C = o.C, F = o.F;
  const sdk::Tensor tx(o.x.data(), {R, C}), tn1(o.norm1.data(), {C}), twqkv(o.wqkv.data(), {o.Nqkv, C}),
      two(o.wo.data(), {C, o.Hq * o.D}), tn2(o.norm2.data(), {C}), twgu(o.wgu.data(), {2 * F, C}),
      twd(o.wdown.data(), {C, F}), tpos(o.pos.data(), {R}, sdk::kI32), tslots(o.slots.data(), {R}, sdk::kI32),
      ttable(o.table.data(), {R, o.T}, sdk::kI32), tfreq(o.inv_freq.data(), {o.D / 2}), ty(y.data(), {R, C}),
      tkc(o.kc.data(), {o.B, o.Hkv, o.bs, o.D}), tvc(o.vc.data(), {o.B, o.Hkv, o.bs, o.D});
  const std::vector<rlh_tensor> in = {tx.raw(),   tn1.raw(),    twqkv.raw(),  two.raw(),
                                      tn2.raw(),  twgu.raw(),   twd.raw(),    tpos.raw(),
                                      tslots.raw(), ttable.raw(), tfreq.raw()};
  const std::vector<rlh_tensor> out = {ty.raw(), tkc.raw(), tvc.raw()};
  const std::vector<rlh_named_value> attrs = decode_layer_attrs(s);
  sdk::Op op = reg.resolve("decode_layer_fwd", sdk::kCPU, in, out, attrs, true);
  rlh_op_call call{};
  call.struct_size = RLH_STRUCT_SIZE(rlh_op_call, workspace_bytes);
  call.inputs = in.data();
  call.num_inputs = in.size();
  call.outputs = out.data();
  call.num_outputs = out.size();
  call.attrs = attrs.data();
  call.num_attrs = attrs.size();
  rlh_status* st = op.api()->run(op.raw(), &call);
  ASSERT_NE(st, nullptr) << "a slot outside the cache ran";
  const sdk::StatusPtr owned(st);
  EXPECT_EQ(st->code, RLH_E_INVALID_ARGUMENT);
  const std::string msg = sdk::status_message(st);
  EXPECT_NE(msg.find("decode_layer_fwd"), std::string::npos) << msg;
  EXPECT_NE(msg.find("slot"), std::string::npos) << msg;
}

}  // namespace
