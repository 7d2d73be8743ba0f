// KV cache row formats: how one token's K or V row of one layer ([n_kv_heads, head_dim] f32 values) is
// stored. f32 and bf16 keep each value; q8_0 and q5_1 keep GGML blocks of 32 values along head_dim
// (core/quant_blocks.h), so a row's bytes depend only on that row's values. That is what makes staging,
// partial commit, rollback and (later) page sharing exact at row granularity (DETERMINISM.md D7).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/result.h"

namespace memra {

enum class KvFormat {
    kF32,   // 4 bytes per value, the input bits
    kBf16,  // 2 bytes per value, f32_to_bf16 (round to nearest even)
    kQ8_0,  // 34 bytes per 32 values: fp16 scale + 32 int8 codes
    kQ5_1,  // 24 bytes per 32 values: fp16 scale, fp16 minimum, 32 5-bit codes
};

// "f32", "bf16", "q8_0", "q5_1"; anything else is refused with the list of valid names.
Result<KvFormat> parse_kv_format(std::string_view name);
const char *kv_format_name(KvFormat format);

// True for the block formats, whose rows need head_dim % kQuantBlock == 0.
bool kv_format_is_block(KvFormat format);

// Bytes of one row of n_kv_heads * head_dim values. Refuses non-positive sizes and, for q8_0 / q5_1,
// a head_dim that is not a multiple of 32 (a block must never straddle two heads).
Result<int64_t> kv_row_bytes(KvFormat format, int n_kv_heads, int head_dim);

// Encode / decode n values (one or more whole rows; n % 32 == 0 for the block formats, a checked
// invariant). Bytes: `out` / `in` hold the format's bytes for n values, in GGML block order. Neither
// allocates; decoding is exact for f32 and bf16 and is GGML's dequantization for the block formats.
void kv_encode(KvFormat format, const float *x, int64_t n, std::byte *out);
void kv_decode(KvFormat format, const std::byte *in, int64_t n, float *y);

}  // namespace memra
