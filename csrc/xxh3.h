// XXH3-64 (seed 0, the default secret): wsync's own, one header for every compiler we use.
//
// wsync.checksum hashes 1 MiB blocks with xxh3-64 and must agree, bit for bit,
// with the `xxhash` Python package; the C++ kernels and the CUDA kernels hash
// the same blocks. This header holds the whole algorithm, written from the
// XXH3 specification: the scalar pieces every build shares (short inputs of
// 0..240 bytes, the stripe round, the scramble, the merge), marked
// __host__ __device__ under a CUDA compiler (nvcc, NVRTC, the CPU harness of
// tests/cudasim), and for plain host C++ (wsync._cpu) the long-input loop with
// SSE2 or AVX2 accumulators (AVX2 where the including file defines
// WS_XXH3_AVX2 and compiles for it, see xxh3_avx2.cpp; plain C++ elsewhere, or
// with WS_XXH3_SCALAR) and the pieces the span-by-span stream of
// xxh3_stream_impl.h needs.
//
// On the host, every function here has internal linkage (static inline): the
// AVX2 and baseline translation units each keep their own copy, so the linker
// can never hand the AVX2 code to a CPU without AVX2.
//
// NVRTC has no system headers: fixed-width types come from ws_common.cuh and
// the host-only includes sit behind !defined(__CUDACC__).
#pragma once

#include "ws_common.cuh"

#if defined(__CUDACC__)
#define WS_X3 __host__ __device__ __forceinline__
#else
#define WS_X3 static inline __attribute__((always_inline))
#endif

#if !defined(__CUDACC__) && (defined(__x86_64__) || defined(_M_X64))
#include <emmintrin.h>  // SSE2: every x86-64 CPU has it
#if defined(WS_XXH3_AVX2)
#include <immintrin.h>
#endif
#endif

