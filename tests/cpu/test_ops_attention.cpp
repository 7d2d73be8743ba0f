// Attention: an independent spelling of the documented two-pass order (bits), float64 softmax within
// tolerance, prefill == token-by-token decode over the growing key set (bits), any split of the queries,
// sliding-window edges, GQA head mapping, the fused gate, thread invariance.
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/ops_attention.h"
#include "backend/cpu/ops_elementwise.h"
#include "core/math.h"
#include "cpu/ops_test_util.h"

namespace memra::cpu::test {
namespace {

// Keys/values for positions [0, n_pos) and queries for positions q_pos.
struct AttnCase {
    AttentionShape shape;
    int64_t n_pos = 0;
    std::vector<float> q;  // [n_q, n_heads, head_dim]
    std::vector<int64_t> q_pos;
    std::vector<float> k, v;  // [n_pos, n_kv_heads, head_dim]
    std::vector<float> gate;  // [n_q, n_heads]
};

AttnCase make_case(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t window, int64_t n_pos,
                   uint32_t seed) {
    AttnCase c;
    c.shape = AttentionShape{n_heads, n_kv_heads, head_dim, window, attention_scale(head_dim)};
    c.n_pos = n_pos;
    for (int64_t p = 0; p < n_pos; ++p) c.q_pos.push_back(p);
    c.q = random_floats(static_cast<size_t>(n_pos * n_heads * head_dim), seed, -2.0f, 2.0f);
    c.k = random_floats(static_cast<size_t>(n_pos * n_kv_heads * head_dim), seed + 1, -2.0f, 2.0f);
    c.v = random_floats(static_cast<size_t>(n_pos * n_kv_heads * head_dim), seed + 2, -2.0f, 2.0f);
    c.gate = random_floats(static_cast<size_t>(n_pos * n_heads), seed + 3, -4.0f, 4.0f);
    return c;
}

// Runs all of the case's queries against keys [0, n_pos).
std::vector<float> run_all(ThreadPool &pool, const AttnCase &c, bool with_gate) {
    const int64_t n_q = static_cast<int64_t>(c.q_pos.size());
    std::vector<float> out(static_cast<size_t>(n_q * c.shape.n_heads * c.shape.head_dim));
    attention(pool, c.shape, c.q.data(), c.shape.n_heads * c.shape.head_dim, c.q_pos.data(), n_q, c.k.data(),
              c.v.data(), 0, c.n_pos, with_gate ? c.gate.data() : nullptr, c.shape.n_heads, out.data());
    return out;
}

int64_t lowest_visible(const AttnCase &c, int64_t pos) {
    return c.shape.window > 0 ? std::max<int64_t>(0, pos - c.shape.window + 1) : 0;
}

// The documented order, spelled independently: scores into a vector, max, exp, sum, weighted sum, divide.
std::vector<float> reference_bits(const AttnCase &c, bool with_gate) {
    const int64_t H = c.shape.n_heads, D = c.shape.head_dim, G = c.shape.n_kv_heads;
    std::vector<float> out;
    for (size_t i = 0; i < c.q_pos.size(); ++i) {
        for (int64_t h = 0; h < H; ++h) {
            const float *qv = c.q.data() + (static_cast<int64_t>(i) * H + h) * D;
            const int64_t g = h / (H / G);
            const int64_t lo = lowest_visible(c, c.q_pos[i]);
            std::vector<float> s;
            for (int64_t p = lo; p <= c.q_pos[i]; ++p) {
                s.push_back(canonical_dot(qv, c.k.data() + (p * G + g) * D, D) * c.shape.scale);
            }
            float m = -std::numeric_limits<float>::infinity();
            for (float x : s) m = std::max(m, x);
            std::vector<float> o(static_cast<size_t>(D), 0.0f);
            float l = 0.0f;
            for (size_t n = 0; n < s.size(); ++n) {
                const float e = exp_f32(s[n] - m);
                l += e;
                const float *vv = c.v.data() + ((lo + static_cast<int64_t>(n)) * G + g) * D;
                for (int64_t d = 0; d < D; ++d) o[d] += e * vv[d];
            }
            for (int64_t d = 0; d < D; ++d) {
                float r = o[d] / l;
                if (with_gate) r *= sigmoid_f32(c.gate[i * H + h]);
                out.push_back(r);
            }
        }
    }
    return out;
}

// float64 softmax attention (no gate).
std::vector<double> reference_f64(const AttnCase &c) {
    const int64_t H = c.shape.n_heads, D = c.shape.head_dim, G = c.shape.n_kv_heads;
    std::vector<double> out;
    for (size_t i = 0; i < c.q_pos.size(); ++i) {
        for (int64_t h = 0; h < H; ++h) {
            const int64_t g = h / (H / G);
            std::vector<double> s;
            double m = -1e300;
            for (int64_t p = 0; p < c.n_pos; ++p) {
                const bool visible = p <= c.q_pos[i] && (c.shape.window == 0 || c.q_pos[i] - c.shape.window < p);
                if (!visible) continue;
                double dot = 0.0;
                for (int64_t d = 0; d < D; ++d) {
                    dot += static_cast<double>(c.q[(static_cast<int64_t>(i) * H + h) * D + d]) * c.k[(p * G + g) * D + d];
                }
                s.push_back(dot / std::sqrt(static_cast<double>(D)));
                m = std::max(m, s.back());
            }
            std::vector<double> o(static_cast<size_t>(D), 0.0);
            double l = 0.0;
            const int64_t lo = lowest_visible(c, c.q_pos[i]);
            for (size_t n = 0; n < s.size(); ++n) {
                const double e = std::exp(s[n] - m);
                l += e;
                for (int64_t d = 0; d < D; ++d) o[d] += e * c.v[((lo + static_cast<int64_t>(n)) * G + g) * D + d];
            }
            for (int64_t d = 0; d < D; ++d) out.push_back(o[d] / l);
        }
    }
    return out;
}

TEST(OpsAttention, MatchesDocumentedOrderAndFloat64) {
    ThreadPool pool(2);
    for (int64_t window : {0, 5}) {
        for (int64_t head_dim : {20, 64}) {
            const AttnCase c = make_case(6, 2, head_dim, window, 13, 7 + static_cast<uint32_t>(head_dim + window));
            const std::vector<float> got = run_all(pool, c, false);
            MEMRA_EXPECT_SAME_BITS(got, reference_bits(c, false)) << window << " " << head_dim;
            const std::vector<double> f64 = reference_f64(c);
            for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], f64[i], 2e-6) << i;
            MEMRA_EXPECT_SAME_BITS(run_all(pool, c, true), reference_bits(c, true));
        }
    }
}

