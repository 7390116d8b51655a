// NeMo-RL's MseValueLossFn (see value_loss.hpp).
#include "rlhost/grpo/value_loss.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "json_read.hpp"

namespace rlh::grpo {

using detail::Section;

ValueLossConfig ValueLossConfig::from_json(const nlohmann::json& j, const std::string& where) {
  const Section s(j, where);
  if (j.is_object())
    for (const auto& [k, v] : j.items())
      if (k != "scale" && k != "cliprange")
        throw ConfigError(s.key(k) + ": not a key of NeMo-RL's MseValueLossConfig (scale, cliprange)");
  ValueLossConfig c;
  s.read("scale", c.scale);
  s.read("cliprange", c.cliprange);
  if (!std::isfinite(c.scale)) throw ConfigError(s.key("scale") + ": must be finite");
  if (c.cliprange && !(*c.cliprange >= 0 && std::isfinite(*c.cliprange)))
    throw ConfigError(s.key("cliprange") + ": must be >= 0 or null (null or 0 = no value clipping)");
  return c;
}

LossResult value_loss(const ValueLossConfig& cfg, const ValueLossInputs& in, double* grad) {
  validate(in.packing);
  if (in.values == nullptr || in.returns == nullptr || in.token_mask == nullptr || grad == nullptr)
    throw std::invalid_argument("value_loss: missing values, returns, token_mask or gradient");
  const bool clip = cfg.clipped();
  if (clip && in.old_values == nullptr) throw std::invalid_argument("value_loss: value clipping needs the old values");
  const int64_t ns = in.packing.num_seqs;
  const int64_t* off = in.packing.seq_offsets;
  const double N = in.global_valid_toks + 1e-8;
  const double k = 0.5 * cfg.scale / N;
  double loss = 0, clipfrac = 0, ret_mean = 0, val_mean = 0, ret_sq = 0, res_sq = 0;
  double vmin = std::numeric_limits<double>::infinity(), vmax = -vmin;
  bool any = false;
  for (int64_t i = 0; i < ns; ++i) {
    const double sm = in.sample_mask != nullptr ? in.sample_mask[i] : 1.0;
    for (int64_t t = off[i]; t < off[i + 1]; ++t) {
      grad[t] = 0;
      const double m = in.token_mask[t] * sm;
      const double v = in.values[t], R = in.returns[t];
      const double u = (v - R) * (v - R);
      double f = u, df = 2 * (v - R);
      if (clip) {
        const double c = *cfg.cliprange, lo = in.old_values[t] - c, hi = in.old_values[t] + c;
        const double vc = std::min(std::max(v, lo), hi);
        const double dvc = (v >= lo && v <= hi) ? 1.0 : 0.0;  // torch.clamp: closed interval
        const double q = (vc - R) * (vc - R), dq = 2 * (vc - R) * dvc;
        if (q > u) {
          f = q;
          df = dq;
        } else if (!(u > q)) {
          df = 0.5 * (df + dq);  // torch.max splits the gradient on a tie
        }
        clipfrac += (q > u ? 1.0 : 0.0) * m / N;
      }
      loss += k * f * m;
      grad[t] = k * df * m;
      ret_mean += R * m / N;
      val_mean += v * m / N;
      ret_sq += R * R * m / N;
      res_sq += u * m / N;
      if (m != 0) {  // NeMo-RL: values[mask.bool()]
        any = true;
        vmin = std::min(vmin, v);
        vmax = std::max(vmax, v);
      }
    }
  }
  LossResult r;
  r.loss = loss;
  r.metrics.sum("loss", loss);
  r.metrics.sum("vf_clipfrac", clipfrac);
  r.metrics.sum("returns_mean", ret_mean);
  r.metrics.sum("values_mean", val_mean);
  if (any) {  // (a call with no masked-in token has no extrema to merge)
    r.metrics.min("values_min", vmin);
    r.metrics.max("values_max", vmax);
  }
  r.metrics.sum("returns_sq_mean", ret_sq);
  r.metrics.sum("residual_sq_mean", res_sq);
  r.metrics.sum("num_valid_samples", static_cast<double>(ns));
  return r;
}

double explained_variance(double returns_mean, double values_mean, double returns_sq_mean, double residual_sq_mean) {
  const double var_returns = returns_sq_mean - returns_mean * returns_mean;
  const double var_residual = residual_sq_mean - (returns_mean - values_mean) * (returns_mean - values_mean);
  return 1.0 - var_residual / std::max(var_returns, 1e-8);
}

}  // namespace rlh::grpo