namespace ws {

#define WS_XXH3_SECRET_BYTES                                                                                   \
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4,  \
        0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6,    \
        0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74,    \
        0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91,    \
        0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d,    \
        0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34,    \
        0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,    \
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5,    \
        0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16,    \
        0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8,    \
        0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca,    \
        0xbb, 0x4b, 0x40, 0x7e

// One copy per address space: device code reads the __constant__ one, host
// code the static one (nvcc forbids either side touching the other's).
#if defined(__CUDACC__)
__constant__ u8 xxh3_secret_dev[192] = {WS_XXH3_SECRET_BYTES};
#endif
#if !WS_DEVICE_PASS
alignas(64) static const u8 xxh3_secret_host[192] = {WS_XXH3_SECRET_BYTES};
#endif

constexpr u32 P32_1 = 0x9E3779B1u;
constexpr u32 P32_2 = 0x85EBCA77u;
constexpr u32 P32_3 = 0xC2B2AE3Du;
constexpr u64 P64_1 = 0x9E3779B185EBCA87ull;
constexpr u64 P64_2 = 0xC2B2AE3D27D4EB4Full;
constexpr u64 P64_3 = 0x165667B19E3779F9ull;
constexpr u64 P64_4 = 0x85EBCA77C2B2AE63ull;
constexpr u64 P64_5 = 0x27D4EB2F165667C5ull;
constexpr u64 PRIME_MX1 = 0x165667919E3779F9ull;
constexpr u64 PRIME_MX2 = 0x9FB21C651E98DF25ull;

constexpr u64 XXH3_STRIPE = 64;       // bytes a round consumes
constexpr u64 XXH3_BLOCK = 1024;      // 16 stripes of 64 bytes between scrambles
constexpr int XXH3_STRIPES = 16;      // (secret size - stripe) / 8
constexpr int XXH3_SCRAMBLE_KEY = 128;  // secret offset of the scramble keys
constexpr int XXH3_LAST_KEY = 121;      // secret offset of the last stripe's keys
constexpr int XXH3_MERGE_KEY = 11;      // secret offset of the merge keys

WS_X3 const u8* xxh3_secret() {
#if WS_DEVICE_PASS
    return xxh3_secret_dev;
#else
    return xxh3_secret_host;
#endif
}

// Little-endian loads at any address. Data may sit at any byte offset (the
// last stripe, short inputs), and the GPU faults on misaligned wide loads.
WS_X3 u64 rd64(const u8* p) {
#if WS_DEVICE_PASS
    if ((reinterpret_cast<unsigned long long>(p) & 7) == 0) return *reinterpret_cast<const u64*>(p);
    u64 v = 0;
    for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
    return v;
#else
    u64 v;  // the host is little-endian (delta_kernels.h refuses others)
    __builtin_memcpy(&v, p, 8);
    return v;
#endif
}

WS_X3 u32 rd32(const u8* p) {
#if WS_DEVICE_PASS
    u32 v = 0;
    for (int k = 3; k >= 0; --k) v = (v << 8) | p[k];
    return v;
#else
    u32 v;
    __builtin_memcpy(&v, p, 4);
    return v;
#endif
}

WS_X3 u64 secret64(int offset) { return rd64(xxh3_secret() + offset); }
WS_X3 u32 secret32(int offset) { return rd32(xxh3_secret() + offset); }

WS_X3 u64 rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
WS_X3 u32 swap32(u32 x) {
    return ((x << 24) & 0xff000000u) | ((x << 8) & 0x00ff0000u) | ((x >> 8) & 0x0000ff00u) | ((x >> 24) & 0xffu);
}
WS_X3 u64 swap64(u64 x) { return (u64(swap32(u32(x))) << 32) | swap32(u32(x >> 32)); }

// Low and high halves of the 128-bit product, folded by xor.
WS_X3 u64 mul128_fold64(u64 a, u64 b) {
#if WS_DEVICE_PASS
    return (a * b) ^ __umul64hi(a, b);
#else
    const unsigned __int128 p = (unsigned __int128)a * b;
    return u64(p) ^ u64(p >> 64);
#endif
}

WS_X3 u64 xxh64_avalanche(u64 h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    h ^= h >> 32;
    return h;
}

WS_X3 u64 xxh3_avalanche(u64 h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    h ^= h >> 32;
    return h;
}

WS_X3 u64 xxh3_rrmxmx(u64 h, u64 len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PRIME_MX2;
    h ^= (h >> 35) + len;
    h *= PRIME_MX2;
    return h ^ (h >> 28);
}

// ---- inputs of 0..240 bytes ------------------------------------------------------------

WS_X3 u64 xxh3_len_1to3(const u8* p, u64 len) {
    const u32 c1 = p[0], c2 = p[len >> 1], c3 = p[len - 1];
    const u32 combined = (c1 << 16) | (c2 << 24) | c3 | (u32(len) << 8);
    const u64 bitflip = u64(secret32(0) ^ secret32(4));
    return xxh64_avalanche(u64(combined) ^ bitflip);
}

WS_X3 u64 xxh3_len_4to8(const u8* p, u64 len) {
    const u32 in1 = rd32(p), in2 = rd32(p + len - 4);
    const u64 bitflip = secret64(8) ^ secret64(16);
    const u64 in64 = u64(in2) + (u64(in1) << 32);
    return xxh3_rrmxmx(in64 ^ bitflip, len);
}

WS_X3 u64 xxh3_len_9to16(const u8* p, u64 len) {
    const u64 bitflip1 = secret64(24) ^ secret64(32);
    const u64 bitflip2 = secret64(40) ^ secret64(48);
    const u64 lo = rd64(p) ^ bitflip1;
    const u64 hi = rd64(p + len - 8) ^ bitflip2;
    const u64 acc = len + swap64(lo) + hi + mul128_fold64(lo, hi);
    return xxh3_avalanche(acc);
}

WS_X3 u64 xxh3_mix16(const u8* p, int secret_offset) {
    return mul128_fold64(rd64(p) ^ secret64(secret_offset), rd64(p + 8) ^ secret64(secret_offset + 8));
}

WS_X3 u64 xxh3_len_17to128(const u8* p, u64 len) {
    u64 acc = len * P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += xxh3_mix16(p + 48, 96);
                acc += xxh3_mix16(p + len - 64, 112);
            }
            acc += xxh3_mix16(p + 32, 64);
            acc += xxh3_mix16(p + len - 48, 80);
        }
        acc += xxh3_mix16(p + 16, 32);
        acc += xxh3_mix16(p + len - 32, 48);
    }
    acc += xxh3_mix16(p, 0);
    acc += xxh3_mix16(p + len - 16, 16);
    return xxh3_avalanche(acc);
}

