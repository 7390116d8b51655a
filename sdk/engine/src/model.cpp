// The engine's storage: validating the description, carving parameters/gradients out of single
// allocations, and laying out the activations of a micro-batch.
#include "model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace rlh::engine {

using sdk::ParamRole;

namespace {

[[noreturn]] void unsupported(const std::string& what) {
  throw std::invalid_argument("engine: " + what + " is not supported by the engine");
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Order of a layer's parameters in storage (engine.hpp): q,k,v adjacent (one [Wqkv, C] matrix)
// and gate,up adjacent (one [2F, C] matrix).
constexpr ParamRole kLayerOrder[] = {
    ParamRole::attn_norm, ParamRole::q,        ParamRole::k,         ParamRole::v,
    ParamRole::q_bias,    ParamRole::k_bias,   ParamRole::v_bias,    ParamRole::q_norm,
    ParamRole::k_norm,    ParamRole::o,        ParamRole::o_bias,    ParamRole::post_attn_norm,
    ParamRole::mlp_norm,
    ParamRole::gate,      ParamRole::up,       ParamRole::gate_bias, ParamRole::up_bias,
    ParamRole::down,      ParamRole::down_bias, ParamRole::post_mlp_norm,
    // MoE: the shared expert's gate_proj and up adjacent (one [2Fs, C] GEMM)
    ParamRole::router,    ParamRole::router_bias, ParamRole::expert_score_bias,
    ParamRole::expert_gate, ParamRole::expert_up, ParamRole::expert_down,
    ParamRole::shared_expert_gate_proj, ParamRole::shared_expert_up, ParamRole::shared_expert_down,
    ParamRole::shared_expert_gate,
    // MLA
    ParamRole::q_a, ParamRole::q_a_norm, ParamRole::q_b, ParamRole::kv_a, ParamRole::kv_a_norm,
    ParamRole::kv_b};
constexpr ParamRole kGlobalOrder[] = {ParamRole::embed, ParamRole::lm_head, ParamRole::final_norm,
                                      ParamRole::value_head};

}  // namespace

LayerBasics layer_basics(const sdk::TransformerDesc& desc, const sdk::LayerDesc& ld) {
  const sdk::AttentionDesc& a = ld.attention;
  LayerBasics s;
  s.Hq = a.num_heads;
  s.Hkv = a.num_kv_heads;
  s.D = a.head_dim;
  s.F = ld.mlp.kind == sdk::MlpKind::dense ? ld.mlp.intermediate_size : 0;
  s.eps_attn = float(ld.attn_norm.eps);
  s.off_attn = float(ld.attn_norm.weight_offset);
  s.eps_mlp = float(ld.mlp_norm.eps);
  s.off_mlp = float(ld.mlp_norm.weight_offset);
  s.qk_norm = a.qk_norm;
  s.use_rope = a.use_rope && desc.rope.kind != sdk::RopeKind::none;
  s.window = a.sliding_window;
  s.scale = float(a.softmax_scale > 0 ? a.softmax_scale : 1.0 / std::sqrt(double(s.D)));
  return s;
}

MoeBasics moe_basics(const sdk::LayerDesc& ld, const MoeOptions& o, const std::string& at) {
  const sdk::MoeDesc& m = ld.mlp.moe;
  if (m.num_experts <= 0 || m.top_k <= 0 || m.top_k > m.num_experts ||
      m.expert_intermediate_size <= 0 || m.shared_expert_intermediate_size < 0)
    throw std::invalid_argument(at + "MoE sizes must satisfy 0 < top_k <= experts, ffn > 0");
  if (m.top_k > 64 || m.n_group > 64)
    throw std::invalid_argument(at + "top_k and n_group above 64 are not supported by the engine");
  // DeepSeek's group-limited routing: a group scores the sum of its two best selection scores,
  // the topk_group best groups stay.
  if (m.n_group < 1 || m.num_experts % m.n_group || m.topk_group < 1 || m.topk_group > m.n_group)
    throw std::invalid_argument(at + "n_group must divide the experts, 1 <= topk_group <= n_group");
  MoeBasics b;
  b.E = m.num_experts;
  b.Kx = m.top_k;
  b.Fe = m.expert_intermediate_size;
  b.Fs = m.shared_expert_intermediate_size;
  b.shared_gate = m.shared_expert_gate && b.Fs > 0;
  b.score_bias = m.e_score_correction_bias;
  b.router_bias = m.router_bias;
  b.scoring = m.scoring == sdk::MoeScoring::sigmoid ? 1 : 0;
  b.norm_topk_prob = m.norm_topk_prob;
  b.scaling_factor = m.routed_scaling_factor;
  b.n_group = m.n_group;
  b.topk_group = m.topk_group;
  const bool aux = o.load_balancing != MoeOptions::LoadBalancing::none && o.aux_loss_coef != 0;
  if ((aux || o.z_loss_coef != 0) && b.scoring != 0)
    throw std::invalid_argument(at + "the load-balancing and z losses are not supported by the "
                                "engine with sigmoid router scores");
  return b;
}

MlaBasics mla_basics(const sdk::LayerDesc& ld, const std::string& at) {
  const sdk::AttentionDesc& a = ld.attention;
  if (a.kv_lora_rank <= 0 || a.qk_rope_head_dim <= 0 || a.qk_nope_head_dim < 0 ||
      a.v_head_dim <= 0 || a.q_lora_rank < 0)
    throw std::invalid_argument(at + "MLA needs kv_lora_rank, qk_rope_head_dim, v_head_dim > 0");
  if (a.v_head_dim > a.qk_nope_head_dim + a.qk_rope_head_dim)
    throw std::invalid_argument(at + "v_head_dim above the q/k head dim is not supported by the engine");
  if (a.q_bias || a.k_bias || a.v_bias || a.o_bias || a.qk_norm)
    throw std::invalid_argument(at + "MLA with biases or q/k norms is not supported by the engine");
  return MlaBasics{a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim};
}

std::span<const ParamRole> layer_param_order() { return kLayerOrder; }
std::span<const ParamRole> global_param_order() { return kGlobalOrder; }

Engine::Impl::Impl(sdk::TransformerDesc d, EngineOptions o) : desc(std::move(d)), opt(o) {
  alloc = opt.allocator ? opt.allocator : &own_alloc;
  state_alloc = opt.state_allocator ? opt.state_allocator : alloc;
  store = opt.units;
  if (!opt.ops)
    throw std::invalid_argument("engine: no kernels given (EngineOptions::ops: make_registry_ops over a kernel registry)");
  ops = opt.ops;
  tp_on = opt.tp != nullptr && opt.tp->size > 1;
  if (tp_on) {
    // This rank's part: its description, then its program with the communication marked.
    if (opt.tp_comm == nullptr) throw std::invalid_argument("engine: tensor parallelism needs its group (tp_comm)");
    if (store != nullptr) throw std::invalid_argument("engine: tensor parallelism with a UnitStore (FSDP) is not supported");
    if (desc.params.size() != opt.tp->full.params.size())
      throw std::invalid_argument("engine: the tensor-parallel layout is of another model");
    desc = opt.tp->local;
    Vall = opt.tp->vocab;
    vlo = opt.tp->vocab_begin;
    vcount = opt.tp->vocab_count;
  }
  ep_on = opt.ep != nullptr && opt.ep->size > 1;
  if (ep_on) {
    // This rank's block of experts: its description, then its program with the MoE steps marked.
    if (opt.ep_comm == nullptr) throw std::invalid_argument("engine: expert parallelism needs its group (ep_comm)");
    if (store != nullptr) throw std::invalid_argument("engine: expert parallelism with a UnitStore (FSDP) is not supported");
    // With tensor parallelism and the experts whole on their ep rank (Megatron's
    // expert_tensor_parallel_size = 1) or cut over an etp group smaller than the tp group, under
    // sequence parallelism: each tp rank routes its own rows (the etp group gathers the rows its
    // experts receive: ep_dispatch.cpp). With the experts cut over the tp group (etp = tp) the
    // MoE block is tensor parallelism's, its rows dispatched over an ep group of ranks of one tp
    // rank.
    if (tp_on) {
      const bool own = opt.tp->expert_size < opt.tp->size;
      if (own && !opt.sequence_parallel)
        throw std::invalid_argument(std::string("engine: expert parallelism with tensor parallelism and the experts ") +
                                    (opt.tp->expert_size == 1 ? "whole on each rank" : "cut over fewer ranks than the tp group") +
                                    " needs sequence parallelism (each tensor-parallel rank dispatches its own rows)");
      moe_own_rows = own;
      if (own && opt.tp->expert_size > 1) {
        if (opt.etp_comm == nullptr)
          throw std::invalid_argument("engine: experts cut over " + std::to_string(opt.tp->expert_size) +
                                      " of the tensor-parallel ranks need their group (etp_comm)");
        etp_size = opt.tp->expert_size;
        etp_rank = opt.tp->expert_rank;
      }
    }
    if (desc.params.size() != opt.ep->full.params.size())
      throw std::invalid_argument("engine: the expert-parallel layout is of another model");
    desc = opt.ep->local;
    ep_size = opt.ep->size;
    ep_rank = opt.ep->rank;
  }
  pp_on = opt.pp != nullptr && opt.pp->size > 1;
  if (pp_on) {
    // This stage's description; under tensor parallelism the pieces follow its parameters.
    if (store != nullptr) throw std::invalid_argument("engine: pipeline parallelism with a UnitStore (FSDP) is not supported");
    if (desc.params.size() != opt.pp->local_index.size())
      throw std::invalid_argument("engine: the pipeline layout is of another model");
    desc = opt.pp->local;
    if (tp_on) {
      tp_stage = *opt.tp;
      tp_stage.local = desc;
      tp_stage.pieces.clear();
      for (int64_t i : opt.pp->full_index) tp_stage.pieces.push_back(opt.tp->pieces.at(size_t(i)));
      opt.tp = &tp_stage;
    }
  }
  if (tp_on || (pp_on && opt.pp->shares_embedding && !opt.pp->first)) {
    norm_w.assign(desc.params.size(), 1.0);
    for (size_t i = 0; i < desc.params.size(); ++i) {
      if (tp_on) norm_w[i] = opt.tp->pieces[i].norm_weight;
      if (pp_on && int64_t(i) == opt.pp->embed_local && !opt.pp->first) norm_w[i] = 0;  // the first stage's counts
    }
  }
  try {
    prog = pp_on ? sdk::build_stage_program(desc, opt.pp->first, opt.pp->last) : sdk::build_program(desc);
    if (tp_on) sdk::mark_tensor_parallel(prog, *opt.tp);
    if (ep_on) sdk::mark_expert_parallel(prog, *opt.ep);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("engine: ") + e.what());
  }
  cp_on = opt.cp_comm != nullptr && opt.cp_comm->size() > 1;
  // A stage's boundary carries this rank's rows of the cp split (stage_rows), under sequence
  // parallelism its block of them.
  if (cp_on) {
    cp = opt.cp_comm->size();
    cp_rank = opt.cp_comm->rank();
    if (store != nullptr) throw std::invalid_argument("engine: context parallelism with a UnitStore (FSDP) is not supported");
  }
  sdk::ExecutorCaps caps;
  caps.name = cp_on ? "engine under context parallelism" : "engine";
  caps.activations = {"silu", "gelu_tanh", "gelu"};
  // Under context parallelism MoE layers route each rank's tokens (their counts summed over the
  // group, moe.cpp) and MLA attends through cp_attention.cpp; a per-sequence RoPE table depends
  // on the whole sequence's length, which the split hides.
  caps.moe = caps.mla = true;
  // Soft-capping (Gemma-2) runs in the registry's attention and head ops, in the loops of the
  // attention under context parallelism (cp_attention.cpp) and in the vocabulary-parallel head
  // (tp_head.cpp).
  caps.attention_softcap = true;
  caps.logit_softcap = true;
  caps.per_sequence_rope = !cp_on && !(tp_on && opt.sequence_parallel);  // padding would change its length
  caps.attention_dv_differs = true;
  caps.value_head = true;
  caps.tensor_parallel = true;
  caps.expert_parallel = true;
  caps.pipeline_stage = true;
  if (const std::string why = sdk::unsupported(prog, caps); !why.empty()) throw std::invalid_argument(why);
  sp_on = tp_on && opt.sequence_parallel;
  sp_whole_rows.assign(desc.params.size(), false);
  if (sp_on)  // the gathers and scatters run on whole values (sequence_parallel.cpp)
    for (const sdk::LayerProgram& lp : prog.layers)
      for (const sdk::LayerStep& st : lp.steps) {
        if (st.op == sdk::StepOp::moe || st.op == sdk::StepOp::mla)
          for (const int64_t i : st.weights) {
            // The router of a block that routes this rank's rows only has a partial gradient.
            const sdk::ParamRole r = desc.params[size_t(i)].role;
            sp_whole_rows[size_t(i)] =
                !(moe_own_rows && (r == sdk::ParamRole::router || r == sdk::ParamRole::router_bias));
          }
        const bool in_whole = st.in.col == 0 && lp.values[size_t(st.in.value)].width == st.in.width;
        const bool out_whole = st.out.col == 0 && lp.values[size_t(st.out.value)].width == st.out.width;
        if ((st.tp_reduce_din && (!in_whole || st.accumulate)) || (st.tp_reduce_out && !out_whole))
          throw std::invalid_argument("engine: layer " + std::to_string(lp.index) +
                                      ": this layer's linears are not supported under sequence parallelism");
      }
  V = prog.vocab;
  if (!tp_on) Vall = V, vcount = V;
  C = prog.hidden;
  L = int64_t(prog.layers.size());
  run_whole();
  ep_acts.assign(ep_on ? size_t(std::max<int64_t>(L, 1)) : 0, EpActs{});
  moe_counts.assign(size_t(std::max<int64_t>(L, 1)), {});

