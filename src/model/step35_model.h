// Step35Model: every checkpoint tensor of a Step-3.5 model bound to a backend's weight handles (official
// names, STEP35.md section 5), after the tensor list has been validated against the config. The bound
// model is plain data; the forward recipe (step35_forward.h) reads it. A model is either whole (TP = 1) or
// one tensor-parallel rank's shard, bound from the parallel plan (the only place sharding is decided). On
// the CPU the handles are zero-copy views (or strided windows) into the store's bytes (a checkpoint's mmap), so
// the io::TensorStore must outlive the backend's use of them; a backend that copies (CUDA) gets each tensor given
// back to the store after its upload (io/tensor_store.h).
#pragma once

#include <vector>

#include "backend/backend.h"
#include "core/result.h"
#include "io/tensor_store.h"
#include "model/step35_config.h"
#include "parallel/plan.h"

namespace memra::model {

// Shapes below are those of a whole model; a TP rank's shard holds the parts its RankLayerPlan names:
// q/g rows of its query heads, k/v rows of its KV heads, o_proj K columns of its canonical blocks, dense
// gate/up rows and down K columns of its d_ff slice, its own routed experts whole, LM head / MTP head
// vocabulary rows. The rest is replicated whole.
struct AttentionWeights {
    MatrixId q;       // q_proj [n_heads * head_dim, d_model]
    MatrixId k;       // k_proj [n_kv_heads * head_dim, d_model]
    MatrixId v;       // v_proj [n_kv_heads * head_dim, d_model]
    MatrixId o;       // o_proj [d_model, n_heads * head_dim], row-parallel (canonical K blocks)
    MatrixId g;       // g_proj [n_heads, d_model]; invalid when use_head_wise_attn_gate is false
    VectorId q_norm;  // [head_dim], (1 + w)
    VectorId k_norm;  // [head_dim], (1 + w)
};

struct MlpWeights {  // a SwiGLU MLP: the dense MLP or the shared expert
    MatrixId gate;   // [d_ff, d_model]
    MatrixId up;     // [d_ff, d_model]
    MatrixId down;   // [d_model, d_ff], row-parallel
};

struct MoeWeights {
    MatrixId router;       // moe.gate.weight [n_experts, d_model] (bf16 widened inside the fp32 product)
    VectorId router_bias;  // moe.router_bias [n_experts] f32, selection only
    BankId gate;           // moe.gate_proj [n_experts, d_expert, d_model] (bf16 or fp8 + scales)
    BankId up;             // moe.up_proj [n_experts, d_expert, d_model]
    BankId down;           // moe.down_proj [n_experts, d_model, d_expert], each expert whole (one K order)
    MlpWeights shared;     // share_expert.{gate,up,down}_proj, width d_shared
};

struct MtpWeights {  // only on MTP layers
    VectorId enorm;      // [d_model]
    VectorId hnorm;      // [d_model]
    MatrixId eh_proj;    // [d_model, 2 * d_model], input [enorm(embedding) | hnorm(hidden)]
    VectorId head_norm;  // transformer.shared_head.norm [d_model]
    MatrixId head;       // transformer.shared_head.output [vocab_size, d_model]
};

struct LayerWeights {
    VectorId input_norm;  // input_layernorm [d_model]
    VectorId post_norm;   // post_attention_layernorm [d_model]
    AttentionWeights attn;
    MlpWeights mlp;  // dense layers (FfnKind::kDense), MTP layers included
    MoeWeights moe;  // MoE layers
    MtpWeights mtp;  // MTP layers
};

// Which part of the model the handles hold.
struct ModelShard {
    bool whole = true;       // every tensor whole: the TP = 1 model, bound without a plan
    int tp = 1;              // TP degree of the plan the shard was bound from (1 when whole)
    parallel::RankPlan rank;  // the rank's holdings per layer (empty when whole)
};

struct Step35Model {
    Step35Config cfg;
    ModelShard shard;
    MatrixId embed;       // model.embed_tokens [vocab_size, d_model]
    VectorId final_norm;  // model.norm [d_model]
    MatrixId lm_head;     // lm_head [vocab_size, d_model] (= embed when tie_word_embeddings)
    std::vector<LayerWeights> layers;  // cfg.layers order: trunk, then MTP
};

// Validates the checkpoint's tensors against cfg (model::validate_tensors: the first error is the
// validation report's), then uploads every tensor to the backend. Errors name the tensor.
Result<Step35Model> bind_step35_model(Backend &backend, const io::TensorStore &store, const Step35Config &cfg);

// The same for TP rank `rank` of `plan` (made by parallel::make_plan from plan_shape(cfg)): only the rank's
// slices are uploaded, as windows of the checkpoint tensors (bind time only; nothing is re-sliced per step).
// Refused besides: a plan with more than one pipeline stage (the forward runs one stage), a rank outside
// the plan, a plan that was not made for this config (it is rebuilt from cfg and compared).
Result<Step35Model> bind_step35_model(Backend &backend, const io::TensorStore &store, const Step35Config &cfg,
                                      const parallel::ParallelPlan &plan, int rank);

}  // namespace memra::model
