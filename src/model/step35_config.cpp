// Step-3.5 config.json parser: reads every key of STEP35.md section 2 (and the legacy spellings the HF
// remote code and vLLM accept), then resolves one LayerGeometry per trunk and MTP layer. Defaults for
// absent keys follow the HF remote code (modeling_step3p5.py) unless noted; each such choice is
// commented where it is made. nlohmann exceptions never leave this file.
#include "model/step35_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace memra::model {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kFullType = "full_attention";
constexpr std::string_view kSlidingType = "sliding_attention";
constexpr uint64_t kMaxConfigFileBytes = 16u << 20;  // a config.json is a few KiB; refuse absurd files

// A string from the config, JSON-quoted and escaped so that messages stay on one line.
std::string json_quoted(std::string_view s) {
    constexpr size_t kMaxChars = 60;
    std::string text = Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
    if (text.size() > kMaxChars) {
        text = text.substr(0, kMaxChars) + "...";
    }
    return text;
}

// A short rendering of a JSON value for "found ..." in messages.
std::string describe(const Json &v) {
    switch (v.type()) {
    case Json::value_t::null:
        return "null";
    case Json::value_t::boolean:
        return v.get<bool>() ? "true" : "false";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float:
        return v.dump();
    case Json::value_t::string:
        return json_quoted(v.get<std::string>());
    case Json::value_t::array:
        return fmt::format("an array of {} entries", v.size());
    case Json::value_t::object:
        return "an object";
    case Json::value_t::binary:
    case Json::value_t::discarded:
        return "an unsupported value";
    }
    return "an unsupported value";
}

// The integer value of a JSON integer, or nullopt for anything else (floats included: sizes and
// indices must be written as integers) and for unsigned values beyond int64_t.
std::optional<int64_t> json_int(const Json &v) {
    if (v.is_number_unsigned()) {
        const uint64_t u = v.get<uint64_t>();
        if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            return std::nullopt;
        }
        return static_cast<int64_t>(u);
    }
    if (v.is_number_integer()) {
        return v.get<int64_t>();
    }
    return std::nullopt;
}

Result<void> to_dim(const Json &v, const std::string &path, int &out) {
    const std::optional<int64_t> i = json_int(v);
    if (!i || *i <= 0) {
        return make_error("{}: expected a positive integer, found {}", path, describe(v));
    }
    if (*i > kMaxConfigDim) {
        return make_error("{}: {} is larger than the limit {}", path, *i, kMaxConfigDim);
    }
    out = static_cast<int>(*i);
    return {};
}

Result<void> to_number(const Json &v, const std::string &path, double &out) {
    if (!v.is_number()) {
        return make_error("{}: expected a number, found {}", path, describe(v));
    }
    const double d = v.get<double>();
    if (!std::isfinite(d)) {
        return make_error("{}: expected a finite number, found {}", path, describe(v));
    }
    out = d;
    return {};
}

Result<void> to_positive_number(const Json &v, const std::string &path, double &out) {
    if (auto st = to_number(v, path, out); !st) {
        return st;
    }
    if (out <= 0.0) {
        return make_error("{}: expected a positive number, found {}", path, describe(v));
    }
    return {};
}

Result<void> to_string(const Json &v, const std::string &path, std::string &out) {
    if (!v.is_string()) {
        return make_error("{}: expected a string, found {}", path, describe(v));
    }
    out = v.get<std::string>();
    return {};
}

Result<void> to_bool(const Json &v, const std::string &path, bool &out) {
    if (!v.is_boolean()) {
        return make_error("{}: expected true or false, found {}", path, describe(v));
    }
    out = v.get<bool>();
    return {};
}

Result<void> to_string_list(const Json &v, const std::string &path, std::vector<std::string> &out) {
    if (!v.is_array()) {
        return make_error("{}: expected a list of strings, found {}", path, describe(v));
    }
    out.clear();
    for (size_t i = 0; i < v.size(); ++i) {
        std::string s;
        if (auto st = to_string(v[i], fmt::format("{}[{}]", path, i), s); !st) {
            return st;
        }
        out.push_back(std::move(s));
    }
    return {};
}

bool is_layer_type(std::string_view s) { return s == kFullType || s == kSlidingType; }

// Reads one JSON object and remembers which keys were looked at, so the rest can be listed as unknown.
// A key whose value is null counts as absent (HF writes null for "not set").
class ObjectReader {
public:
    ObjectReader(const Json &obj, std::string prefix) : obj_(obj), prefix_(std::move(prefix)) {}

    std::string path(std::string_view key) const { return prefix_ + std::string(key); }

    // The value, or nullptr when the key is absent or null. Marks the key as known either way.
    const Json *find(std::string_view key) {
        seen_.insert(std::string(key));
        const auto it = obj_.find(std::string(key));
        if (it == obj_.end() || it->is_null()) {
            return nullptr;
        }
        return &*it;
    }

    Result<const Json *> require(std::string_view key) {
        const Json *v = find(key);
        if (v == nullptr) {
            return make_error("{}: required key is missing", path(key));
        }
        return v;
    }

    Result<void> req_dim(std::string_view key, int &out) {
        auto v = require(key);
        if (!v) {
            return tl::unexpected(v.error());
        }
        return to_dim(**v, path(key), out);
    }

    Result<void> opt_dim(std::string_view key, int &out) {
        const Json *v = find(key);
        return v == nullptr ? Result<void>{} : to_dim(*v, path(key), out);
    }

    Result<void> opt_bool(std::string_view key, bool &out) {
        const Json *v = find(key);
        return v == nullptr ? Result<void>{} : to_bool(*v, path(key), out);
    }

