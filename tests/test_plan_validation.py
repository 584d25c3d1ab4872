"""The loop model against the reference loop: measured costs in, measured samples/s out within 20%."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from wsync.plan.models import PlanError
from wsync.plan.sim import simulate
from wsync.plan.validate import (TOLERANCE, LoopMeasurement, fit_early_stop, from_bench_run, loop_config,
                                 mean_length, predict, task_caps, validate)

LOOP_JSON = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-22-xeon-2core-nogpu-loop.json"


def test_prediction_within_20_percent_of_the_measured_loop():
    rows = validate(LOOP_JSON)
    assert {r["mode"] for r in rows} == {"sync", "async"}
    for r in rows:
        assert abs(r["error"]) <= TOLERANCE, r
        assert r["within_tolerance"]
    # the model also gets the direction and rough size of the async gain
    doc = json.loads(LOOP_JSON.read_text())
    for i, ratio in enumerate(doc["samples_per_s_ratio_async_over_sync"]):
        syn, asy = rows[2 * i], rows[2 * i + 1]
        assert asy["predicted_samples_per_s"] / syn["predicted_samples_per_s"] == pytest.approx(ratio, rel=TOLERANCE)


def test_sync_decode_steps_follow_from_groups_and_stragglers():
    # sync mode: the simulated loop decodes as many steps per trainer step as the real one did
    doc = json.loads(LOOP_JSON.read_text())
    for run in (r for r in doc["runs"] if r["mode"] == "sync"):
        m = from_bench_run(run, doc["args"])
        res = simulate(loop_config(m))
        decode_s = res.step_s * m.steps * (1 - res.sampler_idle)
        assert decode_s / m.decode_step_s == pytest.approx(run["samplers"]["decode_steps"], rel=0.05)


def test_task_caps_match_the_task_sampler():
    from trainer.task import TaskConfig, response_limit, sample_digits

    cfg = TaskConfig(min_digits=3, max_digits=24, tail_prob=0.25)
    caps = dict(task_caps(3, 24, 0.25))
    assert sum(caps.values()) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    drawn = np.array([response_limit(sample_digits(cfg, rng)) for _ in range(40000)])
    for cap in (4, 5, 6, 10, 25):
        assert np.mean(drawn == cap) == pytest.approx(caps[cap], abs=0.006)
    assert dict(task_caps(4, 4, 0.0)) == {5: 1.0}


def test_early_stop_fit_round_trips():
    caps = task_caps(3, 24, 0.25)
    assert fit_early_stop(caps, mean_length(caps, 0.0) + 1) == 0.0  # longer than the caps allow: no early stop
    for p in (0.01, 0.1, 0.3):
        assert fit_early_stop(caps, mean_length(caps, p)) == pytest.approx(p, rel=1e-6)
    rng = np.random.default_rng(1)
    caps_only = [(6, 1.0)]
    lengths = np.minimum(rng.geometric(0.2, size=200000), 6)
    assert mean_length(caps_only, 0.2) == pytest.approx(lengths.mean(), rel=0.01)


def _measurement(**kw) -> LoopMeasurement:
    base = dict(mode="sync", steps=10, samplers=1, slots=64, group_size=8, batch_groups=16, max_staleness=0,
                decode_step_s=0.01, train_step_s=0.2, sync_s=0.05, pause_s=0.0, caps=((4, 1.0),), mean_response=4.0,
                measured_samples_per_s=1.0)
    return LoopMeasurement(**(base | kw))


def test_sync_loop_in_closed_form():
    # 16 groups of 8 through 64 slots: two waves of 4 decode steps, then train and sync
    m = _measurement()
    pred, res = predict(m, seeds=1)
    step = 8 * 0.01 + 0.2 + 0.05
    assert res.step_s == pytest.approx(step)
    assert pred == pytest.approx(128 / step)
    assert res.staleness_max == 0


def test_async_is_bounded_by_the_slower_side():
    m = _measurement(mode="async", max_staleness=2, pause_s=0.001)
    pred, res = predict(m, seeds=1)
    trainer_bound = 128 / (0.2 + 0.05)
    sampler_bound = 64 / 4 / 0.01  # 64 slots, 4 tokens per sample, 10 ms per step
    assert pred <= min(trainer_bound, sampler_bound) * 1.001
    assert pred >= 0.9 * min(trainer_bound, sampler_bound)
    assert res.staleness_max <= 2


def test_groups_reach_the_trainer_whole():
    m = _measurement(mode="async", max_staleness=1, caps=((3, 0.5), (20, 0.5)), mean_response=6.0)
    cfg = replace(loop_config(m), steps=6)
    res = simulate(cfg)
    assert res.staleness_max <= 1 and 0 <= res.dropped_fraction < 1
    with pytest.raises(PlanError, match="group_size"):
        simulate(replace(cfg, group_size=7))


def test_costs_move_the_prediction():
    m = _measurement()
    slow = replace(m, sync_s=1.0)
    assert predict(slow, seeds=1)[0] < predict(m, seeds=1)[0]


def test_bad_results_file_says_how_to_fix():
    with pytest.raises(PlanError, match="wsync bench loop"):
        from_bench_run({"mode": "sync"}, {"steps": 10})


# --- `wsync plan transfer` prefers the C++ backend's measured delta speeds --------------------------------------

def _speed_files(tmp_path):
    codec = tmp_path / "x-codec.json"
    schemes = [{"name": "wsync-packed", "ratio_vs_raw": 50.0, "encode_gbps": 0.5, "decode_gbps": 0.5},
               {"name": "wsync-sparse", "ratio_vs_raw": 20.0, "encode_gbps": 1.0, "decode_gbps": 1.0}]
    codec.write_text(json.dumps({"hardware": {"cpu": "t", "cores": 1}, "runs": [{"label": "run a", "schemes": schemes}]}))
    kernels = tmp_path / "x-kernels.json"
    kernels.write_text(json.dumps({"hardware": {"cpu": "t", "cores": 1}, "model_bytes": 1000, "density": 0.01,
                                   "backends": {"cpu": {"threads": 2, "encode_gbps": 4.0, "apply_gbps": 2.0,
                                                        "payload_bytes": 15}}}))
    return codec, kernels


def test_delta_speeds_prefer_the_cpu_kernels(tmp_path):
    from wsync.plan.codec_speeds import measured_speed

    codec, kernels = _speed_files(tmp_path)
    sparse = measured_speed("delta", tier="sparse", results=codec, kernels=kernels)
    assert (sparse.encode_gbps, sparse.apply_gbps, sparse.saving) == (4.0, 2.0, pytest.approx(0.985))
    assert "x-kernels.json" in sparse.source and "backend cpu" in sparse.source
    packed = measured_speed("delta", tier="packed", results=codec, kernels=kernels)
    # zstd stage = 1/0.5 - 1/1.0 = 1 s per GB, added to the kernel's 0.25 s (encode) and 0.5 s (apply) per GB
    assert packed.encode_gbps == pytest.approx(1 / 1.25) and packed.apply_gbps == pytest.approx(1 / 1.5)
    assert measured_speed("delta", results=codec).encode_gbps == 0.5  # a named codec file alone is used as given
    with pytest.raises(PlanError, match="no 'raw' runs"):  # full weights never read the kernels file
        measured_speed("full", results=codec, kernels=kernels)


def test_repo_default_delta_speed_is_the_fastest_backend():
    from wsync.plan.codec_speeds import candidates, measured_speed

    s = measured_speed("delta", tier="sparse")
    assert s.encode_gbps == max(c.encode_gbps for c in candidates("delta", tier="sparse"))
    assert s.backend != "ref" and f"backend {s.backend}" in s.source
