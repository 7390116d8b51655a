// The layer program's interpreter for one step of the generator, shared by its executors: the
// host's (decode.cpp: float32 over the CPU's kernel registry) and a CUDA device's
// (cuda_executor.cpp: bf16 over the device's registry). What a step computes — the embedding,
// every step of every layer (sdk/layer_program.hpp) with the values carved as the program lays
// them out, MLA's q, k and v, the final norm and the head over the sampling rows — is this code
// once; an executor's backend says only where values live and how each op runs.
//
// B, the backend, provides (T: its activation and weight element, float or bf16):
//   const T* w(int64_t param)                         parameter `param` of desc.params (nullptr if < 0)
//   T* residual(int i), T* values(), T* mla_scratch(), T* head_scratch()   scratch for the step's rows
//   void embed(T* x, int64_t R)                        x [R, C] = embedding of the step's ids
//   void scale(T* x, int64_t n, double s)
//   void norm(T* y, ldy, const T* x, ldx, const T* w, int64_t R, int64_t C, float eps, float offset)
//   void linear(T* y, ldy, const T* x, ldx, const T* W, int64_t R, int64_t N, int64_t K)   y = x W^T
//   void bias_add(T* y, ldy, const T* b, int64_t R, int64_t N)
//   void rope(int table, T* y, ldy, const T* x, ldx, int64_t H, int64_t D, int64_t R)   at the rows' positions
//   void attend(int64_t l, const T* q, ldq, const T* k, ldk, const T* v, ldv, T* o, ldo, int64_t R)
//                                                      the rows' keys and values into the cache, then attention
//   void glu(const std::string& act, T* h, ldh, const T* gu, ldgu, int64_t R, int64_t F)   gate | up side by side
//   void add(T* y, const T* a, const T* b, int64_t n)
//   (optional) bool add_norm(T* y, T* yn, const T* a, const T* b, const T* w, int64_t R, int64_t C, float eps,
//                            float offset)         y = a + b, yn = norm(y), contiguous rows; false: not offered
//   (optional, with add_norm) T* norm_scratch(int i)   two [R, C] buffers a layer's first norm may be written to
//   (optional) bool linear_glu(const std::string& act, T* h, ldh, const T* x, ldx, const T* W, int64_t R,
//                              int64_t F, int64_t K)   h = glu(x W^T), W = gate | up [2F, K]; false: not offered
//   (optional) bool norm_linear(const std::string& act, T* h, ldh, const T* x, const T* w, const T* W, int64_t R,
//                               int64_t N, int64_t K, float eps, float offset)
//                              h = norm(x) W^T (act not empty: its GLU, W = gate | up [2N, K]), x [R, K]
//                              contiguous; false: not offered
//   (optional) bool linear_add(T* y, const T* r, const T* x, ldx, const T* W, int64_t R, int64_t N, int64_t K)
//                              y = r + x W^T, y and r [R, N] contiguous (y may be r); false: not offered
//   (optional) bool rope_attend(int table, int64_t l, T* qk, ldqk, int64_t Hq, int64_t Hk, int64_t D, const T* v,
//                               ldv, T* o, ldo, int64_t R)   q's Hq and k's Hk heads of qk rotated in place,
//                              then attend(l, q, k, v, o) as above; false: not offered
//   (optional) bool dense_layer(int64_t l, const DenseLayerPlan& p, const T* x, T* y, int64_t R)
//                              the whole layer l of x [R, C] into y in one op (docs/ops.md
//                              decode_layer_fwd); false: not offered for this step
//   (optional) void feeds_product(const T* W)   the next producer call (norm, add_norm, glu) writes the
//                              whole input of the product of W, which is the next call after it
//   void copy2d(T* dst, int64_t ldd, const T* src, int64_t lds, int64_t rows, int64_t cols)
//   void moe(int64_t l, int64_t R, const T* xn, T* y)  the MoE block (no residual)
//   void tp_reduce(T* y, int64_t n)                    (tensor parallelism only) the group's sum of y, in place
//   const T* gather_rows(const T* x, int64_t R)        the sampling rows of x [S, C] (x itself when they are all rows in order)
//   void logits(const T* xn, const T* W, int64_t S)    the head's logits of xn [S, C] (float32, the backend's buffer)
#pragma once

#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/generator/model.hpp"

