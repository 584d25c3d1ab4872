"""The reference backend: numpy, readable, always available."""
from __future__ import annotations

from ..checksum import checksum
from ..codecs import delta_ref


class RefKernels:
    name = "ref"
    delta_encode = staticmethod(delta_ref.encode)
    delta_decode = staticmethod(delta_ref.decode)
    checksum = staticmethod(checksum)
