// Paged attention and the KV write: float64 softmax within a stated tolerance and an independent spelling of
// the documented order (bits) over pools whose pages are out of order, at odd shapes (GQA groups 1-12, head_dim
// 32-128, sequences spanning several pages, windowed and full); a query's bits do not depend on the other
// queries and sequences of the call, the page ids or the thread count; missing pages, first_pos, the KV
// formats (reading through a format is exactly decoding), kv_write's bytes, and the per-head sigmoid gate. The
// blocked (device) order likewise: a scalar spelling of it bit for bit over every KV format, blocks and splits
// crossed by full and windowed rows, each of its rounding points and its split merge shown to change bits,
// float64 within bf16 tolerance, and the same invariances. Its SIMD paths (product_isa) give the portable path's
// bits over every KV format pair, odd head_dims, GQA groups, windows, first_pos and adversarial values, and their
// exp and bf16 rounding lanes are held to exp_f32 and f32_to_bf16 over a large sample of all floats.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/ops_attention.h"
#include "core/kv_format.h"
#include "core/kv_page.h"
#include "core/math.h"
#include "cpu/ops_test_util.h"

namespace memra::cpu::test {
namespace {

// A host pool of two layers with the same geometry; the tests use layer 1, so layer offsets matter. Every
// byte starts as 0xFF, a NaN in f32, bf16 and the block formats' fp16 scales: a row read that was never
// written turns the output into NaN.
struct HostPool {
    KvPoolSpec spec;
    KvPageLayout layout;
    std::vector<std::byte> bytes;

    static constexpr int kLayer = 1;

    HostPool(KvFormat k_format, KvFormat v_format, int64_t n_pages, int64_t n_kv_heads, int64_t head_dim) {
        const KvPoolLayer l{static_cast<int>(n_kv_heads), static_cast<int>(head_dim)};
        spec = KvPoolSpec{k_format, v_format, n_pages, {l, l}};
        auto lay = kv_page_layout(spec);
        EXPECT_TRUE(lay.has_value());
        layout = *lay;
        bytes.assign(static_cast<size_t>(kv_pool_bytes(spec, layout)), std::byte{0xFF});
    }

    PagedLayer layer() {
        const auto l = static_cast<size_t>(kLayer);
        return PagedLayer{bytes.data(),          spec.n_pages,          layout.page_bytes, layout.k_offset[l],
                          layout.v_offset[l],    layout.k_row_bytes[l], layout.v_row_bytes[l], spec.k_format,
                          spec.v_format};
    }
    int64_t row_elems() const { return layout.row_elems[static_cast<size_t>(kLayer)]; }

    // Encodes a K and a V row into a slot, with kv_encode at the layout's offsets (not through kv_write).
    void put(int64_t slot, const float *k, const float *v) {
        kv_encode(spec.k_format, k, row_elems(), bytes.data() + layout.k_at(kLayer, slot));
        kv_encode(spec.v_format, v, row_elems(), bytes.data() + layout.v_at(kLayer, slot));
    }
};

// One sequence: its K/V rows for positions [0, n_pos) and the pages of its logical blocks.
struct Seq {
    int64_t n_pos = 0;
    std::vector<int32_t> pages;  // [blocks] page of block b (positions [64 b, 64 b + 64)), -1 = released
    std::vector<float> k, v;     // [n_pos, n_kv_heads * head_dim]
};

struct Query {
    int32_t seq = 0;
    int64_t pos = 0;
};

// A call of the kernel: the shape, the sequences, the queries (q rows and gates).
struct Case {
    AttentionShape shape;
    std::vector<Seq> seqs;
    std::vector<Query> queries;
    std::vector<float> q;     // [n_q, n_heads * head_dim]
    std::vector<float> gate;  // [n_q, n_heads]

