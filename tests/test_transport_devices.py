"""Which CUDA device the nccl/gloo and ucx transports work on, and CUDA tensor blobs on the group path.

Without a GPU these tests use **stand-ins**, named so wherever they appear:

- ``CudaStandIns`` replaces torch.cuda's device calls (is_available, is_initialized,
  current_device, set_device, device) with recording stand-ins that keep a current
  device per thread, 0 in a new thread as in CUDA. No GPU is touched; the tests
  check *which* device each of our threads makes current before it does CUDA work.
- ``NcclStandIn`` replaces dist.ProcessGroupNCCL with a gloo group underneath (so
  bytes really move), logging the thread's current device when it is built.
- ``CudaLabelled`` is a CPU tensor whose ``is_cuda`` says True: groupframe takes its
  device-blob branch (no memoryview, no gather, no host hash), and since the tensor
  really lives on the CPU, which is a gloo wire's device, gloo moves it in place as
  NCCL moves a tensor on the group's device. What this cannot show (NCCL itself,
  real device memory) is in the ``gpu`` tests at the end.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import threading
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from helpers import random_bytes  # noqa: E402

from wsync.errors import BackendUnavailable, ChecksumError, TransportError  # noqa: E402
from wsync.transports import Message, connect, listen  # noqa: E402
from wsync.transports import envelope  # noqa: E402
from wsync.transports import groupframe as gf  # noqa: E402
from wsync.transports import ucx  # noqa: E402
from wsync.transports.base import current_device  # noqa: E402

CUDA = torch.device("cuda", 0).type  # "cuda"


def dev(i: int):
    return torch.device("cuda", i)


# -- stand-ins --------------------------------------------------------------------------


class CudaStandIns:
    """Stand-ins for torch.cuda's device calls: a current device per thread (0 in a new thread), every
    set_device logged as (thread name, index). No GPU is touched."""

    def __init__(self, initialized: bool = True):
        self._local = threading.local()
        self.initialized = initialized
        self.sets: list[tuple[str, int]] = []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, d) -> None:
        index = d if isinstance(d, int) else torch.device(d).index
        self.sets.append((threading.current_thread().name, index))
        self._local.index = index

    @contextlib.contextmanager
    def device(self, d):
        prev = self.current_device()
        self.set_device(d)
        try:
            yield
        finally:
            self._local.index = prev


@pytest.fixture
def cuda(monkeypatch):
    s = CudaStandIns()
    for name in ("is_available", "is_initialized", "current_device", "set_device", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(s, name))
    return s


def _in_thread(fn, *args, name="worker"):
    out = {}

    def run():
        try:
            out["r"] = fn(*args)
        except Exception as e:  # surfaced by the caller
            out["r"] = e

    t = threading.Thread(target=run, name=name)
    t.start()
    return t, out


class CudaLabelled(torch.Tensor):
    """Stand-in for a CUDA tensor: host memory, but is_cuda says True; reading it as host memory fails."""

    @property
    def is_cuda(self):
        return True

    def numpy(self, *a, **k):
        raise AssertionError("a device blob was read as host memory")

    def __array__(self, *a, **k):
        raise AssertionError("a device blob was read as host memory")


def labelled(t):
    return t.as_subclass(CudaLabelled)


# -- the device a link uses: a table ------------------------------------------------------


class _CupyLike:
    """A cupy-like array stand-in: __cuda_array_interface__ and a device named by ordinal."""

    def __init__(self, ordinal: int, n: int = 8):
        self.device = types.SimpleNamespace(id=ordinal)
        self.nbytes = n
        self.__cuda_array_interface__ = {}


class _OnDevice:
    """A tensor stand-in on a given CUDA device (is_cuda True, device cuda:i), with no memory at all."""

    def __init__(self, i: int):
        self.is_cuda, self.device = True, dev(i)


@pytest.mark.parametrize("option, current, tensors, expected", [
    (None, None, (), None),  # no CUDA here, none asked for: host only
    (None, 3, (), dev(3)),  # the device current where the link was made
    ("cuda:1", 3, (), dev(1)),  # the option wins over the captured device
    ("1", 3, (), dev(1)),  # as a query parameter brings it
    (2, None, (), dev(2)),
    (dev(4), 0, (), dev(4)),
    ("cuda", 3, (), dev(3)),  # no index: the captured one
    ("cuda", None, (), dev(0)),
    ("", 5, (), dev(5)),  # an empty option is no option
    (None, 3, (_OnDevice(6),), dev(6)),  # a thread works on the device of the tensors it handles
    ("cuda:1", 3, (_OnDevice(6), _OnDevice(6)), dev(6)),
    ("cuda:1", 3, (_CupyLike(2),), dev(2)),
    ("cuda:1", 3, (b"host", np.zeros(3)), dev(1)),  # host buffers say nothing about a device
    (None, 3, (labelled(torch.zeros(2)),), dev(3)),  # a tensor whose device is not CUDA says nothing either
])
def test_choose_device(option, current, tensors, expected):
    assert gf.choose_device(option, current, tensors) == expected


@pytest.mark.parametrize("option, current, tensors, match", [
    ("cpu", 0, (), "expected a CUDA device"),
    ("banana", 0, (), "expected a CUDA device"),
    (None, 0, (_OnDevice(1), _OnDevice(2)), "several devices"),
])
def test_choose_device_refuses(option, current, tensors, match):
    with pytest.raises(ValueError, match=match):
        gf.choose_device(option, current, tensors)


def test_current_device_leaves_cuda_uninitialized_when_asked(cuda):
    cuda.set_device(2)
    assert current_device() == 2 and current_device(init=False) == 2
    cuda.initialized = False  # nothing has picked a device yet: the default, without starting CUDA
    assert current_device(init=False) == 0


# -- nccl: the device is captured on the caller's thread and made current on every thread -----


@pytest.fixture
def nccl(monkeypatch, cuda):
    """nccl:// on stand-ins: NcclStandIn for the process group, WireStandIn for the wire (host memory, as gloo
    moves it); both log the current (stand-in) device of the thread that calls them."""
    log = []

    class NcclStandIn:
        """Stand-in for dist.ProcessGroupNCCL: a gloo group underneath, logging the thread's current device."""

        class Options:
            _timeout = None

        supports_splitting = True

        def __init__(self, store, rank, size, opts):
            log.append(("built", rank, cuda.current_device()))
            gopts = dist.ProcessGroupGloo._Options()
            gopts._timeout = opts._timeout
            gopts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = dist.ProcessGroupGloo(store, rank, size, gopts)
            self.rank = rank

        def eager_connect_single_device(self, device):
            log.append(("eager", self.rank, cuda.current_device(), device))

        def broadcast(self, *a):
            return self.pg.broadcast(*a)

        def send(self, *a):
            return self.pg.send(*a)

        def recv(self, *a):
            return self.pg.recv(*a)

        def abort(self):
            pass

    class WireStandIn(gf.HostWire):
        """Stand-in for CudaWire: moves host memory as gloo does, logging the thread's current device."""

        def __init__(self, device, chunk):
            self.bound = device
            log.append(("wire", device, cuda.current_device()))

        def outgoing(self, t, slot):
            log.append(("out", self.bound, cuda.current_device()))
            return super().outgoing(t, slot)

        def incoming(self, t, slot):
            log.append(("in", self.bound, cuda.current_device()))
            return super().incoming(t, slot)

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NcclStandIn, raising=False)
    monkeypatch.setattr(gf, "CudaWire", WireStandIn)
    return log


