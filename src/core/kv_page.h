// The byte layout of a paged KV pool (ENGINE.md section 2, SERVING.md 6.1): pages of kKvPageRows token rows,
// each page holding every pool layer's K rows then V rows in the pool's KV formats (core/kv_format.h, GGML
// block order), so one page id covers one run of 64 positions of all the pool's layers. A row's slot is
// page * kKvPageRows + position % kKvPageRows. Backends allocate and address pools with this layout; the
// engine's verification reads rows back through it. Plain arithmetic, no allocation after create.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_format.h"
#include "core/result.h"

namespace memra {

// Token rows per page: one 64-key attention tile (SERVING.md 1.6).
inline constexpr int64_t kKvPageRows = 64;

// One layer of a pool: the K/V heads a rank stores per position.
struct KvPoolLayer {
    int n_kv_heads = 0;
    int head_dim = 0;  // a multiple of 32 when K or V uses a block format
};

struct KvPoolSpec {
    KvFormat k_format = KvFormat::kF32;
    KvFormat v_format = KvFormat::kF32;
    int64_t n_pages = 0;              // >= 1
    std::vector<KvPoolLayer> layers;  // >= 1
};

// Where the bytes of each layer's rows lie inside a page.
struct KvPageLayout {
    int64_t page_bytes = 0;
    std::vector<int64_t> k_offset;     // [layer] first K row of the layer inside a page
    std::vector<int64_t> v_offset;     // [layer] first V row
    std::vector<int64_t> k_row_bytes;  // [layer]
    std::vector<int64_t> v_row_bytes;  // [layer]
    std::vector<int64_t> row_elems;    // [layer] n_kv_heads * head_dim values per row

    // Byte offset of a row's K (or V) bytes in the pool: slot = page * kKvPageRows + row.
    int64_t k_at(int layer, int64_t slot) const {
        return (slot / kKvPageRows) * page_bytes + k_offset[static_cast<size_t>(layer)] +
               (slot % kKvPageRows) * k_row_bytes[static_cast<size_t>(layer)];
    }
    int64_t v_at(int layer, int64_t slot) const {
        return (slot / kKvPageRows) * page_bytes + v_offset[static_cast<size_t>(layer)] +
               (slot % kKvPageRows) * v_row_bytes[static_cast<size_t>(layer)];
    }
};

// The layout of a pool, refusing a bad spec (no layers, non-positive sizes, a head_dim a block format cannot
// cut, a pool larger than 2^62 bytes) with the reason.
Result<KvPageLayout> kv_page_layout(const KvPoolSpec &spec);

// Bytes of the whole pool: n_pages * page_bytes.
int64_t kv_pool_bytes(const KvPoolSpec &spec, const KvPageLayout &layout);

}  // namespace memra
