"""Record MACs: with a token, every record a tcp:// connection carries is authenticated, in order.

The token alone only guards the handshake. Without TLS, a relay on the path
could rewrite a frame and recompute its xxh3 (a checksum, not a MAC), and the
receiver would hand the rewritten bytes on as verified. So when the link has a
token, each record is followed by keyed-BLAKE3 tags::

    header (56 bytes)  tag(n, "H", header)
    body               tag(n, "B", header, body)      (HEAD and FRAME records only)

under the connection's own key (auth.Keys.frames: token, both handshake nonces,
direction), where n counts the records of the connection from 0. A record
changed, dropped, repeated, moved to another position or replayed from another
connection (or an earlier one) fails its tag. The receiver checks a header's
tag before acting on it and a body's before it marks the frame held, so a
failure (``Forged``) ends the link with nothing of the forged message kept.

The xxh3 sums stay: they tell damage in transit (resent) from forgery (fatal).
BLAKE3 rather than HMAC-SHA256: it hashes many chunks at once with SIMD, so it is the faster keyed hash.
"""
from __future__ import annotations

import hmac
import struct

import blake3

from ...errors import TransportError

TAG = 32  # bytes of every tag
COUNT = struct.Struct("<Q")


class Forged(TransportError):
    """A record failed its MAC: someone without the token changed, dropped, repeated or moved bytes on the
    path. Resending would not help: the link is closed."""


class RecordMac:
    """The tags of one connection's records, in the order they travel (one side writes, the other reads)."""

    def __init__(self, key: bytes):
        self._key = key
        self.n = 0  # records tagged so far

    def head(self, header: bytes) -> bytes:
        return blake3.blake3(COUNT.pack(self.n) + b"H" + header, key=self._key).digest()

    def body(self, header: bytes):
        """A hasher to feed the record's body to; its digest() is the body tag."""
        return blake3.blake3(COUNT.pack(self.n) + b"B" + header, key=self._key)

    def next(self) -> None:
        """The current record is complete (sent, or received and checked)."""
        self.n += 1

    def check(self, got: bytes, want: bytes, what: str, peer: str) -> None:
        if not hmac.compare_digest(got, want):
            raise Forged(f"{what} from {peer} (record {self.n} of its connection) failed its MAC: it was changed, "
                         "dropped, repeated or reordered on the path by someone without the token; closing the link")


def macs_for(keys: dict | None, socks: list) -> list[RecordMac | None]:
    """One RecordMac per socket that has a key (keys: socket -> key; None or absent: no token)."""
    return [RecordMac(keys[s]) if keys and keys.get(s) is not None else None for s in socks]
