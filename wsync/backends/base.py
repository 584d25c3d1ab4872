"""What a codec backend provides: the hot loops of the delta format and the checksum.

Backends differ in speed only. Each one must produce the bytes that
``wsync.codecs.delta_ref`` specifies; the test suite runs once per backend.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..codecs.delta_ref import DeltaSections


class Kernels(Protocol):
    name: str

    def delta_encode(self, old: np.ndarray, new: np.ndarray, order: str) -> DeltaSections:
        """Sections for the changes from old to new (1-D <uW bit patterns)."""

    def delta_decode(self, old: np.ndarray, sec: DeltaSections, order: str) -> tuple[np.ndarray, np.ndarray]:
        """Validated (positions, new bit patterns); raises FormatError on bad sections."""

    def checksum(self, buf) -> str:
        """xxh3-64 hex digest of a contiguous buffer."""
