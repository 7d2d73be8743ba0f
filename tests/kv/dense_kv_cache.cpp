// The dense KV cache, the paged bookkeeping's test oracle (dense_kv_cache.h): spec validation and layout,
// transaction bookkeeping (one open transaction, monotonic generations, per-layer staged counts), ring
// addressing for sliding layers, and copy-growth. Every refusal returns before any state changes, so a
// refused call leaves the cache as it was.
#include "dense_kv_cache.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include "core/check.h"

namespace memra::kv {

namespace {

bool mul_overflows(int64_t a, int64_t b) { return b != 0 && a > INT64_MAX / b; }

int64_t ring_slots(int64_t window, int64_t max_stage_rows, int64_t capacity) {
    // Below capacity the ring never wraps, so slots == capacity stores position p at slot p.
    return std::min(window + max_stage_rows, capacity);
}

// Layouts for `spec` with its capacity replaced by `capacity` (grow plans the new size with it).
Result<std::vector<KvLayerLayout>> plan_layouts(const KvCacheSpec &spec, int64_t capacity) {
    if (spec.layers.empty()) return make_error("KV cache spec: expected at least one layer, found none");
    if (capacity < 1) return make_error("KV cache spec: capacity must be >= 1 position, found {}", capacity);
    if (spec.max_stage_rows < 1) {
        return make_error("KV cache spec: max_stage_rows must be >= 1, found {}", spec.max_stage_rows);
    }
    std::vector<KvLayerLayout> layouts;
    layouts.reserve(spec.layers.size());
    int64_t total = 0;
    for (size_t i = 0; i < spec.layers.size(); ++i) {
        const KvLayerSpec &ls = spec.layers[i];
        if (ls.window < 0) return make_error("KV cache spec layer {}: window must be >= 0, found {}", i, ls.window);
        auto k_bytes = kv_row_bytes(spec.k_format, ls.n_kv_heads, ls.head_dim);
        if (!k_bytes) return wrap_error(fmt::format("KV cache spec layer {} K", i), k_bytes.error());
        auto v_bytes = kv_row_bytes(spec.v_format, ls.n_kv_heads, ls.head_dim);
        if (!v_bytes) return wrap_error(fmt::format("KV cache spec layer {} V", i), v_bytes.error());
        KvLayerLayout l;
        l.row_elems = static_cast<int64_t>(ls.n_kv_heads) * ls.head_dim;
        l.k_row_bytes = *k_bytes;
        l.v_row_bytes = *v_bytes;
        l.window = ls.window;
        l.slots = ls.window == 0 ? capacity : ring_slots(ls.window, spec.max_stage_rows, capacity);
        const int64_t row_pair = l.k_row_bytes + l.v_row_bytes;  // each < 2^62, the sum fits
        if (mul_overflows(l.slots, row_pair) || l.slots * row_pair > INT64_MAX - total) {
            return make_error("KV cache spec layer {}: {} rows of {} bytes overflow the byte count", i, l.slots,
                              row_pair);
        }
        total += l.slots * row_pair;
        layouts.push_back(l);
    }
    return layouts;
}

// K and V storage for the given layouts, zero-filled; an allocation failure becomes an Error.
Result<void> allocate(const std::vector<KvLayerLayout> &layouts, std::vector<std::vector<std::byte>> &k,
                      std::vector<std::vector<std::byte>> &v) {
    try {
        k.resize(layouts.size());
        v.resize(layouts.size());
        for (size_t i = 0; i < layouts.size(); ++i) {
            k[i].assign(static_cast<size_t>(layouts[i].slots * layouts[i].k_row_bytes), std::byte{0});
            v[i].assign(static_cast<size_t>(layouts[i].slots * layouts[i].v_row_bytes), std::byte{0});
        }
    } catch (const std::exception &e) {
        return make_error("KV cache: cannot allocate storage ({})", e.what());
    }
    return {};
}

}  // namespace

Result<std::vector<KvLayerLayout>> kv_cache_layout(const KvCacheSpec &spec) {
    return plan_layouts(spec, spec.capacity);
}

Result<int64_t> kv_cache_bytes(const KvCacheSpec &spec) {
    auto layouts = kv_cache_layout(spec);
    if (!layouts) return tl::unexpected(layouts.error());
    int64_t total = 0;  // plan_layouts proved the sum fits
    for (const KvLayerLayout &l : *layouts) total += l.slots * (l.k_row_bytes + l.v_row_bytes);
    return total;
}

Result<KvCache> KvCache::create(const KvCacheSpec &spec) {
    auto layouts = kv_cache_layout(spec);
    if (!layouts) return tl::unexpected(layouts.error());
    KvCache cache;
    if (auto ok = allocate(*layouts, cache.k_, cache.v_); !ok) return tl::unexpected(ok.error());
    cache.spec_ = spec;
    cache.layouts_ = std::move(*layouts);
    cache.staged_.assign(cache.layouts_.size(), 0);
    return cache;
}

// ---- Transactions -------------------------------------------------------------------------------

Result<void> KvCache::check_open(const KvTxn &txn, const char *op) const {
    if (txn.generation == 0 || txn.generation > last_generation_) {
        return make_error("KV cache {}: transaction generation {} was never begun on this cache (last generation {})",
                          op, txn.generation, last_generation_);
    }
    if (!open_ || txn.generation < last_generation_) {
        if (open_) {
            return make_error("KV cache {}: stale transaction generation {}; the open transaction is generation {}",
                              op, txn.generation, last_generation_);
        }
        return make_error("KV cache {}: transaction generation {} is already finished (committed or rolled back)",
                          op, txn.generation);
    }
    if (txn.base != length_) {
        return make_error("KV cache {}: transaction generation {} has base {}, but it began at length {}", op,
                          txn.generation, txn.base, length_);
    }
    return {};
}

Result<KvTxn> KvCache::begin() {
    if (open_) {
        return make_error("KV cache begin: transaction generation {} is still open; commit or roll it back first",
                          last_generation_);
    }
    open_ = true;
    ++last_generation_;
    return KvTxn{last_generation_, length_};
}

Result<void> KvCache::stage(const KvTxn &txn, int layer, std::span<const float> k_rows,
                            std::span<const float> v_rows, int64_t n) {
    if (auto ok = check_open(txn, "stage"); !ok) return ok;
    if (layer < 0 || layer >= n_layers()) {
        return make_error("KV cache stage: layer {} is out of range [0, {})", layer, n_layers());
    }
    if (n < 0) return make_error("KV cache stage: layer {}: row count must be >= 0, found {}", layer, n);
    const KvLayerLayout &l = layouts_[layer];
    const int64_t staged = staged_[layer];
    if (n > spec_.max_stage_rows - staged) {
        return make_error("KV cache stage: layer {}: {} + {} staged rows exceed max_stage_rows {} per transaction",
                          layer, staged, n, spec_.max_stage_rows);
    }
    const int64_t first = length_ + staged;
    if (n > spec_.capacity - first) {
        return make_error("KV cache stage: layer {}: positions [{}, {}) reach past capacity {}", layer, first,
                          first + n, spec_.capacity);
    }
    // n <= slots (n <= max_stage_rows and n <= capacity), and slots * row_bytes fits (plan_layouts).
    const int64_t values = n * l.row_elems;
    if (static_cast<int64_t>(k_rows.size()) != values || static_cast<int64_t>(v_rows.size()) != values) {
        return make_error("KV cache stage: layer {}: expected {} values ({} rows x {}) for K and V, found K {} V {}",
                          layer, values, n, l.row_elems, k_rows.size(), v_rows.size());
    }
    for (int64_t i = 0; i < n; ++i) {
        const int64_t s = slot(layer, first + i);
        kv_encode(spec_.k_format, k_rows.data() + i * l.row_elems, l.row_elems, k_[layer].data() + s * l.k_row_bytes);
        kv_encode(spec_.v_format, v_rows.data() + i * l.row_elems, l.row_elems, v_[layer].data() + s * l.v_row_bytes);
    }
    staged_[layer] = staged + n;
    return {};
}

Result<void> KvCache::commit(const KvTxn &txn, int64_t n) {
    if (auto ok = check_open(txn, "commit"); !ok) return ok;
    const int64_t staged = staged_[0];
    for (int i = 1; i < n_layers(); ++i) {
        if (staged_[i] != staged) {
            return make_error("KV cache commit: layers staged different row counts (layer 0: {}, layer {}: {}); every "
                              "layer must stage the same rows",
                              staged, i, staged_[i]);
        }
    }
    if (n < 0 || n > staged) {
        return make_error("KV cache commit: row count {} is outside [0, {}] (the rows staged)", n, staged);
    }
    length_ += n;
    std::fill(staged_.begin(), staged_.end(), 0);
    open_ = false;
    return {};
}

Result<void> KvCache::rollback(const KvTxn &txn) {
    if (auto ok = check_open(txn, "rollback"); !ok) return ok;
    std::fill(staged_.begin(), staged_.end(), 0);
    open_ = false;
    return {};
}

Result<void> KvCache::grow(int64_t new_capacity) {
    if (open_) {
        return make_error("KV cache grow: transaction generation {} is open; commit or roll it back before growing",
                          last_generation_);
    }
    if (new_capacity < spec_.capacity) {
        return make_error("KV cache grow: new capacity {} is below the current capacity {} (a cache only grows)",
                          new_capacity, spec_.capacity);
    }
    if (new_capacity == spec_.capacity) return {};
    auto layouts = plan_layouts(spec_, new_capacity);
    if (!layouts) return wrap_error("KV cache grow", layouts.error());
    std::vector<std::vector<std::byte>> k;
    std::vector<std::vector<std::byte>> v;
    if (auto ok = allocate(*layouts, k, v); !ok) return wrap_error("KV cache grow", ok.error());
    // Copy every live (committed) row from its old slot to its new one; ring slots move when a ring
    // that was clipped to the old capacity gets longer.
    for (int i = 0; i < n_layers(); ++i) {
        const KvLayerLayout &from = layouts_[i];
        const KvLayerLayout &to = (*layouts)[i];
        for (int64_t p = live_begin(i); p < length_; ++p) {
            const int64_t old_slot = p % from.slots;
            const int64_t new_slot = p % to.slots;
            std::memcpy(k[i].data() + new_slot * to.k_row_bytes, k_[i].data() + old_slot * from.k_row_bytes,
                        static_cast<size_t>(from.k_row_bytes));
            std::memcpy(v[i].data() + new_slot * to.v_row_bytes, v_[i].data() + old_slot * from.v_row_bytes,
                        static_cast<size_t>(from.v_row_bytes));
        }
    }
    k_ = std::move(k);
    v_ = std::move(v);
    layouts_ = std::move(*layouts);
    spec_.capacity = new_capacity;
    return {};
}

// ---- State ----------------------------------------------------------------------------------------

const KvLayerLayout &KvCache::layout(int layer) const {
    MEMRA_CHECK(layer >= 0 && layer < n_layers(), "KV cache layer {} out of range [0, {})", layer, n_layers());
    return layouts_[layer];
}

int64_t KvCache::staged(int layer) const {
    MEMRA_CHECK(layer >= 0 && layer < n_layers(), "KV cache layer {} out of range [0, {})", layer, n_layers());
    return staged_[layer];
}

int64_t KvCache::live_begin(int layer) const {
    const int64_t window = layout(layer).window;
    return window == 0 ? 0 : std::max<int64_t>(0, length_ - window);
}

int64_t KvCache::live_end(int layer) const { return length_ + staged(layer); }

int64_t KvCache::storage_bytes() const {
    int64_t total = 0;
    for (int i = 0; i < n_layers(); ++i) total += static_cast<int64_t>(k_[i].size() + v_[i].size());
    return total;
}

// ---- Reads ----------------------------------------------------------------------------------------

Result<void> KvCache::check_live(const char *op, int layer, int64_t p0, int64_t p1) const {
    if (layer < 0 || layer >= n_layers()) {
        return make_error("KV cache {}: layer {} is out of range [0, {})", op, layer, n_layers());
    }
    const int64_t lo = live_begin(layer);
    const int64_t hi = live_end(layer);
    if (p0 > p1 || p0 < lo || p1 > hi) {
        return make_error("KV cache {}: layer {} positions [{}, {}) are not live; live positions are [{}, {}) "
                          "(window {}, committed {}, staged {})",
                          op, layer, p0, p1, lo, hi, layouts_[layer].window, length_, staged_[layer]);
    }
    return {};
}

Result<void> KvCache::read(int layer, int64_t p0, int64_t p1, std::span<float> k_out, std::span<float> v_out) const {
    if (auto ok = check_live("read", layer, p0, p1); !ok) return ok;
    const KvLayerLayout &l = layouts_[layer];
    const int64_t values = (p1 - p0) * l.row_elems;
    if (static_cast<int64_t>(k_out.size()) != values || static_cast<int64_t>(v_out.size()) != values) {
        return make_error("KV cache read: layer {}: expected output buffers of {} values ({} rows x {}), "
                          "found K {} V {}",
                          layer, values, p1 - p0, l.row_elems, k_out.size(), v_out.size());
    }
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t s = slot(layer, p);
        const int64_t o = (p - p0) * l.row_elems;
        kv_decode(spec_.k_format, k_[layer].data() + s * l.k_row_bytes, l.row_elems, k_out.data() + o);
        kv_decode(spec_.v_format, v_[layer].data() + s * l.v_row_bytes, l.row_elems, v_out.data() + o);
    }
    return {};
}

