"""Records on a tcp:// stream after the handshake, and the checks applied to them.

A tcp link spreads each message over several TCP connections, so every record
names what it carries: which message (``seq``), which blob, which byte range,
and an xxh3-64 of its body. The fixed 56-byte record header carries its own
xxh3 too, so a flipped bit anywhere is seen as corruption (and answered by a
resend) rather than mistaken for a protocol violation (which is fatal).

Record header (little-endian)::

    0  4  magic b"WSF1"
    4  1  type: HEAD, FRAME, ACK, CLOSE
    8  8  seq     message sequence number (per direction, from 0)
    16 4  blob    blob index (FRAME)
    20 4  spare   zero
    24 8  off     byte offset in the blob (FRAME), a multiple of the message's frame size
    32 8  length  body bytes that follow
    40 8  body xxh3-64
    48 8  xxh3-64 of bytes 0..48

HEAD carries the message header (envelope.py, with its ``frame`` field); FRAME carries blob bytes;
ACK (``seq`` = every message below it is complete) and CLOSE have no body.
With a token, a tag follows the header and another the body (mac.py).
Every number read from the wire is bounded here before anything is allocated.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import xxhash

from ... import safejson
from ...errors import ChecksumError, TransportError
from .. import envelope

REC = struct.Struct("<4sB3xQIIQQQ")
REC_SUM = struct.Struct("<Q")
REC_SIZE = REC.size + REC_SUM.size  # 56
MAGIC = b"WSF1"
HEAD, FRAME, ACK, CLOSE = 1, 2, 3, 4
MIN_HEAD_LIMIT = 64 << 10  # a narrowed max_message (TcpLink.limit) lowers the header limit, never below this


class CorruptRecord(ChecksumError):
    """A record whose bytes do not match their checksum: the link resends it."""

    def __init__(self, msg: str, key: tuple | None = None):
        super().__init__(msg)
        self.key = key  # (seq, blob, frame) when known, to count resends per frame


class MessageTooLarge(TransportError):
    """A peer announced a message larger than this side accepts; refused before anything is allocated."""


@dataclass
class Record:
    type: int
    seq: int = 0
    blob: int = 0
    off: int = 0
    length: int = 0
    body_sum: int = 0


def pack(rec: Record) -> bytes:
    head = REC.pack(MAGIC, rec.type, rec.seq, rec.blob, 0, rec.off, rec.length, rec.body_sum)
    return head + REC_SUM.pack(xxhash.xxh3_64_intdigest(head))


def unpack(raw: bytes, mac=None, peer: str = "peer") -> Record:
    """Parse and check a record header (with mac, raw ends with its tag): CorruptRecord if its bytes are
    damaged, mac.Forged if they were forged; only then is any field believed."""
    head = raw[: REC.size]
    (want,) = REC_SUM.unpack_from(raw, REC.size)
    if xxhash.xxh3_64_intdigest(head) != want:
        raise CorruptRecord("record header failed its checksum (corrupt in transit)")
    if mac is not None:
        mac.check(raw[REC_SIZE:], mac.head(raw[:REC_SIZE]), "a record header", peer)
    magic, typ, seq, blob, spare, off, length, body_sum = REC.unpack(head)
    if magic != MAGIC or typ not in (HEAD, FRAME, ACK, CLOSE) or spare:
        raise TransportError(f"peer broke the tcp record format (magic {magic!r}, type {typ})")
    if typ in (ACK, CLOSE) and length:
        raise TransportError("peer sent an ACK/CLOSE record with a body")
    return Record(typ, seq, blob, off, length, body_sum)


def decode_head(body: bytes, max_message: int, why: str | None = None) -> envelope.Header:
    """A HEAD body: the envelope's checks, then its total size against what this side accepts.

    why: what set max_message, when the receiver narrowed it (TcpLink.limit), for the refusal."""
    h = envelope.parse(body, need=("frame",))
    total = sum(h.sizes)
    if total > max_message:
        if why is not None:
            raise MessageTooLarge(f"peer announced a {total}-byte message, above the {max_message} bytes {why}")
        raise MessageTooLarge(f"peer announced a {total}-byte message, above max_message={max_message}; "
                              "raise max_message on this side if that is expected")
    return h


def frame_count(size: int, frame: int) -> int:
    return (size + frame - 1) // frame


def check_frame(rec: Record, sizes: list[int], frame: int) -> int:
    """The frame index a FRAME record claims, after checking it tiles its blob exactly."""
    if rec.blob >= len(sizes):
        raise TransportError(f"peer sent a frame for blob {rec.blob} of a {len(sizes)}-blob message")
    size = sizes[rec.blob]
    if rec.off % frame or rec.off >= size or rec.length != min(frame, size - rec.off):
        raise TransportError(f"peer sent a frame at offset {rec.off} of {rec.length} bytes, "
                             f"which is not a frame of a {size}-byte blob cut in {frame}-byte frames")
    return rec.off // frame


# -- resume state: what one side holds of the other's messages ---------------------------------


def encode_state(next_seq: int, partial: dict[int, list[list[int]] | None]) -> bytes:
    """next_seq: all lower messages complete; partial: seq -> per-blob lists of held frame indices
    (None once the message is complete)."""
    doc = {"next": next_seq, "partial": [[s, held] for s, held in sorted(partial.items())]}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_state(body: bytes, sent: int) -> tuple[int, dict[int, list[set[int]] | None]]:
    """Parse the peer's resume state; ``sent`` is our next sequence number, which bounds it."""
    try:
        doc = safejson.loads(body, what="resume state")
        nxt, items = doc["next"], doc["partial"]
        partial = {}
        for s, held in items:
            if type(s) is not int or not nxt <= s < sent:
                raise ValueError(f"sequence {s} outside [{nxt}, {sent})")
            partial[s] = None if held is None else [set(map(_index, h)) for h in held]
    except (ValueError, KeyError, TypeError) as e:
        raise TransportError(f"malformed resume state from peer: {e}") from None
    if type(nxt) is not int or not 0 <= nxt <= sent:
        raise TransportError(f"peer claims to hold messages up to {nxt} but only {sent} were sent")
    return nxt, partial


def _index(i) -> int:
    if type(i) is not int or i < 0:
        raise ValueError(f"bad frame index {i!r}")
    return i
