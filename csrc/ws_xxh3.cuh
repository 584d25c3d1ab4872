// XXH3_64bits (seed 0, default secret), for the GPU kernels.
//
// wsync.checksum hashes every 1 MiB block of a tensor with xxh3-64 so that GPU
// blocks can share the work; the digests must equal what the `xxhash` package
// computes, bit for bit. This is a from-the-spec port of xxhash 0.8's scalar
// code paths, for every input length class (0, 1-3, 4-8, 9-16, 17-128,
// 129-240, and the >240 stripe / accumulate / scramble loop).
//
// The long loop is also split the way a warp runs it: lane (i, g) owns
// accumulator i (0..7) and stripes 4g..4g+3 (g = 0..3) of each 1 KiB block.
// Additions into an accumulator commute, so the four groups' partial sums can
// be added after the fact; the scramble between blocks is what keeps the
// blocks sequential. xxh3_lane_* are those per-lane steps; the kernel runs
// them one lane each (tests/test_cuda_sim.py runs that kernel on CPU fibers).
#pragma once

#include "ws_common.cuh"

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
static const u8 xxh3_secret_host[192] = {WS_XXH3_SECRET_BYTES};
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

constexpr u64 XXH3_BLOCK = 1024;    // 16 stripes of 64 bytes between scrambles
constexpr int XXH3_STRIPES = 16;

WS_HD const u8* xxh3_secret() {
#if WS_DEVICE_PASS
    return xxh3_secret_dev;
#else
    return xxh3_secret_host;
#endif
}

// Little-endian loads at any address. Data may sit at any byte offset (the
// last stripe, short inputs), and the GPU faults on misaligned wide loads.
WS_HD u64 rd64(const u8* p) {
#if WS_DEVICE_PASS
    if ((reinterpret_cast<unsigned long long>(p) & 7) == 0) return *reinterpret_cast<const u64*>(p);
#endif
    u64 v = 0;
    for (int k = 7; k >= 0; --k) v = (v << 8) | p[k];
    return v;
}

WS_HD u32 rd32(const u8* p) {
    u32 v = 0;
    for (int k = 3; k >= 0; --k) v = (v << 8) | p[k];
    return v;
}

// Loads known to be 8-byte aligned (the hot loop; the host wrapper guarantees
// an aligned base, and every stripe starts 64 bytes after the previous).
WS_HD u64 rd64_aligned(const u8* p) {
#if WS_DEVICE_PASS
    return *reinterpret_cast<const u64*>(p);
#else
    return rd64(p);
#endif
}

WS_HD u64 secret64(int offset) { return rd64(xxh3_secret() + offset); }
WS_HD u32 secret32(int offset) { return rd32(xxh3_secret() + offset); }

WS_HD u64 rotl64(u64 x, int r) { return (x << r) | (x >> (64 - r)); }
WS_HD u32 swap32(u32 x) {
    return ((x << 24) & 0xff000000u) | ((x << 8) & 0x00ff0000u) | ((x >> 8) & 0x0000ff00u) | ((x >> 24) & 0xffu);
}
WS_HD u64 swap64(u64 x) { return (u64(swap32(u32(x))) << 32) | swap32(u32(x >> 32)); }

// Low and high halves of the 128-bit product, folded by xor.
WS_HD u64 mul128_fold64(u64 a, u64 b) {
#if WS_DEVICE_PASS
    return (a * b) ^ __umul64hi(a, b);
#else
    const unsigned __int128 p = (unsigned __int128)a * b;
    return u64(p) ^ u64(p >> 64);
#endif
}

WS_HD u64 xxh64_avalanche(u64 h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    h ^= h >> 32;
    return h;
}

WS_HD u64 xxh3_avalanche(u64 h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    h ^= h >> 32;
    return h;
}

WS_HD u64 xxh3_rrmxmx(u64 h, u64 len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PRIME_MX2;
    h ^= (h >> 35) + len;
    h *= PRIME_MX2;
    return h ^ (h >> 28);
}

WS_HD u64 xxh3_len_1to3(const u8* p, u64 len) {
    const u32 c1 = p[0], c2 = p[len >> 1], c3 = p[len - 1];
    const u32 combined = (c1 << 16) | (c2 << 24) | c3 | (u32(len) << 8);
    const u64 bitflip = u64(secret32(0) ^ secret32(4));
    return xxh64_avalanche(u64(combined) ^ bitflip);
}

WS_HD u64 xxh3_len_4to8(const u8* p, u64 len) {
    const u32 in1 = rd32(p), in2 = rd32(p + len - 4);
    const u64 bitflip = secret64(8) ^ secret64(16);
    const u64 in64 = u64(in2) + (u64(in1) << 32);
    return xxh3_rrmxmx(in64 ^ bitflip, len);
}

WS_HD u64 xxh3_len_9to16(const u8* p, u64 len) {
    const u64 bitflip1 = secret64(24) ^ secret64(32);
    const u64 bitflip2 = secret64(40) ^ secret64(48);
    const u64 lo = rd64(p) ^ bitflip1;
    const u64 hi = rd64(p + len - 8) ^ bitflip2;
    const u64 acc = len + swap64(lo) + hi + mul128_fold64(lo, hi);
    return xxh3_avalanche(acc);
}

