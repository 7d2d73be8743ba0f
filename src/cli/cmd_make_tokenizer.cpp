// `memra make-tokenizer -f CORPUS OUT_DIR`: trains make-tiny's byte-level BPE on a text file and writes
// tokenizer.json and tokenizer_config.json (the default model's tokenizer is made this way).
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "make_tiny/make_tiny.h"
#include "make_tiny/tiny_tokenizer.h"

namespace memra::cli {

Command add_make_tokenizer_command(CLI::App &app) {
    auto opts = std::make_shared<tools::TokenizerOptions>();
    auto out_dir = std::make_shared<std::string>();
    auto corpus = std::make_shared<std::string>();

    CLI::App *sub = app.add_subcommand(
        "make-tokenizer",
        "Train make-tiny's byte-level BPE on a text file; write tokenizer.json and tokenizer_config.json");
    sub->add_option("OUT_DIR", *out_dir, "Directory to write the two files into (created if missing)")->required();
    sub->add_option("-f,--file", *corpus, "UTF-8 training text")->required();
    sub->add_option("--vocab-size", opts->vocab_size,
                    "Tokens in all: BOS, EOS, 256 bytes, 8 chat specials and the merges learned")
        ->check(CLI::Range(tools::kTokenizerFixedTokens + 1, tools::kMaxTokenizerVocab))
        ->capture_default_str();
    sub->add_option("--model-max-length", opts->model_max_length, "model_max_length in tokenizer_config.json")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
        ->capture_default_str();
    sub->add_flag("--force", opts->force, "Replace existing tokenizer files in OUT_DIR");

    return {sub, [opts, out_dir, corpus]() {
                opts->out_dir = *out_dir;
                opts->corpus = *corpus;
                auto summary = tools::make_tokenizer_files(*opts);
                if (!summary) return report_error(summary.error().message);
                std::printf("wrote %s/tokenizer.json and tokenizer_config.json: %lld tokens (%lld merges learned "
                            "from %llu bytes), <|im_end|> = %lld\n",
                            opts->out_dir.string().c_str(), static_cast<long long>(summary->n_tokens),
                            static_cast<long long>(summary->n_merges),
                            static_cast<unsigned long long>(summary->corpus_bytes),
                            static_cast<long long>(summary->im_end_id));
                return kExitOk;
            }};
}

}  // namespace memra::cli
