// CUDA kernels of the delta `sparse` layout and the 1 MiB-block xxh3 checksum.
//
// wsync/codecs/delta_ref.py is the format; these kernels must write the same
// bytes. Everything is per 65536-element chunk, one thread block per chunk:
//
//   delta_count_<W>_<order>   changed and escape counts per chunk (the table),
//                             plus a bit per element saying "changed", so the
//                             second pass reads 1/16 of the bytes instead of
//                             both tensors again (two full passes would cap
//                             encode at half the copy bandwidth)
//   (host)                    exclusive prefix sums of the table: where each
//                             chunk's gaps/steps/escapes start
//   delta_fill_<W>_<order>    stream compaction within the chunk: each thread
//                             takes one mask word (32 elements), a block scan
//                             gives it its output ranks and the offset of the
//                             change before its first, tile after tile
//   delta_check / decode / apply / restore
//                             the reverse walk: a block scan of gap + 1 gives
//                             each change its offset; every offset is checked
//                             against its chunk and errors are recorded, never
//                             written through
//   fused_count_bf16 / fused_fill_bf16
//                             count/fill reading fp32 master weights and
//                             rounding them to bf16 on the fly
//   xxh3_blocks               xxh3-64 of every 1 MiB block of many buffers,
//                             one warp per block
//   lora_range_bf16           Y = (W_new - W_old) @ Omega from two bf16
//                             matrices, one block per row (ws_lora.cuh)
//   quant_int4_group_<dt>     wsync.quant's quantizers of bf16 / f16 / f32
//   quant_int8_channel_<dt>   weights (ws_quant.cuh): a thread per INT4 group,
//   quant_fp8_block_<dt>      a block per INT8 row or per FP8 block; each
//                             records the first non-finite element's flat
//                             index (atomicMin) instead of quantizing it
//
// Entry points are extern "C" so cupy's RawModule can look them up by name
// after NVRTC compiles this file (wsync.backends.cuda.kernel_source inlines
// the two headers first, so cupy's source-keyed cache sees every edit). Every
// kernel runs NT = 256 threads per block; the grid is one block per chunk,
// except xxh3_blocks (one warp per 1 MiB block). On a machine without a GPU
// the same text runs on CPU fibers (tests/cudasim: g++ with a shim for the
// CUDA built-ins), unchanged, under several thread schedules.
#include "ws_common.cuh"
#include "ws_lora.cuh"
#include "ws_quant.cuh"
#include "ws_xxh3.cuh"

