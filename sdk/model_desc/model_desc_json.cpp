// JSON form of the transformer description (model_desc.hpp): how it crosses the C ABI.
//
// Every enum travels by name so a reader built against an older enum fails loudly on a value it
// does not know instead of misreading a number. Fields with "feature off" defaults are optional on
// read, so documents written before an optional field was added still load.
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "rlhost/sdk/model_desc.hpp"

namespace rlh::sdk {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// enum <-> name tables

namespace {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

constexpr EnumName<NormKind> kNormKinds[] = {{NormKind::rmsnorm, "rmsnorm"},
                                             {NormKind::layernorm, "layernorm"}};
constexpr EnumName<RopeKind> kRopeKinds[] = {
    {RopeKind::none, "none"},     {RopeKind::default_, "default"}, {RopeKind::linear, "linear"},
    {RopeKind::dynamic, "dynamic"}, {RopeKind::llama3, "llama3"},  {RopeKind::yarn, "yarn"},
    {RopeKind::longrope, "longrope"}};
constexpr EnumName<RopeLayout> kRopeLayouts[] = {{RopeLayout::half_split, "half_split"},
                                                 {RopeLayout::interleaved, "interleaved"}};
constexpr EnumName<AttentionKind> kAttentionKinds[] = {{AttentionKind::gqa, "gqa"},
                                                       {AttentionKind::mla, "mla"}};
constexpr EnumName<MlpKind> kMlpKinds[] = {{MlpKind::dense, "dense"}, {MlpKind::moe, "moe"}};
constexpr EnumName<MoeScoring> kMoeScorings[] = {{MoeScoring::softmax, "softmax"},
                                                 {MoeScoring::sigmoid, "sigmoid"}};
constexpr EnumName<ParamTransform> kTransforms[] = {{ParamTransform::none, "none"},
                                                    {ParamTransform::stack, "stack"},
                                                    {ParamTransform::concat, "concat"}};
constexpr EnumName<ParamRole> kRoles[] = {
    {ParamRole::embed, "embed"},
    {ParamRole::lm_head, "lm_head"},
    {ParamRole::final_norm, "final_norm"},
    {ParamRole::attn_norm, "attn_norm"},
    {ParamRole::mlp_norm, "mlp_norm"},
    {ParamRole::q, "q"},
    {ParamRole::k, "k"},
    {ParamRole::v, "v"},
    {ParamRole::o, "o"},
    {ParamRole::q_bias, "q_bias"},
    {ParamRole::k_bias, "k_bias"},
    {ParamRole::v_bias, "v_bias"},
    {ParamRole::o_bias, "o_bias"},
    {ParamRole::q_norm, "q_norm"},
    {ParamRole::k_norm, "k_norm"},
    {ParamRole::post_attn_norm, "post_attn_norm"},
    {ParamRole::post_mlp_norm, "post_mlp_norm"},
    {ParamRole::gate, "gate"},
    {ParamRole::up, "up"},
    {ParamRole::down, "down"},
    {ParamRole::gate_bias, "gate_bias"},
    {ParamRole::up_bias, "up_bias"},
    {ParamRole::down_bias, "down_bias"},
    {ParamRole::router, "router"},
    {ParamRole::router_bias, "router_bias"},
    {ParamRole::expert_score_bias, "expert_score_bias"},
    {ParamRole::expert_gate, "expert_gate"},
    {ParamRole::expert_up, "expert_up"},
    {ParamRole::expert_down, "expert_down"},
    {ParamRole::shared_expert_gate_proj, "shared_expert_gate_proj"},
    {ParamRole::shared_expert_up, "shared_expert_up"},
    {ParamRole::shared_expert_down, "shared_expert_down"},
    {ParamRole::shared_expert_gate, "shared_expert_gate"},
    {ParamRole::q_a, "q_a"},
    {ParamRole::q_a_norm, "q_a_norm"},
    {ParamRole::q_b, "q_b"},
    {ParamRole::kv_a, "kv_a"},
    {ParamRole::kv_a_norm, "kv_a_norm"},
    {ParamRole::kv_b, "kv_b"},
    {ParamRole::value_head, "value_head"},
};

template <class E, size_t N>
const char* name_of(const EnumName<E> (&table)[N], E v) {
  for (const auto& row : table)
    if (row.value == v) return row.name;
  return "?";
}

template <class E, size_t N>
E parse_enum(const EnumName<E> (&table)[N], const json& j, const char* what) {
  if (!j.is_string())
    throw std::runtime_error(std::string("model description: ") + what + " must be a string");
  const auto& s = j.get_ref<const std::string&>();
  for (const auto& row : table)
    if (s == row.name) return row.value;
  throw std::runtime_error(std::string("model description: unknown ") + what + " '" + s + "'");
}

// Required field: a clear error naming the key instead of nlohmann's generic message.
const json& req(const json& j, const char* key) {
  if (!j.is_object())
    throw std::runtime_error(std::string("model description: expected an object holding '") + key +
                             "'");
  auto it = j.find(key);
  if (it == j.end())
    throw std::runtime_error(std::string("model description: missing field '") + key + "'");
  return *it;
}

template <class T>
void opt(const json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it != j.end() && !it->is_null()) it->get_to(out);
}

void opt_double(const json& j, const char* key, std::optional<double>& out) {
  auto it = j.find(key);
  if (it != j.end() && !it->is_null())
    out = it->get<double>();
  else
    out.reset();
}

void put_opt(json& j, const char* key, const std::optional<double>& v) {
  j[key] = v ? json(*v) : json(nullptr);
}

}  // namespace

