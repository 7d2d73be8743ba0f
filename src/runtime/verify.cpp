// memra verify's gates (verify.h). The scenario is data (Action list, the MTP stage, the batch probe); the
// TP=1 reference engine runs it once, recording logits, sampled tokens, KV rows and the tapped layer's
// intermediates, and computes the per-expert oracle and the host combine from its taps; each native engine
// then runs the same scenario and is compared stage by stage, rank by rank. Nothing here is timed: it counts
// bits and work.
#include "runtime/verify.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "core/device_numerics.h"
#include "core/float_formats.h"
#include "core/math.h"
#include "model/step35_forward.h"
#include "model/step35_moe.h"
#include "model/step35_plan.h"
#include "model/step35_weights.h"
#include "parallel/plan.h"
#include "runtime/engine.h"

namespace memra::runtime {

namespace {

using model::AttnKind;
using model::FfnKind;
using model::kFp8ScaleSuffix;
using model::LayerGeometry;
using model::Step35Config;
using model::Tap;
using model::TapFn;
using model::kTapCount;
using model::tap_name;

// ---- Gate names (report order) ----

constexpr const char *kLogitsPrefill = "LOGITS_PREFILL";
constexpr const char *kLogitsDecode = "LOGITS_DECODE";
constexpr const char *kKvBytes = "KV_BYTES";
constexpr const char *kKvTransactions = "KV_TRANSACTIONS";
constexpr const char *kKvPages = "KV_PAGES";
constexpr const char *kKvSliding = "KV_SLIDING_RELEASE";
constexpr const char *kMtpGate = "MTP";
constexpr const char *kSpecGate = "SPECULATION";
constexpr const char *kBatch = "BATCH_INVARIANCE";
constexpr const char *kStepWork = "STEP_WORK";
constexpr const char *kAttnCacheless = "ATTENTION_CACHELESS";
constexpr const char *kAttnCached = "ATTENTION_CACHED";
constexpr const char *kRouter = "ROUTER";
constexpr const char *kExperts = "EXPERTS_GROUPED";
constexpr const char *kRows = "EXPERT_ROWS_ALL_RANKS";
constexpr const char *kCombine = "COMBINE";
constexpr const char *kShared = "SHARED_EXPERT";
constexpr const char *kLayer = "DECODER_LAYER";
constexpr const char *kAllocs = "HOT_PATH_ALLOCS";
constexpr const char *kNativeRun = "NATIVE_RUN";

// ---- Token ids ----

// n ids uniform over [0, vocab) from splitmix64, keyed by (seed, stream): each part of the scenario draws
// its own stream, so changing one part's length leaves the others' tokens alone.
std::vector<int32_t> draw_tokens(uint64_t seed, uint64_t stream, int64_t n, int32_t vocab) {
    std::vector<int32_t> out(static_cast<size_t>(n));
    uint64_t s = seed ^ (stream * 0xd1b54a32d192ed03ull);
    for (int32_t &t : out) {
        s += 0x9e3779b97f4a7c15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        t = static_cast<int32_t>(z % static_cast<uint64_t>(vocab));
    }
    return out;
}

// ---- The scenario ----

// One step of a scenario sequence, or the MTP stage. Every step samples after its last trunk row (seeded,
// at temperature 0.8), so its one backend -> host copy is the ids; the logits are read from each rank after
// the step, outside its counts.
struct Action {
    std::string stage;
    const char *logits_gate = nullptr;
    const char *kv_gate = nullptr;
    std::vector<int32_t> tokens;  // appended to the sequence, then staged as trunk rows
    LogitRows logits = LogitRows::kLast;
    int64_t keep = -1;       // trunk rows kept; -1: all of them
    bool abandon = false;    // plan and run, then abandon the step
    bool unchanged = false;  // the cache must end exactly as it began (rollback, abandon)
    bool tap = false;        // the layer gates observe this step
    bool cacheless = false;  // a prefill from an empty cache: attention reads only the step's own rows
    bool work = false;       // a one-token decode step: its work counts join the STEP_WORK gate
};

struct Scenario {
    std::vector<Action> actions;  // sequence 0: prefill, decode, transactions, slide
    std::vector<int32_t> mtp_prompt;  // the MTP stage's sequence (empty: the model has no MTP layer)
    int64_t mtp_rows[model::kMaxMtp] = {0, 0, 0};

    // The MTP stage's one step: the whole prompt of `seq` (holding mtp_prompt) and every MTP layer's rows.
    StepItem mtp_item(Sequence &seq) const {
        StepItem it;
        it.seq = &seq;
        it.rows = static_cast<int64_t>(mtp_prompt.size());
        it.logits = LogitRows::kNone;
        std::copy(mtp_rows, mtp_rows + model::kMaxMtp, it.mtp_rows);
        it.mtp_logits = true;
        return it;
    }
    // Speculation: the prompt decoded spec_new tokens without drafts (the reference) and with spec_draft drafts.
    std::vector<int32_t> spec_prompt;
    int64_t spec_new = 0;
    int spec_draft = 0;  // 0: the model has no MTP layer
    int window = 0;  // the widest sliding window of the trunk (0: no sliding layer)
    int layer = 0;
    bool layer_moe = false;
    int64_t tap_rows = 1;  // most rows of a tapped step
    EngineOptions engine;  // capacities (the backend factory is set per run)
    // Batch invariance: the probe and B - 1 fillers of different lengths, each then decoding one token.
    std::vector<int32_t> probe;
    int32_t probe_next = 0;
    std::vector<std::vector<int32_t>> fillers;
    std::vector<int32_t> filler_next;
};

constexpr uint64_t kSamplingSeed = 0x5a3717;

SamplingParams scenario_sampling() {
    SamplingParams p;
    p.temperature = 0.8f;
    p.seed = kSamplingSeed;
    return p;
}

// The SPECULATION gate's samplings: greedy, and seeded temperature 0.7 with top-p 0.9 and a repetition penalty
// (the penalty window then holds drafts).
std::vector<std::pair<std::string, SamplingParams>> spec_samplings() {
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    SamplingParams t07;
    t07.temperature = 0.7f;
    t07.top_k = 0;
    t07.top_p = 0.9f;
    t07.min_p = 0.0f;
    t07.repetition_penalty = 1.1f;
    t07.seed = kSamplingSeed;
    return {{"greedy", greedy}, {"T0.7", t07}};
}

Result<Scenario> make_scenario(const Step35Config &cfg, const VerifyOptions &o) {
    Scenario sc;
    const int64_t n = o.prefill_tokens;
    const int32_t vocab = cfg.vocab_size;
    sc.layer = o.layer;
    if (sc.layer < 0) {
        sc.layer = 0;
        for (int l = 0; l < cfg.n_layers; ++l) {
            if (cfg.layers[static_cast<size_t>(l)].ffn == FfnKind::kMoe) {
                sc.layer = l;
                break;
            }
        }
    }
    sc.layer_moe = cfg.layers[static_cast<size_t>(sc.layer)].ffn == FfnKind::kMoe;
    for (int l = 0; l < cfg.n_layers; ++l) {
        const LayerGeometry &g = cfg.layers[static_cast<size_t>(l)];
        if (g.attn == AttnKind::kSliding) sc.window = std::max(sc.window, g.window);
    }
    sc.tap_rows = std::max<int64_t>(n, 3);

    const auto prompt = draw_tokens(o.seed, 1, n, vocab);
    auto step = [](std::string stage, const char *lg, const char *kg, std::vector<int32_t> tokens, LogitRows logits) {
        Action a;
        a.stage = std::move(stage);
        a.logits_gate = lg;
        a.kv_gate = kg;
        a.tokens = std::move(tokens);
        a.logits = logits;
        return a;
    };
    Action prefill = step("prefill", kLogitsPrefill, kKvBytes, prompt, LogitRows::kAll);
    prefill.tap = true;
    prefill.cacheless = true;
    sc.actions.push_back(prefill);
    int64_t length = n;
    for (int64_t i = 1; i <= o.decode_steps; ++i) {
        Action a = step(fmt::format("decode {}", i), kLogitsDecode, kKvBytes,
                        draw_tokens(o.seed, 10 + static_cast<uint64_t>(i), 1, vocab), LogitRows::kLast);
        a.tap = i == 1;
        a.work = true;
        sc.actions.push_back(a);
        ++length;
    }
    // Speculation's shapes: 3 rows staged, the first kept; 3 staged, none kept; 3 staged, all kept; then a
    // step that samples and is abandoned.
    const char *txn = kKvTransactions;
    Action partial = step("txn partial", txn, txn, draw_tokens(o.seed, 100, 3, vocab), LogitRows::kAll);
    partial.keep = 1;
    Action rollback = step("txn rollback", txn, txn, draw_tokens(o.seed, 101, 3, vocab), LogitRows::kAll);
    rollback.keep = 0;
    rollback.unchanged = true;
    Action recommit = step("txn recommit", txn, txn, draw_tokens(o.seed, 102, 3, vocab), LogitRows::kAll);
    partial.tap = rollback.tap = recommit.tap = true;
    Action abandon = step("txn abandon", txn, txn, draw_tokens(o.seed, 103, 2, vocab), LogitRows::kAll);
    abandon.abandon = true;
    abandon.unchanged = true;
    sc.actions.push_back(partial);
    sc.actions.push_back(rollback);
    sc.actions.push_back(recommit);
    sc.actions.push_back(abandon);
    length += 1 + 3;
    // Then steps of up to 16 rows until a full page is complete and, with sliding layers, until the first
    // sliding page has left every window and gone back to the pool (released at commit once the length
    // reaches 64 + window - 1).
    const int64_t target = std::max(length + 2, sc.window > 0 ? kKvPageRows + sc.window : kKvPageRows + 1);
    for (int64_t i = 1; length < target; ++i) {
        const int64_t rows = std::min<int64_t>(16, target - length);
        sc.actions.push_back(step(fmt::format("slide {}", i), kLogitsDecode, sc.window > 0 ? kKvSliding : kKvBytes,
                                  draw_tokens(o.seed, 300 + static_cast<uint64_t>(i), rows, vocab),
                                  LogitRows::kLast));
        length += rows;
    }
    // The MTP stage: a fresh sequence prefills the prompt with every MTP layer teacher-forced in the same
    // step, in chain order: MTP layer k has rows k .. n - 2 (row p takes token p + 1).
    int64_t mtp_logit_rows = 0;
    if (cfg.n_mtp_layers > 0) {
        sc.mtp_prompt = prompt;
        for (int k = 0; k < std::min(cfg.n_mtp_layers, model::kMaxMtp); ++k) {
            sc.mtp_rows[k] = std::max<int64_t>(0, n - 1 - k);
            mtp_logit_rows += sc.mtp_rows[k];
        }
    }

    // Speculation: the prompt, then decode + 8 tokens with and without drafts.
    if (cfg.n_mtp_layers > 0) {
        sc.spec_prompt = prompt;
        sc.spec_new = int64_t{o.decode_steps} + 8;
        sc.spec_draft = std::min(cfg.n_mtp_layers, model::kMaxMtp);
    }

    // Batch invariance: a probe of up to 8 tokens and fillers of 1 .. 7 tokens, all different lengths.
    const int64_t probe_len = std::min<int64_t>(n, 8);
    sc.probe = draw_tokens(o.seed, 400, probe_len, vocab);
    sc.probe_next = draw_tokens(o.seed, 401, 1, vocab).front();
    int64_t batch_tokens = probe_len;
    for (int j = 1; j < o.batch; ++j) {
        const int64_t len = 1 + (3 * j) % 7;
        sc.fillers.push_back(draw_tokens(o.seed, 500 + static_cast<uint64_t>(j), len, vocab));
        sc.filler_next.push_back(draw_tokens(o.seed, 600 + static_cast<uint64_t>(j), 1, vocab).front());
        batch_tokens += len;
    }

    EngineOptions &e = sc.engine;
    e.k_format = o.k_format;
    e.v_format = o.v_format;
    e.max_seqs = o.batch;
    e.step_rows = std::max({n, batch_tokens, int64_t{16}});
    e.max_logit_rows = std::max({n, mtp_logit_rows, probe_len + o.batch, int64_t{1 + 2 * sc.spec_draft}});
    e.mtp_layers = std::min(cfg.n_mtp_layers, model::kMaxMtp);
    e.spec_draft = sc.spec_draft;
    // Sequence 0 and a batch beside it, each sequence with a page of slack.
    e.ctx_size = target + 1 + int64_t{o.batch + 2} * kKvPageRows + n;
    if (target + 1 > cfg.context_length || n + sc.spec_new > cfg.context_length) {
        return make_error("the scenario reaches position {} (prefill {}, decode {}, transactions, sliding release), "
                          "past the model's context length {}",
                          target, n, o.decode_steps, cfg.context_length);
    }
    return sc;
}

// Runs one action on an engine: appends its tokens, plans a step over them (sampling after the last row),
// runs it, then finishes with the action's keep count or abandons it; the sequence's tokens end at its
// committed length. Taps and counters are the caller's.
Result<void> execute(Engine &engine, Sequence &seq, const Action &a) {
    seq.tokens.insert(seq.tokens.end(), a.tokens.begin(), a.tokens.end());
    StepItem it;
    it.seq = &seq;
    it.rows = static_cast<int64_t>(a.tokens.size());
    it.logits = a.logits;
    it.sample = true;
    auto ok = engine.plan(std::span(&it, 1));
    if (ok) {
        engine.run();
        if (a.abandon) {
            engine.abandon();
        } else {
            Keep keep;
            keep.rows[0] = a.keep;
            ok = engine.finish(std::span(&keep, 1));
        }
    }
    seq.tokens.resize(static_cast<size_t>(seq.length(0)));
    return ok;
}

// ---- Captured intermediates ----

// A forward's tapped intermediates of one step, copied into storage reserved beforehand (the copies run
// inside the step, where nothing may allocate). Every tapped buffer holds 4-byte values (f32 or i32).
class TapCapture {
public:
    // max_rows token rows of a step; tp owners' expert rows (each at most max_rows * top_k).
    void reserve(const Step35Config &cfg, int layer, int64_t max_rows, int tp) {
        const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
        const int64_t width = std::max<int64_t>({cfg.d_model, int64_t{g.n_heads} * g.head_dim,
                                                 int64_t{g.n_kv_heads} * g.head_dim, g.n_heads, g.n_experts,
                                                 g.top_k, g.d_expert, g.d_shared});
        for (int t = 0; t < kTapCount; ++t) {
            const bool pairs = t >= static_cast<int>(Tap::kExpertGate) && t <= static_cast<int>(Tap::kExpertDown);
            data_[static_cast<size_t>(t)].reserve(
                static_cast<size_t>(max_rows * (pairs ? g.top_k * tp : 1) * width));
        }
    }
    void clear() {
        seen_.fill(false);
        copies_ = 0;
        overflow_.clear();
    }
    void on_tap(Tap t, TensorView v) {
        const auto i = static_cast<size_t>(t);
        std::vector<uint32_t> &buf = data_[i];
        const auto n = static_cast<size_t>(v.numel());
        if (dtype_size(v.dtype) != 4 || n > buf.capacity()) {
            if (overflow_.empty()) overflow_ = tap_name(t);  // a literal: no allocation for short names
            return;
        }
        buf.resize(n);  // within the reserved capacity
        backend->copy_to_host(v, buf.data());
        rows_[i] = v.rows();
        cols_[i] = v.row_elems();
        seen_[i] = true;
        ++copies_;
    }
    bool seen(Tap t) const { return seen_[static_cast<size_t>(t)]; }
    int64_t rows(Tap t) const { return rows_[static_cast<size_t>(t)]; }
    int64_t cols(Tap t) const { return cols_[static_cast<size_t>(t)]; }
    const uint32_t *data(Tap t) const { return data_[static_cast<size_t>(t)].data(); }
    int64_t copies() const { return copies_; }
    const std::string &overflow() const { return overflow_; }

