// Strict JSON parsing: a parse callback keeps one frame per open object or array, so a repeated
// key is caught with the path of the object that holds it, and the nesting depth is bounded.
#include "io/strict_json.h"

#include <new>
#include <set>
#include <vector>

namespace memra::io {
namespace {

// Thrown from the parse callback to stop the parser; caught in parse_json_strict.
struct StrictJsonError {
    std::string message;
};

struct Frame {
    bool is_object = false;
    std::string name;            // how the parent refers to this value: its key, or "[]" inside an array
    std::string last_key;        // the key whose value is being parsed (objects only)
    std::set<std::string> keys;  // keys seen so far (objects only)
};

std::string frame_path(const std::vector<Frame> &frames) {
    std::string path;
    for (size_t i = 1; i < frames.size(); ++i) {
        if (!path.empty() && frames[i].name != "[]") path += '.';
        path += frames[i].name;
    }
    return path;
}

}  // namespace

Result<nlohmann::json> parse_json_strict(std::string_view text) {
    using nlohmann::json;
    std::vector<Frame> frames;
    auto callback = [&frames](int /*depth*/, json::parse_event_t event, json &parsed) -> bool {
        switch (event) {
        case json::parse_event_t::object_start:
        case json::parse_event_t::array_start: {
            if (frames.size() >= kMaxJsonDepth) {
                throw StrictJsonError{fmt::format("JSON nesting deeper than {} levels", kMaxJsonDepth)};
            }
            Frame frame;
            frame.is_object = event == json::parse_event_t::object_start;
            if (!frames.empty()) frame.name = frames.back().is_object ? frames.back().last_key : "[]";
            frames.push_back(std::move(frame));
            break;
        }
        case json::parse_event_t::object_end:
        case json::parse_event_t::array_end:
            frames.pop_back();
            break;
        case json::parse_event_t::key: {
            Frame &frame = frames.back();
            const std::string &key = parsed.get_ref<const std::string &>();
            if (!frame.keys.insert(key).second) {
                if (frames.size() == 1) {
                    throw StrictJsonError{fmt::format("duplicate key \"{}\" at the top level", key)};
                }
                throw StrictJsonError{fmt::format("duplicate key \"{}\" in \"{}\"", key, frame_path(frames))};
            }
            frame.last_key = key;
            break;
        }
        case json::parse_event_t::value:
            break;
        }
        return true;
    };
    try {
        return json::parse(text.begin(), text.end(), callback);
    } catch (const StrictJsonError &err) {
        return make_error("{}", err.message);
    } catch (const json::exception &err) {
        // what() reads "[json.exception.parse_error.101] parse error at line 1, column 2: ...".
        std::string_view what = err.what();
        size_t bracket = what.find("] ");
        if (what.starts_with("[json.exception.") && bracket != std::string_view::npos) what.remove_prefix(bracket + 2);
        return make_error("invalid JSON: {}", what);
    } catch (const std::bad_alloc &) {
        return make_error("out of memory while parsing {} bytes of JSON", text.size());
    }
}

bool is_valid_utf8(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
        auto c = static_cast<unsigned char>(s[i]);
        size_t n = 0;
        uint32_t cp = 0;
        if (c < 0x80) {
            ++i;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1;
            cp = c & 0x1Fu;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2;
            cp = c & 0x0Fu;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3;
            cp = c & 0x07u;
        } else {
            return false;
        }
        if (i + n >= s.size()) return false;  // truncated sequence
        for (size_t k = 1; k <= n; ++k) {
            auto cc = static_cast<unsigned char>(s[i + k]);
            if ((cc & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (cc & 0x3Fu);
        }
        // Overlong encodings, UTF-16 surrogates and code points past U+10FFFF are not UTF-8.
        const uint32_t min_cp = n == 1 ? 0x80 : n == 2 ? 0x800 : 0x10000;
        if (cp < min_cp || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return false;
        i += n + 1;
    }
    return true;
}

}  // namespace memra::io
