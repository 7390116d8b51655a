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
    case TpSplit::expert_rows: return "expert_rows";
    case TpSplit::expert_cols: return "expert_cols";
    case TpSplit::experts_whole: return "experts_whole";
  }
  return "?";
}

namespace {

// Megatron's layout of a decoder: ColumnParallelLinear for linear_qkv and linear_fc1,
// RowParallelLinear for linear_proj and linear_fc2, VocabParallelEmbedding, and a
// vocabulary-parallel output layer; norms replicated. A column-parallel linear's bias is cut with
// its rows; a row-parallel one's is whole and added once, after the sum (Megatron's
// RowParallelLinear adds it after the all-reduce). MoE (expert_tensor_parallel_size = T): every
// routed expert's gate/up cut by rows and its down by columns, the shared expert likewise, the
// router (and its biases, the shared expert's sigmoid gate) replicated: every rank routes alike.
// (With expert_tensor_parallel_size Te < T under expert parallelism the routed experts are cut
// in Te blocks instead, or left whole at Te = 1: TpLayout::expert_size.)
// MLA: q_b / kv_b (or q without q_lora_rank) cut by heads, the latent projections and their
// norms replicated with their gradients summed (each rank backpropagates its heads only).
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
    {ParamRole::q_bias, TpSplit::rows},
    {ParamRole::k_bias, TpSplit::kv_rows},
    {ParamRole::v_bias, TpSplit::kv_rows},
    {ParamRole::o_bias, TpSplit::replicated},
    {ParamRole::q_norm, TpSplit::replicated_sum},
    {ParamRole::k_norm, TpSplit::replicated_sum},
    {ParamRole::gate, TpSplit::rows},
    {ParamRole::up, TpSplit::rows},
    {ParamRole::down, TpSplit::cols},
    {ParamRole::gate_bias, TpSplit::rows},
    {ParamRole::up_bias, TpSplit::rows},
    {ParamRole::down_bias, TpSplit::replicated},
    {ParamRole::router, TpSplit::replicated},
    {ParamRole::router_bias, TpSplit::replicated},
    {ParamRole::expert_score_bias, TpSplit::replicated},
    {ParamRole::expert_gate, TpSplit::expert_rows},
    {ParamRole::expert_up, TpSplit::expert_rows},
    {ParamRole::expert_down, TpSplit::expert_cols},
    {ParamRole::shared_expert_gate_proj, TpSplit::rows},
    {ParamRole::shared_expert_up, TpSplit::rows},
    {ParamRole::shared_expert_down, TpSplit::cols},
    {ParamRole::shared_expert_gate, TpSplit::replicated},
    {ParamRole::q_a, TpSplit::replicated_sum},
    {ParamRole::q_a_norm, TpSplit::replicated_sum},
    {ParamRole::q_b, TpSplit::rows},
    {ParamRole::kv_a, TpSplit::replicated_sum},
    {ParamRole::kv_a_norm, TpSplit::replicated_sum},
    {ParamRole::kv_b, TpSplit::rows},
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

std::string tp_unsupported(const TransformerDesc& d, int64_t T, const std::string& key, int64_t expert_size) {
  const std::string at = key + " = " + std::to_string(T) + ": ";
  if (T < 1) return at + "must be at least 1";
  if (T == 1) return {};
  const int64_t Te = expert_size == 0 ? T : expert_size;
  if (Te < 1 || Te > T || T % Te != 0)
    return at + "expert tensor-parallel size " + std::to_string(expert_size) + " does not divide it";
  auto multiple = [&](const std::string& in, const char* what, int64_t n, int64_t by) {
    return n % by == 0 ? std::string() : in + what + " = " + std::to_string(n) + " is not a multiple of " + std::to_string(by);
  };
  for (const LayerDesc& l : d.layers) {
    const std::string in = at + "layer " + std::to_string(l.index) + ": ";
    const AttentionDesc& a = l.attention;
    if (std::string why = multiple(in, "num_attention_heads", a.num_heads, T); !why.empty()) return why;
    if (a.kind == AttentionKind::gqa) {
      const int64_t kv = a.num_kv_heads;
      if (kv <= 0 || (kv >= T ? kv % T != 0 : T % kv != 0))
        return in + "num_key_value_heads = " + std::to_string(kv) + " neither divides nor is a multiple of " +
               std::to_string(T);
    }
    if (l.mlp.kind == MlpKind::moe) {
      const MoeDesc& e = l.mlp.moe;
      if (e.num_local_experts > 0 && e.num_local_experts != e.num_experts)
        return in + "expert parallelism is not supported with tensor parallelism";
      if (Te > 1)  // (the expert width cut in Te blocks; at Te = 1 the experts are whole)
        if (std::string why = multiple(in, "moe_intermediate_size", e.expert_intermediate_size, Te); !why.empty())
          return why;
      if (std::string why = multiple(in, "shared expert intermediate size", e.shared_expert_intermediate_size, T);
          !why.empty())
        return why;
    } else if (std::string why = multiple(in, "intermediate_size", l.mlp.intermediate_size, T); !why.empty()) {
      return why;
    }
  }
  for (const ParamDesc& p : d.params)
    if (rule_of(p.role) == nullptr)
      return at + "parameter " + p.name + " (role " + to_string(p.role) +
             ") has no tensor-parallel rule (value heads are not supported under tensor parallelism)";
  return {};
}

TpLayout make_tp_layout(const TransformerDesc& d, int64_t T, int64_t r, const std::string& key, int64_t expert_size) {
  if (const std::string why = tp_unsupported(d, T, key, expert_size); !why.empty()) throw std::invalid_argument(why);
  if (r < 0 || r >= T) throw std::invalid_argument("tensor-parallel rank " + std::to_string(r) + " outside 0.." + std::to_string(T - 1));
  TpLayout L;
  L.size = T;
  L.rank = r;
  // (T = 1 has no experts to cut: Te 1 as well.)
  L.expert_size = T == 1 ? 1 : expert_size == 0 ? T : expert_size;
  L.expert_rank = r % L.expert_size;
  const bool experts_whole = L.expert_size == 1;
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
    if (l.mlp.kind == MlpKind::moe) {
      l.mlp.moe.expert_intermediate_size /= L.expert_size;
      l.mlp.moe.shared_expert_intermediate_size /= T;
    } else {
      l.mlp.intermediate_size /= T;
    }
  }
  const double inv_t = 1.0 / double(T);
  for (size_t i = 0; i < d.params.size(); ++i) {
    const ParamDesc& p = d.params[i];
    TpPiece pc;
    pc.split = rule_of(p.role)->split;
    if (experts_whole && (pc.split == TpSplit::expert_rows || pc.split == TpSplit::expert_cols))
      pc.split = TpSplit::experts_whole;
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
      case TpSplit::experts_whole:  // counted by their owner (the backend sums them over ep)
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
      case TpSplit::expert_rows:
      case TpSplit::expert_cols:
        // Te blocks of each expert, this rank's the expert_rank-th (Te = T: the tp rank's).
        pc.axis = pc.split == TpSplit::expert_rows ? 1 : 2;
        pc.full = p.shape[size_t(pc.axis)];
        pc.count = pc.extent = pc.full / L.expert_size;
        pc.begin = L.expert_rank * pc.count;
        break;
      case TpSplit::kv_rows: {
        const LayerDesc& l = d.layers[size_t(p.layer)];
        const int64_t kv = l.attention.num_kv_heads, D = l.attention.head_dim;
        if (kv <= 0 || pc.full != kv * D)
          throw std::invalid_argument(L.full.params[i].name + ": k/v rows are not kv heads x head_dim");
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

namespace {

// A tensor as [outer, full, inner] around the cut axis: the piece is [outer, count, inner] of it,
// stored [outer, extent, inner] (extent > count: a padded vocabulary block, zero rows).
struct Around {
  int64_t outer = 1, inner = 1;
};
Around around(const std::vector<int64_t>& shape, int axis) {
  Around a;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (int(d) < axis) a.outer *= shape[d];
    if (int(d) > axis) a.inner *= shape[d];
  }
  return a;
}

}  // namespace

void tp_embedding_lookup(const TpLayout& L, float* x, const int32_t* ids, int64_t R, const float* W, int64_t C) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t id = int64_t(ids[r]) - L.vocab_begin;
    if (id >= 0 && id < L.vocab_count)
      std::memcpy(x + r * C, W + id * C, size_t(C) * sizeof(float));
    else
      std::memset(x + r * C, 0, size_t(C) * sizeof(float));
  }
}