namespace ws {

constexpr int NT = 256;        // threads per block, every kernel
constexpr int NW = NT / 32;    // warps per block
constexpr u64 MIB = 1ull << 20;  // wsync.checksum.BLOCK
enum { ERR_ESCAPES = 1, ERR_TABLE = 2 };  // bits of err[1]; err[0] is the first change out of its chunk

#if defined(__CUDACC__)
constexpr unsigned FULL = 0xffffffffu;

struct ScanOut {
    u64 excl;       // sum over the threads before this one
    u64 total;      // sum over the block
    i32 excl_max;   // max over the threads before this one (-1 if none)
    i32 total_max;  // max over the block
};

// Exclusive sum of v and exclusive max of m across the block, in thread
// order. Sums are u64 so two u32 counters can ride in one (low, high) pair;
// every caller keeps each half below 2^32 per tile.
__device__ __forceinline__ ScanOut block_scan(u64 v, i32 m) {
    __shared__ u64 s_sum[NW];
    __shared__ i32 s_max[NW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inc = v;
    i32 mx = m;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(FULL, inc, o);
        const i32 tm = __shfl_up_sync(FULL, mx, o);
        if (lane >= o) {
            inc += t;
            mx = ws_max(mx, tm);
        }
    }
    i32 lane_excl_max = __shfl_up_sync(FULL, mx, 1);
    if (lane == 0) lane_excl_max = -1;
    if (lane == 31) {
        s_sum[warp] = inc;
        s_max[warp] = mx;
    }
    __syncthreads();
    if (warp == 0) {
        u64 x = lane < NW ? s_sum[lane] : 0;
        i32 y = lane < NW ? s_max[lane] : -1;
#pragma unroll
        for (int o = 1; o < NW; o <<= 1) {
            const u64 t = __shfl_up_sync(FULL, x, o);
            const i32 tm = __shfl_up_sync(FULL, y, o);
            if (lane >= o) {
                x += t;
                y = ws_max(y, tm);
            }
        }
        if (lane < NW) {
            s_sum[lane] = x;
            s_max[lane] = y;
        }
    }
    __syncthreads();
    ScanOut r;
    r.excl = (warp ? s_sum[warp - 1] : 0) + inc - v;
    r.excl_max = ws_max(warp ? s_max[warp - 1] : -1, lane_excl_max);
    r.total = s_sum[NW - 1];
    r.total_max = s_max[NW - 1];
    __syncthreads();  // the next call overwrites s_sum / s_max
    return r;
}

template <int ORD, class Src>
__device__ __forceinline__ void count_chunk(const Src src, const typename Src::in_t* __restrict__ a,
                                            const typename Src::in_t* __restrict__ b, u64 n, u32 nchunks,
                                            u32* __restrict__ table, u32* __restrict__ mask) {
    typedef typename Src::in_t I;
    constexpr int VEC = 16 / int(sizeof(I));  // elements per 16-byte load
    constexpr int G = 32 / VEC;               // lanes whose bits make one mask word
    constexpr int U = 4;                      // vector pairs in flight per thread
    const u64 c = blockIdx.x;
    const u32 len = chunk_len(n, c);
    const u64 start = c * CHUNK;
    const u32 nvec = (len + VEC - 1) / VEC;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 changed = 0, escapes = 0;
    // The loop bound is block-uniform so every lane reaches the shuffles.
    for (u32 v0 = 0; v0 < nvec; v0 += NT * U) {
        Vec16 va[U], vb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {  // issue all loads before the first use
            const u32 v = v0 + u * NT + threadIdx.x;
            const int valid = v < nvec ? int(ws_min<u32>(VEC, len - v * VEC)) : 0;
            va[u] = load_vec<I, VEC>(a + start + u64(v) * VEC, valid);
            vb[u] = load_vec<I, VEC>(b + start + u64(v) * VEC, valid);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 v = v0 + u * NT + threadIdx.x;
            const int valid = v < nvec ? int(ws_min<u32>(VEC, len - v * VEC)) : 0;
            const u32 bits = count_vec<ORD, Src, VEC>(src, va[u], vb[u], valid, &escapes);
            changed += ws_popc(bits);
            // v and lane agree mod 32, so the G lanes of a word are adjacent and aligned.
            u32 word = bits << ((lane * VEC) & 31);
#pragma unroll
            for (int s = 1; s < G; s <<= 1) word |= __shfl_xor_sync(FULL, word, s);
            if (lane % G == 0 && v * VEC < len) mask[c * CHUNK_WORDS + v * VEC / 32] = word;
        }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        changed += __shfl_xor_sync(FULL, changed, o);
        escapes += __shfl_xor_sync(FULL, escapes, o);
    }
    __shared__ u32 s_changed[NW], s_escapes[NW];
    if (lane == 0) {
        s_changed[warp] = changed;
        s_escapes[warp] = escapes;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 tc = 0, te = 0;
        for (int w = 0; w < NW; ++w) {
            tc += s_changed[w];
            te += s_escapes[w];
        }
        table[c] = tc;
        table[nchunks + c] = te;
    }
}

template <int ORD, class Src>
__device__ __forceinline__ void fill_chunk(const Src src, const typename Src::in_t* __restrict__ a,
                                           const typename Src::in_t* __restrict__ b, u64 n,
                                           const u32* __restrict__ mask, const u64* __restrict__ chg_base,
                                           const u64* __restrict__ esc_base, u16* __restrict__ gaps,
                                           i8* __restrict__ steps, typename Src::bits_t* __restrict__ escapes) {
    typedef typename Src::in_t I;
    const u64 c = blockIdx.x;
    const u32 len = chunk_len(n, c);
    const u64 start = c * CHUNK;
    const u32 nwords = (len + 31) / 32;
    u64 rank = chg_base[c], esc_rank = esc_base[c];
    i32 prev = -1;  // offset of the last change of the tiles before (none yet)
    for (u32 w0 = 0; w0 < nwords; w0 += NT) {
        const u32 w = w0 + threadIdx.x;
        const u32 word = w < nwords ? mask[c * CHUNK_WORDS + w] : 0u;
        const I* pa = a + start + u64(w) * 32;
        const I* pb = b + start + u64(w) * 32;
        FillSummary s = {0, 0, -1};
        if (word) s = fill_summarize<ORD>(src, pa, pb, word, w);
        // Per tile: at most NT * 32 changes, so each half of the sum stays small.
        const ScanOut r = block_scan(u64(s.n_changed) | (u64(s.n_escapes) << 32), s.last_offset);
        if (word)
            fill_emit<ORD>(src, pa, pb, word, w, rank + u32(r.excl), esc_rank + (r.excl >> 32),
                           ws_max(prev, r.excl_max), gaps, steps, escapes);
        rank += u32(r.total);
        esc_rank += r.total >> 32;
        prev = ws_max(prev, r.total_max);
    }
}

template <class T, int ORD, int MODE>
__device__ __forceinline__ void walk_chunk(T* weights, u64 n, u32 nchunks, const u32* __restrict__ table,
                                           const u64* __restrict__ chg_base, const u64* __restrict__ esc_base,
                                           const u16* __restrict__ gaps, const i8* __restrict__ steps,
                                           const T* __restrict__ escapes, T* vals, i64* pos, u64* err) {
    const u64 c = blockIdx.x;
    const u32 len = chunk_len(n, c);
    const u64 start = c * CHUNK;
    const u32 count = table[c], esc_count = table[nchunks + c];
    const u64 base = chg_base[c], ebase = esc_base[c];
    // The host validated the table; a table that still lies stops here, whole block at once.
    if (count > len || esc_count > count) {
        if (threadIdx.x == 0) atomicOr(&err[1], u64(ERR_TABLE));
        return;
    }
    u32 carry_off = 0, carry_esc = 0;  // sum of (gap + 1) and escapes over the tiles before
    for (u32 i0 = 0; i0 < count; i0 += NT) {
        const u32 i = i0 + threadIdx.x;
        const bool valid = i < count;
        const u32 g1 = valid ? u32(gaps[base + i]) + 1 : 0;
        const int st = valid ? int(steps[base + i]) : 0;
        const u32 is_esc = valid && st == ESCAPE;
        // Per tile the offset half sums to at most NT * 65536 < 2^32.
        const ScanOut r = block_scan(u64(g1) | (u64(is_esc) << 32), -1);
        if (valid) {
            const u32 offset = carry_off + u32(r.excl) + g1 - 1;
            const u32 er = carry_esc + u32(r.excl >> 32);
            const int e = walk_one<T, ORD, MODE>(weights, start, len, offset, st, base + i, er, esc_count, ebase,
                                                 escapes, vals, pos);
            if (e == WALK_ERR_OFFSET) atomicMin(&err[0], base + i);
            if (e == WALK_ERR_ESCAPE) atomicOr(&err[1], u64(ERR_ESCAPES));
        }
        carry_off = ws_min<u32>(carry_off + u32(r.total), OFF_SAT);
        carry_esc += u32(r.total >> 32);
    }
    if (threadIdx.x == 0 && carry_esc != esc_count) atomicOr(&err[1], u64(ERR_ESCAPES));
}

// One warp per 1 MiB block; buffer k owns blocks first_block[k] .. first_block[k+1]-1.
// Each buffer must start 8-byte aligned (the host copies one that does not).
__device__ __forceinline__ void xxh3_warp(const u64* __restrict__ ptrs, const u64* __restrict__ sizes,
                                          const u64* __restrict__ first_block, u32 nbuf, u64 total_blocks,
                                          u64* __restrict__ out) {
    const u64 wid = (u64(blockIdx.x) * NT + threadIdx.x) / 32;
    if (wid >= total_blocks) return;  // whole warps leave together
    u32 lo = 0, hi = nbuf;            // last k with first_block[k] <= wid
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (first_block[mid] <= wid) lo = mid; else hi = mid;
    }
    const u64 blk = wid - first_block[lo];
    const u8* p = reinterpret_cast<const u8*>(ptrs[lo]) + blk * MIB;
    const u64 len = ws_min<u64>(MIB, sizes[lo] - blk * MIB);
    const int lane = threadIdx.x & 31, i = lane & 7, g = lane >> 3;
    u64 h;
    if (len <= 240) {
        h = xxh3_short(p, len);
    } else {
        const Xxh3LaneKeys keys = xxh3_lane_keys(i, g);
        u64 acc = xxh3_acc_init(i);
        const u64 nb = xxh3_full_blocks(len);
        Xxh3LaneData cur = xxh3_lane_load(p, i, g, nb ? XXH3_STRIPES : 0);
        for (u64 b = 0; b < nb; ++b) {
            // Fetch block b+1 while block b is mixed: the scramble chain is serial, the loads need not be.
            const Xxh3LaneData nxt = xxh3_lane_load(p + (b + 1) * XXH3_BLOCK, i, g, b + 1 < nb ? XXH3_STRIPES : 0);
            u64 part = xxh3_lane_mix(cur, keys, g, XXH3_STRIPES);
            part += __shfl_xor_sync(FULL, part, 8);
            part += __shfl_xor_sync(FULL, part, 16);
            acc = xxh3_scramble(acc + part, keys.scramble);
            cur = nxt;
        }
        const int ts = xxh3_tail_stripes(len);
        u64 part = xxh3_lane_mix(xxh3_lane_load(p + nb * XXH3_BLOCK, i, g, ts), keys, g, ts);
        part += __shfl_xor_sync(FULL, part, 8);
        part += __shfl_xor_sync(FULL, part, 16);
        acc += part + xxh3_last_stripe(p, len, i);
        u64 all[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) all[k] = __shfl_sync(FULL, acc, k);  // lanes 0..7 hold accumulators 0..7
        h = xxh3_merge(all, len);
    }
    if (lane == 0) out[wid] = h;
}
#endif  // __CUDACC__

}  // namespace ws

