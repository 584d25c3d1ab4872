"""Sharded sync over the other transports: a pair's Publisher on ucx://, local:// or gloo://, not tcp.

The same group as test_shard_sync.py (2 trainer ranks in this process, 2 engine-rank processes, the coordinator
on trainer rank 0 over tcp with the token); only the (trainer, engine) pairs' Publishers listen on the transport
under test, and engine ranks dial what the coordinator's address book says. After every commit each engine rank
compares every local tensor, as uint16 bit patterns (its bytes), with the unsharded reference sliced by the layout.
"""
from __future__ import annotations

import os

import pytest

from helpers import TOKEN
from shard_helpers import Group, commit, make_plan, piece_bytes

torch = pytest.importorskip("torch")


from wsync.errors import TransportError  # noqa: E402
from wsync.shard.stage import data_scheme, data_token  # noqa: E402
from wsync.shard.sync import ShardPublisher, data_address  # noqa: E402

OVERHEAD = 64 << 10  # per pair and version, as in test_shard_sync.py
VERSIONS = 4  # a keyframe, then deltas moving ~1% of the values


def _versions_over(g: Group, scheme: str) -> None:
    for pub in g.pubs:
        assert pub.transport == scheme
        assert pub.publishers and all(a.startswith(f"{scheme}://") for a in pub.addresses.values()), pub.addresses
    for v in range(VERSIONS):
        commit(g, v)  # committed on every engine rank, digests equal, every rank's bytes = the reference sliced
    for t, pub in enumerate(g.pubs):
        mine, stats = piece_bytes(g.plan.for_trainer(t)), pub.stats
        pairs = len(pub.sends)
        assert stats.bytes[0] <= mine + pairs * OVERHEAD, stats  # the keyframe: its pieces, raw
        for v in range(1, VERSIONS):  # deltas: a fraction of that
            assert 0 < stats.bytes[v] <= 0.25 * mine + pairs * OVERHEAD, (v, stats)


def test_2_2_over_local(groups):
    # local:// has no token option and no resume window: the pairs' links run without them (the coordinator's
    # link keeps the token); engine ranks are processes on this host, as this user
    g = groups(2, 2, transport="local", listen_opts={})
    _versions_over(g, "local")


def test_2_2_over_ucx(groups):
    pytest.importorskip("ucxx", reason="ucx:// needs ucxx (pip install 'wsync[ucx]', package ucxx-cu12)")
    # a UCX listener needs UCX's tcp transport; set before this process or an engine rank (spawned: it inherits
    # the environment) starts UCX. As tests/test_ucx.py does.
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    g = groups(2, 2, transport="ucx", listen_opts={})
    _versions_over(g, "ucx")


GLOO = {"stall_timeout": 20.0, "join_timeout": 30.0}  # a pair's group: a dead peer shows within 20 s


def test_2_2_over_gloo(groups):
    # each (trainer, engine) pair is a gloo group of two, formed when the engine rank dials; lockstep: every
    # version's acks are gathered before the next goes out
    g = groups(2, 2, transport="gloo", listen_opts=GLOO)
    assert all(a.endswith("?world_size=2") for pub in g.pubs for a in pub.addresses.values())
    _versions_over(g, "gloo")


@pytest.mark.parametrize("scheme", ["local", "gloo"])
def test_killed_engine_rank_rejoins_its_publishers(groups, scheme):
    """Why a pair's Publisher must outlive its engine rank: a rank killed mid-version is restarted, dials the same
    addresses and takes a keyframe. Over gloo that is a new group of two on the same address (the listener's next
    generation), the dead rank's group having failed."""
    g = groups(2, 2, hooks={1: {"die_at": (2, 0)}}, transport=scheme, listen_opts=GLOO if scheme == "gloo" else {})
    commit(g, 0)
    commit(g, 1)
    g.publish(2)  # rank 1 dies once a bucket of version 2 arrived from trainer rank 0
    res = g.outcome(2)
    assert res["outcome"] == "aborted" and "engine rank 1 lost" in res["reason"], res
    g.procs[1].join(10)
    assert g.procs[1].exitcode == -9
    got = g.expect("aborted", 2, [0])
    assert all(served == 1 and ok for served, ok in got.values()), got
    g.log = [e for e in g.log if e[0] != 1]
    g.start(1, {})
    g.expect("joined", None, [1])
    commit(g, 3)
    commit(g, 4)


def test_transport_choice_is_checked():
    plan = make_plan(2, 2)
    with pytest.raises(ValueError, match="must be one of tcp, ucx, local, gloo, nccl"):
        ShardPublisher(plan, 0, coordinator="tcp://127.0.0.1:0", host_coordinator=True, token=TOKEN,
                       transport="udp")
    # only tcp carries the token; local names are fresh per Publisher; a group pair has two ranks
    assert data_token("tcp", TOKEN) == TOKEN and data_token("tcp://127.0.0.1:1", TOKEN) == TOKEN
    assert data_token("ucx://127.0.0.1:1", TOKEN) is None and data_token("local", TOKEN) is None
    assert data_token("gloo://127.0.0.1:1?world_size=2", TOKEN) is None
    assert data_address("local", "ignored", "t0e1") != data_address("local", "ignored", "t0e1")
    assert data_address("ucx", "127.0.0.1", "t0e1") == "ucx://127.0.0.1:0"
    assert data_address("gloo", "127.0.0.1", "t0e1") == "gloo://127.0.0.1:0?world_size=2"
    # an engine rank refuses an address book entry it must not dial (the book is a peer's message)
    assert data_scheme("local://ws-1-ab-t0e1") == "local"
    assert data_scheme("gloo://127.0.0.1:5?world_size=2") == "gloo"
    for bad in ("tcp://nohostport", "file:///etc/passwd", "gloo://127.0.0.1:5?world_size=3",
                "gloo://127.0.0.1:5", "gloo://127.0.0.1:5?world_size=2&pool_bytes=100G",
                "nccl://127.0.0.1:5?world_size=2&chunk=1"):
        with pytest.raises(TransportError, match="trainer publisher address"):
            data_scheme(bad)
