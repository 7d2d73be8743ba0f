// backend/cuda/ops_matmul: the GPU products against CpuBackend in device numerics on the same weights and
// activations, compared as raw bits (a NaN result compares as NaN only: x86 propagates an operand's payload,
// the GPU returns 0x7fffffff), except the tensor-core products: bf16 weights with bf16 activations, and F8 banks
// with e4m3 activations in 128 x 128 tiles (wgmma). Those run in the GPU's own order, held to a tolerance against
// the CPU (close_to_cpu; e4m3: bit for bit where exact arithmetic leaves no room) and to bits against themselves
// (rows of a batch, TP windows, experts grouped or alone, slices of the e4m3 scratch). Every weight dtype with
// every ActRounding the CPU gives it (bf16 weights: bf16 activations, or f32 ones for the router; F32 / F16 / F8
// matrices: the exact loop; F8 banks with 128-wide tiles: e4m3 groups of 128), fp8 tiles of 128 x 128 and of odd
// sizes with partial last tiles, row windows, K windows at TP 2, 4 and 8, grouped products with empty experts and
// uneven offsets, batch sizes 1..140 (a row's bits never depend on its batch), adversarial values where FTZ/DAZ
// and saturation decide the bits (checked against every instruction path of this CPU), and perturbations that
// show the comparison can fail. MatmulUpload.* runs without a GPU: the upload refusals, word for word those of the
// CPU backend, and the launchers' refusals.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/matmul.h"
#include "backend/cuda/ops_matmul.h"
#include "backend/cuda/ops_rows.h"
#include "core/device_numerics.h"
#include "core/float_formats.h"
#include "core/fp8_block.h"
#include "cuda/cuda_test_util.h"

namespace memra {
namespace {

using cuda::CudaBank;
using cuda::CudaMatrix;
using Floats = std::vector<float>;

size_t sz(int64_t n) { return static_cast<size_t>(n); }
uint32_t bits(float f) { return f32_as_u32(f); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Elements whose bits differ (two NaNs match); `first` describes the first such element.
int64_t mismatches(const Floats &got, const Floats &want, std::string *first = nullptr) {
    if (got.size() != want.size()) return -1;
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (bits(got[i]) == bits(want[i]) || (std::isnan(got[i]) && std::isnan(want[i]))) continue;
        if (bad++ == 0 && first != nullptr) {
            *first = "index " + std::to_string(i) + ": got " + std::to_string(got[i]) + " (bits " +
                     std::to_string(bits(got[i])) + "), want " + std::to_string(want[i]) + " (bits " +
                     std::to_string(bits(want[i])) + ")";
        }
    }
    return bad;
}

#define EXPECT_SAME_BITS(got, want, what)                                       \
    do {                                                                        \
        std::string first_;                                                     \
        EXPECT_EQ(mismatches((got), (want), &first_), 0) << (what) << ": " << first_; \
    } while (0)

// ---------------------------------------------------------------------------------------------
// Weights and activations.

// A matrix or bank as host memory: [n_experts, rows, cols] elements, fp8 scale grids per expert.
struct Weights {
    DType dtype = DType::kBF16;
    int64_t n_experts = 1;
    int64_t rows = 0;
    int64_t cols = 0;
    int64_t block_rows = kFp8Block;
    int64_t block_cols = kFp8Block;
    bool f32_activations = false;
    std::vector<uint8_t> bytes;
    Floats scales;  // fp8: [n_experts, ceil(rows / block_rows), ceil(cols / block_cols)]

    int64_t tiles() const { return ceil_div(rows, block_rows) * ceil_div(cols, block_cols); }
    int64_t elem() const { return static_cast<int64_t>(dtype_size(dtype)); }
    HostMatrix matrix() const {
        return HostMatrix{.dtype = dtype,
                          .data = bytes.data(),
                          .rows = rows,
                          .cols = cols,
                          .scale_inv = dtype == DType::kF8E4M3 ? scales.data() : nullptr,
                          .block_rows = block_rows,
                          .block_cols = block_cols,
                          .f32_activations = f32_activations};
    }
    HostBank bank() const {
        return HostBank{.dtype = dtype,
                        .data = bytes.data(),
                        .n_experts = n_experts,
                        .rows = rows,
                        .cols = cols,
                        .scale_inv = dtype == DType::kF8E4M3 ? scales.data() : nullptr,
                        .block_rows = block_rows,
                        .block_cols = block_cols};
    }
    // Stores v as element i (the dtype's rounding; fp8: v is an e4m3 value to encode).
    void set(int64_t i, float v) {
        switch (dtype) {
            case DType::kF32: std::memcpy(&bytes[sz(i * 4)], &v, 4); break;
            case DType::kBF16: {
                const uint16_t h = f32_to_bf16(v);
                std::memcpy(&bytes[sz(i * 2)], &h, 2);
                break;
            }
            case DType::kF16: {
                const uint16_t h = f32_to_f16(v);
                std::memcpy(&bytes[sz(i * 2)], &h, 2);
                break;
            }
            default: bytes[sz(i)] = f32_to_fp8_e4m3(v, Fp8Saturation::kSaturate); break;
        }
    }
};

// A value over a few binades; `tiny` sends a quarter of them far down (float denormals, bf16 denormals, values
// whose products underflow).
float weight_value(std::mt19937 &rng, bool tiny) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    float v = std::ldexp(dist(rng), -static_cast<int>(rng() % 6));
    if (tiny && rng() % 4 == 0) v = std::ldexp(v, -118 - static_cast<int>(rng() % 20));
    return v;
}

Weights make_weights(DType dtype, int64_t n_experts, int64_t rows, int64_t cols, uint32_t seed, bool tiny = false,
                     int64_t block_rows = kFp8Block, int64_t block_cols = kFp8Block) {
    Weights w;
    w.dtype = dtype;
    w.n_experts = n_experts;
    w.rows = rows;
    w.cols = cols;
    w.block_rows = block_rows;
    w.block_cols = block_cols;
    const int64_t n = n_experts * rows * cols;
    w.bytes.assign(sz(n * w.elem()), 0);
    std::mt19937 rng(seed);
    for (int64_t i = 0; i < n; ++i) {
        if (dtype == DType::kF8E4M3) {
            // Any code but NaN: magnitudes from the subnormal 2^-9 to 448, both signs, zeros.
            uint8_t c = static_cast<uint8_t>(rng() & 0xffu);
            if ((c & 0x7fu) == 0x7fu) c = static_cast<uint8_t>(c - 1u);
            w.bytes[sz(i)] = c;
        } else {
            w.set(i, weight_value(rng, tiny));
        }
    }
    if (dtype == DType::kF8E4M3) {
        std::uniform_real_distribution<float> unit(1.0f, 2.0f);
        w.scales.resize(sz(n_experts * w.tiles()));
        for (float &s : w.scales) {
            s = std::ldexp(unit(rng), -8 - static_cast<int>(rng() % 4));
            if (tiny && rng() % 3 == 0) s = std::ldexp(s, -115 - static_cast<int>(rng() % 12));  // some denormal
        }
    }
    return w;
}

// Activations uniform in [-2, 2); `tiny` sends a third of them to 2^-120 .. 2^-131 (denormals among them).
Floats activations(int64_t n, int64_t k, uint32_t seed, bool tiny = false) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
    Floats x(sz(n * k));
    for (float &v : x) {
        v = dist(rng);
        if (tiny && rng() % 3 == 0) v = std::ldexp(v, -120 - static_cast<int>(rng() % 12));
    }
    return x;
}

