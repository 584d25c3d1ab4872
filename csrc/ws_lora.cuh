// The range finder of a randomized SVD of a weight update, straight from two bf16 matrices.
//
// wsync.lowrank (LOSSY, opt-in) factors a full-weight update D = W_new - W_old
// with a randomized SVD; its first pass is Y = D @ Omega for a random Omega of
// a few dozen columns. Materializing D costs a write and a read of a matrix
// as large as the weight, in fp32; here each block takes one row of both bf16
// matrices, forms every element of D in a register once, and adds it times
// the matching row of Omega into up to LORA_KMAX column sums per thread, which
// a fixed reduction tree (warp shuffles, then one slot per warp in shared
// memory) combines, so Y is the same bits on every run. Wider Omegas are done
// in passes of LORA_KMAX columns (the host's loop; each pass reads W again).
#pragma once

#include "ws_common.cuh"

namespace ws {

constexpr int LORA_KMAX = 32;  // Omega columns per pass (a thread's column sums live in registers)

WS_HD float bf16_to_f32(u16 h) {
    union {
        u32 u;
        float f;
    } v;
    v.u = u32(h) << 16;
    return v.f;
}

#if defined(__CUDACC__)
// Row blockIdx.x of Y[:, c0 : c0 + kc] = (w_new - w_old)[row, :] @ omega[:, c0 : c0 + kc].
// w_*: [m, n] bf16 patterns, row-major; omega: [n, ld] fp32; y: [m, ld] fp32.
__device__ __forceinline__ void lora_range_row(const u16* __restrict__ w_new, const u16* __restrict__ w_old,
                                               const float* __restrict__ omega, u64 n, u32 ld, u32 c0, u32 kc,
                                               float* __restrict__ y) {
    constexpr int NTL = 256, NWL = NTL / 32;  // ws::NT of delta_cuda.cu; every kernel runs 256 threads
    const u64 row = blockIdx.x;
    const u16* a = w_new + row * n;
    const u16* b = w_old + row * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float acc[LORA_KMAX];
    WS_UNROLL
    for (int c = 0; c < LORA_KMAX; ++c) acc[c] = 0.0f;
    for (u64 j = threadIdx.x; j < n; j += NTL) {
        const float d = bf16_to_f32(a[j]) - bf16_to_f32(b[j]);
        if (d != 0.0f) {  // most of an RL step leaves an element alone: skip its Omega row
            const float* om = omega + j * ld + c0;
            WS_UNROLL
            for (int c = 0; c < LORA_KMAX; ++c)
                if (c < int(kc)) acc[c] = fmaf(d, om[c], acc[c]);
        }
    }
    __shared__ float part[NWL][LORA_KMAX];
    WS_UNROLL
    for (int c = 0; c < LORA_KMAX; ++c) {
        if (c < int(kc)) {  // kc is the same in every thread: the shuffles stay convergent
            float v = acc[c];
            for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) part[warp][c] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < kc) {
        float s = 0.0f;
        for (int w = 0; w < NWL; ++w) s += part[w][threadIdx.x];
        y[row * ld + c0 + threadIdx.x] = s;
    }
}
#else
// The C++ twin (wsync._cpu.lora_range): row y_row [ld] = (a - b) @ omega for one row a, b [n]. The same
// per-element arithmetic, summed left to right per column instead of in the GPU's tree; the loop over columns
// is what the compiler vectorizes.
static inline void lora_range_row_host(const u16* a, const u16* b, const float* omega, u64 n, u32 ld, float* y_row) {
    for (u32 c = 0; c < ld; ++c) y_row[c] = 0.0f;
    for (u64 j = 0; j < n; ++j) {
        const float d = bf16_to_f32(a[j]) - bf16_to_f32(b[j]);
        if (d == 0.0f) continue;
        const float* om = omega + j * ld;
        for (u32 c = 0; c < ld; ++c) y_row[c] += d * om[c];
    }
}
#endif

}  // namespace ws
