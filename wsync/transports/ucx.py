"""``ucx://host:port``: messages over UCX through UCXX (``pip install 'wsync[ucx]'``, package ucxx-cu12).

UCX picks the fastest path it has: shared memory or TCP on a plain host, RDMA
and GPU-direct where present. UCX-Py is discontinued; UCXX is its successor.
UCXX is asyncio-based, so this module runs one private event loop thread per
process (UCXX keeps one context and worker per process) and offers the usual
blocking Link on top: every call hands a coroutine to that loop and waits.

On the wire: a u64 header length, the header (envelope.py's, with ``sums`` and
``device`` fields), then each non-empty blob as one tagged UCX message.
Host blobs carry xxh3-64 sums checked on arrival; CUDA blobs (torch tensors or
anything with ``__cuda_array_interface__``) go device to device and arrive as
uint8 CUDA tensors, unchecked here (the sync layer's digest covers them), on the
link's device: the ``device`` option, else the device current on the thread that
called ``listen`` or ``connect``, read there and then. The UCX work runs on the
process's one loop thread, which every link shares and which starts on device 0,
so that thread makes the right device current right before each CUDA step (a
receive buffer, a posted send or receive of device memory).
A recv that times out leaves its receive pending and the next recv resumes it,
so no bytes are lost or matched out of order. A send whose part the peer does
not take within ``stall_timeout`` fails, and the link with it.

Listeners need UCX's tcp transport (``UCX_TLS=tcp`` or ``sm,tcp``; ``sm``
alone cannot connect through a listener); the ``tls`` option sets it for this
process when UCX_TLS is unset, before UCX starts.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
from dataclasses import dataclass

import numpy as np
import xxhash

from ..errors import BackendUnavailable, ChecksumError, TransportError
from . import envelope
from . import groupframe as gf
from . import options
from .base import Address, Message, TransportTimeout, current_device
from .pool import BufferPool


@dataclass(kw_only=True)
class UcxConfig:
    connect_timeout: float = 30.0  # seconds to reach a listener
    stall_timeout: float = 120.0  # once a message has started, the longest wait for the rest of it
    pool_bytes: int = 1 << 30  # received host buffers kept for reuse once the caller drops them
    tls: str | None = None  # UCX_TLS for this process if the environment does not set it (e.g. "tcp,sm,self")
    device: str | None = None  # where CUDA blobs arrive (default: the GPU current where listen/connect was called)


KINDS = {"connect_timeout": float, "stall_timeout": float, "pool_bytes": "size"}
_LOOP = None
_LOOP_LOCK = threading.Lock()
_RETIRED: list = []  # closed listeners, kept alive (see UcxListener.close)


def _ucxx():
    try:
        import ucxx
    except ImportError as e:
        raise BackendUnavailable(f"ucx:// needs UCXX ({e}); install it with: pip install 'wsync[ucx]' (ucxx-cu12)") from None
    return ucxx


def _loop(cfg: UcxConfig, device=None) -> "_Loop":
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            if cfg.tls and "UCX_TLS" not in os.environ:
                os.environ["UCX_TLS"] = cfg.tls
            _LOOP = _Loop(_ucxx(), device)
        return _LOOP


def _link_device(cfg: UcxConfig):
    """The device CUDA blobs arrive on: the option, else the calling thread's current one (None: no CUDA here)."""
    return gf.choose_device(cfg.device, current_device(init=False))


def _use_device(device, only_if_initialized: bool = False) -> None:
    """Make device current on this thread (the loop thread) before a CUDA step; None leaves it as it is."""
    if device is None:
        return
    import torch

    if only_if_initialized and not torch.cuda.is_initialized():
        return  # nothing CUDA has happened in this process: do not start it for a link that may move host bytes
    torch.cuda.set_device(device)


async def _on_device(device, start):
    """await start() with device current: set in the same step as start() posts its UCX request, with no await
    between, because the loop thread is shared and another link's step may have set another device meanwhile."""
    _use_device(device)
    return await start()