// Columns [k0, k1) of x [n, k].
Floats columns(const Floats &x, int64_t n, int64_t k, int64_t k0, int64_t k1) {
    Floats out(sz(n * (k1 - k0)));
    for (int64_t t = 0; t < n; ++t) {
        std::copy(x.begin() + t * k + k0, x.begin() + t * k + k1, out.begin() + t * (k1 - k0));
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// The CPU reference: CpuBackend in device numerics.

enum class Product { kMatmul, kCanonical };

void cpu_product(const HostMatrix &m, const MatrixWindow &win, Product kind, const Floats &x, int64_t n, Floats *y) {
    cpu::CpuBackend be(2, Numerics::kDevice);
    auto id = be.upload_matrix_window(m, win);
    ASSERT_TRUE(id.has_value()) << id.error().message;
    const int64_t rows = win.row_end - win.row_begin;
    const int64_t cols = win.col_end - win.col_begin;
    ASSERT_EQ(x.size(), sz(n * cols));
    auto xv = be.alloc(DType::kF32, {n, cols});
    auto yv = be.alloc(DType::kF32, {n, rows});
    ASSERT_TRUE(xv.has_value() && yv.has_value());
    be.copy_from_host(x.data(), *xv);
    if (kind == Product::kMatmul) {
        be.matmul(*xv, *id, *yv);
    } else {
        auto ws = be.alloc(DType::kF32, {std::max<int64_t>(1, be.canonical_workspace_floats(n, *id))});
        ASSERT_TRUE(ws.has_value());
        be.matmul_canonical(*xv, *id, *yv, *ws);
    }
    y->assign(sz(n * rows), 0.0f);
    be.copy_to_host(*yv, y->data());
}

// expert rows as Backend::matmul_grouped; y starts as y_init ([x_rows, rows]).
void cpu_grouped(const HostBank &b, const BankWindow &win, const std::vector<int32_t> &offsets, const Floats &x,
                 int64_t x_rows, const Floats &y_init, Floats *y) {
    cpu::CpuBackend be(2, Numerics::kDevice);
    auto id = be.upload_bank_window(b, win);
    ASSERT_TRUE(id.has_value()) << id.error().message;
    auto xv = be.alloc(DType::kF32, {x_rows, b.cols});
    auto yv = be.alloc(DType::kF32, {x_rows, b.rows});
    auto ov = be.alloc(DType::kI32, {static_cast<int64_t>(offsets.size())});
    ASSERT_TRUE(xv.has_value() && yv.has_value() && ov.has_value());
    be.copy_from_host(x.data(), *xv);
    be.copy_from_host(y_init.data(), *yv);
    be.copy_from_host(offsets.data(), *ov);
    be.matmul_grouped(*xv, *id, *ov, *yv);
    y->assign(sz(x_rows * b.rows), 0.0f);
    be.copy_to_host(*yv, y->data());
}

// ---------------------------------------------------------------------------------------------
// The GPU side.

struct GpuMatrix {
    std::unique_ptr<DeviceBuffer> buf;
    CudaMatrix w;
};

struct GpuBank {
    std::unique_ptr<DeviceBuffer> buf;
    CudaBank w;
};

void gpu_upload(const HostMatrix &m, const MatrixWindow &win, GpuMatrix *out) {
    const int64_t bytes = cuda::cuda_matrix_bytes(m, win);
    ASSERT_GT(bytes, 0);
    out->buf = std::make_unique<DeviceBuffer>(sz(bytes));
    auto w = cuda::upload_cuda_matrix(m, win, out->buf->as<void>(), nullptr);
    ASSERT_TRUE(w.has_value()) << w.error().message;
    out->w = *w;
}

void gpu_upload(const HostBank &b, const BankWindow &win, GpuBank *out) {
    const int64_t bytes = cuda::cuda_bank_bytes(b, win);
    ASSERT_GT(bytes, 0);
    out->buf = std::make_unique<DeviceBuffer>(sz(bytes));
    auto w = cuda::upload_cuda_bank(b, win, out->buf->as<void>(), nullptr);
    ASSERT_TRUE(w.has_value()) << w.error().message;
    out->w = *w;
}

void gpu_product(const CudaMatrix &w, Product kind, const Floats &x, int64_t n, Floats *y) {
    ASSERT_EQ(x.size(), sz(n * w.cols));
    const DeviceBuffer dx = to_device(x);
    const DeviceBuffer dy(sz(n * w.rows) * 4);
    const cudaError_t err = kind == Product::kMatmul
                                ? cuda::cuda_matmul(w, dx.as<float>(), n, dy.as<float>(), nullptr)
                                : cuda::cuda_matmul_canonical(w, dx.as<float>(), n, dy.as<float>(), nullptr);
    ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    *y = from_device<float>(dy, sz(n * w.rows));
}

// The backend's e4m3 scratch (kE4m3ScratchRows rows of K 8192), allocated once.
cuda::E4m3Scratch full_scratch() {
    static const DeviceBuffer codes(sz(cuda::kE4m3ScratchCodeBytes));
    static const DeviceBuffer scales(sz(cuda::kE4m3ScratchScaleFloats) * 4);
    return {codes.as<uint8_t>(), scales.as<float>(), cuda::kE4m3ScratchCodeBytes, cuda::kE4m3ScratchScaleFloats};
}

void gpu_grouped(const CudaBank &w, const std::vector<int32_t> &offsets, const Floats &x, int64_t x_rows,
                 const Floats &y_init, Floats *y, const cuda::E4m3Scratch &scratch = full_scratch()) {
    const DeviceBuffer dx = to_device(x);
    const DeviceBuffer dy = to_device(y_init);
    const DeviceBuffer doff = to_device(offsets);
    const cudaError_t err =
        cuda::cuda_matmul_grouped(w, dx.as<float>(), x_rows, doff.as<int32_t>(), static_cast<int64_t>(offsets.size()),
                                  dy.as<float>(), scratch, nullptr);
    ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    *y = from_device<float>(dy, sz(x_rows * w.rows));
}

// ---------------------------------------------------------------------------------------------
// Tensor-core products against the CPU.

// Whether the GPU runs this weight's products on the tensor cores (bf16 weights, bf16 activations).
bool tensor_core(const Weights &w) { return w.dtype == DType::kBF16 && !w.f32_activations; }

float bf16_at(const Weights &w, int64_t i) {
    uint16_t h = 0;
    std::memcpy(&h, &w.bytes[sz(i * 2)], 2);
    return bf16_to_f32(h);
}

// How far a tensor-core element may be from the CPU's: 2^-14 of sum |x_k w_k| (x rounded to bf16; both sides add
// exact products in fp32, in different orders and roundings), plus the terms with a denormal operand (the CPU
// treats those as zero), plus 2^-110 (products that underflow). NaN where a term is NaN (the result must be NaN);
// Inf where the magnitudes overflow (any order may overflow: not compared). Weight row `row` of expert `e`, K
// [k0, k1) of it; x: K k0 at x[0].
double tensor_core_bound(const Weights &w, int64_t e, int64_t row, const float *x, int64_t k0, int64_t k1) {
    double sum = 0.0;
    double daz = 0.0;
    for (int64_t k = k0; k < k1; ++k) {
        const float xv = bf16_to_f32(f32_to_bf16(x[k - k0]));
        const float wv = bf16_at(w, (e * w.rows + row) * w.cols + k);
        const double term = std::fabs(static_cast<double>(xv) * static_cast<double>(wv));
        sum += term;
        if (std::fpclassify(xv) == FP_SUBNORMAL || std::fpclassify(wv) == FP_SUBNORMAL) daz += term;
    }
    if (std::isnan(sum)) return sum;
    if (sum > static_cast<double>(FLT_MAX) / 2) return std::numeric_limits<double>::infinity();
    return std::ldexp(sum, -14) + daz + std::ldexp(1.0, -110);
}

// Whether a bank's grouped products run on the tensor cores: bf16 weights (bf16 activations), or F8_E4M3 ones
// with e4m3 groups whose shapes take the wgmma kernel (scale tiles 128 wide and a multiple of 64 high, K a multiple
// of 16 up to 8192).
bool tensor_core_bank(const Weights &w) {
    if (tensor_core(w)) return true;
    return w.dtype == DType::kF8E4M3 && w.block_cols == 128 && w.block_rows % 64 == 0 && w.cols % 16 == 0 &&
           w.cols <= 8192;
}

// How far a tensor-core e4m3 element may be from the CPU's. Both sides quantize x alike (e4m3_quantize_group) and
// promote each 128-wide chunk's sum alike; inside a chunk the CPU adds the exact products in fp32, wgmma with its
// coarser accumulation (CUDA.md 7 measured at most 1.6e-3 of the chunk's sum |q w|). So: 2^-8 of each chunk's
// sum |q_k w_k| times |x scale * weight scale|, plus 2^-20 of their total (the promotions' roundings, and a chunk
// sum's error carried through them), plus 2^-110. NaN where the total is NaN, Inf where it overflows (as
// tensor_core_bound). Weight row `row` of expert `e`; x: the row's K values.
double e4m3_bound(const Weights &w, int64_t e, int64_t row, const float *x) {
    const int64_t chunks = ceil_div(w.cols, 128);
    double bound = 0.0;
    double all = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n = std::min<int64_t>(128, w.cols - 128 * c);
        float q[128];
        const float xs = e4m3_quantize_group(x + 128 * c, n, q);
        const float ws = w.scales[sz(e * w.tiles() + (row / w.block_rows) * chunks + c)];
        double sum = 0.0;
        for (int64_t k = 0; k < n; ++k) {
            const float wv = fp8_e4m3_to_f32(w.bytes[sz((e * w.rows + row) * w.cols + 128 * c + k)]);
            sum += std::fabs(static_cast<double>(q[k]) * static_cast<double>(wv));
        }
        const double scaled = sum * std::fabs(static_cast<double>(xs) * static_cast<double>(ws));
        bound += std::ldexp(scaled, -8);
        all += scaled;
    }
    if (std::isnan(all)) return all;
    if (all > static_cast<double>(FLT_MAX) / 2) return std::numeric_limits<double>::infinity();
    return bound + std::ldexp(all, -20) + std::ldexp(1.0, -110);
}

// How far a tensor-core element of a bank may be from the CPU's (row `row` of expert `e`; x: the row's K values).
double bank_bound(const Weights &w, int64_t e, int64_t row, const float *x) {
    return w.dtype == DType::kBF16 ? tensor_core_bound(w, e, row, x, 0, w.cols) : e4m3_bound(w, e, row, x);
}

// Bounds of a window's [n, rows] outputs (x: [n, the window's columns]).
std::vector<double> window_bounds(const Weights &w, const MatrixWindow &win, const Floats &x, int64_t n) {
    const int64_t cols = win.col_end - win.col_begin;
    std::vector<double> b;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t r = win.row_begin; r < win.row_end; ++r) {
            b.push_back(tensor_core_bound(w, 0, r, x.data() + t * cols, win.col_begin, win.col_end));
        }
    }
    return b;
}

// Elements outside their bound (NaN bound: must be NaN; infinite bound: not compared).
int64_t outside(const Floats &got, const Floats &want, const std::vector<double> &bound, std::string *first) {
    if (got.size() != want.size() || got.size() != bound.size()) return -1;
    int64_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        bool ok = true;
        if (std::isnan(bound[i])) {
            ok = std::isnan(got[i]);
        } else if (std::isfinite(bound[i])) {
            ok = std::fabs(static_cast<double>(got[i]) - static_cast<double>(want[i])) <= bound[i];
        }
        if (!ok && bad++ == 0 && first != nullptr) {
            *first = "index " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", want " +
                     std::to_string(want[i]) + ", bound " + std::to_string(bound[i]);
        }
    }
    return bad;
}

#define EXPECT_CLOSE_TO_CPU(got, want, bound, what)                                  \
    do {                                                                             \
        std::string first_;                                                          \
        EXPECT_EQ(outside((got), (want), (bound), &first_), 0) << (what) << ": " << first_; \
    } while (0)

// CPU and GPU on one window of one matrix; the GPU result goes to *gpu_out when asked.
void compare_window(const Weights &wt, const MatrixWindow &win, Product kind, const Floats &x_full, int64_t n,
                    const std::string &what, Floats *gpu_out = nullptr) {
    const Floats x = columns(x_full, n, wt.cols, win.col_begin, win.col_end);
    Floats want;
    Floats got;
    ASSERT_NO_FATAL_FAILURE(cpu_product(wt.matrix(), win, kind, x, n, &want));
    GpuMatrix g;
    ASSERT_NO_FATAL_FAILURE(gpu_upload(wt.matrix(), win, &g));
    ASSERT_NO_FATAL_FAILURE(gpu_product(g.w, kind, x, n, &got));
    if (tensor_core(wt)) {
        EXPECT_CLOSE_TO_CPU(got, want, window_bounds(wt, win, x, n), what);
    } else {
        EXPECT_SAME_BITS(got, want, what);
    }
    if (gpu_out != nullptr) *gpu_out = got;
}

std::string describe(const Weights &w, int64_t n) {
    return std::string(dtype_name(w.dtype)) + (w.f32_activations ? " (f32 activations)" : "") + " [" +
           std::to_string(w.rows) + ", " + std::to_string(w.cols) + "] tiles " + std::to_string(w.block_rows) + "x" +
           std::to_string(w.block_cols) + ", " + std::to_string(n) + " tokens";
}

