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

Every transport sends a message as envelope.py's header, then its blobs;
every length is bounded and every host blob checked before the receiver sees it.
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import TransportError
from ..tokens import check as check_token


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
    # every member takes part in every message (a group's collectives): the publisher gathers acks as the
    # reply to each send instead of reading them apart, and a subscriber speaks only when spoken to
    lockstep: bool

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
