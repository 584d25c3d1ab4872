"""The reference backend: numpy, readable, always available.

Its fused operations are `Composed`'s: the three reference calls one after
another, which is what the fused kernels of the other backends must equal.
"""
from __future__ import annotations

from ..checksum import checksum
from ..codecs import delta_ref
from .base import Composed


class RefKernels(Composed):
    name = "ref"
    delta_encode = staticmethod(delta_ref.encode)
    delta_decode = staticmethod(delta_ref.decode)
    checksum = staticmethod(checksum)
