// Tensor parallelism's plan, this rank's description, slicing of full tensors and the pass that
// marks a program's communication (tensor_parallel.hpp).
#include "rlhost/sdk/tensor_parallel.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace rlh::sdk {

const char* to_string(TpSplit s) {
  switch (s) {
    case TpSplit::replicated: return "replicated";
    case TpSplit::replicated_sum: return "replicated_sum";
    case TpSplit::rows: return "rows";
    case TpSplit::cols: return "cols";
    case TpSplit::kv_rows: return "kv_rows";
    case TpSplit::vocab_rows: return "vocab_rows";
  }
  return "?";
}

namespace {

// Megatron's layout of a dense decoder: ColumnParallelLinear for linear_qkv and linear_fc1,
// RowParallelLinear for linear_proj and linear_fc2, VocabParallelEmbedding, and a
// vocabulary-parallel output layer; norms replicated.
constexpr TpRule kPlan[] = {
    {ParamRole::embed, TpSplit::vocab_rows},
    {ParamRole::lm_head, TpSplit::vocab_rows},
    {ParamRole::final_norm, TpSplit::replicated},
    {ParamRole::attn_norm, TpSplit::replicated},
    {ParamRole::mlp_norm, TpSplit::replicated},
    {ParamRole::post_attn_norm, TpSplit::replicated},
    {ParamRole::post_mlp_norm, TpSplit::replicated},
    {ParamRole::q, TpSplit::rows},
    {ParamRole::k, TpSplit::kv_rows},
    {ParamRole::v, TpSplit::kv_rows},
    {ParamRole::o, TpSplit::cols},
    {ParamRole::q_norm, TpSplit::replicated_sum},
    {ParamRole::k_norm, TpSplit::replicated_sum},
    {ParamRole::gate, TpSplit::rows},
    {ParamRole::up, TpSplit::rows},
    {ParamRole::down, TpSplit::cols},
};

const TpRule* rule_of(ParamRole role) {
  for (const TpRule& r : kPlan)
    if (r.role == role) return &r;
  return nullptr;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

}  // namespace

std::span<const TpRule> tp_plan() { return kPlan; }

std::string tp_unsupported(const TransformerDesc& d, int64_t T, const std::string& key) {
  const std::string at = key + " = " + std::to_string(T) + ": ";
  if (T < 1) return at + "must be at least 1";
  if (T == 1) return {};
  if (d.final_logit_softcapping != 0)
    return at + "final_logit_softcapping is not supported under tensor parallelism";
  for (const LayerDesc& l : d.layers) {
    const std::string in = at + "layer " + std::to_string(l.index) + ": ";
    const AttentionDesc& a = l.attention;
    if (a.kind == AttentionKind::mla)
      return in + "multi-head latent attention (MLA) is not supported under tensor parallelism";
    if (l.mlp.kind == MlpKind::moe)
      return in + "mixture-of-experts layers are not supported under tensor parallelism";
    if (a.q_bias || a.k_bias || a.v_bias || a.o_bias)
      return in + "attention biases (attention_bias) are not supported under tensor parallelism";
    if (l.mlp.bias) return in + "MLP biases (mlp_bias) are not supported under tensor parallelism";
    if (a.sliding_window > 0)
      return in + "sliding_window attention is not supported under tensor parallelism";
    if (a.logit_softcapping != 0)
      return in + "attn_logit_softcapping is not supported under tensor parallelism";
    if (a.num_heads % T != 0)
      return in + "num_attention_heads = " + std::to_string(a.num_heads) + " is not a multiple of " +
             std::to_string(T);
    const int64_t kv = a.num_kv_heads;
    if (kv <= 0 || (kv >= T ? kv % T != 0 : T % kv != 0))
      return in + "num_key_value_heads = " + std::to_string(kv) + " neither divides nor is a multiple of " +
             std::to_string(T);
    if (l.mlp.intermediate_size % T != 0)
      return in + "intermediate_size = " + std::to_string(l.mlp.intermediate_size) + " is not a multiple of " +
             std::to_string(T);
  }
  for (const ParamDesc& p : d.params)
    if (rule_of(p.role) == nullptr)
      return at + "parameter " + p.name + " (role " + to_string(p.role) +
             ") has no tensor-parallel rule (value heads are not supported under tensor parallelism)";
  return {};
}

TpLayout make_tp_layout(const TransformerDesc& d, int64_t T, int64_t r, const std::string& key) {
  if (const std::string why = tp_unsupported(d, T, key); !why.empty()) throw std::invalid_argument(why);
  if (r < 0 || r >= T) throw std::invalid_argument("tensor-parallel rank " + std::to_string(r) + " outside 0.." + std::to_string(T - 1));
  TpLayout L;
  L.size = T;
  L.rank = r;
  L.full = d;
  L.local = d;
  L.vocab = d.vocab_size;
  L.vocab_block = (d.vocab_size + T - 1) / T;
  L.vocab_begin = std::min(d.vocab_size, r * L.vocab_block);
  L.vocab_count = std::min(d.vocab_size, (r + 1) * L.vocab_block) - L.vocab_begin;
  L.local.vocab_size = L.vocab_block;
  for (LayerDesc& l : L.local.layers) {
    AttentionDesc& a = l.attention;
    a.num_heads /= T;
    a.num_kv_heads = a.num_kv_heads >= T ? a.num_kv_heads / T : 1;
    l.mlp.intermediate_size /= T;
  }
  const double inv_t = 1.0 / double(T);
  for (size_t i = 0; i < d.params.size(); ++i) {
    const ParamDesc& p = d.params[i];
    TpPiece pc;
    pc.split = rule_of(p.role)->split;
    pc.full = p.shape[0];
    pc.begin = 0;
    pc.count = pc.extent = pc.full;
    switch (pc.split) {
      case TpSplit::replicated:
        pc.norm_weight = inv_t;
        break;
      case TpSplit::replicated_sum:
        pc.norm_weight = inv_t;
        pc.sum_grads = true;
        break;
      case TpSplit::rows:
        pc.count = pc.extent = pc.full / T;
        pc.begin = r * pc.count;
        break;
      case TpSplit::cols:
        pc.axis = 1;
        pc.full = p.shape[1];
        pc.count = pc.extent = pc.full / T;
        pc.begin = r * pc.count;
        break;
      case TpSplit::kv_rows: {
        const LayerDesc& l = d.layers[size_t(p.layer)];
        const int64_t kv = l.attention.num_kv_heads, D = l.attention.head_dim;
        if (kv >= T) {
          pc.count = pc.extent = pc.full / T;
          pc.begin = r * pc.count;
        } else {  // rank r's query heads read kv head r / (T / kv): replicated there
          pc.count = pc.extent = D;
          pc.begin = (r / (T / kv)) * D;
          pc.norm_weight = double(kv) / double(T);
          pc.sum_grads = true;
        }
        break;
      }
      case TpSplit::vocab_rows:
        pc.begin = L.vocab_begin;
        pc.count = L.vocab_count;
        pc.extent = L.vocab_block;
        break;
    }
    L.local.params[i].shape[size_t(pc.axis)] = pc.extent;
    L.pieces.push_back(pc);
  }
  return L;
}

std::vector<float> tp_slice(const TpLayout& L, size_t i, std::span<const float> full) {
  const TpPiece& pc = L.pieces.at(i);
  const std::vector<int64_t>& fs = L.full.params[i].shape;
  if (int64_t(full.size()) != numel(fs))
    throw std::invalid_argument("tp_slice: parameter " + L.full.params[i].name + " has the wrong number of elements");
  std::vector<float> out(size_t(numel(L.local.params[i].shape)), 0.f);
  const int64_t inner = fs.size() > 1 ? numel(std::vector<int64_t>(fs.begin() + 1, fs.end())) : 1;
  if (pc.axis == 0) {
    std::memcpy(out.data(), full.data() + pc.begin * inner, size_t(pc.count * inner) * sizeof(float));
  } else {  // [rows, full] -> [rows, extent]
    const int64_t rows = fs[0];
    for (int64_t q = 0; q < rows; ++q)
      std::memcpy(out.data() + q * pc.extent, full.data() + q * pc.full + pc.begin, size_t(pc.count) * sizeof(float));
  }
  return out;
}

void tp_place(const TpLayout& L, size_t i, std::span<const float> local, std::span<float> full) {
  const TpPiece& pc = L.pieces.at(i);
  const std::vector<int64_t>& fs = L.full.params[i].shape;
  if (int64_t(full.size()) != numel(fs) || int64_t(local.size()) != numel(L.local.params[i].shape))
    throw std::invalid_argument("tp_place: parameter " + L.full.params[i].name + " has the wrong number of elements");
  const int64_t inner = fs.size() > 1 ? numel(std::vector<int64_t>(fs.begin() + 1, fs.end())) : 1;
  if (pc.axis == 0) {
    std::memcpy(full.data() + pc.begin * inner, local.data(), size_t(pc.count * inner) * sizeof(float));
  } else {
    const int64_t rows = fs[0];
    for (int64_t q = 0; q < rows; ++q)
      std::memcpy(full.data() + q * pc.full + pc.begin, local.data() + q * pc.extent, size_t(pc.count) * sizeof(float));
  }
}

void mark_tensor_parallel(ModelProgram& prog, const TpLayout& L) {
  prog.tp_size = L.size;
  if (L.size == 1) return;
  for (LayerProgram& lp : prog.layers)
    for (LayerStep& st : lp.steps) {
      if (st.op != StepOp::linear || st.weights.empty()) continue;
      const ParamRole role = L.local.params[size_t(st.weights[0])].role;
      if (role == ParamRole::q || role == ParamRole::gate) {
        // d input is a partial sum over ranks; reduced right after this step's backward, which
        // must therefore write it alone.
        if (st.accumulate)
          throw std::logic_error("tensor parallelism: layer " + std::to_string(lp.index) +
                                 ": a column-parallel linear's input gradient is shared");
        st.tp_reduce_din = true;
      } else if (role == ParamRole::o || role == ParamRole::down) {
        st.tp_reduce_out = true;
      } else {
        throw std::logic_error("tensor parallelism: layer " + std::to_string(lp.index) + ": a linear of role " +
                               to_string(role) + " has no parallel form");
      }
    }
}

}  // namespace rlh::sdk
