// The conformance runner (rlh_kernel_check) and `rlhost check-kernels` on the gemm-only test
// provider (tests/kernels/plugins): a correct provider passes, with every op it does not list
// shown as not offered; one whose gemm ignores beta fails, naming the case; a provider whose
// operands live in "device" memory is staged through its memory services; its FP8 gemm is
// checked with per-tensor scales; a missing reference is a one-line error. Plus the number
// formats the runner rounds to.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "numeric.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/kernel_check.hpp"

namespace {

using namespace rlh;
namespace fs = std::filesystem;

const char* const kTestProvider = RLH_TEST_KERNEL_PLUGIN_DIR "/libtest_gemm_provider.so";

// ---------------------------------------------------------------------------------------------
// Number formats

TEST(KernelCheckNumerics, Fp8FormatsRoundToNearestEven) {
  const auto& e4m3 = sdk::kcheck::fp8_format(sdk::kE4M3);
  const auto& e5m2 = sdk::kcheck::fp8_format(sdk::kE5M2);
  EXPECT_EQ(e4m3.max_finite(), 448.0);
  EXPECT_EQ(e5m2.max_finite(), 57344.0);
  EXPECT_EQ(e4m3.decode(0x01), std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_EQ(e5m2.decode(0x01), std::ldexp(1.0, -16));
  EXPECT_EQ(e4m3.encode(1.0), 0x38);
  EXPECT_EQ(e4m3.encode(-1.0), 0xB8);
  EXPECT_EQ(e4m3.encode(1.0625), 0x38);  // halfway between 1 and 1.125: to the even code (1)
  EXPECT_EQ(e4m3.encode(1.1875), 0x3A);  // halfway between 1.125 and 1.25: to 1.25 (even)
  EXPECT_EQ(e4m3.encode(1e6), 0x7E);     // saturates at 448
  EXPECT_TRUE(std::isnan(e4m3.decode(e4m3.encode(NAN))));
  EXPECT_TRUE(std::isnan(e5m2.decode(0x7F)));
  for (int b = 0; b < 256; ++b) {  // every finite code survives a round trip
    const double v = e4m3.decode(uint8_t(b));
    if (!std::isnan(v) && v != 0) {
      EXPECT_EQ(e4m3.encode(v), b) << b;
    }
    const double w = e5m2.decode(uint8_t(b));
    if (!std::isnan(w) && w != 0) {
      EXPECT_EQ(e5m2.encode(w), b) << b;
    }
  }
  // The scale brings the largest magnitude into range and is a power of two.
  const double s = sdk::kcheck::fp8_scale(sdk::kE4M3, 3.0);
  EXPECT_LE(3.0 / s, 448.0);
  EXPECT_GT(3.0 / s, 224.0);
  EXPECT_EQ(std::exp2(std::round(std::log2(s))), s);
  EXPECT_EQ(sdk::kcheck::round_bf16(1.0 + std::ldexp(1.0, -8)), 1.0);  // bf16 tie to even
  EXPECT_EQ(sdk::kcheck::round_bf16(1.0 + 3 * std::ldexp(1.0, -8)), 1.0 + std::ldexp(1.0, -6));
}

// ---------------------------------------------------------------------------------------------
// The runner through the SDK

class TestProviderHost {
 public:
  explicit TestProviderHost(const char* mode) {
    if (mode) setenv("RLH_TEST_PROVIDER_MODE", mode, 1);
    else unsetenv("RLH_TEST_PROVIDER_MODE");
    sdk::check(rlhost_create(&h_));
    rlhost_set_log_level(h_, RLH_LOG_WARN);
    sdk::check(rlhost_add_plugin_dir(h_, RLH_PLUGIN_DIR));
    sdk::check(rlhost_load_plugin(h_, "kernels_cpu"));
    sdk::check(rlhost_load_plugin(h_, kTestProvider));
    const sdk::Host host(rlhost_services(h_));
    ref_ = sdk::ReferenceKernels::find(host);
    api_ = host.find<rlh_kernels_api>(RLH_KIND_KERNELS, "test_gemm_provider", RLH_STRUCT_SIZE(rlh_kernels_api, release_op));
    sdk::check(api_->create(host.api(), sdk::kCPU, "{}", 2, &inst_));
    unsetenv("RLH_TEST_PROVIDER_MODE");
  }
  ~TestProviderHost() {
    api_->destroy(inst_);
    ref_.reset();
    rlhost_destroy(h_);
  }
  sdk::KernelCheckReport check() const {
    return sdk::check_kernels(*ref_, "test_gemm_provider", api_, inst_, sdk::kCPU);
  }
  const sdk::ReferenceKernels* reference() const { return ref_.get(); }

 private:
  rlhost_t* h_ = nullptr;
  std::unique_ptr<sdk::ReferenceKernels> ref_;
  const rlh_kernels_api* api_ = nullptr;
  rlh_kernels* inst_ = nullptr;
};

size_t variant_index(const char* name) {
  const auto& v = sdk::kernel_variants();
  for (size_t i = 0; i < v.size(); ++i)
    if (std::string(v[i].name) == name) return i;
  return v.size();
}

TEST(KernelCheck, CorrectProviderPassesUnlistedOpsNotOffered) {
  for (const char* mode : {(const char*)nullptr, "device_memory"}) {
    SCOPED_TRACE(mode ? mode : "host memory");
    TestProviderHost h(mode);
    ASSERT_NE(h.reference(), nullptr);
    EXPECT_EQ(h.reference()->name(), "kernels_cpu");  // found by provider_info
    const auto t0 = std::chrono::steady_clock::now();
    const sdk::KernelCheckReport rep = h.check();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s(%.0f ms)\n", rep.table().c_str(), ms);
    EXPECT_FALSE(rep.failed());
    const auto* gemm = rep.row("gemm");
    ASSERT_NE(gemm, nullptr);
    EXPECT_TRUE(gemm->listed);
    EXPECT_EQ(gemm->cells[variant_index("f32")].state, sdk::KernelCheckCell::pass);
    EXPECT_GE(gemm->cells[variant_index("f32")].calls, 10);
    EXPECT_EQ(gemm->cells[variant_index("e4m3")].state, sdk::KernelCheckCell::pass);  // scaled fp8
    // The weight-only form (bf16 A x e4m3 B): tried because e4m3 is listed; only the cases that
    // mark a weight run in it (three).
    EXPECT_EQ(gemm->cells[variant_index("bf16xe4m3")].state, sdk::KernelCheckCell::pass);
    EXPECT_EQ(gemm->cells[variant_index("bf16xe4m3")].calls, 3);
    // bf16 is listed, but C only in float32: bf16+f32 passes and bf16 counts as not offered (not
    // as unverified, which the registry would warn about)
    EXPECT_EQ(gemm->cells[variant_index("bf16+f32")].state, sdk::KernelCheckCell::pass);
    EXPECT_EQ(gemm->cells[variant_index("bf16")].state, sdk::KernelCheckCell::not_offered);
    EXPECT_EQ(gemm->cells[variant_index("e5m2")].state, sdk::KernelCheckCell::not_offered);
    int rows = 0;
    for (const auto& row : rep.rows) {
      if (row.op == "gemm") continue;
      ++rows;
      EXPECT_FALSE(row.listed) << row.op;
      for (const auto& c : row.cells) EXPECT_EQ(c.state, sdk::KernelCheckCell::not_offered) << row.op;
    }
    EXPECT_EQ(size_t(rows) + 1, sdk::kernel_check_ops().size());
    EXPECT_NE(rep.table().find("not offered"), std::string::npos);
  }
}

TEST(KernelCheck, WrongGemmFailsNamingTheCase) {
  TestProviderHost h("wrong");
  const sdk::KernelCheckReport rep = h.check();
  EXPECT_TRUE(rep.failed());
  const auto& cell = rep.row("gemm")->cells[variant_index("f32")];
  EXPECT_EQ(cell.state, sdk::KernelCheckCell::fail);
  EXPECT_GT(cell.worst, 1e-2);
  EXPECT_NE(cell.where.find("beta=0.5"), std::string::npos) << cell.where;  // beta ignored
  ASSERT_FALSE(rep.failures().empty());
  EXPECT_NE(rep.failures()[0].find("gemm f32: worst error"), std::string::npos) << rep.failures()[0];
  EXPECT_NE(rep.table().find("FAIL"), std::string::npos);
}

TEST(KernelCheck, FailuresAtResolveAndRunAreFailures) {
  for (const char* mode : {"resolve_fails", "run_fails"}) {
    SCOPED_TRACE(mode);
    TestProviderHost h(mode);
    const sdk::KernelCheckReport rep = h.check();
    const auto& cell = rep.row("gemm")->cells[variant_index("f32")];
    EXPECT_EQ(cell.state, sdk::KernelCheckCell::fail);
    EXPECT_NE(cell.where.find("planted failure"), std::string::npos) << cell.where;
  }
}

// ---------------------------------------------------------------------------------------------
// rlhost check-kernels

struct Result {
  int code = -1;
  std::string out, err;
};

Result run_cli(const std::string& env, const std::string& args) {
  static int n = 0;
  const fs::path err_file = fs::temp_directory_path() / ("rlh_ck_err_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
  const std::string cmd = env + " " + std::string(RLHOST_EXE) + " check-kernels " + args + " 2>" + err_file.string();
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t got;
  while ((got = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), got);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  r.err.assign(std::istreambuf_iterator<char>(in), {});
  fs::remove(err_file);
  return r;
}

std::string line_of(const std::string& text, const std::string& start) {
  const size_t p = text.find("\n" + start);
  if (p == std::string::npos) return {};
  return text.substr(p + 1, text.find('\n', p + 1) - p - 1);
}

TEST(CheckKernelsCli, CorrectProviderPassesWithUnofferedOpsShown) {
  const Result r = run_cli("RLH_TEST_PROVIDER_MODE=", std::string("--plugin ") + kTestProvider);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  const std::string gemm = line_of(r.out, "gemm ");
  EXPECT_NE(gemm.find("pass"), std::string::npos) << r.out;
  EXPECT_EQ(gemm.find("FAIL"), std::string::npos) << r.out;
  EXPECT_NE(line_of(r.out, "attention_fwd ").find("not offered"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("test_gemm_provider on cpu"), std::string::npos) << r.out;
}

TEST(CheckKernelsCli, WrongGemmPrintsFailAndExitsNonZero) {
  const Result r = run_cli("RLH_TEST_PROVIDER_MODE=wrong", std::string("--plugin ") + kTestProvider);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(line_of(r.out, "gemm ").find("FAIL"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("FAIL gemm f32: worst error"), std::string::npos) << r.out;
  std::string err = r.err;
  while (!err.empty() && err.back() == '\n') err.pop_back();
  EXPECT_EQ(err.find('\n'), std::string::npos) << err;  // one line
  EXPECT_NE(err.find("error"), std::string::npos) << err;
  EXPECT_NE(err.find("test_gemm_provider"), std::string::npos) << err;
}

TEST(CheckKernelsCli, MissingReferenceIsAOneLineError) {
  Result r = run_cli("", std::string("--plugin ") + kTestProvider + " --reference " + kTestProvider);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("no reference kernel provider"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
  r = run_cli("", std::string("--plugin ") + kTestProvider + " --reference no_such_plugin");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("no reference kernel provider"), std::string::npos) << r.err;
  r = run_cli("", std::string("--plugin ") + kTestProvider + " --device tpu");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--device"), std::string::npos) << r.err;
}

}  // namespace