  // MoE and MLA layers: their composite steps' readings.
  shapes.assign(size_t(L), LayerShape{});
  for (int64_t l = 0; l < L; ++l)
    for (const sdk::LayerStep& st : prog.layers[size_t(l)].steps) {
      if (st.op == sdk::StepOp::moe) describe_moe_layer(desc.layers[size_t(l)], st, shapes[size_t(l)]);
      if (st.op == sdk::StepOp::mla) describe_mla_layer(desc.layers[size_t(l)], st, shapes[size_t(l)]);
    }

  // RoPE tables (per-sequence kinds compute theirs per sequence).
  for (const sdk::RopeTable& t : prog.ropes) {
    RopeState r;
    r.table = &t;
    r.R = t.rotary_dim;
    r.scale = t.scale;
    r.interleaved = t.interleaved;
    r.per_sequence = t.per_sequence;
    const std::vector<double> f = sdk::rope_inv_freq(t.rope, t.rotary_dim);
    r.inv_freq = Buffer<float>(*alloc, f.size());
    for (size_t i = 0; i < f.size(); ++i) r.inv_freq[i] = float(f[i]);
    ropes.push_back(std::move(r));
  }
  carve_params();
}

// Parameters, then gradients of the same layout: one allocation each (none with a UnitStore).
void Engine::Impl::carve_params() {
  const size_t n = desc.params.size();
  offset.assign(n, -1);
  unit_of.assign(n, -1);
  unit_begin.assign(size_t(L) + 2, 0);
  std::vector<bool> placed(n, false);
  int64_t at = 0;
  auto place = [&](int64_t layer, ParamRole role, int64_t unit) {
    const sdk::ParamDesc* p = desc.find_param(layer, role);
    if (!p) return;
    const size_t i = size_t(p - desc.params.data());
    offset[i] = at;
    unit_of[i] = int32_t(unit);
    placed[i] = true;
    at += numel(p->shape);
  };
  // Expert parallelism: the routed experts apart, after everything else (their gradients are
  // reduced over another group), each region padded for the owner's equal blocks.
  const auto apart = [&](ParamRole r) {
    return ep_on && sdk::ep_split_of(r) == sdk::EpSplit::experts;
  };
  const auto pad = [](int64_t n, int64_t m) { m = std::max<int64_t>(1, m); return (n + m - 1) / m * m; };
  for (int64_t l = 0; l < L; ++l) {
    unit_begin[size_t(l)] = at;
    for (ParamRole r : kLayerOrder)
      if (!apart(r)) place(l, r, l);
  }
  unit_begin[size_t(L)] = at;
  for (ParamRole r : kGlobalOrder) place(-1, r, L);
  unit_begin[size_t(L) + 1] = at;
  if (ep_on) {
    at = pad(at, opt.pad_storage_to);
    expert_begin = at;
    for (int64_t l = 0; l < L; ++l)
      for (ParamRole r : kLayerOrder)
        if (apart(r)) place(l, r, L);  // (w() and g() reach them through the global unit's base)
    at = pad(at, opt.pad_experts_to);
  }
  for (size_t i = 0; i < n; ++i)
    if (!placed[i])
      unsupported("parameter " + desc.params[i].name + " (role " +
                  sdk::to_string(desc.params[i].role) + ")");
  total = at;
  if (!ep_on) expert_begin = expert_end = total;
  else expert_end = total;
  pu.assign(size_t(L) + 1, nullptr);
  gu.assign(size_t(L) + 1, nullptr);
  p_held.assign(size_t(L) + 1, 0);
  g_held.assign(size_t(L) + 1, 0);
  P.assign(size_t(L), LayerParams{});
  G.assign(size_t(L), LayerParams{});
  if (store == nullptr) {
    const int64_t m = std::max<int64_t>(1, opt.pad_storage_to);
    const size_t padded = size_t((total + m - 1) / m * m);
    params = Buffer<float>(*state_alloc, padded);
    grads = Buffer<float>(*state_alloc, padded);
    std::memset(params.data(), 0, padded * sizeof(float));
    std::memset(grads.data(), 0, padded * sizeof(float));
    for (int64_t u = 0; u <= L; ++u) {
      pu[size_t(u)] = params.data() + unit_begin[size_t(u)];
      gu[size_t(u)] = grads.data() + unit_begin[size_t(u)];
    }
    for (int64_t l = 0; l < L; ++l) {
      P[size_t(l)] = layer_params(l, false);
      G[size_t(l)] = layer_params(l, true);
    }
  }

  // Optimizer runs: tensors in storage order, merged while trainable/decay agree.
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return offset[a] < offset[b]; });
  runs.clear();
  for (size_t i : order) {
    const sdk::ParamDesc& p = desc.params[i];
    const bool decay = opt.optimizer.decay_1d_params || p.shape.size() > 1;
    // freeze_moe_router: the router is a buffer for the optimizer (no update, no gradient norm).
    const bool frozen = opt.moe.freeze_router &&
                        (p.role == ParamRole::router || p.role == ParamRole::router_bias);
    const bool trainable = p.trainable && !frozen;
    const int64_t b = offset[i], e = b + numel(p.shape);
    if (!runs.empty() && runs.back().end == b && runs.back().trainable == trainable &&
        runs.back().decay == decay)
      runs.back().end = e;
    else
      runs.push_back(Run{b, e, trainable, decay});
  }
}