    int64_t row() const { return shape.n_kv_heads * shape.head_dim; }
    int64_t q_row() const { return shape.n_heads * shape.head_dim; }
    int64_t n_q() const { return static_cast<int64_t>(queries.size()); }
    int64_t max_blocks() const {
        size_t b = 1;
        for (const Seq &s : seqs) b = std::max(b, s.pages.size());
        return static_cast<int64_t>(b);
    }
    // [n_seqs, max_blocks] i32, -1 past a sequence's blocks.
    std::vector<int32_t> block_tables() const {
        const auto mb = static_cast<size_t>(max_blocks());
        std::vector<int32_t> bt(seqs.size() * mb, -1);
        for (size_t s = 0; s < seqs.size(); ++s) {
            std::copy(seqs[s].pages.begin(), seqs[s].pages.end(), bt.begin() + static_cast<int64_t>(s * mb));
        }
        return bt;
    }
    int64_t lowest_visible(int64_t pos, int64_t first_pos) const {
        return shape.window > 0 ? std::max(first_pos, pos - shape.window + 1) : first_pos;
    }
};

// Sequences of the given lengths with random K/V in [-2, 2]; each sequence's blocks take pages from `pages`
// in turn (so a caller chooses out-of-order and interleaved page ids). Queries: every position of every
// sequence, random q in [-2, 2] and gate logits in [-4, 4].
Case make_case(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t window,
               const std::vector<int64_t> &lengths, const std::vector<int32_t> &pages, uint32_t seed) {
    Case c;
    c.shape = AttentionShape{n_heads, n_kv_heads, head_dim, window, attention_scale(head_dim)};
    size_t next_page = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
        Seq seq;
        seq.n_pos = lengths[s];
        for (int64_t b = 0; b < (lengths[s] + kKvPageRows - 1) / kKvPageRows; ++b) {
            seq.pages.push_back(pages.at(next_page++));
        }
        const auto n = static_cast<size_t>(lengths[s] * c.row());
        seq.k = random_floats(n, seed + 10 * static_cast<uint32_t>(s) + 1, -2.0f, 2.0f);
        seq.v = random_floats(n, seed + 10 * static_cast<uint32_t>(s) + 2, -2.0f, 2.0f);
        c.seqs.push_back(std::move(seq));
        for (int64_t p = 0; p < lengths[s]; ++p) c.queries.push_back(Query{static_cast<int32_t>(s), p});
    }
    c.q = random_floats(static_cast<size_t>(c.n_q() * c.q_row()), seed + 3, -2.0f, 2.0f);
    c.gate = random_floats(static_cast<size_t>(c.n_q() * n_heads), seed + 4, -4.0f, 4.0f);
    return c;
}

int64_t max_page(const Case &c) {
    int32_t m = 0;
    for (const Seq &s : c.seqs) {
        for (int32_t p : s.pages) m = std::max(m, p);
    }
    return m;
}

// A pool holding the case's rows in its pages (positions >= from only; the others stay NaN bytes).
HostPool fill_pool(const Case &c, KvFormat k_format, KvFormat v_format, int64_t from = 0) {
    HostPool pool(k_format, v_format, max_page(c) + 1, c.shape.n_kv_heads, c.shape.head_dim);
    for (const Seq &s : c.seqs) {
        for (int64_t p = from; p < s.n_pos; ++p) {
            const int32_t page = s.pages[static_cast<size_t>(p / kKvPageRows)];
            if (page < 0) continue;
            pool.put(page * kKvPageRows + p % kKvPageRows, s.k.data() + p * c.row(), s.v.data() + p * c.row());
        }
    }
    return pool;
}

// Runs queries [q0, q1) of the case in one call over every sequence's block table.
std::vector<float> run(ThreadPool &threads, const Case &c, HostPool &pool, bool with_gate, int64_t first_pos = 0,
                       int64_t q0 = 0, int64_t q1 = -1) {
    if (q1 < 0) q1 = c.n_q();
    std::vector<int64_t> pos;
    std::vector<int32_t> seq;
    for (int64_t i = q0; i < q1; ++i) {
        pos.push_back(c.queries[static_cast<size_t>(i)].pos);
        seq.push_back(c.queries[static_cast<size_t>(i)].seq);
    }
    const std::vector<int32_t> bt = c.block_tables();
    std::vector<float> out(static_cast<size_t>((q1 - q0) * c.q_row()), -7.0f);
    paged_attention(threads, c.shape, c.q.data() + q0 * c.q_row(), c.q_row(), pos.data(), seq.data(), q1 - q0,
                    pool.layer(), bt.data(), c.max_blocks(), static_cast<int64_t>(c.seqs.size()), first_pos,
                    with_gate ? c.gate.data() + q0 * c.shape.n_heads : nullptr, c.shape.n_heads, out.data());
    return out;
}

// Query i alone: one call whose block table holds only its own sequence.
std::vector<float> run_alone(ThreadPool &threads, const Case &c, HostPool &pool, int64_t i, bool with_gate) {
    const Query &qi = c.queries[static_cast<size_t>(i)];
    const Seq &s = c.seqs[static_cast<size_t>(qi.seq)];
    const int64_t pos = qi.pos;
    const int32_t seq0 = 0;
    std::vector<float> out(static_cast<size_t>(c.q_row()), -7.0f);
    paged_attention(threads, c.shape, c.q.data() + i * c.q_row(), c.q_row(), &pos, &seq0, 1, pool.layer(),
                    s.pages.data(), static_cast<int64_t>(s.pages.size()), 1, 0,
                    with_gate ? c.gate.data() + i * c.shape.n_heads : nullptr, c.shape.n_heads, out.data());
    return out;
}

std::vector<float> rows_of(const std::vector<float> &v, int64_t r0, int64_t r1, int64_t width) {
    return std::vector<float>(v.begin() + r0 * width, v.begin() + r1 * width);
}

// float64 softmax attention over the case's f32 rows (no gate), keys [lowest_visible, pos].
std::vector<double> reference_f64(const Case &c, int64_t first_pos = 0) {
    const int64_t H = c.shape.n_heads, G = c.shape.n_kv_heads, D = c.shape.head_dim;
    std::vector<double> out;
    for (int64_t i = 0; i < c.n_q(); ++i) {
        const Query &qi = c.queries[static_cast<size_t>(i)];
        const Seq &s = c.seqs[static_cast<size_t>(qi.seq)];
        const int64_t lo = c.lowest_visible(qi.pos, first_pos);
        for (int64_t h = 0; h < H; ++h) {
            const int64_t g = h / (H / G);
            std::vector<double> sc;
            double m = -std::numeric_limits<double>::infinity();
            for (int64_t p = lo; p <= qi.pos; ++p) {
                double dot = 0.0;
                for (int64_t d = 0; d < D; ++d) {
                    dot += static_cast<double>(c.q[static_cast<size_t>(i * c.q_row() + h * D + d)]) *
                           s.k[static_cast<size_t>(p * c.row() + g * D + d)];
                }
                sc.push_back(dot / std::sqrt(static_cast<double>(D)));
                m = std::max(m, sc.back());
            }
            std::vector<double> o(static_cast<size_t>(D), 0.0);
            double l = 0.0;
            for (size_t n = 0; n < sc.size(); ++n) {
                const double e = std::exp(sc[n] - m);
                l += e;
                const int64_t p = lo + static_cast<int64_t>(n);
                for (int64_t d = 0; d < D; ++d) {
                    o[static_cast<size_t>(d)] += e * s.v[static_cast<size_t>(p * c.row() + g * D + d)];
                }
            }
            for (int64_t d = 0; d < D; ++d) out.push_back(o[static_cast<size_t>(d)] / l);
        }
    }
    return out;
}

// The documented order (ops_attention.h), spelled independently over the case's f32 rows: scores into a
// vector, their max, then exp, sum and weighted values in increasing position, one division, the gate.
std::vector<float> reference_bits(const Case &c, bool with_gate) {
    const int64_t H = c.shape.n_heads, G = c.shape.n_kv_heads, D = c.shape.head_dim;
    std::vector<float> out;
    for (int64_t i = 0; i < c.n_q(); ++i) {
        const Query &qi = c.queries[static_cast<size_t>(i)];
        const Seq &s = c.seqs[static_cast<size_t>(qi.seq)];
        const int64_t lo = c.lowest_visible(qi.pos, 0);
        for (int64_t h = 0; h < H; ++h) {
            const int64_t g = h / (H / G);
            const float *qv = c.q.data() + i * c.q_row() + h * D;
            std::vector<float> sc;
            for (int64_t p = lo; p <= qi.pos; ++p) {
                sc.push_back(canonical_dot(qv, s.k.data() + p * c.row() + g * D, D) * c.shape.scale);
            }
            float m = -std::numeric_limits<float>::infinity();
            for (float x : sc) m = std::max(m, x);
            std::vector<float> o(static_cast<size_t>(D), 0.0f);
            float l = 0.0f;
            for (size_t n = 0; n < sc.size(); ++n) {
                const float e = exp_f32(sc[n] - m);
                l = l + e;
                const float *vv = s.v.data() + (lo + static_cast<int64_t>(n)) * c.row() + g * D;
                for (int64_t d = 0; d < D; ++d) o[static_cast<size_t>(d)] = o[static_cast<size_t>(d)] + e * vv[d];
            }
            for (int64_t d = 0; d < D; ++d) {
                float r = o[static_cast<size_t>(d)] / l;
                if (with_gate) r = r * sigmoid_f32(c.gate[static_cast<size_t>(i * H + h)]);
                out.push_back(r);
            }
        }
    }
    return out;
}

// The case with every K and V row replaced by what the formats store: kv_decode(kv_encode(row)).
Case as_stored(const Case &c, KvFormat k_format, KvFormat v_format) {
    Case stored = c;
    std::vector<std::byte> buf(static_cast<size_t>(c.row() * 4));
    for (Seq &s : stored.seqs) {
        for (int64_t p = 0; p < s.n_pos; ++p) {
            kv_encode(k_format, s.k.data() + p * c.row(), c.row(), buf.data());
            kv_decode(k_format, buf.data(), c.row(), s.k.data() + p * c.row());
            kv_encode(v_format, s.v.data() + p * c.row(), c.row(), buf.data());
            kv_decode(v_format, buf.data(), c.row(), s.v.data() + p * c.row());
        }
    }
    return stored;
}

float rne_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// The rounding points and the split length of the blocked order (ops_attention.h). The defaults are the kernel's;
// a reference with one point changed shows that the kernel implements that point (its bits differ from it).
struct BlockedVariant {
    bool round_p = true;            // P_p = bf16(e_p) before P * V
    bool round_v = true;            // every value to bf16
    bool round_f32_keys = true;     // f32 / bf16 cache keys to bf16
    bool round_block_keys = false;  // q8_0 / q5_1 cache keys to bf16 (the kernel does not)
    int64_t split = 512;            // positions per split, aligned to 0
};

// The blocked order spelled independently over plain arrays: `stored` holds the rows as the formats keep them
// (as_stored) and k_format says which keys the order rounds. For each query and head: every visible score into
// a vector, then each split from a fresh state over its blocks (explicit position ranges), the merge of the
// splits left to right, one division, the gate.
std::vector<float> reference_blocked(const Case &stored, KvFormat k_format, bool with_gate,
                                     const BlockedVariant &var = {}) {
    const Case &c = stored;
    const int64_t H = c.shape.n_heads, G = c.shape.n_kv_heads, D = c.shape.head_dim;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const bool block_keys = k_format == KvFormat::kQ8_0 || k_format == KvFormat::kQ5_1;
    const bool round_keys = block_keys ? var.round_block_keys : var.round_f32_keys;
    std::vector<float> out;
    for (int64_t i = 0; i < c.n_q(); ++i) {
        const Query &qi = c.queries[static_cast<size_t>(i)];
        const Seq &s = c.seqs[static_cast<size_t>(qi.seq)];
        const int64_t lo = c.lowest_visible(qi.pos, 0);
        for (int64_t h = 0; h < H; ++h) {
            const int64_t g = h / (H / G);
            const float *qv = c.q.data() + i * c.q_row() + h * D;
            auto key = [&](int64_t p) {
                std::vector<float> k(s.k.begin() + p * c.row() + g * D, s.k.begin() + p * c.row() + (g + 1) * D);
                if (round_keys) {
                    for (float &x : k) x = rne_bf16(x);
                }
                return k;
            };
            auto value = [&](int64_t p) {
                std::vector<float> v(s.v.begin() + p * c.row() + g * D, s.v.begin() + p * c.row() + (g + 1) * D);
                if (var.round_v) {
                    for (float &x : v) x = rne_bf16(x);
                }
                return v;
            };
            std::vector<float> sc;  // sc[p - lo]
            for (int64_t p = lo; p <= qi.pos; ++p) sc.push_back(canonical_dot(qv, key(p).data(), D) * c.shape.scale);
            float big_m = neg_inf, big_l = 0.0f;
            std::vector<float> big_acc;
            for (int64_t t = lo / var.split; t <= qi.pos / var.split; ++t) {
                const int64_t t0 = std::max(lo, t * var.split), t1 = std::min(qi.pos, t * var.split + var.split - 1);
                float m = neg_inf, l = 0.0f;
                std::vector<float> acc(static_cast<size_t>(D), 0.0f);
                for (int64_t b = t0 / 128; b <= t1 / 128; ++b) {
                    const int64_t b0 = std::max(t0, b * 128), b1 = std::min(t1, b * 128 + 127);
                    float bm = neg_inf;
                    for (int64_t p = b0; p <= b1; ++p) bm = std::max(bm, sc[static_cast<size_t>(p - lo)]);
                    const float m_new = std::max(m, bm);
                    if (m_new == neg_inf) continue;
                    const float alpha = m == neg_inf ? 0.0f : exp_f32(m - m_new);
                    std::vector<float> e;
                    float sum = 0.0f;
                    for (int64_t p = b0; p <= b1; ++p) {
                        e.push_back(exp_f32(sc[static_cast<size_t>(p - lo)] - m_new));
                        sum = sum + e.back();
                    }
                    l = l * alpha + sum;
                    for (float &x : acc) x = x * alpha;
                    for (int64_t p = b0; p <= b1; ++p) {
                        const float e_p = e[static_cast<size_t>(p - b0)];
                        const float w = var.round_p ? rne_bf16(e_p) : e_p;
                        const std::vector<float> v = value(p);
                        for (size_t d = 0; d < acc.size(); ++d) acc[d] = acc[d] + w * v[d];
                    }
                    m = m_new;
                }
                if (t0 == lo) {
                    big_m = m;
                    big_l = l;
                    big_acc = acc;
                    continue;
                }
                const float m_next = std::max(big_m, m);
                const float a = exp_f32(big_m - m_next), b = exp_f32(m - m_next);
                big_l = big_l * a + l * b;
                for (size_t d = 0; d < acc.size(); ++d) big_acc[d] = big_acc[d] * a + acc[d] * b;
                big_m = m_next;
            }
            for (const float x : big_acc) {
                float r = x / big_l;
                if (with_gate) r = r * sigmoid_f32(c.gate[static_cast<size_t>(i * H + h)]);
                out.push_back(r);
            }
        }
    }
    return out;
}

// Sequences of 1, 17, 70 and 200 positions (1, 1, 2 and 4 pages), pages out of order and interleaved.
const std::vector<int64_t> kLengths{1, 17, 70, 200};
const std::vector<int32_t> kPages{9, 3, 5, 2, 7, 0, 11, 4};

struct Geometry {
    int64_t n_heads, n_kv_heads, head_dim, window;
};
// GQA groups 1, 2, 3 and 12 (past the kernel's batch of 8 query heads per work item), head_dim 32-128,
// full and windowed (windows inside a page, across pages, and longer than some sequences).
constexpr Geometry kGeometries[] = {{4, 4, 32, 0},   {6, 3, 64, 16},  {6, 2, 128, 0},
                                    {24, 2, 64, 0},  {12, 1, 32, 100}, {8, 4, 128, 65}};

TEST(OpsPagedAttention, MatchesFloat64) {
    // |out - out64| over outputs that are weighted means of values in [-2, 2]. Observed worst case 8.6e-7 over
    // these cases (and 5.9e-7 in KeysBelowFirstPosAreNeverRead); the bound 2e-6 is about 17 float ulps at 1.
    ThreadPool pool(3);
    uint32_t seed = 10;
    for (const Geometry &g : kGeometries) {
        const Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, kLengths, kPages, seed += 10);
        HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
        const std::vector<float> got = run(pool, c, kv, false);
        const std::vector<double> want = reference_f64(c);
        ASSERT_EQ(got.size(), want.size());
        double worst = 0.0;
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
        EXPECT_LT(worst, 2e-6) << "heads " << g.n_heads << "/" << g.n_kv_heads << " head_dim " << g.head_dim
                               << " window " << g.window;
        EXPECT_GT(worst, 0.0);  // a result that never rounds would be suspect
    }
}

