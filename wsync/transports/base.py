"""The transport interface: move messages between a publisher and its subscribers.

A **message** is a kind, a small JSON-able ``meta`` dict and zero or more binary
``blobs`` (payload bytes, possibly gigabytes, passed as buffers, never copied
into one string). The sync protocol (``wsync.sync``) speaks only in messages;
a transport only moves them. So any transport carries any codec.

Two verbs on each side, one address form:

    listener = listen("tcp://127.0.0.1:0", token=...)      # publisher side
    link = listener.accept(timeout=1.0)                    # a Link, or None on timeout
    link = connect("tcp://127.0.0.1:7070", token=...)     # subscriber side
    link.send(Message("hello", {"version": 3}))
    msg = link.recv(timeout=30.0)

A ``Link`` is duplex, ordered and reliable, and joins the publisher to one
subscriber; or, for broadcast transports (nccl/gloo), to a whole group at once:
then ``link.fanout`` > 1, ``send`` reaches every member, and ``recv`` returns
one message per member in turn (each carries ``meta["rank"]``).

On a byte stream a message travels as an envelope (all integers little-endian)::

    0  4  magic b"WSM1"
    4  4  u32 header length H
    8  8  u64 xxh3-64 of the header bytes
    16 H  header: UTF-8 JSON {"kind", "meta", "sizes": [...], "sums": [...]}
    then each blob's bytes, sizes[i] of them, whose xxh3-64 is sums[i] (hex)

Every length is bounded and every blob checked before the receiver sees it.
"""
from __future__ import annotations

import json
import socket
import struct
import urllib.parse
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from .. import safejson
from ..errors import ChecksumError, TransportError
from ..tokens import check as check_token

MAGIC = b"WSM1"
ENVELOPE = struct.Struct("<4sIQ")
MAX_HEADER = 16 << 20  # a message header is small JSON; anything bigger is a broken peer
MAX_BLOB = 1 << 40  # 1 TiB: larger than any single tensor bucket we would send


@dataclass
class Message:
    kind: str  # e.g. "hello", "bucket", "ack"; the sync protocol defines them
    meta: dict = field(default_factory=dict)  # JSON-serialisable fields
    blobs: list = field(default_factory=list)  # bytes-like buffers (memoryview, bytes, numpy arrays)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes if getattr(b, "is_cuda", False) else memoryview(b).nbytes for b in self.blobs)


class TransportTimeout(TransportError, TimeoutError):
    """recv/accept waited longer than its timeout. The link is still usable."""


class Link(Protocol):
    peer: str  # printable name of the other side, for logs
    fanout: int  # subscribers reached by one send (1 except broadcast groups)

    def send(self, msg: Message) -> None:
        """Deliver msg whole or raise TransportError; blocks until the bytes are handed off."""

    def recv(self, timeout: float | None = None) -> Message:
        """Next message; TransportTimeout after timeout seconds, TransportError if the link is gone."""

    def close(self) -> None: ...


class Listener(Protocol):
    address: str  # the address subscribers dial, with the real port filled in

    def accept(self, timeout: float | None = None) -> Link | None:
        """A newly joined subscriber (already authenticated), or None after timeout."""

    def close(self) -> None: ...


# scheme -> "module:attr" of a module with listen(addr, **opts) and connect(addr, **opts)
REGISTRY = {
    "tcp": "wsync.transports.tcp",
    "ucx": "wsync.transports.ucx",
    "gloo": "wsync.transports.torchdist",
    "nccl": "wsync.transports.torchdist",
    "local": "wsync.transports.local",
}


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str
    port: int | None
    path: str
    params: dict[str, str]

    def __str__(self) -> str:
        q = ("?" + urllib.parse.urlencode(self.params)) if self.params else ""
        where = self.path if self.scheme == "local" else f"{self.host}:{self.port}"
        return f"{self.scheme}://{where}{q}"


def parse_address(addr: str) -> Address:
    """'tcp://host:port?streams=4' -> Address; 'local://name' keeps name in path."""
    if not isinstance(addr, str) or "://" not in addr:
        raise ValueError(f"expected an address like tcp://host:port, got {addr!r}")
    u = urllib.parse.urlsplit(addr)
    if u.scheme not in REGISTRY:
        raise ValueError(f"unknown transport {u.scheme!r} in {addr!r}; known: {', '.join(sorted(REGISTRY))}")
    params = dict(urllib.parse.parse_qsl(u.query, keep_blank_values=True))
    if u.scheme == "local":
        name = (u.netloc + u.path).strip("/")
        if not name:
            raise ValueError(f"local:// needs a name, e.g. local://trainer0, got {addr!r}")
        return Address("local", "", None, name, params)
    try:
        port = u.port
    except ValueError:
        raise ValueError(f"bad port in {addr!r}") from None
    if not u.hostname or port is None:
        raise ValueError(f"{addr!r} needs host:port")
    return Address(u.scheme, u.hostname, port, "", params)


def _module(scheme: str):
    import importlib

    return importlib.import_module(REGISTRY[scheme])


def listen(address: str, **opts) -> Listener:
    a = parse_address(address)
    return _module(a.scheme).listen(a, **opts)


def connect(address: str, **opts) -> Link:
    a = parse_address(address)
    return _module(a.scheme).connect(a, **opts)


def with_token(opts: dict | None, token) -> dict:
    """opts plus token= for transports that authenticate peers (tcp); none is passed when token is None.
    A token too short to resist offline guessing is refused here, in the caller's thread (tokens.py)."""
    opts = dict(opts or {})
    if token is not None:
        opts["token"] = check_token(token)
    return opts


