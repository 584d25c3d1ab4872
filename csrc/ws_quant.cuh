// The quantizers of wsync.quant (ref.py is the spec), written once for the C++ CPU kernels and the CUDA ones.
//
// Three formats, over BF16 / F16 / F32 weight bit patterns:
//   int4_group    compressed-tensors' symmetric INT4, a scale per `group` elements of a row, packed 8 codes
//                 (code + 8, low nibble first) to an int32
//   int8_channel  compressed-tensors' symmetric INT8, a scale per row
//   fp8_block     vLLM's per_block_cast_to_fp8: e4m3 codes, a float32 scale per bm x bn block of each matrix
// Every result must be the reference's bytes, so the arithmetic is its arithmetic, rounding for rounding:
// compressed-tensors divides in float32 and rounds the quotient to the weight's dtype before rounding it to an
// integer (ties to even both times); vLLM multiplies by the float32 reciprocal of the scale and casts with
// torch's saturating float32 -> e4m3fn. The float operations go through q_div / q_mul / q_add so that nvcc and
// NVRTC, which contract a multiply and an add into an FMA by default, never fuse or approximate one: each is
// one IEEE float32 operation, rounded to nearest, as numpy's. Conversions between the dtypes are integer
// code, exact on every compiler.
//
// A non-finite weight is never quantized: the kernels report the smallest flat index of one (the host's
// wrapper then raises the reference's QuantizeError, which names it).
#pragma once

#include "ws_common.cuh"

// Inlined everywhere: a call left in a host loop over elements keeps the compiler from vectorizing it, and
// wsync._cpu compiles these loops a second time inside functions built for AVX2 (only what is inlined into
// them is).
#if defined(__CUDACC__) || !defined(__GNUC__)
#define WS_QHD WS_HD
#else
#define WS_QHD inline __attribute__((always_inline))
#endif

