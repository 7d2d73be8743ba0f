// CUDA matrix products in `device` numerics, and the layout of weights on the GPU. Weights stay in their
// checkpoint dtypes (F32, BF16, F16, F8_E4M3 with its block scales); an upload copies exactly the window a TP rank
// holds and records its absolute origin, so chunk cuts, fp8 scale tiles and canonical block numbers are those of
// the whole matrix. Products with bf16 activations (kBf16, BF16 weights) run on the tensor cores in the GPU's own
// canonical order (fixed 128-wide K chunks of m16n8k16 steps, chunk sums in K order, the canonical tree over
// blocks: ops_matmul.cu), within a measured tolerance of cpu::CpuBackend(..., Numerics::kDevice); so do grouped
// products with e4m3 activations (kE4m3x128) of the shapes real checkpoints have (128 x 128 scale tiles, K a
// multiple of 16 up to 8192): each activation row quantized once into an E4m3Scratch, then FP8 wgmma over
// 128-wide K chunks, each chunk's sum promoted with both scales in K order as the CPU's device loop does. Every
// other product runs the CPU's K loop for its ActRounding (backend/cpu/matmul.h) bit for bit: the exact loop
// (kNone) or the device loop with e4m3 groups of 128 (kE4m3x128), whose FTZ/DAZ arithmetic is that of
// core/device_numerics.h. Either way an element's bits depend on its x row, its W row and K only: never on the
// batch, the grid or which other rows run beside it. Launchers never allocate and never read device memory on
// the host.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "backend/cpu/matmul.h"
#include "core/dtype.h"
#include "core/fp8_block.h"

