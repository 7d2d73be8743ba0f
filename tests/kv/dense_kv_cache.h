// The dense KV cache, kept as a test oracle (ENGINE.md section 2): one sequence, every layer's K and V rows
// in contiguous storage (full layers) or a ring (sliding-window and MTP layers), written only through
// transactions. The engine stores KV in pages (kv/paged_kv.h); test_paged_kv.cpp's transaction fuzz (SERVING.md
// 6.4 T2) runs the same steps on both and requires the same bytes per logical row, which is why everything
// here is addressed by (layer, absolute position), never by storage offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_format.h"
#include "core/result.h"

namespace memra::kv {

struct KvLayerSpec {
    int n_kv_heads = 0;  // K/V heads stored per position
    int head_dim = 0;    // values per head; a multiple of 32 when K or V uses a block format
    int window = 0;      // 0: full attention, every position kept; > 0: sliding window of this many positions
};

struct KvCacheSpec {
    std::vector<KvLayerSpec> layers;  // the model's layers in order (trunk, then MTP layers, which slide)
    KvFormat k_format = KvFormat::kF32;
    KvFormat v_format = KvFormat::kF32;
    int64_t capacity = 0;    // most positions the sequence may hold (committed + staged), >= 1
    int max_stage_rows = 1;  // most rows one transaction may stage per layer, >= 1: the ring's headroom
};

// Storage geometry of one layer, derived from the spec (kv_cache_layout).
struct KvLayerLayout {
    int64_t row_elems = 0;  // n_kv_heads * head_dim values per row
    int64_t k_row_bytes = 0;
    int64_t v_row_bytes = 0;
    int64_t window = 0;  // 0: full layer
    // Physical rows. Full: capacity. Sliding: min(window + max_stage_rows, capacity), a ring indexed by
    // position % slots. Staging at most max_stage_rows rows past the committed length overwrites only
    // positions below length - window, so a rollback or partial commit never destroys a live row.
    int64_t slots = 0;
};

// Validates a spec (non-empty layers, positive sizes, head_dim % 32 for block formats, capacity >= 1,
// max_stage_rows >= 1, no size overflow) and returns each layer's layout.
Result<std::vector<KvLayerLayout>> kv_cache_layout(const KvCacheSpec &spec);

// Bytes of K + V storage a cache for `spec` allocates: the figure the CLI prints. Equals
// KvCache::storage_bytes() of a cache created from the spec.
Result<int64_t> kv_cache_bytes(const KvCacheSpec &spec);

// A transaction handle: a plain value, checked against the cache on every use.
struct KvTxn {
    uint64_t generation = 0;  // 1 for a cache's first transaction, then +1 per begin (survives grow)
    int64_t base = 0;         // committed length at begin: staged row i of a layer is position base + i
};

class KvCache {
public:
    // Allocates every row the spec asks for (zero-filled), so stage / commit / rollback / read never
    // allocate. Refuses a bad spec (kv_cache_layout) or a failed allocation.
    static Result<KvCache> create(const KvCacheSpec &spec);

    // ---- Transactions. A refused call changes nothing. ----

    // Opens a transaction; refused while one is open (no nesting).
    Result<KvTxn> begin();
    // Appends n rows to `layer` at positions length() + staged(layer) ... . k_rows / v_rows hold exactly
    // n * row_elems f32 values ([n, n_kv_heads, head_dim] row-major); they are encoded (quantized) now.
    // Refused: a handle that is not the open transaction, a bad layer, n < 0, more than max_stage_rows
    // rows staged in the layer by this transaction, positions at or past capacity, wrong span sizes.
    Result<void> stage(const KvTxn &txn, int layer, std::span<const float> k_rows, std::span<const float> v_rows,
                       int64_t n);
    // Keeps the first n staged rows of every layer, drops the rest, and closes the transaction. Every
    // layer must have staged the same number of rows, and n must lie in [0, that number].
    Result<void> commit(const KvTxn &txn, int64_t n);
    // Drops every staged row and closes the transaction.
    Result<void> rollback(const KvTxn &txn);

    // Raises the capacity, preserving every live row's bytes and the generation counter. Refused while
    // a transaction is open (its staged rows are neither kept nor dropped yet, so there is no single
    // state to preserve) and for new_capacity < capacity(); equal is a no-op. Allocates: not hot path.
    Result<void> grow(int64_t new_capacity);

    // ---- State ----

    const KvCacheSpec &spec() const { return spec_; }
    int n_layers() const { return static_cast<int>(layouts_.size()); }
    const KvLayerLayout &layout(int layer) const;
    int64_t length() const { return length_; }  // committed positions
    int64_t capacity() const { return spec_.capacity; }
    bool in_txn() const { return open_; }
    uint64_t last_generation() const { return last_generation_; }  // newest handed out; 0 before any begin
    int64_t staged(int layer) const;  // rows the open transaction staged in `layer` (0 when none is open)
    // Readable positions of a layer are [live_begin, live_end): committed rows (for a sliding layer the
    // last `window` of them) plus the rows staged in it by the open transaction. A query at a staged
    // position attends to earlier staged rows through these bounds.
    int64_t live_begin(int layer) const;
    int64_t live_end(int layer) const;
    int64_t storage_bytes() const;  // K + V bytes held, == kv_cache_bytes(spec())

    // ---- Reads (no allocation) ----

    // Decodes the K and V rows of positions [p0, p1) of `layer` to f32 into k_out / v_out, each exactly
    // (p1 - p0) * row_elems values ([p1 - p0, n_kv_heads, head_dim]). Refuses positions that are not live.
    Result<void> read(int layer, int64_t p0, int64_t p1, std::span<float> k_out, std::span<float> v_out) const;
    // The stored bytes of one live row (for D7 byte comparisons); the span is valid until the row's slot
    // is rewritten or the cache grows.
    Result<std::span<const std::byte>> k_row_bytes(int layer, int64_t pos) const;
    Result<std::span<const std::byte>> v_row_bytes(int layer, int64_t pos) const;

private:
    KvCache() = default;
    Result<void> check_open(const KvTxn &txn, const char *op) const;
    Result<void> check_live(const char *op, int layer, int64_t p0, int64_t p1) const;
    int64_t slot(int layer, int64_t pos) const { return pos % layouts_[layer].slots; }

    KvCacheSpec spec_;
    std::vector<KvLayerLayout> layouts_;
    std::vector<std::vector<std::byte>> k_;  // per layer: [slots, k_row_bytes]
    std::vector<std::vector<std::byte>> v_;  // per layer: [slots, v_row_bytes]
    std::vector<int64_t> staged_;            // per layer: rows staged by the open transaction
    int64_t length_ = 0;
    bool open_ = false;
    uint64_t last_generation_ = 0;
};

// FNV-1a 64 over the logical contents: the committed length, the open transaction's staged counts,
// then for each layer in order every live row's K bytes and V bytes in position order. Two caches
// holding the same logical rows (dense or, later, paged) digest equal whatever their physical layout.
uint64_t kv_cache_digest(const KvCache &cache);

}  // namespace memra::kv
