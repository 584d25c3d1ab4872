"""Kernel test cases, shared by test_backends.py and the AddressSanitizer run (asan_driver.py).

Honest pairs: old and new bit patterns whose changes mix every step kind the
delta format distinguishes. Hostile cases: a base plus sections that may lie
in any way a payload can: tables of the wrong length or with impossible
counts, gaps that walk off a chunk, escape markers that disagree with the
table, sections too short or too long.
check_case holds every operation that reads sections (decode, and the fused
decode/apply calls of the Kernels protocol) to the reference's verdict.
Cases are drawn through `pick(lo, hi)` (an int in [lo, hi]), so hypothesis can
drive and shrink them while a plain numpy generator drives the ASan subprocess.
"""
from __future__ import annotations

import numpy as np

from wsync.checksum import checksum
from wsync.codecs import delta_ref
from wsync.codecs.delta_ref import DeltaSections
from wsync.errors import FormatError

C = delta_ref.CHUNK_ELEMS
WIDTHS = (1, 2, 4, 8)
ORDERS = ("float", "int", "uint")
FIELDS = ("table", "gaps", "steps", "escapes")


def specials(width: int, order: str) -> np.ndarray:
    """NaN, ±inf, ±0, ±smallest denormal, ±max finite for floats; extremes for ints."""
    bits = 8 * width
    sb = 1 << (bits - 1)
    mask = (1 << bits) - 1
    if order == "float":
        exp_bits = {1: 4, 2: 8, 4: 8, 8: 11}[width]  # e4m3, bf16 (fp16 differs only in where inf is), f32, f64
        inf = ((1 << exp_bits) - 1) << (bits - 1 - exp_bits)
        vals = [inf | 1, inf, sb | inf, sb, 0, 1, sb | 1, inf - 1, mask, sb | (inf - 1)]
    else:
        vals = [0, 1, sb - 1, sb, sb + 1, mask, mask - 1]
    return np.array([v & mask for v in vals], dtype=f"<u{width}")


