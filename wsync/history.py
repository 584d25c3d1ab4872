"""The publisher's memory of versions, and how a subscriber catches up from it.

The publisher keeps the newest keyframe (a whole state, immutable) and the
delta of every version since, each against the version before it. A subscriber
holding version v gets the deltas v+1..N when all of them are kept, and
otherwise the keyframe followed by the deltas after it. Each keyframe drops
the deltas from before the previous one, so memory stays flat however many
versions pass: at most one keyframe state, the newest state, and two windows of
keyframe_every small deltas. Deltas are small, but raw versions (codec="raw")
are whole models, so the kept versions are also bounded by bytes (``trim``):
the oldest go first, and a subscriber that needed one gets a keyframe of the
newest state instead.

Everything here is pure planning or plain bookkeeping under the caller's lock;
the encoding and sending happen in sync.py.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .snapshot import State


@dataclass
class EncodedVersion:
    """One version as a list of bucket messages, filled in by the encoder as each bucket is ready."""

    version: int
    base_version: int | None  # None: a keyframe (raw, applies to anything)
    checksum: str | None  # digest of the whole state this version produces (set once encoded)
    count: int  # buckets it will have
    buckets: list = field(default_factory=list)  # transport Messages, in order
    error: BaseException | None = None  # set if encoding failed; the version is then skipped
    nbytes: int = 0  # payload bytes so far
    # None: the buckets are kept above as they are encoded. Otherwise make(i) encodes bucket i for the one sender
    # that asks, and nothing is kept (a keyframe of a state on disk: it can always be encoded again)
    make: Callable[[int], Any] | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.buckets) == self.count


@dataclass
class Keyframe:
    version: int
    state: State  # never mutated once stored
    checksum: str | None  # None until an encoding of this version has produced it
    encoded: EncodedVersion | None = None  # raw buckets, made the first time a subscriber needs them
    lock: threading.Lock = field(default_factory=threading.Lock)


def catch_up_versions(have: int | None, newest: int, keyframe: int, deltas) -> tuple[int | None, list[int]]:
    """What to send a subscriber holding `have` so it reaches `newest`.

    Returns (keyframe version to send first, or None; delta versions after it).
    `deltas` holds the versions whose delta (against version - 1) is kept.
    """
    if have is not None and keyframe <= newest and have <= newest:
        chain = list(range(have + 1, newest + 1))
        if all(v in deltas for v in chain):
            return None, chain
    return keyframe, [v for v in range(keyframe + 1, newest + 1)]


def keyframe_due(version_index: int, since_keyframe: int, keyframe_every: int) -> bool:
    """The first version is always a keyframe; then every keyframe_every versions (0: never again)."""
    return version_index == 0 or (keyframe_every > 0 and since_keyframe >= keyframe_every)


class History:
    """Versions since the newest keyframe. Not thread-safe: the Publisher holds its lock around every call."""

    def __init__(self):
        self.keyframe: Keyframe | None = None
        self.deltas: dict[int, EncodedVersion] = {}
        self.newest: int | None = None
        self.checksums: dict[int, str] = {}  # version -> state digest, for versions still reachable

    def add_keyframe(self, version: int, state: State, checksum: str | None, delta: EncodedVersion | None) -> None:
        """A new keyframe at `version`.

        The deltas since the previous keyframe stay (with `delta`, from version - 1),
        so a subscriber a few versions behind across the boundary still gets deltas,
        not a whole keyframe; older ones go. At most two windows of deltas are kept.
        """
        prev = self.keyframe.version if self.keyframe is not None else version
        self.keyframe = Keyframe(version, state, checksum)
        self.deltas = {v: d for v, d in self.deltas.items() if v > prev}
        if delta is not None:
            self.deltas[version] = delta
        self.checksums = {v: c for v, c in self.checksums.items() if v >= prev}
        self._set_newest(version, checksum)

    def add_delta(self, enc: EncodedVersion) -> None:
        self.deltas[enc.version] = enc
        self._set_newest(enc.version, enc.checksum)

    def _set_newest(self, version: int, checksum: str | None) -> None:
        self.newest = version
        self.checksums[version] = checksum

    def known(self, version: int, checksum: str) -> None:
        """A version's digest, once its encoding has produced it."""
        if version in self.checksums:
            self.checksums[version] = checksum
        if self.keyframe is not None and self.keyframe.version == version and self.keyframe.checksum is None:
            self.keyframe.checksum = checksum

    def drop(self, version: int) -> None:
        """Forget a version whose encoding failed; if it was the newest, the one before is newest again."""
        self.deltas.pop(version, None)
        if self.newest == version and (self.keyframe is None or self.keyframe.version != version):
            self.checksums.pop(version, None)
            self.newest = max(self.checksums, default=None)

    def held_bytes(self) -> int:
        """Bytes of encoded versions kept for catch-up (the keyframe's own state and encoding aside)."""
        return sum(d.nbytes for d in self.deltas.values())

    def trim(self, cap: int) -> list[int]:
        """Drop the oldest finished versions until the rest hold at most cap bytes; returns those dropped.

        The newest version and one still being encoded always stay (a sender may be waiting on its buckets)."""
        held, dropped = self.held_bytes(), []
        for v in sorted(self.deltas):
            if held <= cap:
                break
            d = self.deltas[v]
            if v == self.newest or not d.done:
                continue
            del self.deltas[v]
            held -= d.nbytes
            dropped.append(v)
        return dropped

    def keyframe_chain_kept(self) -> bool:
        """Every version from the keyframe to the newest is still kept, each on the one before it."""
        if self.keyframe is None or self.newest is None:
            return False
        v = self.newest
        while v != self.keyframe.version:
            d = self.deltas.get(v)
            if d is None or d.error is not None or d.base_version is None:
                return False
            v = d.base_version
        return True

    def catch_up(self, have: int | None, have_checksum: str | None) -> tuple[Keyframe | None, list[EncodedVersion]]:
        """The keyframe (or None) and deltas that bring a subscriber at `have` to the newest version."""
        if self.newest is None or self.keyframe is None:
            return None, []
        if have is not None and have_checksum is not None and self.checksums.get(have) not in (None, have_checksum):
            have = None  # it holds something else under that number: start over from the keyframe
        if have is not None and have not in self.checksums:
            have = None
        kf, chain = catch_up_versions(have, self.newest, self.keyframe.version, self.deltas)
        deltas = [self.deltas[v] for v in chain if v in self.deltas and self.deltas[v].error is None]
        return (self.keyframe if kf is not None else None), deltas