// MoE / MLA pointers (shapes were checked by the program).
LayerParams Engine::Impl::layer_params(int64_t l, bool grads_of) const {
  auto get = [&](ParamRole role) -> float* {
    const sdk::ParamDesc* p = desc.find_param(l, role);
    if (!p) return nullptr;
    const int64_t i = p - desc.params.data();
    return grads_of ? g(i) : w(i);
  };
  const LayerShape& s = shapes[size_t(l)];
  LayerParams p;
  if (s.mla) {
    p.q_a = get(ParamRole::q_a);
    p.q_a_norm = get(ParamRole::q_a_norm);
    p.q_b = get(ParamRole::q_b);
    p.wq = get(ParamRole::q);
    p.kv_a = get(ParamRole::kv_a);
    p.kv_a_norm = get(ParamRole::kv_a_norm);
    p.kv_b = get(ParamRole::kv_b);
  }
  if (s.moe) {
    p.router = get(ParamRole::router);
    p.router_b = get(ParamRole::router_bias);
    p.score_bias = get(ParamRole::expert_score_bias);
    p.we_gate = get(ParamRole::expert_gate);
    p.we_up = get(ParamRole::expert_up);
    p.we_down = get(ParamRole::expert_down);
    if (s.Fs > 0) {
      p.ws_gu = get(ParamRole::shared_expert_gate_proj);
      if (get(ParamRole::shared_expert_up) != p.ws_gu + s.Fs * C)
        throw std::logic_error("engine: shared expert gate/up are not adjacent in storage");
      p.ws_down = get(ParamRole::shared_expert_down);
      p.ws_gate = get(ParamRole::shared_expert_gate);
    }
  }
  return p;
}

