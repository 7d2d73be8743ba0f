// The tensors a Step-3.5 checkpoint must hold for a given config (official HF names, PyTorch [out, in]
// shapes, accepted dtypes; STEP35.md section 5), and the check of a checkpoint's tensor list against
// them. Works on io::TensorInfo lists only (name, dtype, shape), so it needs no file access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/result.h"
#include "io/safetensors.h"
#include "model/step35_config.h"

namespace memra::model {

// Suffix of an FP8 weight's block-scale companion ("<weight name>_scale_inv"). Despite the name the
// stored value is the multiplier: w = fp8 * scale_inv[row / block_out, col / block_in].
inline constexpr std::string_view kFp8ScaleSuffix = "_scale_inv";

enum class TensorRole {
    kEmbedding,      // model.embed_tokens.weight [vocab, d_model]
    kLmHead,         // lm_head.weight [vocab, d_model] (absent when tie_word_embeddings)
    kNorm,           // every RMSNorm weight, stored w and applied as (1 + w): [d_model] or [head_dim]
    kAttention,      // self_attn.{q,k,v,o,g}_proj.weight
    kDenseMlp,       // mlp.{gate,up,down}_proj.weight (dense trunk layers and MTP layers)
    kRouter,         // moe.gate.weight [n_experts, d_model]
    kRouterBias,     // moe.router_bias [n_experts] F32, selection bias (no ".weight" suffix)
    kRoutedExperts,  // moe.{gate,up,down}_proj.weight, stacked [n_experts, out, in]
    kSharedExpert,   // share_expert.{gate,up,down}_proj.weight (sibling of moe, not under it)
    kMtpProj,        // MTP eh_proj.weight [d_model, 2 * d_model]
    kMtpHead,        // MTP transformer.shared_head.output.weight [vocab, d_model]
    kFp8Scale,       // <weight>_scale_inv F32 block scales of an FP8 weight
};

// Whether a tensor may or must be stored as FP8 E4M3 with block scales.
enum class Fp8Rule {
    kNever,     // never FP8 (norms, embedding, router, router bias, scales; everything in a BF16 checkpoint)
    kAllowed,   // FP8 checkpoint, linear weight outside the routed experts: high precision as released,
                // but F8_E4M3 plus a correct scale is accepted (and reported)
    kRequired,  // FP8 checkpoint, routed experts: F8_E4M3, with a kFp8Scale entry right after it
};

struct ExpectedTensor {
    std::string name;            // official HF name, e.g. "model.layers.3.moe.gate_proj.weight"
    std::vector<int64_t> shape;  // PyTorch order [out, in]; stacked experts [n_experts, out, in]
    std::vector<DType> dtypes;   // accepted dtypes; the first is what the released checkpoint stores
    int layer = -1;              // index into Step35Config::layers; -1 for embedding, final norm, lm_head
    TensorRole role = TensorRole::kNorm;
    Fp8Rule fp8 = Fp8Rule::kNever;
};

// The catalogue, in order: embedding, each layer (trunk then MTP) in index order, final norm, lm_head.
// FP8 checkpoints (config.quantization_config present) list each routed expert weight as F8_E4M3
// followed by its scale [n_experts, ceil(out / block_out), ceil(in / block_in)] F32.
std::vector<ExpectedTensor> expected_tensors(const Step35Config &cfg);

// Shape of the block-scale tensor of a weight whose last two dims are [out, in]; leading dims are kept.
std::vector<int64_t> fp8_scale_shape(std::span<const int64_t> weight_shape, int block_out, int block_in);

// "[16, 96, 256]".
std::string format_shape(std::span<const int64_t> shape);

struct ValidationReport {
    std::vector<std::string> problems;     // one line each: catalogue order, then unexpected tensors in input order
    std::vector<std::string> fp8_tensors;  // weights found stored as F8_E4M3, catalogue order
    size_t n_expected = 0;                 // catalogue entries
    size_t n_found = 0;                    // tensors in the checked list

    bool ok() const { return problems.empty(); }
};

// Checks a checkpoint's tensor list against the catalogue: missing, unexpected (with the reason when it
// is clear: no MTP layers, a dense layer, tied embeddings...), wrong shape, wrong dtype, FP8 weights
// without their scale or with a scale of the wrong grid, scales next to non-FP8 weights, duplicates.
// Uses only name, dtype and shape of each TensorInfo.
ValidationReport validate_tensors(const Step35Config &cfg, std::span<const io::TensorInfo> tensors);

// The first max_problems problems, one per line, then "... and N more" when some were left out.
// Empty when the report has no problems.
std::string format_validation_report(const ValidationReport &report, size_t max_problems = 20);

// validate_tensors as one Error: "checkpoint does not match the config: <first problem> (and N more)".
Result<void> check_tensors(const Step35Config &cfg, std::span<const io::TensorInfo> tensors);

}  // namespace memra::model
