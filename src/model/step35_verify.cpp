// memra verify's gates (step35_verify.h). The scenario is data (Action list, batch probe); the TP=1
// reference runs it once, recording logits, KV snapshots and the tapped layer's intermediates, and computes
// the per-expert oracle and the host combine from its taps; each native rank group then runs the same
// scenario and is compared stage by stage, rank by rank. Nothing here is timed: it counts bits and work.
#include "model/step35_verify.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <map>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "core/check.h"
#include "kv/kv_cache.h"
#include "model/step35_forward.h"
#include "model/step35_model.h"
#include "model/step35_plan.h"
#include "model/step35_ranks.h"
#include "model/step35_weights.h"
#include "parallel/plan.h"

namespace memra::model {

namespace {

// ---- Gate names (report order) ----

constexpr const char *kLogitsPrefill = "LOGITS_PREFILL";
constexpr const char *kLogitsDecode = "LOGITS_DECODE";
constexpr const char *kKvBytes = "KV_BYTES";
constexpr const char *kKvTransactions = "KV_TRANSACTIONS";
constexpr const char *kKvGrow = "KV_GROW";
constexpr const char *kKvRing = "KV_SLIDING_RING";
constexpr const char *kMtpGate = "MTP";
constexpr const char *kBatch = "BATCH_INVARIANCE";
constexpr const char *kAttnCacheless = "ATTENTION_CACHELESS";
constexpr const char *kAttnCached = "ATTENTION_CACHED";
constexpr const char *kRouter = "ROUTER";
constexpr const char *kExperts = "EXPERTS_GROUPED";
constexpr const char *kRoutes = "ROUTES_DYNAMIC";
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

enum class ActionKind { kStep, kMtp, kGrow };

struct Action {
    ActionKind kind = ActionKind::kStep;
    std::string stage;
    const char *logits_gate = nullptr;
    const char *kv_gate = nullptr;
    std::vector<int32_t> tokens;  // trunk: new tokens; MTP: next tokens
    bool all_logits = false;
    int64_t commit = -1;
    HiddenRows h_prev;     // MTP only
    int64_t grow_to = 0;   // kGrow only
    bool tap = false;      // the layer gates observe this step
    bool cacheless = false;  // a prefill from an empty cache: attention reads only the step's own rows
    bool rollback = false;   // commits nothing: every cache must end exactly as it began
};

struct Scenario {
    std::vector<Action> actions;  // sequence 0: prefill, MTP, decode, transactions, grow, ring
    int64_t capacity0 = 0;        // sequence 0's capacity until the grow
    int max_stage_rows = 1;
    int ring_window = 0;  // the widest sliding window of the trunk (0: no sliding layer)
    int64_t ring_slots = 0;
    int layer = 0;
    bool layer_moe = false;
    int64_t tap_rows = 1;  // most rows of a tapped step
    ForwardCapacity capacity;
    // Batch invariance: the probe and B - 1 fillers of different lengths, each then decoding one token.
    std::vector<int32_t> probe;
    int32_t probe_next = 0;
    std::vector<std::vector<int32_t>> fillers;
    std::vector<int32_t> filler_next;
    int64_t batch_capacity = 0;
    int batch_stage_rows = 1;
};

Result<Scenario> make_scenario(const Step35Config &cfg, const VerifyOptions &o) {
    Scenario sc;
    const int64_t n = o.prefill_tokens;
    const int64_t d = o.decode_steps;
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
        if (g.attn == AttnKind::kSliding) sc.ring_window = std::max(sc.ring_window, g.window);
    }
    sc.max_stage_rows = static_cast<int>(std::max<int64_t>(n, 3));
    sc.tap_rows = std::max<int64_t>(n, 3);

