"""Reference delta codec v2: the readable specification of the `delta-v2` kind (tier `v2`).

This file *is* the format. The C++ (and CUDA) twins must produce the same bytes.

v2 codes the same changes as v1 (delta_ref: which elements changed, and the
signed step d = key(new) - key(old) of each, in monotone keys), near their
entropy, with the base as context. Both sides know the base, so both know each
element's **class** (value_class: a float's exponent field, an integer's bit
length), and a value's chance of changing depends strongly on it: Adam moves
every weight by about lr, and a bf16 value changes when lr crosses half its ulp,
which doubles with each exponent.

Chunks of C = 65536 elements (the last may be short) are coded independently,
each into a position bitstream and a step rANS stream, so a GPU decodes one
chunk per thread. Within a chunk the changes are taken in **coding order**:
by class ascending, then by position.

Model (part `model`, LEB128 varints):
  K                      changes in the segment
  lo, hi                 classes lo..hi-1 follow (0 <= lo <= hi <= 256); every other class has m_c = 0
  for each class c in lo..hi-1:
    m_c                  Golomb parameter of class c; 0: no element of class c changes anywhere
    if m_c > 0: F_c[15]  step frequencies of class c, summing to 4096

Positions (part `pos`, one bitstream per chunk, bits LSB first within bytes).
For each class c with m_c > 0, in order, let P be the class-c elements of the
chunk in position order (|P| = pop). The changed ones are coded by their ranks
in P: each as the gap g >= 0 from the previous changed rank + 1 (the first from
rank 0), with r = the ranks left; then an end mark. A gap is Golomb(m_c)
truncated by r: q = g // m_c as q one bits then a zero bit, where the reader
stops at q * m_c >= r (that is the end mark, no zero bit); then g - q * m_c in
truncated binary over min(m_c, r - q * m_c) values (k = floor(log2 s) bits;
values >= u = 2^(k+1) - s take a (k+1)-th bit: the k high bits, then the low
bit). So the end costs about what "no further change in r" costs an ideal coder.

Steps (part `steps`, one rANS stream per chunk): each change's symbol, in
coding order, with class c's frequencies: d in -7..-1 -> d + 7, d in 1..7 ->
d + 6, anything else ESC = 14. rANS: 32-bit state, 12-bit probabilities, byte
renormalisation at L = 2^23, the state's 4 bytes little-endian first; the
encoder runs backwards from state L, so a decoder that ends anywhere but L
with every byte read has a corrupt stream.

Escapes follow the gaps in the chunk's position bitstream, in coding order:
a sign bit (1 = negative), then |d| - 7 in Elias gamma (n zero bits, a one
bit, the n low bits of the value, n = bit_length - 1). |d| <= 2^(8W-1), and
d = +2^(8W-1) is never written (it is -2^(8W-1) modulo 2^(8W)).

Index (part `index`, varints): per chunk, the byte lengths of its position
bitstream and of its rANS stream; they tile `pos` and `steps` exactly. Padding
bits at a bitstream's end are zero.

A segment is stored as a delta only when something changed and v1's sparse
sections would be smaller than the tensor (K >= 1 and 8 * nchunks + 3 * K <
n * W); a decoder refuses a K that breaks that rule, so a delta never makes a
receiver allocate more than v1 would. Decoding validates
every count, length, parameter and frequency; bad input raises FormatError.
"""
from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..manifest import CHUNK_ELEMS
from . import delta_ref
from .delta_ref import DeltaSections

# mantissa bits of each float dtype: the exponent field sits just above them
MANTISSA_BITS = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52, "F8_E4M3": 3, "F8_E5M2": 2}
NCLASS = 256
NSYM = 15
ESC = 14
SMALL = 7  # steps -SMALL..SMALL have their own symbol
PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 23
PARTS = ("model", "index", "pos", "steps")


# --- context --------------------------------------------------------------------------

