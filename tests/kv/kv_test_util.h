// Shared helpers for the KV cache tests: deterministic row values per (layer, position, salt), an
// independent reference encoder built on core's conversions, staging helpers, and logical snapshots.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "core/float_formats.h"
#include "core/quant_blocks.h"
#include "dense_kv_cache.h"

namespace memra::kv::test {

inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Values of one K (is_v = false) or V row: a function of (layer, pos, salt) only, so a straight run and a
// speculating run produce the same row for the same token. Magnitudes vary per 32-value block.
inline std::vector<float> row_values(int layer, int64_t pos, uint64_t salt, bool is_v, int64_t row_elems) {
    std::vector<float> x(row_elems);
    const uint64_t key = splitmix64(splitmix64(splitmix64(static_cast<uint64_t>(layer) * 2 + (is_v ? 1 : 0)) ^
                                               static_cast<uint64_t>(pos)) ^ salt);
    for (int64_t i = 0; i < row_elems; ++i) {
        const uint64_t h = splitmix64(key + static_cast<uint64_t>(i));
        const float unit = static_cast<float>(h >> 40) / 16777216.0f - 0.5f;  // [-0.5, 0.5)
        const float scale = static_cast<float>(1 + ((key >> (i / 32 % 8 * 4)) & 7));
        x[i] = unit * scale;
    }
    return x;
}

// Expected bytes of a row, from core's conversions directly (not through kv_encode).
inline std::vector<std::byte> reference_encode(KvFormat format, const std::vector<float> &x) {
    const int64_t n = static_cast<int64_t>(x.size());
    std::vector<std::byte> out;
    switch (format) {
        case KvFormat::kF32:
            out.resize(x.size() * 4);
            std::memcpy(out.data(), x.data(), out.size());
            break;
        case KvFormat::kBf16: {
            std::vector<uint16_t> h(x.size());
            for (size_t i = 0; i < x.size(); ++i) h[i] = f32_to_bf16(x[i]);
            out.resize(h.size() * 2);
            std::memcpy(out.data(), h.data(), out.size());
            break;
        }
        case KvFormat::kQ8_0: {
            std::vector<BlockQ8_0> b(n / kQuantBlock);
            quantize_row_q8_0(x.data(), b.data(), n);
            out.resize(b.size() * sizeof(BlockQ8_0));
            std::memcpy(out.data(), b.data(), out.size());
            break;
        }
        case KvFormat::kQ5_1: {
            std::vector<BlockQ5_1> b(n / kQuantBlock);
            quantize_row_q5_1(x.data(), b.data(), n);
            out.resize(b.size() * sizeof(BlockQ5_1));
            std::memcpy(out.data(), b.data(), out.size());
            break;
        }
    }
    return out;
}

// Expected f32 read-back of a row, from core's conversions directly (not through kv_decode).
inline std::vector<float> reference_decode(KvFormat format, const std::vector<float> &x) {
    const int64_t n = static_cast<int64_t>(x.size());
    std::vector<float> y(x.size());
    switch (format) {
        case KvFormat::kF32: y = x; break;
        case KvFormat::kBf16:
            for (size_t i = 0; i < x.size(); ++i) y[i] = bf16_to_f32(f32_to_bf16(x[i]));
            break;
        case KvFormat::kQ8_0: {
            std::vector<BlockQ8_0> b(n / kQuantBlock);
            quantize_row_q8_0(x.data(), b.data(), n);
            dequantize_row_q8_0(b.data(), y.data(), n);
            break;
        }
        case KvFormat::kQ5_1: {
            std::vector<BlockQ5_1> b(n / kQuantBlock);
            quantize_row_q5_1(x.data(), b.data(), n);
            dequantize_row_q5_1(b.data(), y.data(), n);
            break;
        }
    }
    return y;
}

inline bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Stages the rows of positions [pos0, pos0 + n) of `layer`, generated with `salt`.
inline Result<void> stage_rows(KvCache &cache, const KvTxn &txn, int layer, int64_t pos0, int64_t n, uint64_t salt) {
    const int64_t e = cache.layout(layer).row_elems;
    std::vector<float> k, v;
    for (int64_t p = pos0; p < pos0 + n; ++p) {
        const auto kr = row_values(layer, p, salt, false, e);
        const auto vr = row_values(layer, p, salt, true, e);
        k.insert(k.end(), kr.begin(), kr.end());
        v.insert(v.end(), vr.begin(), vr.end());
    }
    return cache.stage(txn, layer, k, v, n);
}

// Stages n rows in every layer, continuing where each layer's staging stands.
inline void stage_all(KvCache &cache, const KvTxn &txn, int64_t n, uint64_t salt) {
    for (int l = 0; l < cache.n_layers(); ++l) {
        auto ok = stage_rows(cache, txn, l, cache.live_end(l), n, salt);
        ASSERT_TRUE(ok.has_value()) << ok.error().message;
    }
}

// A straight (never speculating) run: `n` rows per transaction, every row committed, salt 0.
inline void run_straight(KvCache &cache, int64_t total, int64_t chunk) {
    for (int64_t done = 0; done < total; done += chunk) {
        auto txn = cache.begin();
        ASSERT_TRUE(txn.has_value());
        const int64_t n = std::min(chunk, total - done);
        stage_all(cache, *txn, n, 0);
        ASSERT_TRUE(cache.commit(*txn, n).has_value());
    }
}

// Every live row's bytes per layer, and the bounds: the logical state D7 compares.
struct Snapshot {
    int64_t length = 0;
    std::vector<int64_t> live_begin, live_end;
    std::vector<std::vector<std::vector<std::byte>>> k, v;  // [layer][pos - live_begin] row bytes

    friend bool operator==(const Snapshot &, const Snapshot &) = default;
};

inline Snapshot snapshot(const KvCache &cache) {
    Snapshot s;
    s.length = cache.length();
    for (int l = 0; l < cache.n_layers(); ++l) {
        s.live_begin.push_back(cache.live_begin(l));
        s.live_end.push_back(cache.live_end(l));
        s.k.emplace_back();
        s.v.emplace_back();
        for (int64_t p = cache.live_begin(l); p < cache.live_end(l); ++p) {
            auto k = cache.k_row_bytes(l, p);
            auto v = cache.v_row_bytes(l, p);
            EXPECT_TRUE(k && v);
            if (!k || !v) continue;
            s.k.back().emplace_back(k->begin(), k->end());
            s.v.back().emplace_back(v->begin(), v->end());
        }
    }
    return s;
}

}  // namespace memra::kv::test