namespace rlh::gen {

// MLA's latent norms use eps 1e-6, HF's DeepseekV3RMSNorm default (sdk/engine/src/mla.cpp's
// kLatentEps; the config's rms_norm_eps is not theirs).
constexpr float kMlaLatentEps = 1e-6f;

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // 64 bytes of floats, 32 of bf16

// The products of a linear step: weights adjacent in memory (q|k|v, gate|up of the arena) run
// as one product. `at(param)` is where a weight lies (a pointer or an arena offset, in elements);
// fn(i, rows) runs once per product, i its first weight's index in st.weights.
template <class At, class Fn>
void for_each_linear_product(const sdk::TransformerDesc& desc, const sdk::LayerStep& st, At at, Fn fn) {
  const int64_t K = st.in.width;
  for (size_t i = 0; i < st.weights.size();) {
    size_t j = i + 1;
    int64_t n = desc.params[size_t(st.weights[i])].shape[0];
    while (j < st.weights.size() && at(st.weights[j]) == at(st.weights[i]) + n * K) {
      n += desc.params[size_t(st.weights[j])].shape[0];
      ++j;
    }
    fn(i, n);
    i = j;
  }
}

// A layer that is the plain dense decoder layer, as decode_layer_fwd computes it: RMSNorm, one
// q|k|v product (adjacent weights, no bias), RoPE of q and k with one half-split table over the
// whole head, attention (no window, no soft-cap, Dk = Dv), o, the residual add, RMSNorm, one
// gate|up product, SwiGLU, down, the residual add; no tensor-parallel sums. Parameter indices and
// attributes; `at(param)` is where a weight lies (adjacency of q|k|v and gate|up).
struct DenseLayerPlan {
  int64_t norm1 = -1, q = -1, o = -1, norm2 = -1, gate = -1, down = -1;
  double eps1 = 0, eps2 = 0, offset = 0, scale = 1;
  int table = -1;
  int64_t Hq = 0, Hkv = 0, D = 0, F = 0;
};
template <class At>
bool match_dense_layer(const sdk::LayerProgram& lp, const sdk::TransformerDesc& desc, const std::vector<RopeTable>& ropes,
                       int64_t C, At at, DenseLayerPlan& p) {
  using sdk::StepOp;
  const std::vector<sdk::LayerStep>& s = lp.steps;
  static const StepOp kOps[] = {StepOp::norm,   StepOp::linear, StepOp::rope, StepOp::rope,
                                StepOp::attention, StepOp::linear, StepOp::add,  StepOp::norm,
                                StepOp::linear, StepOp::glu,    StepOp::linear, StepOp::add};
  if (s.size() != std::size(kOps)) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i].op != kOps[i] || s[i].tp_reduce_out) return false;
    for (int64_t b : s[i].biases)
      if (b >= 0) return false;
  }
  const sdk::LayerStep &n1 = s[0], &qkv = s[1], &rq = s[2], &rk = s[3], &att = s[4], &o = s[5], &a1 = s[6], &n2 = s[7],
                       &gu = s[8], &glu = s[9], &dn = s[10], &a2 = s[11];
  const int64_t D = att.dk, Hq = att.hq, Hkv = att.hkv;
  if (att.dv != D || att.window != 0 || att.softcap != 0 || glu.act != "silu" || n1.offset != n2.offset) return false;
  if (qkv.weights.size() != 3 || gu.weights.size() != 2 || o.weights.size() != 1 || dn.weights.size() != 1) return false;
  const int64_t F = glu.out.width;
  auto rows = [&](int64_t param) { return desc.params[size_t(param)].shape[0]; };
  if (rows(qkv.weights[0]) != Hq * D || rows(qkv.weights[1]) != Hkv * D || rows(qkv.weights[2]) != Hkv * D ||
      rows(gu.weights[0]) != F || rows(gu.weights[1]) != F || n1.in.width != C || qkv.in.width != C ||
      o.in.width != Hq * D || dn.in.width != F)
    return false;
  if (at(qkv.weights[1]) != at(qkv.weights[0]) + Hq * D * C || at(qkv.weights[2]) != at(qkv.weights[1]) + Hkv * D * C ||
      at(gu.weights[1]) != at(gu.weights[0]) + F * C)
    return false;
  // the wiring: x -> norm -> q|k|v (rotated in place) -> attention -> o -> + x -> norm -> gate|up -> glu -> down -> + h
  auto adds = [](const sdk::LayerStep& a, int u, int v) {
    return (a.in.value == u && a.in2.value == v) || (a.in.value == v && a.in2.value == u);
  };
  if (n1.in.value != 0 || qkv.in.value != n1.out.value || rq.in.value != qkv.out.value || rq.in.col != 0 ||
      rk.in.value != qkv.out.value || rk.in.col != Hq * D || rq.heads != Hq || rk.heads != Hkv || rq.head_dim != D ||
      rk.head_dim != D || rq.table != rk.table || att.in.value != qkv.out.value || att.in.col != 0 ||
      att.in2.col != Hq * D || att.in3.col != (Hq + Hkv) * D || o.in.value != att.out.value ||
      !adds(a1, 0, o.out.value) || n2.in.value != a1.out.value || gu.in.value != n2.out.value ||
      glu.in.value != gu.out.value || dn.in.value != glu.out.value || !adds(a2, a1.out.value, dn.out.value) ||
      lp.root(a2.out.value) != lp.root(lp.output))
    return false;
  if (rq.table < 0 || size_t(rq.table) >= ropes.size()) return false;
  const RopeTable& t = ropes[size_t(rq.table)];
  if (t.R != D || t.interleaved || t.dynamic_from > 0) return false;
  p = DenseLayerPlan{n1.weights[0], qkv.weights[0], o.weights[0], n2.weights[0], gu.weights[0], dn.weights[0],
                     n1.eps, n2.eps, n1.offset, att.scale, rq.table, Hq, Hkv, D, F};
  return true;
}

