"""The dtypes wsync moves, named as safetensors names them.

The codecs never do float arithmetic: they work on the bit patterns, so all a
dtype needs to say is its width and how its bits order (sign-magnitude floats,
two's-complement ints, or plain unsigned).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import FormatError


@dataclass(frozen=True)
class DType:
    name: str  # safetensors code, also the manifest's spelling
    itemsize: int  # bytes per element
    order: str  # "float" (sign-magnitude), "int" (two's complement) or "uint"
    torch_name: str  # attribute of the torch module

    @property
    def bits_dtype(self) -> np.dtype:
        """The unsigned little-endian integer dtype that views one element's bits."""
        return np.dtype(f"<u{self.itemsize}")


_ALL = [
    DType("BOOL", 1, "uint", "bool"),
    DType("U8", 1, "uint", "uint8"),
    DType("I8", 1, "int", "int8"),
    DType("F8_E4M3", 1, "float", "float8_e4m3fn"),
    DType("F8_E5M2", 1, "float", "float8_e5m2"),
    DType("U16", 2, "uint", "uint16"),
    DType("I16", 2, "int", "int16"),
    DType("F16", 2, "float", "float16"),
    DType("BF16", 2, "float", "bfloat16"),
    DType("U32", 4, "uint", "uint32"),
    DType("I32", 4, "int", "int32"),
    DType("F32", 4, "float", "float32"),
    DType("U64", 8, "uint", "uint64"),
    DType("I64", 8, "int", "int64"),
    DType("F64", 8, "float", "float64"),
]
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
_BY_TORCH = {d.torch_name: d for d in _ALL}
_BY_NUMPY = {
    np.dtype(np.bool_): DTYPES["BOOL"],
    np.dtype(np.uint8): DTYPES["U8"],
    np.dtype(np.int8): DTYPES["I8"],
    np.dtype(np.uint16): DTYPES["U16"],
    np.dtype(np.int16): DTYPES["I16"],
    np.dtype(np.float16): DTYPES["F16"],
    np.dtype(np.uint32): DTYPES["U32"],
    np.dtype(np.int32): DTYPES["I32"],
    np.dtype(np.float32): DTYPES["F32"],
    np.dtype(np.uint64): DTYPES["U64"],
    np.dtype(np.int64): DTYPES["I64"],
    np.dtype(np.float64): DTYPES["F64"],
}


def by_name(name: str) -> DType:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def from_torch(dtype) -> DType:
    name = str(dtype).removeprefix("torch.")
    try:
        return _BY_TORCH[name]
    except KeyError:
        raise TypeError(f"wsync cannot move torch dtype {dtype}; supported: {', '.join(_BY_TORCH)}") from None


def from_numpy(dtype) -> DType:
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        raise TypeError(f"big-endian numpy arrays are not supported (got {dt}); convert with .astype('{dt.newbyteorder('<')}')")
    try:
        return _BY_NUMPY[dt.newbyteorder("=")]
    except KeyError:
        raise TypeError(f"wsync cannot move numpy dtype {dt}") from None
