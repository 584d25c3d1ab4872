"""The reference loop end to end: sampler processes, weights through a real wsync Publisher/Subscriber over TCP."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.decode import DecodeConfig  # noqa: E402
from trainer.grpo import GRPOConfig  # noqa: E402
from trainer.loop import LoopConfig, run  # noqa: E402
from trainer.task import TaskConfig  # noqa: E402


def _cfg(**kw) -> LoopConfig:
    base = dict(steps=8, group_size=4, batch_groups=4, progress=False, report_digests=True, keep_samples=True,
                task=TaskConfig(min_digits=3, max_digits=10, tail_prob=0.3),
                decode=DecodeConfig(slots=16), stall_timeout=120.0)
    base.update(kw)
    return LoopConfig(**base)


def _check_sync_digests(result):
    """Every version a sampler applied is bit-identical to the trainer's weights of that version."""
    assert result.synced, "samplers reported no applied versions"
    for rep in result.synced:
        assert rep["digest"] == result.digests[rep["version"]], rep


@pytest.fixture(scope="module")
def async_run():
    return run(_cfg(mode="async", max_staleness=1, steps=10))


def test_async_weights_bit_identical_after_every_sync(async_run):
    _check_sync_digests(async_run)
    assert len({r["version"] for r in async_run.synced}) > 5  # followed the trainer, not just version 0


def test_async_staleness_bounded_and_versions_monotone(async_run):
    samples = async_run.samples
    assert len(samples) == 10 * 4 * 4
    assert all(0 <= s["staleness"] <= 1 for s in samples)
    assert all(s["versions"] == sorted(s["versions"]) for s in samples)
    assert any(len(set(s["versions"])) == 2 for s in samples), "no sequence picked up weights in flight"
    summary = async_run.summary
    assert max(int(k) for k in summary["staleness_hist"]) <= 1
    assert summary["samples_trained"] == len(samples)
    assert sum(summary["versions_spanned_hist"].values()) == len(samples)
    for rec in summary["history"]:
        assert rec["ess"] <= 1.0 + 1e-6 and 0.0 <= rec["clip_frac"] <= 1.0


def test_sync_mode_is_on_policy():
    """Zero staleness: samplers wait for each version, and behaviour logprobs equal the trainer's (< 1e-4)."""
    r = run(_cfg(mode="sync", steps=5))
    _check_sync_digests(r)
    assert all(s["staleness"] == 0 and set(s["versions"]) == {s["versions"][0]} for s in r.samples)
    for rec in r.summary["history"]:
        assert rec["logprob_diff_max"] < 1e-4, rec
        assert rec["ratio_max"] == pytest.approx(1.0, abs=1e-4) and rec["clip_frac"] == 0.0
    s = r.summary
    assert s["dropped_stale"] == 0 and s["steps"] == 5
    assert s["samplers"]["wait_version_s"] > 0 or s["samplers"]["no_work_s"] > 0  # sync samplers do idle


def test_summary_accounts_for_time_and_bytes(async_run):
    s = async_run.summary
    for key in ("train_s", "publish_s", "wait_samples_s", "idle_pct"):
        assert key in s["trainer"]
    for key in ("decode_s", "no_work_s", "wait_version_s", "queue_full_s", "apply_s", "idle_pct", "slot_utilisation"):
        assert key in s["samplers"]
    assert s["sync"]["bytes_total"] > 0 and s["sync"]["versions_sent"] >= 1
    assert s["sync"]["send_s"] > 0  # measured by the publisher: publish() until every sampler's link had a version
    assert s["hardware"]["cores"] >= 1
    json.dumps(s)  # the whole summary is plain JSON