template <class B>
class ProgramRunner {
 public:
  using T = typename B::T;
  ProgramRunner(const DecodeModel& m, B& b) : m_(m), b_(b) {}

  // The embedding and every layer for the step's R rows; returns the last residual stream [R, C].
  T* layers(int64_t R) {
    const sdk::ModelProgram& prog = m_.program();
    const int64_t C = m_.hidden(), L = m_.num_layers();
    b_.embed(b_.residual(0), R);  // x [R,C]
    if (prog.embed_scale != 1) b_.scale(b_.residual(0), R * C, double(float(prog.embed_scale)));
    int64_t l0 = 0;  // the first layer the program runs step by step
    // One token whose layers are all plain dense ones: each layer one op where the backend offers
    // it (a decoding step at batch 1; docs/generator.md "The fused decoding layer").
    if constexpr (requires(DenseLayerPlan dp) { b_.dense_layer(int64_t(0), dp, (const T*)nullptr, (T*)nullptr, int64_t(0)); }) {
      if (R == 1) {
        std::vector<DenseLayerPlan> plans(static_cast<size_t>(L));
        bool all = true;
        for (int64_t l = 0; l < L && all; ++l)
          all = match_dense_layer(prog.layers[size_t(l)], m_.desc(), m_.ropes(), C, [&](int64_t q) { return b_.w(q); },
                                  plans[size_t(l)]);
        while (all && l0 < L && b_.dense_layer(l0, plans[size_t(l0)], b_.residual(int(l0 % 2)), b_.residual(int((l0 + 1) % 2)), R))
          ++l0;
      }
    }
    std::vector<T*> v;
    T* pre_normed = nullptr;  // this layer's first norm, already written by the last layer's add
    for (int64_t l = l0; l < L; ++l) {
      const sdk::LayerProgram& lp = prog.layers[size_t(l)];
      // The layer's values for R rows: input and output on the residual stream in turn, the
      // rest carved from one block, values sharing storage sharing the pointer.
      v.assign(lp.values.size(), nullptr);
      const int out_root = lp.root(lp.output);
      T* at = b_.values();
      for (size_t i = 1; i < lp.values.size(); ++i)
        if (lp.values[i].storage < 0 && int(i) != out_root) {
          v[i] = at;
          at += round16(R * lp.values[i].width);
        }
      v[0] = b_.residual(int(l % 2));
      v[size_t(out_root)] = b_.residual(int((l + 1) % 2));
      size_t first = 0;
      if (pre_normed != nullptr) {  // (lead_norm_fusable held for this layer)
        v[size_t(lp.steps[0].out.value)] = pre_normed;
        first = 1;
        pre_normed = nullptr;
      }
      for (size_t i = 1; i < lp.values.size(); ++i)
        if (lp.values[i].storage >= 0) v[i] = v[size_t(lp.root(int(i)))];
      for (size_t i = first; i < lp.steps.size(); ++i) {
        // A product whose output only the residual add after it reads: one linear_add where the
        // backend offers it (docs/ops.md gemm_add_fwd; bitwise the two steps). At batch 1 this
        // is the o and down products with their adds (the add launches of a layer).
        if constexpr (requires { b_.linear_add(nullptr, nullptr, nullptr, 0, nullptr, 0, 0, 0); }) {
          if (i + 1 < lp.steps.size()) {
            const sdk::LayerStep& st = lp.steps[i];
            const sdk::LayerStep& nx = lp.steps[i + 1];
            if (const T* W = add_product(lp, i, C)) {
              const int r = nx.in.value == st.out.value ? nx.in2.value : nx.in.value;
              if (b_.linear_add(v[size_t(nx.out.value)], v[size_t(r)], v[size_t(st.in.value)] + st.in.col,
                                lp.values[size_t(st.in.value)].width, W, R, C, st.in.width)) {
                ++i;
                continue;
              }
            }
          }
        }
        // A norm and the one product that reads it (and that product's GLU): one norm_linear
        // where the backend offers it (docs/ops.md rmsnorm_gemm_fwd; bitwise the steps). At batch
        // 1 this is a layer's two norms with q|k|v and gate|up (the norm launches of a layer).
        if constexpr (requires { b_.norm_linear(std::string(), nullptr, 0, nullptr, nullptr, nullptr, 0, 0, 0, 0.f, 0.f); }) {
          if (i + 1 < lp.steps.size()) {
            const sdk::LayerStep& st = lp.steps[i];
            const sdk::LayerStep& nx = lp.steps[i + 1];
            int64_t rows = 0;
            if (const T* W = normed_product(lp, st, nx, C, rows)) {
              const bool glu = i + 2 < lp.steps.size() && glu_product(lp, nx, lp.steps[i + 2]) == W;
              const sdk::LayerStep& last = glu ? lp.steps[i + 2] : nx;
              T* h = v[size_t(last.out.value)] + last.out.col;
              const int64_t ldh = lp.values[size_t(last.out.value)].width;
              if (b_.norm_linear(glu ? last.act : std::string(), h, ldh, v[size_t(st.in.value)], b_.w(st.weights[0]), W, R,
                                 glu ? last.out.width : rows, C, float(st.eps), float(st.offset))) {
                i += glu ? 2 : 1;
                continue;
              }
            }
          }
        }
        // A residual add and the norm that reads its sum: one add_norm where the backend offers
        // it, into the norm's value (the next step of this layer) or into norm_scratch for the
        // next layer's first step (a decoding step at batch 1 is ~190 launches, two of these a
        // layer). Bitwise the two steps (docs/ops.md add_rmsnorm_fwd).
        if constexpr (requires { b_.add_norm(nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0.f, 0.f); }) {
          const sdk::LayerStep& st = lp.steps[i];
          if (st.op == sdk::StepOp::add && whole(lp, st.out, C) && whole(lp, st.in, C) && whole(lp, st.in2, C)) {
            T* a = v[size_t(st.in.value)];
            T* b = v[size_t(st.in2.value)];
            T* y = v[size_t(st.out.value)];
            if (i + 1 < lp.steps.size() && norm_of(lp, lp.steps[i + 1], st.out.value, C)) {
              const sdk::LayerStep& nx = lp.steps[i + 1];
              T* yn = v[size_t(nx.out.value)];
              if (yn != a && yn != b && yn != y && (i + 2 >= lp.steps.size() || announce(lp, nx.out, lp.steps[i + 2])) &&
                  b_.add_norm(y, yn, a, b, b_.w(nx.weights[0]), R, C, float(nx.eps), float(nx.offset))) {
                ++i;
                continue;
              }
            } else if (i + 1 == lp.steps.size() && lp.root(int(st.out.value)) == out_root && l + 1 < L &&
                       // (roots: an add's output is a value of its own sharing its input's storage;
                       // comparing the values themselves never matched, so until 2026-12-06 the
                       // boundary ran as an add and a norm)
                       lead_norm_fusable(prog.layers[size_t(l + 1)], C)) {
              const sdk::LayerProgram& nl = prog.layers[size_t(l + 1)];
              const sdk::LayerStep& nx = nl.steps[0];
              T* yn = b_.norm_scratch(int(l % 2));
              if ((nl.steps.size() < 2 || announce(nl, nx.out, nl.steps[1])) &&
                  b_.add_norm(y, yn, a, b, b_.w(nx.weights[0]), R, C, float(nx.eps), float(nx.offset))) {
                pre_normed = yn;
                continue;
              }
            }
          }
        }
        // The gate|up product and the GLU that reads it: one linear_glu where the backend offers
        // it (docs/ops.md gemm_glu_fwd; bitwise the two steps).
        if constexpr (requires { b_.linear_glu(std::string(), nullptr, 0, nullptr, 0, nullptr, 0, 0, 0); }) {
          if (i + 1 < lp.steps.size()) {
            const sdk::LayerStep& st = lp.steps[i];
            const sdk::LayerStep& nx = lp.steps[i + 1];
            const T* W = glu_product(lp, st, nx);
            if (W != nullptr) {
              const int64_t F = nx.out.width;
              if (b_.linear_glu(nx.act, v[size_t(nx.out.value)], lp.values[size_t(nx.out.value)].width,
                                v[size_t(st.in.value)] + st.in.col, lp.values[size_t(st.in.value)].width, W, R, F,
                                st.in.width)) {
                ++i;
                continue;
              }
            }
          }
        }
        // q's and k's RoPE (adjacent columns, one table) and the attention that reads them: one
        // rope_attend where the backend offers it (the RoPE and the cache write as one op:
        // docs/ops.md rope_kv_cache_write).
        if constexpr (requires { b_.rope_attend(0, int64_t(0), nullptr, 0, 0, 0, 0, nullptr, 0, nullptr, 0, 0); }) {
          if (i + 2 < lp.steps.size() && adjacent_ropes(lp.steps[i], lp.steps[i + 1])) {
            const sdk::LayerStep &rq = lp.steps[i], &rk = lp.steps[i + 1], &at = lp.steps[i + 2];
            if (at.op == sdk::StepOp::attention && at.in.value == rq.in.value && at.in.col == rq.in.col &&
                at.in.width == rq.in.width && at.in2.value == rk.in.value && at.in2.col == rk.in.col &&
                at.in2.width == rk.in.width && at.in3.valid()) {
              const int64_t ld_qk = lp.values[size_t(rq.in.value)].width;
              if (b_.rope_attend(rq.table, l, v[size_t(rq.in.value)] + rq.in.col, ld_qk, rq.heads, rk.heads,
                                 rq.head_dim, v[size_t(at.in3.value)] + at.in3.col,
                                 lp.values[size_t(at.in3.value)].width, v[size_t(at.out.value)] + at.out.col,
                                 lp.values[size_t(at.out.value)].width, R)) {
                i += 2;
                continue;
              }
            }
          }
        }
        // q's and k's RoPE on adjacent columns of one value with one table: one call over both
        // (per head the same math; a launch fewer per layer, which counts at small batch)
        if (i + 1 < lp.steps.size() && adjacent_ropes(lp.steps[i], lp.steps[i + 1])) {
          sdk::LayerStep both = lp.steps[i];
          both.heads += lp.steps[i + 1].heads;
          both.in.width += lp.steps[i + 1].in.width;
          run_step(l, both, v, R);
          ++i;
          continue;
        }
        if (i + 1 < lp.steps.size() && (lp.steps[i].op == sdk::StepOp::norm || lp.steps[i].op == sdk::StepOp::glu))
          announce(lp, lp.steps[i].out, lp.steps[i + 1]);
        run_step(l, lp.steps[i], v, R);
      }
    }
    return b_.residual(int(L % 2));
  }

