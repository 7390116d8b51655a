// Expert parallelism (Megatron-style) as data and a pass over the layer program (static library
// rlh_model_desc). docs/model_parallelism.md, "Expert parallelism", says how an executor runs it.
//
// Why a plan keyed by role, as for tensor parallelism (tensor_parallel.hpp): which tensors are
// cut is a property of their role. The routed experts' stacked weights (expert_gate, expert_up,
// expert_down: [E, ...]) are cut along the expert axis, rank r of the ep group holding experts
// [r E/ep, (r + 1) E/ep); everything else (embedding, attention, norms, the router, its biases,
// the shared expert and its gate, the head) is replicated over the ep group. In Megatron's
// layout the ep group is carved from the data-parallel ranks (parallel_groups.hpp: world 4,
// ep 2 -> expert data-parallel size 2), so every rank trains on its own batch shard:
//
//   replicated tensors   gradients reduced over the dense data-parallel group (dp_cp)
//   expert tensors       gradients reduced over the expert data-parallel group (expert_dp):
//                        the ranks that hold the same experts
//
// The pass (`mark_expert_parallel`) marks every MoE step of this rank's program: the executor
// then routes each token locally (the router is replicated), sends each (token, choice) row to
// the rank owning its expert (all-to-all dispatch, dropless: no capacity, every row goes),
// runs its own experts over the rows it received from every rank, and sends the outputs back
// (all-to-all combine). The backward runs the same exchanges for the gradients. The router's
// auxiliary losses and routing record/replay stay per token and local.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rlhost/sdk/layer_program.hpp"
#include "rlhost/sdk/model_desc.hpp"

namespace rlh::sdk {

enum class EpSplit {
  replicated,  // whole on every rank of the ep group (gradients reduced over dense dp)
  experts,     // cut along axis 0 (the expert axis) in ep equal blocks (reduced over expert dp)
};
const char* to_string(EpSplit s);

// The sharding plan: the roles cut over the expert-parallel group; every other role is
// replicated.
struct EpRule {
  ParamRole role;
  EpSplit split;
};
std::span<const EpRule> ep_plan();
// The rule of a role (replicated when the plan does not name it).
EpSplit ep_split_of(ParamRole role);

// One parameter on one rank: experts [begin, begin + count) of `full` along axis 0.
struct EpPiece {
  EpSplit split = EpSplit::replicated;
  int64_t begin = 0, count = 0, full = 0;
};

struct EpLayout {
  int64_t size = 1, rank = 0;
  TransformerDesc full;   // the model as one rank sees it
  TransformerDesc local;  // this rank's: its experts' parameter shapes, num_local_experts set
  std::vector<EpPiece> pieces;  // per parameter (desc order)
  bool is_expert(size_t i) const { return pieces.at(i).split == EpSplit::experts; }
};

// Empty when `size` ranks can run `desc` with expert parallelism, else one line naming the first
// setting that stops it ("expert_model_parallel_size = 3 does not divide num_experts = 8 of
// layer 0"). `key` names the setting in messages.
std::string ep_unsupported(const TransformerDesc& desc, int64_t size,
                           const std::string& key = "expert_model_parallel_size");
// Throws std::invalid_argument with ep_unsupported's line when it is not empty.
EpLayout make_ep_layout(const TransformerDesc& desc, int64_t size, int64_t rank,
                        const std::string& key = "expert_model_parallel_size");

// This rank's part of parameter i (the full tensor in row-major desc shape), in local shape.
std::vector<float> ep_slice(const EpLayout& layout, size_t i, std::span<const float> full);
// Writes a rank's part `local` of parameter i into the full tensor.
void ep_place(const EpLayout& layout, size_t i, std::span<const float> local, std::span<float> full);

// The pass: marks this rank's program (built from layout.local, whose expert tensors
// build_program checks against num_local_experts): ModelProgram::ep_size and
// LayerStep::ep_dispatch on every MoE step.
void mark_expert_parallel(ModelProgram& program, const EpLayout& layout);

}  // namespace rlh::sdk