    const auto prompt = draw_tokens(o.seed, 1, n, vocab);
    auto step = [](std::string stage, const char *lg, const char *kg, std::vector<int32_t> tokens, bool all,
                   int64_t commit) {
        Action a;
        a.stage = std::move(stage);
        a.logits_gate = lg;
        a.kv_gate = kg;
        a.tokens = std::move(tokens);
        a.all_logits = all;
        a.commit = commit;
        return a;
    };
    Action prefill = step("prefill", kLogitsPrefill, kKvBytes, prompt, true, -1);
    prefill.tap = true;
    prefill.cacheless = true;
    sc.actions.push_back(prefill);
    if (cfg.n_mtp_layers > 0) {
        // The MTP layer over the prompt (token p + 1 with the trunk's hidden state at p), then one chained
        // draft from the MTP layer's own last hidden row.
        Action m = step("mtp prompt", kMtpGate, kMtpGate, std::vector<int32_t>(prompt.begin() + 1, prompt.end()),
                        true, -1);
        m.kind = ActionKind::kMtp;
        m.h_prev = HiddenRows{false, 0, n - 1};
        sc.actions.push_back(m);
        Action c = step("mtp chained", kMtpGate, kMtpGate, draw_tokens(o.seed, 2, 1, vocab), true, -1);
        c.kind = ActionKind::kMtp;
        c.h_prev = HiddenRows{true, n - 2, n - 1};
        sc.actions.push_back(c);
    }
    for (int64_t i = 1; i <= d; ++i) {
        Action a = step(fmt::format("decode {}", i), kLogitsDecode, kKvBytes,
                        draw_tokens(o.seed, 10 + static_cast<uint64_t>(i), 1, vocab), false, -1);
        a.tap = i == 1;
        sc.actions.push_back(a);
    }
    // Speculation: 3 tokens staged, the first kept; 3 staged, none kept; 3 staged, all kept.
    const char *txn = kKvTransactions;
    Action partial = step("txn partial", txn, txn, draw_tokens(o.seed, 100, 3, vocab), true, 1);
    Action rollback = step("txn rollback", txn, txn, draw_tokens(o.seed, 101, 3, vocab), true, 0);
    Action recommit = step("txn recommit", txn, txn, draw_tokens(o.seed, 102, 3, vocab), true, -1);
    partial.tap = rollback.tap = recommit.tap = true;
    rollback.rollback = true;
    sc.actions.push_back(partial);
    sc.actions.push_back(rollback);
    sc.actions.push_back(recommit);
    // The cache is exactly full now; grow it, decode, then decode until every sliding ring has wrapped (two
    // positions past its slots: the live window holds rows on both sides of the wrap).
    sc.capacity0 = n + d + 4;
    const int64_t grown_len = sc.capacity0 + 1;
    int64_t capacity1 = grown_len + 2;
    int64_t target_len = grown_len;
    if (sc.ring_window > 0) {
        const int64_t w = sc.ring_window;
        capacity1 = std::max(w + sc.max_stage_rows, grown_len) + w + 2;
        sc.ring_slots = w + sc.max_stage_rows;  // kv::KvLayerLayout: min(window + stage rows, capacity)
        target_len = std::max(grown_len + 2, sc.ring_slots + 2);
    }
    Action grow;
    grow.kind = ActionKind::kGrow;
    grow.stage = "grow";
    grow.kv_gate = kKvGrow;
    grow.grow_to = capacity1;
    sc.actions.push_back(grow);
    sc.actions.push_back(step("grown decode", kKvGrow, kKvGrow, draw_tokens(o.seed, 200, 1, vocab), false, -1));
    for (int64_t i = 1; grown_len + i <= target_len; ++i) {
        sc.actions.push_back(step(fmt::format("ring {}", i), kLogitsDecode, kKvRing,
                                  draw_tokens(o.seed, 300 + static_cast<uint64_t>(i), 1, vocab), false, -1));
    }

    // Batch invariance: a probe of up to 8 tokens and fillers of 1 .. 7 tokens, all different lengths.
    const int64_t probe_len = std::min<int64_t>(n, 8);
    sc.probe = draw_tokens(o.seed, 400, probe_len, vocab);
    sc.probe_next = draw_tokens(o.seed, 401, 1, vocab).front();
    int64_t batch_tokens = probe_len;
    int64_t longest = probe_len;
    for (int j = 1; j < o.batch; ++j) {
        const int64_t len = 1 + (3 * j) % 7;
        sc.fillers.push_back(draw_tokens(o.seed, 500 + static_cast<uint64_t>(j), len, vocab));
        sc.filler_next.push_back(draw_tokens(o.seed, 600 + static_cast<uint64_t>(j), 1, vocab).front());
        batch_tokens += len;
        longest = std::max(longest, len);
    }
    sc.batch_stage_rows = static_cast<int>(longest);
    sc.batch_capacity = longest + 1;