std::vector<float> tp_slice(const TpLayout& L, size_t i, std::span<const float> full) {
  const TpPiece& pc = L.pieces.at(i);
  const std::vector<int64_t>& fs = L.full.params[i].shape;
  if (int64_t(full.size()) != numel(fs))
    throw std::invalid_argument("tp_slice: parameter " + L.full.params[i].name + " has the wrong number of elements");
  std::vector<float> out(size_t(numel(L.local.params[i].shape)), 0.f);
  const Around a = around(fs, pc.axis);
  for (int64_t o = 0; o < a.outer; ++o)
    std::memcpy(out.data() + o * pc.extent * a.inner, full.data() + (o * pc.full + pc.begin) * a.inner,
                size_t(pc.count * a.inner) * sizeof(float));
  return out;
}

void tp_place(const TpLayout& L, size_t i, std::span<const float> local, std::span<float> full) {
  const TpPiece& pc = L.pieces.at(i);
  const std::vector<int64_t>& fs = L.full.params[i].shape;
  if (int64_t(full.size()) != numel(fs) || int64_t(local.size()) != numel(L.local.params[i].shape))
    throw std::invalid_argument("tp_place: parameter " + L.full.params[i].name + " has the wrong number of elements");
  const Around a = around(fs, pc.axis);
  for (int64_t o = 0; o < a.outer; ++o)
    std::memcpy(full.data() + (o * pc.full + pc.begin) * a.inner, local.data() + o * pc.extent * a.inner,
                size_t(pc.count * a.inner) * sizeof(float));
}

