"""A subscriber's memory stays bounded: against a token holder that announces more than the engine's layout
can take, and against an engine that never polls; and wait_for without a timeout says what it waits for.

The hostile publisher is a token holder speaking the real protocol over the real tcp framing (a wsync
listener that greets the subscriber and then sends forged bucket messages). Allocation is measured with
tracemalloc (numpy reports its buffers to it), never with RSS or wall time. Everything is on 127.0.0.1.
"""
from __future__ import annotations

import logging
import socket
import threading
import tracemalloc

import numpy as np
import pytest

from wsync import api
from wsync.shadow import Shadow
from wsync.errors import TransportError
from wsync.layout import Layout
from wsync.snapshot import as_state
from wsync import subscriber as subscriber_mod
from wsync.staging import Limits, Oversized, Received, Staging, version_bound
from wsync.subscriber import Subscriber
from wsync.sync import Publisher
from wsync.transports import Message, envelope, listen
from wsync.transports.tcp import frames as tf

from helpers import TOKEN

ADDR = "tcp://127.0.0.1:0"


def _same(engine: Shadow, state) -> bool:
    want = as_state(state)
    return engine.state.keys() == want.keys() and all(
        engine.state[k].bits.tobytes() == want[k].bits.tobytes() for k in want)


def _engine_state(rng, n=16 << 10):
    return {"w": rng.integers(0, 1 << 16, n, dtype=np.uint16), "b": rng.standard_normal(64).astype(np.float32)}


class Hostile:
    """A publisher that holds the token and speaks the protocol: greets each subscriber that dials, then runs
    attack(link) on it (each in its own thread, so a link that waits to resume holds nobody up)."""

    def __init__(self, attack):
        self.lst = listen(ADDR, token=TOKEN, resume_window=1.0, linger=0.1)
        self.address, self.attack, self.attacks = self.lst.address, attack, 0
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                link = self.lst.accept(timeout=0.2)
            except TransportError:
                return
            if link is not None:
                self.attacks += 1
                threading.Thread(target=self._run, args=(link,), daemon=True).start()

    def _run(self, link):
        try:
            link.recv(timeout=10)  # the subscriber's hello
            link.send(Message("welcome", {"newest": 1}))
            self.attack(link)
        except TransportError:
            pass  # the subscriber hung up on us: what the tests expect
        finally:
            link.close()

    def close(self):
        self._stop.set()
        self.lst.close()


def _bucket(index: int, count: int, payload) -> Message:
    meta = {"version": 1, "base_version": None, "index": index, "count": count, "checksum": None}
    return Message("bucket", meta, [payload.header(), payload.body])


