// The model's program (DecodeModel: what every executor reads of the description once) and the
// host executor: the layer program's steps (program_runner.hpp) for a step's rows, as the engines
// run them (sdk/engine/src/forward.cpp), with the two generator forms — linear steps on the
// batch-invariant gemm, attention over the paged KV cache — then the logits of the rows that
// sample and the draw.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "host_executor.hpp"
#include "rlhost/generator/program_runner.hpp"
#include "rlhost/sdk/status.hpp"
#include "rlhost/sdk/weight_pieces.hpp"

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

}  // namespace

// ---------------------------------------------------------------------------------------------
// DecodeModel

// The setting a tensor-parallel generator's refusals name.
constexpr const char* kTpKey = "policy.generation.vllm_cfg.tensor_parallel_size";

DecodeModel::DecodeModel(sdk::TransformerDesc desc, TpGroup* tp) : desc_(std::move(desc)), tp_(tp) {
  if (tp_on()) {
    // This rank's part of the trainer's tensor-parallel layout: the same plan, so the same
    // refusals (heads or widths the group does not divide, roles without a rule).
    full_desc_ = desc_;
    try {
      tp_layout_ = sdk::make_tp_layout(full_desc_, tp_->size(), tp_->rank(), kTpKey);
    } catch (const std::invalid_argument& e) {
      throw Error(RLH_E_UNIMPLEMENTED, std::string("generator: ") + e.what());
    }
    desc_ = tp_layout_.local;
    // The layout cuts engine shapes only; this rank's weights are loaded whole (sync_weights), and
    // a stacked parameter's pieces (its experts) are found by their HF shapes: cut them alike.
    // Each HF shape is this rank's box of the HF tensor (sdk::hf_box; a padded vocabulary block
    // without its padding), what a refit of pieces sends (update_weights).
    for (size_t i = 0; i < desc_.params.size(); ++i) {
      sdk::ParamDesc& p = desc_.params[i];
      const sdk::EngineBox box = sdk::tp_box(tp_layout_, i);
      for (size_t k = 0; k < p.hf_shapes.size(); ++k) {
        const sdk::HfBox h = sdk::hf_box(full_desc_.params[i], k, box);
        if (!h.present) throw Error(RLH_E_UNIMPLEMENTED, "generator: " + p.hf_names[k] + " has no part on this rank");
        p.hf_shapes[k] = h.extent;
      }
    }
  }
  try {
    prog_ = sdk::build_program(desc_);
    if (tp_on()) sdk::mark_tensor_parallel(prog_, tp_layout_);
  } catch (const std::invalid_argument& e) {
    throw Error(RLH_E_INVALID_ARGUMENT, std::string("generator: ") + e.what());
  } catch (const std::logic_error& e) {
    throw Error(RLH_E_UNIMPLEMENTED, std::string("generator: ") + e.what());
  }
  sdk::ExecutorCaps caps;
  // The host executor honours the marks: an all-reduce after each row-parallel linear and MoE
  // block, the vocabulary-parallel embedding and head (decode.cpp's HostBackend).
  caps.tensor_parallel = tp_on();
  caps.name = "generator";
  caps.activations = {"silu", "gelu_tanh", "gelu"};
  caps.moe = caps.mla = true;
  // Soft-capping (Gemma-2): both executors pass it to the registry's paged_attention and sample.
  caps.attention_softcap = caps.logit_softcap = true;
  caps.per_sequence_rope = true;  // a row past the threshold gets its own table (the host executor)
  caps.attention_dv_differs = true;
  if (const std::string why = sdk::unsupported(prog_, caps); !why.empty()) throw Error(RLH_E_UNIMPLEMENTED, why);
  Vrows_ = prog_.vocab;
  V_ = tp_on() ? tp_layout_.vocab : prog_.vocab;
  C_ = prog_.hidden;
  L_ = int64_t(prog_.layers.size());

  auto index = [&](int64_t layer, ParamRole role) -> int64_t {
    const sdk::ParamDesc* p = desc_.find_param(layer, role);
    return p ? int64_t(p - desc_.params.data()) : -1;
  };
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
        s.softcap = st.softcap;
      } else if (st.op == StepOp::moe) {
        static_cast<engine::MoeBasics&>(s) = engine::moe_basics(ld, engine::MoeOptions{}, at);
        s.moe = true;
        s.act = st.act;
        s.router.scoring = s.scoring;
        s.router.norm_topk_prob = s.norm_topk_prob;
        s.router.scaling_factor = s.scaling_factor;
        s.router.n_group = s.n_group;
        s.router.topk_group = s.topk_group;
        s.p_router = index(l, ParamRole::router);
        s.p_router_b = index(l, ParamRole::router_bias);
        s.p_score_bias = index(l, ParamRole::expert_score_bias);
        s.p_gate = index(l, ParamRole::expert_gate);
        s.p_up = index(l, ParamRole::expert_up);
        s.p_down = index(l, ParamRole::expert_down);
        s.p_ws_gate_proj = index(l, ParamRole::shared_expert_gate_proj);
        s.p_ws_up = index(l, ParamRole::shared_expert_up);
        s.p_ws_down = index(l, ParamRole::shared_expert_down);
        s.p_ws_gate = index(l, ParamRole::shared_expert_gate);
      } else if (st.op == StepOp::mla) {
        static_cast<engine::MlaBasics&>(s) = engine::mla_basics(ld, at);
        s.mla = true;
        s.Hq = s.Hkv = st.hq;  // keys and values expanded per head from the shared latent
        s.Dk = st.dk;
        s.Dv = st.dv;
        s.Wqkv = st.out2.width;
        s.scale = st.scale;
        s.window = st.window;
        s.softcap = st.softcap;
        s.rope = st.table;
        s.p_q = index(l, ParamRole::q);
        s.p_q_a = index(l, ParamRole::q_a);
        s.p_q_a_norm = index(l, ParamRole::q_a_norm);
        s.p_q_b = index(l, ParamRole::q_b);
        s.p_kv_a = index(l, ParamRole::kv_a);
        s.p_kv_a_norm = index(l, ParamRole::kv_a_norm);
        s.p_kv_b = index(l, ParamRole::kv_b);
      }
    }
    if (s.Hkv < 1) throw Error(RLH_E_UNIMPLEMENTED, at + "a layer without attention");
  }
  weights_ = std::make_unique<Weights>(desc_);
  if (tp_on()) full_weights_ = std::make_unique<Weights>(full_desc_);

  // RoPE: the program's tables. Dynamic NTK and longrope change a table beyond a length: the
  // engine uses the length of the whole training sequence there; a generator does not know it,
  // so a row at position p uses the table for length p + 1 (HF's per-step rule while decoding).
  for (const sdk::RopeTable& t : prog_.ropes) {
    RopeTable r;
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

void DecodeModel::update_weights(int64_t version, std::span<const rlh_named_tensor> weights, bool may_alias) {
  if (!full_weights_) {
    weights_->update(version, weights, may_alias);
    return;
  }
  bool pieces = false;
  for (const rlh_named_tensor& w : weights) {
    const std::vector<int64_t>* whole = w.name ? full_weights_->hf_shape(w.name) : nullptr;
    if (whole && (w.tensor.ndim != int32_t(whole->size()) || !std::equal(whole->begin(), whole->end(), w.tensor.shape)))
      pieces = true;
  }
  if (!pieces) {
    full_weights_->update(version, weights, may_alias);
    pieces_in_force_ = false;
    return;
  }
  weights_->update(version, weights, may_alias);
  pieces_in_force_ = true;
  if (weights_->complete()) full_weights_->release();
}

void DecodeModel::require_complete() const {
  (pieces_in_force_ ? *weights_ : input_weights()).require_complete();
}

void DecodeModel::sync_weights() {
  if (!full_weights_ || pieces_in_force_) return;
  const Weights& in = *full_weights_;
  in.require_complete();
  if (synced_serial_ == in.serial()) return;
  std::vector<std::vector<float>> mine(full_desc_.params.size());
  std::vector<float> whole;
  for (size_t i = 0; i < full_desc_.params.size(); ++i) {
    const sdk::ParamDesc& p = full_desc_.params[i];
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    std::span<const float> full;
    if (const float* w = in.param(i)) {
      full = {w, size_t(n)};
    } else {  // a stacked parameter whose pieces (one per expert) are views lying apart
      const size_t k = p.hf_names.size();
      if (k == 0 || n % int64_t(k) != 0)
        throw Error(RLH_E_INTERNAL, "generator: parameter " + p.name + " has no whole tensor to slice");
      const int64_t slab = n / int64_t(k);
      whole.resize(size_t(n));
      for (size_t e = 0; e < k; ++e) std::memcpy(whole.data() + int64_t(e) * slab, in.piece(i, e), size_t(slab) * sizeof(float));
      full = whole;
    }
    mine[i] = sdk::tp_slice(tp_layout_, i, full);
  }
  weights_->load(mine, in.version());
  synced_serial_ = in.serial();
}

KvLayout DecodeModel::kv_layout(int64_t block_size, bool keys_transposed, int64_t elem_bytes) const {
  std::vector<int64_t> heads, dims, vdims;
  for (const LayerShape& s : shapes_) {
    heads.push_back(s.Hkv);
    dims.push_back(s.Dk);
    vdims.push_back(s.Dv);
  }
  return KvLayout::make(block_size, heads, dims, vdims, keys_transposed, elem_bytes);
}

int64_t DecodeModel::values_elems(int64_t rows) const {
  int64_t worst = 0;
  for (const sdk::LayerProgram& lp : prog_.layers) {
    int64_t n = 0;
    const int out_root = lp.root(lp.output);
    for (size_t v = 1; v < lp.values.size(); ++v)
      if (lp.values[v].storage < 0 && int(v) != out_root) n += round16(rows * lp.values[v].width);
    worst = std::max(worst, n);
  }
  return worst;
}

int64_t DecodeModel::mla_scratch_elems(int64_t rows) const {
  int64_t n = 0;
  for (const LayerShape& s : shapes_)
    if (s.mla) n = std::max(n, ProgramRunner<HostBackend>::mla_elems(s, rows));
  return n;
}

// ---------------------------------------------------------------------------------------------
// StepRows

void StepRows::build(std::span<const int32_t> step_ids, std::span<const CacheRow> step_rows,
                     std::span<const int64_t> samples, int64_t bs, int64_t min_width) {
  const int64_t R = int64_t(step_ids.size());
  if (int64_t(step_rows.size()) != R) throw Error(RLH_E_INTERNAL, "generator: rows and ids differ in length");
  ids.assign(step_ids.begin(), step_ids.end());
  rows = step_rows;
  sample_rows.assign(samples.begin(), samples.end());
  for (int64_t r : sample_rows)
    if (r < 0 || r >= R) throw Error(RLH_E_INTERNAL, "generator: sample row out of range");
  // Each row's block table, as wide as the longest row needs.
  width = std::max<int64_t>(1, min_width);
  for (const CacheRow& r : step_rows) width = std::max<int64_t>(width, r.pos / bs + 1);
  table.assign(size_t(R * width), -1);
  pos.resize(size_t(R));
  slots.resize(size_t(R));
  for (int64_t r = 0; r < R; ++r) {
    const CacheRow& row = step_rows[size_t(r)];
    std::copy(row.blocks, row.blocks + row.pos / bs + 1, table.begin() + r * width);
    pos[size_t(r)] = row.pos;
    slots[size_t(r)] = int32_t(int64_t(row.blocks[row.pos / bs]) * bs + row.pos % bs);
  }
}

// ---------------------------------------------------------------------------------------------
// HostBackend

HostBackend::HostBackend(DecodeModel& m, engine::Ops* ops) : m_(m), ops_(ops), C_(m.hidden()), V_(m.vocab()) {
  if (!ops_) throw Error(RLH_E_INVALID_ARGUMENT, "generator: no kernels given");
  row_rope_.resize(m.ropes().size());
}

void HostBackend::bind_weights() {
  const Weights& w = m_.weights();
  const sdk::TransformerDesc& desc = m_.desc();
  lw_.assign(size_t(m_.num_layers()), MoeWeights{});
  for (int64_t l = 0; l < m_.num_layers(); ++l) {
    const LayerShape& s = m_.shapes()[size_t(l)];
    if (!s.moe) continue;
    MoeWeights& lw = lw_[size_t(l)];
    lw.router = this->w(s.p_router);
    lw.router_b = this->w(s.p_router_b);
    lw.score_bias = this->w(s.p_score_bias);
    // Experts one by one: a stacked parameter's pieces, or slabs of one [E, ...] tensor.
    auto experts = [&](int64_t i, std::vector<const float*>& out) {
      out.clear();
      if (i < 0) return;
      const sdk::ParamDesc& p = desc.params[size_t(i)];
      const int64_t E = p.shape[0], slab = p.shape[1] * p.shape[2];
      for (int64_t e = 0; e < E; ++e)
        out.push_back(p.transform == sdk::ParamTransform::stack && int64_t(p.hf_names.size()) == E
                          ? w.piece(size_t(i), size_t(e))
                          : w.param(size_t(i)) + e * slab);
    };
    experts(s.p_gate, lw.e_gate);
    experts(s.p_up, lw.e_up);
    experts(s.p_down, lw.e_down);
    lw.ws_gate_proj = this->w(s.p_ws_gate_proj);
    lw.ws_up = this->w(s.p_ws_up);
    lw.ws_down = this->w(s.p_ws_down);
    lw.ws_gate = this->w(s.p_ws_gate);
    if (m_.router_fp64()) lw.router64.assign(lw.router, lw.router + s.E * C_);  // exact widening
  }
  bound_serial_ = w.serial();
  bound_fp64_ = m_.router_fp64();
}

void HostBackend::reserve(int64_t rows, int64_t samples) {
  if (rows > cap_rows_) {
    for (AlignedFloats& x : xs_) x.resize(size_t(rows * C_));
    for (AlignedFloats& x : normed_) x.resize(size_t(rows * C_));
    values_.resize(size_t(m_.values_elems(rows)));
    mla_f_.resize(size_t(m_.mla_scratch_elems(rows)));
    for (size_t t = 0; t < row_rope_.size(); ++t)
      if (m_.ropes()[t].dynamic_from > 0) {
        row_rope_[t].freq.resize(size_t(rows * (m_.ropes()[t].R / 2)));
        row_rope_[t].own.resize(size_t(rows));
      }
    cap_rows_ = rows;
  }
  if (samples > cap_samples_) {
    hs_.resize(size_t(samples * C_));
    xn_.resize(size_t(samples * C_));
    logits_.resize(size_t(samples * V_));
    if (TpGroup* tp = m_.tp()) {
      tile_.resize(size_t(samples * m_.vocab_rows()));
      gathered_.resize(size_t(tp->size() * samples * m_.vocab_rows()));
    }
    cap_samples_ = samples;
  }
}

void HostBackend::prepare(const StepRows& rows, KvCache& kv) {
  m_.weights().require_complete();
  if (bound_serial_ != m_.weights().serial() || bound_fp64_ != m_.router_fp64()) bind_weights();
  reserve(rows.R(), rows.S());
  rows_ = &rows;
  kv_ = &kv;
  const int64_t R = rows.R();
  for (size_t t = 0; t < row_rope_.size(); ++t) {
    const RopeTable& rp = m_.ropes()[t];
    if (rp.dynamic_from == 0) continue;
    RowRope& own = row_rope_[t];
    for (int64_t r = 0; r < R; ++r) {
      own.own[size_t(r)] = 0;
      if (rows.pos[size_t(r)] < rp.dynamic_from) continue;
      const std::vector<double> f = sdk::rope_inv_freq(m_.program().ropes[t].rope, rp.R, int64_t(rows.pos[size_t(r)]) + 1);
      std::copy(f.begin(), f.end(), own.freq.begin() + r * (rp.R / 2));
      own.own[size_t(r)] = 1;
    }
  }
}

void HostBackend::embed(float* x, int64_t R) {
  TpGroup* tp = m_.tp();
  if (!tp) {
    ops_->embedding_fwd(x, rows_->ids.data(), w(m_.program().embed), R, C_, V_);
    return;
  }
  // Vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere, and the group
  // sums (one rank's row plus zeros: the whole model's row, exactly).
  sdk::tp_embedding_lookup(m_.tp_layout(), x, rows_->ids.data(), R, w(m_.program().embed), C_);
  tp->all_reduce_sum(x, R * C_);
}

void HostBackend::tp_reduce(float* y, int64_t n) {
  TpGroup* tp = m_.tp();
  if (!tp) throw Error(RLH_E_INTERNAL, "generator: a tensor-parallel step without a group");
  tp->all_reduce_sum(y, n);
}

// Runs of rows on the shared table in one call; a row with its own table alone.
void HostBackend::rope(int t, float* y, int64_t ldy, const float* x, int64_t ldx, int64_t H, int64_t D, int64_t R) {
  const RopeTable& rp = m_.ropes()[size_t(t)];
  const RowRope& own = row_rope_[size_t(t)];
  const int32_t* pos = rows_->pos.data();
  int64_t r = 0;
  while (r < R) {
    if (rp.dynamic_from > 0 && own.own[size_t(r)]) {
      ops_->rope_fwd(y + r * ldy, ldy, x + r * ldx, ldx, pos + r, own.freq.data() + r * (rp.R / 2), 1, H, D, rp.R,
                     rp.scale, rp.interleaved);
      ++r;
      continue;
    }
    int64_t e = r;
    while (e < R && !(rp.dynamic_from > 0 && own.own[size_t(e)])) ++e;
    ops_->rope_fwd(y + r * ldy, ldy, x + r * ldx, ldx, pos + r, rp.inv_freq.data(), e - r, H, D, rp.R, rp.scale,
                   rp.interleaved);
    r = e;
  }
}

void HostBackend::attend(int64_t l, const float* q, int64_t ldq, const float* k, int64_t ldk, const float* v,
                         int64_t ldv, float* out, int64_t ldo, int64_t R) {
  const LayerShape& s = m_.shapes()[size_t(l)];
  const KvLayout& L = kv_->layout();
  engine::Ops::PagedCache c;
  if (L.elem_bytes == 1) {  // FP8 e4m3 codes; scale 1 (vLLM's without calibrated scales)
    c.k8 = kv_->keys_bytes(0, l);
    c.v8 = kv_->values_bytes(0, l);
  } else {
    c.k = kv_->keys(0, l);
    c.v = kv_->values(0, l);
  }
  c.num_blocks = kv_->num_blocks();
  c.block_stride = L.block_elems;
  c.block_size = L.block_size;
  c.Hkv = s.Hkv;
  c.Dk = s.Dk;
  c.Dv = s.Dv;
  // every row's key first: rows of one sequence see each other
  ops_->kv_cache_write(k, ldk, v, ldv, R, rows_->slots.data(), c);
  ops_->paged_attention(out, ldo, q, ldq, R, s.Hq, c, rows_->table.data(), rows_->width, rows_->pos.data(),
                        float(s.scale), s.window, float(s.softcap));
}

void HostBackend::glu(const std::string& act, float* h, int64_t ldh, const float* gu, int64_t ldgu, int64_t R,
                      int64_t F) {
  if (act == "silu")
    ops_->swiglu_fwd(h, ldh, gu, ldgu, gu + F, ldgu, R, F);
  else
    ops_->geglu_fwd(h, ldh, gu, ldgu, gu + F, ldgu, R, F, act == "gelu_tanh");
}

void HostBackend::copy2d(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ldd, src + r * lds, size_t(cols) * sizeof(float));
}

