// The paged KV cache's bookkeeping (ENGINE.md section 2, SERVING.md 6.1): the backend owns the bytes in two
// pools of 64-row pages (full-attention layers; sliding-window + MTP layers); this module owns which page
// holds which positions of which sequence, the reference counts, and the transactions that stage a step's
// rows and then keep or drop them. Everything here is host-side integers: no row bytes, no backend.
//
// A sequence has one stream of rows per layer group that advances on its own: the trunk (stream 0) and the
// MTP layers (stream 1 + k for MTP layer k), whose rows lag the trunk. MTP layer k has no rows below
// position k (its row p reads MTP layer k - 1's row p - 1). One transaction per step covers every stream:
// begin() stages rows per stream and allocates their pages, commit() keeps a prefix of each stream's staged
// rows (its own count: speculation keeps 1 + accepted trunk rows and fewer MTP rows) and releases the pages
// that hold no kept row, rollback() drops everything staged. Sliding pages are released only at commit, and
// only once wholly below the window of every stream's next row, so a rollback never needs a released row.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/kv_page.h"
#include "core/result.h"

namespace memra::kv {

// Streams a sequence can have: the trunk and up to three MTP layers (Step-3.5 MTP-3).
inline constexpr int kMaxStreams = 4;

enum class PoolKind { kFull, kSwa };
const char *pool_kind_name(PoolKind kind);  // "full", "sliding"

// Free list, reference counts and prefix-cache marks of one pool's pages. The reference count is the number of
// block tables holding a page; a page the prefix cache holds (kv/prefix_cache.h) is marked cached instead, and
// when no table holds it any more it is evictable: not free, but a cached page the pool's owner may take back
// (PrefixCache::evict) before it runs out. The lowest free page is handed out first, so the same sequence of calls
// gives the same page ids (reproducible layouts; correctness never depends on them).
class PagePool {
public:
    PagePool() = default;
    explicit PagePool(int32_t n_pages);  // every page free; n_pages >= 0
    // Move-only: a copy would hand out the same pages twice.
    PagePool(PagePool &&) = default;
    PagePool &operator=(PagePool &&) = default;
    PagePool(const PagePool &) = delete;
    PagePool &operator=(const PagePool &) = delete;

    int32_t n_pages() const { return static_cast<int32_t>(refs_.size()); }
    int32_t n_free() const { return static_cast<int32_t>(free_.size()); }
    // Cached pages no block table holds.
    int32_t n_evictable() const { return n_evictable_; }
    // Pages a step may take: the free ones and the evictable ones.
    int32_t n_available() const { return n_free() + n_evictable_; }
    int32_t refcount(int32_t page) const;  // MEMRA_CHECK: a page of the pool
    bool cached(int32_t page) const;
    bool evictable(int32_t page) const { return cached(page) && refcount(page) == 0; }
    // The evictable page that became evictable longest ago (-1: none): evictable pages form a list in the order
    // their last holders let them go.
    int32_t oldest_evictable() const { return lru_head_; }

    // A free page with reference count 1, or nullopt when none is free.
    std::optional<int32_t> alloc();
    // One more holder of a held or cached page (a sequence reusing a cached prefix). MEMRA_CHECK: held or cached.
    void retain(int32_t page);
    // Drops one reference (MEMRA_CHECK: the page is held); at 0 the page is free again, or evictable if cached.
    void release(int32_t page);
    // Marks a held page cached (MEMRA_CHECK: held, not cached), and unmarks a cached one (MEMRA_CHECK: cached):
    // free again if no table holds it.
    void set_cached(int32_t page);
    void uncache(int32_t page);

private:
    void free_page(int32_t page);
    void lru_append(int32_t page);
    void lru_unlink(int32_t page);

    std::vector<int32_t> free_;     // a stack whose top (back) is the lowest free page
    std::vector<int32_t> refs_;     // [page]
    std::vector<uint8_t> cached_;   // [page]
    std::vector<int32_t> lru_prev_, lru_next_;  // [page] the evictable list's links, -1 at its ends
    int32_t lru_head_ = -1, lru_tail_ = -1;
    int32_t n_evictable_ = 0;
};

// What the sequences of one engine look like.
struct SeqKvShape {
    int n_streams = 1;           // 1 (trunk) + the MTP layers this sequence stages rows for, <= kMaxStreams
    bool trunk_full = true;      // the trunk has full-attention layers (its rows take full-pool pages)
    bool trunk_sliding = false;  // the trunk has sliding layers (its rows take sliding-pool pages too)
    int64_t window = 0;          // the sliding pool's window (its widest layer), >= 1 when it is used
    int64_t max_positions = 0;   // the most positions a sequence may reach, >= 1