    Backend *backend = nullptr;

private:
    std::array<std::vector<uint32_t>, kTapCount> data_;
    std::array<int64_t, kTapCount> rows_{};
    std::array<int64_t, kTapCount> cols_{};
    std::array<bool, kTapCount> seen_{};
    int64_t copies_ = 0;
    std::string overflow_;
};

// ---- Comparisons ----

Comparison make_cmp(const char *gate, const char *what, const char *unit = "values") {
    Comparison c;
    c.gate = gate;
    c.what = what;
    c.unit = unit;
    return c;
}

// Compares rows [r0, r1) x `cols` columns of got (row stride gs, first column gc) with want (ws, wc), as raw
// 4-byte values. `label` names the tensor in the first mismatch.
void compare_values(Comparison &c, const uint32_t *got, int64_t gs, int64_t gc, const uint32_t *want, int64_t ws,
                    int64_t wc, int64_t r0, int64_t r1, int64_t cols, const std::string &label) {
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t j = 0; j < cols; ++j) {
            const uint32_t a = want[r * ws + wc + j];
            const uint32_t b = got[r * gs + gc + j];
            if (a != b) {
                if (c.mismatches == 0) {
                    c.first = fmt::format("{} row {} col {}: want {:08x}, got {:08x}", label, r, wc + j, a, b);
                }
                ++c.mismatches;
            }
        }
    }
    c.compared += (r1 - r0) * cols;
}

// A mismatch of shape: every wanted value counts.
void shape_mismatch(Comparison &c, int64_t want_elems, const std::string &what) {
    if (c.mismatches == 0) c.first = what;
    c.mismatches += std::max<int64_t>(want_elems, 1);
    c.compared += std::max<int64_t>(want_elems, 1);
}

void compare_floats(Comparison &c, std::span<const float> want, std::span<const float> got, const std::string &label) {
    if (want.size() != got.size()) {
        shape_mismatch(c, static_cast<int64_t>(want.size()),
                       fmt::format("{}: {} values, want {}", label, got.size(), want.size()));
        return;
    }
    for (size_t i = 0; i < want.size(); ++i) {
        const auto a = std::bit_cast<uint32_t>(want[i]);
        const auto b = std::bit_cast<uint32_t>(got[i]);
        if (a != b) {
            if (c.mismatches == 0) c.first = fmt::format("{} value {}: want {:08x}, got {:08x}", label, i, a, b);
            ++c.mismatches;
        }
    }
    c.compared += static_cast<int64_t>(want.size());
}

// A captured tensor against a reference tensor: got holds columns [c0, c0 + got cols) of want's columns
// (c0 = 0 and equal widths for a whole tensor), over rows [r0, r1) (r1 < 0: every row).
void compare_tap(Comparison &c, const TapCapture &got, Tap t, const uint32_t *want, int64_t want_rows,
                 int64_t want_cols, int64_t c0, const std::string &who, int64_t r0 = 0, int64_t r1 = -1) {
    const std::string label = fmt::format("{} {}", who, tap_name(t));
    if (!got.seen(t)) {
        shape_mismatch(c, want_rows * want_cols, label + ": not observed");
        return;
    }
    if (r1 < 0) r1 = want_rows;
    if (got.rows(t) != want_rows || c0 + got.cols(t) > want_cols) {
        shape_mismatch(c, want_rows * want_cols,
                       fmt::format("{}: [{}, {}] at column {}, want [{}, {}]", label, got.rows(t), got.cols(t), c0,
                                   want_rows, want_cols));
        return;
    }
    compare_values(c, got.data(t), got.cols(t), 0, want, want_cols, c0, r0, r1, got.cols(t), label);
}

// The same tensor whole in both captures.
void compare_whole(Comparison &c, const TapCapture &got, const TapCapture &want, Tap t, const std::string &who) {
    if (!want.seen(t)) {
        shape_mismatch(c, 1, fmt::format("reference {}: not observed", tap_name(t)));
        return;
    }
    if (got.seen(t) && got.cols(t) != want.cols(t)) {
        shape_mismatch(c, want.rows(t) * want.cols(t),
                       fmt::format("{} {}: {} columns, want {}", who, tap_name(t), got.cols(t), want.cols(t)));
        return;
    }
    compare_tap(c, got, t, want.data(t), want.rows(t), want.cols(t), 0, who);
}

// ---- KV rows ----

// The live rows of a sequence on one rank: per stored layer, the positions that hold a row and their bytes,
// plus the state fields (lengths, generation, pages held) and the block tables.
struct LayerRows {
    int layer = 0;
    std::vector<int64_t> positions;
    std::vector<std::byte> k, v;  // rows in position order
    int64_t k_row = 0, v_row = 0;
};

struct KvSnapshot {
    std::vector<int64_t> fields;  // lengths per stream, pages held per pool, then the transaction generation
    std::vector<int32_t> tables;  // full then sliding block table
    std::vector<LayerRows> layers;
};

std::vector<int64_t> kv_fields(const Sequence &seq) {
    std::vector<int64_t> f;
    for (int s = 0; s < seq.n_streams(); ++s) f.push_back(seq.length(s));
    f.push_back(seq.kv().pages_held(kv::PoolKind::kFull));
    f.push_back(seq.kv().pages_held(kv::PoolKind::kSwa));
    f.push_back(static_cast<int64_t>(seq.kv().last_generation()));
    return f;
}

std::vector<int32_t> kv_tables(const Sequence &seq) {
    std::vector<int32_t> t;
    for (const kv::PoolKind kind : {kv::PoolKind::kFull, kv::PoolKind::kSwa}) {
        const auto b = seq.kv().block_table(kind);
        t.insert(t.end(), b.begin(), b.end());
    }
    return t;
}

// Every stored layer's live positions: trunk layers [0, length(0)), MTP layer k [k, length(1 + k)), each
// where the sequence still has the row's page.
Result<KvSnapshot> snapshot(const Engine &engine, int rank, const Sequence &seq) {
    const Step35Config &cfg = engine.config();
    const model::KvPoolLayout &pools = engine.pool_layout();
    KvSnapshot s;
    s.fields = kv_fields(seq);
    s.tables = kv_tables(seq);
    std::vector<std::byte> k, v;
    for (const LayerGeometry &g : cfg.layers) {
        if (pools.pool_layer[static_cast<size_t>(g.index)] < 0) continue;
        const int stream = g.is_mtp ? 1 + g.index - cfg.n_layers : 0;
        if (stream >= seq.n_streams()) continue;
        const kv::PoolKind kind = pools.in_swa[static_cast<size_t>(g.index)] ? kv::PoolKind::kSwa : kv::PoolKind::kFull;
        LayerRows rows;
        rows.layer = g.index;
        for (int64_t p = seq.kv().first(stream); p < seq.length(stream); ++p) {
            if (!seq.kv().has_page(kind, p)) continue;
            if (auto ok = engine.kv_row(rank, seq, g.index, p, k, v); !ok) return tl::unexpected(ok.error());
            rows.positions.push_back(p);
            rows.k_row = static_cast<int64_t>(k.size());
            rows.v_row = static_cast<int64_t>(v.size());
            rows.k.insert(rows.k.end(), k.begin(), k.end());
            rows.v.insert(rows.v.end(), v.begin(), v.end());
        }
        s.layers.push_back(std::move(rows));
    }
    return s;
}

