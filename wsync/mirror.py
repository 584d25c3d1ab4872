"""The publisher's own copy of the newest version, and deltas measured straight from the trainer's tensors.

A delta needs the previous version and the new one. The first publish path
(snapshot.Copying) copies the trainer's whole state, so the trainer may move
on, and the encoder then reads that copy and the previous one again: four
passes over the model's bytes, and on a CPU memory traffic is a delta's cost.

When the trainer's tensors are in host memory, publish() takes the other
path: it makes the encoder's one pass itself, over the trainer's tensors and
the Mirror (the previous version, which only the publisher holds), keeps what
changed, and writes those changes into the Mirror, which so becomes the new
version. That reads each byte of the two states once and writes only what
changed. The trainer waits for that pass (about what the copy took); the
zstd stage, framing and sending of each bucket run behind it, on the
encoder's thread, while publish() measures the next bucket.
"""
from __future__ import annotations

import threading

from .codecs import delta
from .codecs.base import Encoded
from .errors import SnapshotError
from .layout import Bound, Layout, segments
from .snapshot import State, TensorBits, destination, owned_copy


class Mirror:
    """A private, writable copy of one published version (None until the encoder makes one).

    publish() writes each new version into it under ``lock``; anything else
    that reads it (the encoder adopting a keyframe, a sender freezing an
    on-demand keyframe) holds the lock too.
    """

    def __init__(self, kernels):
        self.state: State | None = None
        self.version: int | None = None
        self.sums: dict[str, str] = {}  # each segment's checksum (by key): the next delta's base sums, unhashed
        self.lock = threading.Lock()
        self.kernels = kernels

    def adopt(self, version: int, state: State, *, copy: bool, sums: dict[str, str] | None = None) -> State | None:
        """Become `version`: its state itself, or (copy, for a state the history keeps) a copy of it.

        sums: each segment's checksum (by segment key) where the caller has
        them (the encoder does, for a state it just encoded); otherwise the
        mirror hashes segments as it first measures them. Returns the state
        the mirror let go of, for reuse; None when the copy went into its arrays.
        """
        with self.lock:
            old = self.state
            if copy:
                mine = {}
                for name, tb in state.items():  # into the old mirror's arrays where they fit
                    dst = destination(tb.bits, (old or {}).get(name))
                    dst[...] = tb.bits
                    mine[name] = TensorBits(tb.dtype, tb.shape, dst)
                state, old, sums = mine, None, None
            # a Bound builds each bucket's segment tables once, for every later version
            self.state, self.version = state if isinstance(state, Bound) else Bound(state), version
            self.sums = dict(sums or {})
            return old

    def freeze(self, version: int) -> State | None:
        """A copy of the mirror if it still holds `version` (None once publish() has moved it on)."""
        with self.lock:
            if self.state is None or self.version != version:
                return None
            return owned_copy(self.state)

    def invalidate(self) -> None:
        self.version = None


class LiveDelta:
    """One version's deltas against a Mirror, measured group by group in publish() for the encoder to pack.

    run() needs the mirror's lock held; on any failure the mirror is half
    written, and the caller invalidates it.
    """

    def __init__(self, mirror: Mirror, live: State, groups: list[Layout], *, tier: str, kernels):
        self.base_version = mirror.version
        self._mirror, self._sums, self._live, self.groups = mirror.state, mirror.sums, live, groups
        self._tier, self._kernels = tier, kernels
        self._done: list[list[tuple[TensorBits, Encoded]]] = []
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    @property
    def count(self) -> int:
        return len(self.groups)

    def run(self) -> None:
        try:
            for members in self.groups:
                mine, theirs = segments(self._mirror, members), segments(self._live, members)
                measured = [(m, self._step(key, m, t)) for key, m, t in zip(members.keys(), mine, theirs)]
                with self._cv:
                    self._done.append(measured)
                    self._cv.notify_all()
        except BaseException as e:
            with self._cv:
                self._error = e
                self._cv.notify_all()
            raise

    def _step(self, key: str, mirror: TensorBits, new: TensorBits) -> Encoded:
        """Measure one segment's change, then write the changed elements into the mirror."""
        enc = delta.measure(mirror, new, tier=self._tier, kernels=self._kernels, own=True,
                            base_sum=self._sums.get(key))
        if enc.sections is not None:
            self._kernels.write_changes(mirror.bits, new.bits, enc.sections)
        elif enc.kind != "same":
            self._kernels.copy_checksummed(new.bits, mirror.bits)
        self._sums[key] = enc.new_sum
        return enc

    def wait(self, i: int) -> list[tuple[TensorBits, Encoded]]:
        """Group i's measured segments, once publish() has them; SnapshotError if it failed first."""
        with self._cv:
            while len(self._done) <= i:
                if self._error is not None:
                    raise SnapshotError(f"the version was not measured: {self._error!r}") from self._error
                self._cv.wait()
            return self._done[i]
