"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


class atomic_write:
    """Open a temp file beside `path`; rename it over `path` only if the block succeeds."""

    def __init__(self, path):
        self.path = Path(path)

    def __enter__(self):
        fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self.f = os.fdopen(fd, "wb")
        return self.f

    def __exit__(self, exc_type, *_):
        self.f.close()
        if exc_type is not None:
            Path(self.tmp).unlink(missing_ok=True)
            return
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o666 & ~umask)  # mkstemp's 0600 would surprise whoever reads the result
        os.replace(self.tmp, self.path)