const char* to_string(NormKind v) { return name_of(kNormKinds, v); }
const char* to_string(RopeKind v) { return name_of(kRopeKinds, v); }
const char* to_string(RopeLayout v) { return name_of(kRopeLayouts, v); }
const char* to_string(AttentionKind v) { return name_of(kAttentionKinds, v); }
const char* to_string(MlpKind v) { return name_of(kMlpKinds, v); }
const char* to_string(MoeScoring v) { return name_of(kMoeScorings, v); }
const char* to_string(ParamRole v) { return name_of(kRoles, v); }
const char* to_string(ParamTransform v) { return name_of(kTransforms, v); }

// ---------------------------------------------------------------------------------------------
// structs

void to_json(json& j, const NormDesc& v) {
  j = json{{"kind", to_string(v.kind)}, {"eps", v.eps}, {"weight_offset", v.weight_offset}};
}
void from_json(const json& j, NormDesc& v) {
  v = NormDesc{};
  v.kind = parse_enum(kNormKinds, req(j, "kind"), "norm kind");
  req(j, "eps").get_to(v.eps);
  opt(j, "weight_offset", v.weight_offset);
}

void to_json(json& j, const RopeDesc& v) {
  j = json{{"kind", to_string(v.kind)},
           {"theta", v.theta},
           {"factor", v.factor},
           {"original_max_position_embeddings", v.original_max_position_embeddings},
           {"max_position_embeddings", v.max_position_embeddings},
           {"low_freq_factor", v.low_freq_factor},
           {"high_freq_factor", v.high_freq_factor},
           {"beta_fast", v.beta_fast},
           {"beta_slow", v.beta_slow},
           {"truncate", v.truncate},
           {"short_factor", v.short_factor},
           {"long_factor", v.long_factor},
           {"rotary_dim", v.rotary_dim},
           {"partial_rotary_factor", v.partial_rotary_factor},
           {"layout", to_string(v.layout)}};
  put_opt(j, "mscale", v.mscale);
  put_opt(j, "mscale_all_dim", v.mscale_all_dim);
  put_opt(j, "attention_factor", v.attention_factor);
}
void from_json(const json& j, RopeDesc& v) {
  v = RopeDesc{};
  v.kind = parse_enum(kRopeKinds, req(j, "kind"), "rope kind");
  req(j, "theta").get_to(v.theta);
  opt(j, "factor", v.factor);
  opt(j, "original_max_position_embeddings", v.original_max_position_embeddings);
  opt(j, "max_position_embeddings", v.max_position_embeddings);
  opt(j, "low_freq_factor", v.low_freq_factor);
  opt(j, "high_freq_factor", v.high_freq_factor);
  opt(j, "beta_fast", v.beta_fast);
  opt(j, "beta_slow", v.beta_slow);
  opt_double(j, "mscale", v.mscale);
  opt_double(j, "mscale_all_dim", v.mscale_all_dim);
  opt_double(j, "attention_factor", v.attention_factor);
  opt(j, "truncate", v.truncate);
  opt(j, "short_factor", v.short_factor);
  opt(j, "long_factor", v.long_factor);
  req(j, "rotary_dim").get_to(v.rotary_dim);
  opt(j, "partial_rotary_factor", v.partial_rotary_factor);
  if (auto it = j.find("layout"); it != j.end()) v.layout = parse_enum(kRopeLayouts, *it, "rope layout");
}

