// The layer program: what a model computes, derived once from its description, for every
// executor to run (the CPU engine, the CUDA engine, the generators).
//
// Why: the decoder used to be written once per executor, each with its own reading of the
// description and its own support checks. Here the sequence of ops each layer runs (which op,
// on which weights, over which activation columns, with which attributes), the buffers it reads
// and writes, what its backward must keep, and how gradients flow are decided once. An executor
// is a small interpreter: it owns memory and kernels, and runs each step with the op handles it
// resolved. A model feature (Gemma's sandwich norms, GeGLU, per-layer RoPE, embedding scale) is
// a change here and in the description, not in each executor. Parallel layouts are meant to
// rewrite this program (shard widths, insert communication steps), not branch inside executors.
//
// Shape: a layer's activations are values, each `width` columns per token (the token count N is
// the executor's, per micro-batch). Value 0 is the layer input (the residual stream x_l); the
// value `output` is x_{l+1}. A step reads and writes column blocks (Cols) of values. Steps that
// only add (the residual adds) write in place into their second operand's storage, so
// `storage` chains values that share memory.
//
// Backward: steps run in reverse; each input's gradient goes into a gradient buffer (shared by
// every layer: `grad` ids index ModelProgram::grad_widths; id 0 is d residual stream), written
// by the first step that produces it and accumulated by the others (`accumulate`). A residual
// add passes its output's gradient buffer to both operands (no copy), so the norm that read
// the residual stream accumulates straight into it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "rlhost/sdk/model_desc.hpp"