    Result<void> opt_string(std::string_view key, std::string &out) {
        const Json *v = find(key);
        return v == nullptr ? Result<void>{} : to_string(*v, path(key), out);
    }

    Result<void> opt_positive_number(std::string_view key, double &out) {
        const Json *v = find(key);
        return v == nullptr ? Result<void>{} : to_positive_number(*v, path(key), out);
    }

    Result<void> opt_int(std::string_view key, int64_t &out) {
        const Json *v = find(key);
        if (v == nullptr) {
            return {};
        }
        const std::optional<int64_t> i = json_int(*v);
        if (!i) {
            return make_error("{}: expected an integer, found {}", path(key), describe(*v));
        }
        out = *i;
        return {};
    }

    // Keys never looked at, as "prefix.key".
    void collect_unknown(std::vector<std::string> &out) const {
        for (const auto &[key, value] : obj_.items()) {
            if (!seen_.contains(key)) {
                out.push_back(prefix_ + key);
            }
        }
    }

private:
    const Json &obj_;
    std::string prefix_;
    std::set<std::string, std::less<>> seen_;
};

// Per-layer lists cover trunk and MTP layers: num_hidden_layers + num_nextn_predict_layers entries.
std::string expected_entries(const Step35Config &cfg) {
    if (cfg.n_mtp_layers == 0) {
        return fmt::format("{} entries (one per layer)", cfg.n_layers);
    }
    return fmt::format("{} entries ({} trunk + {} MTP layers)", cfg.n_total_layers(), cfg.n_layers,
                       cfg.n_mtp_layers);
}

Result<void> check_list_length(const Json &v, const std::string &path, const Step35Config &cfg) {
    if (!v.is_array()) {
        return make_error("{}: expected a list of {}, found {}", path, expected_entries(cfg), describe(v));
    }
    if (v.size() != static_cast<size_t>(cfg.n_total_layers())) {
        return make_error("{}: expected {}, found {}", path, expected_entries(cfg), v.size());
    }
    return {};
}

// A per-layer list of non-negative clamp limits; null entries mean "off" (0).
Result<void> read_limits(ObjectReader &r, std::string_view key, const Step35Config &cfg, std::vector<double> &out) {
    out.assign(static_cast<size_t>(cfg.n_total_layers()), 0.0);
    const Json *v = r.find(key);
    if (v == nullptr) {
        return {};
    }
    if (auto st = check_list_length(*v, r.path(key), cfg); !st) {
        return st;
    }
    for (size_t i = 0; i < v->size(); ++i) {
        const Json &e = (*v)[i];
        if (e.is_null()) {
            continue;
        }
        const std::string path = fmt::format("{}[{}]", r.path(key), i);
        if (auto st = to_number(e, path, out[i]); !st) {
            return st;
        }
        if (out[i] < 0.0 || out[i] > static_cast<double>(std::numeric_limits<float>::max())) {
            return make_error("{}: expected a limit >= 0 (0 or null = off), found {}", path, describe(e));
        }
    }
    return {};
}

// "rope_theta": one base per layer, or a single number for every layer.
Result<void> read_rope_theta(ObjectReader &r, const Step35Config &cfg, std::vector<double> &out) {
    auto v = r.require("rope_theta");
    if (!v) {
        return tl::unexpected(v.error());
    }
    const Json &j = **v;
    const std::string path = r.path("rope_theta");
    out.assign(static_cast<size_t>(cfg.n_total_layers()), 0.0);
    if (j.is_number()) {
        double theta = 0.0;
        if (auto st = to_positive_number(j, path, theta); !st) {
            return st;
        }
        std::fill(out.begin(), out.end(), theta);
        return {};
    }
    if (auto st = check_list_length(j, path, cfg); !st) {
        return st;
    }
    for (size_t i = 0; i < j.size(); ++i) {
        if (auto st = to_positive_number(j[i], fmt::format("{}[{}]", path, i), out[i]); !st) {
            return st;
        }
    }
    return {};
}

// "partial_rotary_factors" (list, or a number) wins over the scalar "partial_rotary_factor": the HF
// remote code reads only the list and writes the scalar back into the config at run time, so a config
// saved after loading can carry both. Absent: 1.0 (whole head rotated), as in the remote code.
// paths[i] is the key to name in errors about layer i.
Result<void> read_partial_rotary(ObjectReader &r, const Step35Config &cfg, std::vector<double> &out,
                                 std::vector<std::string> &paths) {
    const size_t n = static_cast<size_t>(cfg.n_total_layers());
    out.assign(n, 1.0);
    paths.assign(n, "partial_rotary_factors");
    const Json *list = r.find("partial_rotary_factors");
    const Json *scalar = r.find("partial_rotary_factor");
    const std::string key = list != nullptr ? "partial_rotary_factors" : "partial_rotary_factor";
    const Json *v = list != nullptr ? list : scalar;
    if (v == nullptr) {
        return {};
    }
    if (v->is_number()) {
        double f = 0.0;
        if (auto st = to_positive_number(*v, r.path(key), f); !st) {
            return st;
        }
        std::fill(out.begin(), out.end(), f);
        std::fill(paths.begin(), paths.end(), r.path(key));
        return {};
    }
    if (auto st = check_list_length(*v, r.path(key), cfg); !st) {
        return st;
    }
    for (size_t i = 0; i < n; ++i) {
        paths[i] = fmt::format("{}[{}]", r.path(key), i);
        if (auto st = to_positive_number((*v)[i], paths[i], out[i]); !st) {
            return st;
        }
    }
    return {};
}