TEST(OpsAttention, ScaleIsHfHeadDimPowMinusHalf) {
    EXPECT_EQ(attention_scale(128), static_cast<float>(std::pow(128.0, -0.5)));
    EXPECT_EQ(attention_scale(64), 0.125f);
    EXPECT_EQ(attention_scale(96), static_cast<float>(1.0 / std::sqrt(96.0)));
}

TEST(OpsAttention, PrefillEqualsTokenByTokenDecode) {
    for (int64_t window : {0, 16}) {
        const AttnCase c = make_case(4, 2, 64, window, 40, 100 + static_cast<uint32_t>(window));
        ThreadPool pool(3);
        const std::vector<float> prefill = run_all(pool, c, true);
        const int64_t H = c.shape.n_heads, D = c.shape.head_dim, row = c.shape.n_kv_heads * D;
        for (int64_t p = 0; p < c.n_pos; ++p) {
            // Decode step p: one query, the keys written so far; for a sliding layer only the live window is
            // passed (kv_begin > 0), as a ring cache would return it.
            const int64_t kv_begin = lowest_visible(c, p);
            std::vector<float> one(static_cast<size_t>(H * D));
            attention(pool, c.shape, c.q.data() + p * H * D, H * D, &c.q_pos[p], 1, c.k.data() + kv_begin * row,
                      c.v.data() + kv_begin * row, kv_begin, p + 1, c.gate.data() + p * H, H, one.data());
            MEMRA_EXPECT_SAME_BITS(one, std::vector<float>(prefill.begin() + p * H * D, prefill.begin() + (p + 1) * H * D))
                << "window " << window << " position " << p;
        }
        // Chunked prefill: positions [0, 17) then [17, 40) with the keys available so far.
        std::vector<float> chunked(prefill.size());
        attention(pool, c.shape, c.q.data(), H * D, c.q_pos.data(), 17, c.k.data(), c.v.data(), 0, 17, c.gate.data(),
                  H, chunked.data());
        attention(pool, c.shape, c.q.data() + 17 * H * D, H * D, c.q_pos.data() + 17, 23, c.k.data(), c.v.data(), 0,
                  40, c.gate.data() + 17 * H, H, chunked.data() + 17 * H * D);
        MEMRA_EXPECT_SAME_BITS(chunked, prefill);
    }
}

