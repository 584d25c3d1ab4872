// CUDA decoder of delta codec v2 (wsync/codecs/v2_ref.py): a warp per 65536-element chunk. Chunks are v2's
// independent lanes (their own position bitstream and rANS stream), so a GPU decodes them all at once.
//
// Within a chunk, each of the 32 lanes owns a contiguous 2048-element segment. The lanes count their
// segments' value classes (shared memory, a column per lane: no two lanes touch one bank); the class
// counts before each lane are an exclusive scan over the lanes. Lane 0 then reads the chunk's codes with
// ws_v2.cuh's decode_codes, the C++ backend's own: each change's rank within its class and its step, in
// coding order. Each lane finds, per class, the first change whose rank falls in its segment, counts the
// changes it will place (a warp scan gives its first output index), and walks its segment again: an
// element whose running class count equals the next wanted rank is that change. Changes come out in
// position order, at the chunk's offset in off/step, with their count and an error code (ws::v2::Err).
//
// The host parses the model and the index (a few hundred bytes) and hands the kernel flat tables; scratch
// is per chunk in global memory. On a machine without a GPU the same text runs on CPU fibers
// (tests/cudasim), unchanged.
#include "ws_common.cuh"
#include "ws_v2.cuh"

namespace ws {
namespace v2 {

constexpr u32 WL = 32;           // lanes per chunk: one warp, the whole block
constexpr u32 SEG = CHUNK / WL;  // elements per lane
// Per-chunk scratch tables, in u32s: first [NCLASS + 1] (decode_codes), then pop [NCLASS] (class counts).
constexpr u32 TABLES = 2 * NCLASS + 1;
constexpr u16 NONE = 0xFFFF;  // want: no change left (a count of 65535 meets it too: the match is checked)
constexpr unsigned FULL = 0xffffffffu;

struct CountsOf {  // decode_codes' pop: the chunk's class counts
  const u32* pop;
  WS_HD u64 operator()(int c) const { return pop[c]; }
};

// The first j in [b, e) with rank[j] >= r (ranks of one class increase), else e.
__device__ inline u32 lower_rank(const u32* rank, u32 b, u32 e, u32 r) {
  while (b < e) {
    const u32 mid = b + (e - b) / 2;
    if (rank[mid] < r) b = mid + 1;
    else e = mid;
  }
  return b;
}

template <class T>
__device__ void decode_chunks(const T* old, u64 n, const u64* m, const u32* freq, const u32* cum, const u8* slot,
                              int lo, int hi, int kind, int shift, int ebits, u64 k, const u8* pos, const u64* pos_at,
                              const u8* steps, const u64* steps_at, u32* rank, i64* d, u32* ptr, u32* tables,
                              u32* off, i64* step, u32* count, int* err) {
  __shared__ u16 cnt[NCLASS * WL];   // [class - lo][lane]: counts, then the count before the lane, then running
  __shared__ u16 want[NCLASS * WL];  // [class - lo][lane]: rank of the lane's next change of the class
  __shared__ int s_err;
  __shared__ u32 s_k;
  const u64 nc = (n + CHUNK - 1) / CHUNK;
  const u64 c = blockIdx.x;
  const u32 lane = threadIdx.x;
  if (c >= nc) return;  // the whole block
  const u64 at = c * CHUNK;
  const u32 len = u32(n - at < CHUNK ? n - at : CHUNK);
  const T* x = old + at;
  const u32 a = lane * SEG < len ? lane * SEG : len;
  const u32 z = a + SEG < len ? a + SEG : len;
  const u32 span = u32(hi - lo);  // the classes the model codes lie in [lo, hi); others never change
  u32* first = tables + c * TABLES;
  u32* pop = first + NCLASS + 1;
  u32* rk = rank + at;
  i64* dd = d + at;
  u32* pt = ptr + c * (NCLASS * WL);

  for (u32 j = 0; j < span; ++j) cnt[j * WL + lane] = 0;
  for (u32 o = a; o < z; ++o) {
    const u32 cl = value_class<T>(x[o], kind, shift, ebits) - u32(lo);  // wraps below lo
    if (cl < span) cnt[cl * WL + lane]++;  // <= SEG per lane: fits
  }
  __syncwarp();
  for (u32 j = lane; j < span; j += WL) {  // a class per lane: the counts before each lane, and the total
    u32 run = 0;
    for (u32 l = 0; l < WL; ++l) {
      const u32 v = cnt[j * WL + l];
      cnt[j * WL + l] = u16(run);  // < 31 * SEG: fits
      run += v;
    }
    pop[lo + j] = run;
  }
  __syncwarp();
  if (lane == 0) {
    u32 got = 0;
    const ModelView md{m, freq, cum, slot};
    s_err = decode_codes(pos + pos_at[c], pos_at[c + 1] - pos_at[c], steps + steps_at[c],
                         steps_at[c + 1] - steps_at[c], md, lo, hi, int(8 * sizeof(T)), k, CountsOf{pop}, rk, dd,
                         first, &got);
    s_k = got;
  }
  __syncwarp();
  const int e0 = s_err;
  const u32 kc = s_k;
  if (e0) {
    if (lane == 0) {
      err[c] = e0;
      count[c] = 0;
    }
    return;
  }
  u32 mine = 0;  // changes whose element lies in this lane's segment
  for (u32 j = 0; j < span; ++j) {
    const u32 idx = j * WL + lane;
    const u32 b = first[lo + j], e = first[lo + j + 1];
    if (b == e) {
      want[idx] = NONE;
      pt[idx] = e;
      continue;
    }
    const u32 p0 = cnt[idx];
    const u32 p1 = lane + 1 < WL ? u32(cnt[idx + 1]) : pop[lo + j];
    const u32 s0 = lower_rank(rk, b, e, p0);
    mine += lower_rank(rk, s0, e, p1) - s0;
    pt[idx] = s0;
    want[idx] = s0 < e ? u16(rk[s0]) : NONE;  // ranks < the class's count <= 65536
  }
  u32 base = mine;  // inclusive scan over the lanes, then exclusive
  for (u32 o = 1; o < WL; o <<= 1) {
    const u32 t = __shfl_up_sync(FULL, base, o);
    if (lane >= o) base += t;
  }
  const u32 total = __shfl_sync(FULL, base, WL - 1);
  base -= mine;
  __syncwarp();  // every lane has read the others' counts before any moves its own
  u32 i = base;
  for (u32 o = a; o < z; ++o) {
    const u32 cl = value_class<T>(x[o], kind, shift, ebits) - u32(lo);
    if (cl >= span) continue;
    const u32 idx = cl * WL + lane;
    const u32 r = cnt[idx];
    cnt[idx] = u16(r + 1);
    if (r != want[idx]) continue;
    u32 j = pt[idx];
    const u32 e = first[lo + cl + 1];
    if (j >= e || rk[j] != r) continue;  // NONE met by a count of 65535
    off[at + i] = o;
    step[at + i] = dd[j];
    ++i;
    ++j;
    pt[idx] = j;
    want[idx] = j < e ? u16(rk[j]) : NONE;
  }
  // Every rank is below its class's count, so each lane places exactly its share (never otherwise).
  const bool bad = __any_sync(FULL, i - base != mine) || total != kc;
  if (lane == 0) {
    err[c] = bad ? int(PLACE) : int(OK);
    count[c] = bad ? 0 : kc;
  }
}

}  // namespace v2
}  // namespace ws

