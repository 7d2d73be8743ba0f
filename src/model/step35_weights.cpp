// Step-3.5 tensor catalogue (STEP35.md 5.1-5.3) and checkpoint validation. Dtype policy: weights as
// released (BF16) or F32/F16 (tiny test checkpoints); router weight BF16 or F32 (open question 4);
// router_bias F32 only (every known export keeps it F32, and the selection it drives is sensitive to
// rounding); FP8 scales F32 only. Nothing here reads files.
#include "model/step35_weights.h"

#include <algorithm>
#include <charconv>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "core/check.h"

namespace memra::model {
namespace {

constexpr DType kFloatDtypes[] = {DType::kBF16, DType::kF32, DType::kF16};
constexpr DType kRouterDtypes[] = {DType::kBF16, DType::kF32};
constexpr DType kF32Only[] = {DType::kF32};
constexpr DType kFp8Only[] = {DType::kF8E4M3};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string format_dtypes(std::span<const DType> dtypes) {
    std::string out;
    for (size_t i = 0; i < dtypes.size(); ++i) {
        if (i > 0) {
            out += i + 1 == dtypes.size() ? " or " : ", ";
        }
        out += dtype_name(dtypes[i]);
    }
    return out;
}

// Builds the catalogue entry by entry.
class Catalogue {
public:
    explicit Catalogue(const Step35Config &cfg) : cfg_(cfg) {}

    void add(std::string name, std::vector<int64_t> shape, TensorRole role, int layer) {
        ExpectedTensor t;
        t.name = std::move(name);
        t.shape = std::move(shape);
        t.layer = layer;
        t.role = role;
        switch (role) {
        case TensorRole::kRouter:
            t.dtypes.assign(std::begin(kRouterDtypes), std::end(kRouterDtypes));
            break;
        case TensorRole::kRouterBias:
        case TensorRole::kFp8Scale:
            t.dtypes.assign(std::begin(kF32Only), std::end(kF32Only));
            break;
        case TensorRole::kRoutedExperts:
            if (cfg_.is_fp8()) {
                t.dtypes.assign(std::begin(kFp8Only), std::end(kFp8Only));
                t.fp8 = Fp8Rule::kRequired;
            } else {
                t.dtypes.assign(std::begin(kFloatDtypes), std::end(kFloatDtypes));
            }
            break;
        case TensorRole::kAttention:
        case TensorRole::kDenseMlp:
        case TensorRole::kSharedExpert:
        case TensorRole::kMtpProj:
        case TensorRole::kMtpHead:
        case TensorRole::kLmHead:
            t.dtypes.assign(std::begin(kFloatDtypes), std::end(kFloatDtypes));
            t.fp8 = cfg_.is_fp8() ? Fp8Rule::kAllowed : Fp8Rule::kNever;
            break;
        case TensorRole::kEmbedding:
        case TensorRole::kNorm:
            t.dtypes.assign(std::begin(kFloatDtypes), std::end(kFloatDtypes));
            break;
        }
        const bool needs_scale = t.fp8 == Fp8Rule::kRequired;
        out_.push_back(std::move(t));
        if (needs_scale) {
            const ExpectedTensor &w = out_.back();
            ExpectedTensor s;
            s.name = w.name + std::string(kFp8ScaleSuffix);
            s.shape = fp8_scale_shape(w.shape, cfg_.quantization.block_out, cfg_.quantization.block_in);
            s.dtypes.assign(std::begin(kF32Only), std::end(kF32Only));
            s.layer = layer;
            s.role = TensorRole::kFp8Scale;
            out_.push_back(std::move(s));
        }
    }