const float* HostBackend::gather_rows(const float* x, int64_t) {
  const int64_t S = rows_->S();
  for (int64_t i = 0; i < S; ++i)
    std::memcpy(hs_.data() + i * C_, x + rows_->sample_rows[size_t(i)] * C_, size_t(C_) * sizeof(float));
  return hs_.data();
}

void HostBackend::logits(const float* xn, const float* W, int64_t S) {
  TpGroup* tp = m_.tp();
  if (!tp) {
    ops_->gemm_rows(logits_.data(), V_, xn, C_, W, C_, S, V_, C_);  // [S,V]
    return;
  }
  // Vocabulary-parallel head: this rank's tile [S, B] of its B rows, then every rank's tile,
  // all-gathered, laid side by side into the whole [S, V] (the padding rows dropped), so every
  // rank of the group draws from the same logits with the same uniforms. Each logit is the same
  // k-ordered sum as on one rank (the batch-invariant gemm), so the draws are one rank's.
  const int64_t B = m_.vocab_rows(), G = tp->size();
  ops_->gemm_rows(tile_.data(), B, xn, C_, W, C_, S, B, C_);
  tp->all_gather(tile_.data(), S * B, gathered_.data());
  for (int64_t g = 0; g < G; ++g) {
    const int64_t lo = std::min(V_, g * B), count = std::min(V_, (g + 1) * B) - lo;
    if (count <= 0) continue;
    const float* from = gathered_.data() + g * S * B;
    for (int64_t s = 0; s < S; ++s) std::memcpy(logits_.data() + s * V_ + lo, from + s * B, size_t(count) * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------------
// The host executor

namespace {

class HostExecutor final : public StepExecutor {
 public:
  HostExecutor(DecodeModel& m, engine::Ops* ops, bool kv_fp8) : m_(m), ops_(ops), b_(m, ops), kv_fp8_(kv_fp8) {}
  std::string name() const override { return "host (" + ops_->name() + (kv_fp8_ ? ", FP8 KV cache" : "") + ")"; }
  int64_t elem_bytes() const override { return kv_fp8_ ? 1 : 4; }
  PoolAllocator kv_allocator() override { return {}; }  // the generator's (the host's allocator)

  void step(const StepRows& rows, KvCache& kv, const StepDraws& draws) override {
    const int64_t R = rows.R(), S = rows.S();
    if (R == 0) return;
    b_.prepare(rows, kv);
    {
      const SerialOpenMp serial_ops;
      ProgramRunner<HostBackend> run(m_, b_);
      const float* x = run.layers(R);
      run.head(x, R, S);
    }
    if (S > 0)
      ops_->sample(draws.tokens.data(), draws.logprobs.data(), b_.logits(), m_.vocab(), S, m_.vocab(), draws.u.data(),
                   draws.attrs);
  }

 private:
  DecodeModel& m_;
  engine::Ops* ops_;
  HostBackend b_;
  bool kv_fp8_;
};

}  // namespace

std::unique_ptr<StepExecutor> make_host_executor(DecodeModel& model, engine::Ops* ops, bool kv_fp8) {
  return std::make_unique<HostExecutor>(model, ops, kv_fp8);
}

}  // namespace rlh::gen
