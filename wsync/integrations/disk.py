"""A sidecar that turns wsync versions into the checkpoint folders a framework already reloads from.

slime (``--update-weight-transport disk``) and prime-rl (``weight_broadcast.type
= filesystem``) hand new weights to their inference engines as Hugging Face
folders on a filesystem the engines can read. With wsync the trainer publishes
deltas instead, and on each inference host a ``StepDirs`` subscriber keeps the
newest version in memory and writes every committed version into the folder the
framework's reload already expects. Only the coded bytes cross the network; the
engines and the framework's reload code stay as they are.

A folder is written whole under a temporary name, ``marker`` inside it, and
swapped into place when the Subscriber commits the version (``version`` is
set), so nothing ever reads a half-written version; like ``pull``, it replaces
or removes only folders wsync wrote (``wsync.fsutil``). The Subscriber acks a
version only after that, so ``Publisher.flush()`` on the trainer returns once
every sidecar has its folder.
"""
from __future__ import annotations

from pathlib import Path

from ..shadow import Shadow


class StepDirs(Shadow):
    """A Shadow engine that writes each committed version to ``path_for(version)/model.safetensors``."""

    def __init__(self, path_for, *, marker: str | None = None, keep: int = 2):
        super().__init__()
        self.path_for = path_for  # version -> folder
        self.marker = marker  # file created in a folder once it is complete (prime-rl: "STABLE")
        self.keep = keep  # folders kept, newest first (older ones are removed)
        self._version: int | None = None
        self._written: list[Path] = []

    @property
    def version(self):
        return self._version

    @version.setter
    def version(self, v):
        if v is not None and v != self._version:
            self._write(v)
        self._version = v

    def _write(self, version: int) -> None:
        """The folder appears whole (marker included) or not at all, and only replaces a folder wsync wrote."""
        from ..checkpoint import Checkpoint, write_checkpoint
        from ..fsutil import remove_output

        final = Path(self.path_for(version))
        write_checkpoint(final, Checkpoint(self.state, None, {"format": "pt", "wsync_version": str(version)}),
                         extra={self.marker: b""} if self.marker else None)
        self._written.append(final)
        while len(self._written) > self.keep:
            remove_output(self._written.pop(0))

def sidecar(address: str, path_for, *, token: str | None = None, marker: str | None = None, keep: int = 2):
    """Start a Subscriber that writes every version it commits (call .close() to stop)."""
    from ..subscriber import Subscriber
    from .common import load_token

    return Subscriber(address, engine=StepDirs(path_for, marker=marker, keep=keep),
                      token=load_token(token))  # None: WSYNC_TOKEN / WSYNC_TOKEN_FILE, if set