def test_nccl_group_is_bound_to_the_device_current_where_it_was_made(cuda, nccl):
    """The listener reads the device on the thread that calls listen (3), the subscriber on the thread that calls
    connect (5); accept, send and recv then run on fresh threads, whose current device is 0: each makes its
    link's device current before any CUDA work, and gives the thread back as it found it."""
    cuda.set_device(3)
    lst = listen("nccl://127.0.0.1:0?world_size=2&chunk=16K")
    assert lst.device == dev(3)

    def subscriber():
        cuda.set_device(5)
        return connect(lst.address)

    ts, rs = _in_thread(subscriber, name="subscriber")
    ta, ra = _in_thread(lst.accept, 60, name="accept")
    ts.join(), ta.join()
    pub, sub = ra["r"], rs["r"]
    assert not isinstance(pub, Exception) and not isinstance(sub, Exception), (pub, sub)
    assert (pub.device, sub.device) == (dev(3), dev(5))
    # the group was built and connected with its device current, on the accept thread too
    assert sorted(e for e in nccl if e[0] in ("built", "eager")) == [
        ("built", 0, 3), ("built", 1, 5), ("eager", 0, 3, dev(3)), ("eager", 1, 5, dev(5))]
    assert ("accept", 3) in cuda.sets and ("subscriber", 5) in cuda.sets
    assert sorted((e for e in nccl if e[0] == "wire"), key=str) == [("wire", dev(3), 3), ("wire", dev(5), 5)]

    del nccl[:]
    blob = random_bytes(1, 100_000)

    def on_fresh_thread(fn, *args):
        r = fn(*args)
        return r, cuda.current_device()  # given back as found

    tr, rr = _in_thread(on_fresh_thread, sub.recv, 30, name="sub-recv")
    tp, rp = _in_thread(on_fresh_thread, pub.send, Message("bucket", {"v": 1}, [b"abc", blob]), name="pub-send")
    tr.join(), tp.join()
    (got, after_recv), (_, after_send) = rr["r"], rp["r"]
    assert [bytes(b) for b in got.blobs] == [b"abc", blob.tobytes()] and after_recv == after_send == 0
    tr, rr = _in_thread(on_fresh_thread, sub.send, Message("ack", {}, [blob[:5000]]), name="sub-send")
    tp, rp = _in_thread(on_fresh_thread, pub.recv, 30, name="pub-recv")
    tr.join(), tp.join()
    assert bytes(rp["r"][0].blobs[0]) == blob[:5000].tobytes()
    moves = [e for e in nccl if e[0] in ("out", "in")]
    assert len(moves) >= 8  # several pieces each way
    assert all(current == bound.index for _, bound, current in moves), moves
    for link in (pub, sub):
        link.close()
    lst.close()