TEST(OpsPagedAttention, BitsFollowTheDocumentedOrder) {
    ThreadPool pool(2);
    uint32_t seed = 100;
    for (const Geometry &g : kGeometries) {
        const Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, kLengths, kPages, seed += 10);
        HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
        MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, false), reference_bits(c, false)) << g.n_heads << " " << g.head_dim;
        MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true), reference_bits(c, true)) << g.n_heads << " " << g.head_dim;
    }
    // More visible keys than the kernel keeps pass-1 scores for (2048): the rest are scored again in pass 2.
    Case c = make_case(3, 1, 32, 0, {2100}, {30, 2, 17, 5, 25, 11, 8, 0, 21, 14, 3, 27, 6, 19, 1, 23, 9, 12, 28, 4,
                                             15, 26, 7, 18, 10, 22, 13, 29, 16, 24, 20, 31, 33, 32},
                       200);
    c.queries = {{0, 2099}, {0, 2047}, {0, 2048}, {0, 1500}};
    HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
    MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true), reference_bits(c, true));
}

TEST(OpsPagedAttention, ScaleIsHfHeadDimPowMinusHalf) {
    EXPECT_EQ(attention_scale(128), static_cast<float>(std::pow(128.0, -0.5)));
    EXPECT_EQ(attention_scale(64), 0.125f);
    EXPECT_EQ(attention_scale(96), static_cast<float>(1.0 / std::sqrt(96.0)));
}

TEST(OpsPagedAttention, AQueryDependsOnNothingElseInTheCall) {
    // D2: every query alone (one call, one query, its sequence's block table only) equals its row of the call
    // holding every query of every sequence; so does any contiguous chunk of queries (chunked prefill), and a
    // decode step that finds only the rows written so far.
    ThreadPool pool(3);
    for (const Geometry &g : {kGeometries[1], kGeometries[3], kGeometries[4]}) {
        const Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, kLengths, kPages, 300);
        HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
        const std::vector<float> all = run(pool, c, kv, true);
        int64_t bad = 0;
        for (int64_t i = 0; i < c.n_q(); ++i) {
            bad += bit_mismatches(run_alone(pool, c, kv, i, true), rows_of(all, i, i + 1, c.q_row()));
        }
        EXPECT_EQ(bad, 0) << g.n_heads << " " << g.head_dim;
        for (const auto &[q0, q1] : {std::pair<int64_t, int64_t>{0, 5}, {5, 100}, {100, 101}, {101, 288}}) {
            MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true, 0, q0, q1), rows_of(all, q0, q1, c.q_row()));
        }
        // Decode: sequence 3's query at P with only its rows [0, P] written (the later ones NaN bytes).
        for (const int64_t P : {0, 63, 64, 130, 199}) {
            Case written = c;
            Seq &s = written.seqs[3];
            s.n_pos = P + 1;
            s.k.resize(static_cast<size_t>((P + 1) * c.row()));
            s.v.resize(static_cast<size_t>((P + 1) * c.row()));
            HostPool kv_p = fill_pool(written, KvFormat::kF32, KvFormat::kF32);
            const int64_t i = 1 + 17 + 70 + P;
            MEMRA_EXPECT_SAME_BITS(run_alone(pool, written, kv_p, i, true), rows_of(all, i, i + 1, c.q_row()))
                << "position " << P;
        }
    }
}

TEST(OpsPagedAttention, PageIdsDoNotChangeBits) {
    // The same rows written into other pages (another order, a larger pool) give identical bits; a block table
    // pointing at the wrong pages does not, so the comparison can fail.
    ThreadPool pool(2);
    const Case a = make_case(24, 2, 64, 0, kLengths, kPages, 400);
    Case b = a;
    const std::vector<int32_t> other{14, 0, 1, 12, 3, 8, 6, 13};
    size_t next = 0;
    for (Seq &s : b.seqs) {
        for (int32_t &p : s.pages) p = other[next++];
    }
    HostPool kv_a = fill_pool(a, KvFormat::kF32, KvFormat::kF32);
    HostPool kv_b = fill_pool(b, KvFormat::kF32, KvFormat::kF32);
    const std::vector<float> out_a = run(pool, a, kv_a, true);
    MEMRA_EXPECT_SAME_BITS(run(pool, b, kv_b, true), out_a);
    Case swapped = a;
    std::swap(swapped.seqs[3].pages[1], swapped.seqs[3].pages[2]);
    EXPECT_GT(bit_mismatches(run(pool, swapped, kv_a, true), out_a), 0);
}

