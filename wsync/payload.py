"""The container: fixed header, JSON manifest, then the body of tensor frames.

Layout (all integers little-endian)::

    0   8  magic  b"\\x89WSYNC\\r\\n"
    8   4  u32    format version (2)
    12  4  u32    manifest length M
    16  8  u64    body length B
    24  8  u64    xxh3-64 of the manifest bytes
    32  M         manifest (UTF-8 JSON, see manifest.py)
    32+M B        body: each tensor's parts back to back, in manifest order

A file is exactly 32 + M + B bytes; anything shorter is truncated and anything
longer is rejected, so a receiver never guesses where a payload ends.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

import xxhash

from .errors import ChecksumError, FormatError
from .fsutil import atomic_write
from .manifest import FORMAT_VERSION, Manifest, TensorSpec, unsupported

MAGIC = b"\x89WSYNC\r\n"
HEADER = struct.Struct("<8sIIQQ")
MAX_MANIFEST = 256 << 20  # a manifest this large is a lie, not a model


@dataclass
class Payload:
    manifest: Manifest
    body: memoryview  # the tensors' bytes; may be backed by an mmap
    # tensors whose stored bytes passed their checksum, with what decoding them needed no base for
    # (api.prepare fills it as a bucket arrives; apply then skips that work)
    unpacked: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Total serialized size (header + manifest + body)."""
        return HEADER.size + len(self.manifest.to_json()) + len(self.body)

    def frame(self, spec: TensorSpec) -> memoryview:
        return self.body[spec.offset : spec.offset + spec.length]

    def parts(self, spec: TensorSpec) -> dict[str, memoryview]:
        out, pos = {}, spec.offset
        for name, n in spec.parts.items():
            out[name] = self.body[pos : pos + n]
            pos += n
        return out

    def header(self) -> bytes:
        m = self.manifest.to_json()
        return HEADER.pack(MAGIC, FORMAT_VERSION, len(m), len(self.body), xxhash.xxh3_64_intdigest(m)) + m

    def to_bytes(self) -> bytes:
        return self.header() + bytes(self.body)

    def write(self, path) -> None:
        """Write atomically: a reader sees the old file or the whole new one."""
        with atomic_write(path) as f:
            f.write(self.header())
            f.write(self.body)

    @classmethod
    def from_bytes(cls, buf) -> "Payload":
        buf = memoryview(buf).cast("B")
        manifest, hlen = cls._parse_head(buf, len(buf))
        return cls(manifest, buf[hlen:])

    @property
    def on_device(self) -> bool:
        """The body is device memory (a flat uint8 CUDA tensor, from a link that carries device memory)."""
        return getattr(self.body, "is_cuda", False) is True

    @classmethod
    def from_parts(cls, head, body) -> "Payload":
        """A payload received as header+manifest bytes and a separate body buffer (no copy of the body).

        body may be a flat uint8 CUDA tensor: its bytes are then checked and applied on the device."""
        head = memoryview(head).cast("B")
        if getattr(body, "is_cuda", False) is not True:
            body = memoryview(body).cast("B")
        manifest, hlen = cls._parse_head(head, len(head) + len(body))
        if hlen != len(head):
            raise FormatError(f"payload head is {len(head)} bytes, its header says {hlen}")
        return cls(manifest, body)

    @staticmethod
    def _parse_head(buf: memoryview, total: int) -> tuple[Manifest, int]:
        """Check the fixed header and manifest; total is the whole payload's length. Returns (manifest, 32 + M)."""
        if len(buf) < HEADER.size:
            raise FormatError(f"truncated payload: {len(buf)} bytes, the header alone is {HEADER.size}")
        magic, version, mlen, blen, mhash = HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise FormatError(f"not a wsync payload (magic {bytes(magic)!r})")
        if version != FORMAT_VERSION:
            raise FormatError(unsupported(version))
        if mlen > MAX_MANIFEST:
            raise FormatError(f"manifest length {mlen} exceeds the {MAX_MANIFEST}-byte limit")
        expect = HEADER.size + mlen + blen
        if total != expect or len(buf) < HEADER.size + mlen:
            what = "truncated" if total < expect else "trailing bytes in"
            raise FormatError(f"{what} payload: header promises {expect} bytes, got {total}")
        mbytes = bytes(buf[HEADER.size : HEADER.size + mlen])
        if xxhash.xxh3_64_intdigest(mbytes) != mhash:
            raise ChecksumError("manifest checksum mismatch: the header or manifest is corrupt")
        manifest = Manifest.from_json(mbytes)
        if manifest.body_length != blen:
            raise FormatError(f"manifest describes {manifest.body_length} body bytes, header says {blen}")
        return manifest, HEADER.size + mlen

    @classmethod
    def read(cls, path) -> "Payload":
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise FormatError(f"{path}: empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return cls.from_bytes(mm)


def as_payload(obj) -> Payload:
    if isinstance(obj, Payload):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return Payload.read(obj)
    if isinstance(obj, (bytes, bytearray, memoryview, mmap.mmap)):
        return Payload.from_bytes(obj)
    raise TypeError(f"expected a Payload, bytes or a path, got {type(obj).__name__}")
