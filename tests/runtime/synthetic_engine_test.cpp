// An engine over the synthetic store (tools/make_tiny/synthetic_store.h) computes the bits of an engine over the
// checkpoint make-tiny writes for the same preset and seed: prefill logits and greedy decode steps, bf16 and fp8,
// on the CPU backend (which keeps views of the store's bytes) and on a backend that copies at upload (as CUDA
// does), where the binder gives every tensor back so the store ends up holding nothing.
#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cpu/cpu_backend.h"
#include "io/safetensors.h"
#include "make_tiny/make_tiny.h"
#include "make_tiny/synthetic_store.h"
#include "model/step35_config.h"
#include "runtime/engine.h"

#include "model/model_test_util.h"
#include "model/tiny_dirs.h"

namespace memra::runtime {
namespace {

using model::bit_mismatches;
using model::make_tokens;

// The CPU backend uploading copies of the host bytes, as the CUDA backend does: nothing it computes with points
// into the store, so the binder may give each tensor back after its upload.
class CopyingCpuBackend : public cpu::CpuBackend {
public:
    using cpu::CpuBackend::CpuBackend;
    bool keeps_host_views() const override { return false; }

    Result<MatrixId> upload_matrix(const HostMatrix &m) override { return cpu::CpuBackend::upload_matrix(copy(m)); }
    Result<BankId> upload_bank(const HostBank &b) override { return cpu::CpuBackend::upload_bank(copy(b)); }
    Result<MatrixId> upload_matrix_window(const HostMatrix &m, const MatrixWindow &w) override {
        return cpu::CpuBackend::upload_matrix_window(copy(m), w);
    }
    Result<BankId> upload_bank_window(const HostBank &b, const BankWindow &w) override {
        return cpu::CpuBackend::upload_bank_window(copy(b), w);
    }
    Result<VectorId> upload_vector(const HostVector &v) override {
        HostVector c = v;
        c.data = keep(v.data, static_cast<size_t>(v.n) * dtype_size(v.dtype));
        return cpu::CpuBackend::upload_vector(c);
    }

private:
    static int64_t blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

    HostMatrix copy(const HostMatrix &m) {
        HostMatrix c = m;
        c.data = keep(m.data, static_cast<size_t>(m.rows * m.cols) * dtype_size(m.dtype));
        if (m.scale_inv != nullptr) {
            const int64_t n = blocks(m.rows, m.block_rows) * blocks(m.cols, m.block_cols);
            c.scale_inv = static_cast<const float *>(keep(m.scale_inv, static_cast<size_t>(n) * 4));
        }
        return c;
    }
    HostBank copy(const HostBank &b) {
        HostBank c = b;
        c.data = keep(b.data, static_cast<size_t>(b.n_experts * b.rows * b.cols) * dtype_size(b.dtype));
        if (b.scale_inv != nullptr) {
            const int64_t n = b.n_experts * blocks(b.rows, b.block_rows) * blocks(b.cols, b.block_cols);
            c.scale_inv = static_cast<const float *>(keep(b.scale_inv, static_cast<size_t>(n) * 4));
        }
        return c;
    }
    const void *keep(const void *src, size_t n) {
        copies_.emplace_back(n);
        std::memcpy(copies_.back().data(), src, n);
        return copies_.back().data();
    }