TEST(OpsPagedAttention, ThreadCountDoesNotChangeBits) {
    for (const Geometry &g : {kGeometries[2], kGeometries[3], kGeometries[4]}) {
        const Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, kLengths, kPages, 500);
        HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
        ThreadPool one(1);
        const std::vector<float> base = run(one, c, kv, true);
        for (int threads : {3, 8}) {
            ThreadPool pool(threads);
            MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true), base) << threads;
        }
    }
}

TEST(OpsPagedAttention, SlidingWindowNeedsOnlyTheLivePages) {
    // Window 16 at position 100 sees [85, 100], all in block 1: block 0 may be released (-1) and its page
    // garbage; the result equals the run with block 0 present. Window 16 at position 70 sees [55, 70], which
    // reaches into block 0 (see the death test).
    ThreadPool pool(2);
    Case c = make_case(6, 2, 64, 16, {101}, {3, 1}, 600);
    c.queries = {{0, 100}, {0, 79}, {0, 90}};
    HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
    const std::vector<float> want = run(pool, c, kv, true);
    Case released = c;
    released.seqs[0].pages[0] = -1;  // positions 0 .. 63 are written nowhere
    HostPool kv_live = fill_pool(released, KvFormat::kF32, KvFormat::kF32);
    MEMRA_EXPECT_SAME_BITS(run(pool, released, kv_live, true), want);
}

TEST(OpsPagedAttention, KeysBelowFirstPosAreNeverRead) {
    // An MTP layer has no rows below its first position: with first_pos = 5 (and 69, which leaves block 0
    // without a page), NaN garbage below it changes nothing. The result equals the run in which those
    // positions are absent: the rows from first_pos on, renumbered from 0.
    ThreadPool pool(2);
    for (const int64_t window : {0, 20}) {
        for (const int64_t first_pos : {5, 69}) {
            const Case full = make_case(6, 3, 32, window, {150}, {4, 0, 6}, 700);
            Case c = full;
            c.queries.clear();
            for (int64_t p = first_pos; p < 150; ++p) c.queries.push_back(Query{0, p});
            c.q = rows_of(full.q, first_pos, 150, full.q_row());
            c.gate = rows_of(full.gate, first_pos, 150, full.shape.n_heads);
            if (first_pos >= kKvPageRows) c.seqs[0].pages[0] = -1;
            HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32, first_pos);  // rows below stay NaN bytes
            const std::vector<float> got = run(pool, c, kv, true, first_pos);

            Case shifted = c;
            shifted.seqs[0].n_pos = 150 - first_pos;
            shifted.seqs[0].k = rows_of(c.seqs[0].k, first_pos, 150, c.row());
            shifted.seqs[0].v = rows_of(c.seqs[0].v, first_pos, 150, c.row());
            shifted.seqs[0].pages = {1, 5, 2};
            shifted.seqs[0].pages.resize(static_cast<size_t>((shifted.seqs[0].n_pos + 63) / 64));
            for (Query &qi : shifted.queries) qi.pos -= first_pos;
            HostPool kv_shifted = fill_pool(shifted, KvFormat::kF32, KvFormat::kF32);
            MEMRA_EXPECT_SAME_BITS(got, run(pool, shifted, kv_shifted, true, 0))
                << "window " << window << " first_pos " << first_pos;
            // And float64 over [max(first_pos, P - window + 1), P] agrees (no gate).
            const std::vector<float> plain = run(pool, c, kv, false, first_pos);
            const std::vector<double> want = reference_f64(c, first_pos);
            for (size_t i = 0; i < plain.size(); ++i) ASSERT_NEAR(plain[i], want[i], 2e-6) << i;
        }
    }
}

TEST(OpsPagedAttention, ReadingThroughAFormatIsExactlyDecoding) {
    // A bf16 / q8_0 / q5_1 pool gives the bits of an f32 pool holding kv_decode(kv_encode(row)): the kernel
    // reads each key and value as the format stores it, nothing more and nothing less.
    ThreadPool pool(3);
    const KvFormat formats[] = {KvFormat::kF32, KvFormat::kBf16, KvFormat::kQ8_0, KvFormat::kQ5_1};
    for (const Geometry &g : {Geometry{6, 2, 64, 0}, Geometry{24, 2, 128, 40}, Geometry{4, 4, 32, 16}}) {
        for (KvFormat kf : formats) {
            for (KvFormat vf : formats) {
                if (kf == KvFormat::kF32 && vf == KvFormat::kF32) continue;
                const Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, {17, 130}, {6, 1, 4, 0}, 800);
                HostPool kv = fill_pool(c, kf, vf);
                const Case rounded = as_stored(c, kf, vf);
                HostPool kv_f32 = fill_pool(rounded, KvFormat::kF32, KvFormat::kF32);
                const std::vector<float> got = run(pool, c, kv, true);
                MEMRA_EXPECT_SAME_BITS(got, run(pool, rounded, kv_f32, true))
                    << kv_format_name(kf) << "/" << kv_format_name(vf) << " head_dim " << g.head_dim;
                // The rounding is visible: the unrounded f32 pool differs.
                HostPool kv_exact = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
                EXPECT_GT(bit_mismatches(got, run(pool, c, kv_exact, true)), 0) << kv_format_name(kf) << "/"
                                                                                 << kv_format_name(vf);
            }
        }
    }
}

TEST(OpsPagedAttention, GateIsSigmoidPerHead) {
    // out = attn * sigmoid_f32(gate[i, h]) for every element of head h: one rounded multiply after the division.
    ThreadPool pool(2);
    for (const Geometry &g : {kGeometries[0], kGeometries[3], kGeometries[5]}) {
        const Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, kLengths, kPages, 900);
        HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
        std::vector<float> want = run(pool, c, kv, false);
        for (int64_t i = 0; i < c.n_q(); ++i) {
            for (int64_t h = 0; h < g.n_heads; ++h) {
                const float s = sigmoid_f32(c.gate[static_cast<size_t>(i * g.n_heads + h)]);
                for (int64_t d = 0; d < g.head_dim; ++d) {
                    float &o = want[static_cast<size_t>(i * c.q_row() + h * g.head_dim + d)];
                    o = o * s;
                }
            }
        }
        MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true), want) << g.n_heads;
    }
}

// ---- The blocked (device) order: shape.blocked. ----

// Sequences of 1100, 300 and 5 positions (18, 5 and 1 pages, shuffled), in blocked mode, queried on both sides of
// the 128-position blocks and the 512-position splits. With window 200 the rows at 600, 700 and 1099 start
// mid-block and mid-split (at 401, 501 and 900); with window 700 the row at 1099 spans three splits from 400.
Case make_long_case(const Geometry &g, uint32_t seed) {
    std::vector<int32_t> pages(24);
    for (size_t b = 0; b < pages.size(); ++b) pages[b] = static_cast<int32_t>(b);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(seed));
    Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, {1100, 300, 5}, pages, seed);
    c.shape.blocked = true;
    c.queries.clear();
    for (const int64_t p : {0,   1,   127, 128, 129, 200, 255, 256,  383,  384,  511, 512,
                            513, 600, 639, 640, 700, 767, 900, 1023, 1024, 1025, 1099}) {
        c.queries.push_back(Query{0, p});
    }
    for (const int64_t p : {0, 127, 128, 299}) c.queries.push_back(Query{1, p});
    c.queries.push_back(Query{2, 4});
    return c;
}

// GQA groups 1, 9 and 12 (the last two past the kernel's batch of 8 query heads), head_dim 32-128, full causal
// and windows of 200 and 700 (not multiples of 128).
constexpr Geometry kBlockedGeometries[] = {{4, 4, 64, 0}, {18, 2, 64, 200}, {12, 1, 32, 700}, {8, 2, 128, 200}};

