// make_tiny_checkpoint: validates the request, builds every file in memory, writes them into a
// staging directory and moves them into place. Only files the generator owns are ever removed.
#include "make_tiny/make_tiny.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "core/check.h"
#include "io/safetensors.h"
#include "make_tiny/tiny_presets.h"
#include "make_tiny/tiny_tokenizer.h"
#include "make_tiny/tiny_weights.h"

namespace memra::tools {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kGeneratorFiles[] = {"config.json", "generation_config.json", "tokenizer.json",
                                                "tokenizer_config.json", io::kIndexFileName};

std::string join(const std::vector<std::string> &items) {
    std::string out;
    for (const std::string &s : items) {
        if (!out.empty()) {
            out += ", ";
        }
        out += s;
    }
    return out;
}

Result<void> write_text_file(const fs::path &path, const std::string &text) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) {
        return make_error("cannot create {}", path.string());
    }
    f.write(text.data(), static_cast<std::streamsize>(text.size()));
    f.close();
    if (!f) {
        return make_error("cannot write {}", path.string());
    }
    return {};
}

// Absolute, normalized, without a trailing separator ("out/" and "out/." name the directory out).
fs::path normalized_dir(const fs::path &p) {
    fs::path abs = fs::absolute(p).lexically_normal();
    if (!abs.has_filename() && abs.has_parent_path() && abs != abs.root_path()) {
        abs = abs.parent_path();
    }
    return abs;
}

// Creates a fresh staging directory named base + "-<pid>-<k>" (never reusing an existing path).
Result<fs::path> create_staging_dir(const fs::path &base) {
    std::error_code ec;
    for (int k = 0; k < 1000; ++k) {
        fs::path candidate = base;
        candidate += fmt::format("-{}-{}", ::getpid(), k);
        if (fs::create_directory(candidate, ec)) {
            return candidate;
        }
        if (ec) {
            return make_error("make-tiny: cannot create the staging directory {}: {}", candidate.string(),
                              ec.message());
        }
    }
    return make_error("make-tiny: cannot find a free staging directory name next to {}", base.string());
}

// Removes the staging directory this run created (and only the files this run wrote into it).
void remove_staging(const fs::path &stage, const std::vector<std::string> &names) {
    std::error_code ec;
    for (const std::string &n : names) {
        fs::remove(stage / n, ec);
    }
    std::error_code ec2;
    fs::directory_iterator it(stage, ec2);
    if (!ec2) {
        for (const fs::directory_entry &e : it) {
            // Shards the writer created before failing.
            if (is_tiny_generator_file(e.path().filename().string())) {
                fs::remove(e.path(), ec);
            }
        }
    }
    fs::remove(stage, ec);  // only succeeds if empty: nothing foreign is ever deleted
}

std::vector<std::string> list_names(const fs::path &dir) {
    std::vector<std::string> names;
    std::error_code ec;
    for (const fs::directory_entry &e : fs::directory_iterator(dir, ec)) {
        names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
}

}  // namespace

bool is_tiny_generator_file(const std::string &file_name) {
    for (std::string_view g : kGeneratorFiles) {
        if (file_name == g) {
            return true;
        }
    }
    constexpr std::string_view kExt = ".safetensors";
    return file_name.size() > kExt.size() && file_name.ends_with(kExt);
}

std::vector<std::string> tiny_preset_names() {
    std::vector<std::string> names;
    for (const TinyPreset &p : tiny_preset_table()) {
        names.push_back(p.name);
    }
    return names;
}

std::vector<TinyPresetInfo> tiny_presets() {
    std::vector<TinyPresetInfo> out;
    for (const TinyPreset &p : tiny_preset_table()) {
        out.push_back({p.name, p.description});
    }
    return out;
}

