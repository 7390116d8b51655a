// RoPE inverse frequencies and the cos/sin attention factor, in double precision, following the
// formulas of Hugging Face transformers' modeling_rope_utils (v5) so every backend rotates by the
// same angles. HF evaluates these in float32; we keep double so backends can round once, at the
// precision they run in.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <stdexcept>
#include <string>
#include <vector>

#include "rlhost/sdk/model_desc.hpp"

namespace rlh::sdk {

namespace {

void check_dim(int64_t dim) {
  if (dim <= 0 || dim % 2 != 0)
    throw std::invalid_argument("rope: rotary dim must be a positive even number, got " +
                                std::to_string(dim));
}

// theta^(-2i/dim) for i in [0, dim/2).
std::vector<double> base_inv_freq(double theta, int64_t dim) {
  if (!(theta > 0.0)) throw std::invalid_argument("rope: theta must be positive");
  std::vector<double> f(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i)
    f[static_cast<size_t>(i)] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(dim));
  return f;
}

double require_factor(const RopeDesc& r) {
  if (!(r.factor > 0.0)) throw std::invalid_argument("rope: scaling factor must be positive");
  return r.factor;
}

int64_t require_original_max(const RopeDesc& r) {
  if (r.original_max_position_embeddings <= 0)
    throw std::invalid_argument(std::string("rope: ") + to_string(r.kind) +
                                " needs original_max_position_embeddings");
  return r.original_max_position_embeddings;
}

// Llama 3.1: keep high frequencies, divide low ones by factor, blend in between by wavelength.
std::vector<double> llama3_inv_freq(const RopeDesc& r, int64_t dim) {
  std::vector<double> f = base_inv_freq(r.theta, dim);
  const double factor = require_factor(r);
  const double old_ctx = static_cast<double>(require_original_max(r));
  if (r.high_freq_factor == r.low_freq_factor)
    throw std::invalid_argument("rope: llama3 needs high_freq_factor != low_freq_factor");
  const double low_wavelen = old_ctx / r.low_freq_factor;
  const double high_wavelen = old_ctx / r.high_freq_factor;
  for (double& x : f) {
    const double wavelen = 2.0 * std::numbers::pi / x;
    if (wavelen > low_wavelen) {
      x = x / factor;
    } else if (wavelen >= high_wavelen) {
      // Medium band (HF: neither wavelen < high nor wavelen > low).
      const double smooth = (old_ctx / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      x = (1.0 - smooth) * x / factor + smooth * x;
    }
  }
  return f;
}

// The dimension index at which a frequency completes `rotations` turns over `max_pos` positions.
double yarn_correction_dim(double rotations, int64_t dim, double theta, double max_pos) {
  return static_cast<double>(dim) * std::log(max_pos / (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

// HF treats 0/None alike for beta_fast/beta_slow ("x or default") and for mscale/mscale_all_dim
// (truthiness), so we do too.
double or_default(double v, double d) { return v != 0.0 ? v : d; }
bool truthy(const std::optional<double>& v) { return v.has_value() && *v != 0.0; }

// YaRN: each frequency is a blend of the extrapolated (unscaled) and interpolated (divided by
// factor) value; the blend ramps linearly over the dims between the beta_fast and beta_slow
// correction points.
std::vector<double> yarn_inv_freq(const RopeDesc& r, int64_t dim) {
  const double factor = require_factor(r);
  const double orig = static_cast<double>(require_original_max(r));
  const double beta_fast = or_default(r.beta_fast, 32.0);
  const double beta_slow = or_default(r.beta_slow, 1.0);
  double low = yarn_correction_dim(beta_fast, dim, r.theta, orig);
  double high = yarn_correction_dim(beta_slow, dim, r.theta, orig);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // HF: avoid a zero-width ramp

  std::vector<double> extrap = base_inv_freq(r.theta, dim);
  std::vector<double> out(extrap.size());
  for (size_t i = 0; i < extrap.size(); ++i) {
    double ramp = (static_cast<double>(i) - low) / (high - low);
    ramp = std::clamp(ramp, 0.0, 1.0);
    const double extrap_weight = 1.0 - ramp;
    const double interp = extrap[i] / factor;
    out[i] = interp * (1.0 - extrap_weight) + extrap[i] * extrap_weight;
  }
  return out;
}

// The factor longrope and yarn derive from the context extension when the config has none.
double effective_factor(const RopeDesc& r) {
  if (r.factor > 0.0) return r.factor;
  if (r.max_position_embeddings > 0 && r.original_max_position_embeddings > 0)
    return static_cast<double>(r.max_position_embeddings) /
           static_cast<double>(r.original_max_position_embeddings);
  return 1.0;
}

std::vector<double> longrope_inv_freq(const RopeDesc& r, int64_t dim, int64_t seq_len) {
  const int64_t orig = require_original_max(r);
  const auto& ext = (seq_len > orig) ? r.long_factor : r.short_factor;
  if (static_cast<int64_t>(ext.size()) != dim / 2)
    throw std::invalid_argument("rope: longrope " +
                                std::string(seq_len > orig ? "long_factor" : "short_factor") +
                                " has " + std::to_string(ext.size()) + " entries, expected " +
                                std::to_string(dim / 2));
  std::vector<double> f(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double e = ext[static_cast<size_t>(i)];
    f[static_cast<size_t>(i)] =
        1.0 / (e * std::pow(r.theta, static_cast<double>(2 * i) / static_cast<double>(dim)));
  }
  return f;
}

// Dynamic NTK: theta *= (factor * L / max_pos - (factor - 1))^(dim / (dim - 2)) with L the
// sequence length, never below max_pos.
std::vector<double> dynamic_inv_freq(const RopeDesc& r, int64_t dim, int64_t seq_len) {
  const double factor = require_factor(r);
  if (r.max_position_embeddings <= 0)
    throw std::invalid_argument("rope: dynamic needs max_position_embeddings");
  if (dim <= 2) throw std::invalid_argument("rope: dynamic needs a rotary dim > 2");
  const double max_pos = static_cast<double>(r.max_position_embeddings);
  const double len = std::max(static_cast<double>(seq_len), max_pos);
  const double theta = r.theta * std::pow(factor * len / max_pos - (factor - 1.0),
                                          static_cast<double>(dim) / static_cast<double>(dim - 2));
  return base_inv_freq(theta, dim);
}

}  // namespace

std::vector<double> rope_inv_freq(const RopeDesc& rope, int64_t dim) {
  return rope_inv_freq(rope, dim, 0);
}

std::vector<double> rope_inv_freq(const RopeDesc& rope, int64_t dim, int64_t seq_len) {
  check_dim(dim);
  switch (rope.kind) {
    case RopeKind::none:
      throw std::invalid_argument("rope: kind 'none' has no frequencies");
    case RopeKind::default_:
      return base_inv_freq(rope.theta, dim);
    case RopeKind::linear: {
      auto f = base_inv_freq(rope.theta, dim);
      const double factor = require_factor(rope);
      for (double& x : f) x /= factor;
      return f;
    }
    case RopeKind::dynamic:
      return dynamic_inv_freq(rope, dim, seq_len);
    case RopeKind::llama3:
      return llama3_inv_freq(rope, dim);
    case RopeKind::yarn:
      return yarn_inv_freq(rope, dim);
    case RopeKind::longrope:
      return longrope_inv_freq(rope, dim, seq_len);
  }
  throw std::invalid_argument("rope: unknown kind");
}

double rope_attention_scaling(const RopeDesc& rope) {
  switch (rope.kind) {
    case RopeKind::yarn: {
      if (rope.attention_factor) return *rope.attention_factor;
      const double factor = effective_factor(rope);
      if (truthy(rope.mscale) && truthy(rope.mscale_all_dim))
        return yarn_get_mscale(factor, *rope.mscale) / yarn_get_mscale(factor, *rope.mscale_all_dim);
      return yarn_get_mscale(factor, 1.0);
    }
    case RopeKind::longrope: {
      if (rope.attention_factor) return *rope.attention_factor;
      const double factor = effective_factor(rope);
      if (factor <= 1.0) return 1.0;
      const int64_t orig = require_original_max(rope);
      return std::sqrt(1.0 + std::log(factor) / std::log(static_cast<double>(orig)));
    }
    default:
      return 1.0;
  }
}

}  // namespace rlh::sdk