// FNV-1a 64 over a snapshot's rows, bytes, lengths, pages and block tables — everything but the transaction
// generation, which counts begun transactions (an abandoned or rolled-back step still began one).
uint64_t digest(const KvSnapshot &s) {
    uint64_t h = 0xcbf29ce484222325ull;
    const auto mix = [&h](const void *data, size_t n) {
        const auto *b = static_cast<const unsigned char *>(data);
        for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
    };
    mix(s.fields.data(), (s.fields.size() - 1) * 8);
    mix(s.tables.data(), s.tables.size() * 4);
    for (const LayerRows &l : s.layers) {
        mix(l.positions.data(), l.positions.size() * 8);
        mix(l.k.data(), l.k.size());
        mix(l.v.data(), l.v.size());
    }
    return h;
}

// Rank `rank`'s rows of a sequence against its KV heads' bytes of the reference rows, and the state fields
// (lengths, generation, pages held) and block tables against the reference's.
void compare_kv(Comparison &bytes, Comparison &state, Comparison &pages, const KvSnapshot &want, const Engine &engine,
                int rank, const Sequence &seq) {
    const Step35Config &cfg = engine.config();
    const auto field = [&](Comparison &c, const char *name, int64_t i, int64_t a, int64_t b) {
        ++c.compared;
        if (a != b) {
            if (c.mismatches == 0) c.first = fmt::format("rank {} {} {}: want {}, got {}", rank, name, i, a, b);
            ++c.mismatches;
        }
    };
    const std::vector<int64_t> f = kv_fields(seq);
    for (size_t i = 0; i < std::max(f.size(), want.fields.size()); ++i) {
        field(state, "state field", static_cast<int64_t>(i), i < want.fields.size() ? want.fields[i] : -1,
              i < f.size() ? f[i] : -1);
    }
    const std::vector<int32_t> t = kv_tables(seq);
    for (size_t i = 0; i < std::max(t.size(), want.tables.size()); ++i) {
        field(pages, "block table entry", static_cast<int64_t>(i), i < want.tables.size() ? want.tables[i] : -2,
              i < t.size() ? t[i] : -2);
    }
    const parallel::RankPlan *plan = engine.tp() > 1 ? &engine.plan_of_ranks().ranks[static_cast<size_t>(rank)] : nullptr;
    std::vector<std::byte> k, v;
    for (const LayerRows &w : want.layers) {
        const LayerGeometry &g = cfg.layers[static_cast<size_t>(w.layer)];
        const parallel::Range heads = plan != nullptr ? plan->layers[static_cast<size_t>(w.layer)].kv_heads
                                                      : parallel::Range{0, g.n_kv_heads};
        for (size_t i = 0; i < w.positions.size(); ++i) {
            const int64_t p = w.positions[i];
            auto ok = engine.kv_row(rank, seq, w.layer, p, k, v);
            for (int kv_i = 0; kv_i < 2; ++kv_i) {
                const int64_t row = kv_i == 0 ? w.k_row : w.v_row;
                const int64_t per_head = row / g.n_kv_heads;
                const std::byte *want_row =
                    (kv_i == 0 ? w.k : w.v).data() + static_cast<int64_t>(i) * row + heads.begin * per_head;
                const int64_t n = heads.size() * per_head;
                const std::vector<std::byte> &got = kv_i == 0 ? k : v;
                bytes.compared += n;
                if (!ok || static_cast<int64_t>(got.size()) != n) {
                    if (bytes.mismatches == 0) {
                        bytes.first = fmt::format("rank {} layer {} position {}: {}", rank, w.layer, p,
                                                  ok ? fmt::format("{} bytes, want {}", got.size(), n)
                                                     : ok.error().message);
                    }
                    bytes.mismatches += n;
                    continue;
                }
                for (int64_t j = 0; j < n; ++j) {
                    if (got[static_cast<size_t>(j)] != want_row[j]) {
                        if (bytes.mismatches == 0) {
                            bytes.first = fmt::format("rank {} layer {} position {} {} byte {}", rank, w.layer, p,
                                                      kv_i == 0 ? "K" : "V", j);
                        }
                        ++bytes.mismatches;
                    }
                }
            }
        }
    }
}

// ---- The per-expert oracle ----

// What the oracle computes from the reference's taps of one step.
struct OracleStep {
    int64_t n = 0;
    int64_t k = 0;
    int64_t pairs = 0;
    std::vector<int32_t> offsets;      // [n_experts + 1]
    std::vector<int32_t> row_of_pair;  // [pairs] sorted row of pair t * k + slot
    std::vector<uint32_t> gate, up, act;  // [pairs, d_expert] in sorted row order
    std::vector<uint32_t> down;           // [pairs, d_model]
    std::vector<uint32_t> combine;        // [n, d_model] residual + (routed + shared), on the host
};

// One routed expert projection of the checkpoint (a bank [n_experts, rows, cols], bf16 / f16 / f32 or fp8
// with block scales), read straight from the mapped tensor.
struct OracleBank {
    DType dtype = DType::kBF16;
    const std::byte *data = nullptr;
    int64_t rows = 0;
    int64_t cols = 0;
    const float *scale_inv = nullptr;  // fp8: [n_experts, ceil(rows / block_rows), ceil(cols / block_cols)]
    int64_t block_rows = 128;
    int64_t block_cols = 128;
};

// The exact f32 value of element (e, r, c) of a bank.
float bank_value(const OracleBank &b, int64_t e, int64_t r, int64_t c) {
    const int64_t i = (e * b.rows + r) * b.cols + c;
    uint16_t h = 0;
    switch (b.dtype) {
    case DType::kF32: {
        float f = 0.0f;
        std::memcpy(&f, b.data + i * 4, 4);
        return f;
    }
    case DType::kBF16: std::memcpy(&h, b.data + i * 2, 2); return bf16_to_f32(h);
    case DType::kF16: std::memcpy(&h, b.data + i * 2, 2); return f16_to_f32(h);
    case DType::kF8E4M3: return fp8_e4m3_to_f32(static_cast<uint8_t>(b.data[i]));
    default: MEMRA_CHECK(false, "oracle: bank dtype {}", dtype_name(b.dtype)); return 0.0f;
    }
}

// y[r] = x . W_e[r] for every row r, written out from the K loops' definitions (backend/cpu/matmul.h,
// DETERMINISM.md rule 2). Exact numerics (or a bank device numerics leaves at f32 activations): K cut into
// chunks at multiples of block_cols (128), each chunk the 16-lane canonical dot (core/math.h dot_f32) of x
// with the chunk's widened weights, fp8 chunks multiplied by their scale, the chunk results added in K order
// from +0. Device numerics: x rounded to bf16 (bf16 banks) or quantized to e4m3 per 128 (fp8 banks with
// 128-wide blocks), then core/device_numerics.h's chunk dot over the whole K (bf16) or per 128-wide chunk
// promoted by both scales (fp8), in FTZ/DAZ arithmetic. Plain scalar host code that shares nothing with a
// backend's kernels, so the grouped products are checked against an independent computation.
void oracle_product(const OracleBank &b, Numerics numerics, int64_t e, const float *x, float *y) {
    const int64_t col_blocks = (b.cols + b.block_cols - 1) / b.block_cols;
    const int64_t row_blocks = (b.rows + b.block_rows - 1) / b.block_rows;
    const bool bf16_act = numerics == Numerics::kDevice && b.dtype == DType::kBF16;
    const bool e4m3_act = numerics == Numerics::kDevice && b.dtype == DType::kF8E4M3 && b.block_cols == 128;
    std::vector<float> xr(x, x + b.cols);
    std::vector<float> xscale(static_cast<size_t>(col_blocks), 1.0f);
    if (bf16_act) {
        for (float &v : xr) v = bf16_to_f32(f32_to_bf16(v));
    } else if (e4m3_act) {
        for (int64_t c0 = 0; c0 < b.cols; c0 += 128) {
            xscale[static_cast<size_t>(c0 / 128)] = e4m3_quantize_group(x + c0, std::min<int64_t>(128, b.cols - c0),
                                                                        xr.data() + c0);
        }
    }
    // bf16 activations: the whole K is one chunk; otherwise chunks of block_cols.
    const int64_t edge = bf16_act ? b.cols : b.block_cols;
    std::vector<float> w(static_cast<size_t>(edge));
    for (int64_t r = 0; r < b.rows; ++r) {
        float sum = 0.0f;
        for (int64_t c0 = 0; c0 < b.cols; c0 += edge) {
            const int64_t c1 = std::min(b.cols, c0 + edge);
            for (int64_t c = c0; c < c1; ++c) w[static_cast<size_t>(c - c0)] = bank_value(b, e, r, c);
            const bool device = bf16_act || e4m3_act;
            float chunk = device ? device_chunk_dot(xr.data() + c0, w.data(), c1 - c0)
                                 : dot_f32(xr.data() + c0, w.data(), c1 - c0);
            if (b.scale_inv != nullptr) {
                const float ws = b.scale_inv[(e * row_blocks + r / b.block_rows) * col_blocks + c0 / b.block_cols];
                chunk = e4m3_act ? fz_mul(chunk, fz_mul(xscale[static_cast<size_t>(c0 / 128)], ws)) : chunk * ws;
            }
            sum = device ? fz_add(sum, chunk) : sum + chunk;
        }
        y[r] = sum;
    }
}

// cpu::swiglu's definition (backend/cpu/ops_elementwise.h) on one value pair, from core/math.h.
float oracle_swiglu(float g, float u, float limit) {
    float act = silu_f32(g);
    if (limit > 0.0f) {
        act = act > limit ? limit : act;
        u = u < -limit ? -limit : (u > limit ? limit : u);
    }
    return act * u;
}

// Every (token, expert) pair of one step through its expert, computed on the host from the checkpoint
// (oracle_product), then the slot-order combine: the routed gates are checked against this, never against
// the backend that produced them. It reads the layer's banks through views it never gives back (one layer:
// a generated store keeps them for its life).
class ExpertOracle {
public:
    static Result<ExpertOracle> create(const io::TensorStore &store, const Step35Config &cfg, int layer,
                                       Numerics numerics) {
        ExpertOracle o;
        o.numerics_ = numerics;
        const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
        o.g_ = g;
        o.d_ = cfg.d_model;
        const std::string p = fmt::format("model.layers.{}.moe.", layer);
        OracleBank *banks[] = {&o.gate_, &o.up_, &o.down_};
        const char *projs[] = {"gate_proj", "up_proj", "down_proj"};
        for (int i = 0; i < 3; ++i) {
            const std::string name = p + projs[i] + ".weight";
            auto ref = store.get(name);
            if (!ref) return tl::unexpected(ref.error());
            const io::TensorInfo &info = *ref->info;
            if (info.shape.size() != 3 || info.shape[0] != g.n_experts) {
                return make_error("oracle: tensor {} is not [{}, rows, cols]", name, g.n_experts);
            }
            OracleBank &b = *banks[i];
            b.dtype = info.dtype;
            b.data = ref->bytes.data();
            b.rows = info.shape[1];
            b.cols = info.shape[2];
            if (info.dtype == DType::kF8E4M3) {
                const std::string scale_name = name + std::string(kFp8ScaleSuffix);
                auto sref = store.get(scale_name);
                if (!sref) return tl::unexpected(sref.error());
                auto floats = sref->as<float>();
                if (!floats) return tl::unexpected(floats.error());
                b.scale_inv = floats->data();
                b.block_rows = cfg.quantization.block_out;
                b.block_cols = cfg.quantization.block_in;
            }
        }
        return o;
    }

