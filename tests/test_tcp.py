"""tcp:// transport: exact delivery, order, fan-out, auth, damage, resume, TLS, timeouts, hostile input."""
from __future__ import annotations

import logging
import os
import socket
import ssl
import struct
import threading
import time

import numpy as np
import pytest

from helpers import blob
from tcp_helpers import Proxy, self_signed
from wsync.errors import ChecksumError, TransportError
from wsync.transports import Message, TransportTimeout, connect, listen
from wsync.transports import envelope
from wsync.transports.tcp import auth as tcp_auth, frames as tf
from wsync.transports.tcp.link import HASH_PIECE, ConnectionLost, recv_hashed
from wsync.transports.tcp.outbox import LANE_STREAMS, LANE_WARMUP, Outbox, as_views, frame_size

LOG = "wsync.transports.tcp"


@pytest.fixture
def pair(request):
    """(listener, client link, server link) on loopback; options from the test's parametrization."""
    opts = getattr(request, "param", {})
    lst = listen("tcp://127.0.0.1:0", **opts)
    cli = connect(lst.address, **opts)
    srv = lst.accept(timeout=10)
    yield lst, cli, srv
    cli.close()
    srv.close()
    lst.close()


def recv_in_thread(link, timeout=60):
    out = {}

    def run():
        try:
            out["msg"] = link.recv(timeout)
        except Exception as e:  # handed to the test thread
            out["err"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def wait_for_log(caplog, pred, timeout: float = 5.0) -> bool:
    """The listener logs from its own threads: give it a moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.name == LOG and pred(r.getMessage()) for r in caplog.records):
            return True
        time.sleep(0.02)
    return False


def test_small_messages_both_ways(pair):
    _, cli, srv = pair
    cli.send(Message("hello", {"version": 3, "names": ["a", "b"]}, [b"abc", b"", bytearray(b"xyz" * 1000)]))
    m = srv.recv(5)
    assert (m.kind, m.meta) == ("hello", {"version": 3, "names": ["a", "b"]})
    assert [bytes(b) for b in m.blobs] == [b"abc", b"", b"xyz" * 1000]
    srv.send(Message("ack"))
    m = cli.recv(5)
    assert (m.kind, m.meta, m.blobs) == ("ack", {}, [])


@pytest.mark.parametrize("pair", [{"streams": 4, "frame_bytes": 1 << 20}], indirect=True)
def test_large_message_over_several_streams_is_exact(pair):
    _, cli, srv = pair
    data = np.random.default_rng(1).integers(0, 256, (80 << 20) + 12345, dtype=np.uint8)  # > 64 MiB, odd size
    small = blob(3, 2)
    t, out = recv_in_thread(cli)
    srv.send(Message("bucket", {"i": 0}, [data, small]))
    t.join()
    m = out["msg"]
    assert m.blobs[0] == data.data and bytes(m.blobs[1]) == small


@pytest.mark.parametrize("nbytes, streams, frame_bytes, want", [
    (1 << 30, 1, 4 << 20, 4 << 20),  # one stream: no tail to shorten, frame_bytes as set
    (96 << 20, 1, 4 << 20, 4 << 20),
    (1 << 30, 4, 4 << 20, 4 << 20),  # large message: 64 frames per stream already
    (96 << 20, 4, 4 << 20, 1572864),  # 16 frames per stream: 1.5 MiB
    (96 << 20, 8, 4 << 20, 768 << 10),
    (4 << 20, 4, 4 << 20, 256 << 10),  # would be 64 KiB: held at the 256 KiB floor
    (64 << 20, 4, 4 << 20, 1 << 20),  # a sync bucket
    ((40 << 20) + 1, 2, 4 << 20, 21 << 16),  # 1.25 MiB and a byte: rounded up to whole 64 KiB
    (10, 4, 4 << 20, 256 << 10),
    (96 << 20, 4, 512 << 10, 512 << 10),  # frame_bytes caps it
    (96 << 20, 4, 128 << 10, 128 << 10),  # frame_bytes below the floor wins
    (96 << 20, 4, 64 << 20, 1572864),
])
def test_frame_size_per_message(nbytes, streams, frame_bytes, want):
    f = frame_size(nbytes, streams, frame_bytes)
    assert f == want and envelope.MIN_FRAME <= f <= envelope.MAX_FRAME


@pytest.mark.parametrize("streams", [2, 4])
def test_small_messages_keep_to_stream_zero_large_ones_spread(streams):
    """The outbox's dealing rule, with writer threads whose 'sendall' takes 2 ms."""
    cv, live = threading.Condition(), [True]
    out, taken = Outbox(cv, 4 << 20, streams), []
    out.start(streams)  # a new epoch: stream 0 may take LANE_WARMUP bytes of large messages

    def writer(k):
        while True:
            with cv:
                job = out.take(k, lambda: live[0])
            if job is None:
                return
            time.sleep(0.002)
            with cv:
                kind = job[0] if job[0] != "frames" else ("spread" if job[3] else "whole")
                taken.append((k, kind, job[1].seq))
                out.written(job)

    threads = [threading.Thread(target=writer, args=(k,), daemon=True) for k in range(streams)]
    for t in threads:
        t.start()

    def send(nbytes):
        with cv:
            assert cv.wait_for(lambda: out.free == set(range(streams)), timeout=10)  # every writer waiting
            om = out.add("m", {}, as_views([b"h" * 100, bytes(nbytes)]))
            out.queue(om)
            cv.notify_all()
            assert cv.wait_for(lambda: om.pending == 0, timeout=10)
            return om.seq

    small = [send(170_000) for _ in range(10)]  # a delta bucket each: head + body, whole on stream 0
    big = send(16 << 20)  # 64 frames of 256 KiB: every bulk stream takes some
    with cv:
        live[0] = False
        cv.notify_all()
    for t in threads:
        t.join(timeout=10)
    assert all((0, "whole", seq) in taken for seq in small)
    assert {k for k, kind, seq in taken if kind != "head" and seq in small} == {0}
    spread = [k for k, kind, seq in taken if seq == big and kind == "spread"]
    assert set(spread) == set(range(streams))
    if streams >= LANE_STREAMS:  # stream 0 is the lane of small messages: it took only its warm-up
        assert spread.count(0) == LANE_WARMUP // (256 << 10)


@pytest.mark.parametrize("n", [1, HASH_PIECE - 1, HASH_PIECE, 3 * HASH_PIECE + 12345])
def test_recv_hashed_fills_the_view_and_hashes_it_like_one_shot(n):
    import xxhash

    data = blob(n, n)
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: [a.sendall(data[i: i + 1000]) for i in range(0, n, 1000)])  # ragged arrival
    t.start()
    buf = bytearray(n)
    got = recv_hashed(b, memoryview(buf), "peer")
    t.join()
    assert bytes(buf) == data and got == xxhash.xxh3_64_intdigest(data)
    a.close()
    with pytest.raises(ConnectionLost, match="closed a connection"):
        recv_hashed(b, memoryview(bytearray(10)), "peer")
    b.close()


