"""Sharded sync: trainer ranks publish only their pieces, engine ranks commit a version all or none.

Engine ranks run as spawned processes (their own sockets, killable); trainer ranks are ShardPublishers in
this process, each with its own Publishers and coordinator link, as a rank process would have (they share
nothing but the coordinator, which trainer rank 0 hosts). After every outcome each engine rank compares
every local tensor, as uint16 bit patterns, with the unsharded reference sliced by the layout, at the version
it serves; tcp on 127.0.0.1 only.
"""
from __future__ import annotations

import pytest

from helpers import TOKEN
from shard_helpers import commit, make_plan, piece_bytes, run_processes

torch = pytest.importorskip("torch")

from wsync.shard.layout import box_numel  # noqa: E402

OVERHEAD = 64 << 10  # per (trainer, engine) pair and version: manifests, message headers, a layout table


@pytest.mark.parametrize("m,n,engine", [(2, 2, "vllm"), pytest.param(4, 3, "hf", marks=pytest.mark.slow)])
def test_versions_commit_bit_exact_on_every_engine_rank(groups, m, n, engine):
    g = groups(m, n, engine=engine)
    for v in range(6):  # a keyframe, then deltas moving ~1% of the values
        commit(g, v)
    # (e) a trainer rank allocates and sends only its pieces: never a parameter it does not own
    for t, pub in enumerate(g.pubs):
        assert all(c._tables is not None for c in pub._src.values())  # copied and hashed by one call per dtype
        mine = piece_bytes(g.plan.for_trainer(t))
        stats = pub.stats
        held = {h.name: h.box for h in g.plan.trainer.held if h.rank == t}
        assert stats.piece_bytes == mine
        for r, pieces in pub.sends.items():  # to any one engine rank, at most what it holds (norms go to all)
            assert piece_bytes(pieces) <= sum(2 * box_numel(b) for b in held.values())
            assert all(p.src_name in held and all(a >= 0 and b <= h1 - h0 for (a, b), (h0, h1)
                                                  in zip(p.local, held[p.src_name])) for p in pieces)
        pairs = len(pub.sends)
        assert stats.bytes[0] <= mine + pairs * OVERHEAD, stats  # the keyframe: its pieces, raw
        for v in range(1, 6):  # the deltas: a fraction of that
            assert stats.bytes[v] <= 0.25 * mine + pairs * OVERHEAD, (v, stats)
    assert sum(piece_bytes(g.plan.for_trainer(t)) for t in range(m)) == \
        sum(piece_bytes(g.plan.for_engine(r)) for r in range(n))


def test_corrupt_piece_on_one_rank_aborts_every_rank(groups):
    g = groups(2, 2, hooks={1: {"corrupt_at": 2}})
    commit(g, 0)
    commit(g, 1)
    g.publish(2)
    res = g.outcome(2)
    assert res["outcome"] == "aborted" and "engine rank 1 from trainer ranks" in res["reason"], res
    got = g.expect("aborted", 2, range(2))
    assert all(served == 1 and ok for served, ok in got.values()), got  # both still serve version 1's bytes
    commit(g, 3)  # the bad source took a keyframe; the group commits the next version together


@pytest.mark.slow  # tests/test_shard_transports.py kills and rejoins a rank in the fast tier
def test_killed_engine_rank_commits_nothing_and_catches_up(groups):
    g = groups(2, 3, hooks={1: {"die_at": (2, 0)}}, engine="hf")
    commit(g, 0)
    commit(g, 1)
    g.publish(2)  # rank 1 dies once a bucket of version 2 arrived, before it could be ready
    res = g.outcome(2)
    assert res["outcome"] == "aborted" and "engine rank 1 lost" in res["reason"], res
    g.procs[1].join(10)
    assert g.procs[1].exitcode == -9
    got = g.expect("aborted", 2, [0, 2])
    assert all(served == 1 and ok for served, ok in got.values()), got
    g.log = [e for e in g.log if e[0] != 1]
    g.start(1, {})  # restarted with nothing: it takes a keyframe from every source
    g.expect("joined", None, [1])
    commit(g, 3)


