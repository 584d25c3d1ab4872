"""What a codec backend provides: the hot loops of the delta format and the checksum.

Backends differ in speed only. Each one must produce the bytes that
``wsync.codecs.delta_ref`` specifies; the test suite runs once per backend.

Three operations are the format (`delta_encode`, `delta_decode`, `checksum`), and
two its v2 tier (`v2_encode`, `v2_decode`, whose spec is ``wsync.codecs.v2_ref``).
The fused operations do what wsync.api needs per tensor (verify the base,
decode, write the result, checksum it) in as few passes over the tensor as a
backend can manage; `Composed` builds each of them from the three, so every
backend offers the same calls and a fast one overrides only what it fuses.
All checksums here are the hex strings of ``wsync.checksum``.

Wherever a call takes a tensor's bit patterns (old, new, bits, dst, src, out)
it also takes a ``wsync.tables.Table``, many tensors back to back, and means
their concatenation: positions and checksums are those of the gathered
array. `Composed` does exactly that (gathers, and writes back with
Table.put/scatter), so the reference backend stays the spec.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..codecs.base import Overwritten
from ..codecs import delta_ref
from ..codecs.delta_ref import DeltaSections
from ..tables import Table, as_array, write


class Kernels(Protocol):
    name: str

    def delta_encode(self, old: np.ndarray, new: np.ndarray, order: str) -> DeltaSections:
        """Sections for the changes from old to new (1-D <uW bit patterns)."""

    def delta_decode(self, old: np.ndarray, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray]:
        """Validated (positions, new bit patterns); raises FormatError on bad sections."""

    def checksum(self, buf) -> str:
        """xxh3-64 tree digest of a contiguous buffer."""

    def v2_encode(self, old: np.ndarray, sec: DeltaSections, dtype) -> dict:
        """codecs/v2_ref.encode's parts for sections of changes to old (the base's bits, an array or a Table)."""

    def v2_decode(self, old: np.ndarray, parts: dict, dtype) -> DeltaSections:
        """codecs/v2_ref.decode: the v1 sections those parts code; FormatError where the reference refuses."""

    def quantize(self, scheme, bits: np.ndarray, dtype: str, outs: list[np.ndarray], what: str = "tensor") -> None:
        """Write ``scheme.reference(bits, dtype)`` into outs (bit-pattern views shaped as the scheme's outputs;
        scheme: a wsync.quant scheme, told apart by its ``kind``). bits: the weight's patterns, shaped as the weight. QuantizeError as the reference
        (a non-finite element, named by its flat index); outs are then garbage."""

    # ---- fused (Composed provides each from the three above) ----

    def delta_encode_checksummed(self, old: np.ndarray, new: np.ndarray, order: str,
                                 old_sum: bool = True) -> tuple[DeltaSections, str | None, str]:
        """(delta_encode(old, new), checksum(old), checksum(new)); old's is None unless old_sum."""

    def write_changes(self, dst: np.ndarray, src: np.ndarray, sec: DeltaSections) -> None:
        """dst[p] = src[p] at every position the sections change (dst, src: 1-D, one dtype and length).

        FormatError on a position outside the tensor; what came before it is written.
        """

    def delta_decode_checksummed(self, old: np.ndarray, sec: DeltaSections,
                                 order: str) -> tuple[np.ndarray, np.ndarray, str]:
        """(*delta_decode(old, sec), checksum(old)); FormatError as delta_decode."""

    def delta_apply(self, old: np.ndarray, sec: DeltaSections, order: str,
                    out: np.ndarray | None = None) -> tuple[np.ndarray, str, str]:
        """(new bits, checksum(old), checksum(new)), out of place: old is never written.

        out: where the result goes (a fresh array if None); 1-D, old's dtype and
        length, not overlapping old. FormatError as delta_decode; out is then garbage.
        """

    def delta_apply_inplace(self, bits: np.ndarray, sec: DeltaSections, order: str) -> tuple[Overwritten, str, str]:
        """Write the changes into bits: (what was overwritten, checksum before, checksum after).

        On FormatError bits is left exactly as it was.
        """

    def copy_checksummed(self, src, dst: np.ndarray) -> str:
        """dst[:] = src (same bytes, no overlap) and return the checksum of those bytes."""

    def put(self, bits, positions: np.ndarray, values: np.ndarray) -> None:
        """bits[positions] = values: int64 positions in any order (undo of an in-place apply).

        ValueError, with nothing written, if any position is outside [0, len(bits)).
        """


