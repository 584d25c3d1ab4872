"""The sync under threads and bounds: stats read across threads, raw history bounded by bytes,
`serve --no-watch` bounded on a frozen subscriber, no import circle between sync.py and subscriber.py,
and a subscriber that survives a manifest nested too deep.

Everything runs on 127.0.0.1 with numpy states and Shadow engines (no torch needed).
"""
from __future__ import annotations

import ast
import subprocess
import sys
import threading
from dataclasses import FrozenInstanceError
from pathlib import Path

import numpy as np
import pytest

from wsync.checkpoint import Checkpoint, write_checkpoint
from wsync.shadow import Shadow
from wsync.errors import WsyncError
from wsync.serve import serve
from wsync.snapshot import as_state
from wsync.subscriber import Subscriber
from wsync.sync import Publisher
from wsync.transports import Message, connect
from wsync.sender import PROTOCOL

from helpers import TOKEN, settle

ADDR = "tcp://127.0.0.1:0"


def _state(rng, n=64 << 10):
    return {"w": rng.integers(0, 1 << 16, n, dtype=np.uint16), "b": rng.standard_normal(256).astype(np.float32)}


def _step(state, rng):
    w = state["w"].copy()
    idx = rng.choice(w.size, max(1, w.size // 50), replace=False)
    w[idx] += 1
    return {"w": w, "b": state["b"] + np.float32(1)}


def _same(engine: Shadow, state) -> bool:
    want = as_state(state)
    return engine.state.keys() == want.keys() and all(
        engine.state[k].bits.tobytes() == want[k].bits.tobytes() for k in want)


# -- stats are a snapshot, safe to read while the encoder writes ------------------------

def test_stats_reads_while_publishing_never_race(rng):
    """Reading Publisher.stats while the encoder thread adds to it never raises (the trainer's driver does so)."""
    errors, stop = [], threading.Event()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: the race shows up within a few hundred versions

    def reader(pub):
        while not stop.is_set():
            try:
                s = pub.stats
                {v: n for v, n in s.bytes.items() if n is not None}
                sum(s.encode_s.values())
            except Exception as e:  # noqa: BLE001 - any error reading stats is the failure under test
                errors.append(e)
                return

    state = {"w": rng.integers(0, 255, 64, dtype=np.uint8)}
    try:
        with Publisher(ADDR, token=TOKEN, codec="raw", keyframe_every=0) as pub:
            threads = [threading.Thread(target=reader, args=(pub,), daemon=True) for _ in range(2)]
            for t in threads:
                t.start()
            for v in range(600):
                pub.publish(state, version=v)
                if errors:
                    break
            pub.flush(timeout=60)
            stop.set()
            for t in threads:
                t.join(timeout=30)
            assert not errors, errors[0]
            snap = pub.stats
    finally:
        sys.setswitchinterval(old)
        stop.set()
    assert not errors, errors[0]
    assert snap.versions == 600 and len(snap.bytes) == 600


def test_stats_is_a_copy_not_the_live_counters(rng):
    state = _state(rng, 1024)
    with Publisher(ADDR, token=TOKEN) as pub, Subscriber(pub.address, engine=Shadow(), token=TOKEN) as sub:
        pub.publish(state, version=0)
        sub.wait_for(0, timeout=30)
        pub.flush(timeout=30)
        s = pub.stats
        s.bytes.clear()
        s.send_s.clear()
        with pytest.raises(FrozenInstanceError):
            s.versions = -1
        assert pub.stats.versions == 1 and 0 in pub.stats.bytes and 0 in pub.stats.send_s
        t = sub.stats
        with pytest.raises(FrozenInstanceError):
            t.versions = -1
        with pytest.raises(FrozenInstanceError):
            t.last.version = 99
        assert sub.stats.versions == 1 and sub.stats.last.version == 0


def test_send_seconds_once_every_subscriber_link_has_the_version(rng):
    """send_s holds a version once every live subscriber's link has all of its buckets, and not before: a
    version published with nobody subscribed has none until a subscriber joins and is sent it."""
    states = [_state(rng, 4096) for _ in range(3)]
    with Publisher(ADDR, token=TOKEN, codec="raw") as pub:
        pub.publish(states[0], version=0)
        pub.flush(timeout=30)
        assert pub.stats.send_s == {} and 0 in pub.stats.encode_s  # encoded, sent to nobody
        with Subscriber(pub.address, engine=Shadow(), token=TOKEN) as a, \
                Subscriber(pub.address, engine=Shadow(), token=TOKEN) as b:
            a.wait_for(0, timeout=30)
            b.wait_for(0, timeout=30)
            for v in (1, 2):
                pub.publish(states[v], version=v)
            a.wait_for(2, timeout=30)
            b.wait_for(2, timeout=30)
            pub.flush(timeout=30)
            send_s = pub.stats.send_s
    assert sorted(send_s) == [0, 1, 2] and all(s >= 0 for s in send_s.values())


def test_concurrent_polls_apply_each_version_once(rng):
    """poll() from two threads (a background subscriber's receiver and a caller) must not apply twice."""
    states = [_state(rng, 4096)]
    for _ in range(30):
        states.append(_step(states[-1], rng))
    engine = Shadow()
    with Publisher(ADDR, token=TOKEN, keyframe_every=5) as pub, \
            Subscriber(pub.address, engine=engine, token=TOKEN, apply="poll") as sub:
        stop = threading.Event()
        polls = [threading.Thread(target=lambda: [sub.poll() for _ in iter(stop.is_set, True)], daemon=True)
                 for _ in range(3)]
        for t in polls:
            t.start()
        for v, st in enumerate(states):
            pub.publish(st, version=v)
        sub.wait_for(len(states) - 1, timeout=60)
        stop.set()
        for t in polls:
            t.join(timeout=30)
        assert sub.stats.failures == 0
        assert _same(engine, states[-1])


# -- raw history is bounded by bytes -------------------------------------------------------------

def test_raw_history_bounded_by_bytes_and_late_subscribers_converge(rng):
    states = [_state(rng)]  # ~130 KB a version
    for _ in range(25):
        states.append(_step(states[-1], rng))
    one = sum(a.nbytes for a in states[0].values())
    cap = 3 * one + one // 2
    # a subscriber that took version 0 and then left: its chain of raw versions will be dropped
    early = Shadow()
    with Publisher(ADDR, token=TOKEN, codec="raw", keyframe_every=50, history_bytes=cap) as pub:
        with Subscriber(pub.address, engine=early, token=TOKEN) as sub:
            pub.publish(states[0], version=0)
            sub.wait_for(0, timeout=30)
            served = sub.served
        held = []
        for v, st in enumerate(states[1:], start=1):
            pub.publish(st, version=v)
            pub.flush(timeout=60)
            held.append(pub.stats.history_bytes)
        assert max(held) <= cap, held
        assert held[-1] > 0
        newest = len(states) - 1
        late = Shadow()
        with Subscriber(pub.address, engine=late, token=TOKEN) as fresh, \
                Subscriber(pub.address, engine=early, token=TOKEN, served=served) as back:
            assert fresh.wait_for(newest, timeout=60) == newest
            assert back.wait_for(newest, timeout=60) == newest
            assert back.stats.failures == 0 and back.stats.last.keyframe
        assert _same(late, states[-1]) and _same(early, states[-1])


def test_history_bytes_must_be_positive():
    with pytest.raises(ValueError, match="history_bytes"):
        Publisher(ADDR, token=TOKEN, history_bytes=0)


# -- serve --no-watch does not wait forever on a frozen subscriber -------------------------

def test_serve_no_watch_names_the_frozen_subscriber(tmp_path, rng):
    src = tmp_path / "ckpts"
    write_checkpoint(src / "step_0003", Checkpoint(as_state(_state(rng, 4096)), None, {}))
    settle(src)
    frozen = {}

    def log(line):
        if line.startswith("serving"):  # before anything is published: a subscriber joins and never acks
            link = connect(line.split(" at ")[1], token=TOKEN)
            link.send(Message("hello", {"protocol": PROTOCOL, "version": None, "checksum": None}))
            assert link.recv(timeout=30).kind == "welcome"  # the publisher counts it now
            frozen["link"] = link

    out = {}

    def run():
        try:
            serve(src, ADDR, token=TOKEN, watch=False, settle_s=0.5, log=log, flush_timeout=1.0)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=60)
    try:
        assert not t.is_alive(), "serve --no-watch still waiting on a frozen subscriber"
        err = out.get("error")
        assert isinstance(err, WsyncError), err
        assert "127.0.0.1" in str(err) and "holds nothing" in str(err) and "version 3" in str(err)
    finally:
        frozen["link"].close()


def test_serve_takes_a_flush_timeout_with_a_positive_default():
    from wsync.cli import parser

    a = parser().parse_args(["serve", "x", "--listen", "127.0.0.1:0", "--no-watch", "--flush-timeout", "5"])
    assert a.flush_timeout == 5.0
    assert parser().parse_args(["serve", "x", "--listen", "127.0.0.1:0"]).flush_timeout > 0


# -- no import circle between sync.py and subscriber.py -------------------------------------

def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_sync_does_not_import_subscriber():
    import wsync

    root = Path(wsync.__file__).parent
    assert not {".subscriber", "wsync.subscriber"} & _imports(root / "sync.py")
    # and each side imports alone, in either order
    for first in ("wsync.subscriber", "wsync.sync"):
        subprocess.run([sys.executable, "-c", f"import {first}; import wsync.sync, wsync.subscriber"], check=True)


def test_default_history_cap_follows_the_model(rng, monkeypatch):
    """Without history_bytes, raw history is bounded by twice the model's bytes (at least MIN_HISTORY_BYTES)."""
    import wsync.sync as sync

    monkeypatch.setattr(sync, "MIN_HISTORY_BYTES", 1)  # so a small test model shows the bound
    states = [_state(rng)]
    for _ in range(8):
        states.append(_step(states[-1], rng))
    one = sum(a.nbytes for a in states[0].values())
    with Publisher(ADDR, token=TOKEN, codec="raw") as pub:
        for v, st in enumerate(states):
            pub.publish(st, version=v)
            pub.flush(timeout=60)
            assert pub.stats.history_bytes <= 2 * one + 4096  # payload headers ride on top of the tensors
        late = Shadow()
        with Subscriber(pub.address, engine=late, token=TOKEN) as sub:
            sub.wait_for(len(states) - 1, timeout=60)
        assert _same(late, states[-1])


# -- a deep-JSON manifest from upstream costs a reconnect, not the receive thread -----

def test_deep_json_manifest_from_upstream_is_survived_and_the_engine_converges(rng, monkeypatch):
    """A bucket whose manifest nests too deep (its xxh3 valid), as a compromised relay or publisher could send,
    is a FormatError: the subscriber drops the link, redials, and converges, its receive thread alive."""
    import xxhash

    from wsync import payload as wp
    from wsync import sender as ws

    deep = b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"
    poisoned = []
    real = ws.Sender._send_version

    def once_poisoned(self, enc):
        if enc.version == 1 and not poisoned:
            poisoned.append(enc.version)
            msg = self.pub._wait_bucket(enc, 0)
            head = wp.HEADER.pack(wp.MAGIC, wp.FORMAT_VERSION, len(deep), len(msg.blobs[1]),
                                  xxhash.xxh3_64_intdigest(deep)) + deep
            self.link.send(Message("bucket", msg.meta, [head, msg.blobs[1]]))
            return False
        return real(self, enc)

    monkeypatch.setattr(ws.Sender, "_send_version", once_poisoned)
    s0 = _state(rng)
    s1 = _step(s0, rng)
    engine = Shadow()
    with Publisher("tcp://127.0.0.1:0", codec="delta") as pub:
        with Subscriber(pub.address, engine=engine, retry_s=0.05) as sub:
            pub.publish(s0, version=0)
            sub.wait_for(0, timeout=60)
            pub.publish(s1, version=1)
            sub.wait_for(1, timeout=60)
            assert poisoned == [1] and sub.stats.reconnects >= 1 and sub._thread.is_alive()
            assert _same(engine, s1)
