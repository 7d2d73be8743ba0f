// Bridges a Step-3.5 config to the parallel planner: the per-layer shapes parallel/plan needs,
// so the planner never sees config.json and the config never knows about ranks.
#pragma once

#include "model/step35_config.h"
#include "parallel/plan.h"

namespace memra::model {

// One LayerShape per layer (trunk then MTP). Routed experts count as FP8 when the config carries a
// quantization_config (the released FP8 checkpoint quantizes exactly those); the scale tile edge is
// the least common multiple of its weight_block_size entries.
parallel::ModelShape plan_shape(const Step35Config &cfg);

}  // namespace memra::model
