// The forward of one scheduler step (DecodeModel::forward): the layer program's steps
// (sdk/layer_program.hpp) for the step's rows, as the engines run them (sdk/engine/src/forward.cpp),
// with the two generator forms: linear steps on the batch-invariant gemm, attention over the paged
// KV cache. Then the logits of the rows that sample.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "rlhost/generator/model.hpp"
#include "rlhost/sdk/status.hpp"

namespace rlh::gen {

using sdk::Error;
using sdk::ParamRole;
using sdk::StepOp;

namespace {

// Makes OpenMP regions opened on this thread (the elementwise ops of kernels_cpu: norms, RoPE,
// GLU, adds, a few percent of a step) run on it alone while a step runs: an OpenMP team woken
// for a few rows costs more than the op, and would spin against the provider's own decode
// threads (the gemm and attention run on those).
class SerialOpenMp {
 public:
  SerialOpenMp() : prev_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SerialOpenMp() { omp_set_num_threads(prev_); }
  SerialOpenMp(const SerialOpenMp&) = delete;
  SerialOpenMp& operator=(const SerialOpenMp&) = delete;

 private:
  int prev_;
};

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // floats: 64-byte boundaries

}  // namespace

DecodeModel::DecodeModel(sdk::TransformerDesc desc, engine::Ops* ops) : desc_(std::move(desc)) {
  if (!ops) throw Error(RLH_E_INVALID_ARGUMENT, "generator: no kernels given");
  ops_ = ops;
  try {
    prog_ = sdk::build_program(desc_);
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator: ") + e.what());
  }
  sdk::ExecutorCaps caps;
  caps.name = "generator";
  caps.activations = {"silu", "gelu_tanh", "gelu"};
  caps.moe = caps.mla = true;
  caps.per_sequence_rope = true;  // a row past the threshold gets its own table (prepare_rows)
  caps.attention_dv_differs = true;
  if (const std::string why = sdk::unsupported(prog_, caps); !why.empty()) throw Error(RLH_E_UNIMPLEMENTED, why);
  V_ = prog_.vocab;
  C_ = prog_.hidden;
  L_ = int64_t(prog_.layers.size());

  shapes_.assign(size_t(L_), LayerShape{});
  for (int64_t l = 0; l < L_; ++l) {
    const sdk::LayerDesc& ld = desc_.layers[size_t(l)];
    LayerShape& s = shapes_[size_t(l)];
    const std::string at = "generator: layer " + std::to_string(l) + ": ";
    for (const sdk::LayerStep& st : prog_.layers[size_t(l)].steps) {
      if (st.op == StepOp::attention) {
        s.Hq = st.hq;
        s.Hkv = st.hkv;
        s.Dk = st.dk;
        s.Dv = st.dv;
        s.scale = st.scale;
        s.window = st.window;
      } else if (st.op == StepOp::moe) {
        static_cast<engine::MoeBasics&>(s) = engine::moe_basics(ld, engine::MoeOptions{}, at);
        s.moe = true;
        s.act = st.act;
        s.router.scoring = s.scoring;
        s.router.norm_topk_prob = s.norm_topk_prob;
        s.router.scaling_factor = s.scaling_factor;
        s.router.n_group = s.n_group;
        s.router.topk_group = s.topk_group;
      } else if (st.op == StepOp::mla) {
        static_cast<engine::MlaBasics&>(s) = engine::mla_basics(ld, at);
        s.mla = true;
        s.Hq = s.Hkv = st.hq;  // keys and values expanded per head from the shared latent
        s.Dk = st.dk;
        s.Dv = st.dv;
        s.Wqkv = st.out2.width;
        s.scale = st.scale;
        s.window = st.window;
        s.rope = st.table;
      }
    }
    if (s.Hkv < 1) throw Error(RLH_E_UNIMPLEMENTED, at + "a layer without attention");
  }
  weights_ = std::make_unique<Weights>(desc_);

  // RoPE: the program's tables. Dynamic NTK and longrope change a table beyond a length: the
  // engine uses the length of the whole training sequence there; a generator does not know it,
  // so a row at position p uses the table for length p + 1 (HF's per-step rule while decoding).
  for (const sdk::RopeTable& t : prog_.ropes) {
    Rope r;
    const std::vector<double> f = sdk::rope_inv_freq(t.rope, t.rotary_dim);
    r.inv_freq.assign(f.begin(), f.end());
    r.R = t.rotary_dim;
    r.scale = t.scale;
    r.interleaved = t.interleaved;
    if (t.per_sequence) {
      const sdk::RopeDesc& d = t.rope;
      r.dynamic_from = std::max<int64_t>(
          1, d.kind == sdk::RopeKind::longrope && d.original_max_position_embeddings > 0 ? d.original_max_position_embeddings
                                                                                          : d.max_position_embeddings);
    }
    ropes_.push_back(std::move(r));
  }
}

DecodeModel::~DecodeModel() = default;

KvLayout DecodeModel::kv_layout(int64_t block_size) const {
  std::vector<int64_t> heads, dims, vdims;
  for (const LayerShape& s : shapes_) {
    heads.push_back(s.Hkv);
    dims.push_back(s.Dk);
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
  lw_.assign(size_t(L_), LayerWeights{});
  for (int64_t l = 0; l < L_; ++l) {
    const LayerShape& s = shapes_[size_t(l)];
    LayerWeights& lw = lw_[size_t(l)];
    if (s.moe) {
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
      if (router_fp64_) lw.router64.assign(lw.router, lw.router + s.E * C_);  // exact widening
    }
    if (s.mla) {
      lw.q = get(l, ParamRole::q);
      lw.q_a = get(l, ParamRole::q_a);
      lw.q_a_norm = get(l, ParamRole::q_a_norm);
      lw.q_b = get(l, ParamRole::q_b);
      lw.kv_a = get(l, ParamRole::kv_a);
      lw.kv_a_norm = get(l, ParamRole::kv_a_norm);
      lw.kv_b = get(l, ParamRole::kv_b);
    }
  }
  bound_serial_ = w.serial();
}

void DecodeModel::reserve(int64_t rows, int64_t samples) {
  if (rows > cap_rows_) {
    int64_t worst = 0, mla = 0;
    for (const sdk::LayerProgram& lp : prog_.layers) {
      int64_t n = 0;
      const int out_root = lp.root(lp.output);
      for (size_t v = 1; v < lp.values.size(); ++v)
        if (lp.values[v].storage < 0 && int(v) != out_root) n += round16(rows * lp.values[v].width);
      worst = std::max(worst, n);
    }
    for (const LayerShape& s : shapes_)  // q latent, kv latent | k_rot, its norm, kv_b's output
      if (s.mla) mla = std::max(mla, rows * (s.rq + (s.rkv + s.dr) + s.rkv + s.Hq * (s.dn + s.Dv)) + 64);
    for (AlignedFloats& x : xs_) x.resize(size_t(rows * C_));
    values_.resize(size_t(worst));
    mla_f_.resize(size_t(mla));
    pos_.resize(size_t(rows));
    for (Rope& r : ropes_)
      if (r.dynamic_from > 0) {
        r.row_freq.resize(size_t(rows * (r.R / 2)));
        r.row_own.resize(size_t(rows));
      }
    cap_rows_ = rows;
  }
  if (samples > cap_samples_) {
    hs_.resize(size_t(samples * C_));
    xn_.resize(size_t(samples * C_));
    cap_samples_ = samples;
  }
}

void DecodeModel::prepare_rows(std::span<const CacheRow> rows) {
  const int64_t R = int64_t(rows.size());
  for (int64_t r = 0; r < R; ++r) pos_[size_t(r)] = rows[size_t(r)].pos;
  for (size_t t = 0; t < ropes_.size(); ++t) {
    Rope& rp = ropes_[t];
    if (rp.dynamic_from == 0) continue;
    for (int64_t r = 0; r < R; ++r) {
      rp.row_own[size_t(r)] = 0;
      if (rows[size_t(r)].pos < rp.dynamic_from) continue;
      const std::vector<double> f =
          sdk::rope_inv_freq(prog_.ropes[t].rope, rp.R, int64_t(rows[size_t(r)].pos) + 1);
      std::copy(f.begin(), f.end(), rp.row_freq.begin() + r * (rp.R / 2));
      rp.row_own[size_t(r)] = 1;
    }
  }
}

// Runs of rows on the shared table in one call; a row with its own table alone.
void DecodeModel::rope(int t, float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D, int64_t R) {
  const Rope& rp = ropes_[size_t(t)];
  int64_t r = 0;
  while (r < R) {
    if (rp.dynamic_from > 0 && rp.row_own[size_t(r)]) {
      ops_->rope_fwd(y + r * ldy, ldy, x + r * ldx, ldx, pos_.data() + r, rp.row_freq.data() + r * (rp.R / 2), 1, H,
                     D, rp.R, rp.scale, rp.interleaved);
      ++r;
      continue;
    }
    int64_t e = r;
    while (e < R && !(rp.dynamic_from > 0 && rp.row_own[size_t(e)])) ++e;
    ops_->rope_fwd(y + r * ldy, ldy, x + r * ldx, ldx, pos_.data() + r, rp.inv_freq.data(), e - r, H, D, rp.R,
                   rp.scale, rp.interleaved);
    r = e;
  }
}

void DecodeModel::attend(int64_t l, const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                         int64_t ldv, float* out, int64_t ldo, std::span<const CacheRow> rows, KvCache& kv) {
  const LayerShape& s = shapes_[size_t(l)];
  const KvLayout& L = kv.layout();
  engine::Ops::PagedCache c;
  c.k = kv.keys(0, l);
  c.v = kv.values(0, l);
  c.num_blocks = kv.num_blocks();
  c.block_stride = L.block_floats;
  c.block_size = L.block_size;
  c.Hkv = s.Hkv;
  c.Dk = s.Dk;
  c.Dv = s.Dv;
  // every row's key first: rows of one sequence see each other
  ops_->kv_cache_write(k, ldk, v, ldv, int64_t(rows.size()), slots_.data(), c);
  ops_->paged_attention(out, ldo, q, ldq, int64_t(rows.size()), s.Hq, c, table_.data(), table_width_, pos_.data(),
                        float(s.scale), s.window);
}

void DecodeModel::run_step(int64_t l, const sdk::LayerStep& st, std::vector<float*>& v,
                           std::span<const CacheRow> rows, KvCache& kv) {
  const sdk::LayerProgram& lp = prog_.layers[size_t(l)];
  const int64_t R = int64_t(rows.size());
  auto cols = [&](const sdk::Cols& c) { return v[size_t(c.value)] + c.col; };
  auto ld = [&](const sdk::Cols& c) { return lp.values[size_t(c.value)].width; };
  float* in = st.in.valid() ? cols(st.in) : nullptr;
  float* out = st.out.valid() ? cols(st.out) : nullptr;
  const int64_t ldi = st.in.valid() ? ld(st.in) : 0, ldo = st.out.valid() ? ld(st.out) : 0;
  switch (st.op) {
    case StepOp::norm:
      ops_->rmsnorm_fwd(out, ldo, nullptr, in, ldi, wp(st.weights[0]), R, st.in.width, float(st.eps),
                        float(st.offset));
      break;
    case StepOp::head_norm:  // per head over head_dim; the output is a whole contiguous value
      for (int64_t h = 0; h < st.heads; ++h)
        ops_->rmsnorm_fwd(out + h * st.head_dim, ldo, nullptr, in + h * st.head_dim, ldi, wp(st.weights[0]), R,
                          st.head_dim, float(st.eps), float(st.offset));
      break;
    case StepOp::linear: {
      // Weights adjacent in memory (q|k|v, gate|up of the owned arena) run as one product.
      const int64_t K = st.in.width;
      int64_t row = 0;
      for (size_t i = 0; i < st.weights.size();) {
        size_t j = i + 1;
        int64_t n = desc_.params[size_t(st.weights[i])].shape[0];
        while (j < st.weights.size() && wp(st.weights[j]) == wp(st.weights[i]) + n * K) {
          n += desc_.params[size_t(st.weights[j])].shape[0];
          ++j;
        }
        ops_->gemm_rows(out + row, ldo, in, ldi, wp(st.weights[i]), K, R, n, K);
        row += n;
        i = j;
      }
      row = 0;
      for (size_t i = 0; i < st.weights.size(); ++i) {
        const int64_t n = desc_.params[size_t(st.weights[i])].shape[0];
        if (st.biases[i] >= 0) ops_->bias_add_fwd(out + row, ldo, wp(st.biases[i]), R, n);
        row += n;
      }
      break;
    }
    case StepOp::rope:
      rope(st.table, in, ldi, in, ldi, st.heads, st.head_dim, R);
      break;
    case StepOp::attention:
      attend(l, in, ldi, cols(st.in2), ld(st.in2), cols(st.in3), ld(st.in3), out, ldo, rows, kv);
      break;
    case StepOp::glu: {
      const int64_t F = st.out.width;
      if (st.act == "silu")
        ops_->swiglu_fwd(out, ldo, in, ldi, in + F, ldi, R, F);
      else
        ops_->geglu_fwd(out, ldo, in, ldi, in + F, ldi, R, F, st.act == "gelu_tanh");
      break;
    }
    case StepOp::add:  // whole values, contiguous [R, width]
      ops_->add_fwd(out, in, cols(st.in2), R * st.out.width);
      break;
    case StepOp::moe:
      moe_block(l, R, in, out);
      break;
    case StepOp::mla: {
      const LayerShape& s = shapes_[size_t(l)];
      float* qkv = cols(st.out2);
      mla_qkv(l, in, qkv, R);
      attend(l, qkv, s.Wqkv, qkv + s.Hq * s.Dk, s.Wqkv, qkv + 2 * s.Hq * s.Dk, s.Wqkv, out, ldo, rows, kv);
      break;
    }
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
  const SerialOpenMp serial_ops;
  prepare_rows(rows);
  // Each row's block table, as wide as the longest row needs.
  const int64_t bs = kv.layout().block_size;
  table_width_ = 1;
  for (const CacheRow& r : rows) table_width_ = std::max<int64_t>(table_width_, r.pos / bs + 1);
  table_.assign(size_t(R * table_width_), -1);
  slots_.resize(size_t(R));
  for (int64_t r = 0; r < R; ++r) {
    const CacheRow& row = rows[size_t(r)];
    std::copy(row.blocks, row.blocks + row.pos / bs + 1, table_.begin() + r * table_width_);
    slots_[size_t(r)] = int32_t(int64_t(row.blocks[row.pos / bs]) * bs + row.pos % bs);
  }

  ops_->embedding_fwd(xs_[0].data(), ids.data(), wp(prog_.embed), R, C, V_);  // x [R,C]
  if (prog_.embed_scale != 1) ops_->scale(xs_[0].data(), R * C, double(float(prog_.embed_scale)));
  std::vector<float*> v;
  for (int64_t l = 0; l < L_; ++l) {
    const sdk::LayerProgram& lp = prog_.layers[size_t(l)];
    // The layer's values for R rows: input and output on the residual stream in turn, the
    // rest carved from one block, values sharing storage sharing the pointer.
    v.assign(lp.values.size(), nullptr);
    const int out_root = lp.root(lp.output);
    float* at = values_.data();
    for (size_t i = 1; i < lp.values.size(); ++i)
      if (lp.values[i].storage < 0 && int(i) != out_root) {
        v[i] = at;
        at += round16(R * lp.values[i].width);
      }
    v[0] = xs_[size_t(l % 2)].data();
    v[size_t(out_root)] = xs_[size_t((l + 1) % 2)].data();
    for (size_t i = 1; i < lp.values.size(); ++i)
      if (lp.values[i].storage >= 0) v[i] = v[size_t(lp.root(int(i)))];
    for (const sdk::LayerStep& st : lp.steps) run_step(l, st, v, rows, kv);
  }
  const float* x = xs_[size_t(L_ % 2)].data();

  // Head, for the rows that sample only.
  if (S == 0) return;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t r = sample_rows[size_t(i)];
    if (r < 0 || r >= R) throw Error(RLH_E_INTERNAL, "generator: sample row out of range");
    std::memcpy(hs_.data() + i * C, x + r * C, size_t(C) * sizeof(float));
  }
  ops_->rmsnorm_fwd(xn_.data(), C, nullptr, hs_.data(), C, wp(prog_.final_norm), S, C, float(prog_.final_eps),
                    float(prog_.final_offset));                                             // xn [S,C]
  ops_->gemm_rows(logits, V_, xn_.data(), C, wp(prog_.head), C, S, V_, C);                  // logits [S,V]
}

}  // namespace rlh::gen