// "use_rope_layers": per-layer booleans (0/1 accepted, as the remote code only tests truthiness).
// Absent or empty: every layer uses RoPE (HF remote code and vLLM).
Result<void> read_use_rope(ObjectReader &r, const Step35Config &cfg, std::vector<bool> &out) {
    out.assign(static_cast<size_t>(cfg.n_total_layers()), true);
    const Json *v = r.find("use_rope_layers");
    if (v == nullptr || (v->is_array() && v->empty())) {
        return {};
    }
    if (auto st = check_list_length(*v, r.path("use_rope_layers"), cfg); !st) {
        return st;
    }
    for (size_t i = 0; i < v->size(); ++i) {
        const Json &e = (*v)[i];
        const std::optional<int64_t> as_int = json_int(e);
        if (e.is_boolean()) {
            out[i] = e.get<bool>();
        } else if (as_int && (*as_int == 0 || *as_int == 1)) {
            out[i] = *as_int == 1;
        } else {
            return make_error("{}[{}]: expected true or false, found {}", r.path("use_rope_layers"), i, describe(e));
        }
    }
    return {};
}

// "moe_layers_enum": "3,4,...,44" (the release form) or a list of ints (transformers accepts both).
// Empty tokens are skipped, as transformers does; an empty string means no MoE layer.
Result<void> read_moe_layers(const Json &v, const std::string &path, const Step35Config &cfg, std::vector<int> &out) {
    std::vector<int64_t> raw;
    if (v.is_string()) {
        const std::string s = v.get<std::string>();
        size_t start = 0;
        while (start <= s.size()) {
            size_t end = s.find(',', start);
            if (end == std::string::npos) {
                end = s.size();
            }
            std::string_view token(s.data() + start, end - start);
            while (!token.empty() && (token.front() == ' ' || token.front() == '\t')) {
                token.remove_prefix(1);
            }
            while (!token.empty() && (token.back() == ' ' || token.back() == '\t')) {
                token.remove_suffix(1);
            }
            if (!token.empty()) {
                int64_t value = 0;
                const auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), value);
                if (ec != std::errc() || ptr != token.data() + token.size()) {
                    return make_error("{}: expected comma-separated layer indices, found {} in it", path,
                                      json_quoted(token));
                }
                raw.push_back(value);
            }
            start = end + 1;
        }
    } else if (v.is_array()) {
        for (size_t i = 0; i < v.size(); ++i) {
            const std::optional<int64_t> value = json_int(v[i]);
            if (!value) {
                return make_error("{}[{}]: expected a layer index, found {}", path, i, describe(v[i]));
            }
            raw.push_back(*value);
        }
    } else {
        return make_error("{}: expected a comma-separated string of layer indices, found {}", path, describe(v));
    }
    std::set<int64_t> seen;
    for (int64_t idx : raw) {
        if (idx < 0 || idx >= cfg.n_layers) {
            return make_error("{}: MoE layer index {} is out of range: trunk layers are 0..{} (MTP layers are "
                              "always dense)",
                              path, idx, cfg.n_layers - 1);
        }
        if (!seen.insert(idx).second) {
            return make_error("{}: layer {} is listed twice", path, idx);
        }
    }
    out.assign(seen.begin(), seen.end());
    return {};
}

Result<void> read_rope_scaling(ObjectReader &root, Step35Config &cfg) {
    const Json *v = root.find("rope_scaling");
    if (v == nullptr) {
        return {};
    }
    if (!v->is_object()) {
        return make_error("rope_scaling: expected an object or null, found {}", describe(*v));
    }
    ObjectReader r(*v, "rope_scaling.");
    RopeScaling &rs = cfg.rope_scaling;
    std::string type;
    const Json *type_v = r.find("rope_type");
    std::string type_key = "rope_type";
    if (type_v == nullptr) {
        type_v = r.find("type");
        type_key = "type";
    } else {
        r.find("type");  // a legacy duplicate is allowed, rope_type wins (as in HF)
    }
    if (type_v == nullptr) {
        return make_error("rope_scaling.rope_type: required key is missing");
    }
    if (auto st = to_string(*type_v, r.path(type_key), type); !st) {
        return st;
    }
    if (type == "default") {
        // HF's "default" rope type: plain RoPE, nothing to scale.
        r.collect_unknown(cfg.unknown_keys);
        return {};
    }
    if (type != "llama3") {
        return make_error("{}: only \"llama3\" scaling is supported, found {}", r.path(type_key), json_quoted(type));
    }
    rs.present = true;
    rs.type = type;
    for (std::string_view key : {"factor", "low_freq_factor", "high_freq_factor"}) {
        auto f = r.require(key);
        if (!f) {
            return tl::unexpected(f.error());
        }
        double value = 0.0;
        if (auto st = to_positive_number(**f, r.path(key), value); !st) {
            return st;
        }
        if (key == "factor") {
            rs.factor = value;
        } else if (key == "low_freq_factor") {
            rs.low_freq_factor = value;
        } else {
            rs.high_freq_factor = value;
        }
    }
    auto l0 = r.require("original_max_position_embeddings");
    if (!l0) {
        return tl::unexpected(l0.error());
    }
    const std::optional<int64_t> l0_value = json_int(**l0);
    if (!l0_value || *l0_value <= 0) {
        return make_error("rope_scaling.original_max_position_embeddings: expected a positive integer, found {}",
                          describe(**l0));
    }
    rs.original_max_position_embeddings = *l0_value;
    // llama3 smooths between wavelengths L0/high and L0/low, dividing by (high - low).
    if (rs.high_freq_factor <= rs.low_freq_factor) {
        return make_error("rope_scaling.high_freq_factor: expected a value above low_freq_factor {}, found {}",
                          rs.low_freq_factor, rs.high_freq_factor);
    }
    r.collect_unknown(cfg.unknown_keys);
    return {};
}

