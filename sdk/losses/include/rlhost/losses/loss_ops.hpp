// The kernel ops clipped_pg_loss and nll_loss (docs/ops.md): their attribute names, the order of
// their metrics output, and the mapping between a ClippedPGConfig and the attributes. One place,
// so the algorithm that calls the op, the reference op (kernels_cpu) and other providers
// (kernels_cuda's losses.cu) agree.
//
// Operands (token-aligned, as a backend's outputs are: entry t of a sequence is about token t;
// the loss pairs logprob t with field t for t >= 1 within each sequence):
//   clipped_pg_loss  inputs  logprobs [N], advantages [N], generation_logprobs [N],
//                            token_mask [N], sample_mask [S], cu_seqlens i32 [S+1],
//                            prev_logprobs [N] (opt.), reference_policy_logprobs [N] (opt.),
//                            rewards [S] (opt.)
//                    outputs loss [1], dlogprobs [N] (written; 0 at each sequence's first token),
//                            metrics [kClippedPgMetricCount] (opt.)
//   nll_loss         inputs  logprobs [N], token_mask [N], sample_mask [S], cu_seqlens i32 [S+1]
//                    outputs loss [1], dlogprobs [N], metrics [kNllMetricCount] (opt.)
#pragma once

#include <cstddef>
#include <functional>
#include <string_view>
#include <vector>

#include "rlhost/kernels.h"
#include "rlhost/losses/clipped_pg_loss.hpp"
#include "rlhost/losses/metrics.hpp"

namespace rlh::losses {

struct OpMetric {
  const char* name;
  Reduce reduce;
};

// clipped_pg_loss's metrics output, in order (NeMo-RL's names, as clipped_pg_loss() reports
// them). Entries the config does not produce (is_oob_ratio without truncated IS, the clip
// fractions without a clamped ratio) hold 0; clipped_pg_metric_reported() says which exist.
inline constexpr OpMetric kClippedPgMetrics[] = {
    {"loss", Reduce::kSum},
    {"probs_ratio", Reduce::kSum},
    {"probs_ratio_clamped", Reduce::kSum},
    {"probs_ratio_min", Reduce::kMin},
    {"probs_ratio_max", Reduce::kMax},
    {"probs_ratio_clamped_min", Reduce::kMin},
    {"probs_ratio_clamped_max", Reduce::kMax},
    {"kl_penalty", Reduce::kSum},
    {"token_mult_prob_error", Reduce::kSum},
    {"gen_kl_error", Reduce::kSum},
    {"policy_kl_error", Reduce::kSum},
    {"js_divergence_error", Reduce::kSum},
    {"logprob_abs_error", Reduce::kSum},
    {"logprob_abs_error_max", Reduce::kMax},
    {"sampling_importance_ratio", Reduce::kSum},
    {"num_valid_samples", Reduce::kSum},
    {"approx_entropy", Reduce::kSum},
    {"is_oob_ratio", Reduce::kSum},
    {"positive_nll_loss", Reduce::kSum},
    {"actor_loss", Reduce::kSum},
    {"probs_ratio_clip_low_fraction", Reduce::kSum},
    {"probs_ratio_clip_high_fraction", Reduce::kSum},
};
inline constexpr size_t kClippedPgMetricCount = std::size(kClippedPgMetrics);

inline constexpr OpMetric kNllMetrics[] = {
    {"loss", Reduce::kSum},
    {"num_unmasked_tokens", Reduce::kSum},
    {"num_valid_samples", Reduce::kSum},
};
inline constexpr size_t kNllMetricCount = std::size(kNllMetrics);

// Whether clipped_pg_loss() reports metric `index` of kClippedPgMetrics under `cfg`.
bool clipped_pg_metric_reported(const ClippedPGConfig& cfg, size_t index);

// The normalisation counts a loss op takes (attributes global_valid_toks, global_valid_seqs,
// global_positive_toks).
struct LossCounts {
  double valid_toks = 0;
  double valid_seqs = 0;
  double positive_toks = 0;  // 0: NeMo-RL's per-call count (ClippedPGInputs)
};

// The attributes of clipped_pg_loss for `cfg` and `counts`. Names point to static strings; every
// attribute is given, whatever its default.
std::vector<rlh_named_value> clipped_pg_attrs(const ClippedPGConfig& cfg, const LossCounts& counts);
std::vector<rlh_named_value> nll_attrs(const LossCounts& counts);

// The inverse, for a provider: reads attributes through `num(name, fallback)` (a call's
// attributes over its resolution defaults) and validates the config (ConfigError naming the
// attribute's loss_fn key).
using AttrReader = std::function<double(const char* name, double fallback)>;
ClippedPGConfig clipped_pg_config_from_attrs(const AttrReader& num, LossCounts* counts);
LossCounts nll_counts_from_attrs(const AttrReader& num);

}  // namespace rlh::losses