def test_device_option_wins_over_the_current_device(cuda, nccl):
    cuda.set_device(3)
    lst = listen("nccl://127.0.0.1:0?world_size=2", device="cuda:1")
    assert lst.device == dev(1)
    lst.close()


def test_gloo_links_leave_the_device_alone(cuda):
    lst = listen("gloo://127.0.0.1:0?world_size=2")
    ts, rs = _in_thread(connect, lst.address)
    pub = lst.accept(timeout=60)
    ts.join()
    sub = rs["r"]
    assert pub.device is None and sub.device is None
    tr, rr = _in_thread(sub.recv, 30)
    pub.send(Message("bucket", {}, [b"xyz"]))
    tr.join()
    assert bytes(rr["r"].blobs[0]) == b"xyz" and cuda.sets == []
    pub.close(), sub.close(), lst.close()


def test_nccl_without_cuda_is_refused_at_listen_and_connect():
    if hasattr(dist, "ProcessGroupNCCL") and torch.cuda.is_available():
        pytest.skip("this machine can run nccl")
    with pytest.raises(BackendUnavailable, match="nccl"):
        listen("nccl://127.0.0.1:0?world_size=2")
    with pytest.raises(BackendUnavailable, match="nccl"):
        connect("nccl://127.0.0.1:1?world_size=2", join_timeout=0.5)


# -- groupframe: device blobs -----------------------------------------------------------


@pytest.mark.parametrize("sizes, device, chunk, expected", [
    ([1, 1], [], 4, [[(0, 0, 1), (1, 0, 1)]]),
    ([1, 1], [1], 4, [[(0, 0, 1)], [(1, 0, 1)]]),  # a device blob shares no piece
    ([1, 1, 1], [1], 4, [[(0, 0, 1)], [(1, 0, 1)], [(2, 0, 1)]]),
    ([1, 1, 1], [0], 4, [[(0, 0, 1)], [(1, 0, 1), (2, 0, 1)]]),
    ([9, 2], [0], 4, [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 1)], [(1, 0, 2)]]),
    ([0, 3], [0, 1], 4, [[(1, 0, 3)]]),
])
def test_plan_pieces_with_device_blobs(sizes, device, chunk, expected):
    assert gf.plan_pieces(sizes, chunk, device) == expected
    assert gf.host_pieces(expected, device) == sum(1 for p in expected if p[0][0] not in device)


