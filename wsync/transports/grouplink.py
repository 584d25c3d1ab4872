"""The Link of a torch.distributed group: broadcast down, gather up, in lockstep.

Each message is: (1) an allgather of [direction, header length, sequence] from
every rank on the control group, checked so that exactly the expected side is
sending; (2) the header bytes; (3) the payload pieces (groupframe) on the data
group; (4) a trailer of per-piece xxh3-64 digests, checked by the receiver.
Publisher -> subscribers uses broadcasts; subscriber -> publisher uses
point-to-point sends that the publisher drains one rank per ``recv``.

A blob may be a CUDA tensor: see groupframe. Where the group has a CUDA device
(nccl), every verb makes it the calling thread's current device for its
duration: the Publisher's sender threads and the Subscriber's thread start on
device 0, whichever GPU the group was formed on.

Only step (1) may wait for a long time (a subscriber idles between versions),
and it runs on gloo where waiting on a Work with a timeout leaves the operation
pending: a ``recv`` that times out raises TransportTimeout and the next
``recv`` resumes the same wait. Every later step is bounded by ``stall_timeout``;
a failure there leaves the group out of step, so the link is marked broken.

A gloo collective (every first step, and every broadcast) is waited on in
slices of SLICE seconds, so that close() ends a wait in progress (a recv
without a timeout, as a publisher gathers acks) within one slice: the thread
that waits is free to be joined, rather than sitting in a C++ call with the
GIL released until its peer moves, which it may never do. A point-to-point
piece is waited on once, to its end, bounded by stall_timeout: gloo fails the
pair under a send or recv whose wait times out, so its wait cannot be resumed,
and its peer waits for it the same way. So a subscriber's message to the
publisher (point to point after its first step) runs to its end once
announced, close() or not.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections import deque

import numpy as np

from ..errors import TransportError
from . import envelope
from . import groupframe as gf
from .base import Message, TransportTimeout
from .pool import BufferPool

SEND, RECV = 1, 2  # a rank's part in the next message
TAG = 0x5753  # point-to-point tag for subscriber -> publisher messages
STALL = object()  # "wait at most stall_timeout", the bound for every step after the first
SLICE = 0.1  # seconds: the longest a thread waits on one gloo operation without looking whether the link closed
_KEPT: list = []  # closed links' process groups and stores (see GroupLink.close)
_KEEPER: threading.Thread | None = None
_KEEP_LOCK = threading.Lock()


def _keep(items: list) -> None:
    """Hold items until the process ends: a daemon thread's frame holds the list, and interpreter shutdown neither
    unwinds daemon threads nor frees what they hold (a module global alone would be freed then, and hang there)."""
    global _KEEPER
    with _KEEP_LOCK:
        _KEPT.extend(items)
        if _KEEPER is None:
            _KEEPER = threading.Thread(target=_hold, args=(_KEPT, threading.Event()), name="wsync-group-keeper",
                                       daemon=True)
            _KEEPER.start()


def _hold(kept: list, never: threading.Event) -> None:
    never.wait()


class _PointToPoint:
    """A send or recv's Work, marked so it is never waited on in slices (see the module docstring)."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self, *timeout):
        return self.work.wait(*timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class GroupLink:
    lockstep = True  # every rank takes part in every message: the publisher gathers acks, it has no ack reader

    def __init__(self, *, ctrl, data, wire, rank: int, size: int, cfg, peer: str, store, device=None):
        self.ctrl, self.data, self.wire = ctrl, data, wire
        self.device = device  # the group's CUDA device (nccl), None for gloo
        self.rank, self.size, self.cfg, self.peer = rank, size, cfg, peer
        self.fanout = size - 1 if rank == 0 else 1
        self._store = store  # the TCPStore must outlive the groups built on it
        self._seq = 0  # messages completed; every rank counts the same
        self._pending = None  # (direction, work, table) of a first step that timed out
        self._replies = deque()  # publisher: (rank, header length) still to drain after a gather
        self._pool = BufferPool(cfg.pool_bytes)  # receive buffers, recycled once the caller drops them
        self._broken = None
        self._closed = False
        self._kept = False  # its groups handed to the keeper
        self._lock = threading.Lock()  # orders close() against the posting of an operation
        self._posted: list = []  # operations posted, the completed ones pruned now and then

    # -- public verbs -------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        """Send msg to the group. Blobs are host buffers or torch CUDA tensors; a CUDA tensor's writes must be
        finished, or ordered on the stream current on this thread for its device, when send is called (NCCL
        orders its own stream after that one)."""
        self._usable()
        if self._replies:
            raise TransportError(f"{len(self._replies)} subscriber replies are still unread; recv them before sending")
        with self._on_device():
            head, sizes = gf.pack_head(msg, self.cfg.chunk)
            views = [gf.flat(b) for b in msg.blobs]
            self._guard(self._send, head, sizes, views, gf.device_blobs(msg.blobs))

    def recv(self, timeout: float | None = None) -> Message:
        """The next message. A blob sent as a CUDA tensor arrives as a flat uint8 tensor on this link's wire
        device (nccl: the group's GPU; gloo: host memory), every other blob as host bytes."""
        self._usable()
        with self._on_device():
            return self._guard(self._recv, timeout)

    def close(self) -> None:
        """Start no more messages, end the collective waits in progress (within SLICE seconds: a message the
        publisher sends, or one a link receives, is abandoned and its peers see it stall; a subscriber's
        message to the publisher, once announced, runs to its end), and hand the groups to the keeper if an
        operation is still in flight.

        A gloo process group's destructor joins its worker threads, so it waits for every operation it was
        given, on whichever thread drops the last reference: a group dropped with an operation no peer will
        ever finish (an idle subscriber's first step, nearly always; or a piece its peer stopped sending)
        blocks that thread for good (torch 2.13; abort() is a no-op on gloo). So a closed link's groups are
        dropped only when nothing posted on them is outstanding; otherwise a thread that never ends holds
        them, and they go with the process (a group's few threads and sockets per such link). close() may run
        on any thread while another is inside send or recv: it takes the lock every post takes, and a post
        after it looked hands the groups over itself."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._broken = self._broken or "closed"
            if not all(w.is_completed() for w in self._posted):
                self._keep_groups()
            self._posted = []
        with self._on_device():
            for pg in {id(self.ctrl): self.ctrl, id(self.data): self.data}.values():
                try:
                    pg.abort()  # NCCL fails its pending operations; a no-op on gloo
                except (RuntimeError, AttributeError):
                    pass
        self._store = None
        self._pool.clear()

    def __del__(self):
        try:  # a link dropped without close(): its groups must not be destroyed under a pending operation either
            self.close()
        except Exception:
            pass

    # -- one message --------------------------------------------------------------------

    def _on_device(self):
        """The group's device made current on the calling thread (and the previous one restored after)."""
        if self.device is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(self.device)

    def _send(self, head: bytes, sizes: list[int], views: list, device: list[int]) -> None:
        self._step(SEND, len(head), self.cfg.stall_timeout)
        if self.rank == 0:
            ctrl, data = self._bcast(self.ctrl), self._bcast(self.data)
        else:
            ctrl, data = self._p2p_send(self.ctrl), self._p2p_send(self.data)
        self._wait(ctrl(gf.as_u8(head)))
        pieces = gf.plan_pieces(sizes, self.cfg.chunk, device)
        digests = gf.send_pieces(views, pieces, data, self.wire, self._wait_data, device)
        if digests:
            self._wait(ctrl(gf.as_u8(memoryview(np.array(digests, dtype=np.uint64)).cast("B"))))

    def _recv(self, timeout: float | None) -> Message:
        if self.rank == 0:
            if not self._replies:
                table = self._step(RECV, 0, timeout)
                self._replies.extend((r, int(table[r, 1])) for r in range(1, self.size))
            src, hlen = self._replies.popleft()
            ctrl, data = self._p2p_recv(self.ctrl, src), self._p2p_recv(self.data, src)
        else:
            src, hlen = 0, int(self._step(RECV, 0, timeout)[0, 1])
            ctrl, data = self._bcast(self.ctrl), self._bcast(self.data)
        raw = bytearray(envelope.check_length(hlen))
        self._wait(ctrl(gf.as_u8(raw)))
        h = gf.parse_head(raw)
        kind, meta, sizes, chunk, device = h.kind, h.meta, h.sizes, h.chunk, h.device
        pieces = gf.plan_pieces(sizes, chunk, device)
        blobs = [self._device_buffer(n) if i in device else self._pool.take(n) for i, n in enumerate(sizes)]
        got = gf.recv_pieces(blobs, pieces, data, self.wire, self._wait_data, device)
        expected = np.zeros(gf.host_pieces(pieces, device), dtype=np.uint64)
        if len(expected):
            self._wait(ctrl(gf.as_u8(memoryview(expected).cast("B"))))
        gf.verify(got, expected)
        if self.rank == 0:
            meta = {**meta, "rank": src}
        return Message(kind, meta, blobs)

    def _device_buffer(self, n: int):
        import torch

        return torch.empty(n, dtype=torch.uint8, device=self.wire.device)

    def _step(self, direction: int, hlen: int, timeout: float | None) -> np.ndarray:
        """Allgather every rank's [direction, header length, seq] and check the group is in step."""
        import torch

        if self._pending is None:
            mine = torch.tensor([direction, hlen, self._seq], dtype=torch.int64)
            table = torch.zeros(self.size, 3, dtype=torch.int64)
            work = self._post(lambda: self.ctrl.allgather([list(table.unbind(0))], [mine]), first=True)
            self._pending = (direction, work, table)
        elif self._pending[0] != direction:
            raise TransportError("a recv timed out and its wait is still pending; call recv again before sending")
        _, work, table = self._pending
        try:
            # a subscriber's message to the publisher goes on point to point once announced, and the publisher
            # would wait for those pieces unsliced: so it is not abandoned here, half announced
            self._wait(work, timeout, abandon=direction == RECV or self.rank == 0)
        except TransportTimeout:
            if direction == SEND:
                raise TransportError(f"subscribers did not start receiving within {timeout}s") from None
            raise
        self._pending = None
        self._seq += 1
        return self._check_step(table.numpy(), direction)

    def _check_step(self, table: np.ndarray, direction: int) -> np.ndarray:
        sender = direction == SEND if self.rank == 0 else direction == RECV
        expect = [SEND if sender else RECV] + [RECV if sender else SEND] * (self.size - 1)
        if table[:, 0].tolist() != expect or len(set(table[:, 2].tolist())) != 1:
            raise TransportError(f"group out of step at message {self._seq - 1}: directions "
                                 f"{table[:, 0].tolist()} (1=send, 2=recv) and sequences {table[:, 2].tolist()}; "
                                 "the publisher and subscribers must alternate send and recv")
        return table

    # -- operations ---------------------------------------------------------------------

    def _post(self, start, first: bool = False):
        """Start one operation (start() returns its Work) and record it for close().

        Once the link is closed no message starts (its first operation raises TransportError); an operation
        of a message under way posted after close() looked is handed to the keeper at once (the wait that
        follows it raises)."""
        with self._lock:
            if self._closed and first:
                raise TransportError(f"link to {self.peer} was closed")
            work = start()
            if self._closed:
                self._keep_groups()
            else:
                if len(self._posted) >= 64:
                    self._posted = [w for w in self._posted if not w.is_completed()]
                self._posted.append(work)
            return work

    def _keep_groups(self) -> None:
        """(Under the lock.) Hand the groups to the keeper, once. A pending Work holds its own tensors, and
        the groups hold the store, in C++: the groups are all that must never be destroyed."""
        if not self._kept:
            self._kept = True
            _keep([self.ctrl, self.data])

    def _bcast(self, pg):
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return lambda t: self._post(lambda: pg.broadcast([t], opts))

    def _p2p_send(self, pg):
        return lambda t: _PointToPoint(self._post(lambda: pg.send([t], 0, TAG)))

    def _p2p_recv(self, pg, src: int):
        return lambda t: _PointToPoint(self._post(lambda: pg.recv([t], src, TAG)))

    def _wait(self, work, timeout=STALL, abandon: bool = True) -> None:
        """Wait for a gloo operation, at most timeout seconds (None: no bound). A collective is waited on in
        slices that notice close() (abandon=False: that go on regardless); a point-to-point piece, whose peer
        waits for it unsliced, in one wait to its end."""
        t = self.cfg.stall_timeout if timeout is STALL else timeout
        if isinstance(work, _PointToPoint):
            if t is None:
                work.wait()
            elif not self._wait_once(work, max(t, 0.001)):
                raise TransportTimeout(f"no message from {self.peer} within {t}s")
            return
        deadline = None if t is None else time.monotonic() + t
        while True:
            if self._closed and abandon:
                raise TransportError(f"link to {self.peer} was closed")
            left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
            if left < 0.001:  # a wait of 0 ms is torch's "no timeout"
                raise TransportTimeout(f"no message from {self.peer} within {t}s")
            if self._wait_once(work, left):
                return

    def _wait_data(self, work) -> None:
        """A payload piece's operation. On an NCCL group, wait() orders the current stream after it and
        returns without waiting for the GPU, so it is waited on once, as it is."""
        if self.data is self.ctrl or isinstance(work, _PointToPoint):
            self._wait(work)
        elif not self._wait_once(work, self.cfg.stall_timeout):
            raise TransportTimeout(f"no message from {self.peer} within {self.cfg.stall_timeout}s")

    def _wait_once(self, work, seconds: float) -> bool:
        """One wait on work; False if it timed out with the operation still pending."""
        try:
            work.wait(datetime.timedelta(seconds=seconds))
            return True
        except RuntimeError as e:
            if "timed out" in str(e).lower() and not work.is_completed():
                return False
            raise TransportError(f"{self.peer}: {(str(e).strip().splitlines() or ['error'])[0][:300]}") from None

    def _guard(self, fn, *args):
        """Run one message; anything but a first-step timeout leaves the group out of step for good."""
        try:
            return fn(*args)
        except TransportTimeout:
            if self._pending is None:
                self._broken = f"a part of a message from {self.peer} stalled"
            raise
        except Exception as e:
            self._broken = f"{type(e).__name__}: {e}"
            raise

    def _usable(self) -> None:
        if self._broken:
            raise TransportError(f"link to {self.peer} is unusable ({self._broken}); make a new group")
