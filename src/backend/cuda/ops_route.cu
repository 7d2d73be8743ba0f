// MoE routing kernels (ops_route.h). The router runs one warp per token: its selection scores sit in shared
// memory and each slot is a warp arg-max under the strict total order (score descending, index ascending), so
// slot k is the k-th expert of that order, exactly the CPU's "largest not yet chosen, ties to the lower
// index". The pair sort is one block: a shared-memory histogram (integer atomics, whose result does not depend
// on their order), one warp's scan, then one warp placing the pairs 32 at a time in increasing pair index
// (match_any ranks within the 32), which is the CPU's stable counting sort.
#include "backend/cuda/ops_route.h"

#include <algorithm>
#include <cstdint>

#include <cuda_runtime.h>

#include "backend/cuda/arg_first.cuh"
#include "backend/cuda/exact_loop.cuh"
#include "backend/cuda/launch.cuh"
#include "core/float_formats.h"
#include "core/math.h"

namespace memra::cuda {

namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kSharedBytes = 48 * 1024;  // the default dynamic shared-memory limit of a block
constexpr int kRouterMaxWarps = 8;
constexpr int kSortThreads = 1024;
constexpr int kSortTile = 4096;  // pairs staged in shared memory per round of the placement warp
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;  // grid-stride loops cover anything larger

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sets the caller's sticky error flag (ops_route.h); many threads may set it, all to 1.
__device__ void raise_flag(int32_t *flag) {
    if (flag != nullptr) atomicExch(flag, 1);
}

// ---- Router ---------------------------------------------------------------------------------------------

// Token t's selection by the calling warp (cpu::router_topk): z: its [n_experts] logits, read with ld.global.cg
// (the fused route reads logits other blocks of its grid wrote); gbias: [n_experts] f32 or nullptr; s: the
// warp's [n_experts] floats of shared memory (the selection scores); ids, w: its [top_k] outputs.
__device__ void route_token(const float *z, const float *gbias, int n_experts, int top_k, bool renormalize,
                            float scaling_factor, float *s, int32_t *ids, float *w, int lane) {
    const float kNegInf = u32_as_f32(0xff800000u);
    // A lane's logits and biases, kChainLoads of each at once, are loaded before any score is formed (a store to
    // s between them would keep the compiler from moving the next loads ahead of it).
    for (int e0 = lane; e0 < n_experts; e0 += kWarp * kChainLoads) {
        float zv[kChainLoads];
        float bv[kChainLoads];
#pragma unroll
        for (int j = 0; j < kChainLoads; ++j) {
            const int e = e0 + j * kWarp;
            zv[j] = e < n_experts ? __ldcg(z + e) : 0.0f;
            bv[j] = e < n_experts && gbias != nullptr ? gbias[e] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kChainLoads; ++j) {
            const int e = e0 + j * kWarp;
            if (e >= n_experts) break;
            float v = sigmoid_f32(zv[j]);
            if (gbias != nullptr) v = v + bv[j];
            s[e] = v != v ? kNegInf : v;
        }
    }
    __syncwarp();

    // Slots go 32 at a time: slot base + l's expert stays with lane l, whose weight sigmoid(z) (the bias never
    // enters the weights) is then loaded by every lane at once; renormalisation sums the weights in slot order
    // (the lanes' values folded one after another across the chunks). The last chunk's weights are stored
    // final from registers; earlier chunks' raw weights are rescaled in place by the lanes that wrote them.
    float prev_s = 0.0f;
    int prev_e = -1;  // slot k picks the first expert strictly after slot k - 1's in the order
    float sum = 0.0f, wk = 0.0f;
    int base = 0;
    for (;; base += kWarp) {
        const int n = top_k - base < kWarp ? top_k - base : kWarp;
        int mine = 0;
        for (int k = 0; k < n; ++k) {
            float best_s = 0.0f;
            int32_t best_e = -1;
            for (int e = lane; e < n_experts; e += kWarp) {
                const float v = s[e];
                const bool after_prev = prev_e < 0 || first_before(prev_s, prev_e, v, e);
                if (after_prev && first_before(v, e, best_s, best_e)) {
                    best_s = v;
                    best_e = e;
                }
            }
            warp_first(best_s, best_e);
            // Every lane holds the same winner (top_k <= n_experts, so one exists).
            if (lane == k) mine = best_e;
            prev_s = best_s;
            prev_e = best_e;
        }
        wk = lane < n ? sigmoid_f32(__ldcg(z + mine)) : 0.0f;
        if (lane < n) ids[base + lane] = mine;
        if (renormalize) {
            for (int l = 0; l < n; ++l) sum = sum + __shfl_sync(kFullMask, wk, l);
        }
        if (base + kWarp >= top_k) break;
        w[base + lane] = wk;
    }
    const auto finish = [&](float x) { return (renormalize ? x / sum : x) * scaling_factor; };
    if (lane < top_k - base) w[base + lane] = finish(wk);
    for (int k = lane; k < base; k += kWarp) w[k] = finish(w[k]);
}

// glogits: [n_tokens, n_experts] f32; gbias: [n_experts] f32 or nullptr; gids, gweights: [n_tokens, top_k].
// Dynamic shared memory: [warps per block, n_experts] f32 selection scores.
__global__ void router_topk_kernel(const float *glogits, const float *gbias, int64_t n_tokens, int n_experts, int top_k,
                                   bool renormalize, float scaling_factor, int32_t *gids, float *gweights) {
    pdl_enter();
    extern __shared__ float s_score[];
    const int warp = static_cast<int>(threadIdx.x) / kWarp;
    const int lane = static_cast<int>(threadIdx.x) % kWarp;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
    if (t >= n_tokens) return;  // whole warps leave together; no block barrier follows
    route_token(glogits + t * n_experts, gbias, n_experts, top_k, renormalize, scaling_factor,
                s_score + static_cast<int64_t>(warp) * n_experts, gids + t * top_k, gweights + t * top_k, lane);
}

// ---- Pair sort --------------------------------------------------------------------------------------------

// The sort by the calling block, every thread of it (it has block barriers): gids: [n_pairs] i32, read with
// ld.global.cg (the fused route sorts ids other blocks wrote); goffsets: [n_experts + 1]; gsorted, grow_of:
// [n_pairs]. s_cursor: [n_experts] i32 of shared memory (counts, then each expert's next free row); s_ids:
// [tile] i32 of shared memory, the ids staged for the placement warp a tile at a time.
__device__ void sort_pairs_block(const int32_t *gids, int64_t n_pairs, int n_experts, int32_t *goffsets,
                                 int32_t *gsorted, int32_t *grow_of, int32_t *flag, int32_t *s_cursor, int32_t *s_ids,
                                 int tile) {
    const int tid = static_cast<int>(threadIdx.x);
    const int threads = static_cast<int>(blockDim.x);
    const int lane = tid % kWarp;
    for (int e = tid; e < n_experts; e += threads) s_cursor[e] = 0;
    __syncthreads();
    for (int64_t q = tid; q < n_pairs; q += threads) {
        const int32_t e = __ldcg(gids + q);
        if (e >= 0 && e < n_experts) {
            atomicAdd(&s_cursor[e], 1);
        } else {
            raise_flag(flag);
        }
    }
    __syncthreads();
    if (tid < kWarp) {  // exclusive scan of the counts, 32 experts at a time
        int32_t carry = 0;
        for (int base = 0; base < n_experts; base += kWarp) {
            const int e = base + lane;
            const int32_t count = e < n_experts ? s_cursor[e] : 0;
            int32_t inclusive = count;
            for (int offset = 1; offset < kWarp; offset *= 2) {
                const int32_t up = __shfl_up_sync(kFullMask, inclusive, offset);
                if (lane >= offset) inclusive += up;
            }
            if (e < n_experts) {
                s_cursor[e] = carry + inclusive - count;
                goffsets[e] = carry + inclusive - count;
            }
            carry += __shfl_sync(kFullMask, inclusive, kWarp - 1);
        }
        if (lane == 0) goffsets[n_experts] = carry;
    }
    // Placement: the block stages a tile of ids, warp 0 places its pairs 32 at a time in increasing q. Within
    // 32 pairs, a pair's rank among those of its expert is the number of lower lanes with the same expert.
    for (int64_t t0 = 0; t0 < n_pairs; t0 += tile) {
        const int tile_n = static_cast<int>(n_pairs - t0 < tile ? n_pairs - t0 : tile);
        __syncthreads();  // the scan (first tile) or the previous tile's placement is done
        for (int i = tid; i < tile_n; i += threads) s_ids[i] = __ldcg(gids + t0 + i);
        __syncthreads();
        if (tid >= kWarp) continue;
        for (int base = 0; base < tile_n; base += kWarp) {
            const int i = base + lane;
            const auto q = static_cast<int32_t>(t0 + i);  // < n_pairs <= INT32_MAX where it is used
            const int32_t e = i < tile_n ? s_ids[i] : -1;
            const bool valid = i < tile_n && e >= 0 && e < n_experts;
            const unsigned peers = __match_any_sync(kFullMask, valid ? e : -1);
            const unsigned lower = (1u << lane) - 1u;
            if (valid) {
                const int32_t row = s_cursor[e] + __popc(peers & lower);
                gsorted[row] = q;
                grow_of[q] = row;
            } else if (i < tile_n) {
                grow_of[q] = -1;
            }
            __syncwarp();  // every lane has read its expert's cursor before the group's last lane moves it
            if (valid && lane == 31 - __clz(peers)) s_cursor[e] += __popc(peers);
            __syncwarp();
        }
    }
}

// One block of kSortThreads. Dynamic shared memory: s_cursor [n_experts] i32.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_pairs_kernel(const int32_t *gids, int64_t n_pairs, int n_experts, int32_t *goffsets, int32_t *gsorted,
                          int32_t *grow_of, int32_t *flag) {
    pdl_enter();
    extern __shared__ int32_t s_cursor[];
    __shared__ int32_t s_ids[kSortTile];
    sort_pairs_block(gids, n_pairs, n_experts, goffsets, gsorted, grow_of, flag, s_cursor, s_ids, kSortTile);
}

