// KL estimators: the SDK's loss library (rlhost/losses/kl.hpp).
#pragma once

#include "rlhost/losses/kl.hpp"
#include "rlhost/grpo/config.hpp"

namespace rlh::grpo {
using losses::KlType;
using losses::parse_kl_type;
using losses::kl_type_name;
using losses::kl_estimator;
using losses::kl_estimator_dlogr;
using losses::kl_plain;
using losses::KlToken;
using losses::kl_token;
}  // namespace rlh::grpo
