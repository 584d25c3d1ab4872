"""What every codec hands to, and gets from, the payload assembler."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from ..errors import FormatError


@dataclass
class Decoded:
    """A tensor's new contents: all of it (positions None) or only the changed elements."""

    values: np.ndarray  # <uW bit patterns
    positions: np.ndarray | None = None  # int64 element indices, increasing

    def scatter_into(self, bits: np.ndarray) -> np.ndarray:
        """Write into bits (1-D, writable); return what was overwritten, for undo."""
        if self.positions is None:
            old = bits.copy()
            bits[:] = self.values
        else:
            old = bits[self.positions]
            bits[self.positions] = self.values
        return old

    def undo(self, bits: np.ndarray, old: np.ndarray) -> None:
        if self.positions is None:
            bits[:] = old
        else:
            bits[self.positions] = old


def zstd_compress(data, level: int) -> bytes:
    """zstd frame with its content size; an empty section stays empty."""
    if len(data) == 0:
        return b""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def zstd_decompress(frame, expected: int, what: str) -> bytes:
    """Decompress exactly `expected` bytes from one zstd frame or raise FormatError."""
    if len(frame) == 0:
        if expected:
            raise FormatError(f"{what}: empty section, expected {expected} bytes once decompressed")
        return b""
    try:
        size = zstandard.frame_content_size(frame)
        if size != expected:
            raise FormatError(f"{what}: frame holds {size} bytes, expected {expected}")
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: corrupt zstd frame ({e})") from None
    if len(out) != expected:
        raise FormatError(f"{what}: decompressed to {len(out)} bytes, expected {expected}")
    return out


def frombuffer(buf, dtype, what: str) -> np.ndarray:
    dtype = np.dtype(dtype)
    if len(buf) % dtype.itemsize:
        raise FormatError(f"{what}: {len(buf)} bytes is not a whole number of {dtype.itemsize}-byte elements")
    return np.frombuffer(buf, dtype=dtype)