    void add_layer(const LayerGeometry &g) {
        const int64_t d = cfg_.d_model;
        const int64_t q = int64_t{g.n_heads} * g.head_dim;
        const int64_t kv = int64_t{g.n_kv_heads} * g.head_dim;
        const std::string p = fmt::format("model.layers.{}.", g.index);
        const int i = g.index;
        add(p + "input_layernorm.weight", {d}, TensorRole::kNorm, i);
        add(p + "post_attention_layernorm.weight", {d}, TensorRole::kNorm, i);
        add(p + "self_attn.q_proj.weight", {q, d}, TensorRole::kAttention, i);
        add(p + "self_attn.k_proj.weight", {kv, d}, TensorRole::kAttention, i);
        add(p + "self_attn.v_proj.weight", {kv, d}, TensorRole::kAttention, i);
        add(p + "self_attn.o_proj.weight", {d, q}, TensorRole::kAttention, i);
        if (cfg_.use_head_wise_attn_gate) {
            add(p + "self_attn.g_proj.weight", {g.n_heads, d}, TensorRole::kAttention, i);
        }
        // The HF code builds q_norm/k_norm whatever use_qk_norm says, so they are always expected.
        add(p + "self_attn.q_norm.weight", {g.head_dim}, TensorRole::kNorm, i);
        add(p + "self_attn.k_norm.weight", {g.head_dim}, TensorRole::kNorm, i);
        if (g.ffn == FfnKind::kDense) {
            add(p + "mlp.gate_proj.weight", {g.d_ff, d}, TensorRole::kDenseMlp, i);
            add(p + "mlp.up_proj.weight", {g.d_ff, d}, TensorRole::kDenseMlp, i);
            add(p + "mlp.down_proj.weight", {d, g.d_ff}, TensorRole::kDenseMlp, i);
        } else {
            add(p + "moe.gate.weight", {g.n_experts, d}, TensorRole::kRouter, i);
            add(p + "moe.router_bias", {g.n_experts}, TensorRole::kRouterBias, i);
            add(p + "moe.gate_proj.weight", {g.n_experts, g.d_expert, d}, TensorRole::kRoutedExperts, i);
            add(p + "moe.up_proj.weight", {g.n_experts, g.d_expert, d}, TensorRole::kRoutedExperts, i);
            add(p + "moe.down_proj.weight", {g.n_experts, d, g.d_expert}, TensorRole::kRoutedExperts, i);
            add(p + "share_expert.gate_proj.weight", {g.d_shared, d}, TensorRole::kSharedExpert, i);
            add(p + "share_expert.up_proj.weight", {g.d_shared, d}, TensorRole::kSharedExpert, i);
            add(p + "share_expert.down_proj.weight", {d, g.d_shared}, TensorRole::kSharedExpert, i);
        }
        if (g.is_mtp) {
            add(p + "enorm.weight", {d}, TensorRole::kNorm, i);
            add(p + "hnorm.weight", {d}, TensorRole::kNorm, i);
            add(p + "eh_proj.weight", {d, 2 * d}, TensorRole::kMtpProj, i);  // input: [enorm(emb) | hnorm(h)]
            add(p + "transformer.shared_head.norm.weight", {d}, TensorRole::kNorm, i);
            add(p + "transformer.shared_head.output.weight", {cfg_.vocab_size, d}, TensorRole::kMtpHead, i);
        }
    }

    std::vector<ExpectedTensor> take() { return std::move(out_); }

private:
    const Step35Config &cfg_;
    std::vector<ExpectedTensor> out_;
};

bool ends_with(std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// Why a tensor that is not in the catalogue is there, when the config makes it clear.
std::string unexpected_reason(const Step35Config &cfg, std::string_view name) {
    if (name == "lm_head.weight" && cfg.tie_word_embeddings) {
        return "tie_word_embeddings is true, so the embedding is the LM head";
    }
    if (ends_with(name, kFp8ScaleSuffix) && !cfg.is_fp8()) {
        return "an FP8 scale, but config.json has no quantization_config";
    }
    constexpr std::string_view kLayers = "model.layers.";
    if (starts_with(name, kLayers)) {
        std::string_view rest = name.substr(kLayers.size());
        int64_t index = -1;
        const auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), index);
        if (ec == std::errc() && ptr != rest.data() && ptr < rest.data() + rest.size() && *ptr == '.') {
            rest = rest.substr(static_cast<size_t>(ptr - rest.data()) + 1);
            if (index >= cfg.n_total_layers()) {
                if (cfg.n_mtp_layers == 0) {
                    return fmt::format("layer {} does not exist: the config has {} trunk layers and no MTP layers "
                                       "(num_nextn_predict_layers)",
                                       index, cfg.n_layers);
                }
                return fmt::format("layer {} does not exist: the config has {} trunk + {} MTP layers", index,
                                   cfg.n_layers, cfg.n_mtp_layers);
            }
            const LayerGeometry &g = cfg.layers[static_cast<size_t>(index)];
            if (g.ffn == FfnKind::kDense && (starts_with(rest, "moe.") || starts_with(rest, "share_expert."))) {
                return fmt::format("layer {} is a dense layer", index);
            }
            if (g.ffn == FfnKind::kMoe && starts_with(rest, "mlp.")) {
                return fmt::format("layer {} is a MoE layer", index);
            }
            if (!g.is_mtp && (starts_with(rest, "enorm.") || starts_with(rest, "hnorm.") ||
                              starts_with(rest, "eh_proj.") || starts_with(rest, "transformer."))) {
                return fmt::format("layer {} is a trunk layer, not an MTP layer", index);
            }
            if (starts_with(rest, "self_attn.g_proj.") && !cfg.use_head_wise_attn_gate) {
                return "use_head_wise_attn_gate is false";
            }
        }
    }
    return "not part of the Step-3.5 layout for this config";
}

}  // namespace

