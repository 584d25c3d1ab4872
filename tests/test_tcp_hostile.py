"""The tcp wire against hostile peers: a relay without the token, strangers that trickle or flood, and
oversized messages.

A relay that rewrites, drops, repeats or reorders records is caught by their MACs; a handshake has one total
deadline however slowly it trickles in; the token proof is checked before a request is read or room made for
it; strangers hold a bounded number of threads; a message is limited to what the receiver's role allows.
All sockets are on 127.0.0.1.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from helpers import blob, port_of
from tcp_helpers import Proxy, RecordRelay
from wsync.errors import TransportError
from wsync.transports import Message, connect, listen
from wsync.transports.tcp import auth
from wsync.transports.tcp.mac import TAG


# -- every byte a receiver keeps is authenticated under the token -----------------------


@pytest.mark.parametrize("action", ["rewrite", "drop", "repeat", "swap"])
def test_a_relay_without_the_token_cannot_change_drop_repeat_or_reorder_records(action):
    lst = listen("tcp://127.0.0.1:0", token="relay-test-secret-16", frame_bytes=64 << 10, resume_window=2)  # 16 frames
    relay = RecordRelay(port_of(lst.address), action, tag=TAG)
    cli = connect(relay.address, token="relay-test-secret-16", streams=1)
    srv = lst.accept(timeout=10)
    data = blob(1 << 20, 1)
    try:
        # the receiver may hang up while this is still sending: that is the sender's problem, not the test's
        threading.Thread(target=_quietly, args=(srv.send, Message("bucket", {"v": 1}, [data])), daemon=True).start()
        with pytest.raises(TransportError, match="failed its MAC"):
            got = cli.recv(timeout=15)
            assert bytes(got.blobs[0]) == data, "the receiver took bytes the relay rewrote"
        assert relay.done
        with pytest.raises(TransportError):  # the link is closed: nothing more comes out of it
            cli.recv(timeout=1)
    finally:
        cli.close(), srv.close(), lst.close(), relay.close()


def _quietly(fn, *args):
    try:
        fn(*args)
    except TransportError:
        pass


def test_a_relay_that_only_forwards_changes_nothing_and_resumes_bit_exact():
    """The honest path with a token: several streams, many messages, and a cut that forces a resume
    (new connections, new keys, record counts from 0) all arrive bit-exact."""
    lst = listen("tcp://127.0.0.1:0", token="relay-test-secret-16", max_message=64 << 20)
    proxy = Proxy(port_of(lst.address), direction="down", cut_after=12 << 20)
    cli = connect(proxy.address, token="relay-test-secret-16", streams=3, frame_bytes=1 << 20)
    srv = lst.accept(timeout=10)
    sent = [[blob(20 << 20, 2), blob(3, 3)], [blob(100, 4)], [], [blob(700 << 10, 5), blob(5 << 20, 6)]]
    try:
        for i, blobs in enumerate(sent):
            srv.send(Message("bucket", {"i": i}, blobs))
        for i, blobs in enumerate(sent):
            m = cli.recv(timeout=60)
            assert m.meta == {"i": i} and [bytes(b) for b in m.blobs] == blobs
        cli.send(Message("ack", {"ok": True}, [blob(2 << 20, 7)]))  # and the other way
        m = srv.recv(timeout=30)
        assert bytes(m.blobs[0]) == blob(2 << 20, 7)
        assert proxy.cuts == 1 and cli.reconnects == 1
    finally:
        cli.close(), srv.close(), lst.close(), proxy.close()


def test_record_keys_differ_per_connection_and_direction():
    """What makes a record recorded on one connection fail on any other: its key depends on both nonces."""
    a = auth.Keys(b"t", b"\1" * 32, b"\2" * 32)
    b = auth.Keys(b"t", b"\1" * 32, b"\3" * 32)
    keys = {a.frames("up"), a.frames("down"), b.frames("up"), b.frames("down")}
    assert len(keys) == 4 and all(len(k) == 32 for k in keys)


# -- strangers cost a bounded amount, for a bounded time --------------------------------


def _hello() -> bytes:
    return auth.HELLO_C.pack(auth.MAGIC, auth.VERSION, bytes(32))


def _closed_by_peer(sock) -> bool:
    """True once the other side has closed (EOF or reset), False if it sent data."""
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, socket.timeout):
        return True


def test_a_trickling_handshake_is_dropped_at_one_total_deadline():
    lst = listen("tcp://127.0.0.1:0", token="wire-test-token-16", handshake_timeout=1.0)
    s = socket.create_connection(("127.0.0.1", port_of(lst.address)))
    try:
        for byte in _hello():  # one byte every 0.1 s: each read is quick, the whole hello outlasts the deadline
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break  # the listener has hung up on us
            time.sleep(0.1)
        s.settimeout(10)
        assert _closed_by_peer(s), "the listener kept a trickled hello past its handshake deadline"
    finally:
        s.close(), lst.close()


def test_the_token_proof_is_checked_before_the_request_is_read():
    """A stranger announcing a 1 MiB request is refused at its proof: nothing is read or allocated for it."""
    lst = listen("tcp://127.0.0.1:0", token="wire-test-token-16", handshake_timeout=5.0)
    s = socket.create_connection(("127.0.0.1", port_of(lst.address)))
    try:
        s.sendall(_hello())
        s.settimeout(10)
        hello = b""
        while len(hello) < auth.HELLO_S.size:
            hello += s.recv(auth.HELLO_S.size - len(hello))
        s.sendall(bytes(32) + struct.pack("<I", 1 << 20))  # a wrong proof, then the length of a big request
        head = s.recv(4)
        assert len(head) == 4, "no answer: the listener waited for the request before checking the token"
        (n,) = struct.unpack("<I", head)
        body = b""
        while len(body) < n:
            body += s.recv(n - len(body))
        assert b"bad or missing token" in body
    finally:
        s.close(), lst.close()


def test_a_flood_of_tricklers_keeps_threads_bounded_and_honest_peers_get_in():
    cap, flood = 16, 300
    base = threading.active_count()
    lst = listen("tcp://127.0.0.1:0", token="wire-test-token-16", max_handshakes=cap, handshake_timeout=30.0)
    socks, stop, rounds = [], threading.Event(), []

    def trickle():  # one byte of hello per socket every 0.5 s: alive as far as any per-read timeout sees
        for k in range(1, 30):
            for s in list(socks):
                try:
                    s.send(_hello()[k: k + 1])
                except OSError:
                    pass
            rounds.append(k)
            if stop.wait(0.5):
                return

    try:
        for _ in range(flood):
            s = socket.create_connection(("127.0.0.1", port_of(lst.address)))
            s.send(_hello()[:1])
            socks.append(s)
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        most, deadline = 0, time.monotonic() + 60  # the deadline only turns a stalled trickler into a failure
        while len(rounds) < 3:  # the thread count, sampled while every stranger trickles in two more bytes
            assert time.monotonic() < deadline and t.is_alive(), rounds
            most = max(most, threading.active_count() - base)
            time.sleep(0.02)
        # the listener's accept loop and door watchdog, this test's trickler, and at most cap admitting threads
        assert most <= cap + 4, f"{most} threads for {flood} strangers (cap {cap})"
        cli = connect(lst.address, token="wire-test-token-16", streams=2, timeout=20)
        srv = lst.accept(timeout=10)
        srv.send(Message("bucket", {}, [blob(3 << 20, 9)]))
        assert bytes(cli.recv(timeout=30).blobs[0]) == blob(3 << 20, 9)
        cli.close(), srv.close()
    finally:
        stop.set()
        for s in socks:
            s.close()
        lst.close()


# -- a message is limited to what the receiver's role allows ---------------------------


def test_a_listener_refuses_a_message_larger_than_its_role_allows():
    """A listener (the publisher) hears only control messages: a token holder announcing 64 MiB is refused
    at the header, before anything is allocated, and the link fails with a clear error."""
    lst = listen("tcp://127.0.0.1:0", token="wire-test-token-16")
    cli = connect(lst.address, token="wire-test-token-16", streams=1)
    srv = lst.accept(timeout=10)
    try:
        with pytest.raises(TransportError):
            cli.send(Message("hello", {}, [np.zeros(64 << 20, dtype=np.uint8)]))
            cli.flush(30)
        with pytest.raises(TransportError, match="max_message"):
            srv.recv(timeout=30)
    finally:
        cli.close(), srv.close(), lst.close()


def _send_quietly(link, msg) -> None:
    try:
        link.send(msg)
    except TransportError:
        pass


def test_a_receiver_that_knows_what_to_expect_narrows_the_limit():
    lst = listen("tcp://127.0.0.1:0", token="wire-test-token-16")
    cli = connect(lst.address, token="wire-test-token-16", streams=1)
    srv = lst.accept(timeout=10)
    try:
        cli.limit(1 << 20)  # e.g. a subscriber that knows its layout's bucket sizes
        srv.send(Message("bucket", {}, [blob(1 << 20, 1)]))
        assert len(cli.recv(timeout=30).blobs[0]) == 1 << 20
        # the receiver refuses at the header and drops the link, so the sender's send may wait on a peer
        # that will not resume and fail itself: it runs aside, and only the receiver's verdict is the test
        sender = threading.Thread(target=_send_quietly, args=(srv, Message("bucket", {}, [blob((1 << 20) + 1, 2)])),
                                  daemon=True)
        sender.start()
        with pytest.raises(TransportError, match="max_message"):
            cli.recv(timeout=30)
    finally:
        cli.close(), srv.close(), lst.close()