void Engine::Impl::use_params(int64_t u) {
  if (store == nullptr || p_held[size_t(u)]) return;
  pu[size_t(u)] = store->acquire_params(u);
  p_held[size_t(u)] = 1;
  if (u < L) P[size_t(u)] = layer_params(u, false);
}
void Engine::Impl::drop_params(int64_t u) {
  if (store == nullptr || !p_held[size_t(u)]) return;
  p_held[size_t(u)] = 0;
  pu[size_t(u)] = nullptr;
  store->release_params(u);
}
void Engine::Impl::use_grads(int64_t u) {
  if (store == nullptr || g_held[size_t(u)]) return;
  gu[size_t(u)] = store->acquire_grads(u);
  g_held[size_t(u)] = 1;
  if (u < L) G[size_t(u)] = layer_params(u, true);
}
void Engine::Impl::drop_grads(int64_t u) {
  if (store == nullptr || !g_held[size_t(u)]) return;
  g_held[size_t(u)] = 0;
  gu[size_t(u)] = nullptr;
  store->release_grads(u);
}
void Engine::Impl::forget_units() {
  if (store == nullptr) return;
  std::fill(p_held.begin(), p_held.end(), 0);
  std::fill(g_held.begin(), g_held.end(), 0);
  std::fill(pu.begin(), pu.end(), nullptr);
  std::fill(gu.begin(), gu.end(), nullptr);
}

