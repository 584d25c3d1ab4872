"""The engine `wsync pull` applies versions to: the replica's tensors in file-backed memory, not on the heap.

A keyframe arrives bucket by bucket and is staged whole before it applies (a
version is all or nothing). Decoding it into arrays beside the staged buckets,
and then copying those into the engine, would hold the model three times.
Spool takes the decoded buckets one at a time and writes each to a scratch file
beside the output, then maps that file copy-on-write and unlinks it: the
weights live in the page cache, and only the pages a later delta writes become
this process's own memory. A replica an earlier pull left is mapped the same
way (checkpoint.read_checkpoint(private=True)), so a resumed pull holds the
model once, however many deltas it applies. The output itself is written from
these mappings (serve.pull).
"""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from ..bits import State, TensorBits
from ..fsutil import clean_stale, temp_sibling
from ..shadow import Shadow

ALIGN = 64  # each tensor starts on a cache line in the scratch file, so its view is aligned for any dtype


class Spool(Shadow):
    """Host-memory engine for one replica folder: engines.Shadow whose keyframes are mapped from files.

    beside: the output path; scratch files are its temp siblings (fsutil.temp_sibling), so the next run
    removes one a killed pull left behind."""

    def __init__(self, beside, state: State | None = None):
        super().__init__()
        self.state = dict(state or {})  # the caller's arrays as they are: mapped, not copied
        self._beside = Path(beside)

    def replace(self, state: State) -> None:
        """Take a whole new state (a keyframe)."""
        self.replace_parts([state])

    def replace_parts(self, parts) -> None:
        """Take a whole new state given as an iterable of parts (a keyframe's decoded buckets, each checked).

        Each part is written out before the next is made, so at most one is in memory; the state changes
        only once every part has been taken (a failed part leaves the engine as it was)."""
        self._beside.parent.mkdir(parents=True, exist_ok=True)  # where the output will be written anyway
        clean_stale(self._beside)
        tmp = temp_sibling(self._beside)
        try:
            placed = []
            with open(tmp, "wb") as f:
                for part in parts:
                    for name, tb in part.items():
                        f.write(bytes(-f.tell() % ALIGN))
                        placed.append((name, tb.dtype, tb.shape, f.tell(), tb.nbytes))
                        f.write(memoryview(tb.bits).cast("B"))
                size = f.tell()
            with open(tmp, "rb") as f:
                data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), np.uint8) if size \
                    else np.zeros(0, np.uint8)
        finally:
            tmp.unlink(missing_ok=True)  # the mapping keeps the pages; nothing stays on disk
        self.state = {name: TensorBits(dt, shape, data[at : at + n].view(dt.bits_dtype))
                      for name, dt, shape, at, n in placed}