Result<void> read_attention_override(ObjectReader &root, Step35Config &cfg) {
    const Json *v = root.find("attention_other_setting");
    if (v == nullptr) {
        return {};
    }
    if (!v->is_object()) {
        return make_error("attention_other_setting: expected an object, found {}", describe(*v));
    }
    ObjectReader r(*v, "attention_other_setting.");
    AttentionOverride &o = cfg.attention_other;
    o.present = true;
    auto type = r.require("attention_type");
    if (!type) {
        return tl::unexpected(type.error());
    }
    if (auto st = to_string(**type, r.path("attention_type"), o.attention_type); !st) {
        return st;
    }
    if (!is_layer_type(o.attention_type)) {
        return make_error("attention_other_setting.attention_type: unknown layer type {} (expected "
                          "\"full_attention\" or \"sliding_attention\")",
                          json_quoted(o.attention_type));
    }
    if (auto st = r.req_dim("num_attention_heads", o.n_heads); !st) {
        return st;
    }
    if (auto st = r.req_dim("num_attention_groups", o.n_kv_heads); !st) {
        return st;
    }
    o.head_dim = cfg.head_dim;
    if (auto st = r.opt_dim("head_dim", o.head_dim); !st) {
        return st;
    }
    // "true_head_dim" (release: 128, equal to head_dim) is read by no reference implementation; a
    // different value would mean a layout memra does not know, so it is refused.
    int true_head_dim = o.head_dim;
    if (auto st = r.opt_dim("true_head_dim", true_head_dim); !st) {
        return st;
    }
    if (true_head_dim != o.head_dim) {
        return make_error("attention_other_setting.true_head_dim: expected {} (the head_dim), found {}", o.head_dim,
                          true_head_dim);
    }
    r.collect_unknown(cfg.unknown_keys);
    return {};
}

Result<void> read_quantization(ObjectReader &root, Step35Config &cfg) {
    const Json *v = root.find("quantization_config");
    if (v == nullptr) {
        return {};
    }
    if (!v->is_object()) {
        return make_error("quantization_config: expected an object, found {}", describe(*v));
    }
    ObjectReader r(*v, "quantization_config.");
    QuantizationConfig &q = cfg.quantization;
    q.present = true;
    auto method = r.require("quant_method");
    if (!method) {
        return tl::unexpected(method.error());
    }
    if (auto st = to_string(**method, r.path("quant_method"), q.quant_method); !st) {
        return st;
    }
    if (q.quant_method != "fp8") {
        return make_error("quantization_config.quant_method: only \"fp8\" (block-scaled E4M3) is supported, found "
                          "{}",
                          json_quoted(q.quant_method));
    }
    if (auto st = r.opt_string("fmt", q.fmt); !st) {
        return st;
    }
    if (!q.fmt.empty() && q.fmt != "e4m3") {
        return make_error("quantization_config.fmt: only \"e4m3\" is supported, found {}", json_quoted(q.fmt));
    }
    if (auto st = r.opt_string("activation_scheme", q.activation_scheme); !st) {
        return st;
    }
    auto block_v = r.require("weight_block_size");
    if (!block_v) {
        return make_error("quantization_config.weight_block_size: required key is missing (memra supports only "
                          "block-scaled FP8)");
    }
    const Json &b = **block_v;
    int64_t block[2] = {0, 0};
    for (size_t i = 0; b.is_array() && b.size() == 2 && i < 2; ++i) {
        block[i] = json_int(b[i]).value_or(0);
    }
    if (block[0] <= 0 || block[1] <= 0 || block[0] > kMaxConfigDim || block[1] > kMaxConfigDim) {
        return make_error("quantization_config.weight_block_size: expected two positive integers, found {}",
                          b.is_array() ? b.dump() : describe(b));
    }
    // A rank's slice of an expert must cover whole tiles along both edges (model/step35_plan.h takes
    // their lcm); keep that tile inside the config's dimension limit so it fits an int.
    if (std::lcm(block[0], block[1]) > kMaxConfigDim) {
        return make_error("quantization_config.weight_block_size: tiles {} x {} have a common multiple above {}",
                          block[0], block[1], kMaxConfigDim);
    }
    q.block_out = static_cast<int>(block[0]);
    q.block_in = static_cast<int>(block[1]);
    // The list of modules left in high precision goes by several names across exporters.
    for (std::string_view key : {"ignored_layers", "modules_to_not_convert", "ignore"}) {
        const Json *list = r.find(key);
        if (list == nullptr) {
            continue;
        }
        if (!q.unquantized_key.empty()) {
            return make_error("{}: unquantized modules are already listed under quantization_config.{}",
                              r.path(key), q.unquantized_key);
        }
        if (auto st = to_string_list(*list, r.path(key), q.unquantized_modules); !st) {
            return st;
        }
        q.unquantized_key = std::string(key);
    }
    r.collect_unknown(cfg.unknown_keys);
    return {};
}

