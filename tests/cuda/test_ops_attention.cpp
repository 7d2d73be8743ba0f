// backend/cuda/ops_attention: the KV write, the query rounding and blocked paged attention against their CPU
// twins in device numerics (cpu::kv_write, cpu::round_rows, cpu::paged_attention with shape.blocked) on the same
// inputs. Every attention case fills its pool twice, with the CPU's kv_write on the host and the GPU's on the
// device, and requires the two pools' bytes to be equal before any attention runs; the query is rounded for the
// key format by both sides (bits compared too). Attention over q8_0 / q5_1 keys (and head dims the tensor cores do
// not take) compares raw bits with the CPU; over f32 / bf16 keys at head_dim 32, 64, 128 the tensor-core kernel is
// held to the CPU within tensor_core_bound on random data and to its bits on exact data
// (TensorCoresGiveTheCpuBitsOnExactData), and to itself bit for bit across launch shapes, batches and row orders.
// Cases cover every K/V format pair, head_dim 32 / 64 / 128 (and 17, 512), GQA groups 1, 4, 8, 12, sequences
// crossing 128-blocks and 512-splits (1100 positions), sliding windows, first_pos > 0 with released pages below
// it, steps mixing decode rows and prefill chunks of several sequences, the gate on and off, masked (-inf) blocks
// and splits, and adversarial values. Results that are NaN compare as NaN only (x86 propagates an operand's
// payload, the GPU returns 0x7fffffff). The GPU tests skip without a GPU; CudaAttentionData.* and
// CudaAttention.RefusesBadArguments run everywhere.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "backend/cpu/ops_attention.h"
#include "backend/cpu/ops_elementwise.h"
#include "backend/cuda/ops_attention.h"
#include "core/float_formats.h"
#include "core/kv_format.h"
#include "core/kv_page.h"
#include "core/quant_blocks.h"
#include "core/thread_pool.h"
#include "cuda/cuda_test_util.h"

namespace memra::cuda {
namespace {

using Floats = std::vector<float>;

constexpr KvFormat kFormats[] = {KvFormat::kF32, KvFormat::kBf16, KvFormat::kQ8_0, KvFormat::kQ5_1};

size_t sz(int64_t n) { return static_cast<size_t>(n); }

uint32_t bits(float f) { return f32_as_u32(f); }

ThreadPool &threads() {
    static ThreadPool pool(std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 16));
    return pool;
}

// Elements whose bits differ; where want is NaN, got need only be NaN. `first` gets the first such index.
int64_t mismatches(const Floats &got, const Floats &want, int64_t *first = nullptr) {
    if (got.size() != want.size()) return -1;
    int64_t n = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const bool same = std::isnan(want[i]) ? std::isnan(got[i]) : bits(got[i]) == bits(want[i]);
        if (!same && n++ == 0 && first != nullptr) *first = static_cast<int64_t>(i);
    }
    return n;
}

// Elements whose bits differ, NaNs included (two results of the same GPU kernel).
int64_t bit_mismatches(const Floats &a, const Floats &b) {
    if (a.size() != b.size()) return -1;
    int64_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += bits(a[i]) != bits(b[i]) ? 1 : 0;
    return n;
}

// The tensor-core kernel (tensor_core_attention: f32 / bf16 keys at head_dim 32, 64, 128) against the CPU's
// blocked order: every element within tol of the CPU's, NaN where the CPU's is NaN and infinite with its sign where
// the CPU's is. The largest difference seen is kept for the message.
struct Closeness {
    int64_t outside = 0;
    int64_t first = -1;
    double max_err = 0.0;
};

Closeness closeness(const Floats &got, const Floats &want, float tol) {
    Closeness c;
    if (got.size() != want.size()) {
        c.outside = -1;
        return c;
    }
    for (size_t i = 0; i < got.size(); ++i) {
        bool ok = false;
        if (std::isnan(want[i]) || std::isinf(want[i])) {
            ok = std::isnan(want[i]) ? std::isnan(got[i]) : got[i] == want[i];
        } else if (std::isfinite(got[i])) {
            const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
            c.max_err = std::max(c.max_err, err);
            ok = err <= tol;
        }
        if (!ok && c.outside++ == 0) c.first = static_cast<int64_t>(i);
    }
    return c;
}

Floats uniform(size_t n, uint32_t seed, float lo, float hi) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    Floats v(n);
    for (float &x : v) x = dist(rng);
    return v;
}

// Rows that stress the encoders and roundings, by row index: plain values; a wide exponent range (subnormals to
// 2^100); zeros of both signs; subnormals only; a NaN and both infinities; bf16 ties and q8_0 code ties
// (x * 127 / amax = k + 0.5); constant blocks (q5_1 scale 0); huge values (fp16 scale overflow).
Floats adversarial_rows(int64_t n_rows, int64_t d, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::uniform_int_distribution<int> expo(-140, 100);
    Floats x(sz(n_rows * d));
    for (int64_t r = 0; r < n_rows; ++r) {
        float *row = x.data() + r * d;
        for (int64_t j = 0; j < d; ++j) {
            float v = 2.0f * unit(rng);
            switch (r % 8) {
                case 0: break;
                case 1: v = std::ldexp(unit(rng), expo(rng)); break;
                case 2: v = (j % 3 == 0) ? -0.0f : 0.0f; break;
                case 3: v = std::ldexp(unit(rng), -135); break;
                case 4:
                    if (j == 1) v = std::numeric_limits<float>::quiet_NaN();
                    if (j == d / 2) v = std::numeric_limits<float>::infinity();
                    if (j == d - 1) v = -std::numeric_limits<float>::infinity();
                    break;
                case 5: {
                    const float ties[] = {127.0f, 2.5f, -3.5f, 0.5f, -0.5f, u32_as_f32(0x3f808000u),
                                          u32_as_f32(0xbf818000u), 1.0f};
                    v = ties[j % 8];
                    break;
                }
                case 6: v = 0.75f; break;
                case 7: v = (j % 2 == 0 ? 1.0f : -3.0f) * std::ldexp(1.0f, 100 + static_cast<int>(j % 27)); break;
            }
            row[j] = v;
        }
    }
    return x;
}

// ---- Pools. ----

KvPageLayout layout_of(const KvPoolSpec &spec) {
    auto layout = kv_page_layout(spec);
    EXPECT_TRUE(layout.has_value());
    return layout ? *layout : KvPageLayout{};
}

// A pool of two layers of one geometry, on the host and (unless host_only) on the device, both zero-filled (as
// the engine's pages are); the tests address layer 1, so the layer offsets matter.
struct Pool {
    static constexpr int kLayer = 1;
    KvPoolSpec spec;
    KvPageLayout layout;
    int64_t n_bytes;
    std::vector<std::byte> host;
    std::optional<DeviceBuffer> device;

    Pool(KvFormat k_format, KvFormat v_format, int64_t n_pages, int64_t n_kv_heads, int64_t head_dim,
         bool host_only = false)
        : spec{k_format, v_format, n_pages,
               {KvPoolLayer{static_cast<int>(n_kv_heads), static_cast<int>(head_dim)},
                KvPoolLayer{static_cast<int>(n_kv_heads), static_cast<int>(head_dim)}}},
          layout(layout_of(spec)),
          n_bytes(kv_pool_bytes(spec, layout)),
          host(sz(n_bytes), std::byte{0}) {
        if (!host_only) {
            device.emplace(sz(n_bytes));
            device->upload(host.data());
        }
    }

    cpu::PagedLayer layer(std::byte *base) const {
        const auto l = static_cast<size_t>(kLayer);
        return cpu::PagedLayer{base,
                               spec.n_pages,
                               layout.page_bytes,
                               layout.k_offset[l],
                               layout.v_offset[l],
                               layout.k_row_bytes[l],
                               layout.v_row_bytes[l],
                               spec.k_format,
                               spec.v_format};
    }
    cpu::PagedLayer host_layer() { return layer(host.data()); }
    cpu::PagedLayer device_layer() const { return layer(device->as<std::byte>()); }
    int64_t row_elems() const { return layout.row_elems[static_cast<size_t>(kLayer)]; }

    std::vector<std::byte> device_bytes() const {
        std::vector<std::byte> b(sz(n_bytes));
        device->download(b.data());
        return b;
    }
};

