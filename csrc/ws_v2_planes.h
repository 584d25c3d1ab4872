// Delta codec v2 on the CPU, the fast path of a chunk: its classes as four bit planes over a window of
// fifteen classes. csrc/ws_v2.h runs a chunk here when the CPU has popcnt (x86-64-v2; AVX2 forms of the
// two loops over every element where it has that too) and a window holds the chunk's classes; otherwise
// the portable code (ws_v2.cuh's decode_chunk, ws_v2.h's count loop), which gives the same results.
//
// Both directions need every coded class's element count in a chunk, and a change's rank in its class
// (encode) or the element of a given rank (decode). The portable code counts class bytes in four tables,
// about 1.6 cycles an element on a Zen 3 core. Here each element gets a 4-bit code: its class minus w0 for
// the 15 classes of the window [w0, w0 + 15), and 15 for any other class (the rest). A float tensor's
// exponents fall off by about half per class below the top, so a window holds all but a few elements in
// ten thousand. The codes are kept as four bit planes, 64 elements a word: one class's mask in a word is
// four ANDs of planes or their complements, its count one popcnt, and a word's fifteen counts are a tree
// of 30 ANDs and 15 popcnts. Per word and class the count is kept (u16), and per block of 8 words the count
// before it, so an element of a given rank is one search over the class's blocks, one over 8 words (a
// prefix sum in a register) and a select in one word. The rest are listed in position order with their
// class while counting, and found from the list.
//
// The window is the one the previous chunk's counts chose, else the one below the top class; if more than
// len / REST_MAX elements fall outside it, the chunk's histogram chooses again, and a chunk no window holds
// (classes spread wider than a float's exponents: integers, uniform data) takes the portable path.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "ws_v2.cuh"
#include "xxh3_dispatch.h"  // use_avx2(): the AVX2 forms here follow xxh3's switch (WSYNC_NO_AVX2)

#if defined(__GNUC__) && defined(__x86_64__) && WS_V2_SSE2
#define WS_V2_PLANES 1
#include <immintrin.h>
#define WS_PLANES_FN __attribute__((target("popcnt")))
#define WS_PLANES_AVX2_FN __attribute__((target("popcnt,avx2")))
#else
#define WS_V2_PLANES 0
#endif

namespace wsync {
namespace v2 {
namespace planes {

using ws::u16;
using ws::u32;
using ws::u64;
using ws::u8;

constexpr int NWIN = 15;               // classes in the window; code 15 is the rest
constexpr u32 WORDS = ws::CHUNK / 64;  // a chunk's words of 64 elements
constexpr u32 BW = 8;                  // words per block
constexpr u32 NBLK = WORDS / BW;
constexpr u32 REST_MAX = 64;           // more than len / REST_MAX elements in the rest: the portable path
constexpr u32 REST_CAP = WORDS;        // = CHUNK / REST_MAX: the longest rest list kept
// A row of wc. Padded past WORDS so that the fifteen rows the counting loop writes side by side do not
// fall in the same few sets of the L1 cache (2 KiB apart, they would share two).
constexpr u32 WC_ROW = WORDS + 32;
constexpr int FALLBACK = -1;           // decode_chunk's answer for a chunk the window does not hold

// Whether this CPU runs the planes (WSYNC_V2_PORTABLE=1 turns them off: the tests compare both paths).
inline bool enabled() {
#if WS_V2_PLANES
  static const bool yes = __builtin_cpu_supports("popcnt") && !std::getenv("WSYNC_V2_PORTABLE");
  return yes;
#else
  return false;
#endif
}

// One chunk's planes and counts (a thread's scratch, scratch(): about 330 KiB, mostly tmp).
struct Planes {
  alignas(64) u64 p[WORDS / 4][4][4];  // plane i of word w at [w / 4][i][w % 4] (code 15 past len, to a group's end)
  u16 wc[NWIN][WC_ROW];      // window class j's count in word w (0 past the last word, to the block's end)
  u32 snap[NWIN][NBLK + 1];  // window class j's count before block b
  u32 cnt[NWIN];             // window class j's count in the chunk
  u32 rest[256];             // the counts of the classes outside the window
  u16 rest_at[REST_CAP];     // the rest's elements in position order
  u8 rest_cls[REST_CAP];     // and their classes
  u32 tmp[ws::CHUNK];        // decode_chunk's scratch for sorting
  u32 nrest;
  u32 len, words;
  int w0;                    // the window: classes [w0, w0 + NWIN)
  int hint = -1;             // the window build tries first (chosen by the chunk built before)