// Restores this CPU's best product path when a test that forced others ends.
struct IsaGuard {
    cpu::ProductIsa saved = cpu::product_isa();
    ~IsaGuard() { cpu::force_product_isa(saved); }
};

std::vector<cpu::ProductIsa> supported_isas() {
    std::vector<cpu::ProductIsa> v;
    for (cpu::ProductIsa isa : {cpu::ProductIsa::kPortable, cpu::ProductIsa::kAvx2Fma, cpu::ProductIsa::kAvx512Bf16}) {
        if (cpu::product_isa_supported(isa)) v.push_back(isa);
    }
    return v;
}

// ---------------------------------------------------------------------------------------------
// Uploads: no GPU needed (every refusal comes before any CUDA call).

TEST(MatmulUpload, RefusesWhatTheCpuRefusesInItsWords) {
    const Weights bf = make_weights(DType::kBF16, 4, 8, 64, 1);
    Weights fp8 = make_weights(DType::kF8E4M3, 4, 8, 64, 2);
    const Weights w60 = make_weights(DType::kBF16, 1, 8, 60, 3);
    cpu::CpuBackend be(1, Numerics::kDevice);
    // The CPU's message with "cpu upload" in place of "cuda upload".
    const auto cpu_words = [](const std::string &cuda_msg) {
        std::string s = cuda_msg;
        const size_t at = s.find("cuda upload");
        if (at != std::string::npos) s.replace(at, 11, "cpu upload");
        return s;
    };
    const auto matrix_case = [&](const HostMatrix &m, const MatrixWindow &win) {
        auto ours = cuda::upload_cuda_matrix(m, win, nullptr, nullptr);
        auto theirs = be.upload_matrix_window(m, win);
        ASSERT_FALSE(ours.has_value());
        ASSERT_FALSE(theirs.has_value()) << ours.error().message;
        EXPECT_EQ(cpu_words(ours.error().message), theirs.error().message);
        EXPECT_FALSE(cuda::check_cuda_matrix(m, win).has_value());
        EXPECT_EQ(cuda::cuda_matrix_bytes(m, win), 0);
    };
    const HostMatrix m = bf.matrix();
    ASSERT_NO_FATAL_FAILURE(matrix_case(m, MatrixWindow{0, 0, 0, 64}));
    ASSERT_NO_FATAL_FAILURE(matrix_case(m, MatrixWindow{0, 9, 0, 64}));
    ASSERT_NO_FATAL_FAILURE(matrix_case(m, MatrixWindow{-1, 8, 0, 64}));
    ASSERT_NO_FATAL_FAILURE(matrix_case(m, MatrixWindow{0, 8, 0, 72}));
    ASSERT_NO_FATAL_FAILURE(matrix_case(m, MatrixWindow{0, 8, 8, 24}));
    ASSERT_NO_FATAL_FAILURE(matrix_case(m, MatrixWindow{0, 8, 0, 24}));
    ASSERT_NO_FATAL_FAILURE(matrix_case(m, MatrixWindow{0, 8, 4, 12}));
    ASSERT_NO_FATAL_FAILURE(matrix_case(w60.matrix(), MatrixWindow{0, 8, 0, 30}));
    HostMatrix bad = m;
    bad.dtype = DType::kI32;
    ASSERT_NO_FATAL_FAILURE(matrix_case(bad, MatrixWindow::whole(bad)));
    bad = m;
    bad.data = nullptr;
    ASSERT_NO_FATAL_FAILURE(matrix_case(bad, MatrixWindow::whole(bad)));
    bad = fp8.matrix();
    bad.scale_inv = nullptr;
    ASSERT_NO_FATAL_FAILURE(matrix_case(bad, MatrixWindow::whole(bad)));
    bad = fp8.matrix();
    bad.block_cols = 0;
    ASSERT_NO_FATAL_FAILURE(matrix_case(bad, MatrixWindow::whole(bad)));

    const auto bank_case = [&](const HostBank &b, const BankWindow &win) {
        auto ours = cuda::upload_cuda_bank(b, win, nullptr, nullptr);
        auto theirs = be.upload_bank_window(b, win);
        ASSERT_FALSE(ours.has_value());
        ASSERT_FALSE(theirs.has_value()) << ours.error().message;
        EXPECT_EQ(cpu_words(ours.error().message), theirs.error().message);
        EXPECT_EQ(cuda::cuda_bank_bytes(b, win), 0);
    };
    ASSERT_NO_FATAL_FAILURE(bank_case(bf.bank(), BankWindow{2, 5}));
    ASSERT_NO_FATAL_FAILURE(bank_case(bf.bank(), BankWindow{3, 3}));
    ASSERT_NO_FATAL_FAILURE(bank_case(bf.bank(), BankWindow{-1, 2}));
    HostBank bad_bank = fp8.bank();
    bad_bank.scale_inv = nullptr;
    ASSERT_NO_FATAL_FAILURE(bank_case(bad_bank, BankWindow{0, 2}));
    bad_bank = bf.bank();
    bad_bank.dtype = DType::kU8;
    ASSERT_NO_FATAL_FAILURE(bank_case(bad_bank, BankWindow{0, 2}));
    bad_bank = bf.bank();
    bad_bank.rows = 0;
    ASSERT_NO_FATAL_FAILURE(bank_case(bad_bank, BankWindow{0, 2}));

    // Where the CPU refuses only at the first product: a non-positive chunk edge.
    HostMatrix edge = m;
    edge.block_cols = 0;
    EXPECT_FALSE(cuda::check_cuda_matrix(edge, MatrixWindow::whole(edge)).has_value());
    // Accepted windows need their bytes, and only a null or misaligned destination stops them here.
    EXPECT_TRUE(cuda::check_cuda_matrix(m, MatrixWindow{3, 5, 32, 64}).has_value());
    EXPECT_EQ(cuda::cuda_matrix_bytes(m, MatrixWindow{3, 5, 32, 64}), 2 * 32 * 2);
    // fp8 rows [3, 5) x K [32, 64) of 8 x 64 with 128-tiles: 64 bytes, then one tile at byte 256.
    EXPECT_EQ(cuda::cuda_matrix_bytes(fp8.matrix(), MatrixWindow{3, 5, 32, 64}), 256 + 4);
    // experts [1, 3): 2 x 8 x 64 bytes = 1024, then 2 grids of one tile.
    EXPECT_EQ(cuda::cuda_bank_bytes(fp8.bank(), BankWindow{1, 3}), 1024 + 8);
    auto null_dst = cuda::upload_cuda_matrix(m, MatrixWindow::whole(m), nullptr, nullptr);
    ASSERT_FALSE(null_dst.has_value());
    EXPECT_NE(null_dst.error().message.find("16-byte aligned device pointer"), std::string::npos);
}