    sc.capacity.max_tokens = std::max(n, batch_tokens);
    sc.capacity.max_seqs = o.batch;
    sc.capacity.max_context = std::max(capacity1, sc.batch_capacity);
    sc.capacity.max_logit_rows = std::max<int64_t>(n, probe_len + o.batch);
    if (sc.capacity.max_context > cfg.context_length) {
        return make_error("the scenario reaches position {} (prefill {}, decode {}, transactions, ring), past the "
                          "model's context length {}",
                          sc.capacity.max_context, n, d, cfg.context_length);
    }
    return sc;
}

// ---- Captured intermediates ----

// A forward's tapped intermediates of one step, copied into storage reserved beforehand (the copies run
// inside the step, where nothing may allocate). Every tapped buffer holds 4-byte values (f32 or i32).
class TapCapture {
public:
    void reserve(const Step35Config &cfg, int layer, int64_t max_rows) {
        const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
        const int64_t width = std::max<int64_t>({cfg.d_model, int64_t{g.n_heads} * g.head_dim,
                                                 int64_t{g.n_kv_heads} * g.head_dim, g.n_heads, g.n_experts,
                                                 g.top_k, g.d_expert, g.d_shared});
        for (int t = 0; t < kTapCount; ++t) {
            const bool pairs = t >= static_cast<int>(Tap::kExpertGate) && t <= static_cast<int>(Tap::kExpertDown);
            data_[static_cast<size_t>(t)].reserve(static_cast<size_t>(max_rows * (pairs ? g.top_k : 1) * width));
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

// ---- KV caches ----

struct LayerRows {
    int64_t begin = 0;
    int64_t end = 0;
    std::vector<std::byte> k, v;  // live rows in position order
    int64_t k_row = 0, v_row = 0;
};

struct CacheSnapshot {
    int64_t length = 0;
    int64_t capacity = 0;
    uint64_t generation = 0;
    std::vector<LayerRows> layers;
};

Result<CacheSnapshot> snapshot(const kv::KvCache &c) {
    CacheSnapshot s;
    s.length = c.length();
    s.capacity = c.capacity();
    s.generation = c.last_generation();
    for (int l = 0; l < c.n_layers(); ++l) {
        LayerRows rows;
        rows.begin = c.live_begin(l);
        rows.end = c.live_end(l);
        rows.k_row = c.layout(l).k_row_bytes;
        rows.v_row = c.layout(l).v_row_bytes;
        for (int64_t p = rows.begin; p < rows.end; ++p) {
            auto k = c.k_row_bytes(l, p);
            auto v = c.v_row_bytes(l, p);
            if (!k || !v) return make_error("reference KV snapshot: layer {} position {}: {}", l, p,
                                            (!k ? k.error() : v.error()).message);
            rows.k.insert(rows.k.end(), k->begin(), k->end());
            rows.v.insert(rows.v.end(), v->begin(), v->end());
        }
        s.layers.push_back(std::move(rows));
    }
    return s;
}

// Rank `rank`'s cache against its KV heads' bytes of the TP=1 cache: bytes of every live row, and the state
// fields (length, capacity, generation, live bounds per layer).
void compare_cache(Comparison &bytes, Comparison &state, const CacheSnapshot &want, const kv::KvCache &got,
                   const parallel::RankPlan &plan, int first_layer, int rank, const Step35Config &cfg) {
    auto field = [&](const char *name, int64_t a, int64_t b) {
        ++state.compared;
        if (a != b) {
            if (state.mismatches == 0) state.first = fmt::format("rank {} {}: want {}, got {}", rank, name, a, b);
            ++state.mismatches;
        }
    };
    field("length", want.length, got.length());
    field("capacity", want.capacity, got.capacity());
    field("generation", static_cast<int64_t>(want.generation), static_cast<int64_t>(got.last_generation()));
    if (static_cast<int>(want.layers.size()) != got.n_layers()) {
        field("layers", static_cast<int64_t>(want.layers.size()), got.n_layers());
        return;
    }
    for (int l = 0; l < got.n_layers(); ++l) {
        const LayerRows &w = want.layers[static_cast<size_t>(l)];
        field("live_begin", w.begin, got.live_begin(l));
        field("live_end", w.end, got.live_end(l));
        const parallel::Range heads = plan.layers[static_cast<size_t>(first_layer + l)].kv_heads;
        const int n_heads = cfg.layers[static_cast<size_t>(first_layer + l)].n_kv_heads;
        for (int kv = 0; kv < 2; ++kv) {
            const int64_t row = kv == 0 ? w.k_row : w.v_row;
            const int64_t per_head = row / n_heads;
            const std::vector<std::byte> &all = kv == 0 ? w.k : w.v;
            for (int64_t p = w.begin; p < w.end; ++p) {
                const std::byte *want_row = all.data() + (p - w.begin) * row + heads.begin * per_head;
                const int64_t n = heads.size() * per_head;
                bytes.compared += n;
                auto part = kv == 0 ? got.k_row_bytes(l, p) : got.v_row_bytes(l, p);
                if (!part || static_cast<int64_t>(part->size()) != n) {
                    if (bytes.mismatches == 0) {
                        bytes.first = fmt::format("rank {} layer {} position {}: {}", rank, first_layer + l, p,
                                                  part ? fmt::format("{} bytes, want {}", part->size(), n)
                                                       : part.error().message);
                    }
                    bytes.mismatches += n;
                    continue;
                }
                for (int64_t i = 0; i < n; ++i) {
                    if ((*part)[static_cast<size_t>(i)] != want_row[i]) {
                        if (bytes.mismatches == 0) {
                            bytes.first = fmt::format("rank {} layer {} position {} {} byte {}", rank,
                                                      first_layer + l, p, kv == 0 ? "K" : "V", i);
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
    int64_t launches = 0;
};

// One plain product per (token, expert) pair on the reference backend, over per-expert matrices of the
// checkpoint's full expert banks (windows of the mapped tensors, no copies).
class ExpertOracle {
public:
    static Result<ExpertOracle> create(Backend &be, const io::Checkpoint &ckpt, const Step35Config &cfg, int layer) {
        ExpertOracle o;
        o.be_ = &be;
        const LayerGeometry &g = cfg.layers[static_cast<size_t>(layer)];
        o.g_ = g;
        o.d_ = cfg.d_model;
        const std::string p = fmt::format("model.layers.{}.moe.", layer);
        for (const char *proj : {"gate_proj", "up_proj", "down_proj"}) {
            const std::string name = p + proj + ".weight";
            auto ref = ckpt.get(name);
            if (!ref) return tl::unexpected(ref.error());
            const io::TensorInfo &info = *ref->info;
            if (info.shape.size() != 3 || info.shape[0] != g.n_experts) {
                return make_error("oracle: tensor {} is not [{}, rows, cols]", name, g.n_experts);
            }
            const int64_t rows = info.shape[1];
            const int64_t cols = info.shape[2];
            const float *scale = nullptr;
            int64_t scale_stride = 0;
            if (info.dtype == DType::kF8E4M3) {
                const std::string scale_name = name + std::string(kFp8ScaleSuffix);
                auto sref = ckpt.get(scale_name);
                if (!sref) return tl::unexpected(sref.error());
                auto floats = sref->as<float>();
                if (!floats) return tl::unexpected(floats.error());
                if (sref->info->shape.size() != 3) return make_error("oracle: tensor {} is not 3-d", scale_name);
                scale = floats->data();
                scale_stride = sref->info->shape[1] * sref->info->shape[2];
            }
            std::vector<MatrixId> &ids = proj[0] == 'g' ? o.gate_ : proj[0] == 'u' ? o.up_ : o.down_;
            const int64_t bytes = rows * cols * static_cast<int64_t>(dtype_size(info.dtype));
            for (int64_t e = 0; e < g.n_experts; ++e) {
                HostMatrix m;
                m.dtype = info.dtype;
                m.data = ref->bytes.data() + e * bytes;
                m.rows = rows;
                m.cols = cols;
                m.scale_inv = scale != nullptr ? scale + e * scale_stride : nullptr;
                if (scale != nullptr) {
                    m.block_rows = cfg.quantization.block_out;
                    m.block_cols = cfg.quantization.block_in;
                }
                auto id = be.upload_matrix(m);
                if (!id) return wrap_error(fmt::format("oracle: {} expert {}", name, e), id.error());
                ids.push_back(*id);
            }
        }
        auto x = be.alloc(DType::kF32, {1, o.d_});
        auto gt = be.alloc(DType::kF32, {1, g.d_expert});
        auto up = be.alloc(DType::kF32, {1, g.d_expert});
        auto out = be.alloc(DType::kF32, {1, o.d_});
        auto ws = be.alloc(DType::kF32, {std::max<int64_t>(be.canonical_workspace_floats(1, o.down_.front()), 1)});
        if (!x || !gt || !up || !out || !ws) return make_error("oracle: backend buffers could not be allocated");
        o.x_ = *x;
        o.g1_ = *gt;
        o.u1_ = *up;
        o.o1_ = *out;
        o.ws_ = *ws;
        return o;
    }

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
        for (int64_t p = 0; p < s.pairs; ++p) {
            const auto e = static_cast<size_t>(ids[static_cast<size_t>(p)]);
            const int64_t row = s.row_of_pair[static_cast<size_t>(p)];
            be_->copy_from_host(a + (p / s.k) * d_, x_);
            be_->matmul(x_, gate_[e], g1_);
            be_->matmul(x_, up_[e], u1_);
            be_->copy_to_host(g1_, s.gate.data() + row * de);
            be_->copy_to_host(u1_, s.up.data() + row * de);
            be_->swiglu(g1_, u1_, g_.clamp_routed, g1_);
            be_->copy_to_host(g1_, s.act.data() + row * de);
            be_->matmul_canonical(g1_, down_[e], o1_, ws_);
            be_->copy_to_host(o1_, s.down.data() + row * d_);
            s.launches += 4;
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
    Backend *be_ = nullptr;
    LayerGeometry g_;
    int64_t d_ = 0;
    std::vector<MatrixId> gate_, up_, down_;  // [expert]
    TensorView x_, g1_, u1_, o1_, ws_;        // [1, d_model], [1, d_expert] x2, [1, d_model], workspace
};

// ---- The reference run ----

struct RefStep {
    std::vector<float> logits;
    CacheSnapshot kv;  // sequence 0's trunk cache, or its MTP cache after an MTP step
    std::optional<TapCapture> taps;
    std::optional<OracleStep> oracle;
};

struct Reference {
    std::vector<RefStep> steps;  // per action
    std::vector<float> probe_prefill, probe_decode;
};

// Layer-gate comparisons of one tapped step; one instance per line.
struct LayerCmp {
    Comparison attention, router, experts, routes, rows, combine, shared, layer;

    explicit LayerCmp(bool cacheless)
        : attention(make_cmp(cacheless ? kAttnCacheless : kAttnCached, "attention")),
          router(make_cmp(kRouter, "router")),
          experts(make_cmp(kExperts, "experts")),
          routes(make_cmp(kRoutes, "routes")),
          rows(make_cmp(kRows, "expert_rows")),
          combine(make_cmp(kCombine, "combine")),
          shared(make_cmp(kShared, "shared")),
          layer(make_cmp(kLayer, "layer")) {}
};

// The reference's own taps against the oracle: its grouped projections and its combine.
void reference_oracle_checks(LayerCmp &c, const TapCapture &ref, const OracleStep &o, int64_t de, int64_t d) {
    compare_tap(c.experts, ref, Tap::kExpertGate, o.gate.data(), o.pairs, de, 0, "tp1");
    compare_tap(c.experts, ref, Tap::kExpertUp, o.up.data(), o.pairs, de, 0, "tp1");
    compare_tap(c.experts, ref, Tap::kExpertAct, o.act.data(), o.pairs, de, 0, "tp1");
    compare_tap(c.experts, ref, Tap::kExpertDown, o.down.data(), o.pairs, d, 0, "tp1");
    compare_tap(c.combine, ref, Tap::kLayerOut, o.combine.data(), o.n, d, 0, "tp1");
}

void emit(VerifyReport &report, const VerifyOptions &o, VerifyLine line) {
    if (o.on_line) o.on_line(line);
    report.lines.push_back(std::move(line));
}

Result<Reference> run_reference(const io::Checkpoint &ckpt, const Step35Config &cfg, const Scenario &sc,
                                const VerifyOptions &o, VerifyReport &report) {
    auto backend = o.make_reference_backend();
    if (!backend) return wrap_error("reference backend", backend.error());
    if (!*backend) return make_error("reference backend: the factory returned none");
    Backend &be = **backend;
    auto model = bind_step35_model(be, ckpt, cfg);
    if (!model) return wrap_error("reference", model.error());
    auto fwd = Step35Forward::create(be, *model, sc.capacity);
    if (!fwd) return wrap_error("reference forward", fwd.error());
    std::optional<ExpertOracle> oracle;
    if (sc.layer_moe) {
        auto made = ExpertOracle::create(be, ckpt, cfg, sc.layer);
        if (!made) return tl::unexpected(made.error());
        oracle.emplace(std::move(*made));
    }
    auto trunk = kv::KvCache::create(trunk_kv_spec(cfg, o.k_format, o.v_format, sc.capacity0, sc.max_stage_rows));
    if (!trunk) return wrap_error("reference KV cache", trunk.error());
    std::optional<kv::KvCache> mtp;
    if (cfg.n_mtp_layers > 0) {
        auto m = kv::KvCache::create(mtp_kv_spec(cfg, 0, o.k_format, o.v_format, sc.capacity0, sc.max_stage_rows));
        if (!m) return wrap_error("reference MTP KV cache", m.error());
        mtp.emplace(std::move(*m));
    }
    TapCapture cap;
    cap.backend = &be;
    cap.reserve(cfg, sc.layer, sc.tap_rows);
    const int64_t de = cfg.layers[static_cast<size_t>(sc.layer)].d_expert;

    Reference ref;
    for (const Action &a : sc.actions) {
        RefStep rs;
        Result<void> ok;
        cap.clear();
        fwd->set_tap(a.tap ? sc.layer : -1, a.tap ? TapFn([&cap](Tap t, TensorView v) { cap.on_tap(t, v); }) : TapFn{});
        if (a.kind == ActionKind::kStep) {
            const SeqChunk c{&*trunk, a.tokens, a.all_logits, a.commit};
            ok = fwd->step(std::span(&c, 1));
        } else if (a.kind == ActionKind::kMtp) {
            const MtpChunk c{&*mtp, a.tokens, a.all_logits, a.commit};
            const TensorView src = a.h_prev.from_mtp ? fwd->mtp_hidden() : fwd->hidden();
            ok = fwd->mtp_step(0, std::span(&c, 1), src.row_slice(a.h_prev.row_begin, a.h_prev.row_end));
        } else {
            ok = trunk->grow(a.grow_to);
            if (ok && mtp) ok = mtp->grow(a.grow_to);
        }
        fwd->set_tap(-1, {});
        if (!ok) return wrap_error(fmt::format("reference {}", a.stage), ok.error());
        if (!cap.overflow().empty()) return make_error("reference {}: tap {} overflowed", a.stage, cap.overflow());
        if (a.kind != ActionKind::kGrow) rs.logits.assign(fwd->logits().begin(), fwd->logits().end());
        auto snap = snapshot(a.kind == ActionKind::kMtp ? *mtp : *trunk);
        if (!snap) return tl::unexpected(snap.error());
        rs.kv = std::move(*snap);
        if (a.tap) {
            rs.taps = cap;
            if (oracle) {
                auto os = oracle->run(cap);
                if (!os) return wrap_error(fmt::format("reference {}", a.stage), os.error());
                LayerCmp c(a.cacheless);
                reference_oracle_checks(c, cap, *os, de, cfg.d_model);
                VerifyLine line;
                line.reference = true;
                line.stage = fmt::format("L{} {}", sc.layer, a.stage);
                line.comparisons = {c.experts, c.combine};
                line.note = fmt::format("oracle: {} pairs, {} launches", os->pairs, os->launches);
                emit(report, o, std::move(line));
                rs.oracle = std::move(*os);
            }
        }
        ref.steps.push_back(std::move(rs));
    }

    // The batch probe alone.
    auto pc = kv::KvCache::create(trunk_kv_spec(cfg, o.k_format, o.v_format, sc.batch_capacity, sc.batch_stage_rows));
    if (!pc) return wrap_error("reference probe KV cache", pc.error());
    SeqChunk c{&*pc, sc.probe, true, -1};
    if (auto ok = fwd->step(std::span(&c, 1)); !ok) return wrap_error("reference probe", ok.error());
    ref.probe_prefill.assign(fwd->logits().begin(), fwd->logits().end());
    c = SeqChunk{&*pc, std::span(&sc.probe_next, 1), false, -1};
    if (auto ok = fwd->step(std::span(&c, 1)); !ok) return wrap_error("reference probe decode", ok.error());
    ref.probe_decode.assign(fwd->logits().begin(), fwd->logits().end());
    return ref;
}

// ---- A native run ----

class NativeRun {
public:
    NativeRun(const Step35Config &cfg, const Scenario &sc, const Reference &ref, const VerifyOptions &o,
              VerifyReport &report, int tp, bool ep)
        : cfg_(cfg), sc_(sc), ref_(ref), o_(o), report_(report), tp_(tp), ep_(ep) {}

    // Runs every stage; returns the error that stopped the run (also on a failed line), or empty.
    std::string run(const io::Checkpoint &ckpt) {
        const int tp = tp_;
        BackendFactory factory = [this, tp](int rank) { return o_.make_rank_backend(tp, rank); };
        auto group = Step35RankGroup::create(ckpt, cfg_, RankGroupOptions{tp_, ep_, sc_.capacity, factory});
        if (!group) return fail("create", group.error().message);
        g_ = std::move(*group);
        if (o_.count_allocations) g_->set_allocation_counter(o_.count_allocations);
        auto seq = g_->create_sequence(o_.k_format, o_.v_format, sc_.capacity0, sc_.max_stage_rows);
        if (!seq) return fail("create", seq.error().message);
        seq_.emplace(std::move(*seq));
        caps_.resize(static_cast<size_t>(tp_));
        for (int r = 0; r < tp_; ++r) {
            caps_[static_cast<size_t>(r)].backend = &g_->backend(r);
            caps_[static_cast<size_t>(r)].reserve(cfg_, sc_.layer, sc_.tap_rows);
        }
        for (size_t i = 0; i < sc_.actions.size(); ++i) {
            if (auto err = action(sc_.actions[i], ref_.steps[i]); !err.empty()) return err;
        }
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
        line.ep = ep_;
        line.stage = std::move(stage);
        return line;
    }

    // Clears every rank's capture and turns the ranks' taps on or off for the next step.
    void set_taps(bool on) {
        for (int r = 0; r < tp_; ++r) {
            TapCapture *cap = &caps_[static_cast<size_t>(r)];
            cap->clear();
            g_->forward(r).set_tap(on ? sc_.layer : -1,
                                   on ? TapFn([cap](Tap t, TensorView v) { cap->on_tap(t, v); }) : TapFn{});
        }
    }
    // Turns the taps off, keeping what they captured.
    void untap() {
        for (int r = 0; r < tp_; ++r) g_->forward(r).set_tap(-1, {});
    }

    // Rank 0's work during the last step (the verifier's own tap copies taken out).
    StepCounts counts() const {
        StepCounts s;
        for (int r = 0; r < tp_; ++r) {
            const BackendCounters b = g_->counters(r);
            const CommCounters c = g_->comm_counters(r);
            const int64_t copies = b.host_copies - caps_[static_cast<size_t>(r)].copies();
            if (r == 0) {
                s.launches = b.launches;
                s.host_copies = copies;
                s.all_gathers = c.all_gathers;
                s.broadcasts = c.broadcasts;
                s.comm_bytes = c.bytes;
            } else if (b.launches != s.launches || copies != s.host_copies || c.all_gathers != s.all_gathers ||
                       c.broadcasts != s.broadcasts) {
                s.ranks_differ = true;
            }
        }
        s.allocations = g_->step_allocations();
        return s;
    }

    void compare_logits(Comparison &c, std::span<const float> want) const {
        for (int r = 0; r < tp_; ++r) {
            const auto got = g_->rank_logits(r);
            compare_floats(c, want, got, fmt::format("rank {} logits", r));
        }
    }

    std::string action(const Action &a, const RefStep &want) {
        VerifyLine line = new_line(a.stage);
        std::vector<uint64_t> before;
        if (a.rollback || a.kind == ActionKind::kGrow) {
            for (int r = 0; r < tp_; ++r) before.push_back(kv::kv_cache_digest(seq_->trunk(r)));
        }
        set_taps(a.tap);
        g_->reset_counters();
        Result<void> ok;
        if (a.kind == ActionKind::kStep) {
            const RankSeqChunk c{&*seq_, a.tokens, a.all_logits, a.commit};
            ok = g_->step(std::span(&c, 1));
        } else if (a.kind == ActionKind::kMtp) {
            const RankMtpChunk c{&*seq_, a.tokens, a.all_logits, a.commit};
            ok = g_->mtp_step(0, std::span(&c, 1), a.h_prev);
        } else {
            ok = g_->grow(*seq_, a.grow_to);
        }
        const bool tapped = a.tap;
        if (a.kind != ActionKind::kGrow) {
            line.has_counts = true;
            line.counts = counts();
            if (!counted_any_) line.note = "warm-up";
            counted_any_ = true;
        }
        untap();
        if (!ok) return fail(a.stage, ok.error().message);

        if (a.kind != ActionKind::kGrow) {
            Comparison lg = make_cmp(a.logits_gate, "logits");
            compare_logits(lg, want.logits);
            line.comparisons.push_back(lg);
        }
        Comparison bytes = make_cmp(a.kv_gate, "kv_bytes", "bytes");
        Comparison state = make_cmp(a.kv_gate, "kv_state", "fields");
        const bool mtp = a.kind == ActionKind::kMtp;
        for (int r = 0; r < tp_; ++r) {
            compare_cache(bytes, state, want.kv, mtp ? seq_->mtp(0, r) : seq_->trunk(r),
                          g_->plan().ranks[static_cast<size_t>(r)], mtp ? cfg_.n_layers : 0, r, cfg_);
        }
        line.comparisons.push_back(bytes);
        line.comparisons.push_back(state);
        if (!before.empty()) {
            // A rollback leaves every cache as it was; a grow keeps every live row (logical digest).
            Comparison same = make_cmp(a.kv_gate, a.rollback ? "unchanged" : "preserved", "caches");
            for (int r = 0; r < tp_; ++r) {
                ++same.compared;
                if (kv::kv_cache_digest(seq_->trunk(r)) != before[static_cast<size_t>(r)]) {
                    if (same.mismatches == 0) same.first = fmt::format("rank {} cache digest changed", r);
                    ++same.mismatches;
                }
            }
            line.comparisons.push_back(same);
        }
        if (a.kind == ActionKind::kGrow) line.note = fmt::format("capacity {} -> {}", sc_.capacity0, a.grow_to);
        emit(report_, o_, std::move(line));
        if (tapped) layer_line(a, want);
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
            const parallel::RankLayerPlan &rl = g_->plan().ranks[static_cast<size_t>(r)].layers[static_cast<size_t>(
                sc_.layer)];
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
            Comparison grouped = make_cmp(kExperts, "experts");
            if (!ep_) {
                // Every pair, the rank's d_expert columns.
                compare_tap(grouped, cap, Tap::kExpertGate, os.gate.data(), os.pairs, g.d_expert, rl.d_expert.begin,
                            who);
                compare_tap(grouped, cap, Tap::kExpertUp, os.up.data(), os.pairs, g.d_expert, rl.d_expert.begin, who);
                compare_tap(grouped, cap, Tap::kExpertAct, os.act.data(), os.pairs, g.d_expert, rl.d_expert.begin,
                            who);
            } else {
                // Whole rows of the pairs routed to the rank's own experts, computed before any exchange.
                const int64_t r0 = os.offsets[static_cast<size_t>(rl.experts.begin)];
                const int64_t r1 = os.offsets[static_cast<size_t>(rl.experts.end)];
                compare_tap(grouped, cap, Tap::kExpertGate, os.gate.data(), os.pairs, g.d_expert, 0, who, r0, r1);
                compare_tap(grouped, cap, Tap::kExpertUp, os.up.data(), os.pairs, g.d_expert, 0, who, r0, r1);
                compare_tap(grouped, cap, Tap::kExpertAct, os.act.data(), os.pairs, g.d_expert, 0, who, r0, r1);
                compare_tap(grouped, cap, Tap::kExpertDownOwn, os.down.data(), os.pairs, d, 0, who, r0, r1);
            }
            c.experts.mismatches += grouped.mismatches;
            c.experts.compared += grouped.compared;
            if (c.experts.first.empty()) c.experts.first = grouped.first;
            compare_tap(c.rows, cap, Tap::kExpertDown, os.down.data(), os.pairs, d, 0, who);
            compare_tap(c.combine, cap, Tap::kLayerOut, os.combine.data(), os.n, d, 0, who);
        }
        line.comparisons = {c.attention, c.layer};
        if (sc_.layer_moe && want.oracle) {
            line.comparisons = {c.attention, c.router, c.experts, c.rows, c.combine, c.shared, c.layer};
            // Routes refreshed in place: every tapped step after the first routes other pairs through the
            // same buffers (fixed capacity); its grouped rows must still equal the oracle's.
            if (last_offsets_ && *last_offsets_ != want.oracle->offsets) {
                c.routes.mismatches = c.experts.mismatches + c.rows.mismatches;
                c.routes.compared = c.experts.compared + c.rows.compared;
                c.routes.first = c.experts.first.empty() ? c.rows.first : c.experts.first;
                line.comparisons.push_back(c.routes);
            }
            line.note = fmt::format("{} pairs", want.oracle->pairs);
            last_offsets_ = want.oracle->offsets;
        }
        emit(report_, o_, std::move(line));
    }

    // Batch invariance: the probe alone (the b = 1 run) against the reference, then inside batches of
    // 2 .. B sequences at every slot; a prefill step with every probe logit, then one decode step.
    std::string batch() {
        std::vector<float> alone_prefill, alone_decode;
        set_taps(false);
        for (int b = 1; b <= o_.batch; ++b) {
            VerifyLine line = new_line(fmt::format("batch {}", b));
            Comparison probe = make_cmp(kBatch, b == 1 ? "probe_vs_tp1" : "probe");
            int64_t allocations = 0;
            for (int slot = 0; slot < b; ++slot) {
                std::vector<RankSequence> seqs;
                for (int i = 0; i < b; ++i) {
                    auto s = g_->create_sequence(o_.k_format, o_.v_format, sc_.batch_capacity, sc_.batch_stage_rows);
                    if (!s) return fail(line.stage, s.error().message);
                    seqs.push_back(std::move(*s));
                }
                std::vector<RankSeqChunk> prefill, decode;
                int filler = 0;
                for (int i = 0; i < b; ++i) {
                    if (i == slot) {
                        prefill.push_back(RankSeqChunk{&seqs[static_cast<size_t>(i)], sc_.probe, true, -1});
                        decode.push_back(RankSeqChunk{&seqs[static_cast<size_t>(i)], std::span(&sc_.probe_next, 1),
                                                      false, -1});
                    } else {
                        const auto f = static_cast<size_t>(filler++);
                        prefill.push_back(RankSeqChunk{&seqs[static_cast<size_t>(i)], sc_.fillers[f], false, -1});
                        decode.push_back(RankSeqChunk{&seqs[static_cast<size_t>(i)],
                                                      std::span(&sc_.filler_next[f], 1), false, -1});
                    }
                }
                for (int phase = 0; phase < 2; ++phase) {
                    g_->reset_counters();
                    auto ok = g_->step(phase == 0 ? prefill : decode);
                    if (!ok) return fail(line.stage, ok.error().message);
                    const StepCounts sc = counts();
                    allocations += std::max<int64_t>(sc.allocations, 0);
                    if (phase == 1) line.counts = sc;
                    const auto rows = g_->logit_row_begin();
                    const auto all = g_->logits();
                    const size_t v = static_cast<size_t>(cfg_.vocab_size);
                    const std::span<const float> got =
                        all.subspan(static_cast<size_t>(rows[static_cast<size_t>(slot)]) * v,
                                    static_cast<size_t>(rows[static_cast<size_t>(slot) + 1] -
                                                        rows[static_cast<size_t>(slot)]) *
                                        v);
                    std::vector<float> &alone = phase == 0 ? alone_prefill : alone_decode;
                    if (b == 1) {
                        alone.assign(got.begin(), got.end());
                        compare_floats(probe, phase == 0 ? ref_.probe_prefill : ref_.probe_decode, got,
                                       "probe alone vs tp1");
                    } else {
                        compare_floats(probe, alone, got, fmt::format("probe in slot {} of {}", slot, b));
                    }
                }
            }
            line.has_counts = true;
            if (line.counts.allocations >= 0) line.counts.allocations = allocations;
            line.comparisons.push_back(probe);
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
    bool ep_;
    std::unique_ptr<Step35RankGroup> g_;
    std::optional<RankSequence> seq_;
    std::vector<TapCapture> caps_;  // [rank]
    bool counted_any_ = false;
    std::optional<std::vector<int32_t>> last_offsets_;
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
    if (sc.ring_window == 0) skip_reason[kKvRing] = "the model has no sliding-window layer";
    if (!sc.layer_moe) {
        const std::string why = fmt::format("layer {} is dense (--layer picks a MoE layer)", sc.layer);
        for (const char *g : {kRouter, kExperts, kRoutes, kRows, kCombine, kShared}) skip_reason[g] = why;
    }
    const bool none_ran = report.runs == 0;
    for (const std::string &name : verify_gate_names()) {
        GateResult gate;
        gate.name = name;
        std::map<std::string, std::pair<int64_t, int64_t>> by_unit;
        std::vector<std::string> run_keys;
        std::string first;
        for (const VerifyLine &line : report.lines) {
            const std::string key = line.reference ? "ref" : fmt::format("{}/{}", line.tp, line.ep);
            for (const Comparison &c : line.comparisons) {
                if (c.gate != name) continue;
                auto &mc = by_unit[c.unit];
                mc.first += c.mismatches;
                mc.second += c.compared;
                gate.mismatches += c.mismatches;
                if (first.empty() && c.mismatches > 0) {
                    first = fmt::format("{} {}: {}", line.reference ? "tp1 reference" : fmt::format("tp={} ep={}",
                                                                                                     line.tp,
                                                                                                     line.ep ? "on"
                                                                                                             : "off"),
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
                if (line.note == "warm-up") continue;
                ++steps;
                if (line.counts.allocations > 0) {
                    if (first.empty()) {
                        first = fmt::format("tp={} ep={} {}: {} allocations", line.tp, line.ep ? "on" : "off",
                                            line.stage, line.counts.allocations);
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
                              : none_ran            ? "every (tp, ep) was refused by the plan"
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
                    errors += fmt::format("tp={} ep={}: {}", c.tp, c.ep ? "on" : "off", c.reason);
                }
            }
            gate.runs = report.runs;
            if (!none_ran) gate.totals = fmt::format("{} native run{}", report.runs, report.runs == 1 ? "" : "s");
            gate.status = none_ran ? GateStatus::kSkip : errors.empty() ? GateStatus::kPass : GateStatus::kFail;
            gate.detail = none_ran ? "every (tp, ep) was refused by the plan" : errors;
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
                          : none_ran                ? "every (tp, ep) was refused by the plan"
                                                    : "not reached (a native run stopped early)";
            if (it == skip_reason.end() && !none_ran && name == kRoutes) {
                gate.detail = "the tapped steps never changed the routes";
            }
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
        kLogitsPrefill, kLogitsDecode, kKvBytes,  kKvTransactions, kKvGrow, kKvRing,  kMtpGate,
        kBatch,         kAttnCacheless, kAttnCached, kRouter,      kExperts, kRoutes, kRows,
        kCombine,       kShared,        kLayer,      kAllocs,      kNativeRun};
    return names;
}

bool VerifyReport::any_fail() const {
    return std::any_of(gates.begin(), gates.end(), [](const GateResult &g) { return g.status == GateStatus::kFail; });
}

Result<VerifyReport> run_verify(const io::Checkpoint &ckpt, const Step35Config &cfg, const VerifyOptions &options) {
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
    if (options.tp.empty() || options.ep.empty()) return make_error("verify: no (tp, ep) to run");
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
        for (const bool ep : options.ep) {
            VerifyCombo combo;
            combo.tp = tp;
            combo.ep = ep;
            combo.requested = !options.ep_both;
            parallel::PlanRequest req;
            req.tp = tp;
            req.ep = ep;
            req.devices_available = tp;
            auto plan = parallel::make_plan(plan_shape(cfg), req);
            if (!plan) {
                combo.skipped = true;
                combo.reason = plan.error().message;
            }
            report.combos.push_back(std::move(combo));
        }
    }
    const bool any_runs = std::any_of(report.combos.begin(), report.combos.end(),
                                      [](const VerifyCombo &c) { return !c.skipped; });
    std::optional<Reference> ref;
    if (any_runs) {
        auto made = run_reference(ckpt, cfg, *sc, options, report);
        if (!made) return tl::unexpected(made.error());
        ref.emplace(std::move(*made));
    }
    for (VerifyCombo &combo : report.combos) {
        if (combo.skipped) {
            VerifyLine line;
            line.tp = combo.tp;
            line.ep = combo.ep;
            line.stage = "SKIP";
            line.note = combo.requested ? fmt::format("requested, but the plan refuses it: {}", combo.reason)
                                        : fmt::format("the plan refuses it: {}", combo.reason);
            emit(report, options, std::move(line));
            continue;
        }
        ++report.runs;
        NativeRun run(cfg, *sc, *ref, options, report, combo.tp, combo.ep);
        combo.reason = run.run(ckpt);
    }
    summarize(report, cfg, *sc, options);
    return report;
}

std::string format_verify_line(const VerifyLine &line) {
    const std::string who =
        line.reference ? std::string("tp=1 (ref)") : fmt::format("tp={} ep={}", line.tp, line.ep ? "on" : "off");
    std::string out = fmt::format("{:<12}", who);
    out += fmt::format(" {:<16}", line.stage);
    if (line.failed) return out + " FAILED: " + line.note;
    for (const Comparison &c : line.comparisons) out += fmt::format(" {} {}/{}", c.what, c.mismatches, c.compared);
    if (line.has_counts) {
        const StepCounts &s = line.counts;
        out += fmt::format(" | launches {} host_copies {} all_gathers {} broadcasts {} allocs {}", s.launches,
                           s.host_copies, s.all_gathers, s.broadcasts,
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

}  // namespace memra::model