def test_split_frames_resume_after_a_cut_bit_exact():
    """Default options over 4 streams (frames of 640 KiB, unsent data limited): a cut resumes bit-exact."""
    lst = listen("tcp://127.0.0.1:0")
    proxy = Proxy(int(lst.address.rsplit(":", 1)[1]), direction="down", cut_after=14 << 20)
    cli = connect(proxy.address, streams=4)
    srv = lst.accept(timeout=10)
    data = blob((40 << 20) + 777, 9)
    t, out = recv_in_thread(cli)
    srv.send(Message("a", {}, [data]))
    t.join()
    assert proxy.cuts == 1 and cli.reconnects == 1 and out["msg"].blobs[0] == data
    cli.close(), srv.close(), proxy.close(), lst.close()


def test_many_messages_stay_in_order(pair):
    _, cli, srv = pair
    sizes = [int(x) for x in np.random.default_rng(3).integers(0, 300_000, 200)]
    sent = [blob(n, i) for i, n in enumerate(sizes)]

    def send_all():
        for i, b in enumerate(sent):
            srv.send(Message("m", {"i": i}, [b]))

    t = threading.Thread(target=send_all)
    t.start()
    for i in range(len(sent)):
        m = cli.recv(30)
        assert m.meta["i"] == i and m.blobs[0] == sent[i]
    t.join()