TEST(OpsAttention, QueriesInAnyOrderAndSubset) {
    const AttnCase c = make_case(4, 4, 32, 0, 25, 300);
    ThreadPool pool(2);
    const std::vector<float> all = run_all(pool, c, false);
    const int64_t HD = c.shape.n_heads * c.shape.head_dim;
    AttnCase sub = c;
    sub.q_pos = {24, 3, 3, 11};
    sub.q.clear();
    for (int64_t p : sub.q_pos) sub.q.insert(sub.q.end(), c.q.begin() + p * HD, c.q.begin() + (p + 1) * HD);
    const std::vector<float> got = run_all(pool, sub, false);
    for (size_t i = 0; i < sub.q_pos.size(); ++i) {
        const int64_t p = sub.q_pos[i];
        MEMRA_EXPECT_SAME_BITS(std::vector<float>(got.begin() + static_cast<int64_t>(i) * HD, got.begin() + (static_cast<int64_t>(i) + 1) * HD),
                         std::vector<float>(all.begin() + p * HD, all.begin() + (p + 1) * HD));
    }
}

TEST(OpsAttention, SlidingWindowEdges) {
    ThreadPool pool(2);
    // W = 1: only the current position is visible, so the output is exactly its value row.
    {
        const AttnCase c = make_case(2, 1, 16, 1, 9, 400);
        const std::vector<float> out = run_all(pool, c, false);
        for (int64_t p = 0; p < c.n_pos; ++p) {
            for (int64_t h = 0; h < 2; ++h) {
                for (int64_t d = 0; d < 16; ++d) ASSERT_EQ(bits(out[(p * 2 + h) * 16 + d]), bits(c.v[p * 16 + d]));
            }
        }
    }
    // W = 16 over 40 positions: position P sees [P - 15, P]. Changing key P - 16 changes nothing; changing
    // key P - 15 changes the output.
    const AttnCase c = make_case(2, 1, 16, 16, 40, 500);
    const std::vector<float> base = run_all(pool, c, false);
    const std::vector<double> f64 = reference_f64(c);
    for (size_t i = 0; i < base.size(); ++i) ASSERT_NEAR(base[i], f64[i], 2e-6);
    const int64_t P = 30;
    for (int64_t changed : {P - 16, P - 15}) {
        AttnCase d = c;
        for (int64_t j = 0; j < 16; ++j) d.k[changed * 16 + j] += 1.0f;
        const std::vector<float> out = run_all(pool, d, false);
        const std::vector<float> row(out.begin() + P * 32, out.begin() + (P + 1) * 32);
        const std::vector<float> base_row(base.begin() + P * 32, base.begin() + (P + 1) * 32);
        if (changed == P - 16) {
            MEMRA_EXPECT_SAME_BITS(row, base_row);
        } else {
            EXPECT_GT(bit_mismatches(row, base_row), 0);
        }
    }
    // Early positions (P < W) see everything from 0.
    const AttnCase full = [&] {
        AttnCase f = c;
        f.shape.window = 0;
        return f;
    }();
    const std::vector<float> full_out = run_all(pool, full, false);
    MEMRA_EXPECT_SAME_BITS(std::vector<float>(base.begin(), base.begin() + 16 * 32),
                     std::vector<float>(full_out.begin(), full_out.begin() + 16 * 32));
    EXPECT_GT(bit_mismatches(std::vector<float>(base.begin() + 16 * 32, base.begin() + 17 * 32),
                             std::vector<float>(full_out.begin() + 16 * 32, full_out.begin() + 17 * 32)),
              0);
}

