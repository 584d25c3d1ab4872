"""Closing a tcp:// link: an orderly close is seen as one by the peer, whoever closes and from how many
threads, and a link that is down ends at once instead of waiting for it to come back.

Links here use a small resume_window: a close the peer mistakes for a drop then fails the test with
"did not reconnect within resume_window" instead of stalling it for the default 30 s.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from tcp_helpers import Proxy
from wsync.shadow import Shadow
from wsync.errors import TransportError
from wsync.subscriber import Subscriber
from wsync.sync import Publisher
from wsync.transports import Message, connect, listen
from wsync.transports.tcp.link import ConnectionLost

from helpers import TOKEN, blob

LOG = "wsync.transports.tcp"
WINDOW = 3.0  # resume_window: shorter than linger (5 s), so lingering on a dropped link ends in "failed"


def state_of(link, want, timeout: float = 10.0) -> str:
    with link.cv:
        link.cv.wait_for(lambda: link.state in want, timeout=timeout)
        return link.state


def in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["ret"] = fn(*args)
        except Exception as e:  # handed to the test thread
            out["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def close_from_threads(link, n: int = 2) -> None:
    """What Subscriber.close() does: its caller and its receiving thread both close the link."""
    go = threading.Barrier(n)
    ts = [threading.Thread(target=lambda: (go.wait(), link.close())) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts)


@pytest.mark.parametrize("closer", ["dialler", "listener"])
def test_a_close_from_two_threads_reaches_the_peer_as_an_orderly_close(closer, caplog):
    caplog.set_level("INFO", logger=LOG)
    lst = listen("tcp://127.0.0.1:0", resume_window=WINDOW)
    try:
        for i in range(8):  # each round is a fresh race between the peer's streams
            cli = connect(lst.address, streams=4, resume_window=WINDOW)
            srv = lst.accept(timeout=10)
            cli.send(Message("ack", {"version": i}))
            assert srv.recv(10).meta == {"version": i}
            mine, peer = (cli, srv) if closer == "dialler" else (srv, cli)
            close_from_threads(mine)
            with pytest.raises(TransportError, match="closed the link"):  # not "did not reconnect"
                peer.recv(30)
            assert (mine.state, peer.state, peer.reconnects) == ("closed", "closed", 0)
            assert "closed by this side" in str(mine.error)
            peer.close()
        assert not [r for r in caplog.records if "connection lost" in r.getMessage()]
    finally:
        lst.close()


def test_both_sides_closing_at_once_end_orderly(caplog):
    caplog.set_level("INFO", logger=LOG)
    lst = listen("tcp://127.0.0.1:0", resume_window=WINDOW)
    try:
        for _ in range(4):
            cli = connect(lst.address, streams=4, resume_window=WINDOW)
            srv = lst.accept(timeout=10)
            go = threading.Barrier(3)
            ts = [threading.Thread(target=lambda link=link: (go.wait(), link.close())) for link in (cli, cli, srv)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            assert (cli.state, srv.state) == ("closed", "closed")
        assert not [r for r in caplog.records if "connection lost" in r.getMessage() or r.levelname == "ERROR"]
    finally:
        lst.close()


def broken_pair(sender: str):
    """(listener, proxy, client, server) whose connections were cut mid-message, with the path kept down,
    and the sending side's send of that message blocked on the broken link (its thread and result)."""
    lst = listen("tcp://127.0.0.1:0", resume_window=WINDOW, max_message=64 << 20)
    proxy = Proxy(int(lst.address.rsplit(":", 1)[1]), direction="down" if sender == "listener" else "up",
                  cut_after=2 << 20)
    cli = connect(proxy.address, streams=2, frame_bytes=1 << 20, resume_window=WINDOW)
    srv = lst.accept(timeout=10)
    proxy.refuse = True  # the dialler's attempts to resume find nothing
    tx = srv if sender == "listener" else cli
    t, out = in_thread(tx.send, Message("big", {}, [blob(16 << 20)]))
    assert state_of(tx, ("broken", "failed", "closed")) == "broken"
    return lst, proxy, cli, srv, tx, t, out


@pytest.mark.parametrize("sender", ["listener", "dialler"])
def test_close_ends_a_broken_link_at_once_and_releases_its_blocked_send(sender):
    lst, proxy, cli, srv, tx, t, out = broken_pair(sender)
    try:
        tx.close()
        t.join(30)
        assert not t.is_alive()
        # ended by the close, not by the resume window running out while close() lingered
        assert tx.state == "closed", tx.error
        assert isinstance(out.get("err"), TransportError) and "closed by this side" in str(out["err"])
    finally:
        cli.close(), srv.close(), proxy.close(), lst.close()


def test_send_while_up_gives_up_on_a_broken_link_and_delivers_on_a_live_one():
    lst, proxy, cli, srv, tx, t, out = broken_pair("listener")
    try:
        with pytest.raises(ConnectionLost, match="broken"):
            srv.send_while_up(Message("bye"))
    finally:
        cli.close(), srv.close(), proxy.close(), lst.close()
    lst = listen("tcp://127.0.0.1:0")
    cli = connect(lst.address, streams=2)
    srv = lst.accept(timeout=10)
    try:
        srv.send_while_up(Message("bye", {"n": 1}))
        m = cli.recv(10)
        assert (m.kind, m.meta) == ("bye", {"n": 1})
    finally:
        cli.close(), srv.close(), lst.close()


def test_publisher_close_ends_a_dropped_subscriber_link_without_waiting_for_it():
    state = {"w": np.arange(4096, dtype=np.float32)}
    pub = Publisher(f"tcp://127.0.0.1:0?resume_window={WINDOW}", token=TOKEN)
    proxy = Proxy(int(pub.address.rsplit(":", 1)[1].split("?")[0]))
    sub = Subscriber(proxy.address, engine=Shadow(), token=TOKEN, connect_opts={"resume_window": WINDOW})
    try:
        pub.publish(state, version=0)
        sub.wait_for(0, timeout=30)
        pub.flush(timeout=30)
        (sender,) = pub._peers
        proxy.refuse = True
        proxy.cut_all()
        assert state_of(sender.link, ("broken", "failed", "closed")) == "broken"
        t, out = in_thread(pub.close)
        t.join(30)
        assert not t.is_alive() and "err" not in out
        # ended by the close: a bye sent on the dropped link would have waited for the window to fail it
        assert sender.link.state == "closed", sender.link.error
    finally:
        sub.close(), proxy.close(), pub.close()


def test_a_subscriber_that_closes_leaves_the_publisher_an_orderly_close(caplog):
    """Subscriber.close() closes its link from two threads at once (its caller's, and its receiver's on the
    way out): the publisher must hear a goodbye, not a drop it waits resume_window for."""
    caplog.set_level("INFO", logger=LOG)
    state = {"w": np.arange(4096, dtype=np.float32)}
    with Publisher(f"tcp://127.0.0.1:0?resume_window={WINDOW}", token=TOKEN) as pub:
        pub.publish(state, version=0)
        for _ in range(6):
            with Subscriber(pub.address, engine=Shadow(), token=TOKEN) as sub:
                sub.wait_for(0, timeout=30)
            sender = pub._peers[-1]  # the newest to join
            assert state_of(sender.link, ("closed", "failed", "broken")) == "closed", sender.link.error
            assert "closed the link" in str(sender.link.error)
    assert not [r for r in caplog.records if "connection lost" in r.getMessage()]
