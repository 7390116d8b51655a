// ABI tests through the embedding API (rlhost/host.h): the fixture plugins of tests/abi/plugins
// loaded by path into librlhost. Each refusal must carry the right code and a message naming the
// plugin file and the problem, and the host must keep working afterwards (it loads the C plugin
// and scores with it). Components are used through rlhost_services(h)->find_component and the
// C tables, exactly as another plugin would use them.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "rlhost/host.h"
#include "rlhost/rlhost.h"

#ifndef RLH_TEST_PLUGIN_DIR
#error "RLH_TEST_PLUGIN_DIR must name the folder of the fixture plugins"
#endif
#ifndef RLH_TEST_C_PLUGINS
#error "RLH_TEST_C_PLUGINS must list the C fixture builds (c_plugin_gcc,c_plugin_clang)"
#endif
#ifndef RLH_TEST_OLD_PLUGINS
#error "RLH_TEST_OLD_PLUGINS must list the frozen-header fixture builds"
#endif

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) if (!item.empty()) out.push_back(item);
  return out;
}

std::string file_of(const std::string& name) { return "lib" + name + ".so"; }
std::string path_of(const std::string& name) { return std::string(RLH_TEST_PLUGIN_DIR) + "/" + file_of(name); }

struct StatusDeleter {
  void operator()(rlh_status* s) const { rlh_status_destroy(s); }
};
using Status = std::unique_ptr<rlh_status, StatusDeleter>;

std::string text(const rlh_status* s) {
  if (s == nullptr) return "OK";
  EXPECT_GE(s->struct_size, RLH_STRUCT_SIZE(rlh_status, destroy));
  EXPECT_NE(s->message, nullptr);
  if (s->message == nullptr) return "";
  EXPECT_EQ(std::strlen(s->message), s->message_len) << "message_len must match the NUL-terminated text";
  return std::string(s->message, s->message_len);
}

void append(void* user, const void* data, size_t len) {
  static_cast<std::string*>(user)->append(static_cast<const char*>(data), len);
}

#define ASSERT_OK(expr)                                              \
  do {                                                               \
    Status st_(expr);                                                \
    ASSERT_EQ(st_.get(), nullptr) << #expr << ": " << text(st_.get()); \
  } while (0)

class HostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK(rlhost_create(&h_));
    ASSERT_NE(h_, nullptr);
    rlhost_set_log_level(h_, RLH_LOG_WARN);
    svc_ = rlhost_services(h_);
    ASSERT_NE(svc_, nullptr);
    ASSERT_GE(svc_->struct_size, RLH_STRUCT_SIZE(rlh_host_api, is_cancelled));
    ASSERT_EQ(svc_->abi_major, static_cast<uint32_t>(RLH_ABI_VERSION_MAJOR));
  }
  void TearDown() override { rlhost_destroy(h_); }

  // Loads a fixture expecting a refusal; returns the message after checking code and parts.
  std::string expect_refused(const std::string& name, rlh_code code, const std::vector<std::string>& parts) {
    Status s(rlhost_load_plugin(h_, path_of(name).c_str()));
    EXPECT_NE(s.get(), nullptr) << file_of(name) << " must be refused";
    if (s == nullptr) return "";
    std::string m = text(s.get());
    EXPECT_EQ(s->code, code) << rlh_code_name(s->code) << ": " << m;
    EXPECT_NE(m.find(file_of(name)), std::string::npos) << "the message must name the file: " << m;
    for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "expected '" << p << "' in: " << m;
    return m;
  }

  const rlh_component_desc* find(int32_t kind, const char* name, rlh_code want = RLH_OK,
                                 std::string* message = nullptr) {
    const rlh_component_desc* d = nullptr;
    Status s(svc_->find_component(svc_->ctx, kind, name, &d));
    EXPECT_EQ(s ? s->code : RLH_OK, want) << name << ": " << text(s.get());
    if (message != nullptr) *message = text(s.get());
    if (want == RLH_OK) {
      EXPECT_NE(d, nullptr);
      if (d != nullptr) {
        EXPECT_EQ(d->kind, kind);
        EXPECT_STREQ(d->name, name);
      }
    }
    return d;
  }

  nlohmann::json list() {
    std::string out;
    Status s(rlhost_list_plugins(h_, append, &out));
    EXPECT_EQ(s.get(), nullptr) << text(s.get());
    return nlohmann::json::parse(out);
  }

  // Scores `response` against `expected` with the C plugin's environment; returns the reward.
  double score_with(const rlh_environment_api* env, rlh_environment* e, const std::string& response,
                    const std::string& metadata, rlh_code want = RLH_OK, std::string* message = nullptr) {
    rlh_env_sample sample{};
    sample.struct_size = RLH_STRUCT_SIZE(rlh_env_sample, metadata_len);
    sample.prompt = "q";
    sample.prompt_len = 1;
    sample.response = response.data();
    sample.response_len = response.size();
    sample.metadata_json = metadata.data();
    sample.metadata_len = metadata.size();
    const char* names[] = {"reward"};
    double reward = -1;
    uint8_t done = 0;
    rlh_env_result result{};
    result.struct_size = RLH_STRUCT_SIZE(rlh_env_result, user);
    result.num_rewards = 1;
    result.reward_names = names;
    result.rewards = &reward;
    result.done = &done;
    Status s(env->score(e, &sample, 1, &result));
    EXPECT_EQ(s ? s->code : RLH_OK, want) << text(s.get());
    if (message != nullptr) *message = text(s.get());
    if (want == RLH_OK) {
      EXPECT_EQ(done, 1);
    }
    return reward;
  }

  // The host still works: load the gcc-or-clang C plugin and run its components end to end.
  void use_c_plugin(const std::string& plugin) {
    ASSERT_OK(rlhost_load_plugin(h_, path_of(plugin).c_str()));
    const rlh_component_desc* ed = find(RLH_KIND_ENVIRONMENT, "c_exact_match");
    const rlh_component_desc* dd = find(RLH_KIND_DATASET, "c_fixed_rows");
    ASSERT_TRUE(ed != nullptr && dd != nullptr);
    const auto* env = static_cast<const rlh_environment_api*>(ed->api);
    const auto* ds = static_cast<const rlh_dataset_api*>(dd->api);
    ASSERT_GE(env->struct_size, RLH_STRUCT_SIZE(rlh_environment_api, score));
    ASSERT_GE(ds->struct_size, RLH_STRUCT_SIZE(rlh_dataset_api, get));
    rlh_dataset* d = nullptr;
    ASSERT_OK(ds->create(svc_, "{}", 2, &d));
    rlh_environment* e = nullptr;
    ASSERT_OK(env->create(svc_, "{}", 2, &e));
    ASSERT_EQ(ds->size(d), 3);
    const char* answers[] = {"4", "Paris", "\"hi\""};
    for (int64_t i = 0; i < ds->size(d); ++i) {
      std::string row;
      ASSERT_OK(ds->get(d, i, append, &row));
      auto j = nlohmann::json::parse(row);
      ASSERT_EQ(j["expected_answer"], answers[i]) << row;
      EXPECT_EQ(score_with(env, e, j["expected_answer"].get<std::string>(), row), 1.0) << row;
      EXPECT_EQ(score_with(env, e, "  " + j["expected_answer"].get<std::string>() + "\n", row), 1.0) << row;
      EXPECT_EQ(score_with(env, e, "wrong", row), 0.0) << row;
    }
    env->destroy(e);
    ds->destroy(d);
  }

  rlhost_t* h_ = nullptr;
  const rlh_host_api* svc_ = nullptr;
};

std::string abi_text(uint32_t major, uint32_t minor) {
  return "ABI " + std::to_string(major) + "." + std::to_string(minor);
}

// ------------------------------------------------------------------------------------------------
// The C99 plugin, built by gcc and by clang-14.

class CPluginTest : public HostTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(CPluginTest, ComponentsWorkThroughTheAbi) {
  use_c_plugin(GetParam());
  const rlh_component_desc* ed = find(RLH_KIND_ENVIRONMENT, "c_exact_match");
  ASSERT_NE(ed, nullptr);
  EXPECT_EQ(ed->iface_major, static_cast<uint32_t>(RLH_ENVIRONMENT_API_VERSION_MAJOR));
  EXPECT_EQ(ed->iface_minor, static_cast<uint32_t>(RLH_ENVIRONMENT_API_VERSION_MINOR));
  EXPECT_STREQ(ed->version, "1.0.0");
  const auto* env = static_cast<const rlh_environment_api*>(ed->api);