TEST(OpsAttention, GqaMapsQueryHeadToKvHeadByDivision) {
    ThreadPool pool(2);
    const int64_t H = 6, G = 2, D = 16, n = 10;
    const AttnCase gqa = make_case(H, G, D, 0, n, 600);
    // The same K/V repeated per query head (MHA with 6 kv heads) must give the same bits.
    AttnCase mha = gqa;
    mha.shape.n_kv_heads = H;
    mha.k.clear();
    mha.v.clear();
    for (int64_t p = 0; p < n; ++p) {
        for (int64_t h = 0; h < H; ++h) {
            const int64_t g = h / (H / G);
            mha.k.insert(mha.k.end(), gqa.k.begin() + (p * G + g) * D, gqa.k.begin() + (p * G + g + 1) * D);
            mha.v.insert(mha.v.end(), gqa.v.begin() + (p * G + g) * D, gqa.v.begin() + (p * G + g + 1) * D);
        }
    }
    const std::vector<float> a = run_all(pool, gqa, false);
    MEMRA_EXPECT_SAME_BITS(a, run_all(pool, mha, false));
    // Perturbing kv head 1 changes query heads 3..5 only.
    AttnCase d = gqa;
    for (int64_t p = 0; p < n; ++p) {
        for (int64_t j = 0; j < D; ++j) d.v[(p * G + 1) * D + j] += 0.5f;
    }
    const std::vector<float> b = run_all(pool, d, false);
    for (int64_t p = 0; p < n; ++p) {
        for (int64_t h = 0; h < H; ++h) {
            const std::vector<float> ra(a.begin() + (p * H + h) * D, a.begin() + (p * H + h + 1) * D);
            const std::vector<float> rb(b.begin() + (p * H + h) * D, b.begin() + (p * H + h + 1) * D);
            if (h < 3) {
                MEMRA_EXPECT_SAME_BITS(ra, rb) << p << " " << h;
            } else {
                EXPECT_GT(bit_mismatches(ra, rb), 0) << p << " " << h;
            }
        }
    }
}

TEST(OpsAttention, FusedGateEqualsSeparateHeadGate) {
    const AttnCase c = make_case(4, 2, 32, 0, 12, 700);
    ThreadPool pool(2);
    std::vector<float> separate = run_all(pool, c, false);
    head_gate(pool, separate.data(), c.n_pos, 4, 32, c.gate.data(), 4);
    MEMRA_EXPECT_SAME_BITS(run_all(pool, c, true), separate);
}

TEST(OpsAttention, ThreadInvariance) {
    const AttnCase c = make_case(8, 2, 48, 7, 33, 800);
    ThreadPool one(1);
    const std::vector<float> base = run_all(one, c, true);
    for (int threads : kThreadCounts) {
        ThreadPool pool(threads);
        MEMRA_EXPECT_SAME_BITS(run_all(pool, c, true), base) << threads;
    }
}

TEST(OpsAttentionDeathTest, MissingVisibleKeysIsAnInvariantViolation) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    const AttnCase c = make_case(2, 1, 16, 0, 8, 900);
    ThreadPool pool(1);
    std::vector<float> out(32);
    const int64_t pos = 5;
    // Full attention at position 5 needs keys [0, 6); only [2, 6) given.
    EXPECT_DEATH(attention(pool, c.shape, c.q.data(), 32, &pos, 1, c.k.data(), c.v.data(), 2, 6, nullptr, 0, out.data()),
                 "query 0 at position 5 sees \\[0, 5\\], keys given for \\[2, 6\\)");
}

}  // namespace
}  // namespace memra::cpu::test
