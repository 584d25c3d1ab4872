"""How one message crosses a collective group: a JSON header, pieces of payload, a trailer of digests.

Broadcast and point-to-point transports (torch.distributed today) cannot stream
bytes; they move whole tensors. So a message is cut into **pieces** of at most
``chunk`` bytes, each moved by one operation, with a few pieces in flight so the
wire stays busy while the CPU hashes the piece before. The checksums travel
*after* the payload (a trailer of xxh3-64 per piece), which lets the sender hash
piece k while piece k is on the wire instead of hashing the whole message first.

A large blob is split into chunk-sized slices moved straight from/into its own
memory; consecutive small blobs share one piece through a staging copy, so a
message of many tiny blobs costs a few operations, not one per blob.

The functions take ``post(tensor) -> Work`` callables so the same code drives a
broadcast (publisher -> all) and a point-to-point send (subscriber -> publisher).
"""
from __future__ import annotations

import json
from collections import deque

import numpy as np
import xxhash

from ..errors import ChecksumError, TransportError
from .base import ENVELOPE, MAGIC, MAX_BLOB, MAX_HEADER, Message, open_head

WINDOW = 2  # pieces in flight: one on the wire while the CPU hashes or copies the other


def plan_pieces(sizes: list[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Cut blobs of these sizes into pieces; each piece is [(blob, offset, length), ...], never empty.

    A piece with a single entry is moved in place; a piece of several entries
    (small blobs packed together) goes through a staging buffer.
    """
    pieces, group, used = [], [], 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if group and used + n > chunk:
            pieces.append(group)
            group, used = [], 0
        if n >= chunk:
            pieces.extend([(i, off, min(chunk, n - off))] for off in range(0, n, chunk))
            continue
        group.append((i, 0, n))
        used += n
    if group:
        pieces.append(group)
    return pieces


def pack_head(msg: Message, chunk: int) -> tuple[bytes, list[int]]:
    """Envelope + JSON header (kind, meta, sizes, chunk) and the blob sizes."""
    sizes = [memoryview(b).nbytes for b in msg.blobs]
    head = json.dumps({"kind": msg.kind, "meta": msg.meta, "sizes": sizes, "chunk": chunk}, separators=(",", ":")).encode()
    return ENVELOPE.pack(MAGIC, len(head), xxhash.xxh3_64_intdigest(head)) + head, sizes


def parse_head(raw: bytes) -> tuple[str, dict, list[int], int]:
    """Check the envelope and header fields; returns kind, meta, sizes, chunk."""
    if len(raw) < ENVELOPE.size:
        raise TransportError(f"message header of {len(raw)} bytes is shorter than its envelope")
    magic, hlen, hsum = ENVELOPE.unpack_from(raw)
    if magic != MAGIC or hlen != len(raw) - ENVELOPE.size:
        raise TransportError(f"peer sent a frame that is not a wsync message (magic {magic!r}, length {hlen})")
    kind, meta, sizes, chunk = open_head(raw[ENVELOPE.size:], hsum, ("kind", "meta", "sizes", "chunk"))
    ok = (isinstance(kind, str) and isinstance(meta, dict) and isinstance(sizes, list)
          and all(type(n) is int and 0 <= n <= MAX_BLOB for n in sizes) and type(chunk) is int and 0 < chunk < (1 << 40))
    if not ok:
        raise TransportError("malformed message header: bad field types, blob sizes or chunk size")
    return kind, meta, sizes, chunk


def check_head_len(n: int) -> int:
    if not 0 < n <= MAX_HEADER + ENVELOPE.size:
        raise TransportError(f"peer announced a message header of {n} bytes (limit {MAX_HEADER})")
    return n


def as_u8(buf):
    """A buffer as a flat uint8 tensor sharing its memory (no copy)."""
    import warnings

    import torch

    arr = np.frombuffer(buf, dtype=np.uint8)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # Only senders pass read-only buffers (bytes) and collectives never write to a
    # source tensor; torch's warning is about the possibility, not a real write.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def send_pieces(views: list[memoryview], pieces, post, wire, wait) -> list[int]:
    """Move every piece with post(); returns their xxh3-64 digests (hashed while on the wire)."""
    digests, inflight, keep = [], deque(), deque()
    for k, piece in enumerate(pieces):
        host = _gather(views, piece)
        inflight.append(post(wire.outgoing(as_u8(host), k % WINDOW)))
        keep.append(host)  # a staging copy must outlive its operation
        digests.append(xxhash.xxh3_64_intdigest(host))
        if len(inflight) >= WINDOW:
            wait(inflight.popleft())
            keep.popleft()
    while inflight:
        wait(inflight.popleft())
    return digests


def recv_pieces(blobs: list[bytearray], pieces, post, wire, wait) -> list[int]:
    """Receive every piece into blobs (in place where possible); returns the digests of what arrived."""
    views = [memoryview(b) for b in blobs]
    targets = [memoryview(bytearray(sum(n for _, _, n in p))) if len(p) > 1 else _slice(views, p[0]) for p in pieces]
    inflight = deque()

    def start(k):
        inflight.append((k, post(wire.incoming(as_u8(targets[k]), k % WINDOW))))

    for k in range(min(WINDOW, len(pieces))):
        start(k)
    digests = []
    while inflight:
        k, work = inflight.popleft()
        wait(work)
        wire.landed(as_u8(targets[k]), k % WINDOW)
        if k + WINDOW < len(pieces):
            start(k + WINDOW)
        digests.append(xxhash.xxh3_64_intdigest(targets[k]))
        if len(pieces[k]) > 1:
            _scatter(views, pieces[k], targets[k])
    return digests


def verify(got: list[int], expected: np.ndarray) -> None:
    for k, (a, b) in enumerate(zip(got, expected.tolist())):
        if a != b:
            raise ChecksumError(f"message piece {k} of {len(got)} failed its checksum (corrupt in transit)")


def _slice(views, entry):
    i, off, n = entry
    return views[i][off:off + n]


def _gather(views, piece):
    if len(piece) == 1:
        return _slice(views, piece[0])
    out = bytearray(sum(n for _, _, n in piece))
    pos = 0
    for i, off, n in piece:
        out[pos:pos + n] = views[i][off:off + n]
        pos += n
    return memoryview(out)


def _scatter(views, piece, staged):
    pos = 0
    for i, off, n in piece:
        views[i][off:off + n] = staged[pos:pos + n]
        pos += n


class HostWire:
    """gloo moves host memory directly: no copies on either side."""

    def outgoing(self, t, slot):
        return t

    def incoming(self, t, slot):
        return t

    def landed(self, t, slot):
        pass


class CudaWire:
    """nccl moves device memory: host pieces are staged through WINDOW reusable GPU buffers."""

    def __init__(self, device, chunk: int):
        import torch

        self.bufs = [torch.empty(chunk, dtype=torch.uint8, device=device) for _ in range(WINDOW)]

    def outgoing(self, t, slot):
        dev = self.bufs[slot][: t.numel()]
        dev.copy_(t)
        return dev

    def incoming(self, t, slot):
        return self.bufs[slot][: t.numel()]

    def landed(self, t, slot):
        t.copy_(self.bufs[slot][: t.numel()])