std::vector<int64_t> fp8_scale_shape(std::span<const int64_t> weight_shape, int block_out, int block_in) {
    MEMRA_CHECK(weight_shape.size() >= 2 && block_out > 0 && block_in > 0, "bad FP8 scale request {} {}x{}",
                format_shape(weight_shape), block_out, block_in);
    std::vector<int64_t> out(weight_shape.begin(), weight_shape.end());
    const size_t n = out.size();
    out[n - 2] = ceil_div(out[n - 2], block_out);
    out[n - 1] = ceil_div(out[n - 1], block_in);
    return out;
}

std::string format_shape(std::span<const int64_t> shape) {
    std::string out = "[";
    for (size_t i = 0; i < shape.size(); ++i) {
        out += i == 0 ? "" : ", ";
        out += std::to_string(shape[i]);
    }
    return out + "]";
}

std::vector<ExpectedTensor> expected_tensors(const Step35Config &cfg) {
    Catalogue c(cfg);
    const int64_t d = cfg.d_model;
    c.add("model.embed_tokens.weight", {cfg.vocab_size, d}, TensorRole::kEmbedding, -1);
    for (const LayerGeometry &g : cfg.layers) {
        c.add_layer(g);
    }
    c.add("model.norm.weight", {d}, TensorRole::kNorm, -1);
    if (!cfg.tie_word_embeddings) {
        c.add("lm_head.weight", {cfg.vocab_size, d}, TensorRole::kLmHead, -1);
    }
    return c.take();
}

