// The parameter table: which tensors a description needs (decided by role from the layer
// settings), their shapes (from the description), and their HF names (from the row's patterns).
#include "parameter_table.hpp"

#include <stdexcept>
#include <string>

namespace rlh::model {

using sdk::MlpKind;
using sdk::ParamDesc;
using sdk::ParamRole;
using sdk::ParamTransform;

namespace {

// Parameter-table entries (HF tensors) above this are refused: far beyond real models (DeepSeek-V3
// has ~47k), and it keeps hostile configs from building enormous tables.
constexpr size_t kMaxHfTensors = size_t{1} << 20;

std::string substitute(std::string_view pattern, int64_t layer, int64_t expert) {
  std::string out(pattern);
  auto replace = [&](std::string_view key, int64_t v) {
    for (size_t pos; (pos = out.find(key)) != std::string::npos;) out.replace(pos, key.size(), std::to_string(v));
  };
  if (layer >= 0) replace("{i}", layer);
  if (expert >= 0) replace("{e}", expert);
  return out;
}

// Engine name of a stacked expert tensor: the pattern without its ".{e}" component.
std::string stacked_name(std::string_view pattern, int64_t layer) {
  std::string p(pattern);
  if (auto pos = p.find(".{e}"); pos != std::string::npos) p.erase(pos, 4);
  return substitute(p, layer, -1);
}

int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) throw std::runtime_error("config: a parameter shape overflows int64");
  return n;
}

class TableBuilder {
 public:
  TableBuilder(const sdk::TransformerDesc& d, const ArchitectureRow& row) : d_(d), row_(row) {}

  std::string_view pattern(ParamRole role) const {
    for (const auto& w : row_.weights)
      if (w.role == role) return w.pattern;
    throw std::logic_error("architecture table " + std::string(row_.architecture) +
                           " has no weight name for role " + sdk::to_string(role));
  }

  // One HF tensor -> one engine tensor of the same shape and name.
  void plain(ParamRole role, int64_t layer, std::vector<int64_t> shape, bool trainable = true) {
    ParamDesc p;
    p.name = substitute(pattern(role), layer, -1);
    p.shape = shape;
    p.dtype = d_.torch_dtype;
    p.layer = layer;
    p.role = role;
    p.trainable = trainable;
    p.hf_names = {p.name};
    p.hf_shapes = {std::move(shape)};
    p.transform = ParamTransform::none;
    add(std::move(p));
  }

  // E per-expert HF tensors of `expert_shape` -> one [E, ...] engine tensor.
  void stacked(ParamRole role, int64_t layer, int64_t experts, const std::vector<int64_t>& expert_shape) {
    ParamDesc p;
    const std::string_view pat = pattern(role);
    if (pat.find("{e}") == std::string_view::npos)
      throw std::logic_error("architecture table " + std::string(row_.architecture) +
                             ": expert pattern without {e} for role " + sdk::to_string(role));
    p.name = stacked_name(pat, layer);
    p.shape = {experts};
    p.shape.insert(p.shape.end(), expert_shape.begin(), expert_shape.end());
    p.dtype = d_.torch_dtype;
    p.layer = layer;
    p.role = role;
    p.transform = ParamTransform::stack;
    for (int64_t e = 0; e < experts; ++e) {
      p.hf_names.push_back(substitute(pat, layer, e));
      p.hf_shapes.push_back(expert_shape);
    }
    add(std::move(p));
  }

  std::vector<ParamDesc> take() { return std::move(params_); }

 private:
  void add(ParamDesc p) {
    checked_numel(p.shape);
    hf_count_ += p.hf_names.size();
    if (hf_count_ > kMaxHfTensors) throw std::runtime_error("config: the model would have too many tensors");
    params_.push_back(std::move(p));
  }

  const sdk::TransformerDesc& d_;
  const ArchitectureRow& row_;
  std::vector<ParamDesc> params_;
  size_t hf_count_ = 0;
};

}  // namespace