    std::deque<std::vector<std::byte>> copies_;  // never reallocated: the backend's views point here
};

EngineOptions options(int tp, bool copying) {
    EngineOptions o;
    o.tp = tp;
    o.ctx_size = 256;
    o.step_rows = 64;
    o.max_logit_rows = 64;
    o.mtp_layers = 1;
    o.make_backend = [copying](int) -> Result<std::unique_ptr<Backend>> {
        if (copying) return std::unique_ptr<Backend>(std::make_unique<CopyingCpuBackend>(1, Numerics::kDevice));
        return std::unique_ptr<Backend>(std::make_unique<cpu::CpuBackend>(1, Numerics::kDevice));
    };
    return o;
}

// A prompt's logits (every row) then four greedy decode steps' (the token each sampled fed to the next), all
// concatenated.
std::vector<float> run_logits(Engine &e) {
    SequenceOptions so;
    so.sampling.temperature = 0.0f;
    auto seq = e.create_sequence(so);
    EXPECT_TRUE(seq.has_value()) << seq.error().message;
    if (!seq) return {};
    Sequence &s = **seq;
    s.tokens = make_tokens(3, 37, 700);
    std::vector<float> out;
    for (int step = 0; step < 5; ++step) {
        StepItem it;
        it.seq = &s;
        it.rows = s.pending();
        it.logits = LogitRows::kAll;
        it.sample = true;
        it.return_logits = true;
        auto ok = e.step(std::span(&it, 1));
        EXPECT_TRUE(ok.has_value()) << ok.error().message;
        if (!ok) return {};
        const auto lg = e.logits(0);
        out.insert(out.end(), lg.begin(), lg.end());
        s.tokens.push_back(e.sampled(0).id);
    }
    return out;
}

class SyntheticEngineTest : public ::testing::TestWithParam<const char *> {
protected:
    static void SetUpTestSuite() { dirs_ = new model::TinyDirs("synthetic_engine_test", 7, 9); }
    static void TearDownTestSuite() {
        delete dirs_;
        dirs_ = nullptr;
    }
    static bool fp8() { return std::string(GetParam()) == "fp8"; }
    static uint64_t seed() { return fp8() ? 9 : 7; }

    static model::TinyDirs *dirs_;
};

model::TinyDirs *SyntheticEngineTest::dirs_ = nullptr;

TEST_P(SyntheticEngineTest, LogitsAreTheCheckpointEnginesBits) {
    auto cfg = model::load_step35_config(dirs_->at(GetParam()));
    ASSERT_TRUE(cfg.has_value()) << cfg.error().message;
    auto ckpt = io::Checkpoint::open(dirs_->at(GetParam()));
    ASSERT_TRUE(ckpt.has_value()) << ckpt.error().message;
    auto preset = tools::find_tiny_preset("tiny");
    ASSERT_TRUE(preset.has_value());

    for (const int tp : {1, 2}) {
        SCOPED_TRACE(testing::Message() << "tp " << tp);
        auto reference = Engine::create(*ckpt, *cfg, options(tp, false));
        ASSERT_TRUE(reference.has_value()) << reference.error().message;
        const std::vector<float> want = run_logits(**reference);
        ASSERT_EQ(want.size(), (37u + 4u) * 1024u);

        for (const bool copying : {false, true}) {
            SCOPED_TRACE(copying ? "copying backend" : "cpu backend (views)");
            const tools::SyntheticStore store(*preset, seed(), fp8(), 2);
            // The synthetic model is configured by the config.json make-tiny writes, through the normal parser.
            auto scfg = model::parse_step35_config(store.config_json());
            ASSERT_TRUE(scfg.has_value()) << scfg.error().message;
            auto engine = Engine::create(store, *scfg, options(tp, copying));
            ASSERT_TRUE(engine.has_value()) << engine.error().message;
            const tools::SyntheticStats bound = store.stats();
            if (copying) {
                // Every tensor was given back after its upload: at most one tensor (with its FP8 scales) at a time.
                const std::vector<tools::TinyTensor> &tensors = store.tensors();
                uint64_t largest = 0;
                for (size_t i = 0; i < tensors.size(); ++i) {
                    uint64_t bytes = tensors[i].info.n_bytes();
                    if (tensors[i].part == tools::TinyPart::kFp8Codes) bytes += tensors[i + 1].info.n_bytes();
                    largest = std::max(largest, bytes);
                }
                EXPECT_EQ(bound.held_bytes, 0u);
                EXPECT_LE(bound.peak_held_bytes, largest);
                EXPECT_GE(bound.bytes, store.total_bytes()) << "every rank generates what it binds";
            } else {
                EXPECT_EQ(bound.held_bytes, store.total_bytes()) << "the CPU backend's views keep the whole model";
            }
            EXPECT_EQ(bit_mismatches(run_logits(**engine), want), 0);
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SyntheticEngineTest, ::testing::Values("bf16", "fp8"));

}  // namespace
}  // namespace memra::runtime
