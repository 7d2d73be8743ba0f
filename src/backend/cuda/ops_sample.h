// CUDA sampling op: per row, the token a core Sampler (core/sampling.h) draws — penalties, temperature,
// top-k / top-p / min-p, Gumbel-max keyed by (seed, choice, position) — and token_logprobs' log-probabilities,
// identical to CpuBackend::sample bit for bit (same id, same logprob bits). One block per row; the vocabulary
// loops use the whole block, the order-dependent float sums (the candidates' softmax sum and top-p scan in
// descending order, the log-softmax sum in id order) run on one thread in exactly the CPU's order, and the
// noise, exp and log are the shared MEMRA_HD functions. The launcher allocates nothing and reads nothing on
// the host: the workspace is sized once (sample_workspace_bytes) at prepare time.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/sampling_hd.h"

namespace memra::cuda {

// Bytes of one row slot of the sampling workspace for logits rows of up to `vocab` ids (a multiple of 256):
// the penalised logits [vocab] f32 and the candidates' sort keys [next power of two >= vocab] u64.
int64_t sample_workspace_slot_bytes(int32_t vocab);
// Bytes of a workspace of `slots` row slots: rows run concurrently one block per slot, more rows than slots
// take turns. vocab < 1 or slots < 1: 0.
int64_t sample_workspace_bytes(int32_t vocab, int64_t slots);

// CpuBackend::sample (a Sampler per row with the row's params, then token_logprobs when asked):
// out[i] = the SampledToken of rows[i], drawn from the ids [0, n_valid) of logits row rows[i].logit_row.
// Writes out[i].id and .has_logprobs, and with top_logprobs >= 0 also .logprobs.chosen, .n_top and the first
// n_top entries of top_ids / top_logprobs; the other bytes of out[i] are left untouched, as the CPU leaves them.
// logits: [n_logit_rows, row_stride] f32 (row_stride >= n_valid: the model's vocabulary, padding included);
// rows: [n_rows] SampleRow (8-byte aligned); history: [history_size] i32, the tokens the rows' penalty windows
// index (nullptr when history_size is 0); bias: [bias_size] LogitBias (4-byte aligned), the entries the rows'
// logit biases index (nullptr when bias_size is 0), added to the row's logits before the penalties with the CPU's
// float add; out: [n_rows] SampledToken (4-byte aligned).
// workspace: workspace_bytes >= sample_workspace_slot_bytes(workspace_vocab) bytes (256-byte aligned), made for
// rows of workspace_vocab >= n_valid ids; its contents need no initial value and are garbage afterwards.
// Bad rows: a logit_row, history or bias range outside the buffers, a bias range that is not sorted by unique
// ids in [0, workspace_vocab), a position outside [0, 2^32) or top_logprobs outside [-1, kMaxTopLogprobs]
// writes id = -1, has_logprobs = 0 and raises the flag (as ops_route.h); a bias id in [n_valid,
// workspace_vocab) has no logit and is skipped silently, as on the CPU (which also checks the values); a
// penalty-window token outside [0, workspace_vocab) is skipped and raises the flag (the CPU aborts on all).
// Tokens in [n_valid, workspace_vocab) have no logit to penalise and are skipped silently, as on the CPU.
// Outside the bit-identity contract: a NaN penalised logit, which only a frequency penalty whose product
// with a count overflows can make (the CPU's std::sort order is then unspecified).
cudaError_t sample(const float *logits, int64_t n_logit_rows, int64_t row_stride, int32_t n_valid,
                   const SampleRow *rows, int64_t n_rows, const int32_t *history, int64_t history_size,
                   const LogitBias *bias, int64_t bias_size, SampledToken *out, void *workspace,
                   int64_t workspace_bytes, int32_t workspace_vocab, int32_t *error_flag, cudaStream_t stream);

}  // namespace memra::cuda
