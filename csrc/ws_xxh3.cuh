// XXH3-64 as a warp computes it, for the checksum kernel (xxh3_blocks in delta_cuda.cu).
//
// The algorithm itself is xxh3.h (shared with the C++ kernels); this file
// splits its long loop the way a warp runs it: lane (i, g) owns accumulator i
// (0..7) and stripes 4g..4g+3 (g = 0..3) of each 1 KiB block. Additions into
// an accumulator commute, so the four groups' partial sums can be added after
// the fact; the scramble between blocks is what keeps the blocks sequential.
// xxh3_lane_* are those per-lane steps; the kernel runs them one lane each
// (tests/test_cuda_sim.py runs that kernel on CPU fibers against python-xxhash).
#pragma once

#include "xxh3.h"

namespace ws {

// Loads known to be 8-byte aligned (the hot loop; the host wrapper guarantees
// an aligned base, and every stripe starts 64 bytes after the previous).
WS_HD u64 rd64_aligned(const u8* p) {
#if WS_DEVICE_PASS
    return *reinterpret_cast<const u64*>(p);
#else
    return rd64(p);
#endif
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
    k.scramble = secret64(XXH3_SCRAMBLE_KEY + 8 * i);
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

}  // namespace ws
