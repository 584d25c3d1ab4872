"""Reference delta codec: the readable specification of the `sparse` layout.

This file *is* the format. The C++ and CUDA kernels must produce the same bytes.

A tensor of n elements, each W bytes wide, is viewed as unsigned W-byte bit
patterns and cut into chunks of C = 65536 elements (the last may be short).
Chunks are independent, so kernels can encode and apply them in parallel.

Monotone key. A bit pattern x maps to key(x), an unsigned integer of the same
width that orders values the way the dtype does:
  - floats (sign-magnitude): key = ~x if the sign bit is set, else x | signbit
  - signed ints (two's complement): key = x ^ signbit
  - unsigned ints and bool: key = x
key is a bijection, so any bit pattern (NaN, inf, -0.0, denormals) round-trips,
and a float that moves by one representable value moves its key by one, also
across zero.

Per changed element i (old[i] != new[i]), in increasing position order:
  - position: its gap, gap = offset_in_chunk for the first change of a chunk,
    else offset - previous_offset - 1; always < C, stored as u16;
  - step: d = key(new) - key(old) modulo 2^(8W), read as signed. If
    -127 <= d <= 127 it is stored as an i8; otherwise the i8 is ESCAPE (-128)
    and the new bit pattern goes, in order, into the escapes array (uW).

Sections of one tensor, back to back, all little-endian:
  table    u32[2 * nchunks]  changed count per chunk, then escape count per chunk
  gaps     u16[n_changed]
  steps    i8[n_changed]
  escapes  uW[n_escapes]

A tensor is stored as a delta only when these sections are smaller than the
tensor itself (n * W bytes); a denser change is stored whole. A decoder
refuses sections, or a chunk table, that claim as much or more, so a delta
never makes a receiver allocate more than the tensor it changes.

Decoding validates everything it reads: counts fit their chunk, the section
sizes agree with the table, every position is inside its chunk, and each
chunk's escape markers match its escape count. Invalid input raises
FormatError and touches nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FormatError
from ..manifest import CHUNK_ELEMS

ESCAPE = -128


@dataclass
class DeltaSections:
    table: np.ndarray  # <u4 [2 * nchunks]: counts then escape counts
    gaps: np.ndarray  # <u2 [n_changed]
    steps: np.ndarray  # i1 [n_changed]
    escapes: np.ndarray  # <uW [n_escapes]

    @property
    def n_changed(self) -> int:
        return len(self.steps)

    def sparse_size(self) -> int:
        return self.table.nbytes + self.gaps.nbytes + self.steps.nbytes + self.escapes.nbytes


def sign_bit(dtype: np.dtype):
    return dtype.type(1 << (8 * dtype.itemsize - 1))


def monotone_key(bits: np.ndarray, order: str, xp=np) -> np.ndarray:
    """Map bit patterns to keys that sort like the values (see module docstring). xp: the array module
    of bits (cupy for the CUDA backend's device arrays)."""
    sb = sign_bit(bits.dtype)
    if order == "float":
        return xp.where(bits & sb, ~bits, bits | sb)
    if order == "int":
        return bits ^ sb
    return bits


def unkey(keys: np.ndarray, order: str, xp=np) -> np.ndarray:
    """Inverse of monotone_key."""
    sb = sign_bit(keys.dtype)
    if order == "float":
        return xp.where(keys & sb, keys ^ sb, ~keys)
    if order == "int":
        return keys ^ sb
    return keys


def nchunks(n: int) -> int:
    return -(-n // CHUNK_ELEMS)


def sparse_size(n: int, itemsize: int, n_changed: int, n_escapes: int) -> int:
    """Bytes of the sparse sections, known before they are built (the encoder's choice uses it)."""
    return 8 * nchunks(n) + 3 * n_changed + itemsize * n_escapes


def encode(old: np.ndarray, new: np.ndarray, order: str) -> DeltaSections:
    """old, new: 1-D <uW bit patterns of equal length."""
    pos = np.flatnonzero(old != new)
    nc = nchunks(len(new))
    chunk = pos // CHUNK_ELEMS
    offset = pos & (CHUNK_ELEMS - 1)
    first = np.ones(len(pos), dtype=bool)
    first[1:] = chunk[1:] != chunk[:-1]
    prev = np.empty_like(offset)
    prev[1:] = offset[:-1]
    gaps = np.where(first, offset, offset - prev - 1).astype("<u2")

    kold = monotone_key(old[pos], order)
    knew = monotone_key(new[pos], order)
    signed = np.dtype(f"<i{new.dtype.itemsize}")
    d = (knew - kold).view(signed)  # unsigned subtraction wraps: the step modulo 2^(8W)
    small = (d >= -127) & (d <= 127)
    steps = np.where(small, d, ESCAPE).astype(np.int8)
    escapes = new[pos[~small]].astype(new.dtype.newbyteorder("<"))

    counts = np.bincount(chunk, minlength=nc).astype("<u4")
    esc_counts = np.bincount(chunk[~small], minlength=nc).astype("<u4")
    return DeltaSections(np.concatenate([counts, esc_counts]), gaps, steps, escapes)


def decode(old: np.ndarray, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate sections against a base of len(old) elements.

    Returns (positions int64, new bit patterns at those positions); the caller
    scatters them, so an in-place apply can keep what it overwrote.
    """
    pos, chunk = _positions(sec, len(old))
    nc = nchunks(len(old))
    is_esc = sec.steps == ESCAPE
    if not np.array_equal(np.bincount(chunk[is_esc], minlength=nc), sec.table[nc:].astype(np.int64)):
        raise FormatError("escape markers in the steps disagree with the chunk table's escape counts")
    kold = monotone_key(old[pos], order)
    values = unkey(kold + sec.steps.astype(old.dtype), order)  # i8 -> uW sign-extends; uW add wraps
    values[is_esc] = sec.escapes
    return pos, values


def positions(sec: DeltaSections, n: int) -> np.ndarray:
    """The element indices the sections change, in a tensor of n elements (validated as decode() does)."""
    return _positions(sec, n)[0]


def _positions(sec: DeltaSections, n: int) -> tuple[np.ndarray, np.ndarray]:
    nc = nchunks(n)
    if len(sec.table) != 2 * nc:
        raise FormatError(f"chunk table has {len(sec.table)} entries, expected {2 * nc}")
    counts = sec.table[:nc].astype(np.int64)
    esc_counts = sec.table[nc:].astype(np.int64)
    chunk_len = np.full(nc, CHUNK_ELEMS, dtype=np.int64)
    if nc:
        chunk_len[-1] = n - (nc - 1) * CHUNK_ELEMS
    bad = np.flatnonzero((counts > chunk_len) | (esc_counts > counts))
    if len(bad):
        c = int(bad[0])
        raise FormatError(f"chunk {c}: {counts[c]} changes, {esc_counts[c]} escapes for {chunk_len[c]} elements")
    total, total_esc = int(counts.sum()), int(esc_counts.sum())
    if (len(sec.gaps), len(sec.steps), len(sec.escapes)) != (total, total, total_esc):
        raise FormatError(
            f"section sizes gaps={len(sec.gaps)} steps={len(sec.steps)} escapes={len(sec.escapes)} "
            f"disagree with the chunk table ({total} changes, {total_esc} escapes)"
        )

    chunk = np.repeat(np.arange(nc, dtype=np.int64), counts)
    # offset within chunk = running sum of (gap + 1) since the chunk began, minus 1
    run = np.cumsum(sec.gaps.astype(np.int64) + 1)
    starts = np.cumsum(counts) - counts  # index of each chunk's first change
    before = np.zeros(nc, dtype=np.int64)
    has_prev = starts > 0
    before[has_prev] = run[starts[has_prev] - 1]
    offset = run - before[chunk] - 1
    outside = np.flatnonzero(offset >= chunk_len[chunk])
    if len(outside):
        i = int(outside[0])
        raise FormatError(f"change #{i} lands at offset {offset[i]} of chunk {chunk[i]}, which has {chunk_len[chunk[i]]} elements")
    return chunk * CHUNK_ELEMS + offset, chunk
