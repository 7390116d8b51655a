// The case list, and the one table of which operands are statistics (docs/ops.md, "dtypes").
#include <map>
#include <set>
#include <stdexcept>

#include "cases.hpp"

namespace rlh::sdk::kcheck {
namespace {

// Operand positions (inputs, outputs) that are statistics or parameter gradients: in a
// "bf16+f32" op they are float32 while the rest is bf16 (what an engine passes: its lse, rstd,
// routing weights and gradient accumulators stay float32).
struct StatPositions {
  std::set<int> in, out;
};
const std::map<std::string, StatPositions>& stat_table() {
  static const std::map<std::string, StatPositions> t = {
      {"gemm", {{2}, {0}}},  // C
      {"embedding_bwd", {{}, {0}}},
      {"rmsnorm_fwd", {{}, {1}}},
      {"rmsnorm_bwd", {{3}, {1}}},
      {"attention_fwd", {{}, {1}}},
      {"attention_bwd", {{5}, {}}},
      {"bias_bwd", {{}, {0}}},
      {"linear_logprob_fwd", {{}, {0, 1, 2}}},
      {"linear_logprob_bwd", {{3, 4, 5, 6}, {1}}},
      {"moe_router_fwd", {{1}, {0, 2, 3}}},
      {"moe_router_bwd", {{0, 1, 3, 4}, {}}},
      {"moe_unpermute_fwd", {{2}, {}}},
      {"moe_unpermute_bwd", {{3}, {1}}},
      {"grouped_gemm", {{}, {0}}},
      {"amax", {{}, {0}}},  // the scale an FP8 recipe derives from it is float32
  };
  return t;
}

void finish_call(const Case& c, Call& call) {
  if (call.op.empty()) return;
  const auto it = stat_table().find(call.op);
  auto fix = [&](std::vector<Operand>& ops, bool input) {
    for (size_t i = 0; i < ops.size(); ++i) {
      Operand& o = ops[i];
      if (o.role != Role::automatic) continue;
      if (o.src == Src::ints) o.role = Role::i32;
      else if (o.src == Src::constant) o.role = Role::f32;
      else if (it != stat_table().end() && (input ? it->second.in : it->second.out).count(int(i))) o.role = Role::stat;
      else o.role = Role::flt;
    }
  };
  fix(call.inputs, true);
  fix(call.outputs, false);
  auto bad = [&](const std::string& why) { throw std::logic_error("conformance case '" + c.name + "': " + why); };
  auto size_of = [&](const Operand& o) -> int64_t {
    const size_t i = size_t(o.index);
    switch (o.src) {
      case Src::input: case Src::grad_input:
        return i < c.in_sizes.size() ? c.in_sizes[i] : -1;
      case Src::output: case Src::grad_output: case Src::saved:
        return i < c.out_sizes.size() ? c.out_sizes[i] : -1;
      case Src::ints: return i < c.ints.size() ? int64_t(c.ints[i].values.size()) : -1;
      case Src::constant: return i < c.consts.size() ? int64_t(c.consts[i].size()) : -1;
    }
    return -1;
  };
  for (const auto* list : {&call.inputs, &call.outputs})
    for (const Operand& o : *list) {
      const int64_t n = size_of(o);
      if (n < 0) bad(call.op + ": an operand names a buffer the case does not have");
      int64_t last = o.layout.offset;  // the furthest element the layout reaches must be inside
      std::vector<int64_t> st = o.layout.strides;
      if (st.empty()) {
        st.assign(o.layout.shape.size(), 1);
        for (int d = int(st.size()) - 2; d >= 0; --d) st[size_t(d)] = st[size_t(d) + 1] * o.layout.shape[size_t(d) + 1];
      }
      for (size_t d = 0; d < o.layout.shape.size(); ++d) last += (o.layout.shape[d] - 1) * st[d];
      if (last >= n) bad(call.op + ": an operand's layout reaches past its buffer");
    }
}

}  // namespace

void finish(Case& c) {
  c.in_positive.resize(c.in_sizes.size(), false);
  c.in_uniform.resize(c.in_sizes.size(), false);
  if (c.in_scale.size() != c.in_sizes.size()) throw std::logic_error("conformance case '" + c.name + "': in_scale");
  finish_call(c, c.fwd);
  finish_call(c, c.bwd);
  finish_call(c, c.fwd_prefix);
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  add_dense_cases(v);
  add_logprob_cases(v);
  add_moe_cases(v);
  add_optimizer_cases(v);
  add_decode_cases(v);
  add_loss_cases(v);
  add_dense_cases_late(v);   // appended: the cases above keep their indices (their seeds)
  add_decode_cases_late(v);
  add_weight_only_cases(v);
  add_decode_layer_cases(v);
  add_fp8_cache_cases(v);
  add_fused_product_cases(v);
  add_rope_kv_cases(v);
  add_residual_epilogue_cases(v);
  for (Case& c : v) finish(c);
  return v;
}

}  // namespace rlh::sdk::kcheck