std::vector<ParamDesc> build_parameter_table(const sdk::TransformerDesc& d, const ArchitectureRow& row) {
  // Refuse before building: a hostile config must not make us allocate millions of names.
  size_t estimate = 3;
  for (const auto& L : d.layers)
    estimate += 16 + (L.mlp.kind == MlpKind::moe ? 3 * static_cast<size_t>(L.mlp.moe.num_experts) : 0);
  if (estimate > kMaxHfTensors) throw std::runtime_error("config: the model would have too many tensors");

  TableBuilder t(d, row);
  const int64_t D = d.hidden_size;
  const int64_t V = d.vocab_size;
  t.plain(ParamRole::embed, -1, {V, D});
  for (const auto& L : d.layers) {
    const int64_t i = L.index;
    const auto& a = L.attention;
    t.plain(ParamRole::attn_norm, i, {D});
    if (a.kind == sdk::AttentionKind::gqa) {
      const int64_t q_out = a.num_heads * a.head_dim;
      const int64_t kv_out = a.num_kv_heads * a.head_dim;
      t.plain(ParamRole::q, i, {q_out, D});
      if (a.q_bias) t.plain(ParamRole::q_bias, i, {q_out});
      t.plain(ParamRole::k, i, {kv_out, D});
      if (a.k_bias) t.plain(ParamRole::k_bias, i, {kv_out});
      t.plain(ParamRole::v, i, {kv_out, D});
      if (a.v_bias) t.plain(ParamRole::v_bias, i, {kv_out});
      t.plain(ParamRole::o, i, {D, q_out});
      if (a.o_bias) t.plain(ParamRole::o_bias, i, {D});
      if (a.qk_norm) {
        t.plain(ParamRole::q_norm, i, {a.head_dim});
        t.plain(ParamRole::k_norm, i, {a.head_dim});
      }
    } else {
      const int64_t qk = a.qk_nope_head_dim + a.qk_rope_head_dim;
      if (a.q_lora_rank > 0) {
        t.plain(ParamRole::q_a, i, {a.q_lora_rank, D});
        t.plain(ParamRole::q_a_norm, i, {a.q_lora_rank});
        t.plain(ParamRole::q_b, i, {a.num_heads * qk, a.q_lora_rank});
      } else {
        t.plain(ParamRole::q, i, {a.num_heads * qk, D});
      }
      t.plain(ParamRole::kv_a, i, {a.kv_lora_rank + a.qk_rope_head_dim, D});
      t.plain(ParamRole::kv_a_norm, i, {a.kv_lora_rank});
      t.plain(ParamRole::kv_b, i, {a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank});
      t.plain(ParamRole::o, i, {D, a.num_heads * a.v_head_dim});
    }
    if (L.post_attn_norm) t.plain(ParamRole::post_attn_norm, i, {D});
    t.plain(ParamRole::mlp_norm, i, {D});
    const auto& m = L.mlp;
    if (m.kind == MlpKind::dense) {
      const int64_t F = m.intermediate_size;
      t.plain(ParamRole::gate, i, {F, D});
      if (m.bias) t.plain(ParamRole::gate_bias, i, {F});
      t.plain(ParamRole::up, i, {F, D});
      if (m.bias) t.plain(ParamRole::up_bias, i, {F});
      t.plain(ParamRole::down, i, {D, F});
      if (m.bias) t.plain(ParamRole::down_bias, i, {D});
      if (L.post_mlp_norm) t.plain(ParamRole::post_mlp_norm, i, {D});
    } else {
      const auto& e = m.moe;
      const int64_t E = e.num_experts, Fm = e.expert_intermediate_size;
      t.plain(ParamRole::router, i, {E, D});
      if (e.e_score_correction_bias) t.plain(ParamRole::expert_score_bias, i, {E}, /*trainable=*/false);
      t.stacked(ParamRole::expert_gate, i, E, {Fm, D});
      t.stacked(ParamRole::expert_up, i, E, {Fm, D});
      t.stacked(ParamRole::expert_down, i, E, {D, Fm});
      if (e.shared_expert_intermediate_size > 0) {
        const int64_t Fs = e.shared_expert_intermediate_size;
        t.plain(ParamRole::shared_expert_gate_proj, i, {Fs, D});
        t.plain(ParamRole::shared_expert_up, i, {Fs, D});
        t.plain(ParamRole::shared_expert_down, i, {D, Fs});
        if (e.shared_expert_gate) t.plain(ParamRole::shared_expert_gate, i, {1, D});
      }
    }
  }
  t.plain(ParamRole::final_norm, -1, {D});
  if (!d.tie_word_embeddings) t.plain(ParamRole::lm_head, -1, {V, D});
  return t.take();
}

}  // namespace rlh::model