  // The head for the sampling rows of x [R, C]: final norm, then the logits into the backend's
  // buffer.
  void head(const T* x, int64_t R, int64_t S) {
    if (S == 0) return;
    const sdk::ModelProgram& prog = m_.program();
    const int64_t C = m_.hidden();
    const T* hs = b_.gather_rows(x, R);  // [S,C]
    T* xn = b_.head_scratch();
    b_.norm(xn, C, hs, C, b_.w(prog.final_norm), S, C, float(prog.final_eps), float(prog.final_offset));
    b_.logits(xn, b_.w(prog.head), S);  // [S,V]
  }

  // Scratch elements of the MLA step for R rows (its carving in mla_qkv).
  static int64_t mla_elems(const LayerShape& s, int64_t R) {
    return round16(R * s.rq) + round16(R * (s.rkv + s.dr)) + round16(R * s.rkv) + round16(R * s.Hq * (s.dn + s.Dv));
  }

 private:
  // The producer about to run (a norm, an add and norm, a GLU) writes `out`, and `nx`, a linear
  // step run right after it, reads that whole value: the backend is told its first weight
  // (optional hook feeds_product), so the producer may also hand that product its input in the
  // product's own form (FP8 codes and scales: cuda_executor.cpp). Always true (a condition's
  // step, before the producer's call).
  bool announce(const sdk::LayerProgram& lp, const sdk::Cols& out, const sdk::LayerStep& nx) {
    if constexpr (requires { b_.feeds_product((const T*)nullptr); }) {
      const int64_t width = out.valid() ? lp.values[size_t(out.value)].width : 0;
      if (nx.op == sdk::StepOp::linear && !nx.weights.empty() && out.valid() && out.col == 0 && out.width == width &&
          nx.in.value == out.value && nx.in.col == 0 && nx.in.width == width)
        b_.feeds_product(b_.w(nx.weights[0]));
    }
    return true;
  }