// bos / pad / eos token ids. Needs vocab_size already parsed (the eos ids are checked against it).
Result<void> read_token_ids(ObjectReader &r, Step35Config &cfg) {
    for (std::string_view key : {"bos_token_id", "pad_token_id"}) {
        int64_t id = -1;
        const bool present = r.find(key) != nullptr;
        if (auto st = r.opt_int(key, id); !st) {
            return st;
        }
        if (!present) {
            continue;
        }
        if (id < 0) {
            return make_error("{}: expected a token id >= 0, found {}", key, id);
        }
        (key == "bos_token_id" ? cfg.bos_token_id : cfg.pad_token_id) = id;
    }
    const Json *eos = r.find("eos_token_id");
    if (eos == nullptr) {
        return {};
    }
    // Kept as int64 and bounded by vocab_size (parsed before this), so consumers may narrow them to the
    // int32 token ids the engine samples: vocab_size is at most kMaxConfigDim.
    const bool is_list = eos->is_array();
    const size_t n = is_list ? eos->size() : 1;
    for (size_t i = 0; i < n; ++i) {
        const Json &e = is_list ? (*eos)[i] : *eos;
        const std::string field = is_list ? fmt::format("eos_token_id[{}]", i) : std::string("eos_token_id");
        const std::optional<int64_t> id = json_int(e);
        if (!id || *id < 0) {
            return make_error("{}: expected a token id >= 0, found {}", field, describe(e));
        }
        if (*id >= cfg.vocab_size) {
            return make_error("{}: expected a token id below vocab_size {}, found {}", field, cfg.vocab_size, *id);
        }
        cfg.eos_token_ids.push_back(*id);
    }
    return {};
}

// Attention, RoPE and per-layer lists. Needs sizes and head defaults already parsed.
Result<void> read_attention(ObjectReader &r, Step35Config &cfg) {
    if (auto st = r.req_dim("num_attention_heads", cfg.n_heads); !st) {
        return st;
    }
    // num_attention_groups is Step's name for the KV head count; num_key_value_heads (transformers'
    // name) is accepted as an alias when it agrees.
    int groups = 0;
    int kv_heads = 0;
    if (auto st = r.opt_dim("num_attention_groups", groups); !st) {
        return st;
    }
    if (auto st = r.opt_dim("num_key_value_heads", kv_heads); !st) {
        return st;
    }
    if (groups == 0 && kv_heads == 0) {
        return make_error("num_attention_groups: required key is missing");
    }
    if (groups != 0 && kv_heads != 0 && groups != kv_heads) {
        return make_error("num_key_value_heads: {} disagrees with num_attention_groups {}", kv_heads, groups);
    }
    cfg.n_kv_heads = groups != 0 ? groups : kv_heads;
    if (r.find("head_dim") != nullptr) {
        if (auto st = r.opt_dim("head_dim", cfg.head_dim); !st) {
            return st;
        }
    } else {
        // HF: head_dim = hidden_size // num_attention_heads when the key is absent.
        if (cfg.d_model % cfg.n_heads != 0) {
            return make_error("head_dim: absent, and hidden_size {} is not a multiple of num_attention_heads {}",
                              cfg.d_model, cfg.n_heads);
        }
        cfg.head_dim = cfg.d_model / cfg.n_heads;
    }
    cfg.att_impl_type = "GQA";
    if (auto st = r.opt_string("att_impl_type", cfg.att_impl_type); !st) {
        return st;
    }
    if (cfg.att_impl_type != "GQA") {
        return make_error("att_impl_type: only \"GQA\" is supported, found {}", json_quoted(cfg.att_impl_type));
    }
    if (auto st = r.opt_bool("use_qk_norm", cfg.use_qk_norm); !st) {
        return st;
    }
    if (auto st = r.opt_bool("use_head_wise_attn_gate", cfg.use_head_wise_attn_gate); !st) {
        return st;
    }
    if (auto st = r.opt_dim("sliding_window", cfg.sliding_window); !st) {
        return st;
    }
    if (auto st = read_attention_override(r, cfg); !st) {
        return st;
    }

    // layer_types. Absent: the references disagree (the remote modeling code indexes the missing list
    // and fails; vLLM makes even layers sliding; ATOM uses i % 4; transformers' Step3p7TextConfig, the
    // independent oracle of STEP35.md section 10, makes every layer full). memra follows transformers
    // for the trunk, and makes MTP layers sliding as every port does (STEP35.md 4.8).
    const size_t n = static_cast<size_t>(cfg.n_total_layers());
    const Json *types = r.find("layer_types");
    cfg.layer_types_given = types != nullptr;
    if (types == nullptr) {
        cfg.layer_types.assign(n, std::string(kFullType));
        for (size_t i = static_cast<size_t>(cfg.n_layers); i < n; ++i) {
            cfg.layer_types[i] = std::string(kSlidingType);
        }
    } else {
        if (auto st = check_list_length(*types, "layer_types", cfg); !st) {
            return st;
        }
        if (auto st = to_string_list(*types, "layer_types", cfg.layer_types); !st) {
            return st;
        }
        for (size_t i = 0; i < n; ++i) {
            if (!is_layer_type(cfg.layer_types[i])) {
                return make_error("layer_types[{}]: unknown layer type {} (expected \"full_attention\" or "
                                  "\"sliding_attention\")",
                                  i, json_quoted(cfg.layer_types[i]));
            }
        }
    }

    // yarn_only_types. Absent: rope_scaling applies to every layer (the remote code's hasattr test and
    // vLLM's truthiness test agree). A present list is taken literally, so [] scales no layer (remote
    // code; vLLM would treat [] like absent).
    if (const Json *yarn = r.find("yarn_only_types"); yarn != nullptr) {
        cfg.yarn_only_types_given = true;
        if (auto st = to_string_list(*yarn, "yarn_only_types", cfg.yarn_only_types); !st) {
            return st;
        }
        for (size_t i = 0; i < cfg.yarn_only_types.size(); ++i) {
            if (!is_layer_type(cfg.yarn_only_types[i])) {
                return make_error("yarn_only_types[{}]: unknown layer type {}", i, json_quoted(cfg.yarn_only_types[i]));
            }
        }
    }
    return read_rope_scaling(r, cfg);
}

