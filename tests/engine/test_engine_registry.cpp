// The engine on kernels found through the C ABI's registry, as a backend builds it
// (make_kernel_registry): every provider the host has for the device, best score first, the
// reference last, op by op. A provider that answers only `gemm` (tests/kernels/plugins) is
// chosen for it while every other op falls through to kernels_cpu, it shows in the choices, and
// on one thread (the same sgemm as kernels_cpu's) the engine's results are bit for bit those of
// kernels_cpu alone. Pins, and providers that fail at resolve or run, give one-line errors
// naming the provider and the op. Providers are verified before they are chosen
// (policy.kernels.verify): one whose results are wrong is left out for the op with a warning,
// and chosen only when verification is off.
#include <gtest/gtest.h>

#include <omp.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "kernels_cpu_abi.hpp"
#include "rlhost/engine/engine.hpp"
#include "rlhost/host.h"
#include "rlhost/model/llama_family.hpp"
#include "rlhost/sdk/kernel_registry.hpp"
#include "rlhost/sdk/kernels.hpp"

using namespace rlh;

namespace {

sdk::TransformerDesc small_desc() {
  nlohmann::json c = {{"architectures", {"Qwen3ForCausalLM"}}, {"vocab_size", 101},
                      {"hidden_size", 32}, {"intermediate_size", 72}, {"num_hidden_layers", 2},
                      {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
                      {"max_position_embeddings", 128}, {"rms_norm_eps", 1e-6},
                      {"rope_theta", 1000000.0}, {"tie_word_embeddings", false},
                      {"torch_dtype", "float32"}};
  return model::describe(c);
}

void fill(engine::Engine& e) {
  uint32_t x = 7;
  for (size_t i = 0; i < e.num_params(); ++i)
    for (float& v : e.param(i)) {
      x = x * 1664525u + 1013904223u;
      v = (e.desc().params[i].shape.size() == 1 ? 1.0f : 0.0f) +
          0.2f * (float(x >> 8) / 16777216.0f - 0.5f);
    }
}

// A host with kernels_cpu and the gemm-only test provider loaded.
class TwoProviders {
 public:
  TwoProviders() {
    sdk::check(rlhost_create(&h_));
    rlhost_set_log_level(h_, RLH_LOG_WARN);
    const char* dir = std::getenv("RLH_TEST_PLUGIN_DIR");
    sdk::check(rlhost_add_plugin_dir(h_, dir && *dir ? dir : RLH_PLUGIN_DIR));
    sdk::check(rlhost_load_plugin(h_, "kernels_cpu"));
    sdk::check(rlhost_load_plugin(h_, RLH_TEST_KERNEL_PLUGIN_DIR "/libtest_gemm_provider.so"));
  }
  ~TwoProviders() { rlhost_destroy(h_); }
  sdk::Host host() const { return sdk::Host(rlhost_services(h_)); }
  // The same services, with warnings and errors logged into `log` (one entry per line).
  sdk::Host capturing(std::vector<std::string>& log) {
    captured_ = *rlhost_services(h_);
    sink() = &log;
    captured_.log = [](rlh_host_ctx*, int32_t level, const char* msg, size_t len) {
      if (level >= RLH_LOG_WARN && sink() != nullptr) sink()->emplace_back(msg, len);
    };
    return sdk::Host(&captured_);
  }

 private:
  static std::vector<std::string>*& sink() {
    static std::vector<std::string>* s = nullptr;
    return s;
  }
  rlhost_t* h_ = nullptr;
  rlh_host_api captured_{};
};

struct EngineRun {
  engine::Outputs out;
  engine::StepResult step;
  std::vector<std::vector<float>> grads;
};

EngineRun run_engine(engine::Ops& ops) {
  engine::EngineOptions eo;
  eo.ops = &ops;
  engine::Engine e(small_desc(), eo);
  fill(e);
  std::vector<int32_t> ids = {5, 17, 99, 3, 42, 42, 7, 0, 64, 11, 23};
  std::vector<int32_t> cu = {0, 4, 11};
  engine::MicroBatch mb;
  mb.input_ids = ids;
  mb.cu_seqlens = cu;
  engine::StepOptions so;
  so.global_tokens = 9;
  so.apply_optimizer = false;
  so.outputs.entropy = true;
  auto loss = [](const engine::LossContext& c, const engine::OutputViews& o, engine::OutputGrads& g) {
    engine::LossResult r;
    for (size_t t = 0; t < o.logprob.size(); ++t) {
      r.loss -= (o.logprob[t] + 0.1 * o.entropy[t]) / double(c.global_tokens);
      g.logprob[t] = float(-1.0 / double(c.global_tokens));
      g.entropy[t] = float(-0.1 / double(c.global_tokens));
    }
    return r;
  };
  EngineRun r;
  r.out = e.forward(mb, so.outputs);
  r.step = e.train_step({&mb, 1}, so, loss);
  for (size_t i = 0; i < e.num_params(); ++i) r.grads.emplace_back(e.grad(i).begin(), e.grad(i).end());
  return r;
}

// One OpenMP thread for the test's scope: kernels_cpu then runs each GEMM as one sgemm call.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

TEST(KernelRegistry, ProvidersInScoreOrderReferenceLast) {
  TwoProviders h;
  auto reg = sdk::make_kernel_registry(h.host(), sdk::kCPU, {}, "test");
  ASSERT_EQ(reg->providers().size(), 2u);
  EXPECT_EQ(reg->providers()[0].name, "test_gemm_provider");
  EXPECT_EQ(reg->providers()[1].name, "kernels_cpu");
  EXPECT_TRUE(reg->providers()[1].reference);
  EXPECT_FALSE(reg->providers()[0].reference);
}

TEST(KernelRegistry, GemmFromTheTestProviderTheRestFallsThroughBitwiseEqual) {
  OneThread one;
  TwoProviders h;
  auto both = sdk::make_kernel_registry(h.host(), sdk::kCPU, {}, "test");
  std::unique_ptr<engine::Ops> ops = engine::make_registry_ops(*both);
  const EngineRun a = run_engine(*ops);
  // Which provider runs each op is recorded for the log.
  for (const auto& c : both->choices())
    EXPECT_EQ(c.provider, c.op == "gemm" ? "test_gemm_provider" : "kernels_cpu") << c.op;
  const std::string summary = both->choices_summary();
  EXPECT_NE(summary.find("test_gemm_provider: gemm f32"), std::string::npos) << summary;
  EXPECT_NE(summary.find("kernels_cpu: embedding_fwd f32"), std::string::npos) << summary;

  // kernels_cpu alone (pinned for gemm: the only choice then)
  auto pinned = sdk::make_kernel_registry(h.host(), sdk::kCPU, {{"gemm", "kernels_cpu"}}, "test");
  std::unique_ptr<engine::Ops> ref_ops = engine::make_registry_ops(*pinned);
  for (const auto& c : pinned->choices()) EXPECT_EQ(c.provider, "kernels_cpu") << c.op;
  const EngineRun b = run_engine(*ref_ops);
  EXPECT_EQ(a.out.logprob, b.out.logprob);
  EXPECT_EQ(a.out.entropy, b.out.entropy);
  EXPECT_EQ(a.step.loss, b.step.loss);
  EXPECT_EQ(a.step.grad_norm, b.step.grad_norm);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << i;
}

TEST(KernelRegistry, PinnedProviderThatDoesNotOfferTheOpIsRefusedNamingBoth) {
  TwoProviders h;
  // At setup, from what the provider lists: before any executor resolves anything.
  try {
    sdk::make_kernel_registry(h.host(), sdk::kCPU, {{"attention", "test_gemm_provider"}}, "test");
    ADD_FAILURE() << "a pin to a provider without attention was accepted";
  } catch (const sdk::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("policy.kernels.attention"), std::string::npos) << m;
    EXPECT_NE(m.find("test_gemm_provider"), std::string::npos) << m;
    EXPECT_NE(m.find("gemm"), std::string::npos) << m;  // what it does offer
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  // A provider that lists the op but cannot take the executor's operands is refused when the op
  // resolves, naming both: the gemm-only provider offers float32 gemm, not float64.
  auto reg = sdk::make_kernel_registry(h.host(), sdk::kCPU, {{"gemm", "test_gemm_provider"}}, "test");
  auto ops = engine::make_registry_ops(*reg);
  std::vector<double> a(4, 1.0), b(4, 1.0), c(4, 0.0);
  try {
    ops->gemm_f64(false, false, 2, 2, 2, 1.0, a.data(), 2, b.data(), 2, 0.0, c.data(), 2);
    ADD_FAILURE() << "float64 gemm pinned to a float32-only provider was accepted";
  } catch (const sdk::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("gemm"), std::string::npos) << m;
    EXPECT_NE(m.find("test_gemm_provider"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

TEST(KernelRegistry, PinToAnAbsentProviderNamesTheKey) {
  TwoProviders h;
  try {
    sdk::make_kernel_registry(h.host(), sdk::kCPU, {{"gemm", "vendor_x"}}, "test");
    ADD_FAILURE() << "a pin to an absent provider was accepted";
  } catch (const sdk::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("policy.kernels.gemm"), std::string::npos) << m;
    EXPECT_NE(m.find("vendor_x"), std::string::npos) << m;
  }
  EXPECT_THROW(sdk::kernel_pins_from_json(R"({"gemm": 3})"), sdk::Error);
  EXPECT_EQ(sdk::kernel_pins_from_json(R"({"gemm": "auto", "attention": "kernels_cudnn"})").size(), 1u);
}

// A provider that claims an op and then fails: verified (the default), it is left out for the op
// at setup with one warning line naming it, the op and the failure, and the engine runs on
// kernels_cpu; unverified, the failure surfaces where the op is resolved or run, one line
// naming both; the host and a registry without it still work.
TEST(KernelRegistry, ProviderFailingAtResolveOrRunIsNamed) {
  for (const char* mode : {"resolve_fails", "run_fails"}) {
    SCOPED_TRACE(mode);
    setenv("RLH_TEST_PROVIDER_MODE", mode, 1);
    TwoProviders h;
    auto reg = sdk::make_kernel_registry(h.host(), sdk::kCPU, {}, "test", "{}", /*verify=*/false);
    std::vector<std::string> log;
    auto verified = sdk::make_kernel_registry(h.capturing(log), sdk::kCPU, {}, "test");
    unsetenv("RLH_TEST_PROVIDER_MODE");
    try {
      std::unique_ptr<engine::Ops> ops = engine::make_registry_ops(*reg);
      run_engine(*ops);
      ADD_FAILURE() << "the planted failure did not surface";
    } catch (const sdk::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("test_gemm_provider"), std::string::npos) << m;
      EXPECT_NE(m.find("'gemm'"), std::string::npos) << m;
      EXPECT_NE(m.find("planted failure"), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
    ASSERT_EQ(log.size(), 1u);
    EXPECT_NE(log[0].find("test_gemm_provider"), std::string::npos) << log[0];
    EXPECT_NE(log[0].find("'gemm'"), std::string::npos) << log[0];
    EXPECT_NE(log[0].find("planted failure"), std::string::npos) << log[0];
    EXPECT_EQ(log[0].find('\n'), std::string::npos) << log[0];
    {
      std::unique_ptr<engine::Ops> ops = engine::make_registry_ops(*verified);
      EXPECT_NO_THROW(run_engine(*ops));
      for (const auto& c : verified->choices()) EXPECT_EQ(c.provider, "kernels_cpu") << c.op;
    }
    auto ok = sdk::make_kernel_registry(h.host(), sdk::kCPU, {{"gemm", "kernels_cpu"}}, "test");
    std::unique_ptr<engine::Ops> ops = engine::make_registry_ops(*ok);
    EXPECT_NO_THROW(run_engine(*ops));
  }
}

// A provider whose gemm gives wrong results (it ignores beta) is never chosen silently: with
// verification it is left out for gemm with one warning naming it, the op, the dtype and the
// worst error, and gemm comes from kernels_cpu; with policy.kernels.verify false it is chosen;
// a pin to it for gemm is refused at setup, naming both.
TEST(KernelRegistry, ProviderWithWrongResultsIsLeftOutUnlessVerifyIsOff) {
  setenv("RLH_TEST_PROVIDER_MODE", "wrong", 1);
  TwoProviders h;
  std::vector<std::string> log;
  auto verified = sdk::make_kernel_registry(h.capturing(log), sdk::kCPU, {}, "test");
  auto unverified = sdk::make_kernel_registry(h.host(), sdk::kCPU, {}, "test", "{}", /*verify=*/false);
  std::string pin_error;
  try {
    sdk::make_kernel_registry(h.host(), sdk::kCPU, {{"gemm", "test_gemm_provider"}}, "test");
  } catch (const sdk::Error& e) {
    pin_error = e.what();
  }
  unsetenv("RLH_TEST_PROVIDER_MODE");

  ASSERT_EQ(log.size(), 1u);
  const std::string& w = log[0];
  EXPECT_NE(w.find("test_gemm_provider"), std::string::npos) << w;
  EXPECT_NE(w.find("'gemm'"), std::string::npos) << w;
  EXPECT_NE(w.find("f32: worst error"), std::string::npos) << w;
  EXPECT_NE(w.find("beta=0.5"), std::string::npos) << w;  // the case it fails
  EXPECT_EQ(w.find('\n'), std::string::npos) << w;

  std::vector<float> a(6 * 4, 1.f), b(4 * 5, 1.f), c(6 * 5, 0.f);
  const sdk::Tensor A(a.data(), {6, 4}), B(b.data(), {4, 5}), C(c.data(), {6, 5});
  const std::vector<rlh_tensor> ins = {A.raw(), B.raw()}, outs = {C.raw()};
  EXPECT_EQ(verified->resolve("gemm", sdk::kCPU, ins, outs).provider(), "kernels_cpu");
  EXPECT_EQ(unverified->resolve("gemm", sdk::kCPU, ins, outs).provider(), "test_gemm_provider");

  EXPECT_NE(pin_error.find("policy.kernels.gemm"), std::string::npos) << pin_error;
  EXPECT_NE(pin_error.find("test_gemm_provider"), std::string::npos) << pin_error;
  EXPECT_NE(pin_error.find("fails conformance"), std::string::npos) << pin_error;
  EXPECT_EQ(pin_error.find('\n'), std::string::npos) << pin_error;
}

// A correct provider passes verification and is chosen for the ops it lists, with no warning.
TEST(KernelRegistry, CorrectProviderIsVerifiedQuietly) {
  TwoProviders h;
  std::vector<std::string> log;
  auto reg = sdk::make_kernel_registry(h.capturing(log), sdk::kCPU, {}, "test");
  EXPECT_TRUE(log.empty()) << log[0];
  ASSERT_EQ(reg->providers().size(), 2u);
  EXPECT_TRUE(reg->providers()[0].verified);
  EXPECT_EQ(reg->providers()[0].verified_ops, std::vector<std::string>{"gemm"});
  EXPECT_THROW(sdk::kernel_verify_from_json(R"({"verify": "yes"})"), sdk::Error);
  EXPECT_FALSE(sdk::kernel_verify_from_json(R"({"verify": false, "gemm": "auto"})"));
  EXPECT_TRUE(sdk::kernel_verify_from_json(R"({"gemm": "auto"})"));
}

}  // namespace
