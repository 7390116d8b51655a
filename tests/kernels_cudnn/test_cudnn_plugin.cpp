// The kernels_cudnn plugin on any machine: it loads with dlopen without a GPU, a driver or cuDNN,
// describes itself, lists its two ops, its probe says whether it can run here, and create()
// refuses host memory (UNIMPLEMENTED) and, without a GPU or cuDNN, says why in one line
// (UNAVAILABLE). No CUDA or cuDNN is linked into this test.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "rlhost/kernels.h"
#include "rlhost/sdk/kernels.hpp"
#include "rlhost/sdk/status.hpp"

namespace {

std::string plugin_path() {
  if (const char* p = std::getenv("RLH_KCUDNN_PLUGIN"); p && *p) return p;
  return RLH_KCUDNN_PLUGIN_PATH;
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

bool one_line(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

TEST(KernelsCudnnPlugin, LoadsDescribesItselfAndProbesAnywhere) {
  Loaded l = load();
  ASSERT_NE(l.lib, nullptr) << dlerror();
  ASSERT_NE(l.desc, nullptr);
  EXPECT_STREQ(l.desc->name, "kernels_cudnn");
  ASSERT_NE(l.api, nullptr);
  ASSERT_GE(l.api->struct_size, RLH_STRUCT_SIZE(rlh_kernels_api, workspace_size));
  ASSERT_TRUE(RLH_HAS_FIELD(l.desc, rlh_plugin_desc, probe));
  ASSERT_NE(l.desc->probe, nullptr);
  int32_t score = -1;
  std::string reason;
  rlh_status* s = l.desc->probe(nullptr, &score, rlh::sdk::write_to_string, &reason);
  ASSERT_EQ(s, nullptr) << rlh::sdk::status_message(s);
  std::printf("probe: score %d, %s\n", score, reason.c_str());
  EXPECT_TRUE(one_line(reason)) << reason;
  if (score == 0) {
    // No usable device, or no usable cuDNN: the reason says which.
    EXPECT_TRUE(reason.rfind("no CUDA device", 0) == 0 || reason.find("compute capability") != std::string::npos ||
                reason.find("libcudnn.so.9") != std::string::npos)
        << reason;
  } else {
    // Above kernels_cuda's 10: the registry asks kernels_cudnn first for attention.
    EXPECT_EQ(score, 20);
    EXPECT_NE(reason.find("cuDNN 9."), std::string::npos) << reason;
  }
}

TEST(KernelsCudnnPlugin, ListsAttentionForwardAndBackwardInBf16) {
  Loaded l = load();
  ASSERT_NE(l.api, nullptr);
  std::string listing;
  rlh_status* s = l.api->list_ops(nullptr, rlh::sdk::write_to_string, &listing);
  ASSERT_EQ(s, nullptr) << rlh::sdk::status_message(s);
  EXPECT_NE(listing.find("\"name\":\"attention_fwd\""), std::string::npos) << listing;
  EXPECT_NE(listing.find("\"name\":\"attention_bwd\""), std::string::npos) << listing;
  EXPECT_NE(listing.find("\"backward\":\"attention_bwd\""), std::string::npos) << listing;
  EXPECT_NE(listing.find("\"bf16\""), std::string::npos) << listing;
  EXPECT_EQ(listing.find("\"f32\""), std::string::npos) << listing;  // bf16 only
  EXPECT_EQ(listing.find("gemm"), std::string::npos) << listing;     // attention only
}

TEST(KernelsCudnnPlugin, RefusesHostMemoryAndSaysWhyItCannotRunHere) {
  Loaded l = load();
  ASSERT_NE(l.api, nullptr);
  rlh_kernels* k = nullptr;
  rlh::sdk::StatusPtr s(l.api->create(nullptr, rlh::sdk::kCPU, "{}", 2, &k));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_UNIMPLEMENTED) << rlh::sdk::status_message(s.get());
  EXPECT_NE(rlh::sdk::status_message(s.get()).find("kernels_cudnn"), std::string::npos);

  int32_t score = -1;
  std::string reason;
  rlh_status_destroy(l.desc->probe(nullptr, &score, rlh::sdk::write_to_string, &reason));
  if (score != 0) GTEST_SKIP() << "a GPU and cuDNN are usable here (" << reason << "): the gpu test covers create()";
  rlh::sdk::StatusPtr c(l.api->create(nullptr, rlh::sdk::cuda_device(0), "{}", 2, &k));
  ASSERT_NE(c, nullptr) << "create() succeeded where the probe said: " << reason;
  const std::string msg = rlh::sdk::status_message(c.get());
  std::printf("create(cuda:0): %s\n", msg.c_str());
  EXPECT_EQ(c->code, RLH_E_UNAVAILABLE) << msg;
  EXPECT_TRUE(one_line(msg)) << msg;
  EXPECT_EQ(msg.rfind("kernels_cudnn: ", 0), 0u) << msg;
  EXPECT_TRUE(msg.find("no CUDA device") != std::string::npos || msg.find("libcudnn.so.9") != std::string::npos)
      << msg;
}

TEST(KernelsCudnnPlugin, StatesDeviceMemory) {
  Loaded l = load();
  ASSERT_NE(l.api, nullptr);
  ASSERT_NE(l.api->provider_info, nullptr);
  std::string info;
  rlh_status* s = l.api->provider_info(nullptr, rlh::sdk::write_to_string, &info);
  ASSERT_EQ(s, nullptr);
  EXPECT_EQ(info, "{\"reference\":false,\"memory\":\"device\"}");
  EXPECT_NE(l.api->memory_alloc, nullptr);
  EXPECT_NE(l.api->memory_copy, nullptr);
  EXPECT_NE(l.api->synchronize, nullptr);
  EXPECT_NE(l.api->workspace_size, nullptr);
}

}  // namespace
