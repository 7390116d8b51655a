// The description's JSON form (what crosses the C ABI) round-trips and refuses what it cannot read.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "model_test_util.hpp"
#include "rlhost/model/llama_family.hpp"

using namespace rlh;
using nlohmann::json;
namespace fs = std::filesystem;

TEST(ModelDescJson, EveryHandWrittenConfigRoundTrips) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(RLH_MODEL_TEST_CONFIGS)) {
    const auto name = e.path().filename().string();
    if (!name.ends_with(".json") || name.ends_with(".hf.json") || name == "rope_golden.json") continue;
    std::ifstream in(e.path());
    const auto d = model::describe(json::parse(in));
    const json j = d;
    EXPECT_EQ(j.at("schema_version"), sdk::kModelDescSchemaVersion);
    const auto back = json::parse(j.dump()).get<sdk::TransformerDesc>();
    EXPECT_EQ(json(back), j) << name;
    EXPECT_EQ(back.params.size(), d.params.size());
    ++n;
  }
  EXPECT_GT(n, 0);
}

TEST(ModelDescJson, EnumsTravelByName) {
  json cfg = json::parse(R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":32,"hidden_size":16,
    "intermediate_size":24,"num_hidden_layers":1,"num_attention_heads":2,"head_dim":8,"tie_word_embeddings":true})");
  const json j = model::describe(cfg);
  EXPECT_EQ(j.at("rope").at("kind"), "default");
  EXPECT_EQ(j.at("rope").at("layout"), "half_split");
  EXPECT_EQ(j.at("layers").at(0).at("attention").at("kind"), "gqa");
  EXPECT_EQ(j.at("layers").at(0).at("mlp").at("kind"), "dense");
  EXPECT_EQ(j.at("params").at(0).at("role"), "embed");
  EXPECT_EQ(j.at("params").at(0).at("dtype"), "F32");
  EXPECT_EQ(j.at("params").at(0).at("transform"), "none");
}

TEST(ModelDescJson, RefusesNewerSchemaUnknownEnumsAndMissingFields) {
  json cfg = json::parse(R"({"architectures":["LlamaForCausalLM"],"vocab_size":32,"hidden_size":16,
    "intermediate_size":24,"num_hidden_layers":1,"num_attention_heads":2})");
  const json good = model::describe(cfg);
  json j = good;
  j["schema_version"] = sdk::kModelDescSchemaVersion + 1;
  EXPECT_THROW(j.get<sdk::TransformerDesc>(), std::runtime_error);
  j = good;
  j["rope"]["kind"] = "spiral";
  try {
    j.get<sdk::TransformerDesc>();
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("spiral"), std::string::npos);
  }
  j = good;
  j["params"][0]["role"] = "wormhole";
  EXPECT_THROW(j.get<sdk::TransformerDesc>(), std::runtime_error);
  j = good;
  j.erase("layers");
  try {
    j.get<sdk::TransformerDesc>();
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'layers'"), std::string::npos);
  }
  j = good;
  j["num_layers"] = 5;
  EXPECT_THROW(j.get<sdk::TransformerDesc>(), std::runtime_error);
  // Optional fields may be absent (older writers).
  j = good;
  j["layers"][0]["attention"].erase("q_lora_rank");
  j["rope"].erase("short_factor");
  EXPECT_NO_THROW(j.get<sdk::TransformerDesc>());
}
