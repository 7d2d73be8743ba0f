// Device twins of core's number-format conversions (core/float_formats.h, core/fp8_block.h,
// core/quant_blocks.h): each kernel calls the same MEMRA_HD scalar function as the host, so the GPU
// result equals the CPU one bit for bit. Launchers take raw device pointers, element counts and a
// stream; they return the launch status (cudaErrorInvalidValue for a bad count or a null pointer).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/float_formats.h"
#include "core/quant_blocks.h"

namespace memra {

// Number of visible CUDA devices; 0 when there is no GPU or no usable driver (never aborts).
int cuda_device_count();

// Element-wise conversions over n elements: in [n] -> out [n].
cudaError_t cuda_bf16_to_f32(const uint16_t *in, float *out, int64_t n, cudaStream_t stream);
cudaError_t cuda_f32_to_bf16(const float *in, uint16_t *out, int64_t n, cudaStream_t stream);
cudaError_t cuda_f16_to_f32(const uint16_t *in, float *out, int64_t n, cudaStream_t stream);
cudaError_t cuda_f32_to_f16(const float *in, uint16_t *out, int64_t n, cudaStream_t stream);
cudaError_t cuda_fp8_e4m3_to_f32(const uint8_t *in, float *out, int64_t n, cudaStream_t stream);
cudaError_t cuda_f32_to_fp8_e4m3(const float *in, uint8_t *out, int64_t n, Fp8Saturation saturation,
                                 cudaStream_t stream);

// FP8 128x128 block dequantization (core/fp8_block.h): q [rows, cols] e4m3fn,
// scale_inv [ceil(rows/128), ceil(cols/128)] f32 -> out [rows, cols] f32.
cudaError_t cuda_dequantize_fp8_block(const uint8_t *q, int64_t rows, int64_t cols, const float *scale_inv,
                                      float *out, cudaStream_t stream);

// GGML block dequantization: x [n / 32] blocks -> y [n] f32; n must be a multiple of 32.
cudaError_t cuda_dequantize_q8_0(const BlockQ8_0 *x, float *y, int64_t n, cudaStream_t stream);
cudaError_t cuda_dequantize_q5_1(const BlockQ5_1 *x, float *y, int64_t n, cudaStream_t stream);

}  // namespace memra