def test_head_lists_device_blobs_and_host_headers_are_unchanged():
    host, _ = gf.pack_head(Message("k", {"a": 1}, [b"xy"]), 16)
    h = gf.parse_head(host)
    assert b'"device"' not in host and (h.kind, h.meta, h.sizes, h.chunk, h.device) == ("k", {"a": 1}, [2], 16, [])
    t = labelled(torch.arange(6, dtype=torch.float32))
    head, sizes = gf.pack_head(Message("k", {}, [b"xy", t]), 16)
    assert sizes == [2, 24] and gf.parse_head(head).device == [1]


@pytest.mark.parametrize("device", [[2], [-1], [1, 0], [0, 0], ["0"], "0", [True]])
def test_parse_head_refuses_bad_device_lists(device):
    import json

    doc = json.dumps({"kind": "k", "meta": {}, "sizes": [1, 2], "chunk": 16, "device": device}).encode()
    raw = envelope.seal(doc)
    with pytest.raises(TransportError, match="device blobs"):
        gf.parse_head(raw)


class _Done:
    def wait(self, *a):
        return True


def test_send_and_recv_pieces_move_device_blobs_in_place():
    """Device pieces are posted as slices of the blob itself on both sides (a handed destination is received
    into directly); only host pieces are hashed."""
    src = labelled(torch.from_numpy(random_bytes(2, 10_000)).clone())
    host = memoryview(random_bytes(3, 700).tobytes())
    views, device = [host, gf.flat(src), memoryview(b"tail")], [1]
    pieces = gf.plan_pieces([len(host), 10_000, 4], 4096, device)
    wire, wire_posts, sent = gf.HostWire(), [], []

    def post_send(t):
        wire_posts.append(t)
        sent.append(t.as_subclass(torch.Tensor).clone())
        return _Done()

    digests = gf.send_pieces(views, pieces, post_send, wire, lambda w: w.wait(), device)
    assert len(digests) == gf.host_pieces(pieces, device) == 2
    lo, hi = src.data_ptr(), src.data_ptr() + 10_000
    dev_posts = [t for t in wire_posts if isinstance(t, CudaLabelled)]
    assert len(dev_posts) == 3 and all(lo <= t.data_ptr() < hi for t in dev_posts)

    dest = labelled(torch.zeros(10_000, dtype=torch.uint8))
    blobs, targets = [bytearray(len(host)), dest, bytearray(4)], []

    def post_recv(t):
        targets.append(t)
        t.copy_(sent.pop(0))
        return _Done()

    got = gf.recv_pieces(blobs, pieces, post_recv, wire, lambda w: w.wait(), device)
    assert got == digests
    lo, hi = dest.data_ptr(), dest.data_ptr() + 10_000
    assert sum(1 for t in targets if lo <= t.data_ptr() < hi) == 3
    assert torch.equal(dest.as_subclass(torch.Tensor), src.as_subclass(torch.Tensor))
    assert bytes(blobs[0]) == bytes(host) and bytes(blobs[2]) == b"tail"


def test_cuda_wire_passes_pieces_on_its_device_as_they_are():
    """A piece already on the wire's device is posted and received as it is: no staging buffer is allocated, and
    nothing is copied when it lands (the stand-in has no memory to copy)."""
    wire = gf.CudaWire("cuda:3", 1 << 20)
    piece = _OnDevice(3)
    assert wire.outgoing(piece, 0) is piece and wire.incoming(piece, 1) is piece
    wire.landed(piece, 1)
    assert wire._bufs is None


def _gloo_pair(**opts):
    lst = listen("gloo://127.0.0.1:0?world_size=2", **opts)
    t, r = _in_thread(connect, lst.address)
    pub = lst.accept(timeout=60)
    t.join()
    return lst, pub, r["r"]


