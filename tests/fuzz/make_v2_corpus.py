"""A seeded corpus of delta v2 decoder inputs: valid payloads and mutations of them that reach the decoder.

A fuzz corpus is only worth keeping if every run replays the same one: this one is regenerated from a seed,
the same bytes on every machine, so CI replays exactly what was checked here (tests/test_codec_v2_corpus.py).
v2_corpus.sha256 holds the seed and the digest of the whole corpus: a change to this generator, to the
reference encoder, or to anything they draw from shows up as a digest mismatch, not as a quietly different
corpus. Randomness comes only from random.Random's getrandbits, randrange and choice, whose streams Python
keeps stable across versions (numpy's Generator methods make no such promise).

An input is a dtype, base bits and the four v2 parts, as a decoder takes them. v2 parts carry no checksum
of their own (the payload's per-tensor checksum sits a layer above), so every mutation reaches the decoder.
Subjects vary dtype (all 15), length (1 element to 3 chunks and a bit), base value profile (weight-like
exponents, uniform bits, one value, outliers and specials, zeros) and changes (one, sparse, dense up to the
sparse-size limit, bursts, chunk edges, escapes, the extreme step). Mutations: bit flips, truncations,
extensions and splices of a part; model fields rewritten (change count, class range, Golomb parameters,
frequencies, including sizes far past any limit and overlong varints); index lengths shifted between chunks
so they still tile, or declared huge; a chunk's streams replaced; the base's classes changed under valid
streams; the parts read as another dtype of the same width.

    python tests/fuzz/make_v2_corpus.py               # digest of the corpus for the checked-in seed
    python tests/fuzz/make_v2_corpus.py --out FILE    # and write it (format: see pack)
    python tests/fuzz/make_v2_corpus.py --update      # rewrite v2_corpus.sha256 (a deliberate change only)
"""
from __future__ import annotations

import argparse
import hashlib
import random
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from wsync import dtypes  # noqa: E402
from wsync.codecs import delta_ref, v2_ref  # noqa: E402

DIGEST_FILE = HERE / "v2_corpus.sha256"
PARTS = v2_ref.PARTS
C = 65536
MAGIC = b"WSV2CORPUS1\n"


class Case:
    __slots__ = ("label", "dtype", "base", "parts")

    def __init__(self, label: str, dtype: str, base: bytes, parts: dict):
        self.label, self.dtype, self.base, self.parts = label, dtype, base, parts


# --- varint lists (the model and the index are nothing else) --------------------------------------------

def varints(buf: bytes) -> list[int]:
    out, at = [], 0
    while at < len(buf):
        v, at = v2_ref.get_varint(buf, at, "corpus", 1 << 70)
        out.append(v)
    return out


def pack_varints(vals, overlong_at: int | None = None) -> bytes:
    out = bytearray()
    for i, v in enumerate(vals):
        if i == overlong_at:  # the same value in more bytes than it needs, up to the 10 a reader allows
            b = bytearray()
            v2_ref.put_varint(b, v)
            b[-1] |= 0x80
            b += b"\x80" * max(0, 9 - len(b)) + b"\x00"
            out += b
        else:
            v2_ref.put_varint(out, v)
    return bytes(out)


# --- subjects: valid payloads ---------------------------------------------------------------------------

def words(r: random.Random, n: int) -> np.ndarray:
    return np.frombuffer(r.getrandbits(64 * n).to_bytes(8 * n, "little"), "<u8") if n else np.zeros(0, "<u8")


def trailing_zeros(x: np.ndarray, cap: int) -> np.ndarray:
    low = x & (~x + np.uint64(1))
    tz = v2_ref._bit_length(low).astype(np.int64) - 1
    return np.where(x == 0, cap, np.minimum(tz, cap))