  rlh_environment* e = nullptr;
  ASSERT_OK(env->create(svc_, "{}", 2, &e));
  std::string names;
  ASSERT_OK(env->reward_names(e, append, &names));
  EXPECT_EQ(nlohmann::json::parse(names), nlohmann::json::array({"reward"}));
  const std::string row = R"({"prompt": "Capital of France?", "expected_answer": "Paris"})";
  EXPECT_EQ(score_with(env, e, "paris", row), 0.0) << "case-sensitive by default";
  std::string m;
  score_with(env, e, "Paris", R"({"prompt": "x"})", RLH_E_INVALID_ARGUMENT, &m);
  EXPECT_NE(m.find("expected_answer"), std::string::npos) << m;
  env->destroy(e);

  const std::string cfg = R"({"case_insensitive": true})";
  ASSERT_OK(env->create(svc_, cfg.data(), cfg.size(), &e));
  EXPECT_EQ(score_with(env, e, "paris", row), 1.0) << "instance config read";
  env->destroy(e);

  const rlh_component_desc* dd = find(RLH_KIND_DATASET, "c_fixed_rows");
  ASSERT_NE(dd, nullptr);
  const auto* ds = static_cast<const rlh_dataset_api*>(dd->api);
  rlh_dataset* d = nullptr;
  ASSERT_OK(ds->create(svc_, "{}", 2, &d));
  std::string out;
  Status s(ds->get(d, 7, append, &out));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->code, RLH_E_OUT_OF_RANGE);
  EXPECT_EQ(text(s.get()), "c_fixed_rows: row 7 out of range [0, 3)");
  EXPECT_TRUE(out.empty());
  ds->destroy(d);
}

TEST_P(CPluginTest, ReadsItsConfigSectionThroughHostServicesAtInit) {
  const std::string yaml = "c_plugin:\n  case_insensitive: true\n";
  ASSERT_OK(rlhost_load_config_text(h_, yaml.data(), yaml.size(), "abi test"));
  ASSERT_OK(rlhost_load_plugin(h_, path_of(GetParam()).c_str()));
  // Resolving checks every key against the loaded plugins' config_keys ("c_plugin.*" is the C
  // plugin's) and makes the configuration visible to config_get.
  ASSERT_OK(rlhost_resolve_config(h_, nullptr, nullptr));
  const rlh_component_desc* ed = find(RLH_KIND_ENVIRONMENT, "c_exact_match");  // runs init
  ASSERT_NE(ed, nullptr);
  const auto* env = static_cast<const rlh_environment_api*>(ed->api);
  rlh_environment* e = nullptr;
  ASSERT_OK(env->create(svc_, "{}", 2, &e));
  EXPECT_EQ(score_with(env, e, "PARIS", R"({"expected_answer": "Paris"})"), 1.0)
      << "init must have read c_plugin.case_insensitive through config_get";
  env->destroy(e);
}

TEST_P(CPluginTest, IsListedWithItsDescriptorAndProbeScore) {
  ASSERT_OK(rlhost_load_plugin(h_, path_of(GetParam()).c_str()));
  bool seen = false;
  for (const auto& p : list()) {
    if (p.value("name", "") != GetParam()) continue;
    seen = true;
    EXPECT_EQ(p["abi"], std::to_string(RLH_ABI_VERSION_MAJOR) + "." + std::to_string(RLH_ABI_VERSION_MINOR));
    EXPECT_EQ(p["score"], 2) << "the probe slot's score";
    EXPECT_EQ(p["can_run"], true);
    EXPECT_EQ(p["license"], "Apache-2.0");
    ASSERT_EQ(p["components"].size(), 2u) << p.dump();
    EXPECT_EQ(p["components"][0]["kind"], "environment");
    EXPECT_EQ(p["components"][0]["name"], "c_exact_match");
    EXPECT_EQ(p["components"][1]["kind"], "dataset");
    EXPECT_EQ(p["components"][1]["name"], "c_fixed_rows");
  }
  EXPECT_TRUE(seen) << list().dump(2);
}

INSTANTIATE_TEST_SUITE_P(Compilers, CPluginTest, ::testing::ValuesIn(split(RLH_TEST_C_PLUGINS)),
                         [](const auto& info) { return info.param; });

// ------------------------------------------------------------------------------------------------
// Old x new: plugins built from frozen copies of older headers of this major.

