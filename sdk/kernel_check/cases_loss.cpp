// Cases of the loss ops (clipped_pg_loss, nll_loss; docs/ops.md): packed sequences of several
// lengths (one of a single token, which has no loss position), masks drawn in [0, 1) (weights,
// as NeMo-RL's masks multiply), and the ClippedPG options a device loss must get right: the PPO
// ratio with asymmetric and dual clip, k1/k2/k3 KL with its input and output clamps, the
// on-policy KL approximation, importance-sampling correction with each truncation, sequence-level
// reduction, force_on_policy_ratio, disable_ppo_ratio and CISPO.
#include <string>

#include "cases.hpp"

namespace rlh::sdk::kcheck {
namespace {

const std::vector<int32_t> kOffsets = {0, 5, 6, 14, 27};  // lengths 5, 1, 8, 13

struct PgOpts {
  std::string label;
  std::vector<Attr> attrs;
  bool ref = true;  // reference_policy_logprobs (the KL term's input) given
};

// Inputs: logprobs, advantages, generation_logprobs, token_mask, sample_mask, cu_seqlens,
// prev_logprobs (given always: force_on_policy_ratio ignores it), reference_policy_logprobs.
Case clipped_pg_case(const PgOpts& o) {
  Case c;
  const int64_t S = int64_t(kOffsets.size()) - 1, N = kOffsets.back();
  c.name = "clipped_pg_loss " + o.label + " S=" + std::to_string(S) + " N=" + std::to_string(N);
  c.in_sizes = {N, N, N, N, S, N};
  c.in_scale = {0.4, 1, 0.4, 1, 1, 0.4};
  c.in_uniform = {false, false, false, true, true, false};
  if (o.ref) {
    c.in_sizes.push_back(N);
    c.in_scale.push_back(0.4);
    c.in_uniform.push_back(false);
  }
  c.out_sizes = {1, N, 22};
  c.ints = {IntBuf{kOffsets, {S + 1}}};
  std::vector<Operand> ins = {in(0, contiguous({N})), in(1, contiguous({N})), in(2, contiguous({N})),
                              in(3, contiguous({N})), in(4, contiguous({S})), ints(0, {S + 1}),
                              in(5, contiguous({N}))};
  if (o.ref) ins.push_back(in(6, contiguous({N})));
  std::vector<Attr> attrs = {attr_d("global_valid_toks", 9.5), attr_d("global_valid_seqs", 2.5)};
  attrs.insert(attrs.end(), o.attrs.begin(), o.attrs.end());
  c.fwd = {"clipped_pg_loss", ins, {out(0, contiguous({1})), out(1, contiguous({N})), out(2, contiguous({22}))},
           attrs, {}, {}};
  return c;
}

Case nll_case() {
  Case c;
  const int64_t S = int64_t(kOffsets.size()) - 1, N = kOffsets.back();
  c.name = "nll_loss S=" + std::to_string(S) + " N=" + std::to_string(N);
  c.in_sizes = {N, N, S};
  c.in_scale = {1, 1, 1};
  c.in_uniform = {false, true, true};
  c.out_sizes = {1, N, 3};
  c.ints = {IntBuf{kOffsets, {S + 1}}};
  c.fwd = {"nll_loss", {in(0, contiguous({N})), in(1, contiguous({N})), in(2, contiguous({S})), ints(0, {S + 1})},
           {out(0, contiguous({1})), out(1, contiguous({N})), out(2, contiguous({3}))},
           {attr_d("global_valid_toks", 7.25)}, {}, {}};
  return c;
}

}  // namespace

void add_loss_cases(std::vector<Case>& v) {
  v.push_back(clipped_pg_case({"ppo k3 clamps", {attr_d("kl_penalty", 0.05), attr_i("kl_type", 3),
                                                 attr_d("kl_input_clamp", 0.5), attr_d("kl_output_clamp", 0.08)}}));
  v.push_back(clipped_pg_case({"dual clip k1 tis seq-level",
                               {attr_d("ratio_clip_min", 0.1), attr_d("ratio_clip_max", 0.28),
                                attr_d("ratio_clip_c", 1.5), attr_d("kl_penalty", 0.02), attr_i("kl_type", 1),
                                attr_i("use_importance_sampling_correction", 1), attr_i("tis_type", 1),
                                attr_d("tis_ratio", 1.2), attr_i("token_level_loss", 0)}}));
  v.push_back(clipped_pg_case({"icepop k2 on-policy kl",
                               {attr_d("kl_penalty", 0.1), attr_i("kl_type", 2), attr_d("kl_input_clamp", 0),
                                attr_d("kl_output_clamp", 0), attr_i("use_on_policy_kl_approximation", 1),
                                attr_i("use_importance_sampling_correction", 1), attr_i("tis_type", 2),
                                attr_d("tis_ratio", 1.3), attr_d("tis_ratio_min", 0.7)}}));
  v.push_back(clipped_pg_case({"seq-mask-tis constant_normalizer",
                               {attr_d("kl_penalty", 0.0), attr_i("use_importance_sampling_correction", 1),
                                attr_i("tis_type", 3), attr_d("tis_ratio", 1.1), attr_d("tis_ratio_min", 0.9),
                                attr_d("constant_normalizer", 6)},
                               false}));
  v.push_back(clipped_pg_case({"force_on_policy_ratio", {attr_i("force_on_policy_ratio", 1), attr_d("kl_penalty", 0.03)}}));
  v.push_back(clipped_pg_case({"disable_ppo_ratio", {attr_i("disable_ppo_ratio", 1), attr_d("kl_penalty", 0.0)}, false}));
  v.push_back(clipped_pg_case({"cispo", {attr_i("use_cispo", 1), attr_d("kl_penalty", 0.0)}, false}));
  v.push_back(nll_case());
}

}  // namespace rlh::sdk::kcheck
