// NeMo-RL's NLLLossFn (see nll_loss.hpp).
#include "rlhost/losses/nll_loss.hpp"

#include <algorithm>
#include <stdexcept>

namespace rlh::losses {

namespace {
constexpr double kEps = 1e-8;
}

LossResult nll_loss(const NllInputs& in, double* grad_logprobs) {
  if (in.logprobs == nullptr || in.token_mask == nullptr || in.sample_mask == nullptr ||
      grad_logprobs == nullptr)
    throw std::invalid_argument("nll_loss: missing logprobs, token_mask, sample_mask or gradient");
  const LossFrame f = make_loss_frame(in.packing);
  const std::vector<double> lp = gather_output(f, in.logprobs);
  const std::vector<double> tm = gather_field(f, in.token_mask);
  std::vector<double> d(f.size(), 0.0);
  const double denom = in.global_valid_toks + kEps;
  double sum = 0, unmasked = 0;
  for (int64_t q = 0; q < f.size(); ++q) {
    const double m = tm[q] * in.sample_mask[f.seq[q]];
    if (m == 0) continue;
    sum += lp[q] * m;
    unmasked += m;
    d[q] = -m / denom;
  }
  LossResult r;
  r.loss = -sum / denom;
  double valid = 0;
  for (int64_t i = 0; i < in.packing.num_seqs; ++i) valid += in.sample_mask[i];
  r.metrics.sum("loss", r.loss);
  r.metrics.sum("num_unmasked_tokens", unmasked);
  r.metrics.sum("num_valid_samples", valid);
  scatter_output(f, d, grad_logprobs, in.packing.num_tokens);
  return r;
}

std::vector<double> per_sample_nll(const LossFrame& f, const std::vector<double>& lp,
                                   const std::vector<double>& mask, bool average,
                                   std::vector<double>* d_scale) {
  const int64_t ns = static_cast<int64_t>(f.seq_begin.size()) - 1;
  std::vector<double> out(ns, 0.0), count(ns, 0.0);
  for (int64_t q = 0; q < f.size(); ++q) {
    if (mask[q] == 0) continue;
    out[f.seq[q]] -= lp[q] * mask[q];
    count[f.seq[q]] += mask[q];
  }
  if (d_scale) d_scale->assign(ns, 1.0);
  if (average) {
    for (int64_t i = 0; i < ns; ++i) {
      const double c = std::max(count[i], 1.0);  // num_unmasked_tokens.clamp(min=1)
      out[i] /= c;
      if (d_scale) (*d_scale)[i] = 1.0 / c;
    }
  }
  return out;
}

}  // namespace rlh::losses