namespace memra::cuda {

using cpu::ActRounding;

// A matrix (or the window of one a TP rank holds) resident on the GPU. The held rows and K columns are
// dense; absolute positions come from the origins.
struct CudaMatrix {
    DType dtype = DType::kBF16;        // kF32, kBF16, kF16 or kF8E4M3, as in the checkpoint
    const void *data = nullptr;        // [rows, cols] dtype, row-major, dense: held row r, held column c
    int64_t rows = 0;                  // output rows held: absolute rows [row_begin, row_begin + rows)
    int64_t cols = 0;                  // K columns held: absolute K [k_begin, k_begin + cols)
    int64_t row_begin = 0;             // absolute row of held row 0 (a row window)
    int64_t k_begin = 0;               // absolute K of held column 0 (a K window: whole canonical blocks)
    int64_t full_rows = 0;             // rows of the whole matrix
    int64_t k_full = 0;                // K of the whole matrix
    int64_t block_rows = kFp8Block;    // fp8 scale tile height
    int64_t block_cols = kFp8Block;    // fp8 scale tile width; also the exact loop's chunk edge (every dtype)
    const float *scale_inv = nullptr;  // kF8E4M3 only: [scale_tile_rows, scale_tile_cols] f32, row-major: the
                                       // tiles covering the window, tile (i, j) = whole-matrix tile
                                       // (scale_row0 + i, scale_col0 + j)
    int64_t scale_row0 = 0;            // row_begin / block_rows
    int64_t scale_col0 = 0;            // k_begin / block_cols
    int64_t scale_tile_rows = 0;
    int64_t scale_tile_cols = 0;       // also the row stride of scale_inv
    ActRounding act = ActRounding::kNone;  // kBf16 for BF16 weights, else kNone (f32 activations: the
                                           // router's f32_activations, F32/F16/F8 matrices), as CpuBackend
};

// A stacked expert bank resident on the GPU, or the experts [first_expert, first_expert + n_experts) of one.
// Every held expert is whole (routed experts are never split by width).
struct CudaBank {
    DType dtype = DType::kBF16;
    const void *data = nullptr;        // [n_experts, rows, cols] dtype, dense: held expert 0 first
    int64_t n_experts = 0;             // experts held
    int64_t rows = 0;
    int64_t cols = 0;
    int64_t first_expert = 0;          // global index of held expert 0: the grouped product reads
                                       // offsets[first_expert .. first_expert + n_experts]
    int64_t block_rows = kFp8Block;
    int64_t block_cols = kFp8Block;
    const float *scale_inv = nullptr;  // kF8E4M3 only: [n_experts, ceil(rows / block_rows),
                                       // ceil(cols / block_cols)] f32, dense
    ActRounding act = ActRounding::kNone;  // kBf16 for BF16 banks; kE4m3x128 for F8_E4M3 banks with 128-wide
                                           // scale tiles; else kNone (exact loop), as CpuBackend
};

// ---- Products. x, y, offsets are device pointers; launchers return cudaErrorInvalidValue for arguments the
// CPU op would refuse (a MEMRA_CHECK there), else the launch status (cudaGetLastError). Only the tensor-core e4m3
// products need a scratch (E4m3Scratch); every other product rounds its activations inside the kernel (bf16 as
// read; each e4m3 group of 128 once per block of output rows, in shared memory). ----

// Device memory for the e4m3 codes and group scales of the activation rows a tensor-core e4m3 product quantizes:
// ceil(K / 128) * 128 code bytes and ceil(K / 128) scales per row. A product whose rows do not fit runs in slices
// of the rows that do (two launches per slice), so a scratch of kE4m3ScratchRows rows of K 8192 serves a step of
// that many (token, expert) rows in one slice.
struct E4m3Scratch {
    uint8_t *codes = nullptr;
    float *scales = nullptr;
    int64_t code_bytes = 0;
    int64_t scale_floats = 0;
};
constexpr int64_t kE4m3ScratchRows = 8192;
constexpr int64_t kE4m3ScratchCodeBytes = kE4m3ScratchRows * 8192;
constexpr int64_t kE4m3ScratchScaleFloats = kE4m3ScratchRows * 8192 / 128;

// cpu::matmul with w.act (CpuBackend::matmul): y[t, n] = dot(x[t], W[n]) by the canonical K loop over the
// whole K. w must hold every K column. x: [n_tokens, w.cols] f32; y: [n_tokens, w.rows] f32.
cudaError_t cuda_matmul(const CudaMatrix &w, const float *x, int64_t n_tokens, float *y, cudaStream_t stream);

// cuda_matmul(*w[i], x, n_tokens, y[i]) for i < n, bit for bit, as one launch: up to kMaxMultiParts BF16
// matrices (kBf16 activations) of one K, every K column held, any number of tokens (the kernel cuda_matmul would
// pick for the token count, its row blocks walking the matrices one after the other), so that a step makes the
// same launches at every batch size. cudaErrorNotSupported where they cannot be one launch (then nothing ran: the
// caller runs them one by one).
constexpr int kMaxMultiParts = 4;
cudaError_t cuda_matmul_multi(const CudaMatrix *const *w, float *const *y, int n, const float *x, int64_t n_tokens,
                              cudaStream_t stream);

// The canonical blocks w holds: [k_begin / B, (k_begin + cols) / B) with B = k_full / 8, all 8 for a whole
// matrix. False when k_full is not a multiple of 8 (no canonical blocks: the row-parallel product is refused).
bool cuda_canonical_blocks(const CudaMatrix &w, int64_t *block_begin, int64_t *block_end);

// cpu::matmul_canonical (CpuBackend::matmul_canonical): the partial of each canonical block w holds (the K loop
// over that block), reduced by the blocks' subtree of ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)): the TP = 1 product
// for a whole matrix, the rank's subtree sum for a K window (finished by canonical_combine). The partials live
// in registers, so CudaBackend::canonical_workspace_floats may return 0. Refused for kE4m3x128 (the CPU
// refuses it too). x: [n_tokens, w.cols] f32 (the held K columns); y: [n_tokens, w.rows] f32.
cudaError_t cuda_matmul_canonical(const CudaMatrix &w, const float *x, int64_t n_tokens, float *y,
                                  cudaStream_t stream);

// CpuBackend::matmul_grouped: with base = offsets[b.first_expert], the rows [offsets[e] - base,
// offsets[e + 1] - base) of x and y go through held expert e - b.first_expert by cpu::matmul (whole K), for
// every held e; rows from offsets[b.first_expert + b.n_experts] - base to n_rows are left untouched. The
// offsets are read on the device only (the grid covers all n_rows rows, or every expert's token tiles; each block
// finds its rows' expert), so the counts need no host read. scratch: for a tensor-core e4m3 bank (refused with
// cudaErrorInvalidValue when it holds not one row); other banks ignore it. x: [n_rows, b.cols] f32; offsets:
// [n_offsets] i32, n_offsets
// >= b.first_expert + b.n_experts + 1, non-decreasing over the held experts' entries; y: [n_rows, b.rows] f32.
cudaError_t cuda_matmul_grouped(const CudaBank &b, const float *x, int64_t n_rows, const int32_t *offsets,
                                int64_t n_offsets, float *y, const E4m3Scratch &scratch, cudaStream_t stream);
// The kernel launches cuda_matmul_grouped makes for n_rows rows (for the backend's launch count).
int64_t cuda_matmul_grouped_launches(const CudaBank &b, int64_t n_rows, const E4m3Scratch &scratch);

// cuda_matmul_grouped(a, x, .., y_a) and cuda_matmul_grouped(b, x, .., y_b) bit for bit (the routed experts' gate
// and up): for tensor-core e4m3 banks of one shape over the same experts, x is quantized once and both banks' row
// tiles run in one launch; other banks run one after the other.
cudaError_t cuda_matmul_grouped_pair(const CudaBank &a, const CudaBank &b, const float *x, int64_t n_rows,
                                     const int32_t *offsets, int64_t n_offsets, float *y_a, float *y_b,
                                     const E4m3Scratch &scratch, cudaStream_t stream);
int64_t cuda_matmul_grouped_pair_launches(const CudaBank &a, const CudaBank &b, int64_t n_rows,
                                          const E4m3Scratch &scratch);

// cuda::swiglu(gate, up, .., limit, gate) (the activation written into gate), then cuda_matmul_grouped(b, gate, ..)
// bit for bit (the routed experts' down product): for a tensor-core e4m3 bank the activation is formed, stored and
// quantized by the product's quantization launch, with no launch of its own. gate, up: [n_rows, b.cols] f32.
cudaError_t cuda_matmul_grouped_swiglu(const CudaBank &b, float *gate, const float *up, float limit, int64_t n_rows,
                                       const int32_t *offsets, int64_t n_offsets, float *y, const E4m3Scratch &scratch,
                                       cudaStream_t stream);
int64_t cuda_matmul_grouped_swiglu_launches(const CudaBank &b, int64_t n_rows, const E4m3Scratch &scratch);

}  // namespace memra::cuda

