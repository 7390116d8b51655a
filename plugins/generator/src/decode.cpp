// The forward of one scheduler step (DecodeModel::forward): embedding, decoder layers over the
// paged KV cache, and the logits of the rows that sample. One op per line, in the engine's order
// (sdk/engine/src/forward.cpp), so the two compute the same function of the same weights.
#include <algorithm>
#include <cstring>
#include <string>

#include "rlhost/generator/linear.hpp"
#include "rlhost/generator/model.hpp"
#include "rlhost/generator/worker_pool.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::gen {

using sdk::Error;
using sdk::ParamRole;

DecodeModel::DecodeModel(sdk::TransformerDesc desc, engine::Ops* ops) : desc_(std::move(desc)) {
  shapes_ = layer_shapes(desc_);
  V_ = desc_.vocab_size;
  C_ = desc_.hidden_size;
  L_ = desc_.num_layers;
  if (!ops) throw Error(RLH_E_INVALID_ARGUMENT, "generator: no kernels given");
  ops_ = ops;
  // Every parameter the forward reads must exist with the shape it reads it as.
  auto check = [&](int64_t layer, ParamRole role, std::vector<int64_t> shape, bool required) {
    const sdk::ParamDesc* p = desc_.find_param(layer, role);
    if (!p) {
      if (required)
        throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator: missing parameter of role ") + sdk::to_string(role) +
                                                (layer >= 0 ? " in layer " + std::to_string(layer) : std::string()));
      return;
    }
    if (p->shape != shape) throw Error(RLH_E_INVALID_ARGUMENT, "generator: parameter " + p->name + " has an unexpected shape");
  };
  check(-1, ParamRole::embed, {V_, C_}, true);
  check(-1, ParamRole::final_norm, {C_}, true);
  if (!desc_.tie_word_embeddings) check(-1, ParamRole::lm_head, {V_, C_}, true);
  for (int64_t l = 0; l < L_; ++l) {
    const LayerShape& s = shapes_[size_t(l)];
    const int64_t qo = s.Hq * s.D, kvo = s.Hkv * s.D;
    check(l, ParamRole::attn_norm, {C_}, true);
    if (s.mla) {  // as the engine reads them (sdk/engine/src/model.cpp)
      check(l, ParamRole::q_a, {s.rq, C_}, s.rq > 0);
      check(l, ParamRole::q_a_norm, {s.rq}, s.rq > 0);
      check(l, ParamRole::q_b, {qo, s.rq}, s.rq > 0);
      check(l, ParamRole::q, {qo, C_}, s.rq == 0);
      check(l, ParamRole::kv_a, {s.rkv + s.dr, C_}, true);
      check(l, ParamRole::kv_a_norm, {s.rkv}, true);
      check(l, ParamRole::kv_b, {s.Hq * (s.dn + s.Dv), s.rkv}, true);
      check(l, ParamRole::o, {C_, s.Hq * s.Dv}, true);
    } else {
    check(l, ParamRole::q, {qo, C_}, true);
    check(l, ParamRole::k, {kvo, C_}, true);
    check(l, ParamRole::v, {kvo, C_}, true);
    check(l, ParamRole::q_bias, {qo}, false);
    check(l, ParamRole::k_bias, {kvo}, false);
    check(l, ParamRole::v_bias, {kvo}, false);
    check(l, ParamRole::q_norm, {s.D}, s.qk_norm);
    check(l, ParamRole::k_norm, {s.D}, s.qk_norm);
    check(l, ParamRole::o, {C_, qo}, true);
    check(l, ParamRole::o_bias, {C_}, false);
    }
    check(l, ParamRole::mlp_norm, {C_}, true);
    if (!s.moe) {
      check(l, ParamRole::gate, {s.F, C_}, true);
      check(l, ParamRole::up, {s.F, C_}, true);
      check(l, ParamRole::gate_bias, {s.F}, false);
      check(l, ParamRole::up_bias, {s.F}, false);
      check(l, ParamRole::down, {C_, s.F}, true);
      check(l, ParamRole::down_bias, {C_}, false);
      continue;
    }
    const sdk::MoeDesc& m = desc_.layers[size_t(l)].mlp.moe;
    check(l, ParamRole::router, {s.E, C_}, true);
    check(l, ParamRole::router_bias, {s.E}, m.router_bias);
    check(l, ParamRole::expert_score_bias, {s.E}, m.e_score_correction_bias);
    check(l, ParamRole::expert_gate, {s.E, s.Fe, C_}, true);
    check(l, ParamRole::expert_up, {s.E, s.Fe, C_}, true);
    check(l, ParamRole::expert_down, {s.E, C_, s.Fe}, true);
    if (s.Fs > 0) {
      check(l, ParamRole::shared_expert_gate_proj, {s.Fs, C_}, true);
      check(l, ParamRole::shared_expert_up, {s.Fs, C_}, true);
      check(l, ParamRole::shared_expert_down, {C_, s.Fs}, true);
      check(l, ParamRole::shared_expert_gate, {1, C_}, s.shared_gate);
    }
  }
  weights_ = std::make_unique<Weights>(desc_);

  // RoPE: one table, except that dynamic NTK and longrope change it beyond a length. The engine
  // uses the length of the whole training sequence there; a generator does not know it, so a
  // row at position p uses the table for length p + 1 (HF's per-step rule while decoding).
  const sdk::RopeDesc& rope = desc_.rope;
  if (rope.kind != sdk::RopeKind::none) {
    R_ = rope.rotary_dim > 0 ? rope.rotary_dim : shapes_[0].D;
    for (const LayerShape& s : shapes_)
      if (s.use_rope && R_ > s.D) throw Error(RLH_E_INVALID_ARGUMENT, "generator: rotary dims exceed head_dim");
    rope_scale_ = sdk::rope_attention_scaling(rope);
    rope_interleaved_ = rope.layout == sdk::RopeLayout::interleaved;
    if (rope.kind == sdk::RopeKind::dynamic) rope_dynamic_from_ = std::max<int64_t>(1, rope.max_position_embeddings);
    if (rope.kind == sdk::RopeKind::longrope)
      rope_dynamic_from_ = std::max<int64_t>(1, rope.original_max_position_embeddings > 0
                                                    ? rope.original_max_position_embeddings
                                                    : rope.max_position_embeddings);
    const std::vector<double> f = sdk::rope_inv_freq(rope, R_);
    inv_freq_.assign(f.begin(), f.end());
  }
}