namespace rlh::sdk {

// Columns [col, col + width) of value `value` of the layer.
struct Cols {
  int value = -1;
  int64_t col = 0;
  int64_t width = 0;
  bool valid() const { return value >= 0; }
};

enum class StepOp : uint8_t {
  norm,       // out = rmsnorm(in) * (w + offset); keeps rstd [N]
  head_norm,  // the same over each of `heads` heads of `head_dim` in `in` (q/k norms); keeps
              // rstd [heads, N]; w is [head_dim], shared by the heads; `out` is a whole value
              // (contiguous [N, heads head_dim], so [N heads, head_dim] rows), `in` may be a slice
  linear,     // out = in W^T (+ b): weights fused along output rows (q|k|v, gate|up)
  rope,       // rotate `heads` heads of `head_dim` in `in` in place (RoPE table `table`)
  attention,  // out = causal attention(q = in, k = in2, v = in3) over packed sequences; keeps
              // lse [hq, N]
  glu,        // out = act(in[:, :F]) * in[:, F:], F = out.width (swiglu, geglu)
  add,        // out = in + in2, in place into in2's storage (the residual adds)
  moe,        // out = the layer's mixture-of-experts MLP of in (the executor's MoE block)
  mla,        // out = DeepSeek multi-head latent attention of in, before o_proj (the
              // executor's MLA block); the q|k|v its attention reads go to out2,
              // H (2 (dn+dr) + dv) wide; keeps lse [H, N]
};
const char* to_string(StepOp op);

struct LayerStep {
  StepOp op = StepOp::norm;
  Cols in, in2, in3, out, out2;
  // Description parameters (indices into TransformerDesc::params): a norm's weight; a linear's
  // weights, fused in this order along its output rows, with one bias each (-1: none).
  std::vector<int64_t> weights, biases;
  double eps = 0, offset = 0;            // norm, head_norm
  int64_t heads = 0, head_dim = 0;       // head_norm, rope
  int table = -1;                        // rope: ModelProgram::ropes index
  int64_t hq = 0, hkv = 0, dk = 0, dv = 0, window = 0;  // attention
  double scale = 0, softcap = 0;                        // attention
  std::string act;  // glu: "silu" (swiglu), "gelu_tanh" or "gelu" (geglu, tanh or erf form)
  // Backward: whether each input's gradient adds into its buffer (else it is written).
  bool accumulate = false, accumulate2 = false, accumulate3 = false;
  // Saved statistic of this step (norm/head_norm rstd, attention lse): rows per token of the
  // layer's stat `stat` (-1: none).
  int stat = -1;
  // Tensor parallelism (tensor_parallel.hpp's pass sets them; false in a one-rank program):
  // all-reduce (sum) this step's output over the group after its forward (a row-parallel
  // linear), or its input's gradient after its backward (a column-parallel linear).
  bool tp_reduce_out = false, tp_reduce_din = false;
  // Expert parallelism (expert_parallel.hpp's pass sets it on MoE steps): the step's routed rows
  // go to the ranks owning their experts and come back (all-to-all dispatch and combine).
  bool ep_dispatch = false;
};

struct LayerValue {
  std::string name;
  int64_t width = 0;
  int storage = -1;           // shares the storage of this (earlier) value: an in-place write
  bool saved = false;         // a backward step reads it (a storage root: one living in it is)
  bool recomputable = false;  // a norm or glu output: selective recompute rebuilds it
  int grad = -1;              // gradient buffer (ModelProgram::grad_widths), -1: needs none
};

struct LayerProgram {
  int64_t index = 0;
  std::vector<LayerValue> values;  // values[0]: the layer input
  int output = -1;                 // the layer output value
  std::vector<LayerStep> steps;
  std::vector<int64_t> stat_rows;  // per saved statistic: rows per token (rstd: heads, lse: hq)
  // The storage a value lives in (following `storage` to its root).
  int root(int v) const {
    while (values[size_t(v)].storage >= 0) v = values[size_t(v)].storage;
    return v;
  }
};

// A RoPE table: inverse frequencies from `rope` for `rotary_dim` dims, cos/sin scaled by
// `scale`; `per_sequence` (dynamic NTK, longrope) when they depend on the sequence length.
struct RopeTable {
  RopeDesc rope;
  int64_t rotary_dim = 0;
  double scale = 1;
  bool interleaved = false;
  bool per_sequence = false;
};

struct ModelProgram {
  int64_t vocab = 0, hidden = 0;
  int64_t embed = -1;            // param index
  double embed_scale = 1;        // x_0 = embed[ids] * embed_scale (1: none)
  std::vector<LayerProgram> layers;
  int64_t final_norm = -1;       // param index
  double final_eps = 0, final_offset = 0;
  int64_t head = -1;             // lm_head param index (the embedding's when tied)
  double logit_softcap = 0;      // 0: none
  int64_t value_head = -1;       // score.weight [1, hidden] param index; -1: no value head
  std::vector<RopeTable> ropes;
  std::vector<int64_t> grad_widths;  // per gradient buffer id: the widest value it holds
  // Tensor parallelism: the group size this (one rank's) program was built and marked for
  // (tensor_parallel.hpp); 1 for the whole model.
  int64_t tp_size = 1;
  // Expert parallelism: the expert-parallel group size this program was marked for
  // (expert_parallel.hpp); 1 for the whole model.
  int64_t ep_size = 1;
  // Pipeline parallelism (pipeline_parallel.hpp's build_stage_program): whether this program
  // starts with the embedding (else the previous stage's activations come in) and ends with the
  // final norm and the head (else its output goes to the next stage). Both true for a whole model.
  bool pp_first = true, pp_last = true;
};

// Derives the program. Throws std::invalid_argument naming the layer and what is inconsistent
// (a missing parameter, a shape that does not match, an unknown activation).
ModelProgram build_program(const TransformerDesc& desc);

// Whether steps i and i + 1 of `lp` are a linear and the residual add that is the only reader of
// its output: the product's value and the add's operands and output are whole values, the
// product is one of the add's two operands, the product's value is not the layer's output, and
// the add's output does not live in the product's input storage. An executor may then run the two
// as one op (gemm_add_fwd) that never writes the product's value. The linear's weights, biases
// and parallel sums (what makes it one product) are the executor's to check.
bool product_then_residual_add(const LayerProgram& lp, size_t i);

// What an executor runs. supports() gives the one answer every executor uses.
struct ExecutorCaps {
  std::string name;                      // "engine", "cuda engine", "generator" (for messages)
  std::vector<std::string> activations = {"silu"};  // glu act names it runs
  bool moe = false, mla = false;
  bool per_sequence_rope = false;        // dynamic NTK / longrope tables
  bool attention_softcap = false, logit_softcap = false;
  bool attention_dv_differs = false;     // attention with dv != dk (MLA needs it)
  bool value_head = false;               // the scalar head (ParamRole::value_head, RLH_OUTPUT_VALUE)
  bool tensor_parallel = false;          // programs marked by mark_tensor_parallel (tp_size > 1)
  bool expert_parallel = false;          // programs marked by mark_expert_parallel (ep_size > 1)
  bool pipeline_stage = false;           // a pipeline stage's program (pp_first / pp_last false)
};
// Empty when `caps` runs `program`, else one line naming the executor and the first feature it
// lacks ("cuda engine: layer 3: dynamic RoPE is not supported").
std::string unsupported(const ModelProgram& program, const ExecutorCaps& caps);

}  // namespace rlh::sdk
