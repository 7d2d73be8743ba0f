// The memra subcommands. Each add_*_command registers its options on the app and returns the
// action to run when that subcommand was chosen. Actions return the process exit code:
// 0 ok, 1 invalid input (bad file, config, checkpoint), 2 usage (set by the parser itself), 3 a verify gate
// failed.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <CLI/CLI.hpp>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/forced_draft_backend.h"
#include "core/kv_format.h"
#include "core/result.h"
#include "io/safetensors.h"
#include "make_tiny/make_tiny.h"
#include "make_tiny/synthetic_store.h"
#include "model/step35_config.h"
#include "model/step35_model.h"
#include "runtime/engine.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace memra::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInvalidInput = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitGateFailed = 3;  // memra verify: a determinism gate found a mismatch

// A registered subcommand and what to run when the parser chose it.
struct Command {
    CLI::App *sub = nullptr;
    std::function<int()> run;
};

Command add_inspect_command(CLI::App &app);
Command add_plan_command(CLI::App &app);
Command add_make_tiny_command(CLI::App &app);
Command add_make_tokenizer_command(CLI::App &app);
Command add_run_command(CLI::App &app);
Command add_bench_command(CLI::App &app);
Command add_perplexity_command(CLI::App &app);
Command add_verify_command(CLI::App &app);
Command add_serve_command(CLI::App &app);
Command add_chat_command(CLI::App &app);

// The embedded default model: <directory of the memra executable>/models/default, the committed trained
// checkpoint the build copies there. MEMRA_MODEL (or a MODEL_DIR argument) overrides it.
std::filesystem::path default_model_dir();

// Adds the optional positional MODEL_DIR (with its MEMRA_MODEL environment mirror).
void add_model_dir_option(CLI::App &sub, std::string &model_dir);

// The model directory to use: the argument if given, else $MEMRA_MODEL when set, else the embedded default
// (with a clear message on stderr and an empty path when that is missing).
std::filesystem::path resolve_model_dir(const std::string &model_dir);

// The exit code of `memra verify`: kExitGateFailed when a gate failed, else kExitInvalidInput when nothing
// was verified (the plan refused every degree), else kExitOk.
int verify_exit_code(bool any_gate_failed, int native_runs);

// Prints "error: <message>" to stderr and returns kExitInvalidInput.
int report_error(const std::string &message);

// Runs a subcommand's action and turns any exception escaping it into one line on stderr and
// kExitInvalidInput, never std::terminate: "memra: error: out of memory (std::bad_alloc) in <name>" for
// std::bad_alloc, "memra: error: <what()>" for another std::exception (line breaks shown as spaces),
// "memra: error: unknown exception in <name>" otherwise. Exceptions on other threads are not seen here.
int run_guarded(const std::string &name, const std::function<int()> &action);

// Validators for numeric options, checked on the text before CLI11 converts it: CLI11 itself wraps "-1"
// into an unsigned option and saturates values past its range. Failures are usage errors (exit 2),
// reported as "--seed: expected an integer in [0, 18446744073709551615], found -1".
CLI::Validator uint64_validator();        // decimal digits, 0 .. 2^64 - 1
CLI::Validator positive_int_validator();  // decimal digits, 1 .. INT_MAX

// A count as inspect and bench print it, like llama-bench's params column: 8860672 -> "8.86 M".
std::string human_count(int64_t n);

// The hardware threads (at least 1): the default of -t/--threads.
int default_threads();

// Options shared by the commands that run the CPU engine (run, bench, perplexity), with the same spellings, help
// texts and MEMRA_* mirrors: -t/--threads, the KV cache formats -ctk/--kv-k/--cache-type-k and
// -ctv/--kv-v/--cache-type-v (f32, bf16, q8_0, q5_1; parsed later with parse_kv_format), and --tp (bench,
// perplexity: CPU ranks of one process).
void add_threads_option(CLI::App &sub, int &threads);
void add_kv_format_options(CLI::App &sub, std::string &kv_k, std::string &kv_v);
// --numerics device|exact (run, bench, perplexity, verify; MEMRA_NUMERICS): ENGINE.md section 4's two modes.
void add_numerics_option(CLI::App &sub, Numerics &numerics);
// --device cpu|cuda (MEMRA_DEVICE): where the engine runs; unset = auto.
enum class DeviceChoice { kAuto, kCpu, kCuda };
void add_device_option(CLI::App &sub, DeviceChoice &device);
// Whether this build has the CUDA backend and a GPU is visible.
bool cuda_available();
// The device a command runs on: auto is cuda when cuda_available(), else cpu. Refused, naming the flag: cuda in a
// build without CUDA or with no visible GPU; exact numerics on cuda (the GPU computes device numerics only).
Result<Device> resolve_device(DeviceChoice choice, Numerics numerics);
inline const char *device_name(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }
void add_tp_option(CLI::App &sub, int &tp);
// --enable-prefix-caching / --no-enable-prefix-caching (vLLM's names): reuse the KV pages of a cached prompt prefix.
void add_prefix_cache_option(CLI::App &sub, bool &prefix_cache);
// The two formats those options name; the error names the option ("--kv-k: ...").
Result<std::pair<KvFormat, KvFormat>> parse_kv_format_options(const std::string &kv_k,
                                                                       const std::string &kv_v);

