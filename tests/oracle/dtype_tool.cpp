// memra_dtype_tool: runs one of core's number-format conversions over a raw little-endian binary file,
// so tests/oracle/test_dtypes.py and test_quants.py can compare memra's bits with ml_dtypes and gguf.
// Usage: memra_dtype_tool OP IN OUT [ROWS COLS]. Exit 0 on success, 2 on bad usage or malformed input
// (with a message naming the problem), 1 when a file cannot be read or written.
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/float_formats.h"
#include "core/fp8_block.h"
#include "core/quant_blocks.h"
#include "core/result.h"

namespace {

using memra::Error;
using memra::Result;
using Bytes = std::vector<uint8_t>;

constexpr int kExitIo = 1;
constexpr int kExitUsage = 2;

constexpr std::string_view kUsage =
    "usage: memra_dtype_tool OP IN OUT [ROWS COLS]\n"
    "  IN and OUT are raw little-endian binary files.\n"
    "  element-wise:  f32_to_bf16 bf16_to_f32 f32_to_f16 f16_to_f32\n"
    "                 f32_to_fp8 (non-saturating, = ml_dtypes) f32_to_fp8_sat fp8_to_f32\n"
    "  GGML blocks:   quantize_q8_0 dequantize_q8_0 quantize_q5_1 dequantize_q5_1\n"
    "                 quantize_q4_0 dequantize_q4_0 quantize_q8_1 dequantize_q8_1\n"
    "                 (quantize: f32 count a multiple of 32; dequantize: whole blocks)\n"
    "  FP8 128x128:   fp8_block_quant ROWS COLS    f32 [ROWS, COLS] -> e4m3 [ROWS, COLS] then f32 scale_inv\n"
    "                 fp8_block_dequant ROWS COLS  e4m3 [ROWS, COLS] then f32 scale_inv -> f32 [ROWS, COLS]\n";

// A failure with its exit code: usage/input problems are 2, file-system problems 1.
struct ToolError {
    int code;
    std::string message;
};

Result<Bytes> read_file(const std::string &path) {
    std::FILE *f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return memra::make_error("input file {}: cannot open: {}", path, std::strerror(errno));
    Bytes data;
    uint8_t buf[1 << 16];
    size_t got = 0;
    while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) data.insert(data.end(), buf, buf + got);
    const bool failed = std::ferror(f) != 0;
    std::fclose(f);
    if (failed) return memra::make_error("input file {}: read error", path);
    return data;
}

Result<bool> write_file(const std::string &path, const Bytes &data) {
    std::FILE *f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return memra::make_error("output file {}: cannot open: {}", path, std::strerror(errno));
    const size_t put = data.empty() ? 0 : std::fwrite(data.data(), 1, data.size(), f);
    const bool closed = std::fclose(f) == 0;
    if (put != data.size() || !closed) return memra::make_error("output file {}: write error", path);
    return true;
}

// Typed copies of the raw bytes (memcpy keeps this free of aliasing questions).
std::vector<float> to_f32(const Bytes &b) {
    std::vector<float> v(b.size() / 4);
    if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * 4);
    return v;
}

std::vector<uint16_t> to_u16(const Bytes &b) {
    std::vector<uint16_t> v(b.size() / 2);
    if (!v.empty()) std::memcpy(v.data(), b.data(), v.size() * 2);
    return v;
}

Bytes from_raw(const void *p, size_t n) {
    Bytes out(n);
    if (n > 0) std::memcpy(out.data(), p, n);
    return out;
}

Bytes from_f32(const std::vector<float> &v) { return from_raw(v.data(), v.size() * 4); }
Bytes from_u16(const std::vector<uint16_t> &v) { return from_raw(v.data(), v.size() * 2); }