    // Whether the banks' products have bf16 or e4m3 activations (BF16 experts, or FP8 ones with 128-wide scale
    // tiles, in device numerics): on the GPU those run on the tensor cores, whose sums are not the host's scalar
    // products.
    bool tensor_core_products() const {
        return numerics_ == Numerics::kDevice &&
               (gate_.dtype == DType::kBF16 || (gate_.dtype == DType::kF8E4M3 && gate_.block_cols == 128));
    }
    // From now on the pairs' products run on `be` (the layer's banks uploaded to it), one pair per call.
    Result<void> use_backend(Backend &be) {
        auto dev = BackendProducts::create(be, banks(), g_.n_experts, d_);
        if (!dev) return tl::unexpected(dev.error());
        dev_ = *dev;
        return {};
    }
    bool on_backend() const { return dev_.has_value(); }

    // From the reference taps of one step: every pair through its expert, then the host combine.
    Result<OracleStep> run(const TapCapture &ref) const {
        for (Tap t : {Tap::kFfnNorm, Tap::kExpertIds, Tap::kExpertWeights, Tap::kResidual, Tap::kSharedOut}) {
            if (!ref.seen(t)) return make_error("oracle: the reference step did not show {}", tap_name(t));
        }
        OracleStep s;
        s.n = ref.rows(Tap::kExpertIds);
        s.k = ref.cols(Tap::kExpertIds);
        s.pairs = s.n * s.k;
        const int64_t de = g_.d_expert;
        const uint32_t *id_bits = ref.data(Tap::kExpertIds);  // i32 values
        const uint32_t *a = ref.data(Tap::kFfnNorm);          // f32 values
        std::vector<int32_t> ids(static_cast<size_t>(s.pairs));
        for (int64_t p = 0; p < s.pairs; ++p) ids[static_cast<size_t>(p)] = static_cast<int32_t>(id_bits[p]);
        // The stable counting sort of the pairs by expert (rule 5): expert e's rows hold its pairs in order.
        s.offsets.assign(static_cast<size_t>(g_.n_experts + 1), 0);
        for (const int32_t e : ids) {
            if (e < 0 || e >= g_.n_experts) {
                return make_error("oracle: a pair routed to expert {} of {}", e, g_.n_experts);
            }
            ++s.offsets[static_cast<size_t>(e + 1)];
        }
        for (int64_t e = 0; e < g_.n_experts; ++e) {
            s.offsets[static_cast<size_t>(e + 1)] += s.offsets[static_cast<size_t>(e)];
        }
        std::vector<int32_t> next(s.offsets.begin(), s.offsets.end() - 1);
        s.row_of_pair.resize(static_cast<size_t>(s.pairs));
        for (size_t p = 0; p < ids.size(); ++p) s.row_of_pair[p] = next[static_cast<size_t>(ids[p])]++;
        s.gate.resize(static_cast<size_t>(s.pairs * de));
        s.up.resize(s.gate.size());
        s.act.resize(s.gate.size());
        s.down.resize(static_cast<size_t>(s.pairs * d_));
        std::vector<float> x(static_cast<size_t>(d_)), gv(static_cast<size_t>(de)), uv(gv.size()), av(gv.size()),
            dv(x.size());
        for (int64_t p = 0; p < s.pairs; ++p) {
            const int64_t e = ids[static_cast<size_t>(p)];
            const int64_t row = s.row_of_pair[static_cast<size_t>(p)];
            for (int64_t j = 0; j < d_; ++j) x[static_cast<size_t>(j)] = std::bit_cast<float>(a[(p / s.k) * d_ + j]);
            if (dev_) dev_->select(e, g_.n_experts);
            const auto product = [&](int bank, const float *in, float *out) {  // 0 gate, 1 up, 2 down
                const OracleBank &b = *banks()[bank];
                if (dev_) {
                    dev_->product(dev_->ids[bank], in, b.cols, out, b.rows);
                } else {
                    oracle_product(b, numerics_, e, in, out);
                }
            };
            product(0, x.data(), gv.data());
            product(1, x.data(), uv.data());
            for (int64_t j = 0; j < de; ++j) {
                const auto i = static_cast<size_t>(j);
                av[i] = oracle_swiglu(gv[i], uv[i], g_.clamp_routed);
                s.gate[static_cast<size_t>(row * de + j)] = std::bit_cast<uint32_t>(gv[i]);
                s.up[static_cast<size_t>(row * de + j)] = std::bit_cast<uint32_t>(uv[i]);
                s.act[static_cast<size_t>(row * de + j)] = std::bit_cast<uint32_t>(av[i]);
            }
            product(2, av.data(), dv.data());
            for (int64_t j = 0; j < d_; ++j) {
                s.down[static_cast<size_t>(row * d_ + j)] = std::bit_cast<uint32_t>(dv[static_cast<size_t>(j)]);
            }
        }
        // The combine on the host: per token and column, the top-k slots in order, each product rounded
        // before its add (no fused multiply-add: host code builds with -ffp-contract=off), then the shared
        // expert, then the residual (DETERMINISM.md rule 5; cpu::moe_combine).
        const uint32_t *w = ref.data(Tap::kExpertWeights);  // f32 values, read through bit_cast
        const uint32_t *h = ref.data(Tap::kResidual);
        const uint32_t *shared = ref.data(Tap::kSharedOut);
        s.combine.resize(static_cast<size_t>(s.n * d_));
        for (int64_t t = 0; t < s.n; ++t) {
            for (int64_t j = 0; j < d_; ++j) {
                float routed = 0.0f;
                for (int64_t slot = 0; slot < s.k; ++slot) {
                    const int64_t row = s.row_of_pair[static_cast<size_t>(t * s.k + slot)];
                    const float y = std::bit_cast<float>(s.down[static_cast<size_t>(row * d_ + j)]);
                    const float prod = std::bit_cast<float>(w[t * s.k + slot]) * y;
                    routed = routed + prod;
                }
                const float ffn = routed + std::bit_cast<float>(shared[t * d_ + j]);
                s.combine[static_cast<size_t>(t * d_ + j)] =
                    std::bit_cast<uint32_t>(std::bit_cast<float>(h[t * d_ + j]) + ffn);
            }
        }
        return s;
    }

private:
    // The pairs' products on a backend: the layer's banks uploaded whole, one pair at a time through
    // matmul_grouped with offsets that give the pair's expert its one row.
    struct BackendProducts {
        Backend *be = nullptr;
        std::array<BankId, 3> ids;    // gate, up, down
        TensorView in, out, offsets;  // [1, max cols], [1, max rows] f32; [n_experts + 1] i32

        static Result<BackendProducts> create(Backend &be, const std::array<const OracleBank *, 3> &banks,
                                              int64_t n_experts, int64_t d_model) {
            BackendProducts p;
            p.be = &be;
            be.bind_thread();
            for (size_t i = 0; i < banks.size(); ++i) {
                const OracleBank &b = *banks[i];
                auto id = be.upload_bank(HostBank{.dtype = b.dtype,
                                                  .data = b.data,
                                                  .n_experts = n_experts,
                                                  .rows = b.rows,
                                                  .cols = b.cols,
                                                  .scale_inv = b.scale_inv,
                                                  .block_rows = b.block_rows,
                                                  .block_cols = b.block_cols});
                if (!id) return wrap_error("oracle: uploading an expert bank", id.error());
                p.ids[i] = *id;
            }
            const int64_t width = std::max(d_model, banks[0]->rows);  // d_expert: the gate's rows
            auto in = be.alloc(DType::kF32, {1, width});
            auto out = be.alloc(DType::kF32, {1, width});
            auto off = be.alloc(DType::kI32, {n_experts + 1});
            if (!in || !out || !off) return make_error("oracle: backend buffers for the expert products");
            p.in = *in;
            p.out = *out;
            p.offsets = *off;
            return p;
        }
        // The offsets that route the one row to expert e.
        void select(int64_t e, int64_t n_experts) const {
            std::vector<int32_t> off(static_cast<size_t>(n_experts + 1));
            for (int64_t j = 0; j <= n_experts; ++j) off[static_cast<size_t>(j)] = j > e ? 1 : 0;
            be->copy_from_host(off.data(), offsets);
        }
        // y[0, rows) = the selected expert of bank b applied to x[0, cols).
        void product(BankId b, const float *x, int64_t cols, float *y, int64_t rows) const {
            TensorView xv = in;
            xv.shape = {1, cols};
            TensorView yv = out;
            yv.shape = {1, rows};
            be->copy_from_host(x, xv);
            be->matmul_grouped(xv, b, offsets, yv);
            be->copy_to_host(yv, y);
        }
    };

    std::array<const OracleBank *, 3> banks() const { return {&gate_, &up_, &down_}; }

    LayerGeometry g_;
    int64_t d_ = 0;
    Numerics numerics_ = Numerics::kExact;
    OracleBank gate_, up_, down_;
    std::optional<BackendProducts> dev_;
};

// The owner-compact rows of a tapped expert stage against the oracle's sorted rows: the capture holds, for
// each owner o in [o0, o1), its pairs' rows at slot_rows * (o - o0) + j, j < its pair count, which are the
// oracle's sorted rows offsets[first expert of o] + j. per_owner: experts per owner (n_experts / tp).
void compare_owner_rows(Comparison &c, const TapCapture &got, Tap t, const OracleStep &o, const uint32_t *want,
                        int64_t cols, int o0, int o1, int64_t per_owner, int64_t slot_rows, const std::string &who) {
    const std::string label = fmt::format("{} {}", who, tap_name(t));
    if (!got.seen(t)) {
        shape_mismatch(c, o.pairs * cols, label + ": not observed");
        return;
    }
    if (got.cols(t) != cols || got.rows(t) != slot_rows * (o1 - o0)) {
        shape_mismatch(c, o.pairs * cols,
                       fmt::format("{}: [{}, {}], want [{}, {}]", label, got.rows(t), got.cols(t),
                                   slot_rows * (o1 - o0), cols));
        return;
    }
    for (int owner = o0; owner < o1; ++owner) {
        const int64_t r0 = o.offsets[static_cast<size_t>(owner * per_owner)];
        const int64_t r1 = o.offsets[static_cast<size_t>((owner + 1) * per_owner)];
        if (r1 - r0 > slot_rows) {
            shape_mismatch(c, (r1 - r0) * cols, fmt::format("{}: owner {} has {} pairs, {} rows reserved", label,
                                                            owner, r1 - r0, slot_rows));
            continue;
        }
        // got row slot_rows * (owner - o0) + j against want row r0 + j.
        const uint32_t *got_rows = got.data(t) + slot_rows * (owner - o0) * cols;
        compare_values(c, got_rows, cols, 0, want + r0 * cols, cols, 0, 0, r1 - r0, cols,
                       fmt::format("{} owner {}", label, owner));
    }
}

// ---- The reference run ----

struct RefStep {
    std::vector<float> logits;  // the step's logit rows (all of them; none for an abandoned step's)
    int32_t token = -1;         // the sampled token (-1: abandoned)
    KvSnapshot kv;
    std::optional<TapCapture> taps;
    std::optional<OracleStep> oracle;
};

// A speculation run: the scenario prompt, then spec_new tokens decoded with `draft` drafts per step.
struct SpecRun {
    std::unique_ptr<Sequence> seq;
    std::vector<std::vector<float>> logits;  // the logit row behind each decoded token
    std::vector<Decoded> steps;
};

