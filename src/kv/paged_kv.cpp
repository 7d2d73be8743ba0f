// Paged KV bookkeeping (paged_kv.h): page pools, per-sequence block tables and the transactions over them.
#include "kv/paged_kv.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>

#include <fmt/format.h>

#include "core/check.h"

namespace memra::kv {

namespace {

constexpr int32_t kNoPage = -1;

size_t idx(PoolKind kind) { return kind == PoolKind::kFull ? 0 : 1; }

int64_t block_of(int64_t position) { return position / kKvPageRows; }

}  // namespace

const char *pool_kind_name(PoolKind kind) { return kind == PoolKind::kFull ? "full" : "sliding"; }

int64_t window_first_block(int64_t position, int64_t window) {
    if (window < 1) return 0;
    return std::max<int64_t>(0, position - window + 1) / kKvPageRows;
}

// ---- PagePool ----

PagePool::PagePool(int32_t n_pages) {
    MEMRA_CHECK(n_pages >= 0, "page pool of {} pages", n_pages);
    refs_.assign(static_cast<size_t>(n_pages), 0);
    cached_.assign(static_cast<size_t>(n_pages), 0);
    lru_prev_.assign(static_cast<size_t>(n_pages), -1);
    lru_next_.assign(static_cast<size_t>(n_pages), -1);
    free_.reserve(static_cast<size_t>(n_pages));
    for (int32_t p = n_pages - 1; p >= 0; --p) free_.push_back(p);
}

int32_t PagePool::refcount(int32_t page) const {
    MEMRA_CHECK(page >= 0 && page < n_pages(), "page {} of a pool of {}", page, n_pages());
    return refs_[static_cast<size_t>(page)];
}

bool PagePool::cached(int32_t page) const {
    MEMRA_CHECK(page >= 0 && page < n_pages(), "page {} of a pool of {}", page, n_pages());
    return cached_[static_cast<size_t>(page)] != 0;
}

std::optional<int32_t> PagePool::alloc() {
    if (free_.empty()) return std::nullopt;
    const int32_t page = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(page)] = 1;
    return page;
}

void PagePool::retain(int32_t page) {
    MEMRA_CHECK(refcount(page) > 0 || cached(page), "retain of page {}, which is free", page);
    if (refs_[static_cast<size_t>(page)]++ == 0) lru_unlink(page);
}

void PagePool::release(int32_t page) {
    MEMRA_CHECK(refcount(page) > 0, "release of page {}, which no table holds", page);
    if (--refs_[static_cast<size_t>(page)] > 0) return;
    if (cached(page)) {
        lru_append(page);
    } else {
        free_page(page);
    }
}

void PagePool::set_cached(int32_t page) {
    MEMRA_CHECK(refcount(page) > 0 && !cached(page), "page {} cannot be cached (holders {}, cached {})", page,
                refcount(page), cached(page));
    cached_[static_cast<size_t>(page)] = 1;
}

void PagePool::uncache(int32_t page) {
    MEMRA_CHECK(cached(page), "page {} is not cached", page);
    cached_[static_cast<size_t>(page)] = 0;
    if (refs_[static_cast<size_t>(page)] == 0) {
        lru_unlink(page);
        free_page(page);
    }
}

void PagePool::lru_append(int32_t page) {
    const auto p = static_cast<size_t>(page);
    lru_prev_[p] = lru_tail_;
    lru_next_[p] = -1;
    (lru_tail_ >= 0 ? lru_next_[static_cast<size_t>(lru_tail_)] : lru_head_) = page;
    lru_tail_ = page;
    ++n_evictable_;
}

void PagePool::lru_unlink(int32_t page) {
    const auto p = static_cast<size_t>(page);
    const int32_t prev = lru_prev_[p], next = lru_next_[p];
    (prev >= 0 ? lru_next_[static_cast<size_t>(prev)] : lru_head_) = next;
    (next >= 0 ? lru_prev_[static_cast<size_t>(next)] : lru_tail_) = prev;
    lru_prev_[p] = lru_next_[p] = -1;
    --n_evictable_;
}

void PagePool::free_page(int32_t page) {
    // Keep the stack sorted (lowest on top) so that ids stay reproducible; pools are small enough for this.
    auto it = std::lower_bound(free_.begin(), free_.end(), page, std::greater<int32_t>());
    free_.insert(it, page);  // within the reserved capacity: no allocation
}