tl::expected<bool, ToolError> check_multiple(const std::string &op, const Bytes &in, size_t unit,
                                             const char *unit_name) {
    if (in.size() % unit != 0) {
        return tl::unexpected(ToolError{kExitUsage, fmt::format("{}: input size must be a multiple of {} bytes ({}), "
                                                                "found {} bytes",
                                                                op, unit, unit_name, in.size())});
    }
    return true;
}

// f32 input whose element count is a whole number of 32-value blocks.
tl::expected<std::vector<float>, ToolError> f32_blocks(const std::string &op, const Bytes &in) {
    if (in.size() % (4 * memra::kQuantBlock) != 0) {
        return tl::unexpected(ToolError{kExitUsage, fmt::format("{}: input must hold a multiple of {} f32 values "
                                                                "({} bytes), found {} bytes",
                                                                op, memra::kQuantBlock, 4 * memra::kQuantBlock,
                                                                in.size())});
    }
    return to_f32(in);
}

tl::expected<int64_t, ToolError> parse_dim(const std::string &op, const char *name, const std::string &text) {
    int64_t v = -1;
    const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || ptr != text.data() + text.size() || v < 0 || v > (int64_t{1} << 24)) {
        return tl::unexpected(
            ToolError{kExitUsage, fmt::format("{}: {} must be an integer in [0, 2^24], found '{}'", op, name, text)});
    }
    return v;
}