// ---- Permute ------------------------------------------------------------------------------------------------

// gx: [n_tokens, d]; gsorted: [n_tokens * top_k]; goffsets: [n_experts + 1]; gx_own: [x_own_rows, d].
// One block of kThreads per row of x_own in a grid-stride loop.
constexpr int kPermuteBatch = 16;

__global__ void __launch_bounds__(kThreads)
    moe_permute_kernel(const float *gx, int64_t n_tokens, int64_t d, const int32_t *gsorted, const int32_t *goffsets,
                       int64_t expert_begin, int64_t expert_end, int64_t top_k, float *gx_own, int64_t x_own_rows,
                       int32_t *flag) {
    pdl_enter();
    const int64_t r0 = goffsets[expert_begin];
    const int64_t r1 = goffsets[expert_end];
    if (r0 < 0 || r1 < r0 || r1 > n_tokens * top_k || r1 - r0 > x_own_rows) {
        if (blockIdx.x == 0 && threadIdx.x == 0) raise_flag(flag);
        return;
    }
    for (int64_t j = blockIdx.x; j < r1 - r0; j += gridDim.x) {
        const int64_t q = gsorted[r0 + j];
        if (q < 0 || q >= n_tokens * top_k) {
            if (threadIdx.x == 0) raise_flag(flag);
            continue;
        }
        const float *src = gx + (q / top_k) * d;
        float *dst = gx_own + j * d;
        // kPermuteBatch loads in flight per thread before its stores (src and dst may alias as far as the
        // compiler knows, so it would not move a load above an earlier store by itself).
        for (int64_t c0 = threadIdx.x; c0 < d; c0 += int64_t{kPermuteBatch} * kThreads) {
            float v[kPermuteBatch];
#pragma unroll
            for (int u = 0; u < kPermuteBatch; ++u) {
                const int64_t c = c0 + int64_t{u} * kThreads;
                v[u] = c < d ? src[c] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < kPermuteBatch; ++u) {
                const int64_t c = c0 + int64_t{u} * kThreads;
                if (c < d) dst[c] = v[u];
            }
        }
    }
}