Result<void> read_moe(ObjectReader &r, Step35Config &cfg) {
    // Legacy Step-1/2 switches: parsed for their types and recorded, but Step-3.5 code (HF remote code
    // and vLLM) decides MoE layers from moe_layers_enum alone.
    if (auto st = r.opt_bool("use_moe", cfg.use_moe); !st) {
        return st;
    }
    if (auto st = r.opt_int("moe_layer_offset", cfg.moe_layer_offset); !st) {
        return st;
    }
    if (auto st = r.opt_int("moe_every_n_layer", cfg.moe_every_n_layer); !st) {
        return st;
    }
    if (const Json *v = r.find("moe_layers_enum"); v != nullptr) {
        cfg.moe_layers_given = true;
        if (auto st = read_moe_layers(*v, "moe_layers_enum", cfg, cfg.moe_layers); !st) {
            return st;
        }
    } else {
        // Absent: the remote modeling code and vLLM make layers 1 .. L-1 MoE, ignoring use_moe. A config
        // that says use_moe: false but gives no list would silently become MoE there; refuse it instead.
        if (r.find("use_moe") != nullptr && !cfg.use_moe) {
            return make_error("moe_layers_enum: missing while use_moe is false; the HF code would still make layers "
                              "1..{} MoE, so list the MoE layers explicitly (\"\" for none)",
                              cfg.n_layers - 1);
        }
        for (int i = 1; i < cfg.n_layers; ++i) {
            cfg.moe_layers.push_back(i);
        }
    }

    const bool any_moe = !cfg.moe_layers.empty();
    auto dim = [&](std::string_view key, int &out) { return any_moe ? r.req_dim(key, out) : r.opt_dim(key, out); };
    if (auto st = dim("moe_num_experts", cfg.n_experts); !st) {
        return st;
    }
    if (auto st = dim("moe_top_k", cfg.top_k); !st) {
        return st;
    }
    if (auto st = dim("moe_intermediate_size", cfg.d_expert); !st) {
        return st;
    }
    // share_expert_dim, or the config class's constructor spelling share_expert_dims.
    int shared = 0;
    int shared_alias = 0;
    if (auto st = r.opt_dim("share_expert_dim", shared); !st) {
        return st;
    }
    if (auto st = r.opt_dim("share_expert_dims", shared_alias); !st) {
        return st;
    }
    if (shared != 0 && shared_alias != 0 && shared != shared_alias) {
        return make_error("share_expert_dims: {} disagrees with share_expert_dim {}", shared_alias, shared);
    }
    cfg.d_shared = shared != 0 ? shared : shared_alias;
    if (any_moe && cfg.d_shared == 0) {
        return make_error("share_expert_dim: required key is missing");
    }
    if (cfg.top_k > cfg.n_experts && (any_moe || cfg.n_experts > 0)) {
        return make_error("moe_top_k: {} is larger than moe_num_experts {}", cfg.top_k, cfg.n_experts);
    }

    // Absent activation: sigmoid, vLLM's getattr default for this model (the only scoring it implements).
    cfg.moe_router_activation = "sigmoid";
    if (auto st = r.opt_string("moe_router_activation", cfg.moe_router_activation); !st) {
        return st;
    }
    if (cfg.moe_router_activation != "sigmoid") {
        return make_error("moe_router_activation: only \"sigmoid\" routing is supported, found {}",
                          json_quoted(cfg.moe_router_activation));
    }
    if (auto st = r.opt_bool("use_moe_router_bias", cfg.use_moe_router_bias); !st) {
        return st;
    }
    if (!cfg.use_moe_router_bias && any_moe) {
        // Without the bias the HF code switches to a different routing function (normalising over all
        // experts first); vLLM refuses it too.
        return make_error("use_moe_router_bias: only true is supported (biased sigmoid top-k), found false");
    }
    if (auto st = r.opt_bool("norm_expert_weight", cfg.norm_expert_weight); !st) {
        return st;
    }
    if (auto st = r.opt_positive_number("moe_router_scaling_factor", cfg.moe_router_scaling_factor); !st) {
        return st;
    }
    if (auto st = r.opt_bool("need_fp32_gate", cfg.need_fp32_gate); !st) {
        return st;
    }
    if (!cfg.need_fp32_gate && any_moe) {
        return make_error("need_fp32_gate: only true is supported (router logits in FP32), found false");
    }
    return {};
}

