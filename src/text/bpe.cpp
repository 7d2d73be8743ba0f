// BPE word encoding (see bpe.h). Symbols form a linked list over the word's characters; a min-heap
// of (rank, position) candidate merges is popped and re-validated, which applies, at every step,
// the lowest-rank adjacent pair, leftmost on ties: O(n log n) per word.
#include "text/bpe.h"

#include <mutex>
#include <queue>

#include <fmt/format.h>

#include "core/check.h"
#include "text/utf8.h"

namespace memra::text {

// Word -> ids for words shorter than kMaxWordBytes; cleared when it reaches kMaxEntries, so memory
// stays bounded however varied the input.
struct BpeCache {
    static constexpr size_t kMaxEntries = 16384;
    static constexpr size_t kMaxWordBytes = 256;
    std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
};

BpeModel::BpeModel() : cache_(std::make_unique<BpeCache>()) {}
BpeModel::~BpeModel() = default;
BpeModel::BpeModel(BpeModel &&) noexcept = default;
BpeModel &BpeModel::operator=(BpeModel &&) noexcept = default;

Result<BpeModel> BpeModel::from_json(const Json &model, const std::string &path) {
    BpeModel bpe;
    auto vocab = json_object(model, "vocab", path);
    if (!vocab) return tl::unexpected(vocab.error());
    const std::string vocab_path = json_path(path, "vocab");
    for (const auto &[token, value] : (*vocab)->items()) {
        auto id = json_id(value, vocab_path + "[\"" + token + "\"]");
        if (!id) return tl::unexpected(id.error());
        // Bounded before the id -> token table below is sized by it.
        if (auto ok = check_token_id(*id, token, vocab_path); !ok) return tl::unexpected(ok.error());
        if (static_cast<size_t>(*id) >= bpe.tokens_.size()) {
            bpe.tokens_.resize(static_cast<size_t>(*id) + 1);
            bpe.has_token_.resize(static_cast<size_t>(*id) + 1, false);
        }
        if (bpe.has_token_[*id]) {
            return make_error("{}: id {} is used by both \"{}\" and \"{}\"", vocab_path, *id, bpe.tokens_[*id], token);
        }
        bpe.tokens_[*id] = token;
        bpe.has_token_[*id] = true;
        bpe.vocab_.emplace(token, *id);
    }

    auto merges = json_array(model, "merges", path);
    if (!merges) return tl::unexpected(merges.error());
    const std::string merges_path = json_path(path, "merges");
    int32_t rank = 0;
    for (const Json &m : **merges) {
        const std::string mpath = json_path(merges_path, static_cast<size_t>(rank));
        std::string a, b;
        if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
            a = m[0].get<std::string>();
            b = m[1].get<std::string>();
        } else if (m.is_string()) {
            // Legacy "a b" form: split at the first space.
            const std::string s = m.get<std::string>();
            const size_t space = s.find(' ');
            if (space == std::string::npos) {
                return make_error("{}: expected \"left right\", found \"{}\" (no space)", mpath, s);
            }
            a = s.substr(0, space);
            b = s.substr(space + 1);
        } else {
            return make_error("{}: expected a [\"left\", \"right\"] pair or a \"left right\" string, found {}", mpath,
                              describe_json(m));
        }
        auto ia = bpe.vocab_.find(a), ib = bpe.vocab_.find(b), inew = bpe.vocab_.find(a + b);
        if (ia == bpe.vocab_.end()) return make_error("{}: token \"{}\" is not in the vocabulary", mpath, a);
        if (ib == bpe.vocab_.end()) return make_error("{}: token \"{}\" is not in the vocabulary", mpath, b);
        if (inew == bpe.vocab_.end())
            return make_error("{}: merged token \"{}\" is not in the vocabulary", mpath, a + b);
        // A repeated pair keeps its last rank, as Hugging Face's map building does.
        bpe.merges_[pair_key(ia->second, ib->second)] = Merge{rank, inew->second};
        ++rank;
    }

