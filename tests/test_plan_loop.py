"""RL-loop model: decode roofline, simulator invariants, sweep Pareto front, sandbox sizing."""
from __future__ import annotations

from dataclasses import replace

import pytest

from wsync.plan.loop import DecodeCost, SimulatedLoop, decode_step_s, train_step_s
from wsync.plan.models import PlanError, get_model
from wsync.plan.params import checkpoint_bytes
from wsync.plan.sandboxes import SandboxConfig, erlang_b, plan_sandboxes, poisson_quantile
from wsync.plan.sim import simulate
from wsync.plan.sweep import SweepPoint, mark_pareto, sweep

# small enough to simulate in well under a second, long-tailed enough to matter
SMALL = SimulatedLoop(model="qwen3-8b", train_gpus=2, infer_gpus=4, max_batch=16, samples_per_step=32,
                   response_mean=1024, response_sigma=1.2, response_max=8192, steps=8, warmup_steps=2)


def test_decode_is_memory_bound_at_batch_one():
    cfg, m = SimulatedLoop(step_overhead_s=0.0), get_model("qwen3-8b")
    t = decode_step_s(cfg, m, 1, 0)
    assert t == pytest.approx(checkpoint_bytes(m) / (3.35e12 * 0.8), rel=1e-3)


def test_decode_turns_compute_bound_at_large_batch():
    cfg, m = SimulatedLoop(step_overhead_s=0.0), get_model("qwen3-8b")
    per_token = [decode_step_s(cfg, m, b, 0) / b for b in (1, 8, 64, 512, 4096)]
    assert per_token == sorted(per_token, reverse=True)  # batching amortizes the weight reads
    big = decode_step_s(cfg, m, 4096, 0) / decode_step_s(cfg, m, 2048, 0)
    assert big == pytest.approx(2.0, rel=0.01)  # compute bound: linear in batch


def test_moe_reads_only_the_experts_it_hits():
    cfg, m = SimulatedLoop(model="qwen3-30b-a3b", step_overhead_s=0.0), get_model("qwen3-30b-a3b")
    cost = DecodeCost(cfg, m)
    assert cost(1, 0) < cost(64, 0) < cost(4096, 0)
    assert cost(1, 0) < 0.2 * checkpoint_bytes(m) / (3.35e12 * 0.8)


def test_measured_curve_overrides_the_roofline():
    cfg = SimulatedLoop(decode_curve=((1, 0.01), (64, 0.02)))
    m = get_model("qwen3-8b")
    assert decode_step_s(cfg, m, 1, 999) == pytest.approx(0.01)
    assert decode_step_s(cfg, m, 32, 0) == pytest.approx(0.01 + 0.01 * 31 / 63)
    assert decode_step_s(cfg, m, 128, 0) == pytest.approx(0.01 + 0.01 * 127 / 63)


def test_trainer_time_scales_with_tokens_and_gpus():
    m = get_model("qwen3-8b")
    t = train_step_s(SimulatedLoop(train_gpus=8), m, 1_000_000)
    matmul = 8.191e9 - 151936 * 4096  # the embedding lookup does no FLOPs; the LM head does
    assert t == pytest.approx(1e6 * 8 * matmul / (8 * 989e12 * 0.4), rel=0.01)
    assert train_step_s(SimulatedLoop(train_gpus=16), m, 1_000_000) == pytest.approx(t / 2)


def test_sync_mode_has_zero_staleness_and_idles_the_trainer():
    r = simulate(replace(SMALL, mode="sync"))
    assert r.staleness_mean == r.staleness_max == 0 and r.dropped_fraction == 0
    assert 0 < r.trainer_idle < 1 and 0 < r.sampler_idle < 1


@pytest.mark.parametrize("cap", [0, 1, 2, 3])
def test_async_staleness_never_exceeds_the_cap(cap):
    r = simulate(replace(SMALL, mode="async", max_staleness=cap))
    assert r.staleness_max <= cap
    assert r.staleness_p99 <= cap