void to_json(json& j, const AttentionDesc& v) {
  j = json{{"kind", to_string(v.kind)},
           {"num_heads", v.num_heads},
           {"num_kv_heads", v.num_kv_heads},
           {"head_dim", v.head_dim},
           {"q_bias", v.q_bias},
           {"k_bias", v.k_bias},
           {"v_bias", v.v_bias},
           {"o_bias", v.o_bias},
           {"qk_norm", v.qk_norm},
           {"qk_norm_weight_offset", v.qk_norm_weight_offset},
           {"logit_softcapping", v.logit_softcapping},
           {"sliding_window", v.sliding_window},
           {"softmax_scale", v.softmax_scale},
           {"use_rope", v.use_rope},
           {"q_lora_rank", v.q_lora_rank},
           {"kv_lora_rank", v.kv_lora_rank},
           {"qk_rope_head_dim", v.qk_rope_head_dim},
           {"qk_nope_head_dim", v.qk_nope_head_dim},
           {"v_head_dim", v.v_head_dim}};
}
void from_json(const json& j, AttentionDesc& v) {
  v = AttentionDesc{};
  v.kind = parse_enum(kAttentionKinds, req(j, "kind"), "attention kind");
  req(j, "num_heads").get_to(v.num_heads);
  req(j, "num_kv_heads").get_to(v.num_kv_heads);
  req(j, "head_dim").get_to(v.head_dim);
  opt(j, "q_bias", v.q_bias);
  opt(j, "k_bias", v.k_bias);
  opt(j, "v_bias", v.v_bias);
  opt(j, "o_bias", v.o_bias);
  opt(j, "qk_norm", v.qk_norm);
  opt(j, "qk_norm_weight_offset", v.qk_norm_weight_offset);
  opt(j, "logit_softcapping", v.logit_softcapping);
  opt(j, "sliding_window", v.sliding_window);
  req(j, "softmax_scale").get_to(v.softmax_scale);
  opt(j, "use_rope", v.use_rope);
  opt(j, "q_lora_rank", v.q_lora_rank);
  opt(j, "kv_lora_rank", v.kv_lora_rank);
  opt(j, "qk_rope_head_dim", v.qk_rope_head_dim);
  opt(j, "qk_nope_head_dim", v.qk_nope_head_dim);
  opt(j, "v_head_dim", v.v_head_dim);
}

void to_json(json& j, const MoeDesc& v) {
  j = json{{"num_experts", v.num_experts},
           {"top_k", v.top_k},
           {"expert_intermediate_size", v.expert_intermediate_size},
           {"norm_topk_prob", v.norm_topk_prob},
           {"scoring", to_string(v.scoring)},
           {"shared_expert_intermediate_size", v.shared_expert_intermediate_size},
           {"shared_expert_gate", v.shared_expert_gate},
           {"n_group", v.n_group},
           {"topk_group", v.topk_group},
           {"routed_scaling_factor", v.routed_scaling_factor},
           {"e_score_correction_bias", v.e_score_correction_bias},
           {"router_bias", v.router_bias},
           {"router_aux_loss_coef", v.router_aux_loss_coef}};
}
void from_json(const json& j, MoeDesc& v) {
  v = MoeDesc{};
  req(j, "num_experts").get_to(v.num_experts);
  req(j, "top_k").get_to(v.top_k);
  req(j, "expert_intermediate_size").get_to(v.expert_intermediate_size);
  opt(j, "norm_topk_prob", v.norm_topk_prob);
  if (auto it = j.find("scoring"); it != j.end())
    v.scoring = parse_enum(kMoeScorings, *it, "moe scoring");
  opt(j, "shared_expert_intermediate_size", v.shared_expert_intermediate_size);
  opt(j, "shared_expert_gate", v.shared_expert_gate);
  opt(j, "n_group", v.n_group);
  opt(j, "topk_group", v.topk_group);
  opt(j, "routed_scaling_factor", v.routed_scaling_factor);
  opt(j, "e_score_correction_bias", v.e_score_correction_bias);
  opt(j, "router_bias", v.router_bias);
  opt(j, "router_aux_loss_coef", v.router_aux_loss_coef);
}