class _Loop:
    """The process's UCXX event loop, on a daemon thread."""

    def __init__(self, ucxx, device=None):
        self.ucxx = ucxx
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._main, args=(device,), name="wsync-ucx", daemon=True).start()
        self.run(self._init())

    def _main(self, device) -> None:
        _use_device(device, only_if_initialized=True)  # the first link's device, before UCX starts on this thread
        self.loop.run_forever()

    async def _init(self):
        self.ucxx.init()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransportTimeout(f"UCX operation did not finish within {timeout}s") from None


def _errors(e: BaseException, peer: str) -> Exception:
    if isinstance(e, (TransportError, ChecksumError, BackendUnavailable)):
        return e
    return TransportError(f"UCX link to {peer}: {type(e).__name__}: {e}")


def listen(addr: Address, **opts) -> "UcxListener":
    return UcxListener(addr, options.build(UcxConfig, addr.params, opts, KINDS))


def connect(addr: Address, **opts) -> "UcxLink":
    cfg = options.build(UcxConfig, addr.params, opts, KINDS)
    device = _link_device(cfg)  # here, on the caller's thread
    lp = _loop(cfg, device)
    peer = f"{addr.host}:{addr.port}"
    try:
        ep = lp.run(lp.ucxx.create_endpoint(addr.host, addr.port, connect_timeout=cfg.connect_timeout),
                    cfg.connect_timeout + 5)
    except Exception as e:
        raise TransportError(f"cannot reach a ucx publisher at {peer}: {e}") from None
    return UcxLink(lp, ep, cfg, peer, device)


class UcxListener:
    def __init__(self, addr: Address, cfg: UcxConfig):
        self.device = _link_device(cfg)  # here, on the caller's thread: accept() may run on any other
        self.cfg, self.lp, self._joined = cfg, _loop(cfg, self.device), queue.Queue()
        self._closed = threading.Event()
        joined, closed = self._joined, self._closed

        async def on_connect(ep):
            if closed.is_set():  # the port stays open (see close): turn the peer away
                await ep.close()
            else:
                joined.put(ep)

        async def start():
            return self.lp.ucxx.create_listener(on_connect, port=addr.port or None)

        try:
            self._listener = self.lp.run(start(), 30)
        except Exception as e:
            raise TransportError(f"cannot listen on ucx port {addr.port}: {e}") from None
        self.address = str(Address("ucx", addr.host, self._listener.port, "", addr.params))

    def accept(self, timeout: float | None = None) -> "UcxLink | None":
        try:
            ep = self._joined.get(timeout=timeout)
        except queue.Empty:
            return None
        return UcxLink(self.lp, ep, self.cfg, f"ucx subscriber of {self.address}", self.device)

    def close(self) -> None:
        """Stop taking subscribers. The UCX listener itself is kept for the life of the process, turning peers
        away: UCXX 0.52 frees its Python callback data when the listener object goes, but not the UCX listener
        under it, which keeps taking the connection requests of peers that redial; at the next garbage collection
        that crashed the process (a listener destroyed with unprocessed requests). So a closed ucx Publisher
        keeps its port until its process exits."""
        self._closed.set()
        _RETIRED.append(self._listener)
        while True:  # peers that joined but were never accepted: close them too
            try:
                ep = self._joined.get_nowait()
            except queue.Empty:
                break
            try:
                self.lp.run(ep.close(), 10)
            except Exception:
                pass


def _is_cuda(b) -> bool:
    return getattr(b, "is_cuda", False) is True or hasattr(b, "__cuda_array_interface__")


def _cuda_nbytes(b) -> int:
    if hasattr(b, "element_size"):
        return b.numel() * b.element_size()
    return int(b.nbytes)


def pack_head(msg: Message) -> tuple[bytes, list]:
    """The message header; returns it and the buffers to send (non-empty blobs, in order)."""
    sizes, sums, device, bufs = [], [], [], []
    for i, b in enumerate(msg.blobs):
        if _is_cuda(b):
            n, s, buf = _cuda_nbytes(b), [], b
            device.append(i)
        else:
            buf = memoryview(b).cast("B")
            n, s = len(buf), [xxhash.xxh3_64_hexdigest(buf)]
        sizes.append(n), sums.append(s)
        if n:
            bufs.append(buf)
    return envelope.pack(msg.kind, msg.meta, sizes, sums=sums, device=device), bufs


def parse_head(raw: bytes) -> envelope.Header:
    """The header of a message over UCX: envelope.parse with the fields pack_head sends."""
    return envelope.parse(raw, need=("sums",), may=("device",))