TEST(MatmulUpload, LaunchersRefuseWhatTheCpuAbortsOn) {
    // Fake device pointers: every call below is refused before any launch.
    const auto *fake = reinterpret_cast<const void *>(uintptr_t{4096});
    float *y = reinterpret_cast<float *>(uintptr_t{8192});
    const auto *x = reinterpret_cast<const float *>(uintptr_t{12288});
    CudaMatrix w;
    w.dtype = DType::kBF16;
    w.data = fake;
    w.rows = 4;
    w.cols = 32;
    w.k_begin = 32;
    w.k_full = 64;
    w.act = cuda::ActRounding::kBf16;
    EXPECT_EQ(cuda::cuda_matmul(w, x, 1, y, nullptr), cudaErrorInvalidValue);  // a K window: column-parallel
    w.k_begin = 8;
    EXPECT_EQ(cuda::cuda_matmul_canonical(w, x, 1, y, nullptr), cudaErrorInvalidValue);  // not an aligned subtree
    w.k_begin = 0;
    w.cols = 60;
    w.k_full = 60;
    EXPECT_EQ(cuda::cuda_matmul_canonical(w, x, 1, y, nullptr), cudaErrorInvalidValue);  // 60 % 8 != 0
    w.dtype = DType::kF16;
    EXPECT_EQ(cuda::cuda_matmul(w, x, 1, y, nullptr), cudaErrorInvalidValue);  // bf16 activations, F16 weight
    w.dtype = DType::kF8E4M3;
    w.act = cuda::ActRounding::kNone;
    EXPECT_EQ(cuda::cuda_matmul(w, x, 1, y, nullptr), cudaErrorInvalidValue);  // fp8 without scales
    EXPECT_EQ(cuda::cuda_matmul(w, x, -1, y, nullptr), cudaErrorInvalidValue);
    CudaBank b;
    b.dtype = DType::kF8E4M3;
    b.data = fake;
    b.scale_inv = x;
    b.n_experts = 2;
    b.rows = 4;
    b.cols = 256;
    b.first_expert = 2;
    b.act = cuda::ActRounding::kE4m3x128;
    const auto *off = reinterpret_cast<const int32_t *>(uintptr_t{16384});
    EXPECT_EQ(cuda::cuda_matmul_grouped(b, x, 3, off, 4, y, {}, nullptr), cudaErrorInvalidValue);  // needs 5 offsets
    b.block_cols = 64;
    EXPECT_EQ(cuda::cuda_matmul_grouped(b, x, 3, off, 5, y, {}, nullptr), cudaErrorInvalidValue);  // e4m3 needs 128
    b.block_cols = 128;
    EXPECT_EQ(cuda::cuda_matmul_grouped(b, x, 0, off, 5, y, {}, nullptr), cudaSuccess);  // no rows: nothing to launch
    // The tensor-core e4m3 kernel needs a scratch that holds at least one row (256 code bytes and 2 scales).
    EXPECT_EQ(cuda::cuda_matmul_grouped(b, x, 3, off, 5, y, {}, nullptr), cudaErrorInvalidValue);
    auto *fake_codes = reinterpret_cast<uint8_t *>(uintptr_t{20480});
    auto *fake_scales = reinterpret_cast<float *>(uintptr_t{24576});
    EXPECT_EQ(cuda::cuda_matmul_grouped(b, x, 3, off, 5, y, {fake_codes, fake_scales, 255, 2}, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(cuda::cuda_matmul_grouped_launches(b, 3, {fake_codes, fake_scales, 256, 2}), 6);  // a slice per row
    EXPECT_EQ(cuda::cuda_matmul_grouped_launches(b, 3, {fake_codes, fake_scales, 512, 4}), 4);
    b.block_rows = 16;  // the exact e4m3 loop: one launch, no scratch
    EXPECT_EQ(cuda::cuda_matmul_grouped_launches(b, 3, {}), 1);
    CudaMatrix e4 = w;
    e4.scale_inv = x;
    e4.cols = 256;
    e4.k_full = 256;
    e4.act = cuda::ActRounding::kE4m3x128;
    EXPECT_EQ(cuda::cuda_matmul_canonical(e4, x, 1, y, nullptr), cudaErrorInvalidValue);  // groups span blocks
}

// ---------------------------------------------------------------------------------------------
// Column-parallel products.

TEST(CudaMatmul, EveryDtypeAndRoundingEqualsTheCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    struct Shape {
        int64_t n, rows, cols;
    };
    const Shape shapes[] = {{1, 1, 1}, {1, 7, 33}, {3, 17, 100}, {5, 40, 256}, {2, 130, 300}, {4, 33, 1280}};
    struct Kind {
        DType dtype;
        bool f32_act;
        int64_t block_rows, block_cols;
    };
    const Kind kinds[] = {{DType::kBF16, false, 128, 128}, {DType::kBF16, true, 128, 128},
                          {DType::kF32, false, 128, 128},  {DType::kF16, false, 128, 128},
                          {DType::kF8E4M3, false, 128, 128}, {DType::kF8E4M3, false, 48, 40},
                          {DType::kF32, false, 7, 24}};
    uint32_t seed = 10;
    for (const Kind &k : kinds) {
        for (const Shape &s : shapes) {
            for (const bool tiny : {false, true}) {
                Weights w = make_weights(k.dtype, 1, s.rows, s.cols, ++seed, tiny, k.block_rows, k.block_cols);
                w.f32_activations = k.f32_act;
                const Floats x = activations(s.n, s.cols, ++seed, tiny);
                ASSERT_NO_FATAL_FAILURE(compare_window(w, MatrixWindow::whole(w.matrix()), Product::kMatmul, x, s.n,
                                                       describe(w, s.n) + (tiny ? " tiny" : "")));
            }
        }
    }
}

// A row window (a column-parallel shard) gives the whole matrix's rows, also where it starts inside an fp8 tile.
TEST(CudaMatmul, RowWindowsEqualTheCpuAndTheWholeRows) {
    MEMRA_SKIP_WITHOUT_GPU();
    struct Case {
        DType dtype;
        int64_t block_rows;
        int64_t r0, r1;
    };
    const Case cases[] = {{DType::kBF16, 128, 3, 5}, {DType::kF8E4M3, 128, 50, 230}, {DType::kF8E4M3, 48, 47, 97},
                          {DType::kF32, 128, 0, 1}, {DType::kF16, 128, 299, 300}};
    const int64_t n = 3;
    const int64_t rows = 300;
    const int64_t cols = 384;
    for (const Case &c : cases) {
        const Weights w = make_weights(c.dtype, 1, rows, cols, static_cast<uint32_t>(c.r0 + 7), false, c.block_rows);
        const Floats x = activations(n, cols, 99);
        Floats whole;
        Floats part;
        const std::string what = describe(w, n) + " rows [" + std::to_string(c.r0) + ", " + std::to_string(c.r1) + ")";
        ASSERT_NO_FATAL_FAILURE(
            compare_window(w, MatrixWindow::whole(w.matrix()), Product::kMatmul, x, n, what + " (whole)", &whole));
        ASSERT_NO_FATAL_FAILURE(
            compare_window(w, MatrixWindow{c.r0, c.r1, 0, cols}, Product::kMatmul, x, n, what, &part));
        Floats rows_of_whole;
        for (int64_t t = 0; t < n; ++t) {
            rows_of_whole.insert(rows_of_whole.end(), whole.begin() + t * rows + c.r0, whole.begin() + t * rows + c.r1);
        }
        EXPECT_SAME_BITS(part, rows_of_whole, what + " vs the whole product's rows");
    }
}

// ---------------------------------------------------------------------------------------------
// Row-parallel products.

// The whole product and every TP rank's K window (with and without a row window) equal the CPU's, and the
// ranks' subtree sums combined by the canonical tree equal the whole product (TP = 1) bit for bit.
TEST(CudaMatmulCanonical, WholeAndTpWindowsEqualTheCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    struct Case {
        DType dtype;
        bool f32_act;
        int64_t cols;
        int64_t block_rows, block_cols;
    };
    const Case cases[] = {
        {DType::kBF16, false, 1024, 128, 128}, {DType::kBF16, false, 1280, 128, 128},  // blocks of 160: cut chunks
        {DType::kBF16, false, 136, 128, 128},  {DType::kBF16, true, 1280, 128, 128},   // blocks of 17
        {DType::kF32, false, 1280, 128, 128},  {DType::kF16, false, 1024, 128, 128},
        {DType::kF8E4M3, false, 1280, 128, 128}, {DType::kF8E4M3, false, 1024, 48, 40},
        {DType::kF32, false, 8, 128, 3},
    };
    const int64_t n = 3;
    const int64_t rows = 37;
    uint32_t seed = 500;
    for (const Case &c : cases) {
        for (const bool tiny : {false, true}) {
            Weights w = make_weights(c.dtype, 1, rows, c.cols, ++seed, tiny, c.block_rows, c.block_cols);
            w.f32_activations = c.f32_act;
            const Floats x = activations(n, c.cols, ++seed, tiny);
            const std::string what = describe(w, n) + (tiny ? " tiny" : "");
            Floats whole;
            ASSERT_NO_FATAL_FAILURE(
                compare_window(w, MatrixWindow::whole(w.matrix()), Product::kCanonical, x, n, what, &whole));
            for (const int64_t tp : {2, 4, 8}) {
                const int64_t kc = c.cols / tp;
                Floats sums;
                for (int64_t r = 0; r < tp; ++r) {
                    Floats sum;
                    const std::string rank = what + " TP " + std::to_string(tp) + " rank " + std::to_string(r);
                    ASSERT_NO_FATAL_FAILURE(compare_window(w, MatrixWindow{0, rows, r * kc, (r + 1) * kc},
                                                           Product::kCanonical, x, n, rank, &sum));
                    sums.insert(sums.end(), sum.begin(), sum.end());
                    if (r == 1) {  // a rank holding a row window too
                        ASSERT_NO_FATAL_FAILURE(compare_window(w, MatrixWindow{5, 29, r * kc, (r + 1) * kc},
                                                               Product::kCanonical, x, n, rank + " rows [5, 29)"));
                    }
                }
                Floats combined(sz(n * rows));
                cpu::canonical_tree_combine(sums.data(), tp, n * rows, combined.data());
                EXPECT_SAME_BITS(combined, whole, what + " TP " + std::to_string(tp) + " combined vs TP 1");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Grouped products.

TEST(CudaMatmulGrouped, EveryBankEqualsTheCpuWithEmptyExpertsAndUnevenOffsets) {
    MEMRA_SKIP_WITHOUT_GPU();
    struct Kind {
        DType dtype;
        int64_t cols;
        int64_t block_rows, block_cols;
    };
    // bf16: bf16 activations (K 256: whole 32-wide groups, the skinny kernel; K 300: the 16-thread one); fp8
    // with 128-wide tiles: e4m3 groups (304 = 2 groups + a partial 48 in 128 x 128 tiles: wgmma, with 40 rows a
    // partial 64-row tile; 256 in 16 x 128 tiles and 300, a partial 44, K not a multiple of 16: the 16-thread
    // exact loop); fp8 with other tiles, F32 and F16: the exact loop.
    const Kind kinds[] = {{DType::kBF16, 300, 128, 128},   {DType::kBF16, 256, 128, 128},
                          {DType::kF8E4M3, 300, 128, 128},  {DType::kF8E4M3, 304, 128, 128},
                          {DType::kF8E4M3, 256, 16, 128},  {DType::kF8E4M3, 200, 64, 64},
                          {DType::kF32, 100, 128, 128},    {DType::kF16, 130, 128, 128}};
    const int64_t n_layer_experts = 8;
    const int64_t rows = 40;
    // Rows per expert of the layer: empty experts, uneven counts (up to 20 rows of one expert).
    const std::vector<std::vector<int32_t>> count_sets = {{3, 0, 5, 1, 0, 0, 7, 2}, {0, 0, 0, 0, 0, 0, 0, 0},
                                                          {0, 0, 9, 0, 0, 0, 0, 0}, {1, 1, 1, 1, 1, 1, 1, 1},
                                                          {20, 0, 3, 17, 0, 1, 0, 9}};
    const BankWindow windows[] = {{0, 8}, {2, 6}, {7, 8}};
    uint32_t seed = 900;
    for (const Kind &k : kinds) {
        const Weights w = make_weights(k.dtype, n_layer_experts, rows, k.cols, ++seed, false, k.block_rows,
                                       k.block_cols);
        for (const BankWindow &win : windows) {
            GpuBank g;
            ASSERT_NO_FATAL_FAILURE(gpu_upload(w.bank(), win, &g));
            for (const auto &counts : count_sets) {
                std::vector<int32_t> offsets(sz(n_layer_experts + 1), 0);
                for (int64_t e = 0; e < n_layer_experts; ++e) offsets[sz(e + 1)] = offsets[sz(e)] + counts[sz(e)];
                const int64_t own = offsets[sz(win.expert_end)] - offsets[sz(win.expert_begin)];
                const int64_t x_rows = own + 3;  // rows past the owned ones stay untouched
                const Floats x = activations(x_rows, k.cols, ++seed);
                const Floats y_init(sz(x_rows * rows), -12345.0f);
                Floats want;
                Floats got;
                ASSERT_NO_FATAL_FAILURE(cpu_grouped(w.bank(), win, offsets, x, x_rows, y_init, &want));
                ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, offsets, x, x_rows, y_init, &got));
                std::string what = std::string(dtype_name(k.dtype)) + " K " + std::to_string(k.cols) + " tiles " +
                                   std::to_string(k.block_rows) + "x" + std::to_string(k.block_cols) + " experts [" +
                                   std::to_string(win.expert_begin) + ", " + std::to_string(win.expert_end) +
                                   ") counts";
                for (int32_t c : counts) what.append(" ").append(std::to_string(c));
                if (!tensor_core_bank(w)) {
                    EXPECT_SAME_BITS(got, want, what);
                } else {
                    // Against the CPU within the bound of each row's expert; against each row alone in its
                    // expert (a one-row call) bit for bit.
                    std::vector<double> bound(sz(x_rows * rows), 0.0);
                    for (int64_t t = 0; t < own; ++t) {
                        const int64_t v = offsets[sz(win.expert_begin)] + t;
                        int64_t e = 0;
                        while (offsets[sz(e + 1)] <= v) ++e;
                        for (int64_t r = 0; r < rows; ++r) {
                            bound[sz(t * rows + r)] = bank_bound(w, e, r, x.data() + t * k.cols);
                        }
                        std::vector<int32_t> alone(sz(n_layer_experts + 1));
                        for (int64_t j = 0; j <= n_layer_experts; ++j) alone[sz(j)] = j > e ? 1 : 0;
                        Floats one;
                        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, alone, Floats(x.begin() + t * k.cols,
                                                                               x.begin() + (t + 1) * k.cols),
                                                            1, Floats(sz(rows), -12345.0f), &one));
                        EXPECT_SAME_BITS(Floats(got.begin() + t * rows, got.begin() + (t + 1) * rows), one,
                                         what + ": row " + std::to_string(t) + " alone");
                    }
                    EXPECT_CLOSE_TO_CPU(got, want, bound, what);
                }
                for (int64_t i = own * rows; i < x_rows * rows; ++i) {
                    ASSERT_EQ(bits(got[sz(i)]), bits(-12345.0f)) << what << ": untouched row element " << i;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The tensor-core e4m3 products (wgmma_e4m3_kernel).

// The offsets of per-expert row counts.
std::vector<int32_t> offsets_of(const std::vector<int32_t> &counts) {
    std::vector<int32_t> off(counts.size() + 1, 0);
    for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
    return off;
}

// Exact arithmetic: weight codes of small integers, power-of-two scales, activation groups of integers up to 7 with
// a 7 in each (scale 7 / 448 = 2^-6, codes 64 x), so every chunk sum is an integer below 2^17 that any accumulation
// order gives exactly: the GPU must equal the CPU bit for bit, which only the right operand layouts, swizzles,
// scale tiles and token and row indices give. K 1328 (a partial last chunk of 48), 136 rows (a partial 64-row
// tile), token tiles of 8, 32 and 128 (by the rows per expert), experts of several tiles, empty experts.
TEST(CudaMatmulE4m3, ExactArithmeticEqualsTheCpuBitForBit) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t rows = 136;
    const int64_t k = 1328;
    const int64_t n_experts = 4;
    Weights w = make_weights(DType::kF8E4M3, n_experts, rows, k, 31);
    std::mt19937 rng(32);
    for (uint8_t &c : w.bytes)
        c = f32_to_fp8_e4m3(static_cast<float>(static_cast<int>(rng() % 5) - 2), Fp8Saturation::kSaturate);
    for (float &sc : w.scales) sc = std::ldexp(1.0f, -8 - static_cast<int>(rng() % 4));
    ASSERT_TRUE(tensor_core_bank(w));
    GpuBank g;
    ASSERT_NO_FATAL_FAILURE(gpu_upload(w.bank(), BankWindow::whole(w.bank()), &g));
    for (const std::vector<int32_t> &counts :
         std::vector<std::vector<int32_t>>{{1, 0, 3, 2}, {5, 0, 44, 9}, {150, 3, 0, 70}, {0, 0, 0, 1}}) {
        const std::vector<int32_t> offsets = offsets_of(counts);
        const int64_t n = offsets.back();
        Floats x(sz(n * k));
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t i = 0; i < k; ++i) {
                x[sz(t * k + i)] =
                    i % 128 == (t * 5) % 48 ? 7.0f : static_cast<float>(static_cast<int>(rng() % 15) - 7);
            }
        }
        const Floats y_init(sz(n * rows), 0.0f);
        Floats want;
        Floats got;
        ASSERT_NO_FATAL_FAILURE(cpu_grouped(w.bank(), BankWindow::whole(w.bank()), offsets, x, n, y_init, &want));
        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, offsets, x, n, y_init, &got));
        std::string what = "counts";
        for (int32_t c : counts) what.append(" ").append(std::to_string(c));
        EXPECT_SAME_BITS(got, want, what);
    }
}

// The shapes of Step-3.5's routed experts (gate and up [1280, 4096] as one [2560, 4096] product, down [4096, 1280])
// on random codes and scales: within e4m3_bound of the CPU; each row bit for bit its own one-row product; the same
// bits when the scratch holds only 7 rows (slices of 7 rows, each quantized and multiplied on its own) and when the
// bank runs as a pair with another (cuda_matmul_grouped_pair).
TEST(CudaMatmulE4m3, ExpertShapesNearTheCpuAndRowsAlone) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (const auto &[rows, k] : {std::pair<int64_t, int64_t>{2560, 4096}, {4096, 1280}}) {
        const int64_t n_experts = 4;
        const Weights w = make_weights(DType::kF8E4M3, n_experts, rows, k, 41);
        GpuBank g;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w.bank(), BankWindow::whole(w.bank()), &g));
        const std::vector<int32_t> counts = {3, 0, 12, 2};
        const std::vector<int32_t> offsets = offsets_of(counts);
        const int64_t n = offsets.back();
        const Floats x = activations(n, k, 42);
        const Floats y_init(sz(n * rows), 0.0f);
        Floats want;
        Floats got;
        ASSERT_NO_FATAL_FAILURE(cpu_grouped(w.bank(), BankWindow::whole(w.bank()), offsets, x, n, y_init, &want));
        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, offsets, x, n, y_init, &got));
        const std::string what = std::to_string(rows) + " x " + std::to_string(k);
        std::vector<double> bound(sz(n * rows));
        for (int64_t t = 0; t < n; ++t) {
            int64_t e = 0;
            while (offsets[sz(e + 1)] <= t) ++e;
            for (int64_t r = 0; r < rows; ++r) bound[sz(t * rows + r)] = e4m3_bound(w, e, r, x.data() + t * k);
            std::vector<int32_t> alone(sz(n_experts + 1));
            for (int64_t j = 0; j <= n_experts; ++j) alone[sz(j)] = j > e ? 1 : 0;
            Floats one;
            ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, alone, Floats(x.begin() + t * k, x.begin() + (t + 1) * k), 1,
                                                Floats(sz(rows), 0.0f), &one));
            EXPECT_SAME_BITS(Floats(got.begin() + t * rows, got.begin() + (t + 1) * rows), one,
                             what + " row " + std::to_string(t) + " alone");
        }
        EXPECT_CLOSE_TO_CPU(got, want, bound, what);
        const int64_t n_chunks = ceil_div(k, 128);
        const cuda::E4m3Scratch full = full_scratch();
        const cuda::E4m3Scratch seven{full.codes, full.scales, 7 * n_chunks * 128, 7 * n_chunks};
        EXPECT_EQ(cuda::cuda_matmul_grouped_launches(g.w, n, seven), 2 * ceil_div(n, 7));
        Floats sliced;
        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, offsets, x, n, y_init, &sliced, seven));
        EXPECT_SAME_BITS(sliced, got, what + " in slices of 7 rows");
        // As a pair with another bank of the shape (gate and up): one quantization, one launch, each bank's bits.
        const Weights w2 = make_weights(DType::kF8E4M3, n_experts, rows, k, 43);
        GpuBank g2;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w2.bank(), BankWindow::whole(w2.bank()), &g2));
        Floats got2;
        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g2.w, offsets, x, n, y_init, &got2));
        EXPECT_EQ(cuda::cuda_matmul_grouped_pair_launches(g.w, g2.w, n, full), 2);
        const DeviceBuffer dx = to_device(x);
        const DeviceBuffer doff = to_device(offsets);
        const DeviceBuffer dya = to_device(y_init);
        const DeviceBuffer dyb = to_device(y_init);
        ASSERT_EQ(cuda::cuda_matmul_grouped_pair(g.w, g2.w, dx.as<float>(), n, doff.as<int32_t>(),
                                                 static_cast<int64_t>(offsets.size()), dya.as<float>(), dyb.as<float>(),
                                                 full, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_SAME_BITS(from_device<float>(dya, sz(n * rows)), got, what + " first of a pair");
        EXPECT_SAME_BITS(from_device<float>(dyb, sz(n * rows)), got2, what + " second of a pair");
    }
}

