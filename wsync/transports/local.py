"""``local://name``: publisher and subscribers on one host, payload through shared memory.

A Unix socket in a private runtime directory (mode 0700, peers must run as our
uid) carries message headers (envelope.py) and small JSON control frames;
payload bytes are written once into a **memfd** segment whose file descriptor
travels with the message header (SCM_RIGHTS),
and the reader maps it copy-on-write and hands out views: no second copy, and
the caller may still write to what it got. Segments have no name anywhere, so
nothing can leak into /dev/shm: when both processes close their descriptors
and mappings, or die, the kernel frees the memory.

Segments are reused: the reader tells the writer (frame ``F``) once the caller
has dropped every view of a message (checked every 20 ms and at each call), and the
writer recycles that segment for a later message of the same or smaller size,
so steady-state syncs fault no fresh pages. Payload is hashed per piece
(xxh3-64) while it is copied in, and checked per piece when mapped, on a small
thread pool. CUDA tensors given as blobs travel as CUDA IPC handles (see
local_cuda) and come back as CUDA tensors on the same memory. A message with
CUDA blobs carries an id; the writer holds those tensors until the reader's
``F`` names that id, sent once nothing in the reader holds their storages, so
``wait_cuda_released`` tells the writer when it may overwrite them.
"""
from __future__ import annotations

import json
import mmap
import os
import queue
import select
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field

from .. import safejson
from ..errors import ChecksumError, TransportError
from . import envelope, local_cuda, options
from .base import Address, Message, TransportTimeout
from .local_segments import SegmentPool, copy_in, verify_pieces

FRAME = struct.Struct("<cI")  # frame type, JSON body length
HELLO = FRAME.pack(b"H", 0)  # a subscriber's first bytes
REAP_EVERY = 0.02  # seconds between checks for released messages while the socket is idle
MAX_FRAME = envelope.PREFIX.size + envelope.MAX_HEADER  # a message header is the largest frame


@dataclass(kw_only=True)
class LocalConfig:
    dir: str | None = None  # rendezvous directory; default $XDG_RUNTIME_DIR/wsync or /tmp/wsync-<uid>
    pool_bytes: int = 4 << 30  # released segments kept for reuse by this writer
    piece: int = 8 << 20  # bytes per checksummed piece (the unit of parallel copy/hash)


KINDS = {"pool_bytes": "size", "piece": "size"}


@dataclass
class _Held:
    """What the reader handed out for one message, given back to the writer (frame F) once all of it is unused."""

    seg: int | None = None  # the writer's segment id
    mm: mmap.mmap | None = None  # our mapping of it, until it closes
    msg: int | None = None  # the writer's id for a message with CUDA blobs
    cuda: list = field(default_factory=list)  # weak references to the CUDA storages we opened

    def done(self) -> bool:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view of it is still alive
                return False
            self.mm = None
        return all(r.expired() for r in self.cuda)


def _socket_path(addr: Address, cfg: LocalConfig) -> str:
    name = addr.path
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"local:// names may use letters, digits, '-', '_' and '.', got {name!r}")
    d = cfg.dir or os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"wsync-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise TransportError(f"{d} must belong to uid {os.getuid()} with mode 0700 so no other user can reach the socket")
    path = os.path.join(d, name + ".sock")
    if len(path.encode()) > 107:
        raise ValueError(f"socket path {path!r} is longer than a Unix socket allows; use a shorter name or dir")
    return path


def listen(addr: Address, **opts) -> "LocalListener":
    return LocalListener(addr, options.build(LocalConfig, addr.params, opts, KINDS))


def connect(addr: Address, **opts) -> "LocalLink":
    cfg = options.build(LocalConfig, addr.params, opts, KINDS)
    path = _socket_path(addr, cfg)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise TransportError(f"no local publisher at {path} ({e.strerror}); is it listening on {addr}?") from None
    sock.sendall(HELLO)  # tells the listener this is a subscriber, not a probe for a live socket
    return LocalLink(sock, cfg, f"local://{addr.path}")


class LocalListener:
    def __init__(self, addr: Address, cfg: LocalConfig):
        self.cfg, self.path, self.address = cfg, _socket_path(addr, cfg), str(addr)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
            raise TransportError(f"another publisher already listens on {self.address} ({self.path})")
        except (FileNotFoundError, ConnectionRefusedError):
            if os.path.exists(self.path):  # left by a process that died: nobody answers on it
                os.unlink(self.path)
        finally:
            probe.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(64)

    def accept(self, timeout: float | None = None) -> "LocalLink | None":
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.sock.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                return None
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] == os.getuid() and _said_hello(conn):
                conn.settimeout(None)
                return LocalLink(conn, self.cfg, self.address)
            conn.close()  # a probe, or another user (the 0700 directory should already stop them)

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _said_hello(conn: socket.socket) -> bool:
    conn.settimeout(5.0)
    got = b""
    try:
        while len(got) < len(HELLO):
            more = conn.recv(len(HELLO) - len(got))
            if not more:
                return False
            got += more
    except OSError:
        return False
    return got == HELLO


