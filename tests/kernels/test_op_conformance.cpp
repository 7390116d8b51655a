// Op conformance through the SDK's runner (rlhost/sdk/kernel_check.hpp) on every kernel provider
// the host finds on the build's plugin path that runs on the CPU, kernels_cpu included: the
// reference is checked against itself where that means something, its float32 ops against its
// float64 ones. Every op a provider lists must have a case, every dtype it lists must run, and
// the runner must find the reference by its provider_info, not by name.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
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

}  // namespace
