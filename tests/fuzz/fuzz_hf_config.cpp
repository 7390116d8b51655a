// libFuzzer target: arbitrary text as an HF config.json. describe_json_text must either return a
// description or throw std::runtime_error; a description must survive the JSON round trip that
// carries it across the C ABI, and its RoPE frequencies must compute or be refused cleanly.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string_view>

#include <nlohmann/json.hpp>

#include "rlhost/model/llama_family.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  rlh::sdk::TransformerDesc d;
  try {
    d = rlh::model::describe_json_text(text, "fuzz/config.json");
  } catch (const std::runtime_error&) {
    return 0;
  }
  // Large (legal) tables make the round trip slow without exercising anything new.
  size_t hf_names = 0;
  for (const auto& p : d.params) hf_names += p.hf_names.size();
  if (hf_names <= 8192) {
    const nlohmann::json j = d;
    const auto back = nlohmann::json::parse(j.dump()).get<rlh::sdk::TransformerDesc>();
    if (nlohmann::json(back) != j) __builtin_trap();
  }
  if (d.layers.size() != static_cast<size_t>(d.num_layers)) __builtin_trap();
  try {
    for (double f : rlh::sdk::rope_inv_freq(d.rope, d.rope.rotary_dim, d.max_position_embeddings * 2))
      if (std::isnan(f)) break;  // a legal but degenerate config may produce NaN; only crashes matter
    (void)rlh::sdk::rope_attention_scaling(d.rope);
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