  bool in_window(int c) const { return c >= w0 && c < w0 + NWIN; }
  u64 plane(int i, u32 w) const { return p[w >> 2][i][w & 3]; }
  u64 pop(int c) const { return in_window(c) ? cnt[c - w0] : rest[c]; }
};

// Counts the class bytes of[from, to) into four tables, element by element in turn, so that four
// increment chains through memory run at once; a class's count is the sum of its four. (The portable
// encoder's counting and the planes' histogram.)
inline void count_bytes4(const u8* of, u32 from, u32 to, u32 (*h)[256]) {
  u32 o = from;
  for (; o + 4 <= to; o += 4) {
    h[0][of[o]]++;
    h[1][of[o + 1]]++;
    h[2][of[o + 2]]++;
    h[3][of[o + 3]]++;
  }
  for (; o < to; ++o) h[0][of[o]]++;
}

// This thread's Planes, made on first use.
inline Planes& scratch() {
  thread_local std::unique_ptr<Planes> pl;
  if (!pl) pl.reset(new Planes);
  return *pl;
}

#if WS_V2_PLANES
// The class bytes of 16 elements of old (kind 0: a float's exponent, its top 8 bits where it has more;
// value_class), for the widths that have a vector form; classes() is the scalar reference.
template <class T>
WS_PLANES_FN inline __m128i classes16(const T* old, __m128i count, __m128i keep) {
  const __m128i* p = reinterpret_cast<const __m128i*>(old);
  if (sizeof(T) == 2)
    return _mm_packus_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(p), count), keep),
                            _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128(p + 1), count), keep));
  const __m128i lo = _mm_packs_epi32(_mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p), count), keep),
                                     _mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p + 1), count), keep));
  const __m128i hi = _mm_packs_epi32(_mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p + 2), count), keep),
                                     _mm_and_si128(_mm_srl_epi32(_mm_loadu_si128(p + 3), count), keep));
  return _mm_packus_epi16(lo, hi);
}

// Where a chunk's classes come from: straight from the base (a float of 2 or 4 bytes), or from the class
// bytes classes() wrote (every other kind and width).
template <class T>
struct Source {
  const T* old;
  const u8* of;  // null: from old
  int kind, shift, ebits;
  bool vector() const { return !of; }
  u32 cls(u32 o) const { return of ? of[o] : ws::v2::value_class<T>(old[o], kind, shift, ebits); }
};

template <class T>
inline bool vector_classes(int kind) {
  return kind == 0 && (sizeof(T) == 2 || sizeof(T) == 4);
}

// The class bytes of elements [16 k, 16 k + 16).
template <class T>
WS_PLANES_FN inline __m128i group(const Source<T>& src, u32 k, __m128i count, __m128i keep) {
  return src.vector() ? classes16<T>(src.old + 16 * k, count, keep)
                      : _mm_loadu_si128(reinterpret_cast<const __m128i*>(src.of + 16 * k));
}

// Codes of 16 elements of classes cls into the planes (u16 piece k of each).
WS_PLANES_FN inline void put_codes(Planes& pl, u32 k, __m128i cls, __m128i w0v) {
  const __m128i code = _mm_min_epu8(_mm_sub_epi8(cls, w0v), _mm_set1_epi8(15));
  const u32 w = k / 4;  // word w's piece k % 4 of plane i: q[16 i]
  u16* q = reinterpret_cast<u16*>(&pl.p[w >> 2][0][w & 3]) + k % 4;
  q[0] = u16(_mm_movemask_epi8(_mm_slli_epi16(code, 7)));
  q[16] = u16(_mm_movemask_epi8(_mm_slli_epi16(code, 6)));
  q[32] = u16(_mm_movemask_epi8(_mm_slli_epi16(code, 5)));
  q[48] = u16(_mm_movemask_epi8(_mm_slli_epi16(code, 4)));
}

// The window's first class for a chunk's top class.
inline int window_of(u32 top) { return top >= NWIN - 1 ? int(top) - (NWIN - 1) : 0; }