// Sets every NaN fp16 field of the block formats' rows (q8_0's scale, q5_1's scale and minimum) to one NaN code.
// A NaN input makes the scale by arithmetic on a NaN (amax / 127, (hi - lo) / 31), whose payload x86 keeps and
// the GPU replaces by 0x7fffffff, so those fields compare as NaN only; every other byte compares exactly.
void canonicalize_nan_scales(const Pool &pool, std::vector<std::byte> &bytes) {
    auto fix = [&](size_t at) {
        uint16_t h;
        std::memcpy(&h, bytes.data() + at, 2);
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0) {
            h = 0x7e00u;
            std::memcpy(bytes.data() + at, &h, 2);
        }
    };
    for (int64_t page = 0; page < pool.spec.n_pages; ++page) {
        for (size_t l = 0; l < pool.spec.layers.size(); ++l) {
            const std::pair<KvFormat, int64_t> regions[] = {{pool.spec.k_format, pool.layout.k_offset[l]},
                                                            {pool.spec.v_format, pool.layout.v_offset[l]}};
            for (const auto &[format, offset] : regions) {
                if (!kv_format_is_block(format)) continue;
                const auto block = static_cast<int64_t>(format == KvFormat::kQ8_0 ? sizeof(BlockQ8_0)
                                                                                  : sizeof(BlockQ5_1));
                const int64_t n_blocks = kKvPageRows * pool.layout.row_elems[l] / kQuantBlock;
                for (int64_t b = 0; b < n_blocks; ++b) {
                    const auto at = static_cast<size_t>(page * pool.layout.page_bytes + offset + b * block);
                    fix(at);                                     // d
                    if (format == KvFormat::kQ5_1) fix(at + 2);  // m
                }
            }
        }
    }
}

// Index of the first byte where the device pool differs from the host pool (NaN scales by class), or -1.
int64_t first_byte_difference(const Pool &pool) {
    std::vector<std::byte> dev = pool.device_bytes();
    std::vector<std::byte> host = pool.host;
    canonicalize_nan_scales(pool, dev);
    canonicalize_nan_scales(pool, host);
    for (size_t i = 0; i < dev.size(); ++i) {
        if (dev[i] != host[i]) return static_cast<int64_t>(i);
    }
    return -1;
}

