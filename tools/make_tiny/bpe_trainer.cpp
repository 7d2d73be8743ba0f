// Deterministic byte-level BPE training (see bpe_trainer.h for the rules). Pair counts are kept
// up to date incrementally (only the words holding the merged pair are recounted); each step scans
// all pairs for the winner, which is cheap at these sizes (a few KB of text, a few hundred merges).
#include "make_tiny/bpe_trainer.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

namespace memra::tools {

namespace {

enum class ByteClass { kLetter, kDigit, kSpace, kPunct };

ByteClass byte_class(uint8_t b) {
    if ((b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || b >= 0x80) {
        return ByteClass::kLetter;
    }
    if (b >= '0' && b <= '9') {
        return ByteClass::kDigit;
    }
    if (b == ' ' || b == '\t' || b == '\r' || b == '\n') {
        return ByteClass::kSpace;
    }
    return ByteClass::kPunct;
}

// Appends the UTF-8 encoding of code point cp (cp < 0x800 here: at most U+0143).
void append_utf8(std::string &out, uint32_t cp) {
    if (cp < 0x80) {
        out.push_back(static_cast<char>(cp));
    } else {
        out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
}

bool is_printable_latin(uint32_t b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

// (left, right) ordering for the tie rule: byte-wise lexicographic, unsigned.
bool pair_less(const std::string &l1, const std::string &r1, const std::string &l2, const std::string &r2) {
    auto cmp = [](const std::string &a, const std::string &b) {
        return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
            return static_cast<unsigned char>(x) < static_cast<unsigned char>(y);
        });
    };
    if (l1 != l2) {
        return cmp(l1, l2);
    }
    return cmp(r1, r2);
}

}  // namespace

std::string byte_level_char(uint8_t byte) {
    std::string out;
    if (is_printable_latin(byte)) {
        append_utf8(out, byte);
        return out;
    }
    // Non-printable bytes take U+0100 + (their rank among the non-printable bytes).
    uint32_t rank = 0;
    for (uint32_t b = 0; b < byte; ++b) {
        if (!is_printable_latin(b)) {
            ++rank;
        }
    }
    append_utf8(out, 0x100 + rank);
    return out;
}

std::string byte_level_encode(std::string_view bytes) {
    std::string out;
    for (char c : bytes) {
        out += byte_level_char(static_cast<uint8_t>(c));
    }
    return out;
}

std::vector<std::string> bpe_training_split(std::string_view text) {
    std::vector<std::string> words;
    size_t i = 0;
    while (i < text.size()) {
        size_t begin = i;
        ByteClass cls = byte_class(static_cast<uint8_t>(text[i]));
        // " word": a lone space joins the letter run right after it.
        if (text[i] == ' ' && i + 1 < text.size() &&
            byte_class(static_cast<uint8_t>(text[i + 1])) == ByteClass::kLetter) {
            cls = ByteClass::kLetter;
            ++i;
        }
        size_t limit = cls == ByteClass::kDigit ? 3 : text.size();
        size_t run = 0;
        while (i < text.size() && run < limit && byte_class(static_cast<uint8_t>(text[i])) == cls) {
            // A whitespace run leaves its last space to the letter run that follows it.
            if (cls == ByteClass::kSpace && i > begin && text[i] == ' ' && i + 1 < text.size() &&
                byte_class(static_cast<uint8_t>(text[i + 1])) == ByteClass::kLetter) {
                break;
            }
            ++i;
            ++run;
        }
        if (i == begin) {
            ++i;  // unreachable for a well-formed class scan; keeps the loop strictly advancing
        }
        words.emplace_back(text.substr(begin, i - begin));
    }
    return words;
}

std::vector<BpeMerge> train_bpe(const std::vector<std::string> &words, const BpeTrainOptions &options) {
    // Symbol ids: 0..255 are the bytes, then one id per merge in creation order.
    std::vector<std::string> symbols;
    for (int b = 0; b < 256; ++b) {
        symbols.emplace_back(1, static_cast<char>(b));
    }
    std::set<std::string> existing(symbols.begin(), symbols.end());
    std::set<std::string> reserved(options.reserved.begin(), options.reserved.end());

    // Distinct words with their counts (std::map: a fixed, content-defined order).
    std::map<std::string, uint64_t> word_counts;
    for (const std::string &w : words) {
        if (!w.empty()) {
            ++word_counts[w];
        }
    }
    std::vector<std::vector<int32_t>> pieces;  // per distinct word: its current symbol ids
    std::vector<uint64_t> counts;
    for (const auto &[w, n] : word_counts) {
        std::vector<int32_t> ids;
        for (char c : w) {
            ids.push_back(static_cast<unsigned char>(c));
        }
        pieces.push_back(std::move(ids));
        counts.push_back(n);
    }

    // Pair counts weighted by word frequency, kept up to date as words change.
    std::map<std::pair<int32_t, int32_t>, uint64_t> pair_counts;
    auto add_pairs = [&pair_counts](const std::vector<int32_t> &ids, uint64_t n, bool add) {
        for (size_t k = 0; k + 1 < ids.size(); ++k) {
            auto it = pair_counts.try_emplace({ids[k], ids[k + 1]}, 0).first;
            if (add) {
                it->second += n;
            } else if ((it->second -= n) == 0) {
                pair_counts.erase(it);
            }
        }
    };
    for (size_t w = 0; w < pieces.size(); ++w) {
        add_pairs(pieces[w], counts[w], true);
    }

    std::vector<BpeMerge> merges;
    while (merges.size() < options.max_merges) {
        bool found = false;
        std::pair<int32_t, int32_t> best{0, 0};
        uint64_t best_count = 0;
        for (const auto &[pair, n] : pair_counts) {
            if (n < options.min_count || (found && n < best_count)) {
                continue;
            }
            const std::string &l = symbols[pair.first];
            const std::string &r = symbols[pair.second];
            if (found && n == best_count && !pair_less(l, r, symbols[best.first], symbols[best.second])) {
                continue;
            }
            // Only a pair that would win is checked against the existing tokens (the costly part).
            std::string joined = l + r;
            if (existing.count(joined) != 0 || reserved.count(joined) != 0) {
                continue;
            }
            found = true;
            best = pair;
            best_count = n;
        }
        if (!found) {
            break;
        }
        auto new_id = static_cast<int32_t>(symbols.size());
        symbols.push_back(symbols[best.first] + symbols[best.second]);
        existing.insert(symbols.back());
        merges.push_back({symbols[best.first], symbols[best.second]});
        for (size_t w = 0; w < pieces.size(); ++w) {
            std::vector<int32_t> &ids = pieces[w];
            bool has_pair = false;
            for (size_t k = 0; k + 1 < ids.size() && !has_pair; ++k) {
                has_pair = ids[k] == best.first && ids[k + 1] == best.second;
            }
            if (!has_pair) {
                continue;
            }
            add_pairs(ids, counts[w], false);
            std::vector<int32_t> out;
            out.reserve(ids.size());
            for (size_t k = 0; k < ids.size(); ++k) {
                if (k + 1 < ids.size() && ids[k] == best.first && ids[k + 1] == best.second) {
                    out.push_back(new_id);
                    ++k;
                } else {
                    out.push_back(ids[k]);
                }
            }
            ids = std::move(out);
            add_pairs(ids, counts[w], true);
        }
    }
    return merges;
}

}  // namespace memra::tools