namespace ws {

enum { QD_BF16 = 0, QD_F16 = 1, QD_F32 = 2 };  // the weight dtypes, as the Python wrappers number them

#if defined(__CUDA_ARCH__) && !defined(WSIM_API)
// The GPU: the _rn intrinsics are never contracted or replaced by approximations.
__device__ __forceinline__ float q_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float q_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float q_add(float a, float b) { return __fadd_rn(a, b); }
#else
// g++ (the CPU kernels, and the CPU harness of the CUDA code): IEEE float32 as written, as long as the build
// never asks for fast-math (setup.py does not), and x86-64's SSE has no FMA to contract into by default.
WS_QHD float q_div(float a, float b) { return a / b; }
WS_QHD float q_mul(float a, float b) { return a * b; }
WS_QHD float q_add(float a, float b) { return a + b; }
#endif

WS_QHD float q_f32(u32 u) {
    union {
        u32 u;
        float f;
    } v;
    v.u = u;
    return v.f;
}

// cond ? a : b as bit arithmetic: both sides are always computed, so the compiler cannot sink a float operation
// into a branch (which, since float operations may trap, it then cannot turn back into a select).
WS_QHD u32 q_pick(bool cond, u32 a, u32 b) { return b ^ ((a ^ b) & (0u - u32(cond))); }

WS_QHD u32 q_bits(float f) {
    union {
        float f;
        u32 u;
    } v;
    v.f = f;
    return v.u;
}

// rint(q) for |q| < 2**22, ties to even: adding 1.5 * 2**23 leaves the rounded integer in the low mantissa bits.
WS_QHD i32 q_rint(float q) { return i32(q_bits(q_add(q, 12582912.0f)) & 0x7FFFFFu) - 0x400000; }

// Per weight dtype: its element type, exact conversion to float32, rounding from float32 (nearest, ties to
// even), the bits of |x| (which order as |x| does, for finite values), where the non-finite ones start, and
// torch.finfo(dtype).eps.
template <int D> struct QType;

template <> struct QType<QD_BF16> {
    typedef u16 T;
    static constexpr u32 INF = 0x7F80u;
    static constexpr u32 EPS = 0x3C00u;  // 2**-7
    WS_QHD static u32 abs_bits(T h) { return u32(h) & 0x7FFFu; }
    WS_QHD static float load(u32 h) { return q_f32(h << 16); }
    WS_QHD static T round(float f) {
        const u32 u = q_bits(f);
        return T((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
};

template <> struct QType<QD_F16> {
    typedef u16 T;
    static constexpr u32 INF = 0x7C00u;
    static constexpr u32 EPS = 0x1400u;  // 2**-10
    WS_QHD static u32 abs_bits(T h) { return u32(h) & 0x7FFFu; }
    // Both cases are computed and one is selected, so that the host's loops over elements stay branch-free
    // (which is what lets the compiler vectorize them).
    WS_QHD static float load(u32 h) {
        const u32 a = h & 0x7FFFu, sign = (h & 0x8000u) << 16;
        // a subnormal is its mantissa in units of 2**-24 (exact: both factors and the product are float32s)
        const u32 sub = q_bits(q_mul(float(a), 5.9604644775390625e-8f)), normal = (a << 13) + (112u << 23);
        return q_f32(q_pick(a < 0x400u, sub, normal) | sign);
    }
    WS_QHD static T round(float f) {
        const u32 u = q_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
        // below 2**-14: a subnormal (or zero), its value in units of 2**-24, rounded (the product is below 2**10
        // where it is used; elsewhere it is discarded)
        const u32 sub = u32(q_rint(q_mul(q_f32(q_pick(a < 0x38800000u, a, 0u)), 16777216.0f)));
        // else re-bias the exponent (127 -> 15), round the 13 dropped mantissa bits to even; past 65504: inf
        u32 normal = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
        normal = normal > 0x7C00u ? 0x7C00u : normal;
        return T(q_pick(a < 0x38800000u, sub, normal) | sign);
    }
};

template <> struct QType<QD_F32> {
    typedef u32 T;
    static constexpr u32 INF = 0x7F800000u;
    static constexpr u32 EPS = 0x34000000u;  // 2**-23
    WS_QHD static u32 abs_bits(T h) { return h & 0x7FFFFFFFu; }
    WS_QHD static float load(u32 h) { return q_f32(h); }
    WS_QHD static T round(float f) { return q_bits(f); }
};

// compressed-tensors' symmetric scale of a group (or row) whose largest |x| has bits `amax_bits`, as bits of
// the weight's dtype: absmax / ((q_max - q_min) / 2) in float32, rounded to the dtype; eps where that is zero
// (told apart by its bits, so that a host loop over groups stays free of float compares).
template <int D> WS_QHD typename QType<D>::T q_sym_scale(u32 amax_bits, float half_range) {
    typedef QType<D> Q;
    const typename Q::T s = Q::round(q_div(Q::load(amax_bits), half_range));
    return typename Q::T(q_pick(s == 0, Q::EPS, s));
}

// Its integer code of x: x / scale in float32, rounded to the weight's dtype, rounded to even, clipped. The
// reference clips before rounding; with integer bounds the two orders agree, and clipping the integer keeps
// the loop free of float compares. q_rint needs |q| < 2**22: |x| <= absmax, and the scale is absmax / half
// rounded to the dtype, at worst (in the dtype's subnormals) 2/3 of that, so |q| <= 1.5 * half.
template <int D> WS_QHD i32 q_sym_code(float x, float scale, i32 q_min, i32 q_max) {
    typedef QType<D> Q;
    const i32 c = q_rint(Q::load(Q::round(q_div(x, scale))));
    return c < q_min ? q_min : (c > q_max ? q_max : c);
}

constexpr float Q_INT4_HALF = 7.5f, Q_INT8_HALF = 127.5f;  // (q_max - q_min) / 2
constexpr i32 Q_INT4_MIN = -8, Q_INT4_MAX = 7, Q_INT8_MIN = -128, Q_INT8_MAX = 127;
constexpr float Q_FP8_MAX = 448.0f, Q_FP8_AMAX_FLOOR = 1e-4f;  // float8_e4m3fn's largest; vLLM's clamp of amax

// torch's float32 -> float8_e4m3fn of a finite v: nearest, ties to even; the format has no infinity, so 448
// and beyond saturate to 448 (0x7E). (A NaN, which torch keeps as 0x7F, never gets here: the kernels refuse
// non-finite weights, and the scale keeps |x * (1 / scale)| within 448 and a rounding.) Every case is computed
// and one selected, branch-free (see QType<QD_F16>).
WS_QHD u8 q_fp8_e4m3(float v) {
    const u32 u = q_bits(v), a = u & 0x7FFFFFFFu;
    // below 2**-6: the format's subnormals, k units of 2**-9 with k = rint(|v| * 512) <= 8 (8 units: 0x08), which
    // is the low byte of |v| * 512 + 1.5 * 2**23
    const u32 sub = q_bits(q_add(q_mul(q_f32(a), 512.0f), 12582912.0f)) & 0xFFu;
    // else re-bias the exponent (127 -> 7), round the 20 dropped mantissa bits to even, saturate
    u32 normal = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    normal = normal < 0x7Eu ? normal : 0x7Eu;
    return u8(q_pick(a < (121u << 23), sub, normal) | ((u >> 24) & 0x80u));
}

// vLLM's block scale from the block's largest |x| (bits in the weight's dtype): sf = max(amax, 1e-4) / 448.
template <int D> WS_QHD float q_fp8_scale(u32 amax_bits) {
    float amax = QType<D>::load(amax_bits);
    if (amax < Q_FP8_AMAX_FLOOR) amax = Q_FP8_AMAX_FLOOR;
    return q_div(amax, Q_FP8_MAX);
}

#if defined(__CUDACC__)
// ---- CUDA: every kernel runs QNT threads per block (ws::NT of delta_cuda.cu) -------------------------------
constexpr int QNT = 256, QNW = QNT / 32;

// The largest of every thread's v, in every thread (a barrier inside: all threads of the block must call).
__device__ __forceinline__ u32 q_block_max(u32 v) {
    __shared__ u32 part[QNW];
    for (int o = 16; o; o >>= 1) v = ws_max<u32>(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 m = part[0];
    WS_UNROLL
    for (int w = 1; w < QNW; ++w) m = ws_max<u32>(m, part[w]);
    return m;
}

// INT4: one thread per group (groups are contiguous runs of `group` elements, a row's after the one before, so
// group g covers flat elements g * group ..). packed: group / 8 words per group; scale: one per group.
template <int D>
__device__ __forceinline__ void q_int4_group(const typename QType<D>::T* __restrict__ x, u64 ngroups, u32 group,
                                             u32* __restrict__ packed, typename QType<D>::T* __restrict__ scale,
                                             u64* bad) {
    typedef QType<D> Q;
    const u64 g = u64(blockIdx.x) * QNT + threadIdx.x;
    if (g >= ngroups) return;  // no barrier below
    const typename Q::T* p = x + g * group;
    u32 m = 0;
    for (u32 j = 0; j < group; ++j) m = ws_max<u32>(m, Q::abs_bits(p[j]));
    if (m >= Q::INF) {
        for (u32 j = 0; j < group; ++j)
            if (Q::abs_bits(p[j]) >= Q::INF) {
                atomicMin(bad, g * group + j);
                break;
            }
        return;
    }
    const typename Q::T sb = q_sym_scale<D>(m, Q_INT4_HALF);
    scale[g] = sb;
    const float s = Q::load(sb);
    u32* out = packed + g * (group / 8);
    for (u32 w = 0; w < group / 8; ++w) {
        u32 word = 0;
        WS_UNROLL
        for (int i = 0; i < 8; ++i)
            word |= u32(q_sym_code<D>(Q::load(p[8 * w + i]), s, Q_INT4_MIN, Q_INT4_MAX) + 8) << (4 * i);
        out[w] = word;
    }
}

// INT8: one block per row of k elements; scale: one per row.
template <int D>
__device__ __forceinline__ void q_int8_channel(const typename QType<D>::T* __restrict__ x, u64 k,
                                               i8* __restrict__ codes, typename QType<D>::T* __restrict__ scale,
                                               u64* bad) {
    typedef QType<D> Q;
    const u64 row = blockIdx.x;
    const typename Q::T* p = x + row * k;
    u32 m = 0;
    for (u64 j = threadIdx.x; j < k; j += QNT) m = ws_max<u32>(m, Q::abs_bits(p[j]));
    m = q_block_max(m);
    if (m >= Q::INF) {
        for (u64 j = threadIdx.x; j < k; j += QNT)
            if (Q::abs_bits(p[j]) >= Q::INF) {
                atomicMin(bad, row * k + j);
                break;
            }
        return;
    }
    const typename Q::T sb = q_sym_scale<D>(m, Q_INT8_HALF);
    if (threadIdx.x == 0) scale[row] = sb;
    const float s = Q::load(sb);
    i8* out = codes + row * k;
    for (u64 j = threadIdx.x; j < k; j += QNT) out[j] = i8(q_sym_code<D>(Q::load(p[j]), s, Q_INT8_MIN, Q_INT8_MAX));
}

// FP8: one block per bm x bn block of one of the matrices [m, n] (block index: matrix, then block row, then
// block column); an edge block is the part of the matrix it covers. sf: [matrices, rb, cb] float32.
template <int D>
__device__ __forceinline__ void q_fp8_block(const typename QType<D>::T* __restrict__ x, u64 m, u64 n, u32 bm, u32 bn,
                                            u8* __restrict__ codes, float* __restrict__ sf, u64* bad) {
    typedef QType<D> Q;
    const u64 rb = (m + bm - 1) / bm, cb = (n + bn - 1) / bn;
    const u64 b = blockIdx.x, mat = b / (rb * cb), bi = (b / cb) % rb, bj = b % cb;
    const u64 r0 = bi * bm, c0 = bj * bn;
    const u32 h = u32(ws_min<u64>(bm, m - r0)), w = u32(ws_min<u64>(bn, n - c0));
    const u64 base = mat * m * n + r0 * n + c0;
    const typename Q::T* p = x + base;
    u32 amax = 0;
    for (u32 e = threadIdx.x; e < h * w; e += QNT) amax = ws_max<u32>(amax, Q::abs_bits(p[u64(e / w) * n + e % w]));
    amax = q_block_max(amax);
    if (amax >= Q::INF) {
        for (u32 e = threadIdx.x; e < h * w; e += QNT) {
            const u64 at = u64(e / w) * n + e % w;
            if (Q::abs_bits(p[at]) >= Q::INF) {  // this thread's elements come in flat order: its first is its least
                atomicMin(bad, base + at);
                break;
            }
        }
        return;
    }
    const float s = q_fp8_scale<D>(amax);
    const float inv = q_div(1.0f, s);
    if (threadIdx.x == 0) sf[b] = s;
    for (u32 e = threadIdx.x; e < h * w; e += QNT) {
        const u64 at = u64(e / w) * n + e % w;
        codes[base + at] = q_fp8_e4m3(q_mul(Q::load(p[at]), inv));
    }
}
#else
// ---- the C++ CPU kernels (wsync._cpu.quantize_*): a row, or a block, at a time -----------------------------
// Each returns the flat offset (from its first element) of its first non-finite element, or -1 and its outputs.

// |x| bits of the largest element of n, or of the first non-finite one (>= Q::INF) if any.
template <int D> WS_QHD u32 q_amax_bits(const typename QType<D>::T* p, u64 n) {
    u32 m = 0;
    for (u64 j = 0; j < n; ++j) {
        const u32 a = QType<D>::abs_bits(p[j]);
        m = a > m ? a : m;
    }
    return m;
}

template <int D> static inline i64 q_first_bad(const typename QType<D>::T* p, u64 n) {
    for (u64 j = 0; j < n; ++j)
        if (QType<D>::abs_bits(p[j]) >= QType<D>::INF) return i64(j);
    return -1;
}

// One row of k elements in groups of `group` (a multiple of 8): packed [k / 8], scale [k / group]. tmp: k codes
// and k / group amaxes. Every group's amax first, then every scale, then the codes: no group's arithmetic waits
// on the one before it. G: the group size when known at compile time (0: `group`), so that the common one's
// loops are unrolled whole.
template <int D, u32 G>
WS_QHD i64 q_int4_row_host(const typename QType<D>::T* __restrict__ x, u64 k, u32 group, u32* __restrict__ packed,
                           typename QType<D>::T* __restrict__ scale, i8* __restrict__ tmp, u32* __restrict__ amax) {
    typedef QType<D> Q;
    const u32 gs = G ? G : group;
    const u64 ng = k / gs;
    u32 worst = 0;
    for (u64 g = 0; g < ng; ++g) {
        amax[g] = q_amax_bits<D>(x + g * gs, gs);
        worst = ws_max<u32>(worst, amax[g]);
    }
    if (worst >= Q::INF) return q_first_bad<D>(x, k);
    for (u64 g = 0; g < ng; ++g) scale[g] = q_sym_scale<D>(amax[g], Q_INT4_HALF);
    for (u64 g = 0; g < ng; ++g) {
        const typename Q::T* p = x + g * gs;
        const float s = Q::load(scale[g]);
        i8* c = tmp + g * gs;
        for (u32 j = 0; j < gs; ++j) c[j] = i8(q_sym_code<D>(Q::load(p[j]), s, Q_INT4_MIN, Q_INT4_MAX) + 8);
    }
    for (u64 w = 0; w < k / 8; ++w) {
        u32 word = 0;
        for (int i = 0; i < 8; ++i) word |= u32(u8(tmp[8 * w + i])) << (4 * i);
        packed[w] = word;
    }
    return -1;
}

// One row of k elements: codes [k], one scale.
template <int D>
WS_QHD i64 q_int8_row_host(const typename QType<D>::T* __restrict__ x, u64 k, i8* __restrict__ codes,
                           typename QType<D>::T* __restrict__ scale) {
    typedef QType<D> Q;
    const u32 m = q_amax_bits<D>(x, k);
    if (m >= Q::INF) return q_first_bad<D>(x, k);
    *scale = q_sym_scale<D>(m, Q_INT8_HALF);
    const float s = Q::load(*scale);
    for (u64 j = 0; j < k; ++j) codes[j] = i8(q_sym_code<D>(Q::load(x[j]), s, Q_INT8_MIN, Q_INT8_MAX));
    return -1;
}

// One block of h x w elements at x, rows n apart: codes (rows n apart as well) and its scale.
template <int D>
WS_QHD i64 q_fp8_block_host(const typename QType<D>::T* __restrict__ x, u64 n, u64 h, u64 w, u8* __restrict__ codes,
                            float* __restrict__ sf) {
    typedef QType<D> Q;
    u32 m = 0;
    for (u64 r = 0; r < h; ++r) {
        const u32 mr = q_amax_bits<D>(x + r * n, w);
        m = mr > m ? mr : m;
    }
    if (m >= Q::INF) {
        for (u64 r = 0; r < h; ++r) {
            const i64 j = q_first_bad<D>(x + r * n, w);
            if (j >= 0) return i64(r * n) + j;
        }
    }
    const float s = q_fp8_scale<D>(m);
    const float inv = q_div(1.0f, s);
    *sf = s;
    for (u64 r = 0; r < h; ++r) {
        const typename Q::T* p = x + r * n;
        u8* c = codes + r * n;
        for (u64 j = 0; j < w; ++j) c[j] = q_fp8_e4m3(q_mul(Q::load(p[j]), inv));
    }
    return -1;
}
#endif

}  // namespace ws