def make_pair(seed: int, width: int, order: str, n: int, density: float):
    """Old and new bit patterns whose changes mix every step kind the format distinguishes:
    ±1..3, the escape boundary (±126..±129), sign crossings, huge jumps and special values."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(f"<u{width}")
    old = rng.integers(0, 256, size=n * width, dtype=np.uint8).view(dt)
    sp = specials(width, order)
    old[rng.random(n) < 0.1] = rng.choice(sp)
    new = old.copy()
    pos = np.flatnonzero(rng.random(n) < density)
    kind = rng.integers(0, 5, size=len(pos))
    k = delta_ref.monotone_key(old[pos], order)
    step = rng.choice(np.array([1, 2, 3, 126, 127, 128, 129], dtype=np.int64), size=len(pos))
    step = np.where(rng.random(len(pos)) < 0.5, step, -step).astype(np.int64)
    moved = delta_ref.unkey((k + step.astype(dt)).astype(dt), order)
    mid = dt.type(1 << (8 * width - 1))  # keys around mid are values around zero
    crossed = delta_ref.unkey((mid + rng.integers(-3, 4, size=len(pos)).astype(dt)).astype(dt), order)
    jump = rng.integers(0, 256, size=len(pos) * width, dtype=np.uint8).view(dt)
    special = rng.choice(sp, size=len(pos)) if len(pos) else jump
    new[pos] = np.select([kind == 0, kind == 1, kind == 2, kind == 3], [moved, crossed, jump, special], moved)
    return old, new


def assert_same_sections(a, b):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype, (f, x.dtype, y.dtype)
        assert np.array_equal(x, y), f


def _size(pick) -> int:
    sizes = (0, 1, 2, 77, C - 1, C, C + 1, 2 * C + 5, 3 * C)
    i = pick(0, len(sizes))
    return sizes[i] if i < len(sizes) else pick(0, 4 * C)


def _random_bits(rng, n: int, width: int) -> np.ndarray:
    return rng.integers(0, 256, size=n * width, dtype=np.uint8).view(f"<u{width}")


def _valid(rng, old: np.ndarray, order: str) -> DeltaSections:
    """Honest sections for a random change of old, the starting point for lies."""
    new = old.copy()
    density = (0.0, 0.001, 0.05, 0.5, 1.0)[int(rng.integers(0, 5))]
    pos = np.flatnonzero(rng.random(len(old)) < density)
    new[pos] = _random_bits(rng, len(pos), old.dtype.itemsize)
    small = rng.random(len(pos)) < 0.7  # mostly small steps, so both step kinds appear
    k = delta_ref.monotone_key(old[pos[small]], order)
    new[pos[small]] = delta_ref.unkey(k + rng.integers(1, 4, size=len(k)).astype(old.dtype), order)
    return delta_ref.encode(old, new, order)


def _random_sections(rng, n: int, width: int) -> DeltaSections:
    """Sections that never came from an encoder: plausible lengths, arbitrary contents."""
    nc = delta_ref.nchunks(n)
    cnt = rng.integers(0, 40, size=nc, dtype=np.uint32)
    esc = (cnt * rng.random(nc)).astype(np.uint32)
    total, total_esc = int(cnt.sum()), int(esc.sum())
    gaps = rng.integers(0, 1 << 16, size=total, dtype=np.uint16) >> rng.integers(0, 17)
    steps = rng.integers(-128, 128, size=total, dtype=np.int8)
    steps[rng.random(total) < 0.2] = delta_ref.ESCAPE
    return DeltaSections(np.concatenate([cnt, esc]).astype("<u4"), gaps.astype("<u2"), steps,
                         _random_bits(rng, total_esc, width))


def _resize(a: np.ndarray, delta: int, rng) -> np.ndarray:
    if delta <= 0:
        return a[: max(0, len(a) + delta)].copy()
    extra = rng.integers(0, 256, size=delta * a.dtype.itemsize, dtype=np.uint8).view(a.dtype)
    return np.concatenate([a, extra])


def _mutate(pick, rng, sec: DeltaSections, n: int) -> DeltaSections:
    """One lie: an edited table entry, a resized section, an edited element, or flipped bytes."""
    parts = {f: getattr(sec, f).copy() for f in FIELDS}
    field = FIELDS[pick(0, 3)]
    a = parts[field]
    how = pick(0, 3)
    if how == 0 and len(a):  # a chosen value at a chosen index
        i = pick(0, len(a) - 1)
        if field == "table":
            a[i] = (0, 1, (int(a[i]) + 1) % (1 << 32), max(int(a[i]) - 1, 0), C, C + 1, n, 1 << 31, (1 << 32) - 1)[pick(0, 8)]
        elif field == "gaps":
            a[i] = (0, 1, 65535, int(rng.integers(0, 65536)))[pick(0, 3)]
        elif field == "steps":
            a[i] = (delta_ref.ESCAPE, 0, 127, -127, int(rng.integers(-128, 128)))[pick(0, 4)]
        else:
            a[i] = a.dtype.type(int(rng.integers(0, 256)))
    elif how == 1:  # too short or too long
        parts[field] = _resize(a, pick(-3, 3) or 1, rng)
    elif how == 2 and field == "table" and len(a) >= 2:  # counts and escape counts swapped
        h = len(a) // 2
        parts[field] = np.concatenate([a[h:], a[:h]]).astype("<u4")
    elif len(a):  # random byte flips
        b = a.view(np.uint8)
        for _ in range(pick(1, 4)):
            b[pick(0, len(b) - 1)] ^= np.uint8(pick(1, 255))
    return DeltaSections(**parts)


def make_case(pick) -> tuple[np.ndarray, DeltaSections, str]:
    """A base of random bits and sections that are honest, forged, or honest with lies."""
    width, order, n = WIDTHS[pick(0, 3)], ORDERS[pick(0, 2)], _size(pick)
    rng = np.random.default_rng(pick(0, 2**32 - 1))
    old = _random_bits(rng, n, width)
    sec = _random_sections(rng, n, width) if pick(0, 3) == 0 else _valid(rng, old, order)
    for _ in range(pick(0, 3)):
        sec = _mutate(pick, rng, sec, n)
    return old, sec, order


def outcome(fn):
    """("ok", (positions, values)) or ("FormatError", message); anything else propagates."""
    try:
        return "ok", fn()
    except FormatError as e:
        return "FormatError", str(e)


def check_case(kernels, old: np.ndarray, sec: DeltaSections, order: str) -> str:
    """The backend refuses exactly what the reference refuses, with its message, else returns the same arrays.

    Its fused operations (decode + checksum, apply out of place, apply in
    place) are held to the same standard against the reference's decode,
    copy, scatter and checksums; a refused in-place apply leaves the base as it was.
    """
    want = outcome(lambda: delta_ref.decode(old, sec, order))
    got = outcome(lambda: kernels.delta_decode(old, sec, order))
    assert got[0] == want[0], (got, want)
    if want[0] == "ok":
        (pw, vw), (pg, vg) = want[1], got[1]
        assert pg.dtype == pw.dtype and vg.dtype == vw.dtype
        assert np.array_equal(pg, pw) and np.array_equal(vg, vw)
    else:
        assert got[1] == want[1]
    _check_fused_decode(kernels, old, sec, order, want)
    _check_fused_apply(kernels, old, sec, order, want)
    _check_inplace_apply(kernels, old, sec, order, want)
    return want[0]


def _same_outcome(got, want) -> bool:
    assert got[0] == want[0], (got, want)
    if want[0] != "ok":
        assert got[1] == want[1]
    return want[0] == "ok"


def _check_fused_decode(kernels, old, sec, order, want) -> None:
    got = outcome(lambda: kernels.delta_decode_checksummed(old, sec, order))
    if _same_outcome(got, want):
        pos, values, old_sum = got[1]
        assert np.array_equal(pos, want[1][0]) and np.array_equal(values, want[1][1])
        assert pos.dtype == np.int64 and values.dtype == old.dtype and old_sum == checksum(old)


def _check_fused_apply(kernels, old, sec, order, want) -> None:
    before = old.tobytes()
    got = outcome(lambda: kernels.delta_apply(old, sec, order))
    assert old.tobytes() == before, "delta_apply wrote into old"
    if not _same_outcome(got, want):
        return
    new = old.copy()
    new[want[1][0]] = want[1][1]
    out, old_sum, new_sum = got[1]
    assert out.dtype == old.dtype and out.tobytes() == new.tobytes()
    assert (old_sum, new_sum) == (checksum(old), checksum(new))


def _check_inplace_apply(kernels, old, sec, order, want) -> None:
    bits = old.copy()
    got = outcome(lambda: kernels.delta_apply_inplace(bits, sec, order))
    if not _same_outcome(got, want):
        assert bits.tobytes() == old.tobytes(), "a refused in-place apply changed the base"
        return
    new = old.copy()
    new[want[1][0]] = want[1][1]
    overwritten, old_sum, new_sum = got[1]
    assert bits.tobytes() == new.tobytes()
    assert (old_sum, new_sum) == (checksum(old), checksum(new))
    overwritten.restore(bits)
    assert bits.tobytes() == old.tobytes(), "undo did not restore the base"