def _traced_peak(fn) -> int:
    """Bytes allocated at the peak while fn runs, above what was allocated before."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# -- a token holder announcing more than the layout can take ----------------------------------------


@pytest.mark.parametrize("count, bucket_bytes, buckets", [
    (10 ** 9, 32 << 10, 600),  # a count no layout of two tensors has, then a flood of small buckets
    (2, 100 << 10, 2),  # a plausible count, but buckets adding up to more than a version can take
], ids=["count", "bytes"])
def test_a_version_larger_than_the_layout_is_refused_before_it_is_kept(rng, count, bucket_bytes, buckets):
    """The bucket count and the bytes a version's buckets add up to are held to what one version of the
    engine's layout can take: the subscriber refuses with an error naming that bound, keeps nothing of the
    flood, and the engine keeps what it had."""
    state = _engine_state(rng)
    filler = api.encode(None, {"x": np.arange(bucket_bytes, dtype=np.uint8)}, codec="raw", version=1)
    flood = [_bucket(i, count, filler) for i in range(buckets)]

    def attack(link):
        for msg in flood:
            link.send(msg)

    hostile = Hostile(attack)
    engine = Shadow(state)
    try:
        with Subscriber(hostile.address, engine=engine, token=TOKEN, retry_s=0.05) as sub:
            def run():
                with pytest.raises(Oversized, match="one version can take .the engine's tensors: 2 tensors"):
                    sub.wait_for(1, timeout=60)
            peak = _traced_peak(run)
    finally:
        hostile.close()
    assert hostile.attacks >= subscriber_mod.GIVE_UP
    assert peak < 4 << 20, f"{peak} bytes allocated while a hostile publisher flooded"
    assert engine.version is None and _same(engine, state)


def test_a_message_larger_than_a_version_of_the_layout_is_refused_at_its_header(rng, monkeypatch):
    """A bucket message announcing 2 GiB to a subscriber whose engine holds 32 KiB is refused by the link at
    the message header, before a byte is allocated for it (the dialler would otherwise take up to 64 GiB)."""
    real = envelope.pack

    def forged(kind, meta, sizes, **fields):  # the hostile side announces a body it will never send
        return real(kind, meta, sizes[:1] + [2 << 30] if kind == "bucket" else sizes, **fields)

    monkeypatch.setattr(envelope, "pack", forged)
    small = api.encode(None, {"x": np.zeros(4096, np.uint8)}, codec="raw", version=1)
    hostile = Hostile(lambda link: link.send(_bucket(0, 1, small)))
    engine = Shadow(_engine_state(rng))
    try:
        with Subscriber(hostile.address, engine=engine, token=TOKEN, retry_s=0.05) as sub:
            def run():
                with pytest.raises(tf.MessageTooLarge, match="a 2147[0-9]{6}-byte message, above the .* one version "
                                                             "can take .the engine's tensors"):
                    sub.wait_for(1, timeout=60)
            peak = _traced_peak(run)
    finally:
        hostile.close()
    assert peak < 4 << 20, f"{peak} bytes allocated for a message that was never sent"


def test_a_version_that_fits_the_layout_is_never_refused(rng):
    """The bound holds every codec's worst case: a keyframe of many tiny tensors with long names, each in
    its own bucket (a head per tensor), then deltas that change every element, in every tier."""
    names = [f"layer.{i}." + "n" * 200 for i in range(200)]
    state = {n: rng.integers(0, 1 << 16, 1 + i % 3, dtype=np.uint16) for i, n in enumerate(names)}
    state["big"] = rng.integers(0, 1 << 16, 64 << 10, dtype=np.uint16)
    limit = Limits.of_tensors(as_state(state)).version_bytes
    for tier in ("packed", "sparse", "v2"):
        engine = Shadow({n: np.zeros_like(a) for n, a in state.items()})
        seen = []
        with Publisher(ADDR, token=TOKEN, bucket_bytes=1, tier=tier, keyframe_every=0) as pub, \
                Subscriber(pub.address, engine=engine, token=TOKEN,
                           on_commit=lambda c: seen.append(c["bytes"])) as sub:
            cur = state
            for v in range(3):
                pub.publish(cur, version=v)
                sub.wait_for(v, timeout=60)
                cur = {n: rng.integers(0, 1 << 16, a.size, dtype=np.uint16) for n, a in cur.items()}
            assert sub.stats.failures == 0 and sub.error is None
            cur = None
        assert len(seen) == 3 and max(seen) <= limit


def test_version_bound_table():
    """Pure: the bound grows with the model's bytes, tensors and tables, and covers zstd's expansion."""
    assert version_bound(0, 0, 0) > 0
    for model, tensors, table in [(1 << 20, 1, 10), (1 << 30, 70_000, 5 << 20), (0, 10, 0)]:
        b = version_bound(model, tensors, table)
        assert b >= model + model // 256 + tensors * 500 + table


def test_member_tables_are_held_to_a_byte_budget(monkeypatch):
    """Tables a publisher sends inline are kept by bytes, not only by count; those of the version served stay."""
    monkeypatch.setattr(subscriber_mod, "LAYOUT_BYTES", 1 << 20)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there: the subscriber only dials and waits

    def table(k):
        names = tuple(f"t{k}.{i}." + "x" * 1000 for i in range(64))  # ~64 KiB of JSON each
        return Layout(names, ((1,),) * 64, (64,), ("U8",))

    with Subscriber(f"tcp://127.0.0.1:{port}", engine=Shadow(), token=TOKEN, retry_s=5.0) as sub:
        first = table(0)
        sub._learn(first)
        sub._served = [first]
        for k in range(1, 64):
            sub._learn(table(k))
        held = sum(len(n) + 3 for m in sub._layouts.values() for n in m.names)
        assert held <= (1 << 20) + (80 << 10)
        assert first.hash in sub._layouts


# -- an engine that does not poll ---------------------------------------------------------------------


def _inbox_bytes() -> int:
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*transports/tcp/inbox.py")])
    return sum(s.size for s in snap.statistics("filename"))


def test_an_unpolled_subscriber_holds_one_raw_version_and_poll_yields_the_newest(rng):
    """25 raw versions to a poll-mode subscriber whose engine never polls: each raw version is a keyframe
    that supersedes the one waiting, so at most one version's bytes are held (measured: what the link
    allocated and what is still referenced); one poll then commits the newest, bit for bit."""
    states = [_engine_state(rng, 128 << 10) for _ in range(25)]
    one = sum(a.nbytes for a in states[0].values())
    engine = Shadow(states[0])
    tracemalloc.start()
    try:
        with Publisher(ADDR, token=TOKEN, codec="raw") as pub, \
                Subscriber(pub.address, engine=engine, token=TOKEN, apply="poll") as sub:
            pub.wait_for_subscribers(1, timeout=30)  # else flush() has nobody to wait for
            for v, st in enumerate(states):
                pub.publish(st, version=v)
            pub.flush(timeout=60)  # in poll mode a version is acknowledged once it is staged
            held = _inbox_bytes()
            assert held <= 2 * one, f"the link's buffers still referenced: {held} bytes, two versions are {2 * one}"
            stats = sub.stats
            assert stats.staged == 1 and stats.staged_bytes <= 2 * one
            assert sub.poll() == 24
            assert _same(engine, states[-1])
            assert sub.stats.versions == 1  # the superseded versions were never applied
    finally:
        tracemalloc.stop()


def test_an_unpolled_delta_subscriber_holds_one_keyframe_and_the_deltas_after_it(rng):
    state = _engine_state(rng, 32 << 10)
    states = [state]
    for _ in range(24):
        w = states[-1]["w"].copy()
        w[rng.choice(w.size, 64, replace=False)] += 1
        states.append({"w": w, "b": states[-1]["b"] + np.float32(1)})
    engine = Shadow(state)
    with Publisher(ADDR, token=TOKEN, keyframe_every=5) as pub, \
            Subscriber(pub.address, engine=engine, token=TOKEN, apply="poll") as sub:
        pub.wait_for_subscribers(1, timeout=30)  # else flush() has nobody to wait for
        for v, st in enumerate(states):
            pub.publish(st, version=v)
        pub.flush(timeout=60)
        waiting = list(sub._staged.items)
        assert [st.keyframe for st in waiting] == [True] + [False] * (len(waiting) - 1)
        versions = [st.version for st in waiting]
        assert versions == list(range(versions[0], 25)) and versions[0] % 5 == 0, versions
        sub.wait_for(24, timeout=60)
        assert _same(engine, states[-1])


def test_unpolled_dense_deltas_past_the_bound_are_dropped_and_a_keyframe_brings_the_newest(rng):
    """Deltas that change everything (as large as the model) pile up without a keyframe to supersede them:
    past twice the bound they are dropped and a keyframe is asked for; the newest still arrives bit for bit."""
    states = [{"w": rng.integers(0, 1 << 16, 128 << 10, dtype=np.uint16)} for _ in range(25)]
    engine = Shadow(states[0])
    bound = Limits.of_tensors(as_state(states[0])).version_bytes
    peaks, sub_ref = [], []  # what waits to be applied, sampled as each bucket arrives
    with Publisher(ADDR, token=TOKEN, keyframe_every=0) as pub, \
            Subscriber(pub.address, engine=engine, token=TOKEN, apply="poll",
                       progress=lambda *a: peaks.extend(s.stats.staged_bytes for s in sub_ref)) as sub:
        sub_ref.append(sub)
        pub.wait_for_subscribers(1, timeout=30)  # else flush() has nobody to wait for
        for v, st in enumerate(states):
            pub.publish(st, version=v)
        pub.flush(timeout=60)
        assert max(peaks) <= 2 * bound
        assert sub.stats.staged_bytes <= 2 * bound
        sub.wait_for(24, timeout=60)
        assert _same(engine, states[-1])


def test_staging_keeps_a_keyframe_and_its_deltas():
    """Pure: a keyframe supersedes what waits before it; deltas past the cap leave the first waiting and a
    gap that only a keyframe closes."""
    lim = Limits.stated(1 << 30, "a test allows")

    def st(v, kf, n=100):
        s = Received({"version": v, "base_version": None if kf else v - 1, "count": 1, "checksum": None}, lim)
        s.payloads = [type("P", (), {"manifest": type("M", (), {"codec": "raw" if kf else "delta"})()})()]
        s.add(n)
        return s

    q = Staging()
    for v, kf in [(1, True), (2, False), (3, True), (4, False), (5, False)]:
        assert q.add(st(v, kf), cap=1000)
    assert [s.version for s in q.items] == [3, 4, 5]
    assert not q.add(st(6, False, 900), cap=1000)
    assert [s.version for s in q.items] == [3] and q.gap
    assert q.add(st(7, False), cap=1000) and [s.version for s in q.items] == [3]
    assert q.add(st(8, True), cap=1000) and [s.version for s in q.items] == [8] and not q.gap


# -- wait_for says what it waits for ----------------------------------------------------------------


def test_wait_for_without_a_timeout_logs_what_it_waits_for(monkeypatch):
    monkeypatch.setattr(subscriber_mod, "WAIT_LOG_S", 0.2)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    said = threading.Event()
    lines = []

    class Catch(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
            if "waiting for version 3" in lines[-1]:
                said.set()

    handler = Catch(level=logging.INFO)
    logger = logging.getLogger("wsync.sync")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    outcome = []
    try:
        sub = Subscriber(f"tcp://127.0.0.1:{port}", engine=Shadow(), token=TOKEN, retry_s=0.05)

        def wait():
            try:
                sub.wait_for(3)
            except Exception as e:  # noqa: BLE001 - close() ends the wait
                outcome.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        assert said.wait(30), f"wait_for logged nothing: {lines[-5:]}"
        sub.close()
        t.join(30)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    line = next(x for x in lines if "waiting for version 3" in x)
    assert f"from tcp://127.0.0.1:{port}: nothing received yet" in line and "no link to the publisher" in line
    assert outcome and "closed" in str(outcome[0])