class _Recorder:
    """Forwards to a process group, recording the tensors its broadcasts and sends are given."""

    def __init__(self, pg):
        self.pg, self.posted = pg, []

    def broadcast(self, tensors, opts):
        self.posted.append(tensors[0])
        return self.pg.broadcast(tensors, opts)

    def send(self, tensors, dst, tag):
        self.posted.append(tensors[0])
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self.posted.append(tensors[0])
        return self.pg.recv(tensors, src, tag)

    def abort(self):
        pass


def test_device_blobs_cross_a_gloo_group_in_place():
    """CudaLabelled blobs (stand-ins for CUDA tensors, see the module docstring) go through the device branch:
    posted as slices of themselves, never hashed on the host, and received into a tensor the link allocates on its
    wire's device (for gloo, host memory), beside host blobs that travel exactly as before."""
    lst, pub, sub = _gloo_pair(chunk="4K")
    pub.data, sub.data = _Recorder(pub.data), _Recorder(sub.data)
    weights = labelled(torch.from_numpy(random_bytes(4, 12_000).view(np.float32).copy()))  # 3000 floats: 3 pieces
    strided = labelled(torch.arange(40, dtype=torch.int16).reshape(4, 10)[:, ::2])  # copied to be contiguous
    host = random_bytes(5, 5_000)
    t, r = _in_thread(sub.recv, 30)
    pub.send(Message("bucket", {"v": 2}, [b"head", weights, host, strided, b""]))
    t.join()
    m = r["r"]
    assert not isinstance(m, Exception), m
    lo, hi = weights.data_ptr(), weights.data_ptr() + 12_000
    assert sum(1 for p in pub.data.posted if isinstance(p, CudaLabelled) and lo <= p.data_ptr() < hi) == 3
    assert bytes(m.blobs[0]) == b"head" and bytes(m.blobs[2]) == host.tobytes() and bytes(m.blobs[4]) == b""
    for got, want in ((m.blobs[1], weights), (m.blobs[3], strided)):
        assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got.device.type == "cpu"
        assert torch.equal(got, want.as_subclass(torch.Tensor).contiguous().reshape(-1).view(torch.uint8))
    out = m.blobs[1]
    assert sum(1 for p in sub.data.posted if out.data_ptr() <= p.data_ptr() < out.data_ptr() + 12_000) == 3
    # device blobs only: no trailer at all; and the reply way (point to point) carries them too
    t, r = _in_thread(sub.send, Message("ack", {}, [labelled(torch.ones(5, dtype=torch.float64))]))
    reply = pub.recv(timeout=30)
    t.join()
    assert torch.equal(reply.blobs[0], torch.ones(5, dtype=torch.float64).view(torch.uint8))
    pub.close(), sub.close(), lst.close()


class _FlipHost(gf.HostWire):
    """Corrupts the first host piece on its way out (after the sender hashed it); device pieces pass."""

    def outgoing(self, t, slot):
        if isinstance(t, CudaLabelled):
            return t
        bad = t.clone()
        bad[0] ^= 0xFF
        return bad


def test_host_pieces_beside_device_blobs_are_still_checked():
    lst, pub, sub = _gloo_pair(chunk="4K")
    pub.wire = _FlipHost()
    t, r = _in_thread(sub.recv, 30)
    pub.send(Message("bucket", {}, [labelled(torch.zeros(9000, dtype=torch.uint8)), random_bytes(6, 100)]))
    t.join()
    assert isinstance(r["r"], ChecksumError) and "piece 0 of 1" in str(r["r"])  # one host piece in the trailer
    pub.close(), sub.close(), lst.close()


# -- ucx: the loop thread works on the link's device -----------------------------------------


class _UcxxStandIn:
    """Stand-in for the ucxx module: init() logs the loop thread's current device."""

    def __init__(self, cuda):
        self.cuda, self.seen = cuda, []

    def init(self):
        self.seen.append((threading.current_thread().name, self.cuda.current_device()))


