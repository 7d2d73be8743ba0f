// The prefix cache (prefix_cache.h): entries of published blocks, an open-addressing slot table over their
// chained keys, and LRU eviction through the pools' evictable marks.
#include "kv/prefix_cache.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string_view>

#include "core/check.h"

namespace memra::kv {

namespace {

size_t pool_index(PoolKind kind) { return kind == PoolKind::kFull ? 0 : 1; }

size_t table_size(int64_t capacity) {
    size_t n = 16;
    while (n < static_cast<size_t>(2 * capacity)) n *= 2;
    return n;
}

}  // namespace

PrefixCache::PrefixCache(const SeqKvShape &shape, int32_t full_pages, int32_t swa_pages) : shape_(shape) {
    const int64_t capacity = int64_t{full_pages} + swa_pages;
    entries_.resize(static_cast<size_t>(capacity));
    free_entries_.reserve(static_cast<size_t>(capacity));
    for (auto e = static_cast<int32_t>(capacity) - 1; e >= 0; --e) free_entries_.push_back(e);
    slots_.assign(table_size(capacity), -1);
    entry_of_page_[0].assign(static_cast<size_t>(full_pages), -1);
    entry_of_page_[1].assign(static_cast<size_t>(swa_pages), -1);
    const auto blocks = static_cast<size_t>(shape.max_blocks());
    match_full_.reserve(blocks);
    match_swa_.reserve(blocks);
    matched_.reserve(blocks);
}

uint64_t PrefixCache::key_hash(uint64_t parent, std::span<const int32_t> tokens) const {
    // The key's bytes: the parent's chain id, then the token ids (std::hash over bytes: the slot only; a match
    // compares the whole key).
    char bytes[sizeof(uint64_t) + kKvPageRows * sizeof(int32_t)];
    std::memcpy(bytes, &parent, sizeof(parent));
    std::memcpy(bytes + sizeof(parent), tokens.data(), tokens.size_bytes());
    return std::hash<std::string_view>{}(std::string_view(bytes, sizeof(bytes)));
}

size_t PrefixCache::find_slot(uint64_t hash, uint64_t parent, std::span<const int32_t> tokens) const {
    const size_t mask = slots_.size() - 1;
    for (size_t s = hash & mask;; s = (s + 1) & mask) {
        const int32_t e = slots_[s];
        if (e < 0) return s;
        const Entry &entry = entries_[static_cast<size_t>(e)];
        if (entry.hash == hash && entry.parent == parent &&
            std::equal(tokens.begin(), tokens.end(), entry.tokens)) {
            return s;
        }
    }
}

PrefixCache::Match PrefixCache::match(std::span<const int32_t> tokens) {
    match_full_.clear();
    match_swa_.clear();
    matched_.clear();
    Match m;
    if (entries_.empty() || tokens.empty()) return m;
    const auto most = std::min<int64_t>((static_cast<int64_t>(tokens.size()) - 1) / kKvPageRows,
                                        shape_.max_blocks());
    uint64_t parent = 0;
    for (int64_t b = 0; b < most; ++b) {
        const std::span<const int32_t> block = tokens.subspan(static_cast<size_t>(b * kKvPageRows), kKvPageRows);
        const int32_t e = slots_[find_slot(key_hash(parent, block), parent, block)];
        if (e < 0) break;
        const Entry &entry = entries_[static_cast<size_t>(e)];
        if (shape_.trunk_full && entry.page[0] < 0) break;
        matched_.push_back(e);
        parent = entry.chain;
    }
    auto n = static_cast<int64_t>(matched_.size());
    const auto window_first = [&](int64_t blocks) { return window_first_block(blocks * kKvPageRows, shape_.window); };
    if (shape_.trunk_sliding) {
        // Cut back until the window before the end has every sliding page.
        for (; n > 0; --n) {
            bool whole = true;
            for (int64_t b = window_first(n); b < n && whole; ++b) {
                whole = entries_[static_cast<size_t>(matched_[static_cast<size_t>(b)])].page[1] >= 0;
            }
            if (whole) break;
        }
    }
    if (n == 0) return m;
    m.blocks = n;
    m.swa_first = shape_.trunk_sliding ? window_first(n) : 0;
    for (int64_t b = 0; b < n; ++b) {
        const Entry &entry = entries_[static_cast<size_t>(matched_[static_cast<size_t>(b)])];
        if (shape_.trunk_full) match_full_.push_back(entry.page[0]);
        if (shape_.trunk_sliding && b >= m.swa_first) match_swa_.push_back(entry.page[1]);
    }
    m.full = match_full_;
    m.swa = match_swa_;
    m.chain = entries_[static_cast<size_t>(matched_[static_cast<size_t>(n - 1)])].chain;
    return m;
}

uint64_t PrefixCache::publish(uint64_t parent, std::span<const int32_t> tokens, int32_t full_page, int32_t swa_page,
                              PagePool &full, PagePool &swa) {
    MEMRA_CHECK(static_cast<int64_t>(tokens.size()) == kKvPageRows, "prefix cache: a block of {} tokens",
                tokens.size());
    if (entries_.empty()) return 0;
    const uint64_t hash = key_hash(parent, tokens);
    const size_t slot = find_slot(hash, parent, tokens);
    if (slots_[slot] >= 0) return entries_[static_cast<size_t>(slots_[slot])].chain;
    if (!shape_.trunk_full) full_page = -1;
    if (!shape_.trunk_sliding) swa_page = -1;
    if (full_page < 0 && (shape_.trunk_full || swa_page < 0)) return 0;
    if (free_entries_.empty()) return 0;  // cannot happen: every entry holds a page of its own
    const int32_t e = free_entries_.back();
    free_entries_.pop_back();
    Entry &entry = entries_[static_cast<size_t>(e)];
    entry.chain = next_chain_++;
    entry.parent = parent;
    entry.hash = hash;
    entry.page[0] = full_page;
    entry.page[1] = swa_page;
    std::copy(tokens.begin(), tokens.end(), entry.tokens);
    PagePool *pools[2] = {&full, &swa};
    for (size_t k = 0; k < 2; ++k) {
        if (entry.page[k] < 0) continue;
        pools[k]->set_cached(entry.page[k]);
        entry_of_page_[k][static_cast<size_t>(entry.page[k])] = e;
    }
    slots_[slot] = e;
    ++n_entries_;
    return entry.chain;
}

void PrefixCache::remove(int32_t e, PagePool &full, PagePool &swa) {
    Entry &entry = entries_[static_cast<size_t>(e)];
    PagePool *pools[2] = {&full, &swa};
    for (size_t k = 0; k < 2; ++k) {
        if (entry.page[k] < 0) continue;
        entry_of_page_[k][static_cast<size_t>(entry.page[k])] = -1;
        pools[k]->uncache(entry.page[k]);
        entry.page[k] = -1;
    }
    // Backward-shift deletion: later entries of the probe run move up so that no lookup stops early.
    const size_t mask = slots_.size() - 1;
    size_t hole = find_slot(entry.hash, entry.parent, std::span<const int32_t>(entry.tokens, kKvPageRows));
    MEMRA_CHECK(slots_[hole] == e, "prefix cache: entry {} is not in its slot", e);
    for (size_t s = (hole + 1) & mask; slots_[s] >= 0; s = (s + 1) & mask) {
        const size_t home = entries_[static_cast<size_t>(slots_[s])].hash & mask;
        // The entry at s may move to the hole when its home is not cyclically within (hole, s].
        const bool stays = hole <= s ? (home > hole && home <= s) : (home > hole || home <= s);
        if (stays) continue;
        slots_[hole] = slots_[s];
        hole = s;
    }
    slots_[hole] = -1;
    entry.chain = 0;
    free_entries_.push_back(e);
    --n_entries_;
}

int64_t PrefixCache::evict(PoolKind kind, int64_t pages, PagePool &full, PagePool &swa) {
    const size_t k = pool_index(kind);
    const PagePool &pool = kind == PoolKind::kFull ? full : swa;
    int64_t freed = 0;
    for (int32_t page = pool.oldest_evictable(); freed < pages && page >= 0; page = pool.oldest_evictable()) {
        const int32_t e = entry_of_page_[k][static_cast<size_t>(page)];
        MEMRA_CHECK(e >= 0, "prefix cache: cached {} page {} has no entry", pool_kind_name(kind), page);
        Entry &entry = entries_[static_cast<size_t>(e)];
        if (kind == PoolKind::kSwa && entry.page[0] >= 0) {  // a tombstone: the full page stays reusable
            entry_of_page_[1][static_cast<size_t>(page)] = -1;
            entry.page[1] = -1;
            swa.uncache(page);
        } else {
            remove(e, full, swa);
        }
        ++freed;
    }
    return freed;
}

void PrefixCache::clear(PagePool &full, PagePool &swa) {
    for (size_t e = 0; e < entries_.size(); ++e) {
        if (entries_[e].chain != 0) remove(static_cast<int32_t>(e), full, swa);
    }
}

Result<void> PrefixCache::check(const PagePool &full, const PagePool &swa) const {
    const PagePool *pools[2] = {&full, &swa};
    int64_t live = 0;
    for (size_t e = 0; e < entries_.size(); ++e) {
        const Entry &entry = entries_[e];
        if (entry.chain == 0) continue;
        ++live;
        if (entry.page[0] < 0 && entry.page[1] < 0) return make_error("prefix cache: entry {} holds no page", e);
        for (size_t k = 0; k < 2; ++k) {
            const int32_t page = entry.page[k];
            if (page < 0) continue;
            if (!pools[k]->cached(page) || entry_of_page_[k][static_cast<size_t>(page)] != static_cast<int32_t>(e)) {
                return make_error("prefix cache: entry {}'s {} page {} is not marked cached for it", e,
                                  k == 0 ? "full" : "sliding", page);
            }
        }
        const size_t slot = find_slot(entry.hash, entry.parent, std::span<const int32_t>(entry.tokens, kKvPageRows));
        if (slots_[slot] != static_cast<int32_t>(e)) return make_error("prefix cache: entry {} is not found", e);
    }
    if (live != n_entries_) return make_error("prefix cache: {} live entries, {} counted", live, n_entries_);
    for (size_t k = 0; k < 2; ++k) {
        for (int32_t p = 0; p < pools[k]->n_pages(); ++p) {
            const bool sized = static_cast<int64_t>(entry_of_page_[k].size()) == pools[k]->n_pages();
            const int32_t e = sized ? entry_of_page_[k][static_cast<size_t>(p)] : -1;  // unsized: a disabled cache
            if (pools[k]->cached(p) != (e >= 0)) {
                return make_error("prefix cache: {} page {} is {}cached but {}in an entry", k == 0 ? "full" : "sliding",
                                  p, pools[k]->cached(p) ? "" : "not ", e >= 0 ? "" : "not ");
            }
        }
    }
    return {};
}

}  // namespace memra::kv
