// memra's tiny-checkpoint generator: a complete Step-3.5-architecture checkpoint in the official
// Hugging Face layout (config.json, sharded safetensors + index, byte-level BPE tokenizer, chat
// template, generation_config.json), generated from a seed and a size preset, byte-identical on
// every machine. Used by the tests, the benchmarks and the embedded default model.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "make_tiny/tiny_presets.h"

namespace memra::tools {

// The widest routed expert make-tiny writes (16 experts x 3 matrices x 256 x 8192 is 100M weights per layer).
inline constexpr int64_t kMaxTinyMoeIntermediateSize = 8192;
// The deepest trunk and the most routed experts make-tiny writes (the release has 45 layers, 288 experts).
inline constexpr int64_t kMaxTinyLayers = 64;
inline constexpr int64_t kMaxTinyExperts = 512;

struct TinyOptions {
    std::filesystem::path out_dir;
    uint64_t seed = 0;
    std::string preset = "tiny";  // one of tiny_preset_names()
    std::string dtype = "bf16";   // "bf16", or "fp8" (routed experts F8_E4M3 with 128x128 block scales)
    bool force = false;           // replace the generator's own files in a non-empty out_dir
    // Replaces the preset's routed expert width (moe_intermediate_size) when > 0, e.g. 1280 (the release's)
    // or a width that is not a multiple of 128 (partial fp8 scale tiles). 0: the preset's width.
    int64_t moe_intermediate_size = 0;
    // Replaces the preset's sliding window when > 0, e.g. 192 so that a window spans 3 KV pages of 64 rows
    // and pages are released at commit once out of it. At most the preset's max_seq_len. 0: the preset's.
    int64_t sliding_window = 0;
    // Replaces the preset's MTP layer count (num_nextn_predict_layers) when > 0, 1 .. 3 (speculation tests on
    // the tiny preset want the release's three). 0: the preset's.
    int64_t mtp_layers = 0;
    // Replaces the preset's trunk depth (num_hidden_layers) when > 0, 1 .. kMaxTinyLayers: MoE layers run from
    // the preset's first MoE layer to the last trunk layer; added layers have no clamp. 0: the preset's.
    int64_t layers = 0;
    // Replaces the preset's routed experts (moe_num_experts) when > 0, top_k .. kMaxTinyExperts. 0: the preset's.
    int64_t experts = 0;
};

// A preset with the options' overrides applied, and its format.
struct TinyModel {
    TinyPreset preset;
    bool fp8 = false;  // routed experts F8_E4M3 with 128x128 block scales
};

// Resolves options.preset, options.dtype and the overrides (moe_intermediate_size, sliding_window, mtp_layers,
// layers, experts) into the model make-tiny writes; out_dir and force are not read. Refused, with an Error that
// starts with `who` ("make-tiny", "--synthetic"): an unknown preset (the message lists the valid ones), an
// unknown dtype, an override out of range.
Result<TinyModel> resolve_tiny_model(const TinyOptions &options, std::string_view who);

struct TinySummary {
    std::filesystem::path out_dir;
    std::vector<std::string> files;  // file names written into out_dir, sorted
    size_t n_tensors = 0;            // tensors in the checkpoint (fp8 scales included)
    size_t n_shards = 0;
    uint64_t n_params = 0;           // weight elements, scales excluded
    uint64_t tensor_bytes = 0;       // tensor data bytes over all shards
    uint64_t total_bytes = 0;        // sizes of all files written
    int64_t real_token_count = 0;    // tokenizer tokens (specials included); the rest of vocab_size is padding
    int64_t vocab_size = 0;          // embedding rows
};

struct TinyPresetInfo {
    std::string name;
    std::string description;  // one line for --help
};

// Generates the checkpoint. Refuses (with an Error naming the problem): what resolve_tiny_model refuses (e.g. a
// moe_intermediate_size outside [0, kMaxTinyMoeIntermediateSize], a sliding_window outside [0, max_seq_len]), a
// synthetic-only preset (too large to hold in memory and write), an out_dir that is a file, an out_dir that
// exists and is not empty without force, a directory that cannot be created or written.
// The files are written into a temporary directory first and moved into place at the end, so a
// failure leaves no half-written checkpoint. With force, only the generator's own files are
// removed from out_dir (config.json, generation_config.json, tokenizer.json,
// tokenizer_config.json, model.safetensors.index.json and *.safetensors); anything else stays.
Result<TinySummary> make_tiny_checkpoint(const TinyOptions &options);

// Preset names in --help order ("tiny" first: the default).
std::vector<std::string> tiny_preset_names();
// Name and one-line description of every preset, in the same order.
std::vector<TinyPresetInfo> tiny_presets();

// The largest vocabulary make-tokenizer trains (ids stay far below the tokenizer's 2^24 bound).
inline constexpr int64_t kMaxTokenizerVocab = int64_t{1} << 17;

struct TokenizerOptions {
    std::filesystem::path corpus;   // UTF-8 training text
    std::filesystem::path out_dir;  // receives tokenizer.json and tokenizer_config.json
    int64_t vocab_size = 1024;      // tokens in all: kTokenizerFixedTokens + merges
    int64_t model_max_length = 4096;
    bool force = false;  // replace existing tokenizer files in out_dir
};

struct TokenizerSummary {
    int64_t n_tokens = 0;  // may be below vocab_size when the corpus has no pair seen twice left
    int64_t n_merges = 0;
    int64_t im_end_id = 0;
    uint64_t corpus_bytes = 0;
};

// Trains the byte-level BPE of make-tiny (build_tokenizer) on a corpus file and writes tokenizer.json and
// tokenizer_config.json into out_dir (created if missing). Refuses, naming the problem: a vocab_size outside
// [kTokenizerFixedTokens + 1, kMaxTokenizerVocab], an unreadable or empty corpus, an out_dir that is a file,
// existing tokenizer files without force. Each file is written beside its target and renamed into place.
Result<TokenizerSummary> make_tokenizer_files(const TokenizerOptions &options);

// The file names the generator owns in a checkpoint directory (what force may remove).
bool is_tiny_generator_file(const std::string &file_name);

}  // namespace memra::tools
