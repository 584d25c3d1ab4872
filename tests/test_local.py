"""local:// for real: round trips through memfd segments, reuse, and no leaked shared memory after close or a crash.

CUDA IPC: the description, device mapping, error paths and the reader-done protocol run on CPU with stand-ins for
torch's CUDA calls (named as such where used); the gpu-marked tests run the real thing with a fresh reader process."""
from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import queue
import secrets
import signal
import threading
import time

import numpy as np
import pytest

from helpers import random_bytes

from wsync.errors import ChecksumError, TransportError
from wsync.transports import Message, TransportTimeout, connect, listen, local_cuda


def _name() -> str:
    return f"t{secrets.token_hex(4)}"


def _memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:wsync" in target:
            out.append(target)
    return out


def _shm() -> set:
    """Names in /dev/shm, less POSIX semaphores ("sem.*"): multiprocessing's, of this test or of any other
    process on the host, come and go; wsync never makes one."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith("sem.")}


def _pair(**opts):
    name = _name()
    lst = listen(f"local://{name}", **opts)
    got = {}
    t = threading.Thread(target=lambda: got.update(s=connect(f"local://{name}", **opts)))
    t.start()
    pub = lst.accept(timeout=10)
    t.join()
    return lst, pub, got["s"]


@pytest.fixture
def clean():
    """Every test must leave no memfd open in this process and nothing new in /dev/shm."""
    before = _shm()
    yield
    import gc

    gc.collect()
    assert _memfds() == []
    assert _shm() - before == set()  # what other processes removed meanwhile is none of ours


def test_round_trips_both_ways(clean):
    lst, pub, sub = _pair(piece="64K")
    with pytest.raises(TransportTimeout):
        sub.recv(timeout=0.05)
    blobs = [b"abc", b"", random_bytes(1, 1_000_003), bytearray(b"x" * 100), memoryview(random_bytes(2, 70_000)).cast("B")]
    pub.send(Message("bucket", {"version": 3, "names": ["a", "b"]}, blobs))
    m = sub.recv(timeout=10)
    assert m.kind == "bucket" and m.meta == {"version": 3, "names": ["a", "b"]}
    assert [bytes(b) for b in m.blobs] == [bytes(memoryview(b).cast("B")) for b in blobs]
    m.blobs[2][0] ^= 0xFF  # views are private copies-on-write: ours to scribble on
    sub.send(Message("ack", {"ok": True}, [b"fine"]))
    r = pub.recv(timeout=10)
    assert (r.kind, r.meta, bytes(r.blobs[0])) == ("ack", {"ok": True}, b"fine")
    pub.send(Message("empty"))
    assert sub.recv(timeout=10).blobs == []
    del m, r
    for x in (pub, sub, lst):
        x.close()
    assert not os.path.exists(lst.path)


def test_segments_are_reused_only_once_released(clean):
    lst, pub, sub = _pair(pool_bytes="4M")
    data = random_bytes(3, 3 << 20)
    pub.send(Message("a", {}, [data]))
    held = sub.recv(timeout=10)  # the caller keeps this one
    sub.send(Message("ack"))
    pub.recv(timeout=10)
    pub.send(Message("b", {}, [data]))
    m = sub.recv(timeout=10)
    assert len(pub._out._segs) == 2  # the held segment could not be reused
    del m
    sub.send(Message("ack"))  # reaps the released mapping and tells the writer
    pub.recv(timeout=10)
    pub.send(Message("c", {}, [data]))
    m = sub.recv(timeout=10)
    assert len(pub._out._segs) == 2 and bytes(m.blobs[0]) == data.tobytes()
    del held, m
    sub.send(Message("ack"))
    pub.recv(timeout=10)
    pub.send(Message("tiny", {}, [b"1"]))  # both big segments free: over the 4M pool limit -> one evicted
    sub.recv(timeout=10)
    assert len(pub._out._segs) == 1
    for x in (pub, sub, lst):
        x.close()


def test_corrupted_shared_memory_is_detected(clean):
    lst, pub, sub = _pair(piece="64K")
    pub.send(Message("a", {}, [random_bytes(4, 500_000)]))
    (seg,) = pub._out._segs.values()
    seg.mm[300_000] ^= 0x01  # changed after hashing, before the reader looked
    with pytest.raises(ChecksumError, match="piece 4"):
        sub.recv(timeout=10)
    pub.send(Message("b", {}, [b"still usable"]))
    assert bytes(sub.recv(timeout=10).blobs[0]) == b"still usable"
    for x in (pub, sub, lst):
        x.close()


def test_names_listeners_and_peers():
    with pytest.raises(ValueError, match="names"):
        listen("local://a/b")
    with pytest.raises(TransportError, match="no local publisher"):
        connect(f"local://{_name()}")
    name = _name()
    lst = listen(f"local://{name}")
    with pytest.raises(TransportError, match="already listens"):
        listen(f"local://{name}")
    assert lst.accept(timeout=0.05) is None
    lst.sock.close()  # a crashed publisher leaves its socket file behind ...
    again = listen(f"local://{name}")  # ... and the next one takes it over
    again.close()


# -- crashes ----------------------------------------------------------------------------


def _writer_dies_midway(name: str, ready) -> None:
    """Publisher that is killed after filling its segment, before telling the reader about it."""
    import time

    from wsync.transports import local_segments

    real = local_segments.copy_in

    def copy_then_stall(*args):
        out = real(*args)
        ready.set()
        time.sleep(600)
        return out

    local_segments.copy_in = copy_then_stall
    import wsync.transports.local as local

    local.copy_in = copy_then_stall
    lst = listen(f"local://{name}")
    link = lst.accept(timeout=60)
    link.send(Message("big", {}, [np.zeros(64 << 20, dtype=np.uint8)]))


def test_writer_killed_mid_transfer(clean):
    ctx = mp.get_context("spawn")
    name, ready = _name(), ctx.Event()
    p = ctx.Process(target=_writer_dies_midway, args=(name, ready))
    p.start()
    try:
        for _ in range(600):
            try:
                sub = connect(f"local://{name}")
                break
            except TransportError:
                ready.wait(0.05)
        assert ready.wait(60)
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(TransportError, match="closed"):
            sub.recv(timeout=30)
        with pytest.raises(TransportError):  # and it stays failed
            sub.recv(timeout=1)
        sub.close()
    finally:
        p.join(timeout=30)


def _reader_dies_holding(name: str, done) -> None:
    sub = connect(f"local://{name}")
    m = sub.recv(timeout=60)
    assert len(m.blobs[0]) == 8 << 20
    done.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_reader_killed_while_holding_a_message(clean):
    ctx = mp.get_context("spawn")
    name, done = _name(), ctx.Event()
    lst = listen(f"local://{name}")
    p = ctx.Process(target=_reader_dies_holding, args=(name, done))
    p.start()
    pub = lst.accept(timeout=60)
    pub.send(Message("big", {}, [random_bytes(5, 8 << 20)]))
    assert done.wait(60)
    p.join(timeout=30)
    with pytest.raises(TransportError):
        for _ in range(50):  # the first write may still land in the socket buffer
            pub.send(Message("more", {}, [b"x" * 1000]))
    with pytest.raises(TransportError):
        pub.recv(timeout=5)
    pub.close()
    lst.close()


# -- CUDA IPC without a GPU: the description, the device mapping and the release protocol ---------------------


@pytest.mark.parametrize("uuid, visible, want", [
    ("aa", ["aa", "bb"], 0),  # both processes see the same GPUs in the same order
    ("bb", ["aa", "bb"], 1),
    ("dd", ["dd"], 0),  # the writer's cuda:3 is the reader's only GPU (CUDA_VISIBLE_DEVICES=3 there)
    ("cc", ["cc", "aa"], 0),  # the reader lists GPUs in another order (CUDA_VISIBLE_DEVICES=2,0)
    ("GPU-AB12", ["ab12"], 0),  # nvidia-smi's spelling and case
    ("ab12", ["GPU-ab12"], 0),
    ("ee", ["aa", "bb"], "cannot see"),  # that GPU is hidden from the reader
    ("aa", [], "cannot see"),  # the reader sees no GPU at all
    ("aa", ["aa", "AA"], "several"),  # two ordinals claim the same UUID
])
def test_cuda_device_is_found_by_uuid(uuid, visible, want):
    if isinstance(want, str):
        with pytest.raises(TransportError, match=want):
            local_cuda.reader_device(uuid, 3, visible)
    else:
        assert local_cuda.reader_device(uuid, 3, visible) == want


HANDLE, EVENT, REF = bytes(range(64)), bytes(range(64, 128)), b"/torch_123_456"


class _StandInCudaTensor:
    """Stand-in for a CUDA tensor: only what share() reads, and a _share_cuda_ that returns fixed handles."""

    is_cuda = True

    def __init__(self, torch, ordinal: int, offset: int, numel: int):
        self.device, self._offset, self._numel = torch.device("cuda", ordinal), offset, numel

    def is_contiguous(self):
        return True

    def storage_offset(self):
        return self._offset

    def element_size(self):
        return 4

    def numel(self):
        return self._numel

    def detach(self):
        return self

    def untyped_storage(self):
        return self

    def _share_cuda_(self):
        return self.device.index, HANDLE, 4096, 512, REF, 7, EVENT, True


@pytest.fixture
def standin_cuda(monkeypatch):
    """Stand-ins for CUDA on this host: the writer's GPUs, the reader's GPUs (the writer's cuda:3 is the reader's
    cuda:1), a no-op CUDA init, and a _new_shared_cuda that records its arguments and returns a CPU storage of
    known bytes. Returns (torch, calls, as_reader); call as_reader() before opening what this process shared."""
    torch = pytest.importorskip("torch")
    calls = []

    def new_shared_cuda(*args):
        calls.append(args)
        return torch.arange(args[2], dtype=torch.int64).to(torch.uint8).untyped_storage()

    monkeypatch.setattr(local_cuda, "device_uuid", {0: "uuid-w0", 3: "uuid-w3"}.__getitem__)
    monkeypatch.setattr(local_cuda, "visible_uuids", lambda: ("uuid-w3", "uuid-w0"))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", new_shared_cuda)

    def as_reader():  # the description names its writer's process; the reader is another one
        monkeypatch.setattr(local_cuda, "_process", lambda: "1-another-process")

    return torch, calls, as_reader


def test_cuda_description_round_trips_as_json(standin_cuda):
    """A stand-in tensor's handles go through JSON and reach (a stand-in) _new_shared_cuda byte for byte, on the
    reader's ordinal for the writer's GPU."""
    torch, calls, as_reader = standin_cuda
    d = local_cuda.share(_StandInCudaTensor(torch, 3, offset=10, numel=100))
    wire = json.loads(json.dumps(d))
    assert wire == d and wire["uuid"] == "uuid-w3" and wire["device"] == 3
    assert (wire["offset"], wire["nbytes"]) == (40, 400)
    as_reader()
    t = local_cuda.open_shared(wire)
    assert calls == [(0, HANDLE, 4096, 512, REF, 7, EVENT, True)]  # on the reader's ordinal for uuid-w3
    assert t.dtype == torch.uint8 and t.tolist() == [i % 256 for i in range(40, 440)]
    empty = json.loads(json.dumps(local_cuda.share(_StandInCudaTensor(torch, 0, offset=0, numel=0))))
    assert "handle" not in empty and empty["nbytes"] == 0  # no allocation, so nothing to open


@pytest.mark.parametrize("change, error", [
    (lambda d: d.update(nbytes=4097), ValueError),  # reaches past the storage
    (lambda d: d.update(offset=-1), ValueError),
    (lambda d: d.update(device="3"), ValueError),
    (lambda d: d.update(handle="zz"), ValueError),
    (lambda d: d.pop("ref_handle"), KeyError),
    (lambda d: d.update(uuid="uuid-gone"), TransportError),
])
def test_cuda_description_is_checked(standin_cuda, change, error):
    """A malformed description (of a stand-in tensor) is refused before anything is opened."""
    torch, calls, as_reader = standin_cuda
    d = json.loads(json.dumps(local_cuda.share(_StandInCudaTensor(torch, 3, offset=0, numel=10))))
    change(d)
    as_reader()
    with pytest.raises(error):
        local_cuda.open_shared(d)
    assert calls == []


def test_cuda_open_failure_is_a_transport_error(clean, standin_cuda, monkeypatch):
    """A RuntimeError from _new_shared_cuda (a stand-in here) reaches recv as TransportError, and the writer still
    gets the message back."""
    torch, calls, as_reader = standin_cuda

    def refuse(*args):
        raise RuntimeError("CUDA error: invalid device context")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", refuse)
    d = json.loads(json.dumps(local_cuda.share(_StandInCudaTensor(torch, 3, offset=0, numel=10))))
    lst, pub, sub = _pair()
    pub.send(Message("m", {}, [b"host", _StandInCudaTensor(torch, 3, offset=0, numel=10)]))
    assert pub.cuda_lent() == 1
    as_reader()
    with pytest.raises(TransportError, match="could not open CUDA memory.*invalid device context"):
        local_cuda.open_shared(d)
    with pytest.raises(TransportError, match="invalid device context"):
        sub.recv(timeout=10)
    assert pub.wait_cuda_released(timeout=30)
    assert all(not s.busy for s in pub._out._segs.values())
    pub.send(Message("next", {}, [b"still usable"]))
    assert bytes(sub.recv(timeout=10).blobs[0]) == b"still usable"
    for x in (pub, sub, lst):
        x.close()


def test_cuda_open_in_the_sharing_process_is_refused(clean, standin_cuda):
    """CUDA IPC handles cannot be opened by the process that made them: a clear error, not a CUDA one (stand-in
    tensor; the check runs before any CUDA call)."""
    torch, calls, _ = standin_cuda
    lst, pub, sub = _pair()
    pub.send(Message("m", {}, [_StandInCudaTensor(torch, 0, offset=0, numel=10)]))
    with pytest.raises(TransportError, match="process that shared it"):
        sub.recv(timeout=10)
    assert calls == [] and pub.wait_cuda_released(timeout=30)
    for x in (pub, sub, lst):
        x.close()


def test_cuda_open_without_cuda_is_a_transport_error():
    """The real open_shared in a process where torch has no CUDA: TransportError, not a crash."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    d = {"uuid": "uuid-w0", "device": 0, "proc": "1-another-process", "offset": 0, "nbytes": 4}
    with pytest.raises(TransportError, match="CUDA is not usable"):
        local_cuda.open_shared(d)


