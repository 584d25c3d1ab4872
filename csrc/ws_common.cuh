// Shared scalar building blocks of the delta kernels, written once for three compilers.
//
// The same text is compiled by nvcc (tests, ahead-of-time cubins), by NVRTC
// (cupy RawModule, at run time) and by g++ after tests/cudasim/wsim.h (the
// CPU harness that runs the kernels on fibers; it defines __CUDA_ARCH__, so
// it takes the device branches below). NVRTC has no system headers, hence the
// home-made fixed-width types and no #include of <cstdint>.
#pragma once

#if defined(__CUDACC__)
#define WS_HD __host__ __device__ __forceinline__
#else
#define WS_HD inline
#endif

#if defined(__CUDA_ARCH__)
#define WS_DEVICE_PASS 1
#define WS_UNROLL _Pragma("unroll")
#else
#define WS_DEVICE_PASS 0
#define WS_UNROLL  // g++ would warn about an unknown pragma
#endif

namespace ws {

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

// Elements per independent delta chunk (manifest.CHUNK_ELEMS); offsets fit in u16.
constexpr u32 CHUNK = 1u << 16;
// Mask words (32 elements each) per chunk: the count pass leaves one bit per element.
constexpr u32 CHUNK_WORDS = CHUNK / 32;
constexpr int ESCAPE = -128;

// Orders of delta_ref.monotone_key.
enum { ORD_FLOAT = 0, ORD_INT = 1, ORD_UINT = 2 };

template <int W> struct Bits;
template <> struct Bits<1> { typedef u8 U; typedef i8 S; };
template <> struct Bits<2> { typedef u16 U; typedef i16 S; };
template <> struct Bits<4> { typedef u32 U; typedef i32 S; };
template <> struct Bits<8> { typedef u64 U; typedef i64 S; };

template <class T> WS_HD T sign_bit() { return T(T(1) << (8 * sizeof(T) - 1)); }

// delta_ref.monotone_key. Casts back to T because ~ and | promote u8/u16 to int.
template <class T, int ORD> WS_HD T mkey(T x) {
    if (ORD == ORD_FLOAT) return (x & sign_bit<T>()) ? T(~x) : T(x | sign_bit<T>());
    if (ORD == ORD_INT) return T(x ^ sign_bit<T>());
    return x;
}

// delta_ref.unkey.
template <class T, int ORD> WS_HD T unkey(T k) {
    if (ORD == ORD_FLOAT) return (k & sign_bit<T>()) ? T(k ^ sign_bit<T>()) : T(~k);
    if (ORD == ORD_INT) return T(k ^ sign_bit<T>());
    return k;
}

// The i8 the steps section holds for old -> new (old != new): the key step
// modulo 2^(8W) read as signed, or ESCAPE when it falls outside [-127, 127].
template <class T, int ORD> WS_HD int step_of(T old_bits, T new_bits) {
    typedef typename Bits<sizeof(T)>::S S;
    const S d = S(T(mkey<T, ORD>(new_bits) - mkey<T, ORD>(old_bits)));
    return (d < -127 || d > 127) ? ESCAPE : int(d);
}

// The new bit pattern an element gets back from its step (or its escape value).
// The i8 sign-extends to W bytes and the add wraps, as in delta_ref.decode.
template <class T, int ORD> WS_HD T value_of(T old_bits, int step, T escape_value) {
    typedef typename Bits<sizeof(T)>::S S;
    if (step == ESCAPE) return escape_value;
    return unkey<T, ORD>(T(mkey<T, ORD>(old_bits) + T(S(step))));
}

// fp32 bits -> bf16 bits, round to nearest even, as torch's .to(torch.bfloat16).
// Finite values, infinities and subnormals follow the one RNE formula (no
// flush to zero), as torch's integer paths and cvt.rn.bf16.f32 do. NaN is
// where torch disagrees with itself: its vectorised CPU cast gives 0xFFFF and
// its scalar CPU cast 0x7FC0 for every NaN, and its CUDA cast (cvt.rn on
// sm_80+) a canonical NaN. So the caller passes the pattern the torch it must
// match produces, per sign; wsync.backends.cuda probes torch for them.
WS_HD u16 bf16_rne(u32 f, u16 nan_pos, u16 nan_neg) {
    if ((f & 0x7FFFFFFFu) > 0x7F800000u) return (f >> 31) ? nan_neg : nan_pos;
    return u16((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

// Where the bit patterns come from: the tensors themselves, or (fused change
// detection) fp32 master weights cast to bf16 on the fly.
template <class T> struct Direct {
    typedef T in_t;   // what is read from memory
    typedef T bits_t; // what is compared and stored
    WS_HD T conv(T x) const { return x; }
};

struct F32ToBf16 {
    typedef u32 in_t;
    typedef u16 bits_t;
    u16 nan_pos, nan_neg;
    WS_HD u16 conv(u32 x) const { return bf16_rne(x, nan_pos, nan_neg); }
};

// 16 bytes as four little-endian words: what one vector load brings in.
struct alignas(16) Vec16 {
    u32 w[4];
};

// Element k of a Vec16 holding 16/sizeof(T) elements (k a compile-time
// constant after unrolling, so this is register shuffling, not memory).
template <class T> WS_HD T vec_elem(const Vec16& v, int k) {
    if (sizeof(T) == 8) return T(u64(v.w[2 * k]) | (u64(v.w[2 * k + 1]) << 32));
    const int per = 4 / int(sizeof(T) < 4 ? sizeof(T) : 4);  // (never 0: the u64 case returned above)
    const u32 word = v.w[k / per];
    const int shift = (k % per) * 8 * int(sizeof(T));
    return T(word >> shift);
}

template <class T> WS_HD T ws_min(T a, T b) { return a < b ? a : b; }
template <class T> WS_HD T ws_max(T a, T b) { return a < b ? b : a; }

WS_HD int ws_popc(u32 x) {
#if WS_DEVICE_PASS
    return __popc(x);
#else
    return __builtin_popcount(x);
#endif
}

// Index of the highest set bit of x != 0.
WS_HD int ws_top_bit(u32 x) {
#if WS_DEVICE_PASS
    return 31 - __clz(x);
#else
    return 31 - __builtin_clz(x);
#endif
}

// Index of the lowest set bit of x != 0.
WS_HD int ws_low_bit(u32 x) {
#if WS_DEVICE_PASS
    return __ffs(x) - 1;
#else
    return __builtin_ctz(x);
#endif
}

// Elements in chunk c of an n-element tensor.
WS_HD u32 chunk_len(u64 n, u64 c) {
    const u64 start = c * CHUNK;
    return u32(ws_min<u64>(CHUNK, n - start));
}

// --- count pass: one vector of VEC source elements -------------------------------

// The first `valid` elements at p as a Vec16, the rest zero. Device code
// calls it with valid == VEC on 16-byte aligned addresses (one vector load)
// except for the very last vector of a tensor; host code always goes element
// by element. k is a compile-time constant once the loop unrolls, so the
// short case stays in registers.
template <class I, int VEC> WS_HD Vec16 load_vec(const I* p, int valid) {
#if WS_DEVICE_PASS
    if (valid == VEC) return *reinterpret_cast<const Vec16*>(p);
#endif
    Vec16 v = {{0, 0, 0, 0}};
    WS_UNROLL
    for (int k = 0; k < VEC; ++k) {
        if (k < valid) {
            const u64 x = u64(p[k]);
            if (sizeof(I) == 8) {
                v.w[2 * k] = u32(x);
                v.w[2 * k + 1] = u32(x >> 32);
            } else {
                const int per = 4 / int(sizeof(I) < 4 ? sizeof(I) : 4);
                v.w[k / per] |= u32(x) << ((k % per) * 8 * int(sizeof(I)));
            }
        }
    }
    return v;
}

// Changed-bit mask (bit k = element k of the vector) and escape count of the
// first `valid` elements of a vector pair. Bits past `valid` stay clear, so
// the mask of a short last chunk is exact.
template <int ORD, class Src, int VEC>
WS_HD u32 count_vec(const Src& src, const Vec16& va, const Vec16& vb, int valid, u32* n_escapes) {
    typedef typename Src::in_t I;
    typedef typename Src::bits_t T;
    u32 bits = 0, esc = 0;
    WS_UNROLL
    for (int k = 0; k < VEC; ++k) {
        if (k < valid) {
            const T o = src.conv(vec_elem<I>(va, k)), w = src.conv(vec_elem<I>(vb, k));
            if (o != w) {
                bits |= 1u << k;
                esc += step_of<T, ORD>(o, w) == ESCAPE;
            }
        }
    }
    *n_escapes += esc;
    return bits;
}

// --- fill pass: one mask word (32 elements) per thread -----------------------------

// What a thread contributes to the block scan: its changes, its escapes, and
// the offset in the chunk of its last change (-1 if none), which the next
// thread with a change needs for its first gap.
struct FillSummary {
    u32 n_changed;
    u32 n_escapes;
    i32 last_offset;
};

template <int ORD, class Src>
WS_HD FillSummary fill_summarize(const Src& src, const typename Src::in_t* a, const typename Src::in_t* b,
                                 u32 word, u32 word_index) {
    typedef typename Src::bits_t T;
    FillSummary s;
    s.n_changed = u32(ws_popc(word));
    s.n_escapes = 0;
    s.last_offset = word ? i32(word_index * 32 + ws_top_bit(word)) : -1;
    for (u32 m = word; m; m &= m - 1) {
        const int k = ws_low_bit(m);
        s.n_escapes += step_of<T, ORD>(src.conv(a[k]), src.conv(b[k])) == ESCAPE;
    }
    return s;
}

// Write one thread's changes at their final places: `rank` and `esc_rank` are
// their indices in the gaps/steps and escapes sections, `prev` the offset of
// the change before the first of them (-1 at the start of a chunk, so that the
// first gap of a chunk is its offset, as delta_ref says).
template <int ORD, class Src>
WS_HD void fill_emit(const Src& src, const typename Src::in_t* a, const typename Src::in_t* b, u32 word,
                     u32 word_index, u64 rank, u64 esc_rank, i32 prev, u16* gaps, i8* steps,
                     typename Src::bits_t* escapes) {
    typedef typename Src::bits_t T;
    for (u32 m = word; m; m &= m - 1) {
        const int k = ws_low_bit(m);
        const i32 off = i32(word_index * 32 + k);
        const T o = src.conv(a[k]), w = src.conv(b[k]);
        const int st = step_of<T, ORD>(o, w);
        gaps[rank] = u16(off - prev - 1);
        steps[rank] = i8(st);
        if (st == ESCAPE) escapes[esc_rank++] = w;
        ++rank;
        prev = off;
    }
}

// --- walk pass (check / decode / apply / restore) -----------------------------------

// Offsets are running sums of gap + 1 within a chunk. Anything at or past
// CHUNK is already an error, so sums saturate at OFF_SAT: no u32 wrap can
// bring an out-of-chunk offset back inside (saturating add of non-negative
// values is associative, so the block scan may group it any way).
constexpr u32 OFF_SAT = 2 * CHUNK;
WS_HD u32 sat_add(u32 a, u32 b) { return ws_min<u32>(a + b, OFF_SAT); }  // a, b <= OFF_SAT: no wrap

enum { WALK_CHECK = 0, WALK_DECODE = 1, WALK_APPLY = 2, WALK_RESTORE = 3 };
enum { WALK_OK = 0, WALK_ERR_OFFSET = 1, WALK_ERR_ESCAPE = 2 };

// One change of a walk, at `offset` in a chunk of `len` elements starting at
// element `chunk_start`; idx is its index in the gaps/steps sections.
//   CHECK    only the bounds below
//   DECODE   pos[idx], vals[idx] = where it lands, its new bit pattern
//   APPLY    weights[pos] = new pattern, first saving the old one in vals[idx]
//            when vals is not null (the undo buffer)
//   RESTORE  weights[pos] = vals[idx] (undo an APPLY)
// An offset past the chunk, or an escape past the chunk's escape count, is
// reported and nothing is read or written for it: bad sections never make a
// kernel touch memory outside the tensor or the sections.
template <class T, int ORD, int MODE>
WS_HD int walk_one(T* weights, u64 chunk_start, u32 len, u32 offset, int step, u64 idx, u32 esc_rank,
                   u32 esc_count, u64 esc_base, const T* escapes, T* vals, i64* pos) {
    if (offset >= len) return WALK_ERR_OFFSET;
    const bool is_esc = step == ESCAPE;
    if (is_esc && esc_rank >= esc_count) return WALK_ERR_ESCAPE;
    const u64 p = chunk_start + offset;
    if (MODE == WALK_CHECK) return WALK_OK;
    if (MODE == WALK_RESTORE) {
        weights[p] = vals[idx];
        return WALK_OK;
    }
    const T old = weights[p];
    const T v = value_of<T, ORD>(old, step, is_esc ? escapes[esc_base + esc_rank] : T(0));
    if (MODE == WALK_DECODE) {
        pos[idx] = i64(p);
        vals[idx] = v;
    } else {
        if (vals) vals[idx] = old;
        weights[p] = v;
    }
    return WALK_OK;
}

}  // namespace ws