// The largest byte of mx and t.
WS_PLANES_FN inline u32 hmax(__m128i mx, u32 t) {
  mx = _mm_max_epu8(mx, _mm_srli_si128(mx, 8));
  mx = _mm_max_epu8(mx, _mm_srli_si128(mx, 4));
  mx = _mm_max_epu8(mx, _mm_srli_si128(mx, 2));
  mx = _mm_max_epu8(mx, _mm_srli_si128(mx, 1));
  const u32 m = u32(_mm_cvtsi128_si32(mx)) & 0xFF;
  return m > t ? m : t;
}

// The window that holds the most of counts[256] (the highest of equals).
inline int best_window(const u32* counts) {
  u64 sum = 0;
  for (int c = 256 - NWIN; c < 256; ++c) sum += counts[c];
  u64 best = sum;
  int at = 256 - NWIN;
  for (int w = 256 - NWIN - 1; w >= 0; --w) {
    sum += counts[w];
    sum -= counts[w + NWIN];
    if (sum > best) best = sum, at = w;
  }
  return at;
}

// The shift and mask of a Source's vector classes.
struct Shift {
  __m128i count, keep;
};

template <class T>
WS_PLANES_FN inline Shift shift_of(const Source<T>& src) {
  const int drop = src.shift + (src.ebits > 8 ? src.ebits - 8 : 0);
  const u32 m2 = src.ebits > 8 ? 0xFF : (1u << src.ebits) - 1;
  return Shift{_mm_cvtsi32_si128(drop), sizeof(T) == 2 ? _mm_set1_epi16(short(m2)) : _mm_set1_epi32(int(m2))};
}

// The planes of the chunk's codes for the window [w0, w0 + NWIN); the groups of 16 from `from` on (those
// before it put by put_planes_avx2).
template <class T>
WS_PLANES_FN void put_planes(const Source<T>& src, u32 len, int w0, Planes& pl, u32 from = 0) {
  const Shift sh = shift_of(src);
  const __m128i w0v = _mm_set1_epi8(char(w0));
  const u32 groups = len / 16;
  for (u32 k = from; k < groups; ++k) put_codes(pl, k, group(src, k, sh.count, sh.keep), w0v);
  for (u32 k = groups; k < 4 * pl.words; ++k) {  // the last word's groups: the tail's classes, then code 15
    alignas(16) u8 tail[16];
    for (u32 i = 0; i < 16; ++i) tail[i] = 16 * k + i < len ? u8(src.cls(16 * k + i)) : u8(w0 + NWIN);
    put_codes(pl, k, _mm_load_si128(reinterpret_cast<const __m128i*>(tail)), w0v);
  }
  for (u32 w = pl.words; w % 4; ++w)  // the last group's words past the chunk: code 15
    for (int i = 0; i < 4; ++i) pl.p[w >> 2][i][w & 3] = ~u64(0);
  pl.w0 = w0;
}

// Word w's rest elements (mask r: code 15) onto the list, with their classes counted. False: the list
// outgrew its bound (len / REST_MAX).
template <class T>
inline bool list_rest(const Source<T>& src, u32 len, Planes& pl, u32 w, u64 r, u32& nrest) {
  if (w == pl.words - 1 && len % 64) r &= (u64(1) << (len % 64)) - 1;  // the last word's bits past len
  for (; r; r &= r - 1) {
    if (nrest == REST_CAP || u64(nrest + 1) * REST_MAX > len) return false;
    const u32 o = w * 64 + u32(__builtin_ctzll(r));
    const u32 c = src.cls(o);
    pl.rest_at[nrest] = u16(o);
    pl.rest_cls[nrest++] = u8(c);
    ++pl.rest[c];
  }
  return true;
}