// ---- Source rows ----------------------------------------------------------------------------------------------

// Pair q's source row (cpu::moe_source_rows), -1 (and the flag raised) where it has none. grow_of and goffsets
// are read with ld.global.cg (the fused route reads what its sort just wrote).
__device__ int32_t source_row(const int32_t *gids, const int32_t *grow_of, int64_t q, const int32_t *goffsets,
                              int64_t n_experts, int64_t per_owner, int64_t capacity, int32_t *flag) {
    const int64_t e = __ldcg(gids + q);
    int32_t src = -1;
    if (e >= 0 && e < n_experts) {
        const int64_t owner = e / per_owner;
        const int64_t local = static_cast<int64_t>(__ldcg(grow_of + q)) - __ldcg(goffsets + owner * per_owner);
        const int64_t row = owner * capacity + local;
        if (local >= 0 && local < capacity && row <= INT32_MAX) src = static_cast<int32_t>(row);
    }
    if (src < 0) raise_flag(flag);
    return src;
}

// gids, grow_of, gsrc: [n_pairs]; goffsets: [n_experts + 1]. One thread per pair in a grid-stride loop.
__global__ void moe_source_rows_kernel(const int32_t *gids, const int32_t *grow_of, int64_t n_pairs,
                                       const int32_t *goffsets, int64_t n_experts, int64_t per_owner,
                                       int64_t capacity, int32_t *gsrc, int32_t *flag) {
    pdl_enter();
    for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < n_pairs;
         q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        gsrc[q] = source_row(gids, grow_of, q, goffsets, n_experts, per_owner, capacity, flag);
    }
}