def test_last_sync_is_the_newest_version_on_every_link_else_the_newest_encoded():
    from dataclasses import replace

    from trainer.driver import last_sync, sync_summary
    from wsync.sync import PublisherStats

    st = PublisherStats(versions=3, bytes={0: None, 1: 100, 2: 50}, encode_s={0: 0.25, 1: 0.5, 2: 0.75},
                        send_s={0: 2.0, 1: 1.5}, history_bytes=0)
    assert last_sync(st) == {"version": 1, "bytes": 100, "seconds": 1.5}  # 0 was sized by nobody: a frozen keyframe
    assert last_sync(replace(st, send_s={})) == {"version": 2, "bytes": 50, "seconds": 0.75}
    assert last_sync(replace(st, bytes={0: None})) == {}
    got = sync_summary(st, {0: {"apply_s": 0.5}})
    assert (got["versions_sent"], got["bytes_total"], got["encode_s"], got["send_s"]) == (2, 150, 1.5, 3.5)


@pytest.mark.slow
def test_seeded_run_learns_the_task():
    """Bounded by steps: reversing 2 digits goes from chance (~0.1) to >= 0.6 within 150 steps."""
    r = run(LoopConfig(mode="sync", steps=150, seed=0, progress=False, group_size=8, batch_groups=16,
                       task=TaskConfig(min_digits=2, max_digits=2), grpo=GRPOConfig(lr=1e-3),
                       decode=DecodeConfig(slots=64)))
    s = r.summary
    assert s["reward_first"] < 0.2, s["reward_first"]
    assert s["reward_last"] >= 0.6, s["reward_last"]


def test_cli_arguments_make_the_config():
    import argparse

    from trainer.cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--mode", "sync", "--digits", "3", "--max-digits", "12", "--long-tail", "0.2",
                                         "--kv-cache", "recompute", "--top-p", "0.9"]))
    assert cfg.mode == "sync" and cfg.eta == 0 and cfg.seconds == 60.0  # no budget given: one minute
    assert (cfg.task.min_digits, cfg.task.max_digits, cfg.task.tail_prob) == (3, 12, 0.2)
    assert cfg.decode.kv_cache == "recompute" and cfg.decode.top_p == 0.9


@pytest.mark.slow
def test_cli_writes_summary(tmp_path):
    from wsync.cli import main

    out = tmp_path / "run.json"
    rc = main(["loop", "--mode", "async", "--steps", "3", "--group-size", "4", "--batch-groups", "2",
               "--slots", "8", "--quiet", "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["steps"] == 3 and s["config"]["mode"] == "async" and len(s["history"]) == 3
    assert s["command"].startswith("wsync")


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="budget"):
        LoopConfig(steps=0, seconds=0)
    with pytest.raises(ValueError, match="whole group"):
        LoopConfig(steps=1, group_size=8, decode=DecodeConfig(slots=4))
    with pytest.raises(ValueError, match="mode"):
        LoopConfig(steps=1, mode="eventually")


def _busy_cpus(n: int):
    """n processes that spin a core each: the load under which threads switch at the worst moments."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.soak
def test_sync_loop_completes_under_cpu_load():
    """The loop reads Publisher.stats while the encoder thread writes it: under CPU load it still completes."""
    busy = _busy_cpus(2)
    try:
        r = run(_cfg(mode="sync", steps=0, seconds=4.0, keep_samples=False))
    finally:
        for p in busy:
            p.kill()
            p.wait(10)
    _check_sync_digests(r)
    s = r.summary
    assert s["steps"] >= 1 and s["sync"]["versions_sent"] >= 1


def test_loop_serves_metrics_when_asked():
    """The loop's trainer and samplers each serve their own Prometheus endpoint on loopback."""
    r = run(_cfg(mode="sync", steps=2, metrics_port=0))
    m = r.summary["metrics"]
    assert m["trainer"].startswith("http://127.0.0.1:") and m["trainer"].endswith("/metrics")
    assert list(m["samplers"]) == [0] and m["samplers"][0].startswith("http://127.0.0.1:")
    assert m["samplers"][0] != m["trainer"]


def test_cli_metrics_port_flag():
    import argparse

    from trainer.cli import add_arguments, config_from_args
    from trainer.sampler import metrics_port

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--steps", "1", "--metrics-port", "9400"])).metrics_port == 9400
    assert config_from_args(p.parse_args(["--steps", "1"])).metrics_port is None
    assert (metrics_port(9400, 0), metrics_port(9400, 2), metrics_port(0, 1), metrics_port(None, 0)) == (9401, 9403, 0, None)
