// The kernels_cuda plugin on any machine: it loads with dlopen without a GPU, a driver
// (libcuda.so.1) or cuBLASLt, describes itself, lists its ops, and its probe says whether it can
// run here ("no CUDA device: ..." with score 0 where there is none). No CUDA is linked here.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

std::string plugin_path() {
  if (const char* p = std::getenv("RLH_KCUDA_PLUGIN"); p && *p) return p;
  return RLH_KCUDA_PLUGIN_PATH;
}

struct Loaded {
  void* lib = nullptr;
  const rlh_plugin_desc* desc = nullptr;
  const rlh_kernels_api* api = nullptr;
};

Loaded load() {
  Loaded l;
  l.lib = dlopen(plugin_path().c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!l.lib) return l;
  auto entry = reinterpret_cast<rlh_plugin_entry_fn>(dlsym(l.lib, RLH_PLUGIN_ENTRY_SYMBOL));
  if (!entry) return l;
  l.desc = entry(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR);
  for (size_t i = 0; l.desc && i < l.desc->num_components; ++i)
    if (l.desc->components[i]->kind == RLH_KIND_KERNELS)
      l.api = static_cast<const rlh_kernels_api*>(l.desc->components[i]->api);
  return l;
}

TEST(KernelsCudaPlugin, LoadsAndDescribesItselfAnywhere) {
  Loaded l = load();
  ASSERT_NE(l.lib, nullptr) << dlerror();
  ASSERT_NE(l.desc, nullptr);
  EXPECT_STREQ(l.desc->name, "kernels_cuda");
  ASSERT_NE(l.api, nullptr);
  // The entry created no CUDA state: the probe is what touches the driver.
  ASSERT_TRUE(RLH_HAS_FIELD(l.desc, rlh_plugin_desc, probe));
  ASSERT_NE(l.desc->probe, nullptr);
  int32_t score = -1;
  std::string reason;
  rlh_status* s = l.desc->probe(nullptr, &score, rlh::sdk::write_to_string, &reason);
  ASSERT_EQ(s, nullptr) << rlh::sdk::status_message(s);
  std::printf("probe: score %d, %s\n", score, reason.c_str());
  if (score == 0) {
    EXPECT_TRUE(reason.rfind("no CUDA device", 0) == 0 || reason.find("sm_90a") != std::string::npos)
        << reason;
  } else {
    EXPECT_EQ(score, 10);
    EXPECT_NE(reason.find("sm_90"), std::string::npos) << reason;
  }
}

TEST(KernelsCudaPlugin, ListsEveryOpOfTheContract) {
  Loaded l = load();
  ASSERT_NE(l.api, nullptr);
  std::string listing;
  rlh_status* s = l.api->list_ops(nullptr, rlh::sdk::write_to_string, &listing);
  ASSERT_EQ(s, nullptr);
  for (const char* op : {"gemm", "embedding_fwd", "embedding_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
                         "add_rmsnorm_fwd", "rope_fwd", "rope_bwd", "attention_fwd", "attention_bwd", "swiglu_fwd",
                         "swiglu_bwd", "bias_add_fwd", "bias_bwd", "add_fwd", "linear_logprob_fwd",
                         "linear_logprob_bwd", "adamw", "sumsq", "scale"})
    EXPECT_NE(listing.find(std::string("\"name\":\"") + op + "\""), std::string::npos) << op;
  EXPECT_NE(listing.find("\"bf16\""), std::string::npos);
}

TEST(KernelsCudaPlugin, RefusesHostMemoryAndExplainsWithoutDevice) {
  Loaded l = load();
  ASSERT_NE(l.api, nullptr);
  rlh_kernels* k = nullptr;
  rlh::sdk::StatusPtr s(l.api->create(nullptr, rlh::sdk::kCPU, "{}", 2, &k));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_UNIMPLEMENTED) << rlh::sdk::status_message(s.get());
  int32_t score = -1;
  std::string reason;
  rlh_status_destroy(l.desc->probe(nullptr, &score, rlh::sdk::write_to_string, &reason));
  if (score == 0 && reason.rfind("no CUDA device", 0) == 0) {
    rlh::sdk::StatusPtr c(l.api->create(nullptr, rlh::sdk::cuda_device(0), "{}", 2, &k));
    ASSERT_NE(c, nullptr);
    EXPECT_EQ(c->code, RLH_E_UNAVAILABLE);
    EXPECT_NE(rlh::sdk::status_message(c.get()).find("no CUDA device"), std::string::npos);
  }
}

}  // namespace
