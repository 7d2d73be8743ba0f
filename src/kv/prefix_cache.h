// The prefix cache (SERVING.md 4.3 and 6.1): committed whole 64-row blocks published under a chained key, so a
// later sequence whose tokens begin the same way takes their pages instead of computing the rows again.
//
// A block's key is (the chain id of the block before it, its 64 token ids); the chain id of the first block's
// parent is 0. Every entry gets a chain id never used before, so a match walks the chain exactly: a block
// matches only when its parent is the entry the walk matched last and its tokens are equal (the hash only picks
// the slot). An entry holds the block's page in each pool the trunk uses (the sliding page may be gone: a
// tombstone, still good for the full pool). Published pages are immutable: a sequence writes only positions at
// or past its committed rows, which lie in blocks it does not share.
//
// Reuse is exact because a KV row is a function of the tokens up to it alone (batch, chunk and step
// invariance, DETERMINISM.md), so a cached page holds the bytes a cold prefill would write. Sequences with MTP
// streams neither publish nor reuse: their MTP rows lag the trunk's, so a block is not final when its trunk rows
// are (SERVING.md 4.3's boundary rule is left for the server's speculation).
//
// Pages are marked cached in their PagePool; a cached page no block table holds is evictable, and evict() takes
// them back least recently let go first (a sequence gives its blocks back tail first, so a prefix's head
// outlives its tail). Host integers only, every buffer sized at construction: no call allocates.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_page.h"
#include "core/result.h"
#include "kv/paged_kv.h"

namespace memra::kv {

class PrefixCache {
public:
    PrefixCache() = default;
    // Room for every page of both pools (each entry holds at least one page).
    PrefixCache(const SeqKvShape &shape, int32_t full_pages, int32_t swa_pages);

    // A prefix of whole blocks found in the cache; the spans stay valid until the next match().
    struct Match {
        int64_t blocks = 0;               // 64-row blocks matched (0: none)
        std::span<const int32_t> full;    // [blocks] full-pool pages (empty without full layers)
        int64_t swa_first = 0;            // the first block in the window of position 64 * blocks
        std::span<const int32_t> swa;     // [blocks - swa_first] sliding pages (empty without sliding layers)
        uint64_t chain = 0;               // the chain id of the last matched block
    };
    // The longest cached prefix of tokens that leaves at least one token to compute (the last one's logits are
    // needed): whole blocks from the left whose full pages are cached, cut back until the sliding pages of the
    // window before its end are cached too (SERVING.md 1.1's rule for hybrid models).
    Match match(std::span<const int32_t> tokens);
    // Publishes a committed block: tokens are its 64 ids, parent the chain id of the block before it (0 for the
    // first), pages the sequence's page of it per pool (-1: none, e.g. a sliding page already out of the
    // window). Returns the block's chain id: a new entry's (its pages marked cached), or the entry holding the
    // same block already (the sequence's own pages stay private then); 0 when the block cannot be published (no
    // page to hold), which ends the sequence's chain.
    uint64_t publish(uint64_t parent, std::span<const int32_t> tokens, int32_t full_page, int32_t swa_page,
                     PagePool &full, PagePool &swa);
    // Frees up to `pages` evictable pages of one pool, least recently let go first, dropping their entries (a
    // full page takes its entry's sliding page along; a sliding page alone leaves a tombstone when the entry
    // has a full page). Returns the pages freed in that pool.
    int64_t evict(PoolKind kind, int64_t pages, PagePool &full, PagePool &swa);
    // Drops every entry (their pages free once no table holds them).
    void clear(PagePool &full, PagePool &swa);

    int64_t entries() const { return n_entries_; }
    // Every entry's pages cached in their pools and every cached page in exactly one entry; the slot table
    // finds every entry.
    Result<void> check(const PagePool &full, const PagePool &swa) const;

private:
    struct Entry {
        uint64_t chain = 0;   // 0: an unused entry
        uint64_t parent = 0;
        uint64_t hash = 0;
        int32_t page[2] = {-1, -1};  // [full, sliding]
        int32_t tokens[kKvPageRows] = {};
    };
    uint64_t key_hash(uint64_t parent, std::span<const int32_t> tokens) const;
    // The slot of the entry (parent, tokens), or of the empty slot where it would go.
    size_t find_slot(uint64_t hash, uint64_t parent, std::span<const int32_t> tokens) const;
    void remove(int32_t entry, PagePool &full, PagePool &swa);

    SeqKvShape shape_;
    std::vector<Entry> entries_;
    std::vector<int32_t> free_entries_;   // unused entry indices
    std::vector<int32_t> slots_;          // open addressing (linear probing): entry index or -1
    std::vector<int32_t> entry_of_page_[2];  // [pool][page] the entry caching it, -1
    std::vector<int32_t> match_full_, match_swa_;
    std::vector<int32_t> matched_;        // entries along the walk
    uint64_t next_chain_ = 1;
    int64_t n_entries_ = 0;
};

}  // namespace memra::kv