class UcxLink:
    fanout = 1
    lockstep = False  # one peer, which reads and writes on its own

    def __init__(self, lp: _Loop, ep, cfg: UcxConfig, peer: str, device=None):
        self.lp, self.ep, self.cfg, self.peer = lp, ep, cfg, peer
        self.device = device  # where CUDA blobs arrive; None: this process had no CUDA device when the link was made
        self._pool = BufferPool(cfg.pool_bytes)
        self._pending = None  # a receive that outlived its caller's timeout; the next recv resumes it
        self._broken = None  # why a send stopped half way: the peer's stream is out of step for good

    def send(self, msg: Message) -> None:
        if self._broken:
            raise TransportError(f"UCX link to {self.peer} is unusable ({self._broken})")
        head, bufs = pack_head(msg)
        try:
            self.lp.run(self._send(head, bufs), None)
        except asyncio.TimeoutError:
            self._broken = f"a send stalled for {self.cfg.stall_timeout}s"
            raise TransportError(f"{self.peer} took no part of a message for {self.cfg.stall_timeout}s "
                                 "(stopped receiving?)") from None
        except Exception as e:
            self._broken = f"{type(e).__name__}: {e}"
            raise _errors(e, self.peer) from None

    async def _send(self, head: bytes, bufs: list) -> None:
        """Each part bounded by stall_timeout: a large part waits for the peer to post its receive (rendezvous),
        and a peer that stopped receiving would hold the sender (and Publisher.close's bye) for ever."""
        parts = [np.array([len(head)], dtype=np.uint64), np.frombuffer(head, dtype=np.uint8)]
        parts += [b if _is_cuda(b) else np.frombuffer(b, dtype=np.uint8) for b in bufs]
        for part in parts:
            if _is_cuda(part):  # the part's own device (the link's where the part does not say)
                device = gf.choose_device(self.device, None, [part])
                await asyncio.wait_for(_on_device(device, lambda: self.ep.send(part)), self.cfg.stall_timeout)
            else:
                await asyncio.wait_for(self.ep.send(part), self.cfg.stall_timeout)

    def recv(self, timeout: float | None = None) -> Message:
        if self._pending is None:
            self._pending = self.lp.submit(self._recv())
        try:
            msg = self._pending.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TransportTimeout(f"no message from {self.peer} within {timeout}s") from None
        except Exception as e:
            self._pending = None
            raise _errors(e, self.peer) from None
        self._pending = None
        return msg

    async def _recv(self) -> Message:
        n = np.zeros(1, dtype=np.uint64)
        await self.ep.recv(n)
        raw = np.empty(envelope.check_length(int(n[0])), dtype=np.uint8)
        await asyncio.wait_for(self.ep.recv(raw), self.cfg.stall_timeout)
        h = parse_head(raw.tobytes())
        blobs, device = [], set(h.device)
        for i, (size, s) in enumerate(zip(h.sizes, h.sums)):
            blobs.append(await self._recv_blob(i, size, None if i in device else s[0]))
        return Message(h.kind, h.meta, blobs)

    async def _recv_blob(self, i: int, size: int, expected: str | None):
        """expected: the xxh3-64 of a host blob's bytes; None for a device blob."""
        if expected is None:
            buf = self._device_buffer(size)
            if size:
                await asyncio.wait_for(_on_device(self.device, lambda: self.ep.recv(buf)), self.cfg.stall_timeout)
            return buf
        buf = self._pool.take(size)
        if size:
            await asyncio.wait_for(self.ep.recv(np.frombuffer(buf, dtype=np.uint8)), self.cfg.stall_timeout)
        if xxhash.xxh3_64_hexdigest(buf) != expected:
            raise ChecksumError(f"message blob {i} failed its checksum (corrupt in transit)")
        return buf

    def _device_buffer(self, size: int):
        if self.device is None:
            raise TransportError(f"{self.peer} sent a CUDA blob, but this process had no CUDA device when the link "
                                 "was made (pass device=... to receive on one)")
        import torch

        _use_device(self.device)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        try:
            self.lp.run(self.ep.close(), 10)
        except Exception:
            pass  # closing a link whose peer is gone is not an error
        self._pool.clear()

