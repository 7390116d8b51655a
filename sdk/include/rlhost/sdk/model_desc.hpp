// The transformer description a model plugin produces from a Hugging Face config.json and a
// backend executes: per-layer attention / MLP / norm settings, RoPE, and a parameter table that maps
// engine tensors to HF checkpoint tensors.
//
// Why a description and not code: a backend implements one decoder (norm -> attention -> residual
// -> norm -> MLP -> residual) with switches, and each architecture is a row of data (DESIGN.md,
// "Model -> backend"). The structs are plain values with defaults that mean "feature off", so a
// backend that reads only the fields it knows still computes the right thing for the models it
// claims to support, and one that meets a field it does not support (kind == mla, moe) refuses.
//
// Crossing the C ABI: to_json / from_json (nlohmann) give a JSON document with a schema_version.
// Enums travel by name. from_json refuses a newer schema_version than it knows.
//
// Link rlh_model_desc for the JSON functions and the RoPE frequency functions.
//
// Decoder, as every backend must compute it for a layer (pre-norm, as in HF Llama):
//   h   = x + post_attn_norm(o_proj(attention(attn_norm(x))))
//   out = h + post_mlp_norm(mlp(mlp_norm(h)))
// (the post norms only where the layer has them: Gemma-2/3's sandwich norms), starting from
// x_0 = embedding(ids) * embedding_scale, and at the end: logits = lm_head(final_norm(out))
// (lm_head = embedding when tied). Executors do not read this directly: sdk/layer_program.hpp
// derives the ops, weights and shapes once from the description.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "rlhost/sdk/safetensors_dtype.hpp"