TEST(OpsPagedAttentionBlocked, BitsFollowTheDocumentedOrder) {
    ThreadPool pool(2);
    std::vector<std::pair<KvFormat, KvFormat>> formats = {
        {KvFormat::kF32, KvFormat::kF32},   {KvFormat::kBf16, KvFormat::kBf16}, {KvFormat::kQ8_0, KvFormat::kQ8_0},
        {KvFormat::kQ5_1, KvFormat::kQ5_1}, {KvFormat::kQ8_0, KvFormat::kBf16}, {KvFormat::kF32, KvFormat::kQ5_1}};
    std::vector<bool> gates = {false, true};
#if defined(__SANITIZE_ADDRESS__)
    // The sanitizer build (104 s for all of it) takes every key and value format once, with the gate.
    formats = {{KvFormat::kF32, KvFormat::kQ5_1}, {KvFormat::kQ8_0, KvFormat::kBf16}, {KvFormat::kQ5_1, KvFormat::kF32}};
    gates = {true};
#endif
    uint32_t seed = 2000;
    for (const Geometry &g : kBlockedGeometries) {
        const Case c = make_long_case(g, seed += 10);
        for (const auto &[kf, vf] : formats) {
            HostPool kv = fill_pool(c, kf, vf);
            const Case stored = as_stored(c, kf, vf);
            for (const bool with_gate : gates) {
                MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, with_gate), reference_blocked(stored, kf, with_gate))
                    << kv_format_name(kf) << "/" << kv_format_name(vf) << " heads " << g.n_heads << "/" << g.n_kv_heads
                    << " head_dim " << g.head_dim << " window " << g.window << " gate " << with_gate;
            }
        }
    }
    // The short sequences of the exact-order tests (one split, partial blocks) too.
    for (const Geometry &g : kGeometries) {
        Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, kLengths, kPages, seed += 10);
        c.shape.blocked = true;
        HostPool kv = fill_pool(c, KvFormat::kBf16, KvFormat::kQ8_0);
        MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true),
                               reference_blocked(as_stored(c, KvFormat::kBf16, KvFormat::kQ8_0), KvFormat::kBf16, true))
            << g.n_heads << " " << g.head_dim;
    }
}

TEST(OpsPagedAttentionBlocked, EveryRoundingPointAndTheSplitMergeChangeBits) {
    // The kernel differs from the exact order and from the reference with any one point of the blocked order
    // left out, so each is implemented (a test that passed with the point ignored would prove nothing).
    ThreadPool pool(3);
    const Case c = make_long_case(kBlockedGeometries[1], 3000);
    Case exact = c;
    exact.shape.blocked = false;
    for (const auto &[kf, vf] :
         {std::pair{KvFormat::kF32, KvFormat::kF32}, std::pair{KvFormat::kQ8_0, KvFormat::kQ5_1}}) {
        HostPool kv = fill_pool(c, kf, vf);
        const Case stored = as_stored(c, kf, vf);
        const std::vector<float> got = run(pool, c, kv, true);
        MEMRA_EXPECT_SAME_BITS(got, reference_blocked(stored, kf, true));
        EXPECT_GT(bit_mismatches(got, run(pool, exact, kv, true)), 0) << kv_format_name(kf);
        BlockedVariant no_p, no_v, no_split;
        no_p.round_p = false;
        no_v.round_v = false;
        no_split.split = int64_t{1} << 40;  // one split holds every position: no merge
        EXPECT_GT(bit_mismatches(got, reference_blocked(stored, kf, true, no_p)), 0) << kv_format_name(kf);
        EXPECT_GT(bit_mismatches(got, reference_blocked(stored, kf, true, no_v)), 0) << kv_format_name(vf);
        EXPECT_GT(bit_mismatches(got, reference_blocked(stored, kf, true, no_split)), 0) << kv_format_name(kf);
        BlockedVariant keys;  // f32 keys unrounded; q8_0 keys rounded (the kernel does neither)
        keys.round_f32_keys = false;
        keys.round_block_keys = true;
        EXPECT_GT(bit_mismatches(got, reference_blocked(stored, kf, true, keys)), 0) << kv_format_name(kf);
    }
}

TEST(OpsPagedAttentionBlocked, MatchesFloat64WithinBf16Tolerance) {
    // |out - out64| over weighted means of values in [-2, 2], float64 over the unrounded f32 rows: P, V and the
    // keys enter as bf16 (relative step 2^-8), so the bound is 2e-2 relative to the values' magnitude 2. Observed
    // worst case 9.7e-3 (head_dim 128, where the rounded keys move the scores most), 4.6e-3 at head_dim 32.
    ThreadPool pool(3);
    uint32_t seed = 4000;
    for (const Geometry &g : kBlockedGeometries) {
        const Case c = make_long_case(g, seed += 10);
        HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
        const std::vector<float> got = run(pool, c, kv, false);
        const std::vector<double> want = reference_f64(c);
        ASSERT_EQ(got.size(), want.size());
        double worst = 0.0;
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
        EXPECT_LT(worst, 2e-2 * 2.0) << "heads " << g.n_heads << "/" << g.n_kv_heads << " head_dim " << g.head_dim
                                     << " window " << g.window;
        EXPECT_GT(worst, 1e-5);  // bf16 rounding is visible
    }
}

TEST(OpsPagedAttentionBlocked, ThreadCountDoesNotChangeBits) {
    for (const Geometry &g : kBlockedGeometries) {
        const Case c = make_long_case(g, 5000);
        HostPool kv = fill_pool(c, KvFormat::kBf16, KvFormat::kQ8_0);
        ThreadPool one(1);
        const std::vector<float> base = run(one, c, kv, true);
        for (int threads : {2, 3}) {
            ThreadPool pool(threads);
            MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true), base) << threads << " heads " << g.n_heads;
        }
    }
}

TEST(OpsPagedAttentionBlocked, PageIdsDoNotChangeBits) {
    ThreadPool pool(2);
    const Case a = make_long_case(kBlockedGeometries[1], 6000);
    Case b = a;
    for (Seq &s : b.seqs) {
        for (int32_t &p : s.pages) p = 40 - p;  // other ids, another order, a larger pool
    }
    HostPool kv_a = fill_pool(a, KvFormat::kF32, KvFormat::kQ5_1);
    HostPool kv_b = fill_pool(b, KvFormat::kF32, KvFormat::kQ5_1);
    const std::vector<float> out_a = run(pool, a, kv_a, true);
    MEMRA_EXPECT_SAME_BITS(run(pool, b, kv_b, true), out_a);
    Case swapped = a;
    std::swap(swapped.seqs[0].pages[9], swapped.seqs[0].pages[14]);
    EXPECT_GT(bit_mismatches(run(pool, swapped, kv_a, true), out_a), 0);
}

TEST(OpsPagedAttentionBlocked, AQueryDependsOnNothingElseInTheCall) {
    // As for the exact order: each query alone, contiguous chunks of queries, and a decode step that finds only
    // the rows written so far (the later ones NaN bytes) give the bits of the call holding every query.
    ThreadPool pool(3);
    for (const Geometry &g : {kBlockedGeometries[0], kBlockedGeometries[2]}) {
        const Case c = make_long_case(g, 7000);
        HostPool kv = fill_pool(c, KvFormat::kQ8_0, KvFormat::kBf16);
        const std::vector<float> all = run(pool, c, kv, true);
        int64_t bad = 0;
        for (int64_t i = 0; i < c.n_q(); ++i) {
            bad += bit_mismatches(run_alone(pool, c, kv, i, true), rows_of(all, i, i + 1, c.q_row()));
        }
        EXPECT_EQ(bad, 0) << g.n_heads << " " << g.head_dim;
        for (const auto &[q0, q1] : {std::pair<int64_t, int64_t>{0, 5}, {5, 20}, {20, 21}, {21, c.n_q()}}) {
            MEMRA_EXPECT_SAME_BITS(run(pool, c, kv, true, 0, q0, q1), rows_of(all, q0, q1, c.q_row()));
        }
        for (int64_t i = 0; i < 23; ++i) {  // the queries of sequence 0
            const int64_t P = c.queries[static_cast<size_t>(i)].pos;
            Case written = c;
            Seq &s = written.seqs[0];
            s.n_pos = P + 1;
            s.k.resize(static_cast<size_t>((P + 1) * c.row()));
            s.v.resize(static_cast<size_t>((P + 1) * c.row()));
            HostPool kv_p = fill_pool(written, KvFormat::kQ8_0, KvFormat::kBf16);
            MEMRA_EXPECT_SAME_BITS(run_alone(pool, written, kv_p, i, true), rows_of(all, i, i + 1, c.q_row()))
                << "position " << P;
        }
    }
}

// ---- The blocked order's instruction paths (product_isa): every SIMD path gives the kPortable bits. ----

// The paths other than kPortable that this CPU runs.
std::vector<ProductIsa> simd_isas() {
    std::vector<ProductIsa> v = supported_isas();
    v.erase(v.begin());
    return v;
}

// Same bits, except that a NaN matches any NaN (the lanes' NaN payloads are not part of exp_f32's contract).
bool same_or_both_nan(float got, float want) {
    return std::isnan(want) ? std::isnan(got) : bits(got) == bits(want);
}

