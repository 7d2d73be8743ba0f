// KV row formats: name parsing, byte sizes, and row encode/decode on top of core's exact conversions
// (float_formats.h) and GGML block quantizers (quant_blocks.h). Blocks are copied through a local
// struct with memcpy, so cache storage needs no alignment beyond bytes.
#include "core/kv_format.h"

#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "core/float_formats.h"
#include "core/quant_blocks.h"

namespace memra {

namespace {

// Bytes per kQuantBlock values.
int64_t bytes_per_block(KvFormat format) {
    switch (format) {
        case KvFormat::kF32: return 4 * kQuantBlock;
        case KvFormat::kBf16: return 2 * kQuantBlock;
        case KvFormat::kQ8_0: return static_cast<int64_t>(sizeof(BlockQ8_0));
        case KvFormat::kQ5_1: return static_cast<int64_t>(sizeof(BlockQ5_1));
    }
    MEMRA_CHECK(false, "unknown KvFormat {}", static_cast<int>(format));
    return 0;
}

void check_count(KvFormat format, int64_t n) {
    MEMRA_CHECK(n >= 0 && (!kv_format_is_block(format) || n % kQuantBlock == 0),
                "kv {}: value count must be non-negative and a multiple of {} for block formats, got {}",
                kv_format_name(format), kQuantBlock, n);
}

}  // namespace

Result<KvFormat> parse_kv_format(std::string_view name) {
    if (name == "f32") return KvFormat::kF32;
    if (name == "bf16") return KvFormat::kBf16;
    if (name == "q8_0") return KvFormat::kQ8_0;
    if (name == "q5_1") return KvFormat::kQ5_1;
    return make_error("KV cache format '{}': expected one of f32, bf16, q8_0, q5_1", name);
}

const char *kv_format_name(KvFormat format) {
    switch (format) {
        case KvFormat::kF32: return "f32";
        case KvFormat::kBf16: return "bf16";
        case KvFormat::kQ8_0: return "q8_0";
        case KvFormat::kQ5_1: return "q5_1";
    }
    MEMRA_CHECK(false, "unknown KvFormat {}", static_cast<int>(format));
    return "";
}

bool kv_format_is_block(KvFormat format) { return format == KvFormat::kQ8_0 || format == KvFormat::kQ5_1; }

Result<int64_t> kv_row_bytes(KvFormat format, int n_kv_heads, int head_dim) {
    if (n_kv_heads <= 0 || head_dim <= 0) {
        return make_error("KV row ({}): expected n_kv_heads > 0 and head_dim > 0, found n_kv_heads {} head_dim {}",
                          kv_format_name(format), n_kv_heads, head_dim);
    }
    if (kv_format_is_block(format) && head_dim % kQuantBlock != 0) {
        return make_error("KV row ({}): head_dim must be a multiple of {} so blocks stay inside one head, found {}",
                          kv_format_name(format), kQuantBlock, head_dim);
    }
    const int64_t values = static_cast<int64_t>(n_kv_heads) * head_dim;
    if (values > INT64_MAX / 4) {
        return make_error("KV row ({}): n_kv_heads {} x head_dim {} values overflow a byte count",
                          kv_format_name(format), n_kv_heads, head_dim);
    }
    switch (format) {
        case KvFormat::kF32: return values * 4;
        case KvFormat::kBf16: return values * 2;
        case KvFormat::kQ8_0:
        case KvFormat::kQ5_1: return values / kQuantBlock * bytes_per_block(format);
    }
    MEMRA_CHECK(false, "unknown KvFormat {}", static_cast<int>(format));
    return 0;
}

void kv_encode(KvFormat format, const float *x, int64_t n, std::byte *out) {
    check_count(format, n);
    switch (format) {
        case KvFormat::kF32:
            std::memcpy(out, x, static_cast<size_t>(n) * sizeof(float));
            return;
        case KvFormat::kBf16:
            for (int64_t i = 0; i < n; ++i) {
                const uint16_t h = f32_to_bf16(x[i]);
                std::memcpy(out + 2 * i, &h, sizeof(h));
            }
            return;
        case KvFormat::kQ8_0:
            for (int64_t b = 0; b < n / kQuantBlock; ++b) {
                BlockQ8_0 block;
                quantize_row_q8_0(x + b * kQuantBlock, &block, kQuantBlock);
                std::memcpy(out + b * static_cast<int64_t>(sizeof(block)), &block, sizeof(block));
            }
            return;
        case KvFormat::kQ5_1:
            for (int64_t b = 0; b < n / kQuantBlock; ++b) {
                BlockQ5_1 block;
                quantize_row_q5_1(x + b * kQuantBlock, &block, kQuantBlock);
                std::memcpy(out + b * static_cast<int64_t>(sizeof(block)), &block, sizeof(block));
            }
            return;
    }
    MEMRA_CHECK(false, "unknown KvFormat {}", static_cast<int>(format));
}

void kv_decode(KvFormat format, const std::byte *in, int64_t n, float *y) {
    check_count(format, n);
    switch (format) {
        case KvFormat::kF32:
            std::memcpy(y, in, static_cast<size_t>(n) * sizeof(float));
            return;
        case KvFormat::kBf16:
            for (int64_t i = 0; i < n; ++i) {
                uint16_t h;
                std::memcpy(&h, in + 2 * i, sizeof(h));
                y[i] = bf16_to_f32(h);
            }
            return;
        case KvFormat::kQ8_0:
            for (int64_t b = 0; b < n / kQuantBlock; ++b) {
                BlockQ8_0 block;
                std::memcpy(&block, in + b * static_cast<int64_t>(sizeof(block)), sizeof(block));
                q8_0_dequant_block(block, y + b * kQuantBlock);
            }
            return;
        case KvFormat::kQ5_1:
            for (int64_t b = 0; b < n / kQuantBlock; ++b) {
                BlockQ5_1 block;
                std::memcpy(&block, in + b * static_cast<int64_t>(sizeof(block)), sizeof(block));
                q5_1_dequant_block(block, y + b * kQuantBlock);
            }
            return;
    }
    MEMRA_CHECK(false, "unknown KvFormat {}", static_cast<int>(format));
}

}  // namespace memra
