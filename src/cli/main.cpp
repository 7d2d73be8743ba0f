// memra: the command-line entry point. Subcommands live in cmd_*.cpp; this file only wires the
// parser, maps parse failures to exit code 2, and runs the chosen action behind run_guarded (an
// escaping exception is exit code 1 with one error line).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.h"

int main(int argc, char **argv) {
    using namespace memra::cli;
    // llama.cpp's multi-letter short flags, which CLI11 cannot declare: rewritten to their long names.
    struct Alias {
        const char *from;
        const char *to;
    };
    static constexpr Alias kAliases[] = {
        {"-ctk", "--cache-type-k"}, {"-ctv", "--cache-type-v"}, {"-ub", "--ubatch-size"}, {"-np", "--parallel"}};
    std::vector<const char *> args(argv, argv + argc);
    for (const char *&arg : args) {
        for (const Alias &alias : kAliases) {
            if (std::strcmp(arg, alias.from) == 0) arg = alias.to;
        }
    }

    CLI::App app{"memra: a deterministic inference engine for Step-3.5-class MoE models", "memra"};
    app.set_version_flag("--version", std::string("memra 0.1.0"));
    // At most one subcommand; a missing one is reported after parsing, so that an unknown word
    // ("memra frobnicate", "memra --bogus") is named in the error instead of "A subcommand is required".
    app.require_subcommand(0, 1);
    app.fallthrough(false);

    const std::vector<Command> commands = {add_inspect_command(app), add_plan_command(app),
                                           add_make_tiny_command(app), add_make_tokenizer_command(app), add_run_command(app),
                                           add_bench_command(app), add_perplexity_command(app),
                                           add_verify_command(app), add_serve_command(app),
                                           add_chat_command(app)};

    try {
        app.parse(argc, args.data());
    } catch (const CLI::ParseError &e) {
        int code = app.exit(e);  // prints help / version / the parse error
        return e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success) ? code : kExitUsage;
    }
    for (const Command &command : commands) {
        if (!command.sub->parsed()) continue;
        // Under mpirun: join the job first (one tensor-parallel rank per process).
        if (auto launched = start_launch(command.sub->get_name()); !launched) {
            return end_launch(report_error(launched.error().message));
        }
        // An exception escaping the action (bad_alloc on a huge input, above all) becomes one error line
        // and exit code 1 instead of std::terminate's abort.
        return end_launch(run_guarded(command.sub->get_name(), command.run));
    }
    app.exit(CLI::RequiredError::Subcommand(1));  // "A subcommand is required" and the --help hint
    return kExitUsage;
}