WS_X3 u64 xxh3_len_129to240(const u8* p, u64 len) {
    u64 acc = len * P64_1;
    const int rounds = int(len / 16);
    for (int i = 0; i < 8; ++i) acc += xxh3_mix16(p + 16 * i, 16 * i);
    acc = xxh3_avalanche(acc);
    for (int i = 8; i < rounds; ++i) acc += xxh3_mix16(p + 16 * i, 16 * (i - 8) + 3);  // mid-size start offset
    acc += xxh3_mix16(p + len - 16, 136 - 17);  // minimum secret size - mid-size last offset
    return xxh3_avalanche(acc);
}

WS_X3 u64 xxh3_short(const u8* p, u64 len) {
    if (len > 128) return xxh3_len_129to240(p, len);
    if (len > 16) return xxh3_len_17to128(p, len);
    if (len > 8) return xxh3_len_9to16(p, len);
    if (len >= 4) return xxh3_len_4to8(p, len);
    if (len) return xxh3_len_1to3(p, len);
    return xxh64_avalanche(secret64(56) ^ secret64(64));
}

// ---- inputs over 240 bytes: 8 accumulators over 64-byte stripes ---------------------------

WS_X3 u64 xxh3_acc_init(int i) {
    switch (i) {
        case 0: return P32_3;
        case 1: return P64_1;
        case 2: return P64_2;
        case 3: return P64_3;
        case 4: return P64_4;
        case 5: return P32_2;
        case 6: return P64_5;
        default: return P32_1;
    }
}

// One stripe's addition to accumulator i: its own word times itself split in
// halves after keying, plus the neighbouring lane's raw word (the swap of
// XXH3's accumulate step).
WS_X3 u64 xxh3_round(u64 own, u64 neighbour, u64 key) {
    const u64 dk = own ^ key;
    return (dk & 0xFFFFFFFFull) * (dk >> 32) + neighbour;
}

WS_X3 u64 xxh3_scramble(u64 acc, u64 key) {
    acc ^= acc >> 47;
    acc ^= key;
    return acc * P32_1;
}

// The last stripe (the final 64 bytes, wherever they start), keyed at secret
// offset 121, added to accumulator i.
WS_X3 u64 xxh3_last_stripe(const u8* data, u64 len, int i) {
    const u8* p = data + len - XXH3_STRIPE;
    return xxh3_round(rd64(p + 8 * i), rd64(p + 8 * (i ^ 1)), secret64(XXH3_LAST_KEY + 8 * i));
}

WS_X3 u64 xxh3_merge(const u64 acc[8], u64 len) {
    u64 r = len * P64_1;
    WS_UNROLL
    for (int k = 0; k < 4; ++k)
        r += mul128_fold64(acc[2 * k] ^ secret64(XXH3_MERGE_KEY + 16 * k),
                           acc[2 * k + 1] ^ secret64(XXH3_MERGE_KEY + 16 * k + 8));
    return xxh3_avalanche(r);
}