// ---- entry points -----------------------------------------------------------------
// extern "C" __global__ NAME(params); parameter lists are written once, in these macros.

#define WS_COUNT_PARAMS(I)                                                                                  \
    const I *a, const I *b, ws::u64 n, ws::u32 nchunks, ws::u32 nan_pos, ws::u32 nan_neg, ws::u32 *table, \
        ws::u32 *mask
#define WS_FILL_PARAMS(I, T)                                                                               \
    const I *a, const I *b, ws::u64 n, ws::u32 nchunks, ws::u32 nan_pos, ws::u32 nan_neg,                 \
        const ws::u32 *mask, const ws::u64 *chg_base, const ws::u64 *esc_base, ws::u16 *gaps, ws::i8 *steps, \
        T *escapes
#define WS_WALK_PARAMS(T)                                                                                       \
    T *weights, ws::u64 n, ws::u32 nchunks, const ws::u32 *table, const ws::u64 *chg_base, const ws::u64 *esc_base, \
        const ws::u16 *gaps, const ws::i8 *steps, const T *escapes, T *vals, ws::i64 *pos, ws::u64 *err
#define WS_WALK_ARGS weights, n, nchunks, table, chg_base, esc_base, gaps, steps, escapes, vals, pos, err
#define WS_XXH3_PARAMS                                                                                        \
    const ws::u64 *ptrs, const ws::u64 *sizes, const ws::u64 *first_block, ws::u32 nbuf, ws::u64 total_blocks, \
        ws::u64 *out

