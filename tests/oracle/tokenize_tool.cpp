// memra_tokenize_tool: drives memra::text for the Python oracle (tests/oracle/test_tokenizer.py).
//   encode TOKENIZER IN.json OUT.json [--no-add-special] [--no-parse-special]
//       IN: a JSON list of strings; OUT: a JSON list of id lists. Prints the encode time.
//   decode TOKENIZER IN.json OUT.json [--skip-special]   IN: list of id lists; OUT: list of strings
//   stream TOKENIZER IN.json OUT.json [--skip-special]   the same through StreamDecoder, one id at a
//       time; each output string is the concatenation of what feed() and flush() returned
//   split IN.json OUT.json   IN: list of {"pattern", "behavior", "invert", "text"} (Split with a
//       Regex pattern); OUT: list of piece lists (or {"error": message})
// TOKENIZER is a directory or a tokenizer.json. Exit 1 on failures, 2 on usage errors.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "text/onig_regex.h"
#include "text/pipeline.h"
#include "text/tokenizer.h"

namespace {

using Json = nlohmann::json;
using memra::text::Tokenizer;

int usage() {
    fmt::print(stderr, "usage: memra_tokenize_tool encode|decode|stream TOKENIZER IN.json OUT.json [flags]\n"
                       "       memra_tokenize_tool split IN.json OUT.json\n");
    return 2;
}

bool read_json(const std::string &path, Json &out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        fmt::print(stderr, "memra_tokenize_tool: cannot open {}\n", path);
        return false;
    }
    try {
        out = Json::parse(in);
    } catch (const Json::exception &e) {
        fmt::print(stderr, "memra_tokenize_tool: {}: {}\n", path, e.what());
        return false;
    }
    return true;
}

bool write_json(const std::string &path, const Json &value) {
    std::ofstream out(path, std::ios::binary);
    out << value.dump(-1, ' ', false, Json::error_handler_t::strict);
    return static_cast<bool>(out);
}

int run_split(const std::string &in_path, const std::string &out_path) {
    Json in;
    if (!read_json(in_path, in)) return 1;
    Json out = Json::array();
    for (const Json &item : in) {
        const std::string behavior = item.at("behavior").get<std::string>();
        const memra::text::SplitBehavior b =
            behavior == "removed"                ? memra::text::SplitBehavior::kRemoved
            : behavior == "isolated"             ? memra::text::SplitBehavior::kIsolated
            : behavior == "merged_with_previous" ? memra::text::SplitBehavior::kMergedWithPrevious
            : behavior == "merged_with_next"     ? memra::text::SplitBehavior::kMergedWithNext
                                                 : memra::text::SplitBehavior::kContiguous;
        auto regex = memra::text::Regex::compile(item.at("pattern").get<std::string>());
        if (!regex) {
            out.push_back(Json{{"error", regex.error().message}});
            continue;
        }
        std::vector<std::string> pieces;
        auto ok = memra::text::split_text(item.at("text").get<std::string>(), *regex, item.at("invert").get<bool>(), b,
                                          pieces);
        if (!ok) {
            out.push_back(Json{{"error", ok.error().message}});
            continue;
        }
        out.push_back(pieces);
    }
    return write_json(out_path, out) ? 0 : 1;
}

}  // namespace

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    const std::string mode = argv[1];
    if (mode == "split") {
        if (argc != 4) return usage();
        return run_split(argv[2], argv[3]);
    }
    if ((mode != "encode" && mode != "decode" && mode != "stream") || argc < 5) return usage();
    bool add_special = true, parse_special = true, skip_special = false;
    for (int i = 5; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--no-add-special" && mode == "encode") {
            add_special = false;
        } else if (flag == "--no-parse-special" && mode == "encode") {
            parse_special = false;
        } else if (flag == "--skip-special" && mode != "encode") {
            skip_special = true;
        } else {
            fmt::print(stderr, "memra_tokenize_tool: unknown flag {} for {}\n", flag, mode);
            return 2;
        }
    }
    auto tok = Tokenizer::load(argv[2]);
    if (!tok) {
        fmt::print(stderr, "memra_tokenize_tool: {}\n", tok.error().message);
        return 1;
    }
    Json in;
    if (!read_json(argv[3], in)) return 1;
    if (!in.is_array()) {
        fmt::print(stderr, "memra_tokenize_tool: {}: expected a JSON list\n", argv[3]);
        return 1;
    }
    Json out = Json::array();
    const auto t0 = std::chrono::steady_clock::now();
    size_t bytes = 0;
    for (const Json &item : in) {
        if (mode == "encode") {
            const std::string text = item.get<std::string>();
            bytes += text.size();
            auto ids = tok->encode(text, memra::text::EncodeOptions{add_special, parse_special});
            if (!ids) {
                fmt::print(stderr, "memra_tokenize_tool: {}\n", ids.error().message);
                return 1;
            }
            out.push_back(*ids);
            continue;
        }
        const std::vector<int32_t> ids = item.get<std::vector<int32_t>>();
        if (mode == "decode") {
            out.push_back(tok->decode(ids, skip_special));
            continue;
        }
        memra::text::StreamDecoder stream = tok->stream_decoder(skip_special);
        std::string text;
        for (int32_t id : ids) text += stream.feed(id);
        text += stream.flush();
        out.push_back(text);
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (mode == "encode") fmt::print("encoded {} strings, {} bytes in {:.1f} ms\n", in.size(), bytes, ms);
    return write_json(argv[4], out) ? 0 : 1;
}