namespace rlh::sdk {

// Bumped when a field changes meaning or a required field is added. Adding an optional field
// with a "feature off" default does not bump it.
inline constexpr int kModelDescSchemaVersion = 1;

// ---------------------------------------------------------------------------------------------
// Norms

enum class NormKind {
  rmsnorm,    // y = x / sqrt(mean(x^2) + eps) * (weight + weight_offset); computed in float32 at least
  layernorm,  // not used by the Llama family; reserved
};

struct NormDesc {
  NormKind kind = NormKind::rmsnorm;
  double eps = 1e-6;          // config rms_norm_eps
  double weight_offset = 0.0;  // 0 for Llama/Qwen/Mistral; 1 for Gemma-style (1 + w) norms
};

// ---------------------------------------------------------------------------------------------
// RoPE

enum class RopeKind {
  none,      // no rotary embedding
  default_,  // "default": inv_freq[i] = theta^(-2i/dim)
  linear,    // positions divided by factor (equivalently inv_freq / factor)
  dynamic,   // dynamic NTK: theta grows with the sequence length beyond max_position_embeddings
  llama3,    // Llama 3.1 piecewise wavelength scaling
  yarn,      // YaRN (ramp between interpolation and extrapolation) + attention factor on cos/sin
  longrope,  // Phi-3 style: per-frequency short/long factors
};

// How the rotated dimensions of one head are paired.
enum class RopeLayout {
  half_split,   // Llama/HF "rotate_half": pairs (i, i + rot/2)
  interleaved,  // DeepSeek "rope_interleave": pairs (2i, 2i+1)
};

struct RopeDesc {
  RopeKind kind = RopeKind::default_;
  double theta = 10000.0;  // rope_theta
  double factor = 1.0;     // scaling factor (linear, dynamic, llama3, yarn, longrope)
  // The context the model was pretrained with (llama3, yarn, longrope, dynamic). 0 = not given;
  // describe() fills it from max_position_embeddings where HF falls back to that.
  int64_t original_max_position_embeddings = 0;
  int64_t max_position_embeddings = 0;  // config max_position_embeddings (dynamic, yarn, longrope)
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // yarn (HF _compute_yarn_parameters); unset optionals are HF's "None"
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  std::optional<double> attention_factor;  // explicit attention factor (yarn, longrope)
  bool truncate = true;  // yarn: floor/ceil the correction range (HF "truncate", default true)
  // longrope: one factor per frequency (dim/2 each)
  std::vector<double> short_factor;
  std::vector<double> long_factor;
  // Dimensions of each head that are rotated: head_dim * partial_rotary_factor, rounded down as HF
  // does (int()). For MLA it is qk_rope_head_dim. The remaining head dims pass through.
  int64_t rotary_dim = 0;
  double partial_rotary_factor = 1.0;
  RopeLayout layout = RopeLayout::half_split;
};

// Inverse frequencies (dim/2 values, dim = rotary_dim normally) exactly as HF modeling_rope_utils
// computes them, in double precision. For `dynamic`, this is the value at sequence lengths up to
// max_position_embeddings; use the seq_len overload beyond. Throws std::invalid_argument for an
// odd/non-positive dim or inconsistent parameters (e.g. longrope factor lists of the wrong size).
std::vector<double> rope_inv_freq(const RopeDesc& rope, int64_t dim);
// `dynamic` recomputes theta when seq_len > max_position_embeddings (HF dynamic_rope_update);
// `longrope` picks long_factor when seq_len > original_max_position_embeddings. Other kinds ignore
// seq_len.
std::vector<double> rope_inv_freq(const RopeDesc& rope, int64_t dim, int64_t seq_len);
// The factor HF multiplies cos and sin by (yarn, longrope; 1.0 for the others). Applying it to cos
// and sin scales the rotated part of q and k, so q.k on rotated dims gets its square.
double rope_attention_scaling(const RopeDesc& rope);

// ---------------------------------------------------------------------------------------------
// Attention

enum class AttentionKind {
  gqa,  // standard multi-head attention with grouped K/V (MHA when kv == heads, MQA when kv == 1)
  mla,  // DeepSeek multi-head latent attention (fields below; rlh_engine: sdk/engine/src/mla.cpp)
};

struct AttentionDesc {
  AttentionKind kind = AttentionKind::gqa;
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // key/value heads; divides num_heads
  int64_t head_dim = 0;      // per-head q/k/v width; may differ from hidden/heads (Qwen3)
  bool q_bias = false;       // q_proj has a bias (Qwen2; attention_bias)
  bool k_bias = false;
  bool v_bias = false;
  bool o_bias = false;  // o_proj bias (Llama attention_bias=true sets all four)
  // Qwen3 / Gemma-3: RMSNorm with a [head_dim] weight over each head of q and of k, after the
  // projection and before RoPE, using the model's norm eps and this weight offset (0 Qwen3,
  // 1 Gemma's (1 + w)).
  bool qk_norm = false;
  double qk_norm_weight_offset = 0.0;
  // 0 = full causal attention. W > 0: query i attends keys j with i - W < j <= i (HF sliding
  // window mask: W keys including itself).
  int64_t sliding_window = 0;
  // Multiplies q.k before softmax; describe() sets it (1/sqrt(head_dim) for gqa; for MLA
  // 1/sqrt(qk_nope+qk_rope) times the yarn mscale^2 as HF DeepseekV3Attention does).
  double softmax_scale = 0.0;
  bool use_rope = true;  // false for NoPE layers (none in the dense Llama family)
  // Gemma-2: scores become cap * tanh(scores / cap) before the softmax. 0 = off.
  double logit_softcapping = 0.0;
  // MLA (kind == mla). q_lora_rank 0 = q projected directly (no q_a/q_b).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t v_head_dim = 0;
};

// ---------------------------------------------------------------------------------------------
// MLP

enum class MlpKind {
  dense,  // down(act(gate(x)) * up(x))  (SwiGLU when act = silu)
  moe,    // routed experts of that form (+ optional shared expert)
};

enum class MoeScoring {
  softmax,  // probabilities = softmax(router logits) over all experts (Mixtral, Qwen-MoE)
  sigmoid,  // scores = sigmoid(router logits) (DeepSeek-V3)
};

struct MoeDesc {
  int64_t num_experts = 0;              // routed experts
  // Expert parallelism (expert_parallel.hpp): the routed experts this rank holds, a block of
  // num_experts (0: all of them). Not in the JSON form: a backend sets it on its local copy.
  int64_t num_local_experts = 0;
  int64_t top_k = 0;                    // experts per token
  int64_t expert_intermediate_size = 0;  // ffn width of one routed expert
  // Renormalise the top-k weights to sum to 1 (Mixtral always; Qwen-MoE/DeepSeek per config).
  bool norm_topk_prob = false;
  MoeScoring scoring = MoeScoring::softmax;
  // Shared expert(s): a dense MLP of this width applied to every token and added to the routed
  // output (DeepSeek: n_shared_experts * moe_intermediate_size; Qwen2-MoE:
  // shared_expert_intermediate_size). 0 = none.
  int64_t shared_expert_intermediate_size = 0;
  // Qwen2-MoE: the shared expert output is multiplied by sigmoid(shared_expert_gate(x)), a
  // Linear(hidden, 1).
  bool shared_expert_gate = false;
  // Group-limited routing (DeepSeek-V3): experts split into n_group groups; a group's score is
  // the sum of its top-2 (bias-corrected) scores; only the best topk_group groups are eligible.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;  // multiplies the routed weights
  // DeepSeek-V3: a per-expert bias added to the scores for selection only (the weights use the
  // unbiased scores). It is a buffer: not trained, zero gradient.
  bool e_score_correction_bias = false;
  bool router_bias = false;            // router Linear has a bias
  double router_aux_loss_coef = 0.0;   // config value; how it is applied is the backend's business
  // The router's matmul precision is the engine's choice (HF computes it in the model dtype,
  // DeepSeek in float32).
};

struct MlpDesc {
  MlpKind kind = MlpKind::dense;
  int64_t intermediate_size = 0;  // dense ffn width (kind == dense)
  std::string hidden_act = "silu";  // HF hidden_act ("silu", "gelu", "gelu_pytorch_tanh", ...)
  bool bias = false;                 // gate/up/down biases (Llama mlp_bias)
  MoeDesc moe;                       // kind == moe
};

// ---------------------------------------------------------------------------------------------
// Layers

struct LayerDesc {
  int64_t index = 0;
  NormDesc attn_norm;  // input_layernorm
  AttentionDesc attention;
  NormDesc mlp_norm;  // post_attention_layernorm (pre-MLP norm, despite HF's name)
  MlpDesc mlp;
  // Gemma-2/3 sandwich norms on the branch outputs before each residual add (HF
  // post_attention_layernorm and post_feedforward_layernorm there; mlp_norm is then
  // pre_feedforward_layernorm). Absent for the Llama family.
  std::optional<NormDesc> post_attn_norm;
  std::optional<NormDesc> post_mlp_norm;
  // This layer's RoPE when it differs from the model's (Gemma-3: sliding layers use
  // rope_local_base_freq with default RoPE). Absent: TransformerDesc::rope.
  std::optional<RopeDesc> rope;
};

// ---------------------------------------------------------------------------------------------
// Parameter table

// What a tensor is, so backends can key sharding plans and kernels by role and never by name.
enum class ParamRole {
  embed,        // [vocab, hidden]
  lm_head,      // [vocab, hidden]; absent when tie_word_embeddings
  final_norm,   // [hidden]
  attn_norm,    // [hidden]
  mlp_norm,     // [hidden]
  q,            // [heads*head_dim, hidden]
  k,            // [kv_heads*head_dim, hidden]
  v,            // [kv_heads*head_dim, hidden]
  o,            // [hidden, heads*head_dim]
  q_bias,       // [heads*head_dim]
  k_bias,       // [kv_heads*head_dim]
  v_bias,       // [kv_heads*head_dim]
  o_bias,       // [hidden]
  q_norm,       // [head_dim]
  k_norm,       // [head_dim]
  post_attn_norm,  // [hidden] Gemma-2/3
  post_mlp_norm,   // [hidden]
  gate,         // [ffn, hidden]
  up,           // [ffn, hidden]
  down,         // [hidden, ffn]
  gate_bias,    // [ffn]
  up_bias,      // [ffn]
  down_bias,    // [hidden]
  router,       // [experts, hidden]
  router_bias,  // [experts]
  expert_score_bias,   // [experts] DeepSeek e_score_correction_bias (buffer, not trained)
  expert_gate,         // [experts, moe_ffn, hidden] stacked
  expert_up,           // [experts, moe_ffn, hidden] stacked
  expert_down,         // [experts, hidden, moe_ffn] stacked
  shared_expert_gate_proj,  // [shared_ffn, hidden]
  shared_expert_up,         // [shared_ffn, hidden]
  shared_expert_down,       // [hidden, shared_ffn]
  shared_expert_gate,       // [1, hidden] Qwen2-MoE sigmoid gate on the shared expert
  // MLA
  q_a,        // [q_lora_rank, hidden]
  q_a_norm,   // [q_lora_rank]
  q_b,        // [heads*(nope+rope), q_lora_rank]
  kv_a,       // [kv_lora_rank + rope, hidden] (kv_a_proj_with_mqa)
  kv_a_norm,  // [kv_lora_rank]
  kv_b,       // [heads*(nope+v), kv_lora_rank]
  // A scalar head on the final-normed hidden state (HF *ForSequenceClassification /
  // *ForTokenClassification with num_labels 1: `score.weight`). Not in a model plugin's
  // description: a backend adds it when a model is loaded as a value model (reward model, critic).
  value_head,  // [1, hidden]
};

// How the HF tensors become the engine tensor (and, inverted, how saving splits it back).
enum class ParamTransform {
  none,    // exactly one HF tensor, same shape
  stack,   // HF tensors (same shape each) stacked along a new axis 0, in list order (experts)
  concat,  // HF tensors concatenated along `axis`, in list order (fused qkv, gate_up)
};

struct ParamDesc {
  std::string name;            // engine name (equals the HF name when transform == none)
  std::vector<int64_t> shape;  // engine shape, row-major
  // Dtype the checkpoint stores (all HF sources share it). describe() takes it from the config's
  // torch_dtype; loading a checkpoint may adopt the file's dtype per tensor so a save reproduces it.
  st::DType dtype = st::DType::F32;
  int64_t layer = -1;  // decoder layer, -1 for global tensors
  ParamRole role = ParamRole::embed;
  bool trainable = true;  // false for buffers stored in the checkpoint (e_score_correction_bias)
  // HF source tensors and their shapes (one entry per source).
  std::vector<std::string> hf_names;
  std::vector<std::vector<int64_t>> hf_shapes;
  ParamTransform transform = ParamTransform::none;
  int64_t axis = 0;  // concat axis
};

// ---------------------------------------------------------------------------------------------
// The whole model

struct TransformerDesc {
  int schema_version = kModelDescSchemaVersion;
  std::string architecture;  // "LlamaForCausalLM"
  std::string model_type;    // "llama"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;  // true: no lm_head parameter; logits use the embedding
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // config eos_token_id (an int or a list)
  std::optional<int64_t> pad_token_id;
  st::DType torch_dtype = st::DType::F32;  // config torch_dtype / dtype (checkpoint precision)
  double initializer_range = 0.02;
  NormDesc final_norm;
  RopeDesc rope;  // shared by every layer whose attention.use_rope is set (unless LayerDesc::rope)
  // Gemma: the embedding rows are multiplied by this (sqrt(hidden_size)), in the model's dtype.
  double embedding_scale = 1.0;
  // Gemma-2: logits become cap * tanh(logits / cap). 0 = off.
  double final_logit_softcapping = 0.0;
  std::vector<LayerDesc> layers;
  std::vector<ParamDesc> params;