// ---- Fused route ------------------------------------------------------------------------------------------

constexpr int kRouteThreads = 512;
constexpr int kRouteTileTokens = kRouteThreads / kWarp;  // a warp per token for the tile's selection
constexpr int kRouteGroups = kRouteThreads / kExactLanes;
constexpr int kRouteMaxTiles = static_cast<int>(kRouteMaxTokens / kRouteTileTokens);
static_assert(kRouteMaxTiles * kRouteTileTokens == kRouteMaxTokens && kRouteMaxTiles + 1 <= kRouteTickets);
constexpr int64_t kRouteMaxExperts = 512;
constexpr int64_t kRouteAreaBytes = 32 * 1024;  // chunk sums, then the selection scores
constexpr int kRouteSortTile = 2048;
static_assert(kRouteTileTokens * kRouteMaxExperts * 4 <= kRouteAreaBytes, "the tile's scores fit the area");
static_assert(kRouteAreaBytes + (kRouteMaxExperts + kRouteSortTile) * 4 <= kSharedBytes,
              "the default dynamic shared memory holds the area, the cursors and a sort tile");

struct RouteParams {
    const uint8_t *w;  // [n_experts, k] router rows
    int64_t k;
    int64_t chunk;  // the exact loop's chunk edge
    int n_chunks;
    const float *x;  // [n_tokens, k]
    const float *bias;
    int64_t n_tokens;
    int n_experts;
    int top_k;
    bool renormalize;
    float scaling_factor;
    int64_t per_owner;
    int64_t capacity;
    int n_tiles;
    int sort_tile;
    MoeRouteBuffers out;
    int32_t *tickets;
    int32_t *flag;
};