// forced >= 0: before every step, forcing's drafts become the reference tokens `truth` so that exactly `forced`
// stand (the rank backends must be draft-forcing ones).
Result<SpecRun> spec_decode(Engine &engine, const Scenario &sc, const SamplingParams &sp, int draft,
                            DraftForcing *forcing, const std::vector<int32_t> *truth, int forced) {
    SpecRun run;
    SequenceOptions so;
    so.sampling = sp;
    so.mtp_streams = draft > 0 ? engine.options().mtp_layers : 0;
    auto seq = engine.create_sequence(so);
    if (!seq) return tl::unexpected(seq.error());
    run.seq = std::move(*seq);
    Sequence &s = *run.seq;
    s.tokens = sc.spec_prompt;
    auto first = feed(engine, s);
    if (!first) return tl::unexpected(first.error());
    s.tokens.push_back(*first);
    const auto vocab = static_cast<size_t>(engine.config().vocab_size);
    for (int64_t done = 1; done < sc.spec_new;) {
        if (forced >= 0) {
            ++forcing->step;
            forcing->ids = drafts_accepting(*truth, s.tokens.size(), forced, engine.config().vocab_size);
        }
        DecodeOptions d;
        d.draft = draft;
        d.max_new = sc.spec_new - done;
        d.return_logits = true;
        auto r = decode(engine, s, d);
        if (!r) return tl::unexpected(r.error());
        const auto lg = engine.logits(0);
        for (int64_t j = 0; j < r->emitted; ++j) {
            run.logits.emplace_back(lg.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(j) * vocab),
                                    lg.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(j + 1) * vocab));
        }
        run.steps.push_back(*r);
        done += r->emitted;
    }
    return run;
}

// The reference of one sampling: the tokens and logit rows decoding without drafts, its trunk KV rows and the
// MTP layers' rows of a teacher-forced pass over its committed tokens.
struct SpecRef {
    std::vector<int32_t> tokens;
    std::vector<std::vector<float>> logits;
    KvSnapshot trunk;
    KvSnapshot teacher_forced;
};

struct Reference {
    std::vector<RefStep> steps;                    // per action
    std::vector<std::vector<float>> mtp_logits;    // [MTP layer] rows of the MTP stage
    std::optional<KvSnapshot> mtp_kv;
    std::vector<float> probe_prefill, probe_decode;
    std::vector<SpecRef> spec;  // per spec_samplings()
};

// Layer-gate comparisons of one tapped step; one instance per line.
struct LayerCmp {
    Comparison attention, router, experts, rows, combine, shared, layer;

    explicit LayerCmp(bool cacheless)
        : attention(make_cmp(cacheless ? kAttnCacheless : kAttnCached, "attention")),
          router(make_cmp(kRouter, "router")),
          experts(make_cmp(kExperts, "experts")),
          rows(make_cmp(kRows, "expert_rows")),
          combine(make_cmp(kCombine, "combine")),
          shared(make_cmp(kShared, "shared")),
          layer(make_cmp(kLayer, "layer")) {}
};

// One owner's (or every owner's) tapped expert rows against the oracle: grouped gate / up / act and the own
// down rows (EXPERTS_GROUPED) for owner `rank` of tp, and the exchanged rows of every owner (EXPERT_ROWS).
void oracle_expert_checks(Comparison &experts, Comparison &rows, const TapCapture &got, const OracleStep &o,
                          const LayerGeometry &g, int64_t d, int tp, int rank, const std::string &who) {
    const int64_t per_owner = g.n_experts / tp;
    const int64_t cap = model::moe_owner_capacity(o.n, o.k, per_owner);
    const int64_t de = g.d_expert;
    compare_owner_rows(experts, got, Tap::kExpertGate, o, o.gate.data(), de, rank, rank + 1, per_owner, cap, who);
    compare_owner_rows(experts, got, Tap::kExpertUp, o, o.up.data(), de, rank, rank + 1, per_owner, cap, who);
    compare_owner_rows(experts, got, Tap::kExpertAct, o, o.act.data(), de, rank, rank + 1, per_owner, cap, who);
    compare_owner_rows(experts, got, Tap::kExpertDownOwn, o, o.down.data(), d, rank, rank + 1, per_owner, cap, who);
    compare_owner_rows(rows, got, Tap::kExpertDown, o, o.down.data(), d, 0, tp, per_owner, cap, who);
}

void emit(VerifyReport &report, const VerifyOptions &o, VerifyLine line) {
    if (o.on_line) o.on_line(line);
    report.lines.push_back(std::move(line));
}

// An engine for the scenario on tp ranks, every rank's backend from make(rank).
Result<std::unique_ptr<Engine>> scenario_engine(const io::TensorStore &store, const Step35Config &cfg,
                                                const Scenario &sc, int tp, BackendFactory make,
                                                const VerifyOptions &o) {
    EngineOptions e = sc.engine;
    e.tp = tp;
    e.make_backend = std::move(make);
    e.rank_copy = o.rank_copy;
    e.make_comms = o.make_comms;
    return Engine::create(store, cfg, e);
}

// The probe alone, then in batches of 2 .. B at every slot: its prefill logits (every row) and the decode
// step's. fill(b, slot, seqs) makes the b sequences (the probe at `slot`); step runs one phase.
struct BatchPlan {
    std::vector<StepItem> prefill, decode;
};

BatchPlan batch_items(const Scenario &sc, std::vector<std::unique_ptr<Sequence>> &seqs, int slot) {
    BatchPlan p;
    int filler = 0;
    for (int i = 0; i < static_cast<int>(seqs.size()); ++i) {
        Sequence &s = *seqs[static_cast<size_t>(i)];
        const bool probe = i == slot;
        const auto f = static_cast<size_t>(probe ? 0 : filler++);
        s.tokens = probe ? sc.probe : sc.fillers[f];
        StepItem a;
        a.seq = &s;
        a.rows = static_cast<int64_t>(s.tokens.size());
        a.logits = probe ? LogitRows::kAll : LogitRows::kLast;
        a.sample = true;
        p.prefill.push_back(a);
        StepItem b;
        b.seq = &s;
        b.rows = 1;
        b.logits = LogitRows::kLast;
        b.sample = true;
        p.decode.push_back(b);
    }
    return p;
}

// The rows [first, first + count) of a rank's logits.
std::vector<float> logit_rows(const std::vector<float> &all, std::pair<int64_t, int64_t> range, int64_t vocab) {
    return std::vector<float>(all.begin() + range.first * vocab, all.begin() + (range.first + range.second) * vocab);
}

Result<Reference> run_reference(const io::TensorStore &store, const Step35Config &cfg, const Scenario &sc,
                                const VerifyOptions &o, VerifyReport &report) {
    auto made = scenario_engine(store, cfg, sc, 1, [&o](int) { return o.make_reference_backend(); }, o);
    if (!made) return wrap_error("reference", made.error());
    Engine &engine = **made;
    std::optional<ExpertOracle> oracle;
    if (sc.layer_moe) {
        Backend &be = engine.backend(0);
        auto built = ExpertOracle::create(store, cfg, sc.layer, be.numerics());
        if (!built) return tl::unexpected(built.error());
        const bool on_backend =
            o.oracle_products == OracleProducts::kBackend ||
            (o.oracle_products == OracleProducts::kAuto && be.device() == Device::kCuda && built->tensor_core_products());
        if (on_backend) {
            if (auto ok = built->use_backend(be); !ok) return tl::unexpected(ok.error());
        }
        oracle.emplace(std::move(*built));
    }
    SequenceOptions so;
    so.sampling = scenario_sampling();
    auto seq = engine.create_sequence(so);
    if (!seq) return wrap_error("reference", seq.error());
    TapCapture cap;
    cap.backend = &engine.backend(0);
    cap.reserve(cfg, sc.layer, sc.tap_rows, 1);
    const LayerGeometry &lg = cfg.layers[static_cast<size_t>(sc.layer)];
    const int64_t vocab = cfg.vocab_size;

    Reference ref;
    for (const Action &a : sc.actions) {
        RefStep rs;
        cap.clear();
        engine.forward(0).set_tap(a.tap ? sc.layer : -1,
                                  a.tap ? TapFn([&cap](Tap t, TensorView v) { cap.on_tap(t, v); }) : TapFn{});
        auto ok = execute(engine, **seq, a);
        engine.forward(0).set_tap(-1, {});
        if (!ok) return wrap_error(fmt::format("reference {}", a.stage), ok.error());
        if (!cap.overflow().empty()) return make_error("reference {}: tap {} overflowed", a.stage, cap.overflow());
        rs.logits = engine.rank_logits(0);
        if (!a.abandon) rs.token = engine.sampled(0).id;
        auto snap = snapshot(engine, 0, **seq);
        if (!snap) return wrap_error(fmt::format("reference {}", a.stage), snap.error());
        rs.kv = std::move(*snap);
        if (a.tap) {
            rs.taps = cap;
            if (oracle) {
                auto os = oracle->run(cap);
                if (!os) return wrap_error(fmt::format("reference {}", a.stage), os.error());
                LayerCmp c(a.cacheless);
                oracle_expert_checks(c.experts, c.experts, cap, *os, lg, cfg.d_model, 1, 0, "tp1");
                compare_tap(c.combine, cap, Tap::kLayerOut, os->combine.data(), os->n, cfg.d_model, 0, "tp1");
                VerifyLine line;
                line.reference = true;
                line.stage = fmt::format("L{} {}", sc.layer, a.stage);
                line.comparisons = {c.experts, c.combine};
                line.note = oracle->on_backend()
                                ? fmt::format("oracle: {} pairs, one at a time on the reference backend", os->pairs)
                                : fmt::format("oracle: {} pairs as host scalar products from the checkpoint",
                                              os->pairs);
                emit(report, o, std::move(line));
                rs.oracle = std::move(*os);
            }
        }
        ref.steps.push_back(std::move(rs));
    }

    if (!sc.mtp_prompt.empty()) {
        SequenceOptions mo = so;
        mo.mtp_streams = engine.options().mtp_layers;
        auto ms = engine.create_sequence(mo);
        if (!ms) return wrap_error("reference MTP", ms.error());
        (*ms)->tokens = sc.mtp_prompt;
        const StepItem it = sc.mtp_item(**ms);
        if (auto ok = engine.step(std::span(&it, 1)); !ok) return wrap_error("reference MTP", ok.error());
        const std::vector<float> all = engine.rank_logits(0);
        for (int k = 0; k < engine.options().mtp_layers; ++k) {
            ref.mtp_logits.push_back(logit_rows(all, engine.logit_range(0, 1 + k), vocab));
        }
        auto snap = snapshot(engine, 0, **ms);
        if (!snap) return wrap_error("reference MTP", snap.error());
        ref.mtp_kv = std::move(*snap);
    }

    if (sc.spec_draft > 0) {
        for (const auto &[name, sp] : spec_samplings()) {
            auto plain = spec_decode(engine, sc, sp, 0, nullptr, nullptr, -1);
            if (!plain) return wrap_error(fmt::format("reference speculation {}", name), plain.error());
            SpecRef sr;
            sr.tokens = plain->seq->tokens;
            sr.logits = std::move(plain->logits);
            auto trunk = snapshot(engine, 0, *plain->seq);
            if (!trunk) return wrap_error("reference speculation", trunk.error());
            sr.trunk = std::move(*trunk);
            plain->seq.reset();
            SequenceOptions mo;
            mo.sampling = sp;
            mo.mtp_streams = engine.options().mtp_layers;
            auto tf = engine.create_sequence(mo);
            if (!tf) return wrap_error("reference speculation", tf.error());
            (*tf)->tokens.assign(sr.tokens.begin(), sr.tokens.end() - 1);  // the last token is never fed
            if (auto ok = feed(engine, **tf); !ok) return wrap_error("reference teacher-forced MTP", ok.error());
            auto snap = snapshot(engine, 0, **tf);
            if (!snap) return wrap_error("reference teacher-forced MTP", snap.error());
            sr.teacher_forced = std::move(*snap);
            ref.spec.push_back(std::move(sr));
        }
    }

    // The batch probe alone.
    std::vector<std::unique_ptr<Sequence>> one;
    auto ps = engine.create_sequence(so);
    if (!ps) return wrap_error("reference probe", ps.error());
    one.push_back(std::move(*ps));
    const BatchPlan bp = batch_items(sc, one, 0);
    if (auto ok = engine.step(bp.prefill); !ok) return wrap_error("reference probe", ok.error());
    ref.probe_prefill = logit_rows(engine.rank_logits(0), engine.logit_range(0), vocab);
    one.front()->tokens.push_back(sc.probe_next);
    if (auto ok = engine.step(bp.decode); !ok) return wrap_error("reference probe decode", ok.error());
    ref.probe_decode = logit_rows(engine.rank_logits(0), engine.logit_range(0), vocab);
    return ref;
}

