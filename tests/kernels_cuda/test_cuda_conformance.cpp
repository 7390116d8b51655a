// Op conformance of kernels_cuda through the SDK's runner (rlhost/sdk/kernel_check.hpp), as
// `rlhost check-kernels --plugin libkernels_cuda.so --device cuda:0` runs it: a host with the
// plugin folder (kernels_cpu there is the reference, found by its provider_info), kernels_cuda
// loaded as a plugin, every op it lists in every dtype it lists (f32, bf16, and bf16 with f32
// statistics; the router's f64) on cuda:0, operands staged through its memory services, against
// kernels_cpu in float64. On the device every listed op must pass in every listed dtype, with
// no op left without a case. Where no CUDA device (or no sm_90 one) is usable the test skips
// with kernels_cuda's reason.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "rlhost/host.h"
#include "rlhost/kernels.h"
#include "rlhost/sdk/kernel_check.hpp"

namespace {

using namespace rlh;

std::string kcuda_path() {
  if (const char* p = std::getenv("RLH_KCUDA_PLUGIN"); p && *p) return p;
  return RLH_KCUDA_PLUGIN_PATH;
}

TEST(CudaConformance, EveryListedOpEveryDtypeThroughTheRunner) {
  rlhost_t* h = nullptr;
  sdk::check(rlhost_create(&h));
  struct Destroy {
    rlhost_t* h;
    ~Destroy() { rlhost_destroy(h); }
  } destroy_host{h};
  rlhost_set_log_level(h, RLH_LOG_WARN);
  const char* dir = std::getenv("RLH_TEST_PLUGIN_DIR");
  sdk::check(rlhost_add_plugin_dir(h, dir && *dir ? dir : RLH_PLUGIN_DIR));
  sdk::check(rlhost_load_plugin(h, kcuda_path().c_str()));
  sdk::check(rlhost_load_plugin(h, "kernels_cpu"));
  const sdk::Host host(rlhost_services(h));
  const auto* api = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, "kernels_cuda", RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
  rlh_kernels* inst = nullptr;
  if (rlh_status* s = api->create(host.api(), sdk::cuda_device(0), "{}", 2, &inst)) {
    const std::string why = sdk::status_message(s);
    const rlh_code code = s->code;
    rlh_status_destroy(s);
    if (code == RLH_E_UNAVAILABLE || code == RLH_E_UNIMPLEMENTED) GTEST_SKIP() << "kernels_cuda not on cuda:0: " << why;
    FAIL() << "kernels_cuda on cuda:0: " << why;
  }
  struct DestroyInst {
    const rlh_kernels_api* a;
    rlh_kernels* k;
    ~DestroyInst() { a->destroy(k); }
  } destroy_inst{api, inst};
  const auto ref = sdk::ReferenceKernels::find(host);
  ASSERT_TRUE(ref) << "no reference kernel provider (kernels_cpu) on the plugin path";

  const auto t0 = std::chrono::steady_clock::now();
  const sdk::KernelCheckReport rep = sdk::check_kernels(*ref, "kernels_cuda", api, inst, sdk::cuda_device(0));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s(%.2f s)\n", rep.table().c_str(), secs);

  for (const std::string& f : rep.failures()) ADD_FAILURE() << f;
  const auto& vars = sdk::kernel_variants();
  int listed = 0;
  for (const auto& row : rep.rows) {
    if (!row.listed) continue;
    ++listed;
    bool any = false;
    for (size_t i = 0; i < row.cells.size(); ++i) {
      const auto& c = row.cells[i];
      SCOPED_TRACE(row.op + " " + vars[i].name);
      EXPECT_NE(c.state, sdk::KernelCheckCell::no_case) << "listed but without a conformance case";
      EXPECT_NE(c.state, sdk::KernelCheckCell::no_reference) << c.note;
      EXPECT_NE(c.state, sdk::KernelCheckCell::refused) << c.note;
      EXPECT_NE(c.state, sdk::KernelCheckCell::fail) << c.where;
      any = any || c.state == sdk::KernelCheckCell::pass;
    }
    EXPECT_TRUE(any) << row.op << ": no dtype passed";
    // Every op in f32, but the fused products: written for bf16 alone, they list no f32.
    const bool bf16_only = row.op == "gemm_glu_fwd" || row.op == "rmsnorm_gemm_fwd" || row.op == "gemm_add_fwd";
    EXPECT_EQ(row.cells[0].state, bf16_only ? sdk::KernelCheckCell::not_offered : sdk::KernelCheckCell::pass)
        << row.op << " f32";
  }
  EXPECT_GT(listed, 20);
  const auto* adamw16 = rep.row("adamw_bf16");
  ASSERT_NE(adamw16, nullptr);
  EXPECT_TRUE(adamw16->listed);
  EXPECT_EQ(adamw16->cells[0].state, sdk::KernelCheckCell::pass);
}

}  // namespace
