// The global functions of transformers' chat template environment: range (with the sandbox's
// MAX_RANGE), dict, namespace (no underscore-prefixed attributes), raise_exception and strftime_now.
#include <algorithm>
#include <ctime>

#include <fmt/format.h>

#include "text/jinja_impl.h"

namespace memra::text::jinja {

Value builtin_global(std::string_view name) {
    constexpr std::string_view kGlobals[] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};
    if (std::find(std::begin(kGlobals), std::end(kGlobals), name) == std::end(kGlobals)) return Value();
    Value v = Value::make(Kind::kCallable);
    auto c = std::make_shared<CallableObj>();
    c->fn = CallableObj::Fn::kBuiltin;
    c->name = std::string(name);
    v.obj = std::move(c);
    return v;
}

namespace {

// jinja2's sandbox refuses ranges of more than MAX_RANGE elements.
constexpr int64_t kMaxRange = 100000;

Value range(Renderer &r, const CallArgs &args) {
    if (!args.keyword.empty()) fail("range() takes no keyword arguments");
    const size_t n = args.positional.size();
    if (n == 0 || n > 3) fail(fmt::format("range expected 1 to 3 arguments, got {}", n));
    for (const Value &a : args.positional) {
        if (!a.is_int()) fail(fmt::format("'{}' object cannot be interpreted as an integer", type_name(a)));
    }
    const int64_t start = n == 1 ? 0 : args.positional[0].as_int();
    const int64_t stop = n == 1 ? args.positional[0].as_int() : args.positional[1].as_int();
    const int64_t step = n == 3 ? args.positional[2].as_int() : 1;
    if (step == 0) fail("range() arg 3 must not be zero");
    const Int128 span = step > 0 ? static_cast<Int128>(stop) - start : static_cast<Int128>(start) - stop;
    const Int128 abs_step = step > 0 ? static_cast<Int128>(step) : -static_cast<Int128>(step);
    const Int128 count = span <= 0 ? 0 : (span + abs_step - 1) / abs_step;
    if (count > kMaxRange) {
        fail(fmt::format("range too big: the sandbox blocks ranges larger than MAX_RANGE ({})", kMaxRange));
    }
    std::vector<Value> items;
    items.reserve(static_cast<size_t>(count));
    for (Int128 k = 0; k < count; ++k) items.push_back(Value::integer(static_cast<int64_t>(start + k * step)));
    return r.make_list(std::move(items));
}

// Python's dict(*args, **kwargs): an optional mapping or iterable of pairs, then the keywords.
DictObj make_dict_from(Renderer &r, const CallArgs &args, std::string_view callee) {
    if (args.positional.size() > 1) {
        fail(fmt::format("{} expected at most 1 argument, got {}", callee, args.positional.size()));
    }
    DictObj d;
    if (!args.positional.empty()) {
        const Value &src = args.positional[0];
        if (src.kind == Kind::kDict || src.kind == Kind::kNamespace) {
            d.items = src.dict().items;
            d.string_index = src.dict().string_index;
        } else {
            const std::vector<Value> pairs = iterate(r, src);
            for (size_t k = 0; k < pairs.size(); ++k) {
                const std::vector<Value> kv = pairs[k].is_string() || pairs[k].is_sequence() ? iterate(r, pairs[k])
                                                                                              : std::vector<Value>{};
                if (kv.size() != 2) {
                    fail(fmt::format("dictionary update sequence element #{} has length {}; 2 is required", k,
                                     kv.size()));
                }
                d.set(kv[0], kv[1]);
            }
        }
    }
    for (const auto &[k, v] : args.keyword) d.set(Value::string(k), v);
    r.charge(d.items.size());
    return d;
}

std::tm local_now(const RenderOptions &options) {
    if (options.now) return *options.now;
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    return tm;
}

std::string strftime_now(Renderer &r, const CallArgs &args) {
    const Value *format = args.get(0, "format");
    if (!format || !format->is_string()) fail("strftime_now() needs a format string");
    const std::string &f = format->str();
    if (f.empty()) return "";
    const std::tm tm = local_now(r.options());
    // strftime gives 0 both for "too small" and for an empty result: grow up to a bound, then accept "".
    for (size_t size = 64 + 4 * f.size(); size <= 64 * 1024 + 64 * f.size(); size *= 4) {
        std::string out(size, '\0');
        const size_t n = std::strftime(out.data(), out.size(), f.c_str(), &tm);
        if (n > 0) {
            out.resize(n);
            return out;
        }
    }
    return "";
}

}  // namespace

Value call_builtin(Renderer &r, const CallableObj &fn, const CallArgs &args) {
    const std::string &name = fn.name;
    if (name == "range") return range(r, args);
    if (name == "dict") {
        Value v = make_dict(make_dict_from(r, args, "dict"));
        r.check_depth(v.dict().depth);
        return v;
    }
    if (name == "namespace") {
        DictObj d = make_dict_from(r, args, "namespace");
        for (const auto &[k, v] : d.items) {
            if (k.is_string() && !k.str().empty() && k.str()[0] == '_') {
                fail(fmt::format("chat templates cannot store underscore-prefixed attributes on a namespace ('{}')",
                                 k.str()));
            }
            if (const auto *c = dynamic_cast<const ContainerInfo *>(v.obj.get()); c && c->holds_namespace) {
                fail("a namespace cannot hold a namespace");
            }
        }
        Value v = make_dict(std::move(d), Kind::kNamespace);
        r.check_depth(v.dict().depth);
        return v;
    }
    if (name == "raise_exception") {
        const Value *message = args.get(0, "message");
        fail(message ? to_str(*message, r.options().max_output_bytes) : std::string("raise_exception() called"));
    }
    if (name == "strftime_now") return Value::string(strftime_now(r, args));
    fail(fmt::format("unknown function '{}'", name));
}

}  // namespace memra::text::jinja
