"""The two ends of each transport for `wsync bench transport`: a raw baseline and our Link.

Each ``Side`` is built in a worker process for one role (``send`` or ``recv``)
and offers ``raw(buf)`` and ``ours(buf)``: the sender passes the payload, the
receiver passes None and gets back a buffer holding what arrived. The raw
baselines are what a user would write without wsync, on the same link, in the
same processes: one ``sendall``/``recv_into`` per socket (tcp, Unix socket for
local), one ``dist.broadcast`` on a default process group (gloo/nccl), one
``ucxx`` send/recv (ucx). Receivers reuse one preallocated buffer for the
baseline, as a careful user would.
"""
from __future__ import annotations

import socket
import threading

from wsync.transports import Message, connect, listen


def make(transport: str, role: str, spec: dict):
    return {"tcp": TcpSide, "local": LocalSide, "gloo": DistSide, "nccl": DistSide, "ucx": UcxSide}[transport](role, spec)


class Side:
    """Our Link half: the sender listens (publisher), the receiver connects (subscriber)."""

    def __init__(self, role: str, spec: dict, address: str, **opts):
        self.role, self.spec = role, spec
        if role == "send":
            self.listener = listen(address, **opts)
            self.link = self.listener.accept(timeout=120)
        else:
            self.link = dial(lambda: connect(address, **opts))

    def ours(self, buf):
        if self.role == "send":
            self.link.send(Message("bench", {}, [buf]))
            return None
        return self.link.recv(timeout=300).blobs[0]

    def close(self) -> None:
        self.link.close()
        if self.role == "send":
            self.listener.close()


def dial(fn, seconds: float = 120.0):
    """fn() until it connects: the other worker may not be listening yet."""
    import time

    from wsync.errors import TransportError

    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _stream_pair(role: str, family, where, n: int) -> list[socket.socket]:
    """n connected stream sockets; the receiver side listens on where."""
    if role == "recv":
        srv = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(where)
        srv.listen(n)
        socks = [srv.accept()[0] for _ in range(n)]
        srv.close()
        return socks
    import time

    socks = []
    for _ in range(n):
        for _attempt in range(600):  # the receiver may not be listening yet
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.connect(where)
                break
            except OSError:
                s.close()
                time.sleep(0.05)
        else:
            raise ConnectionError(f"baseline peer at {where} never listened")
        socks.append(s)
    return socks