// Runs an op that takes no ROWS/COLS. Returns the output bytes.
tl::expected<Bytes, ToolError> run_elementwise(const std::string &op, const Bytes &in) {
    using memra::Fp8Saturation;
    auto fail_size = [&](size_t unit, const char *name) { return check_multiple(op, in, unit, name); };
    if (op == "f32_to_bf16" || op == "f32_to_f16" || op == "f32_to_fp8" || op == "f32_to_fp8_sat") {
        if (auto ok = fail_size(4, "f32"); !ok) return tl::unexpected(ok.error());
        const std::vector<float> x = to_f32(in);
        if (op == "f32_to_bf16" || op == "f32_to_f16") {
            std::vector<uint16_t> y(x.size());
            const bool bf16 = op == "f32_to_bf16";
            for (size_t i = 0; i < x.size(); ++i) y[i] = bf16 ? memra::f32_to_bf16(x[i]) : memra::f32_to_f16(x[i]);
            return from_u16(y);
        }
        const Fp8Saturation sat = op == "f32_to_fp8_sat" ? Fp8Saturation::kSaturate : Fp8Saturation::kNonSaturating;
        Bytes y(x.size());
        for (size_t i = 0; i < x.size(); ++i) y[i] = memra::f32_to_fp8_e4m3(x[i], sat);
        return y;
    }
    if (op == "bf16_to_f32" || op == "f16_to_f32") {
        if (auto ok = fail_size(2, "16-bit codes"); !ok) return tl::unexpected(ok.error());
        const std::vector<uint16_t> x = to_u16(in);
        std::vector<float> y(x.size());
        const bool bf16 = op == "bf16_to_f32";
        for (size_t i = 0; i < x.size(); ++i) y[i] = bf16 ? memra::bf16_to_f32(x[i]) : memra::f16_to_f32(x[i]);
        return from_f32(y);
    }
    if (op == "fp8_to_f32") {
        std::vector<float> y(in.size());
        for (size_t i = 0; i < in.size(); ++i) y[i] = memra::fp8_e4m3_to_f32(in[i]);
        return from_f32(y);
    }
    if (op == "quantize_q8_0" || op == "quantize_q5_1" || op == "quantize_q4_0" || op == "quantize_q8_1") {
        auto x = f32_blocks(op, in);
        if (!x) return tl::unexpected(x.error());
        const auto n = static_cast<int64_t>(x->size());
        const auto nb = static_cast<size_t>(n / memra::kQuantBlock);
        if (op == "quantize_q8_0") {
            std::vector<memra::BlockQ8_0> y(nb);
            memra::quantize_row_q8_0(x->data(), y.data(), n);
            return from_raw(y.data(), nb * sizeof(memra::BlockQ8_0));
        }
        if (op == "quantize_q5_1") {
            std::vector<memra::BlockQ5_1> y(nb);
            memra::quantize_row_q5_1(x->data(), y.data(), n);
            return from_raw(y.data(), nb * sizeof(memra::BlockQ5_1));
        }
        if (op == "quantize_q4_0") {
            std::vector<memra::BlockQ4_0> y(nb);
            memra::quantize_row_q4_0(x->data(), y.data(), n);
            return from_raw(y.data(), nb * sizeof(memra::BlockQ4_0));
        }
        std::vector<memra::BlockQ8_1> y(nb);
        memra::quantize_row_q8_1(x->data(), y.data(), n);
        return from_raw(y.data(), nb * sizeof(memra::BlockQ8_1));
    }
    if (op == "dequantize_q8_0") {
        if (auto ok = fail_size(sizeof(memra::BlockQ8_0), "q8_0 blocks"); !ok) return tl::unexpected(ok.error());
        std::vector<memra::BlockQ8_0> x(in.size() / sizeof(memra::BlockQ8_0));
        if (!x.empty()) std::memcpy(x.data(), in.data(), in.size());
        std::vector<float> y(x.size() * memra::kQuantBlock);
        memra::dequantize_row_q8_0(x.data(), y.data(), static_cast<int64_t>(y.size()));
        return from_f32(y);
    }
    if (op == "dequantize_q5_1") {
        if (auto ok = fail_size(sizeof(memra::BlockQ5_1), "q5_1 blocks"); !ok) return tl::unexpected(ok.error());
        std::vector<memra::BlockQ5_1> x(in.size() / sizeof(memra::BlockQ5_1));
        if (!x.empty()) std::memcpy(x.data(), in.data(), in.size());
        std::vector<float> y(x.size() * memra::kQuantBlock);
        memra::dequantize_row_q5_1(x.data(), y.data(), static_cast<int64_t>(y.size()));
        return from_f32(y);
    }
    if (op == "dequantize_q4_0") {
        if (auto ok = fail_size(sizeof(memra::BlockQ4_0), "q4_0 blocks"); !ok) return tl::unexpected(ok.error());
        std::vector<memra::BlockQ4_0> x(in.size() / sizeof(memra::BlockQ4_0));
        if (!x.empty()) std::memcpy(x.data(), in.data(), in.size());
        std::vector<float> y(x.size() * memra::kQuantBlock);
        memra::dequantize_row_q4_0(x.data(), y.data(), static_cast<int64_t>(y.size()));
        return from_f32(y);
    }
    if (op == "dequantize_q8_1") {
        if (auto ok = fail_size(sizeof(memra::BlockQ8_1), "q8_1 blocks"); !ok) return tl::unexpected(ok.error());
        std::vector<memra::BlockQ8_1> x(in.size() / sizeof(memra::BlockQ8_1));
        if (!x.empty()) std::memcpy(x.data(), in.data(), in.size());
        std::vector<float> y(x.size() * memra::kQuantBlock);
        memra::dequantize_row_q8_1(x.data(), y.data(), static_cast<int64_t>(y.size()));
        return from_f32(y);
    }
    return tl::unexpected(ToolError{kExitUsage, fmt::format("unknown OP '{}'", op)});
}