def value_class(bits: np.ndarray, dtype) -> np.ndarray:
    """uint8 class of each base value: floats their exponent field (F64: its top 8 bits), integers the
    bit length of their magnitude (~x for negative ints), unsigned ints and bool their bit length."""
    bits = np.asarray(bits)
    w = 8 * bits.dtype.itemsize
    t = bits.dtype.type
    if dtype.order == "float":
        m = MANTISSA_BITS[dtype.name]
        e = (bits >> t(m)) & t((1 << (w - 1 - m)) - 1)
        if w - 1 - m > 8:
            e = e >> t(w - 1 - m - 8)
        return e.astype(np.uint8)
    mag = np.where((bits & t(1 << (w - 1))) != 0, ~bits, bits) if dtype.order == "int" else bits
    return _bit_length(mag)


def class_spec(dtype) -> tuple[int, int, int]:
    """value_class as the C++ and CUDA kernels take it: (kind, shift, ebits); kind 0 is a float's exponent
    field (shift: mantissa bits, ebits: exponent bits), 1 and 2 the bit length of an int's or uint's value."""
    if dtype.order == "float":
        m = MANTISSA_BITS[dtype.name]
        return 0, m, 8 * dtype.itemsize - 1 - m
    return (1 if dtype.order == "int" else 2), 0, 0


def _bit_length(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape, np.uint8)
    x = x.astype(np.uint64)
    for s in (32, 16, 8, 4, 2, 1):
        big = x >= (np.uint64(1) << np.uint64(s))
        out[big] += s
        x = np.where(big, x >> np.uint64(s), x)
    out[x > 0] += 1
    return out