DecodeModel::~DecodeModel() = default;

KvLayout DecodeModel::kv_layout(int64_t block_size) const {
  std::vector<int64_t> heads, dims, vdims;
  for (const LayerShape& s : shapes_) {
    heads.push_back(s.Hkv);
    dims.push_back(s.D);
    vdims.push_back(s.Dv);
  }
  return KvLayout::make(block_size, heads, dims, vdims);
}

void DecodeModel::bind_weights() {
  const Weights& w = *weights_;
  auto get = [&](int64_t layer, ParamRole role) -> const float* {
    const sdk::ParamDesc* p = desc_.find_param(layer, role);
    return p ? w.param(size_t(p - desc_.params.data())) : nullptr;
  };
  embed_ = get(-1, ParamRole::embed);
  final_norm_ = get(-1, ParamRole::final_norm);
  lm_head_ = desc_.tie_word_embeddings ? embed_ : get(-1, ParamRole::lm_head);
  lw_.assign(size_t(L_), LayerWeights{});
  for (int64_t l = 0; l < L_; ++l) {
    LayerWeights& lw = lw_[size_t(l)];
    lw.attn_norm = get(l, ParamRole::attn_norm);
    lw.q = get(l, ParamRole::q);
    lw.k = get(l, ParamRole::k);
    lw.v = get(l, ParamRole::v);
    lw.bq = get(l, ParamRole::q_bias);
    lw.bk = get(l, ParamRole::k_bias);
    lw.bv = get(l, ParamRole::v_bias);
    lw.q_norm = get(l, ParamRole::q_norm);
    lw.k_norm = get(l, ParamRole::k_norm);
    lw.o = get(l, ParamRole::o);
    lw.bo = get(l, ParamRole::o_bias);
    lw.mlp_norm = get(l, ParamRole::mlp_norm);
    lw.gate = get(l, ParamRole::gate);
    lw.up = get(l, ParamRole::up);
    lw.bgate = get(l, ParamRole::gate_bias);
    lw.bup = get(l, ParamRole::up_bias);
    lw.down = get(l, ParamRole::down);
    lw.bdown = get(l, ParamRole::down_bias);
    lw.router = get(l, ParamRole::router);
    lw.router_b = get(l, ParamRole::router_bias);
    lw.score_bias = get(l, ParamRole::expert_score_bias);
    // Experts one by one: a stacked parameter's pieces, or slabs of one [E, ...] tensor.
    auto experts = [&](ParamRole role, std::vector<const float*>& out) {
      out.clear();
      const sdk::ParamDesc* p = desc_.find_param(l, role);
      if (!p) return;
      const size_t i = size_t(p - desc_.params.data());
      const int64_t E = p->shape[0], slab = p->shape[1] * p->shape[2];
      for (int64_t e = 0; e < E; ++e)
        out.push_back(p->transform == sdk::ParamTransform::stack && int64_t(p->hf_names.size()) == E
                          ? w.piece(i, size_t(e))
                          : w.param(i) + e * slab);
    };
    experts(ParamRole::expert_gate, lw.e_gate);
    experts(ParamRole::expert_up, lw.e_up);
    experts(ParamRole::expert_down, lw.e_down);
    lw.ws_gate_proj = get(l, ParamRole::shared_expert_gate_proj);
    lw.ws_up = get(l, ParamRole::shared_expert_up);
    lw.ws_down = get(l, ParamRole::shared_expert_down);
    lw.ws_gate = get(l, ParamRole::shared_expert_gate);
    lw.q_a = get(l, ParamRole::q_a);
    lw.q_a_norm = get(l, ParamRole::q_a_norm);
    lw.q_b = get(l, ParamRole::q_b);
    lw.kv_a = get(l, ParamRole::kv_a);
    lw.kv_a_norm = get(l, ParamRole::kv_a_norm);
    lw.kv_b = get(l, ParamRole::kv_b);
  }
  bound_serial_ = w.serial();
}

