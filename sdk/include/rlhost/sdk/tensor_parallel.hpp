// Tensor parallelism (Megatron-style) as data and a pass over the layer program (static library
// rlh_model_desc). docs/model_parallelism.md, "Tensor parallelism", says how an executor runs it.
//
// Why a plan keyed by role: which axis of which tensor is cut is a property of the tensor's
// role in the decoder (q/k/v and gate/up are column-parallel: their output rows are cut;
// o and down are row-parallel: their input columns are cut; embedding and lm_head are cut along
// the vocabulary), not of the model's name. The plan below is that table; `make_tp_layout`
// applies it to a description and gives this rank's description (local heads, widths, vocabulary
// rows and parameter shapes), from which `build_program` derives this rank's layer program as
// usual, and `mark_tensor_parallel` then marks the communication that program needs
// (torchtitan's way: a separate pass, executors only honour the marks):
//
//   column-parallel linear (q|k|v, gate|up)  forward: its input is whole on every rank;
//                                            backward: d input is a partial sum -> all-reduce
//   row-parallel linear (o, down)            forward: its output is a partial sum -> all-reduce,
//                                            then its bias (whole on every rank) added once;
//                                            backward: d output is whole on every rank
//   MoE block (experts cut by their width)   both: reduces inside (the output after the combine;
//                                            the routing weights' gradient and d input before
//                                            the router, which every rank holds whole, adds its part)
//   MLA block (heads cut)                    backward: d input is a partial sum -> all-reduce
//
// Attention needs no communication: each rank owns whole query heads and the key/value heads
// they read. With fewer key/value heads than ranks (GQA), each kv head is replicated on the
// ranks whose query heads read it, as Megatron replicates them, and its gradient is the sum of
// those ranks' (TpSplit::kv_rows). Weights every rank holds whole (the norms) get identical
// gradients, except the q/k norms and MLA's latent projections and norms: each rank sees (or
// backpropagates) only its heads, so their gradients are summed (TpSplit::replicated_sum).
//
// Vocabulary: rank r holds rows [r B, min(V, (r + 1) B)) of the embedding and lm_head, B =
// ceil(V / T) (the last rank's block zero-padded to B rows). The embedding is a masked lookup
// plus an all-reduce; the fused logprob head combines per-rank max / sum-exp statistics, so the
// full [N, V] logits never exist on one rank.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rlhost/sdk/layer_program.hpp"
#include "rlhost/sdk/model_desc.hpp"

