"""Shared-memory segments for local://: a writer's pool of memfds, and parallel copy-in / check.

A segment is an anonymous memfd (no name in /dev/shm, so nothing to leak),
mapped once by the writer and kept: a message is copied into a free segment
while each piece is hashed, and the reader maps it by the descriptor it was
sent. The writer reuses a segment only after the reader said it let go.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

ROUND = 1 << 20  # segment sizes are whole MiB so nearby message sizes share segments
_POOL = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """Copy and hash threads; xxh3 and numpy copies release the GIL, so pieces run on every core."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="wsync-shm")
        return _POOL


def _memfd(size: int, name: str) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:  # non-Linux: an unlinked temp file is just as anonymous once the name is gone
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix=name, dir=where)
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


@dataclass
class Segment:
    id: int
    fd: int
    size: int
    mm: mmap.mmap  # the writer's shared, writable mapping, kept for reuse
    busy: bool = True  # holds a message the reader has not released
    shared: bool = False  # the reader already has our descriptor


class SegmentPool:
    """The writer's segments; release() comes from the link's reader thread."""

    def __init__(self, limit: int):
        self.limit = limit  # bytes of free segments kept; more are closed (and the reader told to drop them)
        self._segs: dict[int, Segment] = {}
        self._lock = threading.Lock()
        self._next = 0

    def take(self, n: int) -> Segment:
        with self._lock:
            free = [s for s in self._segs.values() if not s.busy and s.size >= n]
            if free:
                seg = min(free, key=lambda s: s.size)
                seg.busy = True
                return seg
            self._next += 1
            size = -(-n // ROUND) * ROUND
            fd = _memfd(size, f"wsync-{os.getpid()}-{self._next}")
            seg = Segment(self._next, fd, size, mmap.mmap(fd, size))
            self._segs[seg.id] = seg
            return seg

    def release(self, seg_id: int) -> None:
        with self._lock:
            if seg_id in self._segs:
                self._segs[seg_id].busy = False

    def evict(self) -> list[int]:
        """Close free segments beyond the limit, largest first; returns ids the reader must forget."""
        gone = []
        with self._lock:
            free = sorted((s for s in self._segs.values() if not s.busy), key=lambda s: -s.size)
            total = sum(s.size for s in free)
            for s in free:
                if total <= self.limit:
                    break
                total -= s.size
                self._close(self._segs.pop(s.id))
                gone.append(s.id) if s.shared else None
        return gone

    def close(self) -> None:
        with self._lock:
            for s in self._segs.values():
                self._close(s)
            self._segs.clear()

    @staticmethod
    def _close(s: Segment) -> None:
        s.mm.close()
        os.close(s.fd)


def _spans(n: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + piece)) for a in range(0, n, piece)]


def copy_in(mm: mmap.mmap, views: list[memoryview], piece: int) -> list[list[str]]:
    """Copy blobs back to back into mm; returns each blob's per-piece xxh3-64 (hex) of the source bytes."""
    dst = np.frombuffer(mm, dtype=np.uint8)
    jobs, off = [], 0
    for v in views:
        src = np.frombuffer(v, dtype=np.uint8)
        jobs.append([(dst[off + a:off + b], src[a:b]) for a, b in _spans(len(v), piece)])
        off += len(v)

    def one(job):
        np.copyto(job[0], job[1])
        return xxhash.xxh3_64_hexdigest(job[1])

    flat = [j for blob in jobs for j in blob]
    sums = list(_pool().map(one, flat)) if len(flat) > 1 else [one(j) for j in flat]
    del dst, flat  # the mapping must have no exports left when the segment is reused or closed
    out, k = [], 0
    for blob in jobs:
        out.append(sums[k:k + len(blob)])
        k += len(blob)
    return out


def verify_pieces(blobs: list[tuple[memoryview, list[str]]], piece: int) -> int | None:
    """Index (over all pieces) of the first piece whose xxh3-64 differs, or None when all match."""
    jobs = []
    for view, sums in blobs:
        spans = _spans(len(view), piece)
        if len(spans) != len(sums):
            return len(jobs)
        jobs.extend((view[a:b], s) for (a, b), s in zip(spans, sums))
    ok = list(_pool().map(lambda j: xxhash.xxh3_64_hexdigest(j[0]) == j[1], jobs)) if len(jobs) > 1 else \
        [xxhash.xxh3_64_hexdigest(v) == s for v, s in jobs]
    del jobs
    return next((i for i, good in enumerate(ok) if not good), None)
