"""ucx:// over UCXX: round trips, resumable timeouts, failures; skipped where ucxx is not installed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from helpers import random_bytes

pytest.importorskip("ucxx", reason="ucx:// needs ucxx (pip install 'wsync[ucx]')")
# A listener needs tcp (see ../shared/MACHINE.md); GPU buffers need UCX's cuda transports where a GPU exists.
os.environ.setdefault("UCX_TLS", "tcp,sm,self" + (",cuda_copy,cuda_ipc" if os.path.exists("/dev/nvidiactl") else ""))

from wsync.errors import TransportError  # noqa: E402
from wsync.transports import Message, TransportTimeout, connect, listen  # noqa: E402
from wsync.transports import ucx  # noqa: E402


def _pair():
    lst = listen("ucx://127.0.0.1:0")
    got = {}
    t = threading.Thread(target=lambda: got.update(s=connect(lst.address)))
    t.start()
    pub = lst.accept(timeout=30)
    t.join()
    assert pub is not None
    return lst, pub, got["s"]


def test_round_trip_both_ways_with_resumable_timeout():
    lst, pub, sub = _pair()
    with pytest.raises(TransportTimeout):
        sub.recv(timeout=0.1)
    blobs = [b"abc", b"", random_bytes(1, (3 << 20) + 7), bytearray(b"x" * 100)]
    pub.send(Message("bucket", {"version": 9}, blobs))
    m = sub.recv(timeout=30)  # resumes the receive the timeout left pending
    assert m.kind == "bucket" and m.meta == {"version": 9}
    assert [bytes(b) for b in m.blobs] == [bytes(memoryview(b).cast("B")) for b in blobs]
    sub.send(Message("ack", {"ok": True}, [b"fine"]))
    r = pub.recv(timeout=30)
    assert (r.kind, r.meta, bytes(r.blobs[0])) == ("ack", {"ok": True}, b"fine")
    for x in (sub, pub, lst):
        x.close()


def test_header_checks():
    head, bufs = ucx.pack_head(Message("k", {"a": 1}, [b"xy", b""]))
    h = ucx.parse_head(head)
    assert (h.kind, h.meta, h.sizes) == ("k", {"a": 1}, [2, 0]) and len(bufs) == 1
    bad = bytearray(head)
    bad[-2] ^= 1
    with pytest.raises(Exception, match="checksum"):
        ucx.parse_head(bytes(bad))
    with pytest.raises(TransportError, match="not a wsync message"):
        ucx.parse_head(b"NOPE" + head[4:])


def test_unreachable_publisher():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TransportError, match="cannot reach"):
        connect(f"ucx://127.0.0.1:{port}", connect_timeout=1)


def test_between_processes_and_peer_exit():
    lst = listen("ucx://127.0.0.1:0")
    code = textwrap.dedent(f"""
        import numpy as np, xxhash
        from wsync.transports import Message, connect
        link = connect({lst.address!r})
        m = link.recv(timeout=60)
        link.send(Message("ack", {{"digest": xxhash.xxh3_64_hexdigest(m.blobs[0])}}))
        link.recv(timeout=60)
    """)
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp,sm,self")}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        pub = lst.accept(timeout=60)
        assert pub is not None
        big = random_bytes(2, 8 << 20)
        pub.send(Message("bucket", {}, [big]))
        import xxhash

        assert pub.recv(timeout=60).meta["digest"] == xxhash.xxh3_64_hexdigest(big)
        pub.send(Message("bye"))
        assert p.wait(timeout=60) == 0, p.stderr.read()
        with pytest.raises(TransportError) as gone:  # the peer is gone: nothing more arrives
            pub.recv(timeout=10)
        assert not isinstance(gone.value, TransportTimeout), "a dead peer must be reported, not waited for"
        pub.close()
    finally:
        if p.poll() is None:
            p.kill()
        lst.close()


@pytest.mark.gpu
def test_cuda_blobs_go_device_to_device():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lst, pub, sub = _pair()
    t = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    pub.send(Message("cuda", {}, [t, b"host"]))
    m = sub.recv(timeout=60)
    assert m.blobs[0].is_cuda and torch.equal(m.blobs[0].view(torch.int32), t) and bytes(m.blobs[1]) == b"host"
    for x in (sub, pub, lst):
        x.close()


def test_send_to_a_peer_that_stopped_receiving_is_bounded():
    """A large part waits for the peer's receive (rendezvous): one that never comes ends the send after
    stall_timeout with a TransportError, and the link refuses to go on out of step."""
    lst = listen("ucx://127.0.0.1:0", stall_timeout=1)
    got = {}
    t = threading.Thread(target=lambda: got.update(s=connect(lst.address)))
    t.start()
    pub = lst.accept(timeout=30)
    t.join()
    with pytest.raises(TransportError, match="took no part"):
        pub.send(Message("bucket", {}, [random_bytes(2, 64 << 20)]))  # the subscriber never calls recv
    with pytest.raises(TransportError, match="unusable"):
        pub.send(Message("bye"))
    for x in (got["s"], pub, lst):
        x.close()