  // Columns that are a whole value C wide (contiguous [R, C] rows).
  static bool whole(const sdk::LayerProgram& lp, const sdk::Cols& c, int64_t C) {
    return c.valid() && c.col == 0 && c.width == C && lp.values[size_t(c.value)].width == C;
  }
  // A norm step over the whole value `in` into a whole value of its own.
  static bool norm_of(const sdk::LayerProgram& lp, const sdk::LayerStep& st, int in, int64_t C) {
    return st.op == sdk::StepOp::norm && st.in.value == in && whole(lp, st.in, C) && whole(lp, st.out, C) &&
           st.out.value != in;
  }
  // A linear step that is one gate|up product (its weights adjacent, 2F rows, no bias, no
  // tensor-parallel sum) into a whole value, followed by the GLU of that value into columns 0..F
  // of its own: the product's weight, else null.
  const T* glu_product(const sdk::LayerProgram& lp, const sdk::LayerStep& st, const sdk::LayerStep& nx) const {
    if (st.op != sdk::StepOp::linear || nx.op != sdk::StepOp::glu || st.tp_reduce_out || st.weights.empty()) return nullptr;
    const int64_t F = nx.out.width;
    if (nx.in.value != st.out.value || nx.in.col != 0 || nx.in.width != 2 * F || nx.out.col != 0 ||
        lp.root(nx.out.value) == lp.root(st.in.value) || st.out.col != 0 || st.out.width != 2 * F ||
        lp.values[size_t(st.out.value)].width != 2 * F)
      return nullptr;
    for (int64_t bias : st.biases)
      if (bias >= 0) return nullptr;
    // the product itself is not kept: the GLU must be its only reader (nothing shares its storage)
    const int gu = lp.root(st.out.value);
    for (const sdk::LayerStep& o : lp.steps) {
      if (&o == &nx) continue;
      for (const sdk::Cols* c : {&o.in, &o.in2, &o.in3})
        if (c->valid() && lp.root(c->value) == gu) return nullptr;
    }
    int products = 0;
    int64_t rows = 0;
    for_each_linear_product(m_.desc(), st, [&](int64_t p) { return b_.w(p); }, [&](size_t, int64_t n) {
      ++products;
      rows = n;
    });
    return products == 1 && rows == 2 * F ? b_.w(st.weights[0]) : nullptr;
  }

