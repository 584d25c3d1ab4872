// Test-only kernels over the scalar helpers of csrc/ws_common.cuh, compiled by the wsim harness
// only: they let a test sweep millions of inputs through the device build of a helper.
#include "ws_common.cuh"

extern "C" __global__ void probe_bf16_rne(const ws::u32* in, ws::u16* out, ws::u64 n, ws::u32 nan_pos,
                                          ws::u32 nan_neg) {
    const ws::u64 stride = ws::u64(blockDim.x) * gridDim.x;
    for (ws::u64 k = ws::u64(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += stride)
        out[k] = ws::bf16_rne(in[k], ws::u16(nan_pos), ws::u16(nan_neg));
}