// Geometry of every layer, then the checks that need it.
Result<void> resolve_layers(ObjectReader &r, Step35Config &cfg) {
    std::vector<double> theta;
    std::vector<double> partial;
    std::vector<std::string> partial_paths;
    std::vector<double> limits;
    std::vector<double> limits_shared;
    std::vector<bool> use_rope;
    if (auto st = read_rope_theta(r, cfg, theta); !st) {
        return st;
    }
    if (auto st = read_partial_rotary(r, cfg, partial, partial_paths); !st) {
        return st;
    }
    if (auto st = read_use_rope(r, cfg, use_rope); !st) {
        return st;
    }
    if (auto st = read_limits(r, "swiglu_limits", cfg, limits); !st) {
        return st;
    }
    if (auto st = read_limits(r, "swiglu_limits_shared", cfg, limits_shared); !st) {
        return st;
    }
    const std::set<int> moe_set(cfg.moe_layers.begin(), cfg.moe_layers.end());
    bool any_sliding = false;
    cfg.layers.clear();
    for (int i = 0; i < cfg.n_total_layers(); ++i) {
        const size_t u = static_cast<size_t>(i);
        const std::string &type = cfg.layer_types[u];
        LayerGeometry g;
        g.index = i;
        g.is_mtp = i >= cfg.n_layers;
        g.attn = type == kSlidingType ? AttnKind::kSliding : AttnKind::kFull;
        g.n_heads = cfg.n_heads;
        g.n_kv_heads = cfg.n_kv_heads;
        g.head_dim = cfg.head_dim;
        std::string heads_key = "num_attention_heads";
        std::string kv_key = "num_attention_groups";
        if (cfg.attention_other.present && type == cfg.attention_other.attention_type) {
            g.n_heads = cfg.attention_other.n_heads;
            g.n_kv_heads = cfg.attention_other.n_kv_heads;
            g.head_dim = cfg.attention_other.head_dim;
            heads_key = "attention_other_setting.num_attention_heads";
            kv_key = "attention_other_setting.num_attention_groups";
        }
        if (g.n_heads % g.n_kv_heads != 0) {
            return make_error("{}: {} query heads are not a multiple of {} {} (layer {})", heads_key, g.n_heads, kv_key,
                              g.n_kv_heads, i);
        }
        const double rot = partial[u] * static_cast<double>(g.head_dim);
        if (rot != std::floor(rot)) {
            return make_error("{}: {} x head_dim {} = {} is not a whole number of dimensions", partial_paths[u],
                              partial[u], g.head_dim, rot);
        }
        if (rot > static_cast<double>(g.head_dim)) {
            return make_error("{}: {} gives rot_dim {} > head_dim {}", partial_paths[u], partial[u], rot, g.head_dim);
        }
        g.rot_dim = static_cast<int>(rot);
        if (g.rot_dim % 2 != 0) {
            return make_error("{}: {} gives an odd rot_dim {} (RoPE rotates pairs)", partial_paths[u], partial[u],
                              g.rot_dim);
        }
        g.rope_theta = theta[u];
        g.uses_rope = use_rope[u];
        const bool type_scaled = !cfg.yarn_only_types_given ||
                                 std::find(cfg.yarn_only_types.begin(), cfg.yarn_only_types.end(), type) !=
                                     cfg.yarn_only_types.end();
        g.rope_scaled = cfg.rope_scaling.present && g.uses_rope && type_scaled;
        if (g.attn == AttnKind::kSliding) {
            any_sliding = true;
            g.window = cfg.sliding_window;
        }
        if (!g.is_mtp && moe_set.contains(i)) {
            g.ffn = FfnKind::kMoe;
            g.n_experts = cfg.n_experts;
            g.top_k = cfg.top_k;
            g.d_expert = cfg.d_expert;
            g.d_shared = cfg.d_shared;
            g.clamp_routed = static_cast<float>(limits[u]);
        } else {
            // Dense trunk layers and every MTP layer (STEP35.md 4.8): the dense MLP takes the shared limit,
            // the routed limit does not apply.
            g.ffn = FfnKind::kDense;
            g.d_ff = cfg.d_ff;
        }
        g.clamp_shared = static_cast<float>(limits_shared[u]);
        cfg.layers.push_back(g);
    }
    if (any_sliding && cfg.sliding_window == 0) {
        // HF would silently run such layers with full attention but sliding head counts.
        return make_error("sliding_window: required key is missing (layer_types has sliding_attention layers)");
    }
    return {};
}

// Parameters the config describes, in double, to refuse configs whose shapes would overflow int64.
double approx_params(const Step35Config &cfg) {
    const double d = cfg.d_model;
    double total = 2.0 * d * cfg.vocab_size + d;
    for (const LayerGeometry &g : cfg.layers) {
        const double q = static_cast<double>(g.n_heads) * g.head_dim;
        const double kv = static_cast<double>(g.n_kv_heads) * g.head_dim;
        total += d * (2.0 * q + 2.0 * kv + g.n_heads) + 2.0 * g.head_dim + 2.0 * d;
        if (g.ffn == FfnKind::kMoe) {
            total += static_cast<double>(g.n_experts) * (d + 1.0 + 3.0 * d * g.d_expert) + 3.0 * d * g.d_shared;
        } else {
            total += 3.0 * d * g.d_ff;
        }
        if (g.is_mtp) {
            total += 3.0 * d + 2.0 * d * d + d * cfg.vocab_size;
        }
    }
    return total;
}