  // Whether a step other than `skip` reads the value (not its storage: a residual add writes its
  // sum in place into its second operand's storage, and later steps read that sum, not the value
  // a fused op never materialises).
  static bool read_elsewhere(const sdk::LayerProgram& lp, int value, const sdk::LayerStep& skip) {
    if (value == lp.output) return true;
    for (const sdk::LayerStep& o : lp.steps) {
      if (&o == &skip) continue;
      for (const sdk::Cols* c : {&o.in, &o.in2, &o.in3})
        if (c->valid() && c->value == value) return true;
    }
    return false;
  }
  // The weight of a linear step that is one product of `rows` rows (adjacent weights, no bias,
  // no tensor-parallel sum) reading columns 0..K of `in`, else null.
  const T* one_product(const sdk::LayerStep& st, int64_t K, int64_t& rows) const {
    if (st.op != sdk::StepOp::linear || st.tp_reduce_out || st.weights.empty() || st.in.col != 0 || st.in.width != K)
      return nullptr;
    for (int64_t bias : st.biases)
      if (bias >= 0) return nullptr;
    int products = 0;
    for_each_linear_product(m_.desc(), st, [&](int64_t p) { return b_.w(p); }, [&](size_t, int64_t n) {
      ++products;
      rows = n;
    });
    return products == 1 ? b_.w(st.weights[0]) : nullptr;
  }
  // A norm of a whole value into a whole value of its own that only the next step, one product,
  // reads (and not into the input's storage): the product's weight (and its rows), else null.
  const T* normed_product(const sdk::LayerProgram& lp, const sdk::LayerStep& st, const sdk::LayerStep& nx, int64_t C,
                          int64_t& rows) const {
    if (!norm_of(lp, st, st.in.value, C) || st.weights.empty() || nx.in.value != st.out.value ||
        read_elsewhere(lp, st.out.value, nx) || lp.root(nx.out.value) == lp.root(st.in.value))
      return nullptr;
    return one_product(nx, C, rows);
  }
  // A product into a whole value [R, C] that only the next step, a residual add of whole values,
  // reads; the add's output not in the product's input: the product's weight, else null.
  const T* add_product(const sdk::LayerProgram& lp, size_t i, int64_t C) const {
    const sdk::LayerStep &st = lp.steps[i], &nx = lp.steps[i + 1];
    if (!sdk::product_then_residual_add(lp, i) || !whole(lp, st.out, C) || !whole(lp, nx.out, C) ||
        !whole(lp, nx.in, C) || !whole(lp, nx.in2, C))
      return nullptr;
    int64_t rows = 0;
    const T* W = one_product(st, st.in.width, rows);
    return W != nullptr && rows == C ? W : nullptr;
  }

