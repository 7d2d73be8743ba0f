// Helpers shared by the subcommands: the embedded default model, error reporting (and the guard that
// turns an escaping exception into an error line), numeric validators, the engine options, make-tiny's model
// options (shared with --synthetic) and loading a checkpoint or a synthetic model onto the CPU or CUDA backend.
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/progress.h"
#ifdef MEMRA_HAVE_CUDA
#include "backend/cuda/convert.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/nccl_comm.h"
#endif

namespace memra::cli {

std::filesystem::path default_model_dir() {
    std::error_code ec;
    std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) return {};
    return exe.parent_path() / "models" / "default";
}

void add_model_dir_option(CLI::App &sub, std::string &model_dir) {
    sub.add_option("MODEL_DIR", model_dir,
                   "Checkpoint directory (config.json + safetensors); default: $MEMRA_MODEL when set, else the "
                   "embedded default model");
}

std::filesystem::path resolve_model_dir(const std::string &model_dir) {
    if (!model_dir.empty()) return model_dir;
    // Read here rather than as the option's environment variable, so that an exported MEMRA_MODEL does not count
    // as a MODEL_DIR argument where --synthetic excludes one.
    if (const char *env = std::getenv("MEMRA_MODEL"); env != nullptr && *env != '\0') return env;
    std::filesystem::path dir = default_model_dir();
    if (dir.empty() || !std::filesystem::exists(dir / "config.json")) {
        report_error(fmt::format("no MODEL_DIR given and the embedded default model is missing (expected {}); "
                                 "build it with `cmake --build build` or write one with `memra make-tiny DIR`",
                                 dir.string()));
        return {};
    }
    return dir;
}

namespace {

// An integer validator for [lo, hi]: the whole text must be a decimal number in range (no sign, no
// spaces, no hex), so nothing is wrapped, saturated or truncated on the way to the option's value.
CLI::Validator integer_validator(uint64_t lo, uint64_t hi, const std::string &name) {
    return CLI::Validator(
        [lo, hi](std::string &text) -> std::string {
            uint64_t value = 0;
            const char *end = text.data() + text.size();
            const auto [ptr, ec] = std::from_chars(text.data(), end, value);
            if (text.empty() || ec != std::errc() || ptr != end || value < lo || value > hi) {
                return fmt::format("expected an integer in [{}, {}], found {}", lo, hi, text);
            }
            return {};
        },
        name);
}

}  // namespace

CLI::Validator uint64_validator() {
    return integer_validator(0, std::numeric_limits<uint64_t>::max(), "");  // the type already reads UINT
}

CLI::Validator positive_int_validator() {
    return integer_validator(1, static_cast<uint64_t>(std::numeric_limits<int>::max()), "POSITIVE");
}

