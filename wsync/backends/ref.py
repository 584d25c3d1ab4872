"""The reference backend: numpy, readable, always available.

Its fused operations are `Composed`'s: the three reference calls one after
another, which is what the fused kernels of the other backends must equal.
"""
from __future__ import annotations

from ..checksum import checksum
from ..codecs import delta_ref, v2_ref
from ..tables import as_array
from .base import Composed


class RefKernels(Composed):
    """A Table argument is gathered into its concatenation: that is what every backend must equal."""

    name = "ref"

    @staticmethod
    def delta_encode(old, new, order):
        return delta_ref.encode(as_array(old), as_array(new), order)

    @staticmethod
    def delta_decode(old, sec, order):
        return delta_ref.decode(as_array(old), sec, order)

    @staticmethod
    def checksum(buf):
        return checksum(as_array(buf))

    @staticmethod
    def v2_encode(old, sec, dtype):
        return v2_ref.encode(as_array(old), sec, dtype)

    @staticmethod
    def v2_decode(old, parts, dtype):
        return v2_ref.decode(as_array(old), parts, dtype)