// The down product on the SwiGLU formed in its quantization (cuda_matmul_grouped_swiglu) against cuda::swiglu, then
// cuda_matmul_grouped: the same output and activation bits, with and without the clamp, NaN and Inf among the
// gates and ups, the scratch whole and in slices of 5 rows; one launch fewer than the two ops for a tensor-core
// bank, the two ops' launches for another.
TEST(CudaMatmulE4m3, SwigluInTheQuantizationKeepsBothOpsBits) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t rows = 4096;
    const int64_t k = 1280;
    const int64_t n_experts = 4;
    const Weights w = make_weights(DType::kF8E4M3, n_experts, rows, k, 51);
    GpuBank g;
    ASSERT_NO_FATAL_FAILURE(gpu_upload(w.bank(), BankWindow::whole(w.bank()), &g));
    const std::vector<int32_t> offsets = offsets_of({2, 7, 0, 4});
    const int64_t n = offsets.back();
    Floats gate = activations(n, k, 52);
    Floats up = activations(n, k, 53);
    for (float &v : gate) v *= 8.0f;  // past the clamp's limit of 7 now and then
    gate[5] = std::numeric_limits<float>::quiet_NaN();
    gate[k + 9] = std::numeric_limits<float>::infinity();
    up[2 * k + 3] = -std::numeric_limits<float>::infinity();
    up[3 * k + 300] = std::numeric_limits<float>::quiet_NaN();
    const Floats y_init(sz(n * rows), 0.0f);
    const DeviceBuffer doff = to_device(offsets);
    const DeviceBuffer dup = to_device(up);
    const cuda::E4m3Scratch full = full_scratch();
    const int64_t n_chunks = ceil_div(k, 128);
    const cuda::E4m3Scratch five{full.codes, full.scales, 5 * n_chunks * 128, 5 * n_chunks};
    EXPECT_EQ(cuda::cuda_matmul_grouped_swiglu_launches(g.w, n, full), 2);
    EXPECT_EQ(cuda::cuda_matmul_grouped_swiglu_launches(g.w, n, five), 2 * ceil_div(n, 5));
    for (const float limit : {0.0f, 7.0f}) {
        // The two ops.
        const DeviceBuffer dact = to_device(gate);
        const DeviceBuffer dy = to_device(y_init);
        ASSERT_EQ(cuda::swiglu(dact.as<float>(), dup.as<float>(), k, n, k, limit, dact.as<float>(), nullptr),
                  cudaSuccess);
        ASSERT_EQ(cuda::cuda_matmul_grouped(g.w, dact.as<float>(), n, doff.as<int32_t>(),
                                            static_cast<int64_t>(offsets.size()), dy.as<float>(), full, nullptr),
                  cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const Floats want_act = from_device<float>(dact, sz(n * k));
        const Floats want = from_device<float>(dy, sz(n * rows));
        for (const cuda::E4m3Scratch &scratch : {full, five}) {
            const std::string what = "limit " + std::to_string(limit) +
                                     (scratch.code_bytes == full.code_bytes ? ", whole scratch" : ", slices of 5 rows");
            const DeviceBuffer dgate = to_device(gate);
            const DeviceBuffer dy2 = to_device(y_init);
            ASSERT_EQ(cuda::cuda_matmul_grouped_swiglu(g.w, dgate.as<float>(), dup.as<float>(), limit, n,
                                                       doff.as<int32_t>(), static_cast<int64_t>(offsets.size()),
                                                       dy2.as<float>(), scratch, nullptr),
                      cudaSuccess);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            EXPECT_SAME_BITS(from_device<float>(dy2, sz(n * rows)), want, what + ": output");
            EXPECT_SAME_BITS(from_device<float>(dgate, sz(n * k)), want_act, what + ": activation");
        }
    }
    // A bank off the tensor cores (bf16 weights, exact loop): the two ops as they are.
    const Weights wb = make_weights(DType::kBF16, n_experts, 64, k, 54);
    GpuBank gb;
    ASSERT_NO_FATAL_FAILURE(gpu_upload(wb.bank(), BankWindow::whole(wb.bank()), &gb));
    EXPECT_EQ(cuda::cuda_matmul_grouped_swiglu_launches(gb.w, n, full),
              1 + cuda::cuda_matmul_grouped_launches(gb.w, n, full));
    const DeviceBuffer dgate = to_device(gate);
    const DeviceBuffer dy = to_device(Floats(sz(n * 64), 0.0f));
    ASSERT_EQ(cuda::cuda_matmul_grouped_swiglu(gb.w, dgate.as<float>(), dup.as<float>(), 7.0f, n, doff.as<int32_t>(),
                                               static_cast<int64_t>(offsets.size()), dy.as<float>(), full, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const DeviceBuffer dact = to_device(gate);
    ASSERT_EQ(cuda::swiglu(dact.as<float>(), dup.as<float>(), k, n, k, 7.0f, dact.as<float>(), nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Floats act = from_device<float>(dact, sz(n * k));
    EXPECT_SAME_BITS(from_device<float>(dgate, sz(n * k)), act, "bf16 bank: activation");
    Floats want;
    ASSERT_NO_FATAL_FAILURE(gpu_grouped(gb.w, offsets, act, n, Floats(sz(n * 64), 0.0f), &want));
    EXPECT_SAME_BITS(from_device<float>(dy, sz(n * 64)), want, "bf16 bank: output");
    EXPECT_EQ(cuda::cuda_matmul_grouped_swiglu(g.w, dgate.as<float>(), dup.as<float>(), -1.0f, n, doff.as<int32_t>(),
                                               static_cast<int64_t>(offsets.size()), dy.as<float>(), full, nullptr),
              cudaErrorInvalidValue);
}

// ---------------------------------------------------------------------------------------------
// Batch invariance: row r of an M-row call equals the 1-row call of the same row, M = 1..140 (the kernels and tile
// shapes of ops_matmul.cu's bf16 dispatch at few rows: up to 8, 16, 32 tokens, then 64- and 32-token tiles, whole
// and partial).

TEST(CudaMatmulBatch, RowBitsDoNotDependOnTheBatch) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t max_rows = 140;
    const int64_t rows = 48;
    const int64_t cols = 384;
    const Floats x = activations(max_rows, cols, 4242);
    const auto row_of = [&](int64_t t) { return Floats(x.begin() + t * cols, x.begin() + (t + 1) * cols); };

    struct MatrixCase {
        DType dtype;
        Product kind;
    };
    for (const MatrixCase c : {MatrixCase{DType::kBF16, Product::kMatmul}, MatrixCase{DType::kF32, Product::kMatmul},
                               MatrixCase{DType::kF8E4M3, Product::kMatmul},
                               MatrixCase{DType::kBF16, Product::kCanonical}}) {
        const Weights w = make_weights(c.dtype, 1, rows, cols, 77);
        const std::string what = describe(w, max_rows) + (c.kind == Product::kCanonical ? " canonical" : "");
        GpuMatrix g;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w.matrix(), MatrixWindow::whole(w.matrix()), &g));
        std::vector<Floats> single(sz(max_rows));
        for (int64_t t = 0; t < max_rows; ++t) {
            ASSERT_NO_FATAL_FAILURE(gpu_product(g.w, c.kind, row_of(t), 1, &single[sz(t)]));
        }
        for (int64_t m = 1; m <= max_rows; ++m) {
            Floats y;
            ASSERT_NO_FATAL_FAILURE(gpu_product(g.w, c.kind, Floats(x.begin(), x.begin() + m * cols), m, &y));
            for (int64_t t = 0; t < m; ++t) {
                EXPECT_SAME_BITS(Floats(y.begin() + t * rows, y.begin() + (t + 1) * rows), single[sz(t)],
                                 what + " M " + std::to_string(m) + " row " + std::to_string(t));
            }
        }
        Floats want;
        ASSERT_NO_FATAL_FAILURE(cpu_product(w.matrix(), MatrixWindow::whole(w.matrix()), c.kind, x, max_rows, &want));
        Floats all;
        for (const Floats &s : single) all.insert(all.end(), s.begin(), s.end());
        if (tensor_core(w)) {
            EXPECT_CLOSE_TO_CPU(all, want, window_bounds(w, MatrixWindow::whole(w.matrix()), x, max_rows),
                                what + " vs the CPU");
        } else {
            EXPECT_SAME_BITS(all, want, what + " vs the CPU");
        }
    }

    // Grouped products (e4m3 and tensor-core bf16): M rows of one expert, against each row alone.
    for (const DType dt : {DType::kF8E4M3, DType::kBF16}) {
        const Weights b = make_weights(dt, 1, rows, cols, 78);
        GpuBank g;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(b.bank(), BankWindow::whole(b.bank()), &g));
        std::vector<Floats> single(sz(max_rows));
        for (int64_t t = 0; t < max_rows; ++t) {
            ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, {0, 1}, row_of(t), 1, Floats(sz(rows), 0.0f), &single[sz(t)]));
        }
        for (int64_t m = 1; m <= max_rows; ++m) {
            Floats y;
            ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, {0, static_cast<int32_t>(m)},
                                                Floats(x.begin(), x.begin() + m * cols), m, Floats(sz(m * rows), 0.0f),
                                                &y));
            for (int64_t t = 0; t < m; ++t) {
                EXPECT_SAME_BITS(Floats(y.begin() + t * rows, y.begin() + (t + 1) * rows), single[sz(t)],
                                 std::string(dtype_name(dt)) + " grouped M " + std::to_string(m) + " row " +
                                     std::to_string(t));
            }
        }
    }
}