void mark_tensor_parallel(ModelProgram& prog, const TpLayout& L) {
  prog.tp_size = L.size;
  if (L.size == 1) return;
  for (LayerProgram& lp : prog.layers)
    for (LayerStep& st : lp.steps) {
      const std::string at = "tensor parallelism: layer " + std::to_string(lp.index) + ": ";
      if (st.op == StepOp::moe) {
        // The block is row-parallel at its output (the experts' partial sums, reduced once after
        // the combine) and column-parallel at its input; the engine's MoE block reduces inside
        // (the routing weights' gradient before the router's, d input before the router adds
        // its whole part), so the step carries both marks for executors to check.
        st.tp_reduce_out = st.tp_reduce_din = true;
        if (st.accumulate) throw std::logic_error(at + "an MoE block's input gradient is shared");
        continue;
      }
      if (st.op == StepOp::mla) {
        // Every part of d input (q_a or q, kv_a) is a partial sum over this rank's heads.
        if (st.accumulate) throw std::logic_error(at + "an MLA block's input gradient is shared");
        st.tp_reduce_din = true;
        continue;
      }
      if (st.op != StepOp::linear || st.weights.empty()) continue;
      const ParamRole role = L.local.params[size_t(st.weights[0])].role;
      if (role == ParamRole::q || role == ParamRole::gate) {
        // d input is a partial sum over ranks; reduced right after this step's backward, which
        // must therefore write it alone.
        if (st.accumulate) throw std::logic_error(at + "a column-parallel linear's input gradient is shared");
        st.tp_reduce_din = true;
      } else if (role == ParamRole::o || role == ParamRole::down) {
        st.tp_reduce_out = true;  // executors add the bias after the sum (once)
      } else {
        throw std::logic_error(at + "a linear of role " + std::string(to_string(role)) + " has no parallel form");
      }
    }
}

}  // namespace rlh::sdk
