"""The sharded two-phase commit's outcome reaches every engine rank, and a rank's slot belongs to its live link.

Trainer ranks (ShardPublishers), engine ranks (ShardSubscribers) and the coordinator all run in this process
over real tcp links on 127.0.0.1, each with links of its own: 3 trainer ranks (FSDP's uneven Shard(0)) into
2 engine ranks (torch TP), so every engine rank stages from several trainer ranks. A coordinator link that
drops as the decision goes out is made by closing the rank's link the moment the commit reaches it (and
dropping that commit), so the rank must learn the decision some other way. After each step every engine
rank's tensors are compared, as bf16 bit patterns, with the unsharded reference sliced by the layout.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shard_helpers import Reference, engine_expected, make_plan, qwen_params, trainer_local

torch = pytest.importorskip("torch")

from wsync.errors import FormatError  # noqa: E402
from wsync.shard.commit import Coordinator  # noqa: E402
from wsync.shard.decisions import DecisionLog  # noqa: E402
from wsync.shard.member import CoordinatorError, Member  # noqa: E402
from wsync.shard.sync import ShardPublisher, ShardSubscriber  # noqa: E402

from helpers import TOKEN  # noqa: E402

M, N = 3, 2
WAIT = 60.0  # generous: two shared cores


class Ring:
    """A standalone coordinator, M trainer ranks and N engine ranks, all in this process."""

    def __init__(self, state_dir=None, ask_every: float = 2.0, commit_timeout: float = 30.0):
        self.plan = make_plan(M, N, "hf")
        self.ref = Reference(qwen_params())
        self.state_dir = state_dir
        self.coord = Coordinator(self.plan, "tcp://127.0.0.1:0", token=TOKEN, timeout=30.0,
                                 commit_timeout=commit_timeout, state_dir=state_dir)
        self.address = self.coord.address
        self.pubs = [ShardPublisher(self.plan, t, coordinator=self.address, token=TOKEN,
                                    listen_opts={"resume_window": 3.0}) for t in range(M)]
        self.tensors = {r: {name: torch.zeros(p.shape, dtype=torch.bfloat16)
                            for (rank, name), p in self.plan.engine.locals.items() if rank == r} for r in range(N)}
        self.subs = [ShardSubscriber(self.plan, r, self.tensors[r], coordinator=self.address, token=TOKEN,
                                     ask_every=ask_every) for r in range(N)]

    def publish(self, v: int) -> None:
        state = self.ref.torch_state(v)
        for t, pub in enumerate(self.pubs):
            pub.publish(trainer_local(self.plan, t, state), v)

    def commit(self, v: int) -> None:
        self.publish(v)
        res = self.pubs[0].wait(v, timeout=WAIT, complete=True)
        assert res["outcome"] == "committed" and res["version"] == v and res["digest"] == res["expected"], res
        for r in range(N):
            assert self.subs[r].wait_for(v, timeout=WAIT) == v
            assert self.holds(r, v)

    def holds(self, rank: int, v: int) -> bool:
        """Engine rank `rank`'s tensors are version v's bytes, every one."""
        with self.subs[rank].lock:
            want = engine_expected(self.plan, rank, self.ref.at(v))
            return all(np.array_equal(self.tensors[rank][name].view(torch.uint16).numpy(), w)
                       for name, w in want.items())

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()
        for sub in self.subs:
            sub.close()
        self.coord.close()


@pytest.fixture
def rings():
    made = []
    yield lambda **k: made.append(Ring(**k)) or made[-1]
    for g in made:
        g.close()


def drop_commit(sub, version: int, close_link: bool = True, hold: threading.Event | None = None) -> threading.Event:
    """The first commit for `version` never reaches this engine rank: its coordinator link is closed as that
    message arrives (close_link), or the message alone is lost (the coordinator died before sending it).
    hold: the rank cannot redial until it is set. Returns an event set once the commit was dropped."""
    member, deliver, dropped = sub.member, sub.member._on_message, threading.Event()

    def on_message(msg):
        if msg.kind == "commit" and msg.meta.get("version") == version and not dropped.is_set():
            if close_link:
                member._link.close()
            dropped.set()
            if hold is not None:
                hold.wait(WAIT)  # this is the link's reader thread: no redial until it returns
            return
        deliver(msg)
    member._on_message = on_message
    return dropped


def wait_until(cond, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.02)


def test_a_rank_whose_link_drops_at_the_commit_learns_it_on_rejoining(rings):
    g = rings()
    g.commit(0)
    g.commit(1)
    dropped = drop_commit(g.subs[1], 2)
    g.publish(2)
    assert dropped.wait(WAIT)
    # rank 1 is told the decision when it joins again (and answers its ask): both serve version 2, byte for byte
    for r in range(N):
        assert g.subs[r].wait_for(2, timeout=WAIT) == 2
        assert g.holds(r, 2), r
    res = g.pubs[0].wait(2, timeout=WAIT, complete=True)
    assert res["outcome"] == "committed" and res["unconfirmed"] == [] and res["digest"] == res["expected"], res
    assert g.subs[1].pending is None
    g.commit(3)  # and the group goes on together


def test_a_commit_is_reported_incomplete_until_every_rank_confirms_it(rings):
    g = rings()
    g.commit(0)
    g.commit(1)
    hold = threading.Event()
    dropped = drop_commit(g.subs[1], 2, hold=hold)
    g.publish(2)
    try:
        assert dropped.wait(WAIT)
        doc = g.coord.wait_settled(2, timeout=WAIT)  # settled once rank 1's link is seen gone: not whole
        assert doc["outcome"] == "committed" and doc["complete"] is False and doc["unconfirmed"] == [1], doc
        assert "[1]" in doc["reason"], doc
        assert g.coord.status()["unconfirmed"] == {2: [1]}
        for pub in g.pubs:  # what the trainer ranks wait on says so too
            res = pub.wait(2, timeout=WAIT)
            assert res["complete"] is False and res["unconfirmed"] == [1], res
        assert g.subs[0].wait_for(2, timeout=WAIT) == 2 and g.holds(0, 2)
        # rank 1 is not told yet: it keeps serving version 1's bytes, and says it holds 2 pending
        assert g.subs[1].version == 1 and g.subs[1].pending == 2 and g.holds(1, 1)
    finally:
        hold.set()  # its link may come back now
    for pub in g.pubs:
        res = pub.wait(2, timeout=WAIT, complete=True)
        assert res["outcome"] == "committed" and res["complete"] and res["unconfirmed"] == [], res
        assert res["digest"] == res["expected"], res
    assert g.coord.wait_settled(2, timeout=WAIT, complete=True)["complete"]
    assert g.coord.status()["unconfirmed"] == {}
    assert g.subs[1].wait_for(2, timeout=WAIT) == 2 and g.holds(1, 2)


def test_a_rank_that_missed_its_commit_takes_the_settled_outcome(rings):
    """The commit alone is lost and the link stays up, so nothing makes rank 1 rejoin or ask: the round settles
    at its commit timeout as incomplete, and the settled outcome, sent to every rank, commits it there."""
    g = rings(ask_every=600.0, commit_timeout=1.0)
    g.commit(0)
    dropped = drop_commit(g.subs[1], 1, close_link=False)
    g.publish(1)
    assert dropped.wait(WAIT)
    for r in range(N):
        assert g.subs[r].wait_for(1, timeout=WAIT) == 1
        assert g.holds(r, 1), r
    res = g.pubs[0].wait(1, timeout=WAIT, complete=True)
    assert res["outcome"] == "committed" and res["digest"] == res["expected"], res
    g.commit(2)


@pytest.mark.parametrize("durable", [True, False], ids=["state_dir", "no_state_dir"])
def test_a_coordinator_that_died_between_its_commits_settles_every_rank_when_back(rings, tmp_path, durable):
    """The coordinator tells rank 0 commit and dies before rank 1 hears it; training has stopped, so no
    trainer rank will publish again. While it is gone rank 0 serves 2, rank 1 serves 1 and holds 2 pending.
    Started again on its address, it tells rank 1 commit: from its decision log (state_dir), or, with none,
    because rank 0 reports it serves 2 (only a coordinator's commit could have put it there)."""
    g = rings(state_dir=str(tmp_path) if durable else None, ask_every=600.0)  # rank 1 asks only on joining
    g.commit(0)
    g.commit(1)
    if durable:
        assert sorted(DecisionLog(tmp_path, g.plan.hash).load()) == [0, 1]
    dropped = drop_commit(g.subs[1], 2, close_link=False)
    g.publish(2)
    assert dropped.wait(WAIT)
    assert g.subs[0].wait_for(2, timeout=WAIT) == 2 and g.holds(0, 2)
    for pub in g.pubs:  # training stops
        pub.close()
    g.pubs = []
    g.coord.close()
    assert g.subs[1].version == 1 and g.subs[1].pending == 2 and g.holds(1, 1)  # split while the coordinator is gone
    g.coord = Coordinator(g.plan, g.address, token=TOKEN, timeout=30.0, state_dir=g.state_dir)
    for r in range(N):
        assert g.subs[r].wait_for(2, timeout=WAIT) == 2
        assert g.holds(r, 2), r
    wait_until(lambda: g.coord.status()["unconfirmed"] == {}, "every engine rank confirms version 2")
    if durable:
        doc = g.coord.wait_settled(2, timeout=WAIT, complete=True)
        assert doc["outcome"] == "committed" and doc["unconfirmed"] == [] and doc["digest"] == doc["expected"], doc


def test_a_version_a_rank_already_serves_is_not_aborted_by_a_round_run_again(rings):
    """With no decision log, the coordinator that comes back runs version 2's round again (the trainer ranks
    announce it again); rank 1 stays away past that round's timeout. Rank 0 serves 2 already, so an abort
    would leave the ranks a version apart: the round commits instead, and rank 1 commits 2 once it is back."""
    g = rings(ask_every=600.0)
    g.commit(0)
    g.commit(1)
    dropped = drop_commit(g.subs[1], 2, close_link=False)
    g.publish(2)
    assert dropped.wait(WAIT)
    assert g.subs[0].wait_for(2, timeout=WAIT) == 2
    away = g.subs[1].member.address
    for m in [g.subs[1].member] + [pub.member for pub in g.pubs]:  # rank 1 and the trainer ranks cannot reach it
        m.address = "tcp://127.0.0.1:9"
    g.coord.close()
    g.coord = Coordinator(g.plan, g.address, token=TOKEN, timeout=1.0, commit_timeout=30.0)
    wait_until(lambda: g.coord.status()["unconfirmed"] == {2: [1]}, "rank 0 says it serves version 2")
    for pub in g.pubs:  # the trainer ranks come back and announce version 2 again: its round runs again
        pub.member.address = away
    wait_until(lambda: g.coord.status()["round"] == {"version": 2, "phase": "commit"},
               "version 2's round run again, past its timeout, and committed")
    assert not g.coord.settled and g.subs[1].version == 1 and g.holds(1, 1)
    g.subs[1].member.address = away
    for r in range(N):
        assert g.subs[r].wait_for(2, timeout=WAIT) == 2
        assert g.holds(r, 2), r
    res = g.pubs[0].wait(2, timeout=WAIT, complete=True)
    assert res["outcome"] == "committed" and res["unconfirmed"] == [], res
    g.commit(3)


def test_a_second_join_for_a_live_rank_is_turned_away(rings):
    """Anyone holding the token may dial the coordinator; none of them takes a slot whose link is live (the
    rank keeps it and keeps committing), and a slot whose rank is gone is taken by the next to join."""
    g = rings()
    g.commit(0)
    seen = []
    forged = [Member(g.address, {"role": "engine", "rank": 1, "plan": g.plan.hash}, seen.append, token=TOKEN,
                     retry_s=0.1),
              Member(g.address, {"role": "trainer", "rank": 0, "plan": g.plan.hash,
                                 "addresses": {"0": "tcp://127.0.0.1:9", "1": "tcp://127.0.0.1:9"}},
                     seen.append, token=TOKEN, retry_s=0.1)]
    try:
        for m in forged:
            wait_until(lambda: isinstance(m.error, CoordinatorError) and "already joined" in str(m.error),
                       f"{m.join['role']} rank {m.join['rank']} turned away")
            assert not m.refused  # busy, not refused for good: it may take the slot once the live link dies
        assert g.coord._peers[("engine", 1)].incarnation == g.subs[1].member.incarnation
        assert g.coord._peers[("trainer", 0)].incarnation == g.pubs[0].member.incarnation
        assert not any(msg.kind in ("book", "prepare", "commit") for msg in seen)
        g.commit(1)  # the real ranks were not evicted: the group commits on, byte for byte
        g.subs[1].close()  # rank 1 goes; the next to join as rank 1 is admitted
        engine = forged[0]
        wait_until(lambda: g.coord._peers.get(("engine", 1)) is not None
                   and g.coord._peers[("engine", 1)].incarnation == engine.incarnation, "the slot taken over")
        assert g.coord._peers[("trainer", 0)].incarnation == g.pubs[0].member.incarnation
    finally:
        for m in forged:
            m.close()


def test_the_decision_log_keeps_decisions_and_refuses_a_damaged_file(tmp_path):
    log = DecisionLog(tmp_path, "abcd")
    assert log.load() == {}
    d = {"outcome": "committed", "reason": "", "keyframe": {1: [0, 2]}, "expected": {0: {0: "aa", 1: None}}}
    log.record(3, d)
    assert DecisionLog(tmp_path, "abcd").load() == {3: d}
    (tmp_path / "decisions-other.json").write_bytes(log.path.read_bytes())  # another plan's file under its name
    with pytest.raises(FormatError, match="plan"):
        DecisionLog(tmp_path, "other").load()
    log.path.write_bytes(b'{"format": 1, "plan": "abcd", "decisions": [{"version": "3"}]}')
    with pytest.raises(FormatError, match="cannot be read"):
        DecisionLog(tmp_path, "abcd").load()


def test_wait_for_without_a_timeout_says_what_it_waits_for_and_ends_at_close(monkeypatch, caplog):
    from wsync.shard import engine as engine_mod

    monkeypatch.setattr(engine_mod, "WAIT_LOG_S", 0.2)
    plan = make_plan(M, N, "hf")
    tensors = {name: torch.zeros(p.shape, dtype=torch.bfloat16)
               for (rank, name), p in plan.engine.locals.items() if rank == 0}
    nobody = Coordinator(plan, "tcp://127.0.0.1:0", token=TOKEN)  # a coordinator no trainer rank joins
    sub = ShardSubscriber(plan, 0, tensors, coordinator=nobody.address, token=TOKEN)
    outcome = []
    t = threading.Thread(target=lambda: outcome.append(_catch(sub.wait_for, 3)), daemon=True)
    try:
        with caplog.at_level("WARNING", logger="wsync.shard"):
            t.start()
            wait_until(lambda: any("engine rank 0 waiting for version 3" in r.getMessage() for r in caplog.records),
                       "a line saying what wait_for waits for")
    finally:
        sub.close()
        nobody.close()
    t.join(WAIT)
    assert not t.is_alive() and "closed while waiting for version 3" in str(outcome[0])


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test looks at what ended the wait
        return e