@pytest.mark.slow  # a 5 s stall
def test_rank_that_never_gets_ready_aborts_at_the_timeout(groups):
    stall = 5.0
    g = groups(2, 2, hooks={1: {"stall_at": (2, 1), "stall_s": stall}}, timeout=2.0)
    commit(g, 0)
    commit(g, 1)
    g.publish(2)
    res = g.outcome(2)
    # the round's own timeout ended it, naming only the stalled rank: rank 0 got ready (so the coordinator did
    # not abort before waiting), rank 1 never did (so it did not wait for the stall to end, or rank 1's late
    # bucket would have made it ready and the round commit)
    assert res["outcome"] == "aborted" and res["reason"] == "timeout: engine ranks [1] not ready within 2s", res
    got = g.expect("aborted", 2, range(2))
    assert all(served == 1 and ok for served, ok in got.values()), got
    g.expect("received", 2, [1], timeout=stall + 60)  # the stalled source delivers version 2 late
    commit(g, 3)
    assert not any(e[1] == "committed" and e[4] == 2 for e in g.log), g.log  # the late delivery committed nothing


def test_a_restarted_coordinator_resumes_the_rounds(groups):
    """The coordinator as a process of its own, stopped between rounds and started again on its address: every
    trainer and engine rank redials it and joins again, no version commits while it is gone (the engine ranks
    keep serving the last one), the version published meanwhile commits once it is back (each trainer rank says
    its last announcement again on joining), and the next one after it."""
    from wsync.shard.commit import Coordinator

    plan = make_plan(2, 2)
    coord = Coordinator(plan, "tcp://127.0.0.1:0", token=TOKEN, timeout=30.0)
    g = groups(2, 2, coordinator=coord.address)
    commit(g, 0)
    commit(g, 1)
    coord.close()  # the coordinator goes away; its links drop
    g.publish(2)  # its pieces reach the engine ranks' staging, but no round runs
    g.expect("received", 2, range(2))
    assert not any(e[1] == "committed" and e[4] == 2 for e in g.log)
    coord = Coordinator(plan, coord.address, token=TOKEN, timeout=30.0)  # back, on the same address
    try:
        # the trainer ranks join again and say what they published last: version 2 gets its round now
        res = g.outcome(2)
        assert res["outcome"] == "committed" and res["version"] == 2 and res["digest"] == res["expected"], res
        got = g.expect("committed", 2, range(2))
        assert all(served == 2 and ok for served, ok in got.values()), got
        commit(g, 3)
        assert [s["version"] for s in coord.settled] == [2, 3]
    finally:
        coord.close()


@pytest.mark.slow  # 4 to 7 processes import transformers and form gloo groups
@pytest.mark.parametrize("m,n", [(2, 2), (4, 3)])
def test_fsdp2_trainer_into_torch_tp_engine(tmp_path, m, n):
    """The main case: FSDP2 (fully_shard, gloo) training a transformers Qwen3 on m processes -> the same
    model under torch tensor parallelism on n processes, 5 versions, each engine rank's DTensor shards equal
    to slicing the unsharded reference, and the engine's digest equal to the trainers'."""
    pytest.importorskip("transformers")
    from shard_helpers import fsdp_trainer, tp_engine

    run_processes(tmp_path, m, n, fsdp_trainer, tp_engine, 5)


@pytest.mark.slow
def test_fsdp2_qwen3_moe_into_expert_parallel_engine(tmp_path):
    """The MoE case: FSDP2 (fully_shard, gloo) on 2 processes training a transformers 5 Qwen3-MoE (experts
    fused as 3-D gate_up_proj / down_proj, 5 of them: Shard(0) puts experts 0-2 on trainer rank 0, 3-4 on 1) ->
    2 engine ranks in vLLM's expert-parallel layout (w13 / w2 by expert index, fused qkv, padded vocabulary),
    5 AdamW versions: every engine tensor equal to slicing the unsharded reference, each rank's experts the
    reference's by index, the engine digest equal to the trainers'."""
    pytest.importorskip("transformers")
    from shard_helpers import fsdp_trainer, vllm_moe_engine

    run_processes(tmp_path, 2, 2, fsdp_trainer, vllm_moe_engine, 5, trainer_args=(True,))
