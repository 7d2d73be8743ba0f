// Step-3.5 config -> parallel::ModelShape (see step35_plan.h).
#include "model/step35_plan.h"

namespace memra::model {

parallel::ModelShape plan_shape(const Step35Config &cfg) {
    parallel::ModelShape shape;
    shape.d_model = cfg.d_model;
    shape.vocab_size = cfg.vocab_size;
    for (const LayerGeometry &g : cfg.layers) {
        parallel::LayerShape l;
        l.n_heads = g.n_heads;
        l.n_kv_heads = g.n_kv_heads;
        l.head_dim = g.head_dim;
        l.is_mtp = g.is_mtp;
        l.sliding = g.attn == AttnKind::kSliding;
        l.moe = g.ffn == FfnKind::kMoe;
        l.d_ff = g.d_ff;
        l.n_experts = g.n_experts;
        l.top_k = g.top_k;
        l.d_expert = g.d_expert;
        l.d_shared = g.d_shared;
        l.fp8_experts = l.moe && cfg.is_fp8();
        shape.layers.push_back(l);
    }
    return shape;
}

}  // namespace memra::model
