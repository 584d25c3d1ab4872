"""One tcp:// link: 2N one-way TCP connections, reader/writer threads, and resume after a drop.

A link owns N connections for each direction (each connection has one writer
and one reader, so a TLS connection is never used by two threads at once).
Everything the connections carry belongs to an *epoch*. When any connection
fails, the whole epoch ends: all its sockets are shut down and its threads
exit, so nothing is in flight anymore and each side's inbox is exactly what it
holds. The connecting side then dials a new epoch (bounded retries within
``resume_window``), both sides swap what they hold, and each resends only what
the other lacks (outbox.py). The application sees a delay, nothing else;
after the window it sees TransportError.

States: connecting -> up <-> broken; up -> closing -> closed; any -> failed.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter

import xxhash

from ...errors import ChecksumError, TransportError
from .. import envelope
from ..base import Message, TransportTimeout
from . import frames as tf
from .auth import RCVBUF
from .inbox import Inbox
from .mac import TAG, macs_for
from .outbox import Outbox, as_views, write

log = logging.getLogger("wsync.transports.tcp")


class ConnectionLost(TransportError):
    """A connection of the link failed; the link resumes unless the window runs out."""


def recv_some(sock, view: memoryview, peer: str) -> int:
    """One recv_into: how many bytes landed (at least one); ConnectionLost if none can."""
    try:
        n = sock.recv_into(view)
    except OSError as e:
        raise ConnectionLost(f"connection to {peer} lost: {e}") from None
    if not n:
        raise ConnectionLost(f"{peer} closed a connection")
    return n


def recv_into(sock, view: memoryview, peer: str) -> None:
    got = 0
    while got < len(view):
        got += recv_some(sock, view[got:], peer)


HASH_PIECE = 256 << 10  # recv_hashed hashes each piece this size as it lands, while it is in cache
MAC_BATCH = 1 << 20  # ...and feeds a record MAC this many bytes at a time (still in cache, and large enough for BLAKE3's SIMD)


def recv_hashed(sock, view: memoryview, peer: str, tagger=None) -> int:
    """recv_into view, hashing piece by piece as the bytes land; the xxh3-64 of the whole view
    (tagger, a record MAC's body hasher, is fed the same pieces).

    The same digest as xxh3_64_intdigest(view) after one recv_into, but each
    piece is hashed while it is still in cache, where a whole frame hashed
    after it landed would be streamed from memory again.
    """
    h, got, tagged = xxhash.xxh3_64(), 0, 0
    while got < len(view):
        n = recv_some(sock, view[got: got + HASH_PIECE], peer)
        h.update(view[got: got + n])
        got += n
        if tagger is not None and (got - tagged >= MAC_BATCH or got == len(view)):
            tagger.update(view[tagged: got])  # BLAKE3 hashes large updates many 1 KiB chunks at a time
            tagged = got
    return h.intdigest()


def read(sock, n: int, peer: str) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), peer)
    return bytes(buf)


def shut(sock) -> None:
    try:  # the plain-socket shutdown, also for SSLSocket: wakes blocked threads, leaves the TLS object alone
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


# With 2+ streams, the unsent bytes a stream's socket may hold before its writer takes another frame: writers
# take frames from one queue as their streams have room, and "room" must mean "the last frame has nearly left",
# or the first writers swallow many frames each and the slowest stream ends up carrying most of a message.
NOTSENT_LOWAT = 256 << 10


def _limit_unsent(socks) -> None:
    """TCP_NOTSENT_LOWAT on the sending sockets of a multi-stream link (one stream has nothing to balance, and the
    limit would only cost it wakeups, so its caller leaves it alone)."""
    if not hasattr(socket, "TCP_NOTSENT_LOWAT"):
        return
    for s in socks:
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
        except OSError:  # the connection may already be gone; its writer will see that
            pass


CLOSE_ANSWER = 2.0  # seconds close() waits for the peer to answer its CLOSE


def in_flight(cfg) -> int:
    """Bytes a sender may have handed to its kernel that this side has not read yet: both socket buffers of
    every stream (Linux doubles what was asked for; an autotuned one is taken at 32 MiB)."""
    return cfg.streams * 2 * ((cfg.sndbuf or 32 << 20) + RCVBUF)


class TcpLink:
    """A Link (see base.py). Extra verbs: flush(timeout) waits until the peer holds every sent message."""

    fanout = 1
    lockstep = False  # one peer, which reads and writes on its own

    def __init__(self, cfg, *, peer: str, session: str, on_end=None):
        self.cfg, self.peer, self.session = cfg, peer, session
        self.cv = threading.Condition()
        self.out = Outbox(self.cv, cfg.frame_bytes, cfg.streams)
        self.inbox = Inbox(self.cv, cfg.max_message, cfg.pool_bytes)
        self.state, self.epoch, self.error = "connecting", 0, None
        self.reconnects = 0  # epochs started after a drop (tests and logs read it)
        self._socks: list = []
        self._threads: list[threading.Thread] = []
        self._old: list = []  # (threads, sockets) of ended epochs, joined and closed by _reap
        self._corrupt: Counter = Counter()  # checksum failures per (message, blob, frame) since the last progress
        self._peer_closed = False  # the peer said goodbye first
        self._on_end = on_end

    # -- application verbs ------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        self._send(msg, resume=True)

    def send_while_up(self, msg: Message) -> None:
        """send(), for a last word not worth a resume: ConnectionLost at once if the link is not up, or
        if it breaks before msg is in the kernel (msg may then still go out, should the link resume)."""
        self._send(msg, resume=False)

    def _send(self, msg: Message, resume: bool) -> None:
        views = as_views(msg.blobs)
        with self.cv:
            self._check_open()
            if not resume and self.state != "up":
                raise ConnectionLost(f"link to {self.peer} is {self.state}")
            try:
                om = self.out.add(msg.kind, msg.meta, views)
            except TypeError as e:
                raise ValueError(f"message meta must be JSON-serialisable: {e}") from None
            om.pending = -1  # not queued in any epoch yet
            if self.state == "up":
                self.out.queue(om)
                self.cv.notify_all()
            e = self.epoch
            while om.pending != 0:
                self._check_open()
                if not resume and not self._live(e):
                    raise ConnectionLost(f"link to {self.peer} is {self.state}")
                self.cv.wait()

    def recv(self, timeout: float | None = None) -> Message:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while True:
                m = self.inbox.pop()
                if m is not None:
                    return m
                self._check_open()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(f"no message from {self.peer} within {timeout}s")
                self.cv.wait(left)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the peer acknowledged every message sent (after this, buffers may be reused)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while self.out.retained:
                self._check_open()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransportTimeout(f"{self.peer} did not acknowledge within {timeout}s")
                self.cv.wait(left)

    def close(self) -> None:
        """Orderly end: wait (up to linger) for the peer to acknowledge what was sent, then CLOSE and its
        answer. Safe from several threads at once (a Subscriber's caller and its receiving thread both
        close): a later caller waits on the same handshake, as ending the link shuts every socket, and a
        peer whose other streams see that before its stream 0 reader reaches the CLOSE takes the close
        for a drop and waits resume_window for us to come back.

        A link that is not up (broken, or still connecting) ends at once, without lingering: no connection
        can carry what was sent until the dialling side brings a new epoch up, which a closing caller
        would wait for on a network that just failed; what the peer lacks is lost either way."""
        with self.cv:
            deadline = time.monotonic() + self.cfg.linger
            while self.out.retained and self.state == "up":  # let the peer get what we sent before goodbye
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(left)
            if self.state == "up":
                self.state = "closing"
                self.out.control.append(("close",))
                self.cv.notify_all()
            if self.state == "closing":  # ended by the answer to our CLOSE, or by writing ours to the peer's
                self.cv.wait_for(lambda: self.state != "closing", timeout=CLOSE_ANSWER)
            self._end(TransportError(f"link to {self.peer} was closed by this side"))
        self._reap()

    def limit(self, max_message: int, why: str | None = None) -> None:
        """The largest message this side accepts from now on: a receiver that knows what it expects
        (a subscriber: what one version of its engine's layout can take) sets it, so a larger one is
        refused at its header, before anything is allocated for it (frames.MessageTooLarge, naming
        `why`, e.g. "one version of the engine's layout can take"). Message headers are held to it too,
        and the receive buffers kept for reuse to twice it (pool_bytes, if lower, stays)."""
        if max_message < 1:
            raise ValueError(f"max_message must be positive, got {max_message}")
        with self.cv:
            self.inbox.max_message, self.inbox.limit_why = max_message, why
            # messages announced and still incomplete: a sender's next message starts once the last one is in
            # its kernel, so small messages may be many at once; what the sockets can hold in between bounds them
            self.inbox.max_incomplete = max(2 * max_message, in_flight(self.cfg))
            # buffers kept for reuse: two of the largest messages let each one reuse the one before last (the
            # last may still be in use), and no more stay resident for a receiver that expects small ones
            self.inbox.buffers.limit = min(self.cfg.pool_bytes, 2 * max_message)

    def _check_open(self) -> None:
        if self.state in ("failed", "closed"):
            raise self.error

    # -- epochs -----------------------------------------------------------------------------

    def _live(self, e: int) -> bool:
        return self.epoch == e and self.state in ("up", "closing")

    def _start(self, e: int, outs: list, ins: list, peer_state: str, keys: dict | None) -> None:
        """Run epoch e on these sockets (called under cv, once the peer's held state is known);
        keys: socket -> its record MAC key (None without a token)."""
        if self.state not in ("connecting", "broken"):
            raise TransportError(f"link to {self.peer} ended while reconnecting")
        nxt, partial = tf.decode_state(peer_state.encode(), self.out.next_seq)
        try:
            self.out.resume(nxt, partial)
        except ValueError as ex:
            raise TransportError(f"bad resume state from {self.peer}: {ex}") from None
        if self.state == "broken":
            self.reconnects += 1
            log.info("link %s resumed (epoch %d, %d reconnects)", self.peer, e, self.reconnects)
        for m in self.inbox.msgs.values():  # no reader is running: nothing is being received
            m.claimed.clear()
        self.epoch, self.state, self._socks = e, "up", outs + ins
        self.out.start(len(outs))
        if len(outs) > 1:
            _limit_unsent(outs)
        self._threads = [threading.Thread(target=self._writer, args=(e, k, s, mac), daemon=True, name=f"wsync-tx{k}")
                         for k, (s, mac) in enumerate(zip(outs, macs_for(keys, outs)))]
        self._threads += [threading.Thread(target=self._reader, args=(e, s, mac), daemon=True, name=f"wsync-rx{k}")
                          for k, (s, mac) in enumerate(zip(ins, macs_for(keys, ins)))]
        for t in self._threads:
            t.start()
        self.cv.notify_all()

    def _break(self, e: int, why: Exception) -> None:
        with self.cv:
            if e != self.epoch or self.state not in ("up", "closing"):
                return
            if self.state == "closing":  # the peer ends its connections once it has our answer, or its own
                return self._end(TransportError(f"{self.peer} closed the link") if self._peer_closed
                                 else TransportError(f"link to {self.peer} was closed by this side"))
            self.state = "broken"
            self._retire()
            log.warning("link %s: connection lost (%s); resuming within %ss", self.peer, why, self.cfg.resume_window)
            self._on_break(e)

    def _on_break(self, e: int) -> None:
        """Role hook, under cv: the dialling side reconnects, the listening side waits for it."""

    def _fail(self, err: Exception) -> None:
        with self.cv:
            if self.state in ("failed", "closed"):
                return
            self.state, self.error = "failed", err
            self._retire()
            log.error("link %s failed: %s", self.peer, err)
            self._finish()

    def _end(self, err: Exception) -> None:
        """Orderly end (under cv); messages already complete stay readable by recv()."""
        if self.state in ("failed", "closed"):
            return
        self.state, self.error = "closed", err
        self._retire()
        self._finish()

    def _finish(self) -> None:
        self.cv.notify_all()
        if self._on_end is not None:
            self._on_end(self)

    def _retire(self) -> None:
        for s in self._socks:
            shut(s)
        self._old.append((self._threads, self._socks))
        self._threads, self._socks = [], []
        self.cv.notify_all()

    def _reap(self) -> None:
        """Join the threads of ended epochs and close their sockets (never from one of those threads)."""
        with self.cv:
            old, self._old = self._old, []
        me = threading.current_thread()
        for threads, socks in old:
            for t in threads:
                if t is not me:
                    t.join(10.0)
            for s in socks:
                s.close()

    # -- threads ------------------------------------------------------------------------------

    def _writer(self, e: int, k: int, sock, mac) -> None:
        live = lambda: self._live(e)  # noqa: E731
        try:
            while True:
                with self.cv:
                    job = self.out.take(k, live)
                if job is None:
                    return
                write(sock, job, mac)
                with self.cv:
                    self.out.written(job)
                    if job[0] == "close" and self._peer_closed:
                        self._end(TransportError(f"{self.peer} closed the link"))
        except OSError as ex:
            self._break(e, ConnectionLost(f"send to {self.peer} failed: {ex}"))
        except Exception as ex:  # a bug must not leave the link hanging
            log.exception("link %s: writer crashed", self.peer)
            self._fail(TransportError(f"internal error in the tcp writer: {ex!r}"))

    def _reader(self, e: int, sock, mac) -> None:
        try:
            while self._read_one(e, sock, mac):
                pass
        except tf.CorruptRecord as ex:
            self._corrupted(e, ex)
        except ConnectionLost as ex:
            self._break(e, ex)
        except TransportError as ex:  # the peer broke the protocol: resending would not help
            self._fail(ex)
        except Exception as ex:  # a bug must not leave the link hanging
            log.exception("link %s: reader crashed", self.peer)
            self._fail(TransportError(f"internal error in the tcp reader: {ex!r}"))

    def _read_one(self, e: int, sock, mac) -> bool:
        live = lambda: self._live(e)  # noqa: E731
        raw = read(sock, tf.REC_SIZE + (TAG if mac else 0), self.peer)
        rec = tf.unpack(raw, mac, self.peer)
        header = raw[: tf.REC_SIZE]
        if rec.type == tf.FRAME:
            return self._read_frame(e, sock, rec, header, mac, live)
        if rec.type == tf.HEAD:
            most = envelope.PREFIX.size + min(envelope.MAX_HEADER, max(self.inbox.max_message, tf.MIN_HEAD_LIMIT))
            if rec.length > most:
                raise TransportError(f"{self.peer} sent a {rec.length}-byte message header (limit {most})")
            body = read(sock, rec.length, self.peer)
            self._check_body(sock, mac, header, body, xxhash.xxh3_64_intdigest(body) == rec.body_sum,
                             f"header of message {rec.seq}", (rec.seq, -1, -1))
            with self.cv:
                self.inbox.on_head(rec.seq, body, live)
                self._queue_ack()
        elif rec.type == tf.ACK:
            self._next(mac)
            with self.cv:
                if rec.seq > self.out.next_seq:
                    raise TransportError(f"{self.peer} acknowledged message {rec.seq} that was never sent")
                self.out.acked(rec.seq)
        else:  # CLOSE: the peer's goodbye, or its answer to ours
            self._next(mac)
            with self.cv:
                if self.state == "up":  # answer first, so the peer shuts down only once we stopped reading
                    self.state, self._peer_closed = "closing", True
                    self.out.control.append(("close",))
                    self.cv.notify_all()
                else:
                    self._end(TransportError(f"link to {self.peer} was closed by this side"))
            return False
        return live()

    @staticmethod
    def _next(mac) -> None:
        if mac is not None:
            mac.next()

    def _check_body(self, sock, mac, header: bytes, body, sum_ok: bool, what: str, key: tuple, tagger=None) -> None:
        """After a body landed: its tag read and checked (with a token), then its xxh3. Damage is resent,
        forgery ends the link; either way the caller has not marked anything held yet."""
        if mac is not None:
            tag = read(sock, TAG, self.peer)
            if tagger is None:
                tagger = mac.body(header)
                tagger.update(body)
            if sum_ok:
                mac.check(tag, tagger.digest(), what, self.peer)
            mac.next()
        if not sum_ok:
            raise tf.CorruptRecord(f"{what} failed its checksum", key)

    def _read_frame(self, e: int, sock, rec: tf.Record, header: bytes, mac, live) -> bool:
        if rec.length > envelope.MAX_FRAME:
            raise TransportError(f"{self.peer} sent a {rec.length}-byte frame (limit {envelope.MAX_FRAME})")
        with self.cv:
            target = self.inbox.claim(rec, live, self.cfg.stall_timeout)
            if not live():  # the epoch ended meanwhile: leave the frame to the next one
                if target is not None:
                    self.inbox.release(rec.seq, target[0], rec.blob, target[1], False)
                return False
        tagger = mac.body(header) if mac is not None else None
        if target is None:  # a frame we already hold: read it into nothing (its tag still counts)
            left = rec.length
            while left:
                piece = read(sock, min(left, 1 << 20), self.peer)
                left -= len(piece)
                if tagger is not None:
                    tagger.update(piece)
            self._check_body(sock, mac, header, b"", True, f"a repeated frame of message {rec.seq}", (), tagger)
            return True
        m, i, view = target
        what = f"frame {i} of blob {rec.blob} of message {rec.seq}"
        ok = False
        try:
            sum_ok = recv_hashed(sock, view, self.peer, tagger) == rec.body_sum
            self._check_body(sock, mac, header, view, sum_ok, what, (rec.seq, rec.blob, i), tagger)
            ok = True
        finally:
            with self.cv:
                self.inbox.release(rec.seq, m, rec.blob, i, ok)
                self._queue_ack()
        return live()

    def _queue_ack(self) -> None:
        if self.inbox.new_ack:
            self.inbox.new_ack = False
            self._corrupt.clear()  # progress: resend counts are "in a row"
            self.out.ack = self.inbox.complete_below
            self.cv.notify_all()

    def _corrupted(self, e: int, ex: tf.CorruptRecord) -> None:
        with self.cv:
            self._corrupt[ex.key] += 1
            n = self._corrupt[ex.key]
        if n > self.cfg.max_resends:
            self._fail(ChecksumError(f"{ex} from {self.peer} {n} times in a row; giving up (a sender that changed "
                                     "a buffer before flush(), or a link that damages data)"))
        else:
            self._break(e, ex)  # the new epoch resends what failed