#define WS_V2_PARAMS(U)                                                                                         \
  const U *old, ws::u64 n, const ws::u64 *m, const ws::u32 *freq, const ws::u32 *cum, const ws::u8 *slot, int lo, \
      int hi, int kind, int shift, int ebits, ws::u64 k, const ws::u8 *pos, const ws::u64 *pos_at,               \
      const ws::u8 *steps, const ws::u64 *steps_at, ws::u32 *rank, ws::i64 *d, ws::u32 *ptr, ws::u32 *tables,  \
      ws::u32 *off, ws::i64 *step, ws::u32 *count, int *err
#define WS_V2_ARGS old, n, m, freq, cum, slot, lo, hi, kind, shift, ebits, k, pos, pos_at, steps, steps_at, rank, d, ptr, tables, off, step, count, err

extern "C" __global__ void v2_decode_1(WS_V2_PARAMS(ws::u8)) { ws::v2::decode_chunks<ws::u8>(WS_V2_ARGS); }
extern "C" __global__ void v2_decode_2(WS_V2_PARAMS(ws::u16)) { ws::v2::decode_chunks<ws::u16>(WS_V2_ARGS); }
extern "C" __global__ void v2_decode_4(WS_V2_PARAMS(ws::u32)) { ws::v2::decode_chunks<ws::u32>(WS_V2_ARGS); }
extern "C" __global__ void v2_decode_8(WS_V2_PARAMS(ws::u64)) { ws::v2::decode_chunks<ws::u64>(WS_V2_ARGS); }
