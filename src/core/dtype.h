// Element types memra stores or reads, with their safetensors names and sizes. The exact
// conversions between them live in core/float_formats.h and core/quant_blocks.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace memra {

enum class DType : uint8_t {
    kF64,
    kF32,
    kF16,
    kBF16,
    kF8E4M3,  // float8_e4m3fn: no infinities, one NaN pattern per sign (S.1111.111)
    kF8E5M2,
    kI64,
    kI32,
    kI16,
    kI8,
    kU64,
    kU32,
    kU16,
    kU8,
    kBool,
};

inline constexpr DType kAllDTypes[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3,
                                       DType::kF8E5M2, DType::kI64, DType::kI32, DType::kI16, DType::kI8,
                                       DType::kU64, DType::kU32, DType::kU16, DType::kU8, DType::kBool};

// Bytes per element.
size_t dtype_size(DType t);
// The safetensors header spelling ("F32", "BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType t);
// Inverse of dtype_name; nullopt for a name memra does not know.
std::optional<DType> dtype_from_name(std::string_view name);

}  // namespace memra