  // Index into params by engine name; nullptr when absent.
  const ParamDesc* find_param(const std::string& name) const;
  // Index into params by (layer, role); nullptr when absent.
  const ParamDesc* find_param(int64_t layer, ParamRole role) const;
};

// ---------------------------------------------------------------------------------------------
// JSON (for the C ABI and for logs). Names of enum values are the enumerator names without a
// trailing underscore ("default", "half_split", "expert_gate").

const char* to_string(NormKind);
const char* to_string(RopeKind);
const char* to_string(RopeLayout);
const char* to_string(AttentionKind);
const char* to_string(MlpKind);
const char* to_string(MoeScoring);
const char* to_string(ParamRole);
const char* to_string(ParamTransform);

void to_json(nlohmann::json& j, const NormDesc& v);
void from_json(const nlohmann::json& j, NormDesc& v);
void to_json(nlohmann::json& j, const RopeDesc& v);
void from_json(const nlohmann::json& j, RopeDesc& v);
void to_json(nlohmann::json& j, const AttentionDesc& v);
void from_json(const nlohmann::json& j, AttentionDesc& v);
void to_json(nlohmann::json& j, const MoeDesc& v);
void from_json(const nlohmann::json& j, MoeDesc& v);
void to_json(nlohmann::json& j, const MlpDesc& v);
void from_json(const nlohmann::json& j, MlpDesc& v);
void to_json(nlohmann::json& j, const LayerDesc& v);
void from_json(const nlohmann::json& j, LayerDesc& v);
void to_json(nlohmann::json& j, const ParamDesc& v);
void from_json(const nlohmann::json& j, ParamDesc& v);
// Throws std::runtime_error for a schema_version newer than kModelDescSchemaVersion, an unknown
// enum name or a missing required field.
void to_json(nlohmann::json& j, const TransformerDesc& v);
void from_json(const nlohmann::json& j, TransformerDesc& v);

}  // namespace rlh::sdk