  // A layer whose first step is a norm of its input into a value no other shares and that is not
  // its output: that value can live in norm_scratch instead of the layer's block.
  static bool lead_norm_fusable(const sdk::LayerProgram& lp, int64_t C) {
    if (lp.steps.empty() || !norm_of(lp, lp.steps[0], 0, C)) return false;
    const int o = lp.steps[0].out.value;
    if (o == 0 || lp.values[size_t(o)].storage >= 0 || o == lp.root(lp.output)) return false;
    for (size_t i = 1; i < lp.values.size(); ++i)
      if (lp.values[i].storage == o) return false;
    return true;
  }

  static bool adjacent_ropes(const sdk::LayerStep& a, const sdk::LayerStep& b) {
    return a.op == sdk::StepOp::rope && b.op == sdk::StepOp::rope && a.table == b.table &&
           a.head_dim == b.head_dim && a.in.value == b.in.value && b.in.col == a.in.col + a.heads * a.head_dim;
  }

  void run_step(int64_t l, const sdk::LayerStep& st, std::vector<T*>& v, int64_t R) {
    const sdk::LayerProgram& lp = m_.program().layers[size_t(l)];
    const sdk::TransformerDesc& desc = m_.desc();
    auto cols = [&](const sdk::Cols& c) { return v[size_t(c.value)] + c.col; };
    auto ld = [&](const sdk::Cols& c) { return lp.values[size_t(c.value)].width; };
    T* in = st.in.valid() ? cols(st.in) : nullptr;
    T* out = st.out.valid() ? cols(st.out) : nullptr;
    const int64_t ldi = st.in.valid() ? ld(st.in) : 0, ldo = st.out.valid() ? ld(st.out) : 0;
    switch (st.op) {
      case sdk::StepOp::norm:
        b_.norm(out, ldo, in, ldi, b_.w(st.weights[0]), R, st.in.width, float(st.eps), float(st.offset));
        break;
      case sdk::StepOp::head_norm:  // per head over head_dim; the output is a whole contiguous value
        for (int64_t h = 0; h < st.heads; ++h)
          b_.norm(out + h * st.head_dim, ldo, in + h * st.head_dim, ldi, b_.w(st.weights[0]), R, st.head_dim,
                  float(st.eps), float(st.offset));
        break;
      case sdk::StepOp::linear: {
        const int64_t K = st.in.width;
        int64_t row = 0;
        for_each_linear_product(desc, st, [&](int64_t p) { return b_.w(p); }, [&](size_t i, int64_t n) {
          b_.linear(out + row, ldo, in, ldi, b_.w(st.weights[i]), R, n, K);
          row += n;
        });
        // Row-parallel (tensor parallelism): a partial sum over this rank's input columns, summed
        // over the group before the bias (whole on every rank) is added once. The output is a
        // whole value: R x width contiguous.
        if (st.tp_reduce_out) reduce(out, R * st.out.width);
        row = 0;
        for (size_t i = 0; i < st.weights.size(); ++i) {
          const int64_t n = desc.params[size_t(st.weights[i])].shape[0];
          if (st.biases[i] >= 0) b_.bias_add(out + row, ldo, b_.w(st.biases[i]), R, n);
          row += n;
        }
        break;
      }
      case sdk::StepOp::rope:
        b_.rope(st.table, in, ldi, in, ldi, st.heads, st.head_dim, R);
        break;
      case sdk::StepOp::attention:
        b_.attend(l, in, ldi, cols(st.in2), ld(st.in2), cols(st.in3), ld(st.in3), out, ldo, R);
        break;
      case sdk::StepOp::glu:
        b_.glu(st.act, out, ldo, in, ldi, R, st.out.width);
        break;
      case sdk::StepOp::add:  // whole values, contiguous [R, width]
        b_.add(out, in, cols(st.in2), R * st.out.width);
        break;
      case sdk::StepOp::moe:
        b_.moe(l, R, in, out);
        if (st.tp_reduce_out) reduce(out, R * st.out.width);  // the experts' partial sums, after the combine
        break;
      case sdk::StepOp::mla: {
        const LayerShape& s = m_.shapes()[size_t(l)];
        T* qkv = cols(st.out2);
        mla_qkv(l, in, qkv, R);
        b_.attend(l, qkv, s.Wqkv, qkv + s.Hq * s.Dk, s.Wqkv, qkv + 2 * s.Hq * s.Dk, s.Wqkv, out, ldo, R);
        break;
      }
    }
  }

  // A tensor-parallel step's sum over the group: only backends that run tensor parallelism
  // have it (DecodeModel marks programs only for those).
  void reduce(T* y, int64_t n) {
    if constexpr (requires { b_.tp_reduce(y, n); })
      b_.tp_reduce(y, n);
    else
      throw std::logic_error("generator: this executor does not run tensor-parallel programs");
  }

