// Mismatch diagnostics: the SDK's loss library (rlhost/losses/diagnostics.hpp).
#pragma once

#include "rlhost/losses/diagnostics.hpp"
#include "rlhost/grpo/kl.hpp"
#include "rlhost/grpo/metrics.hpp"

namespace rlh::grpo {
using losses::MismatchDiagnostics;
using losses::mismatch_diagnostics;
using losses::approx_entropy;
using losses::add_mismatch_metrics;
}  // namespace rlh::grpo
