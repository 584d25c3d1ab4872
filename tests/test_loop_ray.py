"""The reference loop on a local multi-node Ray cluster: FSDP2 trainer ranks, sampler actors on other nodes.

One cluster for the module (a head node for the trainer, two sampler nodes, 1 CPU each) and two runs:
a clean one that learns (reward, bit-identity after every version, per-version bytes and times), and one
that meets every fault in turn: a sampler killed (Ray restarts it, it rejoins with a keyframe), the node
of the other sampler removed (the trainer keeps stepping), then the trainer killed (the sampler left keeps
serving its last version and says which).

Skipped without ray; WSYNC_REQUIRE_RAY=1 makes that a failure (CI).
"""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from ray_helpers import require_ray

ray = require_ray()

from trainer.decode import DecodeConfig  # noqa: E402
from trainer.grpo import GRPOConfig  # noqa: E402
from trainer.loop import LoopConfig, run  # noqa: E402
from trainer.ray_loop import RayConfig, TrainerFailed, local_cluster, run_on_ray  # noqa: E402
from trainer.task import TaskConfig  # noqa: E402

ETA = 2


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    c = local_cluster(samplers=2, ranks=2)
    ray.init(address=c.address, include_dashboard=False, logging_level=logging.ERROR)
    yield c
    ray.shutdown()
    c.shutdown()


def _batch(model, groups: int, size: int):
    """Groups of sampled responses with behaviour logprobs a little off the model's (a stale sampler's)."""
    import numpy as np
    import torch

    from trainer.decode import Decoder, Sequence
    from trainer.policy import score
    from trainer.task import prompt_ids, response_limit, reward, sample_digits

    rng = np.random.default_rng(7)
    dec = Decoder(model, DecodeConfig(slots=groups * size), seed=7)
    for g in range(groups):
        d = sample_digits(TaskConfig(min_digits=2, max_digits=6), rng)
        for _ in range(size):
            dec.add(Sequence(prompt=prompt_ids(d), limit=response_limit(d), tag={"g": g, "d": d}))
    done = []
    while dec.active:
        done += dec.step(0)
    with torch.no_grad():
        lp, _ = score(model, [s.prompt for s in done], [s.response for s in done])
    out = [[] for _ in range(groups)]
    for i, s in enumerate(done):
        off = rng.normal(0, 0.05, len(s.response))
        out[s.tag["g"]].append({"prompt": s.prompt, "response": s.response, "reward": reward(s.tag["d"], s.response),
                                "logprobs": (lp[i, : len(s.response)].numpy() + off).tolist()})
    return out


