// Loss metrics: the SDK's loss library (rlhost/losses/metrics.hpp).
#pragma once

#include "rlhost/losses/metrics.hpp"

namespace rlh::grpo {
using losses::Reduce;
using losses::Metric;
using losses::Metrics;
}  // namespace rlh::grpo