// ---- SeqKv ----

SeqKv::SeqKv(const SeqKvShape &shape) : shape_(shape) {
    MEMRA_CHECK(shape.n_streams >= 1 && shape.n_streams <= kMaxStreams && shape.max_positions >= 1 &&
                    (shape.window >= 1 || (!shape.trunk_sliding && shape.n_streams == 1)) &&
                    (shape.trunk_full || shape.trunk_sliding),
                "SeqKv shape: {} streams, {} positions, window {}, trunk pools full {} sliding {}", shape.n_streams,
                shape.max_positions, shape.window, shape.trunk_full, shape.trunk_sliding);
    const auto blocks = static_cast<size_t>(shape.max_blocks());
    for (size_t k = 0; k < 2; ++k) {
        tables_[k].assign(blocks, kNoPage);
        added_[k].reserve(blocks);
    }
    for (int s = 0; s < shape.n_streams; ++s) length_[s] = first(s);
}

int64_t SeqKv::first(int stream) const {
    MEMRA_CHECK(stream >= 0 && stream < shape_.n_streams, "stream {} of {}", stream, shape_.n_streams);
    return stream == 0 ? 0 : stream - 1;
}

int64_t SeqKv::length(int stream) const {
    MEMRA_CHECK(stream >= 0 && stream < shape_.n_streams, "stream {} of {}", stream, shape_.n_streams);
    return length_[stream];
}

int64_t SeqKv::staged(int stream) const {
    MEMRA_CHECK(stream >= 0 && stream < shape_.n_streams, "stream {} of {}", stream, shape_.n_streams);
    return open_ ? staged_[stream] : 0;
}

bool SeqKv::uses(PoolKind kind, int stream) const {
    if (kind == PoolKind::kFull) return stream == 0 && shape_.trunk_full;
    return stream > 0 || shape_.trunk_sliding;
}

std::span<const int32_t> SeqKv::block_table(PoolKind kind) const { return tables_[idx(kind)]; }

int64_t SeqKv::pages_held(PoolKind kind) const { return held_[idx(kind)]; }

bool SeqKv::has_page(PoolKind kind, int64_t position) const {
    const int64_t b = block_of(position);
    return position >= 0 && b < shape_.max_blocks() && tables_[idx(kind)][static_cast<size_t>(b)] >= 0;
}

int32_t SeqKv::slot(PoolKind kind, int64_t position) const {
    MEMRA_CHECK(has_page(kind, position), "{} KV position {} has no page", pool_kind_name(kind), position);
    const int32_t page = tables_[idx(kind)][static_cast<size_t>(block_of(position))];
    return static_cast<int32_t>(page * kKvPageRows + position % kKvPageRows);
}

Result<void> SeqKv::check_txn(const TxnId &txn, const char *op) const {
    if (!open_) return make_error("KV {}: no transaction is open", op);
    if (txn.generation != generation_) {
        return make_error("KV {}: stale transaction (generation {}, the open one is {})", op, txn.generation,
                          generation_);
    }
    return {};
}

void SeqKv::take_pages(PoolKind kind, int64_t p0, int64_t p1, PagePool &pool) {
    std::vector<int32_t> &table = tables_[idx(kind)];
    for (int64_t b = block_of(p0); p1 > p0 && b <= block_of(p1 - 1); ++b) {
        int32_t &entry = table[static_cast<size_t>(b)];
        if (entry >= 0) continue;
        const std::optional<int32_t> page = pool.alloc();
        MEMRA_CHECK(page.has_value(), "{} KV pool: counted free pages ran out", pool_kind_name(kind));
        entry = *page;
        added_[idx(kind)].push_back(b);
        ++held_[idx(kind)];
    }
}

void SeqKv::give_back(PoolKind kind, int64_t block, PagePool &pool) {
    int32_t &entry = tables_[idx(kind)][static_cast<size_t>(block)];
    MEMRA_CHECK(entry >= 0, "{} KV block {} has no page to give back", pool_kind_name(kind), block);
    pool.release(entry);
    entry = kNoPage;
    --held_[idx(kind)];
}