// Number of full 1 KiB blocks before the partial one, and the stripes of the
// partial one (not counting the last stripe), for an input of len > 240.
WS_X3 u64 xxh3_full_blocks(u64 len) { return (len - 1) / XXH3_BLOCK; }
WS_X3 int xxh3_tail_stripes(u64 len) { return int(((len - 1) - XXH3_BLOCK * xxh3_full_blocks(len)) / XXH3_STRIPE); }

#if !defined(__CUDACC__)
// ---- the host's long loop: accumulators in vector registers --------------------------------
//
// acc is 8 u64, 32-byte aligned; input at any address.

// Each target keeps the 8 accumulators in registers (Acc) across a whole call: stripe()
// adds one 64-byte stripe, scramble() mixes them after each 1 KiB block.
#if defined(WS_XXH3_AVX2)
struct Xxh3Acc {
    __m256i a[2];
};
WS_X3 Xxh3Acc xxh3_acc_load(const u64* acc) {
    return Xxh3Acc{{_mm256_load_si256(reinterpret_cast<const __m256i*>(acc)),
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(acc + 4))}};
}
WS_X3 void xxh3_acc_store(const Xxh3Acc& A, u64* acc) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(acc), A.a[0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(acc + 4), A.a[1]);
}
WS_X3 void xxh3_stripe(Xxh3Acc& A, const u8* p, const u8* key) {
    for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
        const __m256i k = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 32 * h)));
        // low 32 bits times high 32 bits of each keyed word, plus the neighbouring raw word
        const __m256i m = _mm256_mul_epu32(k, _mm256_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1)));
        A.a[h] = _mm256_add_epi64(A.a[h], _mm256_add_epi64(m, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
    }
}
WS_X3 void xxh3_scramble_regs(Xxh3Acc& A, const u8* key) {
    const __m256i prime = _mm256_set1_epi32(int(P32_1));
    for (int h = 0; h < 2; ++h) {
        const __m256i x = _mm256_xor_si256(_mm256_xor_si256(A.a[h], _mm256_srli_epi64(A.a[h], 47)),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + 32 * h)));
        const __m256i lo = _mm256_mul_epu32(x, prime);
        const __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(x, _MM_SHUFFLE(0, 3, 0, 1)), prime);
        A.a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
}
#elif defined(__SSE2__) && !defined(WS_XXH3_SCALAR)
struct Xxh3Acc {
    __m128i a[4];
};
WS_X3 Xxh3Acc xxh3_acc_load(const u64* acc) {
    Xxh3Acc A;
    for (int h = 0; h < 4; ++h) A.a[h] = _mm_load_si128(reinterpret_cast<const __m128i*>(acc + 2 * h));
    return A;
}
WS_X3 void xxh3_acc_store(const Xxh3Acc& A, u64* acc) {
    for (int h = 0; h < 4; ++h) _mm_store_si128(reinterpret_cast<__m128i*>(acc + 2 * h), A.a[h]);
}
WS_X3 void xxh3_stripe(Xxh3Acc& A, const u8* p, const u8* key) {
    for (int h = 0; h < 4; ++h) {
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h));
        const __m128i k = _mm_xor_si128(d, _mm_loadu_si128(reinterpret_cast<const __m128i*>(key + 16 * h)));
        const __m128i m = _mm_mul_epu32(k, _mm_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1)));
        A.a[h] = _mm_add_epi64(A.a[h], _mm_add_epi64(m, _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
    }
}
WS_X3 void xxh3_scramble_regs(Xxh3Acc& A, const u8* key) {
    const __m128i prime = _mm_set1_epi32(int(P32_1));
    for (int h = 0; h < 4; ++h) {
        const __m128i x = _mm_xor_si128(_mm_xor_si128(A.a[h], _mm_srli_epi64(A.a[h], 47)),
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(key + 16 * h)));
        const __m128i lo = _mm_mul_epu32(x, prime);
        const __m128i hi = _mm_mul_epu32(_mm_shuffle_epi32(x, _MM_SHUFFLE(0, 3, 0, 1)), prime);
        A.a[h] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
    }
}
#else
struct Xxh3Acc {
    u64 a[8];
};
WS_X3 Xxh3Acc xxh3_acc_load(const u64* acc) {
    Xxh3Acc A;
    for (int i = 0; i < 8; ++i) A.a[i] = acc[i];
    return A;
}
WS_X3 void xxh3_acc_store(const Xxh3Acc& A, u64* acc) {
    for (int i = 0; i < 8; ++i) acc[i] = A.a[i];
}
WS_X3 void xxh3_stripe(Xxh3Acc& A, const u8* p, const u8* key) {
    for (int i = 0; i < 8; ++i) A.a[i] += xxh3_round(rd64(p + 8 * i), rd64(p + 8 * (i ^ 1)), rd64(key + 8 * i));
}
WS_X3 void xxh3_scramble_regs(Xxh3Acc& A, const u8* key) {
    for (int i = 0; i < 8; ++i) A.a[i] = xxh3_scramble(A.a[i], rd64(key + 8 * i));
}
#endif