def test_concurrent_send_and_recv_on_both_sides(pair):
    _, cli, srv = pair
    n, size = 40, 1 << 20
    errors = []

    def talk(link, seed_out, seed_in):
        def tx():
            for i in range(n):
                link.send(Message("d", {"i": i}, [blob(size, seed_out + i)]))

        t = threading.Thread(target=tx)
        t.start()
        try:
            for i in range(n):
                m = link.recv(30)
                if m.meta["i"] != i or m.blobs[0] != blob(size, seed_in + i):
                    errors.append((seed_out, i))
        except Exception as e:
            errors.append(e)
        t.join()

    a = threading.Thread(target=talk, args=(cli, 1000, 2000))
    b = threading.Thread(target=talk, args=(srv, 2000, 1000))
    a.start(), b.start()
    a.join(), b.join()
    assert errors == []


def test_several_subscribers_on_one_listener():
    lst = listen("tcp://127.0.0.1:0", token="listener-token-16b")
    subs = [connect(lst.address, token="listener-token-16b", streams=1 + i % 3) for i in range(5)]
    links = [lst.accept(timeout=10) for _ in subs]
    assert all(links) and len({ln.session for ln in links}) == 5
    by_session = {ln.session: ln for ln in links}
    for i, s in enumerate(subs):  # each subscriber gets its own content on its own link
        by_session[s.session].send(Message("v", {"who": i}, [blob(3 << 20, i)]))
    for i, s in enumerate(subs):
        m = s.recv(30)
        assert m.meta["who"] == i and m.blobs[0] == blob(3 << 20, i)
    for ln in subs + links:
        ln.close()
    lst.close()


def test_wrong_or_missing_token_is_refused_and_logged(caplog):
    lst = listen("tcp://127.0.0.1:0", token="the-right-token-16")
    with caplog.at_level(logging.WARNING, logger=LOG):
        with pytest.raises(TransportError, match="token"):
            connect(lst.address, token="the-wrong-token-16", timeout=5)
        with pytest.raises(TransportError, match="token"):
            connect(lst.address, timeout=5)
        assert wait_for_log(caplog, lambda m: "bad or missing token" in m)  # the client without one
        assert wait_for_log(caplog, lambda m: "token check" in m)  # the one with another token
    refusals = [r for r in caplog.records if r.name == LOG and "refused" in r.getMessage()]
    assert len(refusals) >= 2 and all("127.0.0.1:" in r.getMessage() for r in refusals)
    assert lst.accept(timeout=0.2) is None  # nothing unauthenticated reached accept()
    good = connect(lst.address, token="the-right-token-16")  # and the listener still serves good peers
    link = lst.accept(timeout=10)
    good.send(Message("ok", {}, [b"x"]))
    assert bytes(link.recv(5).blobs[0]) == b"x"
    good.close(), link.close(), lst.close()


def test_client_with_token_refuses_a_listener_without_one():
    lst = listen("tcp://127.0.0.1:0")
    with pytest.raises(TransportError, match="does not check tokens"):
        connect(lst.address, token="client-secret-16-bytes", timeout=5)
    lst.close()


@pytest.mark.parametrize("junk", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"WSH1",  # a truncated hello, then silence
    b"WSH1" + struct.pack("<H", 1) + bytes(32) + bytes(32) + struct.pack("<I", 0xFFFFFFFF),  # huge request length
    b"WSH1" + struct.pack("<H", 99) + bytes(32),  # another protocol version
    os.urandom(5000),
])
def test_garbage_never_crashes_the_listener(junk, caplog):
    lst = listen("tcp://127.0.0.1:0", handshake_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger=LOG):
        s = socket.create_connection(("127.0.0.1", int(lst.address.rsplit(":", 1)[1])))
        s.sendall(junk)
        s.settimeout(3)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass
        s.close()
        assert wait_for_log(caplog, lambda m: "127.0.0.1:" in m)  # logged with the peer's address
    assert lst.accept(timeout=0.1) is None
    cli = connect(lst.address)
    srv = lst.accept(timeout=10)
    cli.send(Message("still", {}, [b"fine"]))
    assert bytes(srv.recv(5).blobs[0]) == b"fine"
    cli.close(), srv.close(), lst.close()