Result<Step35Config> parse_object(const Json &root) {
    if (!root.is_object()) {
        return make_error("config: expected a JSON object at the top level, found {}", describe(root));
    }
    Step35Config cfg;
    ObjectReader r(root, "");

    auto model_type = r.require("model_type");
    if (!model_type) {
        return tl::unexpected(model_type.error());
    }
    if (auto st = to_string(**model_type, "model_type", cfg.model_type); !st) {
        return tl::unexpected(st.error());
    }
    if (cfg.model_type != "step3p5") {
        return make_error("model_type: expected \"step3p5\" (Step-3.5), found {}", json_quoted(cfg.model_type));
    }
    if (const Json *arch = r.find("architectures"); arch != nullptr) {
        if (auto st = to_string_list(*arch, "architectures", cfg.architectures); !st) {
            return tl::unexpected(st.error());
        }
    }
    if (auto st = r.opt_string("torch_dtype", cfg.torch_dtype); !st) {
        return tl::unexpected(st.error());
    }
    if (cfg.torch_dtype.empty()) {
        if (auto st = r.opt_string("dtype", cfg.torch_dtype); !st) {
            return tl::unexpected(st.error());
        }
    } else {
        r.find("dtype");
    }

    if (auto st = r.req_dim("hidden_size", cfg.d_model); !st) {
        return tl::unexpected(st.error());
    }
    if (auto st = r.req_dim("intermediate_size", cfg.d_ff); !st) {
        return tl::unexpected(st.error());
    }
    if (auto st = r.req_dim("num_hidden_layers", cfg.n_layers); !st) {
        return tl::unexpected(st.error());
    }
    int64_t n_mtp = 0;
    if (auto st = r.opt_int("num_nextn_predict_layers", n_mtp); !st) {
        return tl::unexpected(st.error());
    }
    if (n_mtp < 0) {
        return make_error("num_nextn_predict_layers: expected an integer >= 0, found {}", n_mtp);
    }
    if (int64_t{cfg.n_layers} + n_mtp > kMaxConfigLayers) {
        return make_error("num_hidden_layers + num_nextn_predict_layers: {} layers is more than the limit {}",
                          int64_t{cfg.n_layers} + n_mtp, kMaxConfigLayers);
    }
    cfg.n_mtp_layers = static_cast<int>(n_mtp);
    if (auto st = r.req_dim("vocab_size", cfg.vocab_size); !st) {
        return tl::unexpected(st.error());
    }
    for (std::string_view key : {"max_seq_len", "max_position_embeddings"}) {
        int64_t value = 0;
        const bool present = r.find(key) != nullptr;
        if (auto st = r.opt_int(key, value); !st) {
            return tl::unexpected(st.error());
        }
        if (present && value <= 0) {
            return make_error("{}: expected a positive integer, found {}", key, value);
        }
        (key == "max_seq_len" ? cfg.max_seq_len : cfg.max_position_embeddings) = value;
    }
    cfg.context_length = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : cfg.max_seq_len;
    if (cfg.context_length == 0) {
        return make_error("max_position_embeddings: required key is missing (and no max_seq_len either)");
    }

    if (auto st = read_attention(r, cfg); !st) {
        return tl::unexpected(st.error());
    }
    if (auto st = read_moe(r, cfg); !st) {
        return tl::unexpected(st.error());
    }
    if (auto st = resolve_layers(r, cfg); !st) {
        return tl::unexpected(st.error());
    }

    if (auto st = r.opt_positive_number("rms_norm_eps", cfg.rms_norm_eps); !st) {
        return tl::unexpected(st.error());
    }
    if (auto st = r.opt_bool("tie_word_embeddings", cfg.tie_word_embeddings); !st) {
        return tl::unexpected(st.error());
    }
    if (auto st = read_token_ids(r, cfg); !st) {
        return tl::unexpected(st.error());
    }
    if (auto st = read_quantization(r, cfg); !st) {
        return tl::unexpected(st.error());
    }

    // Keys seen in Step configs whose only legal value is the one memra implements.
    bool zero_centered = true;
    bool sink = false;
    std::string hidden_act = "silu";
    if (auto st = r.opt_bool("zero_centered", zero_centered); !st) {
        return tl::unexpected(st.error());
    }
    if (!zero_centered) {
        return make_error("zero_centered: only true is supported (RMSNorm weights applied as 1 + w), found false");
    }
    if (auto st = r.opt_bool("sink", sink); !st) {
        return tl::unexpected(st.error());
    }
    if (sink) {
        return make_error("sink: attention sinks are not supported, found true");
    }
    if (auto st = r.opt_string("hidden_act", hidden_act); !st) {
        return tl::unexpected(st.error());
    }
    if (hidden_act != "silu") {
        return make_error("hidden_act: only \"silu\" is supported, found {}", json_quoted(hidden_act));
    }
    // Bookkeeping keys of HF configs with no meaning for the model.
    r.find("auto_map");
    r.find("transformers_version");

    const double params = approx_params(cfg);
    if (params > static_cast<double>(kMaxConfigParams)) {
        return make_error("config: describes about {:.3g} parameters, more than the limit {:.3g}", params,
                          static_cast<double>(kMaxConfigParams));
    }

    r.collect_unknown(cfg.unknown_keys);
    std::sort(cfg.unknown_keys.begin(), cfg.unknown_keys.end());
    return cfg;
}

}  // namespace

std::string_view attn_kind_name(AttnKind kind) {
    switch (kind) {
    case AttnKind::kFull:
        return "full";
    case AttnKind::kSliding:
        return "sliding";
    }
    return "?";
}

std::string_view ffn_kind_name(FfnKind kind) {
    switch (kind) {
    case FfnKind::kDense:
        return "dense";
    case FfnKind::kMoe:
        return "moe";
    }
    return "?";
}

Result<Step35Config> parse_step35_config(std::string_view json_text) {
    Json root;
    try {
        root = Json::parse(json_text.begin(), json_text.end());
    } catch (const Json::exception &e) {
        return make_error("config: invalid JSON: {}", e.what());
    }
    try {
        return parse_object(root);
    } catch (const Json::exception &e) {
        // Every access above checks types first; this is a safety net, not a path.
        return make_error("config: unexpected JSON structure: {}", e.what());
    }
}

Result<Step35Config> load_step35_config(const std::filesystem::path &model_dir) {
    const std::filesystem::path path = model_dir / "config.json";
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::exists(status)) {
        return make_error("{}: not found", path.string());
    }
    if (!std::filesystem::is_regular_file(status)) {
        return make_error("{}: not a regular file", path.string());
    }
    const uintmax_t size = std::filesystem::file_size(path, ec);
    if (ec) {
        return make_error("{}: cannot read its size: {}", path.string(), ec.message());
    }
    if (size > kMaxConfigFileBytes) {
        return make_error("{}: {} bytes, more than the {} a config.json may have", path.string(), size,
                          kMaxConfigFileBytes);
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return make_error("{}: cannot open for reading", path.string());
    }
    std::ostringstream text;
    text << in.rdbuf();
    if (in.bad()) {
        return make_error("{}: read error", path.string());
    }
    auto cfg = parse_step35_config(text.str());
    if (!cfg) {
        return wrap_error(path.string(), cfg.error());
    }
    return cfg;
}

}  // namespace memra::model