// One line per make-tiny preset ("\n  name    description"), for --preset and --synthetic help.
std::string tiny_preset_help();
// make-tiny's model options (seed, dtype and the size overrides) on a subcommand, each named --<prefix><name>:
// make-tiny's own (prefix "", the seed also -s), or those of --synthetic (prefix "synthetic-": bench and verify
// have a -s/--seed and an --experts of their own). One definition for both, so the help texts and ranges agree.
void add_tiny_model_options(CLI::App &sub, tools::TinyOptions &options, const std::string &prefix);

// --synthetic PRESET (bench, verify): the model make-tiny would write for PRESET (and the --synthetic-* options),
// generated in memory tensor by tensor instead of read from a MODEL_DIR (tools/make_tiny/synthetic_store.h).
struct SyntheticChoice {
    bool given = false;          // --synthetic was passed
    tools::TinyOptions options;  // preset (the --synthetic value), seed, dtype, overrides
};
// Adds --synthetic (excluding MODEL_DIR) and the --synthetic-* options, which need it.
void add_synthetic_options(CLI::App &sub, SyntheticChoice &choice);

// A model generated in memory: its store (generating on `threads` threads), its config (parsed from the
// config.json make-tiny would write, so it is validated exactly like a checkpoint's) and its name in reports.
struct SyntheticModel {
    std::string name;  // "synthetic e128 fp8 seed 0"
    model::Step35Config cfg;
    std::unique_ptr<tools::SyntheticStore> store;
};
// Refused, naming --synthetic: an unknown preset (listing the valid ones), an override out of range.
Result<SyntheticModel> open_synthetic_model(const tools::TinyOptions &options, int threads);
// "generated 1011 tensors, 102.70 GB in 25.1 s: 4.09 GB/s on 16 threads; at most 1.34 GB held at once".
std::string synthetic_summary(const tools::SyntheticStats &stats);

// What the commands that drive the engine (run, bench, perplexity) start from: the KV formats their options
// name, the model directory (resolve_model_dir) and its config.json, or a synthetic model.
struct EngineInputs {
    KvFormat k_format = KvFormat::kBf16;
    KvFormat v_format = KvFormat::kBf16;
    std::filesystem::path dir;  // empty for a synthetic model
    model::Step35Config cfg;
    std::string name;  // the directory, or the synthetic model's name
    std::unique_ptr<tools::SyntheticStore> synthetic;  // set for a synthetic model (no directory, no tokenizer)
};
// Parses the formats, resolves the directory and loads its config, in that order; nullopt after the first
// failure, whose error is then on stderr (an input error: exit code kExitInvalidInput).
std::optional<EngineInputs> load_engine_inputs(const std::string &model_dir, const std::string &kv_k,
                                               const std::string &kv_v);
// load_engine_inputs, or with --synthetic the formats, then open_synthetic_model (generating on `threads`);
// MEMRA_MODEL is then ignored.
std::optional<EngineInputs> load_model_inputs(const std::string &model_dir, const SyntheticChoice &synthetic,
                                              int threads, const std::string &kv_k, const std::string &kv_v);
// The weights of the inputs: the synthetic store (moved out of `in`), or the checkpoint in in.dir, opened now.
Result<std::unique_ptr<io::TensorStore>> open_store(EngineInputs &in);

// The engine over a tensor store (a checkpoint or a synthetic model): what run, bench and perplexity execute.
// Members are destroyed in reverse order: a CPU engine's weights are views into the store.
struct LoadedEngine {
    std::unique_ptr<io::TensorStore> store;
    std::unique_ptr<runtime::Engine> engine;
};

// What the engine's ranks run on.
struct BackendChoice {
    Device device = Device::kCpu;  // cpu: options.tp CPU ranks; cuda: options.tp ranks, see rank_gpu
    int n_threads = 1;             // CPU threads, split over the ranks (at least one each)
    Numerics numerics = Numerics::kDevice;
    const DraftForcing *forcing = nullptr;  // speculation's drafts replaced (bench --spec-accept)
};