@pytest.mark.parametrize("initialized, expected", [(True, 3), (False, 0)])
def test_ucx_loop_thread_sets_the_device_before_ucx_starts(cuda, initialized, expected):
    """The loop thread makes the captured device current before UCX starts on it; in a process where CUDA has
    not started, it starts nothing."""
    cuda.initialized = initialized
    fake = _UcxxStandIn(cuda)
    lp = ucx._Loop(fake, dev(3))
    lp.loop.call_soon_threadsafe(lp.loop.stop)
    assert fake.seen == [("wsync-ucx", expected)]
    assert cuda.sets == ([("wsync-ucx", 3)] if initialized else [])


class _EndpointStandIn:
    """Stand-in for a UCXX endpoint: recv fills buffers from queued parts, send records; both log the posting
    thread's current device."""

    def __init__(self, cuda, parts=()):
        self.cuda, self.parts, self.log = cuda, list(parts), []

    async def recv(self, buf):
        self.log.append(("recv", type(buf).__name__, self.cuda.current_device()))
        part = self.parts.pop(0)
        if isinstance(buf, torch.Tensor):
            buf.copy_(torch.from_numpy(np.frombuffer(bytes(part), dtype=np.uint8).copy()))
        else:
            buf[:] = np.frombuffer(bytes(part), dtype=buf.dtype)
        await asyncio.sleep(0)

    async def send(self, part):
        self.log.append(("send", type(part).__name__, self.cuda.current_device()))
        await asyncio.sleep(0)


def _on_loop_thread(coro_fn):
    """Run a coroutine on a fresh thread's event loop (its current device is 0, as the ucx loop thread's is)."""
    t, r = _in_thread(lambda: asyncio.run(coro_fn()), name="wsync-ucx")
    t.join()
    if isinstance(r["r"], Exception):
        raise r["r"]
    return r["r"]


def test_ucx_receives_cuda_blobs_on_the_captured_device(cuda, monkeypatch):
    """The receive buffer of a CUDA blob is allocated, and its receive posted, with the link's device current
    on the loop thread (a stand-in torch.empty records where it was asked to allocate)."""
    real_empty, made = torch.empty, []

    def empty_stand_in(*size, device=None, **kw):
        if device is not None and torch.device(device).type == CUDA:
            made.append((torch.device(device), cuda.current_device()))
            device = None
        return real_empty(*size, device=device, **kw)

    monkeypatch.setattr(torch, "empty", empty_stand_in)
    payload = torch.arange(16, dtype=torch.uint8)
    head, bufs = ucx.pack_head(Message("bucket", {}, [labelled(payload), b"host"]))
    parts = [np.array([len(head)], dtype=np.uint64).tobytes(), head, payload.numpy().tobytes(), b"host"]
    ep = _EndpointStandIn(cuda, parts)
    link = ucx.UcxLink(None, ep, ucx.UcxConfig(), "peer", dev(3))
    m = _on_loop_thread(link._recv)
    assert made == [(dev(3), 3)]
    assert torch.equal(m.blobs[0], payload) and bytes(m.blobs[1]) == b"host"
    assert [e for e in ep.log if e[1] == "Tensor"] == [("recv", "Tensor", 3)]


def test_ucx_without_a_device_refuses_cuda_blobs(cuda):
    head, _ = ucx.pack_head(Message("bucket", {}, [labelled(torch.zeros(4, dtype=torch.uint8))]))
    parts = [np.array([len(head)], dtype=np.uint64).tobytes(), head]
    link = ucx.UcxLink(None, _EndpointStandIn(cuda, parts), ucx.UcxConfig(), "peer", None)
    with pytest.raises(TransportError, match="no CUDA device"):
        _on_loop_thread(link._recv)


def test_ucx_sends_each_cuda_part_on_its_own_device(cuda):
    """A CUDA part is posted with its own device current (a cupy-like stand-in on device 4), one that does not
    name its device with the link's (3); host parts leave the device alone."""
    ep = _EndpointStandIn(cuda)
    link = ucx.UcxLink(None, ep, ucx.UcxConfig(), "peer", dev(3))
    head, bufs = ucx.pack_head(Message("bucket", {}, [_CupyLike(4), labelled(torch.zeros(4)), b"host"]))
    _on_loop_thread(lambda: link._send(head, bufs))
    assert [(kind, cur) for kind, _, cur in ep.log] == [("send", 0), ("send", 0), ("send", 4), ("send", 3), ("send", 3)]
    assert cuda.sets == [("wsync-ucx", 4), ("wsync-ucx", 3)]


