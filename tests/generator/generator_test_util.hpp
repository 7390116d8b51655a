// Shared helpers of the generator tests: fixture folders, random models of given shapes, the
// trainer-side logprobs of generated sequences (the engine's forward), and collecting samples.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "rlhost/engine/engine.hpp"
#include "rlhost/generator/generator.hpp"
#include "rlhost/sdk/model_desc.hpp"

namespace rlh::gen::test {

// $RLHOST_FIXTURES, else the fixtures folder next to the source tree.
std::string fixtures_root();
// Model folders (config.json + reference.safetensors) under it and under the engine's in-tree
// fixtures (tests/engine/fixtures: more MoE configurations), as full paths, sorted by name.
std::vector<std::string> fixture_models();

// A description from an HF-style config (LlamaForCausalLM unless `extra` overrides keys).
sdk::TransformerDesc llama_desc(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, int64_t ffn, const std::string& extra_json = "{}");
// Random weights for desc (normal * scale, norms around 1), deterministic in seed.
std::vector<std::vector<float>> random_weights(const sdk::TransformerDesc& desc, uint64_t seed, float scale = 0.08f);

// One finished sample, copied out of the callback.
struct Out {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  bool truncated = false;
  int64_t weight_version = -1;
};
// Keyed by (global prompt index, sample index).
using Outs = std::map<std::pair<int64_t, int64_t>, Out>;

// Runs g.generate over `prompts` (each a token list) starting at global prompt index `first`,
// adding the results to `outs` under global indices.
Stats run(Generator& g, const std::vector<std::vector<int32_t>>& prompts, Request base, int64_t first, Outs& outs);

// The engine's processed logprobs (temperature, top-k, top-p) of every generated token of
// `outs`, in the order of the sample's ids: the trainer's side of the mismatch measurement.
struct Mismatch {
  double mean_abs = 0, max_abs = 0;
  double token_mult_prob_error = 0;  // NeMo-RL: mean exp|lp_gen - lp_train|
  int64_t tokens = 0;
};
Mismatch trainer_mismatch(engine::Engine& eng, const std::vector<std::vector<int32_t>>& prompts,
                          int64_t first, const Outs& outs, const SamplingParams& sp);

}  // namespace rlh::gen::test