// Whether this block is the last of `of` to reach ticket `t` (the ticket then goes back to zero). Every thread
// of the block calls it after its own stores: the barrier, then thread 0's fence (cumulative, so it orders the
// whole block's stores before the ticket) and atomic; in the last block, thread 0's fence after the atomic and the
// barrier order the earlier blocks' stores before any thread's loads (the pattern of a grid barrier).
__device__ bool last_to_arrive(int32_t *t, int of) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(t, 1) == of - 1;
        if (s_last) *t = 0;  // every block of this launch has taken its ticket
        __threadfence();
    }
    __syncthreads();
    return s_last != 0;
}

// Block (r, tile): logits[t, r] for the tile's tokens, its 32 groups of 16 threads taking the (token, chunk) items
// in turn (exact_chunk_sum, as the products), the chunk sums then added in K order from +0 by one thread per
// token (dot_exact's bits). Dynamic shared memory: the area, s_cursor [n_experts] i32, s_ids [sort_tile] i32.
template <DType kDt>
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(const RouteParams p) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned char s_raw[];
    float *s_area = reinterpret_cast<float *>(s_raw);
    int32_t *s_cursor = reinterpret_cast<int32_t *>(s_raw + kRouteAreaBytes);
    int32_t *s_ids = s_cursor + p.n_experts;
    const int tid = static_cast<int>(threadIdx.x);
    const int row = static_cast<int>(blockIdx.x);
    const int tile = static_cast<int>(blockIdx.y);
    const int64_t t0 = int64_t{tile} * kRouteTileTokens;
    const int tile_n = static_cast<int>(p.n_tokens - t0 < kRouteTileTokens ? p.n_tokens - t0 : kRouteTileTokens);
    {
        const int group = tid / kExactLanes;
        const int lane = tid % kExactLanes;
        const unsigned mask = 0xffffu << (threadIdx.x & 16u);
        const uint8_t *gw = p.w + int64_t{row} * p.k * kElemBytes<kDt>;
        for (int item = group; item < tile_n * p.n_chunks; item += kRouteGroups) {
            const int t = item / p.n_chunks;
            const int c = item % p.n_chunks;
            const int64_t c0 = c * p.chunk;
            const int64_t c1 = c0 + p.chunk < p.k ? c0 + p.chunk : p.k;
            const float v = exact_chunk_sum<kDt>(p.x + (t0 + t) * p.k, gw, 0, c0, c1, lane, mask);
            if (lane == 0) s_area[t * p.n_chunks + c] = v;
        }
        __syncthreads();
        if (tid < tile_n) {
            const float *sums = s_area + tid * p.n_chunks;
            p.out.logits[(t0 + tid) * p.n_experts + row] = chain_sum(p.n_chunks, [&](int c) { return sums[c]; });
        }
    }
    if (!last_to_arrive(p.tickets + tile, p.n_experts)) return;
    // The tile's selection, a warp per token (s_area now holds the warps' scores).
    const int warp = tid / kWarp;
    if (warp < tile_n) {
        const int64_t t = t0 + warp;
        route_token(p.out.logits + t * p.n_experts, p.bias, p.n_experts, p.top_k, p.renormalize, p.scaling_factor,
                    s_area + int64_t{warp} * p.n_experts, p.out.expert_ids + t * p.top_k, p.out.weights + t * p.top_k,
                    tid % kWarp);
    }
    if (p.n_tiles > 1 && !last_to_arrive(p.tickets + kRouteMaxTiles, p.n_tiles)) return;
    __syncthreads();  // this block's selections are visible to all its threads
    const int64_t n_pairs = p.n_tokens * p.top_k;
    sort_pairs_block(p.out.expert_ids, n_pairs, p.n_experts, p.out.offsets, p.out.sorted_pair, p.out.row_of_pair,
                     p.flag, s_cursor, s_ids, p.sort_tile);
    __syncthreads();  // the sort's offsets and rows are visible to all the block's threads
    for (int64_t q = tid; q < n_pairs; q += kRouteThreads) {
        p.out.src_row[q] = source_row(p.out.expert_ids, p.out.row_of_pair, q, p.out.offsets, p.n_experts, p.per_owner,
                                      p.capacity, p.flag);
    }
}

}  // namespace