ValidationReport validate_tensors(const Step35Config &cfg, std::span<const io::TensorInfo> tensors) {
    const std::vector<ExpectedTensor> catalogue = expected_tensors(cfg);
    ValidationReport report;
    report.n_expected = catalogue.size();
    report.n_found = tensors.size();

    // Index the checkpoint; a name listed twice is reported once, at its second appearance.
    std::unordered_map<std::string_view, const io::TensorInfo *> found;
    std::vector<std::string> duplicates;
    for (const io::TensorInfo &t : tensors) {
        if (!found.emplace(t.name, &t).second) {
            duplicates.push_back(fmt::format("{}: listed more than once in the checkpoint", t.name));
        }
    }
    std::unordered_map<std::string_view, const ExpectedTensor *> by_name;
    for (const ExpectedTensor &e : catalogue) {
        by_name.emplace(e.name, &e);
    }
    auto lookup = [&](std::string_view name) -> const io::TensorInfo * {
        const auto it = found.find(name);
        return it == found.end() ? nullptr : it->second;
    };
    std::set<std::string, std::less<>> explained;  // checkpoint names accounted for
    auto check_shape = [&](std::string_view name, std::span<const int64_t> expected, const io::TensorInfo &t) {
        if (!std::equal(expected.begin(), expected.end(), t.shape.begin(), t.shape.end())) {
            report.problems.push_back(fmt::format("{}: expected shape {}, found {}", name, format_shape(expected),
                                                  format_shape(t.shape)));
        }
    };
    auto check_dtype = [&](std::string_view name, std::span<const DType> allowed, const io::TensorInfo &t) {
        if (std::find(allowed.begin(), allowed.end(), t.dtype) == allowed.end()) {
            report.problems.push_back(fmt::format("{}: expected dtype {}, found {}", name, format_dtypes(allowed),
                                                  dtype_name(t.dtype)));
        }
    };
    auto missing = [&](const ExpectedTensor &e) {
        report.problems.push_back(
            fmt::format("{}: missing from the checkpoint (expected shape {})", e.name, format_shape(e.shape)));
    };
    auto missing_scale = [&](std::string_view weight, std::string_view scale) {
        report.problems.push_back(fmt::format("{}: F8_E4M3 weight without its scale tensor {}", weight, scale));
    };

    for (const ExpectedTensor &e : catalogue) {
        explained.insert(e.name);
        const io::TensorInfo *t = lookup(e.name);
        if (e.role == TensorRole::kFp8Scale) {
            const std::string_view weight = std::string_view(e.name).substr(0, e.name.size() - kFp8ScaleSuffix.size());
            if (t == nullptr) {
                const io::TensorInfo *w = lookup(weight);
                if (w != nullptr && w->dtype == DType::kF8E4M3) {
                    missing_scale(weight, e.name);
                } else {
                    missing(e);
                }
                continue;
            }
            check_shape(e.name, e.shape, *t);
            check_dtype(e.name, e.dtypes, *t);
            continue;
        }
        if (t == nullptr) {
            missing(e);
            continue;
        }
        check_shape(e.name, e.shape, *t);
        if (e.fp8 == Fp8Rule::kAllowed && t->dtype == DType::kF8E4M3) {
            // An FP8 weight outside the routed experts: fine in an FP8 checkpoint if its scale is right.
            report.fp8_tensors.push_back(e.name);
            const std::string scale_name = e.name + std::string(kFp8ScaleSuffix);
            explained.insert(scale_name);
            const io::TensorInfo *s = lookup(scale_name);
            if (s == nullptr) {
                missing_scale(e.name, scale_name);
            } else {
                check_shape(scale_name,
                            fp8_scale_shape(e.shape, cfg.quantization.block_out, cfg.quantization.block_in), *s);
                check_dtype(scale_name, kF32Only, *s);
            }
            continue;
        }
        check_dtype(e.name, e.dtypes, *t);
        if (e.fp8 == Fp8Rule::kRequired && t->dtype == DType::kF8E4M3) {
            report.fp8_tensors.push_back(e.name);
        }
    }

    for (const io::TensorInfo &t : tensors) {
        if (explained.contains(t.name)) {
            continue;
        }
        explained.insert(t.name);  // report each unexplained name once (duplicates are reported below)
        if (ends_with(t.name, kFp8ScaleSuffix)) {
            const std::string_view weight = std::string_view(t.name).substr(0, t.name.size() - kFp8ScaleSuffix.size());
            const auto e = by_name.find(weight);
            if (e != by_name.end() && cfg.is_fp8()) {
                const io::TensorInfo *w = lookup(weight);
                const std::string what = w == nullptr ? "absent" : fmt::format("{}", dtype_name(w->dtype));
                const std::string why = e->second->fp8 == Fp8Rule::kNever
                                            ? fmt::format("{} is never quantized", weight)
                                            : fmt::format("{} is {}, not F8_E4M3", weight, what);
                report.problems.push_back(
                    fmt::format("{}: scale tensor for a weight that is not FP8 ({})", t.name, why));
                continue;
            }
        }
        report.problems.push_back(fmt::format("{}: unexpected tensor ({})", t.name, unexpected_reason(cfg, t.name)));
    }
    report.problems.insert(report.problems.end(), duplicates.begin(), duplicates.end());
    return report;
}

std::string format_validation_report(const ValidationReport &report, size_t max_problems) {
    std::string out;
    const size_t shown = std::min(max_problems, report.problems.size());
    for (size_t i = 0; i < shown; ++i) {
        out += report.problems[i];
        out += '\n';
    }
    if (shown < report.problems.size()) {
        out += fmt::format("... and {} more\n", report.problems.size() - shown);
    }
    return out;
}

Result<void> check_tensors(const Step35Config &cfg, std::span<const io::TensorInfo> tensors) {
    const ValidationReport report = validate_tensors(cfg, tensors);
    if (report.ok()) {
        return {};
    }
    if (report.problems.size() == 1) {
        return make_error("checkpoint does not match the config: {}", report.problems[0]);
    }
    return make_error("checkpoint does not match the config: {} (and {} more problems)", report.problems[0],
                      report.problems.size() - 1);
}

}  // namespace memra::model
