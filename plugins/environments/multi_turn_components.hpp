// The multi-turn components' descriptors (multi_turn_envs.cpp), listed by environments_plugin.cpp.
#pragma once

#include "rlhost/plugin.h"

namespace rlh::environments {

extern const rlh_component_desc kSlidingPuzzleEnv;
extern const rlh_component_desc kCalculatorEnv;
extern const rlh_component_desc kRevealEnv;
extern const rlh_component_desc kSlidingPuzzleData;

}  // namespace rlh::environments