cudaError_t router_topk(const float *logits, const float *bias, int64_t n_tokens, int64_t n_experts, int64_t top_k,
                        bool renormalize, float scaling_factor, int32_t *expert_ids, float *weights,
                        cudaStream_t stream) {
    if (n_tokens < 0 || n_experts < 1 || n_experts > kRouterMaxExperts || top_k < 1 || top_k > n_experts) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens == 0) return cudaSuccess;
    if (logits == nullptr || expert_ids == nullptr || weights == nullptr) return cudaErrorInvalidValue;
    // As many warps (tokens) per block as their score rows fit in the default shared memory, at most 8.
    const int64_t row_bytes = n_experts * static_cast<int64_t>(sizeof(float));
    int64_t warps = kSharedBytes / row_bytes;
    warps = warps < kRouterMaxWarps ? warps : kRouterMaxWarps;
    const int64_t blocks = (n_tokens + warps - 1) / warps;
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
    launch_kernel(router_topk_kernel, static_cast<unsigned>(blocks), static_cast<unsigned>(warps * kWarp),
                  static_cast<size_t>(warps * row_bytes), stream, logits, bias, n_tokens, static_cast<int>(n_experts),
                  static_cast<int>(top_k), renormalize, scaling_factor, expert_ids, weights);
    return cudaGetLastError();
}

