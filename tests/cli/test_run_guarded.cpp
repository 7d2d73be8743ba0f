// run_guarded, the wrapper main() puts around every subcommand: an exception escaping the action (bad_alloc
// above all) must become one "memra: error: ..." line on stderr and exit code 1, never std::terminate. The
// unit tests call it directly (src/cli/common.cpp is compiled into this executable); the end-to-end test
// runs `memra run` under a low address-space limit on a tokenizer whose sparse vocabulary needs a 512 MiB
// table, which makes the real binary hit bad_alloc on its main thread.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"

namespace {

namespace fs = std::filesystem;
using memra::cli::kExitInvalidInput;
using memra::cli::run_guarded;

// Exit code and stderr of run_guarded(name, action).
struct Guarded {
    int exit_code = -1;
    std::string err;
};

template <class Action>
Guarded guarded(const std::string &name, Action action) {
    ::testing::internal::CaptureStderr();
    Guarded g;
    g.exit_code = run_guarded(name, action);
    g.err = ::testing::internal::GetCapturedStderr();
    return g;
}

TEST(RunGuarded, ReturnsTheActionsExitCodeAndPrintsNothing) {
    for (int code : {0, 1, 2, 7}) {
        const Guarded g = guarded("plan", [code] { return code; });
        EXPECT_EQ(g.exit_code, code);
        EXPECT_EQ(g.err, "");
    }
}

TEST(RunGuarded, BadAllocIsOneOutOfMemoryLineAndExitCode1) {
    const Guarded g = guarded("run", []() -> int { throw std::bad_alloc(); });
    EXPECT_EQ(g.exit_code, kExitInvalidInput);
    EXPECT_EQ(g.err, "memra: error: out of memory (std::bad_alloc) in run\n");
    // A subclass (what new[] throws for an impossible array length) is reported the same way.
    const Guarded len = guarded("bench", []() -> int { throw std::bad_array_new_length(); });
    EXPECT_EQ(len.exit_code, kExitInvalidInput);
    EXPECT_EQ(len.err, "memra: error: out of memory (std::bad_alloc) in bench\n");
}

TEST(RunGuarded, OtherExceptionsPrintWhatOnOneLine) {
    const Guarded g = guarded("inspect", []() -> int { throw std::runtime_error("map::at: key not found"); });
    EXPECT_EQ(g.exit_code, kExitInvalidInput);
    EXPECT_EQ(g.err, "memra: error: map::at: key not found\n");
    const Guarded multi = guarded("inspect", []() -> int { throw std::logic_error("first\nsecond\r\nthird"); });
    EXPECT_EQ(multi.exit_code, kExitInvalidInput);
    EXPECT_EQ(multi.err, "memra: error: first second  third\n");
    const Guarded other = guarded("verify", []() -> int { throw 42; });
    EXPECT_EQ(other.exit_code, kExitInvalidInput);
    EXPECT_EQ(other.err, "memra: error: unknown exception in verify\n");
}

std::string read_text(const fs::path &path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

// Runs a shell command line; returns its exit status (128 + signal when the shell reports a signal).
int shell(const std::string &command) {
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

TEST(RunGuardedCli, OutOfMemoryInRunIsAnErrorLineNotAnAbort) {
    // ASan reserves terabytes of shadow at start-up, which no address-space limit leaves room for.
    if (kAddressSanitizer) GTEST_SKIP() << "needs an address-space limit, which AddressSanitizer cannot run under";
    if (shell("command -v prlimit > /dev/null") != 0) GTEST_SKIP() << "prlimit (util-linux) not installed";
    const fs::path dir = fs::temp_directory_path() / fmt::format("memra_cli_guarded_{}", ::getpid());
    fs::remove_all(dir);
    const fs::path model = dir / "model";
    ASSERT_EQ(shell(fmt::format("{} make-tiny {} > /dev/null", MEMRA_EXE, model.string())), 0);

    // Move one vocabulary entry to id 16,000,000: still below the tokenizer's 2^24 bound, so loading tries
    // to size its id -> token table at 16M std::strings (512 MiB), above the 384 MiB limit below. Moving an
    // entry keeps the vocabulary's size, so the added tokens keep the ids Hugging Face assigns them.
    nlohmann::json tok = nlohmann::json::parse(read_text(model / "tokenizer.json"));
    nlohmann::json &vocab = tok["model"]["vocab"];
    std::string moved;
    for (const auto &[token, id] : vocab.items()) {
        if (token.size() > 1 && id.get<int64_t>() > 255) moved = token;
    }
    ASSERT_FALSE(moved.empty());
    vocab[moved] = 16'000'000;
    std::ofstream(model / "tokenizer.json", std::ios::trunc) << tok.dump();

    const fs::path err = dir / "stderr.txt";
    const int code = shell(fmt::format("prlimit --as={} {} run {} -p hi -n 1 -t 1 > /dev/null 2> {}", 384 << 20,
                                       MEMRA_EXE, model.string(), err.string()));
    const std::string text = read_text(err);
    fs::remove_all(dir);
    EXPECT_EQ(code, kExitInvalidInput) << text;
    EXPECT_EQ(text, "memra: error: out of memory (std::bad_alloc) in run\n");
}

}  // namespace

// memra verify's exit codes: a failed gate has its own code (3), distinct from invalid input (1).
TEST(VerifyExitCode, GateFailuresHaveTheirOwnCode) {
    using memra::cli::verify_exit_code;
    EXPECT_EQ(verify_exit_code(false, 4), memra::cli::kExitOk);
    EXPECT_EQ(verify_exit_code(true, 4), 3);
    EXPECT_EQ(memra::cli::kExitGateFailed, 3);
    EXPECT_NE(memra::cli::kExitGateFailed, kExitInvalidInput);
    EXPECT_EQ(verify_exit_code(false, 0), kExitInvalidInput);  // nothing verified
    EXPECT_EQ(verify_exit_code(true, 0), 3);                   // a failed run outranks the rest
}