    if (const Json *dropout = json_find(model, "dropout"); dropout != nullptr && !dropout->is_null()) {
        if (!dropout->is_number() || dropout->get<double>() != 0.0) {
            return make_error("{}: expected null (dropout makes encoding random), found {}", json_path(path, "dropout"),
                              describe_json(*dropout));
        }
    }
    for (const char *key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
        auto affix = json_string(model, key, path, false, true);
        if (!affix) return tl::unexpected(affix.error());
        if (*affix && !(*affix)->empty()) {
            return make_error("{}: unsupported \"{}\" (byte-level BPE uses none)", json_path(path, key), **affix);
        }
    }
    auto unk = json_string(model, "unk_token", path, false, true);
    if (!unk) return tl::unexpected(unk.error());
    if (*unk) {
        auto it = bpe.vocab_.find(**unk);
        if (it == bpe.vocab_.end()) {
            return make_error("{}: \"{}\" is not in the vocabulary", json_path(path, "unk_token"), **unk);
        }
        bpe.unk_id_ = it->second;
    }
    auto fuse = json_bool(model, "fuse_unk", path, false);
    auto fallback = json_bool(model, "byte_fallback", path, false);
    auto ignore = json_bool(model, "ignore_merges", path, false);
    if (!fuse) return tl::unexpected(fuse.error());
    if (!fallback) return tl::unexpected(fallback.error());
    if (!ignore) return tl::unexpected(ignore.error());
    bpe.fuse_unk_ = *fuse;
    bpe.byte_fallback_ = *fallback;
    bpe.ignore_merges_ = *ignore;
    if (bpe.byte_fallback_) {
        bpe.byte_ids_.assign(256, -1);
        for (int b = 0; b < 256; ++b) {
            auto it = bpe.vocab_.find(fmt::format("<0x{:02X}>", b));
            if (it != bpe.vocab_.end()) bpe.byte_ids_[static_cast<size_t>(b)] = it->second;
        }
    }
    return bpe;
}

std::optional<int32_t> BpeModel::token_id(std::string_view token) const {
    auto it = vocab_.find(token);
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
}

const std::string *BpeModel::token(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= tokens_.size() || !has_token_[id]) return nullptr;
    return &tokens_[id];
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t> &out) const {
    if (word.empty()) return;
    if (ignore_merges_) {
        if (auto id = token_id(word)) {
            out.push_back(*id);
            return;
        }
    }
    const bool cacheable = word.size() < BpeCache::kMaxWordBytes;
    if (cacheable) {
        std::lock_guard<std::mutex> lock(cache_->mutex);
        auto it = cache_->words.find(word);
        if (it != cache_->words.end()) {
            out.insert(out.end(), it->second.begin(), it->second.end());
            return;
        }
    }
    const size_t first = out.size();
    merge_word(word, out);
    if (cacheable) {
        std::lock_guard<std::mutex> lock(cache_->mutex);
        if (cache_->words.size() >= BpeCache::kMaxEntries) cache_->words.clear();
        cache_->words.emplace(std::string(word),
                              std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
    }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t> &out) const {
    // Initial symbols: one per character, or its <0xHH> bytes, or the unknown token.
    std::vector<int32_t> ids;
    ids.reserve(word.size());
    bool pending_unk = false;
    size_t pos = 0;
    while (pos < word.size()) {
        const size_t start = pos;
        utf8_next(word, pos);
        const std::string_view ch = word.substr(start, pos - start);
        if (auto id = token_id(ch)) {
            if (pending_unk) ids.push_back(*unk_id_);
            pending_unk = false;
            ids.push_back(*id);
            continue;
        }
        if (byte_fallback_) {
            bool all = true;
            for (char c : ch) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
            if (all) {
                // HF adds byte tokens without flushing a pending unknown, which is then emitted later.
                for (char c : ch) ids.push_back(byte_ids_[static_cast<uint8_t>(c)]);
                continue;
            }
        }
        if (unk_id_) {
            if (pending_unk && !fuse_unk_) ids.push_back(*unk_id_);
            pending_unk = true;
        }
        // No unknown token: the character is dropped, as in Hugging Face.
    }
    if (pending_unk) ids.push_back(*unk_id_);

    const auto n = static_cast<int32_t>(ids.size());
    std::vector<int32_t> prev(ids.size()), next(ids.size());
    std::vector<bool> alive(ids.size(), true);
    for (int32_t i = 0; i < n; ++i) {
        prev[i] = i - 1;
        next[i] = i + 1 < n ? i + 1 : -1;
    }
    struct Candidate {
        int32_t rank;
        int32_t pos;
        int32_t new_id;
        bool operator>(const Candidate &o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    auto push = [&](int32_t left) {
        const int32_t right = next[left];
        if (right < 0) return;
        auto it = merges_.find(pair_key(ids[left], ids[right]));
        if (it != merges_.end()) queue.push(Candidate{it->second.rank, left, it->second.new_id});
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!queue.empty()) {
        const Candidate top = queue.top();
        queue.pop();
        if (!alive[top.pos] || next[top.pos] < 0) continue;
        const int32_t right = next[top.pos];
        auto it = merges_.find(pair_key(ids[top.pos], ids[right]));
        if (it == merges_.end() || it->second.new_id != top.new_id) continue;  // stale candidate
        ids[top.pos] = top.new_id;
        alive[right] = false;
        next[top.pos] = next[right];
        if (next[right] >= 0) prev[next[right]] = top.pos;
        if (prev[top.pos] >= 0) push(prev[top.pos]);
        push(top.pos);
    }
    for (int32_t i = 0; i < n; ++i) {
        if (alive[i]) out.push_back(ids[i]);
    }
}

}  // namespace memra::text