@pytest.fixture
def standin_ipc(monkeypatch):
    """Stand-ins for CUDA IPC so the link's release protocol runs on CPU: CPU torch tensors play the CUDA blobs,
    share() files a copy under a key, and open_shared() returns a copy in a storage of its own, as a reader's
    mapping is one."""
    torch = pytest.importorskip("torch")
    shared = {}

    def share(t):
        shared[str(len(shared))] = t.detach().clone()
        return {"standin": str(len(shared) - 1)}

    monkeypatch.setattr(local_cuda, "is_cuda", lambda b: isinstance(b, torch.Tensor))
    monkeypatch.setattr(local_cuda, "share", share)
    monkeypatch.setattr(local_cuda, "open_shared", lambda d: shared[d["standin"]].view(torch.uint8).clone())
    return torch


def _eventually(cond, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit  # only bounds a failure; nothing here is timed
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_cuda_blobs_are_held_until_the_reader_lets_go(clean, standin_ipc):
    """With stand-ins for share/open_shared (CPU tensors as CUDA blobs), the writer holds each message's tensors
    until the reader has dropped every part of that message, views included, and then lets them go."""
    torch = standin_ipc
    from torch.multiprocessing.reductions import StorageWeakRef

    lst, pub, sub = _pair()
    a = torch.arange(100, dtype=torch.float32)
    a_ref = StorageWeakRef(a.untyped_storage())
    pub.send(Message("one", {}, [b"host", a]))
    pub.send(Message("two", {}, [torch.ones(8)]))
    pub.send(Message("host only", {}, [b"x"]))
    del a
    assert pub.cuda_lent() == 2 and not a_ref.expired()  # the writer holds what it lent
    one, two, three = (sub.recv(timeout=10) for _ in range(3))
    assert bytes(one.blobs[0]) == b"host" and one.blobs[1].view(torch.float32).tolist() == list(range(100))
    assert two.blobs[0].view(torch.float32).tolist() == [1.0] * 8 and bytes(three.blobs[0]) == b"x"
    view = one.blobs[1][4:]  # the caller keeps part of the first message's tensor
    del one, two, three
    _eventually(lambda: sorted(pub._lent) == [1], "the second message given back")
    assert not pub.wait_cuda_released(timeout=0.2) and not a_ref.expired()
    del view
    assert pub.wait_cuda_released(timeout=30) and pub.cuda_lent() == 0
    assert a_ref.expired()  # given back: the writer no longer keeps it
    _eventually(lambda: all(not s.busy for s in pub._out._segs.values()), "every segment given back")
    for x in (pub, sub, lst):
        x.close()


def test_waiting_for_cuda_blobs_fails_with_the_link(clean, standin_ipc):
    """With stand-ins for share/open_shared: a reader that goes away holding a message fails the writer's wait."""
    torch = standin_ipc
    lst, pub, sub = _pair()
    pub.send(Message("m", {}, [torch.ones(8)]))
    held = sub.recv(timeout=10)
    sub.close()  # the reader goes away still holding the tensor
    with pytest.raises(TransportError, match="not given back"):
        pub.wait_cuda_released(timeout=30)
    pub.close()
    with pytest.raises(TransportError, match="closed"):
        pub.wait_cuda_released(timeout=30)
    assert pub.cuda_lent() == 0
    del held
    lst.close()


# -- CUDA IPC on a GPU, with a fresh reader process ------------------------------------------------------------


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.init()  # before any test changes CUDA_VISIBLE_DEVICES for its child
    return torch


def _wait(p, what: str, step, limit: float = 120.0):
    """step(short timeout) until it gives something, failing at once with the exit code if the reader p has died."""
    deadline = time.monotonic() + limit  # only a backstop: a dead reader is caught on the next turn
    while True:
        alive = p.is_alive()  # looked at before the step, so what a reader sent just before exiting is still seen
        try:
            got = step(0.25)
        except (queue.Empty, TransportTimeout):
            got = None
        except TransportError as e:  # the link broke: most likely the reader died
            p.join(timeout=10)
            pytest.fail(f"the link failed while we waited for {what} ({e}); reader exit code {p.exitcode}")
        if isinstance(got, tuple) and got[0] == "error":
            pytest.fail(f"the reader failed while we waited for {what}: {got[1]}")
        if got is not None and got is not False:
            return got
        if not alive:
            pytest.fail(f"the reader died with exit code {p.exitcode} (-N: signal N) while we waited for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {limit}s, and the reader is still running")


def _reader(name: str, q, take) -> None:
    """A fresh spawned process: dial, take(sub, q) the first message, ack it, wait for the writer's bye."""
    faulthandler.enable()  # a crash inside CUDA still says where
    try:
        sub = connect(f"local://{name}")
        take(sub, q)
        sub.send(Message("ack"))
        sub.recv(timeout=60)
        sub.close()
    except BaseException as e:
        q.put(("error", repr(e)))
        raise


def _cuda_reader(name: str, q) -> None:
    """A reader whose first CUDA call is opening the shared memory."""
    _reader(name, q, _take_cuda)


def _take_cuda(sub, q) -> None:
    m = sub.recv(timeout=60)
    t, empty = m.blobs[1], m.blobs[2]
    q.put(("got", t.device.type, t.device.index, bytes(t.cpu().numpy()), bytes(m.blobs[0]), empty.numel()))
    # the message and its tensors go out of scope here, before the ack: the writer waits for that


def _start_reader(torch, monkeypatch, target, name, visible: str | None = None):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with monkeypatch.context() as env:
        if visible is not None:
            env.setenv("CUDA_VISIBLE_DEVICES", visible)  # read by the child at its CUDA init; ours is already done
        p = ctx.Process(target=target, args=(name, q))
        p.start()
    return p, q


@contextlib.contextmanager
def _reader_session(torch, monkeypatch, target, visible: str | None = None):
    """A listener, a reader process started on it, and the accepted link; all closed (the reader killed if it
    still runs) however the test ends."""
    name = _name()
    lst = listen(f"local://{name}")
    p, q = _start_reader(torch, monkeypatch, target, name, visible)
    pub = None
    try:
        pub = _wait(p, "the reader to connect", lambda s: lst.accept(timeout=s))
        yield p, q, pub
        pub.send(Message("bye"))
        p.join(timeout=60)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
        if pub is not None:
            pub.close()
        lst.close()


def _ipc_round(torch, monkeypatch, device: int, visible: str | None):
    from torch.multiprocessing.reductions import StorageWeakRef

    with _reader_session(torch, monkeypatch, _cuda_reader, visible) as (p, q, pub):
        with torch.cuda.device(device):
            base = torch.arange(1000, dtype=torch.float32, device="cuda")
            torch.cuda._sleep(200_000_000)  # keeps the stream busy, so the write below lands after the send
            base.mul_(3)
            t = base[10:]  # an offset into its storage
            pub.send(Message("cuda", {}, [b"host", t, torch.empty(0, device="cuda")]))
        ref = StorageWeakRef(base.untyped_storage())
        want = bytes((torch.arange(1000, dtype=torch.float32)[10:] * 3).numpy().view(np.uint8))
        del base, t
        assert pub.cuda_lent() == 1 and not ref.expired()  # held for the reader
        got = _wait(p, "the reader's copy", lambda s: q.get(timeout=s))
        assert got[:3] == ("got", "cuda", 0 if visible else device)
        assert got[3] == want and got[4] == b"host" and got[5] == 0  # the reader's stream waited for the write
        _wait(p, "the reader's ack", lambda s: pub.recv(timeout=s))
        assert _wait(p, "the reader to let go of the CUDA blobs", lambda s: pub.wait_cuda_released(timeout=s))
        assert pub.cuda_lent() == 0 and ref.expired()


@pytest.mark.gpu
def test_cuda_tensors_travel_as_ipc_handles(monkeypatch):
    torch = _cuda_or_skip()
    _ipc_round(torch, monkeypatch, 0, None)


@pytest.mark.gpu
def test_cuda_tensors_find_their_gpu_under_other_visible_devices(monkeypatch):
    """The reader sees only the writer's last GPU, as its cuda:0 (the writer's cuda:N-1)."""
    torch = _cuda_or_skip()
    last = torch.cuda.device_count() - 1
    _ipc_round(torch, monkeypatch, last, "GPU-" + str(torch.cuda.get_device_properties(last).uuid))


def _blind_cuda_reader(name: str, q) -> None:
    _reader(name, q, _take_blind)


def _take_blind(sub, q) -> None:
    try:
        sub.recv(timeout=60)
        q.put(("opened",))
    except TransportError as e:
        q.put(("refused", str(e)))


@pytest.mark.gpu
def test_cuda_reader_without_the_gpu_gets_a_transport_error(monkeypatch):
    torch = _cuda_or_skip()
    with _reader_session(torch, monkeypatch, _blind_cuda_reader, visible="") as (p, q, pub):
        pub.send(Message("cuda", {}, [torch.ones(10, device="cuda")]))
        got = _wait(p, "the reader's verdict", lambda s: q.get(timeout=s))
        assert got[0] == "refused" and "CUDA is not usable" in got[1], got
        _wait(p, "the reader's ack", lambda s: pub.recv(timeout=s))
        assert _wait(p, "the message given back", lambda s: pub.wait_cuda_released(timeout=s))