namespace rlh::sdk {

enum class TpSplit {
  replicated,      // whole on every rank, identical gradients (norms)
  replicated_sum,  // whole on every rank, gradients summed over the group (q/k norms)
  rows,            // output rows cut in T equal blocks (column-parallel q, gate, up)
  cols,            // input columns cut in T equal blocks (row-parallel o, down)
  kv_rows,         // k/v rows by kv head: cut when kv heads >= T, else replicated per head
  vocab_rows,      // vocabulary rows in blocks of ceil(V / T), the last one padded
  expert_rows,     // stacked experts [E, F, C]: each expert's rows (axis 1) in T blocks (gate, up)
  expert_cols,     // stacked experts [E, C, F]: each expert's columns (axis 2) in T blocks (down)
  experts_whole,   // stacked experts not cut over the group (expert_tensor_parallel_size = 1 under
                   // expert parallelism: each rank of the ep group, tp ranks included, holds other
                   // experts whole; norm weight 1, the gradients are the experts' owner's)
};
// (With an expert tensor-parallel size Te strictly between 1 and T, expert_rows / expert_cols
// cut each expert in Te blocks instead of T: TpLayout::expert_size.)
const char* to_string(TpSplit s);

// The sharding plan: every role tensor parallelism runs, and how it is cut. A role not in the
// plan (value heads) is refused by make_tp_layout.
struct TpRule {
  ParamRole role;
  TpSplit split;
};
std::span<const TpRule> tp_plan();

// One parameter on one rank: the slice [begin, begin + count) along `axis` (0, 1 or 2) of the full tensor,
// stored in `extent` rows/columns locally (extent > count only for a padded vocabulary block).
struct TpPiece {
  TpSplit split = TpSplit::replicated;
  int axis = 0;
  int64_t begin = 0, count = 0, extent = 0, full = 0;
  // Each rank's sum of squares of this gradient times `norm_weight`, summed over the group,
  // counts every element of the full gradient once (1 for cut tensors, 1/T for replicated
  // ones, kv heads / T for replicated kv heads).
  double norm_weight = 1;
  bool sum_grads = false;  // the group sums this gradient (replicated_sum, replicated kv heads)
};

struct TpLayout {
  int64_t size = 1, rank = 0;
  // The routed experts' tensor-parallel size Te (Megatron's expert_tensor_parallel_size) and this
  // rank's place in it: Te = size cuts every expert over the whole group; 1 leaves them whole
  // (TpSplit::experts_whole); a Te between them (dividing size) cuts each expert in Te blocks,
  // rank r holding block r mod Te: with Megatron's rank order (tp fastest in the dense layout,
  // etp fastest in the expert one) that is its position in its expert tensor-parallel group.
  // Under Te < size the experts' pieces have norm weight 1: the owner sums their squares over
  // the expert groups (etp x ep), not over tp.
  int64_t expert_size = 1, expert_rank = 0;
  TransformerDesc full;   // the model as one rank sees it
  TransformerDesc local;  // this rank's: local heads, widths, vocabulary rows, parameter shapes
  std::vector<TpPiece> pieces;  // per parameter (desc order)
  int64_t vocab = 0, vocab_begin = 0, vocab_count = 0, vocab_block = 0;
};

// Empty when `size` ranks can run `desc` with tensor parallelism, else one line naming the
// first setting that stops it ("tensor_model_parallel_size = 4 does not divide
// num_attention_heads = 6"). `key` names the setting in messages.
// `expert_size`: Megatron's expert_tensor_parallel_size Te (0: size, its default). 1 (with expert
// parallelism) leaves the routed experts whole (TpSplit::experts_whole); a Te strictly between
// 1 and size that divides it cuts each expert in Te blocks (the expert width a multiple of Te).
// The shared expert is always cut over the whole group, as a dense MLP.
std::string tp_unsupported(const TransformerDesc& desc, int64_t size,
                           const std::string& key = "tensor_model_parallel_size", int64_t expert_size = 0);
// Throws std::invalid_argument with tp_unsupported's line when it is not empty.
TpLayout make_tp_layout(const TransformerDesc& desc, int64_t size, int64_t rank,
                        const std::string& key = "tensor_model_parallel_size", int64_t expert_size = 0);

// This rank's part of parameter i (full tensor in row-major desc shape), in local shape.
std::vector<float> tp_slice(const TpLayout& layout, size_t i, std::span<const float> full);
// Writes a rank's part `local` of parameter i (as tp_slice gives it for that rank's layout)
// into the full tensor.
void tp_place(const TpLayout& layout, size_t i, std::span<const float> local, std::span<float> full);

// The vocabulary-parallel embedding's local half: row r of x [R, C] is this rank's embedding row
// of ids[r] (rows [vocab_begin, vocab_begin + vocab_count) of the vocabulary, W holding them), or
// zeros for an id another rank holds; summing x over the group gives one rank's lookup exactly.
void tp_embedding_lookup(const TpLayout& layout, float* x, const int32_t* ids, int64_t R, const float* W, int64_t C);

// The pass: marks the communication of this rank's program (built from layout.local) —
// LayerStep::tp_reduce_out on row-parallel linears, tp_reduce_din on column-parallel ones.
// Throws std::logic_error if a column-parallel linear's input gradient is accumulated (it must
// be its only reader to be reduced alone).
void mark_tensor_parallel(ModelProgram& program, const TpLayout& layout);

}  // namespace rlh::sdk
