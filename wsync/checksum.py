"""Checksums: a two-level xxh3-64 tree, written as 16 hex digits.

checksum(buf) = xxh3_64(d_0 || d_1 || ... || d_k), where d_i is the xxh3-64 of
the i-th 1 MiB block of buf as 8 little-endian bytes (the last block may be
short; an empty buffer has no blocks). Blocks hash independently, so CPU
threads and GPU blocks can share the work and still agree with this reference
byte for byte. xxh3 runs at memory speed, so checking every tensor on every
update is cheap next to moving it. It guards against corruption, not against an
attacker: the transports authenticate peers separately.
"""
from __future__ import annotations


import numpy as np
import xxhash

ALGO = "xxh3-64-tree-1m"
BLOCK = 1 << 20


def block_digests(buf) -> np.ndarray:
    """xxh3-64 of each BLOCK-sized block of buf, as <u8."""
    mv = memoryview(buf).cast("B")
    return np.array([xxhash.xxh3_64_intdigest(mv[i : i + BLOCK]) for i in range(0, len(mv), BLOCK)], dtype="<u8")


def combine(digests: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(digests, dtype="<u8").tobytes())


def checksum(buf) -> str:
    """Checksum of a contiguous buffer (bytes, memoryview, or C-contiguous numpy array)."""
    return combine(block_digests(buf))


def state_digest(entries) -> str:
    """The one digest of weights: xxh3-64 over sorted (name, dtype, shape, checksum) entries, order-independent.

    Two things are digested with it, and they differ because their entries do:
    - a version (the ``checksum`` every payload and version carries, on the wire and on disk): one entry
      per segment, ``("<layout hash>:<j>", dtype, (numel,), checksum of the segment's bits)``; it depends
      on how the version is cut into buckets and segments (subscriber.version_digest computes it from a state);
    - a state, whatever its layout (snapshot.digest, what engines report to be compared with a trainer): one
      entry per tensor, ``(name, dtype, shape, checksum of the tensor's bits)``.
    """
    h = xxhash.xxh3_64()
    for name, dtype, shape, csum in sorted(entries):
        h.update(f"{name}\0{dtype}\0{list(shape)}\0{csum}\n".encode())
    return h.hexdigest()
