// Expert parallelism's plan, this rank's description, slicing of full tensors and the pass that
// marks a program's MoE steps (expert_parallel.hpp).
#include "rlhost/sdk/expert_parallel.hpp"

#include <cstring>
#include <stdexcept>
#include <string>

namespace rlh::sdk {

const char* to_string(EpSplit s) {
  switch (s) {
    case EpSplit::replicated: return "replicated";
    case EpSplit::experts: return "experts";
  }
  return "?";
}

namespace {

// Megatron's expert layer: the routed experts (SequentialMLP / TEGroupedMLP's fc1 = gate|up and
// fc2 = down) are local to their ep rank; the router and the shared experts are ordinary
// replicated modules.
constexpr EpRule kPlan[] = {
    {ParamRole::expert_gate, EpSplit::experts},
    {ParamRole::expert_up, EpSplit::experts},
    {ParamRole::expert_down, EpSplit::experts},
};

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

}  // namespace

std::span<const EpRule> ep_plan() { return kPlan; }

EpSplit ep_split_of(ParamRole role) {
  for (const EpRule& r : kPlan)
    if (r.role == role) return r.split;
  return EpSplit::replicated;
}

std::string ep_unsupported(const TransformerDesc& d, int64_t P, const std::string& key) {
  const std::string at = key + " = " + std::to_string(P) + ": ";
  if (P < 1) return at + "must be at least 1";
  if (P == 1) return {};
  bool any = false;
  for (const LayerDesc& l : d.layers) {
    if (l.mlp.kind != MlpKind::moe) continue;
    any = true;
    const int64_t E = l.mlp.moe.num_experts;
    if (E % P != 0)
      return at + "layer " + std::to_string(l.index) + ": num_experts = " + std::to_string(E) +
             " is not a multiple of " + std::to_string(P);
  }
  if (!any) return at + d.architecture + " has no mixture-of-experts layer to split";
  for (const ParamDesc& p : d.params)
    if (ep_split_of(p.role) == EpSplit::experts && (p.shape.empty() || p.layer < 0))
      return at + "parameter " + p.name + " is not a stacked expert tensor";
  return {};
}

EpLayout make_ep_layout(const TransformerDesc& d, int64_t P, int64_t r, const std::string& key) {
  if (const std::string why = ep_unsupported(d, P, key); !why.empty()) throw std::invalid_argument(why);
  if (r < 0 || r >= P) throw std::invalid_argument("expert-parallel rank " + std::to_string(r) + " outside 0.." + std::to_string(P - 1));
  EpLayout L;
  L.size = P;
  L.rank = r;
  L.full = d;
  L.local = d;
  for (LayerDesc& l : L.local.layers)
    if (l.mlp.kind == MlpKind::moe) l.mlp.moe.num_local_experts = l.mlp.moe.num_experts / P;
  for (size_t i = 0; i < d.params.size(); ++i) {
    const ParamDesc& p = d.params[i];
    EpPiece pc;
    pc.split = ep_split_of(p.role);
    pc.full = p.shape.empty() ? 1 : p.shape[0];
    pc.count = pc.full;
    if (pc.split == EpSplit::experts) {
      pc.count = pc.full / P;
      pc.begin = r * pc.count;
      ParamDesc& lp = L.local.params[i];
      lp.shape[0] = pc.count;
      // The HF sources of a stacked tensor are one per expert, in expert order: this block's.
      if (lp.hf_names.size() == size_t(pc.full)) {
        lp.hf_names.assign(p.hf_names.begin() + pc.begin, p.hf_names.begin() + pc.begin + pc.count);
        if (lp.hf_shapes.size() == size_t(pc.full))
          lp.hf_shapes.assign(p.hf_shapes.begin() + pc.begin, p.hf_shapes.begin() + pc.begin + pc.count);
      }
    }
    L.pieces.push_back(pc);
  }
  return L;
}

std::vector<float> ep_slice(const EpLayout& L, size_t i, std::span<const float> full) {
  const EpPiece& pc = L.pieces.at(i);
  const std::vector<int64_t>& fs = L.full.params[i].shape;
  if (int64_t(full.size()) != numel(fs))
    throw std::invalid_argument("ep_slice: parameter " + L.full.params[i].name + " has the wrong number of elements");
  const int64_t inner = pc.full > 0 ? numel(fs) / pc.full : 0;
  return std::vector<float>(full.begin() + pc.begin * inner, full.begin() + (pc.begin + pc.count) * inner);
}

void ep_place(const EpLayout& L, size_t i, std::span<const float> local, std::span<float> full) {
  const EpPiece& pc = L.pieces.at(i);
  const std::vector<int64_t>& fs = L.full.params[i].shape;
  const int64_t inner = pc.full > 0 ? numel(fs) / pc.full : 0;
  if (int64_t(full.size()) != numel(fs) || int64_t(local.size()) != pc.count * inner)
    throw std::invalid_argument("ep_place: parameter " + L.full.params[i].name + " has the wrong number of elements");
  std::memcpy(full.data() + pc.begin * inner, local.data(), local.size() * sizeof(float));
}

void mark_expert_parallel(ModelProgram& prog, const EpLayout& L) {
  prog.ep_size = L.size;
  if (L.size == 1) return;
  for (LayerProgram& lp : prog.layers)
    for (LayerStep& st : lp.steps) {
      if (st.op == StepOp::moe) st.ep_dispatch = true;
    }
}

}  // namespace rlh::sdk