// One allocation for a micro-batch of N tokens. save_all: every layer keeps its program values
// and statistics for the backward; otherwise only the layer inputs xs[l] are kept and one set,
// as wide as the widest layer's, is reused (the layer is re-run inside the backward).
void Engine::Impl::plan_acts(int64_t N, bool save_all, int64_t kraw) {
  // A plan that keeps every layer also serves a forward-only pass: alternating logprob passes
  // and train steps (the RL loop) then never reallocates.
  if (N <= acts_tokens && kraw <= acts_kraw && (acts_saved_all || !save_all) &&
      (!layer_acts.empty() || L == 0)) {
    head.kraw = kraw;
    target_raw = kraw > 1 ? ints.data() + 2 * acts_tokens : target;
    return;
  }
  // Floats of one layer's own storage: every value that is a storage root, except the layer
  // input and output (the residual stream xs), and every statistic.
  auto layer_floats = [&](const sdk::LayerProgram& lp) {
    int64_t f = 0;
    const int out_root = lp.root(lp.output);
    for (size_t v = 1; v < lp.values.size(); ++v)
      if (lp.values[v].storage < 0 && int(v) != out_root) f += N * lp.values[v].width;
    for (int64_t rows : lp.stat_rows) f += N * rows;
    return f;
  };
  int64_t total_f = (L + 1) * N * C;  // xs
  int64_t worst = 0;  // the largest layer: the shared block under recompute
  for (const sdk::LayerProgram& lp : prog.layers) {
    const int64_t f = layer_floats(lp);
    if (save_all) total_f += f;
    worst = std::max(worst, f);
  }
  if (!save_all) total_f += worst;
  for (int64_t w : prog.grad_widths) total_f += N * w;
  total_f += 2 * N * C + N;         // head xn, dxn, rstd (its x is xs[L])
  total_f += 6 * N + 2 * N * kraw;  // lp, dlp [N,kraw]; lse, ent, lp_proc, lse_proc, dent, dlp_proc
  total_f += 2 * N;                 // val, dval

  layer_acts.clear();
  acts.reset();
  ints.reset();
  acts = Buffer<float>(*alloc, size_t(total_f));
  ints = Buffer<int32_t>(*alloc, size_t(2 * N + (kraw > 1 ? N * kraw : 0)));
  float* at = acts.data();
  auto take = [&](int64_t n) {
    float* p = at;
    at += n;
    return p;
  };
  xs.assign(size_t(L + 1), nullptr);
  for (int64_t l = 0; l <= L; ++l) xs[size_t(l)] = take(N * C);
  shared_block = nullptr;
  if (save_all) {
    for (size_t l = 0; l < prog.layers.size(); ++l)
      layer_acts.push_back(carve_layer(prog.layers[l], take(layer_floats(prog.layers[l])), N));
  } else if (L > 0) {
    shared_block = take(worst);  // each layer carves its own view of it when it runs (acts_of)
  }
  gbuf.clear();
  for (int64_t w : prog.grad_widths) gbuf.push_back(take(N * w));
  head.x = xs[size_t(L)];
  head.xn = take(N * C);
  head.dxn = take(N * C);
  head.rstd = take(N);
  head.kraw = kraw;
  head.lp = take(N * kraw);
  head.lse = take(N);
  head.ent = take(N);
  head.lp_proc = take(N);
  head.lse_proc = take(N);
  head.dlp = take(N * kraw);
  head.dent = take(N);
  head.dlp_proc = take(N);
  head.val = take(N);
  head.dval = take(N);
  if (at != acts.data() + total_f) throw std::logic_error("engine: activation plan mismatch");
  pos = ints.data();
  target = ints.data() + N;
  target_raw = kraw > 1 ? ints.data() + 2 * N : target;
  acts_tokens = N;
  acts_kraw = kraw;
  acts_saved_all = save_all;
  plan_moe(N, save_all);
  plan_mla(N, save_all);
}