def _slices(size: int, n: int) -> list[tuple[int, int]]:
    step = -(-size // n) if size else 0
    return [(a, min(size, a + step)) for a in range(0, size, step)] if size else []


class SocketBaseline:
    """Plain sockets: sendall on one side, recv_into a reused buffer on the other; n streams in threads."""

    def __init__(self, role: str, socks: list[socket.socket], size: int):
        self.role, self.socks, self.size = role, socks, size
        self.buf = bytearray(size) if role == "recv" else None

    def raw(self, buf):
        view = memoryview(self.buf if self.role == "recv" else buf).cast("B")
        parts = _slices(self.size, len(self.socks))

        def move(sock, a, b):
            if self.role == "send":
                sock.sendall(view[a:b])
                return
            while a < b:
                n = sock.recv_into(view[a:b])
                if n == 0:
                    raise ConnectionError("baseline peer closed mid-transfer")
                a += n

        threads = [threading.Thread(target=move, args=(s, a, b)) for s, (a, b) in zip(self.socks, parts)]
        if len(threads) == 1:
            move(self.socks[0], *parts[0])
        else:
            [t.start() for t in threads]
            [t.join() for t in threads]
        return self.buf

    def close(self) -> None:
        for s in self.socks:
            s.close()


class TcpSide(Side):
    def __init__(self, role: str, spec: dict):
        n = spec["streams"]
        self.base = SocketBaseline(role, _stream_pair(role, socket.AF_INET, ("127.0.0.1", spec["raw_port"]), n), spec["size"])
        # the baseline receives into one reused buffer; let the link reuse its receive buffer too
        super().__init__(role, spec, f"tcp://127.0.0.1:{spec['port']}", streams=n, token=spec["token"],
                         pool_bytes=max(spec["size"], 256 << 20))
        self.raw = self.base.raw

    def close(self) -> None:
        self.base.close()
        super().close()


class LocalSide(Side):
    def __init__(self, role: str, spec: dict):
        self.base = SocketBaseline(role, _stream_pair(role, socket.AF_UNIX, spec["raw_path"], 1), spec["size"])
        super().__init__(role, spec, f"local://{spec['name']}")
        self.raw = self.base.raw

    def close(self) -> None:
        self.base.close()
        super().close()


class DistSide(Side):
    """Baseline: dist.broadcast on the default group; ours runs on its own group beside it."""

    def __init__(self, role: str, spec: dict):
        import torch
        import torch.distributed as dist

        backend, rank = spec["transport"], 0 if role == "send" else 1
        import datetime

        if backend == "nccl":  # one GPU per worker: NCCL refuses two ranks on one device
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['raw_port']}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))  # a lost peer fails the run, not hangs it
        self.device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        self.tensor = torch.empty(spec["size"], dtype=torch.uint8, device=self.device)
        self.host = torch.empty(spec["size"], dtype=torch.uint8) if role == "recv" else None
        addr = f"{backend}://127.0.0.1:{spec['port']}?world_size=2&chunk={spec['chunk']}&join_timeout=120"
        super().__init__(role, spec, addr)

    def raw(self, buf):
        import numpy as np
        import torch
        import torch.distributed as dist

        if self.role == "send":  # nccl: host -> device is part of moving host bytes
            self.tensor.copy_(torch.from_numpy(np.frombuffer(buf, dtype=np.uint8)))
        dist.broadcast(self.tensor, src=0)
        if self.role == "send":
            return None
        if self.device.type == "cuda":
            self.host.copy_(self.tensor)
            return self.host.numpy()
        return self.tensor.numpy()

    def close(self) -> None:
        import torch.distributed as dist

        super().close()
        dist.destroy_process_group()


class UcxSide(Side):
    """Baseline: one plain UCXX endpoint, one tagged send/recv of the whole buffer."""

    def __init__(self, role: str, spec: dict):
        self.base = UcxRaw(role, "127.0.0.1", spec["raw_port"], spec["size"])
        super().__init__(role, spec, f"ucx://127.0.0.1:{spec['port']}", connect_timeout=5.0)
        self.raw = self.base.raw

    def close(self) -> None:
        self.base.close()
        super().close()


class UcxRaw:
    """A bare UCXX endpoint pair (reusing only the ucx module's event loop and connection setup)."""

    def __init__(self, role: str, host: str, port: int, size: int):
        import numpy as np

        from wsync.transports import ucx
        from wsync.transports.base import Address

        cfg, addr = ucx.UcxConfig(connect_timeout=5.0), Address("ucx", host, port, "", {})
        self.role, self.lp = role, ucx._loop(cfg)
        self.buf = np.zeros(size, dtype=np.uint8) if role == "recv" else None
        if role == "recv":
            self._lst = ucx.UcxListener(addr, cfg)
            self.ep = self._lst.accept(timeout=120).ep
        else:
            self._lst = None
            self.ep = dial(lambda: ucx.connect(addr, connect_timeout=5.0)).ep

    def raw(self, buf):
        import numpy as np

        if self.role == "send":
            self.lp.run(self.ep.send(np.frombuffer(buf, dtype=np.uint8)))
            return None
        self.lp.run(self.ep.recv(self.buf))
        return self.buf

    def close(self) -> None:
        try:
            self.lp.run(self.ep.close(), 10)
        except Exception:
            pass  # the peer may have closed first
        if self._lst:
            self._lst.close()