// The counts of the planes: per word and window class (wc), the rest listed. False: the rest outgrew its
// bound (len / REST_MAX).
template <class T>
WS_PLANES_FN bool count_words(const Source<T>& src, u32 len, Planes& pl) {
  u32 nrest = 0;
  std::memset(pl.rest, 0, sizeof(pl.rest));
  for (u32 w = 0; w < pl.words; ++w) {
    const u64 a = pl.plane(0, w), b = pl.plane(1, w), x = pl.plane(2, w), d = pl.plane(3, w);
    const u64 na = ~a, nb = ~b;
    const u64 t[4] = {~d & ~x, ~d & x, d & ~x, d & x};  // class j = 8 d + 4 x + 2 b + a
    for (int h = 0; h < 4; ++h) {
      const u64 lo = t[h] & nb, hi = t[h] & b;
      pl.wc[4 * h + 0][w] = u16(__builtin_popcountll(lo & na));
      pl.wc[4 * h + 1][w] = u16(__builtin_popcountll(lo & a));
      pl.wc[4 * h + 2][w] = u16(__builtin_popcountll(hi & na));
      if (h < 3) pl.wc[4 * h + 3][w] = u16(__builtin_popcountll(hi & a));
    }
    if (!list_rest(src, len, pl, w, d & x & b & a, nrest)) return false;
  }
  pl.nrest = nrest;
  return true;
}

// With AVX2 (use_avx2()): put_planes's groups 32 elements at a time, straight from a float base, and
// count_words's tree four words at a time, each lane's popcount by nibble lookups (AVX2 has no popcnt of
// its own). The same planes and counts as the SSE2 forms beside them.

// The class bytes of 32 elements of old, in order (vector_classes kinds).
template <class T>
WS_PLANES_AVX2_FN inline __m256i classes32(const T* old, __m128i count, __m256i keep) {
  const __m256i* p = reinterpret_cast<const __m256i*>(old);
  if (sizeof(T) == 2) {  // the pack interleaves the 128-bit lanes: the qword permute puts them back
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(p), count), keep);
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(p + 1), count), keep);
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(lo, hi), 0xD8);
  }
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256(p + i), count), keep);
  const __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// put_planes for a float base: the whole groups of 32, then put_planes for what is left.
template <class T>
WS_PLANES_AVX2_FN void put_planes_avx2(const Source<T>& src, u32 len, int w0, Planes& pl) {
  const Shift sh = shift_of(src);
  const __m256i keep = _mm256_broadcastsi128_si256(sh.keep);
  const __m256i w0v = _mm256_set1_epi8(char(w0)), c15 = _mm256_set1_epi8(15);
  const u32 halves = len / 32;  // half words
  for (u32 h = 0; h < halves; ++h) {
    const __m256i code = _mm256_min_epu8(_mm256_sub_epi8(classes32<T>(src.old + 32 * h, sh.count, keep), w0v), c15);
    const u32 w = h / 2;
    u32* q = reinterpret_cast<u32*>(&pl.p[w >> 2][0][w & 3]) + h % 2;  // plane i's half: q[8 i]
    q[0] = u32(_mm256_movemask_epi8(_mm256_slli_epi16(code, 7)));
    q[8] = u32(_mm256_movemask_epi8(_mm256_slli_epi16(code, 6)));
    q[16] = u32(_mm256_movemask_epi8(_mm256_slli_epi16(code, 5)));
    q[24] = u32(_mm256_movemask_epi8(_mm256_slli_epi16(code, 4)));
  }
  put_planes(src, len, w0, pl, 2 * halves);
}

// Each u64 lane's popcount.
WS_PLANES_AVX2_FN inline __m256i popcount4(__m256i v) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2,
                                       2, 3, 2, 3, 3, 4);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i n = _mm256_add_epi8(_mm256_shuffle_epi8(lut, _mm256_and_si256(v, low)),
                                    _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low)));
  return _mm256_sad_epu8(n, _mm256_setzero_si256());
}

// Four words' counts of one class (u64 lanes, each <= 64) as four u16 at row[w..w+4).
WS_PLANES_AVX2_FN inline void put_counts(u16* row, __m256i c) {
  const __m128i d = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(row), _mm_packs_epi32(d, d));
}

