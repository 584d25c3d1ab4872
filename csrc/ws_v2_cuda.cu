// CUDA decoder of delta codec v2 (wsync/codecs/v2_ref.py): one thread per 65536-element chunk, each
// running ws_v2.cuh's decode_chunk, the very function the C++ backend runs on its thread pool. Chunks are
// v2's independent lanes (their own position bitstream and rANS stream), so a GPU decodes them all at once.
//
// The host parses the model and the index (a few hundred bytes) and hands the kernel flat tables; the
// kernel writes each chunk's changes, in position order, at its chunk's offset in off/step, with their
// count and an error code (ws::v2::Err) per chunk. Scratch is per chunk in global memory. On a machine
// without a GPU the same text runs on CPU fibers (tests/cudasim), unchanged.
#include "ws_common.cuh"
#include "ws_v2.cuh"

namespace ws {
namespace v2 {

// Per-chunk scratch tables, in u32s: first [NCLASS + 1], h and qb [WALKERS * NCLASS] each, then the block
// counts snap [SNAP_ROW * NCLASS].
constexpr u32 TABLES = NCLASS + 1 + 2 * WALKERS * NCLASS + SNAP_ROW * NCLASS;

template <class T>
__device__ void decode_chunks(const T* old, u64 n, const u64* m, const u32* freq, const u32* cum, const u8* slot,
                              int lo, int hi, int kind, int shift, int ebits, u64 k, const u8* pos, const u64* pos_at,
                              const u8* steps, const u64* steps_at, u32* rank, i64* d, u8* of, u64* mark,
                              u16* at16, u32* tables, u32* off, i64* step, u32* count, int* err) {
  const u64 nc = (n + CHUNK - 1) / CHUNK;
  const u64 c = u64(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= nc) return;
  const u64 at = c * CHUNK;
  const u32 len = u32(n - at < CHUNK ? n - at : CHUNK);
  u32* t = tables + c * TABLES;
  Scratch sc{rank + at, d + at, t, t + NCLASS + 1, t + NCLASS + 1 + WALKERS * NCLASS, of + at,
             t + NCLASS + 1 + 2 * WALKERS * NCLASS, mark + c * (CHUNK / 64), at16 + at};
  const ModelView md{m, freq, cum, slot};
  u32 got = 0;
  ToArrays out{off + at, step + at};
  err[c] = decode_chunk<T>(old + at, len, pos + pos_at[c], pos_at[c + 1] - pos_at[c], steps + steps_at[c],
                           steps_at[c + 1] - steps_at[c], md, lo, hi, kind, shift, ebits, k, sc, out, &got);
  count[c] = got;
}

}  // namespace v2
}  // namespace ws

#define WS_V2_PARAMS(U)                                                                                         \
  const U *old, ws::u64 n, const ws::u64 *m, const ws::u32 *freq, const ws::u32 *cum, const ws::u8 *slot, int lo, \
      int hi, int kind, int shift, int ebits, ws::u64 k, const ws::u8 *pos, const ws::u64 *pos_at,               \
      const ws::u8 *steps, const ws::u64 *steps_at, ws::u32 *rank, ws::i64 *d, ws::u8 *of, ws::u64 *mark,     \
      ws::u16 *at16, ws::u32 *tables, ws::u32 *off, ws::i64 *step, ws::u32 *count, int *err
#define WS_V2_ARGS \
  old, n, m, freq, cum, slot, lo, hi, kind, shift, ebits, k, pos, pos_at, steps, steps_at, rank, d, of, mark, at16, tables, off, step, count, err

extern "C" __global__ void v2_decode_1(WS_V2_PARAMS(ws::u8)) { ws::v2::decode_chunks<ws::u8>(WS_V2_ARGS); }
extern "C" __global__ void v2_decode_2(WS_V2_PARAMS(ws::u16)) { ws::v2::decode_chunks<ws::u16>(WS_V2_ARGS); }
extern "C" __global__ void v2_decode_4(WS_V2_PARAMS(ws::u32)) { ws::v2::decode_chunks<ws::u32>(WS_V2_ARGS); }
extern "C" __global__ void v2_decode_8(WS_V2_PARAMS(ws::u64)) { ws::v2::decode_chunks<ws::u64>(WS_V2_ARGS); }
