"""What every codec hands to, and gets from, the payload assembler.

A codec module offers encode_tensor (-> Encoded), decode_tensor (-> Decoded,
the changes as arrays, base untouched) and apply_tensor (-> Applied, the new
tensor written out of place or into the base, with the checksums the backend
took on the way). The checksums ride along so wsync.api can verify a tensor
without reading it again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from ..errors import FormatError
from ..tables import read, write


@dataclass
class Decoded:
    """A tensor's new contents: all of it (positions None) or only the changed elements."""

    values: np.ndarray  # <uW bit patterns
    positions: np.ndarray | None = None  # int64 element indices, increasing
    base_sum: str | None = None  # checksum of the base, when decoding read all of it anyway

    def scatter_into(self, bits) -> np.ndarray:
        """Write into bits (1-D, writable, or a Table); return what was overwritten, for undo."""
        old = read(bits, self.positions)
        write(bits, self.positions, self.values)
        return old


@dataclass
class Overwritten:
    """What an in-place write replaced, so that it can be put back."""

    values: np.ndarray  # the old bit patterns: at `positions`, or the whole tensor
    positions: np.ndarray | None = None  # int64 element indices; None means every element

    def restore(self, bits) -> None:
        """Put the values back into bits: a 1-D array or a wsync.tables.Table (positions are the stream's)."""
        write(bits, self.positions, self.values)


@dataclass
class Encoded:
    """One tensor's frame, and the checksums its encoder took while reading the tensors."""

    kind: str  # the spec's kind: "raw", "same", "xor", "delta-sparse", ...
    parts: dict  # part name -> bytes-like, in frame order
    base_sum: str | None = None  # checksum of the base bits, if the encoder computed it
    new_sum: str | None = None  # checksum of the new bits, likewise
    verbatim: bool = False  # the frame is exactly the new bits, so its checksum is theirs
    sections: object = None  # a delta kind's DeltaSections, kept by delta.measure() for callers that apply them


@dataclass
class Applied:
    """One tensor after apply_tensor: its new bits and what the backend saw on the way."""

    bits: np.ndarray  # the new bit patterns (the base's own memory when applied in place)
    new_sum: str  # checksum of bits
    base_sum: str | None = None  # checksum of the base before the apply, when asked for
    overwritten: Overwritten | None = None  # in place: what to put back to undo it

    def undo(self) -> None:
        if self.overwritten is not None:
            self.overwritten.restore(self.bits)


def write_whole(values: np.ndarray, base, *, kernels, inplace: bool, base_sum: bool) -> Applied:
    """A tensor replaced whole by `values` (raw data or an undone xor), each byte read once.

    Out of place into a fresh array; in place into base.bits, after copying
    what it held aside for undo (and checksumming it on the way).
    """
    if not inplace:
        out = np.empty(len(values), values.dtype)
        return Applied(out, kernels.copy_checksummed(values, out), kernels.checksum(base.bits) if base_sum else None)
    saved = np.empty(len(base.bits), base.bits.dtype)
    before = kernels.copy_checksummed(base.bits, saved)
    return Applied(base.bits, kernels.copy_checksummed(values, base.bits), before, Overwritten(saved))


def zstd_compress(data, level: int) -> bytes:
    """zstd frame with its content size; an empty section stays empty."""
    if len(data) == 0:
        return b""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


# No zstd frame expands more than this: a block regenerates at most 128 KiB, and the smallest block
# (an RLE block) is 4 bytes. A section declaring more than this times its stored size is a lie.
ZSTD_MAX_RATIO = (128 << 10) // 4


def zstd_decompress(frame, expected: int, what: str) -> bytes:
    """Decompress exactly `expected` bytes from one zstd frame or raise FormatError.

    The caller has checked `expected` against what it knows (the base's size, a
    budget); the frame's own header and length must agree before anything is allocated.
    """
    if len(frame) == 0:
        if expected:
            raise FormatError(f"{what}: empty section, expected {expected} bytes once decompressed")
        return b""
    _check_frame_size(frame, expected, what)
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: corrupt zstd frame ({e})") from None
    if len(out) != expected:
        raise FormatError(f"{what}: decompressed to {len(out)} bytes, expected {expected}")
    return out


def zstd_blocks(frame, expected: int, what: str, block: int = 1 << 20):
    """The `expected` bytes of one zstd frame in pieces of at most `block` bytes, for readers that only
    count: memory stays at one block whatever the frame declares."""
    if len(frame) == 0:
        if expected:
            raise FormatError(f"{what}: empty section, expected {expected} bytes once decompressed")
        return
    _check_frame_size(frame, expected, what)
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(memoryview(frame), read_across_frames=False) as r:
            while got < expected:
                piece = r.read(min(block, expected - got))
                if not piece:
                    break
                got += len(piece)
                yield piece
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: corrupt zstd frame ({e})") from None
    if got != expected:
        raise FormatError(f"{what}: decompressed to {got} bytes, expected {expected}")


def _check_frame_size(frame, expected: int, what: str) -> None:
    """The frame states its size, the size is `expected`, and `frame` is long enough to hold that much."""
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: corrupt zstd frame ({e})") from None
    if size < 0:
        raise FormatError(f"{what}: zstd frame does not state its content size (wsync always writes it)")
    if size != expected:
        raise FormatError(f"{what}: frame holds {size} bytes, expected {expected}")
    if expected > ZSTD_MAX_RATIO * len(frame):
        raise FormatError(f"{what}: a {len(frame)}-byte zstd frame cannot hold {expected} bytes")


def frombuffer(buf, dtype, what: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if len(buf) % dtype.itemsize:
        raise FormatError(f"{what}: {len(buf)} bytes is not a whole number of {dtype.itemsize}-byte elements")
    return np.frombuffer(buf, dtype=dtype)