// count_words four words at a time.
template <class T>
WS_PLANES_AVX2_FN bool count_words_avx2(const Source<T>& src, u32 len, Planes& pl) {
  u32 nrest = 0;
  std::memset(pl.rest, 0, sizeof(pl.rest));
  const __m256i ones = _mm256_set1_epi8(-1);
  for (u32 g = 0; g < (pl.words + 3) / 4; ++g) {
    const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(pl.p[g][0]));
    const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(pl.p[g][1]));
    const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(pl.p[g][2]));
    const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(pl.p[g][3]));
    const __m256i t[4] = {_mm256_andnot_si256(d, _mm256_xor_si256(x, ones)), _mm256_andnot_si256(d, x),
                          _mm256_andnot_si256(x, d), _mm256_and_si256(d, x)};  // class j = 8 d + 4 x + 2 b + a
    for (int h = 0; h < 4; ++h) {
      const __m256i lo = _mm256_andnot_si256(b, t[h]), hi = _mm256_and_si256(t[h], b);
      put_counts(pl.wc[4 * h + 0] + 4 * g, popcount4(_mm256_andnot_si256(a, lo)));
      put_counts(pl.wc[4 * h + 1] + 4 * g, popcount4(_mm256_and_si256(lo, a)));
      put_counts(pl.wc[4 * h + 2] + 4 * g, popcount4(_mm256_andnot_si256(a, hi)));
      if (h < 3) put_counts(pl.wc[4 * h + 3] + 4 * g, popcount4(_mm256_and_si256(hi, a)));
    }
    const __m256i r4 = _mm256_and_si256(t[3], _mm256_and_si256(b, a));
    if (_mm256_testz_si256(r4, r4)) continue;
    alignas(32) u64 rw[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(rw), r4);
    for (u32 i = 0; i < 4 && 4 * g + i < pl.words; ++i)
      if (!list_rest(src, len, pl, 4 * g + i, rw[i], nrest)) return false;
  }
  pl.nrest = nrest;
  return true;
}

// Every class's count in the chunk the slow way (four count tables over the class bytes, put in bytes as
// scratch first where they come from the base): for choosing a window when the guessed one failed.
template <class T>
WS_PLANES_FN void histogram(const Source<T>& src, u32 len, u8* bytes, u32* counts) {
  const u8* of = src.of;
  if (src.vector()) {
    const Shift sh = shift_of(src);
    for (u32 k = 0; k < len / 16; ++k)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + 16 * k), classes16<T>(src.old + 16 * k, sh.count, sh.keep));
    for (u32 o = len / 16 * 16; o < len; ++o) bytes[o] = u8(src.cls(o));
    of = bytes;
  }
  u32 h[4][256] = {};
  count_bytes4(of, 0, len, h);
  for (int c = 0; c < 256; ++c) counts[c] = h[0][c] + h[1][c] + h[2][c] + h[3][c];
}

// Builds and counts the planes of a chunk of len elements; scratch: len bytes the call may overwrite (the
// class bytes when src reads from them). The window is the one the last chunk's counts chose (Planes keeps
// it: chunks of a tensor nearly always agree), else the top class's; if the rest outgrows its bound there,
// the window that holds the most of this chunk is taken from its full histogram and the planes made again.
// False: even that window leaves too many elements outside (the caller takes the portable path).
template <class T>
WS_PLANES_FN bool build(const Source<T>& src, u32 len, Planes& pl, u8* scratch) {
  pl.len = len;
  pl.words = (len + 63) / 64;
  int w0 = pl.hint;
  if (w0 < 0) {
    const Shift sh = shift_of(src);
    __m128i mx = _mm_setzero_si128();
    for (u32 k = 0; k < len / 16; ++k) mx = _mm_max_epu8(mx, group(src, k, sh.count, sh.keep));
    u32 tail = 0;
    for (u32 o = len / 16 * 16; o < len; ++o) tail = src.cls(o) > tail ? src.cls(o) : tail;
    w0 = window_of(hmax(mx, tail));
  }
  const bool wide = use_avx2();
  auto planes_for = [&](int w) {  // (lambdas take no target: these call out to the targeted forms)
    if (wide && src.vector())
      put_planes_avx2(src, len, w, pl);
    else
      put_planes(src, len, w, pl);
    return wide ? count_words_avx2(src, len, pl) : count_words(src, len, pl);
  };
  u32 counts[256];
  if (!planes_for(w0)) {
    histogram(src, len, scratch, counts);
    const int best = best_window(counts);
    pl.hint = best;
    if (best == w0 || !planes_for(best)) return false;
  }
  // per window class, its count before each block and in the chunk
  const u32 nb = (pl.words + BW - 1) / BW;
  for (int j = 0; j < NWIN; ++j) {
    u16* row = pl.wc[j];
    for (u32 w = pl.words; w < nb * BW; ++w) row[w] = 0;
    u32 s = 0;
    for (u32 g = 0; g < nb; ++g) {
      pl.snap[j][g] = s;
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * BW));  // 8 counts <= 64
      const __m128i s4 = _mm_madd_epi16(v, _mm_set1_epi16(1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s += u32(_mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1))));
    }
    for (u32 g = nb; g <= NBLK; ++g) pl.snap[j][g] = s;
    pl.cnt[j] = s;
  }
  // the next chunk's window: the best for this one's counts
  for (int c = 0; c < 256; ++c) counts[c] = pl.in_window(c) ? pl.cnt[c - pl.w0] : pl.rest[c];
  pl.hint = best_window(counts);
  return true;
}