def _fake_peer(address: str, records: list[bytes]) -> None:
    """A client that passes the handshake (1 stream) and then sends raw records."""
    port = int(address.rsplit(":", 1)[1])
    req = {"session": "ab" * 16, "epoch": 1}
    up = socket.create_connection(("127.0.0.1", port))
    deadline = time.monotonic() + 10
    tcp_auth.client_handshake(up, None, {**req, "op": "open", "dir": "up", "index": 0, "streams": 1,
                                         "state": tf.encode_state(0, {}).decode()}, "test", deadline)
    down = socket.create_connection(("127.0.0.1", port))
    tcp_auth.client_handshake(down, None, {**req, "op": "join", "dir": "down", "index": 0}, "test", deadline)
    for r in records:
        up.sendall(r)
    return up, down


def _head(seq, sizes, frame=1 << 20, max_lie=None):
    body = envelope.pack("x", {}, sizes, frame=frame)
    import xxhash

    return tf.pack(tf.Record(tf.HEAD, seq, length=len(body), body_sum=xxhash.xxh3_64_intdigest(body))) + body


@pytest.mark.parametrize("records, match", [
    ([_head(0, [1 << 40])], "max_message"),
    ([_head(0, [1 << 30]), _head(1, [1 << 30]), _head(2, [1 << 30])], "incomplete"),  # announced, never sent
    ([_head(0, [100], frame=3)], "frame size"),
    ([_head(0, [3 << 20]), tf.pack(tf.Record(tf.FRAME, 0, 0, 12345, 10, 0)) + bytes(10)], "not a frame"),
    ([_head(0, [100]), tf.pack(tf.Record(tf.FRAME, 0, 7, 0, 100, 0)) + bytes(100)], "blob 7"),
    ([tf.pack(tf.Record(tf.ACK, 5))], "never sent"),
    ([tf.pack(tf.Record(tf.HEAD, 0, length=1 << 30))], "limit"),
])
def test_lying_records_fail_the_link_cleanly(records, match):
    lst = listen("tcp://127.0.0.1:0", max_message=1 << 30)
    socks = _fake_peer(lst.address, records)
    link = lst.accept(timeout=10)
    with pytest.raises(TransportError, match=match):
        link.recv(10)
    for s in socks:
        s.close()
    link.close(), lst.close()


def test_a_damaged_frame_is_resent_transparently():
    lst = listen("tcp://127.0.0.1:0")
    proxy = Proxy(int(lst.address.rsplit(":", 1)[1]), direction="down", flip_at=5 << 20)
    cli = connect(proxy.address, streams=2, frame_bytes=1 << 20)
    srv = lst.accept(timeout=10)
    data = blob(12 << 20, 5)
    t, out = recv_in_thread(cli)
    srv.send(Message("b", {}, [data]))
    t.join()
    assert out["msg"].blobs[0] == data and cli.reconnects >= 1 and proxy.flip_at is None
    cli.close(), srv.close(), proxy.close(), lst.close()


def test_damage_that_persists_raises_checksum_error():
    lst = listen("tcp://127.0.0.1:0", linger=0.2)  # its link never gets an ACK: do not wait long at close
    proxy = Proxy(int(lst.address.rsplit(":", 1)[1]), direction="down", damage_all=True)
    cli = connect(proxy.address, streams=1, frame_bytes=1 << 20, max_resends=2)
    srv = lst.accept(timeout=10)
    threading.Thread(target=lambda: _swallow(srv.send, Message("b", {}, [blob(4 << 20)])), daemon=True).start()
    with pytest.raises(ChecksumError, match="checksum"):
        cli.recv(30)
    cli.close(), srv.close(), proxy.close(), lst.close()


