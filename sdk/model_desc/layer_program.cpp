// The layer program (layer_program.hpp): the description read once into steps, values, RoPE
// tables and the gradient plan every executor follows.
#include "rlhost/sdk/layer_program.hpp"
#include "rlhost/sdk/pipeline_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

namespace rlh::sdk {

const char* to_string(StepOp op) {
  switch (op) {
    case StepOp::norm: return "norm";
    case StepOp::head_norm: return "head_norm";
    case StepOp::linear: return "linear";
    case StepOp::rope: return "rope";
    case StepOp::attention: return "attention";
    case StepOp::glu: return "glu";
    case StepOp::add: return "add";
    case StepOp::moe: return "moe";
    case StepOp::mla: return "mla";
  }
  return "?";
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// HF hidden_act -> the glu step's activation; empty for one no executor runs.
std::string glu_act(const std::string& hidden_act) {
  if (hidden_act == "silu" || hidden_act == "swish") return "silu";
  if (hidden_act == "gelu_pytorch_tanh" || hidden_act == "gelu_new") return "gelu_tanh";
  if (hidden_act == "gelu") return "gelu";
  return {};
}

// Builds one layer: values and steps in forward order, then the backward plan.
class LayerBuilder {
 public:
  LayerBuilder(const TransformerDesc& d, const LayerDesc& l, int rope_table)
      : d_(d), l_(l), table_(rope_table) {
    p_.index = l.index;
    at_ = "layer " + std::to_string(l.index) + ": ";
  }

  // The layer's values and steps, its backward plan drawing gradient buffers from `grad_widths`.
  LayerProgram build(std::vector<int64_t>& grad_widths) {
    const int64_t C = d_.hidden_size;
    const int x = value("x", C);
    const int xn1 = value("attn_norm_out", C);
    norm(x, xn1, ParamRole::attn_norm, l_.attn_norm);
    const int att = l_.attention.kind == AttentionKind::mla ? mla(xn1) : gqa(xn1);
    const AttentionDesc& a = l_.attention;
    const int64_t ao = values()[size_t(att)].width;
    int branch = linear(att, value("o_out", C), {ParamRole::o}, {a.o_bias ? ParamRole::o_bias : ParamRole(-1)}, {C}, ao);
    if (l_.post_attn_norm) {
      const int on = value("post_attn_norm_out", C);
      norm(branch, on, ParamRole::post_attn_norm, *l_.post_attn_norm);
      branch = on;
    }
    const int h = add(x, branch, "h");
    const int xn2 = value("mlp_norm_out", C);
    norm(h, xn2, ParamRole::mlp_norm, l_.mlp_norm);
    int mo = l_.mlp.kind == MlpKind::moe ? moe(xn2) : dense_mlp(xn2);
    if (l_.post_mlp_norm) {
      const int mn = value("post_mlp_norm_out", C);
      norm(mo, mn, ParamRole::post_mlp_norm, *l_.post_mlp_norm);
      mo = mn;
    }
    p_.output = add(h, mo, "out");
    mark_saved_and_recomputable();
    plan_grads(grad_widths);
    return std::move(p_);
  }

 private:
  // Gradient buffers of this layer's values; `widths` grows with the buffers it uses.
  void plan_grads(std::vector<int64_t>& widths) {
    std::vector<std::vector<std::pair<int64_t, int64_t>>> written(p_.values.size());
    std::vector<int> first_producer(p_.values.size(), -1);
    for (size_t s = 0; s < p_.steps.size(); ++s)
      for (const Cols* c : {&p_.steps[s].out, &p_.steps[s].out2})
        if (c->valid() && first_producer[size_t(c->value)] < 0) first_producer[size_t(c->value)] = int(s);
    std::vector<bool> busy(widths.size(), false);
    if (busy.empty()) {
      widths.push_back(d_.hidden_size);
      busy.push_back(false);
    }
    busy[0] = true;  // d residual stream, live across the whole layer
    auto alloc = [&](int64_t width) {
      for (size_t i = 1; i < busy.size(); ++i)
        if (!busy[i]) {
          busy[i] = true;
          widths[i] = std::max(widths[i], width);
          return int(i);
        }
      widths.push_back(width);
      busy.push_back(true);
      return int(widths.size() - 1);
    };
    auto whole = [&](int v) { written[size_t(v)] = {{0, p_.values[size_t(v)].width}}; };
    // Whether writing columns c adds to what is there already; records them as written.
    auto touch = [&](const Cols& c) {
      LayerValue& v = p_.values[size_t(c.value)];
      if (v.grad < 0) v.grad = alloc(v.width);
      bool overlap = false;
      for (const auto& [b, e] : written[size_t(c.value)]) overlap = overlap || (c.col < e && b < c.col + c.width);
      written[size_t(c.value)].emplace_back(c.col, c.col + c.width);
      return overlap;
    };
    p_.values[size_t(p_.output)].grad = 0;
    whole(p_.output);
    for (int s = int(p_.steps.size()) - 1; s >= 0; --s) {
      LayerStep& st = p_.steps[size_t(s)];
      switch (st.op) {
        case StepOp::add: {
          // out = in + in2: both operands receive the output's gradient as it is (one buffer).
          const int g = p_.values[size_t(st.out.value)].grad;
          for (int v : {st.in.value, st.in2.value}) {
            if (p_.values[size_t(v)].grad >= 0)
              throw std::logic_error("layer program: " + at_ + "a residual operand's gradient is taken twice");
            p_.values[size_t(v)].grad = g;
            whole(v);
          }
          break;
        }
        case StepOp::rope:
          break;  // in place on its gradient
        default:
          st.accumulate = st.in.valid() && touch(st.in);
          st.accumulate2 = st.in2.valid() && touch(st.in2);
          st.accumulate3 = st.in3.valid() && touch(st.in3);
      }
      if (st.op == StepOp::attention && (st.accumulate || st.accumulate2 || st.accumulate3))
        throw std::logic_error("layer program: " + at_ + "attention's input gradients must be written, not added");
      // A gradient buffer is free once the first step that writes its value has run backward.
      for (size_t v = 0; v < p_.values.size(); ++v)
        if (first_producer[v] == s && p_.values[v].grad > 0) {
          bool shared = false;  // still aliased by a live value (residual operands)
          for (size_t u = 0; u < v; ++u) shared = shared || p_.values[u].grad == p_.values[v].grad;
          if (!shared) busy[size_t(p_.values[v].grad)] = false;
        }
    }
  }

  std::vector<LayerValue>& values() { return p_.values; }

  int value(std::string name, int64_t width, int storage = -1) {
    LayerValue v;
    v.name = std::move(name);
    v.width = width;
    v.storage = storage;
    p_.values.push_back(std::move(v));
    return int(p_.values.size() - 1);
  }
  Cols cols(int v, int64_t col = 0, int64_t width = -1) const {
    return Cols{v, col, width < 0 ? p_.values[size_t(v)].width : width};
  }
  int stat(int64_t rows) {
    p_.stat_rows.push_back(rows);
    return int(p_.stat_rows.size() - 1);
  }

  // The parameter of `role` in this layer, checked to have `shape`; -1 when absent and optional.
  int64_t param(ParamRole role, const std::vector<int64_t>& shape, bool required = true) {
    const ParamDesc* p = d_.find_param(l_.index, role);
    if (p == nullptr) {
      if (required) throw std::invalid_argument(at_ + "missing parameter of role " + std::string(sdk::to_string(role)));
      return -1;
    }
    if (p->shape != shape)
      throw std::invalid_argument(at_ + "parameter " + p->name + " has shape " + shape_str(p->shape) + ", expected " +
                                  shape_str(shape));
    return int64_t(p - d_.params.data());
  }

  void norm(int in, int out, ParamRole role, const NormDesc& n) {
    if (n.kind != NormKind::rmsnorm) throw std::invalid_argument(at_ + "only RMSNorm is executed");
    const int64_t C = p_.values[size_t(in)].width;
    LayerStep s;
    s.op = StepOp::norm;
    s.in = cols(in);
    s.out = cols(out);
    s.weights = {param(role, {C})};
    s.eps = n.eps;
    s.offset = n.weight_offset;
    s.stat = stat(1);
    p_.steps.push_back(std::move(s));
  }

  // out = in W^T (+ b): `roles` fused along the output rows, each `rows[i]` rows of `k` columns.
  int linear(int in, int out, const std::vector<ParamRole>& roles, const std::vector<ParamRole>& bias_roles,
             const std::vector<int64_t>& rows, int64_t k) {
    LayerStep s;
    s.op = StepOp::linear;
    s.in = cols(in);
    s.out = cols(out);
    for (size_t i = 0; i < roles.size(); ++i) {
      s.weights.push_back(param(roles[i], {rows[i], k}));
      s.biases.push_back(int(bias_roles[i]) < 0 ? -1 : param(bias_roles[i], {rows[i]}, false));
    }
    p_.steps.push_back(std::move(s));
    return out;
  }

  int add(int a, int b, const char* name) {
    const int out = value(name, p_.values[size_t(b)].width, b);
    LayerStep s;
    s.op = StepOp::add;
    s.in = cols(a);
    s.in2 = cols(b);
    s.out = cols(out);
    p_.steps.push_back(std::move(s));
    return out;
  }

  void rope(const Cols& c, int64_t heads, int64_t head_dim) {
    LayerStep s;
    s.op = StepOp::rope;
    s.in = s.out = c;
    s.heads = heads;
    s.head_dim = head_dim;
    s.table = table_;
    p_.steps.push_back(std::move(s));
  }

  // Grouped-query attention from xn: returns the attention output value [Hq D].
  int gqa(int xn) {
    const AttentionDesc& a = l_.attention;
    const int64_t C = d_.hidden_size, Hq = a.num_heads, Hkv = a.num_kv_heads, D = a.head_dim;
    if (Hq <= 0 || Hkv <= 0 || D <= 0 || Hq % Hkv != 0)
      throw std::invalid_argument(at_ + "heads must be positive and kv heads must divide query heads");
    const int qkv = value("qkv", (Hq + 2 * Hkv) * D);
    linear(xn, qkv, {ParamRole::q, ParamRole::k, ParamRole::v},
           {a.q_bias ? ParamRole::q_bias : ParamRole(-1), a.k_bias ? ParamRole::k_bias : ParamRole(-1),
            a.v_bias ? ParamRole::v_bias : ParamRole(-1)},
           {Hq * D, Hkv * D, Hkv * D}, C);
    Cols q = cols(qkv, 0, Hq * D), k = cols(qkv, Hq * D, Hkv * D);
    const Cols v = cols(qkv, (Hq + Hkv) * D, Hkv * D);
    if (a.qk_norm) {  // normed q and k as values of their own: contiguous [N, H D] each
      const int qn = value("q_normed", Hq * D), kn = value("k_normed", Hkv * D);
      head_norm(q, cols(qn), Hq, D, ParamRole::q_norm);
      head_norm(k, cols(kn), Hkv, D, ParamRole::k_norm);
      q = cols(qn);
      k = cols(kn);
    }
    if (a.use_rope && table_ >= 0) {
      rope(q, Hq, D);
      rope(k, Hkv, D);
    }
    const int att = value("att", Hq * D);
    LayerStep s;
    s.op = StepOp::attention;
    s.in = q;
    s.in2 = k;
    s.in3 = v;
    s.out = cols(att);
    s.hq = Hq;
    s.hkv = Hkv;
    s.dk = s.dv = D;
    s.window = a.sliding_window;
    s.scale = a.softmax_scale > 0 ? a.softmax_scale : 1.0 / std::sqrt(double(D));
    s.softcap = a.logit_softcapping;
    s.stat = stat(Hq);
    p_.steps.push_back(std::move(s));
    return att;
  }

  void head_norm(const Cols& in, const Cols& out, int64_t heads, int64_t D, ParamRole role) {
    LayerStep s;
    s.op = StepOp::head_norm;
    s.in = in;
    s.out = out;
    s.heads = heads;
    s.head_dim = D;
    s.weights = {param(role, {D})};
    s.eps = d_.rms_norm_eps;
    s.offset = l_.attention.qk_norm_weight_offset;
    s.stat = stat(heads);
    p_.steps.push_back(std::move(s));
  }

  // DeepSeek MLA from xn: one composite step (the executors' MLA blocks); returns [H dv].
  int mla(int xn) {
    const AttentionDesc& a = l_.attention;
    const int64_t C = d_.hidden_size, H = a.num_heads;
    const int64_t rq = a.q_lora_rank, rkv = a.kv_lora_rank, dn = a.qk_nope_head_dim, dr = a.qk_rope_head_dim,
                  dv = a.v_head_dim, D = dn + dr;
    if (H <= 0 || rkv <= 0 || dn <= 0 || dr <= 0 || dv <= 0 || rq < 0)
      throw std::invalid_argument(at_ + "MLA ranks and head dims must be positive");
    const int qkv = value("mla_qkv", H * (2 * D + dv));
    const int att = value("att", H * dv);
    LayerStep s;
    s.op = StepOp::mla;
    s.in = cols(xn);
    s.out = cols(att);
    s.out2 = cols(qkv);
    if (rq > 0) {
      s.weights = {param(ParamRole::q_a, {rq, C}), param(ParamRole::q_a_norm, {rq}),
                   param(ParamRole::q_b, {H * D, rq})};
    } else {
      s.weights = {param(ParamRole::q, {H * D, C})};
    }
    s.weights.push_back(param(ParamRole::kv_a, {rkv + dr, C}));
    s.weights.push_back(param(ParamRole::kv_a_norm, {rkv}));
    s.weights.push_back(param(ParamRole::kv_b, {H * (dn + dv), rkv}));
    s.hq = s.hkv = H;
    s.dk = D;
    s.dv = dv;
    s.window = a.sliding_window;
    s.scale = a.softmax_scale > 0 ? a.softmax_scale : 1.0 / std::sqrt(double(D));
    s.softcap = a.logit_softcapping;
    s.table = a.use_rope ? table_ : -1;
    s.heads = H;
    s.head_dim = dr;
    s.stat = stat(H);
    p_.steps.push_back(std::move(s));
    return att;
  }

  int dense_mlp(int xn) {
    const MlpDesc& m = l_.mlp;
    const int64_t C = d_.hidden_size, F = m.intermediate_size;
    if (F <= 0) throw std::invalid_argument(at_ + "intermediate_size must be positive");
    const std::string act = glu_act(m.hidden_act);
    if (act.empty()) throw std::invalid_argument(at_ + "activation '" + m.hidden_act + "' is not executed");
    const int gu = value("gate_up", 2 * F);
    linear(xn, gu, {ParamRole::gate, ParamRole::up},
           {m.bias ? ParamRole::gate_bias : ParamRole(-1), m.bias ? ParamRole::up_bias : ParamRole(-1)}, {F, F}, C);
    const int a = value("act", F);
    LayerStep s;
    s.op = StepOp::glu;
    s.in = cols(gu);
    s.out = cols(a);
    s.act = act;
    p_.steps.push_back(std::move(s));
    return linear(a, value("mlp_out", C), {ParamRole::down}, {m.bias ? ParamRole::down_bias : ParamRole(-1)}, {C}, F);
  }

  int moe(int xn) {
    const MlpDesc& m = l_.mlp;
    const MoeDesc& e = m.moe;
    const int64_t C = d_.hidden_size;
    if (e.num_experts <= 0 || e.top_k <= 0 || e.top_k > e.num_experts || e.expert_intermediate_size <= 0)
      throw std::invalid_argument(at_ + "MoE sizes must be positive with top_k <= num_experts");
    const std::string act = glu_act(m.hidden_act);
    if (act.empty()) throw std::invalid_argument(at_ + "activation '" + m.hidden_act + "' is not executed");
    const int out = value("moe_out", C);
    LayerStep s;
    s.op = StepOp::moe;
    s.in = cols(xn);
    s.out = cols(out);
    s.act = act;
    const int64_t E = e.num_experts, Fe = e.expert_intermediate_size, Fs = e.shared_expert_intermediate_size;
    // Under expert parallelism this rank holds a block of El experts (the router still scores E).
    const int64_t El = e.num_local_experts > 0 ? e.num_local_experts : E;
    if (El > E || E % El != 0) throw std::invalid_argument(at_ + "num_local_experts must divide num_experts");
    s.weights = {param(ParamRole::router, {E, C}), param(ParamRole::expert_gate, {El, Fe, C}),
                 param(ParamRole::expert_up, {El, Fe, C}), param(ParamRole::expert_down, {El, C, Fe})};
    if (e.router_bias) s.weights.push_back(param(ParamRole::router_bias, {E}));
    if (e.e_score_correction_bias) s.weights.push_back(param(ParamRole::expert_score_bias, {E}));
    if (Fs > 0) {
      s.weights.push_back(param(ParamRole::shared_expert_gate_proj, {Fs, C}));
      s.weights.push_back(param(ParamRole::shared_expert_up, {Fs, C}));
      s.weights.push_back(param(ParamRole::shared_expert_down, {C, Fs}));
      if (e.shared_expert_gate) s.weights.push_back(param(ParamRole::shared_expert_gate, {1, C}));
    }
    p_.steps.push_back(std::move(s));
    return out;
  }

  // saved: read by some step's backward; recomputable: a norm/glu output that owns its storage.
  void mark_saved_and_recomputable() {
    auto save = [&](const Cols& c) {
      if (c.valid()) p_.values[size_t(c.value)].saved = true;
    };
    for (const LayerStep& s : p_.steps) {
      switch (s.op) {
        case StepOp::norm:
        case StepOp::head_norm:
        case StepOp::linear:
        case StepOp::glu:
        case StepOp::moe: save(s.in); break;
        case StepOp::attention: save(s.in); save(s.in2); save(s.in3); save(s.out); break;
        case StepOp::mla: save(s.in); save(s.out); save(s.out2); break;
        case StepOp::rope:
        case StepOp::add: break;
      }
    }
    // A storage root is kept when any value living in it is.
    for (size_t v = 0; v < p_.values.size(); ++v)
      if (p_.values[v].saved) p_.values[size_t(p_.root(int(v)))].saved = true;
    for (size_t v = 0; v < p_.values.size(); ++v) {
      bool produced_cheaply = false;
      for (const LayerStep& s : p_.steps)
        if (s.out.value == int(v) && (s.op == StepOp::norm || s.op == StepOp::glu)) produced_cheaply = true;
      bool shared = false;
      for (const LayerValue& u : p_.values) shared = shared || u.storage == int(v);
      p_.values[v].recomputable = produced_cheaply && p_.values[v].storage < 0 && !shared;
    }
  }

  const TransformerDesc& d_;
  const LayerDesc& l_;
  int table_;
  std::string at_;
  LayerProgram p_;
};

// One table per distinct (RoPE, rotary dims): layers sharing them share the table.
int rope_table(std::vector<RopeTable>& tables, const RopeDesc& r, int64_t rotary_dim) {
  if (r.kind == RopeKind::none) return -1;
  const nlohmann::json key = r;
  for (size_t i = 0; i < tables.size(); ++i)
    if (tables[i].rotary_dim == rotary_dim && nlohmann::json(tables[i].rope) == key) return int(i);
  RopeTable t;
  t.rope = r;
  t.rotary_dim = rotary_dim;
  t.scale = rope_attention_scaling(r);
  t.interleaved = r.layout == RopeLayout::interleaved;
  t.per_sequence = r.kind == RopeKind::dynamic || r.kind == RopeKind::longrope;
  rope_inv_freq(r, rotary_dim);  // validates dims and factors now, naming the problem
  tables.push_back(std::move(t));
  return int(tables.size() - 1);
}

}  // namespace

// first / last: a pipeline stage's program (pipeline_parallel.hpp): the embedding is read only
// where it is used (the first stage, and the last one's tied head), the final norm and the head
// only on the last stage.
static ModelProgram build_program_of_stage(const TransformerDesc& desc, bool first, bool last) {
  ModelProgram p;
  p.pp_first = first;
  p.pp_last = last;
  p.vocab = desc.vocab_size;
  p.hidden = desc.hidden_size;
  if (p.vocab <= 0 || p.hidden <= 0 || desc.num_layers < 0 || int64_t(desc.layers.size()) != desc.num_layers)
    throw std::invalid_argument("model description has inconsistent sizes");
  auto global = [&](ParamRole role, bool required) -> int64_t {
    const ParamDesc* q = desc.find_param(-1, role);
    if (q == nullptr) {
      if (required) throw std::invalid_argument(std::string("missing parameter of role ") + to_string(role));
      return -1;
    }
    const std::vector<int64_t> want = role == ParamRole::final_norm ? std::vector<int64_t>{p.hidden}
                                                                     : std::vector<int64_t>{p.vocab, p.hidden};
    if (q->shape != want)
      throw std::invalid_argument("parameter " + q->name + " has shape " + shape_str(q->shape) + ", expected " +
                                  shape_str(want));
    return int64_t(q - desc.params.data());
  };
  p.embed = global(ParamRole::embed, first || (last && desc.tie_word_embeddings));
  p.embed_scale = desc.embedding_scale > 0 ? desc.embedding_scale : 1.0;
  p.final_norm = global(ParamRole::final_norm, last);
  if (desc.final_norm.kind != NormKind::rmsnorm) throw std::invalid_argument("final norm: only RMSNorm is executed");
  p.final_eps = desc.final_norm.eps;
  p.final_offset = desc.final_norm.weight_offset;
  p.head = !last ? -1 : desc.tie_word_embeddings ? p.embed : global(ParamRole::lm_head, true);
  p.logit_softcap = desc.final_logit_softcapping;
  if (const ParamDesc* q = desc.find_param(-1, ParamRole::value_head)) {
    if (q->shape != std::vector<int64_t>{1, p.hidden})
      throw std::invalid_argument("parameter " + q->name + " has shape " + shape_str(q->shape) + ", expected " +
                                  shape_str({1, p.hidden}) + " (a value head has one label)");
    p.value_head = int64_t(q - desc.params.data());
  }
  p.grad_widths = {p.hidden};
  for (const LayerDesc& l : desc.layers) {
    const AttentionDesc& a = l.attention;
    const RopeDesc& r = l.rope ? *l.rope : desc.rope;
    int table = -1;
    if (a.use_rope && r.kind != RopeKind::none) {
      const int64_t head = a.kind == AttentionKind::mla ? a.qk_rope_head_dim : a.head_dim;
      const int64_t dims = a.kind == AttentionKind::mla ? a.qk_rope_head_dim : (r.rotary_dim > 0 ? r.rotary_dim : head);
      if (dims > head || dims <= 0 || dims % 2 != 0)
        throw std::invalid_argument("layer " + std::to_string(l.index) + ": rotary dims " + std::to_string(dims) +
                                    " must be even and at most the head dim " + std::to_string(head));
      table = rope_table(p.ropes, r, dims);
    }
    p.layers.push_back(LayerBuilder(desc, l, table).build(p.grad_widths));
  }
  return p;
}

ModelProgram build_program(const TransformerDesc& desc) { return build_program_of_stage(desc, true, true); }
ModelProgram build_stage_program(const TransformerDesc& desc, bool first, bool last) {
  return build_program_of_stage(desc, first, last);
}

bool product_then_residual_add(const LayerProgram& lp, size_t i) {
  if (i + 1 >= lp.steps.size()) return false;
  const LayerStep &st = lp.steps[i], &nx = lp.steps[i + 1];
  if (st.op != StepOp::linear || nx.op != StepOp::add) return false;
  auto whole = [&](const Cols& c) {
    return c.valid() && c.col == 0 && c.width == lp.values[size_t(c.value)].width;
  };
  const int o = st.out.value;
  if (!whole(st.out) || !whole(nx.in) || !whole(nx.in2) || !whole(nx.out) || !st.in.valid() ||
      (nx.in.value == o) == (nx.in2.value == o) || o == lp.output || lp.root(nx.out.value) == lp.root(st.in.value))
    return false;
  for (size_t j = 0; j < lp.steps.size(); ++j) {  // the add is the product's only reader
    if (j == i + 1) continue;
    for (const Cols* c : {&lp.steps[j].in, &lp.steps[j].in2, &lp.steps[j].in3})
      if (c->valid() && c->value == o) return false;
  }
  return true;
}

std::string unsupported(const ModelProgram& p, const ExecutorCaps& caps) {
  const std::string who = caps.name + ": ";
  if ((!p.pp_first || !p.pp_last) && !caps.pipeline_stage) return who + "pipeline parallelism is not supported";
  if (p.tp_size > 1 && !caps.tensor_parallel) return who + "tensor parallelism is not supported";
  if (p.ep_size > 1 && !caps.expert_parallel) return who + "expert parallelism is not supported";
  if (p.logit_softcap != 0 && !caps.logit_softcap) return who + "final logit soft-capping is not supported";
  if (p.value_head >= 0 && !caps.value_head)
    return who + "the value head (score.weight, RLH_OUTPUT_VALUE: reward models and critics) is not supported";
  for (const RopeTable& t : p.ropes)
    if (t.per_sequence && !caps.per_sequence_rope)
      return who + std::string(t.rope.kind == RopeKind::dynamic ? "dynamic NTK" : "longrope") +
             " RoPE (frequencies that depend on the sequence length) is not supported";
  for (const LayerProgram& l : p.layers) {
    const std::string at = who + "layer " + std::to_string(l.index) + ": ";
    for (const LayerStep& s : l.steps) {
      if ((s.op == StepOp::glu || s.op == StepOp::moe) &&
          std::find(caps.activations.begin(), caps.activations.end(), s.act) == caps.activations.end())
        return at + "the " + s.act + " activation is not supported";
      if (s.op == StepOp::moe && !caps.moe) return at + "mixture-of-experts layers are not supported";
      if (s.op == StepOp::mla && !caps.mla) return at + "multi-head latent attention is not supported";
      if ((s.op == StepOp::attention || s.op == StepOp::mla) && s.softcap != 0 && !caps.attention_softcap)
        return at + "attention logit soft-capping is not supported";
      if (s.op == StepOp::attention && s.dk != s.dv && !caps.attention_dv_differs)
        return at + "attention with value dims other than the key dims is not supported";
    }
  }
  return {};
}

}  // namespace rlh::sdk
