"""The message header every transport sends ahead of a message's blobs, and the one check of it.

A ``Message`` (base.py) crosses any transport as this header followed by its
blobs, however the transport moves them. The header is (integers little-endian)::

    0  4  magic b"WSM1"
    4  4  u32 JSON length H
    8  8  u64 xxh3-64 of the JSON
    16 H  UTF-8 JSON {"kind", "meta", "sizes": [bytes of each blob], ...fields}

Fields a transport adds for itself (each checked here, against the rest):

    frame   tcp: the size the blobs are cut into, one record each
    chunk   torch.distributed groups: the most bytes one collective moves
    device  indices of the blobs that travel as device memory (sorted, no repeats; left out when none)
    sums    per blob, the xxh3-64 hex digests of its host bytes: one, or one per ``piece``; none for a device blob
    piece   local: the bytes each digest of ``sums`` covers
    seg     local: the writer's shared-memory segment holding the host blobs back to back (null: no host bytes)
    msg     local: the writer's id of a message whose device blobs it holds until the reader lets go
    ipc     local: one CUDA IPC description (an object, checked by local_cuda) per device blob

``parse`` is the security-relevant part: a peer's bytes decide nothing (an
allocation, a count, a lookup) before every number in them is bounded here.
A header that fails its xxh3 is ChecksumError (damage in transit); anything
else wrong is TransportError (a broken or hostile peer).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import xxhash

from .. import safejson
from ..errors import ChecksumError, TransportError

MAGIC = b"WSM1"
PREFIX = struct.Struct("<4sIQ")  # magic, JSON length, xxh3-64 of the JSON
MAX_HEADER = 16 << 20  # bytes of JSON: a header is small; anything bigger is a broken peer
MAX_KIND = 64  # characters of a kind ("hello", "bucket", "ack", ...)
MAX_BLOBS = 1 << 16  # blobs in one message
MAX_BLOB = 1 << 40  # bytes in one blob: more than any bucket a sync sends
MIN_FRAME, MAX_FRAME = 4 << 10, 256 << 20  # bounds of tcp's frame size
MAX_PIECE = 1 << 40  # bounds chunk and piece: a cut larger than any blob means nothing
DIGEST = 16  # hex characters of an xxh3-64 digest
FIELDS = ("frame", "chunk", "device", "sums", "piece", "seg", "msg", "ipc")


@dataclass
class Header:
    kind: str
    meta: dict
    sizes: list[int]
    frame: int | None = None
    chunk: int | None = None
    device: list[int] = field(default_factory=list)
    sums: list[list[str]] | None = None
    piece: int | None = None
    seg: int | None = None
    msg: int | None = None
    ipc: list[dict] | None = None


def pack(kind: str, meta: dict, sizes: list[int], **fields) -> bytes:
    """The header of a message: kind, meta, blob sizes, and this transport's fields (None ones left out).

    TypeError if meta is not JSON-serialisable."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise TypeError(f"unknown message header fields {sorted(unknown)}")
    doc = {"kind": kind, "meta": meta, "sizes": sizes}
    doc.update((k, v) for k, v in fields.items() if v is not None)
    if not doc.get("device"):
        doc.pop("device", None)
    return seal(json.dumps(doc, separators=(",", ":")).encode())


def seal(body: bytes) -> bytes:
    """JSON bytes behind the magic, their length and their xxh3-64."""
    return PREFIX.pack(MAGIC, len(body), xxhash.xxh3_64_intdigest(body)) + body


def check_length(n: int) -> int:
    """A header length a peer announced ahead of the header (prefix included), refused before a buffer is made."""
    if type(n) is not int or not PREFIX.size < n <= PREFIX.size + MAX_HEADER:
        raise TransportError(f"peer announced a message header of {n} bytes (limit {PREFIX.size + MAX_HEADER})")
    return n