// The running sums of a class's 8 word counts in block g (row: its wc): lane i holds words 0..i.
WS_PLANES_FN inline __m128i block_prefix(const u16* row, u32 g) {
  __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * BW));
  p = _mm_add_epi16(p, _mm_slli_si128(p, 2));
  p = _mm_add_epi16(p, _mm_slli_si128(p, 4));
  return _mm_add_epi16(p, _mm_slli_si128(p, 8));
}

// Window class j's mask in word w: each plane as is where j has the bit, complemented where not.
struct ClassMask {
  u64 f0, f1, f2, f3;
  explicit ClassMask(int j)
      : f0(j & 1 ? 0 : ~u64(0)), f1(j & 2 ? 0 : ~u64(0)), f2(j & 4 ? 0 : ~u64(0)), f3(j & 8 ? 0 : ~u64(0)) {}
  u64 operator()(const Planes& pl, u32 w) const {
    return (pl.plane(0, w) ^ f0) & (pl.plane(1, w) ^ f1) & (pl.plane(2, w) ^ f2) & (pl.plane(3, w) ^ f3);
  }
};

// The elements of class cls of ranks rank[0..n) (increasing; each meant to be < the class's count), coding
// indexes first + i: key[i] = offset << 16 | (first + i) (key may be rank: each rank is read before its key
// is written). False if a rank has no element (a corrupt payload that got this far).
WS_PLANES_FN inline bool place(const Planes& pl, int cls, const u32* rank, u32 n, u32 first, u32* key) {
  if (pl.in_window(cls)) {
    const int j = cls - pl.w0;
    const ClassMask mask(j);
    const u32* snap = pl.snap[j];
    const u16* row = pl.wc[j];
    const u32 nb = (pl.words + BW - 1) / BW;
    u32 g = 0;
    for (u32 i = 0; i < n; ++i) {
      const u32 r = rank[i];
      g = ws::v2::block_of(snap, g, nb, r);
      const u32 need = r - snap[g];
      const __m128i incl = block_prefix(row, g);
      // the first word whose inclusive count passes need (counts <= 512: signed compares are exact)
      const u32 past = u32(_mm_movemask_epi8(_mm_cmpgt_epi16(incl, _mm_set1_epi16(short(need)))));
      if (!past) return false;
      const u32 wi = u32(__builtin_ctz(past)) / 2;
      alignas(16) u16 lanes[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(lanes), _mm_slli_si128(incl, 2));  // exclusive
      const u32 w = g * BW + wi;
      const u32 a = ws::v2::select64(mask(pl, w), need - lanes[wi]);
      if (a >= 64) return false;
      key[i] = (w * 64 + a) << 16 | (first + i);
    }
    return true;
  }
  u32 i = 0, seen = 0;
  for (u32 e = 0; e < pl.nrest && i < n; ++e)
    if (pl.rest_cls[e] == cls && seen++ == rank[i]) {
      key[i] = u32(pl.rest_at[e]) << 16 | (first + i);
      ++i;
    }
  return i == n;
}

// The rank in its class of the element at o, of window class cls.
WS_PLANES_FN inline u32 rank_of(const Planes& pl, int cls, u32 o) {
  const int j = cls - pl.w0;
  const u32 w = o / 64, g = w / BW, wi = w % BW;
  alignas(16) u16 lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), _mm_slli_si128(block_prefix(pl.wc[j], g), 2));
  const u64 below = ClassMask(j)(pl, w) & ((u64(1) << (o % 64)) - 1);
  return pl.snap[j][g] + lanes[wi] + u32(__builtin_popcountll(below));
}