cudaError_t moe_sort_pairs(const int32_t *expert_ids, int64_t n_tokens, int64_t top_k, int64_t n_experts,
                           int32_t *offsets, int32_t *sorted_pair, int32_t *row_of_pair, int32_t *error_flag,
                           cudaStream_t stream) {
    if (n_tokens < 0 || top_k < 1 || n_experts < 1 || n_experts > kSortMaxExperts || offsets == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (n_tokens > INT32_MAX / top_k) return cudaErrorInvalidValue;
    const int64_t n_pairs = n_tokens * top_k;
    if (n_pairs > 0 && (expert_ids == nullptr || sorted_pair == nullptr || row_of_pair == nullptr)) {
        return cudaErrorInvalidValue;
    }
    // Launched even without pairs: the offsets are still written (all zero).
    launch_kernel(moe_sort_pairs_kernel, 1, kSortThreads, static_cast<size_t>(n_experts) * sizeof(int32_t), stream,
                  expert_ids, n_pairs, static_cast<int>(n_experts), offsets, sorted_pair, row_of_pair, error_flag);
    return cudaGetLastError();
}

cudaError_t moe_permute(const float *x, int64_t n_tokens, int64_t d, const int32_t *sorted_pair,
                        const int32_t *offsets, int64_t n_experts, int64_t expert_begin, int64_t expert_end,
                        int64_t top_k, float *x_own, int64_t x_own_rows, int32_t *error_flag, cudaStream_t stream) {
    if (n_tokens < 0 || d < 1 || top_k < 1 || n_experts < 1 || expert_begin < 0 || expert_begin > expert_end ||
        expert_end > n_experts || x_own_rows < 0 || offsets == nullptr) {
        return cudaErrorInvalidValue;
    }
    if (x_own_rows == 0 || expert_begin == expert_end) return cudaSuccess;  // nothing can be copied
    if (x == nullptr || sorted_pair == nullptr || x_own == nullptr) return cudaErrorInvalidValue;
    const int64_t blocks = x_own_rows < kMaxBlocks ? x_own_rows : kMaxBlocks;
    launch_kernel(moe_permute_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, x, n_tokens, d, sorted_pair,
                  offsets, expert_begin, expert_end, top_k, x_own, x_own_rows, error_flag);
    return cudaGetLastError();
}

cudaError_t moe_source_rows(const int32_t *expert_ids, const int32_t *row_of_pair, int64_t n_pairs,
                            const int32_t *offsets, int64_t n_experts, int64_t n_owners, int64_t capacity,
                            int32_t *src_row, int32_t *error_flag, cudaStream_t stream) {
    if (n_pairs < 0 || n_owners < 1 || n_experts < n_owners || n_experts % n_owners != 0 || capacity < 0) {
        return cudaErrorInvalidValue;
    }
    if (n_pairs == 0) return cudaSuccess;
    if (expert_ids == nullptr || row_of_pair == nullptr || offsets == nullptr || src_row == nullptr) {
        return cudaErrorInvalidValue;
    }
    const int64_t blocks_needed = (n_pairs + kThreads - 1) / kThreads;
    const int64_t blocks = blocks_needed < kMaxBlocks ? blocks_needed : kMaxBlocks;
    launch_kernel(moe_source_rows_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream, expert_ids, row_of_pair,
                  n_pairs, offsets, n_experts, n_experts / n_owners, capacity, src_row, error_flag);
    return cudaGetLastError();
}

bool moe_route_covers(const CudaMatrix &router, int64_t n_tokens, int64_t top_k) {
    return (router.dtype == DType::kF32 || router.dtype == DType::kBF16) && router.act == ActRounding::kNone &&
           router.k_begin == 0 && router.cols >= 1 && router.cols == router.k_full && router.row_begin == 0 &&
           router.rows == router.full_rows && router.rows <= kRouteMaxExperts && router.block_cols >= 1 &&
           n_tokens >= 1 && n_tokens <= kRouteMaxTokens && top_k >= 1 && top_k <= router.rows &&
           kRouteTileTokens * ceil_div(router.cols, router.block_cols) * 4 <= kRouteAreaBytes;
}

cudaError_t moe_route(const CudaMatrix &router, const float *x, int64_t n_tokens, const float *bias, int64_t top_k,
                      bool renormalize, float scaling_factor, int64_t n_owners, int64_t capacity,
                      const MoeRouteBuffers &out, int32_t *tickets, int32_t *error_flag, cudaStream_t stream) {
    const int64_t n_experts = router.rows;
    if (!moe_route_covers(router, n_tokens, top_k) || router.data == nullptr || x == nullptr || n_owners < 1 ||
        n_experts % n_owners != 0 || capacity < 0 || out.logits == nullptr || out.expert_ids == nullptr ||
        out.weights == nullptr || out.offsets == nullptr || out.sorted_pair == nullptr || out.row_of_pair == nullptr ||
        out.src_row == nullptr || tickets == nullptr) {
        return cudaErrorInvalidValue;
    }
    RouteParams p{};
    p.w = static_cast<const uint8_t *>(router.data);
    p.k = router.cols;
    p.chunk = router.block_cols;
    p.n_chunks = static_cast<int>(ceil_div(router.cols, router.block_cols));
    p.x = x;
    p.bias = bias;
    p.n_tokens = n_tokens;
    p.n_experts = static_cast<int>(n_experts);
    p.top_k = static_cast<int>(top_k);
    p.renormalize = renormalize;
    p.scaling_factor = scaling_factor;
    p.per_owner = n_experts / n_owners;
    p.capacity = capacity;
    p.n_tiles = static_cast<int>(ceil_div(n_tokens, kRouteTileTokens));
    p.sort_tile = static_cast<int>(std::min<int64_t>(n_tokens * top_k, kRouteSortTile));
    p.out = out;
    p.tickets = tickets;
    p.flag = error_flag;
    const size_t smem = static_cast<size_t>(kRouteAreaBytes + (n_experts + p.sort_tile) * 4);
    const dim3 grid(static_cast<unsigned>(n_experts), static_cast<unsigned>(p.n_tiles));
    if (router.dtype == DType::kF32) {
        launch_kernel(moe_route_kernel<DType::kF32>, grid, kRouteThreads, smem, stream, p);
    } else {
        launch_kernel(moe_route_kernel<DType::kBF16>, grid, kRouteThreads, smem, stream, p);
    }
    return cudaGetLastError();
}

}  // namespace memra::cuda