#define WS_BF16_SRC (ws::F32ToBf16{ws::u16(nan_pos), ws::u16(nan_neg)})

#if defined(__CUDACC__)
#define WS_ENTRY(NAME, PARAMS) extern "C" __global__ void __launch_bounds__(ws::NT) NAME(PARAMS)

#define WS_DIRECT_KERNELS(TN, T, ON, ORD)                                                                     \
    WS_ENTRY(delta_count_##TN##_##ON, WS_COUNT_PARAMS(T)) {                                                   \
        (void)nan_pos;                                                                                        \
        (void)nan_neg;                                                                                        \
        ws::count_chunk<ws::ORD>(ws::Direct<T>(), a, b, n, nchunks, table, mask);                             \
    }                                                                                                         \
    WS_ENTRY(delta_fill_##TN##_##ON, WS_FILL_PARAMS(T, T)) {                                                  \
        (void)nchunks;                                                                                        \
        (void)nan_pos;                                                                                        \
        (void)nan_neg;                                                                                        \
        ws::fill_chunk<ws::ORD>(ws::Direct<T>(), a, b, n, mask, chg_base, esc_base, gaps, steps, escapes);    \
    }                                                                                                         \
    WS_ENTRY(delta_decode_##TN##_##ON, WS_WALK_PARAMS(T)) {                                                   \
        ws::walk_chunk<T, ws::ORD, ws::WALK_DECODE>(WS_WALK_ARGS);                                            \
    }                                                                                                         \
    WS_ENTRY(delta_apply_##TN##_##ON, WS_WALK_PARAMS(T)) { ws::walk_chunk<T, ws::ORD, ws::WALK_APPLY>(WS_WALK_ARGS); }

#define WS_WIDTH_KERNELS(TN, T)                                                                               \
    WS_DIRECT_KERNELS(TN, T, float, ORD_FLOAT)                                                                \
    WS_DIRECT_KERNELS(TN, T, int, ORD_INT)                                                                    \
    WS_DIRECT_KERNELS(TN, T, uint, ORD_UINT)                                                                  \
    WS_ENTRY(delta_restore_##TN, WS_WALK_PARAMS(T)) {                                                         \
        ws::walk_chunk<T, ws::ORD_UINT, ws::WALK_RESTORE>(WS_WALK_ARGS);                                      \
    }

WS_WIDTH_KERNELS(u8, ws::u8)
WS_WIDTH_KERNELS(u16, ws::u16)
WS_WIDTH_KERNELS(u32, ws::u32)
WS_WIDTH_KERNELS(u64, ws::u64)

// Bounds and escape-count check of untrusted sections, before anything is written.
// It reads no tensor, so one width serves all.
WS_ENTRY(delta_check, WS_WALK_PARAMS(ws::u8)) { ws::walk_chunk<ws::u8, ws::ORD_UINT, ws::WALK_CHECK>(WS_WALK_ARGS); }

// Change detection straight from fp32 master weights: the bf16 patterns an
// engine would receive are rounded in registers, never stored.
WS_ENTRY(fused_count_bf16, WS_COUNT_PARAMS(ws::u32)) {
    ws::count_chunk<ws::ORD_FLOAT>(WS_BF16_SRC, a, b, n, nchunks, table, mask);
}
WS_ENTRY(fused_fill_bf16, WS_FILL_PARAMS(ws::u32, ws::u16)) {
    (void)nchunks;
    ws::fill_chunk<ws::ORD_FLOAT>(WS_BF16_SRC, a, b, n, mask, chg_base, esc_base, gaps, steps, escapes);
}

WS_ENTRY(xxh3_blocks, WS_XXH3_PARAMS) { ws::xxh3_warp(ptrs, sizes, first_block, nbuf, total_blocks, out); }

// The range finder of wsync.lowrank: columns c0 .. c0 + kc of Y = (w_new - w_old) @ omega, one block per row.
#define WS_LORA_PARAMS \
    const ws::u16 *w_new, const ws::u16 *w_old, const float *omega, ws::u64 n, ws::u32 ld, ws::u32 c0, ws::u32 kc, float *y
WS_ENTRY(lora_range_bf16, WS_LORA_PARAMS) {
    ws::lora_range_row(w_new, w_old, omega, n, ld, c0, kc, y);
}

// The quantizers of wsync.quant, per weight dtype (T: its bit patterns). bad: the least flat index of a
// non-finite element, left at ~0 while there is none.
#define WS_QI4_PARAMS(T) const T *x, ws::u64 ngroups, ws::u32 group, ws::u32 *packed, T *scale, ws::u64 *bad
#define WS_QI8_PARAMS(T) const T *x, ws::u64 k, ws::i8 *codes, T *scale, ws::u64 *bad
#define WS_QF8_PARAMS(T) \
    const T *x, ws::u64 m, ws::u64 n, ws::u32 bm, ws::u32 bn, ws::u8 *codes, float *sf, ws::u64 *bad
#define WS_QUANT_KERNELS(DN, D, T)                                                                            \
    WS_ENTRY(quant_int4_group_##DN, WS_QI4_PARAMS(T)) {                                                       \
        ws::q_int4_group<D>(x, ngroups, group, packed, scale, bad);                                           \
    }                                                                                                         \
    WS_ENTRY(quant_int8_channel_##DN, WS_QI8_PARAMS(T)) { ws::q_int8_channel<D>(x, k, codes, scale, bad); }   \
    WS_ENTRY(quant_fp8_block_##DN, WS_QF8_PARAMS(T)) { ws::q_fp8_block<D>(x, m, n, bm, bn, codes, sf, bad); }

WS_QUANT_KERNELS(bf16, ws::QD_BF16, ws::u16)
WS_QUANT_KERNELS(f16, ws::QD_F16, ws::u16)
WS_QUANT_KERNELS(f32, ws::QD_F32, ws::u32)
#endif  // __CUDACC__