TEST(OpsPagedAttentionBlockedIsa, ExpLanesAreExpF32) {
    // Every 61st bit pattern; every float in [80, 89.5] and [-104.5, -80] (k = 128, subnormal results, both
    // limits); every 5th float with 2^-6 <= |x| < 80 (the rounding of k next to the ties t = n + 1/2); specials.
    // Each class of result must be reached, so a sample that missed a branch would fail.
    const IsaGuard guard;
    const std::vector<ProductIsa> isas = simd_isas();
    if (isas.empty()) GTEST_SKIP() << "no SIMD path on this CPU";
#if defined(__SANITIZE_ADDRESS__)
    const uint32_t stride = 997, dense = 13;
#else
    const uint32_t stride = 61, dense = 1;
#endif
    for (ProductIsa isa : isas) {
        ASSERT_TRUE(force_product_isa(isa));
        int64_t bad = 0, nan = 0, inf = 0, zero = 0, subnormal = 0, normal = 0;
        std::vector<float> x, y;
        auto flush = [&] {
            y.assign(x.size(), -7.0f);
            blocked_exp_f32(x.data(), static_cast<int64_t>(x.size()), y.data());
            for (size_t i = 0; i < x.size(); ++i) {
                const float want = exp_f32(x[i]);
                if (!same_or_both_nan(y[i], want) && bad++ < 5) {
                    ADD_FAILURE() << std::hex << "x 0x" << bits(x[i]) << ": 0x" << bits(y[i]) << " vs 0x" << bits(want);
                }
                nan += std::isnan(want) ? 1 : 0;
                inf += std::isinf(want) ? 1 : 0;
                zero += want == 0.0f ? 1 : 0;
                subnormal += std::fpclassify(want) == FP_SUBNORMAL ? 1 : 0;
                normal += std::isnormal(want) ? 1 : 0;
            }
            x.clear();
        };
        auto add = [&](uint32_t u) {
            x.push_back(from_bits(u));
            if (x.size() == 8192) flush();
        };
        for (uint64_t u = 0; u <= 0xffffffffu; u += stride) add(static_cast<uint32_t>(u));
        for (uint32_t u = bits(80.0f); u <= bits(89.5f); u += dense) add(u);
        for (uint32_t u = bits(-80.0f); u <= bits(-104.5f); u += dense) add(u);
        for (uint32_t u = bits(0.015625f); u < bits(80.0f); u += 5 * dense) {
            add(u);
            add(u | 0x80000000u);
        }
        for (const float f : {89.0f, -104.0f, 88.7228394f, -87.3365479f, -103.278931f, 0.34657359f, -0.34657359f}) {
            for (uint32_t u = bits(f) - 4; u <= bits(f) + 4; ++u) add(u);
        }
        for (const uint32_t u : {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x00800000u, 0x80800000u,
                                 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                                 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x3f800000u, 0xbf800000u}) {
            add(u);
        }
        flush();
        EXPECT_EQ(bad, 0) << product_isa_name(isa);
        EXPECT_GT(nan, 0);
        EXPECT_GT(inf, 0);
        EXPECT_GT(zero, 0);
        EXPECT_GT(subnormal, 1000);
        EXPECT_GT(normal, 1000000);
    }
}

TEST(OpsPagedAttentionBlockedIsa, Bf16RoundingLanesAreF32ToBf16) {
    // Every 61st bit pattern, and under every bf16 value the low halves around the tie: bits, NaN included
    // (a NaN rounds to the quiet NaN with its sign).
    const IsaGuard guard;
    const std::vector<ProductIsa> isas = simd_isas();
    if (isas.empty()) GTEST_SKIP() << "no SIMD path on this CPU";
    std::vector<float> x;
    for (uint64_t u = 0; u <= 0xffffffffu; u += 61) x.push_back(from_bits(static_cast<uint32_t>(u)));
    for (uint32_t h = 0; h <= 0xffffu; ++h) {
        for (const uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
            x.push_back(from_bits((h << 16) | low));
        }
    }
    x.push_back(1.0f);  // a tail past the 8-lane groups
    int64_t up = 0, nan = 0;
    for (const float v : x) {
        up += bits(rne_bf16(v)) > bits(v) ? 1 : 0;
        nan += std::isnan(v) ? 1 : 0;
    }
    EXPECT_GT(up, 1000);
    EXPECT_GT(nan, 1000);
    for (ProductIsa isa : isas) {
        ASSERT_TRUE(force_product_isa(isa));
        std::vector<float> y(x.size(), -7.0f);
        blocked_round_bf16(x.data(), static_cast<int64_t>(x.size()), y.data());
        int64_t bad = 0;
        for (size_t i = 0; i < x.size(); ++i) {
            if (bits(y[i]) != bits(rne_bf16(x[i])) && bad++ < 5) {
                ADD_FAILURE() << std::hex << "x 0x" << bits(x[i]) << ": 0x" << bits(y[i]);
            }
        }
        EXPECT_EQ(bad, 0) << product_isa_name(isa);
    }
}

// Query heads / kv heads, head_dim, window and first_pos of the path tests.
struct IsaGeometry {
    int64_t n_heads, n_kv_heads, head_dim, window, first_pos;
};
// GQA groups 1, 2, 8, 9 and 10 (the last two in two batches of query heads); head_dim 32-128, and 40, 24 and 36,
// which leave a tail past the 16 dot lanes (36 also past 8 lanes); full causal, windows inside an 8-key chunk,
// inside a block, across blocks and across splits; first_pos at and off a block boundary.
constexpr IsaGeometry kIsaGeometries[] = {{2, 2, 32, 0, 0},    {4, 2, 64, 200, 0}, {8, 1, 128, 0, 300},
                                          {20, 2, 32, 5, 0},   {9, 1, 64, 700, 130}, {6, 3, 40, 16, 0},
                                          {16, 2, 24, 0, 0},   {3, 1, 36, 129, 0}};

// A sequence of 1320 positions and one of 70 on shuffled pages; queries at the edges of the 8-key chunks, the
// 128-position blocks and the 512-position splits, up to 1319, from first_pos on.
Case make_isa_case(const IsaGeometry &g, uint32_t seed) {
    std::vector<int32_t> pages(23);
    for (size_t b = 0; b < pages.size(); ++b) pages[b] = static_cast<int32_t>(b);
    std::shuffle(pages.begin(), pages.end(), std::mt19937(seed));
    Case c = make_case(g.n_heads, g.n_kv_heads, g.head_dim, g.window, {1320, 70}, pages, seed);
    c.shape.blocked = true;
    c.queries.clear();
    for (const int64_t p : {0,   1,   7,   8,   9,   15,  16,  127, 128,  129,  300,  301,  302,
                            383, 511, 512, 513, 520, 700, 1023, 1024, 1025, 1100, 1300, 1319}) {
        if (p >= g.first_pos) c.queries.push_back(Query{0, p});
    }
    for (const int64_t p : {0, 5, 69}) {
        if (p >= g.first_pos) c.queries.push_back(Query{1, p});
    }
    return c;
}

// The outputs of every SIMD path, each compared with kPortable's bit for bit (NaNs by their bits too); returns
// kPortable's.
std::vector<float> expect_every_path_gives_the_portable_bits(ThreadPool &threads, const Case &c, HostPool &kv,
                                                             bool with_gate, int64_t first_pos,
                                                             const std::string &what) {
    EXPECT_TRUE(force_product_isa(ProductIsa::kPortable));
    const std::vector<float> want = run(threads, c, kv, with_gate, first_pos);
    for (ProductIsa isa : simd_isas()) {
        EXPECT_TRUE(force_product_isa(isa));
        EXPECT_EQ(product_isa(), isa);
        const std::vector<float> got = run(threads, c, kv, with_gate, first_pos);
        const int64_t bad = bit_mismatches(got, want);
        EXPECT_EQ(bad, 0) << product_isa_name(isa) << " " << what;
        for (size_t i = 0; bad > 0 && i < got.size(); ++i) {
            if (bits(got[i]) != bits(want[i])) {
                ADD_FAILURE() << "first difference at " << i << ": " << got[i] << " vs " << want[i];
                break;
            }
        }
    }
    return want;
}

std::string describe(const IsaGeometry &g, KvFormat kf, KvFormat vf, bool with_gate) {
    return std::string(kv_format_name(kf)) + "/" + kv_format_name(vf) + " heads " + std::to_string(g.n_heads) + "/" +
           std::to_string(g.n_kv_heads) + " head_dim " + std::to_string(g.head_dim) + " window " +
           std::to_string(g.window) + " first_pos " + std::to_string(g.first_pos) + " gate " +
           std::to_string(with_gate);
}