WS_HD u64 xxh3_mix16(const u8* p, int secret_offset) {
    return mul128_fold64(rd64(p) ^ secret64(secret_offset), rd64(p + 8) ^ secret64(secret_offset + 8));
}

WS_HD u64 xxh3_len_17to128(const u8* p, u64 len) {
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

WS_HD u64 xxh3_len_129to240(const u8* p, u64 len) {
    u64 acc = len * P64_1;
    const int rounds = int(len / 16);
    for (int i = 0; i < 8; ++i) acc += xxh3_mix16(p + 16 * i, 16 * i);
    acc = xxh3_avalanche(acc);
    for (int i = 8; i < rounds; ++i) acc += xxh3_mix16(p + 16 * i, 16 * (i - 8) + 3);  // MIDSIZE_STARTOFFSET
    acc += xxh3_mix16(p + len - 16, 136 - 17);  // SECRET_SIZE_MIN - MIDSIZE_LASTOFFSET
    return xxh3_avalanche(acc);
}

WS_HD u64 xxh3_short(const u8* p, u64 len) {
    if (len > 128) return xxh3_len_129to240(p, len);
    if (len > 16) return xxh3_len_17to128(p, len);
    if (len > 8) return xxh3_len_9to16(p, len);
    if (len >= 4) return xxh3_len_4to8(p, len);
    if (len) return xxh3_len_1to3(p, len);
    return xxh64_avalanche(secret64(56) ^ secret64(64));
}

WS_HD u64 xxh3_acc_init(int i) {
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
// XXH3_accumulate_512).
WS_HD u64 xxh3_round(u64 own, u64 neighbour, u64 key) {
    const u64 dk = own ^ key;
    return (dk & 0xFFFFFFFFull) * (dk >> 32) + neighbour;
}

WS_HD u64 xxh3_scramble(u64 acc, u64 key) {
    acc ^= acc >> 47;
    acc ^= key;
    return acc * P32_1;
}

// The secret words lane (i, g) uses: keys for its four stripes and its scramble key.
struct Xxh3LaneKeys {
    u64 stripe[4];
    u64 scramble;
};

WS_HD Xxh3LaneKeys xxh3_lane_keys(int i, int g) {
    Xxh3LaneKeys k;
    WS_UNROLL
    for (int j = 0; j < 4; ++j) k.stripe[j] = secret64(8 * (4 * g + j + i));
    k.scramble = secret64(192 - 64 + 8 * i);
    return k;
}

// Lane (i, g)'s words of one 1 KiB block: own and neighbour word of each of its
// stripes that lies in the first `stripes` of the block. Loaded apart from the
// arithmetic so the kernel can fetch block b+1 while it mixes block b.
struct Xxh3LaneData {
    u64 own[4];
    u64 nb[4];
};

WS_HD Xxh3LaneData xxh3_lane_load(const u8* block, int i, int g, int stripes) {
    Xxh3LaneData d;
    WS_UNROLL
    for (int j = 0; j < 4; ++j) {
        const int s = 4 * g + j;
        const u8* p = block + 64 * s;
        d.own[j] = s < stripes ? rd64_aligned(p + 8 * i) : 0;
        d.nb[j] = s < stripes ? rd64_aligned(p + 8 * (i ^ 1)) : 0;
    }
    return d;
}

WS_HD u64 xxh3_lane_mix(const Xxh3LaneData& d, const Xxh3LaneKeys& k, int g, int stripes) {
    u64 sum = 0;
    WS_UNROLL
    for (int j = 0; j < 4; ++j)
        if (4 * g + j < stripes) sum += xxh3_round(d.own[j], d.nb[j], k.stripe[j]);
    return sum;
}

// The last stripe (the final 64 bytes, wherever they start), keyed at secret
// offset 121, added to accumulator i. Any lane may compute it for its i.
WS_HD u64 xxh3_last_stripe(const u8* data, u64 len, int i) {
    const u8* p = data + len - 64;
    return xxh3_round(rd64(p + 8 * i), rd64(p + 8 * (i ^ 1)), secret64(192 - 64 - 7 + 8 * i));
}

WS_HD u64 xxh3_merge(const u64 acc[8], u64 len) {
    u64 r = len * P64_1;
    WS_UNROLL
    for (int k = 0; k < 4; ++k)
        r += mul128_fold64(acc[2 * k] ^ secret64(11 + 16 * k), acc[2 * k + 1] ^ secret64(11 + 16 * k + 8));
    return xxh3_avalanche(r);
}

// Number of full 1 KiB blocks before the partial one, and the stripes of the
// partial one (not counting the last stripe), for an input of len > 240.
WS_HD u64 xxh3_full_blocks(u64 len) { return (len - 1) / XXH3_BLOCK; }
WS_HD int xxh3_tail_stripes(u64 len) { return int(((len - 1) - XXH3_BLOCK * xxh3_full_blocks(len)) / 64); }

}  // namespace ws