void DecodeModel::reserve(int64_t rows, int64_t samples) {
  if (rows > cap_rows_) {
    int64_t wqkv = 0, att = 0, f = 0, mla = 0;
    for (const LayerShape& s : shapes_) {
      wqkv = std::max(wqkv, s.Wqkv);
      att = std::max(att, s.Hq * s.Dv);
      f = std::max(f, s.F);
      // MLA: q latent, kv latent | k_rot, its norm, kv_b's output (mla_decode.cpp)
      if (s.mla) mla = std::max(mla, s.rq + (s.rkv + s.dr) + s.rkv + s.Hq * (s.dn + s.Dv));
    }
    mla_f_.resize(size_t(rows * mla));
    x_.resize(size_t(rows * C_));
    xn_.resize(size_t(rows * C_));
    qkv_.resize(size_t(rows * wqkv));
    att_.resize(size_t(rows * att));
    h_.resize(size_t(rows * C_));
    gu_.resize(size_t(rows * 2 * f));
    a_.resize(size_t(rows * f));
    pos_.resize(size_t(rows));
    row_own_freq_.resize(size_t(rows));
    row_freq_.resize(size_t(rows * (R_ / 2)));
    cap_rows_ = rows;
  }
  if (samples > cap_samples_) {
    hs_.resize(size_t(samples * C_));
    cap_samples_ = samples;
  }
}

// RoPE on H heads of every row; rows past the dynamic threshold use their own table.
void DecodeModel::apply_rope_to(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D,
                                std::span<const CacheRow> rows) {
  const int64_t R = int64_t(rows.size());
  int64_t r = 0;
  while (r < R) {
    if (row_own_freq_[size_t(r)]) {
      ops_->rope_fwd(y + r * ldy, ldy, x + r * ldx, ldx, pos_.data() + r, row_freq_.data() + r * (R_ / 2), 1, H, D,
                     R_, rope_scale_, rope_interleaved_);
      ++r;
      continue;
    }
    int64_t e = r;
    while (e < R && !row_own_freq_[size_t(e)]) ++e;
    ops_->rope_fwd(y + r * ldy, ldy, x + r * ldx, ldx, pos_.data() + r, inv_freq_.data(), e - r, H, D, R_,
                   rope_scale_, rope_interleaved_);
    r = e;
  }
}