// ---- A native run ----

class NativeRun {
public:
    NativeRun(const Step35Config &cfg, const Scenario &sc, const Reference &ref, const VerifyOptions &o,
              VerifyReport &report, int tp)
        : cfg_(cfg), sc_(sc), ref_(ref), o_(o), report_(report), tp_(tp) {}

    // Runs every stage; returns the error that stopped the run (also on a failed line), or empty.
    std::string run(const io::TensorStore &store) {
        const int tp = tp_;
        auto made = scenario_engine(store, cfg_, sc_, tp_,
                                    [this, tp](int rank) { return o_.make_rank_backend(tp, rank); }, o_);
        if (!made) return fail("create", made.error().message);
        e_ = std::move(*made);
        if (o_.count_allocations) e_->set_allocation_counter(o_.count_allocations);
        SequenceOptions so;
        so.sampling = scenario_sampling();
        auto seq = e_->create_sequence(so);
        if (!seq) return fail("create", seq.error().message);
        seq_ = std::move(*seq);
        caps_.resize(static_cast<size_t>(tp_));
        for (int r = 0; r < tp_; ++r) {
            caps_[static_cast<size_t>(r)].backend = &e_->backend(r);
            caps_[static_cast<size_t>(r)].reserve(cfg_, sc_.layer, sc_.tap_rows, tp_);
        }
        for (size_t i = 0; i < sc_.actions.size(); ++i) {
            if (auto err = action(sc_.actions[i], ref_.steps[i]); !err.empty()) return err;
        }
        if (auto err = mtp(); !err.empty()) return err;
        if (auto err = speculation(); !err.empty()) return err;
        return batch();
    }

private:
    std::string fail(const std::string &stage, const std::string &error) {
        VerifyLine line = new_line(stage);
        line.failed = true;
        line.note = error;
        emit(report_, o_, std::move(line));
        return error;
    }

    VerifyLine new_line(std::string stage) const {
        VerifyLine line;
        line.tp = tp_;
        line.stage = std::move(stage);
        return line;
    }

    // Clears every rank's capture and turns the ranks' taps on or off for the next step.
    void set_taps(bool on) {
        for (int r = 0; r < tp_; ++r) {
            TapCapture *cap = &caps_[static_cast<size_t>(r)];
            cap->clear();
            e_->forward(r).set_tap(on ? sc_.layer : -1,
                                   on ? TapFn([cap](Tap t, TensorView v) { cap->on_tap(t, v); }) : TapFn{});
        }
    }
    // Turns the taps off, keeping what they captured.
    void untap() {
        for (int r = 0; r < tp_; ++r) e_->forward(r).set_tap(-1, {});
    }

    // Rank 0's work during the last step (the verifier's own tap copies taken out).
    StepCounts counts() const {
        StepCounts s;
        for (int r = 0; r < tp_; ++r) {
            const StepCounters c = e_->counters(r);
            const int64_t taps = caps_[static_cast<size_t>(r)].copies();  // all made during run()
            const int64_t d2h = c.backend.d2h_copies - taps;
            if (r == 0) {
                s.launches = c.backend.launches;
                s.h2d = c.backend.h2d_copies;
                s.d2h = d2h;
                s.syncs = c.d2h_before_finish - taps;
                s.all_gathers = c.comm.all_gathers;
                s.exchanges = c.comm.exchanges;
                s.comm_bytes = c.comm.bytes;
            } else if (c.backend.launches != s.launches || c.backend.h2d_copies != s.h2d ||
                       c.comm.all_gathers != s.all_gathers || c.comm.exchanges != s.exchanges) {
                // (Only rank 0 copies results back: the ranks' backend -> host copies differ by design.)
                s.ranks_differ = true;
            }
        }
        s.allocations = e_->step_allocations();
        return s;
    }

    // The work rules of one step (STEP_WORK): one host -> backend copy (the tables), at most one backend ->
    // host copy (the sampled ids) and none before finish (no wait for the backend inside plan or run), every
    // rank the same work, and, when given, the launches of a one-sequence decode.
    void check_work(Comparison &c, const StepCounts &s, int64_t want_launches, const std::string &what) const {
        const auto rule = [&](bool ok, const std::string &msg) {
            ++c.compared;
            if (!ok) {
                if (c.mismatches == 0) c.first = what + ": " + msg;
                ++c.mismatches;
            }
        };
        rule(s.h2d == 1, fmt::format("{} host -> backend copies, want 1", s.h2d));
        rule(s.d2h <= 1, fmt::format("{} backend -> host copies, want at most 1", s.d2h));
        rule(s.syncs == 0, fmt::format("{} backend -> host copies before finish, want 0", s.syncs));
        rule(!s.ranks_differ, "the ranks' work differs");
        if (want_launches >= 0) {
            rule(s.launches == want_launches,
                 fmt::format("{} launches, a one-sequence decode makes {}", s.launches, want_launches));
        }
    }

    void compare_logits(Comparison &c, std::span<const float> want, std::pair<int64_t, int64_t> range) const {
        for (int r = 0; r < tp_; ++r) {
            const std::vector<float> got = logit_rows(e_->rank_logits(r), range, cfg_.vocab_size);
            compare_floats(c, want, got, fmt::format("rank {} logits", r));
        }
    }

    void compare_pages(Comparison &c) const {
        ++c.compared;
        if (auto ok = e_->check_pages(); !ok) {
            if (c.mismatches == 0) c.first = ok.error().message;
            ++c.mismatches;
        }
    }

    std::string action(const Action &a, const RefStep &want) {
        VerifyLine line = new_line(a.stage);
        std::vector<uint64_t> before;
        if (a.unchanged) {
            for (int r = 0; r < tp_; ++r) {
                auto snap = snapshot(*e_, r, *seq_);
                if (!snap) return fail(a.stage, snap.error().message);
                before.push_back(digest(*snap));
            }
        }
        set_taps(a.tap);
        e_->reset_counters();
        auto ok = execute(*e_, *seq_, a);
        line.has_counts = true;
        line.counts = counts();
        if (!counted_any_) line.note = "warm-up";
        counted_any_ = true;
        untap();
        if (!ok) return fail(a.stage, ok.error().message);
        if (a.stage == "decode 1") decode_launches_ = line.counts.launches;

        Comparison lg = make_cmp(a.logits_gate, "logits");
        compare_logits(lg, want.logits, {0, static_cast<int64_t>(want.logits.size()) / cfg_.vocab_size});
        if (!a.abandon) {
            ++lg.compared;
            if (e_->sampled(0).id != want.token) {
                if (lg.mismatches == 0) lg.first = fmt::format("sampled token {}, want {}", e_->sampled(0).id, want.token);
                ++lg.mismatches;
            }
        }
        line.comparisons.push_back(lg);
        Comparison bytes = make_cmp(a.kv_gate, "kv_bytes", "bytes");
        Comparison state = make_cmp(a.kv_gate, "kv_state", "fields");
        Comparison pages = make_cmp(kKvPages, "pages", "fields");
        for (int r = 0; r < tp_; ++r) compare_kv(bytes, state, pages, want.kv, *e_, r, *seq_);
        compare_pages(pages);
        line.comparisons.push_back(bytes);
        line.comparisons.push_back(state);
        line.comparisons.push_back(pages);
        if (a.unchanged) {
            // A rollback or an abandoned step leaves every rank's cache as it was (rows, bytes, state).
            Comparison same = make_cmp(a.kv_gate, "unchanged", "caches");
            for (int r = 0; r < tp_; ++r) {
                ++same.compared;
                auto snap = snapshot(*e_, r, *seq_);
                if (!snap || digest(*snap) != before[static_cast<size_t>(r)]) {
                    if (same.mismatches == 0) same.first = fmt::format("rank {} cache changed", r);
                    ++same.mismatches;
                }
            }
            line.comparisons.push_back(same);
        }
        if (a.work) {
            Comparison work = make_cmp(kStepWork, "work", "fields");
            check_work(work, line.counts, decode_launches_, a.stage);
            line.comparisons.push_back(work);
        }
        line.note += fmt::format("{}pages held: full {} of {}, sliding {} of {}", line.note.empty() ? "" : "; ",
                                 seq_->kv().pages_held(kv::PoolKind::kFull),
                                 e_->page_pool(kv::PoolKind::kFull).n_pages(),
                                 seq_->kv().pages_held(kv::PoolKind::kSwa),
                                 e_->page_pool(kv::PoolKind::kSwa).n_pages());
        emit(report_, o_, std::move(line));
        if (a.tap) layer_line(a, want);
        return {};
    }

    // The layer gates of one tapped step, every rank against the reference and the oracle.
    void layer_line(const Action &a, const RefStep &want) {
        VerifyLine line = new_line(fmt::format("L{} {}", sc_.layer, a.stage));
        LayerCmp c(a.cacheless);
        const TapCapture &ref = *want.taps;
        const LayerGeometry &g = cfg_.layers[static_cast<size_t>(sc_.layer)];
        const int64_t hd = g.head_dim;
        const int64_t d = cfg_.d_model;
        for (int r = 0; r < tp_; ++r) {
            const TapCapture &cap = caps_[static_cast<size_t>(r)];
            const parallel::RankLayerPlan &rl =
                e_->plan_of_ranks().ranks[static_cast<size_t>(r)].layers[static_cast<size_t>(sc_.layer)];
            const std::string who = fmt::format("rank {}", r);
            if (!cap.overflow().empty()) shape_mismatch(c.layer, 1, who + ": tap overflowed at " + cap.overflow());
            // Attention: the rank's query / KV heads' columns; the o_proj and residual whole.
            compare_whole(c.attention, cap, ref, Tap::kAttnNorm, who);
            compare_tap(c.attention, cap, Tap::kQ, ref.data(Tap::kQ), ref.rows(Tap::kQ), ref.cols(Tap::kQ),
                        rl.q_heads.begin * hd, who);
            for (Tap t : {Tap::kK, Tap::kV}) {
                compare_tap(c.attention, cap, t, ref.data(t), ref.rows(t), ref.cols(t), rl.kv_heads.begin * hd, who);
            }
            if (ref.seen(Tap::kAttnGate)) {
                compare_tap(c.attention, cap, Tap::kAttnGate, ref.data(Tap::kAttnGate), ref.rows(Tap::kAttnGate),
                            ref.cols(Tap::kAttnGate), rl.q_heads.begin, who);
            }
            compare_tap(c.attention, cap, Tap::kAttnOut, ref.data(Tap::kAttnOut), ref.rows(Tap::kAttnOut),
                        ref.cols(Tap::kAttnOut), rl.q_heads.begin * hd, who);
            compare_whole(c.attention, cap, ref, Tap::kOProj, who);
            compare_whole(c.attention, cap, ref, Tap::kResidual, who);
            compare_whole(c.layer, cap, ref, Tap::kLayerIn, who);
            compare_whole(c.layer, cap, ref, Tap::kLayerOut, who);
            if (!sc_.layer_moe || !want.oracle) continue;
            const OracleStep &os = *want.oracle;
            for (Tap t : {Tap::kFfnNorm, Tap::kRouterLogits, Tap::kExpertIds, Tap::kExpertWeights}) {
                compare_whole(c.router, cap, ref, t, who);
            }
            compare_whole(c.shared, cap, ref, Tap::kSharedOut, who);
            oracle_expert_checks(c.experts, c.rows, cap, os, g, d, tp_, r, who);
            compare_tap(c.combine, cap, Tap::kLayerOut, os.combine.data(), os.n, d, 0, who);
        }
        line.comparisons = {c.attention, c.layer};
        if (sc_.layer_moe && want.oracle) {
            line.comparisons = {c.attention, c.router, c.experts, c.rows, c.combine, c.shared, c.layer};
            line.note = fmt::format("{} pairs", want.oracle->pairs);
        }
        emit(report_, o_, std::move(line));
    }