    int64_t max_blocks() const { return (max_positions + kKvPageRows - 1) / kKvPageRows; }
};

// The first block a row at `position` reads through a sliding window of `window` positions (0 for window < 1).
int64_t window_first_block(int64_t position, int64_t window);

// A transaction handle: a plain value, checked against the sequence on every use.
struct TxnId {
    uint64_t generation = 0;  // 1 for a sequence's first transaction, then +1 per begin
};

class SeqKv {
public:
    // Sizes the block tables for the shape (an allocation: not on the hot path). MEMRA_CHECK: a valid shape,
    // whose trunk uses at least one pool.
    explicit SeqKv(const SeqKvShape &shape);
    // Move-only: a copy would hold the same pages twice.
    SeqKv(SeqKv &&) = default;
    SeqKv &operator=(SeqKv &&) = default;
    SeqKv(const SeqKv &) = delete;
    SeqKv &operator=(const SeqKv &) = delete;

    const SeqKvShape &shape() const { return shape_; }
    // Committed rows of a stream are positions [first(s), length(s)); first(0) = 0, first(1 + k) = k.
    int64_t first(int stream) const;
    int64_t length(int stream) const;
    // Rows the open transaction staged in a stream (0 when none is open): positions length .. + staged.
    int64_t staged(int stream) const;
    bool in_txn() const { return open_; }
    uint64_t last_generation() const { return generation_; }

    // The free pages of each pool ([full, sliding]) begin(rows) would take: the blocks of the staged rows that
    // have no page yet, each counted once. A scheduler plans a step's pages with it.
    std::array<int64_t, 2> pages_needed(std::span<const int64_t> rows) const;
    // Opens a transaction staging rows[s] rows on each stream (rows.size() == n_streams, each >= 0) and
    // takes the pages they need from the pools. Refused, changing nothing: an open transaction, rows past
    // max_positions, a pool out of pages (the message names the pool, the pages needed and the pages free).
    Result<TxnId> begin(std::span<const int64_t> rows, PagePool &full, PagePool &swa);
    // Keeps the first keep[s] staged rows of each stream (0 <= keep[s] <= staged(s)), closes the transaction,
    // releases the pages that hold no committed row and, unless release_window is false (the caller publishes the
    // committed blocks first, then calls release_out_of_window), the sliding pages wholly out of every stream's
    // window.
    Result<void> commit(const TxnId &txn, std::span<const int64_t> keep, PagePool &full, PagePool &swa,
                        bool release_window = true);
    // Releases the sliding pages wholly below the window of every stream's next row.
    void release_out_of_window(PagePool &swa);
    // Drops every staged row, gives back the pages the transaction took, closes it.
    Result<void> rollback(const TxnId &txn, PagePool &full, PagePool &swa);
    // Gives back every page (the sequence ends), the last block first (a cached prefix's tail, the least reusable
    // part, becomes evictable before its head); an open transaction is rolled back first.
    void release_all(PagePool &full, PagePool &swa);
    // Takes a cached prefix of n = full.size() whole blocks on a sequence with one stream and no rows: block b gets
    // full[b] (when the trunk has full layers) and, for b >= swa_first, swa[b - swa_first] (when it has sliding
    // layers; the blocks below swa_first are out of the window of position 64 n, as if released). Each page gains a
    // holder; the trunk then has 64 n committed rows. MEMRA_CHECK: a fresh one-stream sequence, no open
    // transaction, swa_first the first block in the window of position 64 n, n within max_positions.
    void adopt(std::span<const int32_t> full_pages, int64_t swa_first, std::span<const int32_t> swa_pages,
               PagePool &full, PagePool &swa);

    // The page holding logical block b (positions [64 b, 64 b + 64)) of a pool, -1 for none.
    std::span<const int32_t> block_table(PoolKind kind) const;
    // page * 64 + position % 64 of a position whose block has a page (MEMRA_CHECK).
    int32_t slot(PoolKind kind, int64_t position) const;
    int64_t pages_held(PoolKind kind) const;
    // Whether the block of a position has a page in a pool. That is true for every committed or staged row a
    // step may read (sliding rows inside some stream's window), and also for positions past them in the same
    // page and for out-of-window positions whose block is not yet released: callers check the rows' range.
    bool has_page(PoolKind kind, int64_t position) const;

private:
    Result<void> check_txn(const TxnId &txn, const char *op) const;
    bool uses(PoolKind kind, int stream) const;
    // Pages for the blocks of [p0, p1) of a pool that have none (begin counted them: they exist); the ones
    // taken are appended to added.
    void take_pages(PoolKind kind, int64_t p0, int64_t p1, PagePool &pool);
    void give_back(PoolKind kind, int64_t block, PagePool &pool);

    SeqKvShape shape_;
    std::vector<int32_t> tables_[2];            // [pool kind][block]
    std::vector<int64_t> added_[2];             // blocks the open transaction took pages for
    int64_t held_[2] = {0, 0};                  // pages held per pool
    int64_t length_[kMaxStreams] = {};
    int64_t staged_[kMaxStreams] = {};
    int64_t swa_released_ = 0;                  // sliding blocks [0, swa_released_) are released
    bool open_ = false;
    uint64_t generation_ = 0;
};

}  // namespace memra::kv