// Encoding's counts: builds the planes of old[0..len) and sets each change's class and rank (v[0..n),
// in offset order, with .off set). False, nothing set: the window does not hold the chunk.
template <class T, class Change>
WS_PLANES_FN bool rank_changes(const T* old, u32 len, int kind, int shift, int ebits, u8* of, Planes& pl, Change* v,
                               size_t n) {
  Source<T> src{old, nullptr, kind, shift, ebits};
  if (!vector_classes<T>(kind)) {
    ws::v2::classes<T>(old, len, kind, shift, ebits, of);
    src.of = of;
  }
  if (!build(src, len, pl, of)) return false;
  u32 e = 0, seen[256];
  bool rest_seen = false;
  for (size_t i = 0; i < n; ++i) {
    Change& x = v[i];
    const int c = int(src.cls(x.off));
    x.cls = u16(c);
    if (pl.in_window(c)) {
      x.rank = rank_of(pl, c, x.off);
      continue;
    }
    if (!rest_seen) {  // the rest's classes counted along the list as the offsets grow
      std::memset(seen, 0, sizeof(seen));
      rest_seen = true;
    }
    for (; e < pl.nrest && pl.rest_at[e] < x.off; ++e) ++seen[pl.rest_cls[e]];
    x.rank = seen[c];
  }
  return true;
}

struct PlanePop {
  const Planes* pl;
  u64 operator()(int c) const { return pl->pop(c); }
};

// decode_chunk (ws_v2.cuh) over the planes: the same changes and errors; FALLBACK, nothing emitted, for a
// chunk the window does not hold. sc.of: scratch for the class bytes of the kinds without a vector form.
template <class T, class Emit>
WS_PLANES_FN int decode_chunk(const T* old, u32 len, const u8* pb, u64 plen, const u8* sb, u64 slen,
                              ws::v2::ModelView md, int lo, int hi, int kind, int shift, int ebits, u64 budget,
                              ws::v2::Scratch sc, Planes& pl, Emit& emit, u32* count) {
  Source<T> src{old, nullptr, kind, shift, ebits};
  if (!vector_classes<T>(kind)) {
    ws::v2::classes<T>(old, len, kind, shift, ebits, sc.of);
    src.of = sc.of;
  }
  if (!build(src, len, pl, sc.of)) return FALLBACK;
  u32 k = 0;
  {
    const int e = ws::v2::decode_codes(pb, plen, sb, slen, md, lo, hi, int(8 * sizeof(T)), budget, PlanePop{&pl},
                                       sc.rank, sc.d, sc.first, &k);
    if (e) return e;
  }
  // each class's changes placed (their keys over their ranks), the keys sorted by offset (two passes of a
  // byte each; the offsets are distinct), then handed over in position order
  u32* key = sc.rank;
  for (int c = lo; c < hi; ++c) {
    const u32 f = sc.first[c], n = sc.first[c + 1] - f;
    if (n && !place(pl, c, sc.rank + f, n, f, key + f)) return ws::v2::PLACE;
  }
  u32 h0[256] = {}, h1[256] = {};
  for (u32 j = 0; j < k; ++j) {
    ++h0[(key[j] >> 16) & 0xFF];
    ++h1[key[j] >> 24];
  }
  for (u32 b = 0, s0 = 0, s1 = 0; b < 256; ++b) {
    const u32 c0 = h0[b], c1 = h1[b];
    h0[b] = s0;
    h1[b] = s1;
    s0 += c0;
    s1 += c1;
  }
  u32* tmp = pl.tmp;
  for (u32 j = 0; j < k; ++j) tmp[h0[(key[j] >> 16) & 0xFF]++] = key[j];
  for (u32 j = 0; j < k; ++j) key[h1[tmp[j] >> 24]++] = tmp[j];
  for (u32 i = 0; i < k; ++i) emit(i, key[i] >> 16, sc.d[key[i] & 0xFFFF]);
  *count = k;
  return ws::v2::OK;
}
#endif

}  // namespace planes
}  // namespace v2
}  // namespace wsync
