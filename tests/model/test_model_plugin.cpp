// The model_llama plugin module through the C ABI: loaded with dlopen like the host does, its
// MODEL component lists the architectures and describes configs as JSON.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

#include "model_test_util.hpp"
#include "rlhost/model.h"
#include "rlhost/model/llama_family.hpp"

namespace {

struct Loaded {
  void* handle = nullptr;
  const rlh_model_api* api = nullptr;
  Loaded() {
    handle = dlopen(RLH_MODEL_LLAMA_PLUGIN, RTLD_NOW | RTLD_LOCAL);
    if (!handle) return;
    auto entry = reinterpret_cast<rlh_plugin_entry_fn>(dlsym(handle, RLH_PLUGIN_ENTRY_SYMBOL));
    if (!entry) return;
    const rlh_plugin_desc* d = entry(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR);
    if (!d) return;
    for (size_t i = 0; i < d->num_components; ++i)
      if (d->components[i]->kind == RLH_KIND_MODEL) api = static_cast<const rlh_model_api*>(d->components[i]->api);
  }
  ~Loaded() {
    if (handle) dlclose(handle);
  }
};

void append(void* user, const void* data, size_t len) {
  static_cast<std::string*>(user)->append(static_cast<const char*>(data), len);
}

}  // namespace

TEST(ModelPlugin, ListsArchitecturesAndDescribes) {
  Loaded p;
  ASSERT_NE(p.handle, nullptr) << dlerror();
  ASSERT_NE(p.api, nullptr);
  std::vector<std::string> names;
  for (const char* const* a = p.api->architectures; *a; ++a) names.emplace_back(*a);
  EXPECT_EQ(names, rlh::model::supported_architectures());

  for (const auto& dir : rlh::test::model_fixture_dirs()) {
    const std::string cfg = rlh::test::read_file(dir / "config.json");
    std::string out;
    rlh_status* s = p.api->describe(nullptr, cfg.data(), cfg.size(), append, &out);
    ASSERT_EQ(s, nullptr) << s->message;
    const auto direct = rlh::model::describe_model_dir(dir.string());
    EXPECT_EQ(nlohmann::json::parse(out), nlohmann::json(direct)) << dir;
  }
}

TEST(ModelPlugin, ErrorsComeBackAsStatuses) {
  Loaded p;
  ASSERT_NE(p.api, nullptr);
  const std::string cfg = R"({"architectures":["FalconForCausalLM"],"vocab_size":8})";
  std::string out;
  rlh_status* s = p.api->describe(nullptr, cfg.data(), cfg.size(), append, &out);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_INVALID_ARGUMENT);
  EXPECT_NE(std::string(s->message, s->message_len).find("FalconForCausalLM"), std::string::npos);
  rlh_status_destroy(s);
  EXPECT_TRUE(out.empty());
  s = p.api->describe(nullptr, "{", 1, append, &out);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_INVALID_ARGUMENT);
  rlh_status_destroy(s);
}