@pytest.mark.parametrize("seed", [0, 1])
def test_async_beats_sync_with_long_tails(seed):
    s = simulate(replace(SMALL, mode="sync", seed=seed))
    a = simulate(replace(SMALL, mode="async", max_staleness=2, seed=seed))
    assert a.tokens_per_s >= s.tokens_per_s
    assert a.sampler_idle < s.sampler_idle


def test_simulation_is_seeded():
    assert simulate(replace(SMALL, seed=3)) == simulate(replace(SMALL, seed=3))
    assert simulate(replace(SMALL, seed=3)) != simulate(replace(SMALL, seed=4))


def test_sync_time_lengthens_the_sync_step():
    fast = simulate(replace(SMALL, mode="sync", sync_s=0.0))
    slow = simulate(replace(SMALL, mode="sync", sync_s=30.0))
    assert slow.step_s == pytest.approx(fast.step_s + 30.0, rel=0.05)


def test_loop_config_validation():
    for bad in (dict(mode="both"), dict(infer_gpus=2, tp=4), dict(max_staleness=-1), dict(warmup_steps=8)):
        with pytest.raises(PlanError):
            simulate(replace(SMALL, **bad))


def _pt(tps, stale):
    return SweepPoint(train_gpus=1, infer_gpus=1, max_batch=1, max_staleness=0, mode="async", tokens_per_s=tps,
                      samples_per_s=0, staleness_mean=stale, staleness_p99=0, dropped_fraction=0, trainer_idle=0,
                      sampler_idle=0)


def test_pareto_front():
    pts = mark_pareto([_pt(10, 0), _pt(20, 1), _pt(15, 1.5), _pt(30, 2), _pt(30, 2.5)])
    front = {(p.tokens_per_s, p.staleness_mean) for p in pts if p.pareto}
    assert front == {(10, 0), (20, 1), (30, 2)}


def test_sweep_runs_every_point():
    base = replace(SMALL, steps=4, warmup_steps=1)
    pts = sweep(base, total_gpus=6, train_gpus=[2], batches=[8, 16], caps=[0, 2])
    assert len(pts) == 4 and any(p.pareto for p in pts)
    assert all(p.max_staleness == 0 or p.mode == "async" for p in pts)
    with pytest.raises(PlanError):
        sweep(base, total_gpus=6, train_gpus=[6], batches=[8], caps=[0])


def test_poisson_quantile_and_erlang_b():
    assert poisson_quantile(0.0, 0.99) == 0
    assert poisson_quantile(1.0, 0.5) == 1  # P[X<=0]=0.368, P[X<=1]=0.736
    n = poisson_quantile(10_000.0, 0.99)
    assert 10_000 + 2.2 * 100 < n < 10_000 + 2.45 * 100  # normal limit: mean + 2.33 sigma
    assert erlang_b(1, 1.0) == pytest.approx(0.5)
    assert erlang_b(2, 1.0) == pytest.approx(0.2)


def test_sandbox_pool_follows_littles_law():
    p = plan_sandboxes(SandboxConfig(rollouts_per_s=2.0, actions_per_rollout=10, action_latency_s=3.0,
                                     startup_s=20.0, failure_rate=0.0, quantile=0.99))
    assert p.mean_in_use == pytest.approx(2.0 * (20 + 30))
    assert p.pool_size == poisson_quantile(100.0, 0.99) and p.pool_size > 100
    assert p.blocking < 0.05
    worse = plan_sandboxes(SandboxConfig(rollouts_per_s=2.0, actions_per_rollout=10, action_latency_s=3.0,
                                         startup_s=20.0, failure_rate=0.2, quantile=0.99))
    assert worse.mean_in_use > p.mean_in_use and worse.attempts_per_rollout == pytest.approx(1.25)
    with pytest.raises(PlanError):
        plan_sandboxes(SandboxConfig(rollouts_per_s=0))
    with pytest.raises(PlanError):
        plan_sandboxes(SandboxConfig(rollouts_per_s=1, failure_rate=1.0))
