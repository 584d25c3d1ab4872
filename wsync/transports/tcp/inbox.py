"""The receiving half of a tcp:// link: reassembly of striped frames, in-order delivery, resume state.

Each stream's reader thread reads a record header, then receives the frame's
bytes straight into the message buffer at their offset (no copy), checks the
frame's xxh3, and only then marks the frame held. Messages are handed to
``recv`` strictly in sequence order. What is held (complete messages below
``complete_below``, and per-frame sets above it) is exactly what the peer is
told after a reconnect, so it resends only the rest.

Blobs come out of ``recv`` as 1-D uint8 memoryviews (over recycled numpy
buffers). Memory is bounded: a message's buffers are allocated when its HEAD arrives,
after checking its size against ``max_message`` and the bytes of messages
announced but still incomplete against ``max_incomplete``, twice that or what
the sockets can hold in flight (a sender that keeps announcing without
finishing is refused, not fed); a reader stops reading (and
TCP pushes back on the sender) while complete messages the application has
not taken exceed ``RECV_WINDOW``.
"""
from __future__ import annotations

import mmap
import sys
import threading
import time
from collections import deque

import numpy as np

from ...errors import TransportError
from ..base import Message
from . import frames as tf

MIN_POOLED = 1 << 20  # receive buffers smaller than this are never kept for reuse
MAX_INCOMPLETE = 256  # messages announced but not complete; a sane sender has a few
# complete messages recv() has not taken before the readers stop reading: TCP then pushes back on a sender
# that outruns its application, and a receiver's memory stays bounded
RECV_WINDOW = 512 << 20


class Buffers:
    """Receive buffers: numpy.empty when fresh (pages are faulted in by recv_into, outside the GIL,
    where bytearray(n) would zero them first while holding it), recycled once the caller lets go
    (its reference count says so; a memoryview over a buffer holds a reference). A large one is a mapping
    of its own, so when the caller lets go of one the pool does not keep, its pages go back to the system
    at once (freed into malloc's heap they may stay resident), and a receiver's memory follows what it
    holds."""

    def __init__(self, limit: int):
        self.limit = limit  # bytes kept for reuse; 0 turns recycling off
        self._kept: deque = deque()

    def take(self, n: int) -> np.ndarray:
        if n < MIN_POOLED:  # small buffers are cheap to fault in, and their sizes vary too much to reuse
            return np.empty(n, dtype=np.uint8)
        for i in range(len(self._kept)):  # not enumerate(): its cached result tuple would hold b too
            b = self._kept[i]
            # a kept buffer up to twice the size serves too (as a view, which holds a reference to b)
            if n <= b.nbytes < 2 * n and sys.getrefcount(b) <= 3:  # ours: the deque slot, b, getrefcount's arg
                del self._kept[i]  # by position: deque.remove would compare arrays elementwise
                self._kept.append(b)
                return b if b.nbytes == n else b[:n]
        b = np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)
        if n <= self.limit:
            self._kept.append(b)
            while sum(x.nbytes for x in self._kept) > self.limit:
                self._kept.popleft()
        return b


class InMsg:
    __slots__ = ("kind", "meta", "bufs", "frame", "held", "claimed", "missing", "size")

    def __init__(self, kind: str, meta: dict, sizes: list[int], frame: int, alloc, head: int = 0):
        self.kind, self.meta, self.frame = kind, meta, frame
        self.bufs = [alloc(n) for n in sizes]
        self.held = [set() for _ in sizes]  # frame indices received and verified
        self.claimed: set[tuple[int, int]] = set()  # frames a reader is receiving right now
        self.missing = sum(tf.frame_count(n, frame) for n in sizes)
        # its header counts too: a stream of blob-less messages with large metas would otherwise cost nothing
        self.size = sum(sizes) + head


