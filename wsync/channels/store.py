"""Versions held whole, so a channel can be handed any of them again: candidates and promoted history.

A channel's engines follow its own publisher, whose history holds one keyframe
and the deltas since; a promotion can name an older trained version, and a
rollback one promoted long ago, so the hub keeps those states itself: the
newest ``keep`` of them and at most ``max_bytes`` in all (the newest one
always, whatever its size). With a folder, each is also a safetensors file
there, written atomically with its digest in the metadata, and read back (and
checked against that digest) when a hub starts again over the same folder.
The states are host copies that nothing writes, so a publisher can encode them
where they lie (Publisher.publish(frozen=True)).
"""
from __future__ import annotations

import re
import threading
from pathlib import Path

from ..checkpoint import read_safetensors, write_safetensors
from ..errors import ChecksumError, NotHeld
from ..snapshot import State, digest, owned_copy

_FILE = re.compile(r"v(\d{1,18})\.safetensors")


class StateStore:
    """Whole states by version, newest last: at most `keep` of them and `max_bytes` in all, in memory, and in
    `root` (a folder, created if missing) when one is given."""

    def __init__(self, *, keep: int, max_bytes: int | None = None, root=None, what: str = "versions"):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive number of versions, got {keep!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive number of bytes, got {max_bytes!r}")
        self.keep, self.max_bytes, self.what = keep, max_bytes, what
        self.root = Path(root) if root is not None else None
        self._lock = threading.Lock()
        self._states: dict[int, tuple[State, str]] = {}  # version -> (state, digest), in the order added
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._load()

    def put(self, version: int, state, *, checksum: str | None = None, owned: bool = False) -> str:
        """Hold a copy of `state` (tensors or arrays, any device) as `version`; returns its digest. A version
        held already is kept as it is when the digest agrees, refused when it does not.

        owned: `state` is another store's (host bit patterns nothing writes) and `checksum` its digest: it is
        shared, not copied or hashed again."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if owned and checksum is None:
            raise ValueError("an owned state comes with its checksum")
        with self._lock:
            held = self._states.get(version)
        if held is not None and checksum is not None:
            return self._same(version, held[1], checksum)
        copy = state if owned else owned_copy(state)
        got = checksum if owned else digest(copy)
        if checksum is not None and checksum != got:
            raise ChecksumError(f"version {version} digests to {got}, not the {checksum} it was offered with")
        with self._lock:
            held = self._states.get(version)
            if held is not None:
                return self._same(version, held[1], got)
            if self.root is not None:
                write_safetensors(self.root / f"v{version}.safetensors", copy, {"wsync_digest": got})
            self._states[version] = (copy, got)
            self._trim()
        return got

    @staticmethod
    def _same(version: int, held: str, got: str) -> str:
        if held != got:
            raise ChecksumError(f"version {version} is held already with another digest ({held} vs {got}): a "
                                "version number names one state")
        return got

    def get(self, version: int) -> tuple[State, str]:
        """(state, digest) of a held version; NotHeld naming those held otherwise."""
        with self._lock:
            held = self._states.get(version)
            if held is None:
                raise NotHeld(f"version {version} is not among the {self.what} held ({self._held_text()})")
            return held

    def __contains__(self, version) -> bool:
        with self._lock:
            return version in self._states

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._states)

    def nbytes(self) -> int:
        with self._lock:
            return sum(_bytes(s) for s, _ in self._states.values())

    def _held_text(self) -> str:
        return ", ".join(map(str, sorted(self._states))) or "none"

    def _trim(self) -> None:
        """(Under the lock.) Drop the oldest until within keep and max_bytes; the newest always stays."""
        total = sum(_bytes(s) for s, _ in self._states.values())
        for v in sorted(self._states)[:-1]:
            if len(self._states) <= self.keep and (self.max_bytes is None or total <= self.max_bytes):
                break
            total -= _bytes(self._states.pop(v)[0])
            if self.root is not None:
                (self.root / f"v{v}.safetensors").unlink(missing_ok=True)

    def _load(self) -> None:
        """What an earlier hub left in root: every file checked against its recorded digest."""
        for path in sorted(self.root.iterdir()):
            m = _FILE.fullmatch(path.name)
            if m is None or not path.is_file() or path.is_symlink():
                continue
            state, meta = read_safetensors(path)
            got = digest(state)
            if meta.get("wsync_digest") != got:
                raise ChecksumError(f"{path} digests to {got}, not the {meta.get('wsync_digest')!r} it was "
                                    "written with: the file changed or is damaged; remove it to go on without it")
            self._states[int(m.group(1))] = (state, got)
        self._states = dict(sorted(self._states.items()))
        self._trim()


def _bytes(state: State) -> int:
    return sum(tb.nbytes for tb in state.values())