TEST(OpsPagedAttentionBlockedIsa, EveryPathGivesThePortableBits) {
    // Every KV format pair (the block formats where head_dim is a multiple of 32) at every geometry, the gate on
    // and off in turn. The outputs must be ordinary weighted means (finite, not all alike) for the comparison to
    // mean something.
    const IsaGuard guard;
    if (simd_isas().empty()) GTEST_SKIP() << "no SIMD path on this CPU";
    ThreadPool pool(2);
    const KvFormat formats[] = {KvFormat::kF32, KvFormat::kBf16, KvFormat::kQ8_0, KvFormat::kQ5_1};
    uint32_t seed = 9000;
    int flip = 0;
    for (const IsaGeometry &g : kIsaGeometries) {
        const Case c = make_isa_case(g, seed += 10);
        for (const KvFormat kf : formats) {
            for (const KvFormat vf : formats) {
                if (g.head_dim % 32 != 0 && (kv_format_is_block(kf) || kv_format_is_block(vf))) continue;
#if defined(__SANITIZE_ADDRESS__)
                if (kf != vf && !(kf == KvFormat::kF32 && vf == KvFormat::kQ5_1)) continue;
#endif
                const bool with_gate = (flip++ % 2) == 0;
                HostPool kv = fill_pool(c, kf, vf, g.first_pos);
                const std::vector<float> want = expect_every_path_gives_the_portable_bits(
                    pool, c, kv, with_gate, g.first_pos, describe(g, kf, vf, with_gate));
                EXPECT_TRUE(std::all_of(want.begin(), want.end(), [](float v) { return std::isfinite(v); }));
                EXPECT_GT(std::count_if(want.begin(), want.end(), [&](float v) { return v != want[0]; }),
                          static_cast<int64_t>(want.size() / 2));
            }
        }
    }
}

TEST(OpsPagedAttentionBlockedIsa, AdversarialValuesGiveThePortableBits) {
    // Scores spread over about +-60 (exps that are subnormal or 0, blocks whose max moves, alpha = 0),
    // scores that overflow to +-Inf and their NaNs, a NaN in q, NaNs in a stored key and value, subnormal q, keys
    // and values, and a zero scale (every score a signed zero, so the block max is a zero) with signed zeros among
    // the values. Each case must show its feature in kPortable's output, or it would test nothing.
    const IsaGuard guard;
    if (simd_isas().empty()) GTEST_SKIP() << "no SIMD path on this CPU";
    ThreadPool pool(2);
    const IsaGeometry g{8, 2, 32, 0, 0};
    const IsaGeometry g_win{12, 1, 64, 300, 0};
    auto scaled = [](std::vector<float> v, float f) {
        for (float &x : v) x = x * f;
        return v;
    };
    auto zeros = [](std::vector<float> v, uint32_t seed) {  // +0 or -0 at random
        std::mt19937 gen(seed);
        for (float &x : v) x = (gen() & 1) ? -0.0f : 0.0f;
        return v;
    };
    enum Kind { kHuge, kOverflow, kNanQ, kNanKv, kSubnormal, kZeros };
    for (const IsaGeometry &geo : {g, g_win}) {
        for (const Kind kind : {kHuge, kOverflow, kNanQ, kNanKv, kSubnormal, kZeros}) {
            Case c = make_isa_case(geo, 11000 + static_cast<uint32_t>(kind));
            const float ks = std::sqrt(static_cast<float>(geo.head_dim));
            switch (kind) {
                case kHuge:  // scores with a standard deviation of 3 sqrt(head_dim): 17 and 24
                    c.q = scaled(c.q, 9.0f * ks / 4.0f);
                    break;
                case kOverflow:  // even rows: q * k products of 1e40 overflow, their sums are +-Inf or NaN;
                                 // odd rows: finite scores of about 1e34, so one key takes all the weight
                    for (Seq &s : c.seqs) s.k = scaled(s.k, 1e20f);
                    for (int64_t i = 0; i < c.n_q(); ++i) {
                        for (int64_t e = 0; e < c.q_row(); ++e) {
                            float &x = c.q[static_cast<size_t>(i * c.q_row() + e)];
                            x = x * (i % 2 == 0 ? 1e20f : 1e15f);
                        }
                    }
                    break;
                case kNanQ:  // one NaN in every third q row of head 1 (and none elsewhere)
                    for (int64_t i = 0; i < c.n_q(); i += 3) {
                        c.q[static_cast<size_t>(i * c.q_row() + geo.head_dim + 5)] = from_bits(0x7fc00000u);
                    }
                    break;
                case kNanKv:  // NaNs with a payload (the formats and the rounding make them quiet) in a key and a value
                    c.seqs[0].k[static_cast<size_t>(600 * c.row() + 3)] = from_bits(0x7f812345u);
                    c.seqs[0].v[static_cast<size_t>(1000 * c.row() + 9)] = from_bits(0x7fd54321u);
                    break;
                case kSubnormal:
                    c.q = scaled(c.q, 1e-20f);
                    for (Seq &s : c.seqs) {
                        s.k = scaled(s.k, 1e-19f);
                        s.v = scaled(s.v, 1e-39f);
                    }
                    break;
                case kZeros:  // scale +0: every score is a zero, of the dot's sign; values with signed zeros
                    c.shape.scale = 0.0f;
                    for (Seq &s : c.seqs) {
                        std::vector<float> z = zeros(s.v, 3);
                        for (size_t e = 0; e < z.size(); e += 2) s.v[e] = z[e];
                    }
                    break;
            }
            for (const auto &[kf, vf] : {std::pair{KvFormat::kF32, KvFormat::kF32},
                                         std::pair{KvFormat::kBf16, KvFormat::kBf16},
                                         std::pair{KvFormat::kF32, KvFormat::kBf16}}) {
                for (const bool with_gate : {false, true}) {
                    HostPool kv = fill_pool(c, kf, vf, geo.first_pos);
                    if (kind == kNanKv) {  // bf16 NaNs with a payload too, which kv_encode never writes
                        auto slot = [&](int64_t p) {
                            return c.seqs[0].pages[static_cast<size_t>(p / kKvPageRows)] * kKvPageRows +
                                   p % kKvPageRows;
                        };
                        const std::byte nan_lo{0x81}, nan_hi{0x7f};
                        if (kf == KvFormat::kBf16) {
                            std::byte *k = kv.bytes.data() + kv.layout.k_at(HostPool::kLayer, slot(700)) + 2 * 5;
                            k[0] = nan_lo;
                            k[1] = nan_hi;
                        }
                        if (vf == KvFormat::kBf16) {
                            std::byte *v = kv.bytes.data() + kv.layout.v_at(HostPool::kLayer, slot(1100)) + 2 * 7;
                            v[0] = nan_lo;
                            v[1] = nan_hi;
                        }
                    }
                    const std::string what = describe(geo, kf, vf, with_gate) + " case " + std::to_string(kind);
                    const std::vector<float> want =
                        expect_every_path_gives_the_portable_bits(pool, c, kv, with_gate, geo.first_pos, what);
                    const auto count = [&](auto pred) { return std::count_if(want.begin(), want.end(), pred); };
                    switch (kind) {
                        case kHuge:  // one key takes all the weight in many rows: outputs that are bf16 values
                            if (!with_gate) {
                                EXPECT_GT(count([](float v) { return v != 0.0f && (bits(v) & 0xffffu) == 0; }), 100)
                                    << what;
                            }
                            EXPECT_EQ(count([](float v) { return !std::isfinite(v); }), 0) << what;
                            break;
                        case kOverflow:
                        case kNanQ:
                        case kNanKv:
                            EXPECT_GT(count([](float v) { return std::isnan(v); }), 0) << what;
                            EXPECT_GT(count([](float v) { return std::isfinite(v) && v != 0.0f; }), 0) << what;
                            break;
                        case kSubnormal:
                            EXPECT_GT(count([](float v) { return std::fpclassify(v) == FP_SUBNORMAL; }), 100) << what;
                            break;
                        case kZeros:
                            EXPECT_GT(count([](float v) { return v == 0.0f; }), 0) << what;
                            EXPECT_GT(count([](float v) { return std::isfinite(v) && v != 0.0f; }), 100) << what;
                            break;
                    }
                }
            }
        }
    }
}

// ---- Through the backend: kv_write's bytes, and the op over a backend pool. ----

