// The logical contents of a sequence's KV cache on rank 0, for raw-bit comparisons between engines.
#pragma once

#include <cstddef>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/engine.h"

namespace memra::runtime {

// Every live K/V row of a sequence on rank 0, all stored layers, in order: the cache's logical contents (of
// its first `streams` streams; -1: all).
inline std::vector<std::byte> kv_contents(const Engine &e, const Sequence &s, int streams = -1) {
    std::vector<std::byte> out, k, v;
    const model::Step35Config &cfg = e.config();
    for (const model::LayerGeometry &g : cfg.layers) {
        if (e.pool_layout().pool_layer[static_cast<size_t>(g.index)] < 0) continue;
        const int stream = g.is_mtp ? 1 + g.index - cfg.n_layers : 0;
        if (stream >= s.n_streams() || (streams >= 0 && stream >= streams)) continue;
        const kv::PoolKind kind =
            e.pool_layout().in_swa[static_cast<size_t>(g.index)] ? kv::PoolKind::kSwa : kv::PoolKind::kFull;
        for (int64_t p = s.kv().first(stream); p < s.length(stream); ++p) {
            if (!s.kv().has_page(kind, p)) continue;
            auto ok = e.kv_row(0, s, g.index, p, k, v);
            EXPECT_TRUE(ok.has_value()) << ok.error().message;
            out.insert(out.end(), k.begin(), k.end());
            out.insert(out.end(), v.begin(), v.end());
        }
    }
    return out;
}

}  // namespace memra::runtime