// ---------------------------------------------------------------------------------------------
// Uploads (prepare time): the caller reserves cuda_*_bytes() device bytes, then uploads into them. Host code
// only, defined inline here: it reports errors through Result (fmt), whose compile-time format checks nvcc
// cannot compile (nor those of core/tensor.h, which backend.h brings), so .cu files see none of it.
#if !defined(__CUDACC__)

#include "backend/backend.h"
#include "backend/op_checks.h"
#include "core/result.h"

namespace memra::cuda {

// Whether `win` of `m` can be uploaded: op_checks::matrix_upload, the refusals every backend makes, as "cuda upload".
inline Result<void> check_cuda_matrix(const HostMatrix &m, const MatrixWindow &win);
// Device bytes upload_cuda_matrix writes for `win` of `m` (the window's elements, then its scale tiles at a
// 256-byte boundary); 0 when check_cuda_matrix refuses the window.
inline int64_t cuda_matrix_bytes(const HostMatrix &m, const MatrixWindow &win);
// Copies the window of m (host memory, pageable or pinned) to device_dst (cuda_matrix_bytes(m, win) bytes,
// 16-byte aligned) on `stream` and waits for the copy, so the host memory may go away on return. The
// ActRounding is CpuBackend's in device numerics. Refused: what check_cuda_matrix refuses, a null or
// misaligned device_dst, a failing copy (with CUDA's message).
inline Result<CudaMatrix> upload_cuda_matrix(const HostMatrix &m, const MatrixWindow &win, void *device_dst,
                                             cudaStream_t stream);

// The bank versions (op_checks::bank_upload). Layout: the held experts' elements, then (fp8) their scale grids at
// a 256-byte boundary.
inline Result<void> check_cuda_bank(const HostBank &b, const BankWindow &win);
inline int64_t cuda_bank_bytes(const HostBank &b, const BankWindow &win);
inline Result<CudaBank> upload_cuda_bank(const HostBank &b, const BankWindow &win, void *device_dst,
                                         cudaStream_t stream);

namespace upload_detail {

inline constexpr int64_t kDataAlign = 256;  // the scale tiles start at this boundary after the elements

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t elem_size(DType t) { return static_cast<int64_t>(dtype_size(t)); }
// Where a matrix window's elements and scale tiles go.
struct MatrixLayout {
    int64_t rows = 0;  // held
    int64_t cols = 0;
    int64_t data_bytes = 0;
    int64_t tile_r0 = 0;  // whole-matrix scale tiles [tile_r0, tile_r1) x [tile_c0, tile_c1)
    int64_t tile_r1 = 0;
    int64_t tile_c0 = 0;
    int64_t tile_c1 = 0;
    int64_t host_tile_cols = 0;  // row stride of the host scale grid
    int64_t scale_offset = 0;    // bytes from the start of the upload
    int64_t total_bytes = 0;
};

inline MatrixLayout matrix_layout(const HostMatrix &m, const MatrixWindow &win) {
    MatrixLayout l;
    l.rows = win.row_end - win.row_begin;
    l.cols = win.col_end - win.col_begin;
    l.data_bytes = l.rows * l.cols * elem_size(m.dtype);
    l.total_bytes = l.data_bytes;
    if (m.dtype == DType::kF8E4M3) {
        l.tile_r0 = win.row_begin / m.block_rows;
        l.tile_r1 = ceil_div(win.row_end, m.block_rows);
        l.tile_c0 = win.col_begin / m.block_cols;
        l.tile_c1 = ceil_div(win.col_end, m.block_cols);
        l.host_tile_cols = ceil_div(m.cols, m.block_cols);
        l.scale_offset = ceil_div(l.data_bytes, kDataAlign) * kDataAlign;
        l.total_bytes = l.scale_offset + (l.tile_r1 - l.tile_r0) * (l.tile_c1 - l.tile_c0) * 4;
    }
    return l;
}

struct BankLayout {
    int64_t n_experts = 0;      // held
    int64_t expert_bytes = 0;
    int64_t expert_scales = 0;  // scale floats per expert
    int64_t scale_offset = 0;   // bytes from the start of the upload
    int64_t total_bytes = 0;
};

inline BankLayout bank_layout(const HostBank &b, const BankWindow &win) {
    BankLayout l;
    l.n_experts = win.expert_end - win.expert_begin;
    l.expert_bytes = b.rows * b.cols * elem_size(b.dtype);
    l.total_bytes = l.n_experts * l.expert_bytes;
    if (b.dtype == DType::kF8E4M3) {
        l.expert_scales = ceil_div(b.rows, b.block_rows) * ceil_div(b.cols, b.block_cols);
        l.scale_offset = ceil_div(l.total_bytes, kDataAlign) * kDataAlign;
        l.total_bytes = l.scale_offset + l.n_experts * l.expert_scales * 4;
    }
    return l;
}

inline Result<void> check_destination(void *device_dst) {
    if (device_dst == nullptr || reinterpret_cast<uintptr_t>(device_dst) % 16 != 0) {
        return make_error("cuda upload: the destination {} is not a 16-byte aligned device pointer", device_dst);
    }
    return {};
}

// Waits for an upload's copies: the first failure among them, or the stream's (then clears CUDA's last error so
// that no unrelated call reports it).
inline cudaError_t finish_copies(cudaError_t first, cudaStream_t stream) {
    const cudaError_t sync = cudaStreamSynchronize(stream);
    const cudaError_t err = first != cudaSuccess ? first : sync;
    if (err != cudaSuccess) (void)cudaGetLastError();
    return err;
}

}  // namespace upload_detail

inline Result<void> check_cuda_matrix(const HostMatrix &m, const MatrixWindow &win) {
    return op_checks::matrix_upload("cuda upload", m, win);
}

inline int64_t cuda_matrix_bytes(const HostMatrix &m, const MatrixWindow &win) {
    if (!check_cuda_matrix(m, win)) return 0;
    return upload_detail::matrix_layout(m, win).total_bytes;
}

inline Result<CudaMatrix> upload_cuda_matrix(const HostMatrix &m, const MatrixWindow &win, void *device_dst,
                                             cudaStream_t stream) {
    using namespace upload_detail;
    if (auto ok = check_cuda_matrix(m, win); !ok) return tl::unexpected(ok.error());
    if (auto ok = check_destination(device_dst); !ok) return tl::unexpected(ok.error());
    const MatrixLayout l = matrix_layout(m, win);
    const int64_t es = elem_size(m.dtype);
    auto *dst = static_cast<uint8_t *>(device_dst);
    const auto *src = static_cast<const uint8_t *>(m.data) + (win.row_begin * m.cols + win.col_begin) * es;
    cudaError_t err = cudaSuccess;
    if (l.cols == m.cols) {  // whole rows: one contiguous copy
        err = cudaMemcpyAsync(dst, src, static_cast<size_t>(l.data_bytes), cudaMemcpyHostToDevice, stream);
    } else {
        err = cudaMemcpy2DAsync(dst, static_cast<size_t>(l.cols * es), src, static_cast<size_t>(m.cols * es),
                                static_cast<size_t>(l.cols * es), static_cast<size_t>(l.rows), cudaMemcpyHostToDevice,
                                stream);
    }
    CudaMatrix w;
    w.dtype = m.dtype;
    w.data = dst;
    w.rows = l.rows;
    w.cols = l.cols;
    w.row_begin = win.row_begin;
    w.k_begin = win.col_begin;
    w.full_rows = m.rows;
    w.k_full = m.cols;
    w.block_rows = m.block_rows;
    w.block_cols = m.block_cols;
    w.act = m.dtype == DType::kBF16 && !m.f32_activations ? ActRounding::kBf16 : ActRounding::kNone;
    if (m.dtype == DType::kF8E4M3) {
        const int64_t tile_cols = l.tile_c1 - l.tile_c0;
        auto *scale_dst = reinterpret_cast<float *>(dst + l.scale_offset);
        const float *scale_src = m.scale_inv + l.tile_r0 * l.host_tile_cols + l.tile_c0;
        if (err == cudaSuccess) {
            err = cudaMemcpy2DAsync(scale_dst, static_cast<size_t>(tile_cols * 4), scale_src,
                                    static_cast<size_t>(l.host_tile_cols * 4), static_cast<size_t>(tile_cols * 4),
                                    static_cast<size_t>(l.tile_r1 - l.tile_r0), cudaMemcpyHostToDevice, stream);
        }
        w.scale_inv = scale_dst;
        w.scale_row0 = l.tile_r0;
        w.scale_col0 = l.tile_c0;
        w.scale_tile_rows = l.tile_r1 - l.tile_r0;
        w.scale_tile_cols = tile_cols;
    }
    if (err = finish_copies(err, stream); err != cudaSuccess) {
        return make_error("cuda upload: copying matrix [{}, {}] window rows [{}, {}) columns [{}, {}) to the device "
                          "failed: {}",
                          m.rows, m.cols, win.row_begin, win.row_end, win.col_begin, win.col_end,
                          cudaGetErrorString(err));
    }
    return w;
}

inline Result<void> check_cuda_bank(const HostBank &b, const BankWindow &win) {
    return op_checks::bank_upload("cuda upload", b, win);
}

inline int64_t cuda_bank_bytes(const HostBank &b, const BankWindow &win) {
    if (!check_cuda_bank(b, win)) return 0;
    return upload_detail::bank_layout(b, win).total_bytes;
}

inline Result<CudaBank> upload_cuda_bank(const HostBank &b, const BankWindow &win, void *device_dst,
                                         cudaStream_t stream) {
    using namespace upload_detail;
    if (auto ok = check_cuda_bank(b, win); !ok) return tl::unexpected(ok.error());
    if (auto ok = check_destination(device_dst); !ok) return tl::unexpected(ok.error());
    const BankLayout l = bank_layout(b, win);
    auto *dst = static_cast<uint8_t *>(device_dst);
    const auto *src = static_cast<const uint8_t *>(b.data) + win.expert_begin * l.expert_bytes;
    cudaError_t err = cudaMemcpyAsync(dst, src, static_cast<size_t>(l.n_experts * l.expert_bytes),
                                      cudaMemcpyHostToDevice, stream);
    CudaBank w;
    w.dtype = b.dtype;
    w.data = dst;
    w.n_experts = l.n_experts;
    w.rows = b.rows;
    w.cols = b.cols;
    w.first_expert = win.expert_begin;
    w.block_rows = b.block_rows;
    w.block_cols = b.block_cols;
    if (b.dtype == DType::kBF16) w.act = ActRounding::kBf16;
    if (b.dtype == DType::kF8E4M3 && b.block_cols == cpu::kE4m3Group) w.act = ActRounding::kE4m3x128;
    if (b.dtype == DType::kF8E4M3) {
        auto *scale_dst = reinterpret_cast<float *>(dst + l.scale_offset);
        if (err == cudaSuccess) {
            err = cudaMemcpyAsync(scale_dst, b.scale_inv + win.expert_begin * l.expert_scales,
                                  static_cast<size_t>(l.n_experts * l.expert_scales * 4), cudaMemcpyHostToDevice,
                                  stream);
        }
        w.scale_inv = scale_dst;
    }
    if (err = finish_copies(err, stream); err != cudaSuccess) {
        return make_error("cuda upload: copying expert bank [{}, {}, {}] experts [{}, {}) to the device failed: {}",
                          b.n_experts, b.rows, b.cols, win.expert_begin, win.expert_end, cudaGetErrorString(err));
    }
    return w;
}

}  // namespace memra::cuda

#endif  // !defined(__CUDACC__)