def _swallow(fn, *args):
    try:
        fn(*args)
    except TransportError:
        pass


@pytest.mark.parametrize("direction", ["down", "up"])
def test_connections_cut_mid_message_resume_bit_exact(direction):
    lst = listen("tcp://127.0.0.1:0", max_message=64 << 20)  # a listener takes 16 MiB unless told
    proxy = Proxy(int(lst.address.rsplit(":", 1)[1]), direction=direction, cut_after=20 << 20)
    cli = connect(proxy.address, streams=3, frame_bytes=1 << 20)
    srv = lst.accept(timeout=10)
    tx, rx = (srv, cli) if direction == "down" else (cli, srv)
    data = [blob(48 << 20, 7), blob(5 << 20, 8)]
    t, out = recv_in_thread(rx)
    tx.send(Message("a", {"n": 1}, data))
    tx.send(Message("b", {"n": 2}, [b"after"]))
    t.join()
    assert proxy.cuts == 1 and cli.reconnects == 1
    m = out["msg"]
    assert (m.kind, m.meta) == ("a", {"n": 1}) and m.blobs[0] == data[0] and m.blobs[1] == data[1]
    m = rx.recv(10)  # the next message arrives once, in order: nothing lost, nothing repeated
    assert m.kind == "b" and bytes(m.blobs[0]) == b"after"
    with pytest.raises(TransportTimeout):
        rx.recv(0.3)
    cli.close(), srv.close(), proxy.close(), lst.close()


def test_resume_window_exceeded_raises_on_both_sides():
    lst = listen("tcp://127.0.0.1:0", resume_window=1.0)
    proxy = Proxy(int(lst.address.rsplit(":", 1)[1]), direction="down", cut_after=3 << 20)
    cli = connect(proxy.address, streams=2, resume_window=1.0, frame_bytes=1 << 20)
    srv = lst.accept(timeout=10)
    proxy.refuse = True  # the path stays down after the cut
    threading.Thread(target=lambda: _swallow(srv.send, Message("b", {}, [blob(16 << 20)])), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="resume_window"):
        cli.recv(30)
    with pytest.raises(TransportError, match="resume_window"):
        srv.recv(30)
    assert time.monotonic() - t0 < 20
    with pytest.raises(TransportError):
        cli.send(Message("late"))
    cli.close(), srv.close(), proxy.close(), lst.close()


def test_tls_round_trip(tmp_path, caplog):
    cert, key = self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    lst = listen("tcp://127.0.0.1:0", tls=server_ctx, token="tls-token-16-bytes")
    cli = connect(lst.address, tls={"cafile": cert}, token="tls-token-16-bytes", streams=2, frame_bytes=1 << 20)
    srv = lst.accept(timeout=10)
    data = blob(9 << 20, 9)
    t, out = recv_in_thread(srv)
    cli.send(Message("tls", {}, [data]))
    t.join()
    assert out["msg"].blobs[0] == data
    assert isinstance(cli._socks[0], ssl.SSLSocket)
    with caplog.at_level(logging.WARNING, logger=LOG):  # a plain client is turned away, and logged
        with pytest.raises(TransportError):
            connect(lst.address, token="tls-token-16-bytes", timeout=3, handshake_timeout=2)
        assert wait_for_log(caplog, lambda m: "127.0.0.1:" in m)
    cli.close(), srv.close(), lst.close()


def test_tls_client_rejects_an_untrusted_certificate(tmp_path):
    cert, key = self_signed(tmp_path)
    lst = listen("tcp://127.0.0.1:0", tls={"certfile": cert, "keyfile": key})
    with pytest.raises(TransportError, match="(?i)certificate"):
        connect(lst.address, tls={}, timeout=5)  # system trust store: the self-signed cert is not in it
    lst.close()