    // The MTP stage: every MTP layer's logits and KV rows against the reference.
    std::string mtp() {
        if (sc_.mtp_prompt.empty()) return {};
        VerifyLine line = new_line("mtp");
        SequenceOptions mo;
        mo.sampling = scenario_sampling();
        mo.mtp_streams = e_->options().mtp_layers;
        auto ms = e_->create_sequence(mo);
        if (!ms) return fail(line.stage, ms.error().message);
        (*ms)->tokens = sc_.mtp_prompt;
        const StepItem it = sc_.mtp_item(**ms);
        e_->reset_counters();
        auto ok = e_->step(std::span(&it, 1));
        line.has_counts = true;
        line.counts = counts();
        if (!ok) return fail(line.stage, ok.error().message);
        Comparison lg = make_cmp(kMtpGate, "logits");
        for (int k = 0; k < e_->options().mtp_layers; ++k) {
            compare_logits(lg, ref_.mtp_logits[static_cast<size_t>(k)], e_->logit_range(0, 1 + k));
        }
        Comparison bytes = make_cmp(kMtpGate, "kv_bytes", "bytes");
        Comparison state = make_cmp(kMtpGate, "kv_state", "fields");
        Comparison pages = make_cmp(kKvPages, "pages", "fields");
        for (int r = 0; r < tp_; ++r) compare_kv(bytes, state, pages, *ref_.mtp_kv, *e_, r, **ms);
        compare_pages(pages);
        line.comparisons = {lg, bytes, state, pages};
        line.note = fmt::format("MTP layers 0 .. {} chained, rows {}, {}, {}", e_->options().mtp_layers - 1,
                                sc_.mtp_rows[0], sc_.mtp_rows[1], sc_.mtp_rows[2]);
        emit(report_, o_, std::move(line));
        return {};
    }

    // Speculation (D8): per sampling, the MTP layers' own drafts and (with draft-forcing backends) drafts forced
    // so that exactly 0 .. spec_draft stand (greedy; at temperature 0.7, where the penalty window holds the
    // drafts, all of them), each run against decoding without drafts on the TP = 1 reference:
    // every token, the logit row behind it, each rank's trunk KV bytes; the MTP layers' rows against the
    // teacher-forced pass; the forced acceptance itself.
    std::string speculation() {
        if (sc_.spec_draft == 0) return {};
        const std::vector<std::pair<std::string, SamplingParams>> samplings = spec_samplings();
        for (size_t si = 0; si < samplings.size(); ++si) {
            const SpecRef &want = ref_.spec[si];
            for (int forced = -1; forced <= (o_.forcing != nullptr ? sc_.spec_draft : -1); ++forced) {
                if (si > 0 && forced >= 0 && forced < sc_.spec_draft) continue;
                const std::string label = forced < 0 ? "own drafts" : fmt::format("{} accepted", forced);
                VerifyLine line = new_line(fmt::format("spec {} {}", samplings[si].first, label));
                auto run = spec_decode(*e_, sc_, samplings[si].second, sc_.spec_draft, o_.forcing, &want.tokens,
                                       forced);
                if (!run) return fail(line.stage, run.error().message);
                const Sequence &s = *run->seq;
                Comparison tokens = make_cmp(kSpecGate, "tokens", "fields");
                for (size_t i = 0; i < std::max(want.tokens.size(), s.tokens.size()); ++i) {
                    ++tokens.compared;
                    const int64_t a = i < want.tokens.size() ? want.tokens[i] : -1;
                    const int64_t b = i < s.tokens.size() ? s.tokens[i] : -1;
                    if (a != b) {
                        if (tokens.mismatches == 0) tokens.first = fmt::format("position {}: want {}, got {}", i, a, b);
                        ++tokens.mismatches;
                    }
                }
                Comparison logits = make_cmp(kSpecGate, "logits");
                if (want.logits.size() != run->logits.size()) {
                    shape_mismatch(logits, static_cast<int64_t>(want.logits.size()), "decoded rows");
                }
                for (size_t i = 0; i < std::min(want.logits.size(), run->logits.size()); ++i) {
                    compare_floats(logits, want.logits[i], run->logits[i], fmt::format("decoded token {}", i));
                }
                Comparison trunk = make_cmp(kSpecGate, "trunk_kv", "bytes");
                Comparison mtp_rows = make_cmp(kSpecGate, "mtp_kv", "bytes");
                Comparison ignored_state = make_cmp(kSpecGate, "state", "fields");
                Comparison ignored_pages = make_cmp(kSpecGate, "pages", "fields");
                // The MTP layers' rows this sequence holds, against the teacher-forced pass's.
                KvSnapshot tf;
                for (const LayerRows &l : want.teacher_forced.layers) {
                    if (!cfg_.layers[static_cast<size_t>(l.layer)].is_mtp) continue;
                    const int stream = 1 + l.layer - cfg_.n_layers;
                    LayerRows kept = l;
                    kept.positions.clear();
                    kept.k.clear();
                    kept.v.clear();
                    for (size_t i = 0; i < l.positions.size(); ++i) {
                        const int64_t p = l.positions[i];
                        if (p >= s.length(stream) || !s.kv().has_page(kv::PoolKind::kSwa, p)) continue;
                        kept.positions.push_back(p);
                        kept.k.insert(kept.k.end(), l.k.begin() + static_cast<std::ptrdiff_t>(i) * l.k_row,
                                      l.k.begin() + static_cast<std::ptrdiff_t>(i + 1) * l.k_row);
                        kept.v.insert(kept.v.end(), l.v.begin() + static_cast<std::ptrdiff_t>(i) * l.v_row,
                                      l.v.begin() + static_cast<std::ptrdiff_t>(i + 1) * l.v_row);
                    }
                    tf.layers.push_back(std::move(kept));
                }
                for (int r = 0; r < tp_; ++r) {
                    compare_kv(trunk, ignored_state, ignored_pages, want.trunk, *e_, r, s);
                    compare_kv(mtp_rows, ignored_state, ignored_pages, tf, *e_, r, s);
                }
                SpecStats stats;
                Comparison accepted = make_cmp(kSpecGate, "acceptance", "fields");
                for (size_t i = 0; i < run->steps.size(); ++i) {
                    const Decoded &d = run->steps[i];
                    stats.add(d);
                    if (forced < 0) continue;
                    ++accepted.compared;
                    if (d.accepted != std::min<int64_t>(forced, d.drafted)) {
                        if (accepted.mismatches == 0) {
                            accepted.first = fmt::format("step {}: {} of {} drafts accepted, {} forced", i, d.accepted,
                                                         d.drafted, forced);
                        }
                        ++accepted.mismatches;
                    }
                }
                // One more drafting step, counted: the work rules of any step (one copy each way, none before
                // finish, the same on every rank) and no heap allocation.
                Comparison work = make_cmp(kStepWork, "work", "fields");
                if (o_.forcing != nullptr) o_.forcing->ids = {-1, -1, -1};
                e_->reset_counters();
                DecodeOptions d;
                d.draft = sc_.spec_draft;
                d.max_new = sc_.spec_draft + 1;
                auto more = decode(*e_, *run->seq, d);
                if (!more) return fail(line.stage, more.error().message);
                line.has_counts = true;
                line.counts = counts();
                check_work(work, line.counts, -1, line.stage);
                line.comparisons = {tokens, logits, trunk, mtp_rows, work};
                if (forced >= 0) line.comparisons.push_back(accepted);
                std::string rates;
                for (int j = 0; j < sc_.spec_draft; ++j) rates += fmt::format(" {:.2f}", stats.rate(j));
                line.note = fmt::format("{} steps, {:.2f} tokens per step, acceptance per position{}", stats.steps,
                                        stats.tokens_per_step(), rates);
                emit(report_, o_, std::move(line));
            }
        }
        return {};
    }

    // Batch invariance: the probe alone (the b = 1 run) against the reference, then inside batches of
    // 2 .. B sequences at every slot; a prefill step with every probe logit, then one decode step, whose work
    // must equal a one-sequence decode's.
    std::string batch() {
        std::vector<float> alone_prefill, alone_decode;
        set_taps(false);
        for (int b = 1; b <= o_.batch; ++b) {
            VerifyLine line = new_line(fmt::format("batch {}", b));
            Comparison probe = make_cmp(kBatch, b == 1 ? "probe_vs_tp1" : "probe");
            Comparison work = make_cmp(kStepWork, "work", "fields");
            Comparison pages = make_cmp(kKvPages, "pages", "fields");
            int64_t allocations = 0;
            for (int slot = 0; slot < b; ++slot) {
                std::vector<std::unique_ptr<Sequence>> seqs;
                SequenceOptions so;
                so.sampling = scenario_sampling();
                for (int i = 0; i < b; ++i) {
                    auto s = e_->create_sequence(so);
                    if (!s) return fail(line.stage, s.error().message);
                    seqs.push_back(std::move(*s));
                }
                BatchPlan bp = batch_items(sc_, seqs, slot);
                for (int phase = 0; phase < 2; ++phase) {
                    if (phase == 1) {
                        int filler = 0;
                        for (int i = 0; i < b; ++i) {
                            seqs[static_cast<size_t>(i)]->tokens.push_back(
                                i == slot ? sc_.probe_next : sc_.filler_next[static_cast<size_t>(filler++)]);
                        }
                    }
                    e_->reset_counters();
                    auto ok = e_->step(phase == 0 ? bp.prefill : bp.decode);
                    if (!ok) return fail(line.stage, ok.error().message);
                    const StepCounts sc = counts();
                    allocations += std::max<int64_t>(sc.allocations, 0);
                    if (phase == 1) {
                        line.counts = sc;
                        check_work(work, sc, decode_launches_, fmt::format("batch {} slot {} decode", b, slot));
                    }
                    const std::vector<float> got = logit_rows(e_->rank_logits(0), e_->logit_range(static_cast<size_t>(slot)),
                                                              cfg_.vocab_size);
                    std::vector<float> &alone = phase == 0 ? alone_prefill : alone_decode;
                    if (b == 1) {
                        alone = got;
                        compare_floats(probe, phase == 0 ? ref_.probe_prefill : ref_.probe_decode, got,
                                       "probe alone vs tp1");
                    } else {
                        compare_floats(probe, alone, got, fmt::format("probe in slot {} of {}", slot, b));
                    }
                    compare_pages(pages);
                }
            }
            line.has_counts = true;
            if (line.counts.allocations >= 0) line.counts.allocations = allocations;
            line.comparisons = {probe, work, pages};
            line.note = fmt::format("counts: the batch's decode step; allocs: all {} steps of the {} slot runs", 2 * b,
                                    b);
            emit(report_, o_, std::move(line));
        }
        return {};
    }

