// Kernels that break (or keep) the rules wsim enforces, for tests/test_cuda_sim_harness.py:
// the harness must fail each broken one with its reason, and compute the kept ones as CUDA does.
// MODE selects the case; it is the same in every thread, so branching on it is uniform.

constexpr unsigned FULL = 0xffffffffu;

__device__ int deep(int n) {  // no tail call: every level keeps a frame
    volatile char pad[512];
    pad[n & 511] = char(n);
    return n ? deep(n - 1) + pad[(n * 7) & 511] : 0;
}

extern "C" __global__ void st_rules(int mode, unsigned* out, const unsigned* in) {
    const unsigned t = threadIdx.x, lane = t & 31;
    unsigned v = t;
    switch (mode) {
        case 0:  // divergent barriers: two call sites
            if (t < 16) __syncthreads(); else __syncthreads();
            break;
        case 1:  // a thread returns, the others meet at a barrier
            if (t == 5) return;
            __syncthreads();
            break;
        case 2:  // a shuffle inside a branch half the warp takes
            if (lane < 16) v = __shfl_xor_sync(FULL, v, 1);
            break;
        case 3:  // lanes disagree on the mask
            v = __shfl_xor_sync(lane < 16 ? 0x0000ffffu : FULL, v, 1);
            break;
        case 4:  // a mask that leaves the caller out
            v = __shfl_xor_sync(0xfffffffeu, v, 1);
            break;
        case 5:  // reading a lane outside the mask
            if (lane < 16) v = __shfl_sync(0x0000ffffu, v, 20);
            break;
        case 6:  // a half-warp leaves, the other half shuffles with a full mask
            if (lane >= 16) return;
            v = __shfl_xor_sync(FULL, v, 1);
            break;
        case 7:  // a write past the end of out (into the unmapped page after it)
            if (t == 0) out[gridDim.x * blockDim.x + 512] = 1;
            break;
        case 8:  // a write just past the end of out (into the junk before the page)
            if (t == 0) out[gridDim.x * blockDim.x] = 1;
            break;
        case 9:  // a write through a const pointer
            if (t == 0) const_cast<unsigned*>(in)[0] = 7;
            break;
        case 10:  // a stack that overflows
            v = unsigned(deep(1 << 20));
            break;
        case 11:  // lanes at different collectives
            if (lane & 1) v = __shfl_xor_sync(FULL, v, 1); else v = __shfl_xor_sync(FULL, v, 2);
            break;
        case 12:  // a barrier while the rest of the warp waits at a shuffle
            if (lane == 0) __syncthreads(); else v = __shfl_xor_sync(FULL, v, 1);
            break;
        case 13:  // __syncwarp with a half-warp exited
            if (lane >= 16) return;
            __syncwarp();
            break;
        case 14:  // a full-warp shuffle: fine, unless the block ends in a partial warp
            v = __shfl_xor_sync(FULL, v, 1);
            break;
    }
    out[blockIdx.x * blockDim.x + t] = v;
}

// Collectives the way CUDA defines them; out gets NOUT words per thread.
constexpr int NOUT = 16;
extern "C" __global__ void st_collectives(unsigned* out, const unsigned* in) {
    const unsigned t = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x & 31;
    const unsigned x = in[t];
    unsigned* o = out + t * NOUT;
    o[0] = __shfl_sync(FULL, x, 7);
    o[1] = __shfl_sync(FULL, x, 3, 8);
    o[2] = __shfl_up_sync(FULL, x, 3);
    o[3] = __shfl_up_sync(FULL, x, 3, 16);
    o[4] = __shfl_down_sync(FULL, x, 5);
    o[5] = __shfl_xor_sync(FULL, x, 9);
    o[6] = __shfl_xor_sync(FULL, x, 9, 8);
    o[7] = __ballot_sync(FULL, x & 1);
    o[8] = __any_sync(FULL, x == 12345u);
    o[9] = __all_sync(FULL, x != 12345u);
    o[10] = __reduce_add_sync(FULL, x);
    o[11] = unsigned(__reduce_min_sync(FULL, int(x) - 1000));
    o[12] = __reduce_max_sync(FULL, x);
    o[13] = __syncthreads_count(x & 1);
    o[14] = unsigned(__shfl_sync(FULL, (unsigned long long)x << 32 | lane, 31) >> 32);
    // Disjoint masks in one warp: each half shuffles within itself.
    o[15] = lane < 16 ? __shfl_xor_sync(0x0000ffffu, x, 15) : __shfl_xor_sync(0xffff0000u, x, 15);
    __syncwarp();
}

// __shared__ read before anything writes it: the harness must hand out junk. (The write that
// never happens keeps g++ from folding a never-written array to its zero initializer.)
extern "C" __global__ void st_shared_junk(unsigned* out, int write_first) {
    __shared__ unsigned s[256];
    if (write_first) s[threadIdx.x] = 0;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
}

// A race the schedules must expose: thread 0 publishes, the others read, and
// no barrier orders them (RACY = 1) or one does (RACY = 0).
extern "C" __global__ void st_race(int racy, unsigned* out) {
    __shared__ unsigned s[1];
    if (threadIdx.x == 0) s[0] = 42;
    if (!racy) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[0];
}

// Integer intrinsics and atomics over a few words.
extern "C" __global__ void st_intrinsics(const unsigned* in, unsigned* out, unsigned long long* acc) {
    const unsigned t = blockIdx.x * blockDim.x + threadIdx.x, x = in[t], y = in[t + 1];
    unsigned* o = out + 8 * t;
    o[0] = unsigned(__popc(x));
    o[1] = unsigned(__clz(int(x)));
    o[2] = unsigned(__ffs(int(x)));
    o[3] = __funnelshift_l(x, y, t);
    o[4] = __funnelshift_r(x, y, t);
    o[5] = __brev(x);
    o[6] = unsigned(__umul64hi((unsigned long long)x << 20 | y, 0x9E3779B97F4A7C15ull) >> 7);
    o[7] = __byte_perm(x, y, 0x5140);
    atomicAdd(&acc[0], (unsigned long long)x);
    atomicMin(&acc[1], (unsigned long long)x);
    atomicOr(&acc[2], (unsigned long long)x);
    atomicMax(&acc[3], (unsigned long long)x);
}
