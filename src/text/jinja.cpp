// The public API of jinja.h: parsing and rendering behind Result (the interpreter throws internally;
// nothing escapes here), and the argument helpers filters and methods share.
#include "text/jinja.h"

#include <algorithm>

#include <fmt/format.h>

#include "text/jinja_impl.h"

namespace memra::text::jinja {

Value param(const CallArgs &args, size_t position, std::string_view name, const Value &fallback) {
    const Value *v = args.get(position, name);
    return v ? *v : fallback;
}

int64_t int_param(const CallArgs &args, size_t position, std::string_view name, int64_t fallback) {
    const Value v = param(args, position, name);
    if (v.kind == Kind::kNone) return fallback;
    if (!v.is_int()) fail(fmt::format("'{}' must be an integer, not {}", name, type_name(v)));
    return v.as_int();
}

std::string_view str_of(const Renderer &r, const Value &v, std::string &storage) {
    if (v.is_string()) return v.str();
    storage = to_str(v, r.options().max_output_bytes);
    return storage;
}

const Value *CallArgs::get(size_t position, std::string_view name) const {
    if (position < positional.size()) return &positional[position];
    for (const auto &[k, v] : keyword) {
        if (k == name) return &v;
    }
    return nullptr;
}

void CallArgs::check(std::string_view callee, std::initializer_list<std::string_view> params) const {
    if (positional.size() > params.size()) {
        fail(fmt::format("{}() takes at most {} argument(s), {} given", callee, params.size(), positional.size()));
    }
    for (const auto &[k, v] : keyword) {
        if (std::find(params.begin(), params.end(), k) == params.end()) {
            fail(fmt::format("{}() got an unexpected keyword argument '{}'", callee, k));
        }
    }
}

Result<Template> Template::parse(std::string_view source) {
    try {
        auto impl = std::make_shared<Impl>();
        impl->body = parse_template(source);
        return Template(std::move(impl));
    } catch (const SyntaxError &e) {
        return make_error("line {}:{}: {}", e.line, e.col, e.message);
    } catch (const RenderError &e) {
        return make_error("{}", e.message);
    } catch (const std::exception &e) {
        return make_error("template parsing failed: {}", e.what());
    }
}

Result<std::string> Template::render(const nlohmann::ordered_json &context, const RenderOptions &options) const {
    if (!context.is_object()) {
        return make_error("render context: expected a JSON object, found {}", context.type_name());
    }
    int line = 0;
    try {
        auto globals = std::make_shared<Scope>();
        for (const auto &[k, v] : context.items()) globals->set(k, from_json(v, options.max_depth));
        Renderer r(options, std::move(globals));
        std::string out;
        try {
            r.render(impl_->body, out);
        } catch (...) {
            line = r.line;
            throw;
        }
        return out;
    } catch (const RenderError &e) {
        if (line == 0) return make_error("{}", e.message);
        return make_error("line {}: {}", line, e.message);
    } catch (const std::bad_alloc &) {
        return make_error("line {}: out of memory", line);
    } catch (const std::exception &e) {
        return make_error("line {}: {}", line, e.what());
    }
}

}  // namespace memra::text::jinja
