// Metrics of a loss call: NeMo-RL's names and its reduction semantics.
//
// A kSum metric is already divided by the global token or sequence count (or is a raw count),
// so summing it over micro-batches and data-parallel ranks gives the step's value: this is what
// rlh_microbatch.metric does. kMin/kMax metrics (probs_ratio_min, ...) are extrema of one call and
// combine with min/max instead; the ABI's metric callback only sums, so the loss adapter keeps
// them in its own accumulator (see loss_adapter.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace rlh::losses {

enum class Reduce : uint8_t { kSum, kMin, kMax };

struct Metric {
  std::string name;
  double value = 0;
  Reduce reduce = Reduce::kSum;
};

class Metrics {
 public:
  void sum(std::string_view name, double v) { add(name, v, Reduce::kSum); }
  void min(std::string_view name, double v) { add(name, v, Reduce::kMin); }
  void max(std::string_view name, double v) { add(name, v, Reduce::kMax); }
  // Adds a value, combining with an existing metric of the same name by its reduction.
  void add(std::string_view name, double v, Reduce r);
  // Combines every metric of `other` into this one.
  void merge(const Metrics& other);

  std::optional<double> get(std::string_view name) const;
  bool has(std::string_view name) const { return get(name).has_value(); }
  const std::vector<Metric>& items() const { return items_; }
  void clear() { items_.clear(); }

 private:
  std::vector<Metric> items_;
};

}  // namespace rlh::losses
