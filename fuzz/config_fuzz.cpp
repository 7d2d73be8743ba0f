// libFuzzer target for the Step-3.5 config parser: any input must give an Error or a config whose
// resolved geometry keeps every promise of step35_config.h (one LayerGeometry per trunk and MTP layer,
// heads divisible by KV heads, an even rot_dim inside the head, windows only on sliding layers, eos ids
// inside the vocabulary, ...).
// An accepted config is then pushed through what consumes it (tensor catalogue, validation of the
// catalogue against itself, parameter accounting, plan_shape and make_plan), so that UBSan and ASan see
// any overflow or out-of-range access a hostile but accepted config could cause downstream.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "io/safetensors.h"
#include "model/step35_config.h"
#include "model/step35_plan.h"
#include "model/step35_stats.h"
#include "model/step35_weights.h"
#include "parallel/plan.h"

namespace {

using memra::model::AttnKind;
using memra::model::FfnKind;
using memra::model::LayerGeometry;
using memra::model::Step35Config;

bool positive_dim(int v) { return v > 0 && v <= memra::model::kMaxConfigDim; }

void check_layer(const Step35Config &c, const LayerGeometry &g, int i) {
    if (g.index != i || g.is_mtp != (i >= c.n_layers)) __builtin_trap();
    if (!positive_dim(g.n_heads) || !positive_dim(g.n_kv_heads) || !positive_dim(g.head_dim)) __builtin_trap();
    if (g.n_heads % g.n_kv_heads != 0) __builtin_trap();
    if (g.rot_dim <= 0 || g.rot_dim % 2 != 0 || g.rot_dim > g.head_dim) __builtin_trap();
    if (!(g.rope_theta > 0.0) || !std::isfinite(g.rope_theta)) __builtin_trap();
    if (g.rope_scaled && (!c.rope_scaling.present || !g.uses_rope)) __builtin_trap();

    const std::string &type = c.layer_types[static_cast<size_t>(i)];
    if (g.attn == AttnKind::kFull) {
        if (type != "full_attention" || g.window != 0) __builtin_trap();
    } else {
        if (type != "sliding_attention" || g.window <= 0 || g.window != c.sliding_window) __builtin_trap();
    }

    const bool listed = std::binary_search(c.moe_layers.begin(), c.moe_layers.end(), i);
    if ((g.ffn == FfnKind::kMoe) != (listed && !g.is_mtp)) __builtin_trap();
    if (g.ffn == FfnKind::kMoe) {
        if (!positive_dim(g.n_experts) || !positive_dim(g.d_expert) || !positive_dim(g.d_shared)) __builtin_trap();
        if (g.top_k < 1 || g.top_k > g.n_experts || g.d_ff != 0) __builtin_trap();
    } else {
        if (g.d_ff != c.d_ff || !positive_dim(g.d_ff)) __builtin_trap();
        if (g.n_experts != 0 || g.top_k != 0 || g.d_expert != 0 || g.d_shared != 0) __builtin_trap();
        if (g.clamp_routed != 0.0f) __builtin_trap();
    }
    if (!(g.clamp_routed >= 0.0f) || !std::isfinite(g.clamp_routed)) __builtin_trap();
    if (!(g.clamp_shared >= 0.0f) || !std::isfinite(g.clamp_shared)) __builtin_trap();
}

void check_config(const Step35Config &c) {
    if (c.model_type != "step3p5") __builtin_trap();
    if (c.n_layers <= 0 || c.n_mtp_layers < 0) __builtin_trap();
    if (c.n_total_layers() > memra::model::kMaxConfigLayers) __builtin_trap();
    if (c.layers.size() != static_cast<size_t>(c.n_layers) + static_cast<size_t>(c.n_mtp_layers)) __builtin_trap();
    if (c.layer_types.size() != c.layers.size()) __builtin_trap();
    if (!positive_dim(c.d_model) || !positive_dim(c.vocab_size) || !positive_dim(c.d_ff)) __builtin_trap();
    if (c.context_length <= 0) __builtin_trap();
    // Every eos id indexes the vocabulary, so the CLI's narrowing to int32 token ids is exact.
    for (int64_t id : c.eos_token_ids) {
        if (id < 0 || id >= c.vocab_size) __builtin_trap();
    }
    if (!(c.rms_norm_eps > 0.0) || !std::isfinite(c.rms_norm_eps)) __builtin_trap();
    for (size_t i = 0; i < c.moe_layers.size(); ++i) {
        if (c.moe_layers[i] < 0 || c.moe_layers[i] >= c.n_layers) __builtin_trap();
        if (i > 0 && c.moe_layers[i - 1] >= c.moe_layers[i]) __builtin_trap();  // sorted, unique
    }
    if (c.quantization.present) {
        if (c.quantization.quant_method != "fp8") __builtin_trap();
        if (!positive_dim(c.quantization.block_out) || !positive_dim(c.quantization.block_in)) __builtin_trap();
    }
    if (!std::is_sorted(c.unknown_keys.begin(), c.unknown_keys.end())) __builtin_trap();
    for (int i = 0; i < c.n_total_layers(); ++i) check_layer(c, c.layers[static_cast<size_t>(i)], i);
}

// The catalogue as a contiguous tensor list at its released dtypes.
std::vector<memra::io::TensorInfo> catalogue_as_tensors(const std::vector<memra::model::ExpectedTensor> &catalogue) {
    std::vector<memra::io::TensorInfo> out;
    uint64_t offset = 0;
    for (const memra::model::ExpectedTensor &e : catalogue) {
        if (e.dtypes.empty()) __builtin_trap();
        uint64_t n = 1;
        for (int64_t d : e.shape) {
            if (d <= 0) __builtin_trap();
            n *= static_cast<uint64_t>(d);
        }
        const uint64_t end = offset + n * memra::dtype_size(e.dtypes.front());
        out.push_back(memra::io::TensorInfo{e.name, e.dtypes.front(), e.shape, offset, end});
        offset = end;
    }
    return out;
}

void check_consumers(const Step35Config &c) {
    const std::vector<memra::model::ExpectedTensor> catalogue = memra::model::expected_tensors(c);
    const std::vector<memra::io::TensorInfo> tensors = catalogue_as_tensors(catalogue);
    // The catalogue, stored as released, is a valid checkpoint of its own config.
    const memra::model::ValidationReport report = memra::model::validate_tensors(c, tensors);
    if (!report.ok() || report.n_found != catalogue.size()) __builtin_trap();

    const memra::model::ModelStats stats = memra::model::compute_model_stats(c, tensors);
    if (stats.total_params <= 0 || stats.total_params > memra::model::kMaxConfigParams) __builtin_trap();
    if (stats.total_params != stats.trunk_params + stats.mtp_params) __builtin_trap();
    if (stats.active_params <= 0 || stats.active_params > stats.total_params) __builtin_trap();
    if (stats.checkpoint_bytes != stats.expected_bytes) __builtin_trap();

    const memra::parallel::ModelShape shape = memra::model::plan_shape(c);
    if (shape.layers.size() != c.layers.size()) __builtin_trap();
    for (int tp : {1, 2, 4, 8}) {
        memra::parallel::PlanRequest request;
        request.tp = tp;
        request.devices_available = tp;
        auto plan = memra::parallel::make_plan(shape, request);
        if (!plan) continue;  // the config may not split at this degree; that is an Error, not a bug
        if (plan->n_ranks != tp || plan->ranks.size() != static_cast<size_t>(tp)) __builtin_trap();
        for (const memra::parallel::RankPlan &rank : plan->ranks) {
            if (rank.layers.size() != c.layers.size()) __builtin_trap();
        }
        // Routed experts are owned whole: the ranks' ranges tile [0, n_experts) in rank order.
        for (size_t l = 0; l < shape.layers.size(); ++l) {
            int next = 0;
            for (const memra::parallel::RankPlan &rank : plan->ranks) {
                const memra::parallel::Range &e = rank.layers[l].experts;
                if (e.size() > 0 && e.begin != next) __builtin_trap();
                next += e.size();
            }
            if (next != shape.layers[l].n_experts) __builtin_trap();
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const std::string_view text(reinterpret_cast<const char *>(data), size);
    auto cfg = memra::model::parse_step35_config(text);
    if (!cfg) {
        if (cfg.error().message.empty()) __builtin_trap();  // every refusal says why
        return 0;
    }
    check_config(*cfg);
    check_consumers(*cfg);
    return 0;
}