def test_timeouts_leave_the_link_usable(pair):
    lst, cli, srv = pair
    t0 = time.monotonic()
    with pytest.raises(TransportTimeout):
        cli.recv(0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    assert lst.accept(timeout=0.1) is None
    srv.send(Message("late", {}, [b"ok"]))
    assert bytes(cli.recv(5).blobs[0]) == b"ok"
    cli.send(Message("x"))
    srv.flush(5)
    cli.flush(5)


def test_connect_to_nothing_fails_cleanly():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(TransportError, match="cannot connect"):
        connect(f"tcp://127.0.0.1:{port}", timeout=2)


def test_peer_close_delivers_what_was_sent_then_raises(pair):
    _, cli, srv = pair
    srv.send(Message("last", {}, [blob(2 << 20)]))
    srv.close()
    assert cli.recv(5).blobs[0] == blob(2 << 20)
    with pytest.raises(TransportError, match="closed"):
        cli.recv(5)
    with pytest.raises(TransportError, match="closed"):
        cli.send(Message("x"))


def test_options_from_the_address():
    lst = listen("tcp://127.0.0.1:0?frame_bytes=256K")
    assert lst.address.endswith("?frame_bytes=256K")
    base = lst.address.split("?")[0]
    cli = connect(base + "?streams=2&frame_bytes=128K&sndbuf=1M")
    srv = lst.accept(timeout=10)
    assert cli.cfg.streams == 2 and cli.cfg.frame_bytes == 128 << 10 and cli.cfg.sndbuf == 1 << 20
    assert len(cli._socks) == 4
    cli.send(Message("o", {}, [blob(1 << 20)]))
    assert srv.recv(5).blobs[0] == blob(1 << 20)
    with pytest.raises(ValueError, match="unknown option"):
        connect(base + "?stream=2")
    cli.close(), srv.close(), lst.close()


def test_receive_buffers_are_recycled_only_once_released(pair):
    _, cli, srv = pair
    srv.send(Message("a", {}, [blob(1 << 20, 1)]))
    held = cli.recv(5)  # kept by the caller: its buffer must not be reused
    srv.send(Message("b", {}, [blob(1 << 20, 2)]))
    second = cli.recv(5)
    assert second.blobs[0].obj is not held.blobs[0].obj
    assert held.blobs[0] == blob(1 << 20, 1) and second.blobs[0] == blob(1 << 20, 2)
    mine = id(second.blobs[0].obj)  # an id, not a reference (the pool keeps the array alive)
    del second  # released: the next message of that size lands in the same memory
    srv.send(Message("c", {}, [blob(1 << 20, 3)]))
    third = cli.recv(5)
    assert id(third.blobs[0].obj) == mine and third.blobs[0] == blob(1 << 20, 3)
    assert held.blobs[0] == blob(1 << 20, 1)


def test_non_contiguous_blob_is_refused_with_a_hint(pair):
    _, cli, _ = pair
    with pytest.raises(ValueError, match="contiguous"):
        cli.send(Message("x", {}, [np.zeros((4, 4))[:, 1]]))


def test_retransmit_timers_where_the_kernel_has_them(pair):
    """rto_min / delack_max reach every connection (Linux >= 6.15), and must keep delayed ACKs under the RTO."""
    _, cli, srv = pair
    socks = cli._socks + srv._socks
    try:
        got = [(s.getsockopt(socket.IPPROTO_TCP, tcp_auth.TCP_RTO_MIN_US),
                s.getsockopt(socket.IPPROTO_TCP, tcp_auth.TCP_DELACK_MAX_US)) for s in socks]
    except OSError as e:
        pytest.skip(f"this kernel has no TCP_RTO_MIN_US / TCP_DELACK_MAX_US ({e})")
    assert len(socks) == 16  # 4 streams each way, both ends
    # the kernel keeps them in jiffies: what it reports is rounded up to its tick (4 ms at HZ=250)
    assert all(50_000 <= rto < 60_000 and 10_000 <= ack < 20_000 for rto, ack in got), got
    with pytest.raises(ValueError, match="delack_max"):
        connect("tcp://127.0.0.1:1", rto_min=0.01, delack_max=0.01)
