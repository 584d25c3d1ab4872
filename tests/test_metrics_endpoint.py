"""The metrics endpoint under idle and trickling clients: its threads stay bounded and scrapes still answer."""
from __future__ import annotations

import select
import socket
import threading
import time
import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from wsync.metrics import PublisherMetrics  # noqa: E402

CAP = 8


def scrape(url: str) -> str:
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def connect(address) -> socket.socket:
    s = socket.create_connection(address, timeout=10)
    s.setblocking(False)
    return s


def closed_by_server(s: socket.socket) -> bool:
    """True once the server has shut s: EOF or a reset, never data it was not asked for."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def started_since(before: set) -> int:
    """Threads alive now that were not in `before`: the endpoint's, whichever threads of earlier tests end
    meanwhile."""
    return len(set(threading.enumerate()) - before)


def wait_until(cond, timeout=15.0, step=0.01):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(step)
    return True


@pytest.fixture
def endpoint():
    before = set(threading.enumerate())
    ep = PublisherMetrics(0, max_connections=CAP, deadline_s=60.0)
    ep.published(7)
    yield ep, before
    ep.close()


def test_idle_connections_past_the_cap_keep_threads_bounded_and_scrapes_answer(endpoint):
    ep, before = endpoint
    bound = 1 + CAP  # the accepting thread and one per held connection
    idle, peak = [], 0
    try:
        for _ in range(300):
            idle.append(connect(ep.address))
            peak = max(peak, started_since(before))
        # all but the newest CAP were closed to make room, and none of the newest were
        assert wait_until(lambda: all(closed_by_server(s) for s in idle[:-CAP]))
        assert not any(closed_by_server(s) for s in idle[-CAP:])
        peak = max(peak, started_since(before))
        assert peak <= bound, (peak, bound)

        assert "wsync_newest_version 7.0" in scrape(ep.url)  # while CAP idle connections are held
        assert started_since(before) <= bound
        assert sum(closed_by_server(s) for s in idle[-CAP:]) == 1  # the scrape took the oldest one's place
    finally:
        for s in idle:
            s.close()
    assert "wsync_newest_version 7.0" in scrape(ep.url)
    assert wait_until(lambda: started_since(before) <= 1)


def test_close_ends_the_threads_of_held_connections():
    before = set(threading.enumerate())
    ep = PublisherMetrics(0, max_connections=CAP, deadline_s=60.0)
    idle = [connect(ep.address) for _ in range(CAP)]
    try:
        assert wait_until(lambda: started_since(before) == 1 + CAP)
        ep.close()
        assert wait_until(lambda: started_since(before) == 0)
        assert wait_until(lambda: all(closed_by_server(s) for s in idle))
    finally:
        for s in idle:
            s.close()


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling"])
def test_a_slow_client_is_dropped_after_the_deadline(trickle):
    before = set(threading.enumerate())
    ep = PublisherMetrics(0, max_connections=CAP, deadline_s=0.3)
    s = connect(ep.address)
    # never finished: the blank line that ends the head is not in it
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 4096
    try:
        give_up = time.monotonic() + 15
        for byte in request:
            if closed_by_server(s):
                break
            assert time.monotonic() < give_up, "the server never dropped a client that kept it waiting"
            if trickle:  # a byte every 20 ms: each read is well inside any per-read timeout
                try:
                    s.send(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    break
            time.sleep(0.02)
        else:
            pytest.fail("the server read the whole trickled request without dropping the client")
        assert wait_until(lambda: started_since(before) <= 1)
        assert "wsync_newest_version" in scrape(ep.url)  # the endpoint still serves
    finally:
        s.close()
        ep.close()