def golomb_param(n: int, k: int) -> int:
    """The encoder's m for a class of n elements of which k change: round(ln 2 * n / k), at least 1.
    Integer arithmetic (2839/4096 ~ ln 2), so every twin picks the same m."""
    return 0 if k == 0 else max(1, (n * 2839 + k * 2048) // (k * 4096))


def quantize(counts: np.ndarray) -> list[int]:
    """Frequencies summing to PROB_SCALE, every seen symbol at least 1: floor(count * 4096 / total),
    raised to 1, then the difference to 4096 added to the first most frequent symbol."""
    total = int(counts.sum())
    f = [0 if c == 0 else max(1, int(c) * PROB_SCALE // total) for c in counts]
    top = max(range(NSYM), key=lambda s: (counts[s], -s))
    f[top] += PROB_SCALE - sum(f)
    return f


def symbol(d: np.ndarray) -> np.ndarray:
    return np.where((d >= -SMALL) & (d < 0), d + SMALL, np.where((d > 0) & (d <= SMALL), d + SMALL - 1, ESC))


# --- bits and varints -----------------------------------------------------------------

class BitWriter:
    def __init__(self):
        self.acc, self.n, self.out = 0, 0, bytearray()

    def put(self, value: int, nbits: int) -> None:
        self.acc |= (value & ((1 << nbits) - 1)) << self.n
        self.n += nbits
        while self.n >= 8:
            self.out.append(self.acc & 0xFF)
            self.acc >>= 8
            self.n -= 8

    def finish(self) -> bytes:
        if self.n:
            self.out.append(self.acc & 0xFF)
        return bytes(self.out)


class BitReader:
    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what  # pos counts bits

    def get(self, nbits: int) -> int:
        if self.pos + nbits > 8 * len(self.data):
            raise FormatError(f"{self.what}: bitstream ends early")
        v = 0
        for i in range(nbits):
            p = self.pos + i
            v |= ((self.data[p >> 3] >> (p & 7)) & 1) << i
        self.pos += nbits
        return v

    def finish(self) -> None:
        """Only zero padding may remain, and less than a byte of it."""
        left = 8 * len(self.data) - self.pos
        if left >= 8 or (left and self.get(left)):
            raise FormatError(f"{self.what}: {left} bits left over after the last code")


def put_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def get_varint(buf, at: int, what: str, limit: int) -> tuple[int, int]:
    """(value, next offset); at most 10 bytes, value <= limit."""
    v = shift = 0
    for i in range(10):
        if at + i >= len(buf):
            break
        b = buf[at + i]
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            if v > limit:
                raise FormatError(f"{what}: {v} is over the limit {limit}")
            return v, at + i + 1
    raise FormatError(f"{what}: truncated or overlong varint")


# --- Golomb gaps and escapes ----------------------------------------------------------

def put_gap(w: BitWriter, g: int | None, m: int, r: int) -> None:
    """g: a gap < r, or None for the end mark."""
    if g is None:
        for _ in range(-(-r // m)):
            w.put(1, 1)
        return
    q = g // m
    for _ in range(q):
        w.put(1, 1)
    w.put(0, 1)
    _put_truncated(w, g - q * m, min(m, r - q * m))


def get_gap(rd: BitReader, m: int, r: int) -> int | None:
    q = 0
    while q * m < r:
        if not rd.get(1):
            return q * m + _get_truncated(rd, min(m, r - q * m))
        q += 1
    return None


def _put_truncated(w: BitWriter, v: int, s: int) -> None:
    if s == 1:
        return
    k = s.bit_length() - 1
    u = (1 << (k + 1)) - s
    if v < u:
        w.put(v, k)
    else:
        w.put((v + u) >> 1, k)
        w.put((v + u) & 1, 1)


def _get_truncated(rd: BitReader, s: int) -> int:
    if s == 1:
        return 0
    k = s.bit_length() - 1
    u = (1 << (k + 1)) - s
    v = rd.get(k)
    return v if v < u else ((v << 1) | rd.get(1)) - u


def put_escape(w: BitWriter, d: int) -> None:
    w.put(1 if d < 0 else 0, 1)
    v = abs(d) - SMALL
    n = v.bit_length() - 1
    w.put(0, n)
    w.put(1, 1)
    w.put(v, n)


def get_escape(rd: BitReader, width_bits: int) -> int:
    neg = rd.get(1)
    n = 0
    while not rd.get(1):
        n += 1
        if n >= width_bits:
            raise FormatError(f"{rd.what}: escape longer than a {width_bits}-bit step")
    v = (1 << n) | rd.get(n)
    mag = v + SMALL
    if mag > 1 << (width_bits - 1) or (mag == 1 << (width_bits - 1) and not neg):
        raise FormatError(f"{rd.what}: escape step {'-' if neg else ''}{mag} does not fit {width_bits} bits")
    return -mag if neg else mag


# --- rANS -----------------------------------------------------------------------------

def rans_encode(syms: list[int], tables: list[list[int]]) -> bytes:
    """syms[i] coded with frequency table tables[i] (a class's F, cumulated here)."""
    x = RANS_L
    out = bytearray()  # bytes in reverse order
    for s, f in zip(reversed(syms), reversed(tables)):
        freq, cum = f[s], sum(f[:s])
        x_max = ((RANS_L >> PROB_BITS) << 8) * freq
        while x >= x_max:
            out.append(x & 0xFF)
            x >>= 8
        x = ((x // freq) << PROB_BITS) + (x % freq) + cum
    for _ in range(4):
        out.append((x >> 24) & 0xFF)
        x = (x << 8) & 0xFFFFFFFF
    out.reverse()
    return bytes(out)


class RansDecoder:
    def __init__(self, data: bytes, what: str):
        if len(data) < 4:
            raise FormatError(f"{what}: rANS stream of {len(data)} bytes, needs at least 4")
        self.data, self.what = data, what
        self.x = int.from_bytes(data[:4], "little")
        self.pos = 4
        if not RANS_L <= self.x < RANS_L << 8:
            raise FormatError(f"{what}: rANS state {self.x:#x} outside [2^23, 2^31)")

    def get(self, f: list[int], cum: list[int], slot_sym: bytes) -> int:
        slot = self.x & (PROB_SCALE - 1)
        s = slot_sym[slot]
        self.x = f[s] * (self.x >> PROB_BITS) + slot - cum[s]
        while self.x < RANS_L:
            if self.pos >= len(self.data):
                raise FormatError(f"{self.what}: rANS stream ends early")
            self.x = (self.x << 8) | self.data[self.pos]
            self.pos += 1
        return s

    def finish(self) -> None:
        if self.x != RANS_L or self.pos != len(self.data):
            raise FormatError(f"{self.what}: rANS stream does not end where it should (corrupt)")


# --- encode ---------------------------------------------------------------------------

def changes(old: np.ndarray, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, signed steps int64) of the changes v1's sections describe."""
    pos, values = delta_ref.decode(old, sec, order)
    w = old.dtype.itemsize
    d = (delta_ref.monotone_key(values, order) - delta_ref.monotone_key(old[pos], order)).view(f"<i{w}")
    return pos, d.astype(np.int64)


def encode(old: np.ndarray, sec: DeltaSections, dtype) -> dict[str, bytes]:
    """The v2 parts of the changes v1's sections describe, against base bits old (1-D <uW)."""
    pos, d = changes(old, sec, dtype.order)
    return encode_changes(old, pos, d, dtype)


def encode_changes(old: np.ndarray, pos: np.ndarray, d: np.ndarray, dtype) -> dict[str, bytes]:
    n = len(old)
    cls = value_class(old, dtype)
    ccls = cls[pos]
    sym = symbol(d.astype(np.int64))
    n_c = np.bincount(cls, minlength=NCLASS)
    k_c = np.bincount(ccls, minlength=NCLASS)
    m = [golomb_param(int(n_c[c]), int(k_c[c])) for c in range(NCLASS)]
    freqs = {c: quantize(np.bincount(sym[ccls == c], minlength=NSYM)) for c in range(NCLASS) if m[c]}
    model = bytearray()
    put_varint(model, len(pos))
    used = [c for c in range(NCLASS) if m[c]]
    lo, hi = (used[0], used[-1] + 1) if used else (0, 0)
    put_varint(model, lo)
    put_varint(model, hi)
    for c in range(lo, hi):
        put_varint(model, m[c])
        for f in freqs.get(c, ()):
            put_varint(model, f)

    index, pos_out, steps_out = bytearray(), bytearray(), bytearray()
    chunk_of = pos // CHUNK_ELEMS
    bounds = np.searchsorted(chunk_of, np.arange(delta_ref.nchunks(n) + 1))
    for ch in range(delta_ref.nchunks(n)):
        lo, hi = int(bounds[ch]), int(bounds[ch + 1])
        start = ch * CHUNK_ELEMS
        p, b = _encode_chunk(cls[start:start + CHUNK_ELEMS], pos[lo:hi] - start, d[lo:hi], sym[lo:hi], m, freqs)
        put_varint(index, len(p))
        put_varint(index, len(b))
        pos_out += p
        steps_out += b
    return {"model": bytes(model), "index": bytes(index), "pos": bytes(pos_out), "steps": bytes(steps_out)}


def _encode_chunk(cls, off, d, sym, m, freqs) -> tuple[bytes, bytes]:
    """One chunk: cls the classes of its elements, off/d/sym its changes in position order."""
    w = BitWriter()
    members = np.argsort(cls, kind="stable")  # chunk offsets grouped by class, in position order
    starts = np.concatenate([[0], np.cumsum(np.bincount(cls, minlength=NCLASS))])
    rank = np.empty(len(cls), np.int64)
    rank[members] = np.arange(len(cls)) - starts[cls[members]]
    order = np.lexsort((off, cls[off]))  # coding order: class, then position
    syms, tables, escapes = [], [], []
    for c in range(NCLASS):
        if not m[c] or starts[c] == starts[c + 1]:
            continue
        pop = int(starts[c + 1] - starts[c])
        mine = order[cls[off[order]] == c]
        nxt = 0  # the lowest rank the next change may have
        for i in mine:
            rk = int(rank[off[i]])
            put_gap(w, rk - nxt, m[c], pop - nxt)
            nxt = rk + 1
            syms.append(int(sym[i]))
            tables.append(freqs[c])
            if sym[i] == ESC:
                escapes.append(int(d[i]))
        put_gap(w, None, m[c], pop - nxt)
    for e in escapes:
        put_escape(w, e)
    return w.finish(), rans_encode(syms, tables) if syms else b""


# --- decode ---------------------------------------------------------------------------

def read_model(model, numel: int, nbytes: int, itemsize: int) -> tuple[int, list[int], dict]:
    """(K, m per class, class -> frequencies), validated against a segment of numel elements."""
    what = "v2 model"
    k, at = get_varint(model, 0, what, numel)
    if k == 0 or delta_ref.sparse_size(numel, itemsize, k, 0) >= nbytes:  # stored as "same", or whole
        raise FormatError(f"{what}: {k} changes in {numel} elements is too dense for a delta, or none")
    lo, at = get_varint(model, at, f"{what} first class", NCLASS)
    hi, at = get_varint(model, at, f"{what} class end", NCLASS)
    if lo > hi:
        raise FormatError(f"{what}: class range {lo}..{hi} is empty backwards")
    m, freqs = [0] * NCLASS, {}
    for c in range(lo, hi):
        mc, at = get_varint(model, at, f"{what} class {c}", 1 << 32)
        m[c] = mc
        if mc:
            f = []
            for _ in range(NSYM):
                v, at = get_varint(model, at, f"{what} class {c} frequency", PROB_SCALE)
                f.append(v)
            if sum(f) != PROB_SCALE:
                raise FormatError(f"{what} class {c}: frequencies sum to {sum(f)}, expected {PROB_SCALE}")
            freqs[c] = f
    if at != len(model):
        raise FormatError(f"{what}: {len(model) - at} bytes after the last class")
    return k, m, freqs


def read_index(index, nc: int, pos_len: int, steps_len: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for ch in range(nc):
        a, at = get_varint(index, at, f"v2 index chunk {ch}", pos_len)
        b, at = get_varint(index, at, f"v2 index chunk {ch}", steps_len)
        out.append((a, b))
    if at != len(index) or sum(a for a, _ in out) != pos_len or sum(b for _, b in out) != steps_len:
        raise FormatError("v2 index: chunk lengths do not tile the position and step sections")
    return out


def decode(old: np.ndarray, parts: dict, dtype) -> DeltaSections:
    """v1 sections of the changes, decoded against base bits old; FormatError on any inconsistency."""
    pos, d = decode_changes(old, parts, dtype)
    return to_sections(old, pos, d, dtype.order)


def decode_changes(old: np.ndarray, parts: dict, dtype) -> tuple[np.ndarray, np.ndarray]:
    n, w = len(old), old.dtype.itemsize
    k, m, freqs = read_model(parts["model"], n, n * w, w)
    nc = delta_ref.nchunks(n)
    lens = read_index(parts["index"], nc, len(parts["pos"]), len(parts["steps"]))
    tabs = {c: _decode_table(f) for c, f in freqs.items()}
    cls = value_class(old, dtype)
    all_pos, all_d = [], []
    got = 0
    pa = sa = 0
    for ch, (pl, sl) in enumerate(lens):
        start = ch * CHUNK_ELEMS
        p, dd = _decode_chunk(cls[start:start + CHUNK_ELEMS], bytes(parts["pos"][pa:pa + pl]),
                              bytes(parts["steps"][sa:sa + sl]), m, tabs, 8 * w, k - got, ch)
        pa, sa = pa + pl, sa + sl
        got += len(p)
        all_pos.append(p + start)
        all_d.append(dd)
    if got != k:
        raise FormatError(f"v2: decoded {got} changes, the model declares {k}")
    pos = np.concatenate(all_pos) if all_pos else np.zeros(0, np.int64)
    return pos, (np.concatenate(all_d) if all_d else np.zeros(0, np.int64))


def _decode_table(f: list[int]):
    cum = [sum(f[:s]) for s in range(NSYM)]
    slot = bytearray(PROB_SCALE)
    for s in range(NSYM):
        slot[cum[s]:cum[s] + f[s]] = bytes([s]) * f[s]
    return f, cum, bytes(slot)


def _decode_chunk(cls, pbytes, sbytes, m, tabs, width_bits, budget, ch):
    what = f"v2 chunk {ch}"
    rd = BitReader(pbytes, f"{what} positions")
    members = np.argsort(cls, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(cls, minlength=NCLASS))])
    offs, ccls = [], []
    for c in range(NCLASS):
        pop = int(starts[c + 1] - starts[c])
        if not m[c] or not pop:
            continue
        nxt = 0
        while True:
            g = get_gap(rd, m[c], pop - nxt)
            if g is None:
                break
            if len(offs) >= budget:
                raise FormatError(f"{what}: more changes than the model declares")
            offs.append(int(members[starts[c] + nxt + g]))
            ccls.append(c)
            nxt += g + 1
    if not offs:
        if sbytes:
            raise FormatError(f"{what}: steps for a chunk without changes")
        rd.finish()
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    dec = RansDecoder(sbytes, f"{what} steps")
    d = []
    for c in ccls:
        s = dec.get(*tabs[c])
        d.append(s - SMALL if s < SMALL else s - SMALL + 1 if s < ESC else None)
    dec.finish()
    d = [get_escape(rd, width_bits) if v is None else v for v in d]
    rd.finish()
    offs = np.array(offs, np.int64)
    order = np.argsort(offs, kind="stable")
    return offs[order], np.array(d, dtype=np.int64)[order]


def to_sections(old: np.ndarray, pos: np.ndarray, d: np.ndarray, order: str) -> DeltaSections:
    """v1 sections (delta_ref) of changes given as increasing positions and signed int64 steps."""
    return sections_of(len(old), old[pos], pos, d, order)


def sections_of(n: int, before: np.ndarray, pos: np.ndarray, d: np.ndarray, order: str, xp=np) -> DeltaSections:
    """to_sections given only the base's values at the changes (before = old[pos]) of an n-element tensor.
    xp: the array module of the arrays (the CUDA backend builds the sections on its device with cupy)."""
    w = before.dtype.itemsize
    ud = (d.view(np.uint64) if w == 8 else d & ((1 << (8 * w)) - 1)).astype(before.dtype)  # d modulo 2^(8W)
    new = delta_ref.unkey(delta_ref.monotone_key(before, order, xp) + ud, order, xp)
    nc = delta_ref.nchunks(n)
    chunk, offset = pos // CHUNK_ELEMS, pos % CHUNK_ELEMS
    first = xp.ones(len(pos), dtype=bool)
    first[1:] = chunk[1:] != chunk[:-1]
    prev = xp.concatenate([xp.zeros(1, np.int64), offset[:-1].astype(np.int64)])
    gaps = xp.where(first, offset, offset - prev - 1).astype("<u2")
    small = (d >= -127) & (d <= 127)
    steps = xp.where(small, d, delta_ref.ESCAPE).astype(np.int8)
    counts = xp.bincount(chunk, minlength=nc).astype("<u4")
    esc = xp.bincount(chunk[~small], minlength=nc).astype("<u4")
    return DeltaSections(xp.concatenate([counts, esc]), gaps, steps,
                         new[~small].astype(before.dtype.newbyteorder("<")))
