// Row types of the architecture tables: what differs between members of the Llama family is
// data here, read by one generic describe() (describe_config.cpp).
#pragma once

#include <span>
#include <string_view>

#include "rlhost/sdk/model_desc.hpp"

namespace rlh::model {

// A config hyper-parameter: the canonical field, the config.json keys that may hold it (first
// present wins; aliases separated by '|'; empty = never read from the config), and the value
// when absent, as JSON text ("" = required).
struct HparamRow {
  std::string_view field;
  std::string_view keys;
  std::string_view default_json;
};

// Which layers use a sliding window, when the window is on at all (use_sliding_window); a config
// "layer_types" list overrides the rule where the row honours layer_types.
enum class SlidingRule {
  none,           // never
  all_layers,     // every layer (Mistral, Mixtral, Qwen3-MoE)
  from_layer,     // i >= max_window_layers (Qwen2, Qwen3)
  even_below_max,  // even i (HF: (i + 1) % 2) below max_window_layers (Qwen2-MoE)
  pattern,         // all but every sliding_pattern-th layer: (i + 1) % pattern != 0 (Gemma-2/3)
};

// Which layers are MoE.
enum class MoeRule {
  none,
  all_layers,   // Mixtral
  sparse_step,  // not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (Qwen-MoE)
  first_k_dense,  // i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek)
};

// HF weight name pattern of one parameter role: "{i}" is the layer, "{e}" the expert. Expert
// patterns are stacked along a new axis 0 into one engine tensor whose name drops ".{e}".
struct WeightNameRow {
  sdk::ParamRole role;
  std::string_view pattern;
};

struct ArchitectureRow {
  std::string_view architecture;  // HF "architectures"[0]
  std::string_view model_type;    // HF "model_type"
  std::span<const HparamRow> hparams;  // overrides and additions over kCommonHparams
  std::span<const WeightNameRow> weights;
  sdk::AttentionKind attention = sdk::AttentionKind::gqa;
  bool qk_norm = false;  // Qwen3: RMSNorm on each q/k head
  SlidingRule sliding = SlidingRule::none;
  bool honours_layer_types = false;  // config "layer_types" decides sliding layers
  MoeRule moe = MoeRule::none;
  sdk::MoeScoring moe_scoring = sdk::MoeScoring::softmax;
  bool moe_norm_topk_always = false;  // Mixtral renormalises its top-k without a config key
  bool shared_expert_gate = false;    // Qwen2-MoE sigmoid gate on the shared expert
  bool expert_score_bias = false;     // DeepSeek-V3 e_score_correction_bias
  // Gemma: (1 + w) norms everywhere, embedding rows scaled by sqrt(hidden_size), softmax scale
  // query_pre_attn_scalar^-1/2, soft-capping keys (the description carries them; executors
  // refuse what they do not run).
  bool gemma = false;
  bool sandwich_norms = false;  // Gemma-2/3: post-attention and post-feed-forward norms
  bool local_rope = false;      // Gemma-3: sliding layers use rope_local_base_freq, default RoPE
};

// Hyper-parameters every row starts from (HF's PreTrainedConfig-level defaults).
std::span<const HparamRow> common_hparams();
std::span<const ArchitectureRow> architecture_rows();
const ArchitectureRow* find_architecture(std::string_view architecture);

}  // namespace rlh::model