def make_base(r: random.Random, dt, n: int, profile: str) -> np.ndarray:
    w = 8 * dt.itemsize
    bd = dt.bits_dtype
    raw = words(r, n)
    if profile == "uniform":
        return (raw & np.uint64((1 << w) - 1)).astype(bd)
    if profile == "zeros":
        return np.zeros(n, bd)
    if profile == "flat":
        out = np.full(n, raw[0], np.uint64).astype(bd)
        at = words(r, min(3, n)) % np.uint64(n)  # and a few others
        out[at] = raw[1:1 + len(at)].astype(bd) if n > len(at) else out[at]
        return out
    # "weights" and "outliers": a top class and about half as many in each class below it
    depth = trailing_zeros(words(r, n), 12)
    if dt.order == "float":
        m = v2_ref.MANTISSA_BITS[dt.name]
        ebits = w - 1 - m
        top = r.choice([(1 << ebits) - 2, (1 << (ebits - 1)) - 7 if ebits > 3 else 2])  # huge, or about 0.02
        e = np.maximum(top - depth, 0).astype(np.uint64)
        sign = (raw >> np.uint64(63)) << np.uint64(w - 1)
        out = (sign | (e << np.uint64(m)) | (raw & np.uint64((1 << m) - 1))).astype(bd)
    else:
        top = r.randrange(1, w)
        bits = np.maximum(top - depth, 0).astype(np.uint64)
        high = np.left_shift(np.uint64(1), np.maximum(bits, 1).astype(np.uint64) - np.uint64(1))
        mag = np.where(bits > 0, high | (raw & (high - np.uint64(1))), np.uint64(0))
        if dt.order == "int":
            mag = np.where(raw >> np.uint64(63) == 1, ~mag, mag)
        out = (mag & np.uint64((1 << w) - 1)).astype(bd)
    if profile == "outliers" and n:
        specials = [(1 << w) - 1, 1 << (w - 1), (1 << (w - 1)) - 1, 0, 1]
        if dt.order == "float":
            m = v2_ref.MANTISSA_BITS[dt.name]
            specials += [((1 << (w - 1 - m)) - 1) << m, (((1 << (w - 1 - m)) - 1) << m) | 1]  # inf, nan
        at = words(r, 1 + n // 500) % np.uint64(n)
        out[at] = np.array([specials[i % len(specials)] for i in range(len(at))], np.uint64).astype(bd)
    return out


def make_changes(r: random.Random, dt, old: np.ndarray, kmax: int) -> tuple[np.ndarray, np.ndarray]:
    n, w = len(old), 8 * dt.itemsize
    kind = r.choice(["one", "sparse", "sparse", "dense", "burst", "edges", "class"])
    # dense up to the limit only where the reference decodes it quickly: its Python loop is per change
    want = {"one": 1, "sparse": 1 + n // 1000, "dense": kmax if n <= 5000 else n // 40,
            "burst": 1 + n // 50}.get(kind, 1 + n // 200)
    k = max(1, min(kmax, want))
    if kind == "burst":
        start = r.randrange(max(1, n - k + 1))
        pos = np.arange(start, min(n, start + k))
    elif kind == "edges":
        pos = np.array([p for c in range(0, n, C) for p in (c, c + 1, c + C - 2, c + C - 1) if p < n] + [n - 1])
    elif kind == "class":  # every change in the rarest class present: long Golomb runs elsewhere
        cls = v2_ref.value_class(old, dt)
        rare = int(np.argmin(np.where(np.bincount(cls, minlength=256) > 0, np.bincount(cls, minlength=256), n + 1)))
        pos = np.flatnonzero(cls == rare)
    else:
        pos = words(r, k) % np.uint64(n)
    pos = np.unique(pos.astype(np.int64))[:kmax]
    steps = np.array([1, -1, 1, -1, 2, -2, 3, -3, 5, -7, 7, 8, -8, 100, -300], np.int64)
    pick = words(r, len(pos))
    d = steps[(pick % np.uint64(len(steps))).astype(np.int64)]
    lim = 1 << (w - 1)
    wide = (pick >> np.uint64(32)) % np.uint64(23) == 0  # an escape of any size the width allows
    big = (words(r, len(pos)) % np.uint64(lim)).astype(np.int64) if w < 64 else \
        (words(r, len(pos)) >> np.uint64(1)).astype(np.int64)
    d = np.where(wide, np.where(pick & np.uint64(1), big, -big), d)
    d = np.where(d == 0, 9, d)
    d = np.maximum(np.minimum(d, lim - 1), -lim) if w < 64 else d
    if len(d) > 1 and r.randrange(3) == 0:
        d[r.randrange(len(d))] = -lim if w < 64 else np.iinfo(np.int64).min  # the extreme step
    return pos, d


def subject(r: random.Random, i: int) -> Case | None:
    names = sorted(dtypes.DTYPES)
    name = names[i % len(names)]
    dt = dtypes.DTYPES[name]
    n = r.choice([1, 2, 3, 7, 40, 100, 999, 4097, 20_000, 65_535, 65_536, 65_537, 3 * C + 5] +
                 [r.randrange(8, 3000) for _ in range(6)])
    nc = delta_ref.nchunks(n)
    kmax = (n * dt.itemsize - 8 * nc - 1) // 3
    if kmax < 1:
        return None
    profile = r.choice(["weights", "weights", "uniform", "flat", "outliers", "zeros"])
    old = make_base(r, dt, n, profile)
    pos, d = make_changes(r, dt, old, kmax)
    parts = v2_ref.encode_changes(old, pos, d, dt)
    return Case(f"{i}:{name}:n={n}:{profile}:k={len(pos)}", name, old.tobytes(), parts)


# --- mutations ------------------------------------------------------------------------------------------

def _part(r, parts):
    live = [p for p in PARTS if parts[p]]
    return r.choice(live or list(PARTS))


def m_flip(r, s):
    parts = dict(s.parts)
    p = _part(r, parts)
    b = bytearray(parts[p])
    for _ in range(1 + r.randrange(3)):
        if b:
            b[r.randrange(len(b))] ^= 1 << r.randrange(8)
    parts[p] = bytes(b)
    return f"flip {p}", s.dtype, s.base, parts


def m_truncate(r, s):
    parts = dict(s.parts)
    p = _part(r, parts)
    parts[p] = parts[p][:r.randrange(len(parts[p]) + 1)]
    return f"truncate {p}", s.dtype, s.base, parts


def m_extend(r, s):
    parts = dict(s.parts)
    p = r.choice(PARTS)
    ln = r.randrange(1, 17)
    tail = r.choice([b"\x00", b"\x00" * ln, r.getrandbits(8 * ln).to_bytes(ln, "little")])
    parts[p] = parts[p] + tail
    return f"extend {p} by {len(tail)}", s.dtype, s.base, parts


def m_splice(r, s):
    parts = dict(s.parts)
    p = _part(r, parts)
    b = bytearray(parts[p])
    at = r.randrange(len(b) + 1)
    b[at:at] = r.getrandbits(8 * 4).to_bytes(4, "little")[:1 + r.randrange(4)]
    parts[p] = bytes(b)
    return f"splice {p}", s.dtype, s.base, parts


def m_model(r, s):
    """A model field rewritten: counts, the class range, a Golomb parameter or frequencies."""
    v = varints(s.parts["model"])
    n = len(s.base) // dtypes.DTYPES[s.dtype].itemsize
    what = r.choice(["k", "k", "range", "m", "m", "freq", "freq_keep", "freq_one", "overlong", "extra_class"])
    over = None
    if what == "k":
        v[0] = r.choice([0, 1, v[0] - 1, v[0] + 1, n, n + 1, (1 << 32) + 1, (1 << 63) - 1, (1 << 64) - 1])
    elif what == "range":
        v[1], v[2] = r.choice([(v[2], v[1]), (0, 256), (255, 257), (256, 256), (v[1], v[1]), (1 << 40, 1 << 41)])
    elif what in ("m", "freq", "freq_keep", "freq_one"):
        slots, at = [], 3
        for c in range(v[1], v[2]):
            if at >= len(v):
                break
            slots.append(at)
            at += 1 + (15 if v[at] else 0)
        if not slots:
            return None
        at = r.choice(slots)
        if what == "m":
            v[at] = r.choice([1, 2, max(1, v[at] - 1), v[at] + 1, v[at] * 7 + 3, 1 << 31, 1 << 32, (1 << 32) + 1])
        elif v[at]:
            f = v[at + 1:at + 16]
            a, b = r.randrange(15), r.randrange(15)
            if what == "freq":
                f[a] = r.choice([0, f[a] + 1, 4096, 4097, 1 << 20])
            elif what == "freq_keep" and f[a]:  # still sums to 4096: a different but valid table
                f[a] -= 1
                f[b] += 1
            else:
                f = [0] * 15
                f[a] = 4096
            v[at + 1:at + 16] = f
        else:
            return None
    elif what == "overlong":
        over = r.randrange(len(v))
    else:  # a class the encoder left out, now with a parameter: the decoder reads gaps it was never given
        if v[2] >= 256:
            return None
        v[2:3] = [v[2] + 1]
        v += [r.choice([1, 3, 64])] + [4096 - 14] + [1] * 14
    parts = dict(s.parts, model=pack_varints(v, over))
    return f"model {what}", s.dtype, s.base, parts


def m_index(r, s):
    v = varints(s.parts["index"])
    what = r.choice(["shift", "shift", "huge", "swap", "drop", "add", "overlong"])
    over = None
    if what == "shift" and len(v) >= 4:  # still tiles pos and steps: chunks start in each other's bytes
        j = r.choice([0, 1])
        a = r.randrange(0, len(v) - 2, 2) + j
        dlt = r.choice([1, 2, -1, 3])
        if v[a] + dlt < 0 or v[a + 2] - dlt < 0:
            return None
        v[a] += dlt
        v[a + 2] -= dlt
    elif what == "shift":
        v[0] += 1
    elif what == "huge":
        v[r.randrange(len(v))] = r.choice([1 << 31, 1 << 32, 1 << 40, (1 << 63) - 1, (1 << 64) - 1])
    elif what == "swap" and len(v) >= 4:
        v[0:2], v[2:4] = v[2:4], v[0:2]
    elif what == "drop":
        v = v[:-1]
    elif what == "add":
        v += [0, 0]
    elif what == "overlong":
        over = r.randrange(len(v))
    else:
        return None
    return f"index {what}", s.dtype, s.base, dict(s.parts, index=pack_varints(v, over))


def m_stream(r, s):
    """One chunk's position or rANS stream replaced, the index left as it is."""
    v = varints(s.parts["index"])
    ch = r.randrange(len(v) // 2)
    which = r.choice(["pos", "steps"])
    at = sum(v[2 * c + (which == "steps")] for c in range(ch))
    ln = v[2 * ch + (which == "steps")]
    fill = r.choice(["zeros", "ones", "random", "state"])
    if fill == "zeros":
        new = b"\x00" * ln
    elif fill == "ones":
        new = b"\xff" * ln
    elif fill == "random":
        new = r.getrandbits(8 * ln).to_bytes(ln, "little") if ln else b""
    else:  # a rANS state just outside [2^23, 2^31), or at its edges
        if which != "steps" or ln < 4:
            return None
        x = r.choice([(1 << 23) - 1, 1 << 23, (1 << 31) - 1, 1 << 31, 0, 0xFFFFFFFF])
        new = x.to_bytes(4, "little") + s.parts["steps"][at + 4:at + ln]
    part = s.parts[which]
    parts = dict(s.parts, **{which: part[:at] + new + part[at + ln:]})
    return f"stream {which} chunk {ch} {fill}", s.dtype, s.base, parts


def m_base(r, s):
    """Valid streams against a base whose classes moved: the ranks run past or short of each class."""
    dt = dtypes.DTYPES[s.dtype]
    old = np.frombuffer(s.base, dt.bits_dtype).copy()
    if not len(old):
        return None
    how = r.choice(["some", "many", "all"])
    k = {"some": 1 + len(old) // 1000, "many": 1 + len(old) // 10, "all": len(old)}[how]
    at = words(r, k) % np.uint64(len(old))
    old[at] = words(r, k).astype(dt.bits_dtype)
    return f"base {how}", s.dtype, old.tobytes(), s.parts


def m_dtype(r, s):
    """The parts read as another dtype of the same width: other classes, other escape widths."""
    w = dtypes.DTYPES[s.dtype].itemsize
    others = sorted(n for n, d in dtypes.DTYPES.items() if d.itemsize == w and n != s.dtype)
    if not others:
        return None
    name = r.choice(others)
    return f"as {name}", name, s.base, s.parts


def m_empty(r, s):
    keep = r.choice(PARTS)
    return f"only {keep}", s.dtype, s.base, {p: (s.parts[p] if p == keep else b"") for p in PARTS}


MUTATIONS = [m_flip] * 4 + [m_truncate] * 2 + [m_extend, m_splice] + [m_model] * 4 + [m_index] * 2 + \
    [m_stream] * 2 + [m_base] * 2 + [m_dtype, m_empty]


# --- the corpus -----------------------------------------------------------------------------------------

def corpus(seed: int, subjects: int, per_subject: int) -> list[Case]:
    r = random.Random(seed)
    out = []
    for i in range(subjects):
        s = subject(r, i)
        if s is None:
            continue
        out.append(Case("valid " + s.label, s.dtype, s.base, s.parts))
        for j in range(per_subject):
            got = r.choice(MUTATIONS)(r, s)
            if got is not None:
                label, name, base, parts = got
                out.append(Case(f"{label} of {s.label}#{j}", name, base, parts))
    return out


def pack(cases: list[Case]) -> bytes:
    """MAGIC, the count, then per case: label, dtype, base and the four parts, each as a u32 length and its
    bytes; a base seen before is stored as length 0xFFFFFFFF and the u32 number of that earlier base."""
    out, seen = [MAGIC, struct.pack("<I", len(cases))], {}
    for c in cases:
        for b in (c.label.encode(), c.dtype.encode()):
            out += [struct.pack("<I", len(b)), b]
        if c.base in seen:
            out.append(struct.pack("<II", 0xFFFFFFFF, seen[c.base]))
        else:
            seen[c.base] = len(seen)
            out += [struct.pack("<I", len(c.base)), c.base]
        for p in PARTS:
            out += [struct.pack("<I", len(c.parts[p])), bytes(c.parts[p])]
    return b"".join(out)


def unpack(buf: bytes) -> list[Case]:
    assert buf.startswith(MAGIC), "not a v2 corpus"
    at = len(MAGIC)

    def u32():
        nonlocal at
        at += 4
        return struct.unpack_from("<I", buf, at - 4)[0]

    def take():
        nonlocal at
        ln = u32()
        at += ln
        return buf[at - ln:at]

    out, bases = [], []
    for _ in range(u32()):
        label, name = take().decode(), take().decode()
        if struct.unpack_from("<I", buf, at)[0] == 0xFFFFFFFF:
            u32()
            base = bases[u32()]
        else:
            base = take()
            bases.append(base)
        out.append(Case(label, name, base, {p: take() for p in PARTS}))
    assert at == len(buf), "trailing bytes after the corpus"
    return out


def checked_in() -> dict:
    """The seed, sizes and digest in v2_corpus.sha256 (lines of key value)."""
    return dict(line.split(None, 1) for line in DIGEST_FILE.read_text().splitlines() if line.strip())


def build(seed: int, subjects: int, per_subject: int) -> tuple[bytes, str]:
    blob = pack(corpus(seed, subjects, per_subject))
    return blob, hashlib.sha256(blob).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the corpus here")
    ap.add_argument("--update", action="store_true", help="rewrite v2_corpus.sha256 with this corpus's digest")
    ap.add_argument("--seed", type=int, help="another seed (default: the checked-in one)")
    a = ap.parse_args()
    ref = checked_in() if DIGEST_FILE.exists() else {"seed": "1", "subjects": "240", "per_subject": "13"}
    seed = a.seed if a.seed is not None else int(ref["seed"])
    subjects, per = int(ref["subjects"]), int(ref["per_subject"])
    blob, digest = build(seed, subjects, per)
    if a.out:
        Path(a.out).write_bytes(blob)
    n = struct.unpack_from("<I", blob, len(MAGIC))[0]
    print(f"seed {seed}: {n} inputs, {len(blob)} bytes, sha256 {digest}")
    if a.update:
        DIGEST_FILE.write_text(f"seed {seed}\nsubjects {subjects}\nper_subject {per}\ninputs {n}\nsha256 {digest}\n")


if __name__ == "__main__":
    main()
