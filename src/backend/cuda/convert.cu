// Conversion kernels: one thread per output element in a grid-stride loop, each calling the shared
// MEMRA_HD scalar function, so there is no device-only arithmetic to drift from the host reference.
#include "backend/cuda/convert.h"

#include <cuda_runtime.h>

#include "core/fp8_block.h"

namespace memra {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;  // the grid-stride loop covers anything larger

int64_t grid_for(int64_t n) {
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    return blocks < kMaxBlocks ? blocks : kMaxBlocks;
}

__device__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

__device__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__global__ void bf16_to_f32_kernel(const uint16_t *in, float *out, int64_t n) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = bf16_to_f32(in[i]);
}

__global__ void f32_to_bf16_kernel(const float *in, uint16_t *out, int64_t n) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = f32_to_bf16(in[i]);
}

__global__ void f16_to_f32_kernel(const uint16_t *in, float *out, int64_t n) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = f16_to_f32(in[i]);
}

__global__ void f32_to_f16_kernel(const float *in, uint16_t *out, int64_t n) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = f32_to_f16(in[i]);
}

__global__ void fp8_e4m3_to_f32_kernel(const uint8_t *in, float *out, int64_t n) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = fp8_e4m3_to_f32(in[i]);
}

__global__ void f32_to_fp8_e4m3_kernel(const float *in, uint8_t *out, int64_t n, Fp8Saturation saturation) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) out[i] = f32_to_fp8_e4m3(in[i], saturation);
}

// gq: [rows, cols] e4m3fn; gscale_inv: [ceil(rows/128), ceil(cols/128)] f32; gout: [rows, cols] f32.
__global__ void dequantize_fp8_block_kernel(const uint8_t *gq, int64_t rows, int64_t cols,
                                            const float *gscale_inv, float *gout) {
    const int64_t scale_cols = fp8_scale_blocks(cols);
    const int64_t n = rows * cols;
    for (int64_t i = first_index(); i < n; i += grid_stride()) {
        const int64_t r = i / cols;
        const int64_t c = i - r * cols;
        gout[i] = fp8_block_dequant_one(gq[i], gscale_inv[(r / kFp8Block) * scale_cols + c / kFp8Block]);
    }
}

__global__ void dequantize_q8_0_kernel(const BlockQ8_0 *gx, float *gy, int64_t n) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) {
        gy[i] = q8_0_dequant_one(gx[i / kQuantBlock], static_cast<int>(i % kQuantBlock));
    }
}

__global__ void dequantize_q5_1_kernel(const BlockQ5_1 *gx, float *gy, int64_t n) {
    for (int64_t i = first_index(); i < n; i += grid_stride()) {
        gy[i] = q5_1_dequant_one(gx[i / kQuantBlock], static_cast<int>(i % kQuantBlock));
    }
}

// Argument check shared by the launchers: a negative count, or a null pointer with work to do.
bool bad_args(int64_t n, const void *in, const void *out) {
    return n < 0 || (n > 0 && (in == nullptr || out == nullptr));
}

// The launch status: a launch error, or (with nothing pending) success.
cudaError_t launch_status() { return cudaGetLastError(); }

}  // namespace

int cuda_device_count() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();  // clear the error so later calls do not report it
        return 0;
    }
    return count;
}

cudaError_t cuda_bf16_to_f32(const uint16_t *in, float *out, int64_t n, cudaStream_t stream) {
    if (bad_args(n, in, out)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    bf16_to_f32_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(in, out, n);
    return launch_status();
}

cudaError_t cuda_f32_to_bf16(const float *in, uint16_t *out, int64_t n, cudaStream_t stream) {
    if (bad_args(n, in, out)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    f32_to_bf16_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(in, out, n);
    return launch_status();
}

cudaError_t cuda_f16_to_f32(const uint16_t *in, float *out, int64_t n, cudaStream_t stream) {
    if (bad_args(n, in, out)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    f16_to_f32_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(in, out, n);
    return launch_status();
}

cudaError_t cuda_f32_to_f16(const float *in, uint16_t *out, int64_t n, cudaStream_t stream) {
    if (bad_args(n, in, out)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    f32_to_f16_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(in, out, n);
    return launch_status();
}

cudaError_t cuda_fp8_e4m3_to_f32(const uint8_t *in, float *out, int64_t n, cudaStream_t stream) {
    if (bad_args(n, in, out)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    fp8_e4m3_to_f32_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(in, out, n);
    return launch_status();
}

cudaError_t cuda_f32_to_fp8_e4m3(const float *in, uint8_t *out, int64_t n, Fp8Saturation saturation,
                                 cudaStream_t stream) {
    if (bad_args(n, in, out)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    f32_to_fp8_e4m3_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(in, out, n, saturation);
    return launch_status();
}

cudaError_t cuda_dequantize_fp8_block(const uint8_t *q, int64_t rows, int64_t cols, const float *scale_inv,
                                      float *out, cudaStream_t stream) {
    if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
    const int64_t n = rows * cols;
    if (bad_args(n, q, out) || (n > 0 && scale_inv == nullptr)) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    dequantize_fp8_block_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(q, rows, cols,
                                                                                             scale_inv, out);
    return launch_status();
}

cudaError_t cuda_dequantize_q8_0(const BlockQ8_0 *x, float *y, int64_t n, cudaStream_t stream) {
    if (bad_args(n, x, y) || n % kQuantBlock != 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    dequantize_q8_0_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(x, y, n);
    return launch_status();
}

cudaError_t cuda_dequantize_q5_1(const BlockQ5_1 *x, float *y, int64_t n, cudaStream_t stream) {
    if (bad_args(n, x, y) || n % kQuantBlock != 0) return cudaErrorInvalidValue;
    if (n == 0) return cudaSuccess;
    dequantize_q5_1_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(x, y, n);
    return launch_status();
}

}  // namespace memra