// Opens the checkpoint in `dir` and creates an engine (options without a backend factory) on `backends`. On
// cuda, a checkpoint larger than the GPU's free memory is refused before anything is uploaded, and the upload
// shows its progress on stderr. The error is the checkpoint's, the validation's, the device's or the engine's
// message.
Result<LoadedEngine> load_engine(const std::filesystem::path &dir, const model::Step35Config &cfg,
                                 runtime::EngineOptions options, const BackendChoice &backends);
// The same over an open store (a synthetic model): its total bytes are what the GPU check compares.
Result<LoadedEngine> load_engine(std::unique_ptr<io::TensorStore> store, const model::Step35Config &cfg,
                                 runtime::EngineOptions options, const BackendChoice &backends);
// A backend factory for rank r of `tp` ranks on `backends` (verify's native ranks and reference), without upload
// progress.
runtime::BackendFactory backend_factory(const BackendChoice &backends, int tp = 1);
// Where rank `rank` of `tp` CUDA ranks runs: under a multi-process launch the process's GPU (its local rank);
// else GPU `rank` when the machine has at least tp GPUs and the build has NCCL (ranks_use_nccl), else GPU 0,
// which the ranks then share, exchanging by device copies.
int rank_gpu(int tp, int rank);
bool ranks_use_nccl(int tp);
// The engine's communicators for CUDA ranks on distinct GPUs: one NCCL group over the backends' GPUs and
// streams; none (the in-process group) when the ranks share a GPU.
runtime::CommFactory nccl_comm_factory();

// A multi-process launch (launch.cpp): under Open MPI's mpirun each process runs one tensor-parallel rank of run,
// bench or perplexity (--tp = the process count); MPI carries the CPU ranks' traffic and, on GPUs, rank 0's NCCL
// id (the ranks then talk over NCCL, a process per GPU of its host).
struct ProcessLaunch {
    int rank = 0;        // this process's rank in the job
    int size = 1;        // processes in the job (1: started alone)
    int local_rank = 0;  // among the job's processes on this host: its GPU
    int local_size = 1;
};
// This process's launch ({0, 1, 0, 1} unless start_launch found mpirun).
const ProcessLaunch &process_launch();
// main(), before the command: joins the MPI job when mpirun started this process; a rank past 0 writes nothing to
// stdout. Refused: several processes for a command other than run, bench, perplexity; a build without MPI.
Result<void> start_launch(const std::string &command);
// main(), after the command: leaves the MPI job (a failed rank of several aborts it, so no peer waits on it);
// returns exit_code.
int end_launch(int exit_code);
// load_engine: under a launch of several processes, this process's rank (options.process_rank) and the
// communicator that reaches the others. Refused: --tp other than the process count.
Result<void> apply_launch(runtime::EngineOptions &options, Device device);

// The chat template of serve and chat: the --chat-template FILE when given, else tokenizer_config.json's (nullopt
// when neither has one), with the tokenizer's BOS and EOS texts; `origin` says which. Refused: an unreadable file,
// a template that does not parse (the message names where it came from).
Result<std::optional<text::ChatTemplate>> load_chat_template(const text::Tokenizer &tok, const std::string &file,
                                                             std::string &origin);

// The sampling options of run and chat (llama.cpp's spellings and defaults, MEMRA_* mirrors): --temp, --top-k,
// --top-p, --min-p, --repeat-penalty, --repeat-last-n, --presence-penalty, --frequency-penalty, -s/--seed.
void add_sampling_options(CLI::App &sub, SamplingParams &sampling);

// Options shared by the commands that drive the engine (run, bench, perplexity): -c/--ctx-size and
// -ub/--ubatch-size.
void add_engine_size_options(CLI::App &sub, int64_t &ctx_size, int64_t &step_rows);

// The drafts per step `run` makes by default on a model with MTP layers: see README "Speculative decoding" for
// the measurement behind it.
inline constexpr int kDefaultSpecDraft = 1;
// Speculative decoding (run, bench, serve): --spec-draft K, the drafts the MTP layers make per decode step (0: off).
CLI::Option *add_spec_draft_option(CLI::App &sub, int &spec_draft, int default_draft);
// Gives the engine the MTP layers K drafts need (K = 0: none) and returns the K it runs. K asked for (`given`:
// the flag or its variable was set) and more than the model's MTP layers is refused, naming the flag, K and the
// model's count; a default K is lowered to the model's layers (0 without any) and to half the step budget
// (options.step_rows, set before).
Result<int> enable_speculation(runtime::EngineOptions &options, const model::Step35Config &cfg, int spec_draft,
                               bool given);
// "acceptance 0.62 0.41 0.30 per draft position, 2.33 tokens per step (57 steps)".
std::string spec_summary(const runtime::SpecStats &stats, int spec_draft);

}  // namespace memra::cli