// The shapes that take the other paths of the decode and prefill kernels (ops_matmul.cu stream_bf16_kernel,
// gemm_bf16_kernel): many row tiles (4500 rows: several per stream block, a partial 128-row tile), and x too long
// for one block's shared memory (K 14336: 8 tokens take two token tiles, the partials several phases), at 8 tokens
// (decode), 40 (64 x 64 tiles, 64 x 32 canonical and grouped) and 200 (on the H200, 4500 rows take 128 x 128 tiles,
// a partial one; 40 rows 64 x 64). Each token against the token alone, bit for bit; the grouped rows against the
// matrix's (the same weights as expert 0); and the CPU within the tensor-core bound.
TEST(CudaMatmulBatch, DecodeAndTiledShapesKeepTheirBits) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (const auto &[rows, cols] : {std::pair<int64_t, int64_t>{4500, 256}, {40, 14336}}) {
        const Weights w = make_weights(DType::kBF16, 1, rows, cols, 91);
        GpuMatrix gm;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w.matrix(), MatrixWindow::whole(w.matrix()), &gm));
        GpuBank gb;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w.bank(), BankWindow::whole(w.bank()), &gb));
        for (const int64_t tokens : {int64_t{8}, int64_t{40}, int64_t{200}}) {
            const Floats x = activations(tokens, cols, 92);
            const auto row_of = [&](int64_t t) { return Floats(x.begin() + t * cols, x.begin() + (t + 1) * cols); };
            for (const Product kind : {Product::kMatmul, Product::kCanonical}) {
                const std::string what = describe(w, tokens) + (kind == Product::kCanonical ? " canonical" : "");
                Floats all;
                ASSERT_NO_FATAL_FAILURE(gpu_product(gm.w, kind, x, tokens, &all));
                for (int64_t t = 0; t < tokens; ++t) {
                    Floats one;
                    ASSERT_NO_FATAL_FAILURE(gpu_product(gm.w, kind, row_of(t), 1, &one));
                    EXPECT_SAME_BITS(Floats(all.begin() + t * rows, all.begin() + (t + 1) * rows), one,
                                     what + " token " + std::to_string(t) + " vs alone");
                }
                Floats want;
                ASSERT_NO_FATAL_FAILURE(
                    cpu_product(w.matrix(), MatrixWindow::whole(w.matrix()), kind, x, tokens, &want));
                EXPECT_CLOSE_TO_CPU(all, want, window_bounds(w, MatrixWindow::whole(w.matrix()), x, tokens),
                                    what + " vs the CPU");
                if (kind == Product::kMatmul) {
                    Floats grouped;
                    ASSERT_NO_FATAL_FAILURE(gpu_grouped(gb.w, {0, static_cast<int32_t>(tokens)}, x, tokens,
                                                        Floats(sz(tokens * rows), 0.0f), &grouped));
                    EXPECT_SAME_BITS(grouped, all, what + " grouped vs the matrix");
                }
            }
        }
    }
}