    const Step35Config &cfg_;
    const Scenario &sc_;
    const Reference &ref_;
    const VerifyOptions &o_;
    VerifyReport &report_;
    int tp_;
    std::unique_ptr<Engine> e_;
    std::unique_ptr<Sequence> seq_;
    std::vector<TapCapture> caps_;  // [rank]
    bool counted_any_ = false;
    int64_t decode_launches_ = -1;  // launches of "decode 1", the one-sequence decode every decode must match
};

// ---- Gates ----

std::string format_totals(const std::map<std::string, std::pair<int64_t, int64_t>> &by_unit) {
    std::string out;
    for (const auto &[unit, mc] : by_unit) {
        if (!out.empty()) out += ", ";
        out += fmt::format("{}/{} {}", mc.first, mc.second, unit);
    }
    return out;
}

void summarize(VerifyReport &report, const Step35Config &cfg, const Scenario &sc, const VerifyOptions &o) {
    std::map<std::string, std::string> skip_reason;
    if (cfg.n_mtp_layers == 0) skip_reason[kMtpGate] = "the model has no MTP layer";
    if (cfg.n_mtp_layers == 0) skip_reason[kSpecGate] = "the model has no MTP layer to draft with";
    if (sc.window == 0) skip_reason[kKvSliding] = "the model has no sliding-window layer";
    if (!sc.layer_moe) {
        const std::string why = fmt::format("layer {} is dense (--layer picks a MoE layer)", sc.layer);
        for (const char *g : {kRouter, kExperts, kRows, kCombine, kShared}) skip_reason[g] = why;
    }
    const bool none_ran = report.runs == 0;
    for (const std::string &name : verify_gate_names()) {
        GateResult gate;
        gate.name = name;
        std::map<std::string, std::pair<int64_t, int64_t>> by_unit;
        std::vector<std::string> run_keys;
        std::string first;
        for (const VerifyLine &line : report.lines) {
            const std::string key = line.reference ? "ref" : fmt::format("{}", line.tp);
            for (const Comparison &c : line.comparisons) {
                if (c.gate != name) continue;
                auto &mc = by_unit[c.unit];
                mc.first += c.mismatches;
                mc.second += c.compared;
                gate.mismatches += c.mismatches;
                if (first.empty() && c.mismatches > 0) {
                    first = fmt::format("{} {}: {}",
                                        line.reference ? std::string("tp1 reference") : fmt::format("tp={}", line.tp),
                                        line.stage, c.first);
                }
                if (std::find(run_keys.begin(), run_keys.end(), key) == run_keys.end()) run_keys.push_back(key);
            }
        }
        gate.runs = static_cast<int>(run_keys.size());
        gate.totals = format_totals(by_unit);
        if (name == kAllocs) {
            int64_t bad = 0;
            int64_t steps = 0;
            bool counted = false;
            for (const VerifyLine &line : report.lines) {
                if (!line.has_counts || line.counts.allocations < 0) continue;
                counted = true;
                if (line.note.rfind("warm-up", 0) == 0) continue;
                ++steps;
                if (line.counts.allocations > 0) {
                    if (first.empty()) {
                        first = fmt::format("tp={} {}: {} allocations", line.tp, line.stage, line.counts.allocations);
                    }
                    bad += line.counts.allocations;
                }
            }
            gate.mismatches = bad;
            gate.totals = fmt::format("{} allocations in {} steps after warm-up", bad, steps);
            gate.runs = report.runs;
            if (!counted) {
                gate.status = GateStatus::kSkip;
                gate.totals.clear();
                gate.detail = !o.count_allocations ? "allocations are not counted here"
                              : none_ran            ? "every tp was refused by the plan"
                                                    : "no native step ran";
            } else {
                gate.status = bad > 0 ? GateStatus::kFail : GateStatus::kPass;
                gate.detail = first;
            }
        } else if (name == kNativeRun) {
            std::string errors;
            for (const VerifyCombo &c : report.combos) {
                if (!c.skipped && !c.reason.empty()) {
                    if (!errors.empty()) errors += "; ";
                    errors += fmt::format("tp={}: {}", c.tp, c.reason);
                }
            }
            gate.runs = report.runs;
            if (!none_ran) gate.totals = fmt::format("{} native run{}", report.runs, report.runs == 1 ? "" : "s");
            gate.status = none_ran ? GateStatus::kSkip : errors.empty() ? GateStatus::kPass : GateStatus::kFail;
            gate.detail = none_ran ? "every tp was refused by the plan" : errors;
            gate.mismatches = errors.empty() ? 0 : 1;
        } else if (gate.mismatches > 0) {
            gate.status = GateStatus::kFail;
            gate.detail = first;
        } else if (!by_unit.empty()) {
            gate.status = GateStatus::kPass;
        } else {
            gate.status = GateStatus::kSkip;
            auto it = skip_reason.find(name);
            gate.detail = it != skip_reason.end() ? it->second
                          : none_ran                ? "every tp was refused by the plan"
                                                    : "not reached (a native run stopped early)";
        }
        report.gates.push_back(std::move(gate));
    }
}

}  // namespace

const char *gate_status_name(GateStatus s) {
    switch (s) {
    case GateStatus::kPass: return "PASS";
    case GateStatus::kFail: return "FAIL";
    case GateStatus::kSkip: return "SKIP";
    }
    return "?";
}

const std::vector<std::string> &verify_gate_names() {
    static const std::vector<std::string> names = {
        kLogitsPrefill, kLogitsDecode, kKvBytes, kKvTransactions, kKvPages, kKvSliding, kMtpGate, kSpecGate,
        kBatch,         kStepWork,     kAttnCacheless, kAttnCached, kRouter, kExperts, kRows,
        kCombine,       kShared,       kLayer,   kAllocs,   kNativeRun};
    return names;
}

bool VerifyReport::any_fail() const {
    return std::any_of(gates.begin(), gates.end(), [](const GateResult &g) { return g.status == GateStatus::kFail; });
}

Result<VerifyReport> run_verify(const io::TensorStore &store, const Step35Config &cfg, const VerifyOptions &options) {
    if (options.prefill_tokens < 2) {
        return make_error("verify: prefill tokens {}, expected at least 2", options.prefill_tokens);
    }
    if (options.decode_steps < 1) {
        return make_error("verify: decode steps {}, expected at least 1", options.decode_steps);
    }
    if (options.batch < 1) return make_error("verify: batch {}, expected at least 1", options.batch);
    if (options.layer < -1 || options.layer >= cfg.n_layers) {
        return make_error("verify: layer {} outside the model's trunk layers 0 .. {}", options.layer,
                          cfg.n_layers - 1);
    }
    if (options.tp.empty()) return make_error("verify: no tp degree to run");
    for (const int tp : options.tp) {
        if (tp < 1) return make_error("verify: tp {}, expected at least 1", tp);
    }
    if (!options.make_reference_backend || !options.make_rank_backend) {
        return make_error("verify: no backend factory");
    }
    auto sc = make_scenario(cfg, options);
    if (!sc) return make_error("verify: {}", sc.error().message);

    VerifyReport report;
    const LayerGeometry &lg = cfg.layers[static_cast<size_t>(sc->layer)];
    report.model = fmt::format("{}, {} layers + {} MTP, d_model {}, {} experts top-{}; layer gates on layer {} ({}, "
                               "{} attention)",
                               cfg.is_fp8() ? "fp8 experts" : "bf16", cfg.n_layers, cfg.n_mtp_layers, cfg.d_model,
                               lg.n_experts, lg.top_k, sc->layer, sc->layer_moe ? "MoE" : "dense",
                               lg.attn == AttnKind::kSliding ? "sliding" : "full");
    // The plan decides which combinations run; when it refuses them all, nothing runs at all.
    for (const int tp : options.tp) {
        VerifyCombo combo;
        combo.tp = tp;
        parallel::PlanRequest req;
        req.tp = tp;
        req.devices_available = tp;
        auto plan = parallel::make_plan(plan_shape(cfg), req);
        if (!plan) {
            combo.skipped = true;
            combo.reason = plan.error().message;
        }
        report.combos.push_back(std::move(combo));
    }
    const bool any_runs = std::any_of(report.combos.begin(), report.combos.end(),
                                      [](const VerifyCombo &c) { return !c.skipped; });
    std::optional<Reference> ref;
    if (any_runs) {
        auto made = run_reference(store, cfg, *sc, options, report);
        if (!made) return tl::unexpected(made.error());
        ref.emplace(std::move(*made));
    }
    for (VerifyCombo &combo : report.combos) {
        if (combo.skipped) {
            VerifyLine line;
            line.tp = combo.tp;
            line.stage = "SKIP";
            line.note = fmt::format("the plan refuses it: {}", combo.reason);
            emit(report, options, std::move(line));
            continue;
        }
        ++report.runs;
        NativeRun run(cfg, *sc, *ref, options, report, combo.tp);
        combo.reason = run.run(store);
    }
    summarize(report, cfg, *sc, options);
    return report;
}

std::string format_verify_line(const VerifyLine &line) {
    const std::string who =
        line.reference ? std::string("tp=1 (ref)") : fmt::format("tp={}", line.tp);
    std::string out = fmt::format("{:<12}", who);
    out += fmt::format(" {:<16}", line.stage);
    if (line.failed) return out + " FAILED: " + line.note;
    for (const Comparison &c : line.comparisons) out += fmt::format(" {} {}/{}", c.what, c.mismatches, c.compared);
    if (line.has_counts) {
        const StepCounts &s = line.counts;
        out += fmt::format(" | launches {} h2d {} d2h {} syncs {} all_gathers {} exchanges {} allocs {}", s.launches,
                           s.h2d, s.d2h, s.syncs, s.all_gathers, s.exchanges,
                           s.allocations < 0 ? std::string("n/a") : fmt::format("{}", s.allocations));
        if (s.ranks_differ) out += " (ranks differ)";
    }
    if (!line.note.empty() && line.stage != "SKIP") out += " (" + line.note + ")";
    if (line.stage == "SKIP") out += " " + line.note;
    for (const Comparison &c : line.comparisons) {
        if (c.mismatches > 0) out += fmt::format("\n    {} first mismatch: {}", c.what, c.first);
    }
    return out;
}

std::string format_verify_summary(const VerifyReport &report) {
    std::string out;
    size_t width = 0;
    for (const GateResult &g : report.gates) width = std::max(width, g.name.size());
    for (const GateResult &g : report.gates) {
        out += fmt::format("{:<{}} {}", g.name, width, gate_status_name(g.status));
        if (!g.totals.empty()) out += "  " + g.totals;
        if (!g.detail.empty()) out += "  (" + g.detail + ")";
        out += "\n";
    }
    int skipped = 0;
    for (const VerifyCombo &c : report.combos) skipped += c.skipped ? 1 : 0;
    int64_t mismatches = 0;
    for (const GateResult &g : report.gates) mismatches += g.mismatches;
    const char *overall = report.any_fail() ? "FAIL" : report.runs == 0 ? "NOTHING VERIFIED" : "PASS";
    out += fmt::format("VERIFY {}: {} native run{}, {} skipped by the plan, {} mismatch{}\n", overall, report.runs,
                       report.runs == 1 ? "" : "s", skipped, mismatches, mismatches == 1 ? "" : "es");
    return out;
}

}  // namespace memra::runtime