  // The q, k and v of a multi-head latent attention layer (DeepSeek-V2/V3) for the step's rows:
  // the engine's forward (sdk/engine/src/mla.cpp), op for op:
  //
  //   q      = q_b(q_a_norm(q_a(xn)))  [R, H (dn+dr)]     (or q_proj(xn) without q_lora_rank)
  //   kva    = kv_a(xn)                [R, rkv + dr]       latent | k_rot
  //   kv     = kv_b(kv_a_norm(latent)) [R, H (dn+dv)]     per head: k_nope | v
  //   q_rot  = rope(q[.., dn:]),  k_rot = rope(kva[.., rkv:]), shared by every head
  //
  // The results land where a GQA layer's do, in the q|k|v buffer (rows Wqkv = H (2 (dn+dr) + dv)
  // apart, heads contiguous), so the layer continues as any other: keys and values go into the
  // paged cache and attention reads them with Dk = dn + dr, Dv = dv. The cache thus holds the
  // expanded per-head keys and values, H (dn + dr + dv) elements per token and layer, where the
  // latent (rkv + dr) would do: caching the latent and absorbing kv_b into q and o (q.k as
  // (q W_uk).latent) is the memory optimisation left for later; it is the same math in another
  // rounding order, and costs a product per cached token per step where this reads a cache.
  //
  // Differences from the engine that change no value: kv_b is one product over all heads into
  // scratch, then copied into k_nope and v (the engine takes 2H products straight into them;
  // each output element of the batch-invariant gemm is the same k-ordered sum whatever the
  // column split), and the rotated key is formed once per head from the shared unrotated one, as
  // the engine's rope does. DeepSeek's interleaved RoPE (rope_interleave) rotates pairs
  // (2i, 2i+1) in place through the rope op, as the engine does; HF de-interleaves first, which
  // permutes q's and k's rotated dims alike and leaves q.k unchanged.
  void mla_qkv(int64_t l, const T* xn, T* qkv, int64_t R) {
    const LayerShape& s = m_.shapes()[size_t(l)];
    const int64_t C = m_.hidden(), H = s.Hq, D = s.Dk, W = s.Wqkv;
    const int64_t dn = s.dn, dr = s.dr, dv = s.Dv, rq = s.rq, rkv = s.rkv, wkv = H * (dn + dv);
    T* q = qkv;        // [R, H*D]
    T* k = q + H * D;  // [R, H*D]
    T* v = k + H * D;  // [R, H*dv]
    // Scratch carved as mla_elems() counts it.
    T* qa = b_.mla_scratch();               // [R, rq]     q latent, normed in place
    T* kva = qa + round16(R * rq);          // [R, rkv+dr] kv latent | k_rot (unrotated)
    T* ckv = kva + round16(R * (rkv + dr)); // [R, rkv]    kv_a_norm(latent)
    T* kvb = ckv + round16(R * rkv);        // [R, H*(dn+dv)] per head k_nope | v

    if (rq > 0) {
      b_.linear(qa, rq, xn, C, b_.w(s.p_q_a), R, rq, C);                                     // qa [R,rq]
      b_.norm(qa, rq, qa, rq, b_.w(s.p_q_a_norm), R, rq, kMlaLatentEps, 0.f);
      b_.linear(q, W, qa, rq, b_.w(s.p_q_b), R, H * D, rq);                                  // q [R,H*D]
    } else {
      b_.linear(q, W, xn, C, b_.w(s.p_q), R, H * D, C);
    }
    b_.linear(kva, rkv + dr, xn, C, b_.w(s.p_kv_a), R, rkv + dr, C);                         // kva
    b_.norm(ckv, rkv, kva, rkv + dr, b_.w(s.p_kv_a_norm), R, rkv, kMlaLatentEps, 0.f);       // ckv
    b_.linear(kvb, wkv, ckv, rkv, b_.w(s.p_kv_b), R, wkv, rkv);                              // kvb
    for (int64_t h = 0; h < H; ++h) {
      b_.copy2d(k + h * D, W, kvb + h * (dn + dv), wkv, R, dn);                             // k_nope
      b_.copy2d(v + h * dv, W, kvb + h * (dn + dv) + dn, wkv, R, dv);                       // v
    }
    if (s.rope >= 0) {
      for (int64_t h = 0; h < H; ++h) {
        b_.rope(s.rope, q + h * D + dn, W, q + h * D + dn, W, 1, dr, R);                     // q_rot
        b_.rope(s.rope, k + h * D + dn, W, kva + rkv, rkv + dr, 1, dr, R);                   // k_rot
      }
    } else {
      for (int64_t h = 0; h < H; ++h)  // the shared key part into every head, unrotated
        b_.copy2d(k + h * D + dn, W, kva + rkv, rkv + dr, R, dr);
    }
  }

  const DecodeModel& m_;
  B& b_;
};

}  // namespace rlh::gen