std::array<int64_t, 2> SeqKv::pages_needed(std::span<const int64_t> rows) const {
    std::array<int64_t, 2> needed = {0, 0};
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        // The streams' staged blocks [b0, b1] may overlap; each block without a page counts once.
        int64_t lo = INT64_MAX, hi = -1;
        for (int s = 0; s < shape_.n_streams && s < static_cast<int>(rows.size()); ++s) {
            const int64_t n = rows[static_cast<size_t>(s)];
            if (n <= 0 || !uses(kind, s)) continue;
            lo = std::min(lo, block_of(length_[s]));
            hi = std::max(hi, std::min(block_of(length_[s] + n - 1), shape_.max_blocks() - 1));
        }
        const std::vector<int32_t> &table = tables_[idx(kind)];
        for (int64_t b = lo; b <= hi; ++b) {
            if (table[static_cast<size_t>(b)] != kNoPage) continue;
            for (int s = 0; s < shape_.n_streams && s < static_cast<int>(rows.size()); ++s) {
                const int64_t n = rows[static_cast<size_t>(s)];
                if (n > 0 && uses(kind, s) && b >= block_of(length_[s]) && b <= block_of(length_[s] + n - 1)) {
                    ++needed[idx(kind)];
                    break;
                }
            }
        }
    }
    return needed;
}

Result<TxnId> SeqKv::begin(std::span<const int64_t> rows, PagePool &full, PagePool &swa) {
    if (open_) return make_error("KV begin: a transaction is already open (generation {})", generation_);
    if (static_cast<int>(rows.size()) != shape_.n_streams) {
        return make_error("KV begin: rows for {} streams, the sequence has {}", rows.size(), shape_.n_streams);
    }
    for (int s = 0; s < shape_.n_streams; ++s) {
        const int64_t n = rows[static_cast<size_t>(s)];
        if (n < 0) return make_error("KV begin: stream {} stages {} rows", s, n);
        if (length_[s] + n > shape_.max_positions) {
            return make_error("KV begin: stream {} would reach position {}, past the {} positions a sequence may hold",
                              s, length_[s] + n - 1, shape_.max_positions);
        }
    }
    const std::array<int64_t, 2> needed = pages_needed(rows);
    const PagePool *pools[2] = {&full, &swa};
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        const PagePool &pool = *pools[idx(kind)];
        if (needed[idx(kind)] > pool.n_free()) {
            return make_error("{} KV pool out of pages: the step needs {} more, {} of {} are free",
                              pool_kind_name(kind), needed[idx(kind)], pool.n_free(), pool.n_pages());
        }
    }
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        for (int s = 0; s < shape_.n_streams; ++s) {
            if (!uses(kind, s)) continue;
            take_pages(kind, length_[s], length_[s] + rows[static_cast<size_t>(s)], kind == PoolKind::kFull ? full : swa);
        }
    }
    for (int s = 0; s < shape_.n_streams; ++s) staged_[s] = rows[static_cast<size_t>(s)];
    open_ = true;
    ++generation_;
    return TxnId{generation_};
}

Result<void> SeqKv::commit(const TxnId &txn, std::span<const int64_t> keep, PagePool &full, PagePool &swa,
                           bool release_window) {
    if (auto ok = check_txn(txn, "commit"); !ok) return ok;
    if (static_cast<int>(keep.size()) != shape_.n_streams) {
        return make_error("KV commit: keep counts for {} streams, the sequence has {}", keep.size(), shape_.n_streams);
    }
    for (int s = 0; s < shape_.n_streams; ++s) {
        const int64_t k = keep[static_cast<size_t>(s)];
        if (k < 0 || k > staged_[s]) {
            return make_error("KV commit: stream {} keeps {} rows, staged {}", s, k, staged_[s]);
        }
    }
    for (int s = 0; s < shape_.n_streams; ++s) length_[s] += keep[static_cast<size_t>(s)];
    // A page taken by this transaction that holds no committed row goes back.
    PagePool *pools[2] = {&full, &swa};
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        for (const int64_t b : added_[idx(kind)]) {
            bool kept = false;
            for (int s = 0; s < shape_.n_streams && !kept; ++s) {
                kept = uses(kind, s) && length_[s] > first(s) && b * kKvPageRows < length_[s];
            }
            if (!kept) give_back(kind, b, *pools[idx(kind)]);
        }
        added_[idx(kind)].clear();
    }
    for (int s = 0; s < shape_.n_streams; ++s) staged_[s] = 0;
    open_ = false;
    if (release_window) release_out_of_window(swa);
    return {};
}

