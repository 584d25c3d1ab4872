"""Cases for the CUDA kernels, shared by the harness tests (test_cuda_sim*.py), the GPU tests
(test_cuda_kernels.py) and the harness driver (ASan and mutant runs in a subprocess)."""
from __future__ import annotations

import numpy as np

from wsync.backends import cuda
from wsync.codecs import delta_ref

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
CASES = [(w, o) for w in (1, 2, 4, 8) for o in ("float", "int", "uint")]


def make_case(rng, width: int, order: str, n: int, density: float):
    """Bit patterns old -> new: mostly one- to three-step moves (also across zero),
    some large jumps (escapes), runs of neighbours, and special values (NaN, inf, ±0)."""
    u = UINT[width]
    info = np.iinfo(u)
    old = rng.integers(0, info.max, size=n, dtype=u, endpoint=True)
    special = np.array([0, 1, info.max, info.max >> 1, (info.max >> 1) + 1, (info.max >> 1) + 2], dtype=u)
    if width >= 2:  # float specials of this width: +inf, -inf, a quiet NaN, -NaN
        exp_bits = {2: 5, 4: 8, 8: 11}[width]
        inf = ((1 << exp_bits) - 1) << (8 * width - 1 - exp_bits)
        sign = 1 << (8 * width - 1)
        quiet = 1 << (8 * width - 2 - exp_bits)
        special = np.concatenate([special, np.array([inf, inf | sign, inf | quiet, inf | quiet | sign], dtype=u)])
    old[rng.random(n) < 0.05] = rng.choice(special)
    new = old.copy()
    changed = np.flatnonzero(rng.random(n) < density)
    if n > 40 and density > 0:  # a run of adjacent changes
        s = int(rng.integers(0, n - 40))
        changed = np.union1d(changed, np.arange(s, s + 40))
    how = rng.integers(0, 10, size=len(changed))
    key = delta_ref.monotone_key(old[changed], order)
    step = rng.choice(np.array([-3, -2, -1, 1, 2, 3, 127, -127, 128, -128], dtype=np.int64), size=len(changed))
    moved = delta_ref.unkey((key + step.astype(u)).astype(u), order)
    jump = rng.integers(0, info.max, size=len(changed), dtype=u, endpoint=True)
    new[changed] = np.where(how < 7, moved, np.where(how < 9, jump, rng.choice(special, size=len(changed))))
    return old, new


def sections_equal(a: delta_ref.DeltaSections, b: delta_ref.DeltaSections) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in
               ((a.table, b.table), (a.gaps, b.gaps), (a.steps, b.steps), (a.escapes, b.escapes)))


def corruptions(sec: delta_ref.DeltaSections, n: int, old: np.ndarray, order: str):
    """Sections that lie, each a different way (name, sections)."""
    def with_(**kw):
        parts = dict(table=sec.table.copy(), gaps=sec.gaps.copy(), steps=sec.steps.copy(), escapes=sec.escapes.copy())
        parts.update(kw)
        return delta_ref.DeltaSections(**parts)

    nc = delta_ref.nchunks(n)
    k = len(sec.gaps) // 2
    gaps = sec.gaps.copy()
    gaps[k] = 65535
    yield "gap past the chunk", with_(gaps=gaps)
    gaps = sec.gaps.copy()
    gaps[-1] = gaps[-1] + (n - 1) % 65536 + 1 if gaps[-1] < 60000 else 65535
    yield "last gap past the end", with_(gaps=gaps)
    # Exactly one past the chunk: the off-by-one a bounds check must not have.
    pos = delta_ref.decode(old, sec, order)[0]
    counts = sec.table[:nc].astype(np.int64)
    last_of_chunk = np.cumsum(counts) - 1
    for c in {0, nc - 1}:
        if counts[c]:
            i = int(last_of_chunk[c])
            room = int(cuda.chunk_lengths(n)[c]) - int(pos[i] - c * 65536)
            if int(sec.gaps[i]) + room <= 65535:
                gaps = sec.gaps.copy()
                gaps[i] += room
                yield f"change at the end of chunk {c}", with_(gaps=gaps)
    esc = np.flatnonzero(sec.steps == delta_ref.ESCAPE)
    plain = np.flatnonzero(sec.steps != delta_ref.ESCAPE)
    if len(esc):
        steps = sec.steps.copy()
        steps[esc[0]] = 1
        yield "escape marker removed", with_(steps=steps)
    if len(plain):
        steps = sec.steps.copy()
        steps[plain[0]] = delta_ref.ESCAPE
        yield "escape marker added", with_(steps=steps)
    table = sec.table.copy()
    table[0] += 1
    yield "count without a change", with_(table=table)
    table = sec.table.copy()
    table[0] = 70000
    yield "count over the chunk", with_(table=table)
    table = sec.table.copy()
    table[nc] = table[0] + 1
    yield "more escapes than changes", with_(table=table)
    yield "table too short", with_(table=sec.table[:-1])


def misaligned(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of a whose data starts `offset` bytes past a 64-byte boundary (numpy marks it unaligned
    when offset is not a multiple of the itemsize)."""
    raw = np.empty(a.nbytes + 64 + offset, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    view = np.frombuffer(raw.data, dtype=a.dtype, count=len(a), offset=start)
    view = view.view()  # frombuffer of a writable buffer is writable
    raw[start : start + a.nbytes] = a.view(np.uint8)
    return view