void DecodeModel::forward(std::span<const int32_t> ids, std::span<const CacheRow> rows,
                          std::span<const int64_t> sample_rows, KvCache& kv, float* logits) {
  const int64_t R = int64_t(ids.size()), S = int64_t(sample_rows.size()), C = C_;
  if (int64_t(rows.size()) != R) throw Error(RLH_E_INTERNAL, "generator: rows and ids differ in length");
  if (R == 0) return;
  weights_->require_complete();
  if (bound_serial_ != weights_->serial()) bind_weights();
  reserve(R, S);
  // The products and attention run on the pool; kernels_cpu's elementwise ops (norms, RoPE,
  // SwiGLU, adds: a few percent of a step) run serially rather than wake an OpenMP team.
  const WorkerPool::SerialOpenMp serial_ops;
  for (int64_t r = 0; r < R; ++r) {
    pos_[size_t(r)] = rows[size_t(r)].pos;
    row_own_freq_[size_t(r)] = 0;
    if (rope_dynamic_from_ > 0 && rows[size_t(r)].pos >= rope_dynamic_from_) {
      const std::vector<double> f = sdk::rope_inv_freq(desc_.rope, R_, int64_t(rows[size_t(r)].pos) + 1);
      std::copy(f.begin(), f.end(), row_freq_.begin() + r * (R_ / 2));
      row_own_freq_[size_t(r)] = 1;
    }
  }
  float* x = x_.data();
  float* xn = xn_.data();
  float* h = h_.data();

  ops_->embedding_fwd(x, ids.data(), embed_, R, C, V_);  // x [R,C]
  for (int64_t l = 0; l < L_; ++l) {
    const LayerShape& s = shapes_[size_t(l)];
    const LayerWeights& w = lw_[size_t(l)];
    const int64_t Hq = s.Hq, Hkv = s.Hkv, D = s.D, Wqkv = s.Wqkv, F = s.F, qo = Hq * D, kvo = Hkv * D;
    const int64_t ao = Hq * s.Dv;  // attention output width
    float* q = qkv_.data();
    float* k = q + qo;
    float* v = k + kvo;

    // attention block
    ops_->rmsnorm_fwd(xn, C, nullptr, x, C, w.attn_norm, R, C, s.eps_attn, s.off_attn);  // xn [R,C]
    if (s.mla) {
      mla_qkv(l, xn, rows);                                                               // q, k, v
    } else if (w.k == w.q + qo * C && w.v == w.k + kvo * C) {
      linear(q, Wqkv, xn, C, w.q, C, R, Wqkv, C);  // qkv [R,Wqkv] in one product
    } else {
      linear(q, Wqkv, xn, C, w.q, C, R, qo, C);
      linear(k, Wqkv, xn, C, w.k, C, R, kvo, C);
      linear(v, Wqkv, xn, C, w.v, C, R, kvo, C);
    }
    if (w.bq) ops_->bias_add_fwd(q, Wqkv, w.bq, R, qo);
    if (w.bk) ops_->bias_add_fwd(k, Wqkv, w.bk, R, kvo);
    if (w.bv) ops_->bias_add_fwd(v, Wqkv, w.bv, R, kvo);
    if (!s.mla && s.qk_norm) {  // per head over D, in place
      for (int64_t hh = 0; hh < Hq; ++hh)
        ops_->rmsnorm_fwd(q + hh * D, Wqkv, nullptr, q + hh * D, Wqkv, w.q_norm, R, D, s.eps_attn, 0.f);
      for (int64_t hh = 0; hh < Hkv; ++hh)
        ops_->rmsnorm_fwd(k + hh * D, Wqkv, nullptr, k + hh * D, Wqkv, w.k_norm, R, D, s.eps_attn, 0.f);
    }
    if (!s.mla && s.use_rope) {
      apply_rope(q, Wqkv, Hq, D, rows);
      apply_rope(k, Wqkv, Hkv, D, rows);
    }
    kv_write(kv, l, rows, k, Wqkv, v, Wqkv);                                              // cache <- k, v
    paged_attention(att_.data(), ao, q, Wqkv, rows, kv, l, Hq, s.scale, s.window);        // att [R,Hq*Dv]
    linear(h, C, att_.data(), ao, w.o, ao, R, C, ao);                                     // h [R,C]
    if (w.bo) ops_->bias_add_fwd(h, C, w.bo, R, C);
    ops_->add_fwd(h, x, h, R * C);                                                        // h = x + attn

    // MLP block
    ops_->rmsnorm_fwd(xn, C, nullptr, h, C, w.mlp_norm, R, C, s.eps_mlp, s.off_mlp);      // xn [R,C]
    if (s.moe) {
      moe_block(l, R, xn, x);                                                             // x [R,C]
      ops_->add_fwd(x, h, x, R * C);                                                      // x = h + moe
      continue;
    }
    float* gu = gu_.data();
    if (w.up == w.gate + F * C) {
      linear(gu, 2 * F, xn, C, w.gate, C, R, 2 * F, C);                                   // gu [R,2F]
    } else {
      linear(gu, 2 * F, xn, C, w.gate, C, R, F, C);
      linear(gu + F, 2 * F, xn, C, w.up, C, R, F, C);
    }
    if (w.bgate) ops_->bias_add_fwd(gu, 2 * F, w.bgate, R, F);
    if (w.bup) ops_->bias_add_fwd(gu + F, 2 * F, w.bup, R, F);
    ops_->swiglu_fwd(a_.data(), F, gu, 2 * F, gu + F, 2 * F, R, F);                        // a [R,F]
    linear(x, C, a_.data(), F, w.down, F, R, C, F);                                       // x [R,C]
    if (w.bdown) ops_->bias_add_fwd(x, C, w.bdown, R, C);
    ops_->add_fwd(x, h, x, R * C);                                                        // x = h + mlp
  }

  // Head, for the rows that sample only.
  if (S == 0) return;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t r = sample_rows[size_t(i)];
    if (r < 0 || r >= R) throw Error(RLH_E_INTERNAL, "generator: sample row out of range");
    std::memcpy(hs_.data() + i * C, x + r * C, size_t(C) * sizeof(float));
  }
  ops_->rmsnorm_fwd(xn, C, nullptr, hs_.data(), C, final_norm_, S, C, float(desc_.final_norm.eps),
                    float(desc_.final_norm.weight_offset));                               // xn [S,C]
  linear(logits, V_, xn, C, lm_head_, C, S, V_, C);                                       // logits [S,V]
}

}  // namespace rlh::gen