void to_json(json& j, const MlpDesc& v) {
  j = json{{"kind", to_string(v.kind)},
           {"intermediate_size", v.intermediate_size},
           {"hidden_act", v.hidden_act},
           {"bias", v.bias}};
  if (v.kind == MlpKind::moe) j["moe"] = v.moe;
}
void from_json(const json& j, MlpDesc& v) {
  v = MlpDesc{};
  v.kind = parse_enum(kMlpKinds, req(j, "kind"), "mlp kind");
  opt(j, "intermediate_size", v.intermediate_size);
  opt(j, "hidden_act", v.hidden_act);
  opt(j, "bias", v.bias);
  if (v.kind == MlpKind::moe) req(j, "moe").get_to(v.moe);
}

void to_json(json& j, const LayerDesc& v) {
  j = json{{"index", v.index},
           {"attn_norm", v.attn_norm},
           {"attention", v.attention},
           {"mlp_norm", v.mlp_norm},
           {"mlp", v.mlp}};
  if (v.post_attn_norm) j["post_attn_norm"] = *v.post_attn_norm;
  if (v.post_mlp_norm) j["post_mlp_norm"] = *v.post_mlp_norm;
  if (v.rope) j["rope"] = *v.rope;
}
void from_json(const json& j, LayerDesc& v) {
  v = LayerDesc{};
  req(j, "index").get_to(v.index);
  req(j, "attn_norm").get_to(v.attn_norm);
  req(j, "attention").get_to(v.attention);
  req(j, "mlp_norm").get_to(v.mlp_norm);
  req(j, "mlp").get_to(v.mlp);
  if (auto it = j.find("post_attn_norm"); it != j.end() && !it->is_null()) v.post_attn_norm = it->get<NormDesc>();
  if (auto it = j.find("post_mlp_norm"); it != j.end() && !it->is_null()) v.post_mlp_norm = it->get<NormDesc>();
  if (auto it = j.find("rope"); it != j.end() && !it->is_null()) v.rope = it->get<RopeDesc>();
}

void to_json(json& j, const ParamDesc& v) {
  j = json{{"name", v.name},
           {"shape", v.shape},
           {"dtype", std::string(st::dtype_name(v.dtype))},
           {"layer", v.layer},
           {"role", to_string(v.role)},
           {"trainable", v.trainable},
           {"hf_names", v.hf_names},
           {"hf_shapes", v.hf_shapes},
           {"transform", to_string(v.transform)},
           {"axis", v.axis}};
}
void from_json(const json& j, ParamDesc& v) {
  v = ParamDesc{};
  req(j, "name").get_to(v.name);
  req(j, "shape").get_to(v.shape);
  const auto dt = req(j, "dtype").get<std::string>();
  auto parsed = st::dtype_from_name(dt);
  if (!parsed)
    throw std::runtime_error("model description: parameter '" + v.name + "' has unknown dtype '" +
                             dt + "'");
  v.dtype = *parsed;
  req(j, "layer").get_to(v.layer);
  v.role = parse_enum(kRoles, req(j, "role"), "parameter role");
  opt(j, "trainable", v.trainable);
  req(j, "hf_names").get_to(v.hf_names);
  req(j, "hf_shapes").get_to(v.hf_shapes);
  if (auto it = j.find("transform"); it != j.end())
    v.transform = parse_enum(kTransforms, *it, "parameter transform");
  opt(j, "axis", v.axis);
  if (v.hf_names.size() != v.hf_shapes.size())
    throw std::runtime_error("model description: parameter '" + v.name +
                             "' has hf_names and hf_shapes of different lengths");
}