def check_out(old, out, overlap: bool = False) -> None:
    """out fits old (dtype and length); arrays must not overlap unless allowed (Table pieces are trusted)."""
    if out.dtype != old.dtype or out.shape != old.shape:
        raise ValueError(f"out must be {old.dtype}{list(old.shape)}, got {out.dtype}{list(out.shape)}")
    if isinstance(old, Table) or isinstance(out, Table):
        return
    if not overlap and np.may_share_memory(out, old) and old.size:
        raise ValueError("out must not overlap old")


class Composed:
    """The fused operations as the Kernels protocol's three calls, one pass each; the quantizers as the
    reference's.

    A backend subclasses this and overrides what it can fuse; what it leaves
    keeps these semantics exactly (tests/kernel_cases.py holds every backend
    to them against the reference).
    """

    def quantize(self, scheme, bits, dtype, outs, what="tensor"):
        for out, value in zip(outs, scheme.reference(bits, dtype, what)):
            np.copyto(out, value.reshape(out.shape).view(out.dtype))

    def delta_encode_checksummed(self, old, new, order, old_sum=True):
        old, new = as_array(old), as_array(new)
        return self.delta_encode(old, new, order), self.checksum(old) if old_sum else None, self.checksum(new)

    def write_changes(self, dst, src, sec):
        src = as_array(src)
        check_out(src, dst, overlap=True)
        pos = delta_ref.positions(sec, len(dst))
        write(dst, pos, src[pos])

    def delta_decode_checksummed(self, old, sec, order):
        old = as_array(old)
        pos, values = self.delta_decode(old, sec, order)
        return pos, values, self.checksum(old)

    def delta_apply(self, old, sec, order, out=None):
        old = as_array(old)
        if isinstance(out, Table):
            check_out(old, out)
            new, before, after = self.delta_apply(old, sec, order)
            out.scatter(new)
            return out, before, after
        pos, values = self.delta_decode(old, sec, order)  # validates before anything is written
        if out is None:
            out = np.empty_like(old)
        check_out(old, out)
        np.copyto(out, old)
        out[pos] = values
        return out, self.checksum(old), self.checksum(out)

    def delta_apply_inplace(self, bits, sec, order):
        if isinstance(bits, Table):
            if not bits.writable:
                raise TypeError("this table's pieces are read-only")
            work = bits.gather()
            saved, before, after = self.delta_apply_inplace(work, sec, order)  # raises before bits is touched
            bits.put(saved.positions, work[saved.positions])
            return saved, before, after
        pos, values = self.delta_decode(bits, sec, order)
        before = self.checksum(bits)
        saved = Overwritten(bits[pos], pos)
        bits[pos] = values
        return saved, before, self.checksum(bits)

    def copy_checksummed(self, src, dst):
        s = _bytes_of(as_array(src))
        if isinstance(dst, Table):
            if len(s) != dst.nbytes:
                raise ValueError(f"src has {len(s)} bytes, dst {dst.nbytes}")
            dst.scatter(s.view(dst.dtype))
            return self.checksum(s)
        d = _bytes_of(dst)
        if len(s) != len(d):
            raise ValueError(f"src has {len(s)} bytes, dst {len(d)}")
        np.copyto(d, s)
        return self.checksum(dst)

    def put(self, bits, positions, values):
        positions = np.asarray(positions, dtype=np.int64)
        values = np.asarray(values)
        if values.shape != positions.shape:
            raise ValueError(f"values must be {len(positions)} x {bits.dtype}, got {values.dtype}{list(values.shape)}")
        bad = np.flatnonzero((positions < 0) | (positions >= len(bits)))
        if len(bad):
            k = int(bad[0])
            raise ValueError(f"positions[{k}] = {positions[k]} is outside [0, {len(bits)})")
        write(bits, positions, values)


def _bytes_of(buf) -> np.ndarray:
    """A flat uint8 view of a contiguous array or buffer."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("copy_checksummed needs C-contiguous arrays")
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, np.uint8)