class LocalLink:
    fanout = 1
    lockstep = False  # one peer, which reads and writes on its own

    def __init__(self, sock: socket.socket, cfg: LocalConfig, peer: str):
        self.sock, self.cfg, self.peer = sock, cfg, peer
        self._out = SegmentPool(cfg.pool_bytes)  # segments we write
        self._in_fds: dict[int, int] = {}  # the peer's segments we may map, by id
        self._held: list[_Held] = []  # what our caller got, given back once unused
        self._lent: dict[int, list] = {}  # message id -> CUDA tensors we sent that the reader may still use
        self._lent_cv = threading.Condition()
        self._next_msg = 0
        self._broken: TransportError | None = None  # why the read loop stopped
        self._inbox: queue.Queue = queue.Queue()
        self._wlock = threading.Lock()  # one writer of frames at a time (caller and reaper)
        self._hlock = threading.Lock()  # guards _held
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name=f"wsync-local-{peer}", daemon=True)
        self._reader.start()

    # -- sending ------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        self._reap()
        for seg_id in self._out.evict():
            self._frame(b"D", {"seg": seg_id})
        for b in msg.blobs:
            if local_cuda.is_cuda(b):
                local_cuda.check(b)
        sizes, device, ipc, host, cuda = [], [], [], [], []
        for i, b in enumerate(msg.blobs):
            if local_cuda.is_cuda(b):
                device.append(i)
                ipc.append(local_cuda.share(b))
                cuda.append(b)
                sizes.append(b.numel() * b.element_size())
            else:
                v = memoryview(b).cast("B")
                host.append(v)
                sizes.append(len(v))
        total = sum(len(v) for v in host)
        seg = self._out.take(total) if total else None
        host_sums = iter(copy_in(seg.mm, host, self.cfg.piece) if seg is not None else [[] for _ in host])
        on_device = set(device)
        sums = [[] if i in on_device else next(host_sums) for i in range(len(sizes))]
        msg_id = None
        if cuda:
            self._next_msg += 1
            msg_id = self._next_msg
            with self._lent_cv:  # before the frame goes out, so the reader's F cannot arrive first
                self._lent[msg_id] = cuda
        fds = [seg.fd] if seg is not None and not seg.shared else []
        try:
            head = envelope.pack(msg.kind, msg.meta, sizes, sums=sums, piece=self.cfg.piece, device=device,
                                 ipc=ipc or None, seg=seg.id if seg is not None else None, msg=msg_id)
            self._frame(b"M", head, fds)
        except (TransportError, TypeError):
            if cuda:
                self._give_back(msg_id)
            if seg is not None:
                self._out.release(seg.id)
            raise
        if seg is not None:
            seg.shared = True

    def cuda_lent(self) -> int:
        """Messages whose CUDA blobs the reader may still be using (we hold those tensors until it lets go)."""
        with self._lent_cv:
            return len(self._lent)

    def wait_cuda_released(self, timeout: float | None = None) -> bool:
        """Block until the reader has let go of every CUDA blob sent so far: then they may be overwritten or freed.

        False after timeout seconds; TransportError if the link fails first (the reader may still map them).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lent_cv:
            while self._lent or self._closed:
                if self._closed:
                    raise TransportError(f"link to {self.peer} is closed")
                if self._broken is not None:
                    raise TransportError(f"{self._broken}; {len(self._lent)} message(s) of CUDA blobs were not "
                                         f"given back")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lent_cv.wait(left)
            return True

    def _give_back(self, msg_id) -> None:
        with self._lent_cv:
            self._lent.pop(msg_id, None)
            self._lent_cv.notify_all()

    def _frame(self, kind: bytes, body, fds=()) -> None:
        """One frame: a message header (bytes, from envelope.pack) or a control frame's JSON (a dict)."""
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        try:
            with self._wlock:
                if fds:
                    socket.send_fds(self.sock, [FRAME.pack(kind, len(data))], list(fds))
                    self.sock.sendall(data)
                else:
                    self.sock.sendall(FRAME.pack(kind, len(data)) + data)
        except OSError as e:
            raise TransportError(f"send to {self.peer} failed: {e}") from None

    # -- receiving ----------------------------------------------------------------------

    def recv(self, timeout: float | None = None) -> Message:
        self._reap()
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no message from {self.peer} within {timeout}s") from None
        if isinstance(item, Exception):
            self._inbox.put(item)  # every later recv sees the same failure
            raise item
        return self._open(item)

    def _open(self, h: envelope.Header) -> Message:
        """Map a message's segment and open its CUDA descriptions; the host blobs lie back to back in the segment."""
        held, blobs, host, view, err = _Held(seg=h.seg, msg=h.msg), [], [], None, None
        device = dict(zip(h.device, h.ipc or ()))
        try:
            need = sum(n for i, n in enumerate(h.sizes) if i not in device)
            if h.seg is None:
                if need:
                    raise TransportError(f"{self.peer} sent {need} bytes of host blobs without a segment")
            else:
                fd = self._in_fds.get(h.seg)
                if fd is None:
                    raise TransportError(f"{self.peer} named segment {h.seg}, which it never shared")
                size = os.fstat(fd).st_size
                if size < need:
                    raise TransportError(f"{self.peer} put {need} bytes of host blobs in a {size}-byte segment")
                held.mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
                view = memoryview(held.mm)
            off = 0
            for i, n in enumerate(h.sizes):
                if i in device:
                    t = local_cuda.open_shared(device[i])
                    held.cuda.append(local_cuda.watch(t))
                    blobs.append(t)
                    t = None
                else:
                    blobs.append(view[off:off + n] if n else bytearray())
                    if n:
                        host.append((blobs[-1], h.sums[i]))
                    off += n
        except TransportError as e:
            err = e
        except (KeyError, TypeError, ValueError, OSError, AttributeError) as e:
            err = TransportError(f"malformed local message header from {self.peer}: {e!r}")
        if err is not None:
            # what was opened goes back to the writer at once; the exception must not keep it alive in this frame
            blobs = host = view = t = None
            self._hold(held)
            self._reap()
            raise err from None
        self._hold(held)
        bad = verify_pieces(host, h.piece)
        if bad is not None:
            del blobs, host, view
            self._reap()
            raise ChecksumError(f"local message piece {bad} failed its checksum (shared memory changed under us)")
        return Message(h.kind, h.meta, blobs)

    def _read_loop(self) -> None:
        try:
            while True:
                if not select.select([self.sock], [], [], REAP_EVERY)[0]:
                    self._reap()  # between frames: hand back what the caller dropped, without waiting for its next call
                    continue
                kind, body, fds = self._read_frame()
                if kind == b"M":
                    self._inbox.put(self._header(body, fds))
                    continue
                for fd in fds:  # descriptors ride on message headers only
                    os.close(fd)
                if fds:
                    raise TransportError(f"{self.peer} sent descriptors with a {kind!r} frame")
                body = safejson.loads(body, what=f"frame from {self.peer}")
                if kind == b"F":
                    if body.get("seg") is not None:
                        self._out.release(body["seg"])
                    if body.get("msg") is not None:
                        self._give_back(body["msg"])
                elif kind == b"D":
                    os.close(self._in_fds.pop(body["seg"]))
        except Exception as e:  # EOF, a dead peer, or garbage: every waiting recv learns it
            err = e if isinstance(e, TransportError) else TransportError(f"{self.peer}: {e!r}")
            err = err if not self._closed else TransportError(f"link to {self.peer} is closed")
            with self._lent_cv:
                self._broken = err
                self._lent_cv.notify_all()
            self._inbox.put(err)

    def _read_frame(self):
        prefix, fds = b"", []
        while len(prefix) < FRAME.size:  # descriptors ride on the first byte of a frame
            data, got, _flags, _addr = socket.recv_fds(self.sock, FRAME.size - len(prefix), 4)
            if not data:
                raise TransportError(f"{self.peer} closed the connection")
            prefix, fds = prefix + data, fds + list(got)
        kind, n = FRAME.unpack(prefix)
        if kind not in (b"M", b"F", b"D") or n > MAX_FRAME:
            raise TransportError(f"{self.peer} sent a bad frame (type {kind!r}, {n} bytes)")
        body = bytearray()
        while len(body) < n:
            more = self.sock.recv(n - len(body))
            if not more:
                for fd in fds:
                    os.close(fd)
                raise TransportError(f"{self.peer} closed the connection mid-frame")
            body += more
        return kind, bytes(body), fds

    def _header(self, body: bytes, fds: list) -> envelope.Header:
        """A message header, checked; the descriptor it carries (the first time a segment is used) is kept."""
        try:
            h = envelope.parse(body, need=("sums", "piece"), may=("seg", "device", "ipc", "msg"))
            if len(fds) > 1 or (fds and (h.seg is None or h.seg in self._in_fds)):
                raise TransportError(f"{self.peer} sent {len(fds)} descriptors for segment {h.seg}")
        except Exception:
            for fd in fds:
                os.close(fd)
            raise
        if fds:
            self._in_fds[h.seg] = fds[0]
        return h

    def _hold(self, held: _Held) -> None:
        if held.seg is not None or held.msg is not None:  # otherwise the writer holds nothing for this message
            with self._hlock:
                self._held.append(held)

    def _reap(self) -> None:
        """Give back messages our caller has dropped every part of (from the caller's thread or the reader's)."""
        with self._hlock:
            freed, keep = [], []
            for h in self._held:
                (freed if h.done() else keep).append(h)
            self._held = keep
        for h in freed:
            if not self._closed:
                body = {"seg": h.seg} if h.msg is None else {"seg": h.seg, "msg": h.msg}
                try:
                    self._frame(b"F", body)
                except TransportError:
                    pass  # the peer is gone; its segments went with it

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(timeout=5)
        for fd in self._in_fds.values():
            os.close(fd)
        self._in_fds.clear()
        self._out.close()
        with self._lent_cv:  # the reader can no longer tell us; torch's IPC counter still keeps the allocations
            self._lent.clear()
            self._lent_cv.notify_all()
        self._reap()  # mappings still viewed by the caller stay valid until it drops them