// nstripes stripes at p, keyed from `secret` on (stripe s by secret + 8 s), into acc.
WS_X3 void xxh3_accumulate(u64* acc, const u8* p, const u8* secret, u64 nstripes) {
    Xxh3Acc A = xxh3_acc_load(acc);
    for (u64 s = 0; s < nstripes; ++s) xxh3_stripe(A, p + 64 * s, secret + 8 * s);
    xxh3_acc_store(A, acc);
}

WS_X3 void xxh3_scramble_acc(u64* acc, const u8* key) {
    Xxh3Acc A = xxh3_acc_load(acc);
    xxh3_scramble_regs(A, key);
    xxh3_acc_store(A, acc);
}

// nblocks whole 1 KiB blocks at p, each followed by its scramble: the hot loop of long inputs.
WS_X3 void xxh3_blocks(u64* acc, const u8* p, u64 nblocks) {
    Xxh3Acc A = xxh3_acc_load(acc);
    for (u64 b = 0; b < nblocks; ++b, p += XXH3_BLOCK) {
        // 4, not 16: fully unrolled, gcc hoists the 16 stripes' products and spills them (1.7x slower here)
#pragma GCC unroll 4
        for (int s = 0; s < XXH3_STRIPES; ++s) {
            __builtin_prefetch(p + 64 * s + 384);
            xxh3_stripe(A, p + 64 * s, xxh3_secret_host + 8 * s);
        }
        xxh3_scramble_regs(A, xxh3_secret_host + XXH3_SCRAMBLE_KEY);
    }
    xxh3_acc_store(A, acc);
}

WS_X3 void xxh3_init_acc(u64* acc) {
    for (int i = 0; i < 8; ++i) acc[i] = xxh3_acc_init(i);
}

// The end of a long input: its last 64 bytes (at `last`) keyed at offset 121, then the merge.
WS_X3 u64 xxh3_finish(u64* acc, const u8* last, u64 len) {
    xxh3_accumulate(acc, last, xxh3_secret_host + XXH3_LAST_KEY, 1);
    return xxh3_merge(acc, len);
}

// XXH3_64bits(p, len): equal to xxhash.xxh3_64_intdigest of the same bytes.
WS_X3 u64 xxh3_64(const void* data, u64 len) {
    const u8* p = static_cast<const u8*>(data);
    if (len <= 240) return xxh3_short(p, len);
    alignas(32) u64 acc[8];
    xxh3_init_acc(acc);
    const u64 nb = xxh3_full_blocks(len);
    xxh3_blocks(acc, p, nb);
    xxh3_accumulate(acc, p + nb * XXH3_BLOCK, xxh3_secret_host, u64(xxh3_tail_stripes(len)));
    return xxh3_finish(acc, static_cast<const u8*>(data) + len - 64, len);
}
#endif  // !__CUDACC__

}  // namespace ws