def parse(raw, need: tuple[str, ...] = (), may: tuple[str, ...] = ()) -> Header:
    """Check a whole header (prefix and JSON) and return it.

    need: the fields this transport always sends; may: those it sends only sometimes; any other field is
    refused. What a receiver accepts in total is its own policy (tcp's max_message), checked after this."""
    raw = bytes(raw)
    if len(raw) < PREFIX.size:
        raise TransportError(f"message header of {len(raw)} bytes is shorter than its {PREFIX.size}-byte prefix")
    magic, hlen, hsum = PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise TransportError(f"peer sent a frame that is not a wsync message (magic {magic!r})")
    if hlen > MAX_HEADER:
        raise TransportError(f"message header of {hlen} bytes exceeds the {MAX_HEADER}-byte limit")
    if hlen != len(raw) - PREFIX.size:
        raise TransportError(f"message header declares {hlen} bytes of JSON but {len(raw) - PREFIX.size} came")
    body = raw[PREFIX.size:]
    if xxhash.xxh3_64_intdigest(body) != hsum:
        raise ChecksumError("message header checksum mismatch (corrupt in transit)")
    try:
        doc = safejson.loads(body, what="message header")
    except (ValueError, RecursionError) as e:
        raise TransportError(f"malformed message header: {e}") from None
    if not isinstance(doc, dict):
        raise _bad("not a JSON object")
    missing = [k for k in ("kind", "meta", "sizes", *need) if k not in doc]
    if missing:
        raise _bad(f"missing {', '.join(missing)}")
    extra = sorted(set(doc) - {"kind", "meta", "sizes", *need, *may})
    if extra:
        raise _bad(f"unexpected field {extra[0]!r}")
    h = Header(_kind(doc["kind"]), _meta(doc["meta"]), _sizes(doc["sizes"]))
    if "frame" in doc:
        h.frame = _int(doc["frame"], "frame size", MIN_FRAME, MAX_FRAME)
    if "chunk" in doc:
        h.chunk = _int(doc["chunk"], "chunk size", 1, MAX_PIECE - 1)
    if "piece" in doc:
        h.piece = _int(doc["piece"], "piece size", 1, MAX_PIECE - 1)
    if "device" in doc:
        h.device = _device(doc["device"], len(h.sizes))
    if "sums" in doc:
        h.sums = _sums(doc["sums"], h.sizes, set(h.device), h.piece)
    if "seg" in doc:
        h.seg = None if doc["seg"] is None else _int(doc["seg"], "segment id", 0, 1 << 62)
    if "msg" in doc:
        h.msg = _int(doc["msg"], "message id", 1, 1 << 62)
    if "ipc" in doc:
        h.ipc = doc["ipc"]
        if not (isinstance(h.ipc, list) and len(h.ipc) == len(h.device) and all(isinstance(d, dict) for d in h.ipc)):
            raise _bad("ipc must hold one description object per device blob")
    elif h.device and "ipc" in need + may:
        raise _bad("device blobs without their ipc descriptions")
    return h


def _bad(what: str) -> TransportError:
    return TransportError(f"malformed message header: {what}")


def _kind(kind) -> str:
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        raise _bad(f"kind must be a string of 1 to {MAX_KIND} characters")
    return kind


def _meta(meta) -> dict:
    if not isinstance(meta, dict):
        raise _bad("meta must be a JSON object")
    return meta


def _sizes(sizes) -> list[int]:
    if not isinstance(sizes, list) or len(sizes) > MAX_BLOBS:
        raise _bad(f"sizes must be a list of at most {MAX_BLOBS} blob sizes")
    if not all(type(n) is int and 0 <= n <= MAX_BLOB for n in sizes):
        raise _bad(f"blob sizes must be integers in [0, {MAX_BLOB}]")
    return sizes


def _int(v, what: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(f"{what} {v!r} outside [{lo}, {hi}]")
    return v


def _device(device, nblobs: int) -> list[int]:
    if not (isinstance(device, list) and all(type(i) is int and 0 <= i < nblobs for i in device)
            and device == sorted(set(device))):
        raise _bad("device blobs must be distinct blob indices in increasing order")
    return device


def _sums(sums, sizes: list[int], device: set, piece: int | None) -> list[list[str]]:
    """One list of digests per blob: none for a device blob; for a host blob one, or one per piece with piece."""
    if not isinstance(sums, list) or len(sums) != len(sizes):
        raise _bad("sums must list the digests of every blob")
    for i, (s, n) in enumerate(zip(sums, sizes)):
        want = 0 if i in device else (1 if piece is None else -(-n // piece))
        if not (isinstance(s, list) and len(s) == want and all(isinstance(d, str) and len(d) == DIGEST for d in s)):
            raise _bad(f"blob {i} of {n} bytes needs {want} digests of {DIGEST} hex characters")
    return sums