std::string human_count(int64_t n) {
    const double v = static_cast<double>(n);
    if (n >= 1'000'000'000) return fmt::format("{:.2f} B", v / 1e9);
    if (n >= 1'000'000) return fmt::format("{:.2f} M", v / 1e6);
    if (n >= 1'000) return fmt::format("{:.2f} K", v / 1e3);
    return fmt::format("{}", n);
}

int default_threads() {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw > 0 ? static_cast<int>(hw) : 1;
}

void add_threads_option(CLI::App &sub, int &threads) {
    sub.add_option("-t,--threads", threads, "CPU threads (default: the hardware threads)")
        ->envname("MEMRA_THREADS")
        ->check(positive_int_validator())
        ->capture_default_str();
}

void add_numerics_option(CLI::App &sub, Numerics &numerics) {
    const std::map<std::string, Numerics> names = {{"device", Numerics::kDevice}, {"exact", Numerics::kExact}};
    sub.add_option("--numerics", numerics,
                   "what the products and attention compute: device (default) = what a GPU's tensor cores compute "
                   "(bf16 activations before bf16-weight products, e4m3 per 128 values before FP8 experts, "
                   "blocked attention with bf16 q/k, P and V); exact = f32 activations everywhere, the reference "
                   "transformers and llama.cpp's f32 paths are checked against")
        ->envname("MEMRA_NUMERICS")
        ->transform(CLI::CheckedTransformer(names))
        ->default_str("device");
}

void add_device_option(CLI::App &sub, DeviceChoice &device) {
    const std::map<std::string, DeviceChoice> names = {{"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}};
    sub.add_option("--device", device,
                   "where the engine runs: cuda (GPU 0; --tp N on N GPUs over NCCL when the machine has them, else "
                   "every rank on GPU 0; device numerics; -t is unused) or cpu (default: cuda when this build has CUDA "
                   "and a GPU is visible, else cpu)")
        ->envname("MEMRA_DEVICE")
        ->transform(CLI::CheckedTransformer(names));
}

bool cuda_available() {
#ifdef MEMRA_HAVE_CUDA
    return cuda_device_count() > 0;
#else
    return false;
#endif
}

Result<Device> resolve_device(DeviceChoice choice, Numerics numerics) {
    // Exact numerics exist on the CPU only: auto picks it, an explicit cuda is refused.
    if (choice == DeviceChoice::kCpu || numerics == Numerics::kExact) {
        if (choice == DeviceChoice::kCuda) {
            return make_error("--device cuda: the GPU computes --numerics device only; exact runs with --device cpu");
        }
        return Device::kCpu;
    }
    if (cuda_available()) return Device::kCuda;
    if (choice == DeviceChoice::kAuto) return Device::kCpu;
#ifdef MEMRA_HAVE_CUDA
    return make_error("--device cuda: no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
#else
    return make_error("--device cuda: this memra was built without the CUDA backend (no nvcc at configure time)");
#endif
}

void add_kv_format_options(CLI::App &sub, std::string &kv_k, std::string &kv_v) {
    const std::vector<std::string> kv_formats = {"f32", "bf16", "q8_0", "q5_1"};
    sub.add_option("--kv-k,--cache-type-k", kv_k, "KV cache format of the keys (also -ctk)")
        ->envname("MEMRA_KV_K")
        ->check(CLI::IsMember(kv_formats))
        ->capture_default_str();
    sub.add_option("--kv-v,--cache-type-v", kv_v, "KV cache format of the values (also -ctv)")
        ->envname("MEMRA_KV_V")
        ->check(CLI::IsMember(kv_formats))
        ->capture_default_str();
}

void add_tp_option(CLI::App &sub, int &tp) {
    sub.add_option("--tp,--tensor-parallel-size", tp,
                   "Tensor-parallel ranks as `memra plan` splits the model (routed experts whole, each computed by its "
                   "owner rank): threads of one process, -t divided among them (on cuda: a GPU each over NCCL when "
                   "there are enough, else sharing GPU 0); under mpirun one rank per process, --tp = the process count")
        ->envname("MEMRA_TP")
        ->check(positive_int_validator())
        ->capture_default_str();
}

void add_prefix_cache_option(CLI::App &sub, bool &prefix_cache) {
    sub.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", prefix_cache,
                 "Reuse the KV rows of a prompt's cached prefix (whole 64-token blocks committed by earlier requests; "
                 "the output does not change). On by default")
        ->envname("MEMRA_PREFIX_CACHING");
}

CLI::Option *add_spec_draft_option(CLI::App &sub, int &spec_draft, int default_draft) {
    spec_draft = default_draft;
    return sub.add_option("--spec-draft,--draft", spec_draft,
                   "Speculative decoding: tokens the chained MTP layers draft per decode step, verified by the "
                   "trunk in the same step (0 = off). Drafts change speed, never the output: a draft stands only "
                   "if it equals the token the model samples there")
        ->envname("MEMRA_SPEC_DRAFT")
        ->check(CLI::Range(0, model::kMaxMtp))
        ->capture_default_str();
}

Result<int> enable_speculation(runtime::EngineOptions &options, const model::Step35Config &cfg, int spec_draft,
                               bool given) {
    const int layers = std::min(cfg.n_mtp_layers, model::kMaxMtp);
    // A default K fits the model's MTP layers and the step budget (K drafts need 2K rows).
    if (!given) spec_draft = static_cast<int>(std::min<int64_t>({spec_draft, layers, options.step_rows / 2}));
    if (spec_draft == 0) return 0;
    if (spec_draft > layers) {
        return make_error("--spec-draft {}: the model has {} MTP layer(s) (num_nextn_predict_layers), each drafting "
                          "one token; use --spec-draft {} at most",
                          spec_draft, cfg.n_mtp_layers, layers);
    }
    options.mtp_layers = spec_draft;  // the layers that draft; the rest would only catch up
    options.spec_draft = spec_draft;
    return spec_draft;
}

std::string spec_summary(const runtime::SpecStats &stats, int spec_draft) {
    std::string rates;
    for (int j = 0; j < spec_draft; ++j) rates += fmt::format("{}{:.3f}", j == 0 ? "" : " ", stats.rate(j));
    return fmt::format("acceptance {} per draft position, {:.2f} tokens per step ({} steps)", rates,
                       stats.tokens_per_step(), stats.steps);
}

Result<std::pair<KvFormat, KvFormat>> parse_kv_format_options(const std::string &kv_k,
                                                                       const std::string &kv_v) {
    auto k = parse_kv_format(kv_k);
    if (!k) return make_error("--kv-k: {}", k.error().message);
    auto v = parse_kv_format(kv_v);
    if (!v) return make_error("--kv-v: {}", v.error().message);
    return std::pair{*k, *v};
}

std::optional<EngineInputs> load_engine_inputs(const std::string &model_dir, const std::string &kv_k,
                                               const std::string &kv_v) {
    return load_model_inputs(model_dir, SyntheticChoice{}, 1, kv_k, kv_v);
}

std::optional<EngineInputs> load_model_inputs(const std::string &model_dir, const SyntheticChoice &synthetic,
                                              int threads, const std::string &kv_k, const std::string &kv_v) {
    auto kv_formats = parse_kv_format_options(kv_k, kv_v);
    if (!kv_formats) {
        report_error(kv_formats.error().message);
        return std::nullopt;
    }
    if (synthetic.given) {
        auto model = open_synthetic_model(synthetic.options, threads);
        if (!model) {
            report_error(model.error().message);
            return std::nullopt;
        }
        return EngineInputs{kv_formats->first, kv_formats->second, {}, std::move(model->cfg), std::move(model->name),
                            std::move(model->store)};
    }
    std::filesystem::path dir = resolve_model_dir(model_dir);
    if (dir.empty()) return std::nullopt;
    auto cfg = model::load_step35_config(dir);
    if (!cfg) {
        report_error(cfg.error().message);
        return std::nullopt;
    }
    std::string name = dir.string();
    return EngineInputs{kv_formats->first, kv_formats->second, std::move(dir), std::move(*cfg), std::move(name),
                        nullptr};
}

Result<std::unique_ptr<io::TensorStore>> open_store(EngineInputs &in) {
    if (in.synthetic) return std::unique_ptr<io::TensorStore>(std::move(in.synthetic));
    auto ckpt = io::Checkpoint::open(in.dir);
    if (!ckpt) return tl::unexpected(ckpt.error());
    return std::unique_ptr<io::TensorStore>(std::make_unique<io::Checkpoint>(std::move(*ckpt)));
}

std::string tiny_preset_help() {
    std::string out;
    for (const tools::TinyPresetInfo &p : tools::tiny_presets()) {
        out += fmt::format("\n  {:<7} {}", p.name, p.description);
    }
    return out;
}

void add_tiny_model_options(CLI::App &sub, tools::TinyOptions &options, const std::string &prefix) {
    const auto name = [&prefix](const char *flag) { return "--" + prefix + flag; };
    // CLI11 alone would wrap "-1" into 2^64 - 1 and saturate 2^64; the validator refuses both.
    sub.add_option(prefix.empty() ? "-s,--seed" : name("seed"), options.seed,
                   "Weight seed (the files are byte-identical for a seed)")
        ->check(uint64_validator())
        ->capture_default_str();
    sub.add_option(name("dtype"), options.dtype,
                   "Weight format: bf16, or fp8 (routed experts F8_E4M3, 128x128 scales)")
        ->check(CLI::IsMember({"bf16", "fp8"}))
        ->capture_default_str();
    sub.add_option(name("moe-intermediate-size"), options.moe_intermediate_size,
                   "Routed expert width, replacing the preset's (e.g. 1280, the release's); 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, tools::kMaxTinyMoeIntermediateSize))
        ->capture_default_str();
    sub.add_option(name("sliding-window"), options.sliding_window,
                   "Sliding window of the sliding-attention layers, replacing the preset's (e.g. 192: three KV "
                   "pages of 64 rows); 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, int64_t{1} << 20))
        ->capture_default_str();
    sub.add_option(name("mtp-layers"), options.mtp_layers,
                   "MTP layers (num_nextn_predict_layers), replacing the preset's (3: the release's); 0 keeps the "
                   "preset's")
        ->check(CLI::Range(int64_t{0}, int64_t{3}))
        ->capture_default_str();
    sub.add_option(name("layers"), options.layers,
                   "Trunk layers (num_hidden_layers), replacing the preset's; MoE layers run from the preset's first "
                   "MoE layer to the last; 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, tools::kMaxTinyLayers))
        ->capture_default_str();
    sub.add_option(name("experts"), options.experts,
                   "Routed experts (moe_num_experts, at least the preset's top-k), replacing the preset's (288: the "
                   "release's); 0 keeps the preset's")
        ->check(CLI::Range(int64_t{0}, tools::kMaxTinyExperts))
        ->capture_default_str();
}

void add_synthetic_options(CLI::App &sub, SyntheticChoice &choice) {
    CLI::Option *synthetic =
        sub.add_option("--synthetic", choice.options.preset,
                       "Instead of MODEL_DIR: the model `memra make-tiny --preset PRESET` would write (with the "
                       "--synthetic-* options as make-tiny's), generated in memory from its seed, never on disk (a "
                       "backend that copies, CUDA, holds one tensor at a time in host memory); no tokenizer (token "
                       "ids only); -t threads generate it. Step-3.5-E128 in the official layout: --synthetic e128 "
                       "--synthetic-dtype fp8. Presets:" +
                           tiny_preset_help())
            ->type_name("PRESET")
            ->each([&choice](const std::string &) { choice.given = true; })
            ->excludes("MODEL_DIR");
    const size_t first = sub.get_options().size();
    add_tiny_model_options(sub, choice.options, "synthetic-");
    const std::vector<CLI::Option *> all = sub.get_options();
    for (size_t i = first; i < all.size(); ++i) all[i]->needs(synthetic);
}

Result<SyntheticModel> open_synthetic_model(const tools::TinyOptions &options, int threads) {
    auto model = tools::resolve_tiny_model(options, "--synthetic");
    if (!model) return tl::unexpected(model.error());
    auto store = std::make_unique<tools::SyntheticStore>(model->preset, options.seed, model->fp8, std::max(1, threads));
    std::string name =
        fmt::format("synthetic {} {} seed {}", model->preset.name, model->fp8 ? "fp8" : "bf16", options.seed);
    auto cfg = model::parse_step35_config(store->config_json());
    if (!cfg) return wrap_error(name + ": config.json", cfg.error());
    return SyntheticModel{std::move(name), std::move(*cfg), std::move(store)};
}

std::string synthetic_summary(const tools::SyntheticStats &stats) {
    return fmt::format("generated {} tensors, {:.2f} GB in {:.1f} s: {:.2f} GB/s on {} thread{}; at most {:.2f} GB "
                       "held at once",
                       stats.tensors, 1e-9 * static_cast<double>(stats.bytes), stats.seconds, stats.gb_per_s(),
                       stats.threads, stats.threads == 1 ? "" : "s", 1e-9 * static_cast<double>(stats.peak_held_bytes));
}

bool ranks_use_nccl([[maybe_unused]] int tp) {
#if defined(MEMRA_HAVE_CUDA) && defined(MEMRA_HAVE_NCCL)
    return tp > 1 && cuda_device_count() >= tp;
#else
    return false;
#endif
}

int rank_gpu(int tp, int rank) {
    if (process_launch().size > 1) return process_launch().local_rank;
    return ranks_use_nccl(tp) ? rank : 0;
}

runtime::CommFactory nccl_comm_factory() {
    return [](std::span<Backend *const> backends) -> Result<std::vector<std::unique_ptr<parallel::Communicator>>> {
        std::vector<std::unique_ptr<parallel::Communicator>> none;
#if defined(MEMRA_HAVE_CUDA) && defined(MEMRA_HAVE_NCCL)
        std::vector<int> devices;
        std::vector<cudaStream_t> streams;
        for (Backend *b : backends) {
            auto *cb = dynamic_cast<cuda::CudaBackend *>(b);
            if (cb == nullptr) return none;
            if (std::find(devices.begin(), devices.end(), cb->device_index()) != devices.end()) return none;
            devices.push_back(cb->device_index());
            streams.push_back(cb->stream());
        }
        auto group = cuda::NcclGroup::create(devices, streams);
        if (!group) return tl::unexpected(group.error());
        return group->release();
#else
        (void)backends;
        return none;
#endif
    };
}

runtime::BackendFactory backend_factory(const BackendChoice &backends, [[maybe_unused]] int tp) {
    const int per_rank = std::max(1, backends.n_threads);
    const Numerics numerics = backends.numerics;
    const DraftForcing *forcing = backends.forcing;
#ifdef MEMRA_HAVE_CUDA
    if (backends.device == Device::kCuda) {
        return [numerics, forcing, tp](int rank) -> Result<std::unique_ptr<Backend>> {
            auto be = cuda::CudaBackend::create(rank_gpu(tp, rank), numerics, forcing);
            if (!be) return tl::unexpected(be.error());
            return std::unique_ptr<Backend>(std::move(*be));
        };
    }
#endif
    return [per_rank, numerics, forcing](int) -> Result<std::unique_ptr<Backend>> {
        if (forcing != nullptr) {
            return std::unique_ptr<Backend>(std::make_unique<cpu::ForcedDraftBackend>(per_rank, numerics, forcing));
        }
        return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(per_rank, numerics));
    };
}

Result<LoadedEngine> load_engine(const std::filesystem::path &dir, const model::Step35Config &cfg,
                                 runtime::EngineOptions options, const BackendChoice &backends) {
    auto ckpt = io::Checkpoint::open(dir);
    if (!ckpt) return tl::unexpected(ckpt.error());
    return load_engine(std::make_unique<io::Checkpoint>(std::move(*ckpt)), cfg, std::move(options), backends);
}

Result<LoadedEngine> load_engine(std::unique_ptr<io::TensorStore> store, const model::Step35Config &cfg,
                                 runtime::EngineOptions options, const BackendChoice &backends) {
    LoadedEngine out{std::move(store), nullptr};
    if (auto ok = apply_launch(options, backends.device); !ok) return tl::unexpected(ok.error());
    const bool process_rank = options.process_rank >= 0;  // one rank per process (mpirun)
    BackendChoice per_rank = backends;
    per_rank.n_threads = std::max(1, backends.n_threads / (process_rank ? 1 : std::max(1, options.tp)));
    options.make_backend = backend_factory(per_rank);
#ifdef MEMRA_HAVE_CUDA
    if (backends.device == Device::kCuda) {
        // Ranks sharing GPU 0 hold at least the checkpoint's bytes there; ranks on their own GPUs (NCCL) at least
        // a tp-th each (the replicated tensors come on top).
        const bool nccl = process_rank || ranks_use_nccl(options.tp);
        const int first_gpu = rank_gpu(options.tp, std::max(0, options.process_rank));
        auto gpu = cuda::gpu_info(first_gpu);
        if (!gpu) return tl::unexpected(gpu.error());
        const auto total = static_cast<int64_t>(out.store->total_bytes());
        const int64_t weights = total / (nccl ? options.tp : 1);  // what the first rank's GPU must hold at least
        if (process_rank) {
            std::fprintf(stderr, "cuda: rank %d of %d (a process each) on GPU %d, exchanging over NCCL\n",
                         options.process_rank, options.tp, first_gpu);
        } else if (options.tp > 1) {
            std::fprintf(stderr, "cuda: %d ranks %s\n", options.tp,
                         nccl ? fmt::format("on GPUs 0-{}, exchanging over NCCL", options.tp - 1).c_str()
                              : "sharing GPU 0, exchanging by device copies");
        }
        if (nccl && !process_rank) options.make_comms = nccl_comm_factory();
        if (weights > gpu->free_bytes) {
            return make_error("cuda: the model's weights need {:.1f} GiB but {} has {:.1f} GiB free of {:.1f} GiB; use "
                              "--device cpu or a larger GPU",
                              static_cast<double>(weights) / (1 << 30), gpu->name,
                              static_cast<double>(gpu->free_bytes) / (1 << 30),
                              static_cast<double>(gpu->total_bytes) / (1 << 30));
        }
        options.rank_copy = cuda::cuda_rank_copy;
        auto progress = std::make_shared<std::function<void(int64_t)>>(upload_progress_printer(total));  // every rank's uploads
        auto uploaded = std::make_shared<int64_t>(0);
        options.make_backend = [numerics = backends.numerics, forcing = backends.forcing, progress, uploaded,
                                tp = options.tp](int rank) -> Result<std::unique_ptr<Backend>> {
            auto be = cuda::CudaBackend::create(rank_gpu(tp, rank), numerics, forcing);
            if (!be) return tl::unexpected(be.error());
            (*be)->set_upload_observer([progress, uploaded](int64_t bytes) {
                *uploaded += bytes;
                (*progress)(*uploaded);
            });
            return std::unique_ptr<Backend>(std::move(*be));
        };
    }
#endif
    auto engine = runtime::Engine::create(*out.store, cfg, options);
    if (!engine) return tl::unexpected(engine.error());
    out.engine = std::move(*engine);
    return out;
}

void add_engine_size_options(CLI::App &sub, int64_t &ctx_size, int64_t &step_rows) {
    sub.add_option("-c,--ctx-size", ctx_size,
                   "KV cache size in positions, allocated once at start (a sequence reaches at most this and the "
                   "model's context length)")
        ->envname("MEMRA_CTX_SIZE")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
        ->capture_default_str();
    sub.add_option("--ubatch-size", step_rows,
                   "Rows per engine step (also -ub): a longer prompt is prefilled in chunks of this many tokens; buffers are "
                   "sized by it, not by the prompt")
        ->envname("MEMRA_UBATCH")
        ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
        ->capture_default_str();
}

Result<std::optional<text::ChatTemplate>> load_chat_template(const text::Tokenizer &tok, const std::string &file,
                                                             std::string &origin) {
    std::string source = tok.chat_template();
    origin = "tokenizer_config.json";
    if (!file.empty()) {
        std::ifstream in(file, std::ios::binary);
        if (!in) return make_error("--chat-template: cannot open {}", file);
        std::ostringstream text;
        text << in.rdbuf();
        source = text.str();
        origin = file;
    }
    if (source.empty()) return std::optional<text::ChatTemplate>();
    const auto text_of = [&](std::optional<int32_t> id) { return id ? tok.token_text(*id) : std::string(); };
    const std::span<const int32_t> eos = tok.eos_ids();
    auto made = text::ChatTemplate::create(std::move(source), text_of(tok.bos_id()),
                                           eos.empty() ? std::string() : tok.token_text(eos.front()));
    if (!made) return make_error("chat template ({}): {}", origin, made.error().message);
    return std::optional<text::ChatTemplate>(std::move(*made));
}

void add_sampling_options(CLI::App &sub, SamplingParams &s) {
    sub.add_option("--temp,--temperature", s.temperature, "Temperature (0 = greedy)")
        ->envname("MEMRA_TEMP")
        ->check(CLI::Range(0.0f, std::numeric_limits<float>::max()))
        ->capture_default_str();
    sub.add_option("--top-k", s.top_k, "Top-k (0 = off)")
        ->envname("MEMRA_TOP_K")
        ->check(CLI::Range(0, std::numeric_limits<int32_t>::max()))
        ->capture_default_str();
    sub.add_option("--top-p", s.top_p, "Top-p, nucleus (1 = off)")
        ->envname("MEMRA_TOP_P")
        ->check(CLI::Range(0.0f, 1.0f))
        ->capture_default_str();
    sub.add_option("--min-p", s.min_p, "Min-p, relative to the most likely token (0 = off)")
        ->envname("MEMRA_MIN_P")
        ->check(CLI::Range(0.0f, 1.0f))
        ->capture_default_str();
    sub.add_option("--repeat-penalty", s.repetition_penalty, "Repetition penalty (1 = off)")
        ->envname("MEMRA_REPEAT_PENALTY")
        ->check(CLI::Range(0.0f, std::numeric_limits<float>::max()))
        ->capture_default_str();
    sub.add_option("--repeat-last-n", s.penalty_last_n,
                    "Context tokens the penalties look at (0 = none, -1 = the whole context)")
        ->envname("MEMRA_REPEAT_LAST_N")
        ->check(CLI::Range(-1, std::numeric_limits<int32_t>::max()))
        ->capture_default_str();
    sub.add_option("--presence-penalty", s.presence_penalty, "Presence penalty (0 = off)")
        ->envname("MEMRA_PRESENCE_PENALTY")
        ->capture_default_str();
    sub.add_option("--frequency-penalty", s.frequency_penalty, "Frequency penalty (0 = off)")
        ->envname("MEMRA_FREQUENCY_PENALTY")
        ->capture_default_str();
    sub.add_option("-s,--seed", s.seed, "Sampling seed (same seed and settings give the same text)")
        ->envname("MEMRA_SEED")
        ->check(uint64_validator())
        ->capture_default_str();
}

int verify_exit_code(bool any_gate_failed, int native_runs) {
    if (any_gate_failed) return kExitGateFailed;
    return native_runs == 0 ? kExitInvalidInput : kExitOk;
}

int report_error(const std::string &message) {
    std::fprintf(stderr, "error: %s\n", message.c_str());
    return kExitInvalidInput;
}

int run_guarded(const std::string &name, const std::function<int()> &action) {
    // The handlers only write to unbuffered stderr: after bad_alloc, building a message string could
    // throw again.
    try {
        return action();
    } catch (const std::bad_alloc &) {
        std::fprintf(stderr, "memra: error: out of memory (std::bad_alloc) in %s\n", name.c_str());
    } catch (const std::exception &e) {
        std::fputs("memra: error: ", stderr);
        for (const char *c = e.what(); *c != '\0'; ++c) std::fputc(*c == '\n' || *c == '\r' ? ' ' : *c, stderr);
        std::fputc('\n', stderr);
    } catch (...) {
        std::fprintf(stderr, "memra: error: unknown exception in %s\n", name.c_str());
    }
    return kExitInvalidInput;
}

}  // namespace memra::cli