// Products of one x by several matrices in one launch (cuda_matmul_multi: the attention's q, k, v and gate, an
// MLP's gate and up): each part's outputs carry the bits of its own product, at every decode width and on each
// kernel wider steps take (9-16 and 17-32 tokens: mma_bf16_kernel's tiles; 33 on: gemm_bf16_kernel's), with parts
// of uneven rows (a part ending inside a row tile and a tile group; K 256 groups 4 row tiles), K whose rows are
// not 16-byte groups (260), and 2 to 4 parts; the output beyond each part's rows stays untouched. What cannot be
// one launch is refused with nothing written.
TEST(CudaMatmulMulti, EveryPartKeepsTheBitsOfItsOwnProduct) {
    MEMRA_SKIP_WITHOUT_GPU();
    struct Case {
        int64_t cols;
        std::vector<int64_t> rows;
    };
    for (const Case &c : {Case{1024, {257, 40, 1000, 96}}, Case{256, {70, 9}}, Case{260, {33, 130, 16}},
                          Case{4096, {1280, 1280}}}) {
        const int n = static_cast<int>(c.rows.size());
        std::vector<Weights> ws;
        std::vector<GpuMatrix> gms(c.rows.size());
        std::vector<const CudaMatrix *> parts;
        for (int i = 0; i < n; ++i) {
            ws.push_back(make_weights(DType::kBF16, 1, c.rows[sz(i)], c.cols, 300 + static_cast<uint32_t>(i)));
            ASSERT_NO_FATAL_FAILURE(gpu_upload(ws.back().matrix(), MatrixWindow::whole(ws.back().matrix()), &gms[sz(i)]));
            parts.push_back(&gms[sz(i)].w);
        }
        for (const int64_t tokens : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 33, 64, 130}) {
            const Floats x = activations(tokens, c.cols, 400 + static_cast<uint32_t>(tokens));
            const DeviceBuffer dx = to_device(x);
            constexpr float kSentinel = -12345.0f;
            std::vector<DeviceBuffer> dys;
            std::vector<float *> ys;
            for (int i = 0; i < n; ++i) {
                // One row of slack past the part's outputs, which must keep the sentinel.
                dys.push_back(to_device(Floats(sz((tokens + 1) * c.rows[sz(i)]), kSentinel)));
                ys.push_back(dys.back().as<float>());
            }
            const cudaError_t err = cuda::cuda_matmul_multi(parts.data(), ys.data(), n, dx.as<float>(), tokens, nullptr);
            ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            for (int i = 0; i < n; ++i) {
                const int64_t rows = c.rows[sz(i)];
                const Floats got = from_device<float>(dys[sz(i)], sz((tokens + 1) * rows));
                Floats want;
                ASSERT_NO_FATAL_FAILURE(gpu_product(gms[sz(i)].w, Product::kMatmul, x, tokens, &want));
                const std::string what = describe(ws[sz(i)], tokens) + " part " + std::to_string(i) + " of " +
                                         std::to_string(n);
                EXPECT_SAME_BITS(Floats(got.begin(), got.begin() + tokens * rows), want, what);
                EXPECT_EQ(std::count(got.begin() + tokens * rows, got.end(), kSentinel), rows) << what;
            }
        }
    }

    // Refused, nothing written: more than 4 parts, K that differs, a matrix that is not bf16.
    const Weights a = make_weights(DType::kBF16, 1, 32, 128, 1);
    const Weights b = make_weights(DType::kBF16, 1, 32, 256, 2);
    const Weights f = make_weights(DType::kF32, 1, 32, 128, 3);
    GpuMatrix ga;
    GpuMatrix gb;
    GpuMatrix gf;
    ASSERT_NO_FATAL_FAILURE(gpu_upload(a.matrix(), MatrixWindow::whole(a.matrix()), &ga));
    ASSERT_NO_FATAL_FAILURE(gpu_upload(b.matrix(), MatrixWindow::whole(b.matrix()), &gb));
    ASSERT_NO_FATAL_FAILURE(gpu_upload(f.matrix(), MatrixWindow::whole(f.matrix()), &gf));
    const DeviceBuffer dx = to_device(activations(9, 256, 5));
    const DeviceBuffer dy = to_device(Floats(9 * 32, 7.0f));
    float *y5[5] = {dy.as<float>(), dy.as<float>(), dy.as<float>(), dy.as<float>(), dy.as<float>()};
    const CudaMatrix *five[5] = {&ga.w, &ga.w, &ga.w, &ga.w, &ga.w};
    const CudaMatrix *mixed_k[2] = {&ga.w, &gb.w};
    const CudaMatrix *mixed_dtype[2] = {&ga.w, &gf.w};
    EXPECT_EQ(cuda::cuda_matmul_multi(five, y5, 5, dx.as<float>(), 1, nullptr), cudaErrorNotSupported);
    EXPECT_EQ(cuda::cuda_matmul_multi(mixed_k, y5, 2, dx.as<float>(), 1, nullptr), cudaErrorNotSupported);
    EXPECT_EQ(cuda::cuda_matmul_multi(mixed_dtype, y5, 2, dx.as<float>(), 1, nullptr), cudaErrorNotSupported);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Floats y = from_device<float>(dy, 9 * 32);
    EXPECT_EQ(std::count(y.begin(), y.end(), 7.0f), 9 * 32);
}

// ---------------------------------------------------------------------------------------------
// Adversarial values, against every instruction path of this CPU.

float from_bits(uint32_t u) { return u32_as_f32(u); }

// bf16 activations: products near FLT_MIN (so FTZ decides), bf16 denormals next to large factors (so DAZ
// decides: a denormal times 2^40 or 2^100 is far from negligible unless it counts as zero), rounding ties,
// overflow, Inf, NaN, zero rows. Weight rows cycle through magnitudes 2^-63, bf16 denormals mixed with 2^-63,
// ordinary values, huge ones, all bf16 denormals, and 2^100.
TEST(CudaMatmulAdversarial, Bf16ActivationsWhereFlushingDecides) {
    MEMRA_SKIP_WITHOUT_GPU();
    const IsaGuard guard;
    const int64_t rows = 24;
    const int64_t k = 96;
    const int64_t n = 10;
    std::mt19937 rng(17);
    const auto near = [&](int e) {  // a value with a random 8-bit mantissa at 2^e, random sign
        const float v = std::ldexp(1.0f + static_cast<float>(rng() % 128) / 128.0f, e - static_cast<int>(rng() % 3));
        return rng() % 2 ? -v : v;
    };
    const auto denormal = [&] {  // a bf16 denormal: m * 2^-133, m in 1..127
        const float v = std::ldexp(static_cast<float>(rng() % 127 + 1), -133);
        return rng() % 2 ? -v : v;
    };
    Weights w = make_weights(DType::kBF16, 1, rows, k, 1);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < k; ++i) {
            float v = 0.0f;
            switch (r % 6) {
                case 0: v = near(-63); break;
                case 1: v = i % 3 == 0 ? denormal() : near(-63); break;
                case 2: v = near(0); break;
                case 3: v = i % 7 == 0 ? 3.0e38f : near(-2); break;
                case 4: v = denormal(); break;
                default: v = near(100); break;
            }
            w.set(r * k + i, v);
        }
    }
    Floats x(sz(n * k));
    for (int64_t i = 0; i < k; ++i) {
        x[sz(0 * k + i)] = near(-63);
        x[sz(1 * k + i)] = i % 2 ? denormal() : near(-63);
        x[sz(2 * k + i)] = from_bits(0x3f808000u + (static_cast<uint32_t>(i % 4) << 16));  // bf16 ties
        x[sz(3 * k + i)] = i % 5 == 0 ? 1.0e38f : near(0);                                  // overflow
        x[sz(4 * k + i)] = i == 17 ? std::numeric_limits<float>::infinity() : near(0);
        x[sz(5 * k + i)] = i == 40 ? std::nanf("") : near(0);
        x[sz(6 * k + i)] = 0.0f;
        x[sz(7 * k + i)] = i % 2 ? -0.0f : near(-64);
        x[sz(8 * k + i)] = denormal();
        x[sz(9 * k + i)] = near(40);
    }
    for (const Product kind : {Product::kMatmul, Product::kCanonical}) {
        GpuMatrix g;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w.matrix(), MatrixWindow::whole(w.matrix()), &g));
        Floats got;
        ASSERT_NO_FATAL_FAILURE(gpu_product(g.w, kind, x, n, &got));
        const std::vector<double> bound = window_bounds(w, MatrixWindow::whole(w.matrix()), x, n);
        for (cpu::ProductIsa isa : supported_isas()) {
            ASSERT_TRUE(cpu::force_product_isa(isa));
            Floats want;
            ASSERT_NO_FATAL_FAILURE(cpu_product(w.matrix(), MatrixWindow::whole(w.matrix()), kind, x, n, &want));
            EXPECT_CLOSE_TO_CPU(got, want, bound, std::string("bf16 adversarial, CPU path ") +
                                                      cpu::product_isa_name(isa) +
                                                      (kind == Product::kCanonical ? " canonical" : ""));
        }
        for (int64_t r = 0; r < rows; ++r) {  // the zero row gives +0, the NaN row NaN
            EXPECT_EQ(bits(got[sz(6 * rows + r)]), 0u) << "zero row, output " << r;
            EXPECT_TRUE(std::isnan(got[sz(5 * rows + r)])) << "NaN row, output " << r;
        }
    }
}