// Sliding blocks wholly below every stream's next window: the next row of stream s sees positions from
// length(s) - window + 1, so blocks ending at or below min_s length(s) - window + 1 are never read again.
void SeqKv::release_out_of_window(PagePool &swa) {
    bool any = false;
    int64_t frontier = 0;
    for (int s = 0; s < shape_.n_streams; ++s) {
        if (!uses(PoolKind::kSwa, s)) continue;
        frontier = any ? std::min(frontier, length_[s]) : length_[s];
        any = true;
    }
    if (!any) return;
    const int64_t dead_end = window_first_block(frontier, shape_.window);  // blocks [0, dead_end) are dead
    std::vector<int32_t> &table = tables_[idx(PoolKind::kSwa)];
    for (; swa_released_ < dead_end; ++swa_released_) {
        if (table[static_cast<size_t>(swa_released_)] >= 0) give_back(PoolKind::kSwa, swa_released_, swa);
    }
}

Result<void> SeqKv::rollback(const TxnId &txn, PagePool &full, PagePool &swa) {
    if (auto ok = check_txn(txn, "rollback"); !ok) return ok;
    PagePool *pools[2] = {&full, &swa};
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        for (const int64_t b : added_[idx(kind)]) give_back(kind, b, *pools[idx(kind)]);
        added_[idx(kind)].clear();
    }
    for (int s = 0; s < shape_.n_streams; ++s) staged_[s] = 0;
    open_ = false;
    return {};
}

void SeqKv::release_all(PagePool &full, PagePool &swa) {
    if (open_) (void)rollback(TxnId{generation_}, full, swa);
    PagePool *pools[2] = {&full, &swa};
    for (const PoolKind kind : {PoolKind::kFull, PoolKind::kSwa}) {
        const std::vector<int32_t> &table = tables_[idx(kind)];
        for (auto b = static_cast<int64_t>(table.size()) - 1; b >= 0; --b) {
            if (table[static_cast<size_t>(b)] >= 0) give_back(kind, b, *pools[idx(kind)]);
        }
    }
    for (int s = 0; s < shape_.n_streams; ++s) length_[s] = first(s);
    swa_released_ = 0;
}


void SeqKv::adopt(std::span<const int32_t> full_pages, int64_t swa_first, std::span<const int32_t> swa_pages,
                  PagePool &full, PagePool &swa) {
    const auto n = static_cast<int64_t>(full_pages.size());
    MEMRA_CHECK(shape_.n_streams == 1 && length_[0] == 0 && !open_ && held_[0] == 0 && held_[1] == 0,
                "KV adopt: the sequence is not fresh ({} streams, {} rows)", shape_.n_streams, length_[0]);
    MEMRA_CHECK(n * kKvPageRows <= shape_.max_positions, "KV adopt: {} blocks past {} positions", n,
                shape_.max_positions);
    const bool sliding = shape_.trunk_sliding;
    MEMRA_CHECK(!sliding || (swa_first == window_first_block(n * kKvPageRows, shape_.window) &&
                             static_cast<int64_t>(swa_pages.size()) == n - swa_first),
                "KV adopt: sliding pages from block {} ({} of them) for {} blocks", swa_first, swa_pages.size(), n);
    for (int64_t b = 0; b < n; ++b) {
        if (shape_.trunk_full) {
            const int32_t page = full_pages[static_cast<size_t>(b)];
            full.retain(page);
            tables_[idx(PoolKind::kFull)][static_cast<size_t>(b)] = page;
            ++held_[idx(PoolKind::kFull)];
        }
        if (sliding && b >= swa_first) {
            const int32_t page = swa_pages[static_cast<size_t>(b - swa_first)];
            swa.retain(page);
            tables_[idx(PoolKind::kSwa)][static_cast<size_t>(b)] = page;
            ++held_[idx(PoolKind::kSwa)];
        }
    }
    length_[0] = n * kKvPageRows;
    swa_released_ = sliding ? swa_first : 0;
}

}  // namespace memra::kv
