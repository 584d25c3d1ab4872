"""local:// for real: round trips through memfd segments, reuse, and no leaked shared memory after close or a crash."""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import threading

import numpy as np
import pytest

from wsync.errors import ChecksumError, TransportError
from wsync.transports import Message, TransportTimeout, connect, listen


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
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _pair(**opts):
    name = _name()
    lst = listen(f"local://{name}", **opts)
    got = {}
    t = threading.Thread(target=lambda: got.update(s=connect(f"local://{name}", **opts)))
    t.start()
    pub = lst.accept(timeout=10)
    t.join()
    return lst, pub, got["s"]


def _big(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def clean():
    """Every test must leave no memfd open in this process and nothing new in /dev/shm."""
    before = _shm()
    yield
    import gc

    gc.collect()
    assert _memfds() == []
    assert _shm() == before


def test_round_trips_both_ways(clean):
    lst, pub, sub = _pair(piece="64K")
    with pytest.raises(TransportTimeout):
        sub.recv(timeout=0.05)
    blobs = [b"abc", b"", _big(1, 1_000_003), bytearray(b"x" * 100), memoryview(_big(2, 70_000)).cast("B")]
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
    data = _big(3, 3 << 20)
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
    pub.send(Message("a", {}, [_big(4, 500_000)]))
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
    pub.send(Message("big", {}, [_big(5, 8 << 20)]))
    assert done.wait(60)
    p.join(timeout=30)
    with pytest.raises(TransportError):
        for _ in range(50):  # the first write may still land in the socket buffer
            pub.send(Message("more", {}, [b"x" * 1000]))
    with pytest.raises(TransportError):
        pub.recv(timeout=5)
    pub.close()
    lst.close()


# -- CUDA IPC ---------------------------------------------------------------------------


def _cuda_reader(name: str, q) -> None:
    sub = connect(f"local://{name}")
    m = sub.recv(timeout=60)
    t = m.blobs[1]
    q.put((t.device.type, bytes(t.cpu().numpy()), bytes(m.blobs[0])))
    sub.send(Message("ack"))
    sub.recv(timeout=60)


@pytest.mark.gpu
def test_cuda_tensors_travel_as_ipc_handles():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ctx = mp.get_context("spawn")
    name, q = _name(), ctx.Queue()
    lst = listen(f"local://{name}")
    p = ctx.Process(target=_cuda_reader, args=(name, q))
    p.start()
    pub = lst.accept(timeout=60)
    t = torch.arange(1000, dtype=torch.float32, device="cuda")[10:]  # an offset into its storage
    pub.send(Message("cuda", {}, [b"host", t]))
    device, raw, host = q.get(timeout=60)
    assert device == "cuda" and host == b"host" and raw == bytes(t.cpu().numpy().view(np.uint8))
    pub.recv(timeout=60)
    pub.send(Message("bye"))
    p.join(timeout=30)
    pub.close(), lst.close()
