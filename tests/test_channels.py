"""Channels: engines on prod see only promoted versions, gates, rollback, canaries, the control endpoint.

Every engine here is a real Subscriber over tcp loopback; "sees" means what its on_commit hook was handed
and what its memory holds, compared as bytes (digests of the exact bit patterns)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from helpers import TOKEN, TOKEN_HEX
from wsync import Publisher, Subscriber, engines
from wsync.channels import (ChannelError, Channels, Control, Gate, GateRefused, StateStore, call, channel_for,
                            report)
from wsync.errors import ChecksumError, WsyncError
from wsync.snapshot import as_state, digest

WAIT = 60


def states(n: int, tensors: int = 40, seed: int = 0) -> list[dict]:
    """n versions of a state of `tensors` float32 arrays of uneven sizes, about 1% of the values moving each."""
    rng = np.random.default_rng(seed)
    cur = {f"layers.{i}.w": rng.standard_normal(64 + 7 * i).astype(np.float32) for i in range(tensors)}
    out = []
    for _ in range(n):
        cur = {k: v.copy() for k, v in cur.items()}
        for v in cur.values():
            idx = rng.integers(0, v.size, max(1, v.size // 100))
            v[idx] += np.float32(1e-3)
        out.append(cur)
    return out


def dg(state) -> str:
    return digest(as_state(state))


class Engine:
    """A Subscriber into a Shadow engine that records every version it committed (with its note)."""

    def __init__(self, address: str, token=TOKEN, **kw):
        self.seen: list[dict] = []
        self.shadow = engines.Shadow()
        self._cv = threading.Condition()
        self.sub = Subscriber(address, engine=self.shadow, token=token, on_commit=self.committed, **kw)

    def committed(self, c: dict) -> None:
        with self._cv:
            self.seen.append(c)
            self._cv.notify_all()

    def wait(self, release: int) -> None:
        """Until the engine serves `release` and its on_commit has run (it runs just after the commit)."""
        self.sub.wait_for(release, timeout=WAIT)
        with self._cv:
            assert self._cv.wait_for(lambda: any(c["version"] >= release for c in self.seen), WAIT)

    def versions(self) -> list[int]:
        return [c["note"]["version"] for c in self.seen]

    def close(self) -> None:
        self.sub.close()


@pytest.fixture
def hub():
    h = Channels(("prod", "canary"), token=TOKEN, keyframe_every=3)
    yield h
    h.close()


def test_prod_engines_see_only_promoted_versions_through_reconnects_keyframes_catch_up_and_relays(hub):
    vs = states(8)
    prod, relay_engine = Engine(hub.address("prod")), None
    relay = Subscriber(hub.address("prod"), engine=engines.Shadow(), token=TOKEN, relay="tcp://127.0.0.1:0",
                       relay_opts={"keyframe_every": 2})
    try:
        relay_engine = Engine(relay.relay.address)
        promoted = []
        for v, st in enumerate(vs):
            hub.offer(st, v)
            if v in (1, 2, 4, 7):  # keyframe_every=3: release 3 is a keyframe, the rest deltas
                rec = hub.promote(v, why=f"step {v}")
                promoted.append(v)
                prod.wait(rec.release)
                assert prod.shadow.digest() == dg(st) and report(prod.sub)["version"] == v
            if v == 4:  # an engine that was away for two promotions catches up from the channel's history
                late = Engine(hub.address("prod"))
                late.wait(hub.head("prod").release)
                assert late.shadow.digest() == dg(vs[4]) and set(late.versions()) <= set(promoted)
                late.close()
            if v == 5:  # a reconnect: the same engine's memory, a new subscriber holding release 2
                prod.close()
                prod2 = Subscriber(hub.address("prod"), engine=prod.shadow, token=TOKEN, on_commit=prod.committed)
                prod.sub = prod2
        relay_engine.wait(hub.head("prod").release)
        for e in (prod, relay_engine):
            assert set(e.versions()) <= set(promoted), e.versions()
            assert e.shadow.digest() == dg(vs[7])
        assert [c["keyframe"] for c in prod.seen][:1] == [True] and not all(c["keyframe"] for c in prod.seen)
        assert relay_engine.seen[-1]["note"]["channel"] == "prod"  # the note travels through the relay
    finally:
        for e in (prod, relay_engine):
            if e is not None:
                e.close()
        relay.close()


def test_rollback_returns_every_prod_engine_to_the_version_bytes_while_training_goes_on(hub):
    vs = states(8, seed=1)
    with Publisher("tcp://127.0.0.1:0", token=TOKEN) as train:
        rollout_engine = Engine(train.address)
        engines_ = [Engine(hub.address("prod")) for _ in range(3)]
        try:
            for v, st in enumerate(vs[:6]):
                train.publish(st, v)
                hub.offer(st, v)
                if v in (1, 3, 5):
                    hub.promote(v, why="eval passed")
            back = hub.rollback(why="bad outputs")  # to the version served before: 3
            assert (back.version, back.kind) == (3, "rollback")
            for e in engines_:
                e.wait(back.release)
                assert e.shadow.digest() == dg(vs[3]) and report(e.sub)["version"] == 3
            train.publish(vs[6], 6)  # training goes on meanwhile
            rec = hub.rollback(to=1, why="further back")
            for e in engines_:
                e.wait(rec.release)
                assert e.shadow.digest() == dg(vs[1])
                assert e.versions()[-2:] == [3, 1] and report(e.sub)["digest"] == rec.digest == dg(vs[1])
            train.publish(vs[7], 7)
            rollout_engine.wait(7)
            assert rollout_engine.shadow.digest() == dg(vs[7]) and rollout_engine.sub.version == 7
            assert hub.rollback(to=1) is hub.head("prod")  # already there: nothing published
            with pytest.raises(ChannelError, match="never served version 6"):
                hub.rollback(to=6)  # a rollback skips the gate: only what passed onto prod before
        finally:
            for e in engines_ + [rollout_engine]:
                e.close()


def test_a_failed_gate_leaves_prod_untouched_and_is_recorded():
    vs = states(4, seed=2)
    bad = {k: v.copy() for k, v in vs[3].items()}
    bad["layers.0.w"][:] = np.float32(1e6)  # a planted bad version
    evaluator = engines.Shadow()
    looked = []

    def check(engine):
        looked.append(engine.digest())
        worst = max(float(np.abs(tb.bits.view(np.float32)).max()) for tb in engine.state.values())
        return {"passed": worst < 100.0, "max_abs": worst}

    with Channels(("prod",), token=TOKEN, gates={"prod": Gate(check=check, engine=evaluator)}) as hub:
        prod = Engine(hub.address("prod"))
        try:
            hub.offer(vs[0], 0)
            first = hub.promote(0, why="baseline")
            assert first.gate["passed"] and looked == [dg(vs[0])]  # the check ran on the candidate's bytes
            prod.wait(first.release)
            hub.offer(bad, 1)
            with pytest.raises(GateRefused, match="did not pass") as refused:
                hub.promote(1, why="step 1")
            assert refused.value.record.kind == "refused" and not refused.value.record.gate["passed"]
            assert looked[-1] == dg(bad) and hub.head("prod") is first
            hub.offer(vs[2], 2)
            ok = hub.promote(2)
            prod.wait(ok.release)
            assert prod.versions() == [0, 2] and prod.shadow.digest() == dg(vs[2])
            assert [r.kind for r in hub.records if r.channel == "prod"] == ["promote", "refused", "promote"]
            with pytest.raises(ChannelError, match="candidates the gates test"):
                hub.promote(2, channel="gate")
        finally:
            prod.close()


def test_a_gate_that_raises_refuses_the_promotion():
    with Channels(("prod",), token=TOKEN, gates={"prod": Gate(check=lambda e: 1 / 0, engine=engines.Shadow())}) \
            as hub:
        hub.offer(states(1)[0], 0)
        with pytest.raises(GateRefused, match="ZeroDivisionError"):
            hub.promote(0)
        assert hub.head("prod") is None


def test_promote_and_rollback_over_the_control_endpoint_refuse_a_wrong_token(hub):
    vs = states(3, seed=3)
    for v, st in enumerate(vs):
        hub.offer(st, v)
    with Control(hub, token=TOKEN) as control:
        rec = call(control.address, "promote", token=TOKEN, version=1, channel="prod", why="cli")["record"]
        assert (rec["version"], rec["release"], rec["why"]) == (1, 0, "cli")
        again = call(control.address, "promote", token=TOKEN, version=1, channel="prod", why="twice")["record"]
        assert again == rec  # idempotent: the same release, nothing recorded
        for op, args in (("promote", {"version": 2, "channel": "prod"}), ("rollback", {"channel": "prod"})):
            with pytest.raises(WsyncError):
                call(control.address, op, token=b"x" * 16, **args)
        assert hub.head("prod").version == 1 and len(hub.records) == 1
        with pytest.raises(WsyncError):  # nor can an engine follow a channel without the token
            Subscriber(hub.address("prod"), engine=engines.Shadow(), token=b"y" * 16).wait_for(0, timeout=3)
        status = call(control.address, "status", token=TOKEN)
        assert status["channels"]["prod"]["version"] == 1 and status["candidates"] == [0, 1, 2]


@pytest.mark.parametrize("args, match", [
    ({"version": -1, "channel": "prod"}, "non-negative"),
    ({"version": "1", "channel": "prod"}, "non-negative"),
    ({"version": 1.0, "channel": "prod"}, "non-negative"),
    ({"version": 1, "channel": "../prod"}, "refused"),
    ({"version": 1, "channel": "nope"}, "no channel"),
    ({"version": 1, "channel": "prod", "why": "x" * 5000}, "at most"),
    ({"version": 99, "channel": "prod"}, "not held"),
])
def test_crafted_control_requests_get_a_clear_error_and_change_nothing(hub, args, match):
    hub.offer(states(1)[0], 1)
    with Control(hub, token=TOKEN) as control:
        with pytest.raises(ChannelError, match=match):
            call(control.address, "promote", token=TOKEN, **args)
    assert hub.records == [] and hub.head("prod") is None


def test_canary_hold_then_prod_and_an_abort_sends_the_canary_back(hub):
    vs = states(4, seed=4)
    for v, st in enumerate(vs):
        hub.offer(st, v)
    hub.promote(0, channel="prod")
    canary, prod = Engine(hub.address("canary")), Engine(hub.address("prod"))
    try:
        go = threading.Event()
        r = hub.stage(1, hold_s=0.05, check=lambda: True if go.is_set() else None, poll_s=0.02)
        canary.wait(hub.head("canary").release)
        assert canary.shadow.digest() == dg(vs[1]) and r.state == "holding"
        assert hub.head("prod").version == 0  # held: prod has not moved
        go.set()
        assert r.wait(WAIT) == "promoted" and hub.head("prod").version == 1
        prod.wait(hub.head("prod").release)
        assert prod.versions() == [0, 1]

        r = hub.stage(2, check=lambda: None, poll_s=0.02)  # undecided until aborted
        canary.wait(hub.head("canary").release)
        r.abort("canary error rate")
        assert r.wait(WAIT) == "aborted" and hub.head("canary").kind == "abort"
        canary.wait(hub.head("canary").release)
        assert canary.shadow.digest() == dg(vs[1]) and hub.head("prod").version == 1  # back to what prod serves

        r = hub.stage(3, check=lambda: False)
        assert r.wait(WAIT) == "aborted" and hub.head("prod").version == 1
        canary.wait(hub.head("canary").release)
        assert canary.shadow.digest() == dg(vs[1]) and canary.versions()[:3] == [1, 2, 1]
        assert [r.version for r in hub.records if r.channel == "canary"] == [1, 2, 1, 3, 1]
    finally:
        canary.close(), prod.close()


def test_channel_for_picks_the_same_engines_every_time():
    ids = [f"engine-{i}" for i in range(2000)]
    picked = [i for i in ids if channel_for(i, canary=0.1) == "canary"]
    assert 150 < len(picked) < 250 and picked == [i for i in ids if channel_for(i, canary=0.1) == "canary"]
    assert channel_for("a", canary={"a", "b"}) == "canary" and channel_for("c", canary={"a"}) == "prod"
    assert channel_for("a", canary=0.0) == "prod" and channel_for("a", canary=1.0) == "canary"
    with pytest.raises(ValueError):
        channel_for("a", canary=1.5)


def test_a_hub_started_again_over_its_root_resumes_releases_and_heads(tmp_path):
    vs = states(3, seed=5)
    with Channels(("prod",), token=TOKEN, root=tmp_path) as hub:
        for v, st in enumerate(vs):
            hub.offer(st, v)
        hub.promote(0), hub.promote(2)
        engine = Engine(hub.address("prod"))
        engine.wait(1)
        address = hub.address("prod")
    engine.close()
    port = int(address.rsplit(":", 1)[1])
    with Channels(("prod",), token=TOKEN, root=tmp_path, listen=f"tcp://127.0.0.1:{port}") as hub:
        assert [r.release for r in hub.records] == [0, 1] and hub.head("prod").release == 2
        assert hub.head("prod").version == 2 and hub.candidates.versions() == [0, 1, 2]
        again = Subscriber(hub.address("prod"), engine=engine.shadow, token=TOKEN)
        try:
            again.wait_for(2, timeout=WAIT)
            assert engine.shadow.digest() == dg(vs[2]) and report(again)["version"] == 2
            assert hub.rollback().version == 0  # the history survived the restart too
        finally:
            again.close()


def test_state_store_bounds_and_a_damaged_file(tmp_path):
    vs = states(5, seed=6)
    size = sum(v.nbytes for v in vs[0].values())
    store = StateStore(keep=3, max_bytes=2 * size + 1, root=tmp_path)
    for v, st in enumerate(vs):
        assert store.put(v, st) == dg(st)
    assert store.versions() == [3, 4] and sorted(p.name for p in tmp_path.iterdir()) == ["v3.safetensors",
                                                                                        "v4.safetensors"]
    with pytest.raises(ChecksumError, match="another digest"):
        store.put(4, vs[0])
    path = tmp_path / "v3.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="v3.safetensors"):
        StateStore(keep=3, root=tmp_path)


def test_the_command_line_promotes_rolls_back_and_reports(hub, monkeypatch, capsys):
    from wsync.cli import main

    vs = states(3, seed=7)
    for v, st in enumerate(vs):
        hub.offer(st, v)
    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)
    with Control(hub, token=TOKEN) as control:
        addr = control.address.removeprefix("tcp://")
        assert main(["promote", addr, "1", "--why", "eval ok"]) == 0
        assert main(["promote", addr, "2", "--channel", "canary"]) == 0
        assert main(["promote", addr, "2"]) == 0
        assert main(["rollback", addr, "--why", "regression"]) == 0
        out = capsys.readouterr().out
        assert "prod serves version 1 (release 2, rollback)" in out
        assert main(["channels", addr]) == 0
        out = capsys.readouterr().out
        assert "prod       version 1 (release 2)" in out and "canary     version 2 (release 0)" in out
        assert main(["promote", addr, "9"]) == 2
        assert "not held" in capsys.readouterr().err
        monkeypatch.setenv("WSYNC_TOKEN", "ab" * 16)
        assert main(["rollback", addr, "--to", "2"]) == 2
    assert hub.head("prod").version == 1


def test_an_engine_reports_its_channel_version_and_since_in_its_metrics(hub):
    pytest.importorskip("prometheus_client")
    from test_metrics import scrape, value

    vs = states(3, seed=8)
    for v, st in enumerate(vs):
        hub.offer(st, v)
    e = Engine(hub.address("prod"), metrics_port=0)
    try:
        hub.promote(2)
        rec = hub.promote(1)
        e.wait(rec.release)
        s = scrape(e.sub.metrics.url)
        assert value(s, "wsync_served_version") == 1 and value(s, "wsync_engine_version") == rec.release
        assert value(s, "wsync_served_channel", channel="prod") == 1
        assert value(s, "wsync_served_since_seconds") == report(e.sub)["since"] >= rec.at
    finally:
        e.close()


def test_status_answers_while_a_gate_runs():
    entered, release = threading.Event(), threading.Event()

    def slow_check(engine):
        entered.set()
        assert release.wait(WAIT)
        return True

    with Channels(("prod",), token=TOKEN, gates={"prod": Gate(check=slow_check, engine=engines.Shadow())}) as hub:
        hub.offer(states(1)[0], 0)
        t = threading.Thread(target=hub.promote, args=(0,))
        t.start()
        try:
            assert entered.wait(WAIT)
            st = hub.status()  # the decision lock is held by the promotion; status does not wait for it
            assert st["channels"]["prod"]["version"] is None and st["candidates"] == [0]
        finally:
            release.set()
            t.join(WAIT)
        assert hub.head("prod").version == 0


def test_wsync_hub_follows_a_trainer_and_serves_what_is_promoted(monkeypatch):
    """`wsync hub` as its own process: it follows the train stream, and `wsync promote` puts a version on prod."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from wsync.cli import main

    vs = states(3, seed=9)
    env = {**os.environ, "WSYNC_TOKEN": TOKEN_HEX, "PYTHONFAULTHANDLER": "1"}
    monkeypatch.setenv("WSYNC_TOKEN", TOKEN_HEX)
    with Publisher("tcp://127.0.0.1:0", token=TOKEN) as train:
        for v, st in enumerate(vs):
            train.publish(st, v)
        hub = subprocess.Popen([sys.executable, "-m", "wsync.cli", "hub", "--follow", train.address,
                                "--channel", "prod"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        engine = None
        try:
            lines = [hub.stdout.readline() for _ in range(2)]
            control = lines[0].split()[-1]
            prod = lines[1].split()[-1]
            assert lines[0].startswith("wsync hub: control") and "channel prod at" in lines[1], lines
            deadline = time.monotonic() + WAIT
            while 2 not in call(control, "status", token=TOKEN)["candidates"]:
                assert time.monotonic() < deadline and hub.poll() is None
                time.sleep(0.05)  # polling another process's state: nothing to wait on here
            assert main(["promote", control, "1", "--why", "from the command line", "--wait"]) == 0
            engine = Engine(prod)
            engine.wait(0)
            assert engine.shadow.digest() == dg(vs[1]) and report(engine.sub)["version"] == 1
        finally:
            if engine is not None:
                engine.close()
            hub.send_signal(signal.SIGTERM)  # a process manager's stop; SIGINT may be ignored in a child of a test run
            try:
                _, err = hub.communicate(timeout=WAIT)
            except subprocess.TimeoutExpired:
                hub.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack on the way out
                _, err = hub.communicate()
                raise AssertionError(f"wsync hub still running {WAIT} s after SIGTERM:\n{err[-20000:]}") from None
    assert hub.returncode == 0 and "wsync hub: stopped" in err, err


def test_a_moe_scale_state_is_promoted_and_rolled_back_bit_exact(hub):
    """20,000 tensors of uneven sizes (a MoE layer's experts), bf16 bit patterns: promote, promote, roll back."""
    rng = np.random.default_rng(10)
    cur = {f"layers.{i // 128}.mlp.experts.{i % 128}.w": rng.integers(0, 1 << 16, 8 + i % 57, dtype=np.uint16)
           for i in range(20_000)}
    vs = []
    for _ in range(3):
        cur = {k: v.copy() for k, v in cur.items()}
        for v in list(cur.values())[::7]:
            v[0] += np.uint16(1)
        vs.append(cur)
    e = Engine(hub.address("prod"))
    try:
        for v, st in enumerate(vs):
            hub.offer(st, v)
        hub.promote(0), hub.promote(2)
        rec = hub.rollback()
        e.wait(rec.release)
        assert rec.version == 0 and e.shadow.digest() == dg(vs[0]) and len(e.shadow.state) == 20_000
    finally:
        e.close()


def test_a_version_note_is_checked_where_it_is_given_and_where_it_arrives():
    from wsync.errors import TransportError
    from wsync.staging import Limits, Received

    note = {"version": 3, "why": "eval"}
    with Publisher("tcp://127.0.0.1:0", token=TOKEN) as pub:
        for bad, match in (([1], "JSON object"), ({1: "a"}, "string keys"), ({"x": float("nan")}, "plain JSON"),
                           ({"x": "y" * 5000}, "at most 4096")):
            with pytest.raises(ValueError, match=match):
                pub.publish(states(1)[0], 0, note=bad)
        e = Engine(pub.address)
        try:
            pub.publish(states(1)[0], 0, note=note)
            note["why"] = "changed after publish"  # what was published stays what it was
            e.sub.wait_for(0, timeout=WAIT)
            assert e.sub.note == {"version": 3, "why": "eval"}
        finally:
            e.close()
    meta = {"version": 1, "base_version": None, "count": 1, "checksum": None}
    limits = Limits(1 << 20, 4, "a test")
    for bad in ("text", [1, 2], {"x": "y" * 5000}):
        with pytest.raises(TransportError, match="note"):
            Received({**meta, "note": bad}, limits)
    assert Received({**meta, "note": {"a": 1}}, limits).note == {"a": 1}