tl::expected<Bytes, ToolError> run_fp8_block(const std::string &op, const Bytes &in, int64_t rows, int64_t cols) {
    const auto n = static_cast<size_t>(rows * cols);
    const auto n_scale = static_cast<size_t>(memra::fp8_scale_blocks(rows) * memra::fp8_scale_blocks(cols));
    if (op == "fp8_block_quant") {
        if (in.size() != 4 * n) {
            return tl::unexpected(ToolError{kExitUsage, fmt::format("{}: input must be f32 [{}, {}] = {} bytes, found "
                                                                    "{} bytes",
                                                                    op, rows, cols, 4 * n, in.size())});
        }
        const std::vector<float> w = to_f32(in);
        Bytes q(n);
        std::vector<float> scale(n_scale);
        memra::quantize_fp8_block(w.data(), rows, cols, q.data(), scale.data());
        Bytes out = q;
        const Bytes s = from_f32(scale);
        out.insert(out.end(), s.begin(), s.end());
        return out;
    }
    if (in.size() != n + 4 * n_scale) {
        return tl::unexpected(ToolError{kExitUsage, fmt::format("{}: input must be e4m3 [{}, {}] then f32 scale_inv "
                                                                "[{}, {}] = {} bytes, found {} bytes",
                                                                op, rows, cols, memra::fp8_scale_blocks(rows),
                                                                memra::fp8_scale_blocks(cols), n + 4 * n_scale,
                                                                in.size())});
    }
    std::vector<float> scale(n_scale);
    if (n_scale > 0) std::memcpy(scale.data(), in.data() + n, 4 * n_scale);
    std::vector<float> out(n);
    memra::dequantize_fp8_block(in.data(), rows, cols, scale.data(), out.data());
    return from_f32(out);
}

bool is_known_op(std::string_view op) {
    constexpr std::string_view kOps[] = {
        "f32_to_bf16",     "bf16_to_f32",     "f32_to_f16",      "f16_to_f32",      "f32_to_fp8",
        "f32_to_fp8_sat",  "fp8_to_f32",      "quantize_q8_0",   "dequantize_q8_0", "quantize_q5_1",
        "dequantize_q5_1", "quantize_q4_0",   "dequantize_q4_0", "quantize_q8_1",   "dequantize_q8_1",
        "fp8_block_quant", "fp8_block_dequant"};
    for (std::string_view known : kOps) {
        if (op == known) return true;
    }
    return false;
}

tl::expected<bool, ToolError> run(int argc, char **argv) {
    if (argc < 4) {
        return tl::unexpected(ToolError{kExitUsage, fmt::format("expected OP IN OUT, found {} arguments", argc - 1)});
    }
    const std::string op = argv[1];
    if (!is_known_op(op)) return tl::unexpected(ToolError{kExitUsage, fmt::format("unknown OP '{}'", op)});
    const bool is_block = op == "fp8_block_quant" || op == "fp8_block_dequant";
    if (is_block && argc != 6) {
        return tl::unexpected(ToolError{kExitUsage, fmt::format("{} takes IN OUT ROWS COLS, found {} arguments", op,
                                                                argc - 2)});
    }
    if (!is_block && argc != 4) {
        return tl::unexpected(ToolError{kExitUsage, fmt::format("{} takes IN OUT, found {} arguments", op, argc - 2)});
    }
    int64_t rows = 0;
    int64_t cols = 0;
    if (is_block) {
        auto r = parse_dim(op, "ROWS", argv[4]);
        if (!r) return tl::unexpected(r.error());
        auto c = parse_dim(op, "COLS", argv[5]);
        if (!c) return tl::unexpected(c.error());
        rows = *r;
        cols = *c;
    }
    auto in = read_file(argv[2]);
    if (!in) return tl::unexpected(ToolError{kExitIo, in.error().message});
    auto out = is_block ? run_fp8_block(op, *in, rows, cols) : run_elementwise(op, *in);
    if (!out) return tl::unexpected(out.error());
    auto written = write_file(argv[3], *out);
    if (!written) return tl::unexpected(ToolError{kExitIo, written.error().message});
    return true;
}

}  // namespace

int main(int argc, char **argv) {
    auto result = run(argc, argv);
    if (!result) {
        std::fprintf(stderr, "memra_dtype_tool: %s\n", result.error().message.c_str());
        if (result.error().code == kExitUsage) std::fputs(kUsage.data(), stderr);
        return result.error().code;
    }
    return 0;
}