def test_ucx_connect_captures_the_device_on_the_calling_thread(cuda, monkeypatch):
    """connect reads the device on the thread that calls it, and hands it to the loop and the link; the option
    wins. (The loop is a stand-in: LoopStandIn returns an endpoint without UCX.)"""
    loops = []

    class LoopStandIn:
        ucxx = types.SimpleNamespace(create_endpoint=lambda host, port, connect_timeout: None)

        def run(self, coro, timeout=None):
            return "endpoint"

    def loop_stand_in(cfg, device=None):
        loops.append(device)
        return LoopStandIn()

    monkeypatch.setattr(ucx, "_loop", loop_stand_in)

    def caller(**opts):
        cuda.set_device(2)
        return connect("ucx://127.0.0.1:1", **opts).device

    for opts, want in (({}, dev(2)), ({"device": "cuda:7"}, dev(7))):
        t, r = _in_thread(lambda: caller(**opts))
        t.join()
        assert r["r"] == want and loops[-1] == want


# -- on GPUs -------------------------------------------------------------------------------


def _nccl_device_subscriber(address: str, q) -> None:
    try:
        torch.cuda.set_device(0)  # no device= option: the link takes the current device
        link = connect(address)
        m = link.recv(timeout=120)
        t = m.blobs[0]
        ok = t.is_cuda and t.device == torch.device("cuda", 0) and bytes(m.blobs[1]) == b"host"
        link.send(Message("ack", {"ok": bool(ok)}, [t.view(torch.int32) * 2]))
        link.close()
        q.put(("ok", bool(ok)))
    except BaseException as e:
        q.put(("error", repr(e)))
        raise


@pytest.mark.gpu
def test_nccl_moves_cuda_tensors_between_the_captured_devices():
    """A CUDA tensor on the publisher's GPU 1 (captured from the thread that called listen; accept runs on a
    thread whose current device is 0) arrives as a CUDA tensor on the subscriber's GPU 0, and back."""
    if not hasattr(torch.distributed, "ProcessGroupNCCL") or torch.cuda.device_count() < 2:
        pytest.skip("needs a CUDA build of torch and two GPUs (NCCL wants one GPU per rank)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with torch.cuda.device(1):
        lst = listen("nccl://127.0.0.1:0?world_size=2&chunk=1M")
    p = ctx.Process(target=_nccl_device_subscriber, args=(lst.address, q))
    p.start()
    try:
        t, r = _in_thread(lst.accept, 120, name="accept")
        t.join()
        pub = r["r"]
        assert pub.device == torch.device("cuda", 1)
        x = torch.arange((3 << 20) + 5, dtype=torch.int32, device="cuda:1")
        pub.send(Message("bucket", {}, [x, b"host"]))
        reply = pub.recv(timeout=120)
        assert reply.meta["ok"] and reply.blobs[0].device == torch.device("cuda", 1)
        assert torch.equal(reply.blobs[0].view(torch.int32), x * 2)
        assert q.get(timeout=60) == ("ok", True)
        pub.close()
    finally:
        p.join(timeout=60)
        p.kill() if p.is_alive() else None


def test_a_link_dialled_later_by_our_thread_takes_the_device_current_when_it_was_asked_for(monkeypatch):
    """Subscriber and shard members dial on threads of their own, which start on device 0: the device is read
    where they are made, on the caller's thread."""
    from wsync.transports import base

    monkeypatch.setattr(base, "current_device", lambda init=True: 3)
    assert base.with_device("nccl://127.0.0.1:1?world_size=2", None) == {"device": 3}
    assert base.with_device("ucx://127.0.0.1:1", {"device": 1}) == {"device": 1}  # asked for: kept
    assert base.with_device("tcp://127.0.0.1:1", {"token": "t"}) == {"token": "t"}  # host links: untouched