TensorView to_backend(CpuBackend &be, DType dtype, const void *host, std::initializer_list<int64_t> shape) {
    auto v = be.alloc(dtype, shape);
    EXPECT_TRUE(v.has_value());
    be.copy_from_host(host, *v);
    return *v;
}

TEST(CpuBackendKv, KvWriteEncodesEveryRowIntoItsSlotAndNothingElse) {
    const KvFormat formats[] = {KvFormat::kF32, KvFormat::kBf16, KvFormat::kQ8_0, KvFormat::kQ5_1};
    for (KvFormat kf : formats) {
        for (KvFormat vf : {KvFormat::kQ5_1, KvFormat::kF32, KvFormat::kBf16}) {
            CpuBackend be(2, Numerics::kExact);
            // Layer 0: 2 heads of 64; layer 1: 3 heads of 32. 5 pages.
            const KvPoolSpec spec{kf, vf, 5, {KvPoolLayer{2, 64}, KvPoolLayer{3, 32}}};
            const KvPoolId id = *be.create_kv_pool(spec);
            const KvPageLayout layout = *kv_page_layout(spec);
            const TensorView storage = be.kv_pool_storage(id);
            ASSERT_EQ(storage.dtype, DType::kU8);
            ASSERT_EQ(static_cast<int64_t>(storage.n_bytes()), kv_pool_bytes(spec, layout));
            std::vector<std::byte> before(storage.n_bytes());
            for (size_t i = 0; i < before.size(); ++i) before[i] = static_cast<std::byte>(i * 131 % 251);
            be.copy_from_host(before.data(), storage);
            for (int layer : {1, 0}) {
                const int64_t row = layout.row_elems[static_cast<size_t>(layer)];
                // Slots in several pages, out of order, first and last rows of a page included.
                const std::vector<int32_t> slots{64 * 3 + 5, 0, 64 * 4 + 63, 64 * 1 + 17, 63, 64 * 2};
                const auto n = static_cast<int64_t>(slots.size());
                const std::vector<float> k = random_floats(static_cast<size_t>(n * row), 1000 + layer, -3.0f, 3.0f);
                const std::vector<float> v = random_floats(static_cast<size_t>(n * row), 2000 + layer, -3.0f, 3.0f);
                be.reset_counters();
                be.kv_write(id, layer, to_backend(be, DType::kF32, k.data(), {n, row}),
                            to_backend(be, DType::kF32, v.data(), {n, row}),
                            to_backend(be, DType::kI32, slots.data(), {n}));
                EXPECT_EQ(be.counters().launches, 1);
                std::vector<std::byte> want = before;
                for (int64_t i = 0; i < n; ++i) {
                    const int32_t slot = slots[static_cast<size_t>(i)];
                    kv_encode(kf, k.data() + i * row, row, want.data() + layout.k_at(layer, slot));
                    kv_encode(vf, v.data() + i * row, row, want.data() + layout.v_at(layer, slot));
                }
                std::vector<std::byte> got(storage.n_bytes());
                be.copy_to_host(storage, got.data());
                int64_t bad = 0;
                for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
                EXPECT_EQ(bad, 0) << kv_format_name(kf) << "/" << kv_format_name(vf) << " layer " << layer;
                EXPECT_NE(want, before);  // the rows did land somewhere
                before = got;
            }
        }
    }
}

TEST(CpuBackendKv, PagedAttentionOpEqualsTheKernelOverTheSameRows) {
    // The op over a pool filled by kv_write, with gate and a window, equals the raw kernel over a host pool
    // filled with kv_encode, bit for bit; one launch.
    const Case c = make_case(12, 4, 64, 33, kLengths, kPages, 1100);
    const KvFormat kf = KvFormat::kQ8_0, vf = KvFormat::kBf16;
    ThreadPool pool(2);
    HostPool host_kv = fill_pool(c, kf, vf);
    const std::vector<float> want = run(pool, c, host_kv, true);

    CpuBackend be(3, Numerics::kExact);
    const KvPoolId id = *be.create_kv_pool(host_kv.spec);
    std::vector<float> k, v;
    std::vector<int32_t> slots;
    for (const Seq &s : c.seqs) {
        k.insert(k.end(), s.k.begin(), s.k.end());
        v.insert(v.end(), s.v.begin(), s.v.end());
        for (int32_t p = 0; p < s.n_pos; ++p) slots.push_back(s.pages[static_cast<size_t>(p / 64)] * 64 + p % 64);
    }
    const auto n = static_cast<int64_t>(slots.size());
    be.kv_write(id, HostPool::kLayer, to_backend(be, DType::kF32, k.data(), {n, c.row()}),
                to_backend(be, DType::kF32, v.data(), {n, c.row()}), to_backend(be, DType::kI32, slots.data(), {n}));
    std::vector<int64_t> pos;
    std::vector<int32_t> seq;
    for (const Query &qi : c.queries) {
        pos.push_back(qi.pos);
        seq.push_back(qi.seq);
    }
    const std::vector<int32_t> bt = c.block_tables();
    const auto n_seqs = static_cast<int64_t>(c.seqs.size());
    const TensorView qv = to_backend(be, DType::kF32, c.q.data(), {c.n_q(), c.q_row()});
    const TensorView posv = to_backend(be, DType::kI64, pos.data(), {c.n_q()});
    const TensorView seqv = to_backend(be, DType::kI32, seq.data(), {c.n_q()});
    const TensorView btv = to_backend(be, DType::kI32, bt.data(), {n_seqs, c.max_blocks()});
    const TensorView gv = to_backend(be, DType::kF32, c.gate.data(), {c.n_q(), c.shape.n_heads});
    auto out = be.alloc(DType::kF32, {c.n_q(), c.q_row()});
    const AttentionParams p{c.shape.n_heads, c.shape.n_kv_heads, c.shape.head_dim, c.shape.window};
    be.reset_counters();
    be.paged_attention(p, qv, posv, seqv, id, HostPool::kLayer, btv, 0, gv, *out);
    EXPECT_EQ(be.counters().launches, 1);
    EXPECT_EQ(be.counters().host_copies(), 0);
    std::vector<float> got(static_cast<size_t>(out->numel()));
    be.copy_to_host(*out, got.data());
    EXPECT_EQ(be.counters().d2h_copies, 1);
    EXPECT_EQ(be.counters().copy_bytes, static_cast<int64_t>(got.size() * sizeof(float)));
    MEMRA_EXPECT_SAME_BITS(got, want);
    // Without a gate (a view with no data).
    be.paged_attention(p, qv, posv, seqv, id, HostPool::kLayer, btv, 0, TensorView{}, *out);
    be.copy_to_host(*out, got.data());
    MEMRA_EXPECT_SAME_BITS(got, run(pool, c, host_kv, false));
}

TEST(OpsPagedAttentionDeathTest, AVisiblePositionWithoutAPageIsAnInvariantViolation) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    ThreadPool pool(1);
    Case c = make_case(2, 1, 32, 0, {80}, {3, 1}, 1200);
    HostPool kv = fill_pool(c, KvFormat::kF32, KvFormat::kF32);
    c.seqs[0].pages[1] = -1;
    c.queries = {{0, 10}, {0, 70}};
    // Full attention: the query at 70 sees block 1, which has no page.
    EXPECT_DEATH(run(pool, c, kv, false), "query 1 at position 70 sees block 1 of sequence 0, which has no page");
    // Window 16: the query at 70 sees [55, 70], reaching block 0, released here.
    c.seqs[0].pages = {-1, 1};
    c.shape.window = 16;
    c.queries = {{0, 79}, {0, 70}};
    EXPECT_DEATH(run(pool, c, kv, false), "query 1 at position 70 sees block 0 of sequence 0, which has no page");
    // A query below first_pos, or past its block table.
    c.queries = {{0, 3}};
    EXPECT_DEATH(run(pool, c, kv, false, 5), "query 0 at position 3 of sequence 0 \\(first position 5");
    c.queries = {{0, 128}};
    EXPECT_DEATH(run(pool, c, kv, false), "query 0 at position 128 of sequence 0 \\(first position 0, 1 sequences, "
                                          "2 blocks\\)");
    // A block table naming a page past the pool.
    c.shape.window = 0;
    c.seqs[0].pages = {0, 7};
    c.queries = {{0, 70}};
    EXPECT_DEATH(run(pool, c, kv, false), "block 1 of sequence 0 names page 7 of a pool of");
}

}  // namespace
}  // namespace memra::cpu::test