// Writes rows k, v [n, row_elems] into `slots` with the CPU's kv_write (host pool) and the GPU's (device pool);
// returns the GPU's error flag.
int32_t write_both(Pool &pool, const Floats &k, const Floats &v, const std::vector<int32_t> &slots) {
    const auto n = static_cast<int64_t>(slots.size());
    cpu::kv_write(threads(), pool.host_layer(), pool.row_elems(), k.data(), v.data(), slots.data(), n);
    DeviceBuffer d_k = to_device(k), d_v = to_device(v), d_slots = to_device(slots);
    DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
    EXPECT_EQ(kv_write(pool.device_layer(), pool.row_elems(), d_k.as<float>(), d_v.as<float>(),
                       d_slots.as<int32_t>(), n, d_flag.as<int32_t>(), nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return from_device<int32_t>(d_flag, 1)[0];
}

// ---- Attention cases. ----

struct Config {
    KvFormat k_format = KvFormat::kBf16;
    KvFormat v_format = KvFormat::kBf16;
    int64_t n_heads = 8;
    int64_t n_kv_heads = 2;
    int64_t head_dim = 128;
    int64_t window = 0;
    int64_t first_pos = 0;
    bool gate = true;
    std::vector<int64_t> lengths;                      // positions of each sequence
    std::vector<std::pair<int32_t, int64_t>> queries;  // (sequence, position) of each query row
    uint32_t seed = 1;
};

std::string describe(const Config &c) {
    std::string lengths;
    for (int64_t l : c.lengths) lengths += fmt::format(" {}", l);
    return fmt::format("K {} V {} heads {}/{} head_dim {} window {} first_pos {} {} lengths{}",
                       kv_format_name(c.k_format), kv_format_name(c.v_format), c.n_heads, c.n_kv_heads, c.head_dim,
                       c.window, c.first_pos, c.gate ? "gated" : "ungated", lengths);
}

bool on_tensor_cores(const Config &c) { return tensor_core_attention(c.k_format, c.head_dim); }

struct Seq {
    int64_t n_pos = 0;
    std::vector<int32_t> pages;  // [blocks] page of block b, -1 below first_pos (released)
    Floats k, v;                 // [n_pos, n_kv_heads * head_dim]
};

// One call's query side: rows, positions, sequence indices, gate logits and block tables.
struct Queries {
    Floats q;                  // [n, n_heads * head_dim], before the query rounding
    std::vector<int64_t> pos;  // [n]
    std::vector<int32_t> seq;  // [n]
    Floats gate;               // [n, n_heads], or empty: no gate
    std::vector<int32_t> bt;   // [n_seqs, bt_stride]
    int64_t bt_stride = 1;
    int64_t n_seqs = 1;
    int64_t n() const { return static_cast<int64_t>(pos.size()); }
};

struct Case {
    Config cfg;
    cpu::AttentionShape shape;
    RowRounding rounding = RowRounding::kBf16;
    std::vector<Seq> seqs;
    Queries queries;  // every query of the config, over every sequence's block table
    int64_t n_pages = 0;
    int64_t q_row() const { return shape.n_heads * shape.head_dim; }
    int64_t row() const { return shape.n_kv_heads * shape.head_dim; }
};

// The query rounding for a key format (ENGINE.md section 4): bf16 over f32 and bf16 keys, q8_0 blocks over the
// block formats.
RowRounding rounding_for(KvFormat k_format) {
    return kv_format_is_block(k_format) ? RowRounding::kQ8 : RowRounding::kBf16;
}

// Sequences with random K/V in [-2, 2] whose blocks take shuffled page ids (two spare pages stay unused);
// blocks wholly below first_pos have no page. q in [-2, 2], gate logits in [-4, 4].
Case make_case(const Config &cfg) {
    Case c;
    c.cfg = cfg;
    c.shape = cpu::AttentionShape{cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.window,
                                  cpu::attention_scale(cfg.head_dim), true};
    c.rounding = rounding_for(cfg.k_format);
    int64_t n_blocks = 0;
    for (int64_t len : cfg.lengths) n_blocks += (len + kKvPageRows - 1) / kKvPageRows;
    c.n_pages = n_blocks + 2;
    std::vector<int32_t> ids(sz(c.n_pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(cfg.seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    size_t next = 0;
    int64_t max_blocks = 1;
    for (size_t s = 0; s < cfg.lengths.size(); ++s) {
        Seq seq;
        seq.n_pos = cfg.lengths[s];
        const int64_t blocks = (seq.n_pos + kKvPageRows - 1) / kKvPageRows;
        for (int64_t b = 0; b < blocks; ++b) {
            const int32_t id = ids[next++];
            seq.pages.push_back((b + 1) * kKvPageRows <= cfg.first_pos ? -1 : id);
        }
        max_blocks = std::max(max_blocks, blocks);
        const uint32_t seed = cfg.seed * 101u + static_cast<uint32_t>(s) * 7u;
        seq.k = uniform(sz(seq.n_pos * c.row()), seed + 1, -2.0f, 2.0f);
        seq.v = uniform(sz(seq.n_pos * c.row()), seed + 2, -2.0f, 2.0f);
        c.seqs.push_back(std::move(seq));
    }
    Queries &qs = c.queries;
    qs.bt_stride = max_blocks;
    qs.n_seqs = static_cast<int64_t>(c.seqs.size());
    qs.bt.assign(sz(qs.n_seqs * max_blocks), -1);
    for (size_t s = 0; s < c.seqs.size(); ++s) {
        std::copy(c.seqs[s].pages.begin(), c.seqs[s].pages.end(), qs.bt.begin() + static_cast<int64_t>(s) * max_blocks);
    }
    for (const auto &[s, p] : cfg.queries) {
        qs.seq.push_back(s);
        qs.pos.push_back(p);
    }
    qs.q = uniform(sz(qs.n() * c.q_row()), cfg.seed * 13u + 5u, -2.0f, 2.0f);
    if (cfg.gate) qs.gate = uniform(sz(qs.n() * cfg.n_heads), cfg.seed * 17u + 3u, -4.0f, 4.0f);
    return c;
}

// The rows of every position that has a page, with their slots.
struct Rows {
    Floats k, v;
    std::vector<int32_t> slots;
};

Rows stored_rows(const Case &c) {
    Rows r;
    const int64_t row = c.row();
    for (const Seq &s : c.seqs) {
        for (int64_t p = 0; p < s.n_pos; ++p) {
            const int32_t page = s.pages[sz(p / kKvPageRows)];
            if (page < 0) continue;
            r.k.insert(r.k.end(), s.k.begin() + p * row, s.k.begin() + (p + 1) * row);
            r.v.insert(r.v.end(), s.v.begin() + p * row, s.v.begin() + (p + 1) * row);
            r.slots.push_back(static_cast<int32_t>(page * kKvPageRows + p % kKvPageRows));
        }
    }
    return r;
}

// Fills the case's pool with both kv_writes and checks that their bytes agree.
void fill_both(const Case &c, Pool &pool) {
    const Rows r = stored_rows(c);
    EXPECT_EQ(write_both(pool, r.k, r.v, r.slots), 0) << describe(c.cfg);
    EXPECT_EQ(first_byte_difference(pool), -1) << "kv_write bytes, " << describe(c.cfg);
}

// The CPU reference: cpu::round_rows, then cpu::paged_attention in the blocked order over the host pool.
Floats cpu_run(const Case &c, Pool &pool, const Queries &qs) {
    Floats q = qs.q;
    if (qs.n() > 0) cpu::round_rows(threads(), q.data(), qs.n(), c.q_row(), c.rounding);
    Floats out(sz(qs.n() * c.q_row()), -7.0f);
    cpu::paged_attention(threads(), c.shape, q.data(), c.q_row(), qs.pos.data(), qs.seq.data(), qs.n(),
                         pool.host_layer(), qs.bt.data(), qs.bt_stride, qs.n_seqs, c.cfg.first_pos,
                         qs.gate.empty() ? nullptr : qs.gate.data(), c.shape.n_heads, out.data());
    return out;
}

struct GpuRun {
    Floats q_rounded;  // the query after cuda::round_rows
    Floats out;
    int32_t flag = 0;
};

// The GPU: cuda::round_rows, then cuda::paged_attention over the device pool, with a split workspace for `ctas`
// or without.
GpuRun gpu_run_mode(const Case &c, const Pool &pool, const Queries &qs, bool split,
                    SplitCtas ctas = SplitCtas::kSplits) {
    DeviceBuffer d_q = to_device(qs.q), d_pos = to_device(qs.pos), d_seq = to_device(qs.seq);
    DeviceBuffer d_bt = to_device(qs.bt), d_gate = to_device(qs.gate);
    DeviceBuffer d_out(sz(qs.n() * c.q_row()) * sizeof(float));
    DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
    const int64_t ws_floats = split ? paged_attention_split_floats(c.shape, qs.n(), qs.bt_stride, ctas) : 0;
    DeviceBuffer d_ws(sz(std::max<int64_t>(ws_floats, 1)) * sizeof(float));
    EXPECT_EQ(round_rows(d_q.as<float>(), qs.n(), c.q_row(), c.rounding, nullptr), cudaSuccess);
    EXPECT_EQ(paged_attention(c.shape, d_q.as<float>(), c.q_row(), d_pos.as<int64_t>(), d_seq.as<int32_t>(), qs.n(),
                              pool.device_layer(), d_bt.as<int32_t>(), qs.bt_stride, qs.n_seqs, c.cfg.first_pos,
                              qs.gate.empty() ? nullptr : d_gate.as<float>(), c.shape.n_heads, d_out.as<float>(),
                              d_flag.as<int32_t>(), nullptr, split ? d_ws.as<float>() : nullptr, ws_floats, ctas),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    GpuRun r;
    r.q_rounded = from_device<float>(d_q, sz(qs.n() * c.q_row()));
    r.out = from_device<float>(d_out, sz(qs.n() * c.q_row()));
    r.flag = from_device<int32_t>(d_flag, 1)[0];
    return r;
}

// Every launch shape: one cluster (or tensor-core CTA) per work item over every split, and split-KV (every case
// with a range past 512 positions splits, on the tensor cores up to 128 queries; a larger step runs the one launch
// again) with a CTA per split and with a CTA per block of 128 positions (the tensor-core kernel; the others run that
// by splits). They must give the same bits (NaN rows as NaN) and flags; the result is returned once.
GpuRun gpu_run(const Case &c, const Pool &pool, const Queries &qs) {
    GpuRun whole = gpu_run_mode(c, pool, qs, false);
    if (qs.n() > 0 && qs.bt_stride * kKvPageRows > 512) {
        EXPECT_GT(paged_attention_split_floats(c.shape, qs.n(), qs.bt_stride), 0) << describe(c.cfg);
        for (const SplitCtas ctas : {SplitCtas::kSplits, SplitCtas::kBlocks}) {
            const GpuRun split = gpu_run_mode(c, pool, qs, true, ctas);
            const char *how = ctas == SplitCtas::kSplits ? "a CTA per split" : "a CTA per block";
            EXPECT_EQ(bit_mismatches(split.out, whole.out), 0)
                << "split-KV, " << how << ", against one launch, " << describe(c.cfg);
            EXPECT_EQ(split.flag, whole.flag) << "split-KV flag, " << how << ", " << describe(c.cfg);
        }
    }
    return whole;
}

// The bound of the tensor-core kernel against the CPU: 2^-7 of the largest |v| of the case. A p on the other side
// of a bf16 rounding tie from the CPU's moves one weight by 2^-8 of itself; the different orders of the dot
// products and sums move the results by far less (measured: see the messages of EveryFormatPair).
float tensor_core_bound(const Case &c) {
    float v_max = 0.0f;
    for (const Seq &s : c.seqs) {
        for (float x : s.v) {
            if (std::isfinite(x)) v_max = std::max(v_max, std::fabs(x));
        }
    }
    return std::ldexp(v_max, -7);
}

// The GPU's result against the CPU's bits (NaN as NaN).
void expect_cpu_bits(const Case &c, const Floats &got, const Floats &want, const std::string &what) {
    int64_t first = -1;
    EXPECT_EQ(mismatches(got, want, &first), 0)
        << what << "; first at query " << (first < 0 ? -1 : first / c.q_row()) << " head "
        << (first < 0 ? -1 : first % c.q_row() / c.cfg.head_dim) << ": got " << (first < 0 ? 0.0f : got[sz(first)])
        << " want " << (first < 0 ? 0.0f : want[sz(first)]);
}

// The GPU's result against the CPU's: bits (NaN as NaN), or on the tensor cores within tensor_core_bound.
void expect_near_cpu(const Case &c, const Floats &got, const Floats &want, const std::string &what) {
    if (!on_tensor_cores(c.cfg)) {
        expect_cpu_bits(c, got, want, what);
        return;
    }
    const float tol = tensor_core_bound(c);
    const Closeness cl = closeness(got, want, tol);
    EXPECT_EQ(cl.outside, 0) << what << "; tensor cores, bound " << tol << ", largest difference " << cl.max_err
                             << "; first at query " << (cl.first < 0 ? -1 : cl.first / c.q_row()) << ": got "
                             << (cl.first < 0 ? 0.0f : got[sz(cl.first)]) << " want "
                             << (cl.first < 0 ? 0.0f : want[sz(cl.first)]);
    std::printf("[ tc ] %s: largest difference %.3g (bound %.3g)\n", what.c_str(), cl.max_err, tol);
}

// Fills both pools, runs every query of the case on both sides and requires the same bits.
void expect_case_matches(const Config &cfg) {
    const Case c = make_case(cfg);
    Pool pool(cfg.k_format, cfg.v_format, c.n_pages, cfg.n_kv_heads, cfg.head_dim);
    fill_both(c, pool);
    const Floats want = cpu_run(c, pool, c.queries);
    const GpuRun got = gpu_run(c, pool, c.queries);
    Floats q_want = c.queries.q;
    cpu::round_rows(threads(), q_want.data(), c.queries.n(), c.q_row(), c.rounding);
    EXPECT_EQ(mismatches(got.q_rounded, q_want), 0) << "query rounding, " << describe(cfg);
    expect_near_cpu(c, got.out, want, describe(cfg));
    EXPECT_EQ(got.flag, 0) << describe(cfg);
}

// Queries of sequence s at the given positions (those in [first_pos, length) only).
void add_queries(Config &cfg, int32_t s, std::initializer_list<int64_t> positions) {
    for (int64_t p : positions) {
        if (p >= cfg.first_pos && p < cfg.lengths[sz(s)]) cfg.queries.emplace_back(s, p);
    }
}

void add_query_range(Config &cfg, int32_t s, int64_t p0, int64_t p1) {
    for (int64_t p = std::max(p0, cfg.first_pos); p < p1 && p < cfg.lengths[sz(s)]; ++p) cfg.queries.emplace_back(s, p);
}

// Three sequences of 1100, 300 and `third` positions; queries: rows of sequence 0 on both sides of the block and
// split boundaries (decode-like rows), a prefill chunk of sequence 1, and the first and last rows of sequence 2.
Config mixed_step(KvFormat kf, KvFormat vf, int64_t third = 1) {
    Config cfg;
    cfg.k_format = kf;
    cfg.v_format = vf;
    cfg.lengths = {1100, 300, third};
    return cfg;
}

void add_mixed_queries(Config &cfg) {
    add_queries(cfg, 0, {cfg.first_pos, 127, 128, 511, 512, 513, 700, 1023, 1024, 1099});
    add_query_range(cfg, 1, 282, 300);
    add_queries(cfg, 2, {cfg.first_pos, cfg.lengths[2] - 1});
}

// The perturbation cases: the mixed step with K in `kf`, and the byte of position 700's K row (sequence 0, kv
// head 0) that they change: byte 2 is q8_0's first code, the low byte of q5_1's fp16 minimum, a byte of value 0
// (f32: bits 16-23) or of value 1 (bf16: its low byte).
Config perturbation_config(KvFormat kf) {
    Config cfg = mixed_step(kf, KvFormat::kQ5_1);
    cfg.seed = 600;
    add_mixed_queries(cfg);
    return cfg;
}

size_t perturbed_byte(const Case &c, const Pool &pool) {
    const int64_t slot = c.seqs[0].pages[700 / kKvPageRows] * kKvPageRows + 700 % kKvPageRows;
    return sz(pool.layout.k_at(Pool::kLayer, slot) + 2);
}

bool sees_perturbed_key(const Case &c, int64_t i) { return c.queries.seq[sz(i)] == 0 && c.queries.pos[sz(i)] >= 700; }

// ---- Tests that run everywhere. ----

// The data can fail the comparison: a flipped key byte changes the CPU result of exactly the rows that see it.
TEST(CudaAttentionData, PerturbedKeyChangesTheRowsThatSeeIt) {
    for (KvFormat kf : kFormats) {
        const Case c = make_case(perturbation_config(kf));
        Pool pool(kf, c.cfg.v_format, c.n_pages, c.cfg.n_kv_heads, c.cfg.head_dim, /*host_only=*/true);
        const Rows r = stored_rows(c);
        cpu::kv_write(threads(), pool.host_layer(), pool.row_elems(), r.k.data(), r.v.data(), r.slots.data(),
                      static_cast<int64_t>(r.slots.size()));
        const Floats before = cpu_run(c, pool, c.queries);
        pool.host[perturbed_byte(c, pool)] ^= std::byte{0x41};
        const Floats after = cpu_run(c, pool, c.queries);
        for (int64_t i = 0; i < c.queries.n(); ++i) {
            const Floats a(before.begin() + i * c.q_row(), before.begin() + (i + 1) * c.q_row());
            const Floats b(after.begin() + i * c.q_row(), after.begin() + (i + 1) * c.q_row());
            if (sees_perturbed_key(c, i)) {
                EXPECT_GT(mismatches(b, a), 0) << kv_format_name(kf) << " query " << i;
            } else {
                EXPECT_EQ(mismatches(b, a), 0) << kv_format_name(kf) << " query " << i;
            }
        }
    }
}

TEST(CudaAttention, RefusesBadArguments) {
    // Checked on the host before any CUDA call, so this runs without a GPU too.
    Pool pool(KvFormat::kQ8_0, KvFormat::kQ5_1, 2, 2, 64, /*host_only=*/true);
    const cpu::PagedLayer layer = pool.host_layer();  // a non-null base; nothing is launched
    const cpu::AttentionShape good{8, 2, 64, 0, cpu::attention_scale(64), true};
    float f = 0.0f;
    int64_t pos = 0;
    int32_t i32 = 0;
    auto attend = [&](const cpu::AttentionShape &s, const cpu::PagedLayer &l, int64_t q_stride, int64_t n_q,
                      const float *gate, int64_t gate_stride) {
        return paged_attention(s, &f, q_stride, &pos, &i32, n_q, l, &i32, 1, 1, 0, gate, gate_stride, &f, nullptr,
                               nullptr);
    };
    EXPECT_EQ(attend(good, layer, 512, 0, nullptr, 0), cudaSuccess);  // no work, no launch
    cpu::AttentionShape s = good;
    s.blocked = false;
    EXPECT_EQ(attend(s, layer, 512, 1, nullptr, 0), cudaErrorInvalidValue);
    s = good;
    s.head_dim = 0;
    EXPECT_EQ(attend(s, layer, 512, 1, nullptr, 0), cudaErrorInvalidValue);
    s = good;
    s.n_heads = 6;
    s.n_kv_heads = 4;
    EXPECT_EQ(attend(s, layer, 512, 1, nullptr, 0), cudaErrorInvalidValue);
    s = good;
    s.window = -1;
    EXPECT_EQ(attend(s, layer, 512, 1, nullptr, 0), cudaErrorInvalidValue);
    s = good;
    s.head_dim = 32;  // the layer's rows hold heads of 64
    EXPECT_EQ(attend(s, layer, 512, 1, nullptr, 0), cudaErrorInvalidValue);
    EXPECT_EQ(attend(good, layer, 511, 1, nullptr, 0), cudaErrorInvalidValue);  // q_stride < 8 * 64
    EXPECT_EQ(attend(good, layer, 512, 1, &f, 7), cudaErrorInvalidValue);       // gate_stride < n_heads
    cpu::PagedLayer l = layer;
    l.k_row_bytes += 2;
    EXPECT_EQ(attend(good, l, 512, 1, nullptr, 0), cudaErrorInvalidValue);
    l = layer;
    l.base = nullptr;
    EXPECT_EQ(attend(good, l, 512, 1, nullptr, 0), cudaErrorInvalidValue);
    EXPECT_EQ(paged_attention(good, &f, 512, &pos, &i32, 1, layer, &i32, 0, 1, 0, nullptr, 0, &f, nullptr, nullptr),
              cudaErrorInvalidValue);  // bt_stride 0
    EXPECT_EQ(paged_attention(good, &f, 512, &pos, &i32, 1, layer, &i32, 1, 1, -1, nullptr, 0, &f, nullptr, nullptr),
              cudaErrorInvalidValue);  // first_pos < 0
    // Tensor-core keys: a block table of 2^31 positions (the kernel's tiles keep positions as i32).
    Pool bf16_pool(KvFormat::kBf16, KvFormat::kBf16, 2, 2, 64, /*host_only=*/true);
    const int64_t too_many_pages = int64_t{1} << 25;  // 2^31 positions exactly
    EXPECT_EQ(paged_attention(good, &f, 512, &pos, &i32, 1, bf16_pool.host_layer(), &i32, too_many_pages, 1, 0, nullptr,
                              0, &f, nullptr, nullptr),
              cudaErrorInvalidValue);

    EXPECT_EQ(kv_write(layer, 128, &f, &f, &i32, 0, nullptr, nullptr), cudaSuccess);
    EXPECT_EQ(kv_write(layer, 96, &f, &f, &i32, 1, nullptr, nullptr), cudaErrorInvalidValue);   // row bytes
    EXPECT_EQ(kv_write(layer, 128, &f, &f, &i32, -1, nullptr, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(kv_write(layer, 128, nullptr, &f, &i32, 1, nullptr, nullptr), cudaErrorInvalidValue);

    EXPECT_EQ(round_rows(&f, 1, 33, RowRounding::kQ8, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(round_rows(&f, -1, 32, RowRounding::kBf16, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(round_rows(nullptr, 1, 32, RowRounding::kBf16, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(round_rows(&f, 1, 33, RowRounding::kNone, nullptr), cudaSuccess);
    EXPECT_EQ(round_rows(&f, 0, 32, RowRounding::kQ8, nullptr), cudaSuccess);
}

// ---- GPU against CPU. ----

TEST(CudaAttention, RoundRowsEqualCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    struct Shape {
        int64_t n_rows, d;
    };
    for (RowRounding r : {RowRounding::kNone, RowRounding::kBf16, RowRounding::kQ8}) {
        for (Shape s : {Shape{1, 32}, Shape{7, 96}, Shape{16, 4096}, Shape{1, 1}, Shape{9, 17}}) {
            if (r == RowRounding::kQ8 && s.d % 32 != 0) continue;
            const Floats x = adversarial_rows(s.n_rows, s.d, static_cast<uint32_t>(s.n_rows * 31 + s.d));
            Floats want = x;
            cpu::round_rows(threads(), want.data(), s.n_rows, s.d, r);
            DeviceBuffer d_x = to_device(x);
            ASSERT_EQ(round_rows(d_x.as<float>(), s.n_rows, s.d, r, nullptr), cudaSuccess);
            const Floats got = from_device<float>(d_x, x.size());
            int64_t first = -1;
            EXPECT_EQ(mismatches(got, want, &first), 0)
                << "rounding " << static_cast<int>(r) << " rows " << s.n_rows << " d " << s.d << " first " << first;
            if (r != RowRounding::kQ8) {
                EXPECT_EQ(bit_mismatches(got, want), 0);  // integer code only: NaNs compare by bits too
            }
        }
    }
}

// The bf16 rounding (the hardware conversion with the CPU's NaN) over every sign, exponent and bf16 mantissa, each
// with the dropped 16 bits at zero, the smallest and largest values, just below, at and above the tie: all bits.
TEST(CudaAttention, RoundBf16EveryHighHalf) {
    MEMRA_SKIP_WITHOUT_GPU();
    constexpr uint32_t kLow[] = {0x0000u, 0x0001u, 0x3fffu, 0x7fffu, 0x8000u, 0x8001u, 0xc000u, 0xffffu};
    Floats x;
    x.reserve(sz(65536) * std::size(kLow));
    for (uint32_t high = 0; high < 65536; ++high) {
        for (uint32_t low : kLow) x.push_back(u32_as_f32(high << 16 | low));
    }
    Floats want = x;
    cpu::round_rows(threads(), want.data(), 1, static_cast<int64_t>(want.size()), RowRounding::kBf16);
    DeviceBuffer d_x = to_device(x);
    ASSERT_EQ(round_rows(d_x.as<float>(), 1, static_cast<int64_t>(x.size()), RowRounding::kBf16, nullptr), cudaSuccess);
    EXPECT_EQ(bit_mismatches(from_device<float>(d_x, x.size()), want), 0);
}

TEST(CudaAttention, KvWriteBytesEqualCpu) {
    MEMRA_SKIP_WITHOUT_GPU();
    struct Geometry {
        int64_t n_kv_heads, head_dim;
    };
    for (KvFormat kf : kFormats) {
        for (KvFormat vf : kFormats) {
            for (Geometry g : {Geometry{1, 32}, Geometry{3, 128}, Geometry{2, 17}}) {
                if ((kv_format_is_block(kf) || kv_format_is_block(vf)) && g.head_dim % 32 != 0) continue;
                Pool pool(kf, vf, 3, g.n_kv_heads, g.head_dim);
                const int64_t row = pool.row_elems();
                const int64_t n = 70;  // more rows than a page, in shuffled slots of all three pages
                std::vector<int32_t> slots(3 * kKvPageRows);
                std::iota(slots.begin(), slots.end(), 0);
                std::mt19937 rng(static_cast<uint32_t>(row));
                std::shuffle(slots.begin(), slots.end(), rng);
                slots.resize(sz(n));
                const Floats k = adversarial_rows(n, row, 11u + static_cast<uint32_t>(row));
                Floats v = adversarial_rows(n, row, 12u + static_cast<uint32_t>(row));
                std::rotate(v.begin(), v.begin() + 3 * row, v.end());  // V rows of other kinds than K's
                EXPECT_EQ(write_both(pool, k, v, slots), 0);
                EXPECT_EQ(first_byte_difference(pool), -1)
                    << kv_format_name(kf) << "/" << kv_format_name(vf) << " heads " << g.n_kv_heads << " head_dim "
                    << g.head_dim;
            }
        }
    }
}

// attention_prologue against the three launches it replaces (qk_norm_rope, kv_write, round_rows; each held to the
// CPU's bits by its own tests): every K/V format pair and query rounding, f32 and bf16 norm weights, head_dim 128
// and 64, q rows wider than their heads, with and without a RoPE table, a token at a position outside the table
// and one in a slot outside the pool (both flagged, both skipped alike). q, k and the two pools compare by bits.
TEST(CudaAttention, PrologueEqualsItsThreeLaunches) {
    MEMRA_SKIP_WITHOUT_GPU();
    const int64_t n = 6, n_heads = 8, n_kv = 2, n_positions = 50, n_pages = 2;
    uint32_t seed = 40;
    for (int64_t hd : {int64_t{128}, int64_t{64}}) {
        for (KvFormat kf : kFormats) {
            for (KvFormat vf : kFormats) {
                for (RowRounding r : {RowRounding::kNone, RowRounding::kBf16, RowRounding::kQ8}) {
                    ++seed;
                    const bool table = seed % 3 != 0;
                    const bool bf16_w = seed % 2 == 0;
                    const int64_t q_stride = n_heads * hd + 32;
                    const Floats q = adversarial_rows(n, q_stride, seed);
                    const Floats k = uniform(sz(n * n_kv * hd), seed + 1, -3.0f, 3.0f);
                    const Floats v = adversarial_rows(n, n_kv * hd, seed + 2);
                    const Floats cos = uniform(sz(n_positions * hd / 2), seed + 3, -1.0f, 1.0f);
                    const Floats sin = uniform(sz(n_positions * hd / 2), seed + 4, -1.0f, 1.0f);
                    const Floats wq = uniform(sz(hd), seed + 5, -0.5f, 0.5f),
                                 wk = uniform(sz(hd), seed + 6, -0.5f, 0.5f);
                    std::vector<uint16_t> wq16(sz(hd)), wk16(sz(hd));
                    for (size_t i = 0; i < sz(hd); ++i) {
                        wq16[i] = f32_to_bf16(wq[i]);
                        wk16[i] = f32_to_bf16(wk[i]);
                    }
                    std::vector<int64_t> pos = {3, n_positions, 0, 49, 17, 8};  // token 1 outside the table
                    std::vector<int32_t> slots = {5, 70, 127, 0, int32_t{n_pages * kKvPageRows},
                                                  64};  // token 4 outside
                    DeviceBuffer d_wq = bf16_w ? to_device(wq16) : to_device(wq);
                    DeviceBuffer d_wk = bf16_w ? to_device(wk16) : to_device(wk);
                    DeviceBuffer d_cos = to_device(cos), d_sin = to_device(sin), d_pos = to_device(pos);
                    DeviceBuffer d_v = to_device(v), d_slots = to_device(slots);
                    const DType wt = bf16_w ? DType::kBF16 : DType::kF32;
                    struct Run {
                        Floats q, k;
                        std::vector<std::byte> pool;
                        int32_t flag;
                    };
                    const auto run = [&](bool fused) {
                        Pool pool(kf, vf, n_pages, n_kv, hd);
                        DeviceBuffer d_q = to_device(q), d_k = to_device(k);
                        DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
                        const QkHeads hq{d_q.as<float>(), q_stride, n_heads, wt, d_wq.as<void>()};
                        const QkHeads hk{d_k.as<float>(), n_kv * hd, n_kv, wt, d_wk.as<void>()};
                        const RopeRows rope{table ? d_cos.as<float>() : nullptr, d_sin.as<float>(), n_positions, hd / 2,
                                            d_pos.as<int64_t>()};
                        if (fused) {
                            EXPECT_EQ(attention_prologue(hq, hk, d_v.as<float>(), n_kv * hd, n, hd, 1e-6f, rope, r,
                                                         pool.device_layer(), d_slots.as<int32_t>(),
                                                         d_flag.as<int32_t>(), nullptr),
                                      cudaSuccess);
                        } else {
                            EXPECT_EQ(qk_norm_rope(hq, hk, n, hd, 1e-6f, rope, d_flag.as<int32_t>(), nullptr),
                                      cudaSuccess);
                            EXPECT_EQ(kv_write(pool.device_layer(), pool.row_elems(), d_k.as<float>(), d_v.as<float>(),
                                               d_slots.as<int32_t>(), n, d_flag.as<int32_t>(), nullptr),
                                      cudaSuccess);
                            for (int64_t t = 0; t < n; ++t) {  // the heads of each row, not the columns past them
                                EXPECT_EQ(round_rows(d_q.as<float>() + t * q_stride, 1, n_heads * hd, r, nullptr),
                                          cudaSuccess);
                            }
                        }
                        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
                        return Run{from_device<float>(d_q, q.size()), from_device<float>(d_k, k.size()),
                                   pool.device_bytes(), from_device<int32_t>(d_flag, 1)[0]};
                    };
                    const Run want = run(false), got = run(true);
                    const std::string what =
                        fmt::format("head_dim {} K {} V {} rounding {}{}{}", hd, kv_format_name(kf), kv_format_name(vf),
                                    static_cast<int>(r), table ? "" : " no table", bf16_w ? " bf16 w" : "");
                    EXPECT_EQ(bit_mismatches(got.q, want.q), 0) << what;
                    EXPECT_EQ(bit_mismatches(got.k, want.k), 0) << what;
                    EXPECT_TRUE(got.pool == want.pool) << what;
                    EXPECT_EQ(got.flag, 1) << what;
                    EXPECT_EQ(want.flag, 1) << what;
                }
            }
        }
    }
    // Bad arguments launch nothing.
    Pool pool(KvFormat::kQ8_0, KvFormat::kBf16, 2, 2, 64, /*host_only=*/true);
    float f = 0.0f;
    int32_t i32 = 0;
    const QkHeads h{&f, 8 * 64, 8, DType::kF32, &f};
    const QkHeads hk{&f, 2 * 64, 2, DType::kF32, &f};
    const auto call = [&](const QkHeads &q, const QkHeads &k, int64_t v_stride, int64_t tokens, int64_t hd,
                          RowRounding r, const cpu::PagedLayer &l) {
        return attention_prologue(q, k, &f, v_stride, tokens, hd, 1e-6f, RopeRows{}, r, l, &i32, nullptr, nullptr);
    };
    const cpu::PagedLayer layer = pool.host_layer();
    EXPECT_EQ(call(h, hk, 128, 0, 64, RowRounding::kQ8, layer), cudaSuccess);
    EXPECT_EQ(call(h, hk, 127, 1, 64, RowRounding::kQ8, layer), cudaErrorInvalidValue);  // v_stride < 2 x 64
    EXPECT_EQ(call(h, hk, 128, -1, 64, RowRounding::kQ8, layer), cudaErrorInvalidValue);
    EXPECT_EQ(call(h, QkHeads{&f, 2 * 64, 2, DType::kF16, &f}, 128, 1, 64, RowRounding::kNone, layer),
              cudaErrorInvalidValue);  // f16 norm weights
    EXPECT_EQ(call(h, QkHeads{&f, 2 * 64, 1, DType::kF32, &f}, 128, 1, 64, RowRounding::kNone, layer),
              cudaErrorInvalidValue);  // the layer's rows hold 2 heads
    EXPECT_EQ(call(QkHeads{&f, 8 * 48, 8, DType::kF32, &f}, QkHeads{&f, 2 * 48, 2, DType::kF32, &f}, 96, 1, 48,
                   RowRounding::kNone, layer),
              cudaErrorInvalidValue);  // q8_0 keys of heads of 48
    EXPECT_EQ(call(QkHeads{nullptr, 8 * 64, 8, DType::kF32, &f}, hk, 128, 1, 64, RowRounding::kNone, layer),
              cudaErrorInvalidValue);
    EXPECT_EQ(attention_prologue(h, hk, &f, 128, 1, 64, 1e-6f, RopeRows{&f, &f, 10, 33, nullptr}, RowRounding::kNone,
                                 layer, &i32, nullptr, nullptr),
              cudaErrorInvalidValue);  // a half of 33 rotates 66 dims of a 64-wide head
}

TEST(CudaAttention, KvWriteSkipsABadSlotAndRaisesTheFlag) {
    MEMRA_SKIP_WITHOUT_GPU();
    Pool pool(KvFormat::kQ8_0, KvFormat::kBf16, 2, 2, 64);
    const int64_t row = pool.row_elems();
    const Floats k = uniform(sz(3 * row), 5, -2.0f, 2.0f), v = uniform(sz(3 * row), 6, -2.0f, 2.0f);
    // The CPU writes rows 0 and 2; the GPU gets row 1 too, with a slot past the pool (the CPU would abort).
    const std::vector<int32_t> good = {5, 100};
    const Floats k_good = [&] {
        Floats x(k.begin(), k.begin() + row);
        x.insert(x.end(), k.begin() + 2 * row, k.end());
        return x;
    }();
    const Floats v_good = [&] {
        Floats x(v.begin(), v.begin() + row);
        x.insert(x.end(), v.begin() + 2 * row, v.end());
        return x;
    }();
    cpu::kv_write(threads(), pool.host_layer(), row, k_good.data(), v_good.data(), good.data(), 2);
    DeviceBuffer d_k = to_device(k), d_v = to_device(v), d_slots = to_device(std::vector<int32_t>{5, 128, 100});
    DeviceBuffer d_flag = to_device(std::vector<int32_t>{0});
    ASSERT_EQ(kv_write(pool.device_layer(), row, d_k.as<float>(), d_v.as<float>(), d_slots.as<int32_t>(), 3,
                       d_flag.as<int32_t>(), nullptr),
              cudaSuccess);
    EXPECT_EQ(from_device<int32_t>(d_flag, 1)[0], 1);
    EXPECT_EQ(first_byte_difference(pool), -1);
}

// Every K/V format pair: head_dim 128, GQA 4, sequences of 1100 (3 splits, 9 blocks), 300 and 1 positions in one
// step with decode-like rows and a prefill chunk, gated.
std::vector<Config> format_pair_configs() {
    std::vector<Config> out;
    uint32_t seed = 1;
    for (KvFormat kf : kFormats) {
        for (KvFormat vf : kFormats) {
            Config cfg = mixed_step(kf, vf);
            cfg.seed = seed++;
            add_mixed_queries(cfg);
            out.push_back(cfg);
        }
    }
    return out;
}

TEST(CudaAttention, EveryFormatPair) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (const Config &cfg : format_pair_configs()) expect_case_matches(cfg);
}

// head_dim 64 / 128 x GQA 1 / 4 x window 0 / 300 x first_pos 0 / 200 x gate on / off, the format pair cycling.
std::vector<Config> shape_configs() {
    const std::pair<KvFormat, KvFormat> pairs[] = {{KvFormat::kBf16, KvFormat::kBf16},
                                                   {KvFormat::kQ8_0, KvFormat::kQ5_1},
                                                   {KvFormat::kF32, KvFormat::kQ8_0},
                                                   {KvFormat::kQ5_1, KvFormat::kF32}};
    std::vector<Config> out;
    uint32_t seed = 100;
    for (int64_t head_dim : {64, 128}) {
        for (int64_t ratio : {1, 4}) {
            for (int64_t window : {0, 300}) {
                for (int64_t first_pos : {0, 200}) {
                    for (bool gate : {true, false}) {
                        Config cfg = mixed_step(pairs[seed % 4].first, pairs[seed % 4].second, 230);
                        cfg.seed = seed++;
                        cfg.head_dim = head_dim;
                        cfg.n_kv_heads = 2;
                        cfg.n_heads = 2 * ratio;
                        cfg.window = window;
                        cfg.first_pos = first_pos;
                        cfg.gate = gate;
                        add_mixed_queries(cfg);
                        out.push_back(cfg);
                    }
                }
            }
        }
    }
    return out;
}

TEST(CudaAttention, Shapes) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (const Config &cfg : shape_configs()) expect_case_matches(cfg);
}

// Shapes past Step-3.5's: a group of 12 (two head batches of 8 and 4, as the sliding layers' 96 / 8), head_dim 17
// (partial dot lanes; f32 / bf16 only), head_dim 512 (the opt-in shared memory size, 4 value chains per thread),
// a single kv head, head_dim 96 (block-format runs starting inside a 32-block: 8 and 24), head_dim 2 (cluster
// CTAs that own no dims), head_dim 200 (4 value chains per thread, not all used).
std::vector<Config> other_shape_configs() {
    struct Shape {
        int64_t n_heads, n_kv_heads, head_dim, window;
        KvFormat kf, vf;
    };
    std::vector<Config> out;
    uint32_t seed = 300;
    for (Shape s : {Shape{24, 2, 128, 300, KvFormat::kQ8_0, KvFormat::kQ5_1},
                    Shape{12, 1, 128, 0, KvFormat::kBf16, KvFormat::kBf16},
                    Shape{4, 2, 17, 0, KvFormat::kF32, KvFormat::kBf16},
                    Shape{3, 1, 17, 300, KvFormat::kBf16, KvFormat::kF32},
                    Shape{2, 1, 512, 0, KvFormat::kQ5_1, KvFormat::kQ8_0},
                    Shape{2, 2, 512, 300, KvFormat::kF32, KvFormat::kF32},
                    Shape{8, 2, 96, 0, KvFormat::kQ8_0, KvFormat::kQ5_1},
                    Shape{4, 2, 2, 300, KvFormat::kF32, KvFormat::kBf16},
                    Shape{8, 1, 200, 0, KvFormat::kBf16, KvFormat::kF32}}) {
        Config cfg = mixed_step(s.kf, s.vf);
        cfg.seed = seed++;
        cfg.n_heads = s.n_heads;
        cfg.n_kv_heads = s.n_kv_heads;
        cfg.head_dim = s.head_dim;
        cfg.window = s.window;
        add_mixed_queries(cfg);
        out.push_back(cfg);
    }
    return out;
}

TEST(CudaAttention, OtherShapes) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (const Config &cfg : other_shape_configs()) expect_case_matches(cfg);
}

// Data on which the tensor cores' sums are exact, so that the GPU must give the CPU's bits: query head h is one-hot
// (1 at dim h % head_dim), every key value is 0 or -2048 (a score of 0 or -2048 * scale, whose weight is exactly 1
// or underflows to 0, by exp_f32 or the hardware's exp2), the values small integers. Every sum is then an exact count
// or integer sum in any order, and a row's output the mean of the values at the positions its head picks (all of its
// range where it picks none), times the gate: an error in positions, masks, pages, heads, splits or the merge
// changes it.
Case exact_case(const Config &cfg) {
    Case c = make_case(cfg);
    std::mt19937 rng(cfg.seed * 31u + 7u);
    std::uniform_int_distribution<int> pick(0, 3), value(-8, 8);
    for (Seq &s : c.seqs) {
        for (float &x : s.k) x = pick(rng) == 0 ? 0.0f : -2048.0f;
        for (float &x : s.v) x = static_cast<float>(value(rng));
    }
    const int64_t hd = cfg.head_dim;
    for (int64_t i = 0; i < c.queries.n(); ++i) {
        for (int64_t h = 0; h < cfg.n_heads; ++h) {
            for (int64_t d = 0; d < hd; ++d) c.queries.q[sz(i * c.q_row() + h * hd + d)] = d == h % hd ? 1.0f : 0.0f;
        }
    }
    return c;
}

// Every head_dim and group the tensor-core kernel takes, over f32 / bf16 keys and f32 / bf16 / q8_0 values (whose
// decoded values stay exact in these sums), windows, first_pos and the gate cycling; groups of 8 and more at
// head_dim 64 and 128 add a prefill chunk of 100 rows (tiles of many queries; a step of 65 to 128 queries); a group of
// 20 takes two tiles of heads (16 and 4).
TEST(CudaAttention, TensorCoresGiveTheCpuBitsOnExactData) {
    MEMRA_SKIP_WITHOUT_GPU();
    const std::pair<KvFormat, KvFormat> pairs[] = {{KvFormat::kBf16, KvFormat::kBf16},
                                                   {KvFormat::kF32, KvFormat::kQ8_0},
                                                   {KvFormat::kBf16, KvFormat::kF32},
                                                   {KvFormat::kF32, KvFormat::kBf16},
                                                   {KvFormat::kBf16, KvFormat::kQ8_0}};
    uint32_t seed = 900;
    for (int64_t head_dim : {32, 64, 128}) {
        for (int64_t group : {1, 4, 8, 12, 20}) {
            Config cfg = mixed_step(pairs[seed % 5].first, pairs[seed % 5].second, 230);
            cfg.seed = seed++;
            cfg.head_dim = head_dim;
            cfg.n_kv_heads = 2;
            cfg.n_heads = 2 * group;
            cfg.window = seed % 2 == 0 ? 300 : 0;
            cfg.first_pos = seed % 3 == 0 ? 200 : 0;
            cfg.gate = seed % 4 != 0;
            add_mixed_queries(cfg);
            if (group >= 8 && head_dim >= 64) add_query_range(cfg, 0, 900, 1000);
            ASSERT_TRUE(on_tensor_cores(cfg)) << describe(cfg);
            const Case c = exact_case(cfg);
            Pool pool(cfg.k_format, cfg.v_format, c.n_pages, cfg.n_kv_heads, cfg.head_dim);
            fill_both(c, pool);
            const Floats want = cpu_run(c, pool, c.queries);
            const GpuRun got = gpu_run(c, pool, c.queries);
            expect_cpu_bits(c, got.out, want, describe(cfg));
            EXPECT_EQ(got.flag, 0) << describe(cfg);
        }
    }
}

// Extreme scores and values. Keys of -inf (f32 and bf16 caches) make whole blocks and splits masked (the live
// test, alpha = 0, a merge from M = -inf, rows whose every key is masked and come out NaN); block formats cannot
// hold -inf, so there the "masked" keys are -60000, whose weights underflow to 0 beside the others (and tie
// where a row sees only them). A third sequence gets a zero query row (all scores equal), a subnormal one and a
// huge one (scores in the thousands: most weights underflow); an infinite value at position 650 of sequence 0.
Case adversarial_case(KvFormat kf) {
    Config cfg;
    cfg.k_format = kf;
    cfg.v_format = kf == KvFormat::kQ5_1 ? KvFormat::kQ8_0 : KvFormat::kBf16;
    cfg.lengths = {700, 700, 200};
    cfg.seed = 400 + static_cast<uint32_t>(kf);
    add_queries(cfg, 2, {199, 150, 100, 60});  // query rows 0-2: zero, subnormal, huge
    add_queries(cfg, 0, {0, 100, 299, 300, 301, 400, 511, 512, 699});
    add_queries(cfg, 1, {100, 550, 599, 600, 601, 699});
    Case c = make_case(cfg);
    const int64_t row = c.row();
    const float masked = kv_format_is_block(kf) ? -6.0e4f : -std::numeric_limits<float>::infinity();
    std::fill(c.seqs[0].k.begin(), c.seqs[0].k.begin() + 300 * row, masked);  // sequence 0: [0, 300)
    std::fill(c.seqs[1].k.begin(), c.seqs[1].k.begin() + 600 * row, masked);  // sequence 1: [0, 600)
    // On the tensor cores a value a row cannot see still meets that row's p = 0 in the tile's product (0 x Inf =
    // NaN), so values must be finite there (as every written value of a finite model is).
    if (!on_tensor_cores(cfg)) c.seqs[0].v[sz(650 * row + 3)] = std::numeric_limits<float>::infinity();
    for (float &x : c.queries.q) x = std::fabs(x) + 0.5f;  // positive: every masked score is -inf
    const int64_t q_row = c.q_row();
    for (int64_t j = 0; j < q_row; ++j) {
        c.queries.q[sz(j)] = 0.0f;
        c.queries.q[sz(q_row + j)] = std::ldexp(c.queries.q[sz(q_row + j)], -130);
        c.queries.q[sz(2 * q_row + j)] *= 3.0e3f;
    }
    return c;
}

TEST(CudaAttention, AdversarialScores) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (KvFormat kf : kFormats) {
        const Case c = adversarial_case(kf);
        const Config &cfg = c.cfg;
        Pool pool(cfg.k_format, cfg.v_format, c.n_pages, cfg.n_kv_heads, cfg.head_dim);
        fill_both(c, pool);
        const Floats want = cpu_run(c, pool, c.queries);
        const GpuRun got = gpu_run(c, pool, c.queries);
        expect_near_cpu(c, got.out, want, "adversarial " + describe(cfg));
        EXPECT_EQ(got.flag, 0);
        if (!kv_format_is_block(kf)) {  // sequence 0 at position 0 sees only a masked key: NaN on both sides
            const size_t at = sz(4 * c.q_row());
            EXPECT_TRUE(std::isnan(want[at]) && std::isnan(got.out[at])) << kv_format_name(kf);
        }
    }
}

// A row's bits do not depend on the rest of the step: each query alone (its own block table, sequence index 0)
// and the step in reverse order give the same bits as the whole step.
TEST(CudaAttention, RowIndependentOfBatch) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (auto [kf, vf] : {std::pair{KvFormat::kQ8_0, KvFormat::kQ5_1}, std::pair{KvFormat::kBf16, KvFormat::kBf16}}) {
        Config cfg = mixed_step(kf, vf, 70);
        cfg.window = kf == KvFormat::kBf16 ? 300 : 0;
        cfg.seed = 500;
        add_mixed_queries(cfg);
        const Case c = make_case(cfg);
        Pool pool(kf, vf, c.n_pages, cfg.n_kv_heads, cfg.head_dim);
        fill_both(c, pool);
        const Floats all = gpu_run(c, pool, c.queries).out;
        const Queries &qs = c.queries;
        const int64_t q_row = c.q_row();
        Queries reversed = qs;
        for (int64_t i = 0; i < qs.n(); ++i) {
            const int64_t r = qs.n() - 1 - i;
            std::copy(qs.q.begin() + r * q_row, qs.q.begin() + (r + 1) * q_row, reversed.q.begin() + i * q_row);
            std::copy(qs.gate.begin() + r * cfg.n_heads, qs.gate.begin() + (r + 1) * cfg.n_heads,
                      reversed.gate.begin() + i * cfg.n_heads);
            reversed.pos[sz(i)] = qs.pos[sz(r)];
            reversed.seq[sz(i)] = qs.seq[sz(r)];
        }
        const Floats rev = gpu_run(c, pool, reversed).out;
        for (int64_t i = 0; i < qs.n(); ++i) {
            const Seq &s = c.seqs[sz(qs.seq[sz(i)])];
            Queries one;
            one.q.assign(qs.q.begin() + i * q_row, qs.q.begin() + (i + 1) * q_row);
            one.gate.assign(qs.gate.begin() + i * cfg.n_heads, qs.gate.begin() + (i + 1) * cfg.n_heads);
            one.pos = {qs.pos[sz(i)]};
            one.seq = {0};
            one.bt = s.pages;
            one.bt_stride = static_cast<int64_t>(s.pages.size());
            one.n_seqs = 1;
            const Floats alone = gpu_run(c, pool, one).out;
            const Floats in_step(all.begin() + i * q_row, all.begin() + (i + 1) * q_row);
            const int64_t r = qs.n() - 1 - i;
            const Floats in_rev(rev.begin() + r * q_row, rev.begin() + (r + 1) * q_row);
            EXPECT_EQ(bit_mismatches(alone, in_step), 0) << describe(cfg) << " query " << i;
            EXPECT_EQ(bit_mismatches(in_rev, in_step), 0) << describe(cfg) << " query " << i;
        }
    }
}

// The comparison can fail: one key byte changed in the device pool changes the GPU result of exactly the rows
// that see that key, against the unchanged CPU reference.
TEST(CudaAttention, PerturbedKeyIsDetected) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (KvFormat kf : kFormats) {
        const Case c = make_case(perturbation_config(kf));
        const Config &cfg = c.cfg;
        Pool pool(kf, cfg.v_format, c.n_pages, cfg.n_kv_heads, cfg.head_dim);
        fill_both(c, pool);
        // The unchanged reference: the CPU's bits, or on the tensor cores the GPU's own before the change.
        const Floats want = on_tensor_cores(cfg) ? gpu_run(c, pool, c.queries).out : cpu_run(c, pool, c.queries);
        std::vector<std::byte> bytes = pool.device_bytes();
        bytes[perturbed_byte(c, pool)] ^= std::byte{0x41};
        pool.device->upload(bytes.data());
        const GpuRun got = gpu_run(c, pool, c.queries);
        const int64_t heads = cfg.n_heads / cfg.n_kv_heads * cfg.head_dim;  // the outputs of kv head 0's heads
        for (int64_t i = 0; i < c.queries.n(); ++i) {
            const auto at = got.out.begin() + i * c.q_row();
            const auto wat = want.begin() + i * c.q_row();
            const Floats g0(at, at + heads), w0(wat, wat + heads);
            const Floats g1(at + heads, at + c.q_row()), w1(wat + heads, wat + c.q_row());
            if (sees_perturbed_key(c, i)) {
                EXPECT_GT(mismatches(g0, w0), 0) << kv_format_name(kf) << " query " << i;
            } else {
                EXPECT_EQ(mismatches(g0, w0), 0) << kv_format_name(kf) << " query " << i;
            }
            EXPECT_EQ(mismatches(g1, w1), 0) << kv_format_name(kf) << " query " << i;  // other kv heads
        }
    }
}

// The good rows keep the bits of the unbroken step: the CPU's, or on the tensor cores the GPU's own.
void expect_bad_rows_flagged(KvFormat kf, KvFormat vf) {
    Config cfg = mixed_step(kf, vf, 70);
    cfg.seed = 700;
    add_mixed_queries(cfg);
    const Case c = make_case(cfg);
    Pool pool(cfg.k_format, cfg.v_format, c.n_pages, cfg.n_kv_heads, cfg.head_dim);
    fill_both(c, pool);
    const Floats want = on_tensor_cores(cfg) ? gpu_run(c, pool, c.queries).out : cpu_run(c, pool, c.queries);
    for (int what = 0; what < 4; ++what) {
        Queries qs = c.queries;
        if (what == 0) qs.bt[sz(qs.bt_stride + 2)] = -1;                                  // block 2 released
        if (what == 1) qs.bt[sz(qs.bt_stride + 4)] = static_cast<int32_t>(c.n_pages);  // past the pool
        if (what == 2) {
            for (int32_t &s : qs.seq) s = s == 1 ? static_cast<int32_t>(qs.n_seqs) : s;  // no such sequence
        }
        if (what == 3) qs.bt[sz(700 / kKvPageRows)] = -1;  // sequence 0's block 10 released
        const auto bad = [&](int64_t i) {
            return what < 3 ? c.queries.seq[sz(i)] == 1 : c.queries.seq[sz(i)] == 0 && c.queries.pos[sz(i)] >= 640;
        };
        const GpuRun got = gpu_run(c, pool, qs);
        EXPECT_EQ(got.flag, 1) << describe(cfg) << " case " << what;
        for (int64_t i = 0; i < qs.n(); ++i) {
            const Floats g(got.out.begin() + i * c.q_row(), got.out.begin() + (i + 1) * c.q_row());
            const Floats w(want.begin() + i * c.q_row(), want.begin() + (i + 1) * c.q_row());
            if (bad(i)) {
                EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float x) { return std::isnan(x); }))
                    << "case " << what << " query " << i;
            } else {
                EXPECT_EQ(mismatches(g, w), 0) << "case " << what << " query " << i;
            }
        }
    }
}

// Inputs the CPU refuses by aborting: a visible block without a page, a page past the pool, a sequence index
// past the block tables. Those rows come out NaN and raise the flag; the other rows of the step are unaffected.
// Cases 0-2 make every row of sequence 1 bad; case 3 releases a page in sequence 0's second split (positions
// 640-703), so only its rows at 700 and later see it (split-KV stores the refusal in that split's or block's state,
// and the merge meets it after a good split).
TEST(CudaAttention, BadRowsRaiseTheFlag) {
    MEMRA_SKIP_WITHOUT_GPU();
    for (auto [kf, vf] : {std::pair{KvFormat::kQ8_0, KvFormat::kQ5_1}, std::pair{KvFormat::kBf16, KvFormat::kBf16}}) {
        expect_bad_rows_flagged(kf, vf);
    }
}

}  // namespace
}  // namespace memra::cuda
