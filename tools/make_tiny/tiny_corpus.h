// The embedded training text for the tiny checkpoint's BPE tokenizer: a few KB of original
// prose, source code, numbers, CJK, emoji and whitespace runs, so the learned merges cover the
// kinds of input the tests feed the tokenizer.
#pragma once

#include <string_view>

namespace memra::tools {

// The whole corpus (UTF-8). Fixed text: changing it changes every tiny tokenizer.
std::string_view tiny_training_corpus();

}  // namespace memra::tools