class OldMinorTest : public HostTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(OldMinorTest, FrozenHeaderPluginLoadsAndWorks) {
  ASSERT_OK(rlhost_load_plugin(h_, path_of(GetParam()).c_str()));
  const std::string comp = GetParam() + "_length";
  const rlh_component_desc* ed = find(RLH_KIND_ENVIRONMENT, comp.c_str());
  ASSERT_NE(ed, nullptr);
  const auto* env = static_cast<const rlh_environment_api*>(ed->api);
  rlh_environment* e = nullptr;
  ASSERT_OK(env->create(svc_, "{}", 2, &e));
  EXPECT_EQ(score_with(env, e, "12345", "{}"), 5.0);
  env->destroy(e);
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

INSTANTIATE_TEST_SUITE_P(Frozen, OldMinorTest, ::testing::ValuesIn(split(RLH_TEST_OLD_PLUGINS)),
                         [](const auto& info) { return info.param; });

// ------------------------------------------------------------------------------------------------
// A newer minor: every struct larger than the host knows.

TEST_F(HostTest, FutureMinorPluginWithLargerStructsIsReadSafely) {
  ASSERT_OK(rlhost_load_plugin(h_, path_of("future_minor").c_str()));
  const rlh_component_desc* ed = find(RLH_KIND_ENVIRONMENT, "future_env");
  ASSERT_NE(ed, nullptr);
  EXPECT_GT(ed->struct_size, sizeof(rlh_component_desc));
  EXPECT_EQ(ed->iface_minor, static_cast<uint32_t>(RLH_ENVIRONMENT_API_VERSION_MINOR + 1));
  const auto* env = static_cast<const rlh_environment_api*>(ed->api);
  EXPECT_GT(env->struct_size, sizeof(rlh_environment_api));
  rlh_environment* e = nullptr;
  ASSERT_OK(env->create(svc_, "{}", 2, &e));
  // 1.0 only when the plugin found (via struct_size) that this host has no newer services slot.
  EXPECT_EQ(score_with(env, e, "x", "{}"), 1.0) << "the host's services struct_size claims a slot it lacks";
  env->destroy(e);

  bool seen = false;
  for (const auto& p : list()) {
    if (p.value("name", "") != "future_minor") continue;
    seen = true;
    EXPECT_EQ(p["abi"], std::to_string(RLH_ABI_VERSION_MAJOR) + "." + std::to_string(RLH_ABI_VERSION_MINOR + 1));
    ASSERT_EQ(p["components"].size(), 2u) << p.dump();
    EXPECT_EQ(p["components"][0]["interface"],
              std::to_string(RLH_ENVIRONMENT_API_VERSION_MAJOR) + "." +
                  std::to_string(RLH_ENVIRONMENT_API_VERSION_MINOR + 1));
    EXPECT_FALSE(p["components"][0].contains("error")) << p.dump();
    // A component of a kind this host does not know: listed as unusable, plugin still loaded.
    EXPECT_EQ(p["components"][1]["name"], "future_kind_component");
    EXPECT_NE(p["components"][1].value("error", "").find("unknown"), std::string::npos) << p.dump();
  }
  EXPECT_TRUE(seen);
  // The unusable component cannot be found; the host says why.
  const rlh_component_desc* none = nullptr;
  Status s(svc_->find_component(svc_->ctx, 1000, "future_kind_component", &none));
  ASSERT_NE(s, nullptr) << "a component of an unknown kind must not be usable";
  EXPECT_EQ(s->code, RLH_E_FAILED_PRECONDITION) << text(s.get());
  EXPECT_NE(text(s.get()).find("1000"), std::string::npos) << text(s.get());
  EXPECT_EQ(none, nullptr);
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

// ------------------------------------------------------------------------------------------------
// Hostile plugins: refused or contained with a clear message; the host keeps running.

TEST_F(HostTest, NoEntrySymbolIsRefused) {
  expect_refused("no_entry", RLH_E_FAILED_PRECONDITION, {RLH_PLUGIN_ENTRY_SYMBOL});
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

TEST_F(HostTest, EntryReturningNullIsRefused) {
  expect_refused("null_desc", RLH_E_ABI_MISMATCH, {"descriptor", abi_text(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR)});
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

TEST_F(HostTest, AnotherMajorIsRefusedNamingBothVersions) {
  expect_refused("wrong_major", RLH_E_ABI_MISMATCH,
                 {abi_text(RLH_ABI_VERSION_MAJOR + 1, 0), abi_text(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR)});
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

// Across majors only {struct_size, abi_major, abi_minor} is stable: the major check must come
// before any size check and read nothing else.
TEST_F(HostTest, AnotherMajorWithADifferentDescriptorLayoutIsRefusedNamingBothVersions) {
  expect_refused("wrong_major_small", RLH_E_ABI_MISMATCH,
                 {abi_text(RLH_ABI_VERSION_MAJOR + 1, 0), abi_text(RLH_ABI_VERSION_MAJOR, RLH_ABI_VERSION_MINOR)});
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

TEST_F(HostTest, TooSmallStructSizeIsRefused) {
  expect_refused("small_struct", RLH_E_ABI_MISMATCH, {"struct_size"});
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

TEST_F(HostTest, MissingDependencyIsRefusedNamingTheLibrary) {
  expect_refused("missing_dep", RLH_E_FAILED_PRECONDITION, {"libgone.so", "cannot open shared object file"});
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

TEST_F(HostTest, NullOptionalSlotsAreNeverCalled) {
  ASSERT_OK(rlhost_load_plugin(h_, path_of("null_slots").c_str()));
  bool seen = false;
  for (const auto& p : list()) {
    if (p.value("name", "") != "null_slots") continue;
    seen = true;
    EXPECT_EQ(p["can_run"], true) << "probe NULL means: can always run";
    EXPECT_EQ(p["score"], 1);
    ASSERT_EQ(p["components"].size(), 2u);
    // The tokenizer leaves only an (optional) slot NULL: usable. The kernels table leaves
    // required slots NULL: listed with the reason, not usable.
    EXPECT_FALSE(p["components"][0].contains("error")) << p.dump();
    ASSERT_TRUE(p["components"][1].contains("error")) << p.dump();
    EXPECT_NE(p["components"][1]["error"].get<std::string>().find("required slot"), std::string::npos) << p.dump();
  }
  EXPECT_TRUE(seen);
  const rlh_component_desc* td = find(RLH_KIND_TOKENIZER, "null_slots_bytes");  // init NULL
  ASSERT_NE(td, nullptr);
  const auto* tok = static_cast<const rlh_tokenizer_api*>(td->api);
  EXPECT_EQ(tok->apply_chat_template, nullptr);
  rlh_tokenizer* t = nullptr;
  ASSERT_OK(tok->create(svc_, "unused", &t));
  std::string ids, back;
  ASSERT_OK(tok->encode(t, "abc", 3, 0, append, &ids));
  ASSERT_EQ(ids.size(), 3 * sizeof(int32_t));
  ASSERT_OK(tok->decode(t, reinterpret_cast<const int32_t*>(ids.data()), 3, 0, append, &back));
  EXPECT_EQ(back, "abc");
  tok->destroy(t);
  const rlh_component_desc* kd = find(RLH_KIND_KERNELS, "null_slots_kernels", RLH_E_FAILED_PRECONDITION);
  EXPECT_EQ(kd, nullptr);
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
  // TearDown destroys the host: shutdown is NULL and must not be called.
}

TEST_F(HostTest, ThrowingCppCallbacksBecomeStatuses) {
  ASSERT_OK(rlhost_load_plugin(h_, path_of("throwing").c_str()));
  const rlh_component_desc* ed = find(RLH_KIND_ENVIRONMENT, "throwing_env");
  ASSERT_NE(ed, nullptr);
  const auto* env = static_cast<const rlh_environment_api*>(ed->api);
  rlh_environment* e = nullptr;
  const std::string bad = R"({"throw": true})";
  {
    Status s(env->create(svc_, bad.data(), bad.size(), &e));
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->code, RLH_E_RESOURCE_EXHAUSTED) << text(s.get());
    EXPECT_EQ(e, nullptr);
  }
  ASSERT_OK(env->create(svc_, "{}", 2, &e));
  {
    std::string out;
    Status s(env->reward_names(e, append, &out));
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->code, RLH_E_FAILED_PRECONDITION);
    EXPECT_EQ(text(s.get()), "throwing_env: reward_names refuses on purpose");
  }
  {
    rlh_env_sample samples[2] = {};
    double rewards[2] = {};
    uint8_t done[2] = {};
    const char* names[] = {"reward"};
    rlh_env_result r{};
    r.struct_size = RLH_STRUCT_SIZE(rlh_env_result, user);
    r.num_rewards = 1;
    r.reward_names = names;
    r.rewards = rewards;
    r.done = done;
    Status s(env->score(e, samples, 2, &r));
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->code, RLH_E_INTERNAL);
    EXPECT_EQ(text(s.get()), "throwing_env: score exploded on 2 samples");
  }
  env->destroy(e);
  const rlh_component_desc* dd = find(RLH_KIND_DATASET, "throwing_rows");
  ASSERT_NE(dd, nullptr);
  const auto* ds = static_cast<const rlh_dataset_api*>(dd->api);
  rlh_dataset* d = nullptr;
  ASSERT_OK(ds->create(svc_, "{}", 2, &d));
  EXPECT_EQ(ds->size(d), 2);
  {
    std::string out;
    Status s(ds->get(d, 1, append, &out));
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->code, RLH_E_OUT_OF_RANGE);
    EXPECT_EQ(text(s.get()), "throwing_rows: row 1 is cursed");
  }
  ds->destroy(d);
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

TEST_F(HostTest, AllRefusalsInOneHostThenItStillWorks) {
  for (const char* name : {"no_entry", "null_desc", "wrong_major", "wrong_major_small", "small_struct", "missing_dep"}) {
    Status s(rlhost_load_plugin(h_, path_of(name).c_str()));
    EXPECT_NE(s, nullptr) << name;
  }
  Status again(rlhost_load_plugin(h_, path_of("wrong_major").c_str()));
  EXPECT_NE(again, nullptr) << "a refused plugin stays refused when loaded again";
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
  // The failures are listed with their reasons next to the loaded plugin.
  auto j = list();
  for (const char* name : {"no_entry", "wrong_major", "missing_dep"}) {
    bool seen = false;
    for (const auto& p : j) {
      const std::string path = p.value("path", "");
      if (path.size() < file_of(name).size() || path.substr(path.size() - file_of(name).size()) != file_of(name)) continue;
      seen = true;
      EXPECT_EQ(p["loaded"], false) << p.dump();
      EXPECT_FALSE(p.value("error", "").empty()) << p.dump();
    }
    EXPECT_TRUE(seen) << name << " missing from " << j.dump(2);
  }
}

TEST_F(HostTest, ListingTheFixtureFolderShowsEveryPluginAndEveryReason) {
  ASSERT_OK(rlhost_add_plugin_dir(h_, RLH_TEST_PLUGIN_DIR));
  auto j = list();
  struct Want {
    const char* name;
    bool ok;
    std::vector<std::string> reason;
  };
  const std::vector<Want> wants = {
      {"no_entry", false, {RLH_PLUGIN_ENTRY_SYMBOL}},
      {"null_desc", false, {"descriptor"}},
      {"wrong_major", false, {abi_text(RLH_ABI_VERSION_MAJOR + 1, 0)}},
      {"wrong_major_small", false, {abi_text(RLH_ABI_VERSION_MAJOR + 1, 0)}},
      {"small_struct", false, {"struct_size"}},
      {"missing_dep", false, {"libgone.so"}},
      {"null_slots", true, {}},
      {"throwing", true, {}},
      {"future_minor", true, {}},
  };
  for (const auto& w : wants) {
    int seen = 0;
    for (const auto& p : j) {
      const std::string path = p.value("path", "");
      const std::string f = file_of(w.name);
      if (path.size() < f.size() || path.compare(path.size() - f.size(), f.size(), f) != 0) continue;
      ++seen;
      if (w.ok) {
        EXPECT_EQ(p.value("name", ""), w.name) << p.dump();
        EXPECT_FALSE(p.contains("error")) << p.dump();
      } else {
        const std::string err = p.value("error", "");
        EXPECT_EQ(p["can_run"], false) << p.dump();
        EXPECT_NE(err.find(f), std::string::npos) << "reason must name the file: " << p.dump();
        for (const auto& r : w.reason) EXPECT_NE(err.find(r), std::string::npos) << r << " not in " << p.dump();
      }
    }
    EXPECT_EQ(seen, 1) << w.name << " in " << j.dump(2);
  }
  for (const auto& c : split(RLH_TEST_C_PLUGINS)) {
    bool seen = false;
    for (const auto& p : j) seen = seen || p.value("name", "") == c;
    EXPECT_TRUE(seen) << c;
  }
  use_c_plugin(split(RLH_TEST_C_PLUGINS).front());
}

TEST_F(HostTest, EmbeddingApiReportsItsAbiVersion) {
  uint32_t major = 99, minor = 99;
  rlhost_abi_version(&major, &minor);
  EXPECT_EQ(major, static_cast<uint32_t>(RLH_ABI_VERSION_MAJOR));
  EXPECT_EQ(minor, static_cast<uint32_t>(RLH_ABI_VERSION_MINOR));
  EXPECT_EQ(svc_->abi_minor, static_cast<uint32_t>(RLH_ABI_VERSION_MINOR));
}

}  // namespace
