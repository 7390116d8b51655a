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
    ParamRole::k_norm,    ParamRole::o,        ParamRole::o_bias,    ParamRole::mlp_norm,
    ParamRole::gate,      ParamRole::up,       ParamRole::gate_bias, ParamRole::up_bias,
    ParamRole::down,      ParamRole::down_bias,
    // MoE: the shared expert's gate_proj and up adjacent (one [2Fs, C] GEMM)
    ParamRole::router,    ParamRole::router_bias, ParamRole::expert_score_bias,
    ParamRole::expert_gate, ParamRole::expert_up, ParamRole::expert_down,
    ParamRole::shared_expert_gate_proj, ParamRole::shared_expert_up, ParamRole::shared_expert_down,
    ParamRole::shared_expert_gate,
    // MLA
    ParamRole::q_a, ParamRole::q_a_norm, ParamRole::q_b, ParamRole::kv_a, ParamRole::kv_a_norm,
    ParamRole::kv_b};
constexpr ParamRole kGlobalOrder[] = {ParamRole::embed, ParamRole::lm_head, ParamRole::final_norm};

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
  if (!opt.ops)
    throw std::invalid_argument("engine: no kernels given (EngineOptions::ops: make_registry_ops over a kernel registry)");
  ops = opt.ops;
  V = desc.vocab_size;
  C = desc.hidden_size;
  L = desc.num_layers;
  if (V <= 0 || C <= 0 || L < 0 || int64_t(desc.layers.size()) != L)
    throw std::invalid_argument("engine: description has inconsistent sizes");
  if (desc.final_norm.kind != sdk::NormKind::rmsnorm) unsupported("final norm kind");

  // Layers: what the dense decoder executes.
  for (const sdk::LayerDesc& ld : desc.layers) {
    const auto& a = ld.attention;
    const std::string at = "layer " + std::to_string(ld.index) + ": ";
    if (a.kind != sdk::AttentionKind::gqa && a.kind != sdk::AttentionKind::mla)
      unsupported(at + "attention kind " + sdk::to_string(a.kind));
    if (ld.mlp.kind != sdk::MlpKind::dense && ld.mlp.kind != sdk::MlpKind::moe)
      unsupported(at + "MLP kind " + sdk::to_string(ld.mlp.kind));
    if (ld.mlp.hidden_act != "silu") unsupported(at + "hidden_act " + ld.mlp.hidden_act);
    if (ld.attn_norm.kind != sdk::NormKind::rmsnorm || ld.mlp_norm.kind != sdk::NormKind::rmsnorm)
      unsupported(at + "norm kind");
    if (a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads || a.head_dim <= 0)
      throw std::invalid_argument("engine: " + at + "bad head counts");
    LayerShape s;
    static_cast<LayerBasics&>(s) = layer_basics(desc, ld);
    s.Wqkv = (s.Hq + 2 * s.Hkv) * s.D;
    if (a.kind == sdk::AttentionKind::mla) describe_mla_layer(ld, s);  // sets D, Wqkv
    if (ld.mlp.kind == sdk::MlpKind::moe) describe_moe_layer(ld, s);  // sets F = 0
    shapes.push_back(s);
  }

  // RoPE: one inv_freq table unless it depends on the sequence length.
  if (desc.rope.kind != sdk::RopeKind::none && L > 0) {
    R = desc.rope.rotary_dim > 0 ? desc.rope.rotary_dim : shapes[0].D;
    for (const LayerShape& s : shapes)
      if (s.use_rope && R > s.D) throw std::invalid_argument("engine: rotary dims exceed head_dim");
    rope_scale = sdk::rope_attention_scaling(desc.rope);
    rope_interleaved = desc.rope.layout == sdk::RopeLayout::interleaved;
    rope_per_sequence =
        desc.rope.kind == sdk::RopeKind::dynamic || desc.rope.kind == sdk::RopeKind::longrope;
    const std::vector<double> f = sdk::rope_inv_freq(desc.rope, R);
    inv_freq = Buffer<float>(*alloc, f.size());
    for (size_t i = 0; i < f.size(); ++i) inv_freq[i] = float(f[i]);
  }
  carve_params();
}