Result<std::span<const std::byte>> KvCache::k_row_bytes(int layer, int64_t pos) const {
    if (auto ok = check_live("k_row_bytes", layer, pos, pos + 1); !ok) return tl::unexpected(ok.error());
    const KvLayerLayout &l = layouts_[layer];
    return std::span<const std::byte>(k_[layer].data() + slot(layer, pos) * l.k_row_bytes,
                                      static_cast<size_t>(l.k_row_bytes));
}

Result<std::span<const std::byte>> KvCache::v_row_bytes(int layer, int64_t pos) const {
    if (auto ok = check_live("v_row_bytes", layer, pos, pos + 1); !ok) return tl::unexpected(ok.error());
    const KvLayerLayout &l = layouts_[layer];
    return std::span<const std::byte>(v_[layer].data() + slot(layer, pos) * l.v_row_bytes,
                                      static_cast<size_t>(l.v_row_bytes));
}

// ---- Digest ---------------------------------------------------------------------------------------

namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

void fnv_bytes(uint64_t &h, std::span<const std::byte> bytes) {
    for (std::byte b : bytes) {
        h ^= static_cast<uint64_t>(b);
        h *= kFnvPrime;
    }
}

void fnv_i64(uint64_t &h, int64_t value) {
    std::byte raw[sizeof(value)];
    std::memcpy(raw, &value, sizeof(value));
    fnv_bytes(h, raw);
}

}  // namespace

uint64_t kv_cache_digest(const KvCache &cache) {
    uint64_t h = kFnvOffset;
    fnv_i64(h, cache.length());
    for (int i = 0; i < cache.n_layers(); ++i) fnv_i64(h, cache.staged(i));
    for (int i = 0; i < cache.n_layers(); ++i) {
        for (int64_t p = cache.live_begin(i); p < cache.live_end(i); ++p) {
            auto k = cache.k_row_bytes(i, p);
            auto v = cache.v_row_bytes(i, p);
            MEMRA_CHECK(k && v, "live row {} of layer {} must be readable", p, i);
            fnv_bytes(h, *k);
            fnv_bytes(h, *v);
        }
    }
    return h;
}

}  // namespace memra::kv