// Pointers of one layer's values and statistics for N tokens, carved from `block` in the order
// plan_acts counts them; the layer input and output are bound by acts_of.
LayerActs Engine::Impl::carve_layer(const sdk::LayerProgram& lp, float* block, int64_t N) const {
  LayerActs a;
  a.v.assign(lp.values.size(), nullptr);
  const int out_root = lp.root(lp.output);
  float* p = block;
  for (size_t v = 1; v < lp.values.size(); ++v)
    if (lp.values[v].storage < 0 && int(v) != out_root) {
      a.v[v] = p;
      p += N * lp.values[v].width;
    }
  for (int64_t rows : lp.stat_rows) {
    a.stat.push_back(p);
    p += N * rows;
  }
  return a;
}

LayerActs Engine::Impl::acts_of(int64_t l) {
  const sdk::LayerProgram& lp = prog.layers[size_t(l)];
  LayerActs a = acts_saved_all ? layer_acts[size_t(l)] : carve_layer(lp, shared_block, acts_tokens);
  const int out_root = lp.root(lp.output);
  a.v[0] = xs[size_t(l)];
  a.v[size_t(out_root)] = xs[size_t(l) + 1];
  for (size_t v = 1; v < lp.values.size(); ++v)
    if (lp.values[v].storage >= 0) a.v[v] = a.v[size_t(lp.root(int(v)))];
  return a;
}

}  // namespace rlh::engine