// Parameters, then gradients of the same layout: one allocation each.
void Engine::Impl::carve_params() {
  const size_t n = desc.params.size();
  offset.assign(n, -1);
  std::vector<bool> placed(n, false);
  int64_t at = 0;
  auto place = [&](int64_t layer, ParamRole role) {
    const sdk::ParamDesc* p = desc.find_param(layer, role);
    if (!p) return;
    const size_t i = size_t(p - desc.params.data());
    offset[i] = at;
    placed[i] = true;
    at += numel(p->shape);
  };
  for (int64_t l = 0; l < L; ++l)
    for (ParamRole r : kLayerOrder) place(l, r);
  for (ParamRole r : kGlobalOrder) place(-1, r);
  for (size_t i = 0; i < n; ++i)
    if (!placed[i])
      unsupported("parameter " + desc.params[i].name + " (role " +
                  sdk::to_string(desc.params[i].role) + ")");
  total = at;
  params = Buffer<float>(*alloc, size_t(total));
  grads = Buffer<float>(*alloc, size_t(total));
  std::memset(params.data(), 0, size_t(total) * sizeof(float));
  std::memset(grads.data(), 0, size_t(total) * sizeof(float));

  // Resolve pointers, checking shapes against the description's sizes.
  auto resolve = [&](float* base, ModelParams& M) {
    auto get = [&](int64_t layer, ParamRole role, std::vector<int64_t> shape,
                   bool required) -> float* {
      const sdk::ParamDesc* p = desc.find_param(layer, role);
      if (!p) {
        if (required)
          throw std::invalid_argument("engine: missing parameter of role " +
                                      std::string(sdk::to_string(role)) + " in layer " +
                                      std::to_string(layer));
        return nullptr;
      }
      if (p->shape != shape) throw std::invalid_argument("engine: parameter " + p->name + " has an unexpected shape");
      return base + offset[size_t(p - desc.params.data())];
    };
    M.embed = get(-1, ParamRole::embed, {V, C}, true);
    M.final_norm = get(-1, ParamRole::final_norm, {C}, true);
    M.lm_head = desc.tie_word_embeddings ? M.embed : get(-1, ParamRole::lm_head, {V, C}, true);
    M.layers.assign(size_t(L), LayerParams{});
    for (int64_t l = 0; l < L; ++l) {
      const LayerShape& s = shapes[size_t(l)];
      LayerParams& p = M.layers[size_t(l)];
      const int64_t qo = s.Hq * s.D, kvo = s.Hkv * s.D;
      p.attn_norm = get(l, ParamRole::attn_norm, {C}, true);
      if (s.mla) {
        const int64_t qk = s.Hq * s.D;
        p.q_a = get(l, ParamRole::q_a, {s.rq, C}, s.rq > 0);
        p.q_a_norm = get(l, ParamRole::q_a_norm, {s.rq}, s.rq > 0);
        p.q_b = get(l, ParamRole::q_b, {qk, s.rq}, s.rq > 0);
        p.wqkv = get(l, ParamRole::q, {qk, C}, s.rq == 0);
        p.kv_a = get(l, ParamRole::kv_a, {s.rkv + s.dr, C}, true);
        p.kv_a_norm = get(l, ParamRole::kv_a_norm, {s.rkv}, true);
        p.kv_b = get(l, ParamRole::kv_b, {s.Hq * (s.dn + s.dv), s.rkv}, true);
        p.wo = get(l, ParamRole::o, {C, s.Hq * s.dv}, true);
      } else {
      p.wqkv = get(l, ParamRole::q, {qo, C}, true);
      float* wk = get(l, ParamRole::k, {kvo, C}, true);
      float* wv = get(l, ParamRole::v, {kvo, C}, true);
      if (wk != p.wqkv + qo * C || wv != wk + kvo * C)
        throw std::logic_error("engine: q/k/v are not adjacent in storage");
      p.bq = get(l, ParamRole::q_bias, {qo}, false);
      p.bk = get(l, ParamRole::k_bias, {kvo}, false);
      p.bv = get(l, ParamRole::v_bias, {kvo}, false);
      p.q_norm = get(l, ParamRole::q_norm, {s.D}, s.qk_norm);
      p.k_norm = get(l, ParamRole::k_norm, {s.D}, s.qk_norm);
      p.wo = get(l, ParamRole::o, {C, qo}, true);
      p.bo = get(l, ParamRole::o_bias, {C}, false);
      }
      p.mlp_norm = get(l, ParamRole::mlp_norm, {C}, true);
      if (s.moe) {
        p.router = get(l, ParamRole::router, {s.E, C}, true);
        p.router_b = get(l, ParamRole::router_bias, {s.E}, s.router_bias);
        p.score_bias = get(l, ParamRole::expert_score_bias, {s.E}, s.score_bias);
        p.we_gate = get(l, ParamRole::expert_gate, {s.E, s.Fe, C}, true);
        p.we_up = get(l, ParamRole::expert_up, {s.E, s.Fe, C}, true);
        p.we_down = get(l, ParamRole::expert_down, {s.E, C, s.Fe}, true);
        if (s.Fs > 0) {
          p.ws_gu = get(l, ParamRole::shared_expert_gate_proj, {s.Fs, C}, true);
          float* su = get(l, ParamRole::shared_expert_up, {s.Fs, C}, true);
          if (su != p.ws_gu + s.Fs * C)
            throw std::logic_error("engine: shared expert gate/up are not adjacent in storage");
          p.ws_down = get(l, ParamRole::shared_expert_down, {C, s.Fs}, true);
          p.ws_gate = get(l, ParamRole::shared_expert_gate, {1, C}, s.shared_gate);
        }
        continue;
      }
      p.wgu = get(l, ParamRole::gate, {s.F, C}, true);
      float* wup = get(l, ParamRole::up, {s.F, C}, true);
      if (wup != p.wgu + s.F * C) throw std::logic_error("engine: gate/up are not adjacent in storage");
      p.bgate = get(l, ParamRole::gate_bias, {s.F}, false);
      p.bup = get(l, ParamRole::up_bias, {s.F}, false);
      p.wdown = get(l, ParamRole::down, {C, s.F}, true);
      p.bdown = get(l, ParamRole::down_bias, {C}, false);
    }
  };
  resolve(params.data(), P);
  resolve(grads.data(), G);

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

// One allocation for a micro-batch of N tokens. save_all: every layer keeps its activations for
// the backward; otherwise only the layer inputs xs[l] are kept and one layer set is reused.
void Engine::Impl::plan_acts(int64_t N, bool save_all, int64_t kraw) {
  // A plan that keeps every layer also serves a forward-only pass: alternating logprob passes
  // and train steps (the RL loop) then never reallocates.
  if (N <= acts_tokens && kraw <= acts_kraw && (acts_saved_all || !save_all) &&
      (!layer_acts.empty() || L == 0)) {
    head.kraw = kraw;
    target_raw = kraw > 1 ? ints.data() + 2 * acts_tokens : target;
    return;
  }
  int64_t max_wqkv = 0, max_att = 0, max_f = 0;
  for (const LayerShape& s : shapes) {
    max_wqkv = std::max(max_wqkv, s.Wqkv);
    max_att = std::max(max_att, s.Hq * s.D);
    max_f = std::max(max_f, s.F);
  }
  // Sizes in floats; a layer set holds every field of LayerActs but x.
  auto layer_floats = [&](const LayerShape& s) {
    int64_t f = 0;
    f += N * C + N;                                                   // xn1, rstd1
    f += N * s.Wqkv;                                                  // qkv
    if (s.qk_norm) f += N * (s.Hq + s.Hkv) * s.D + (s.Hq + s.Hkv) * N;  // qk, rstd_q, rstd_k
    f += N * s.Hq * s.D + s.Hq * N;                                   // att, lse
    f += N * C + N * C + N;                                           // h, xn2, rstd2
    f += N * 2 * s.F + N * s.F;                                       // gu, a
    return f;
  };
  int64_t total_f = (L + 1) * N * C;  // xs
  if (save_all) {
    for (const LayerShape& s : shapes) total_f += layer_floats(s);
  } else {
    int64_t worst = 0;
    for (const LayerShape& s : shapes) worst = std::max(worst, layer_floats(s));
    total_f += worst;
  }
  total_f += N * C + N;         // head xn, rstd (its x is xs[L])
  total_f += 6 * N + 2 * N * kraw;  // lp, dlp [N,kraw]; lse, ent, lp_proc, lse_proc, dent, dlp_proc
  total_f += 2 * N * C + N * max_wqkv + N * max_att + 2 * N * max_f + N * max_f;  // GradActs

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
  auto carve_layer = [&](const LayerShape& s) {
    LayerActs a;
    a.xn1 = take(N * C);
    a.rstd1 = take(N);
    a.qkv = take(N * s.Wqkv);
    if (s.qk_norm) {
      a.qk = take(N * (s.Hq + s.Hkv) * s.D);
      a.rstd_q = take(s.Hq * N);
      a.rstd_k = take(s.Hkv * N);
    }
    a.att = take(N * s.Hq * s.D);
    a.lse = take(s.Hq * N);
    a.h = take(N * C);
    a.xn2 = take(N * C);
    a.rstd2 = take(N);
    a.gu = take(N * 2 * s.F);
    a.a = take(N * s.F);
    return a;
  };
  if (save_all) {
    for (const LayerShape& s : shapes) layer_acts.push_back(carve_layer(s));
  } else if (L > 0) {
    // The largest layer's set, with every optional field present, serves all layers.
    LayerShape worst = shapes[0];
    int64_t best = -1;
    for (const LayerShape& s : shapes)
      if (layer_floats(s) > best) {
        best = layer_floats(s);
        worst = s;
      }
    layer_acts.push_back(carve_layer(worst));
  }
  head.x = xs[size_t(L)];
  head.xn = take(N * C);
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
  grad_acts.dres = take(N * C);
  grad_acts.dxn = take(N * C);
  grad_acts.dqkv = take(N * max_wqkv);
  grad_acts.datt = take(N * max_att);
  grad_acts.dgu = take(N * 2 * max_f);
  grad_acts.da = take(N * max_f);
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

}  // namespace rlh::engine
