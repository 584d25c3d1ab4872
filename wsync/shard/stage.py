"""An engine rank's staging: its pieces, received and verified apart from the live weights, then copied in.

Each trainer rank that sends this rank pieces runs one wsync Publisher for it;
here one Subscriber follows each, into a host-memory staging engine (a
Shadow: piece key -> the piece's bytes). So the codec per piece, deltas
against the previous version of the same piece, keyframes, catch-up,
checksums and auth are the single-engine protocol's, unchanged.

What is new is *when* a version may apply. The Subscribers run in poll mode:
their receiver threads stage versions as they arrive, and this rank applies
them to its staging only up to the version of the coordinator's round
(``advance``). So between ``ready(v)`` and the coordinator's answer the staging
holds exactly v from every source, and ``commit`` copies exactly v, even if
v+1 is already on the wire.
"""
from __future__ import annotations

import logging
import threading

from .. import backends
from ..engines.shadow import Shadow
from ..errors import MismatchError
from ..snapshot import to_bits, to_torch
from ..subscriber import Subscriber
from .rounds import partial_digest

log = logging.getLogger("wsync.shard")


class Source(Subscriber):
    """A Subscriber that applies staged versions only as far as it is told (always in poll mode)."""

    on_staged = None  # called (on the receiver thread) once a whole version is staged: the rank's thread wakes

    def _stage(self, st) -> None:
        super()._stage(st)
        if self.on_staged is not None:
            self.on_staged()

    def apply_through(self, version: int) -> str | None:
        """Apply every staged version up to `version`, in order; returns why one failed, or None."""
        failed = None
        with self._apply_lock:
            while True:
                with self._cv:
                    if not self._staged or self._staged[0].version > version:
                        return failed
                    st = self._staged.pop(0)
                    before = self._stats["failures"]
                self._apply(st)
                with self._cv:
                    if self._stats["failures"] > before:
                        failed = f"version {st.version} failed to stage: {self._apply_error}"

    def overshot(self, version: int) -> bool:
        """The next version staged is past `version` while this source does not hold it: it never will."""
        with self._cv:
            return self.version != version and bool(self._staged) and self._staged[0].version > version

    def restart(self) -> None:
        """Forget what is staged and take a keyframe (the staging was found wrong after it verified)."""
        with self._apply_lock:
            with self._cv:
                self.version = self.engine.version = None
                self._served = self._bound = None
                self._staged.clear()
            self._lost()


def _slices(box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


class Stage:
    """The staging of one engine rank: a Source per trainer rank, and the copy into the live tensors."""

    def __init__(self, pieces, tensors: dict, addresses: dict[int, str], *, token=None, backend: str | None = None,
                 connect_opts: dict | None = None, progress=None, on_staged=None):
        self.tensors = tensors
        self.by_src: dict[int, list] = {}
        for p in pieces:
            self.by_src.setdefault(p.src_rank, []).append(p)
        missing = sorted(set(self.by_src) - set(addresses))
        if missing:
            raise MismatchError(f"no publisher address for trainer ranks {missing}, which send this rank pieces")
        self.kernels = backends.kernels(backend)
        self.lock = threading.RLock()  # held while live tensors are written: a forward pass holds it too
        self._live_sums: dict[str, str] = {}  # piece key -> checksum of what the live tensor holds there
        self.sources: dict[int, Source] = {}
        for s in sorted(self.by_src):
            tell = None if progress is None else (lambda *a, s=s: progress(s, *a))
            self.sources[s] = Source(addresses[s], engine=Shadow(), token=token, apply="poll", backend=backend,
                                     connect_opts=connect_opts, progress=tell)
            self.sources[s].on_staged = on_staged

    def advance(self, version: int) -> tuple[str, str | None]:
        """Apply what has arrived up to `version`: ("ready", None) once every source holds exactly it,
        ("failed", why) if one cannot get there, ("waiting", None) otherwise."""
        for s, src in self.sources.items():
            why = src.apply_through(version)
            if why is not None:
                return "failed", f"from trainer rank {s}: {why}"
            if src.overshot(version):
                return "failed", f"trainer rank {s} sent a version past {version} before it (a keyframe of a newer one)"
        if all(src.version == version for src in self.sources.values()):
            return "ready", None
        return "waiting", None

    def staged_sums(self) -> dict[int, dict[str, str]]:
        """trainer rank -> piece key -> checksum of the staged bytes (read again, so a staged buffer changed
        after its Subscriber verified it is caught)."""
        out = {}
        for s, pieces in self.by_src.items():
            state = self.sources[s].engine.state
            out[s] = {p.key: self.kernels.checksum(state[p.key].bits) for p in pieces}
        return out

    def commit(self, staged: dict[int, dict[str, str]]) -> dict[int, str]:
        """Copy every staged piece whose bytes differ from what the live tensor holds, then return the partial
        digests of what the live tensors hold (each piece read back from them)."""
        live = {}
        with self.lock:
            for s, pieces in self.by_src.items():
                state = self.sources[s].engine.state
                for p in pieces:
                    if self._live_sums.get(p.key) != staged[s][p.key]:
                        self.tensors[p.dst_name][_slices(p.dst)].copy_(to_torch(state[p.key]))
                for p in pieces:
                    bits = to_bits(self.tensors[p.dst_name][_slices(p.dst)]).bits
                    self._live_sums[p.key] = live.setdefault(s, {})[p.key] = self.kernels.checksum(bits)
        return {s: partial_digest(sums) for s, sums in live.items()}

    def keyframe(self, srcs) -> None:
        """These sources staged something wrong: start them over from a keyframe, and rewrite their pieces."""
        for s in srcs:
            if s in self.sources:
                log.warning("pieces from trainer rank %d staged wrong; asking it for a keyframe", s)
                self.sources[s].restart()
                for p in self.by_src[s]:
                    self._live_sums.pop(p.key, None)

    def received_bytes(self) -> int:
        return sum(src.stats_snapshot()["bytes"] for src in self.sources.values())

    def close(self) -> None:
        for src in self.sources.values():
            src.close()
