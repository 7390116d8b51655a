// The architecture tables: every supported HF architecture as rows of data.
//
// Adding a member of the family is adding an ArchitectureRow (plus hyper-parameter defaults that
// differ from the common ones, and a weight-name table if its names are new). Defaults follow
// the HF transformers configuration classes, since a config.json omits whatever equals them.
#include "architecture_tables.hpp"

#include <array>

namespace rlh::model {

using sdk::ParamRole;

namespace {

// --- hyper-parameters -------------------------------------------------------------------------

constexpr HparamRow kCommon[] = {
    {"vocab_size", "vocab_size", ""},
    {"hidden_size", "hidden_size", ""},
    {"num_layers", "num_hidden_layers", ""},
    {"num_heads", "num_attention_heads", ""},
    {"num_kv_heads", "num_key_value_heads", "null"},  // null: = num_heads
    {"head_dim", "head_dim", "null"},                 // null: = hidden_size / num_heads
    {"intermediate_size", "intermediate_size", ""},
    {"hidden_act", "hidden_act", "\"silu\""},
    {"rms_norm_eps", "rms_norm_eps", "1e-6"},
    {"max_position_embeddings", "max_position_embeddings", "2048"},
    {"tie_word_embeddings", "tie_word_embeddings", "false"},
    {"initializer_range", "initializer_range", "0.02"},
    {"bos_token_id", "bos_token_id", "null"},
    {"eos_token_id", "eos_token_id", "null"},
    {"pad_token_id", "pad_token_id", "null"},
    {"torch_dtype", "dtype|torch_dtype", "\"float32\""},
    {"rope_theta", "rope_theta", "10000.0"},
    {"partial_rotary_factor", "partial_rotary_factor", "1.0"},
    {"rope_interleave", "", "false"},
    {"q_bias", "", "false"},
    {"k_bias", "", "false"},
    {"v_bias", "", "false"},
    {"o_bias", "", "false"},
    {"mlp_bias", "", "false"},
    {"sliding_window", "", "null"},
    // Rows whose config has a use_sliding_window switch read it; for the others a configured
    // window is always on.
    {"use_sliding_window", "", "true"},
    {"max_window_layers", "", "0"},
    {"layer_types", "layer_types", "null"},
    // MoE (read only by rows with a MoeRule)
    {"num_experts", "", "0"},
    {"top_k", "num_experts_per_tok", "0"},
    {"moe_intermediate_size", "moe_intermediate_size", "0"},
    {"norm_topk_prob", "norm_topk_prob", "false"},
    {"shared_expert_intermediate_size", "", "0"},
    {"n_shared_experts", "", "0"},
    {"decoder_sparse_step", "decoder_sparse_step", "1"},
    {"mlp_only_layers", "mlp_only_layers", "[]"},
    {"first_k_dense_replace", "first_k_dense_replace", "0"},
    {"moe_layer_freq", "moe_layer_freq", "1"},
    {"n_group", "n_group", "1"},
    {"topk_group", "topk_group", "1"},
    {"routed_scaling_factor", "routed_scaling_factor", "1.0"},
    {"router_aux_loss_coef", "router_aux_loss_coef", "0.0"},
    // MLA (read only by rows with AttentionKind::mla)
    {"q_lora_rank", "q_lora_rank", "null"},
    {"kv_lora_rank", "kv_lora_rank", ""},
    {"qk_rope_head_dim", "qk_rope_head_dim", ""},
    {"qk_nope_head_dim", "qk_nope_head_dim", ""},
    {"v_head_dim", "v_head_dim", ""},
    {"attention_bias", "attention_bias", "false"},
    // Gemma (read only by rows with `gemma`)
    {"rope_local_base_freq", "", "10000.0"},
    {"sliding_pattern", "", "1"},
    {"query_pre_attn_scalar", "", "null"},
    {"final_logit_softcapping", "", "null"},
    {"attn_logit_softcapping", "", "null"},
};

constexpr HparamRow kLlama[] = {
    {"max_position_embeddings", "max_position_embeddings", "2048"},
    {"bos_token_id", "bos_token_id", "1"},
    {"eos_token_id", "eos_token_id", "2"},
    {"q_bias", "attention_bias", "false"},
    {"k_bias", "attention_bias", "false"},
    {"v_bias", "attention_bias", "false"},
    {"o_bias", "attention_bias", "false"},
    {"mlp_bias", "mlp_bias", "false"},
};

constexpr HparamRow kMistral[] = {
    {"max_position_embeddings", "max_position_embeddings", "131072"},
    {"bos_token_id", "bos_token_id", "1"},
    {"eos_token_id", "eos_token_id", "2"},
    {"sliding_window", "sliding_window", "4096"},
};

constexpr HparamRow kQwen2[] = {
    {"max_position_embeddings", "max_position_embeddings", "32768"},
    {"q_bias", "", "true"},
    {"k_bias", "", "true"},
    {"v_bias", "", "true"},
    {"sliding_window", "sliding_window", "4096"},
    {"use_sliding_window", "use_sliding_window", "false"},
    {"max_window_layers", "max_window_layers", "28"},
};

constexpr HparamRow kQwen3[] = {
    {"max_position_embeddings", "max_position_embeddings", "32768"},
    {"head_dim", "head_dim", "128"},
    {"q_bias", "attention_bias", "false"},
    {"k_bias", "attention_bias", "false"},
    {"v_bias", "attention_bias", "false"},
    {"o_bias", "attention_bias", "false"},
    {"sliding_window", "sliding_window", "4096"},
    {"use_sliding_window", "use_sliding_window", "false"},
    {"max_window_layers", "max_window_layers", "28"},
};

constexpr HparamRow kMixtral[] = {
    {"max_position_embeddings", "max_position_embeddings", "131072"},
    {"rms_norm_eps", "rms_norm_eps", "1e-5"},
    {"bos_token_id", "bos_token_id", "1"},
    {"eos_token_id", "eos_token_id", "2"},
    {"rope_theta", "rope_theta", "1000000.0"},
    {"sliding_window", "sliding_window", "null"},
    {"num_experts", "num_local_experts|num_experts", "8"},
    {"top_k", "num_experts_per_tok", "2"},
    // Mixtral's experts are intermediate_size wide; it has no dense MLP.
    {"moe_intermediate_size", "intermediate_size", "14336"},
    {"intermediate_size", "", "0"},
    {"router_aux_loss_coef", "router_aux_loss_coef", "0.001"},
};

constexpr HparamRow kQwen2Moe[] = {
    {"max_position_embeddings", "max_position_embeddings", "32768"},
    {"intermediate_size", "intermediate_size", "5632"},
    {"q_bias", "qkv_bias", "true"},
    {"k_bias", "qkv_bias", "true"},
    {"v_bias", "qkv_bias", "true"},
    {"sliding_window", "sliding_window", "4096"},
    {"use_sliding_window", "use_sliding_window", "false"},
    {"max_window_layers", "max_window_layers", "28"},
    {"num_experts", "num_experts|num_local_experts", "60"},
    {"top_k", "num_experts_per_tok", "4"},
    {"moe_intermediate_size", "moe_intermediate_size", "1408"},
    {"shared_expert_intermediate_size", "shared_expert_intermediate_size", "5632"},
    {"router_aux_loss_coef", "router_aux_loss_coef", "0.001"},
};

constexpr HparamRow kQwen3Moe[] = {
    {"max_position_embeddings", "max_position_embeddings", "32768"},
    {"intermediate_size", "intermediate_size", "6144"},
    {"q_bias", "attention_bias", "false"},
    {"k_bias", "attention_bias", "false"},
    {"v_bias", "attention_bias", "false"},
    {"o_bias", "attention_bias", "false"},
    // Qwen3-MoE applies the window on every layer when use_sliding_window is set.
    {"sliding_window", "sliding_window", "4096"},
    {"use_sliding_window", "use_sliding_window", "false"},
    {"num_experts", "num_local_experts|num_experts", "128"},
    {"top_k", "num_experts_per_tok", "8"},
    {"moe_intermediate_size", "moe_intermediate_size", "768"},
    {"router_aux_loss_coef", "router_aux_loss_coef", "0.001"},
};

// Gemma-2 (Gemma2Config) and Gemma-3 text (Gemma3TextConfig): sliding windows on the layers
// layer_types names (HF fills it from the pattern when absent: every other layer for Gemma-2,
// five of six for Gemma-3).
constexpr HparamRow kGemma2[] = {
    {"vocab_size", "vocab_size", "256000"},
    {"hidden_size", "hidden_size", "2304"},
    {"intermediate_size", "intermediate_size", "9216"},
    {"num_layers", "num_hidden_layers", "26"},
    {"num_heads", "num_attention_heads", "8"},
    {"num_kv_heads", "num_key_value_heads", "4"},
    {"head_dim", "head_dim", "256"},
    {"hidden_act", "hidden_activation|hidden_act", "\"gelu_pytorch_tanh\""},
    {"max_position_embeddings", "max_position_embeddings", "8192"},
    {"pad_token_id", "pad_token_id", "0"},
    {"eos_token_id", "eos_token_id", "1"},
    {"bos_token_id", "bos_token_id", "2"},
    {"tie_word_embeddings", "tie_word_embeddings", "true"},
    {"q_bias", "attention_bias", "false"},
    {"k_bias", "attention_bias", "false"},
    {"v_bias", "attention_bias", "false"},
    {"o_bias", "attention_bias", "false"},
    {"sliding_window", "sliding_window", "4096"},
    {"sliding_pattern", "", "2"},
    {"query_pre_attn_scalar", "query_pre_attn_scalar", "256"},
    {"final_logit_softcapping", "final_logit_softcapping", "30.0"},
    {"attn_logit_softcapping", "attn_logit_softcapping", "50.0"},
};

constexpr HparamRow kGemma3[] = {
    {"vocab_size", "vocab_size", "262208"},
    {"hidden_size", "hidden_size", "2304"},
    {"intermediate_size", "intermediate_size", "9216"},
    {"num_layers", "num_hidden_layers", "26"},
    {"num_heads", "num_attention_heads", "8"},
    {"num_kv_heads", "num_key_value_heads", "4"},
    {"head_dim", "head_dim", "256"},
    {"hidden_act", "hidden_activation|hidden_act", "\"gelu_pytorch_tanh\""},
    {"max_position_embeddings", "max_position_embeddings", "131072"},
    {"pad_token_id", "pad_token_id", "0"},
    {"eos_token_id", "eos_token_id", "1"},
    {"bos_token_id", "bos_token_id", "2"},
    {"tie_word_embeddings", "tie_word_embeddings", "true"},
    {"rope_theta", "rope_theta", "1000000.0"},
    {"rope_local_base_freq", "rope_local_base_freq", "10000.0"},
    {"q_bias", "attention_bias", "false"},
    {"k_bias", "attention_bias", "false"},
    {"v_bias", "attention_bias", "false"},
    {"o_bias", "attention_bias", "false"},
    {"sliding_window", "sliding_window", "4096"},
    {"sliding_pattern", "sliding_window_pattern", "6"},
    {"query_pre_attn_scalar", "query_pre_attn_scalar", "256"},
    {"final_logit_softcapping", "final_logit_softcapping", "null"},
    {"attn_logit_softcapping", "attn_logit_softcapping", "null"},
};

constexpr HparamRow kDeepseekV3[] = {
    {"max_position_embeddings", "max_position_embeddings", "4096"},
    {"bos_token_id", "bos_token_id", "0"},
    {"eos_token_id", "eos_token_id", "1"},
    {"rope_interleave", "rope_interleave", "true"},
    {"num_experts", "n_routed_experts|num_local_experts", "256"},
    {"top_k", "num_experts_per_tok", "8"},
    {"moe_intermediate_size", "moe_intermediate_size", "2048"},
    {"n_shared_experts", "n_shared_experts", "1"},
    {"norm_topk_prob", "norm_topk_prob", "true"},
    {"first_k_dense_replace", "first_k_dense_replace", "3"},
    {"n_group", "n_group", "8"},
    {"topk_group", "topk_group", "4"},
    {"routed_scaling_factor", "routed_scaling_factor", "2.5"},
    {"q_lora_rank", "q_lora_rank", "1536"},
    {"kv_lora_rank", "kv_lora_rank", "512"},
    {"qk_rope_head_dim", "qk_rope_head_dim", "64"},
    {"qk_nope_head_dim", "qk_nope_head_dim", "128"},
    {"v_head_dim", "v_head_dim", "128"},
};

// --- weight names -----------------------------------------------------------------------------

// Global tensors and the attention/norm layout shared by the whole family.
#define RLH_LLAMA_COMMON_WEIGHTS                                              \
  {ParamRole::embed, "model.embed_tokens.weight"},                           \
      {ParamRole::final_norm, "model.norm.weight"},                          \
      {ParamRole::lm_head, "lm_head.weight"},                                \
      {ParamRole::attn_norm, "model.layers.{i}.input_layernorm.weight"},     \
      {ParamRole::mlp_norm, "model.layers.{i}.post_attention_layernorm.weight"}

#define RLH_LLAMA_ATTENTION_WEIGHTS                                           \
  {ParamRole::q, "model.layers.{i}.self_attn.q_proj.weight"},                \
      {ParamRole::k, "model.layers.{i}.self_attn.k_proj.weight"},            \
      {ParamRole::v, "model.layers.{i}.self_attn.v_proj.weight"},            \
      {ParamRole::o, "model.layers.{i}.self_attn.o_proj.weight"},            \
      {ParamRole::q_bias, "model.layers.{i}.self_attn.q_proj.bias"},         \
      {ParamRole::k_bias, "model.layers.{i}.self_attn.k_proj.bias"},         \
      {ParamRole::v_bias, "model.layers.{i}.self_attn.v_proj.bias"},         \
      {ParamRole::o_bias, "model.layers.{i}.self_attn.o_proj.bias"},         \
      {ParamRole::q_norm, "model.layers.{i}.self_attn.q_norm.weight"},       \
      {ParamRole::k_norm, "model.layers.{i}.self_attn.k_norm.weight"}

#define RLH_LLAMA_DENSE_MLP_WEIGHTS                                           \
  {ParamRole::gate, "model.layers.{i}.mlp.gate_proj.weight"},                \
      {ParamRole::up, "model.layers.{i}.mlp.up_proj.weight"},                \
      {ParamRole::down, "model.layers.{i}.mlp.down_proj.weight"},            \
      {ParamRole::gate_bias, "model.layers.{i}.mlp.gate_proj.bias"},         \
      {ParamRole::up_bias, "model.layers.{i}.mlp.up_proj.bias"},             \
      {ParamRole::down_bias, "model.layers.{i}.mlp.down_proj.bias"}

constexpr WeightNameRow kLlamaWeights[] = {
    RLH_LLAMA_COMMON_WEIGHTS,
    RLH_LLAMA_ATTENTION_WEIGHTS,
    RLH_LLAMA_DENSE_MLP_WEIGHTS,
};

constexpr WeightNameRow kMixtralWeights[] = {
    RLH_LLAMA_COMMON_WEIGHTS,
    RLH_LLAMA_ATTENTION_WEIGHTS,
    {ParamRole::router, "model.layers.{i}.block_sparse_moe.gate.weight"},
    {ParamRole::expert_gate, "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"},
    {ParamRole::expert_up, "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"},
    {ParamRole::expert_down, "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"},
};

constexpr WeightNameRow kQwenMoeWeights[] = {
    RLH_LLAMA_COMMON_WEIGHTS,
    RLH_LLAMA_ATTENTION_WEIGHTS,
    RLH_LLAMA_DENSE_MLP_WEIGHTS,  // layers listed in mlp_only_layers
    {ParamRole::router, "model.layers.{i}.mlp.gate.weight"},
    {ParamRole::expert_gate, "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"},
    {ParamRole::expert_up, "model.layers.{i}.mlp.experts.{e}.up_proj.weight"},
    {ParamRole::expert_down, "model.layers.{i}.mlp.experts.{e}.down_proj.weight"},
    {ParamRole::shared_expert_gate_proj, "model.layers.{i}.mlp.shared_expert.gate_proj.weight"},
    {ParamRole::shared_expert_up, "model.layers.{i}.mlp.shared_expert.up_proj.weight"},
    {ParamRole::shared_expert_down, "model.layers.{i}.mlp.shared_expert.down_proj.weight"},
    {ParamRole::shared_expert_gate, "model.layers.{i}.mlp.shared_expert_gate.weight"},
};

constexpr WeightNameRow kDeepseekV3Weights[] = {
    RLH_LLAMA_COMMON_WEIGHTS,
    RLH_LLAMA_DENSE_MLP_WEIGHTS,  // the first_k_dense_replace layers
    {ParamRole::q, "model.layers.{i}.self_attn.q_proj.weight"},  // q_lora_rank null
    {ParamRole::q_a, "model.layers.{i}.self_attn.q_a_proj.weight"},
    {ParamRole::q_a_norm, "model.layers.{i}.self_attn.q_a_layernorm.weight"},
    {ParamRole::q_b, "model.layers.{i}.self_attn.q_b_proj.weight"},
    {ParamRole::kv_a, "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"},
    {ParamRole::kv_a_norm, "model.layers.{i}.self_attn.kv_a_layernorm.weight"},
    {ParamRole::kv_b, "model.layers.{i}.self_attn.kv_b_proj.weight"},
    {ParamRole::o, "model.layers.{i}.self_attn.o_proj.weight"},
    {ParamRole::router, "model.layers.{i}.mlp.gate.weight"},
    {ParamRole::expert_score_bias, "model.layers.{i}.mlp.gate.e_score_correction_bias"},
    {ParamRole::expert_gate, "model.layers.{i}.mlp.experts.{e}.gate_proj.weight"},
    {ParamRole::expert_up, "model.layers.{i}.mlp.experts.{e}.up_proj.weight"},
    {ParamRole::expert_down, "model.layers.{i}.mlp.experts.{e}.down_proj.weight"},
    {ParamRole::shared_expert_gate_proj, "model.layers.{i}.mlp.shared_experts.gate_proj.weight"},
    {ParamRole::shared_expert_up, "model.layers.{i}.mlp.shared_experts.up_proj.weight"},
    {ParamRole::shared_expert_down, "model.layers.{i}.mlp.shared_experts.down_proj.weight"},
};

// Gemma-2/3: HF's post_attention_layernorm is the norm after attention (a sandwich norm), the
// pre-MLP norm is pre_feedforward_layernorm.
constexpr WeightNameRow kGemmaWeights[] = {
    {ParamRole::embed, "model.embed_tokens.weight"},
    {ParamRole::final_norm, "model.norm.weight"},
    {ParamRole::lm_head, "lm_head.weight"},
    {ParamRole::attn_norm, "model.layers.{i}.input_layernorm.weight"},
    {ParamRole::post_attn_norm, "model.layers.{i}.post_attention_layernorm.weight"},
    {ParamRole::mlp_norm, "model.layers.{i}.pre_feedforward_layernorm.weight"},
    {ParamRole::post_mlp_norm, "model.layers.{i}.post_feedforward_layernorm.weight"},
    RLH_LLAMA_ATTENTION_WEIGHTS,
    RLH_LLAMA_DENSE_MLP_WEIGHTS,
};

#undef RLH_LLAMA_COMMON_WEIGHTS
#undef RLH_LLAMA_ATTENTION_WEIGHTS
#undef RLH_LLAMA_DENSE_MLP_WEIGHTS

// --- the table --------------------------------------------------------------------------------

constexpr ArchitectureRow make_row(std::string_view arch, std::string_view model_type,
                                   std::span<const HparamRow> hp, std::span<const WeightNameRow> w) {
  ArchitectureRow r{};
  r.architecture = arch;
  r.model_type = model_type;
  r.hparams = hp;
  r.weights = w;
  return r;
}

const std::array<ArchitectureRow, 10> kRows = [] {
  std::array<ArchitectureRow, 10> rows{};
  // Dense family.
  rows[0] = make_row("LlamaForCausalLM", "llama", kLlama, kLlamaWeights);

  rows[1] = make_row("MistralForCausalLM", "mistral", kMistral, kLlamaWeights);
  rows[1].sliding = SlidingRule::all_layers;

  rows[2] = make_row("Qwen2ForCausalLM", "qwen2", kQwen2, kLlamaWeights);
  rows[2].sliding = SlidingRule::from_layer;
  rows[2].honours_layer_types = true;

  rows[3] = make_row("Qwen3ForCausalLM", "qwen3", kQwen3, kLlamaWeights);
  rows[3].qk_norm = true;
  rows[3].sliding = SlidingRule::from_layer;
  rows[3].honours_layer_types = true;

  // MoE relatives (described; executed once the MoE engine lands).
  rows[4] = make_row("MixtralForCausalLM", "mixtral", kMixtral, kMixtralWeights);
  rows[4].sliding = SlidingRule::all_layers;
  rows[4].moe = MoeRule::all_layers;
  rows[4].moe_norm_topk_always = true;

  rows[5] = make_row("Qwen2MoeForCausalLM", "qwen2_moe", kQwen2Moe, kQwenMoeWeights);
  rows[5].sliding = SlidingRule::even_below_max;
  rows[5].honours_layer_types = true;
  rows[5].moe = MoeRule::sparse_step;
  rows[5].shared_expert_gate = true;

  rows[6] = make_row("Qwen3MoeForCausalLM", "qwen3_moe", kQwen3Moe, kQwenMoeWeights);
  rows[6].qk_norm = true;
  rows[6].sliding = SlidingRule::all_layers;
  rows[6].moe = MoeRule::sparse_step;

  rows[7] = make_row("DeepseekV3ForCausalLM", "deepseek_v3", kDeepseekV3, kDeepseekV3Weights);
  rows[7].attention = sdk::AttentionKind::mla;
  rows[7].moe = MoeRule::first_k_dense;
  rows[7].moe_scoring = sdk::MoeScoring::sigmoid;
  rows[7].expert_score_bias = true;

  rows[8] = make_row("Gemma2ForCausalLM", "gemma2", kGemma2, kGemmaWeights);
  rows[8].gemma = true;
  rows[8].sandwich_norms = true;
  rows[8].sliding = SlidingRule::pattern;
  rows[8].honours_layer_types = true;

  rows[9] = make_row("Gemma3ForCausalLM", "gemma3_text", kGemma3, kGemmaWeights);
  rows[9].gemma = true;
  rows[9].sandwich_norms = true;
  rows[9].qk_norm = true;
  rows[9].local_rope = true;
  rows[9].sliding = SlidingRule::pattern;
  rows[9].honours_layer_types = true;
  return rows;
}();

}  // namespace

std::span<const HparamRow> common_hparams() { return kCommon; }

std::span<const ArchitectureRow> architecture_rows() { return kRows; }

const ArchitectureRow* find_architecture(std::string_view architecture) {
  for (const auto& r : kRows)
    if (r.architecture == architecture) return &r;
  return nullptr;
}

}  // namespace rlh::model