def test_sharded_step_is_the_one_process_step(cluster):
    """Two FSDP2 ranks (Ray actors, gloo) take the step trainer.grpo.Learner takes on the whole batch: the same
    weights (to float rounding: the reduction order differs) and the same diagnostics; the weights are read
    here through a wsync Subscriber, as the samplers read them."""
    import secrets

    import wsync
    from trainer.grpo import Learner
    from trainer.policy import PolicyConfig, build
    from trainer.ray_trainer import TrainerRank
    from wsync.engines import HF

    cfg = LoopConfig(steps=1, group_size=4, batch_groups=6, grpo=GRPOConfig(lr=1e-2))
    local = build(PolicyConfig(seed=0))
    batch = _batch(local, 6, 4)
    actor = ray.remote(num_cpus=0)(TrainerRank)
    ranks = [actor.options(resources={"wsync_trainer": 1}).remote(i, 2, cfg) for i in range(2)]
    token = secrets.token_bytes(16)
    try:
        opened = ray.get(ranks[0].open.remote("tcp://127.0.0.1:0", token, "127.0.0.1"))
        setup = ray.get([r.setup.remote("127.0.0.1", opened["port"]) for r in ranks])
        assert all(o["sharded"] and o["gather_checked"] for o in setup)
        outs = ray.get([r.step.remote(batch, 1) for r in ranks])
        follower = build(PolicyConfig(seed=1))  # other weights: all it holds comes through wsync
        with wsync.Subscriber(opened["address"], engine=HF(follower), token=token) as sub:
            sub.wait_for(1, timeout=60)
    finally:
        for r in ranks:
            ray.kill(r, no_restart=True)
    want = Learner(local, cfg.grpo).step(batch)
    got = outs[0]["stats"]
    assert got == outs[1]["stats"]  # reduced across ranks: both hold the batch's numbers
    for k in ("loss", "ratio_mean", "ratio_max", "ess", "clip_frac", "logprob_diff_max", "grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert got["tokens"] == want["tokens"]
    theirs, ours, before = follower.state_dict(), local.state_dict(), build(PolicyConfig(seed=0)).state_dict()
    moved = max(float((ours[k] - before[k]).abs().max()) for k in ours)
    assert moved > 1e-3  # the step did move the weights
    for k in ours:  # each tensor's update, to float rounding (bounds well above float32's rounding of a sum)
        mine, one = theirs[k] - before[k], ours[k] - before[k]
        assert float((mine - one).norm()) <= 1e-4 * float(one.norm()) + 1e-9, k
        assert float((theirs[k] - ours[k]).abs().max()) < 1e-4, k


@pytest.fixture(scope="module")
def learned(cluster):
    """The seeded task of tests/test_loop.py's learning test (reverse 2 digits), async (eta 1), 100 steps.
    Here reward_last was 0.48-0.64 over six runs (eta 1 and 2)."""
    cfg = LoopConfig(mode="async", max_staleness=1, steps=100, seed=0, samplers=2, group_size=8, batch_groups=16,
                     progress=False, report_digests=True, keep_samples=True, stall_timeout=120.0,
                     task=TaskConfig(min_digits=2, max_digits=2), grpo=GRPOConfig(lr=1e-3), decode=DecodeConfig(slots=64))
    # placed without the custom resources (the fault run below uses them): ranks on this node, samplers pinned
    return run(cfg, ray=RayConfig(address=cluster.address, placement="spread"))


def test_reward_rises_on_a_multi_node_cluster(learned):
    s = learned.summary
    assert s["steps"] == 100 and s["ray"]["nodes"] >= 3 and s["ray"]["placement"] == "spread"
    assert s["reward_first"] < 0.2, s["reward_first"]
    assert s["reward_last"] >= 0.4, s["reward_last"]
    assert max(int(k) for k in s["staleness_hist"]) <= 1
    trainer = s["ray"]["publisher"]["node"]
    nodes = [r["node_id"] for r in s["ray"]["serving"]]
    assert len(set(nodes)) == 2 and trainer not in nodes  # each sampler on a node of its own, not the trainer's
    pub = s["ray"]["publisher"]
    assert pub["address"].startswith("tcp://127.0.0.1:") and pub["ranks"] == 2
    assert pub["sharded"] and pub["gather_checked"]  # FSDP2 shards; the gather equals full_tensor() bit for bit


def test_every_sampler_holds_the_version_it_reports(learned):
    """After every applied version, and at the end: the sampler's weights are the trainer's of that version."""
    for rep in learned.synced:
        assert rep["digest"] == learned.digests[rep["version"]], rep
    assert {r["worker"] for r in learned.synced} == {0, 1}
    assert len({r["version"] for r in learned.synced}) > 50  # followed the trainer, not just version 0
    for srv in learned.summary["ray"]["serving"]:
        assert srv["digest"] == learned.digests[srv["version"]], srv
    assert any(len(set(s["versions"])) > 1 for s in learned.samples), "no sequence took weights in flight"


def test_per_version_bytes_and_times(learned):
    s = learned.summary
    versions = {v["version"]: v for v in s["ray"]["versions"]}
    assert set(versions) == set(range(101))
    first = versions[0]["applied"]
    assert {a["worker"] for a in first} == {0, 1} and all(a["keyframe"] for a in first)
    for v in range(1, 101):
        row = versions[v]
        assert row["bytes"] > 0 and row["gather_s"] >= 0 and row["publish_s"] >= 0, row
    deltas = [a for v in range(1, 101) for a in versions[v]["applied"]]
    assert deltas and all(a["bytes"] > 0 and a["apply_s"] >= 0 for a in deltas)
    assert sum(not a["keyframe"] for a in deltas) > len(deltas) // 2  # deltas between the keyframes
    assert s["sync"]["bytes_total"] > 0 and s["ray"]["step_overhead_s"] >= 0


def test_cli_flags_make_the_ray_config():
    import argparse

    from trainer.cli import add_arguments, config_from_args, ray_config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--ray", "--address", "auto", "--publish-port", "7070", "--steps", "1"])
    rc = ray_config_from_args(a)
    assert (rc.address, rc.publish_port, rc.trainer_ranks) == ("auto", 7070, 2)
    assert config_from_args(a).address == "tcp://127.0.0.1:0"  # --address named the cluster, not the publisher
    a = p.parse_args(["--steps", "1"])
    assert ray_config_from_args(a) is False and config_from_args(a).address == "tcp://127.0.0.1:0"


def test_wsync_loop_ray_writes_its_summary(cluster, tmp_path):  # before the faults: they remove a node
    """`wsync loop --ray` end to end (on the module's cluster: this process is connected to it already)."""
    import json

    from wsync.cli import main

    out = tmp_path / "run.json"
    rc = main(["loop", "--ray", "--address", cluster.address, "--steps", "2", "--samplers", "1", "--group-size", "4",
               "--batch-groups", "2", "--slots", "8", "--quiet", "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["steps"] == 2 and s["ray"]["publisher"]["ranks"] == 2 and s["command"].startswith("wsync loop")
    assert [v["version"] for v in s["ray"]["versions"]] == [0, 1, 2]


class Faults:
    """on_step hook: kill sampler 0, wait for it to rejoin, remove sampler 1's node, and once the driver has
    written sampler 1 off (the trainer stepping on meanwhile), kill trainer rank 0."""

    def __init__(self, cluster):
        self.cluster, self.at = cluster, {}

    def __call__(self, d):
        at, v = self.at, d.version
        if "killed" not in at and v == 2:
            os.kill(ray.get(d.samplers[0].node.remote())["pid"], signal.SIGKILL)
            at["killed"] = v
        elif "killed" in at and "rejoined" not in at and d.report["restarts"] and 0 in d.alive:
            at["rejoined"] = v
        elif "rejoined" in at and "removed" not in at and v >= at["rejoined"] + 2:
            node_id = ray.get(d.samplers[1].node.remote())["node_id"]
            node = next(n for n in self.cluster.list_all_nodes() if n.node_id == node_id)
            self.cluster.remove_node(node, allow_graceful=False)
            at["removed"] = v
        elif "removed" in at and "trainer_killed" not in at and v >= at["removed"] + 3 * ETA and d.down:
            for _ in range(300):  # the sampler left holds version v: the kill is not a race with its delivery
                if ray.get(d.samplers[0].status.remote())["version"] == v:
                    break
                time.sleep(0.1)
            os.kill(ray.get(d.ranks[0].node.remote())["pid"], signal.SIGKILL)
            at["trainer_killed"] = v


@pytest.fixture(scope="module")
def faulted(cluster, learned):  # after the clean run: this one removes a node of the cluster
    faults = Faults(cluster)
    cfg = LoopConfig(mode="async", max_staleness=ETA, steps=400, samplers=2, group_size=4, batch_groups=4,
                     progress=False, report_digests=True, keep_samples=True, stall_timeout=120.0,
                     task=TaskConfig(min_digits=3, max_digits=8, tail_prob=0.3), decode=DecodeConfig(slots=16))
    with pytest.raises(TrainerFailed) as err:
        run_on_ray(cfg, RayConfig(address=cluster.address, lost_after=5.0), on_step=faults)
    return err.value, faults.at


def test_killed_sampler_is_restarted_and_rejoins_with_a_keyframe(faulted):
    err, at = faulted
    assert "rejoined" in at, at
    rep = err.result.summary["ray"]
    assert rep["restarts"] == 1 and rep["placement"] == "resources"
    reborn = [a for a in rep["applied"] if a["worker"] == 0 and a["incarnation"] == 1]
    # its fresh model holds nothing: the publisher's newest keyframe first, then the deltas since (catch-up)
    assert reborn and reborn[0]["keyframe"], reborn[:1]
    assert reborn[-1]["version"] >= at["rejoined"] and any(not a["keyframe"] for a in reborn[1:])
    for r in err.result.synced:  # the new incarnation too: bit-identical to the trainer at every version
        assert r["digest"] == err.result.digests[r["version"]], r
    assert [r for r in err.result.synced if r["worker"] == 0 and r["version"] > at["rejoined"]]
    assert rep["requeued_groups"] >= 1  # what the killed one held was issued again


def test_lost_node_does_not_stall_the_trainer(faulted):
    err, at = faulted
    assert "trainer_killed" in at, at  # it stepped 3 * eta versions after the node went
    rep = err.result.summary["ray"]
    assert any(x["worker"] == 1 and x["version"] >= at["removed"] for x in rep["lost"]), rep["lost"]
    # a lost sampler held at most eta batches: admission still lets the other fill the next ones
    assert rep["held_max"] <= ETA * 4
    assert all(0 <= s["staleness"] <= ETA for s in err.result.samples)
    assert len(err.result.samples) == err.result.summary["steps"] * 4 * 4


def test_samplers_keep_serving_after_the_trainer_dies(faulted):
    err, at = faulted
    assert err.result.summary["steps"] >= at["trainer_killed"]
    answered = [s for s in err.serving if "error" not in s]
    assert [s["worker"] for s in answered] == [0]  # sampler 1's node is gone (or going: Ray says why)
    srv = answered[0]
    assert srv["version"] == err.result.summary["steps"]  # the last version the trainer published
    assert srv["digest"] == err.result.digests[srv["version"]]
    assert srv["probe_versions"] == [srv["version"]]  # a group decoded after the trainer was gone, at that version
    assert f"sampler 0 serves version {srv['version']}" in str(err)