// e4m3 activation groups: an all-zero group (scale 1), a huge value (scale ~2^119; the rest quantizes to zero
// codes, and its product with a denormal weight scale is normal unless DAZ zeroes the scale), groups whose
// amax / 448 underflows (the 2^-149 scale) or is denormal, values at the saturation edge, values on rounding
// ties (scale 1), a partial last group;
// one token with an Inf (scale Inf: NaN codes) and one with a NaN (ignored by amax, a NaN code); the other
// tokens stay finite. Weights: subnormal codes, +-448, -0, one NaN code; scale tiles that are denormal (DAZ),
// tiny (the scale products underflow) and huge (overflow with the huge groups).
TEST(CudaMatmulAdversarial, E4m3GroupsWhereSaturationAndFlushingDecide) {
    MEMRA_SKIP_WITHOUT_GPU();
    const IsaGuard guard;
    const int64_t rows = 37;
    const int64_t n = 6;
    // K 818: a partial last group of 50 (not a multiple of 16: the 16-thread kernel); K 816: of 48 (the skinny
    // kernel).
    for (const int64_t k : {int64_t{6 * 128 + 50}, int64_t{6 * 128 + 48}}) {
        const int64_t block_rows = 16;  // 3 tile rows; tiles 128 wide (e4m3 groups)
        Weights w = make_weights(DType::kF8E4M3, 2, rows, k, 5, false, block_rows, 128);
        std::mt19937 rng(23);
        for (int64_t e = 0; e < 2; ++e) {
            for (int64_t r = 0; r < rows; ++r) {
                for (int64_t i = 0; i < k; ++i) {
                    const int64_t at = (e * rows + r) * k + i;
                    switch ((r + i) % 9) {
                        case 0: w.bytes[sz(at)] = static_cast<uint8_t>(1 + rng() % 7); break;  // subnormal codes
                        case 1: w.bytes[sz(at)] = 0x7e; break;                                  // 448
                        case 2: w.bytes[sz(at)] = 0xfe; break;                                  // -448
                        case 3: w.bytes[sz(at)] = 0x80; break;                                  // -0
                        default: break;
                    }
                }
            }
        }
        w.bytes[sz(3 * k + 5)] = 0x7f;  // a NaN weight in expert 0 row 3
        const int64_t tiles = w.tiles();
        for (int64_t i = 0; i < 2 * tiles; ++i) {
            switch (i % 5) {
                case 0: w.scales[sz(i)] = std::ldexp(1.5f, -130); break;   // denormal: DAZ
                case 1: w.scales[sz(i)] = std::ldexp(1.25f, -100); break;  // scale products underflow
                case 2: w.scales[sz(i)] = std::ldexp(1.0f, 100); break;    // overflow with the huge groups
                default: break;
            }
        }
        Floats x(sz(n * k));
        std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
        // With amax 448 (scale 1): values halfway between e4m3 neighbours (normal, subnormal, across a binade,
        // below 448), half the smallest subnormal, a denormal and zero: ties go to even.
        const std::vector<float> ties = {1.0625f, 1.1875f, std::ldexp(1.5f, -9), std::ldexp(2.5f, -9),
                                          std::ldexp(1.0f, -10), 248.0f, 432.0f, std::ldexp(1.0f, -140),
                                          0.0f, 3.5f, std::ldexp(1.0625f, -5), 17.0f};
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t i = 0; i < k; ++i) {
                const int64_t ci = i / 128;
                const int64_t j = i % 128;
                float v = dist(rng);
                switch ((ci + t) % 6) {  // each token puts the roles in other groups
                    case 0: v = 0.0f; break;
                    case 1: v = j == 3 ? 3.0e38f : v; break;
                    case 2: v = std::ldexp(v, -143); break;  // amax / 448 underflows: scale 2^-149
                    case 3: v = (j % 2 ? 448.0f : 464.0f) * std::ldexp(1.0f, -60) * (v < 0 ? -1.0f : 1.0f); break;
                    case 4: v = std::ldexp(v, -135); break;  // a denormal activation scale
                    default: v = j == 0 ? 448.0f : ties[sz(j) % ties.size()] * (j % 3 == 0 ? -1.0f : 1.0f); break;
                }
                if (t == 4 && ci == 2 && j == 9) v = -std::numeric_limits<float>::infinity();
                if (t == 5 && ci == 4 && j == 11) v = std::nanf("");
                x[sz(t * k + i)] = v;
            }
        }
        // Tokens split over the two experts: 4 rows to expert 0, 2 to expert 1.
        const std::vector<int32_t> offsets = {0, 4, 6};
        GpuBank g;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w.bank(), BankWindow::whole(w.bank()), &g));
        ASSERT_EQ(g.w.act, cuda::ActRounding::kE4m3x128);
        const Floats y_init(sz(n * rows), 0.0f);
        Floats got;
        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, offsets, x, n, y_init, &got));
        int64_t nans = 0;
        int64_t finite = 0;
        for (float v : got) {
            nans += std::isnan(v);
            finite += std::isfinite(v);
        }
        EXPECT_GT(nans, 0);            // the NaN weight, the Inf and NaN tokens reached outputs
        EXPECT_GT(finite, n * rows / 3);  // ... but many stay finite and compare as bits
        for (cpu::ProductIsa isa : supported_isas()) {
            ASSERT_TRUE(cpu::force_product_isa(isa));
            Floats want;
            ASSERT_NO_FATAL_FAILURE(cpu_grouped(w.bank(), BankWindow::whole(w.bank()), offsets, x, n, y_init, &want));
            EXPECT_SAME_BITS(got, want,
                             "e4m3 adversarial K " + std::to_string(k) + ", CPU path " + cpu::product_isa_name(isa));
        }
    }
}

// The exact loop with gradual underflow: denormal weights and activations, products and sums in the denormal
// range (the exact numerics flush nothing), Inf and NaN.
TEST(CudaMatmulAdversarial, ExactLoopKeepsDenormals) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t rows = 20;
    const int64_t k = 200;
    const int64_t n = 4;
    for (const DType dt : {DType::kF32, DType::kF16, DType::kF8E4M3}) {
        Weights w = make_weights(dt, 1, rows, k, 31, true, 32, 48);
        Floats x = activations(n, k, 37, true);
        for (int64_t i = 0; i < k; ++i) {
            x[sz(0 * k + i)] = std::ldexp(x[sz(i)] < 0 ? -1.0f : 1.0f, -75 - static_cast<int>(i % 10));  // underflow
            x[sz(1 * k + i)] = from_bits(static_cast<uint32_t>(i * 37 + 1));                        // denormals
        }
        x[sz(2 * k + 7)] = std::numeric_limits<float>::infinity();
        x[sz(3 * k + 9)] = std::nanf("");
        if (dt == DType::kF32) {  // f32 denormal weights
            for (int64_t i = 0; i < rows * k; i += 3) w.set(i, from_bits(static_cast<uint32_t>(i % 4093 + 1)));
        } else if (dt == DType::kF16) {  // f16 subnormals (2^-24 .. 2^-15)
            for (int64_t i = 0; i < rows * k; i += 3) w.set(i, std::ldexp(static_cast<float>(i % 1023 + 1), -24));
        }
        for (const Product kind : {Product::kMatmul, Product::kCanonical}) {
            ASSERT_NO_FATAL_FAILURE(compare_window(w, MatrixWindow::whole(w.matrix()), kind, x, n,
                                                   describe(w, n) + " adversarial exact"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The comparison can fail: one flipped weight bit or scale changes exactly the outputs it feeds.

// Rows of y [n, rows] that differ from want's.
std::vector<int64_t> differing_rows(const Floats &got, const Floats &want, int64_t n, int64_t rows) {
    std::vector<int64_t> out;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t t = 0; t < n; ++t) {
            if (bits(got[sz(t * rows + r)]) != bits(want[sz(t * rows + r)])) {
                out.push_back(r);
                break;
            }
        }
    }
    return out;
}

TEST(CudaMatmulPerturbed, AFlippedWeightBitOrScaleBreaksTheBits) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t n = 4;
    // bf16 matrix: the lowest mantissa bit of W[5, 17] (against the unperturbed GPU product: the tensor cores'
    // bits are their own).
    {
        const int64_t rows = 24;
        const int64_t k = 256;
        Weights w = make_weights(DType::kBF16, 1, rows, k, 61);
        w.set(5 * k + 17, 1.0f);
        Floats x = activations(n, k, 62);
        for (int64_t t = 0; t < n; ++t) x[sz(t * k + 17)] = 1.0f;
        for (const Product kind : {Product::kMatmul, Product::kCanonical}) {
            Floats want;
            ASSERT_NO_FATAL_FAILURE(cpu_product(w.matrix(), MatrixWindow::whole(w.matrix()), kind, x, n, &want));
            GpuMatrix g;
            ASSERT_NO_FATAL_FAILURE(gpu_upload(w.matrix(), MatrixWindow::whole(w.matrix()), &g));
            Floats before;
            ASSERT_NO_FATAL_FAILURE(gpu_product(g.w, kind, x, n, &before));
            EXPECT_CLOSE_TO_CPU(before, want, window_bounds(w, MatrixWindow::whole(w.matrix()), x, n), "unperturbed");
            const uint16_t flipped = static_cast<uint16_t>(f32_to_bf16(1.0f) ^ 1u);
            ASSERT_EQ(cudaMemcpy(g.buf->as<uint8_t>() + (5 * k + 17) * 2, &flipped, 2, cudaMemcpyHostToDevice),
                      cudaSuccess);
            Floats got;
            ASSERT_NO_FATAL_FAILURE(gpu_product(g.w, kind, x, n, &got));
            EXPECT_EQ(differing_rows(got, before, n, rows), std::vector<int64_t>{5});
        }
    }
    // fp8 bank with e4m3 activations: double the scale of expert 1's tile (row block 0, K chunk 1).
    {
        const int64_t rows = 20;
        const int64_t k = 256;
        const Weights w = make_weights(DType::kF8E4M3, 2, rows, k, 63, false, 16, 128);
        const Floats x = activations(n, k, 64);
        const std::vector<int32_t> offsets = {0, 2, 4};
        const Floats y_init(sz(n * rows), 0.0f);
        Floats want;
        ASSERT_NO_FATAL_FAILURE(cpu_grouped(w.bank(), BankWindow::whole(w.bank()), offsets, x, n, y_init, &want));
        GpuBank g;
        ASSERT_NO_FATAL_FAILURE(gpu_upload(w.bank(), BankWindow::whole(w.bank()), &g));
        Floats got;
        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, offsets, x, n, y_init, &got));
        ASSERT_EQ(mismatches(got, want), 0);
        const int64_t tiles = w.tiles();  // 2 x 2 per expert
        const float doubled = w.scales[sz(tiles + 1)] * 2.0f;
        ASSERT_EQ(cudaMemcpy(const_cast<float *>(g.w.scale_inv) + tiles + 1, &doubled, 4, cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_NO_FATAL_FAILURE(gpu_grouped(g.w, offsets, x, n, y_init, &got));
        // Tokens 2 and 3 (expert 1), rows 0..15 (tile row 0) change; expert 0's tokens do not.
        std::vector<int64_t> expected(16);
        for (int64_t r = 0; r < 16; ++r) expected[sz(r)] = r;
        EXPECT_EQ(differing_rows(got, want, n, rows), expected);
        EXPECT_EQ(mismatches(Floats(got.begin(), got.begin() + 2 * rows), Floats(want.begin(), want.begin() + 2 * rows)),
                  0);
    }
}

}  // namespace
}  // namespace memra
