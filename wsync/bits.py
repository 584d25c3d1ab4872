"""TensorBits: a tensor reduced to its bit pattern, the one type the codecs, checkpoints and snapshots share.

It lives apart from snapshot.py so that checkpoint.py (which reads files into
TensorBits) and snapshot.py (which reads paths through checkpoint.py) do not
import each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .checksum import checksum
from .dtypes import DType
from .tables import as_array


@dataclass(frozen=True)
class TensorBits:
    dtype: DType
    shape: tuple[int, ...]
    bits: np.ndarray  # 1-D, C-contiguous, dtype.bits_dtype; may alias the caller's tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def checksum(self) -> str:
        return checksum(as_array(self.bits))


State = dict[str, TensorBits]