DEVICE_SCHEMES = ("nccl", "ucx")  # transports that put their buffers on a CUDA device


def current_device(init: bool = True) -> int | None:
    """The calling thread's current CUDA device index; None where torch or a CUDA device is missing.

    With init=False a process that has not initialized CUDA is left so (a link that may only ever move host
    memory must not start CUDA, nor spoil a later fork): no torch call can have picked a device yet, since picking
    one initializes CUDA, so every thread's current device is the default, 0."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    if not init and not torch.cuda.is_initialized():
        return 0
    return torch.cuda.current_device()


def with_device(address: str, opts: dict | None) -> dict:
    """opts plus device=, for a link that a thread of ours will dial later: the device current on the
    calling thread now (a new thread starts on device 0, whatever the caller works on)."""
    opts = dict(opts or {})
    if parse_address(address).scheme in DEVICE_SCHEMES and opts.get("device") is None:
        d = current_device(init=False)
        if d is not None:
            opts["device"] = d
    return opts


# -- the envelope on a byte stream ----------------------------------------------------------


def pack_header(msg: Message) -> bytes:
    """Envelope + JSON header for msg; the blobs follow it as they are."""
    views = [memoryview(b).cast("B") for b in msg.blobs]
    head = json.dumps({
        "kind": msg.kind, "meta": msg.meta,
        "sizes": [len(v) for v in views], "sums": [xxhash.xxh3_64_hexdigest(v) for v in views],
    }, separators=(",", ":")).encode()
    return ENVELOPE.pack(MAGIC, len(head), xxhash.xxh3_64_intdigest(head)) + head


def open_head(head: bytes, hsum: int, keys: tuple[str, ...]) -> list:
    """Check a message header's xxh3 and parse its JSON; returns the values of keys (types unchecked)."""
    if xxhash.xxh3_64_intdigest(head) != hsum:
        raise ChecksumError("message header checksum mismatch (corrupt in transit)")
    try:
        doc = safejson.loads(head, what="message header")
        return [doc[k] for k in keys]
    except (ValueError, KeyError, TypeError) as e:
        raise TransportError(f"malformed message header: {e}") from None


def parse_header(env: bytes, read) -> tuple[str, dict, list[int], list[str]]:
    """Check an envelope and read its header with read(n) -> bytes; returns kind, meta, sizes, sums."""
    magic, hlen, hsum = ENVELOPE.unpack(env)
    if magic != MAGIC:
        raise TransportError(f"peer sent a frame that is not a wsync message (magic {magic!r})")
    if hlen > MAX_HEADER:
        raise TransportError(f"message header of {hlen} bytes exceeds the {MAX_HEADER}-byte limit")
    kind, meta, sizes, sums = open_head(read(hlen), hsum, ("kind", "meta", "sizes", "sums"))
    ok = (isinstance(kind, str) and isinstance(meta, dict) and isinstance(sizes, list) and isinstance(sums, list)
          and len(sizes) == len(sums) and all(type(n) is int and 0 <= n <= MAX_BLOB for n in sizes)
          and all(isinstance(s, str) for s in sums))
    if not ok:
        raise TransportError("malformed message header: bad field types or blob sizes")
    return kind, meta, sizes, sums


def check_blob(blob, expected: str, i: int) -> None:
    if xxhash.xxh3_64_hexdigest(blob) != expected:
        raise ChecksumError(f"message blob {i} failed its checksum (corrupt in transit)")


class StreamLink:
    """A Link over one connected stream socket (TCP or Unix). Not thread-safe per direction."""

    fanout = 1

    def __init__(self, sock: socket.socket, peer: str | None = None, stall_timeout: float = 120.0):
        self.sock = sock
        self.stall_timeout = stall_timeout  # once a message has started, the longest wait for its next byte
        self.peer = peer or str(sock.getpeername() if sock.family != socket.AF_UNIX else "unix")

    def send(self, msg: Message) -> None:
        try:
            self.sock.sendall(pack_header(msg))
            for b in msg.blobs:
                self.sock.sendall(memoryview(b).cast("B"))
        except OSError as e:
            raise TransportError(f"send to {self.peer} failed: {e}") from None

    def recv(self, timeout: float | None = None) -> Message:
        try:
            self.sock.settimeout(timeout)
            env = self._read(ENVELOPE.size, first=True)
            self.sock.settimeout(self.stall_timeout)
            kind, meta, sizes, sums = parse_header(env, self._read)
            blobs = []
            for i, n in enumerate(sizes):
                buf = bytearray(n)
                recv_exact(self.sock, memoryview(buf), self.peer)
                check_blob(buf, sums[i], i)
                blobs.append(buf)
        except socket.timeout:
            raise TransportTimeout(f"no message from {self.peer} within {timeout}s") from None
        except OSError as e:  # closed under us
            raise TransportError(f"link to {self.peer} is closed: {e}") from None
        return Message(kind, meta, blobs)

    def _read(self, n: int, first: bool = False) -> bytes:
        buf = bytearray(n)
        recv_exact(self.sock, memoryview(buf), self.peer, allow_timeout=first)
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def recv_exact(sock: socket.socket, view: memoryview, peer: str, allow_timeout: bool = False) -> None:
    """Fill view from sock or raise TransportError (socket.timeout passes through only before any byte)."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            if allow_timeout and got == 0:
                raise
            raise TransportError(f"{peer} stalled mid-message") from None
        except OSError as e:
            raise TransportError(f"connection to {peer} lost: {e}") from None
        if n == 0:
            raise TransportError(f"{peer} closed the connection" + (" mid-message" if got else ""))
        got += n