Result<TokenizerSummary> make_tokenizer_files(const TokenizerOptions &options) {
    if (options.vocab_size <= kTokenizerFixedTokens || options.vocab_size > kMaxTokenizerVocab) {
        return make_error("make-tokenizer: vocab size must be in [{}, {}] ({} fixed tokens + at least one merge), "
                          "found {}",
                          kTokenizerFixedTokens + 1, kMaxTokenizerVocab, kTokenizerFixedTokens, options.vocab_size);
    }
    std::error_code ec;
    std::ifstream in(options.corpus, std::ios::binary);
    if (!in || fs::is_directory(options.corpus, ec)) {
        return make_error("make-tokenizer: cannot read the corpus {}", options.corpus.string());
    }
    const std::string corpus((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) {
        return make_error("make-tokenizer: cannot read the corpus {}", options.corpus.string());
    }
    if (corpus.empty()) {
        return make_error("make-tokenizer: the corpus {} is empty", options.corpus.string());
    }
    const fs::path out = normalized_dir(options.out_dir);
    if (fs::exists(out, ec) && !fs::is_directory(out, ec)) {
        return make_error("make-tokenizer: output path {} exists and is not a directory", out.string());
    }
    constexpr std::string_view kFiles[] = {"tokenizer.json", "tokenizer_config.json"};
    for (std::string_view name : kFiles) {
        if (fs::exists(out / name, ec) && !options.force) {
            return make_error("make-tokenizer: {} exists; pass --force to replace it", (out / name).string());
        }
    }
    const TinyTokenizer tok =
        build_tokenizer(corpus, static_cast<size_t>(options.vocab_size - kTokenizerFixedTokens));
    const std::string texts[] = {tiny_tokenizer_json(tok), tiny_tokenizer_config_json(tok, options.model_max_length)};
    fs::create_directories(out, ec);
    if (ec) {
        return make_error("make-tokenizer: cannot create directory {}: {}", out.string(), ec.message());
    }
    for (size_t i = 0; i < std::size(kFiles); ++i) {
        fs::path tmp = out / fmt::format(".{}.{}.tmp", kFiles[i], ::getpid());
        if (Result<void> ok = write_text_file(tmp, texts[i]); !ok) {
            fs::remove(tmp, ec);
            return wrap_error("make-tokenizer", ok.error());
        }
        fs::rename(tmp, out / kFiles[i], ec);
        if (ec) {
            fs::remove(tmp, ec);
            return make_error("make-tokenizer: cannot move {} into place: {}", tmp.string(), ec.message());
        }
    }
    TokenizerSummary summary;
    summary.n_tokens = tok.n_tokens();
    summary.n_merges = static_cast<int64_t>(tok.merges.size());
    summary.im_end_id = tok.im_end_id;
    summary.corpus_bytes = corpus.size();
    return summary;
}

Result<TinyModel> resolve_tiny_model(const TinyOptions &options, std::string_view who) {
    std::optional<TinyPreset> preset = find_tiny_preset(options.preset);
    if (!preset) {
        return make_error("{}: unknown preset '{}' (valid presets: {})", who, options.preset,
                          join(tiny_preset_names()));
    }
    bool fp8 = false;
    if (options.dtype == "fp8") {
        fp8 = true;
    } else if (options.dtype != "bf16") {
        return make_error("{}: unknown dtype '{}' (valid dtypes: bf16, fp8)", who, options.dtype);
    }
    if (options.moe_intermediate_size < 0 || options.moe_intermediate_size > kMaxTinyMoeIntermediateSize) {
        return make_error("{}: moe_intermediate_size must be in [1, {}] (0 keeps the preset's {}), found {}", who,
                          kMaxTinyMoeIntermediateSize, preset->d_expert, options.moe_intermediate_size);
    }
    if (options.moe_intermediate_size > 0) {
        preset->d_expert = options.moe_intermediate_size;
    }
    if (options.sliding_window < 0 || options.sliding_window > preset->max_seq_len) {
        return make_error("{}: sliding_window must be in [1, {}] (0 keeps the preset's {}), found {}", who,
                          preset->max_seq_len, preset->window, options.sliding_window);
    }
    if (options.sliding_window > 0) {
        preset->window = options.sliding_window;
    }
    if (options.mtp_layers < 0 || options.mtp_layers > 3) {
        return make_error("{}: mtp_layers must be in [1, 3] (0 keeps the preset's {}), found {}", who, preset->n_mtp,
                          options.mtp_layers);
    }
    if (options.mtp_layers > 0) {
        // The added MTP layers clamp as the preset's last layer does.
        preset->n_mtp = options.mtp_layers;
        preset->swiglu_limits.resize(static_cast<size_t>(preset->n_total_layers()), preset->swiglu_limits.back());
        preset->swiglu_limits_shared.resize(static_cast<size_t>(preset->n_total_layers()),
                                            preset->swiglu_limits_shared.back());
    }
    if (options.layers < 0 || options.layers > kMaxTinyLayers) {
        return make_error("{}: layers must be in [1, {}] (0 keeps the preset's {}), found {}", who, kMaxTinyLayers,
                          preset->n_layers, options.layers);
    }
    if (options.layers > 0) {
        // Trunk clamps kept by index (new layers: none), the MTP layers' after them; MoE from the first MoE layer on.
        const auto old_trunk = static_cast<size_t>(preset->n_layers);
        const auto resize = [&](std::vector<double> &lim) {
            std::vector<double> out(static_cast<size_t>(options.layers), 0.0);
            for (size_t i = 0; i < out.size() && i < old_trunk; ++i) out[i] = lim[i];
            out.insert(out.end(), lim.begin() + static_cast<std::ptrdiff_t>(old_trunk), lim.end());
            lim = std::move(out);
        };
        resize(preset->swiglu_limits);
        resize(preset->swiglu_limits_shared);
        const int64_t first_moe = preset->moe_layers.empty() ? options.layers : preset->moe_layers.front();
        preset->moe_layers.clear();
        for (int64_t l = first_moe; l < options.layers; ++l) preset->moe_layers.push_back(l);
        preset->n_layers = options.layers;
    }
    if (options.experts != 0 && (options.experts < preset->top_k || options.experts > kMaxTinyExperts)) {
        return make_error("{}: experts must be in [{}, {}] (top-k .. max; 0 keeps the preset's {}), found {}", who,
                          preset->top_k, kMaxTinyExperts, preset->n_experts, options.experts);
    }
    if (options.experts > 0) preset->n_experts = options.experts;
    return TinyModel{std::move(*preset), fp8};
}

Result<TinySummary> make_tiny_checkpoint(const TinyOptions &options) {
    Result<TinyModel> model = resolve_tiny_model(options, "make-tiny");
    if (!model) return tl::unexpected(model.error());
    const TinyPreset *preset = &model->preset;
    const bool fp8 = model->fp8;
    if (preset->synthetic_only) {
        const uint64_t bytes = TinyWeights(*preset, options.seed, fp8).total_bytes();
        return make_error("make-tiny: preset {} is {:.1f} GB of tensors, too large to build in memory and write; run "
                          "it in memory with `memra bench --synthetic {}`",
                          preset->name, 1e-9 * static_cast<double>(bytes), preset->name);
    }
    if (options.out_dir.empty()) {
        return make_error("make-tiny: no output directory given");
    }

    std::error_code ec;
    const fs::path out = normalized_dir(options.out_dir);
    fs::file_status st = fs::status(out, ec);
    const bool exists = fs::exists(st);
    if (exists && !fs::is_directory(st)) {
        return make_error("make-tiny: output path {} exists and is not a directory", out.string());
    }
    if (exists) {
        std::vector<std::string> present = list_names(out);
        if (!present.empty() && !options.force) {
            return make_error("make-tiny: output directory {} is not empty ({} entries, e.g. '{}'); pass --force to "
                              "replace the generator's files (other files are kept)",
                              out.string(), present.size(), present.front());
        }
    }

    // Everything is built in memory first: nothing touches the disk until it is complete.
    const TinyTokenizer tok = build_tiny_tokenizer();
    MEMRA_CHECK(tok.n_tokens() < preset->vocab_size, "preset {}: {} tokenizer tokens do not fit vocab_size {}",
                preset->name, tok.n_tokens(), preset->vocab_size);
    const std::vector<io::TensorData> tensors = make_tiny_tensors(*preset, options.seed, fp8);
    std::map<std::string, std::string> texts;
    texts["config.json"] = tiny_config_json(*preset, tok.im_end_id, fp8);
    texts["generation_config.json"] = tiny_generation_config_json(tok.im_end_id);
    texts["tokenizer.json"] = tiny_tokenizer_json(tok);
    texts["tokenizer_config.json"] = tiny_tokenizer_config_json(tok, preset->max_seq_len);

    // Staging: a hidden sibling when out_dir does not exist yet (renamed into place at the end),
    // a hidden subdirectory of out_dir when it does (its files are moved in at the end).
    fs::path stage_base;
    if (exists) {
        stage_base = out / ".make-tiny-staging";
    } else {
        fs::create_directories(out.parent_path(), ec);
        if (ec) {
            return make_error("make-tiny: cannot create directory {}: {}", out.parent_path().string(), ec.message());
        }
        stage_base = out.parent_path() / fmt::format(".{}.make-tiny-staging", out.filename().string());
    }
    Result<fs::path> stage_or = create_staging_dir(stage_base);
    if (!stage_or) {
        return tl::unexpected(stage_or.error());
    }
    const fs::path stage = *stage_or;

    Result<void> ok = io::write_sharded_checkpoint(stage, tensors, preset->max_shard_bytes);
    if (!ok) {
        remove_staging(stage, {});
        return wrap_error("make-tiny", ok.error());
    }
    for (const auto &[name, text] : texts) {
        ok = write_text_file(stage / name, text);
        if (!ok) {
            remove_staging(stage, {});
            return wrap_error("make-tiny", ok.error());
        }
    }
    const std::vector<std::string> written = list_names(stage);

    if (!exists) {
        fs::rename(stage, out, ec);
        if (ec) {
            remove_staging(stage, written);
            return make_error("make-tiny: cannot move {} to {}: {}", stage.string(), out.string(), ec.message());
        }
    } else {
        // Old generator files go first (a previous run may have had more shards), then ours move in.
        for (const std::string &name : list_names(out)) {
            fs::path p = out / name;
            if (!is_tiny_generator_file(name) || fs::is_directory(fs::symlink_status(p, ec))) {
                continue;
            }
            fs::remove(p, ec);
            if (ec) {
                remove_staging(stage, written);
                return make_error("make-tiny: cannot remove the old {}: {}", p.string(), ec.message());
            }
        }
        for (const std::string &name : written) {
            fs::rename(stage / name, out / name, ec);
            if (ec) {
                remove_staging(stage, written);
                return make_error("make-tiny: cannot move {} into {}: {}", name, out.string(), ec.message());
            }
        }
        fs::remove(stage, ec);
    }

    TinySummary summary;
    summary.out_dir = out;
    summary.files = written;
    summary.n_tensors = tensors.size();
    for (const io::TensorData &t : tensors) {
        summary.tensor_bytes += t.bytes.size();
        if (!t.name.ends_with("_scale_inv")) {
            uint64_t n = 1;
            for (int64_t s : t.shape) {
                n *= static_cast<uint64_t>(s);
            }
            summary.n_params += n;
        }
    }
    for (const std::string &name : written) {
        summary.total_bytes += fs::file_size(out / name, ec);
        if (name.ends_with(".safetensors")) {
            ++summary.n_shards;
        }
    }
    summary.real_token_count = tok.n_tokens();
    summary.vocab_size = preset->vocab_size;
    return summary;
}

}  // namespace memra::tools