void to_json(json& j, const TransformerDesc& v) {
  j = json{{"schema_version", v.schema_version},
           {"architecture", v.architecture},
           {"model_type", v.model_type},
           {"vocab_size", v.vocab_size},
           {"hidden_size", v.hidden_size},
           {"num_layers", v.num_layers},
           {"max_position_embeddings", v.max_position_embeddings},
           {"rms_norm_eps", v.rms_norm_eps},
           {"tie_word_embeddings", v.tie_word_embeddings},
           {"bos_token_id", v.bos_token_id ? json(*v.bos_token_id) : json(nullptr)},
           {"eos_token_ids", v.eos_token_ids},
           {"pad_token_id", v.pad_token_id ? json(*v.pad_token_id) : json(nullptr)},
           {"torch_dtype", std::string(st::dtype_name(v.torch_dtype))},
           {"initializer_range", v.initializer_range},
           {"final_norm", v.final_norm},
           {"rope", v.rope},
           {"embedding_scale", v.embedding_scale},
           {"final_logit_softcapping", v.final_logit_softcapping},
           {"layers", v.layers},
           {"params", v.params}};
}
void from_json(const json& j, TransformerDesc& v) {
  v = TransformerDesc{};
  const int version = req(j, "schema_version").get<int>();
  if (version > kModelDescSchemaVersion || version < 1)
    throw std::runtime_error("model description: schema_version " + std::to_string(version) +
                             " is not supported (this build reads up to " +
                             std::to_string(kModelDescSchemaVersion) + ")");
  v.schema_version = version;
  req(j, "architecture").get_to(v.architecture);
  opt(j, "model_type", v.model_type);
  req(j, "vocab_size").get_to(v.vocab_size);
  req(j, "hidden_size").get_to(v.hidden_size);
  req(j, "num_layers").get_to(v.num_layers);
  opt(j, "max_position_embeddings", v.max_position_embeddings);
  opt(j, "rms_norm_eps", v.rms_norm_eps);
  opt(j, "tie_word_embeddings", v.tie_word_embeddings);
  if (auto it = j.find("bos_token_id"); it != j.end() && !it->is_null())
    v.bos_token_id = it->get<int64_t>();
  opt(j, "eos_token_ids", v.eos_token_ids);
  if (auto it = j.find("pad_token_id"); it != j.end() && !it->is_null())
    v.pad_token_id = it->get<int64_t>();
  if (auto it = j.find("torch_dtype"); it != j.end()) {
    const auto s = it->get<std::string>();
    auto parsed = st::dtype_from_name(s);
    if (!parsed) throw std::runtime_error("model description: unknown torch_dtype '" + s + "'");
    v.torch_dtype = *parsed;
  }
  opt(j, "initializer_range", v.initializer_range);
  req(j, "final_norm").get_to(v.final_norm);
  req(j, "rope").get_to(v.rope);
  opt(j, "embedding_scale", v.embedding_scale);
  opt(j, "final_logit_softcapping", v.final_logit_softcapping);
  req(j, "layers").get_to(v.layers);
  req(j, "params").get_to(v.params);
  if (static_cast<int64_t>(v.layers.size()) != v.num_layers)
    throw std::runtime_error("model description: num_layers " + std::to_string(v.num_layers) +
                             " but " + std::to_string(v.layers.size()) + " layer entries");
}

// ---------------------------------------------------------------------------------------------
// lookups

const ParamDesc* TransformerDesc::find_param(const std::string& name) const {
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

const ParamDesc* TransformerDesc::find_param(int64_t layer, ParamRole role) const {
  for (const auto& p : params)
    if (p.layer == layer && p.role == role) return &p;
  return nullptr;
}

}  // namespace rlh::sdk
