// The loss the engine tests and benchmarks train with: mean(-logprob) over the predicted tokens
// (every token but each sequence's first), normalised by the step's global count, as an
// engine::LossFn.
#pragma once

#include "rlhost/engine/engine.hpp"

namespace rlh::test {

inline engine::LossResult nll_loss(const engine::LossContext& ctx, const engine::OutputViews& o,
                                   engine::OutputGrads& g) {
  engine::LossResult r;
  const auto& c = ctx.microbatch->cu_seqlens;
  for (size_t s = 0; s + 1 < c.size(); ++s)
    for (int32_t t = c[s] + 1; t < c[s + 1]; ++t) {
      r.loss -= o.logprob[size_t(t)] / double(ctx.global_tokens);
      g.logprob[size_t(t)] = float(-1.0 / double(ctx.global_tokens));
    }
  return r;
}

}  // namespace rlh::test
