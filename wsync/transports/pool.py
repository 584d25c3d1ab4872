"""Receive buffers recycled once the caller has let go of them.

Fresh memory is expensive: every page is faulted in and zeroed on first touch,
which can be slower than the wire, while a sync receives the same bucket sizes
version after version. So a receiving link
keeps the buffers it handed out and gives one back out when the caller holds no
reference to it any more (its reference count says so; a numpy array, tensor or
memoryview over a buffer holds a reference, so a buffer in use is never reused).
"""
from __future__ import annotations

import sys
from collections import deque

# References to a pooled buffer that are ours: the deque slot, the loop variable,
# and getrefcount's own argument. Anything above means the caller still holds it.
_OURS = 3


class BufferPool:
    def __init__(self, limit: int = 1 << 30):
        self.limit = limit  # bytes of buffers kept for reuse; 0 turns recycling off
        self._kept: deque[bytearray] = deque()

    def take(self, n: int) -> bytearray:
        """A bytearray of exactly n bytes, recycled when one is free (contents are stale, not zeroed)."""
        if n and self.limit:
            for b in self._kept:
                if len(b) == n and sys.getrefcount(b) <= _OURS:
                    self._kept.remove(b)
                    self._kept.append(b)  # most recently used last; eviction drops from the left
                    return b
        b = bytearray(n)
        if n and n <= self.limit:
            self._kept.append(b)
            self._trim()
        return b

    def _trim(self) -> None:
        total = sum(len(b) for b in self._kept)
        while total > self.limit and self._kept:
            total -= len(self._kept.popleft())

    def clear(self) -> None:
        self._kept.clear()