class Inbox:
    """Reassembly state; every method runs under the session's condition ``cv``."""

    def __init__(self, cv: threading.Condition, max_message: int, pool_bytes: int):
        self.cv, self.max_message = cv, max_message
        self.limit_why: str | None = None  # what narrowed max_message (TcpLink.limit), named when refusing
        self.max_incomplete = 2 * max_message  # bytes of messages announced and not complete yet (see TcpLink.limit)
        self.buffers = Buffers(pool_bytes)
        self.msgs: dict[int, InMsg] = {}
        self.complete_below = 0  # every message below this is complete (delivered or waiting in msgs)
        self.deliver_next = 0  # the next message recv() hands out
        self.ready_bytes = 0  # deliverable messages (below complete_below) not yet taken by recv()
        self.app_lags = False  # a reader is holding back because recv() is not keeping up
        self.peer_closed = False
        self.new_ack = False  # complete_below moved since the last ACK was queued

    def known(self, seq: int) -> bool:
        return seq < self.complete_below or seq in self.msgs

    def on_head(self, seq: int, body: bytes, live) -> None:
        """Register a message; waits while the application lags by more than RECV_WINDOW."""
        if self.known(seq):
            return  # a HEAD sent again after a reconnect
        h = tf.decode_head(body, self.max_message, self.limit_why)
        sizes = h.sizes
        size = sum(sizes) + len(body)
        incomplete = [m.size for m in self.msgs.values() if m.missing]
        if len(incomplete) >= MAX_INCOMPLETE or seq >= self.complete_below + (1 << 20):
            raise TransportError(f"peer announced message {seq} with {len(incomplete)} still incomplete; "
                                 "protocol broken")
        if sum(incomplete) + sum(sizes) > self.max_incomplete:
            raise TransportError(f"peer announced message {seq} of {sum(sizes)} bytes with {sum(incomplete)} bytes of "
                                 f"earlier messages still incomplete, above {self.max_incomplete}")
        # only deliverable bytes count: waiting on an incomplete earlier message could deadlock
        while live() and self.ready_bytes and self.ready_bytes + size > RECV_WINDOW:
            self.app_lags = True
            self.cv.wait()
        self.app_lags = False
        if not live():
            return
        try:
            self.msgs[seq] = InMsg(h.kind, h.meta, sizes, h.frame, self.buffers.take, len(body))
        except MemoryError:
            raise TransportError(f"cannot allocate {sum(sizes)} bytes for message {seq}; "
                                 "lower max_message or free memory") from None
        self.cv.notify_all()  # readers holding frames of this message wait for it
        self._advance(seq)

    def claim(self, rec: tf.Record, live, stall: float):
        """Where frame rec goes: (msg, index, view), or None to read it into nothing (a duplicate)."""
        deadline = time.monotonic() + stall
        while live() and not self.known(rec.seq):
            if rec.seq >= self.complete_below + (1 << 20):
                raise TransportError(f"peer sent a frame for message {rec.seq}, far ahead of {self.complete_below}")
            if self.app_lags:  # the HEAD is held back by the window, not lost
                deadline = time.monotonic() + stall
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"frame for message {rec.seq} arrived but its header never did")
            self.cv.wait(left)
        m = self.msgs.get(rec.seq)
        if m is None:  # complete already, or the epoch ended
            return None
        i = tf.check_frame(rec, [b.nbytes for b in m.bufs], m.frame)
        if i in m.held[rec.blob] or (rec.blob, i) in m.claimed:
            return None
        m.claimed.add((rec.blob, i))
        return m, i, m.bufs[rec.blob].data[rec.off: rec.off + rec.length]

    def release(self, seq: int, m: InMsg, blob: int, i: int, ok: bool) -> None:
        """A reader is done with a claimed frame: verified (ok) or not."""
        m.claimed.discard((blob, i))
        if ok and i not in m.held[blob]:
            m.held[blob].add(i)
            m.missing -= 1
            self._advance(seq)

    def _advance(self, seq: int) -> None:
        m = self.msgs[seq]
        if m.missing:
            return
        old = self.complete_below
        while self.complete_below in self.msgs and not self.msgs[self.complete_below].missing:
            self.ready_bytes += self.msgs[self.complete_below].size
            self.complete_below += 1
        self.new_ack |= self.complete_below != old
        self.cv.notify_all()

    def pop(self) -> Message | None:
        m = self.msgs.get(self.deliver_next)
        if m is None or m.missing:
            return None
        del self.msgs[self.deliver_next]
        self.deliver_next += 1
        self.ready_bytes -= m.size
        self.cv.notify_all()
        return Message(m.kind, m.meta, [b.data for b in m.bufs])  # memoryviews: compare equal to bytes

    def state(self) -> str:
        partial = {s: (None if not m.missing else [sorted(h) for h in m.held])
                   for s, m in self.msgs.items() if s >= self.complete_below}
        return tf.encode_state(self.complete_below, partial).decode()

    def has_incomplete(self) -> bool:
        return any(m.missing for m in self.msgs.values())
